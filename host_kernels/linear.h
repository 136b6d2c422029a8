// Dense linear layer y = x . W^T over a few tokens, W read in place: f32, bf16 bits, or
// any block format of kernels.h (Q8_0, Q4_0, Q4_K, Q6_K, MXFP4, FP8, ...).
//
// For the non-expert weights of a decode step (attention projections, router, LM
// head): at batch 1 these are matrix-vector products, bound by how fast W streams
// from memory, and XLA's CPU dot on bf16 operands runs far below that (it widens the
// whole weight on every call; docs/benchmarks.md).
// W keeps the HF nn.Linear layout [out, in] so every output is one contiguous row
// (block formats: a row is K / block_weights blocks, GGUF's bytes). Block weights meet
// activations quantised to ActQ8 / ActQ8K blocks once per call (prepare_activations, as the
// expert FFN does), so a Q8_0 matrix streams 1.06 bytes per weight instead of bf16's 2.
// Tasks are blocks of rows (disjoint outputs); tokens are tiled so their activations
// stay in cache while the rows stream, as in expert_ffn.
#pragma once

#include <cstdint>
#include <string>

#include "kernels.h"
#include "thread_pool.h"

namespace ftjax {

// Letters: N output features (rows of W), K input features, T tokens.
struct DenseView {
  const void* w;  // [N, K] row-major (block types: [N, row_bytes(wtype, K)] bytes)
  int64_t rows;   // N
  int64_t cols;   // K, in weights
  WeightType wtype;
};

// Prefill on AMX tiles: under Isa::kAmxBf16 (numerics "fast"), a call of >= 16 tokens
// whose weight type takes tiles (amx_tiles_for: bf16, Q4_K, Q6_K on the bf16 tiles,
// activations rounded to bf16; Q8_0 on the int8 tiles, the exact path's int8 sums) and N
// a multiple of 16 packs its tokens once and streams row passes against them (amx.h).
bool linear_takes_tiles(Isa isa, WeightType wtype, int64_t rows, int64_t cols, int64_t num_tokens);

// y [T, N] = x [T, K] . W^T. Returns "" on success, else an error (missing ISA, K not
// whole blocks of wtype).
std::string linear(const DenseView& w, const float* x, int64_t num_tokens, float* y,
                   ThreadPool* threads, Isa isa);

}  // namespace ftjax
