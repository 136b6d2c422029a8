// Vector math shared by the SIMD kernels: the AVX-512 tile paths' exp (amx.cc's SwiGLU,
// attention_tiles.cc's softmax; every CPU with AMX has AVX-512, and callers reach it only on
// such a CPU) and the AVX2 Q6_K level assembly (the dot kernels, dequant.cc, int8_vector.cc).
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <cstdint>
#include <immintrin.h>

namespace ftjax {

// e^x, 16 lanes: x = n ln2 + r (ln 2 in two parts), e^r by Cephes' expf polynomial, then
// vscalefps by n (overflow to inf, underflow to 0). x clamped to [-104, 89] first, NaN kept.
__attribute__((target("avx512f"), always_inline)) inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.f), _mm512_min_ps(_mm512_set1_ps(89.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// Half h of a Q6_K super-block (its 64 bytes of low nibbles ql and 32 of high pairs qh, as
// kernels.h lays them out): quarter k's 32 levels q = low | high << 4 (0..63) in levels[k].
__attribute__((target("avx2"), always_inline)) inline void q6_k_levels(const uint8_t* ql, const uint8_t* qh,
                                                                       __m256i (&levels)[4]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
  const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
  const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  levels[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), high2));
  levels[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(h, 2), high2));
  levels[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(h, high2));
  levels[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                              _mm256_and_si256(_mm256_srli_epi16(h, 2), high2));
}

}  // namespace ftjax
#endif
