#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "blocks.h"

#if defined(__x86_64__)
#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC 12 avx512fintrin.h false positives
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define FTJAX_AVX512 __attribute__((target("avx512f,avx2,fma")))
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
// AVX-512 forms for bf16 rows (hd % 32 == 0), in the even/odd layout of kernels_avx512.cc:
// one 512-bit load holds 32 bf16 values; `<< 16` gives the 16 even elements as f32 and
// `and 0xFFFF0000` the 16 odd ones, so the query and the value accumulator are kept
// permuted the same way (per 32-element block: 16 even, then 16 odd) and no widening
// shuffle is needed. `to_even_odd` / `from_even_odd` convert a row.
inline void to_even_odd(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 32)
    for (int l = 0; l < 16; ++l) y[i + l] = x[i + 2 * l], y[i + 16 + l] = x[i + 2 * l + 1];
}
inline void from_even_odd(const float* y, float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 32)
    for (int l = 0; l < 16; ++l) x[i + 2 * l] = y[i + l], x[i + 2 * l + 1] = y[i + 16 + l];
}

FTJAX_AVX512 inline void load_even_odd(const uint16_t* p, __m512& even, __m512& odd) {
  const __m512i w = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// out[j] = q . k[j] for kKeys bf16 rows; q_eo in the even/odd layout.
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

// y_eo += sum_j w[j] v[j] over kKeys bf16 rows; y_eo in the even/odd layout.
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

// Pass 1 over whole groups of kKeys rows of one head's keys (rows from `keys`, this
// head's [S, hd] matrix): scores[q, s - s0]; returns the first row not scored.
template <typename Elem, bool kWide>
__attribute__((always_inline)) inline int64_t score_groups(const Elem* keys, const float* qs, const int32_t* qpos,
                                                           const AttentionArgs& a, int64_t s0, int64_t s1,
                                                           float* scores) {
  const int64_t Q = (a.H / a.G) * a.T, hd = a.hd;
  int64_t s = s0;
  for (; s + kKeys <= s1; s += kKeys) {
    const Elem* k[kKeys];
    for (int j = 0; j < kKeys; ++j) k[j] = keys + (s + j) * hd;
    for (int64_t q = 0; q < Q; ++q) {
      float dots[kKeys];
#if defined(__x86_64__)
      if constexpr (kWide) dot_keys_avx512(qs + q * hd, k, hd, dots);  // qs in the even/odd layout
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
template <typename Elem, bool kWide>
__attribute__((always_inline)) inline int64_t value_groups(const Elem* values, const float* weights,
                                                           const AttentionArgs& a, int64_t s0, int64_t s1, float* acc) {
  const int64_t Q = (a.H / a.G) * a.T, hd = a.hd;
  int64_t s = s0;
  for (; s + kKeys <= s1; s += kKeys) {
    const Elem* v[kKeys];
    for (int j = 0; j < kKeys; ++j) v[j] = values + (s + j) * hd;
    for (int64_t q = 0; q < Q; ++q) {
#if defined(__x86_64__)
      if constexpr (kWide) axpy_keys_avx512(weights + q * kChunk + (s - s0), v, acc + q * hd, hd);  // even/odd acc
      else
#endif
        axpy_keys(weights + q * kChunk + (s - s0), v, acc + q * hd, hd);
    }
  }
  return s;
}

// Task (b, g, chunk c) over a cache of Elem rows (float or bf16 bits): scores, softmax
// within the chunk, weighted values. kAvx512: the caller is compiled for AVX-512 (bf16
// groups then use the even/odd intrinsics when hd % 32 == 0).
template <typename Elem, bool kAvx512>
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
  constexpr bool wide = grouped && kAvx512;
  std::vector<float> qs_eo, acc_eo;  // wide: query and value sums in the even/odd layout
  if (wide && hd % 32 == 0) {
    qs_eo.resize(Q * hd);
    acc_eo.assign(Q * hd, 0.f);
    for (int64_t q = 0; q < Q; ++q) to_even_odd(qs.data() + q * hd, qs_eo.data() + q * hd, hd);
  }
  int64_t s = s0;
  if (!qs_eo.empty()) s = score_groups<Elem, wide>(keys, qs_eo.data(), qpos.data(), a, s0, s1, scores.data());
  else if (grouped && hd % kLanes == 0) s = score_groups<Elem, false>(keys, qs.data(), qpos.data(), a, s0, s1, scores.data());
  for (; s < s1; ++s) {  // pass 1 (rest): every key row read once
    const Elem* k = keys + s * hd;
    for (int64_t q = 0; q < Q; ++q) {
      const bool visible = s <= qpos[q] && (a.window == 0 || s > qpos[q] - a.window);
      scores[q * kChunk + (s - s0)] = visible ? dot(qs.data() + q * hd, k, hd) : kNegInf;
    }
  }
  for (int64_t q = 0; q < Q; ++q) {
    float* sc = scores.data() + q * kChunk;
    float m = kNegInf;
    for (int64_t i = 0; i < s1 - s0; ++i) m = std::max(m, sc[i]);
    float l = 0.f;
    if (m != kNegInf) {
      for (int64_t i = 0; i < s1 - s0; ++i) sc[i] = sc[i] == kNegInf ? 0.f : exp_nonpositive(sc[i] - m);
      for (int64_t i = 0; i < s1 - s0; ++i) l += sc[i];
    } else {
      std::fill(sc, sc + (s1 - s0), 0.f);
    }
    p.m[q] = m;
    p.l[q] = l;
  }
  int64_t sv = s0;
  if (!qs_eo.empty()) {
    sv = value_groups<Elem, wide>(values, scores.data(), a, s0, s1, acc_eo.data());
    for (int64_t q = 0; q < Q; ++q) from_even_odd(acc_eo.data() + q * hd, p.acc + q * hd, hd);
  } else if (grouped && hd % kLanes == 0) {
    sv = value_groups<Elem, false>(values, scores.data(), a, s0, s1, p.acc);  // one acc pass per kKeys rows
  }
  for (int64_t s = sv; s < s1; ++s) {  // pass 2 (rest): every value row read once
    const Elem* v = values + s * hd;
    for (int64_t q = 0; q < Q; ++q) {
      const float w = scores[q * kChunk + (s - s0)];
      if (w != 0.f) axpy(w, v, p.acc + q * hd, hd);
    }
  }
}

template <bool kAvx512>
__attribute__((always_inline)) inline void chunk_task(const AttentionArgs& a, int64_t b, int64_t g, int64_t c,
                                                      const Partial& p) {
  if (a.kv_type == WeightType::kF32) chunk_rows<float, false>(a, b, g, c, p);
  else chunk_rows<uint16_t, kAvx512>(a, b, g, c, p);
}

using TaskFn = void (*)(const AttentionArgs&, int64_t, int64_t, int64_t, const Partial&);

void task_scalar(const AttentionArgs& a, int64_t b, int64_t g, int64_t c, const Partial& p) {
  chunk_task<false>(a, b, g, c, p);
}
#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void task_avx2(const AttentionArgs& a, int64_t b, int64_t g, int64_t c,
                                                     const Partial& p) {
  chunk_task<false>(a, b, g, c, p);
}
FTJAX_AVX512 void task_avx512(const AttentionArgs& a, int64_t b, int64_t g, int64_t c, const Partial& p) {
  chunk_task<true>(a, b, g, c, p);
}
#endif

TaskFn select_task(Isa isa) {
#if defined(__x86_64__)
  const bool avx512 = cpu_has_avx512(), avx2 = cpu_has_avx2_fma();
  switch (isa) {
    case Isa::kAuto: return avx512 ? &task_avx512 : avx2 ? &task_avx2 : &task_scalar;
    case Isa::kAvx512: return avx512 ? &task_avx512 : nullptr;
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
