// Persistent worker pool for the host expert kernels.
//
// Design: `num_threads - 1` workers are created once; the calling thread is the
// last worker, so a pool of 1 runs inline and nothing is ever created per call. A
// job is `num_tasks` independent tasks handed out through one atomic counter
// (dynamic balancing: a slow core just takes fewer tasks). A worker must *join* a
// job before taking tasks, and the caller closes the job once it has drained the
// counter itself, so a call never waits for a worker that was asleep or
// descheduled (on a busy machine the caller simply does the work); it only waits
// for workers still inside a task. After a job, workers spin briefly (yielding)
// before sleeping on a condition variable: an expert FFN call is two jobs back to
// back. Jobs from concurrent callers (two Python threads, two XLA programs) are
// serialised by `submit_mutex_`, so a kernel call always sees the whole pool.
// A task that throws (std::bad_alloc, ...) ends its job: no further task is handed
// out, and `run` rethrows the first exception on the calling thread once every worker
// has left, so an exception never unwinds a worker (std::terminate) and the pool
// stays usable.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace ftjax {

class ThreadPool {
 public:
  using TaskFn = void (*)(void* ctx, int64_t task);

  explicit ThreadPool(int num_threads);  // <= 0 means hardware cores
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Runs fn(ctx, i) for i in [0, num_tasks) on all threads; returns when all are done.
  // If a task throws, the job stops early and the first exception is rethrown here.
  void run(int64_t num_tasks, TaskFn fn, void* ctx);

 private:
  struct Job {
    TaskFn fn = nullptr;
    void* ctx = nullptr;
    int64_t num_tasks = 0;
  };

  void worker_loop();
  void drain(const Job& job);
  bool try_join(uint64_t generation);
  void leave();
  bool all_left() const;

  // job_state_ = [generation (low 32 bits) : 32 | closed : 1 | joined workers : 31]
  static constexpr uint64_t kClosed = uint64_t(1) << 31;
  static constexpr uint64_t kJoinedMask = kClosed - 1;

  int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex submit_mutex_;  // one job at a time
  std::mutex mutex_;         // sleeping and waking; job_ is written, error_ set, under it
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  Job job_;
  std::exception_ptr error_;  // the current job's first task exception
  std::atomic<uint64_t> generation_{0};  // bumped (release) after job_ is written
  std::atomic<uint64_t> job_state_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> next_task_{0};
};

// Type-erasing helper: parallel_for(pool, n, [&](int64_t i) { ... }).
template <typename F>
void parallel_for(ThreadPool* pool, int64_t num_tasks, F&& body) {
  using Body = std::remove_reference_t<F>;
  auto trampoline = [](void* ctx, int64_t i) { (*static_cast<Body*>(ctx))(i); };
  if (pool == nullptr || pool->num_threads() == 1 || num_tasks <= 1) {
    for (int64_t i = 0; i < num_tasks; ++i) body(i);
    return;
  }
  pool->run(num_tasks, trampoline, const_cast<void*>(static_cast<const void*>(&body)));
}

int hardware_cores();

}  // namespace ftjax
