// Process-wide objects the XLA FFI handlers find by small integers, so a compiled
// program carries no addresses: the same model gives the same program in every process
// and in every model instance, and XLA's persistent compilation cache can serve it (a
// restarted server, a second test building the same model).
//
//   shared_thread_pool(n)   the process's pool of n workers (n <= 0: hardware cores),
//                           created on first use and never freed; the handlers take n.
//   register_expert_pool    a host expert pool's base addresses (and its caller-owned
//                           int64[3] work counters, or null) under the lowest free id;
//                           the Python owner unregisters it when it is freed, and keeps
//                           the arrays alive until then.
#pragma once

#include <cstdint>
#include <optional>

#include "thread_pool.h"

namespace ftjax {

ThreadPool* shared_thread_pool(int num_threads);

struct ExpertPoolAddresses {
  const void* gate_up = nullptr;
  const void* down = nullptr;
  int64_t* work = nullptr;  // {calls, ns, experts} or null
};

int32_t register_expert_pool(const ExpertPoolAddresses& pool);
void unregister_expert_pool(int32_t id);
std::optional<ExpertPoolAddresses> expert_pool(int32_t id);

}  // namespace ftjax
