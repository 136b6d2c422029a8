// Read-bandwidth ceiling: sum a buffer much larger than the last-level cache with
// the same worker pool and ISA as the expert kernels. A kernel that streams expert
// weights cannot beat this number; benchmarks report the ratio.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels.h"
#include "thread_pool.h"

namespace ftjax {

// GB/s (1e9 bytes/s) of each of `repeats` timed passes (after one warm-up pass).
std::vector<double> read_bandwidth_gbps(ThreadPool* threads, int64_t num_bytes,
                                        int repeats, Isa isa);

}  // namespace ftjax
