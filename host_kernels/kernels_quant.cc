// Block-format dot products: Q8_0 / Q4_0 / Q4_K / Q6_K / MXFP4 (and Q4_K-or-Q6_K) weight rows (kernels.h)
// against activations quantised to ActQ8 blocks of 32, and FP8 rows against float32
// activations. Per Q8_0 / Q4_0 / MXFP4 block (MXFP4: q_w the doubled e2m1 integers,
// d_w = 2^(e - 128)):
//
//     dot += d_w * d_x * sum_i q_w[i] * q_x[i]        (the sum exact in int32)
//
// per Q6_K activation block (two sub-blocks of 16, scales sc_lo, sc_hi; q in -32..31):
//
//     dot += d * d_x * (sc_lo * sum_{i<16} q[i] * q_x[i] + sc_hi * sum_{i>=16} q[i] * q_x[i])
//
// and per FP8 block of 128 (float, e4m3 converted exactly through f16 in registers):
//
//     dot += scale * sum_i e4m3[i] * x[i]
//
// and per Q4_K sub-block j of 32 (weights d*sc_j*q - dmin*m_j, q in 0..15):
//
//     dot += d * d_x * sc_j * sum_i q[i] * q_x[i]  -  dmin * m_j * s_x
//
// (s_x = d_x * sum_i q_x[i], stored with the activation block)
//
// which is llama.cpp's scheme for these types (its Q4_K dot meets Q8_K activations, one
// scale per 256; ours keep one per 32, the activation blocks of every block format): the
// weights never widen to f32, so a core does ~4x the weights per cycle of the bf16 path
// and decode stays bound by the bytes read. Two implementations with one result up to
// float summation order:
//   scalar: plain C++ (the portable fallback and the C++ twin of the numpy reference);
//   AVX2:   32 products per block in 4 integer ops (sign, sign, maddubs, madd; Q4_K's
//           nibbles are unsigned, so maddubs takes them as they are and madd multiplies
//           by sc_j), one conversion and one FMA into 8 float lanes (Q4_K: the min terms
//           of a whole super-block in one more FMA, against the activation blocks' sums
//           s); also used by the AVX-512 table (the integer work is 256 bits wide either way).
// Q6_K: the 6-bit levels centred (q - 32, signed) so the sign trick of Q8_0 applies, and
// the madd by a vector of two scales (sc_lo in the 8 pair sums of bytes 0-15, sc_hi in
// those of 16-31). MXFP4: a pshufb of the nibbles through the 16 doubled e2m1 values,
// then Q4_0's path. FP8: 16 weights per step, sign-extended to 16 bits, << 7 and a mask
// make f16 bits (value e4m3 * 2^-8, subnormals included), two vcvtph2ps and two FMAs
// against the float activations; the block's 2^8 * scale is applied once per 128.
// The numpy reference is ftjax.host.reference_expert_ffn (gguf's dequantiser and the
// numpy twin of quantise_act_q8), the XLA one ftjax.experts.storage.
#include <cmath>
#include <cstring>

#include "kernels.h"

namespace ftjax {

void quantise_act_q8(const float* x, int64_t n, ActQ8* out) {
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const float* v = x + b * kQuantBlock;
    float amax = 0.f;
    for (int i = 0; i < kQuantBlock; ++i) amax = std::fmax(amax, std::fabs(v[i]));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < kQuantBlock; ++i) {
      out[b].qs[i] = static_cast<int8_t>(std::nearbyint(v[i] * id));
      sum += out[b].qs[i];
    }
    out[b].d = d;
    out[b].s = d * static_cast<float>(sum);
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

// Activation block j of a Q6_K super-block covers weights 32j..32j+31: half h = j / 4,
// quarter k = j % 4 (kernels.h), sub-blocks 2j and 2j + 1.
inline float block_dot(const BlockQ6_K& w, const ActQ8* a) {
  const float d = half_to_float(w.d);
  float s = 0.f;
  for (int j = 0; j < 8; ++j) {
    const int h = j / 4, k = j % 4;
    const uint8_t* ql = w.ql + 64 * h + 32 * (k & 1);
    const uint8_t* qh = w.qh + 32 * h;
    const int shift = 4 * (k >> 1);
    int32_t sum[2] = {0, 0};
    for (int l = 0; l < kQuantBlock; ++l) {
      const int32_t q = ((ql[l] >> shift) & 0xF) | (((qh[l] >> (2 * k)) & 3) << 4);
      sum[l / 16] += (q - 32) * a[j].qs[l];
    }
    s += (d * a[j].d) * static_cast<float>(w.scales[2 * j] * sum[0] + w.scales[2 * j + 1] * sum[1]);
  }
  return s;
}

// e4m3fn bits -> f16 bits of value e4m3 * 2^-8 (exact, subnormals included; the NaN
// pattern S.1111.111 becomes a finite f16: weights carry none).
inline uint16_t fp8_to_half_bits(uint8_t b) {
  return static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7));
}

inline float block_dot(const BlockQ4_K& w, const ActQ8* a) {
  const float d = half_to_float(w.d), dmin = half_to_float(w.dmin);
  float s = 0.f;
  for (int j = 0; j < BlockQ4_K::kSubBlocks; ++j) {
    uint8_t sc, m;
    q4_k_scale_min(w.scales, j, &sc, &m);
    const uint8_t* q = w.qs + (j / 2) * kQuantBlock;  // sub-blocks 2c, 2c+1: low, high nibbles
    const int shift = 4 * (j % 2);
    int32_t qa = 0;
    for (int i = 0; i < kQuantBlock; ++i) qa += int32_t((q[i] >> shift) & 0xF) * a[j].qs[i];
    s += (d * a[j].d) * static_cast<float>(sc * qa) - (dmin * m) * a[j].s;
  }
  return s;
}

inline float block_dot(const BlockQ4_KorQ6_K& w, const ActQ8* a) {
  return w.tag == BlockQ4_KorQ6_K::kTagQ6_K ? block_dot(w.q6, a) : block_dot(w.q4, a);
}

template <typename W, int R, int J>
void dot_block_scalar(const void* const* rows_v, const float* const* vecs_v, int64_t n, float* out) {
  constexpr int64_t acts = W::kWeights / kQuantBlock;  // activation blocks per weight block
  for (int r = 0; r < R; ++r) {
    const W* row = static_cast<const W*>(rows_v[r]);
    for (int j = 0; j < J; ++j) {
      const ActQ8* vec = reinterpret_cast<const ActQ8*>(vecs_v[j]);
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

// Rows one after another (decode): each row one sequential stream.
template <typename W, typename Table>
void gemv_rows(const Table& fn, const void* rows, int64_t row_stride, int64_t num_rows, const float* vec,
               int64_t n, float* out) {
  const char* base = static_cast<const char*>(rows);
  int64_t r = 0;
  for (; r + kMaxRows <= num_rows; r += kMaxRows) {
    const void* ptrs[kMaxRows];
    for (int i = 0; i < kMaxRows; ++i) ptrs[i] = base + (r + i) * row_stride;
    fn[kMaxRows][1](ptrs, &vec, n, out + r);
  }
  for (; r < num_rows; ++r) {
    const void* ptr = base + r * row_stride;
    fn[1][1](&ptr, &vec, n, out + r);
  }
}

#define FTJAX_ROW(F, W, R) \
  { nullptr, &F<W, R, 1>, &F<W, R, 2>, &F<W, R, 3> }
#define FTJAX_FNS(F, W) \
  { {}, FTJAX_ROW(F, W, 1), FTJAX_ROW(F, W, 2), FTJAX_ROW(F, W, 3), FTJAX_ROW(F, W, 4) }

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

#define FTJAX_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace ftjax {
namespace {

// The 32 weights of a block as signed bytes.
FTJAX_AVX2 inline __m256i block_bytes(const BlockQ8_0& b) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
}
FTJAX_AVX2 inline __m256i block_bytes(const BlockQ4_0& b) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  return _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
}

FTJAX_AVX2 inline __m256i block_bytes(const BlockMXFP4& b) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i values = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Values));
  const __m128i lo = _mm_shuffle_epi8(values, _mm_and_si128(bytes, mask));
  const __m128i hi = _mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
  return _mm256_set_m128i(hi, lo);
}

// The block's float scale d_w.
FTJAX_AVX2 inline float block_scale(const BlockQ8_0& b) { return _cvtsh_ss(b.d); }
FTJAX_AVX2 inline float block_scale(const BlockQ4_0& b) { return _cvtsh_ss(b.d); }
FTJAX_AVX2 inline float block_scale(const BlockMXFP4& b) { return e8m0_half(b.e); }

// 8 float lanes whose sum is sum_i w[i] * a[i] over 32 signed bytes (|w|, |a| <= 127,
// or w = -128: |w| as unsigned is still exact; pair sums stay below 2^15).
FTJAX_AVX2 inline __m256 dot32(__m256i w, __m256i a) {
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

FTJAX_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <typename W, int R, int J>
FTJAX_AVX2 void dot_block_avx2(const void* const* rows_v, const float* const* vecs_v, int64_t n, float* out) {
  const W* rows[R];
  const ActQ8* vecs[J];
  for (int r = 0; r < R; ++r) rows[r] = static_cast<const W*>(rows_v[r]);
  for (int j = 0; j < J; ++j) vecs[j] = reinterpret_cast<const ActQ8*>(vecs_v[j]);
  __m256 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    __m256i a[J];
    for (int j = 0; j < J; ++j) a[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vecs[j][b].qs));
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(rows[r] + b) + kPrefetchBytes, _MM_HINT_T0);
      const __m256i w = block_bytes(rows[r][b]);
      const float dw = block_scale(rows[r][b]);
      for (int j = 0; j < J; ++j)
        acc[r][j] = _mm256_fmadd_ps(dot32(w, a[j]), _mm256_set1_ps(dw * vecs[j][b].d), acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) out[r * J + j] = hsum(acc[r][j]);
}

// The K super-block types (256 weights, 8 activation blocks each) go one row at a time
// (its J accumulators stay in registers; the activations, a few KiB, are re-read from L1
// for each row), one super-block per `k_block_avx2` call.
//
// Q4_K: the 8 scales sc_j and mins m_j unpacked at once, the mins' terms in one FMA of
// dmin * m_j against the 8 activation blocks' sums s_j (the lanes of an accumulator are
// summed at the end, so the min lanes share it); per sub-block, the 32 nibbles (one load
// serves sub-blocks 2c and 2c+1), maddubs against the activations and madd by sc_j (the
// scale rides the integer pair-sum for free), one conversion and one FMA by d * d_x.
template <int J>
FTJAX_AVX2 inline void k_block_avx2(const BlockQ4_K& w, const ActQ8* const* act, __m256* acc) {
  constexpr int kSub = BlockQ4_K::kSubBlocks;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i s_index = _mm256_setr_epi32(0, 10, 20, 30, 40, 50, 60, 70);  // floats from one ActQ8's s to the next's
  static_assert(sizeof(ActQ8) == 10 * sizeof(float), "ActQ8 stride of s_index");
  alignas(16) uint8_t sc_m[2 * kSub];  // sc_0..7, then m_0..7
  q4_k_unpack_scales(w.scales, sc_m);
  const float d = _cvtsh_ss(w.d);
  const __m256 mins = _mm256_mul_ps(  // dmin * m_j, j = 0..7
      _mm256_set1_ps(_cvtsh_ss(w.dmin)),
      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc_m + kSub)))));
  for (int j = 0; j < J; ++j) acc[j] = _mm256_fnmadd_ps(mins, _mm256_i32gather_ps(&act[j]->s, s_index, 4), acc[j]);
#pragma GCC unroll 8
  for (int s = 0; s < kSub; ++s) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + s / 2 * kQuantBlock));
    const __m256i q = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, low4);
    const __m256i scale = _mm256_set1_epi16(sc_m[s]);
    for (int j = 0; j < J; ++j) {
      // |pair sums| <= 2 * 15 * 127, times sc <= 63, two of them: well inside int32
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act[j][s].qs));
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), scale);
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * act[j][s].d), acc[j]);
    }
  }
}

// Q6_K: per half of a super-block, the 64 bytes of ql and the 32 of qh are loaded once and
// serve its 4 activation blocks (quarters k): the 6-bit levels are assembled in 8-bit
// lanes (16-bit shifts, masks keep each byte's bits), centred to -32..31, multiplied with
// the sign trick of Q8_0, and the 16 pair sums madd-ed by (sc_lo x 8, sc_hi x 8): one
// conversion and one FMA by d * d_x per activation block.
template <int J>
FTJAX_AVX2 inline void k_block_avx2(const BlockQ6_K& w, const ActQ8* const* act, __m256* acc) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
  const float d = _cvtsh_ss(w.d);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.ql + 64 * h));
    const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.ql + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qh + 32 * h));
    const __m256i lows[4] = {_mm256_and_si256(ql0, low4), _mm256_and_si256(ql1, low4),
                             _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                             _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4)};
    const __m256i highs[4] = {_mm256_and_si256(_mm256_slli_epi16(qh, 4), high2),
                              _mm256_and_si256(_mm256_slli_epi16(qh, 2), high2), _mm256_and_si256(qh, high2),
                              _mm256_and_si256(_mm256_srli_epi16(qh, 2), high2)};
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const int s = 4 * h + k;  // activation block
      const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lows[k], highs[k]), bias);
      const __m256i qa = _mm256_sign_epi8(q, q);
      const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(w.scales[2 * s + 1]), _mm_set1_epi16(w.scales[2 * s]));
      for (int j = 0; j < J; ++j) {
        // |pair sums| <= 2 * 32 * 127, times |sc| <= 128, two of them: inside int32
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(act[j][s].qs));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(qa, _mm256_sign_epi8(a, q)), scale);
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * act[j][s].d), acc[j]);
      }
    }
  }
}

// Q4_K or Q6_K as the tag says (a layer's blocks share it: the branch is predicted).
template <int J>
FTJAX_AVX2 inline void k_block_avx2(const BlockQ4_KorQ6_K& w, const ActQ8* const* act, __m256* acc) {
  if (w.tag == BlockQ4_KorQ6_K::kTagQ6_K)
    k_block_avx2<J>(w.q6, act, acc);
  else
    k_block_avx2<J>(w.q4, act, acc);
}

template <typename W, int R, int J>
FTJAX_AVX2 void dot_k_avx2(const void* const* rows_v, const float* const* vecs_v, int64_t n, float* out) {
  static_assert(W::kWeights == 8 * kQuantBlock, "K super-blocks");
  const ActQ8* vecs[J];
  for (int j = 0; j < J; ++j) vecs[j] = reinterpret_cast<const ActQ8*>(vecs_v[j]);
  for (int r = 0; r < R; ++r) {
    const W* row = static_cast<const W*>(rows_v[r]);
    __m256 acc[J];
    for (int j = 0; j < J; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / W::kWeights; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(row + b) + kPrefetchBytes, _MM_HINT_T0);
      if (sizeof(W) > 160)  // Q6_K-wide blocks: a second line ahead
        _mm_prefetch(reinterpret_cast<const char*>(row + b) + kPrefetchBytes + 64, _MM_HINT_T0);
      const ActQ8* act[J];
      for (int j = 0; j < J; ++j) act[j] = vecs[j] + b * 8;
      k_block_avx2<J>(row[b], act, acc);
    }
    for (int j = 0; j < J; ++j) out[r * J + j] = hsum(acc[j]);
  }
}

// FP8 rows against float vectors, one row at a time: per block of 128, 8 steps of 16
// weights (sign-extend to 16 bits, << 7, keep the sign and the 7 value bits: f16 bits
// of e4m3 * 2^-8; two vcvtph2ps), two FMA chains per vector, then one FMA by the block's
// 2^8 * scale into the row's accumulator.
template <typename W, int R, int J>
FTJAX_AVX2 void dot_fp8_avx2(const void* const* rows_v, const float* const* vecs, int64_t n, float* out) {
  static_assert(sizeof(W) == sizeof(BlockFP8), "FP8 rows");
  const __m256i keep = _mm256_set1_epi16(static_cast<int16_t>(0xBF80));  // sign, then e4m3's 7 bits at 13..7
  for (int r = 0; r < R; ++r) {
    const BlockFP8* row = static_cast<const BlockFP8*>(rows_v[r]);
    __m256 acc[J];
    for (int j = 0; j < J; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / BlockFP8::kWeights; ++b) {
      const BlockFP8& w = row[b];
      _mm_prefetch(reinterpret_cast<const char*>(&w) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(&w) + kPrefetchBytes + 64, _MM_HINT_T0);
      __m256 lo[J], hi[J];
      for (int j = 0; j < J; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int s = 0; s < BlockFP8::kWeights / 16; ++s) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + 16 * s));
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7), keep);
        const __m256 w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        const __m256 w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
        for (int j = 0; j < J; ++j) {
          const float* x = vecs[j] + b * BlockFP8::kWeights + 16 * s;
          lo[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), lo[j]);
          hi[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), hi[j]);
        }
      }
      const __m256 scale = _mm256_set1_ps(w.d * 256.f);
      for (int j = 0; j < J; ++j) acc[j] = _mm256_fmadd_ps(_mm256_add_ps(lo[j], hi[j]), scale, acc[j]);
    }
    for (int j = 0; j < J; ++j) out[r * J + j] = hsum(acc[j]);
  }
}

// The R x J kernels of a block type (the gemv entry is filled in by block_table_avx2).
template <typename W>
DotTable avx2_fns() {
  return {FTJAX_FNS(dot_block_avx2, W), nullptr};
}
template <>
DotTable avx2_fns<BlockQ4_K>() {
  return {FTJAX_FNS(dot_k_avx2, BlockQ4_K), nullptr};
}
template <>
DotTable avx2_fns<BlockQ6_K>() {
  return {FTJAX_FNS(dot_k_avx2, BlockQ6_K), nullptr};
}
template <>
DotTable avx2_fns<BlockQ4_KorQ6_K>() {
  return {FTJAX_FNS(dot_k_avx2, BlockQ4_KorQ6_K), nullptr};
}
template <>
DotTable avx2_fns<BlockFP8>() {
  return {FTJAX_FNS(dot_fp8_avx2, BlockFP8), nullptr};
}

template <typename W>
FTJAX_AVX2 void gemv_block_avx2(const void* rows, int64_t row_stride, int64_t num_rows, const float* vec,
                                int64_t n, float* out) {
  static const DotTable t = avx2_fns<W>();
  gemv_rows<W>(t.fn, rows, row_stride, num_rows, vec, n, out);
}

template <typename W>
DotTable avx2_table() {
  DotTable t = avx2_fns<W>();
  t.gemv = &gemv_block_avx2<W>;
  return t;
}

}  // namespace

DotTable block_table_avx2(WeightType w) {
  switch (w) {
    case WeightType::kQ4_0: return avx2_table<BlockQ4_0>();
    case WeightType::kQ4_K: return avx2_table<BlockQ4_K>();
    case WeightType::kQ6_K: return avx2_table<BlockQ6_K>();
    case WeightType::kMXFP4: return avx2_table<BlockMXFP4>();
    case WeightType::kFP8_E4M3: return avx2_table<BlockFP8>();
    case WeightType::kQ4_K_OR_Q6_K: return avx2_table<BlockQ4_KorQ6_K>();
    default: return avx2_table<BlockQ8_0>();
  }
}

}  // namespace ftjax

#else  // not x86: the scalar tables serve every ISA

namespace ftjax {
DotTable block_table_avx2(WeightType w) { return block_table_scalar(w); }
}  // namespace ftjax

#endif
