// Prompt attention on AMX-BF16 tiles: flash attention with keys and values as the tiles'
// A side and queries as their B side, so that every softmax step is a vertical vector op.
// Without AMX (Isa::kAvx512Bf16Tiles) the same layouts multiply with vdpbf16ps, as amx.h's
// vector form does (vector_scores, vector_values).
//
// A prompt chunk of T queries meets its keys in blocks: per task (row b, KV head g, tile
// of 16 query columns), per block of 64 keys,
//   scores^T [64 keys, 16 queries] = K rows (A, read in place from a bf16 cache: 16 keys
//       x 32 dims a tile) . Q^T (B: the 16 queries packed once per task, amx_pack);
//   the online softmax on those 64 rows: each row is one zmm of 16 queries, so the
//       running max, the rescale factor and the row sums are lane-wise (no horizontal
//       reduction anywhere); the weights are rounded to bf16 and interleaved two keys a
//       word, which is exactly the B tile of the next product;
//   out^T [hd, 16 queries] += V^T (A: the block's values transposed, packed once per
//       (b, g) before the tasks) . P^T (B),
// out^T kept in floats and rescaled row by row (one FMA a dimension). Blocks no query of
// the tile can see are skipped (causal: about half of a prompt's blocks; windows: the
// blocks before the window); blocks every query sees in full skip the mask.
//
// The query columns of a task are (token, head-in-group) pairs, heads fastest, so a GQA
// group's heads share each key and value tile. Tasks go out most expensive first (the
// last query tiles see the most keys) to the pool's dynamic counter.
//
// Numerics: queries (scaled by log2(e) / sqrt(hd): scores in log2 units, weights
// 2^(s - m)), keys, values and softmax weights are rounded to bf16, products and sums are
// f32: the `fast` policy's rounding (Isa::kAmxBf16), as on the dense tiles; `exact` keeps
// the f32 path. A query with no visible key gets zeros.
//
// Measured (scripts/bench_prompt_attention.py, docs/results.md): on a 2-core Xeon, the
// default model's geometry (4 heads, 2 KV heads, hd 64), a 4,096-token first chunk, bf16
// cache: 13.8 ms at 2 threads, 30.5 at 1, where XLA's blocked f32 attention takes 162.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "attention.h"
#include "blocks.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC 12's avx512 intrinsics, see kernels_avx512.cc
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace ftjax {

namespace {
constexpr int64_t kQueries = kAmxRows;  // query columns of a task (one B tile wide)
constexpr int64_t kKeyBlock = 4 * kAmxRows;  // keys per step: four score tiles, two P^T tiles
constexpr int64_t kVTile = kAmxRows * kAmxK;  // bf16 values of one V^T tile: 16 dimensions x 32 keys
constexpr int64_t kMaxHeadDim = 256;
}  // namespace

bool attention_takes_tiles(Isa isa, int64_t num_queries, int64_t hd) {
  return tiles_granted(isa) && num_queries >= kAmxMinTokens && hd % kAmxK == 0 && hd <= kMaxHeadDim;
}

#if defined(__x86_64__) && defined(__linux__)
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One (b, g)'s keys and values as the tiles read them, for its key blocks [first, last)
// (pack_kv).
struct PackedKV {
  const uint16_t* k_rows = nullptr;  // bf16 rows of blocks first .. k_full - 1 (in the cache, or k_copy)
  int64_t k_full = 0;                // blocks read from k_rows; the rest from k_copy's tail
  std::vector<uint16_t> k_copy;      // f32 cache: blocks 0 .. last - 1 as bf16; bf16: blocks k_full .. last - 1
  std::vector<uint16_t> v_tiles;     // [block - first][hd / 16][2 halves][16 dims][32 keys] bf16 (0 past kv_len)
  int64_t first = 0;  // the first block packed (v_tiles start there)

  const uint16_t* key_rows(int64_t block, int64_t hd) const {  // 64 rows of hd bf16 (zero past kv_len)
    if (block < k_full) return k_rows + block * kKeyBlock * hd;
    return k_copy.data() + (block - k_full) * kKeyBlock * hd;
  }
};

// The keys [lo, hi] a query at `pos` of row b sees (empty when lo > hi): causal, within
// the window, among the row's keys in use.
struct KeyRange {
  int64_t lo, hi;
};
KeyRange visible_keys(const AttentionArgs& a, int64_t b, int64_t pos) {
  return {a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0, std::min<int64_t>(pos, a.kv_len[b] - 1)};
}

uint16_t element_bf16(const void* base, WeightType t, int64_t i) {
  return t == WeightType::kF32 ? to_bf16(static_cast<const float*>(base)[i]) : static_cast<const uint16_t*>(base)[i];
}

// Keys [first, last) blocks of (b, g): bf16 rows (in place where the cache is bf16 and the
// block is whole) and the transposed value tiles.
void pack_kv(const AttentionArgs& a, int64_t b, int64_t g, int64_t first, int64_t last, PackedKV& p) {
  const int64_t hd = a.hd, len = a.kv_len[b], head = (b * a.G + g) * a.S * hd;
  p.first = first;
  const bool bf16 = a.kv_type == WeightType::kBF16;
  if (bf16) {
    p.k_rows = static_cast<const uint16_t*>(a.k) + head;
    p.k_full = std::max(first, std::min(last, len / kKeyBlock));
    p.k_copy.assign((last - p.k_full) * kKeyBlock * hd, 0);
    for (int64_t s = p.k_full * kKeyBlock; s < std::min(len, last * kKeyBlock); ++s)
      std::memcpy(p.k_copy.data() + (s - p.k_full * kKeyBlock) * hd, p.k_rows + s * hd, hd * 2);
  } else {
    p.k_copy.assign(last * kKeyBlock * hd, 0);  // indexed from block 0 (k_rows points at it)
    for (int64_t s = first * kKeyBlock; s < std::min(len, last * kKeyBlock); ++s)
      for (int64_t i = 0; i < hd; ++i) p.k_copy[s * hd + i] = element_bf16(a.k, a.kv_type, head + s * hd + i);
    p.k_rows = p.k_copy.data();
    p.k_full = last;
  }
  const int64_t groups = hd / kAmxRows;
  p.v_tiles.assign((last - first) * groups * 2 * kVTile, 0);
  for (int64_t blk = first; blk < last; ++blk)
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      const int64_t s = blk * kKeyBlock + j;
      if (s >= len) break;
      for (int64_t d = 0; d < hd; ++d)
        p.v_tiles[(((blk - first) * groups + d / kAmxRows) * 2 + j / kAmxK) * kVTile + d % kAmxRows * kAmxK + j % kAmxK] =
            element_bf16(a.v, a.kv_type, head + s * hd + d);
    }
}

// 2^x for x <= 0 (scores are kept in log2 units: q is scaled by log2(e) / sqrt(hd)), 16
// lanes: x = n + f, |f| <= 1/2, 2^f by its degree-4 Taylor polynomial (relative error
// below 5e-5, under the bf16 rounding of the weights that follows), 2^n by vscalefps. x
// is clamped at -100 (2^-100, still a normal float: a denormal would cost a microcode
// assist per lane); -inf lanes are masked by the callers.
__attribute__((target("avx512f"), always_inline)) inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.61812911e-3f);  // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Softmax bookkeeping of one task: per query column (lane) its visible key range, the
// running max m and sum l; acc = out^T [hd][16].
struct Columns {
  __m512i lo, hi;  // key s visible to column c iff lo[c] <= s <= hi[c]
  int32_t min_lo, max_lo, min_hi, max_hi;  // over the columns that see some key
  bool blind;  // some query column sees no key: every block is masked
};

// The 64 scores rows of a block (16 columns each, in place) -> weights, P^T's two B tiles;
// updates m, l; returns the rescale factor of the block's predecessors.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) __m512 softmax_block(float* scores, int64_t k0,
                                                                            const Columns& cols, bool masked,
                                                                            __m512& m, __m512& l,
                                                                            uint32_t* p_tile) {
  __mmask16 visible[kKeyBlock];
  __m512 mx4[4] = {m, m, m, m};  // four independent max chains
  for (int64_t i = 0; i < kKeyBlock; ++i) {
    __m512 s = _mm512_load_ps(scores + i * kQueries);
    if (masked) {
      const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(k0 + i));
      visible[i] = _mm512_cmple_epi32_mask(cols.lo, key) & _mm512_cmpge_epi32_mask(cols.hi, key);
      s = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), visible[i], s);
      _mm512_store_ps(scores + i * kQueries, s);
    }
    mx4[i % 4] = _mm512_max_ps(mx4[i % 4], s);
  }
  const __m512 mx = _mm512_max_ps(_mm512_max_ps(mx4[0], mx4[1]), _mm512_max_ps(mx4[2], mx4[3]));
  // a column that has seen no key yet keeps m = -inf; its weights are masked to 0
  const __mmask16 seen = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
  const __m512 base = _mm512_maskz_mov_ps(seen, mx);
  const __m512 scale = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ),
                                           exp2_nonpositive(_mm512_sub_ps(m, base)));
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512 sum2[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t i = 0; i < kKeyBlock; i += 2) {
    __m512 p0 = exp2_nonpositive(_mm512_sub_ps(_mm512_load_ps(scores + i * kQueries), base));
    __m512 p1 = exp2_nonpositive(_mm512_sub_ps(_mm512_load_ps(scores + (i + 1) * kQueries), base));
    if (masked) {
      p0 = _mm512_maskz_mov_ps(visible[i], p0);
      p1 = _mm512_maskz_mov_ps(visible[i + 1], p1);
    }
    sum2[i / 2 % 2] = _mm512_add_ps(sum2[i / 2 % 2], _mm512_add_ps(p0, p1));
    // row i / 2 of P^T's B tile: (key i, key i + 1) of every column, one bf16 pair a word
    const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
    _mm512_store_si512(p_tile + (i / 2) * kQueries, _mm512_permutexvar_epi16(interleave, pair));
  }
  m = mx;
  l = _mm512_fmadd_ps(l, scale, _mm512_add_ps(sum2[0], sum2[1]));
  return scale;
}

// C tile `c` = one group of 16 dimensions of the block's out^T: V^T's two key halves (A,
// through tiles 0 and 3) against P^T's (B, in tiles 1 and 2). A macro: GCC's tile
// intrinsics paste their tile numbers into the assembly text, so they must be literals.
#define FTJAX_VALUE_DOTS(c, v_group)            \
  do {                                          \
    _tile_zero(c);                              \
    _tile_loadd(0, (v_group), 64);              \
    _tile_dpbf16ps(c, 0, 1);                    \
    _tile_loadd(3, (v_group) + kVTile, 64);     \
    _tile_dpbf16ps(c, 3, 2);                    \
  } while (0)

// The two products on the tiles. scores^T of a block: tiles 4-7 (keys k0 + 16x, x =
// 0..3); A (keys, in place) in tiles 0, 2, 3, B (queries) in tile 1.
__attribute__((target("amx-tile,amx-bf16"))) void tile_scores(const uint16_t* keys, int64_t hd,
                                                              const uint32_t* q_tiles, float* scores) {
  const int64_t stride = hd * 2;
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t ds = 0; ds < hd / kAmxK; ++ds) {
    const uint16_t* k = keys + ds * kAmxK;
    _tile_loadd(1, q_tiles + ds * kAmxRows * kQueries, 64);
    _tile_loadd(0, k, stride);
    _tile_dpbf16ps(4, 0, 1);
    _tile_loadd(2, k + kAmxRows * hd, stride);
    _tile_dpbf16ps(5, 2, 1);
    _tile_loadd(3, k + 2 * kAmxRows * hd, stride);
    _tile_dpbf16ps(6, 3, 1);
    _tile_loadd(0, k + 3 * kAmxRows * hd, stride);
    _tile_dpbf16ps(7, 0, 1);
  }
  _tile_stored(4, scores, 64);
  _tile_stored(5, scores + kAmxRows * kQueries, 64);
  _tile_stored(6, scores + 2 * kAmxRows * kQueries, 64);
  _tile_stored(7, scores + 3 * kAmxRows * kQueries, 64);
}

// acc (out^T [hd][16]) = acc * scale + the block's out^T: tiles 4-7, four groups of 16
// dimensions at a time; P^T of keys 0-31 in tile 1, 32-63 in tile 2; V^T in tiles 0 and 3.
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void tile_values(const uint16_t* v, int64_t hd,
                                                                      const uint32_t* p_tile, __m512 scale,
                                                                      float* acc) {
  alignas(64) float out_t[kMaxHeadDim * kQueries];  // this block's out^T
  const int64_t groups = hd / kAmxRows;
  _tile_loadd(1, p_tile, 64);
  _tile_loadd(2, p_tile + kAmxRows * kQueries, 64);
  for (int64_t g0 = 0; g0 < groups; g0 += 4) {
    const int64_t in_pass = std::min<int64_t>(4, groups - g0);
    const uint16_t* vg = v + g0 * 2 * kVTile;
    FTJAX_VALUE_DOTS(4, vg);
    if (in_pass > 1) FTJAX_VALUE_DOTS(5, vg + 2 * kVTile);
    if (in_pass > 2) FTJAX_VALUE_DOTS(6, vg + 4 * kVTile);
    if (in_pass > 3) FTJAX_VALUE_DOTS(7, vg + 6 * kVTile);
    float* o = out_t + g0 * kAmxRows * kQueries;
    _tile_stored(4, o, 64);
    if (in_pass > 1) _tile_stored(5, o + kAmxRows * kQueries, 64);
    if (in_pass > 2) _tile_stored(6, o + 2 * kAmxRows * kQueries, 64);
    if (in_pass > 3) _tile_stored(7, o + 3 * kAmxRows * kQueries, 64);
  }
  for (int64_t d = 0; d < hd; ++d) {
    float* row = acc + d * kQueries;
    _mm512_store_ps(row, _mm512_fmadd_ps(_mm512_load_ps(row), scale, _mm512_load_ps(out_t + d * kQueries)));
  }
}

// The two products in the vector form (AVX512-BF16, no AMX): the tiles' B rows are zmm
// of 16 query columns (a pair of dimensions or keys each), the A side's pair broadcast,
// one vdpbf16ps per (row, pair).
//
// scores^T of a block: for 16 keys at a time, over the hd / 2 dimension pairs.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void vector_scores(const uint16_t* keys, int64_t hd,
                                                                            const uint32_t* q_pairs, float* scores) {
  const int64_t pairs = hd / 2;
  for (int64_t i0 = 0; i0 < kKeyBlock; i0 += kAmxRows) {
    __m512 acc[kAmxRows];
    for (int i = 0; i < kAmxRows; ++i) acc[i] = _mm512_setzero_ps();
    const uint16_t* k = keys + i0 * hd;
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh q = (__m512bh)_mm512_load_si512(q_pairs + p * kQueries);
      for (int i = 0; i < kAmxRows; ++i) {
        int32_t pair;
        std::memcpy(&pair, k + i * hd + 2 * p, 4);
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(pair), q);
      }
    }
    for (int i = 0; i < kAmxRows; ++i) _mm512_store_ps(scores + (i0 + i) * kQueries, acc[i]);
  }
}

// acc (out^T [hd][16]) = acc * scale + V^T . P^T of a block: 16 dimensions at a time, over
// the block's 32 key pairs (v_tiles' layout: [hd / 16][2 halves][16 dims][32 keys]).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void vector_values(const uint16_t* v, int64_t hd,
                                                                            const uint32_t* p_pairs, __m512 scale,
                                                                            float* acc) {
  for (int64_t g0 = 0; g0 < hd / kAmxRows; ++g0) {
    float* rows = acc + g0 * kAmxRows * kQueries;
    __m512 o[kAmxRows];
    for (int d = 0; d < kAmxRows; ++d) o[d] = _mm512_mul_ps(_mm512_load_ps(rows + d * kQueries), scale);
    for (int64_t p = 0; p < kKeyBlock / 2; ++p) {
      const __m512bh w = (__m512bh)_mm512_load_si512(p_pairs + p * kQueries);
      const uint16_t* vp = v + (g0 * 2 + p / kAmxRows) * kVTile + 2 * (p % kAmxRows);
      for (int d = 0; d < kAmxRows; ++d) {
        int32_t pair;
        std::memcpy(&pair, vp + d * kAmxK, 4);
        o[d] = _mm512_dpbf16_ps(o[d], (__m512bh)_mm512_set1_epi32(pair), w);
      }
    }
    for (int d = 0; d < kAmxRows; ++d) _mm512_store_ps(rows + d * kQueries, o[d]);
  }
}

// Task: the query columns [c0, c0 + 16) of (b, g) (column = t * r + head-in-group), on the
// tiles or (kVector) in their vector form.
template <bool kVector>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16"))) void query_tile(
    const AttentionArgs& a, int64_t b, int64_t g, int64_t c0, const PackedKV& kv) {
  const int64_t r = a.H / a.G, Q = r * a.T, hd = a.hd, n = std::min(kQueries, Q - c0);
  const float qscale = 1.4426950408889634f / std::sqrt(static_cast<float>(hd));  // log2(e) / sqrt(hd)
  alignas(64) float q[kQueries * kMaxHeadDim];
  alignas(64) uint32_t q_tiles[kMaxHeadDim / kAmxK * kAmxRows * kQueries];
  alignas(64) float scores[kKeyBlock * kQueries];
  alignas(64) uint32_t p_tile[2 * kAmxRows * kQueries];  // P^T's two B tiles (keys 0-31, 32-63)
  alignas(64) float acc[kMaxHeadDim * kQueries];    // running out^T
  alignas(64) int32_t lo[kQueries], hi[kQueries];
  const float* vecs[kQueries];
  Columns cols{};
  cols.min_lo = cols.min_hi = std::numeric_limits<int32_t>::max();
  cols.max_lo = cols.max_hi = std::numeric_limits<int32_t>::min();
  for (int64_t c = 0; c < kQueries; ++c) {
    KeyRange keys{1, 0};  // a padding column sees nothing
    if (c < n) {
      const int64_t t = (c0 + c) / r, j = (c0 + c) % r;
      const float* src = a.q + ((b * a.T + t) * a.H + g * r + j) * hd;
      for (int64_t i = 0; i < hd; ++i) q[c * hd + i] = src[i] * qscale;
      vecs[c] = q + c * hd;
      keys = visible_keys(a, b, a.positions[b * a.T + t]);
    }
    if (keys.lo > keys.hi) {  // nothing visible: masked in every block, no say in the block range
      lo[c] = std::numeric_limits<int32_t>::max(), hi[c] = -1;
      cols.blind |= c < n;
      continue;
    }
    lo[c] = static_cast<int32_t>(keys.lo), hi[c] = static_cast<int32_t>(keys.hi);
    cols.min_lo = std::min(cols.min_lo, lo[c]), cols.max_lo = std::max(cols.max_lo, lo[c]);
    cols.min_hi = std::min(cols.min_hi, hi[c]), cols.max_hi = std::max(cols.max_hi, hi[c]);
  }
  cols.lo = _mm512_load_si512(lo);
  cols.hi = _mm512_load_si512(hi);
  std::fill(acc, acc + hd * kQueries, 0.f);
  __m512 m = _mm512_set1_ps(kNegInf), l = _mm512_setzero_ps();
  if (cols.max_hi >= 0) {
    amx_pack(vecs, n, hd, q_tiles);
    const int64_t first = cols.min_lo / kKeyBlock, last = cols.max_hi / kKeyBlock + 1;
    AmxScope tiles(kVector ? AmxTiles::kBf16Vector : AmxTiles::kBf16);
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t k0 = blk * kKeyBlock;
      const uint16_t* keys = kv.key_rows(blk, hd);
      const uint16_t* v = kv.v_tiles.data() + (blk - kv.first) * hd / kAmxRows * 2 * kVTile;
      if constexpr (kVector) vector_scores(keys, hd, q_tiles, scores);
      else tile_scores(keys, hd, q_tiles, scores);
      const bool masked = cols.blind || k0 < cols.max_lo || k0 + kKeyBlock - 1 > cols.min_hi;
      const __m512 scale = softmax_block(scores, k0, cols, masked, m, l, p_tile);
      if constexpr (kVector) vector_values(v, hd, p_tile, scale, acc);
      else tile_values(v, hd, p_tile, scale, acc);
    }
  }
  // out = acc^T / l (0 where a column saw no key)
  alignas(64) float inv[kQueries];
  const __mmask16 any = _mm512_cmp_ps_mask(l, _mm512_setzero_ps(), _CMP_GT_OQ);
  _mm512_store_ps(inv, _mm512_maskz_div_ps(any, _mm512_set1_ps(1.f), l));
  for (int64_t c = 0; c < n; ++c) {
    const int64_t t = (c0 + c) / r, j = (c0 + c) % r;
    float* dst = a.out + ((b * a.T + t) * a.H + g * r + j) * hd;
    for (int64_t d = 0; d < hd; ++d) dst[d] = acc[d * kQueries + c] * inv[c];
  }
}

}  // namespace

std::string attention_tiles(const AttentionArgs& a, ThreadPool* threads, Isa isa) {
  const bool vector = isa == Isa::kAvx512Bf16Tiles;
  const int64_t r = a.H / a.G, Q = r * a.T, tiles = ceil_div(Q, kQueries), BG = a.B * a.G;
  // the key blocks any query of row b can see
  std::vector<int64_t> first(a.B), last(a.B);
  for (int64_t b = 0; b < a.B; ++b) {
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
    for (int64_t t = 0; t < a.T; ++t) {
      const KeyRange keys = visible_keys(a, b, a.positions[b * a.T + t]);
      if (keys.lo <= keys.hi) lo = std::min(lo, keys.lo), hi = std::max(hi, keys.hi);
    }
    first[b] = hi < 0 ? 0 : lo / kKeyBlock;
    last[b] = hi < 0 ? 0 : hi / kKeyBlock + 1;
  }
  std::vector<PackedKV> kv(BG);
  parallel_for(threads, BG, [&](int64_t bg) { pack_kv(a, bg / a.G, bg % a.G, first[bg / a.G], last[bg / a.G], kv[bg]); });
  // most expensive first: the last query tiles of every (b, g), then the ones before
  parallel_for(threads, BG * tiles, [&](int64_t i) {
    const int64_t tile = tiles - 1 - i / BG, bg = i % BG;
    if (vector) query_tile<true>(a, bg / a.G, bg % a.G, tile * kQueries, kv[bg]);
    else query_tile<false>(a, bg / a.G, bg % a.G, tile * kQueries, kv[bg]);
  });
  return "";
}
#else
std::string attention_tiles(const AttentionArgs&, ThreadPool*, Isa) { return "AMX tiles need an x86-64 Linux build"; }
#endif

}  // namespace ftjax
