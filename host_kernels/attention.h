// Decode attention over a head-major KV cache, read in place (the CPU backend's device
// buffers are host memory).
//
// For a few query tokens per row (decode, batched decode) the work is one pass over the
// keys and values in use, so its speed is the memory read rate. XLA's CPU einsums over
// [blocks of keys] x [a few queries] run well below it; this kernel streams each KV
// head's rows once for all the query heads of its group (GQA) and all T queries.
//
// Tasks are (row b, KV head g, chunk of kChunk keys): pass 1 scores the chunk's keys
// against the group's queries, pass 2 accumulates softmax-weighted values; the chunks of
// a (b, g) are merged with their running maxima afterwards (flash-decoding). bf16 rows
// are widened to f32 one row at a time. Hot loops are plain C++ compiled inside
// AVX2+FMA / AVX-512 entry points (target attributes, chosen at run time).
#pragma once

#include <cstdint>
#include <string>

#include "kernels.h"
#include "thread_pool.h"

namespace ftjax {

// Letters: B rows, T queries per row, H query heads, G KV heads, S capacity, hd head dim.
struct AttentionArgs {
  const float* q;            // [B, T, H, hd]
  const void* k;             // [B, G, S, hd], f32 or bf16 bits
  const void* v;             // [B, G, S, hd], same type
  WeightType kv_type;
  const int32_t* positions;  // [B, T] absolute position of each query
  const int32_t* kv_len;     // [B] keys in use per row (keys s < kv_len[b] may be read)
  int64_t B, T, H, G, S, hd;
  int64_t window;            // 0 = full causal; else key s visible iff pos - window < s <= pos
  float* out;                // [B, T, H, hd]
};

// Returns "" on success, else what is wrong with the arguments. Under Isa::kAmxBf16 a
// prompt chunk (attention_takes_tiles) runs on the AMX tiles (attention_tiles.cc), under
// Isa::kAvx512Bf16Tiles in their vector form; every other call on the exact kernels.
std::string attention(const AttentionArgs& a, ThreadPool* threads, Isa isa);

// Whether attention of T query tokens per row, head dim hd, runs on the bf16 tiles under
// isa: kAmxBf16 or kAvx512Bf16Tiles granted, T >= kAmxMinTokens (a prompt, not decode),
// hd % 32 == 0 and hd <= 256.
bool attention_takes_tiles(Isa isa, int64_t T, int64_t hd);
// The tile path (queries, keys, values and softmax weights rounded to bf16); arguments
// already checked by `attention`.
std::string attention_tiles(const AttentionArgs& a, ThreadPool* threads, Isa isa);

}  // namespace ftjax
