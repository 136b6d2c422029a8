#include "registry.h"

#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace ftjax {
namespace {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

ThreadPool* shared_thread_pool(int num_threads) {
  static auto* pools = new std::map<int, std::unique_ptr<ThreadPool>>();  // never freed: workers outlive exit order
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& pool = (*pools)[num_threads];
  if (!pool) pool = std::make_unique<ThreadPool>(num_threads);
  return pool.get();
}

namespace {
std::vector<std::optional<ExpertPoolAddresses>>& pools() {
  static auto* v = new std::vector<std::optional<ExpertPoolAddresses>>();
  return *v;
}
}  // namespace

int32_t register_expert_pool(const ExpertPoolAddresses& pool) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& v = pools();
  for (size_t i = 0; i < v.size(); ++i)
    if (!v[i]) {
      v[i] = pool;
      return static_cast<int32_t>(i);
    }
  v.push_back(pool);
  return static_cast<int32_t>(v.size() - 1);
}

void unregister_expert_pool(int32_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& v = pools();
  if (id >= 0 && static_cast<size_t>(id) < v.size()) v[id].reset();
}

std::optional<ExpertPoolAddresses> expert_pool(int32_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& v = pools();
  if (id < 0 || static_cast<size_t>(id) >= v.size()) return std::nullopt;
  return v[id];
}

}  // namespace ftjax
