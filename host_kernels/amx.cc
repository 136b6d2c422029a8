#include "amx.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <vector>

#include "blocks.h"
#include "dequant.h"
#include "simd_math.h"

#if defined(__x86_64__) && defined(__linux__)

#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC 12's avx512 intrinsics, see kernels_avx512.cc
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <cerrno>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace ftjax {
namespace {

constexpr int64_t kTileBytes = kAmxRows * 64;  // one tile: 16 rows of 64 bytes

struct TileConfig {  // LDTILECFG's 64-byte operand, palette 1
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Where a pass finds its 32 weight rows: A tile kb (rows 0-15) at base + kb * tile_step,
// rows row_step apart; rows 16-31 at + half_step.
struct ARows {
  const char* base;
  int64_t row_step, tile_step, half_step;
};
// As amx_dots copies them: [K / 32 tiles][32 rows][64 bytes].
constexpr int64_t kATileBytes = 2 * kTileBytes;

// C tiles 0-3 (rows block x token block: 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1)),
// A tiles 4-5 (weight rows 0-15, 16-31), B tiles 6-7 (token blocks 0, 1).
template <bool kTwoRowBlocks, bool kTwoTokenBlocks>
__attribute__((target("amx-tile,amx-bf16"))) void tile_pass(const ARows& a, const char* b, int64_t block_bytes,
                                                            int64_t K, float* out, int64_t out_stride_bytes) {
  _tile_zero(0);
  if constexpr (kTwoTokenBlocks) _tile_zero(1);
  if constexpr (kTwoRowBlocks) {
    _tile_zero(2);
    if constexpr (kTwoTokenBlocks) _tile_zero(3);
  }
  const char* a2 = a.base + a.half_step;
  const int64_t tiles = K / kAmxK;
  for (int64_t kb = 0; kb < tiles; ++kb) {
    _tile_loadd(4, a.base + kb * a.tile_step, a.row_step);
    _tile_loadd(6, b + kb * kTileBytes, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kTwoTokenBlocks) {
      _tile_loadd(7, b + block_bytes + kb * kTileBytes, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (kTwoRowBlocks) {
      _tile_loadd(5, a2 + kb * a.tile_step, a.row_step);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (kTwoTokenBlocks) _tile_dpbf16ps(3, 5, 7);
    }
  }
  char* o = reinterpret_cast<char*>(out);
  _tile_stored(0, o, out_stride_bytes);
  if constexpr (kTwoTokenBlocks) _tile_stored(1, o + kAmxRows * 4, out_stride_bytes);
  if constexpr (kTwoRowBlocks) {
    char* o2 = o + kAmxRows * out_stride_bytes;
    _tile_stored(2, o2, out_stride_bytes);
    if constexpr (kTwoTokenBlocks) _tile_stored(3, o2 + kAmxRows * 4, out_stride_bytes);
  }
}

// tile_pass in the vector form (AmxTiles::kBf16Vector): the pass's rows (16 or 32) eight
// at a time against J = 1, 2 or 3 token blocks, 8 x J zmm accumulators. Step (tile kb,
// pair p): each token block's row p of B (16 tokens' values 32 kb + 2p, + 1) is one load;
// each weight row's same pair is broadcast, and vdpbf16ps adds its two products into
// every token's lane. A broadcast feeds J products, so one block alone runs at about half
// the rate: an odd count of blocks ends with three together (amx_dots).
template <int kBlocks>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void vector_pass(const ARows& a, int64_t num_rows,
                                                                          const char* b, int64_t block_bytes,
                                                                          int64_t K, float* out,
                                                                          int64_t out_stride) {
  constexpr int kRows = 8;
  const int64_t tiles = K / kAmxK;
  for (int64_t m0 = 0; m0 < num_rows; m0 += kRows) {
    const char* row[kRows];  // row m's pair p of tile kb: row[m] + kb * tile_step + 4 p
    for (int m = 0; m < kRows; ++m) {
      const int64_t r = m0 + m;
      row[m] = a.base + r / kAmxRows * a.half_step + r % kAmxRows * a.row_step;
    }
    __m512 acc[kRows][kBlocks];
    for (int m = 0; m < kRows; ++m)
      for (int j = 0; j < kBlocks; ++j) acc[m][j] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < tiles; ++kb) {
      const char* bk = b + kb * kTileBytes;
      const int64_t at = kb * a.tile_step;
      for (int64_t p = 0; p < kAmxRows; ++p) {
        __m512bh x[kBlocks];
        for (int j = 0; j < kBlocks; ++j) x[j] = (__m512bh)_mm512_loadu_si512(bk + j * block_bytes + p * 64);
        for (int m = 0; m < kRows; ++m) {
          int32_t pair;
          std::memcpy(&pair, row[m] + at + p * 4, 4);
          const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
          for (int j = 0; j < kBlocks; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], w, x[j]);
        }
      }
    }
    for (int m = 0; m < kRows; ++m)
      for (int j = 0; j < kBlocks; ++j) _mm512_storeu_ps(out + (m0 + m) * out_stride + j * kAmxRows, acc[m][j]);
  }
}

// bf16: every tile 16 x 64 bytes. int8: C tiles 0 and 3 16 x 64 bytes (16 x 16 int32), A
// tiles 1 and 4 16 x 32 (one Q8_0 block of 16 rows), B tiles 2 and 5 8 x 64 (one ActQ8
// block of 16 tokens).
__attribute__((target("amx-tile"))) void load_config(AmxTiles tiles) {
  alignas(64) TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kAmxRows;
    cfg.colsb[t] = 64;
  }
  if (tiles == AmxTiles::kInt8) {
    cfg.colsb[1] = cfg.colsb[4] = 32;
    cfg.rows[2] = cfg.rows[5] = 8;
  }
  // not _tile_loadconfig: GCC 12's macro names only 8 bytes of the operand, so the
  // stores filling the rest of the struct may be dropped as dead
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

uint64_t xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// Why a self-check product's element (row r, token j) is wrong, or "": within 1e-5 of the
// sum of its terms' magnitudes from the reference.
std::string differs(float got, double ref, double mag, int64_t r, int64_t j) {
  if (std::fabs(got - ref) <= 1e-5 * mag + 1e-6) return "";
  return "the self-check product differs from the reference (row " + std::to_string(r) + ", token " +
         std::to_string(j) + ": " + std::to_string(got) + " vs " + std::to_string(ref) + ")";
}

// A 32-row x 64 product of 20 tokens (two row blocks, a partial second token block)
// against doubles on the same bf16 inputs, on the tiles or in the vector form.
std::string check_product(AmxTiles kind) {
  constexpr int64_t R = 32, K = 64, N = 20;
  std::vector<uint16_t> w(R * K);
  std::vector<float> x(N * K);
  for (int64_t i = 0; i < R * K; ++i) w[i] = to_bf16(std::sin(0.37f * i) * 0.5f);
  for (int64_t i = 0; i < N * K; ++i) x[i] = std::cos(0.11f * i + 0.3f);
  std::vector<const float*> vecs(N);
  for (int64_t j = 0; j < N; ++j) vecs[j] = x.data() + j * K;
  std::vector<uint32_t> packed(amx_packed_words(N, K)), scalar(packed.size());
  amx_pack(vecs.data(), N, K, packed.data());
  amx_pack_scalar(vecs.data(), N, K, scalar.data());
  if (packed != scalar) return "the self-check's packed activations differ from the scalar packing";
  const int64_t blocks = (N + kAmxRows - 1) / kAmxRows, stride = blocks * kAmxRows;
  std::vector<float> out(R * stride);
  {
    AmxScope scope(kind);
    amx_dots(kind, WeightType::kBF16, w.data(), K * 2, R, packed.data(), blocks, K, out.data(), stride);
  }
  auto f = [](uint16_t bits) {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float v;
    std::memcpy(&v, &u, sizeof v);
    return v;
  };
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < N; ++j) {
      double ref = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = static_cast<double>(f(w[r * K + k])) * f(to_bf16(x[j * K + k]));
        ref += p;
        mag += std::fabs(p);
      }
      const std::string wrong = differs(out[r * stride + j], ref, mag, r, j);
      if (!wrong.empty()) return wrong;
    }
  return "";
}

// "" when this process may use tiles whose CPUID bit (leaf 7, EDX) is `feature`.
std::string tile_permission(int feature, const char* name) {
  uint32_t a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << feature)))
    return std::string("the CPU reports no AMX-TILE / ") + name + " (CPUID leaf 7)";
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27)))
    return "the OS has not enabled XSAVE (no OSXSAVE)";
  if ((xcr0() & (3u << 17)) != (3u << 17)) return "the OS has not enabled the tile state (XCR0 bits 17-18)";
  constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) != 0)
    return std::string("Linux refused tile data to this process (arch_prctl: ") + std::strerror(errno) + ")";
  return "";
}

std::string check() {
  const std::string denied = tile_permission(22, "AMX-BF16");
  return denied.empty() ? check_product(AmxTiles::kBf16) : denied;
}

std::string check_vector() {
  if (!cpu_has_avx512_bf16()) return "the CPU reports no AVX512-BF16 (CPUID leaf 7, subleaf 1)";
  return check_product(AmxTiles::kBf16Vector);
}

// amx_pack with AVX512-BF16 (every AMX CPU has it): each token's 32 values of a tile
// rounded in one vcvtne2ps2bf16 (nearest even, as to_bf16; it reads input denormals as
// zero), the 16 x 16 words then transposed through a stack tile. Packing one OLMoE layer's
// 4,096 (token, expert) pairs of 2,048 values: 8 ms scalar, 3 ms here.
__attribute__((target("avx512f,avx512bf16"))) void pack_simd_avx512(const float* const* vecs, int64_t n, int64_t K,
                                                                    uint32_t* packed) {
  const int64_t tiles = K / kAmxK;
  alignas(64) uint32_t words[kAmxRows][kAmxRows];  // [token, pair]
  for (int64_t j0 = 0; j0 < n; j0 += kAmxRows) {
    uint32_t* block = packed + j0 / kAmxRows * tiles * kAmxRows * kAmxRows;
    const int64_t nj = std::min<int64_t>(kAmxRows, n - j0);
    for (int64_t kb = 0; kb < tiles; ++kb) {
      for (int64_t j = 0; j < kAmxRows; ++j) {
        __m512i w = _mm512_setzero_si512();
        if (j < nj) {
          const float* x = vecs[j0 + j] + kb * kAmxK;
          w = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x)));
        }
        _mm512_store_si512(words[j], w);
      }
      uint32_t* tile = block + kb * kAmxRows * kAmxRows;
      for (int64_t r = 0; r < kAmxRows; ++r)
        for (int64_t j = 0; j < kAmxRows; ++j) tile[r * kAmxRows + j] = words[j][r];
    }
  }
}

}  // namespace

bool pack_simd(const float* const* vecs, int64_t n, int64_t K, uint32_t* packed) {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  if (!ok) return false;
  pack_simd_avx512(vecs, n, K, packed);
  return true;
}

// A pass's weight rows are copied first for more token blocks than this (each then meets
// blocks / 2 token pairs); fewer read the pool in place. Measured on a 2-core Xeon (expert
// prefill of 512 tokens, OLMoE shapes, ~64 tokens an expert): copying always 200 ms a
// layer, never 182, above 4 blocks 185; software prefetch of the rows in place: no gain.
constexpr int64_t kCopyAfterBlocks = 4;

const std::string& amx_bf16_status() {
  static const std::string status = check();
  return status;
}

const std::string& bf16_vector_status() {
  static const std::string status = check_vector();
  return status;
}

AmxScope::AmxScope(AmxTiles tiles) : held_(tiles == AmxTiles::kBf16 || tiles == AmxTiles::kInt8) {
  if (held_) load_config(tiles);
}
AmxScope::~AmxScope() {
  if (held_) release_tiles();
}

void amx_dots(AmxTiles kind, WeightType w, const void* rows, int64_t row_bytes, int64_t num_rows, const uint32_t* packed,
              int64_t blocks, int64_t K, float* out, int64_t out_stride) {
  const int64_t tiles = K / kAmxK, block_bytes = tiles * kTileBytes, stride_bytes = out_stride * 4;
  const char* base = static_cast<const char*>(rows);
  const char* b_base = reinterpret_cast<const char*>(packed);
  thread_local std::vector<char> scratch;
  scratch.resize(tiles * kATileBytes + 64);
  char* copy = scratch.data() + (-reinterpret_cast<intptr_t>(scratch.data()) & 63);
  const bool vector = kind == AmxTiles::kBf16Vector;
  const bool copied = w != WeightType::kBF16 || blocks > kCopyAfterBlocks;
  for (int64_t r0 = 0; r0 < num_rows; r0 += kAmxPass) {
    const int64_t nr = std::min<int64_t>(kAmxPass, num_rows - r0);
    ARows a{base + r0 * row_bytes, row_bytes, 64, kAmxRows * row_bytes};
    if (copied) {  // row r's values 32kb.. at copy + kb * kATileBytes + r * 64
      for (int64_t r = 0; r < nr; ++r)
        dequant_bf16(w, base + (r0 + r) * row_bytes, K, reinterpret_cast<uint16_t*>(copy + r * 64), kATileBytes / 2);
      a = ARows{copy, 64, kATileBytes, kTileBytes};
    }
    for (int64_t b0 = 0; b0 < blocks;) {
      const char* b = b_base + b0 * block_bytes;
      float* o = out + r0 * out_stride + b0 * kAmxRows;
      if (vector) {
        const int64_t left = blocks - b0;
        if (left == 3) vector_pass<3>(a, nr, b, block_bytes, K, o, out_stride);
        else if (left >= 2) vector_pass<2>(a, nr, b, block_bytes, K, o, out_stride);
        else vector_pass<1>(a, nr, b, block_bytes, K, o, out_stride);
        b0 += left == 3 ? 3 : 2;
        continue;
      }
      if (blocks - b0 >= 2) {
        if (nr == kAmxPass) tile_pass<true, true>(a, b, block_bytes, K, o, stride_bytes);
        else tile_pass<false, true>(a, b, block_bytes, K, o, stride_bytes);
      } else {
        if (nr == kAmxPass) tile_pass<true, false>(a, b, block_bytes, K, o, stride_bytes);
        else tile_pass<false, false>(a, b, block_bytes, K, o, stride_bytes);
      }
      b0 += 2;
    }
  }
}

// ---- AMX-INT8: Q8_0 rows (amx.h) --------------------------------------------------------

namespace {

#define FTJAX_AMX_INT8 __attribute__((target("amx-tile,amx-int8,avx512f,f16c")))

// dw[b * 16 + m] = the scale of block b of row m, for the 16 rows at `rows`.
FTJAX_AMX_INT8 void row_scales(const uint8_t* rows, int64_t row_bytes, int64_t nb, float* dw) {
  for (int64_t m = 0; m < kAmxRows; ++m) {
    const uint8_t* row = rows + m * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      uint16_t h;
      std::memcpy(&h, row + b * int64_t(sizeof(BlockQ8_0)), sizeof h);
      dw[b * kAmxRows + m] = _cvtsh_ss(h);
    }
  }
}

// acc[m][j] += d_w[m] * d_x[j] * c[m][j], c one stored C tile (16 x 16 int32).
FTJAX_AMX_INT8 __attribute__((always_inline)) inline void scale_into(__m512 (&acc)[kAmxRows], const int32_t* c,
                                                                     const uint8_t* step, const float* dw) {
  const __m512 dx = _mm512_load_ps(reinterpret_cast<const float*>(step + 8 * 64));
#pragma GCC unroll 16
  for (int m = 0; m < kAmxRows; ++m) {
    const __m512 sums = _mm512_cvtepi32_ps(_mm512_load_si512(c + m * kAmxRows));
    acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(sums, dx), _mm512_set1_ps(dw[m]), acc[m]);
  }
}

// out[m * out_stride + j] = row_m . token_j, 16 rows x one block of 16 tokens, K / 32 blocks:
// two blocks per iteration, in C tiles 0 and 3, each scaled into the float accumulators
// once stored. `next` (or nullptr): the 16 rows after these in memory, prefetched a
// block's share per block, so their bytes arrive while these multiply (without, the
// first read of each row block stalled on memory: a fifth of a layer's time on one
// core). A prefetch never faults, so `next` may lie past the caller's rows.
FTJAX_AMX_INT8 void q8_pass(const uint8_t* rows, int64_t row_bytes, const float* dw, const uint8_t* tokens,
                            int64_t nb, float* out, int64_t out_stride, const uint8_t* next) {
  constexpr int64_t kBlock = sizeof(BlockQ8_0);
  alignas(64) int32_t c[2][kAmxRows * kAmxRows];
  __m512 acc[kAmxRows];
  for (int m = 0; m < kAmxRows; ++m) acc[m] = _mm512_setzero_ps();
  const uint8_t* q = rows + offsetof(BlockQ8_0, qs);
  const int64_t share = kAmxRows * kBlock;  // next's bytes per block: 16 rows of row_bytes
  // C tile c = block b of the 16 rows (A tile a) . block b of the tokens (B tile bt). A
  // macro: GCC's tile intrinsics paste their tile numbers into the assembly as written.
#define FTJAX_Q8_MULTIPLY(c, a, bt, b)                              \
  do {                                                              \
    _tile_zero(c);                                                  \
    _tile_loadd(a, q + (b) * kBlock, row_bytes);                    \
    _tile_loadd(bt, tokens + (b) * kAmxQ8StepBytes, 64);            \
    _tile_dpbssd(c, a, bt);                                         \
  } while (0)
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    if (next != nullptr)
      for (int64_t o = 0; o < 2 * share; o += 64) _mm_prefetch(reinterpret_cast<const char*>(next + b * share + o), _MM_HINT_T0);
    FTJAX_Q8_MULTIPLY(0, 1, 2, b);
    FTJAX_Q8_MULTIPLY(3, 4, 5, b + 1);
    _tile_stored(0, c[0], 64);
    _tile_stored(3, c[1], 64);
    scale_into(acc, c[0], tokens + b * kAmxQ8StepBytes, dw + b * kAmxRows);
    scale_into(acc, c[1], tokens + (b + 1) * kAmxQ8StepBytes, dw + (b + 1) * kAmxRows);
  }
  if (b < nb) {  // an odd number of blocks: the last alone
    FTJAX_Q8_MULTIPLY(0, 1, 2, b);
    _tile_stored(0, c[0], 64);
    scale_into(acc, c[0], tokens + b * kAmxQ8StepBytes, dw + b * kAmxRows);
  }
#undef FTJAX_Q8_MULTIPLY
  for (int m = 0; m < kAmxRows; ++m) _mm512_storeu_ps(out + m * out_stride, acc[m]);
}

// 32 rows x 64 (two Q8_0 blocks, q at the int8 extremes included) x 20 tokens (a partial
// second token block) against doubles: the integer block sums times both scales.
std::string check_q8_product() {
  constexpr int64_t R = 32, K = 64, N = 20, nb = K / kQuantBlock;
  constexpr uint16_t kHalves[3] = {0x3C00, 0x3800, 0x2E66};  // 1, 0.5, ~0.1
  std::vector<BlockQ8_0> w(R * nb);
  for (int64_t i = 0; i < R * nb; ++i) {
    w[i].d = kHalves[i % 3];
    for (int k = 0; k < kQuantBlock; ++k) w[i].qs[k] = static_cast<int8_t>((i * 37 + k * 11) % 256 - 128);
  }
  std::vector<float> x(N * K);
  for (int64_t i = 0; i < N * K; ++i) x[i] = std::cos(0.11f * i + 0.3f);
  std::vector<ActQ8> acts(N * nb);
  quantise_act_q8(x.data(), N * K, acts.data(), false);
  std::vector<const ActQ8*> vecs(N);
  for (int64_t j = 0; j < N; ++j) vecs[j] = acts.data() + j * nb;
  std::vector<uint8_t> packed(amx_q8_packed_bytes(N, K) + 64);
  uint8_t* aligned = packed.data() + (-reinterpret_cast<intptr_t>(packed.data()) & 63);
  amx_q8_pack(vecs.data(), N, K, aligned);
  const int64_t blocks = (N + kAmxRows - 1) / kAmxRows, stride = blocks * kAmxRows;
  std::vector<float> out(R * stride);
  {
    AmxScope scope(AmxTiles::kInt8);
    amx_q8_dots(reinterpret_cast<const uint8_t*>(w.data()), nb * sizeof(BlockQ8_0), R, aligned, blocks, K,
                out.data(), stride);
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < N; ++j) {
      double ref = 0, mag = 0;
      for (int64_t b = 0; b < nb; ++b) {
        const BlockQ8_0& wb = w[r * nb + b];
        const ActQ8& xb = acts[j * nb + b];
        int64_t sum = 0;
        for (int k = 0; k < kQuantBlock; ++k) sum += int64_t(wb.qs[k]) * xb.qs[k];
        const double term = static_cast<double>(half_to_float(wb.d)) * xb.d * sum;
        ref += term;
        mag += std::fabs(term);
      }
      const std::string wrong = differs(out[r * stride + j], ref, mag, r, j);
      if (!wrong.empty()) return wrong;
    }
  return "";
}

std::string check_int8() {
  const std::string denied = tile_permission(25, "AMX-INT8");
  return denied.empty() ? check_q8_product() : denied;
}

}  // namespace

__attribute__((target("avx512f"))) void amx_swiglu(float* gate, const float* up, int64_t n, float limit) {
  const __m512 hi = _mm512_set1_ps(limit), lo = _mm512_set1_ps(-limit), one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 g = _mm512_min_ps(hi, _mm512_loadu_ps(gate + i));  // min(hi, x): x when x is NaN
    const __m512 u = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_loadu_ps(up + i)));
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    _mm512_storeu_ps(gate + i, _mm512_mul_ps(silu, u));
  }
}

const std::string& amx_int8_status() {
  static const std::string status = check_int8();
  return status;
}

void amx_q8_dots(const uint8_t* rows, int64_t row_bytes, int64_t num_rows, const uint8_t* packed, int64_t blocks,
                 int64_t K, float* out, int64_t out_stride) {
  const int64_t nb = K / kQuantBlock, block_bytes = nb * kAmxQ8StepBytes;
  thread_local std::vector<float> dw;
  dw.resize(nb * kAmxRows);
  for (int64_t r0 = 0; r0 < num_rows; r0 += kAmxRows) {
    const uint8_t* r = rows + r0 * row_bytes;
    row_scales(r, row_bytes, nb, dw.data());
    const uint8_t* next = r + kAmxRows * row_bytes;  // past num_rows too: the caller's next rows, mostly
    for (int64_t tb = 0; tb < blocks; ++tb)
      q8_pass(r, row_bytes, dw.data(), packed + tb * block_bytes, nb, out + r0 * out_stride + tb * kAmxRows,
              out_stride, tb == 0 ? next : nullptr);
  }
}

}  // namespace ftjax

#else  // not x86-64 Linux

namespace ftjax {

const std::string& amx_bf16_status() {
  static const std::string status = "AMX tiles need x86-64 Linux";
  return status;
}
const std::string& bf16_vector_status() {
  static const std::string status = "the vector form needs x86-64 Linux";
  return status;
}
AmxScope::AmxScope(AmxTiles) : held_(false) {}
AmxScope::~AmxScope() {}
void amx_dots(AmxTiles, WeightType, const void*, int64_t, int64_t, const uint32_t*, int64_t, int64_t, float*, int64_t) {}
const std::string& amx_int8_status() {
  static const std::string status = "AMX tiles need x86-64 Linux";
  return status;
}
void amx_q8_dots(const uint8_t*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t) {}
bool pack_simd(const float* const*, int64_t, int64_t, uint32_t*) { return false; }
void amx_swiglu(float*, const float*, int64_t, float) {}

}  // namespace ftjax

#endif

namespace ftjax {

// Block of 16 tokens, K / 32 tiles: tile kb, row r, column j = (x_j[32 kb + 2r] low,
// x_j[32 kb + 2r + 1] high).
void amx_pack_scalar(const float* const* vecs, int64_t n, int64_t K, uint32_t* packed) {
  const int64_t tiles = K / kAmxK;
  for (int64_t j0 = 0; j0 < n; j0 += kAmxRows) {
    uint32_t* block = packed + j0 / kAmxRows * tiles * kAmxRows * kAmxRows;
    for (int64_t j = 0; j < kAmxRows; ++j) {
      const float* x = j0 + j < n ? vecs[j0 + j] : nullptr;
      for (int64_t kb = 0; kb < tiles; ++kb) {
        uint32_t* col = block + kb * kAmxRows * kAmxRows + j;
        for (int64_t r = 0; r < kAmxRows; ++r) {
          const int64_t k = kb * kAmxK + 2 * r;
          col[r * kAmxRows] = x == nullptr ? 0u : to_bf16(x[k]) | static_cast<uint32_t>(to_bf16(x[k + 1])) << 16;
        }
      }
    }
  }
}

void amx_pack(const float* const* vecs, int64_t n, int64_t K, uint32_t* packed) {
  if (!pack_simd(vecs, n, K, packed)) amx_pack_scalar(vecs, n, K, packed);
}

// Block of 16 tokens, K / 32 steps: q tile row r, column j = q_j[4r .. 4r + 3] of the step's
// ActQ8 block, then the 16 tokens' d.
void amx_q8_pack(const ActQ8* const* vecs, int64_t n, int64_t K, uint8_t* packed) {
  const int64_t nb = K / kQuantBlock;
  for (int64_t j0 = 0; j0 < n; j0 += kAmxRows) {
    uint8_t* block = packed + j0 / kAmxRows * nb * kAmxQ8StepBytes;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* q = block + b * kAmxQ8StepBytes;
      float* d = reinterpret_cast<float*>(q + 8 * 64);
      for (int64_t j = 0; j < kAmxRows; ++j) {
        const ActQ8* a = j0 + j < n ? vecs[j0 + j] + b : nullptr;
        d[j] = a != nullptr ? a->d : 0.f;
        for (int r = 0; r < 8; ++r) {
          if (a != nullptr) std::memcpy(q + r * 64 + 4 * j, a->qs + 4 * r, 4);
          else std::memset(q + r * 64 + 4 * j, 0, 4);
        }
      }
    }
  }
}

}  // namespace ftjax

namespace ftjax {

bool amx_tiles_for(Isa isa, WeightType w, AmxTiles* kind) {
  if (!tiles_granted(isa)) return false;
  if (isa == Isa::kAmxBf16 && w == WeightType::kQ8_0 && amx_int8_ok()) {
    *kind = AmxTiles::kInt8;
    return true;
  }
  if (isa == Isa::kAvx512Bf16Tiles && int8_vector_takes(w) && int8_vector_ok()) {
    *kind = w == WeightType::kQ8_0 ? AmxTiles::kInt8Vector : AmxTiles::kInt8VectorK;
    return true;
  }
  *kind = isa == Isa::kAmxBf16 ? AmxTiles::kBf16 : AmxTiles::kBf16Vector;
  return dequant_bf16_fast(w);
}

int64_t amx_packed_bytes(AmxTiles kind, int64_t n, int64_t K) {
  if (kind == AmxTiles::kInt8) return amx_q8_packed_bytes(n, K);
  if (kind == AmxTiles::kInt8Vector) return int8_vector_packed_bytes(n, K);
  if (kind == AmxTiles::kInt8VectorK) return int8_vector_k_packed_bytes(n, K);
  return amx_packed_words(n, K) * 4;
}

void amx_pack_tokens(AmxTiles kind, const float* const* vecs, int64_t n, int64_t K, uint8_t* packed) {
  if (kind == AmxTiles::kInt8) amx_q8_pack(reinterpret_cast<const ActQ8* const*>(vecs), n, K, packed);
  else if (kind == AmxTiles::kInt8Vector) int8_vector_pack(reinterpret_cast<const ActQ8* const*>(vecs), n, K, packed);
  else if (kind == AmxTiles::kInt8VectorK)
    int8_vector_k_pack(reinterpret_cast<const ActQ8K* const*>(vecs), n, K, packed);
  else amx_pack(vecs, n, K, reinterpret_cast<uint32_t*>(packed));
}

void amx_tile_dots(AmxTiles kind, WeightType w, const void* rows, int64_t row_bytes, int64_t num_rows,
                   const uint8_t* packed, int64_t blocks, int64_t K, float* out, int64_t out_stride) {
  if (kind == AmxTiles::kInt8)
    amx_q8_dots(static_cast<const uint8_t*>(rows), row_bytes, num_rows, packed, blocks, K, out, out_stride);
  else if (kind == AmxTiles::kInt8Vector || kind == AmxTiles::kInt8VectorK)
    int8_vector_dots(w, rows, row_bytes, num_rows, packed, blocks, K, out, out_stride);
  else
    amx_dots(kind, w, rows, row_bytes, num_rows, reinterpret_cast<const uint32_t*>(packed), blocks, K, out,
             out_stride);
}

}  // namespace ftjax
