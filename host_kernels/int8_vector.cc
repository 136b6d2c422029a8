// The int8 tiles' vector form (amx.h, AmxTiles::kInt8Vector): block-format weights against
// int8 activations on AVX512-VNNI, for CPUs without AMX-INT8 (Zen 4/5, Ice Lake, Cooper
// Lake). One vpdpbusd adds 64 byte products (4 into each of 16 int32 lanes) where the bf16
// vector form's vdpbf16ps adds 32, at the same rate on Zen 4 (3.6 G a second a core).
//
// Layout, lanes = tokens (as the bf16 vector form): tokens packed 16 at a time, row p of a
// packed step = the 16 tokens' q[4p .. 4p + 3] (one zmm of signed bytes), then per token
// its scale d and the sums the weights' offsets and mins need. Q8_0 meets ActQ8 (a step:
// one 32-value block), the K formats ActQ8K (a step: one 256-value super-block), the
// activations the exact kernels use. A pass's weight rows are unpacked once into unsigned
// bytes u (vpdpbusd multiplies an unsigned byte by a signed one), w = scale * (u - offset)
// + min per group of values:
//   Q8_0   u = q + 128, offset 128, scale d              (32 values a group)
//   Q4_K   u = the nibble, offset 0, scale d sc_j, min -dmin m_j
//   Q6_K   u = q (0..63), offset 32, scale d sc_g        (16 values a group)
// Four bytes of a row are broadcast per vpdpbusd; a group's int32 sum starts from the
// tokens' -offset * sum(q_x) over the group (from the pack), so it ends as
// sum((u - offset) * q_x), the exact kernels' integer sum. In float:
//   Q8_0   y += d_x * (d * isum)                                    per 32-value block
//   K      t += scale * isum per group (+ min * sum q_x per Q4_K sub-block); y += d_x * t
//          per super-block
// so every format gives the exact path's numbers up to float summation order.
// Availability (`int8_vector_status`): CPUID names AVX512-VNNI and BW, and a small product
// of each format equals a reference on the same bytes.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "amx.h"
#include "blocks.h"
#include "dequant.h"
#include "simd_math.h"

namespace ftjax {
namespace {

// A pass's rows in the unsigned-byte form: u values, and per group the scale; per 32-value
// block (Q4_K) the min. Filled per pass of up to kAmxPass rows.
struct Int8Rows {
  WeightType format = WeightType::kQ8_0;  // Q8_0, Q4_K or Q6_K
  int64_t K = 0;
  std::vector<uint8_t> u;      // [K / 32 blocks][kAmxPass rows][32]
  std::vector<float> scale;    // [kAmxPass rows][groups]
  std::vector<float> min;      // [kAmxPass rows][K / 32] (Q4_K)
  int group() const { return format == WeightType::kQ6_K ? 16 : kQuantBlock; }
  int offset() const { return format == WeightType::kQ8_0 ? 128 : format == WeightType::kQ6_K ? 32 : 0; }
};

// Where the unpacking writes (raw pointers: stores through a vector's own would make the
// compiler reload its data pointer after each).
struct RowsOut {
  uint8_t* u;
  float* scale;  // row r's at scale + r * groups (a super-block's 8 or 16 in one store)
  float* min;    // row r's at min + r * blocks
  int64_t groups, blocks;
  explicit RowsOut(Int8Rows& w)
      : u(w.u.data()), scale(w.scale.data()), min(w.min.data()), groups(w.K / w.group()), blocks(w.K / kQuantBlock) {}
  uint8_t* u_at(int64_t b, int64_t r) const { return u + (b * kAmxPass + r) * kQuantBlock; }
  float* scale_at(int64_t g, int64_t r) const { return scale + r * groups + g; }
  float* min_at(int64_t b, int64_t r) const { return min + r * blocks + b; }
};

// ---- the scalar reference: one row's blocks into Int8Rows ---------------------------------

void unpack_scalar(const BlockQ8_0& b, int64_t b0, RowsOut w, int64_t r) {
  for (int i = 0; i < kQuantBlock; ++i) w.u_at(b0, r)[i] = static_cast<uint8_t>(b.qs[i] + 128);
  *w.scale_at(b0, r) = half_to_float(b.d);
}
void unpack_scalar(const BlockQ4_K& b, int64_t b0, RowsOut w, int64_t r) {
  const float d = half_to_float(b.d), dmin = half_to_float(b.dmin);
  for (int s = 0; s < BlockQ4_K::kSubBlocks; ++s) {
    uint8_t sc, m;
    q4_k_scale_min(b.scales, s, &sc, &m);
    for (int l = 0; l < kQuantBlock; ++l) w.u_at(b0 + s, r)[l] = (b.qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0xF;
    *w.scale_at(b0 + s, r) = d * static_cast<float>(sc);
    *w.min_at(b0 + s, r) = -(dmin * static_cast<float>(m));
  }
}
void unpack_scalar(const BlockQ6_K& b, int64_t b0, RowsOut w, int64_t r) {
  const float d = half_to_float(b.d);
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k) {
      const int64_t blk = b0 + 4 * h + k;
      for (int l = 0; l < kQuantBlock; ++l) {
        const uint8_t ql = b.ql[64 * h + 32 * (k % 2) + l];
        const int low = k < 2 ? ql & 0xF : ql >> 4, high = (b.qh[32 * h + l] >> (2 * k)) & 3;
        w.u_at(blk, r)[l] = static_cast<uint8_t>(low | high << 4);
      }
      for (int half = 0; half < 2; ++half)
        *w.scale_at(2 * blk + half, r) = d * static_cast<float>(b.scales[8 * h + 2 * k + half]);
    }
}

void unpack_scalar(const BlockQ4_KorQ6_K& b, int64_t b0, RowsOut w, int64_t r) {
  if (b.tag == BlockQ4_KorQ6_K::kTagQ6_K) unpack_scalar(b.q6, b0, w, r);
  else unpack_scalar(b.q4, b0, w, r);
}

template <typename W>
void row_scalar(const void* row, int64_t K, RowsOut w, int64_t r) {
  const W* blocks = static_cast<const W*>(row);
  constexpr int64_t kChunks = W::kWeights / kQuantBlock;
  for (int64_t b = 0; b < K / W::kWeights; ++b) unpack_scalar(blocks[b], b * kChunks, w, r);
}

// The format a row of w multiplies as: Q8_0, Q4_K or Q6_K (the tagged type by its first
// block's tag: a layer's blocks share one).
WeightType effective(WeightType w, const void* row) {
  if (w != WeightType::kQ4_K_OR_Q6_K) return w;
  return static_cast<const BlockQ4_KorQ6_K*>(row)->tag == BlockQ4_KorQ6_K::kTagQ6_K ? WeightType::kQ6_K
                                                                                    : WeightType::kQ4_K;
}

// Sizes w for rows of K values of format f (Q8_0, Q4_K or Q6_K).
void int8_rows_shape(Int8Rows& w, WeightType f, int64_t K) {
  w.format = f;
  w.K = K;
  const int64_t nb = K / kQuantBlock;
  w.u.resize(nb * kAmxPass * kQuantBlock);
  w.scale.resize(K / w.group() * kAmxPass);
  w.min.resize(f == WeightType::kQ4_K ? nb * kAmxPass : 0);
}

// Row r (< kAmxPass) of w, K values of type w, unpacked by the scalar reference.
void int8_unpack_scalar(WeightType w, const void* row, int64_t K, Int8Rows& rows, int64_t r) {
  const RowsOut out(rows);
  switch (w) {
    case WeightType::kQ8_0: row_scalar<BlockQ8_0>(row, K, out, r); return;
    case WeightType::kQ4_K: row_scalar<BlockQ4_K>(row, K, out, r); return;
    case WeightType::kQ6_K: row_scalar<BlockQ6_K>(row, K, out, r); return;
    default: row_scalar<BlockQ4_KorQ6_K>(row, K, out, r); return;
  }
}

}  // namespace

bool int8_vector_takes(WeightType w) {
  return w == WeightType::kQ8_0 || w == WeightType::kQ4_K || w == WeightType::kQ6_K ||
         w == WeightType::kQ4_K_OR_Q6_K;
}

// Block of 16 tokens, K / 32 steps: row r, column j = q_j[4r .. 4r + 3], then per token
// (16 lanes each) d and the int32 start -128 * sum(q). Padding tokens: zeros.
void int8_vector_pack(const ActQ8* const* vecs, int64_t n, int64_t K, uint8_t* packed) {
  const int64_t nb = K / kQuantBlock;
  for (int64_t j0 = 0; j0 < n; j0 += kAmxRows) {
    uint8_t* block = packed + j0 / kAmxRows * nb * kInt8VectorStepBytes;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* q = block + b * kInt8VectorStepBytes;
      float* d = reinterpret_cast<float*>(q + 8 * 64);
      int32_t* start = reinterpret_cast<int32_t*>(d + kAmxRows);
      for (int64_t j = 0; j < kAmxRows; ++j) {
        const ActQ8* a = j0 + j < n ? vecs[j0 + j] + b : nullptr;
        int32_t sum = 0;
        for (int r = 0; r < 8; ++r) {
          if (a != nullptr) std::memcpy(q + r * 64 + 4 * j, a->qs + 4 * r, 4);
          else std::memset(q + r * 64 + 4 * j, 0, 4);
        }
        if (a != nullptr)
          for (int i = 0; i < kQuantBlock; ++i) sum += a->qs[i];
        d[j] = a != nullptr ? a->d : 0.f;
        start[j] = -128 * sum;
      }
    }
  }
}

// Block of 16 tokens, K / 256 steps: rows p < 64 of 16 tokens' q[4p .. 4p + 3], then per
// token d, the 8 sub-blocks' sum(q) as floats (Q4_K's mins), and the 16 groups' -32 *
// sum(q) as int32 (Q6_K's offset; ActQ8K's bsums). Padding tokens: zeros.
void int8_vector_k_pack(const ActQ8K* const* vecs, int64_t n, int64_t K, uint8_t* packed) {
  constexpr int64_t kSub = ActQ8K::kValues / kQuantBlock, kGroups = ActQ8K::kValues / 16;
  const int64_t nsb = K / ActQ8K::kValues;
  for (int64_t j0 = 0; j0 < n; j0 += kAmxRows) {
    uint8_t* block = packed + j0 / kAmxRows * nsb * kInt8VectorKStepBytes;
    for (int64_t sb = 0; sb < nsb; ++sb) {
      uint8_t* q = block + sb * kInt8VectorKStepBytes;
      float* d = reinterpret_cast<float*>(q + 64 * 64);
      float* sums = d + kAmxRows;                                   // [8 sub-blocks][16 tokens]
      int32_t* start = reinterpret_cast<int32_t*>(sums + kSub * kAmxRows);  // [16 groups][16 tokens]
      for (int64_t j = 0; j < kAmxRows; ++j) {
        const ActQ8K* a = j0 + j < n ? vecs[j0 + j] + sb : nullptr;
        for (int p = 0; p < 64; ++p) {
          if (a != nullptr) std::memcpy(q + p * 64 + 4 * j, a->qs + 4 * p, 4);
          else std::memset(q + p * 64 + 4 * j, 0, 4);
        }
        d[j] = a != nullptr ? a->d : 0.f;
        for (int64_t s = 0; s < kSub; ++s)
          sums[s * kAmxRows + j] = a != nullptr ? static_cast<float>(a->bsums[2 * s] + a->bsums[2 * s + 1]) : 0.f;
        for (int64_t g = 0; g < kGroups; ++g) start[g * kAmxRows + j] = a != nullptr ? -32 * a->bsums[g] : 0;
      }
    }
  }
}

}  // namespace ftjax

#if defined(__x86_64__) && defined(__linux__)

#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC 12's avx512 intrinsics, see kernels_avx512.cc
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

namespace ftjax {
namespace {

#define FTJAX_VNNI __attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
#define FTJAX_VNNI_INLINE FTJAX_VNNI __attribute__((always_inline)) inline

// ---- unpacking a pass's rows, vectorised (equal to unpack_scalar, byte for byte) ----------

FTJAX_VNNI_INLINE void store32(RowsOut w, int64_t b, int64_t r, __m256i u) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.u_at(b, r)), u);
}

FTJAX_VNNI_INLINE void unpack_simd(const BlockQ8_0& b, int64_t b0, RowsOut w, int64_t r) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs));
  store32(w, b0, r, _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80))));
  *w.scale_at(b0, r) = _cvtsh_ss(b.d);
}
FTJAX_VNNI_INLINE void unpack_simd(const BlockQ4_K& b, int64_t b0, RowsOut w, int64_t r) {
  alignas(16) uint8_t sc_m[16];  // sc_0..7, m_0..7
  q4_k_unpack_scales(b.scales, sc_m);
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(sc_m))));
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(b.d)), dmin = _mm512_set1_ps(-_cvtsh_ss(b.dmin));
  const __m512 scaled = _mm512_mul_ps(v, _mm512_mask_blend_ps(0xFF00, d, dmin));  // d sc_0..7, -(dmin m_0..7)
  _mm256_storeu_ps(w.scale_at(b0, r), _mm512_castps512_ps256(scaled));
  _mm256_storeu_ps(w.min_at(b0, r), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(scaled), 1)));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * c));
    store32(w, b0 + 2 * c, r, _mm256_and_si256(bytes, low4));
    store32(w, b0 + 2 * c + 1, r, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4));
  }
}
FTJAX_VNNI_INLINE void unpack_simd(const BlockQ6_K& b, int64_t b0, RowsOut w, int64_t r) {
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(b.d));
  _mm512_storeu_ps(w.scale_at(2 * b0, r), _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                                          reinterpret_cast<const __m128i*>(b.scales))))));
  for (int h = 0; h < 2; ++h) {
    __m256i levels[4];
    q6_k_levels(b.ql + 64 * h, b.qh + 32 * h, levels);
    for (int k = 0; k < 4; ++k) store32(w, b0 + 4 * h + k, r, levels[k]);
  }
}
FTJAX_VNNI_INLINE void unpack_simd(const BlockQ4_KorQ6_K& b, int64_t b0, RowsOut w, int64_t r) {
  if (b.tag == BlockQ4_KorQ6_K::kTagQ6_K) unpack_simd(b.q6, b0, w, r);
  else unpack_simd(b.q4, b0, w, r);
}

template <typename W>
FTJAX_VNNI void unpack_row(const void* row, int64_t K, RowsOut w, int64_t r) {
  const W* blocks = static_cast<const W*>(row);
  constexpr int64_t kChunks = W::kWeights / kQuantBlock;
  for (int64_t b = 0; b < K / W::kWeights; ++b) unpack_simd(blocks[b], b * kChunks, w, r);
}

void unpack_rows(WeightType w, const char* rows, int64_t row_bytes, int64_t nr, int64_t K, Int8Rows& pass) {
  int8_rows_shape(pass, effective(w, rows), K);
  const RowsOut out(pass);
  for (int64_t r = 0; r < nr; ++r) {
    const char* row = rows + r * row_bytes;
    switch (w) {
      case WeightType::kQ8_0: unpack_row<BlockQ8_0>(row, K, out, r); break;
      case WeightType::kQ4_K: unpack_row<BlockQ4_K>(row, K, out, r); break;
      case WeightType::kQ6_K: unpack_row<BlockQ6_K>(row, K, out, r); break;
      default: unpack_row<BlockQ4_KorQ6_K>(row, K, out, r); break;
    }
  }
}

// ---- the passes: kRows weight rows x one or two token blocks at a time ----------------------

// isum[m][j] += 4-byte dots of weight row m (its bytes at u + 32 m) with token block j's
// packed row x + j * block_bytes: one vpdpbusd per (row, token block).
template <int kRows, int kBlocks>
FTJAX_VNNI_INLINE void dot_step(__m512i (&isum)[kRows][kBlocks], const uint8_t* x, int64_t block_bytes,
                                const uint8_t* u) {
  __m512i xs[kBlocks];
  for (int j = 0; j < kBlocks; ++j) xs[j] = _mm512_loadu_si512(x + j * block_bytes);
  for (int m = 0; m < kRows; ++m) {
    int32_t four;
    std::memcpy(&four, u + m * kQuantBlock, 4);
    const __m512i w = _mm512_set1_epi32(four);
    for (int j = 0; j < kBlocks; ++j) isum[m][j] = _mm512_dpbusd_epi32(isum[m][j], w, xs[j]);
  }
}

// Q8_0: out[m * out_stride + j] for the pass's nr rows (a multiple of kRows) and the token
// block(s) at b (two: block_bytes apart), one 32-value block a step.
template <bool kTwoTokenBlocks>
FTJAX_VNNI void q8_0_pass(const Int8Rows& w, int64_t nr, const uint8_t* b, int64_t block_bytes, float* out,
                          int64_t out_stride) {
  constexpr int kRows = 4, kBlocks = kTwoTokenBlocks ? 2 : 1;
  const int64_t nb = w.K / kQuantBlock;
  for (int64_t m0 = 0; m0 < nr; m0 += kRows) {
    __m512 acc[kRows][kBlocks];
    for (int m = 0; m < kRows; ++m)
      for (int j = 0; j < kBlocks; ++j) acc[m][j] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nb; ++blk) {
      const uint8_t* step = b + blk * kInt8VectorStepBytes;
      const uint8_t* wu = w.u.data() + (blk * kAmxPass + m0) * kQuantBlock;
      __m512i isum[kRows][kBlocks];
      for (int j = 0; j < kBlocks; ++j) {  // the tokens' -128 * sum(q_x)
        const __m512i start = _mm512_loadu_si512(step + j * block_bytes + 8 * 64 + 64);
        for (int m = 0; m < kRows; ++m) isum[m][j] = start;
      }
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) dot_step(isum, step + p * 64, block_bytes, wu + 4 * p);
      for (int j = 0; j < kBlocks; ++j) {
        const __m512 dx = _mm512_loadu_ps(reinterpret_cast<const float*>(step + j * block_bytes + 8 * 64));
        for (int m = 0; m < kRows; ++m) {
          const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(isum[m][j]), _mm512_set1_ps(w.scale[(m0 + m) * nb + blk]));
          acc[m][j] = _mm512_fmadd_ps(scaled, dx, acc[m][j]);
        }
      }
    }
    for (int m = 0; m < kRows; ++m)
      for (int j = 0; j < kBlocks; ++j) _mm512_storeu_ps(out + (m0 + m) * out_stride + j * kAmxRows, acc[m][j]);
  }
}

// Q4_K (F) or Q6_K: as q8_0_pass, one 256-value super-block a step: per group the int32 sum
// scaled into a super-block accumulator t (Q4_K: the mins too), then one FMA by d_x.
template <WeightType F, bool kTwoTokenBlocks>
FTJAX_VNNI void k_pass(const Int8Rows& w, int64_t nr, const uint8_t* b, int64_t block_bytes, float* out,
                       int64_t out_stride) {
  constexpr int kRows = 4, kBlocks = kTwoTokenBlocks ? 2 : 1;
  constexpr int kGroups = F == WeightType::kQ6_K ? 2 : 1, kSteps = 8 / kGroups;  // per 32 values
  constexpr int64_t kSub = ActQ8K::kValues / kQuantBlock;
  const int64_t nsb = w.K / ActQ8K::kValues, nb = w.K / kQuantBlock, groups = nb * kGroups;
  for (int64_t m0 = 0; m0 < nr; m0 += kRows) {
    __m512 acc[kRows][kBlocks];
    for (int m = 0; m < kRows; ++m)
      for (int j = 0; j < kBlocks; ++j) acc[m][j] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* step = b + sb * kInt8VectorKStepBytes;
      const uint8_t* tail = step + 64 * 64;  // d, the sub-block sums, the group starts
      __m512 t[kRows][kBlocks];
      for (int m = 0; m < kRows; ++m)
        for (int j = 0; j < kBlocks; ++j) t[m][j] = _mm512_setzero_ps();
      for (int64_t s = 0; s < kSub; ++s) {
        const int64_t blk = sb * kSub + s;
        const uint8_t* wu = w.u.data() + (blk * kAmxPass + m0) * kQuantBlock;
#pragma GCC unroll 2
        for (int gi = 0; gi < kGroups; ++gi) {
          __m512i isum[kRows][kBlocks];
          for (int j = 0; j < kBlocks; ++j) {  // Q6_K: the tokens' -32 * sum(q_x) over the group
            const __m512i start =
                F == WeightType::kQ6_K
                    ? _mm512_loadu_si512(tail + j * block_bytes + (1 + kSub + s * kGroups + gi) * 64)
                    : _mm512_setzero_si512();
            for (int m = 0; m < kRows; ++m) isum[m][j] = start;
          }
#pragma GCC unroll 8
          for (int st = 0; st < kSteps; ++st) {
            const int p = gi * kSteps + st;
            dot_step(isum, step + (s * 8 + p) * 64, block_bytes, wu + 4 * p);
          }
          for (int m = 0; m < kRows; ++m) {
            const __m512 sc = _mm512_set1_ps(w.scale[(m0 + m) * groups + blk * kGroups + gi]);
            for (int j = 0; j < kBlocks; ++j) t[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m][j]), sc, t[m][j]);
          }
        }
        if constexpr (F == WeightType::kQ4_K) {
          for (int j = 0; j < kBlocks; ++j) {
            const __m512 sums = _mm512_loadu_ps(reinterpret_cast<const float*>(tail + j * block_bytes + (1 + s) * 64));
            for (int m = 0; m < kRows; ++m)
              t[m][j] = _mm512_fmadd_ps(_mm512_set1_ps(w.min[(m0 + m) * nb + blk]), sums, t[m][j]);
          }
        }
      }
      for (int j = 0; j < kBlocks; ++j) {
        const __m512 dx = _mm512_loadu_ps(reinterpret_cast<const float*>(tail + j * block_bytes));
        for (int m = 0; m < kRows; ++m) acc[m][j] = _mm512_fmadd_ps(t[m][j], dx, acc[m][j]);
      }
    }
    for (int m = 0; m < kRows; ++m)
      for (int j = 0; j < kBlocks; ++j) _mm512_storeu_ps(out + (m0 + m) * out_stride + j * kAmxRows, acc[m][j]);
  }
}

template <bool kTwo>
void pass_for(const Int8Rows& w, int64_t nr, const uint8_t* b, int64_t block_bytes, float* out, int64_t out_stride) {
  switch (w.format) {
    case WeightType::kQ6_K: k_pass<WeightType::kQ6_K, kTwo>(w, nr, b, block_bytes, out, out_stride); return;
    case WeightType::kQ4_K: k_pass<WeightType::kQ4_K, kTwo>(w, nr, b, block_bytes, out, out_stride); return;
    default: q8_0_pass<kTwo>(w, nr, b, block_bytes, out, out_stride); return;
  }
}

// Bytes of one token block's packed steps over K, for weights of type w.
int64_t packed_block_bytes(WeightType w, int64_t K) {
  return w == WeightType::kQ8_0 ? K / kQuantBlock * kInt8VectorStepBytes
                                : K / ActQ8K::kValues * kInt8VectorKStepBytes;
}

// Whether the pass's rows of the tagged type hold both Q4_K and Q6_K blocks (one layer of a
// GGUF file never does: its blocks share the tensor's type; arrays built by hand may).
bool mixed_tags(WeightType w, const char* rows, int64_t row_bytes, int64_t nr, int64_t K) {
  if (w != WeightType::kQ4_K_OR_Q6_K) return false;
  const uint8_t first = reinterpret_cast<const BlockQ4_KorQ6_K*>(rows)->tag;
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t b = 0; b < K / BlockQ4_KorQ6_K::kWeights; ++b)
      if (reinterpret_cast<const BlockQ4_KorQ6_K*>(rows + r * row_bytes)[b].tag != first) return true;
  return false;
}

// A pass of mixed tags, plainly: each row widened to bf16 (dequant.h) against the packed
// tokens' q * d. Slow and rare (see mixed_tags); the same result up to the bf16 rounding.
void mixed_pass(WeightType w, const char* rows, int64_t row_bytes, int64_t nr, const uint8_t* packed, int64_t blocks,
                int64_t K, float* out, int64_t out_stride) {
  constexpr int64_t kN = ActQ8K::kValues;
  const int64_t nsb = K / kN, block_bytes = packed_block_bytes(w, K);
  std::vector<uint16_t> row(K);
  for (int64_t r = 0; r < nr; ++r) {
    dequant_bf16(w, rows + r * row_bytes, K, row.data(), kQuantBlock);
    for (int64_t j = 0; j < blocks * kAmxRows; ++j) {
      float sum = 0;
      for (int64_t sb = 0; sb < nsb; ++sb) {
        const uint8_t* step = packed + j / kAmxRows * block_bytes + sb * kInt8VectorKStepBytes;
        const float d = reinterpret_cast<const float*>(step + 64 * 64)[j % kAmxRows];
        float part = 0;
        for (int64_t i = 0; i < kN; ++i)
          part += weight_at(row.data(), sb * kN + i) * static_cast<int8_t>(step[i / 4 * 64 + 4 * (j % kAmxRows) + i % 4]);
        sum += d * part;
      }
      out[r * out_stride + j] = sum;
    }
  }
}

// Reference of one product element: the scalar unpacking's values against the token's
// int8 activations x (ActQ8 or ActQ8K blocks), in double.
template <typename Act>
double reference(const Int8Rows& w, int64_t r, const Act* x, double* mag) {
  double sum = 0;
  *mag = 0;
  for (int64_t b = 0; b < w.K / kQuantBlock; ++b) {
    for (int64_t i = 0; i < kQuantBlock; ++i) {
      const int64_t k = b * kQuantBlock + i, g = k / w.group();
      const int level = w.u[(b * kAmxPass + r) * kQuantBlock + i] - w.offset();
      double v = static_cast<double>(w.scale[r * (w.K / w.group()) + g]) * level;
      if (w.format == WeightType::kQ4_K) v += w.min[r * (w.K / kQuantBlock) + b];
      const Act& a = x[k / Act::kValues];
      const double p = v * a.d * a.qs[k % Act::kValues];
      sum += p;
      *mag += std::fabs(p);
    }
  }
  return sum;
}

// 32 rows x K of format f (bytes from a fixed generator, the int8 extremes included)
// against 20 tokens (a partial second token block): int8_vector_dots against the double
// reference on the scalar unpacking.
std::string check_format(WeightType f) {
  constexpr int64_t R = 32, K = 256, N = 20;
  const int64_t row_bytes = ftjax::row_bytes(f, K), block = ftjax::row_bytes(f, block_weights(f));
  const char* name = f == WeightType::kQ8_0 ? "Q8_0" : f == WeightType::kQ4_K ? "Q4_K" : "Q6_K";
  std::vector<uint8_t> rows(R * row_bytes);
  for (int64_t i = 0; i < static_cast<int64_t>(rows.size()); ++i) rows[i] = static_cast<uint8_t>((i * 37 + i / 7) % 256);
  const uint16_t halves[2] = {0x3800, 0x2E66};  // finite f16 scales: 0.5, ~0.1
  for (int64_t o = 0; o < static_cast<int64_t>(rows.size()); o += block) {
    if (f == WeightType::kQ6_K) std::memcpy(&rows[o + block - 2], &halves[0], 2);
    else std::memcpy(&rows[o], halves, f == WeightType::kQ4_K ? 4 : 2);
  }
  std::vector<float> x(N * K);
  for (int64_t i = 0; i < N * K; ++i) x[i] = std::cos(0.11f * i + 0.3f) * (1 + i % 5);
  std::vector<ActQ8> acts(N * K / kQuantBlock);
  std::vector<ActQ8K> acts_k(N * K / ActQ8K::kValues);
  quantise_act_q8(x.data(), N * K, acts.data(), false);
  quantise_act_q8k(x.data(), N * K, acts_k.data(), false);
  std::vector<const ActQ8*> vecs(N);
  std::vector<const ActQ8K*> vecs_k(N);
  for (int64_t j = 0; j < N; ++j) {
    vecs[j] = acts.data() + j * K / kQuantBlock;
    vecs_k[j] = acts_k.data() + j * K / ActQ8K::kValues;
  }
  const bool k_format = f != WeightType::kQ8_0;
  const int64_t bytes = k_format ? int8_vector_k_packed_bytes(N, K) : int8_vector_packed_bytes(N, K);
  std::vector<uint8_t> packed(bytes + 64);
  uint8_t* aligned = packed.data() + (-reinterpret_cast<intptr_t>(packed.data()) & 63);
  if (k_format) int8_vector_k_pack(vecs_k.data(), N, K, aligned);
  else int8_vector_pack(vecs.data(), N, K, aligned);
  const int64_t blocks = (N + kAmxRows - 1) / kAmxRows, stride = blocks * kAmxRows;
  std::vector<float> out(R * stride);
  int8_vector_dots(f, rows.data(), row_bytes, R, aligned, blocks, K, out.data(), stride);
  Int8Rows ref;
  int8_rows_shape(ref, f, K);
  Int8Rows simd;
  unpack_rows(f, reinterpret_cast<const char*>(rows.data()), row_bytes, R, K, simd);
  for (int64_t r = 0; r < R; ++r) int8_unpack_scalar(f, rows.data() + r * row_bytes, K, ref, r);
  if (ref.u != simd.u || ref.scale != simd.scale || ref.min != simd.min)
    return std::string("the self-check's vector unpacking differs from the scalar one (") + name + ")";
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < N; ++j) {
      double mag;
      const double want = k_format ? reference(ref, r, vecs_k[j], &mag) : reference(ref, r, vecs[j], &mag);
      if (std::fabs(out[r * stride + j] - want) > 1e-5 * mag + 1e-6)
        return std::string("the self-check product differs from the reference (") + name + ", row " +
               std::to_string(r) + ", token " + std::to_string(j) + ": " + std::to_string(out[r * stride + j]) +
               " vs " + std::to_string(want) + ")";
    }
  return "";
}

std::string check() {
  if (!cpu_has_vnni()) return "the CPU reports no AVX512-VNNI with F, BW and VL (CPUID leaf 7)";
  for (WeightType f : {WeightType::kQ8_0, WeightType::kQ4_K, WeightType::kQ6_K}) {
    const std::string wrong = check_format(f);
    if (!wrong.empty()) return wrong;
  }
  return "";
}

}  // namespace

const std::string& int8_vector_status() {
  static const std::string status = check();
  return status;
}

void int8_vector_dots(WeightType w, const void* rows, int64_t row_bytes, int64_t num_rows, const uint8_t* packed,
                      int64_t blocks, int64_t K, float* out, int64_t out_stride) {
  const int64_t block_bytes = packed_block_bytes(w, K);
  const char* base = static_cast<const char*>(rows);
  thread_local Int8Rows pass;
  for (int64_t r0 = 0; r0 < num_rows; r0 += kAmxPass) {
    const int64_t nr = std::min<int64_t>(kAmxPass, num_rows - r0);
    if (mixed_tags(w, base + r0 * row_bytes, row_bytes, nr, K)) {
      mixed_pass(w, base + r0 * row_bytes, row_bytes, nr, packed, blocks, K, out + r0 * out_stride, out_stride);
      continue;
    }
    unpack_rows(w, base + r0 * row_bytes, row_bytes, nr, K, pass);
    for (int64_t b0 = 0; b0 < blocks; b0 += 2) {
      const uint8_t* b = packed + b0 * block_bytes;
      float* o = out + r0 * out_stride + b0 * kAmxRows;
      if (blocks - b0 >= 2) pass_for<true>(pass, nr, b, block_bytes, o, out_stride);
      else pass_for<false>(pass, nr, b, block_bytes, o, out_stride);
    }
  }
}

}  // namespace ftjax

#else  // not x86-64 Linux

namespace ftjax {
const std::string& int8_vector_status() {
  static const std::string status = "the int8 vector form needs x86-64 Linux";
  return status;
}
void int8_vector_dots(WeightType, const void*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t) {}
}  // namespace ftjax

#endif
