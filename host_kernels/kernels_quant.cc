// Block-format dot products: Q8_0 / Q4_0 / Q4_K / Q6_K / MXFP4 (and Q4_K-or-Q6_K) weight rows
// (kernels.h) against int8-quantised activations (ActQ8 blocks of 32; ActQ8K blocks of 256
// for the K super-block types), and FP8 rows against float32 activations. Per Q8_0 / Q4_0 /
// MXFP4 block (MXFP4: q_w the doubled e2m1 integers, d_w = 2^(e - 128)):
//
//     dot += d_w * d_x * sum_i q_w[i] * q_x[i]        (the sum exact in int32)
//
// per Q4_K super-block (weights d*sc_j*q - dmin*m_j, q in 0..15, sub-blocks j of 32), with
// b_j = sum of sub-block j's q_x (two of ActQ8K's bsums):
//
//     dot += d * d_x * sum_j sc_j * sum_i q[i] * q_x[i]  -  dmin * d_x * sum_j m_j * b_j
//
// per Q6_K super-block (16 sub-blocks g of 16, int8 scales sc_g, levels q in 0..63 stored
// for q - 32, bsums_g of ActQ8K):
//
//     dot += d * d_x * (sum_g sc_g * sum_i q[i] * q_x[i]  -  32 * sum_g sc_g * bsums_g)
//
// and per FP8 block of 128 (float, e4m3 converted exactly through f16 in registers):
//
//     dot += scale * sum_i e4m3[i] * x[i]
//
// This is llama.cpp's scheme (its K dots meet Q8_K activations, one scale per 256, as ours
// now do: per-32 activation scales cost a conversion and an FMA per sub-block, and Q4_K ran
// at 0.6x llama.cpp's speed on Zen 4): the weights never widen to f32, so a core does ~4x
// the weights per cycle of the bf16 path and decode stays bound by the bytes read. Three
// implementations with one result up to float summation order:
//   scalar: plain C++ (the portable fallback and the C++ twin of the numpy reference);
//   AVX2:   32 products per block in 4 integer ops (sign, sign, maddubs, madd), one
//           conversion and one FMA into 8 float lanes; the K types' unsigned levels go
//           into maddubs as they are, madd multiplies by the sub-block scales (picked from
//           a vector of 8 by one byte shuffle), and a super-block's sums add up in int32
//           lanes before one conversion and one FMA (Q4_K: a second for the mins, one
//           madd of the bsums with m_j; Q6_K: the -32 offset subtracted in int32); also
//           used by the AVX-512 table on a CPU without VNNI (the integer work is 256 bits
//           wide either way);
//   VNNI:   the same source (kernels_quant_simd.inc, compiled twice) with the unscaled pair
//           sums (Q8_0 / Q4_0 / MXFP4) in one vpdpbusd (AVX-512 VNNI at 256 bits); Q4_K /
//           Q6_K keep maddubs by their levels and fold the madd by their scales and the add
//           into one vpdpwssd (vpdpbusd and an int32 multiply was 10% slower), and tile 6
//           tokens instead of 3. Integer-exact, so its outputs equal AVX2's to the bit. Used by the
//           AVX-512 tables when the CPU has VNNI (prefill 1.1-1.2x for Q8_0 / Q4_0 / MXFP4
//           on Zen 4).
// MXFP4: a pshufb of the nibbles through the 16 doubled e2m1 values, then Q4_0's path.
// FP8: 16 weights per step, sign-extended to 16 bits, << 7 and a mask make f16 bits (value
// e4m3 * 2^-8, subnormals included), two vcvtph2ps and two FMAs against the float
// activations; the block's 2^8 * scale is applied once per 128. The activation quantiser
// has an AVX2 twin (the SIMD tables use it; the same bytes). The numpy reference is
// ftjax.host.reference_expert_ffn (gguf's dequantiser and the numpy twin of the
// quantisers, storage.quantise_activations), the XLA one ftjax.experts.storage.
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels.h"

namespace ftjax {

// The activation block a weight block type meets (kernels.h act_block): ActQ8K for the K
// super-blocks, ActQ8 for the others.
template <typename W>
using ActOf = std::conditional_t<act_block(W::kType) == ActQ8K::kValues, ActQ8K, ActQ8>;

namespace {

#if defined(__x86_64__) || defined(__i386__)
// The same quantiser 8 values at a time (x86 section below; len % 32 == 0): the same d,
// id and products, rounded by vroundps to nearest even, so the same bytes.
float quantise_block_avx2(const float* v, int64_t len, int8_t* q);
#endif

// One int8 block of `len` values: d = max|x| / 127, q = round-to-even(x * (1 / d)); returns d.
// simd: the AVX2 twin (only SIMD tables, so only x86, ask for it).
float quantise_block(const float* v, int64_t len, int8_t* q, bool simd) {
#if defined(__x86_64__) || defined(__i386__)
  if (simd && len % 32 == 0) return quantise_block_avx2(v, len, q);
#else
  (void)simd;
#endif
  float amax = 0.f;
  for (int64_t i = 0; i < len; ++i) amax = std::fmax(amax, std::fabs(v[i]));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  for (int64_t i = 0; i < len; ++i) q[i] = static_cast<int8_t>(std::nearbyint(v[i] * id));
  return d;
}

}  // namespace

void quantise_act_q8(const float* x, int64_t n, ActQ8* out, bool simd) {
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    out[b].d = quantise_block(x + b * kQuantBlock, kQuantBlock, out[b].qs, simd);
  }
}

void quantise_act_q8k(const float* x, int64_t n, ActQ8K* out, bool simd) {
  constexpr int64_t kN = ActQ8K::kValues;
  for (int64_t b = 0; b < n / kN; ++b) {
    out[b].d = quantise_block(x + b * kN, kN, out[b].qs, simd);
    for (int g = 0; g < kN / 16; ++g) {
      int16_t sum = 0;
      for (int i = 0; i < 16; ++i) sum = static_cast<int16_t>(sum + out[b].qs[16 * g + i]);
      out[b].bsums[g] = sum;
    }
  }
}

namespace {

// ---- scalar ------------------------------------------------------------------------------

inline int32_t block_sum(const BlockQ8_0& w, const ActQ8& a) {
  int32_t s = 0;
  for (int i = 0; i < kQuantBlock; ++i) s += int32_t(w.qs[i]) * a.qs[i];
  return s;
}

inline int32_t block_sum(const BlockQ4_0& w, const ActQ8& a) {
  int32_t s = 0;
  for (int i = 0; i < kQuantBlock / 2; ++i)
    s += (int32_t(w.qs[i] & 0xF) - 8) * a.qs[i] + (int32_t(w.qs[i] >> 4) - 8) * a.qs[i + kQuantBlock / 2];
  return s;
}

inline int32_t block_sum(const BlockMXFP4& w, const ActQ8& a) {
  int32_t s = 0;
  for (int i = 0; i < kQuantBlock / 2; ++i)
    s += kMxfp4Values[w.qs[i] & 0xF] * a.qs[i] + kMxfp4Values[w.qs[i] >> 4] * a.qs[i + kQuantBlock / 2];
  return s;
}

// One weight block against its activation blocks (W::kWeights / 32 of them).
template <typename W>
inline float block_dot(const W& w, const ActQ8* a) {
  return half_to_float(w.d) * a->d * static_cast<float>(block_sum(w, *a));
}

inline float block_dot(const BlockMXFP4& w, const ActQ8* a) {
  return e8m0_half(w.e) * a->d * static_cast<float>(block_sum(w, *a));
}

// The K types meet one ActQ8K per super-block. Q6_K: 32 weights 32j..32j+31 (half h = j / 4,
// quarter k = j % 4, kernels.h) are sub-blocks 2j and 2j + 1; the integer sum of
// sc * (q - 32) * q_x over the super-block, times d * d_x.
inline float block_dot(const BlockQ6_K& w, const ActQ8K* a) {
  int32_t sumi = 0;
  for (int j = 0; j < 8; ++j) {
    const int h = j / 4, k = j % 4;
    const uint8_t* ql = w.ql + 64 * h + 32 * (k & 1);
    const uint8_t* qh = w.qh + 32 * h;
    const int shift = 4 * (k >> 1);
    int32_t sum[2] = {0, 0};
    for (int l = 0; l < kQuantBlock; ++l) {
      const int32_t q = ((ql[l] >> shift) & 0xF) | (((qh[l] >> (2 * k)) & 3) << 4);
      sum[l / 16] += (q - 32) * a->qs[32 * j + l];
    }
    sumi += w.scales[2 * j] * sum[0] + w.scales[2 * j + 1] * sum[1];
  }
  return half_to_float(w.d) * a->d * static_cast<float>(sumi);
}

// e4m3fn bits -> f16 bits of value e4m3 * 2^-8 (exact, subnormals included; the NaN
// pattern S.1111.111 becomes a finite f16: weights carry none).
inline uint16_t fp8_to_half_bits(uint8_t b) {
  return static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7));
}

// Q4_K: the integer sums of sc_j * q * q_x and of m_j * q_x (the bsums of sub-block j's two
// halves) over the super-block, times d * d_x and dmin * d_x.
inline float block_dot(const BlockQ4_K& w, const ActQ8K* a) {
  int32_t sumi = 0, summ = 0;
  for (int j = 0; j < BlockQ4_K::kSubBlocks; ++j) {
    uint8_t sc, m;
    q4_k_scale_min(w.scales, j, &sc, &m);
    const uint8_t* q = w.qs + (j / 2) * kQuantBlock;  // sub-blocks 2c, 2c+1: low, high nibbles
    const int shift = 4 * (j % 2);
    int32_t qa = 0;
    for (int i = 0; i < kQuantBlock; ++i) qa += int32_t((q[i] >> shift) & 0xF) * a->qs[32 * j + i];
    sumi += sc * qa;
    summ += m * (a->bsums[2 * j] + a->bsums[2 * j + 1]);
  }
  return half_to_float(w.d) * a->d * static_cast<float>(sumi) -
         half_to_float(w.dmin) * a->d * static_cast<float>(summ);
}

inline float block_dot(const BlockQ4_KorQ6_K& w, const ActQ8K* a) {
  return w.tag == BlockQ4_KorQ6_K::kTagQ6_K ? block_dot(w.q6, a) : block_dot(w.q4, a);
}

template <typename W, int R, int J>
void dot_block_scalar(const void* const* rows_v, const float* const* vecs_v, int64_t n, float* out) {
  using Act = ActOf<W>;
  constexpr int64_t acts = W::kWeights / Act::kValues;  // activation blocks per weight block
  for (int r = 0; r < R; ++r) {
    const W* row = static_cast<const W*>(rows_v[r]);
    for (int j = 0; j < J; ++j) {
      const Act* vec = reinterpret_cast<const Act*>(vecs_v[j]);
      float s = 0.f;
      for (int64_t b = 0; b < n / W::kWeights; ++b) s += block_dot(row[b], vec + b * acts);
      out[r * J + j] = s;
    }
  }
}

// FP8 rows against float vectors: per block, the float sum of e4m3 * 2^-8 * x, then
// times 2^8 * scale (the AVX2 kernel's order of operations, per lane).
template <typename W, int R, int J>
void dot_fp8_scalar(const void* const* rows_v, const float* const* vecs, int64_t n, float* out) {
  for (int r = 0; r < R; ++r) {
    const BlockFP8* row = static_cast<const BlockFP8*>(rows_v[r]);
    for (int j = 0; j < J; ++j) {
      float s = 0.f;
      for (int64_t b = 0; b < n / BlockFP8::kWeights; ++b) {
        const float* x = vecs[j] + b * BlockFP8::kWeights;
        float bs = 0.f;
        for (int i = 0; i < BlockFP8::kWeights; ++i) bs += half_to_float(fp8_to_half_bits(row[b].qs[i])) * x[i];
        s += bs * (row[b].d * 256.f);
      }
      out[r * J + j] = s;
    }
  }
}

// Rows one after another (decode): each row one sequential stream that the prefetchers
// follow. (Four rows interleaved, as the R = 4 tiles read them, halved Q8_0 decode: 11 vs
// 23 GB/s on one Zen 4 core, the read ceiling being 22-26.)
template <typename W, typename Table>
void gemv_rows(const Table& fn, const void* rows, int64_t row_stride, int64_t num_rows, const float* vec,
               int64_t n, float* out) {
  const char* base = static_cast<const char*>(rows);
  for (int64_t r = 0; r < num_rows; ++r) {
    const void* ptr = base + r * row_stride;
    fn[1][1](&ptr, &vec, n, out + r);
  }
}

#define FTJAX_ROW(F, W, R) \
  { nullptr, &F<W, R, 1>, &F<W, R, 2>, &F<W, R, 3> }
#define FTJAX_FNS(F, W) \
  { {}, FTJAX_ROW(F, W, 1), FTJAX_ROW(F, W, 2), FTJAX_ROW(F, W, 3), FTJAX_ROW(F, W, 4) }
#define FTJAX_ROW6(F, W, R) \
  { nullptr, &F<W, R, 1>, &F<W, R, 2>, &F<W, R, 3>, &F<W, R, 4>, &F<W, R, 5>, &F<W, R, 6> }
#define FTJAX_FNS6(F, W) \
  { {}, FTJAX_ROW6(F, W, 1), FTJAX_ROW6(F, W, 2), FTJAX_ROW6(F, W, 3), FTJAX_ROW6(F, W, 4) }

// The R x J kernels of a block type (the gemv entry is filled in by scalar_table).
template <typename W>
DotTable scalar_fns() {
  return {FTJAX_FNS(dot_block_scalar, W), nullptr};
}
template <>
DotTable scalar_fns<BlockFP8>() {
  return {FTJAX_FNS(dot_fp8_scalar, BlockFP8), nullptr};
}

template <typename W>
void gemv_block_scalar(const void* rows, int64_t row_stride, int64_t num_rows, const float* vec, int64_t n,
                       float* out) {
  static const DotTable t = scalar_fns<W>();
  gemv_rows<W>(t.fn, rows, row_stride, num_rows, vec, n, out);
}

template <typename W>
DotTable scalar_table() {
  DotTable t = scalar_fns<W>();
  t.gemv = &gemv_block_scalar<W>;
  return t;
}

}  // namespace

DotTable block_table_scalar(WeightType w) {
  switch (w) {
    case WeightType::kQ4_0: return scalar_table<BlockQ4_0>();
    case WeightType::kQ4_K: return scalar_table<BlockQ4_K>();
    case WeightType::kQ6_K: return scalar_table<BlockQ6_K>();
    case WeightType::kMXFP4: return scalar_table<BlockMXFP4>();
    case WeightType::kFP8_E4M3: return scalar_table<BlockFP8>();
    case WeightType::kQ4_K_OR_Q6_K: return scalar_table<BlockQ4_KorQ6_K>();
    default: return scalar_table<BlockQ8_0>();
  }
}

}  // namespace ftjax

// ---- AVX2 --------------------------------------------------------------------------------
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "simd_math.h"  // q6_k_levels

#define FTJAX_QSIMD __attribute__((target("avx2,fma,f16c")))
#define FTJAX_QSIMD_VNNI 0
namespace ftjax::avx2 {
#include "kernels_quant_simd.inc"
}  // namespace ftjax::avx2
#undef FTJAX_QSIMD
#undef FTJAX_QSIMD_VNNI

#define FTJAX_QSIMD __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define FTJAX_QSIMD_VNNI 1
namespace ftjax::vnni {
#include "kernels_quant_simd.inc"
}  // namespace ftjax::vnni
#undef FTJAX_QSIMD
#undef FTJAX_QSIMD_VNNI

namespace ftjax {
DotTable block_table_avx2(WeightType w) { return avx2::block_table(w); }
DotTable block_table_vnni(WeightType w) { return vnni::block_table(w); }

namespace {

__attribute__((target("avx2,fma"))) float quantise_block_avx2(const float* v, int64_t len, int8_t* q) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int64_t i = 0; i < len; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float d = _mm_cvtss_f32(h) / 127.f;
  const __m256 id = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' lane interleave
  for (int64_t i = 0; i < len; i += 32) {
    __m256i r[4];
    for (int k = 0; k < 4; ++k)
      r[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8 * k), id),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permutevar8x32_epi32(bytes, order));
  }
  return d;
}

}  // namespace
}  // namespace ftjax

#else  // not x86: the scalar tables serve every ISA

namespace ftjax {
DotTable block_table_avx2(WeightType w) { return block_table_scalar(w); }
DotTable block_table_vnni(WeightType w) { return block_table_scalar(w); }
}  // namespace ftjax

#endif
