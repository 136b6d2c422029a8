// Block-format dot products: Q8_0 / Q4_0 / Q4_K weight rows (kernels.h) against
// activations quantised to ActQ8 blocks of 32. Per Q8_0 / Q4_0 block:
//
//     dot += d_w * d_x * sum_i q_w[i] * q_x[i]        (the sum exact in int32)
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

// One weight block against its activation blocks (W::kWeights / 32 of them).
template <typename W>
inline float block_dot(const W& w, const ActQ8* a) {
  return half_to_float(w.d) * a->d * static_cast<float>(block_sum(w, *a));
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

template <typename W>
void gemv_block_scalar(const void* rows, int64_t row_stride, int64_t num_rows, const float* vec, int64_t n,
                       float* out) {
  static const DotTable t{FTJAX_FNS(dot_block_scalar, W), nullptr};
  gemv_rows<W>(t.fn, rows, row_stride, num_rows, vec, n, out);
}

}  // namespace

DotTable block_table_scalar(WeightType w) {
  if (w == WeightType::kQ4_0) return {FTJAX_FNS(dot_block_scalar, BlockQ4_0), &gemv_block_scalar<BlockQ4_0>};
  if (w == WeightType::kQ4_K) return {FTJAX_FNS(dot_block_scalar, BlockQ4_K), &gemv_block_scalar<BlockQ4_K>};
  return {FTJAX_FNS(dot_block_scalar, BlockQ8_0), &gemv_block_scalar<BlockQ8_0>};
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
      const float dw = _cvtsh_ss(rows[r][b].d);
      for (int j = 0; j < J; ++j)
        acc[r][j] = _mm256_fmadd_ps(dot32(w, a[j]), _mm256_set1_ps(dw * vecs[j][b].d), acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) out[r * J + j] = hsum(acc[r][j]);
}

// Q4_K, one row at a time (its J accumulators stay in registers; the activations, a few
// KiB, are re-read from L1 for each row): per super-block, the 8 scales sc_j and mins
// m_j unpacked at once, the mins' terms in one FMA of dmin * m_j against the 8
// activation blocks' sums s_j (the lanes of an accumulator are summed at the end, so
// the min lanes share it); per sub-block, the 32 nibbles (one load serves sub-blocks 2c
// and 2c+1), maddubs against the activations and madd by sc_j (the scale rides the
// integer pair-sum for free), one conversion and one FMA by d * d_x.
template <typename W, int R, int J>
FTJAX_AVX2 void dot_q4_k_avx2(const void* const* rows_v, const float* const* vecs_v, int64_t n, float* out) {
  static_assert(sizeof(W) == sizeof(BlockQ4_K), "Q4_K rows");
  constexpr int kSub = BlockQ4_K::kSubBlocks;
  const ActQ8* vecs[J];
  for (int j = 0; j < J; ++j) vecs[j] = reinterpret_cast<const ActQ8*>(vecs_v[j]);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i s_index = _mm256_setr_epi32(0, 10, 20, 30, 40, 50, 60, 70);  // floats from one ActQ8's s to the next's
  static_assert(sizeof(ActQ8) == 10 * sizeof(float), "ActQ8 stride of s_index");
  for (int r = 0; r < R; ++r) {
    const BlockQ4_K* row = static_cast<const BlockQ4_K*>(rows_v[r]);
    __m256 acc[J];
    for (int j = 0; j < J; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / BlockQ4_K::kWeights; ++b) {
      const BlockQ4_K& w = row[b];
      _mm_prefetch(reinterpret_cast<const char*>(&w) + kPrefetchBytes, _MM_HINT_T0);
      alignas(16) uint8_t sc_m[2 * kSub];  // sc_0..7, then m_0..7
      q4_k_unpack_scales(w.scales, sc_m);
      const float d = _cvtsh_ss(w.d);
      const __m256 mins = _mm256_mul_ps(  // dmin * m_j, j = 0..7
          _mm256_set1_ps(_cvtsh_ss(w.dmin)),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc_m + kSub)))));
      const ActQ8* act[J];
      for (int j = 0; j < J; ++j) {
        act[j] = vecs[j] + b * kSub;
        acc[j] = _mm256_fnmadd_ps(mins, _mm256_i32gather_ps(&act[j]->s, s_index, 4), acc[j]);
      }
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
  return {FTJAX_FNS(dot_q4_k_avx2, BlockQ4_K), nullptr};
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
  if (w == WeightType::kQ4_0) return avx2_table<BlockQ4_0>();
  if (w == WeightType::kQ4_K) return avx2_table<BlockQ4_K>();
  return avx2_table<BlockQ8_0>();
}

}  // namespace ftjax

#else  // not x86: the scalar tables serve every ISA

namespace ftjax {
DotTable block_table_avx2(WeightType w) { return block_table_scalar(w); }
}  // namespace ftjax

#endif
