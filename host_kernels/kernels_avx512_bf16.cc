// AVX-512 with the BF16 and VNNI extensions (Zen 4/5, Cooper Lake, Sapphire Rapids and
// later): bf16 weight rows meet bf16 activations in `vdpbf16ps`, which multiplies 32
// bf16 pairs and adds each adjacent pair's products into 16 float lanes:
//
//     acc[l] += w[2l] * x[2l] + w[2l+1] * x[2l+1]        (products exact, f32 sums)
//
// One instruction per 32 weights per token, against the AVX-512 F table's two FMAs after
// two integer ops to widen the weights: prefill, which is bound by arithmetic, gets up to
// twice the weights per cycle (measured 1.4-1.6x on the expert kernel, Zen 4). The price
// is the activations rounded to bf16 (to nearest even, once per call:
// `prepare_activations`), as llama.cpp's bf16 path does: logits move ~1% from
// transformers' float32 forward, against 1e-5 otherwise, so this table is used only when
// asked for (Isa::kAvx512Bf16; `FTJAX_ISA=avx512_bf16`), never by kAuto. Decode (one
// token) takes the same path, so a token's result does not depend on how many tokens
// share its call. The block formats take the VNNI integer dots of kernels_quant.cc, as
// the AVX-512 F table does on a CPU with VNNI.
//
// Activations in plain order (no even/odd reorder: the pairs are adjacent), as uint16 bf16
// bits through the tables' `const float*` vector pointers. Tails (n % 32) are scalar.
// numpy reference: ftjax.host.reference_linear / reference_expert_ffn with the activations
// rounded as here (host.rounds_activations_to_bf16).
#include <cstring>

#include "kernels.h"

#if defined(__x86_64__)
#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC 12's avx512 intrinsics, see kernels_avx512.cc
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#define FTJAX_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

namespace ftjax {
namespace {

constexpr int64_t kStep = 128;  // elements per outer step (prefetch granularity)

FTJAX_AVX512_BF16 inline __m512bh load_bf16x32(const uint16_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

FTJAX_AVX512_BF16 inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

// out[r * J + j] = rows[r] . vecs[j] over n elements, rows and vecs bf16 bits. C copies of
// the R x J accumulators keep >= 8 dot-product chains in flight.
template <int R, int J>
FTJAX_AVX512_BF16 void dot_bf16dp(const void* const* rows_v, const float* const* vecs_v, int64_t n,
                                  float* out) {
  constexpr int C = R * J >= 8 ? 1 : (R * J >= 4 ? 2 : (R * J >= 2 ? 4 : 8));
  const uint16_t* rows[R];
  const uint16_t* vecs[J];
  for (int r = 0; r < R; ++r) rows[r] = static_cast<const uint16_t*>(rows_v[r]);
  for (int j = 0; j < J; ++j) vecs[j] = reinterpret_cast<const uint16_t*>(vecs_v[j]);
  __m512 acc[C][R][J];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) acc[c][r][j] = _mm512_setzero_ps();
  auto step = [&](int64_t i, int c) FTJAX_AVX512_BF16 {  // elements [i, i + 32)
    __m512bh x[J];
    for (int j = 0; j < J; ++j) x[j] = load_bf16x32(vecs[j] + i);
    for (int r = 0; r < R; ++r) {
      const __m512bh w = load_bf16x32(rows[r] + i);
      for (int j = 0; j < J; ++j) acc[c][r][j] = _mm512_dpbf16_ps(acc[c][r][j], w, x[j]);
    }
  };
  // Tiles prefetch their R rows; decode (one row, one vector) is one sequential stream left
  // to the hardware prefetcher (software prefetch held it to 20 GB/s on one Zen 4 core, 27
  // without).
  constexpr bool kPrefetch = !(R == 1 && J == 1);
  int64_t i = 0;
  for (; i + 2 * kStep <= n; i += 2 * kStep) {  // 8 steps: every accumulator copy in turn
    if constexpr (kPrefetch)
      for (int r = 0; r < R; ++r)
        for (int64_t l = 0; l < 2 * kStep; l += 32)
          _mm_prefetch(reinterpret_cast<const char*>(rows[r] + i + l) + kPrefetchBytes, _MM_HINT_T0);
    for (int s = 0; s < 2 * kStep / 32; ++s) step(i + 32 * s, s % C);
  }
  for (; i + 32 <= n; i += 32) step(i, 0);
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < J; ++j) {
      __m512 a = acc[0][r][j];
      for (int c = 1; c < C; ++c) a = _mm512_add_ps(a, acc[c][r][j]);
      float s = hsum(a);
      for (int64_t t = i; t < n; ++t) s += weight_at(rows[r], t) * weight_at(vecs[j], t);
      out[r * J + j] = s;
    }
  }
}

// Decode: one row at a time, 8 dot-product chains over it: a single sequential stream
// that the prefetchers follow (4 rows interleaved measured 30% slower on one core).
FTJAX_AVX512_BF16 void gemv_bf16dp(const void* rows_v, int64_t row_stride, int64_t num_rows,
                                   const float* vec, int64_t n, float* out) {
  const char* rows = static_cast<const char*>(rows_v);
  for (int64_t r = 0; r < num_rows; ++r) {
    const void* row = rows + r * row_stride;
    dot_bf16dp<1, 1>(&row, &vec, n, out + r);
  }
}

#define FTJAX_ROW(R) \
  { nullptr, &dot_bf16dp<R, 1>, &dot_bf16dp<R, 2>, &dot_bf16dp<R, 3> }

}  // namespace

const Kernels* avx512_bf16_kernels() {
  const Kernels* base = avx512_kernels();  // f32 rows and the read probe as AVX-512 F
  static const Kernels k{base->f32,
                         DotTable{{{}, FTJAX_ROW(1), FTJAX_ROW(2), FTJAX_ROW(3), FTJAX_ROW(4)}, &gemv_bf16dp},
                         block_table_vnni(WeightType::kQ8_0),
                         block_table_vnni(WeightType::kQ4_0),
                         block_table_vnni(WeightType::kQ4_K),
                         block_table_vnni(WeightType::kQ6_K),
                         block_table_vnni(WeightType::kMXFP4),
                         base->fp8,
                         block_table_vnni(WeightType::kQ4_K_OR_Q6_K),
                         base->sum,
                         0,
                         /*bf16_act=*/true,
                         /*simd_quantise=*/true};
  return &k;
}

bool cpu_has_avx512_bf16() {
  static const bool has = cpu_has_vnni() && __builtin_cpu_supports("avx512bf16");
  return has;
}

}  // namespace ftjax

#else  // not x86-64

namespace ftjax {
const Kernels* avx512_bf16_kernels() { return nullptr; }
bool cpu_has_avx512_bf16() { return false; }
}  // namespace ftjax

#endif
