// Read-bandwidth ceiling: sum a buffer much larger than the last-level cache with
// the same worker pool and ISA as the expert kernels. A kernel that streams expert
// weights should not beat this number; benchmarks report the ratio.
//
// How many sequential streams a core keeps in flight decides what it reads: with one
// stream per thread, a bf16 expert GEMV (top-8 experts read side by side) read 1.34x
// "the ceiling" on a Zen 4 core. So each round reads every chunk as 1, 2, 4 and 8
// streams side by side (`sum_streams`) and reports the fastest of those forms.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels.h"
#include "thread_pool.h"

namespace ftjax {

// The stream counts a probe pass tries.
constexpr int kProbeStreams[] = {1, 2, 4, 8};

// GB/s (1e9 bytes/s) of each of `repeats` timed rounds (after one warm-up pass per form):
// a round times one pass per form of kProbeStreams and keeps the fastest.
std::vector<double> read_bandwidth_gbps(ThreadPool* threads, int64_t num_bytes,
                                        int repeats, Isa isa);

// A stream's piece per turn: a few cache lines. Pieces of 4 KiB (a page of one stream,
// then the next) read no faster than one stream on a Zen 4 core; 512 B as fast as
// streams interleaved line by line.
constexpr int64_t kStreamPieceBytes = 512;

// Sum of data[0, n) read as `streams` sequential streams side by side: the range cut in
// `streams` equal parts (the remainder after them read last), each read a piece of
// kStreamPieceBytes at a time, part after part.
float sum_streams(const Kernels& kernels, const float* data, int64_t n, int streams);

}  // namespace ftjax
