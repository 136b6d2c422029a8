// AVX2 + FMA micro-kernels. Compiled with per-function target attributes (no
// -march flag needed) and only called after cpu_has_avx2_fma() says yes.
//
// Every kernel walks 16 elements per step through `load16`, which yields two
// 8-float weight vectors matching vec[i, i+8) and vec[i+8, i+16):
//   f32:  two plain loads;
//   bf16: one 256-bit load of 16 weights; `and 0xFFFF0000` gives the odd ones and
//         `<< 16` the even ones (exact), so vectors use the even/odd layout with
//         block 16 (kernels.h).
// That is 2 integer ops per 16 bf16 weights instead of 2 x (widen + shift).
#include <cstring>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define FTJAX_AVX2 __attribute__((target("avx2,fma")))

namespace ftjax {
namespace {

constexpr int64_t kStep = 64;  // elements per outer step (2 or 4 cache lines of a row)

FTJAX_AVX2 inline void load16(const float* p, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(p);
  b = _mm256_loadu_ps(p + 8);
}

FTJAX_AVX2 inline void load16(const uint16_t* p, __m256& odd, __m256& even) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

FTJAX_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane r of the result = horizontal sum of v[r], r < 8.
FTJAX_AVX2 inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <typename W>
FTJAX_AVX2 inline void prefetch_step(const W* row) {
  for (int64_t l = 0; l < kStep; l += 64 / static_cast<int64_t>(sizeof(W)))
    _mm_prefetch(reinterpret_cast<const char*>(row + l) + kPrefetchBytes, _MM_HINT_T0);
}

// R x J tile of full-length dots (several tokens share each weight load).
template <typename W, int R, int J>
FTJAX_AVX2 void dot_avx2(const void* const* rows_v, const float* const* vecs, int64_t n,
                         float* out) {
  // Accumulator sets: >= 8 independent FMA chains in flight, at most 12
  // accumulators (AVX2 has 16 registers); C = 1 adds both halves into one.
  constexpr int C = R * J >= 8 ? 1 : (R * J >= 4 ? 2 : (R * J >= 2 ? 4 : 8));
  const W* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = static_cast<const W*>(rows_v[r]);
  __m256 acc[C][R][J];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) acc[c][r][j] = _mm256_setzero_ps();
  auto step = [&](int64_t i, int c) FTJAX_AVX2 {  // elements [i, i + 16)
    for (int r = 0; r < R; ++r) {
      __m256 wa, wb;
      load16(rows[r] + i, wa, wb);
      for (int j = 0; j < J; ++j) {  // x reloaded from L1: registers go to accumulators
        __m256 xa, xb;
        load16(vecs[j] + i, xa, xb);
        acc[c][r][j] = _mm256_fmadd_ps(wa, xa, acc[c][r][j]);
        acc[(c + 1) % C][r][j] = _mm256_fmadd_ps(wb, xb, acc[(c + 1) % C][r][j]);
      }
    }
  };
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    for (int r = 0; r < R; ++r) prefetch_step(rows[r] + i);
    for (int s = 0; s < kStep / 16; ++s) step(i + 16 * s, (2 * s) % C);
  }
  for (; i + 16 <= n; i += 16) step(i, 0);
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < J; ++j) {
      __m256 a = acc[0][r][j];
      for (int c = 1; c < C; ++c) a = _mm256_add_ps(a, acc[c][r][j]);
      float s = hsum(a);
      for (int64_t t = i; t < n; ++t) s += weight_at(rows[r], t) * vecs[j][t];
      out[r * J + j] = s;
    }
  }
}

// One row against one vector, 8 FMA chains; returns the 8-lane partial sums of the
// vectorised part, the scalar tail [n / 16 * 16, n) added separately; `prefetch` bytes
// ahead into L2 as kernels_avx512.cc's.
template <typename W>
FTJAX_AVX2 inline __m256 row_dot(const W* row, const float* vec, int64_t n, int64_t prefetch) {
  __m256 acc[8];
  for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    if (prefetch > 0) prefetch_l2(row + i, kStep * static_cast<int64_t>(sizeof(W)), prefetch);
    for (int s = 0; s < kStep / 16; ++s) {
      __m256 wa, wb, xa, xb;
      load16(row + i + 16 * s, wa, wb);
      load16(vec + i + 16 * s, xa, xb);
      acc[2 * s] = _mm256_fmadd_ps(wa, xa, acc[2 * s]);
      acc[2 * s + 1] = _mm256_fmadd_ps(wb, xb, acc[2 * s + 1]);
    }
  }
  for (; i + 16 <= n; i += 16) {
    __m256 wa, wb, xa, xb;
    load16(row + i, wa, wb);
    load16(vec + i, xa, xb);
    acc[0] = _mm256_fmadd_ps(wa, xa, acc[0]);
    acc[1] = _mm256_fmadd_ps(wb, xb, acc[1]);
  }
  const __m256 s01 = _mm256_add_ps(acc[0], acc[1]), s23 = _mm256_add_ps(acc[2], acc[3]);
  const __m256 s45 = _mm256_add_ps(acc[4], acc[5]), s67 = _mm256_add_ps(acc[6], acc[7]);
  return _mm256_add_ps(_mm256_add_ps(s01, s23), _mm256_add_ps(s45, s67));
}

// Consecutive rows against one vector (decode): a single sequential stream, and
// the horizontal sums of 8 rows share one transpose-add.
template <typename W>
FTJAX_AVX2 void gemv_avx2(const void* rows_v, int64_t row_stride, int64_t num_rows,
                          const float* vec, int64_t n, float* out) {
  const int64_t prefetch = gemv_prefetch_bytes();
  const char* rows = static_cast<const char*>(rows_v);
  const int64_t tail = n / 16 * 16;
  for (int64_t r0 = 0; r0 < num_rows; r0 += 8) {
    const int nr = static_cast<int>(num_rows - r0 < 8 ? num_rows - r0 : 8);
    __m256 partial[8];
    for (int r = 0; r < 8; ++r)
      partial[r] = r < nr ? row_dot(reinterpret_cast<const W*>(rows + (r0 + r) * row_stride), vec, n, prefetch)
                           : _mm256_setzero_ps();
    float sums[8];
    _mm256_storeu_ps(sums, hsum8(partial));
    for (int r = 0; r < nr; ++r) {
      const W* row = reinterpret_cast<const W*>(rows + (r0 + r) * row_stride);
      for (int64_t t = tail; t < n; ++t) sums[r] += weight_at(row, t) * vec[t];
      out[r0 + r] = sums[r];
    }
  }
}

FTJAX_AVX2 float sum_avx2(const float* data, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(data + i));
    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(data + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_loadu_ps(data + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_loadu_ps(data + i + 24));
  }
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s += data[i];
  return s;
}

#define FTJAX_ROW(W, R) \
  { nullptr, &dot_avx2<W, R, 1>, &dot_avx2<W, R, 2>, &dot_avx2<W, R, 3> }
#define FTJAX_TABLE(W)                                                                   \
  DotTable {                                                                             \
    {{}, FTJAX_ROW(W, 1), FTJAX_ROW(W, 2), FTJAX_ROW(W, 3), FTJAX_ROW(W, 4)}, &gemv_avx2<W> \
  }

}  // namespace

const Kernels* avx2_kernels() {
  static const Kernels k{FTJAX_TABLE(float), FTJAX_TABLE(uint16_t), block_table_avx2(WeightType::kQ8_0),
                         block_table_avx2(WeightType::kQ4_0),
                         block_table_avx2(WeightType::kQ4_K), block_table_avx2(WeightType::kQ6_K),
                         block_table_avx2(WeightType::kMXFP4), block_table_avx2(WeightType::kFP8_E4M3),
                         block_table_avx2(WeightType::kQ4_K_OR_Q6_K), &sum_avx2, 16,
                         /*bf16_act=*/false, /*simd_quantise=*/true};
  return &k;
}

bool cpu_has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}

}  // namespace ftjax

#else  // not x86

namespace ftjax {
const Kernels* avx2_kernels() { return nullptr; }
bool cpu_has_avx2_fma() { return false; }
}  // namespace ftjax

#endif
