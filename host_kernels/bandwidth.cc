#include "bandwidth.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>

namespace ftjax {
namespace {

constexpr int64_t kChunkBytes = 1 << 20;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

}  // namespace

float sum_streams(const Kernels& kernels, const float* data, int64_t n, int streams) {
  if (streams < 1) throw std::invalid_argument("streams must be at least 1");
  const int64_t part = n / streams, piece = kStreamPieceBytes / 4;
  float total = 0.f;
  for (int64_t offset = 0; offset < part; offset += piece) {
    const int64_t len = std::min(piece, part - offset);
    for (int s = 0; s < streams; ++s) total += kernels.sum(data + s * part + offset, len);
  }
  return total + kernels.sum(data + streams * part, n - streams * part);
}

std::vector<double> read_bandwidth_gbps(ThreadPool* threads, int64_t num_bytes,
                                        int repeats, Isa isa) {
  const Kernels& kernels = require_kernels(isa);
  const int64_t bytes = std::max<int64_t>(kChunkBytes, num_bytes / kChunkBytes * kChunkBytes);
  std::unique_ptr<void, FreeDeleter> buffer(std::aligned_alloc(64, bytes));
  if (!buffer) throw std::bad_alloc();
  std::memset(buffer.get(), 0x3c, bytes);  // touch every page: no shared zero page
  const float* data = static_cast<const float*>(buffer.get());
  const int64_t chunk_floats = kChunkBytes / 4;
  const int64_t num_chunks = bytes / kChunkBytes;
  std::vector<float> sink(num_chunks);

  auto pass = [&](int streams) {
    const auto start = std::chrono::steady_clock::now();
    parallel_for(threads, num_chunks, [&](int64_t i) {
      sink[i] = sum_streams(kernels, data + i * chunk_floats, chunk_floats, streams);
    });
    const std::chrono::duration<double> s = std::chrono::steady_clock::now() - start;
    return static_cast<double>(bytes) / s.count() / 1e9;
  };
  for (int streams : kProbeStreams) pass(streams);
  std::vector<double> gbps;
  for (int r = 0; r < repeats; ++r) {
    double best = 0.0;
    for (int streams : kProbeStreams) best = std::max(best, pass(streams));
    gbps.push_back(best);
  }
  volatile float keep = sink[0];
  (void)keep;
  return gbps;
}

}  // namespace ftjax
