// Pieces every XLA FFI handler file shares: the exception guard, and the attributes
// that name an expert pool and how to run its kernel.
#pragma once

#include <exception>
#include <new>
#include <string>

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

}  // namespace ftjax
