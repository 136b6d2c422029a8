#include "amx.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "blocks.h"

#if defined(__x86_64__) && defined(__linux__)

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

__attribute__((target("amx-tile"))) void load_config() {
  alignas(64) TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kAmxRows;
    cfg.colsb[t] = 64;
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

// A 32-row x 64 product of 20 tokens (two row blocks, a partial second token block)
// against doubles on the same bf16 inputs.
std::string check_product() {
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
    AmxScope scope;
    amx_dots(w.data(), K * 2, R, packed.data(), blocks, K, out.data(), stride);
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
      if (std::fabs(out[r * stride + j] - ref) > 1e-5 * mag + 1e-6)
        return "the self-check product differs from the reference (row " + std::to_string(r) + ", token " +
               std::to_string(j) + ": " + std::to_string(out[r * stride + j]) + " vs " + std::to_string(ref) + ")";
    }
  return "";
}

std::string check() {
  uint32_t a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22)))
    return "the CPU reports no AMX-TILE / AMX-BF16 (CPUID leaf 7)";
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27)))
    return "the OS has not enabled XSAVE (no OSXSAVE)";
  if ((xcr0() & (3u << 17)) != (3u << 17)) return "the OS has not enabled the tile state (XCR0 bits 17-18)";
  constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) != 0)
    return std::string("Linux refused tile data to this process (arch_prctl: ") + std::strerror(errno) + ")";
  return check_product();
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

AmxScope::AmxScope() { load_config(); }
AmxScope::~AmxScope() { release_tiles(); }

void amx_dots(const uint16_t* rows, int64_t row_bytes, int64_t num_rows, const uint32_t* packed, int64_t blocks,
              int64_t K, float* out, int64_t out_stride) {
  const int64_t tiles = K / kAmxK, block_bytes = tiles * kTileBytes, stride_bytes = out_stride * 4;
  const char* base = reinterpret_cast<const char*>(rows);
  const char* b_base = reinterpret_cast<const char*>(packed);
  thread_local std::vector<char> scratch;
  scratch.resize(tiles * kATileBytes + 64);
  char* copy = scratch.data() + (-reinterpret_cast<intptr_t>(scratch.data()) & 63);
  const bool copied = blocks > kCopyAfterBlocks;
  for (int64_t r0 = 0; r0 < num_rows; r0 += kAmxPass) {
    const int64_t nr = std::min<int64_t>(kAmxPass, num_rows - r0);
    ARows a{base + r0 * row_bytes, row_bytes, 64, kAmxRows * row_bytes};
    if (copied) {
      for (int64_t r = 0; r < nr; ++r) {
        const char* src = base + (r0 + r) * row_bytes;
        for (int64_t kb = 0; kb < tiles; ++kb) std::memcpy(copy + kb * kATileBytes + r * 64, src + kb * 64, 64);
      }
      a = ARows{copy, 64, kATileBytes, kTileBytes};
    }
    for (int64_t b0 = 0; b0 < blocks; b0 += 2) {
      const char* b = b_base + b0 * block_bytes;
      float* o = out + r0 * out_stride + b0 * kAmxRows;
      if (blocks - b0 >= 2) {
        if (nr == kAmxPass) tile_pass<true, true>(a, b, block_bytes, K, o, stride_bytes);
        else tile_pass<false, true>(a, b, block_bytes, K, o, stride_bytes);
      } else {
        if (nr == kAmxPass) tile_pass<true, false>(a, b, block_bytes, K, o, stride_bytes);
        else tile_pass<false, false>(a, b, block_bytes, K, o, stride_bytes);
      }
    }
  }
}

}  // namespace ftjax

#else  // not x86-64 Linux

namespace ftjax {

const std::string& amx_bf16_status() {
  static const std::string status = "AMX tiles need x86-64 Linux";
  return status;
}
AmxScope::AmxScope() {}
AmxScope::~AmxScope() {}
void amx_dots(const uint16_t*, int64_t, int64_t, const uint32_t*, int64_t, int64_t, float*, int64_t) {}
bool pack_simd(const float* const*, int64_t, int64_t, uint32_t*) { return false; }

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

}  // namespace ftjax
