// Building blocks shared by the host kernels that stream weight rows against a few
// activation vectors (expert_ffn.cc, linear.cc): aligned scratch, the even/odd
// activation layout and the int8 activations (ActQ8, ActQ8K) of block weights, row x vector tiles, and
// how rows are cut into pool tasks.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "kernels.h"
#include "thread_pool.h"

namespace ftjax {

constexpr int64_t kVecTileBytes = 96 << 10;  // activations kept hot while rows stream
constexpr int64_t kTasksPerThread = 8;
constexpr int64_t kSubRows = 16;  // rows per block_dots call (callers' stack buffers)
constexpr int64_t kMaxTile = 48;  // tokens per tile, a multiple of kMaxVecs

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t m) { return ceil_div(a, m) * m; }

// Scratch floats on 64-byte boundaries: a 512-bit load of a misaligned vector
// touches two cache lines every time.
class AlignedFloats {
 public:
  explicit AlignedFloats(int64_t n)
      : data_(static_cast<float*>(std::aligned_alloc(64, round_up(std::max<int64_t>(n, 1) * 4, 64)))) {
    if (data_ == nullptr) throw std::bad_alloc();
  }
  ~AlignedFloats() { std::free(data_); }
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;
  float* data() const { return data_; }
  float& operator[](int64_t i) const { return data_[i]; }

 private:
  float* data_;
};

// dst [rows, n] = src reordered into the even/odd layout that bf16 SIMD dots expect.
inline void to_layout(const float* src, int64_t rows, int64_t n, int64_t block, float* dst) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < n; ++i) dst[t * n + even_odd_pos(i, n, block)] = src[t * n + i];
}

// float -> bf16 bits, round to nearest even (NaN kept a NaN); numpy twin storage.to_bf16_bits.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Whether the dot table of weight type w reads activations converted from floats (int8
// blocks or bf16 bits) rather than floats in a layout.
inline bool converts_activations(const Kernels& kernels, WeightType w) {
  return act_block(w) != 0 || (w == WeightType::kBF16 && kernels.bf16_act);
}

// dst [rows, n] = src [rows, n] as the dot table of weight type w reads it: ActQ8 or
// ActQ8K blocks for the block types that take them (act_block; each row's blocks at the
// start of its n floats: 36 bytes per 32 values, 320 per 256, fit in 4 bytes a value), bf16 bits in plain order for a table with
// bf16_act (2 bytes per value at the start of each row's n floats), else floats in the
// table's layout (to_layout). Done once per call; every row of the weights then meets it.
inline void prepare_activations(const Kernels& kernels, WeightType w, const float* src, int64_t rows,
                                int64_t n, float* dst) {
  if (!converts_activations(kernels, w)) {
    to_layout(src, rows, n, kernels.layout_block(w), dst);
    return;
  }
  for (int64_t t = 0; t < rows; ++t) {
    if (act_block(w) == ActQ8K::kValues) {
      quantise_act_q8k(src + t * n, n, reinterpret_cast<ActQ8K*>(dst + t * n), kernels.simd_quantise);
    } else if (act_block(w) == kQuantBlock) {
      quantise_act_q8(src + t * n, n, reinterpret_cast<ActQ8*>(dst + t * n), kernels.simd_quantise);
    } else {
      uint16_t* out = reinterpret_cast<uint16_t*>(dst + t * n);
      for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(src[t * n + i]);
    }
  }
}

// prepare_activations with one row per pool task.
inline void prepare_rows(const Kernels& kernels, WeightType w, const float* src, int64_t rows, int64_t n, float* dst,
                         ThreadPool* threads) {
  parallel_for(threads, rows, [&](int64_t r) { prepare_activations(kernels, w, src + r * n, 1, n, dst + r * n); });
}

// Tokens per tile: their activations (len floats each) stay in L1/L2 while rows stream.
inline int64_t vec_tile(int64_t len) {
  const int64_t fit = kVecTileBytes / (len * 4) / kMaxVecs * kMaxVecs;
  return std::min(kMaxTile, std::max<int64_t>(kMaxVecs, fit));
}

// out[r * num_vecs + j] = row_r . vecs[j] for `num_rows` consecutive rows starting at
// `rows`. One token: rows go one at a time, a single sequential stream that the
// prefetchers follow; several tokens: R x J tiles reuse each loaded weight J times.
inline void block_dots(const DotTable& dots, const char* rows, int64_t row_bytes,
                       int64_t num_rows, const float* const* vecs, int64_t num_vecs,
                       int64_t n, float* out) {
  if (num_vecs == 1) {
    dots.gemv(rows, row_bytes, num_rows, vecs[0], n, out);
    return;
  }
  for (int64_t r0 = 0; r0 < num_rows; r0 += kMaxRows) {
    const int R = static_cast<int>(std::min<int64_t>(kMaxRows, num_rows - r0));
    const void* row_ptrs[kMaxRows];
    for (int r = 0; r < R; ++r) row_ptrs[r] = rows + (r0 + r) * row_bytes;
    for (int64_t j0 = 0; j0 < num_vecs; j0 += dots.max_vecs) {
      const int J = static_cast<int>(std::min<int64_t>(dots.max_vecs, num_vecs - j0));
      float tile[kMaxRows * kMaxVecs];
      dots.fn[R][J](row_ptrs, vecs + j0, n, tile);
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < J; ++j) out[(r0 + r) * num_vecs + j0 + j] = tile[r * J + j];
    }
  }
}

// Rows per task: bounded by bytes (a task's weights stay a cache-sized chunk) and by
// balance (>= kTasksPerThread tasks per thread even for 1 token x 2 experts);
// a multiple of 8, the row group of the gemv kernels' shared horizontal sums.
inline int64_t task_rows(int64_t row_bytes, int64_t task_bytes, int64_t total_rows,
                         int num_threads) {
  const int64_t by_bytes = task_bytes / row_bytes;
  const int64_t by_balance = ceil_div(total_rows, kTasksPerThread * num_threads);
  return round_up(std::max<int64_t>(1, std::min(by_bytes, by_balance)), 8);
}

}  // namespace ftjax
