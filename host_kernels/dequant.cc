#include "dequant.h"

#include <cstring>

#include "blocks.h"
#include "simd_math.h"

namespace ftjax {
namespace {

// ---- the scalar reference: a block's floats (gguf's operations), then bf16 ----------------

// A sink for one block's values: value i of the row's block b lands in chunk (32b + i) / 32.
struct Out {
  uint16_t* out;
  int64_t chunk_stride;
  void put(int64_t i, float v) const { out[i / kQuantBlock * chunk_stride + i % kQuantBlock] = to_bf16(v); }
};

void block_scalar(const BlockQ8_0& b, int64_t base, const Out& o) {
  const float d = half_to_float(b.d);
  for (int i = 0; i < kQuantBlock; ++i) o.put(base + i, d * static_cast<float>(b.qs[i]));
}
void block_scalar(const BlockQ4_0& b, int64_t base, const Out& o) {
  const float d = half_to_float(b.d);
  for (int i = 0; i < kQuantBlock / 2; ++i) {
    o.put(base + i, d * static_cast<float>((b.qs[i] & 0xF) - 8));
    o.put(base + i + kQuantBlock / 2, d * static_cast<float>((b.qs[i] >> 4) - 8));
  }
}
void block_scalar(const BlockMXFP4& b, int64_t base, const Out& o) {
  const float d = e8m0_half(b.e);
  for (int i = 0; i < kQuantBlock / 2; ++i) {
    o.put(base + i, static_cast<float>(kMxfp4Values[b.qs[i] & 0xF]) * d);
    o.put(base + i + kQuantBlock / 2, static_cast<float>(kMxfp4Values[b.qs[i] >> 4]) * d);
  }
}
void block_scalar(const BlockQ4_K& b, int64_t base, const Out& o) {
  const float d = half_to_float(b.d), dmin = half_to_float(b.dmin);
  for (int c = 0; c < 4; ++c)  // 64 values: the low nibbles of 32 bytes, then the high
    for (int half = 0; half < 2; ++half) {
      uint8_t sc, m;
      q4_k_scale_min(b.scales, 2 * c + half, &sc, &m);
      const float scale = d * static_cast<float>(sc), offset = dmin * static_cast<float>(m);
      for (int l = 0; l < kQuantBlock; ++l) {
        const int q = half ? b.qs[32 * c + l] >> 4 : b.qs[32 * c + l] & 0xF;
        o.put(base + 64 * c + 32 * half + l, scale * static_cast<float>(q) - offset);
      }
    }
}
void block_scalar(const BlockQ6_K& b, int64_t base, const Out& o) {
  const float d = half_to_float(b.d);
  for (int h = 0; h < 2; ++h)  // 128 values: 4 quarters of 32, each two 16-value scales
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < kQuantBlock; ++l) {
        const uint8_t ql = b.ql[64 * h + 32 * (k % 2) + l];
        const int low = k < 2 ? ql & 0xF : ql >> 4;
        const int high = (b.qh[32 * h + l] >> (2 * k)) & 3;
        const float scale = d * static_cast<float>(b.scales[8 * h + 2 * k + l / 16]);
        o.put(base + 128 * h + 32 * k + l, scale * static_cast<float>((low | high << 4) - 32));
      }
}
void block_scalar(const BlockQ4_KorQ6_K& b, int64_t base, const Out& o) {
  if (b.tag == BlockQ4_KorQ6_K::kTagQ6_K) block_scalar(b.q6, base, o);
  else block_scalar(b.q4, base, o);
}

template <typename W>
void row_scalar(const void* row, int64_t K, const Out& o) {
  const W* blocks = static_cast<const W*>(row);
  for (int64_t b = 0; b < K / W::kWeights; ++b) block_scalar(blocks[b], b * W::kWeights, o);
}

void copy_bf16(const void* row, int64_t K, uint16_t* out, int64_t chunk_stride) {
  for (int64_t c = 0; c < K / kQuantBlock; ++c)
    std::memcpy(out + c * chunk_stride, static_cast<const uint16_t*>(row) + c * kQuantBlock, 64);
}

}  // namespace

bool dequant_bf16_scalar(WeightType w, const void* row, int64_t K, uint16_t* out, int64_t chunk_stride) {
  const Out o{out, chunk_stride};
  switch (w) {
    case WeightType::kBF16: copy_bf16(row, K, out, chunk_stride); return true;
    case WeightType::kQ8_0: row_scalar<BlockQ8_0>(row, K, o); return true;
    case WeightType::kQ4_0: row_scalar<BlockQ4_0>(row, K, o); return true;
    case WeightType::kMXFP4: row_scalar<BlockMXFP4>(row, K, o); return true;
    case WeightType::kQ4_K: row_scalar<BlockQ4_K>(row, K, o); return true;
    case WeightType::kQ6_K: row_scalar<BlockQ6_K>(row, K, o); return true;
    case WeightType::kQ4_K_OR_Q6_K: row_scalar<BlockQ4_KorQ6_K>(row, K, o); return true;
    default: return false;
  }
}

}  // namespace ftjax

#if defined(__x86_64__)

#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC 12's avx512 intrinsics, see kernels_avx512.cc
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

namespace ftjax {
namespace {

#define FTJAX_DQ __attribute__((target("avx2,avx512f,avx512bw,avx512bf16,f16c")))
#define FTJAX_DQ_INLINE FTJAX_DQ __attribute__((always_inline)) inline

// 32 signed levels (bytes) -> bf16 (level * scale) at dst: values 0-15 take scale0, 16-31
// scale1. One rounding, as gguf's Q6_K (d * sc) * (q - 32) and the scalar reference.
FTJAX_DQ_INLINE void put_chunk(__m256i q, float scale0, float scale1, uint16_t* dst) {
  const __m512 v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))),
                                  _mm512_set1_ps(scale0));
  const __m512 v1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))),
                                  _mm512_set1_ps(scale1));
  _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v1, v0)));
}

// The bf16 bits of (i * scale - offset) for the 16 levels i, in words 0-15 (and 16-31):
// mul then sub, as gguf and the scalar reference.
FTJAX_DQ_INLINE __m512i level_table(float scale, float offset) {
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 v = _mm512_sub_ps(_mm512_mul_ps(levels, _mm512_set1_ps(scale)), _mm512_set1_ps(offset));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v, v));
}

// Q4_K: chunk c of 64 values is 32 bytes of nibbles, low ones sub-block 2c, high ones
// 2c + 1. A sub-block's 16 possible values are made once (level_table) and its 32
// nibbles look them up as word indices (vpermw): no per-value conversion or arithmetic.
FTJAX_DQ_INLINE void block_simd(const BlockQ4_K& b, uint16_t* out, int64_t stride) {
  alignas(16) uint8_t sc_m[16];  // sc_0..7, m_0..7
  q4_k_unpack_scales(b.scales, sc_m);
  const float d = _cvtsh_ss(b.d), dmin = _cvtsh_ss(b.dmin);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * c));
    for (int half = 0; half < 2; ++half) {
      const int s = 2 * c + half;
      const __m256i q = _mm256_and_si256(half ? _mm256_srli_epi16(bytes, 4) : bytes, low4);
      const __m512i table = level_table(d * static_cast<float>(sc_m[s]), dmin * static_cast<float>(sc_m[8 + s]));
      _mm512_storeu_si512(out + s * stride, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), table));
    }
  }
}

// Q6_K: per half, 64 bytes of low nibbles and 32 of high pairs give 4 quarters of 32
// levels (as the dot kernels assemble them), each two 16-value scales; q - 32 in the bytes.
FTJAX_DQ_INLINE void block_simd(const BlockQ6_K& b, uint16_t* out, int64_t stride) {
  const float d = _cvtsh_ss(b.d);
  const __m256i bias = _mm256_set1_epi8(32);
  for (int h = 0; h < 2; ++h) {
    __m256i levels[4];
    q6_k_levels(b.ql + 64 * h, b.qh + 32 * h, levels);
    for (int k = 0; k < 4; ++k) {
      const __m256i q = _mm256_sub_epi8(levels[k], bias);
      const int g = 8 * h + 2 * k;
      put_chunk(q, d * static_cast<float>(b.scales[g]), d * static_cast<float>(b.scales[g + 1]),
                out + (4 * h + k) * stride);
    }
  }
}

// Q8_0: one chunk, d * q (gguf's one product) for the 32 signed bytes.
FTJAX_DQ_INLINE void block_simd(const BlockQ8_0& b, uint16_t* out, int64_t) {
  const float d = _cvtsh_ss(b.d);
  put_chunk(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs)), d, d, out);
}

FTJAX_DQ_INLINE void block_simd(const BlockQ4_KorQ6_K& b, uint16_t* out, int64_t stride) {
  if (b.tag == BlockQ4_KorQ6_K::kTagQ6_K) block_simd(b.q6, out, stride);
  else block_simd(b.q4, out, stride);
}

template <typename W>
FTJAX_DQ void row_simd(const void* row, int64_t K, uint16_t* out, int64_t stride) {
  const W* blocks = static_cast<const W*>(row);
  constexpr int64_t kChunks = W::kWeights / kQuantBlock;
  for (int64_t b = 0; b < K / W::kWeights; ++b) block_simd(blocks[b], out + b * kChunks * stride, stride);
}

bool has_simd() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512bf16");
  return ok;
}

}  // namespace

bool dequant_bf16_fast(WeightType w) {
  switch (w) {
    case WeightType::kBF16: return true;
    case WeightType::kQ8_0:
    case WeightType::kQ4_K:
    case WeightType::kQ6_K:
    case WeightType::kQ4_K_OR_Q6_K: return has_simd();
    default: return false;
  }
}

void dequant_bf16(WeightType w, const void* row, int64_t K, uint16_t* out, int64_t chunk_stride) {
  if (w != WeightType::kBF16 && dequant_bf16_fast(w)) {
    switch (w) {
      case WeightType::kQ8_0: row_simd<BlockQ8_0>(row, K, out, chunk_stride); return;
      case WeightType::kQ4_K: row_simd<BlockQ4_K>(row, K, out, chunk_stride); return;
      case WeightType::kQ6_K: row_simd<BlockQ6_K>(row, K, out, chunk_stride); return;
      default: row_simd<BlockQ4_KorQ6_K>(row, K, out, chunk_stride); return;
    }
  }
  dequant_bf16_scalar(w, row, K, out, chunk_stride);
}

}  // namespace ftjax

#else  // not x86-64: the reference only

namespace ftjax {
bool dequant_bf16_fast(WeightType w) { return w == WeightType::kBF16; }
void dequant_bf16(WeightType w, const void* row, int64_t K, uint16_t* out, int64_t chunk_stride) {
  dequant_bf16_scalar(w, row, K, out, chunk_stride);
}
}  // namespace ftjax

#endif
