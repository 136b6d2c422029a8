// The start / finish pair on the CUDA platform: the same runner (async_experts.cc) and
// kernels as the CPU handlers, reached through the compute stream.
//
//   start:  x, layer, ids, weights --D2H into pinned staging--> host function on the
//           stream: copy the staged inputs into an AsyncExpertCall, queue it on the
//           runner (it computes while the stream goes on with the device half)
//   finish: host function on the stream: wait for the call, write y into pinned
//           staging --H2D--> y; the stream waits there, after the device half
//
// Starts and finishes pair up in program order on a stream (a per-stream FIFO): the
// handler cannot read the token, which lives in device memory. A host function may call
// no CUDA API, so pinned buffers are freed by the next handler call on the host thread.
// A failed host task cannot fail the handler that queued it (that returned long ago):
// its y is zeros and the error is returned by the next start or finish handler.
// Built only where the CUDA toolkit is found (CMake option FTJAX_CUDA); CANNOT RUN on a
// machine without a GPU, so only the build and the registration are tested there.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "async_experts.h"
#include "ffi_common.h"
#include "ffi_handler.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct StagedCall {
  ftjax::AsyncExpertCall proto;  // geometry, pool, threads, isa (inputs filled in later)
  float* x = nullptr;
  int32_t* ids = nullptr;
  float* weights = nullptr;
  int32_t* layer = nullptr;
  float* y = nullptr;
  int32_t* token_out = nullptr;
  int64_t n_x = 0, n_ids = 0;
  int32_t token = 0;  // the runner's, set by the host function (0: nothing queued)
};

std::mutex mutex;
std::map<cudaStream_t, std::deque<StagedCall*>> open_calls;  // started, not finished, per stream
std::vector<StagedCall*> to_free;                               // finished: pinned buffers to release
std::string sticky_error;                                       // a host task's failure, reported next call

std::string take_sticky_error_and_free() {  // on the host thread, under no CUDA callback
  std::vector<StagedCall*> done;
  std::string err;
  {
    std::lock_guard<std::mutex> lock(mutex);
    done.swap(to_free);
    err.swap(sticky_error);
  }
  for (StagedCall* c : done) {
    for (void* p : {static_cast<void*>(c->x), static_cast<void*>(c->ids), static_cast<void*>(c->weights),
                    static_cast<void*>(c->layer), static_cast<void*>(c->y), static_cast<void*>(c->token_out)})
      if (p != nullptr) cudaFreeHost(p);
    delete c;
  }
  return err;
}

template <typename T>
T* pinned(int64_t count) {
  void* p = nullptr;
  if (cudaMallocHost(&p, std::max<int64_t>(count, 1) * sizeof(T)) != cudaSuccess) throw std::bad_alloc();
  return static_cast<T*>(p);
}

void CUDART_CB submit_staged(void* arg) {  // host function: the inputs have landed in staging
  auto* c = static_cast<StagedCall*>(arg);
  if (std::none_of(c->ids, c->ids + c->n_ids, [](int32_t i) { return i >= 0; })) return;  // token stays 0
  auto call = std::make_unique<ftjax::AsyncExpertCall>(c->proto);
  call->layer = c->layer[0];
  call->x.assign(c->x, c->x + c->n_x);
  call->ids.assign(c->ids, c->ids + c->n_ids);
  call->weights.assign(c->weights, c->weights + c->n_ids);
  c->token = ftjax::start_expert_call(std::move(call));
}

void CUDART_CB collect(void* arg) {  // host function: after the device half; waits for the host's result
  auto* c = static_cast<StagedCall*>(arg);
  std::string err;
  if (c->token == 0) {
    std::fill(c->y, c->y + c->n_x, 0.0f);
  } else {
    err = ftjax::finish_expert_call(c->token, c->y, c->n_x);
    if (!err.empty()) std::fill(c->y, c->y + c->n_x, 0.0f);
  }
  std::lock_guard<std::mutex> lock(mutex);
  if (!err.empty() && sticky_error.empty()) sticky_error = err;
}

void CUDART_CB release(void* arg) {  // host function: y has been copied out
  std::lock_guard<std::mutex> lock(mutex);
  to_free.push_back(static_cast<StagedCall*>(arg));
}

ffi::Error cuda_error(const char* what, cudaError_t e) {
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

ffi::Error start_cuda(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                      ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> weights, ffi::ResultBuffer<ffi::S32> token,
                      int32_t pool_id, int64_t num_layers, int64_t num_experts, int64_t d_model, int64_t d_ff,
                      int32_t dtype, int32_t down_dtype, float swiglu_limit, int64_t threads, int32_t isa) {
  if (std::string err = take_sticky_error_and_free(); !err.empty())
    return ffi::Error::Internal("ftjax_expert_start (an earlier host task): " + err);
  auto xd = x.dimensions(), idd = ids.dimensions();
  if (xd.size() != 2 || xd[1] != d_model || idd.size() != 2 || idd[0] != xd[0] ||
      weights.element_count() != ids.element_count() || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("ftjax_expert_start: x [T, d_model], layer [], ids / weights [T, K]");
  auto owned = std::make_unique<StagedCall>();
  if (std::string err = ftjax::view_expert_pool("ftjax_expert_start", pool_id, num_layers, num_experts, d_model, d_ff,
                                                dtype, down_dtype, swiglu_limit, &owned->proto.pool,
                                                &owned->proto.work);
      !err.empty())
    return ffi::Error::InvalidArgument(err);
  StagedCall* c = owned.release();  // the stream's FIFO owns it from here (freed after its finish)
  c->proto.num_tokens = xd[0];
  c->proto.top_k = idd[1];
  c->proto.threads = ftjax::shared_thread_pool(static_cast<int>(threads));
  c->proto.isa = static_cast<ftjax::Isa>(isa);
  c->n_x = x.element_count();
  c->n_ids = ids.element_count();
  c->x = pinned<float>(c->n_x);
  c->ids = pinned<int32_t>(c->n_ids);
  c->weights = pinned<float>(c->n_ids);
  c->layer = pinned<int32_t>(1);
  c->y = pinned<float>(c->n_x);
  c->token_out = pinned<int32_t>(1);
  cudaError_t e = cudaMemcpyAsync(c->x, x.typed_data(), c->n_x * sizeof(float), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(c->ids, ids.typed_data(), c->n_ids * sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(c->weights, weights.typed_data(), c->n_ids * sizeof(float), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(c->layer, layer.typed_data(), sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaLaunchHostFunc(stream, submit_staged, c);
  {
    std::lock_guard<std::mutex> lock(mutex);
    open_calls[stream].push_back(c);
    c->token_out[0] = static_cast<int32_t>(open_calls[stream].size());  // informational: the FIFO pairs them
  }
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(token->typed_data(), c->token_out, sizeof(int32_t), cudaMemcpyHostToDevice, stream);
  return e == cudaSuccess ? ffi::Error::Success() : cuda_error("ftjax_expert_start", e);
}

ffi::Error finish_cuda(cudaStream_t stream, ffi::Buffer<ffi::S32> token, ffi::AnyBuffer after,
                       ffi::ResultBuffer<ffi::F32> y) {
  (void)token;
  (void)after;  // ordering operands
  if (std::string err = take_sticky_error_and_free(); !err.empty())
    return ffi::Error::Internal("ftjax_expert_finish (a host task): " + err);
  StagedCall* c = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto& open = open_calls[stream];
    if (open.empty()) return ffi::Error::Internal("ftjax_expert_finish: no open start on this stream");
    c = open.front();
    open.pop_front();
  }
  if (static_cast<int64_t>(y->element_count()) != c->n_x) return ffi::Error::InvalidArgument("ftjax_expert_finish: y must be [T, D]");
  cudaError_t e = cudaLaunchHostFunc(stream, collect, c);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(y->typed_data(), c->y, c->n_x * sizeof(float), cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) e = cudaLaunchHostFunc(stream, release, c);
  return e == cudaSuccess ? ffi::Error::Success() : cuda_error("ftjax_expert_finish", e);
}

ffi::Error start_cuda_impl(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> weights,
                           ffi::ResultBuffer<ffi::S32> token, int32_t pool_id, int64_t num_layers,
                           int64_t num_experts, int64_t d_model, int64_t d_ff, int32_t dtype, int32_t down_dtype,
                           float swiglu_limit, int64_t threads, int32_t isa) noexcept {
  return ftjax::guarded("ftjax_expert_start", [&] {
    return start_cuda(stream, x, layer, ids, weights, token, pool_id, num_layers, num_experts, d_model, d_ff, dtype,
                      down_dtype, swiglu_limit, threads, isa);
  });
}

ffi::Error finish_cuda_impl(cudaStream_t stream, ffi::Buffer<ffi::S32> token, ffi::AnyBuffer after,
                            ffi::ResultBuffer<ffi::F32> y) noexcept {
  return ftjax::guarded("ftjax_expert_finish", [&] { return finish_cuda(stream, token, after, y); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxExpertStartCuda, start_cuda_impl,
                              ftjax::expert_pool_attrs(ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights [T, K]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // token []
                                  ));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxExpertFinishCuda, finish_cuda_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // token []
                                  .Arg<ffi::AnyBuffer>()         // after: ordering only
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [T, D]
