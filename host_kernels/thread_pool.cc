#include "thread_pool.h"

#include <chrono>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FTJAX_PAUSE() std::this_thread::yield()
#else
#define FTJAX_PAUSE() std::this_thread::yield()
#endif

namespace ftjax {
namespace {

constexpr auto kSpin = std::chrono::microseconds(30);  // covers the gap between two jobs

// Polls `done` for up to kSpin; true if it became true.
template <typename Pred>
bool spin_until(Pred done) {
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  for (int i = 0;; ++i) {
    if (done()) return true;
    FTJAX_PAUSE();
    if (i % 4 == 3 && std::chrono::steady_clock::now() > deadline) return false;
  }
}

}  // namespace

int hardware_cores() {
  unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

ThreadPool::ThreadPool(int num_threads)
    : num_threads_(num_threads > 0 ? num_threads : hardware_cores()) {
  workers_.reserve(num_threads_ - 1);
  for (int i = 0; i + 1 < num_threads_; ++i) {
    workers_.emplace_back([this] { worker_loop(); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
  }
  start_cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::drain(const Job& job) {
  try {
    for (;;) {
      const int64_t i = next_task_.fetch_add(1, std::memory_order_relaxed);
      if (i >= job.num_tasks) return;
      job.fn(job.ctx, i);
    }
  } catch (...) {
    // Keep the first exception for the caller and hand out no more tasks: the threads
    // still inside one finish it, then the job ends.
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = std::current_exception();
    next_task_.store(job.num_tasks, std::memory_order_relaxed);
  }
}

bool ThreadPool::try_join(uint64_t generation) {
  uint64_t s = job_state_.load(std::memory_order_acquire);
  for (;;) {
    if ((s >> 32) != (generation & 0xFFFFFFFFu) || (s & kClosed)) return false;
    if (job_state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) return true;
  }
}

void ThreadPool::leave() {
  const uint64_t s = job_state_.fetch_sub(1, std::memory_order_acq_rel) - 1;
  if ((s & kClosed) && (s & kJoinedMask) == 0) {
    { std::lock_guard<std::mutex> lock(mutex_); }  // the caller is checking or waiting
    done_cv_.notify_one();
  }
}

bool ThreadPool::all_left() const {
  return (job_state_.load(std::memory_order_acquire) & kJoinedMask) == 0;
}

void ThreadPool::run(int64_t num_tasks, TaskFn fn, void* ctx) {
  std::lock_guard<std::mutex> submit(submit_mutex_);
  Job job{fn, ctx, num_tasks};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = job;
    next_task_.store(0, std::memory_order_relaxed);
    const uint64_t generation = generation_.load(std::memory_order_relaxed) + 1;
    job_state_.store((generation & 0xFFFFFFFFu) << 32, std::memory_order_release);
    generation_.store(generation, std::memory_order_release);
  }
  start_cv_.notify_all();
  drain(job);
  // No new worker may join now; wait for those inside a task, so that `ctx` (on the
  // caller's stack) outlives its last use.
  job_state_.fetch_or(kClosed, std::memory_order_acq_rel);
  if (!spin_until([this] { return all_left(); })) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [this] { return all_left(); });
  }
  // Every worker has left (its leave() released its write of error_): a task's
  // exception is now the caller's, and the slot is empty for the next job.
  if (std::exception_ptr error = std::exchange(error_, nullptr)) std::rethrow_exception(error);
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    auto new_job = [&] {
      return stop_.load(std::memory_order_relaxed) ||
             generation_.load(std::memory_order_acquire) != seen;
    };
    if (!spin_until(new_job)) {
      std::unique_lock<std::mutex> lock(mutex_);
      start_cv_.wait(lock, new_job);
    }
    if (stop_.load()) return;
    Job job;
    {
      std::lock_guard<std::mutex> lock(mutex_);  // job_ is written under the mutex
      seen = generation_.load(std::memory_order_acquire);
      job = job_;
    }
    if (!try_join(seen)) continue;  // the caller already finished this job
    drain(job);
    leave();
  }
}

}  // namespace ftjax
