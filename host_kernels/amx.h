// AMX tile products: the expert FFN's prefill on Intel's matrix tiles, bf16 (AMX-BF16)
// and Q8_0 (AMX-INT8, below).
//
// One TDPBF16PS multiplies a 16 x 32 bf16 tile A by a 16 x (16 pairs) bf16 tile B into a
// 16 x 16 f32 tile C: C[m][n] += sum_k A[m][k] * B'[k][n], where B holds each column's
// k values in consecutive pairs (B row r = the pairs (2r, 2r + 1) of every column).
// Weights are A, read from the pool as stored: 16 rows of 32 bf16 (64 bytes) of the HF
// [rows, K] layout (no second copy of the pool, no relayout at load). Activations are B: the tokens of one expert are rounded to bf16 and
// packed once per call (`amx_pack`: per block of 16 tokens, per 32 values of K, one
// 1 KiB tile: row r = (x[2r], x[2r + 1]) of each of the 16 tokens). C comes out as
// [rows, tokens], the layout the expert FFN's other paths produce.
//
// Blocking: 32 weight rows x 32 tokens per pass (tiles 0-3 accumulate C, 4-5 hold A,
// 6-7 hold B), the whole K in the pass, so C never leaves the tiles. When an expert has
// many tokens, a pass's 32 weight rows are first copied tile by tile into a contiguous
// scratch (in place, a tile's rows lie a row apart: 4 KiB for K = 2048, one L1 set, so
// they evict each other), then meet every pair of token blocks.
//
// Weights in a block format (Q4_K, Q6_K) are widened to bf16 pass by pass (dequant.h).
//
// Without AMX (Zen 4/5, Cooper Lake), the same layouts multiply on AVX512-BF16 vectors
// (AmxTiles::kBf16Vector, Isa::kAvx512Bf16Tiles): B's row r of a token block is one zmm of
// the 16 tokens' pair r, so C[m][:] += vdpbf16ps(that zmm, A row m's pair r broadcast) is
// a tile product one weight row at a time, lanes = tokens (8 rows x 2 token blocks of
// accumulators per step). Same packing, widening and callers; no tile state.
//
// Availability (`amx_bf16_status`, checked once per process): CPUID names AMX-TILE and
// AMX-BF16, XCR0 has the tile state enabled, Linux grants this process tile data
// (arch_prctl ARCH_REQ_XCOMP_PERM), and a small product equals a scalar reference on
// the same bf16-rounded inputs. Any failure is the reason string, and the callers keep
// the exact kernels. Activations are rounded to bf16 (nearest even): this path runs only
// when asked for (Isa::kAmxBf16; `numerics="fast"` asks for it for prefill).
#pragma once

#include <cstdint>
#include <string>

#include "kernels.h"

namespace ftjax {

constexpr int64_t kAmxRows = 16;       // weight rows, tokens and k pairs per tile
constexpr int64_t kAmxK = 32;          // K values per tile row (64 bytes of bf16)
constexpr int64_t kAmxPass = 2 * kAmxRows;  // weight rows and tokens of one pass (amx_dots)
constexpr int64_t kAmxMinTokens = 16;  // calls with fewer tokens (decode) keep the exact kernels

// "" when AMX-BF16 tiles run here and passed the self-check, else why not (the first
// call checks; later calls return the same answer).
const std::string& amx_bf16_status();
inline bool amx_bf16_ok() { return amx_bf16_status().empty(); }
// "" when the vector form runs here (CPUID names AVX512-BF16, and the self-check product
// equals the reference), else why not.
const std::string& bf16_vector_status();
inline bool bf16_vector_ok() { return bf16_vector_status().empty(); }
// Whether isa is a tile ISA this process may run: kAmxBf16 where amx_bf16_ok, or
// kAvx512Bf16Tiles where bf16_vector_ok (prompt calls on the bf16 tiles or their vector
// form; everything else on kAuto's exact kernels).
inline bool tiles_granted(Isa isa) {
  return (isa == Isa::kAmxBf16 && amx_bf16_ok()) || (isa == Isa::kAvx512Bf16Tiles && bf16_vector_ok());
}

// uint32 words of n tokens of K values packed: ceil(n / 16) token blocks of K / 32 tiles
// of 16 x 16 words (K % 32 == 0).
inline int64_t amx_packed_words(int64_t n, int64_t K) { return (n + kAmxRows - 1) / kAmxRows * K * kAmxRows / 2; }

// vecs[j] (K floats) for j < n -> packed, rounded to bf16 (nearest even); the tokens
// that pad the last block are zeros. AVX512-BF16 where the CPU has it (pack_simd ->
// false where not), else amx_pack_scalar, the reference the self-check holds it to.
void amx_pack(const float* const* vecs, int64_t n, int64_t K, uint32_t* packed);
void amx_pack_scalar(const float* const* vecs, int64_t n, int64_t K, uint32_t* packed);
bool pack_simd(const float* const* vecs, int64_t n, int64_t K, uint32_t* packed);

// The tile configuration of this thread for the lifetime of the scope (LDTILECFG ...
// TILERELEASE). Every amx_dots call on tiles runs inside a kBf16 scope, every amx_q8_dots
// call inside a kInt8 one (their tiles have other shapes); a vector form's scope does nothing.
enum class AmxTiles { kBf16, kInt8, kBf16Vector, kInt8Vector, kInt8VectorK };
// Whether `kind` multiplies int8 activations — the exact kernels' own (ActQ8 or ActQ8K by
// weight type: prepare_rows) — rather than floats.
inline bool int8_tiles(AmxTiles kind) {
  return kind == AmxTiles::kInt8 || kind == AmxTiles::kInt8Vector || kind == AmxTiles::kInt8VectorK;
}
class AmxScope {
 public:
  explicit AmxScope(AmxTiles tiles = AmxTiles::kBf16);
  ~AmxScope();
  AmxScope(const AmxScope&) = delete;
  AmxScope& operator=(const AmxScope&) = delete;

 private:
  bool held_;
};

// out[r * out_stride + j] = row_r . token_j for r < num_rows (a multiple of 16) and
// j < 16 * blocks: rows of weight type w, row_bytes apart: bf16 bits, or a format that
// dequant_bf16_fast widens (each pass's 32 rows widened into the tile scratch first,
// dequant.h); packed holds `blocks` token blocks of amx_pack over the same K (K % 32 == 0).
// On the tiles (kind kBf16) or on AVX512-BF16 vectors (kBf16Vector).
void amx_dots(AmxTiles kind, WeightType w, const void* rows, int64_t row_bytes, int64_t num_rows, const uint32_t* packed,
              int64_t blocks, int64_t K, float* out, int64_t out_stride);

// ---- AMX-INT8: Q8_0 weights against ActQ8 activations -------------------------------------
//
// One TDPBSSD multiplies signed bytes: a 16 x 32 tile A (16 weight rows, the 32 int8 q of
// one Q8_0 block each, read in place from the pool: a block's q lie 2 bytes into its 34)
// by an 8 x 64 tile B (the 32 q of one ActQ8 block of 16 tokens, each row 4 consecutive
// q of every token) into 16 x 16 int32: C[m][j] = sum_i q_w[m][i] * q_x[j][i], the
// integer sum the VNNI kernels compute for the same block, exactly. The block's scales
// are applied as those kernels do (y += d_w * d_x * sum, in float), on AVX-512 after the
// tile is stored: so the result equals the exact path's up to float summation order, and
// the tiles run under any numerics. C tiles alternate between two so the tile unit
// multiplies block b + 1 while the vector unit scales block b.
constexpr int64_t kAmxQ8StepBytes = 8 * 64 + kAmxRows * 4;  // one K block of 16 tokens: q tile, 16 d

// "" when AMX-INT8 tiles run here and passed their self-check, else why not.
const std::string& amx_int8_status();
inline bool amx_int8_ok() { return amx_int8_status().empty(); }

// Bytes of n tokens of K values (K % 32 == 0) packed for amx_q8_dots: ceil(n / 16) token
// blocks of K / 32 steps of kAmxQ8StepBytes.
inline int64_t amx_q8_packed_bytes(int64_t n, int64_t K) {
  return (n + kAmxRows - 1) / kAmxRows * (K / 32) * kAmxQ8StepBytes;
}
// vecs[j] (K / 32 ActQ8 blocks) for j < n -> packed; tokens padding the last block are zeros.
void amx_q8_pack(const ActQ8* const* vecs, int64_t n, int64_t K, uint8_t* packed);

// out[r * out_stride + j] = row_r . token_j for r < num_rows (a multiple of 16) and
// j < 16 * blocks: rows are Q8_0 blocks, row_bytes apart; packed holds `blocks` token
// blocks of amx_q8_pack over the same K.
void amx_q8_dots(const uint8_t* rows, int64_t row_bytes, int64_t num_rows, const uint8_t* packed, int64_t blocks,
                 int64_t K, float* out, int64_t out_stride);

// gate[i] = silu(min(gate[i], limit)) * clamp(up[i], -limit, limit) for i < n (n % 16 == 0),
// NaN kept, as the exact path's scalar SwiGLU, with a vector exp (range reduction by ln 2,
// Cephes' degree-6 polynomial, 2^n by vscalefps: within a few ulp of std::exp); the tile
// paths only (every AMX CPU has AVX-512).
void amx_swiglu(float* gate, const float* up, int64_t n, float limit);

// ---- The int8 tiles' vector form: block weights against ActQ8 on AVX512-VNNI (int8_vector.cc)
//
// For CPUs without AMX-INT8: lanes = tokens, one vpdpbusd adds 4 byte products into each
// of 16 tokens' int32 sums (64 a instruction, twice vdpbf16ps's 32). Q8_0, Q4_K, Q6_K and
// the tagged Q4_K-or-Q6_K; a pass's rows are unpacked once into unsigned bytes with their
// group scales (int8_vector.cc explains the arithmetic). Q8_0 meets ActQ8 (kInt8Vector),
// the K formats ActQ8K (kInt8VectorK): the exact kernels' activations and integer sums.
// One 32-value block of 16 tokens: q, then 16 lanes each of d and the int32 start.
constexpr int64_t kInt8VectorStepBytes = 8 * 64 + 2 * kAmxRows * 4;
// One 256-value super-block of 16 tokens: q, then 16 lanes of d, 8 x 16 sub-block sums, 16 x 16 starts.
constexpr int64_t kInt8VectorKStepBytes = 64 * 64 + (1 + 8 + 16) * kAmxRows * 4;

// "" when the int8 vector form runs here (CPUID: AVX512-VNNI, BW, VL; a small product of
// each format equals the reference), else why not.
const std::string& int8_vector_status();
inline bool int8_vector_ok() { return int8_vector_status().empty(); }
// Whether the int8 vector form multiplies weights of type w (where int8_vector_ok).
bool int8_vector_takes(WeightType w);
inline int64_t int8_vector_packed_bytes(int64_t n, int64_t K) {
  return (n + kAmxRows - 1) / kAmxRows * (K / 32) * kInt8VectorStepBytes;
}
inline int64_t int8_vector_k_packed_bytes(int64_t n, int64_t K) {
  return (n + kAmxRows - 1) / kAmxRows * (K / 256) * kInt8VectorKStepBytes;
}
// vecs[j] (K / 32 ActQ8 blocks) for j < n -> packed (16-token blocks of K / 32 steps:
// the q as 8 rows of 16 tokens x 4, then per token d and -128 sum q); padding tokens are
// zeros.
void int8_vector_pack(const ActQ8* const* vecs, int64_t n, int64_t K, uint8_t* packed);
// vecs[j] (K / 256 ActQ8K blocks) for j < n -> packed for the K formats (16-token blocks of
// K / 256 steps: 64 rows of q, then per token d, the sub-blocks' sum q and -32 times each
// 16 values' sum).
void int8_vector_k_pack(const ActQ8K* const* vecs, int64_t n, int64_t K, uint8_t* packed);
// out[r * out_stride + j] = row_r . token_j for r < num_rows (a multiple of 16) and
// j < 16 * blocks: rows of type w (int8_vector_takes), row_bytes apart; packed holds
// `blocks` token blocks of int8_vector_pack (Q8_0) or int8_vector_k_pack (the K formats)
// over the same K.
void int8_vector_dots(WeightType w, const void* rows, int64_t row_bytes, int64_t num_rows, const uint8_t* packed,
                      int64_t blocks, int64_t K, float* out, int64_t out_stride);

// ---- Either kind, by weight type (the expert FFN's and the dense layer's tile paths) -------

// Whether weights of type w multiply on tiles under isa (tiles_granted), and on which.
// kAmxBf16: Q8_0 on the int8 tiles (where amx_int8_ok), bf16 and the formats
// dequant_bf16_fast widens on the bf16 tiles. kAvx512Bf16Tiles: the formats
// int8_vector_takes in the int8 vector form (where int8_vector_ok), bf16 and the other
// widened formats in the bf16 vector form. (Q8_0 is widened to bf16 under kAmxBf16 where
// AMX-INT8 is not granted.)
bool amx_tiles_for(Isa isa, WeightType w, AmxTiles* kind);
// Bytes of n tokens of K values packed for `kind` (amx_packed_words * 4, amx_q8_packed_bytes,
// int8_vector_packed_bytes or int8_vector_k_packed_bytes).
int64_t amx_packed_bytes(AmxTiles kind, int64_t n, int64_t K);
// vecs[j] for j < n -> packed: floats for the bf16 kinds (amx_pack), ActQ8 or ActQ8K rows
// for the int8 ones (int8_tiles; amx_q8_pack, int8_vector_pack, int8_vector_k_pack).
void amx_pack_tokens(AmxTiles kind, const float* const* vecs, int64_t n, int64_t K, uint8_t* packed);
// amx_dots, amx_q8_dots or int8_vector_dots, as `kind` says.
void amx_tile_dots(AmxTiles kind, WeightType w, const void* rows, int64_t row_bytes, int64_t num_rows,
                   const uint8_t* packed, int64_t blocks, int64_t K, float* out, int64_t out_stride);

}  // namespace ftjax
