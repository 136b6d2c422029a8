// SwiGLU expert FFN over a few tokens, reading experts straight from the host pool.
//
//   router ids/weights --group by expert--> pairs (token, weight) per unique expert
//     phase 1 (tasks: expert x block of F rows):  h[p, f] = silu(gate_f . x_t) * (up_f . x_t)
//     barrier
//     phase 2 (tasks: block of D rows, all experts): y[t, d] = sum_u w_p * (down_u[d] . h[p])
//
// Each expert's weights stream from memory once per call however many tokens use
// it; tokens are tiled so the activations stay in cache while rows stream. Phase 2
// owns disjoint output columns per task, so there are no races and the summation
// order over experts (ascending id) does not depend on the thread count.
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include "kernels.h"
#include "thread_pool.h"

namespace ftjax {

// One host expert pool (HF fused layout). Letters: Lm MoE layers, E experts,
// D model dim, F expert FFN dim. The two parts may have different weight types (GGUF
// Q4_K_M files: gate / up in Q4_K, down in Q6_K); each part's activations are prepared
// for its own type (ActQ8 / ActQ8K blocks, bf16 bits, or floats in its layout).
struct PoolView {
  const void* gate_up;  // [Lm, E, 2F, D]: rows 0..F-1 gate_proj, F..2F-1 up_proj
  const void* down;     // [Lm, E, D, F]
  int64_t num_layers;
  int64_t num_experts;
  int64_t d_model;
  int64_t d_ff;
  WeightType wtype;       // of gate_up
  WeightType down_wtype;  // of down
  // Clamped SwiGLU (DeepSeek-V4): gate <= limit, |up| <= limit before silu(gate) * up;
  // infinity (the default) leaves both as they are.
  float swiglu_limit = std::numeric_limits<float>::infinity();
};

// Letters: T tokens, K top-k choices per token.
struct TokenBatch {
  const float* x;        // [T, D]
  const int32_t* ids;    // [T, K] expert id; < 0 means "not computed here"
  const float* weights;  // [T, K] routing weights
  float* y;              // [T, D] output, fully overwritten
  int64_t num_tokens;
  int64_t top_k;
};

// y[t] = sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]). Returns "" on success, else
// an error message (bad layer, id >= E, missing ISA); y is untouched on error.
// experts_read, if given, receives the number of distinct experts the call read.
// Whether a call multiplies on AMX tiles (Isa::kAmxBf16; both parts' weight types take
// tiles, amx_tiles_for: bf16, Q4_K, Q6_K, Q4_K-or-Q6_K on the bf16 tiles, Q8_0 on the int8
// ones where amx_int8_ok(); D and F whole passes; a prefill's tokens); Python asks the
// same rule (`host.takes_amx_tiles`).
bool expert_ffn_takes_tiles(Isa isa, WeightType wtype, WeightType down_wtype, int64_t d_model, int64_t d_ff,
                            int64_t num_tokens);

std::string expert_ffn(const PoolView& pool, int64_t layer, const TokenBatch& batch,
                       ThreadPool* threads, Isa isa, int64_t* experts_read = nullptr);

}  // namespace ftjax
