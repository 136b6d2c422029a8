#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "blocks.h"

#if defined(__x86_64__)
#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC 12 avx512fintrin.h false positives
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define FTJAX_AVX512 __attribute__((target("avx512f,avx2,fma")))
#define FTJAX_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace ftjax {
namespace {

constexpr int64_t kChunk = 512;  // keys per task
constexpr int kLanes = 16;       // independent partial sums: vectorisable without fast-math
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Partial {  // one task's result for its Q = r*T queries
  float* m;       // [Q] max score (-inf: no visible key)
  float* l;       // [Q] sum of exp(score - m)
  float* acc;     // [Q, hd] sum of exp(score - m) * v
};

constexpr int kKeys = 8;  // bf16 rows scored / added together
constexpr int kPrefetchGroups = 2;  // groups of rows ahead that are requested early
// Asks for the cache lines of n elements at p (a hint: past the end it reads nothing). One
// thread's demand misses alone leave DRAM idle part of the time (measured: 9 GB/s
// against the 19 GB/s of a plain stream).
template <typename Elem>
__attribute__((always_inline)) inline void prefetch_rows(const Elem* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(Elem)); b += 64) __builtin_prefetch(c + b, 0, 0);
}
// Which SIMD forms a task may use for bf16 rows (the ISA its caller was compiled for).
constexpr int kPlain = 0, kSimd256 = 1, kSimd512 = 2;

// Element i of a cache row as f32: f32 as is, bf16 bits widened in registers (no copy).
__attribute__((always_inline)) inline float elem(const float* row, int64_t i) { return row[i]; }
__attribute__((always_inline)) inline float elem(const uint16_t* row, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(row[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename Elem>
__attribute__((always_inline)) inline float dot(const float* a, const Elem* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * elem(b, i + l);
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  for (; i < n; ++i) s += a[i] * elem(b, i);
  return s;
}

// q . k[j] for kKeys rows at once (n a multiple of kLanes): kKeys independent accumulator
// vectors keep the FMA units busy instead of one dependent chain, and each row's lanes are
// summed by a tree (log2 kLanes vector adds) instead of kLanes dependent scalar adds.
template <typename Elem>
__attribute__((always_inline)) inline void dot_keys(const float* q, const Elem* const* k, int64_t n, float* out) {
  float acc[kKeys][kLanes] = {};
  for (int64_t i = 0; i < n; i += kLanes)
    for (int j = 0; j < kKeys; ++j)
      for (int l = 0; l < kLanes; ++l) acc[j][l] += q[i + l] * elem(k[j], i + l);
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < kKeys; ++j)
      for (int l = 0; l < w; ++l) acc[j][l] += acc[j][l + w];
  for (int j = 0; j < kKeys; ++j) out[j] = acc[j][0];
}

// y += sum_j w[j] v[j] over kKeys rows (n a multiple of kLanes), y loaded and stored once.
template <typename Elem>
__attribute__((always_inline)) inline void axpy_keys(const float* w, const Elem* const* v, float* __restrict y,
                                                     int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    float t[kLanes];
    for (int l = 0; l < kLanes; ++l) t[l] = y[i + l];
    for (int j = 0; j < kKeys; ++j)
      for (int l = 0; l < kLanes; ++l) t[l] += w[j] * elem(v[j], i + l);
    for (int l = 0; l < kLanes; ++l) y[i + l] = t[l];
  }
}

template <typename Elem>
__attribute__((always_inline)) inline void axpy(float w, const Elem* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += w * elem(x, i);
}

#if defined(__x86_64__)
// SIMD forms for bf16 rows in the even/odd layout of kernels_avx512.cc, at two widths:
// one load holds kBlock bf16 values (32 for AVX-512, 16 for AVX2); `<< 16` gives the
// kBlock / 2 even elements as f32 and `and 0xFFFF0000` the odd ones, so the query and the
// value accumulator are kept permuted the same way (per kBlock-element block: the even
// elements, then the odd ones) and no widening shuffle is needed. `to_even_odd` /
// `from_even_odd` convert a row (hd % kBlock == 0).
template <int kBlock>
inline void to_even_odd(const float* x, float* y, int64_t n) {
  constexpr int h = kBlock / 2;
  for (int64_t i = 0; i < n; i += kBlock)
    for (int l = 0; l < h; ++l) y[i + l] = x[i + 2 * l], y[i + h + l] = x[i + 2 * l + 1];
}
template <int kBlock>
inline void from_even_odd(const float* y, float* x, int64_t n) {
  constexpr int h = kBlock / 2;
  for (int64_t i = 0; i < n; i += kBlock)
    for (int l = 0; l < h; ++l) x[i + 2 * l] = y[i + l], x[i + 2 * l + 1] = y[i + h + l];
}

FTJAX_AVX512 inline void load_even_odd(const uint16_t* p, __m512& even, __m512& odd) {
  const __m512i w = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// out[j] = q . k[j] for kKeys bf16 rows; q_eo in the even/odd layout (block 32).
FTJAX_AVX512 inline void dot_keys_avx512(const float* q_eo, const uint16_t* const* k, int64_t n, float* out) {
  __m512 acc[kKeys];
  for (int j = 0; j < kKeys; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 32) {
    const __m512 qe = _mm512_loadu_ps(q_eo + i), qo = _mm512_loadu_ps(q_eo + i + 16);
    for (int j = 0; j < kKeys; ++j) {
      __m512 e, o;
      load_even_odd(k[j] + i, e, o);
      acc[j] = _mm512_fmadd_ps(qe, e, _mm512_fmadd_ps(qo, o, acc[j]));
    }
  }
  for (int j = 0; j < kKeys; ++j) out[j] = _mm512_reduce_add_ps(acc[j]);
}

// y_eo += sum_j w[j] v[j] over kKeys bf16 rows; y_eo in the even/odd layout (block 32).
FTJAX_AVX512 inline void axpy_keys_avx512(const float* w, const uint16_t* const* v, float* y_eo, int64_t n) {
  __m512 wj[kKeys];
  for (int j = 0; j < kKeys; ++j) wj[j] = _mm512_set1_ps(w[j]);
  for (int64_t i = 0; i < n; i += 32) {
    __m512 ye = _mm512_loadu_ps(y_eo + i), yo = _mm512_loadu_ps(y_eo + i + 16);
    for (int j = 0; j < kKeys; ++j) {
      __m512 e, o;
      load_even_odd(v[j] + i, e, o);
      ye = _mm512_fmadd_ps(wj[j], e, ye);
      yo = _mm512_fmadd_ps(wj[j], o, yo);
    }
    _mm512_storeu_ps(y_eo + i, ye);
    _mm512_storeu_ps(y_eo + i + 16, yo);
  }
}

FTJAX_AVX2 inline void load_even_odd(const uint16_t* p, __m256& even, __m256& odd) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The AVX2 twins (block 16). kKeys = 8 accumulators + the query pair + one row's pair fill
// 12 of the 16 ymm registers; the 8 row sums are reduced together by a hadd tree.
FTJAX_AVX2 inline void dot_keys_avx2(const float* q_eo, const uint16_t* const* k, int64_t n, float* out) {
  static_assert(kKeys == 8, "the reduction below sums 8 rows");
  __m256 acc[kKeys];
  for (int j = 0; j < kKeys; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m256 qe = _mm256_loadu_ps(q_eo + i), qo = _mm256_loadu_ps(q_eo + i + 8);
    for (int j = 0; j < kKeys; ++j) {
      __m256 e, o;
      load_even_odd(k[j] + i, e, o);
      acc[j] = _mm256_fmadd_ps(qe, e, _mm256_fmadd_ps(qo, o, acc[j]));
    }
  }
  const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
}

FTJAX_AVX2 inline void axpy_keys_avx2(const float* w, const uint16_t* const* v, float* y_eo, int64_t n) {
  __m256 wj[kKeys];
  for (int j = 0; j < kKeys; ++j) wj[j] = _mm256_set1_ps(w[j]);
  for (int64_t i = 0; i < n; i += 16) {
    __m256 ye = _mm256_loadu_ps(y_eo + i), yo = _mm256_loadu_ps(y_eo + i + 8);
    for (int j = 0; j < kKeys; ++j) {
      __m256 e, o;
      load_even_odd(v[j] + i, e, o);
      ye = _mm256_fmadd_ps(wj[j], e, ye);
      yo = _mm256_fmadd_ps(wj[j], o, yo);
    }
    _mm256_storeu_ps(y_eo + i, ye);
    _mm256_storeu_ps(y_eo + i + 8, yo);
  }
}
#endif

// exp(x) for x <= 0 (scores minus their maximum), vectorisable: x = n ln2 + f with n an
// integer and |f| <= ln2 / 2 (ln2 split in two constants so the reduction is exact
// enough), e^f by its degree-7 Taylor polynomial (truncation below 1e-8), 2^n by
// building the exponent bits. Below -87 the result is 0.
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  const float t = x * 1.44269504f;
  const float n = std::floor(t + 0.5f);
  const float f = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // Cody-Waite: ln2 in two parts
  const float p = 1.f + f * (1.f + f * (0.5f + f * (1.f / 6 + f * (1.f / 24 + f * (1.f / 120 + f * (1.f / 720 + f * (1.f / 5040)))))));
  const int32_t e = static_cast<int32_t>(std::max(n, -126.f)) + 127;
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? 0.f : p * scale;
}

#if defined(__x86_64__)
// exp_nonpositive on 8 lanes (the same reduction and polynomial; FMAs round once where the
// scalar form rounds twice). Lanes below -87, -inf included, give 0.
FTJAX_AVX2 inline __m256 exp_nonpositive_avx2(__m256 x) {
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), _mm256_set1_ps(0.5f)));
  const __m256 f = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
  const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(_mm256_max_ps(n, _mm256_set1_ps(-126.f))), _mm256_set1_epi32(127));
  const __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
  return _mm256_and_ps(r, _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ));
}

// sc[i] = exp(sc[i] - m) over whole groups of 8, their sum added to l; returns the first i
// not done.
FTJAX_AVX2 inline int64_t exp_sum_avx2(float* sc, int64_t n, float m, float& l) {
  __m256 sum = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 w = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(sc + i), mv));
    _mm256_storeu_ps(sc + i, w);
    sum = _mm256_add_ps(sum, w);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  for (const float v : lanes) l += v;
  return i;
}
#endif

// One query's chunk of n scores (-inf: not visible) -> its softmax weights exp(score - m)
// in place, m their maximum and l their sum (m = -inf, weights 0: no visible key).
template <int kLevel>
__attribute__((always_inline)) inline void softmax_weights(float* sc, int64_t n, float& m_out, float& l_out) {
  float m = kNegInf, l = 0.f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, sc[i]);
  int64_t i = 0;
  if (m == kNegInf) {
    std::fill(sc, sc + n, 0.f);
    i = n;
  }
#if defined(__x86_64__)
  else if constexpr (kLevel != kPlain) i = exp_sum_avx2(sc, n, m, l);  // exp is most of the work here
#endif
  for (; i < n; ++i) {
    sc[i] = sc[i] == kNegInf ? 0.f : exp_nonpositive(sc[i] - m);
    l += sc[i];
  }
  m_out = m;
  l_out = l;
}

// Pass 1 over whole groups of kKeys rows of one head's keys (rows from `keys`, this
// head's [S, hd] matrix): scores[q, s - s0]; returns the first row not scored.
template <typename Elem, int kLevel>
__attribute__((always_inline)) inline int64_t score_groups(const Elem* keys, const float* qs, const int32_t* qpos,
                                                           const AttentionArgs& a, int64_t s0, int64_t s1,
                                                           float* scores) {
  const int64_t Q = (a.H / a.G) * a.T, hd = a.hd;
  int64_t s = s0;
  for (; s + kKeys <= s1; s += kKeys) {
    const Elem* k[kKeys];
    for (int j = 0; j < kKeys; ++j) k[j] = keys + (s + j) * hd;
    prefetch_rows(keys + (s + kPrefetchGroups * kKeys) * hd, kKeys * hd);
    for (int64_t q = 0; q < Q; ++q) {
      float dots[kKeys];
#if defined(__x86_64__)
      if constexpr (kLevel == kSimd512) dot_keys_avx512(qs + q * hd, k, hd, dots);  // qs in the even/odd layout
      else if constexpr (kLevel == kSimd256) dot_keys_avx2(qs + q * hd, k, hd, dots);
      else
#endif
        dot_keys(qs + q * hd, k, hd, dots);
      for (int j = 0; j < kKeys; ++j) {
        const int64_t key = s + j;
        const bool visible = key <= qpos[q] && (a.window == 0 || key > qpos[q] - a.window);
        scores[q * kChunk + (key - s0)] = visible ? dots[j] : kNegInf;
      }
    }
  }
  return s;
}

// Pass 2 over whole groups of kKeys value rows: acc[q] += sum_s w[q, s] v[s]; returns the
// first row not added.
template <typename Elem, int kLevel>
__attribute__((always_inline)) inline int64_t value_groups(const Elem* values, const float* weights,
                                                           const AttentionArgs& a, int64_t s0, int64_t s1, float* acc) {
  const int64_t Q = (a.H / a.G) * a.T, hd = a.hd;
  int64_t s = s0;
  for (; s + kKeys <= s1; s += kKeys) {
    const Elem* v[kKeys];
    for (int j = 0; j < kKeys; ++j) v[j] = values + (s + j) * hd;
    prefetch_rows(values + (s + kPrefetchGroups * kKeys) * hd, kKeys * hd);
    for (int64_t q = 0; q < Q; ++q) {
#if defined(__x86_64__)
      if constexpr (kLevel == kSimd512) axpy_keys_avx512(weights + q * kChunk + (s - s0), v, acc + q * hd, hd);  // even/odd acc
      else if constexpr (kLevel == kSimd256) axpy_keys_avx2(weights + q * kChunk + (s - s0), v, acc + q * hd, hd);
      else
#endif
        axpy_keys(weights + q * kChunk + (s - s0), v, acc + q * hd, hd);
    }
  }
  return s;
}

// Task (b, g, chunk c) over a cache of Elem rows (float or bf16 bits): scores, softmax
// within the chunk, weighted values. kLevel: the ISA the caller is compiled for (bf16
// groups then use that width's even/odd intrinsics when hd is a multiple of its block).
template <typename Elem, int kLevel>
__attribute__((always_inline)) inline void chunk_rows(const AttentionArgs& a, int64_t b, int64_t g, int64_t c,
                                                      const Partial& p) {
  const int64_t r = a.H / a.G, T = a.T, Q = r * T, hd = a.hd;
  const int64_t s0 = c * kChunk, s1 = std::min<int64_t>((c + 1) * kChunk, a.kv_len[b]);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<float> qs(Q * hd), scores(Q * kChunk);
  std::vector<int32_t> qpos(Q);
  for (int64_t j = 0; j < r; ++j)
    for (int64_t t = 0; t < T; ++t) {
      const float* src = a.q + ((b * T + t) * a.H + g * r + j) * hd;
      for (int64_t i = 0; i < hd; ++i) qs[(j * T + t) * hd + i] = src[i] * scale;
      qpos[j * T + t] = a.positions[b * T + t];
    }
  for (int64_t q = 0; q < Q; ++q) {
    p.m[q] = kNegInf;
    p.l[q] = 0.f;
    std::fill(p.acc + q * hd, p.acc + (q + 1) * hd, 0.f);
  }
  if (s1 <= s0) return;
  const int64_t head = b * a.G + g;  // this (b, g)'s [S, hd] matrices
  const Elem* keys = static_cast<const Elem*>(a.k) + head * a.S * hd;
  const Elem* values = static_cast<const Elem*>(a.v) + head * a.S * hd;
  // bf16: kKeys rows at a time (independent dot products in flight); f32 rows stream
  // fastest one at a time (measured: 21 vs 24-26 ms at 32k keys)
  constexpr bool grouped = std::is_same_v<Elem, uint16_t>;
  constexpr int level = grouped ? kLevel : kPlain;
  constexpr int block = level == kSimd512 ? 32 : 16;
  std::vector<float> qs_eo, acc_eo;  // SIMD: query and value sums in the even/odd layout
  if (level != kPlain && hd % block == 0) {
    qs_eo.resize(Q * hd);
    acc_eo.assign(Q * hd, 0.f);
    for (int64_t q = 0; q < Q; ++q) to_even_odd<block>(qs.data() + q * hd, qs_eo.data() + q * hd, hd);
  }
  int64_t s = s0;
  if (!qs_eo.empty()) s = score_groups<Elem, level>(keys, qs_eo.data(), qpos.data(), a, s0, s1, scores.data());
  else if (grouped && hd % kLanes == 0) s = score_groups<Elem, kPlain>(keys, qs.data(), qpos.data(), a, s0, s1, scores.data());
  for (; s < s1; ++s) {  // pass 1 (rest): every key row read once
    const Elem* k = keys + s * hd;
    for (int64_t q = 0; q < Q; ++q) {
      const bool visible = s <= qpos[q] && (a.window == 0 || s > qpos[q] - a.window);
      scores[q * kChunk + (s - s0)] = visible ? dot(qs.data() + q * hd, k, hd) : kNegInf;
    }
  }
  for (int64_t q = 0; q < Q; ++q) softmax_weights<kLevel>(scores.data() + q * kChunk, s1 - s0, p.m[q], p.l[q]);
  int64_t sv = s0;
  if (!qs_eo.empty()) {
    sv = value_groups<Elem, level>(values, scores.data(), a, s0, s1, acc_eo.data());
    for (int64_t q = 0; q < Q; ++q) from_even_odd<block>(acc_eo.data() + q * hd, p.acc + q * hd, hd);
  } else if (grouped && hd % kLanes == 0) {
    sv = value_groups<Elem, kPlain>(values, scores.data(), a, s0, s1, p.acc);  // one acc pass per kKeys rows
  }
  for (int64_t s = sv; s < s1; ++s) {  // pass 2 (rest): every value row read once
    const Elem* v = values + s * hd;
    for (int64_t q = 0; q < Q; ++q) {
      const float w = scores[q * kChunk + (s - s0)];
      if (w != 0.f) axpy(w, v, p.acc + q * hd, hd);
    }
  }
}

template <int kLevel>
__attribute__((always_inline)) inline void chunk_task(const AttentionArgs& a, int64_t b, int64_t g, int64_t c,
                                                      const Partial& p) {
  if (a.kv_type == WeightType::kF32) chunk_rows<float, kLevel>(a, b, g, c, p);
  else chunk_rows<uint16_t, kLevel>(a, b, g, c, p);
}

using TaskFn = void (*)(const AttentionArgs&, int64_t, int64_t, int64_t, const Partial&);

void task_scalar(const AttentionArgs& a, int64_t b, int64_t g, int64_t c, const Partial& p) {
  chunk_task<kPlain>(a, b, g, c, p);
}
#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void task_avx2(const AttentionArgs& a, int64_t b, int64_t g, int64_t c,
                                                     const Partial& p) {
  chunk_task<kSimd256>(a, b, g, c, p);
}
FTJAX_AVX512 void task_avx512(const AttentionArgs& a, int64_t b, int64_t g, int64_t c, const Partial& p) {
  chunk_task<kSimd512>(a, b, g, c, p);
}
#endif

TaskFn select_task(Isa isa) {
#if defined(__x86_64__)
  const bool avx512 = cpu_has_avx512(), avx2 = cpu_has_avx2_fma();
  switch (isa) {
    case Isa::kAmxBf16:  // decode keeps the exact kernels (prompts: attention_takes_tiles)
    case Isa::kAvx512Bf16Tiles:
      if (!tiles_granted(isa)) return nullptr;
      [[fallthrough]];
    case Isa::kAuto: return avx512 ? &task_avx512 : avx2 ? &task_avx2 : &task_scalar;
    case Isa::kAvx512: return avx512 ? &task_avx512 : nullptr;
    case Isa::kAvx512Bf16: return cpu_has_avx512_bf16() ? &task_avx512 : nullptr;  // K / V stay f32 math
    case Isa::kAvx2: return avx2 ? &task_avx2 : nullptr;
    default: return &task_scalar;
  }
#else
  return isa == Isa::kAuto || isa == Isa::kScalar ? &task_scalar : nullptr;
#endif
}

}  // namespace

std::string attention(const AttentionArgs& a, ThreadPool* threads, Isa isa) {
  if (a.G <= 0 || a.H % a.G != 0) return "H must be a multiple of G";
  if (a.B < 0 || a.T <= 0 || a.S < 0 || a.hd <= 0 || a.window < 0) return "bad shape";
  const TaskFn task = select_task(isa);
  if (task == nullptr) return "requested ISA is not available on this CPU";
  int64_t max_len = 0;
  for (int64_t b = 0; b < a.B; ++b) {
    if (a.kv_len[b] < 0 || a.kv_len[b] > a.S) return "kv_len must be in 0..S";
    max_len = std::max<int64_t>(max_len, a.kv_len[b]);
  }
  if (attention_takes_tiles(isa, a.T, a.hd)) return attention_tiles(a, threads, isa);
  const int64_t r = a.H / a.G, Q = r * a.T, hd = a.hd;
  const int64_t chunks = std::max<int64_t>(1, ceil_div(max_len, kChunk));
  const int64_t tasks = a.B * a.G * chunks;
  std::vector<float> m(tasks * Q), l(tasks * Q), acc(tasks * Q * hd);
  parallel_for(threads, tasks, [&](int64_t i) {
    const int64_t c = i % chunks, bg = i / chunks;
    task(a, bg / a.G, bg % a.G, c, Partial{m.data() + i * Q, l.data() + i * Q, acc.data() + i * Q * hd});
  });
  // merge the chunks of each (b, g) with their maxima
  for (int64_t bg = 0; bg < a.B * a.G; ++bg) {
    const int64_t b = bg / a.G, g = bg % a.G;
    for (int64_t q = 0; q < Q; ++q) {
      float mmax = kNegInf;
      for (int64_t c = 0; c < chunks; ++c) mmax = std::max(mmax, m[(bg * chunks + c) * Q + q]);
      const int64_t j = q / a.T, t = q % a.T;
      float* out = a.out + ((b * a.T + t) * a.H + g * r + j) * hd;
      std::fill(out, out + hd, 0.f);
      if (mmax == kNegInf) continue;  // no visible key (a padding row): zeros
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t k = (bg * chunks + c) * Q + q;
        if (m[k] == kNegInf) continue;
        const float w = std::exp(m[k] - mmax);
        total += w * l[k];
        axpy(w, acc.data() + k * hd, out, hd);
      }
      for (int64_t i = 0; i < hd; ++i) out[i] /= total;
    }
  }
  return "";
}

}  // namespace ftjax
