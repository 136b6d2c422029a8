// Dot-product micro-kernels shared by the expert FFN and the bandwidth probe.
//
// Every matrix product in the expert FFN is "weight rows x activation vectors,
// full-length dots": weights are row-major [rows, n] in the HF layout, so each row
// is one contiguous stream. Two shapes of kernel per (ISA, weight type):
//   gemv:  consecutive rows x 1 vector (decode), one sequential stream;
//   fn[R][J]: an R x J tile (R <= 4, J <= 3; 12 accumulators fit 16 AVX2
//          registers), each converted weight vector reused for J tokens (prefill).
// SIMD tables (AVX2+FMA, AVX-512) are compiled with target attributes, so the
// build needs no -march flag, and picked at run time from what the CPU supports.
//
// Weight types: f32, bf16 (raw uint16 bits) and two GGUF block formats in which 32
// consecutive weights of a row share one f16 scale d (the bytes are exactly GGUF's, so
// a Q8_0 / Q4_0 tensor of a .gguf file is read in place):
//   Q8_0  {d, 32 x int8 q}          w[i] = d * q[i]                 34 bytes / 32
//   Q4_0  {d, 16 bytes of nibbles}  w[i] = d * (nibble(i) - 8);      18 bytes / 32
//         element i < 16 is the low nibble of byte i, element i >= 16 the high
//         nibble of byte i - 16
// Block rows need n % 32 == 0. The SIMD kernels dequantise in registers (the f32
// products are the same as for bf16), so a quantised row costs fewer bytes to stream.
#pragma once

#include <cstdint>
#include <cstring>

namespace ftjax {

enum class WeightType : int32_t { kF32 = 0, kBF16 = 1, kQ8_0 = 2, kQ4_0 = 3 };  // bf16 = raw uint16 bits

constexpr int64_t kQuantBlock = 32;  // weights per block of the block formats
struct BlockQ8_0 {
  uint16_t d;  // f16 scale
  int8_t qs[kQuantBlock];
};
struct BlockQ4_0 {
  uint16_t d;  // f16 scale
  uint8_t qs[kQuantBlock / 2];
};
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18, "GGUF block sizes");

// IEEE half -> float, exact (normals, subnormals, inf, NaN); portable.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400u)) { man <<= 1; --exp; }
    bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Element i of a row of each weight type, as float (tails and the scalar kernels).
inline float weight_at(const float* row, int64_t i) { return row[i]; }
inline float weight_at(const uint16_t* row, int64_t i) {
  const uint32_t u = static_cast<uint32_t>(row[i]) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// Activations meeting block-format weights are quantised the same way, per 32: an f32
// scale d = max|x| / 127 and q = round-to-even(x * (1 / d)) (d = 0: q = 0), so a
// block's dot product is d_w * d_x * (integer sum of 32 products), exact in int32.
// numpy and XLA twins: ftjax.experts.storage.quantise_activations.
struct ActQ8 {
  float d;
  int8_t qs[kQuantBlock];
};
static_assert(sizeof(ActQ8) == 36, "ActQ8 layout");
// x [n] -> n / 32 blocks (n % 32 == 0).
void quantise_act_q8(const float* x, int64_t n, ActQ8* out);
enum class Isa : int32_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3 };

// Software prefetch distance of the SIMD kernels. Hardware prefetchers stop at 4 KiB
// page boundaries, and a weight row (D or F elements) is about a page: with 1 KiB
// ahead bf16 decode reached ~80% of read bandwidth, with 4 KiB ~90-95% (AVX2 and
// AVX-512, measured on a 2-core Zen 5 VM).
constexpr int64_t kPrefetchBytes = 4096;

constexpr int kMaxRows = 4;  // R
constexpr int kMaxVecs = 3;  // J

// out[r * J + j] = sum_i rows[r][i] * vecs[j][i], i in [0, n). For block weight types
// the vectors are ActQ8 blocks (quantise_act_q8), passed through the same pointers.
using DotFn = void (*)(const void* const* rows, const float* const* vecs, int64_t n,
                       float* out);
// Sum of n floats (the read-bandwidth probe).
using SumFn = float (*)(const float* data, int64_t n);

// out[r] = row_r . vec for num_rows rows spaced row_stride BYTES apart (decode:
// one token, the rows read as one sequential stream).
using GemvFn = void (*)(const void* rows, int64_t row_stride, int64_t num_rows,
                        const float* vec, int64_t n, float* out);

struct DotTable {
  DotFn fn[kMaxRows + 1][kMaxVecs + 1];  // fn[R][J], R, J >= 1
  GemvFn gemv;
};

// Activation layout a bf16 table expects, given by a block size B (0 = plain).
// Inside each full block of B elements (i < n / B * B) a vector is stored as
// [odd elements, even elements], matching what one SIMD load of B bf16 weights
// yields after `and 0xFFFF0000` (odd) and `<< 16` (even); the tail stays in order.
// Weights never move; activations are reordered once per call.
inline int64_t even_odd_pos(int64_t i, int64_t n, int64_t block) {
  if (block == 0 || i >= n / block * block) return i;
  const int64_t o = i % block;
  return i - o + (o % 2 ? o / 2 : block / 2 + o / 2);
}

struct Kernels {
  DotTable f32;
  DotTable bf16;
  DotTable q8_0;
  DotTable q4_0;
  SumFn sum;
  int64_t bf16_block;  // activation layout of the bf16 table, see even_odd_pos
  const DotTable& dots(WeightType w) const {
    switch (w) {
      case WeightType::kBF16: return bf16;
      case WeightType::kQ8_0: return q8_0;
      case WeightType::kQ4_0: return q4_0;
      default: return f32;
    }
  }
  int64_t layout_block(WeightType w) const { return w == WeightType::kBF16 ? bf16_block : 0; }
};

const Kernels& scalar_kernels();
// The block-format tables (kernels_quant.cc): integer block dots, scalar and AVX2.
DotTable block_table_scalar(WeightType w);
DotTable block_table_avx2(WeightType w);
const Kernels* avx2_kernels();    // nullptr when not built for this architecture
const Kernels* avx512_kernels();  // nullptr when not built for this architecture
bool cpu_has_avx2_fma();
bool cpu_has_avx512();

// kAuto -> the widest ISA the CPU has; nullptr if a forced ISA is missing.
const Kernels* select_kernels(Isa isa);

inline bool is_block_type(WeightType w) { return w == WeightType::kQ8_0 || w == WeightType::kQ4_0; }
inline bool is_weight_type(int32_t code) { return code >= 0 && code <= 3; }

// Bytes of one row of n weights (block types: n % kQuantBlock == 0).
inline int64_t row_bytes(WeightType w, int64_t n) {
  switch (w) {
    case WeightType::kBF16: return 2 * n;
    case WeightType::kQ8_0: return n / kQuantBlock * int64_t(sizeof(BlockQ8_0));
    case WeightType::kQ4_0: return n / kQuantBlock * int64_t(sizeof(BlockQ4_0));
    default: return 4 * n;
  }
}

}  // namespace ftjax
