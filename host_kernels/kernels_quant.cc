// Block-format dot products: Q8_0 / Q4_0 weight rows (kernels.h) against activations
// quantised to ActQ8 blocks. Per block of 32:
//
//     dot += d_w * d_x * sum_i q_w[i] * q_x[i]        (the sum exact in int32)
//
// which is llama.cpp's scheme for these types: the weights never widen to f32, so a
// core does ~4x the weights per cycle of the bf16 path and decode stays bound by the
// bytes read. Two implementations with one result up to float summation order:
//   scalar: plain C++ (the portable fallback and the C++ twin of the numpy reference);
//   AVX2:   32 products per block in 4 integer ops (sign, sign, maddubs, madd), one
//           conversion and one FMA into 8 float lanes; also used by the AVX-512 table
//           (the integer work is 256 bits wide either way).
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
    out[b].d = d;
    for (int i = 0; i < kQuantBlock; ++i) out[b].qs[i] = static_cast<int8_t>(std::nearbyint(v[i] * id));
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

template <typename W, int R, int J>
void dot_block_scalar(const void* const* rows_v, const float* const* vecs_v, int64_t n, float* out) {
  for (int r = 0; r < R; ++r) {
    const W* row = static_cast<const W*>(rows_v[r]);
    for (int j = 0; j < J; ++j) {
      const ActQ8* vec = reinterpret_cast<const ActQ8*>(vecs_v[j]);
      float s = 0.f;
      for (int64_t b = 0; b < n / kQuantBlock; ++b)
        s += half_to_float(row[b].d) * vec[b].d * static_cast<float>(block_sum(row[b], vec[b]));
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

template <typename W>
FTJAX_AVX2 void gemv_block_avx2(const void* rows, int64_t row_stride, int64_t num_rows, const float* vec,
                                int64_t n, float* out) {
  static const DotTable t{FTJAX_FNS(dot_block_avx2, W), nullptr};
  gemv_rows<W>(t.fn, rows, row_stride, num_rows, vec, n, out);
}

}  // namespace

DotTable block_table_avx2(WeightType w) {
  if (w == WeightType::kQ4_0) return {FTJAX_FNS(dot_block_avx2, BlockQ4_0), &gemv_block_avx2<BlockQ4_0>};
  return {FTJAX_FNS(dot_block_avx2, BlockQ8_0), &gemv_block_avx2<BlockQ8_0>};
}

}  // namespace ftjax

#else  // not x86: the scalar tables serve every ISA

namespace ftjax {
DotTable block_table_avx2(WeightType w) { return block_table_scalar(w); }
}  // namespace ftjax

#endif
