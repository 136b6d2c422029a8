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
#pragma once

#include <cstdint>

namespace ftjax {

enum class WeightType : int32_t { kF32 = 0, kBF16 = 1 };  // bf16 = raw uint16 bits
enum class Isa : int32_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3 };

// Software prefetch distance of the SIMD kernels. Hardware prefetchers stop at 4 KiB
// page boundaries, and a weight row (D or F elements) is about a page: with 1 KiB
// ahead bf16 decode reached ~80% of read bandwidth, with 4 KiB ~90-95% (AVX2 and
// AVX-512, measured on a 2-core Zen 5 VM).
constexpr int64_t kPrefetchBytes = 4096;

constexpr int kMaxRows = 4;  // R
constexpr int kMaxVecs = 3;  // J

// out[r * J + j] = sum_i rows[r][i] * vecs[j][i], i in [0, n).
using DotFn = void (*)(const void* const* rows, const float* const* vecs, int64_t n,
                       float* out);
// Sum of n floats (the read-bandwidth probe).
using SumFn = float (*)(const float* data, int64_t n);

// out[r] = row_r . vec for num_rows rows spaced row_stride elements apart (decode:
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
  SumFn sum;
  int64_t bf16_block;  // activation layout of the bf16 table, see even_odd_pos
  const DotTable& dots(WeightType w) const { return w == WeightType::kBF16 ? bf16 : f32; }
  int64_t layout_block(WeightType w) const { return w == WeightType::kBF16 ? bf16_block : 0; }
};

const Kernels& scalar_kernels();
const Kernels* avx2_kernels();    // nullptr when not built for this architecture
const Kernels* avx512_kernels();  // nullptr when not built for this architecture
bool cpu_has_avx2_fma();
bool cpu_has_avx512();

// kAuto -> the widest ISA the CPU has; nullptr if a forced ISA is missing.
const Kernels* select_kernels(Isa isa);

inline int64_t weight_bytes(WeightType w) { return w == WeightType::kBF16 ? 2 : 4; }

}  // namespace ftjax
