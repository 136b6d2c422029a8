// AVX-512 (F) micro-kernels: the AVX2 kernels (kernels_avx2.cc) at twice the width,
// for CPUs with full-width 512-bit units (Zen 4/5, Intel server parts). Compiled
// with target attributes, used only when cpu_has_avx512() says yes.
//
// `load32` yields two 16-float weight vectors matching vec[i, i+16) and
// vec[i+16, i+32): f32 is two plain loads; bf16 is one 512-bit load of 32
// weights, `and 0xFFFF0000` for the odd ones and `<< 16` for the even ones, so
// vectors use the even/odd layout with block 32 (kernels.h). Tails (< 32
// elements) are scalar, in plain order.
#include <cstring>

#include "kernels.h"

#if defined(__x86_64__)
// GCC 12's avx512fintrin.h seeds unmasked ops with _mm512_undefined_*(), which
// -Wuninitialized reports at every inlined use (a known false positive).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#define FTJAX_AVX512 __attribute__((target("avx512f,avx2,fma")))

namespace ftjax {
namespace {

constexpr int64_t kStep = 128;            // elements per outer step

FTJAX_AVX512 inline void load32(const float* p, __m512& a, __m512& b) {
  a = _mm512_loadu_ps(p);
  b = _mm512_loadu_ps(p + 16);
}

FTJAX_AVX512 inline void load32(const uint16_t* p, __m512& odd, __m512& even) {
  const __m512i w = _mm512_loadu_si512(p);
  odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

FTJAX_AVX512 inline __m256 fold(__m512 v) {  // 16 lanes -> 8 lanes, same total
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

FTJAX_AVX512 inline float hsum(__m512 v) {
  const __m256 h = fold(v);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane r of the result = horizontal sum of v[r], r < 8.
FTJAX_AVX512 inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <typename W>
FTJAX_AVX512 inline void prefetch_step(const W* row) {
  for (int64_t l = 0; l < kStep; l += 64 / static_cast<int64_t>(sizeof(W)))
    _mm_prefetch(reinterpret_cast<const char*>(row + l) + kPrefetchBytes, _MM_HINT_T0);
}

template <typename W, int R, int J>
FTJAX_AVX512 void dot_avx512(const void* const* rows_v, const float* const* vecs, int64_t n,
                             float* out) {
  // Accumulator sets: >= 8 independent FMA chains in flight, at most 12
  // accumulators (AVX2 has 16 registers); C = 1 adds both halves into one.
  constexpr int C = R * J >= 8 ? 1 : (R * J >= 4 ? 2 : (R * J >= 2 ? 4 : 8));
  const W* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = static_cast<const W*>(rows_v[r]);
  __m512 acc[C][R][J];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) acc[c][r][j] = _mm512_setzero_ps();
  auto step = [&](int64_t i, int c) FTJAX_AVX512 {  // elements [i, i + 32)
    for (int r = 0; r < R; ++r) {
      __m512 wa, wb;
      load32(rows[r] + i, wa, wb);
      for (int j = 0; j < J; ++j) {  // x reloaded from L1: registers go to accumulators
        __m512 xa, xb;
        load32(vecs[j] + i, xa, xb);
        acc[c][r][j] = _mm512_fmadd_ps(wa, xa, acc[c][r][j]);
        acc[(c + 1) % C][r][j] = _mm512_fmadd_ps(wb, xb, acc[(c + 1) % C][r][j]);
      }
    }
  };
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    for (int r = 0; r < R; ++r) prefetch_step(rows[r] + i);
    for (int s = 0; s < kStep / 32; ++s) step(i + 32 * s, (2 * s) % C);
  }
  for (; i + 32 <= n; i += 32) step(i, 0);
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < J; ++j) {
      __m512 a = acc[0][r][j];
      for (int c = 1; c < C; ++c) a = _mm512_add_ps(a, acc[c][r][j]);
      float s = hsum(a);
      for (int64_t t = i; t < n; ++t) s += weight_at(rows[r], t) * vecs[j][t];
      out[r * J + j] = s;
    }
  }
}

// One row against one vector with 8 FMA chains; 8-lane partial sums of the
// vectorised part [0, n / 32 * 32). The rows of a gemv are one sequential stream: the
// hardware prefetchers follow it, and `prefetch` bytes ahead (gemv_prefetch_bytes: on
// Intel, where they alone left a core at 0.8 of its read bandwidth) goes into L2 too.
template <typename W>
FTJAX_AVX512 inline __m256 row_dot(const W* row, const float* vec, int64_t n, int64_t prefetch) {
  __m512 acc[8];
  for (int c = 0; c < 8; ++c) acc[c] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    if (prefetch > 0) prefetch_l2(row + i, kStep * static_cast<int64_t>(sizeof(W)), prefetch);
    for (int s = 0; s < kStep / 32; ++s) {
      __m512 wa, wb, xa, xb;
      load32(row + i + 32 * s, wa, wb);
      load32(vec + i + 32 * s, xa, xb);
      acc[2 * s] = _mm512_fmadd_ps(wa, xa, acc[2 * s]);
      acc[2 * s + 1] = _mm512_fmadd_ps(wb, xb, acc[2 * s + 1]);
    }
  }
  for (; i + 32 <= n; i += 32) {
    __m512 wa, wb, xa, xb;
    load32(row + i, wa, wb);
    load32(vec + i, xa, xb);
    acc[0] = _mm512_fmadd_ps(wa, xa, acc[0]);
    acc[1] = _mm512_fmadd_ps(wb, xb, acc[1]);
  }
  const __m512 s01 = _mm512_add_ps(acc[0], acc[1]), s23 = _mm512_add_ps(acc[2], acc[3]);
  const __m512 s45 = _mm512_add_ps(acc[4], acc[5]), s67 = _mm512_add_ps(acc[6], acc[7]);
  return fold(_mm512_add_ps(_mm512_add_ps(s01, s23), _mm512_add_ps(s45, s67)));
}

template <typename W>
FTJAX_AVX512 void gemv_avx512(const void* rows_v, int64_t row_stride, int64_t num_rows,
                              const float* vec, int64_t n, float* out) {
  const int64_t prefetch = gemv_prefetch_bytes();
  const char* rows = static_cast<const char*>(rows_v);
  const int64_t tail = n / 32 * 32;
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

FTJAX_AVX512 float sum_avx512(const float* data, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(data + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(data + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(data + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(data + i + 48));
  }
  float s = hsum(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  for (; i < n; ++i) s += data[i];
  return s;
}

#define FTJAX_ROW(W, R) \
  { nullptr, &dot_avx512<W, R, 1>, &dot_avx512<W, R, 2>, &dot_avx512<W, R, 3> }
#define FTJAX_TABLE(W)                                                                       \
  DotTable {                                                                                 \
    {{}, FTJAX_ROW(W, 1), FTJAX_ROW(W, 2), FTJAX_ROW(W, 3), FTJAX_ROW(W, 4)}, &gemv_avx512<W> \
  }

}  // namespace

const Kernels* avx512_kernels() {
  // block formats: VNNI's integer dots where the CPU has them (exact: the same outputs)
  static const auto blocks = cpu_has_vnni() ? &block_table_vnni : &block_table_avx2;
  static const Kernels k{FTJAX_TABLE(float), FTJAX_TABLE(uint16_t), blocks(WeightType::kQ8_0),
                         blocks(WeightType::kQ4_0),
                         blocks(WeightType::kQ4_K), blocks(WeightType::kQ6_K),
                         blocks(WeightType::kMXFP4), blocks(WeightType::kFP8_E4M3),
                         blocks(WeightType::kQ4_K_OR_Q6_K), &sum_avx512, 32,
                         /*bf16_act=*/false, /*simd_quantise=*/true};
  return &k;
}

bool cpu_has_vnni() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return has;
}

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
                          __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return has;
}

}  // namespace ftjax

#else  // not x86-64

namespace ftjax {
const Kernels* avx512_kernels() { return nullptr; }
bool cpu_has_avx512() { return false; }
bool cpu_has_vnni() { return false; }
}  // namespace ftjax

#endif
