#include "linear.h"

#include <algorithm>

#include "amx.h"
#include "blocks.h"

namespace ftjax {
namespace {

constexpr int64_t kTaskBytes = 256 << 10;  // weight bytes per task

struct LinearCall {
  const DenseView& w;
  const DotTable& dots;
  const float* x_in;  // [T, K] as `dots` reads it (prepare_activations: ActQ8 rows K floats apart)
  int64_t num_tokens;
  float* y;           // [T, N]
};

// y[:, r0:r1] for every token.
void linear_task(const LinearCall& c, int64_t r0, int64_t r1) {
  const int64_t K = c.w.cols, N = c.w.rows;
  const int64_t row_bytes = ftjax::row_bytes(c.w.wtype, K);
  const char* w = static_cast<const char*>(c.w.w);
  const int64_t tile = vec_tile(K);
  float out[kSubRows * kMaxTile];  // [rows, tokens]
  const float* vecs[kMaxTile];
  for (int64_t t0 = 0; t0 < c.num_tokens; t0 += tile) {
    const int64_t nt = std::min(c.num_tokens - t0, tile);
    for (int64_t j = 0; j < nt; ++j) vecs[j] = c.x_in + (t0 + j) * K;
    for (int64_t rr = r0; rr < r1; rr += kSubRows) {
      const int64_t nr = std::min(kSubRows, r1 - rr);
      block_dots(c.dots, w + rr * row_bytes, row_bytes, nr, vecs, nt, K, out);
      for (int64_t j = 0; j < nt; ++j)
        for (int64_t r = 0; r < nr; ++r) c.y[(t0 + j) * N + rr + r] = out[r * nt + j];
    }
  }
}

// ---- AMX tiles: a prefill's tokens under Isa::kAmxBf16 (amx_tiles_for says which) ----

constexpr int64_t kTileChunkBlocks = 16;  // token blocks a row pass meets before the next pass

// Rows [r0, r1) (whole tile passes, the last maybe 16 rows) against every token: token
// chunks of kTileChunkBlocks blocks (their packed bytes, 1 MiB of bf16 for K = 2048,
// stay in L2), within a chunk one row pass at a time (widened once per chunk) against
// all of the chunk's blocks.
void linear_task_amx(const DenseView& w, AmxTiles kind, const uint8_t* packed, int64_t num_tokens, float* y,
                     int64_t r0, int64_t r1) {
  const int64_t K = w.cols, N = w.rows, row_bytes = ftjax::row_bytes(w.wtype, K);
  const int64_t block_bytes = amx_packed_bytes(kind, kAmxRows, K);
  const char* rows = static_cast<const char*>(w.w);
  thread_local std::vector<float> out;  // [pass rows, chunk tokens]
  out.resize(kAmxPass * kTileChunkBlocks * kAmxRows);
  AmxScope scope(kind);
  for (int64_t t0 = 0; t0 < num_tokens; t0 += kTileChunkBlocks * kAmxRows) {
    const int64_t nt = std::min(num_tokens - t0, kTileChunkBlocks * kAmxRows);
    const int64_t blocks = ceil_div(nt, kAmxRows), width = blocks * kAmxRows;
    const uint8_t* chunk = packed + t0 / kAmxRows * block_bytes;
    for (int64_t rr = r0; rr < r1; rr += kAmxPass) {
      const int64_t nr = std::min(kAmxPass, r1 - rr);
      amx_tile_dots(kind, w.wtype, rows + rr * row_bytes, row_bytes, nr, chunk, blocks, K, out.data(), width);
      for (int64_t j = 0; j < nt; ++j)
        for (int64_t r = 0; r < nr; ++r) y[(t0 + j) * N + rr + r] = out[r * width + j];
    }
  }
}

// The tokens packed once (the int8 kinds: quantised as the exact kernels do first), then tasks of row passes.
void linear_amx(const Kernels& kernels, const DenseView& w, AmxTiles kind, const float* x, int64_t num_tokens,
                float* y, ThreadPool* threads) {
  const int64_t K = w.cols;
  AlignedFloats x_q(int8_tiles(kind) ? num_tokens * K : 0);
  if (int8_tiles(kind)) {
    prepare_rows(kernels, w.wtype, x, num_tokens, K, x_q.data(), threads);
    x = x_q.data();
  }
  const int64_t blocks = ceil_div(num_tokens, kAmxRows), block_bytes = amx_packed_bytes(kind, kAmxRows, K);
  AlignedFloats packed(blocks * block_bytes / 4);
  uint8_t* packed_bytes = reinterpret_cast<uint8_t*>(packed.data());
  parallel_for(threads, blocks, [&](int64_t b) {
    const int64_t t0 = b * kAmxRows, n = std::min(kAmxRows, num_tokens - t0);
    const float* vecs[kAmxRows];
    for (int64_t j = 0; j < n; ++j) vecs[j] = x + (t0 + j) * K;
    amx_pack_tokens(kind, vecs, n, K, packed_bytes + b * block_bytes);
  });
  const int num_threads = threads ? threads->num_threads() : 1;
  const int64_t rows = round_up(task_rows(row_bytes(w.wtype, K), kTaskBytes, w.rows, num_threads), kAmxPass);
  parallel_for(threads, ceil_div(w.rows, rows), [&](int64_t i) {
    linear_task_amx(w, kind, packed_bytes, num_tokens, y, i * rows, std::min(w.rows, (i + 1) * rows));
  });
}

}  // namespace

bool linear_takes_tiles(Isa isa, WeightType wtype, int64_t rows, int64_t cols, int64_t num_tokens) {
  AmxTiles kind;
  return amx_tiles_for(isa, wtype, &kind) && rows % kAmxRows == 0 && cols % kAmxK == 0 &&
         num_tokens >= kAmxMinTokens;
}

std::string linear(const DenseView& w, const float* x, int64_t num_tokens, float* y,
                   ThreadPool* threads, Isa isa) {
  const Kernels* kernels = select_kernels(isa);
  if (kernels == nullptr) return "requested ISA is not available on this CPU";
  if (w.cols % block_weights(w.wtype))
    return "rows of K = " + std::to_string(w.cols) + " weights are not whole blocks of " +
           std::to_string(block_weights(w.wtype));
  if (num_tokens == 0 || w.rows == 0) return "";
  if (linear_takes_tiles(isa, w.wtype, w.rows, w.cols, num_tokens)) {
    AmxTiles kind;
    amx_tiles_for(isa, w.wtype, &kind);
    linear_amx(*kernels, w, kind, x, num_tokens, y, threads);
    return "";
  }
  AlignedFloats x_in(num_tokens * w.cols);
  prepare_activations(*kernels, w.wtype, x, num_tokens, w.cols, x_in.data());
  LinearCall call{w, kernels->dots(w.wtype), x_in.data(), num_tokens, y};
  const int num_threads = threads ? threads->num_threads() : 1;
  const int64_t rows = task_rows(row_bytes(w.wtype, w.cols), kTaskBytes, w.rows, num_threads);
  parallel_for(threads, ceil_div(w.rows, rows), [&](int64_t i) {
    linear_task(call, i * rows, std::min(w.rows, (i + 1) * rows));
  });
  return "";
}

}  // namespace ftjax
