// Dot-product micro-kernels shared by the expert FFN and the bandwidth probe.
//
// Every matrix product in the expert FFN is "weight rows x activation vectors,
// full-length dots": weights are row-major [rows, n] in the HF layout, so each row
// is one contiguous stream. Two shapes of kernel per (ISA, weight type):
//   gemv:  consecutive rows x 1 vector (decode), one sequential stream;
//   fn[R][J]: an R x J tile (R <= 4, J <= max_vecs, mostly 3: 12 accumulators fit 16 AVX2
//          registers), each converted weight vector reused for J tokens (prefill).
// SIMD tables (AVX2+FMA, AVX-512) are compiled with target attributes, so the
// build needs no -march flag, and picked at run time from what the CPU supports.
//
// Weight types: f32, bf16 (raw uint16 bits), five GGUF block formats (the bytes are
// exactly GGUF's, so a Q8_0 / Q4_0 / Q4_K / Q6_K / MXFP4 tensor of a .gguf file is read in
// place), a tagged Q4_K-or-Q6_K block and FP8 rows with tile scales (below). In
// Q8_0 / Q4_0, 32 consecutive weights of a row share one f16 scale d:
//   Q8_0  {d, 32 x int8 q}          w[i] = d * q[i]                 34 bytes / 32
//   Q4_0  {d, 16 bytes of nibbles}  w[i] = d * (nibble(i) - 8);      18 bytes / 32
//         element i < 16 is the low nibble of byte i, element i >= 16 the high
//         nibble of byte i - 16
// Q4_K super-blocks hold 256 weights as 8 sub-blocks of 32, each with a 6-bit scale
// sc_j and a 6-bit min m_j, themselves scaled by two f16 values d and dmin:
//   Q4_K  {d, dmin, 12 bytes of packed sc_j / m_j, 128 bytes of nibbles}   144 bytes / 256
//         w = d * sc_j * nibble - dmin * m_j; sub-block 2c is the low nibbles of bytes
//         32c..32c+31, sub-block 2c+1 their high nibbles (q4_k_scale_min unpacks sc, m)
// Q6_K super-blocks hold 256 weights as 16 sub-blocks of 16, each with an int8 scale:
//   Q6_K  {128 bytes ql, 64 bytes qh, 16 x int8 scale, f16 d}   210 bytes / 256
//         w = d * scale_j * (q - 32), q = 4 low bits | 2 high bits << 4 (0..63); weight
//         128h + 32k + l (h < 2 halves, k < 4 quarters, l < 32) has its low bits in
//         ql[64h + 32(k & 1) + l] (low nibble for k < 2, high for k >= 2), its high bits
//         in qh[32h + l] >> 2k, its scale in scale[(128h + 32k + l) / 16]
// MXFP4 (OCP microscaling, GGUF's block_mxfp4): 32 e2m1 values share an e8m0 exponent:
//   MXFP4 {e, 16 bytes of nibbles}  w[i] = 2^(e - 128) * v(nibble(i)), nibbles as Q4_0,
//         v = e2m1 x 2 = {0, 1, 2, 3, 4, 6, 8, 12, -0, -1, ..., -12}: integers, so the
//         block is an int8 dot like Q4_0's after a 16-entry nibble -> int8 lookup
// FP8 (ftjax's own row layout of DeepSeek-V3's float8_e4m3fn weights with 128 x 128
// tile scales; each row's 128-weight blocks carry their tile's scale_inv):
//   FP8_E4M3 {f32 scale, 128 x e4m3fn}   w[i] = e4m3(i) * scale      132 bytes / 128
//         e4m3 is converted to float in registers (exact through f16: e4m3 bits << 7 are
//         an f16 of value e4m3 * 2^-8), and meets float32 activations (no ActQ8:
//         e4m3 levels are not integers of 8 bits)
// Q4_K_OR_Q6_K (a GGUF part whose layers mix the two, llama.cpp's Q4_K_M ffn_down_exps):
//   {tag 4 | 6, 0, a Q4_K block + 66 zero bytes | a Q6_K block}     212 bytes / 256
//         the blocks of one layer share a tag, so the branch on it is predicted
// Block rows need n % block_weights(type) == 0 (32; 256 for the K types; 128 for FP8).
// The block kernels multiply integers (kernels_quant.cc), so a quantised row costs fewer
// bytes to stream.
#pragma once

#include <cstdint>
#include <cstring>

namespace ftjax {

enum class WeightType : int32_t {  // bf16 = raw uint16 bits
  kF32 = 0, kBF16 = 1, kQ8_0 = 2, kQ4_0 = 3, kQ4_K = 4, kQ6_K = 5, kMXFP4 = 6, kFP8_E4M3 = 7, kQ4_K_OR_Q6_K = 8
};

constexpr int64_t kQuantBlock = 32;  // weights per Q8_0 / Q4_0 block, per Q4_K sub-block, per ActQ8 block
struct BlockQ8_0 {
  static constexpr int64_t kWeights = kQuantBlock;
  static constexpr WeightType kType = WeightType::kQ8_0;
  uint16_t d;  // f16 scale
  int8_t qs[kQuantBlock];
};
struct BlockQ4_0 {
  static constexpr int64_t kWeights = kQuantBlock;
  static constexpr WeightType kType = WeightType::kQ4_0;
  uint16_t d;  // f16 scale
  uint8_t qs[kQuantBlock / 2];
};
struct BlockQ4_K {
  static constexpr int64_t kWeights = 256;
  static constexpr WeightType kType = WeightType::kQ4_K;
  static constexpr int kSubBlocks = kWeights / kQuantBlock;  // 8
  uint16_t d;           // f16 scale of the sub-block scales
  uint16_t dmin;        // f16 scale of the sub-block mins
  uint8_t scales[12];   // 8 x 6-bit scale, 8 x 6-bit min (q4_k_scale_min)
  uint8_t qs[kWeights / 2];
};
struct BlockQ6_K {
  static constexpr int64_t kWeights = 256;
  static constexpr WeightType kType = WeightType::kQ6_K;
  uint8_t ql[kWeights / 2];   // low 4 bits
  uint8_t qh[kWeights / 4];   // high 2 bits
  int8_t scales[kWeights / 16];
  uint16_t d;                 // f16 super-block scale
};
struct BlockMXFP4 {
  static constexpr int64_t kWeights = kQuantBlock;
  static constexpr WeightType kType = WeightType::kMXFP4;
  uint8_t e;  // e8m0 shared exponent
  uint8_t qs[kQuantBlock / 2];
};
struct BlockFP8 {
  static constexpr int64_t kWeights = 128;
  static constexpr WeightType kType = WeightType::kFP8_E4M3;
  float d;  // the tile's scale_inv
  uint8_t qs[kWeights];  // float8_e4m3fn bits
};
struct BlockQ4_KorQ6_K {
  static constexpr int64_t kWeights = 256;
  static constexpr WeightType kType = WeightType::kQ4_K_OR_Q6_K;
  static constexpr uint8_t kTagQ6_K = 6;  // else (4) Q4_K
  uint8_t tag;
  uint8_t zero;
  union {
    BlockQ4_K q4;
    BlockQ6_K q6;
  };
};
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_K) == 144 &&
                  sizeof(BlockQ6_K) == 210 && sizeof(BlockMXFP4) == 17 && sizeof(BlockFP8) == 132 &&
                  sizeof(BlockQ4_KorQ6_K) == 212,
              "block sizes");

// e2m1 nibble -> 2 x its value (GGUF's kvalues_mxfp4), and the e8m0 byte -> 2^(e - 128)
// (half the block scale, as the values are doubled; ggml's e8m0_to_fp32_half).
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Scale and min of sub-block j of a Q4_K super-block (GGUF's get_scale_min_k4).
inline void q4_k_scale_min(const uint8_t* s, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// All 16 at once with 32-bit word operations (llama.cpp's utmp trick; the words are
// little-endian): out[0..7] = sc_0..7, out[8..15] = m_0..7.
__attribute__((always_inline)) inline void q4_k_unpack_scales(const uint8_t* s, uint8_t* out) {
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  uint32_t w[3], u[4];
  std::memcpy(w, s, 12);
  u[0] = w[0] & k6;                                    // sc_0..3
  u[1] = (w[2] & k4) | (((w[0] >> 6) & k2) << 4);      // sc_4..7
  u[2] = w[1] & k6;                                    // m_0..3
  u[3] = ((w[2] >> 4) & k4) | (((w[1] >> 6) & k2) << 4);  // m_4..7
  std::memcpy(out, u, 16);
}

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
// Activations meeting block-format weights are quantised to int8. Q8_0 / Q4_0 / MXFP4 meet
// ActQ8, per 32 values: an f32 scale d = max|x| / 127 and q = round-to-even(x * (1 / d))
// (d = 0: q = 0), so a block's dot product is d_w * d_x * (integer sum of 32 products),
// exact in int32.
struct ActQ8 {
  static constexpr int64_t kValues = kQuantBlock;
  float d;
  int8_t qs[kQuantBlock];
};
static_assert(sizeof(ActQ8) == 36, "ActQ8 layout");
// The K super-block types (Q4_K, Q6_K) meet ActQ8K, the same quantiser per 256 values (one
// super-block: llama.cpp's Q8_K), with the sums of each 16 q's: a whole super-block's
// scaled sub-block dots add up in int32 before one conversion and one FMA by d * d_x, and
// the constant-per-sub-block terms (Q4_K's mins, Q6_K's -32 offset) are one integer dot of
// the sub-block scales with bsums. 320 bytes per 256 values (the qs at a 64-byte boundary
// when the row is); 1.25 bytes per value.
struct ActQ8K {
  static constexpr int64_t kValues = 256;
  int8_t qs[kValues];
  int16_t bsums[kValues / 16];  // sum of qs[16g .. 16g + 15]
  float d;
  uint8_t pad[28];
};
static_assert(sizeof(ActQ8K) == 320, "ActQ8K layout");
// x [n] -> n / 32 ActQ8 blocks (n % 32 == 0), or n / 256 ActQ8K blocks (n % 256 == 0);
// at most 1.25 bytes per value, so a buffer of n floats holds them. simd: AVX2, 8 values at a time
// (the same bytes; the SIMD tables ask for it, Kernels::simd_quantise). numpy and XLA
// twins: ftjax.experts.storage.quantise_activations (block 32 or 256).
void quantise_act_q8(const float* x, int64_t n, ActQ8* out, bool simd);
void quantise_act_q8k(const float* x, int64_t n, ActQ8K* out, bool simd);
// kAuto: the widest exact one (AVX-512 F, then AVX2, then scalar). kAvx512Bf16 (only when
// asked for): bf16 rows meet bf16-rounded activations in vdpbf16ps (kernels_avx512_bf16.cc).
// kAmxBf16 (only when asked for, and where amx_bf16_ok()): kAuto's kernels, except that
// calls of >= kAmxMinTokens tokens (prompts: expert FFN, dense linear, attention) multiply
// on AMX tiles with bf16-rounded activations (amx.h). kAvx512Bf16Tiles (only when asked
// for, and where bf16_vector_ok()): the same, the tiles' layouts multiplied with vdpbf16ps
// on a CPU without AMX (amx.h's vector form). tiles_granted (amx.h) says which runs.
enum class Isa : int32_t {
  kAuto = 0,
  kScalar = 1,
  kAvx2 = 2,
  kAvx512 = 3,
  kAvx512Bf16 = 4,
  kAmxBf16 = 5,
  kAvx512Bf16Tiles = 6
};

// Software prefetch distance of the SIMD kernels. Hardware prefetchers stop at 4 KiB
// page boundaries, and a weight row (D or F elements) is about a page: with 1 KiB
// ahead bf16 decode reached ~80% of read bandwidth, with 4 KiB ~90-95% (AVX2 and
// AVX-512, measured on a 2-core Zen 5 VM).
constexpr int64_t kPrefetchBytes = 4096;

// Bytes ahead that the decode GEMV of float and bf16 rows prefetches into L2 (one
// prefetcht1 a line; 0 = none: the hardware prefetchers alone). Chosen by what the CPU
// reports: 4096 on Intel (a 2-core Xeon with AMX: bf16 decode 11.2-12.3 -> 14.0-14.9
// GB/s on one core, 20.4-20.9 -> 25.8-27.0 on two, the probe 13-15 / 26-30); 1024 on AMD
// without AVX-512 (cpu_has_avx512; AUTO's table is then AVX2. A 2-core Zen 3 EPYC: bf16
// decode 15.4-15.7 -> 17.2-17.5 GB/s on one core, 24.7-26.4 -> 27.2-30.1 on two, 2048
// ahead no better, the probe 22-27 / 32-36); 0 elsewhere (on Zen 4 a software prefetch held bf16 decode to 21-24
// GB/s against 29-31 without).
// The result never depends on it. The AVX-512 F and AVX2 tables' GEMVs (AUTO's) take
// it; the AVX512-BF16 table's, used only when asked for, keeps none (not measured).
// set_gemv_prefetch_bytes: the override (`FTJAX_GEMV_PREFETCH`, ftjax.host) and tests.
int64_t gemv_prefetch_bytes();
void set_gemv_prefetch_bytes(int64_t bytes);

// One prefetch into L2 (prefetcht1 on x86) per 64 of the `bytes` bytes at p + ahead.
inline void prefetch_l2(const void* p, int64_t bytes, int64_t ahead) {
  const char* c = static_cast<const char*>(p) + ahead;
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 2);
}

constexpr int kMaxRows = 4;  // R
constexpr int kMaxVecs = 6;  // J: the widest tile of any table (DotTable::max_vecs)

// out[r * J + j] = sum_i rows[r][i] * vecs[j][i], i in [0, n). For block weight types
// the vectors are ActQ8 / ActQ8K blocks (act_block), passed through the same pointers.
using DotFn = void (*)(const void* const* rows, const float* const* vecs, int64_t n,
                       float* out);
// Sum of n floats (the read-bandwidth probe).
using SumFn = float (*)(const float* data, int64_t n);

// out[r] = row_r . vec for num_rows rows spaced row_stride BYTES apart (decode:
// one token, the rows read as one sequential stream).
using GemvFn = void (*)(const void* rows, int64_t row_stride, int64_t num_rows,
                        const float* vec, int64_t n, float* out);

struct DotTable {
  DotFn fn[kMaxRows + 1][kMaxVecs + 1];  // fn[R][J], R >= 1, 1 <= J <= max_vecs
  GemvFn gemv;
  // Tokens per tile call: 3, or 6 for the K super-block types in the VNNI build (one row at
  // a time, 2 x 6 accumulators in its 32 vector registers; each row's super-block decode
  // then serves 6 tokens: Q4_K prefill 1160 -> ~1300 tok/s on one Zen 4 core).
  int max_vecs = 3;
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
  DotTable q4_k;
  DotTable q6_k;
  DotTable mxfp4;
  DotTable fp8;
  DotTable q4_k_or_q6_k;
  SumFn sum;
  int64_t bf16_block;     // activation layout of the bf16 table, see even_odd_pos
  bool bf16_act = false;  // the bf16 table reads bf16 activations (bits, plain order)
  bool simd_quantise = false;  // int8 activations quantised with AVX2 (quantise_act_q8)
  const DotTable& dots(WeightType w) const {
    switch (w) {
      case WeightType::kBF16: return bf16;
      case WeightType::kQ8_0: return q8_0;
      case WeightType::kQ4_0: return q4_0;
      case WeightType::kQ4_K: return q4_k;
      case WeightType::kQ6_K: return q6_k;
      case WeightType::kMXFP4: return mxfp4;
      case WeightType::kFP8_E4M3: return fp8;
      case WeightType::kQ4_K_OR_Q6_K: return q4_k_or_q6_k;
      default: return f32;
    }
  }
  int64_t layout_block(WeightType w) const { return w == WeightType::kBF16 ? bf16_block : 0; }
};

const Kernels& scalar_kernels();
// The block-format tables (kernels_quant.cc): integer block dots (FP8: float), scalar and
// AVX2. Every Kernels table takes its block-format entries from one of these.
DotTable block_table_scalar(WeightType w);
DotTable block_table_avx2(WeightType w);
DotTable block_table_vnni(WeightType w);  // AVX2's kernels with AVX-512 VNNI integer dots
const Kernels* avx2_kernels();    // nullptr when not built for this architecture
const Kernels* avx512_kernels();  // nullptr when not built for this architecture
const Kernels* avx512_bf16_kernels();  // nullptr when not built for this architecture
bool cpu_has_avx2_fma();
bool cpu_has_avx512();
bool cpu_has_vnni();         // AVX-512 F, BW, VL and VNNI: the AVX-512 table's block dots use vpdpbusd
bool cpu_has_avx512_bf16();  // and BF16

// kAuto -> the widest ISA the CPU has; nullptr if a forced ISA is missing.
const Kernels* select_kernels(Isa isa);
// select_kernels for entry points that raise: std::invalid_argument when the CPU lacks the ISA.
const Kernels& require_kernels(Isa isa);

inline bool is_block_type(WeightType w) { return w != WeightType::kF32 && w != WeightType::kBF16; }
// Values per int8 activation block the dots of weight type w take: 256 (ActQ8K) for the K
// super-block types, 32 (ActQ8) for the other block types but FP8, 0 (floats) otherwise.
constexpr int64_t act_block(WeightType w) {
  switch (w) {
    case WeightType::kQ4_K:
    case WeightType::kQ6_K:
    case WeightType::kQ4_K_OR_Q6_K: return ActQ8K::kValues;
    case WeightType::kQ8_0:
    case WeightType::kQ4_0:
    case WeightType::kMXFP4: return kQuantBlock;
    default: return 0;
  }
}
inline bool is_weight_type(int32_t code) { return code >= 0 && code <= 8; }

// Weights per block (1 for the plain types): a row's length must be a multiple of it.
inline int64_t block_weights(WeightType w) {
  switch (w) {
    case WeightType::kQ8_0: return BlockQ8_0::kWeights;
    case WeightType::kQ4_0: return BlockQ4_0::kWeights;
    case WeightType::kQ4_K: return BlockQ4_K::kWeights;
    case WeightType::kQ6_K: return BlockQ6_K::kWeights;
    case WeightType::kMXFP4: return BlockMXFP4::kWeights;
    case WeightType::kFP8_E4M3: return BlockFP8::kWeights;
    case WeightType::kQ4_K_OR_Q6_K: return BlockQ4_KorQ6_K::kWeights;
    default: return 1;
  }
}

// Bytes of one row of n weights (block types: n % block_weights(w) == 0).
inline int64_t row_bytes(WeightType w, int64_t n) {
  switch (w) {
    case WeightType::kBF16: return 2 * n;
    case WeightType::kQ8_0: return n / BlockQ8_0::kWeights * int64_t(sizeof(BlockQ8_0));
    case WeightType::kQ4_0: return n / BlockQ4_0::kWeights * int64_t(sizeof(BlockQ4_0));
    case WeightType::kQ4_K: return n / BlockQ4_K::kWeights * int64_t(sizeof(BlockQ4_K));
    case WeightType::kQ6_K: return n / BlockQ6_K::kWeights * int64_t(sizeof(BlockQ6_K));
    case WeightType::kMXFP4: return n / BlockMXFP4::kWeights * int64_t(sizeof(BlockMXFP4));
    case WeightType::kFP8_E4M3: return n / BlockFP8::kWeights * int64_t(sizeof(BlockFP8));
    case WeightType::kQ4_K_OR_Q6_K: return n / BlockQ4_KorQ6_K::kWeights * int64_t(sizeof(BlockQ4_KorQ6_K));
    default: return 4 * n;
  }
}

}  // namespace ftjax
