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

std::vector<double> read_bandwidth_gbps(ThreadPool* threads, int64_t num_bytes,
                                        int repeats, Isa isa) {
  const Kernels* kernels = select_kernels(isa);
  if (kernels == nullptr) throw std::invalid_argument("requested ISA is not available");
  const int64_t bytes = std::max<int64_t>(kChunkBytes, num_bytes / kChunkBytes * kChunkBytes);
  std::unique_ptr<void, FreeDeleter> buffer(std::aligned_alloc(64, bytes));
  if (!buffer) throw std::bad_alloc();
  std::memset(buffer.get(), 0x3c, bytes);  // touch every page: no shared zero page
  const float* data = static_cast<const float*>(buffer.get());
  const int64_t chunk_floats = kChunkBytes / 4;
  const int64_t num_chunks = bytes / kChunkBytes;
  std::vector<float> sink(num_chunks);

  auto pass = [&] {
    parallel_for(threads, num_chunks, [&](int64_t i) {
      sink[i] = kernels->sum(data + i * chunk_floats, chunk_floats);
    });
  };
  pass();
  std::vector<double> gbps;
  for (int r = 0; r < repeats; ++r) {
    auto start = std::chrono::steady_clock::now();
    pass();
    std::chrono::duration<double> s = std::chrono::steady_clock::now() - start;
    gbps.push_back(static_cast<double>(bytes) / s.count() / 1e9);
  }
  volatile float keep = sink[0];
  (void)keep;
  return gbps;
}

}  // namespace ftjax
