#include "expert_ffn.h"

#include "amx.h"
#include "blocks.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

namespace ftjax {
namespace {

constexpr int64_t kGateUpTaskBytes = 256 << 10;  // weight bytes per phase-1 task
constexpr int64_t kDownTaskBytes = 128 << 10;    // weight bytes per expert per phase-2 task

// Tokens grouped by unique expert: pairs of (token, summed weight), ascending expert.
struct Routing {
  std::vector<int32_t> experts;  // [U] unique expert ids, ascending
  std::vector<int64_t> begin;    // [U + 1] pair offsets of each unique expert
  std::vector<int32_t> token;    // [P] token of each pair
  std::vector<float> weight;     // [P] routing weight (repeats within a token summed)
};

bool repeated_in_token(const int32_t* ids_t, int64_t k) {
  for (int64_t j = 0; j < k; ++j)
    if (ids_t[j] == ids_t[k]) return true;
  return false;
}

// Counting sort of the (token, choice) pairs by expert id.
std::string group_by_expert(const TokenBatch& b, int64_t num_experts, Routing* r) {
  std::vector<int64_t> count(num_experts, 0);
  for (int64_t t = 0; t < b.num_tokens; ++t) {
    const int32_t* ids_t = b.ids + t * b.top_k;
    for (int64_t k = 0; k < b.top_k; ++k) {
      int32_t e = ids_t[k];
      if (e < 0) continue;
      if (e >= num_experts)
        return "expert id " + std::to_string(e) + " >= num_experts " +
               std::to_string(num_experts);
      if (!repeated_in_token(ids_t, k)) ++count[e];
    }
  }
  std::vector<int64_t> cursor(num_experts, -1);
  int64_t num_pairs = 0;
  r->begin.push_back(0);
  for (int64_t e = 0; e < num_experts; ++e) {
    if (count[e] == 0) continue;
    r->experts.push_back(static_cast<int32_t>(e));
    cursor[e] = num_pairs;
    num_pairs += count[e];
    r->begin.push_back(num_pairs);
  }
  r->token.resize(num_pairs);
  r->weight.resize(num_pairs);
  for (int64_t t = 0; t < b.num_tokens; ++t) {
    const int32_t* ids_t = b.ids + t * b.top_k;
    for (int64_t k = 0; k < b.top_k; ++k) {
      int32_t e = ids_t[k];
      if (e < 0) continue;
      float w = b.weights[t * b.top_k + k];
      if (repeated_in_token(ids_t, k)) {
        r->weight[cursor[e] - 1] += w;  // this token is the latest pair of expert e
      } else {
        r->token[cursor[e]] = static_cast<int32_t>(t);
        r->weight[cursor[e]++] = w;
      }
    }
  }
  return "";
}

float silu(float a) { return a / (1.f + std::exp(-a)); }

// Work shared by every task of one call.
struct Call {
  const PoolView& pool;
  const TokenBatch& batch;
  const Routing& routing;
  const DotTable& gate_up_dots;
  const DotTable& down_dots;
  int64_t h_layout;       // layout of h, as `down_dots` expects (even_odd_pos)
  int64_t layer;
  const float* x_in;       // [T, D] batch.x in gate_up's layout, 64-byte aligned (int8
                           // types: each row's ActQ8 / ActQ8K blocks, rows D floats apart)
  const AlignedFloats& h;  // [P, F] SwiGLU activations of each pair, in h_layout
  const float* h_in;       // what phase 2 reads: h, or h's rows converted (prepare_activations)
};

const char* expert_base(const void* base, WeightType wtype, const Call& c, int64_t e, int64_t rows,
                        int64_t cols) {
  const int64_t index = (c.layer * c.pool.num_experts + e) * rows;
  return static_cast<const char*>(base) + index * row_bytes(wtype, cols);
}

struct GateUpTask {
  int64_t u, f0, f1;  // unique expert index, rows [f0, f1) of gate (and of up)
};

// h[p, f] = silu(gate_f . x_t) * (up_f . x_t) for pairs p of expert u, f in [f0, f1)
// (gate and up clamped to the pool's swiglu_limit first: a no-op at infinity).
void gate_up_task(const Call& c, const GateUpTask& task) {
  const int64_t D = c.pool.d_model, F = c.pool.d_ff;
  const int64_t row_bytes = ftjax::row_bytes(c.pool.wtype, D);
  const char* gate = expert_base(c.pool.gate_up, c.pool.wtype, c, c.routing.experts[task.u], 2 * F, D);
  const char* up = gate + F * row_bytes;
  const int64_t p_begin = c.routing.begin[task.u], p_end = c.routing.begin[task.u + 1];
  const int64_t tile = vec_tile(D);
  const float limit = c.pool.swiglu_limit;
  float a[kSubRows * kMaxTile], b[kSubRows * kMaxTile];  // [rows, tokens]
  const float* vecs[kMaxTile];
  for (int64_t p0 = p_begin; p0 < p_end; p0 += tile) {
    const int64_t nt = std::min(p_end - p0, tile);
    for (int64_t j = 0; j < nt; ++j) vecs[j] = c.x_in + c.routing.token[p0 + j] * D;
    for (int64_t f0 = task.f0; f0 < task.f1; f0 += kSubRows) {
      const int64_t nf = std::min(kSubRows, task.f1 - f0);
      block_dots(c.gate_up_dots, gate + f0 * row_bytes, row_bytes, nf, vecs, nt, D, a);
      block_dots(c.gate_up_dots, up + f0 * row_bytes, row_bytes, nf, vecs, nt, D, b);
      for (int64_t f = 0; f < nf; ++f) {
        const int64_t pos = even_odd_pos(f0 + f, F, c.h_layout);
        for (int64_t j = 0; j < nt; ++j)
          c.h[(p0 + j) * F + pos] = silu(std::min(a[f * nt + j], limit)) * std::clamp(b[f * nt + j], -limit, limit);
      }
    }
  }
}

// y[:, d0:d1] = sum over experts u (ascending) of w_p * down_u[d0:d1] . h[p].
void down_task(const Call& c, int64_t d0, int64_t d1) {
  const int64_t D = c.pool.d_model, F = c.pool.d_ff;
  const int64_t row_bytes = ftjax::row_bytes(c.pool.down_wtype, F);
  float* y = c.batch.y;
  for (int64_t t = 0; t < c.batch.num_tokens; ++t)
    std::fill(y + t * D + d0, y + t * D + d1, 0.f);
  const int64_t tile = vec_tile(F);
  float out[kSubRows * kMaxTile];  // [rows, tokens]
  const float* vecs[kMaxTile];
  for (size_t u = 0; u < c.routing.experts.size(); ++u) {
    const char* down = expert_base(c.pool.down, c.pool.down_wtype, c, c.routing.experts[u], D, F);
    const int64_t p_begin = c.routing.begin[u], p_end = c.routing.begin[u + 1];
    for (int64_t p0 = p_begin; p0 < p_end; p0 += tile) {
      const int64_t nt = std::min(p_end - p0, tile);
      for (int64_t j = 0; j < nt; ++j) vecs[j] = c.h_in + (p0 + j) * F;
      for (int64_t r0 = d0; r0 < d1; r0 += kSubRows) {
        const int64_t nr = std::min(kSubRows, d1 - r0);
        block_dots(c.down_dots, down + r0 * row_bytes, row_bytes, nr, vecs, nt, F, out);
        for (int64_t j = 0; j < nt; ++j) {
          float* y_t = y + c.routing.token[p0 + j] * D + r0;
          const float w = c.routing.weight[p0 + j];
          for (int64_t r = 0; r < nr; ++r) y_t[r] += w * out[r * nt + j];
        }
      }
    }
  }
}

// Phase-1 tasks: (unique expert, block of F rows of gate and the same rows of up).
std::vector<GateUpTask> plan_gate_up(const PoolView& pool, int64_t num_unique,
                                     int num_threads, int64_t multiple = 8) {
  const int64_t F = pool.d_ff;
  const int64_t rows = round_up(task_rows(2 * row_bytes(pool.wtype, pool.d_model),
                                          kGateUpTaskBytes, num_unique * F, num_threads), multiple);
  std::vector<GateUpTask> tasks;
  for (int64_t u = 0; u < num_unique; ++u)
    for (int64_t f = 0; f < F; f += rows) tasks.push_back({u, f, std::min(F, f + rows)});
  return tasks;
}

// Phase-2 tasks: blocks of D rows, each over all experts (disjoint outputs).
int64_t plan_down_rows(const PoolView& pool, int num_threads) {
  return task_rows(row_bytes(pool.down_wtype, pool.d_ff), kDownTaskBytes, pool.d_model,
                   num_threads);
}

// ---- AMX tiles (amx.h): a prefill call under Isa::kAmxBf16 or its vector form. Each part
// (gate/up, down) multiplies on the tiles its weight type takes (amx_tiles_for): bf16 tiles
// for bf16 and for the formats widened to bf16 pass by pass (activations rounded to bf16),
// int8 tiles for Q8_0 (the exact path's int8 sums); in the vector form, the block formats
// on int8 (VNNI) and bf16 on bf16. -------------------------------------------------------

// The tiles of the two parts.
struct PartTiles {
  AmxTiles gate_up, down;
};

// Each unique expert's pairs packed for one part's tiles: the activations of its tokens
// (x, K = D) before phase 1, its SwiGLU outputs (h, K = F) before phase 2.
struct PackedPairs {
  std::vector<int64_t> offset;  // [U + 1] byte offset of each expert's token blocks
  AlignedFloats storage;        // the bytes, on 64-byte boundaries (each expert's too)

  PackedPairs(const Routing& r, int64_t K, AmxTiles kind) : storage(offsets(r, K, kind, &offset) / 4) {}
  uint8_t* of(size_t u) const { return reinterpret_cast<uint8_t*>(storage.data()) + offset[u]; }

  static int64_t offsets(const Routing& r, int64_t K, AmxTiles kind, std::vector<int64_t>* offset) {
    offset->assign(r.experts.size() + 1, 0);
    for (size_t u = 0; u < r.experts.size(); ++u)
      (*offset)[u + 1] = (*offset)[u] + round_up(amx_packed_bytes(kind, r.begin[u + 1] - r.begin[u], K), 64);
    return offset->back();
  }
};

// Expert u's pairs packed: rows [T or P, K] (by token: x rows of each pair's token; else
// the pair's own row), floats for the bf16 tiles, ActQ8 blocks (prepare_activations) for int8.
void pack_expert(const Routing& r, size_t u, const float* rows, int64_t K, bool by_token, AmxTiles kind,
                 uint8_t* out) {
  const int64_t p_begin = r.begin[u], n = r.begin[u + 1] - p_begin;
  std::vector<const float*> vecs(n);
  for (int64_t j = 0; j < n; ++j) vecs[j] = rows + (by_token ? r.token[p_begin + j] : p_begin + j) * K;
  amx_pack_tokens(kind, vecs.data(), n, K, out);
}

// h[p, f] = silu(gate_f . x_t) * (up_f . x_t) as gate_up_task, for f in [f0, f1) (whole
// tile rows), on the tiles.
void gate_up_task_amx(const Call& c, const PackedPairs& x, AmxTiles kind, const GateUpTask& task) {
  const int64_t D = c.pool.d_model, F = c.pool.d_ff;
  const int64_t row_bytes = ftjax::row_bytes(c.pool.wtype, D);
  const char* gate = expert_base(c.pool.gate_up, c.pool.wtype, c, c.routing.experts[task.u], 2 * F, D);
  const char* up = gate + F * row_bytes;
  const int64_t p_begin = c.routing.begin[task.u], n = c.routing.begin[task.u + 1] - p_begin;
  const int64_t blocks = ceil_div(n, kAmxRows), width = blocks * kAmxRows;
  const float limit = c.pool.swiglu_limit;
  thread_local std::vector<float> a, b;  // [rows, tokens] of gate and of up
  a.resize(kAmxPass * width);
  b.resize(kAmxPass * width);
  AmxScope scope(kind);
  for (int64_t f0 = task.f0; f0 < task.f1; f0 += kAmxPass) {
    const int64_t nf = std::min(kAmxPass, task.f1 - f0);
    amx_tile_dots(kind, c.pool.wtype, gate + f0 * row_bytes, row_bytes, nf, x.of(task.u), blocks, D, a.data(), width);
    amx_tile_dots(kind, c.pool.wtype, up + f0 * row_bytes, row_bytes, nf, x.of(task.u), blocks, D, b.data(), width);
    amx_swiglu(a.data(), b.data(), nf * width, limit);  // a = h [rows, tokens] (padding tokens: 0)
    for (int64_t j = 0; j < n; ++j) {
      float* h = c.h.data() + (p_begin + j) * F + f0;
      for (int64_t f = 0; f < nf; ++f) h[f] = a[f * width + j];
    }
  }
}

// y[:, d0:d1] as down_task (experts ascending), on the tiles.
void down_task_amx(const Call& c, const PackedPairs& h, AmxTiles kind, int64_t d0, int64_t d1) {
  const int64_t D = c.pool.d_model, F = c.pool.d_ff;
  const int64_t row_bytes = ftjax::row_bytes(c.pool.down_wtype, F);
  float* y = c.batch.y;
  for (int64_t t = 0; t < c.batch.num_tokens; ++t) std::fill(y + t * D + d0, y + t * D + d1, 0.f);
  thread_local std::vector<float> out;  // [rows, tokens]
  AmxScope scope(kind);
  for (size_t u = 0; u < c.routing.experts.size(); ++u) {
    const char* down = expert_base(c.pool.down, c.pool.down_wtype, c, c.routing.experts[u], D, F);
    const int64_t p_begin = c.routing.begin[u], n = c.routing.begin[u + 1] - p_begin;
    const int64_t blocks = ceil_div(n, kAmxRows), width = blocks * kAmxRows;
    out.resize(kAmxPass * width);
    for (int64_t r0 = d0; r0 < d1; r0 += kAmxPass) {
      const int64_t nr = std::min(kAmxPass, d1 - r0);
      amx_tile_dots(kind, c.pool.down_wtype, down + r0 * row_bytes, row_bytes, nr, h.of(u), blocks, F, out.data(),
                    width);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t p = p_begin + j;
        float* y_t = y + c.routing.token[p] * D + r0;
        const float w = c.routing.weight[p];
        for (int64_t r = 0; r < nr; ++r) y_t[r] += w * out[r * width + j];
      }
    }
  }
}

// One part's activations as its tiles take them: floats as given (the bf16 kinds) or ActQ8 /
// ActQ8K rows (the int8 kinds: the exact path's bytes), in `scratch` then.
const float* part_input(const Kernels& kernels, AmxTiles kind, WeightType w, const float* src, int64_t rows,
                        int64_t n, AlignedFloats* scratch, ThreadPool* threads) {
  if (!int8_tiles(kind)) return src;
  prepare_rows(kernels, w, src, rows, n, scratch->data(), threads);
  return scratch->data();
}

// Phase 1 in tasks of whole tile passes, packed x in, h out; h packed; phase 2.
void expert_ffn_amx(const Kernels& kernels, Call& call, PartTiles tiles, ThreadPool* threads, int num_threads) {
  const PoolView& pool = call.pool;
  const Routing& routing = call.routing;
  const int64_t U = routing.experts.size(), T = call.batch.num_tokens, P = routing.token.size();
  AlignedFloats x_q(int8_tiles(tiles.gate_up) ? T * pool.d_model : 0);
  AlignedFloats h_q(int8_tiles(tiles.down) ? P * pool.d_ff : 0);
  const float* x_rows = part_input(kernels, tiles.gate_up, pool.wtype, call.batch.x, T, pool.d_model, &x_q, threads);
  PackedPairs x(routing, pool.d_model, tiles.gate_up);
  parallel_for(threads, U, [&](int64_t u) {
    pack_expert(routing, u, x_rows, pool.d_model, true, tiles.gate_up, x.of(u));
  });
  std::vector<GateUpTask> gate_up = plan_gate_up(pool, U, num_threads, kAmxPass);
  parallel_for(threads, gate_up.size(), [&](int64_t i) { gate_up_task_amx(call, x, tiles.gate_up, gate_up[i]); });
  const float* h_rows = part_input(kernels, tiles.down, pool.down_wtype, call.h.data(), P, pool.d_ff, &h_q, threads);
  PackedPairs h(routing, pool.d_ff, tiles.down);
  parallel_for(threads, U, [&](int64_t u) { pack_expert(routing, u, h_rows, pool.d_ff, false, tiles.down, h.of(u)); });
  const int64_t rows = round_up(plan_down_rows(pool, num_threads), kAmxPass);
  parallel_for(threads, ceil_div(pool.d_model, rows), [&](int64_t i) {
    down_task_amx(call, h, tiles.down, i * rows, std::min(pool.d_model, (i + 1) * rows));
  });
}

}  // namespace

bool expert_ffn_takes_tiles(Isa isa, WeightType wtype, WeightType down_wtype, int64_t d_model, int64_t d_ff,
                            int64_t num_tokens) {
  AmxTiles kind;
  return amx_tiles_for(isa, wtype, &kind) && amx_tiles_for(isa, down_wtype, &kind) &&
         d_model % kAmxPass == 0 && d_ff % kAmxPass == 0 && num_tokens >= kAmxMinTokens;
}

std::string expert_ffn(const PoolView& pool, int64_t layer, const TokenBatch& batch,
                       ThreadPool* threads, Isa isa, int64_t* experts_read) {
  if (layer < 0 || layer >= pool.num_layers)
    return "layer " + std::to_string(layer) + " out of range [0, " +
           std::to_string(pool.num_layers) + ")";
  const Kernels* kernels = select_kernels(isa);
  if (kernels == nullptr) return "requested ISA is not available on this CPU";
  if (pool.d_model % block_weights(pool.wtype) || pool.d_ff % block_weights(pool.down_wtype))
    return "block-quantised experts need d_model divisible by " + std::to_string(block_weights(pool.wtype)) +
           " and d_ff by " + std::to_string(block_weights(pool.down_wtype));
  Routing routing;
  std::string err = group_by_expert(batch, pool.num_experts, &routing);
  if (!err.empty()) return err;
  if (experts_read) *experts_read = static_cast<int64_t>(routing.experts.size());

  const int num_threads = threads ? threads->num_threads() : 1;
  const int64_t num_pairs = routing.token.size();
  AlignedFloats h(num_pairs * pool.d_ff);
  if (expert_ffn_takes_tiles(isa, pool.wtype, pool.down_wtype, pool.d_model, pool.d_ff, batch.num_tokens)) {
    Call call{pool, batch, routing, kernels->dots(pool.wtype), kernels->dots(pool.down_wtype), 0, layer,
              batch.x, h, h.data()};
    PartTiles tiles;
    amx_tiles_for(isa, pool.wtype, &tiles.gate_up);
    amx_tiles_for(isa, pool.down_wtype, &tiles.down);
    expert_ffn_amx(*kernels, call, tiles, threads, num_threads);
    return "";
  }
  const bool h_converted = converts_activations(*kernels, pool.down_wtype);  // h converted after phase 1
  AlignedFloats h_q(h_converted ? num_pairs * pool.d_ff : 0);
  AlignedFloats x_in(batch.num_tokens * pool.d_model);
  prepare_activations(*kernels, pool.wtype, batch.x, batch.num_tokens, pool.d_model, x_in.data());
  Call call{pool, batch, routing, kernels->dots(pool.wtype), kernels->dots(pool.down_wtype),
            h_converted ? 0 : kernels->layout_block(pool.down_wtype), layer, x_in.data(), h,
            h_converted ? h_q.data() : h.data()};

  const std::vector<GateUpTask> gate_up = plan_gate_up(pool, routing.experts.size(), num_threads);
  parallel_for(threads, gate_up.size(), [&](int64_t i) { gate_up_task(call, gate_up[i]); });
  if (h_converted) prepare_rows(*kernels, pool.down_wtype, h.data(), num_pairs, pool.d_ff, h_q.data(), threads);

  const int64_t rows = plan_down_rows(pool, num_threads);
  parallel_for(threads, ceil_div(pool.d_model, rows), [&](int64_t i) {
    down_task(call, i * rows, std::min(pool.d_model, (i + 1) * rows));
  });
  return "";
}

}  // namespace ftjax
