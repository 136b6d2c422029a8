#include "linear.h"

#include <algorithm>

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

}  // namespace

std::string linear(const DenseView& w, const float* x, int64_t num_tokens, float* y,
                   ThreadPool* threads, Isa isa) {
  const Kernels* kernels = select_kernels(isa);
  if (kernels == nullptr) return "requested ISA is not available on this CPU";
  if (w.cols % block_weights(w.wtype))
    return "rows of K = " + std::to_string(w.cols) + " weights are not whole blocks of " +
           std::to_string(block_weights(w.wtype));
  if (num_tokens == 0 || w.rows == 0) return "";
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
