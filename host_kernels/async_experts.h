// The routed-expert host kernel as a start / finish pair, so that a compiled step's
// device half runs while the host computes the missed experts:
//
//   token = start(x, layer, ids, weights)    copies the inputs, queues the call, returns
//   ... device work (the cached experts, attention of other rows) ...
//   y     = finish(token)                    waits for that call, copies y out
//
// One background thread (the runner) takes queued calls in order and runs each with
// `expert_ffn` on the process's shared worker pool (the runner is that job's calling
// thread), so concurrent steps still see the whole pool one job at a time. Inputs are
// copied at start: XLA may reuse their buffers as soon as the start handler returns.
// A call with no id >= 0 queues nothing (token 0; finish writes zeros). A task that
// fails (bad layer, an injected fault, std::bad_alloc) keeps its message and finish
// returns it. A step that fails between start and finish leaves its call behind; a
// call done more than a minute ago is discarded at the next start (a finish comes
// within one layer's device work of its start), or at once by `drop_finished_calls`.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "expert_ffn.h"

namespace ftjax {

struct AsyncExpertCall {
  PoolView pool;
  int64_t layer = 0;
  int64_t num_tokens = 0, top_k = 0;
  std::vector<float> x;          // [T, D]
  std::vector<int32_t> ids;      // [T, K]
  std::vector<float> weights;    // [T, K]
  std::vector<float> y;          // [T, D], written by the runner
  ThreadPool* threads = nullptr;
  Isa isa = Isa::kAuto;
  int64_t* work = nullptr;       // the pool's {calls, ns, experts} counters, or null
  bool fail = false;             // an injected fault: the runner reports it instead of running
};

// Queue a call -> its token (> 0). Thread-safe.
int32_t start_expert_call(std::unique_ptr<AsyncExpertCall> call);

// Wait for `token`'s call and copy its y ([T, D], `count` floats) into `y` -> "" or the
// error message (unknown token, a failed call, a size mismatch). The call is forgotten.
std::string finish_expert_call(int32_t token, float* y, int64_t count);

// Calls queued or done but not collected (finish not called yet).
int64_t pending_expert_calls();

// Wait for every queued call, then forget the uncollected ones done at least
// `older_than_s` seconds ago -> how many. A finish still waiting for one returns an error.
int64_t drop_finished_calls(double older_than_s);

}  // namespace ftjax
