#include "async_experts.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <new>
#include <thread>

namespace ftjax {
namespace {

using Clock = std::chrono::steady_clock;

struct Slot {
  std::unique_ptr<AsyncExpertCall> call;
  bool done = false;
  Clock::time_point done_at;
  std::string error;
};

// The runner: one thread, started on first use and kept for the process (as the
// shared worker pools are); calls run in the order they were started.
class Runner {
 public:
  Runner() : thread_([this] { loop(); }) { thread_.detach(); }

  int32_t submit(std::unique_ptr<AsyncExpertCall> call) {
    std::lock_guard<std::mutex> lock(mutex_);
    erase_done_before(Clock::now() - std::chrono::seconds(kStaleSeconds));
    if (++last_token_ <= 0) last_token_ = 1;  // wraps after 2^31 calls; 0 means "no call"
    const int32_t token = last_token_;
    slots_[token].call = std::move(call);
    queue_.push_back(token);
    work_cv_.notify_one();
    return token;
  }

  std::string finish(int32_t token, float* y, int64_t count) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto found = [&] { return slots_.find(token); };
    done_cv_.wait(lock, [&] { auto it = found(); return it == slots_.end() || it->second.done; });
    auto it = found();  // looked up again: a drop may have run while this waited
    if (it == slots_.end())
      return "no pending host call " + std::to_string(token) + " (finished already, or dropped as stale)";
    Slot slot = std::move(it->second);
    slots_.erase(it);
    lock.unlock();
    if (!slot.error.empty()) return slot.error;
    if (static_cast<int64_t>(slot.call->y.size()) != count)
      return "result of " + std::to_string(slot.call->y.size()) + " floats, expected " + std::to_string(count);
    std::copy(slot.call->y.begin(), slot.call->y.end(), y);
    return "";
  }

  int64_t pending() {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int64_t>(slots_.size());
  }

  int64_t drop(double older_than_s) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [&] { return queue_.empty() && !running_; });
    const int64_t n = erase_done_before(Clock::now() - std::chrono::duration_cast<Clock::duration>(
                                                          std::chrono::duration<double>(older_than_s)));
    done_cv_.notify_all();  // a finish waiting on a dropped token returns its error
    return n;
  }

 private:
  // A finish comes within one layer's device work of its start; a call done this long
  // ago belongs to a step that failed between the two, and nobody will collect it.
  static constexpr int kStaleSeconds = 60;

  int64_t erase_done_before(Clock::time_point limit) {  // under mutex_
    int64_t n = 0;
    for (auto it = slots_.begin(); it != slots_.end();) {
      if (it->second.done && it->second.done_at <= limit) {
        it = slots_.erase(it);
        ++n;
      } else {
        ++it;
      }
    }
    return n;
  }

  void loop() {
    for (;;) {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [&] { return !queue_.empty(); });
      const int32_t token = queue_.front();
      queue_.pop_front();
      AsyncExpertCall* call = slots_[token].call.get();
      running_ = true;
      lock.unlock();
      std::string error = run(*call);
      lock.lock();
      running_ = false;
      auto it = slots_.find(token);
      if (it != slots_.end()) {  // (drop() waits for the running call, so it is there)
        it->second.done = true;
        it->second.done_at = Clock::now();
        it->second.error = std::move(error);
      }
      done_cv_.notify_all();
    }
  }

  static std::string run(AsyncExpertCall& c) noexcept {
    try {
      if (c.fail) return "injected host kernel fault (test hook)";
      const auto t0 = std::chrono::steady_clock::now();
      c.y.assign(c.x.size(), 0.0f);
      TokenBatch batch{c.x.data(), c.ids.data(), c.weights.data(), c.y.data(), c.num_tokens, c.top_k};
      int64_t experts = 0;
      std::string err = expert_ffn(c.pool, c.layer, batch, c.threads, c.isa, &experts);
      if (!err.empty()) return err;
      if (c.work != nullptr) {
        const int64_t ns =
            std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
        __atomic_fetch_add(&c.work[0], 1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&c.work[1], ns, __ATOMIC_RELAXED);
        __atomic_fetch_add(&c.work[2], experts, __ATOMIC_RELAXED);
      }
      return "";
    } catch (const std::bad_alloc& e) {
      return std::string("out of memory (std::bad_alloc: ") + e.what() + ")";
    } catch (const std::exception& e) {
      return e.what();
    } catch (...) {
      return "unknown C++ exception";
    }
  }

  std::mutex mutex_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<int32_t> queue_;
  std::map<int32_t, Slot> slots_;
  int32_t last_token_ = 0;
  bool running_ = false;
  std::thread thread_;
};

Runner& runner() {
  static Runner* r = new Runner();  // never destroyed: its detached thread outlives static teardown
  return *r;
}

}  // namespace

int32_t start_expert_call(std::unique_ptr<AsyncExpertCall> call) { return runner().submit(std::move(call)); }

std::string finish_expert_call(int32_t token, float* y, int64_t count) { return runner().finish(token, y, count); }

int64_t pending_expert_calls() { return runner().pending(); }

int64_t drop_finished_calls(double older_than_s) { return runner().drop(older_than_s); }

}  // namespace ftjax
