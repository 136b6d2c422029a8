// Pieces every XLA FFI handler file shares: the exception guard, and the attributes
// that name an expert pool and how to run its kernel.
#pragma once

#include <exception>
#include <new>
#include <string>

#include "expert_ffn.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ftjax {

// No C++ exception may cross the FFI boundary into XLA (it would call std::terminate
// and kill the process): every handler body runs inside `guarded`, which turns an
// exception (std::bad_alloc from an absurd scratch size, std::length_error, ...) into
// an ffi::Error carrying the message, raised in Python as a runtime error.
template <typename Body>
xla::ffi::Error guarded(const char* target, Body&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc& e) {
    return xla::ffi::Error::Internal(std::string(target) + ": out of memory (std::bad_alloc: " + e.what() + ")");
  } catch (const std::exception& e) {
    return xla::ffi::Error::Internal(std::string(target) + ": " + e.what());
  } catch (...) {
    return xla::ffi::Error::Internal(std::string(target) + ": unknown C++ exception");
  }
}

// The routed-expert handlers' attributes, in order: pool_id (int32: the registry id),
// num_layers, num_experts, d_model, d_ff (int64), dtype, down_dtype (int32 WeightType
// codes of gate_up and down), swiglu_limit (float; inf: plain SwiGLU), threads (int64),
// isa (int32).
template <typename Binding>
auto expert_pool_attrs(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Attr<int32_t>("pool_id")
      .template Attr<int64_t>("num_layers")
      .template Attr<int64_t>("num_experts")
      .template Attr<int64_t>("d_model")
      .template Attr<int64_t>("d_ff")
      .template Attr<int32_t>("dtype")
      .template Attr<int32_t>("down_dtype")
      .template Attr<float>("swiglu_limit")
      .template Attr<int64_t>("threads")
      .template Attr<int32_t>("isa");
}

// The expert pool the routed-expert attributes name -> "" with *view (and *work, its
// {calls, ns, experts} counters or null) filled in, or the message a handler returns
// (an unknown dtype code, a pool id no longer registered).
inline std::string view_expert_pool(const std::string& target, int32_t pool_id, int64_t num_layers,
                                    int64_t num_experts, int64_t d_model, int64_t d_ff, int32_t dtype,
                                    int32_t down_dtype, float swiglu_limit, PoolView* view, int64_t** work) {
  if (!is_weight_type(dtype) || !is_weight_type(down_dtype)) return target + ": unknown dtype code";
  const auto addresses = expert_pool(pool_id);
  if (!addresses)
    return target + ": no expert pool is registered as " + std::to_string(pool_id) + " (its model was freed)";
  *view = PoolView{addresses->gate_up, addresses->down, num_layers, num_experts, d_model, d_ff,
                   static_cast<WeightType>(dtype), static_cast<WeightType>(down_dtype), swiglu_limit};
  *work = addresses->work;
  return "";
}

}  // namespace ftjax
