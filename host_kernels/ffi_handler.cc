#include "ffi_handler.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "async_experts.h"
#include "attention.h"
#include "expert_ffn.h"
#include "linear.h"
#include "ffi_common.h"
#include "registry.h"

namespace ffi = xla::ffi;

namespace ftjax {

namespace {
std::atomic<int64_t> injected_expert_faults{0};  // calls still to fail (inject_expert_faults)
}  // namespace

void inject_expert_faults(int64_t n) { injected_expert_faults.store(n, std::memory_order_relaxed); }

bool take_injected_expert_fault() {
  // Only a positive count is decremented, so concurrent calls take distinct faults.
  int64_t n = injected_expert_faults.load(std::memory_order_relaxed);
  while (n > 0 && !injected_expert_faults.compare_exchange_weak(n, n - 1, std::memory_order_relaxed)) continue;
  return n > 0;
}

}  // namespace ftjax

namespace {

using ftjax::Isa;
using ftjax::WeightType;

// What the routed-expert handler did, for online bandwidth calibration: the pool's
// registered int64[3] {calls, nanoseconds in the kernel, distinct experts read (the kernel's own
// count)}, added to at the end of each call (atomically; the step's host work is done by
// the time Python reads it).
void record_host_work(int64_t* stats, int64_t experts, std::chrono::steady_clock::time_point start) {
  if (stats == nullptr) return;
  int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                   std::chrono::steady_clock::now() - start).count();
  __atomic_fetch_add(&stats[0], 1, __ATOMIC_RELAXED);
  __atomic_fetch_add(&stats[1], ns, __ATOMIC_RELAXED);
  __atomic_fetch_add(&stats[2], experts, __ATOMIC_RELAXED);
}

ffi::Error expert_ffn_body(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> weights,
                           ffi::ResultBuffer<ffi::F32> y, int32_t pool_id, int64_t num_layers,
                           int64_t num_experts, int64_t d_model, int64_t d_ff, int32_t dtype,
                           int32_t down_dtype, float swiglu_limit, int64_t threads, int32_t isa) {
  auto start = std::chrono::steady_clock::now();
  auto xd = x.dimensions(), idd = ids.dimensions(), wd = weights.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || xd[1] != d_model)
    return ffi::Error::InvalidArgument("ftjax_expert_ffn: x must be [T, d_model]");
  if (idd.size() != 2 || idd[0] != xd[0] || wd.size() != 2 || wd[0] != idd[0] ||
      wd[1] != idd[1])
    return ffi::Error::InvalidArgument("ftjax_expert_ffn: ids, weights must be [T, K]");
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != xd[1])
    return ffi::Error::InvalidArgument("ftjax_expert_ffn: y must be [T, d_model]");
  if (layer.element_count() != 1)
    return ffi::Error::InvalidArgument("ftjax_expert_ffn: layer must be a scalar");
  ftjax::PoolView pool;
  int64_t* work = nullptr;
  if (std::string err = ftjax::view_expert_pool("ftjax_expert_ffn", pool_id, num_layers, num_experts, d_model, d_ff,
                                                dtype, down_dtype, swiglu_limit, &pool, &work);
      !err.empty())
    return ffi::Error::InvalidArgument(err);
  ftjax::TokenBatch batch{x.typed_data(), ids.typed_data(), weights.typed_data(),
                          y->typed_data(), xd[0], idd[1]};
  if (ftjax::take_injected_expert_fault())
    return ffi::Error::Internal("ftjax_expert_ffn: injected host kernel fault (test hook)");
  int64_t experts_read = 0;
  std::string err = ftjax::expert_ffn(pool, layer.typed_data()[0], batch,
                                      ftjax::shared_thread_pool(static_cast<int>(threads)),
                                      static_cast<Isa>(isa), &experts_read);
  if (!err.empty()) return ffi::Error::InvalidArgument("ftjax_expert_ffn: " + err);
  record_host_work(work, experts_read, start);
  return ffi::Error::Success();
}

// The weight type comes as the `wtype` attribute (a block matrix is a uint8 buffer
// [N, row bytes]: its dtype cannot name the format); the buffer's dtype must match it.
ffi::Error linear_body(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y,
                       int32_t wtype_code, int64_t threads, int32_t isa) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (!ftjax::is_weight_type(wtype_code))
    return ffi::Error::InvalidArgument("ftjax_linear: unknown wtype code " + std::to_string(wtype_code));
  const WeightType wtype = static_cast<WeightType>(wtype_code);
  const ffi::DataType want = wtype == WeightType::kF32    ? ffi::F32
                             : wtype == WeightType::kBF16 ? ffi::U16
                                                          : ffi::U8;
  if (w.element_type() != want)
    return ffi::Error::InvalidArgument(
        "ftjax_linear: w must be f32 (wtype f32), uint16 bf16 bits (bf16) or uint8 rows of blocks (block types)");
  if (wd.size() != 2 || xd.size() != 2)
    return ffi::Error::InvalidArgument("ftjax_linear: need x [T, K] and w [N, K] (block types: [N, row bytes])");
  int64_t K = wd[1];
  if (ftjax::is_block_type(wtype)) {
    const int64_t block_bytes = ftjax::row_bytes(wtype, ftjax::block_weights(wtype));
    if (K % block_bytes)
      return ffi::Error::InvalidArgument("ftjax_linear: a row of " + std::to_string(K) +
                                         " bytes is not whole blocks of " + std::to_string(block_bytes));
    K = K / block_bytes * ftjax::block_weights(wtype);
  }
  if (xd[1] != K)
    return ffi::Error::InvalidArgument("ftjax_linear: x [T, " + std::to_string(xd[1]) + "] but w rows hold " +
                                       std::to_string(K) + " weights");
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[0])
    return ffi::Error::InvalidArgument("ftjax_linear: y must be [T, N]");
  ftjax::DenseView view{w.untyped_data(), wd[0], K, wtype};
  std::string err = ftjax::linear(view, x.typed_data(), xd[0], y->typed_data(),
                                  ftjax::shared_thread_pool(static_cast<int>(threads)),
                                  static_cast<Isa>(isa));
  if (!err.empty()) return ffi::Error::InvalidArgument("ftjax_linear: " + err);
  return ffi::Error::Success();
}

ffi::Error attention_body(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> kv_len,
                          ffi::ResultBuffer<ffi::F32> out, int64_t window, int64_t threads, int32_t isa) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), od = out->dimensions();
  if (k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("ftjax_attention: k and v must have one dtype");
  WeightType kv_type;
  if (k.element_type() == ffi::BF16 || k.element_type() == ffi::U16)
    kv_type = WeightType::kBF16;
  else if (k.element_type() == ffi::F32)
    kv_type = WeightType::kF32;
  else
    return ffi::Error::InvalidArgument("ftjax_attention: k, v must be f32 or bf16");
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || od.size() != 4)
    return ffi::Error::InvalidArgument("ftjax_attention: q, out [B, T, H, hd]; k, v [B, G, S, hd]");
  for (int i = 0; i < 4; ++i)
    if (kd[i] != vd[i] || od[i] != qd[i])
      return ffi::Error::InvalidArgument("ftjax_attention: k / v or q / out shapes differ");
  if (kd[0] != qd[0] || kd[3] != qd[3] || positions.element_count() != qd[0] * qd[1] ||
      kv_len.element_count() != qd[0])
    return ffi::Error::InvalidArgument("ftjax_attention: batch, head dim, positions [B, T] or kv_len [B] mismatch");
  ftjax::AttentionArgs args{q.typed_data(), k.untyped_data(), v.untyped_data(), kv_type,
                            positions.typed_data(), kv_len.typed_data(),
                            qd[0], qd[1], qd[2], kd[1], kd[2], qd[3], window, out->typed_data()};
  std::string err = ftjax::attention(args, ftjax::shared_thread_pool(static_cast<int>(threads)),
                                     static_cast<Isa>(isa));
  if (!err.empty()) return ffi::Error::InvalidArgument("ftjax_attention: " + err);
  return ffi::Error::Success();
}

ffi::Error attention_impl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> kv_len,
                          ffi::ResultBuffer<ffi::F32> out, int64_t window, int64_t threads,
                          int32_t isa) noexcept {
  return ftjax::guarded("ftjax_attention",
                 [&] { return attention_body(q, k, v, positions, kv_len, out, window, threads, isa); });
}

ffi::Error expert_ffn_impl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> weights,
                           ffi::ResultBuffer<ffi::F32> y, int32_t pool_id, int64_t num_layers,
                           int64_t num_experts, int64_t d_model, int64_t d_ff, int32_t dtype,
                           int32_t down_dtype, float swiglu_limit, int64_t threads,
                           int32_t isa) noexcept {
  return ftjax::guarded("ftjax_expert_ffn", [&] {
    return expert_ffn_body(x, layer, ids, weights, y, pool_id, num_layers, num_experts, d_model,
                           d_ff, dtype, down_dtype, swiglu_limit, threads, isa);
  });
}

// The start / finish pair (async_experts.h): start checks and copies the operands,
// queues the call and writes its token; finish waits for the token's result.
ffi::Error expert_start_body(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> ids,
                             ffi::Buffer<ffi::F32> weights, ffi::ResultBuffer<ffi::S32> token, int32_t pool_id,
                             int64_t num_layers, int64_t num_experts, int64_t d_model, int64_t d_ff, int32_t dtype,
                             int32_t down_dtype, float swiglu_limit, int64_t threads, int32_t isa) {
  auto xd = x.dimensions(), idd = ids.dimensions(), wd = weights.dimensions();
  if (xd.size() != 2 || xd[1] != d_model)
    return ffi::Error::InvalidArgument("ftjax_expert_start: x must be [T, d_model]");
  if (idd.size() != 2 || idd[0] != xd[0] || wd.size() != 2 || wd[0] != idd[0] || wd[1] != idd[1])
    return ffi::Error::InvalidArgument("ftjax_expert_start: ids, weights must be [T, K]");
  if (layer.element_count() != 1 || token->element_count() != 1)
    return ffi::Error::InvalidArgument("ftjax_expert_start: layer and the token must be scalars");
  const int32_t* id = ids.typed_data();
  const int64_t n_ids = ids.element_count();
  if (std::none_of(id, id + n_ids, [](int32_t i) { return i >= 0; })) {
    token->typed_data()[0] = 0;  // nothing runs on the host for this record
    return ffi::Error::Success();
  }
  auto call = std::make_unique<ftjax::AsyncExpertCall>();
  if (std::string err = ftjax::view_expert_pool("ftjax_expert_start", pool_id, num_layers, num_experts, d_model, d_ff,
                                                dtype, down_dtype, swiglu_limit, &call->pool, &call->work);
      !err.empty())
    return ffi::Error::InvalidArgument(err);
  call->layer = layer.typed_data()[0];
  call->num_tokens = xd[0];
  call->top_k = idd[1];
  call->x.assign(x.typed_data(), x.typed_data() + x.element_count());
  call->ids.assign(id, id + n_ids);
  call->weights.assign(weights.typed_data(), weights.typed_data() + weights.element_count());
  call->threads = ftjax::shared_thread_pool(static_cast<int>(threads));
  call->isa = static_cast<Isa>(isa);
  call->fail = ftjax::take_injected_expert_fault();
  token->typed_data()[0] = ftjax::start_expert_call(std::move(call));
  return ffi::Error::Success();
}

ffi::Error expert_finish_body(ffi::Buffer<ffi::S32> token, ffi::AnyBuffer after, ffi::ResultBuffer<ffi::F32> y) {
  (void)after;  // an ordering operand: the device work this call was to overlap
  if (token.element_count() != 1) return ffi::Error::InvalidArgument("ftjax_expert_finish: token must be a scalar");
  const int32_t t = token.typed_data()[0];
  float* out = y->typed_data();
  const int64_t count = y->element_count();
  if (t == 0) {
    std::fill(out, out + count, 0.0f);
    return ffi::Error::Success();
  }
  std::string err = ftjax::finish_expert_call(t, out, count);
  if (!err.empty()) return ffi::Error::Internal("ftjax_expert_finish: " + err);
  return ffi::Error::Success();
}

ffi::Error expert_start_impl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> ids,
                             ffi::Buffer<ffi::F32> weights, ffi::ResultBuffer<ffi::S32> token, int32_t pool_id,
                             int64_t num_layers, int64_t num_experts, int64_t d_model, int64_t d_ff, int32_t dtype,
                             int32_t down_dtype, float swiglu_limit, int64_t threads, int32_t isa) noexcept {
  return ftjax::guarded("ftjax_expert_start", [&] {
    return expert_start_body(x, layer, ids, weights, token, pool_id, num_layers, num_experts, d_model, d_ff, dtype,
                             down_dtype, swiglu_limit, threads, isa);
  });
}

ffi::Error expert_finish_impl(ffi::Buffer<ffi::S32> token, ffi::AnyBuffer after,
                              ffi::ResultBuffer<ffi::F32> y) noexcept {
  return ftjax::guarded("ftjax_expert_finish", [&] { return expert_finish_body(token, after, y); });
}

ffi::Error linear_impl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y,
                       int32_t wtype, int64_t threads, int32_t isa) noexcept {
  return ftjax::guarded("ftjax_linear", [&] { return linear_body(x, w, y, wtype, threads, isa); });
}

// Writes new [B, G, T, hd] into cache [B, G, S, hd] at row start[b] of each (b, g), in
// place: the result is aliased to the cache operand, so only the T new rows move (XLA's
// CPU backend would otherwise rewrite a whole bf16 cache around its update). If XLA did
// not alias them (the operand still live elsewhere), the cache is copied first.
ffi::Error write_rows_body(ffi::AnyBuffer cache, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> start,
                           ffi::Result<ffi::AnyBuffer> out) {
  auto cd = cache.dimensions(), rd = rows.dimensions(), od = out->dimensions();
  if (cache.element_type() != rows.element_type() || out->element_type() != cache.element_type())
    return ffi::Error::InvalidArgument("ftjax_write_rows: cache, rows and result must have one dtype");
  if (cd.size() != 4 || rd.size() != 4 || od.size() != 4)
    return ffi::Error::InvalidArgument("ftjax_write_rows: cache [B, G, S, hd], rows [B, G, T, hd]");
  for (int i = 0; i < 4; ++i)
    if (od[i] != cd[i] || (i != 2 && rd[i] != cd[i]))
      return ffi::Error::InvalidArgument("ftjax_write_rows: rows or result shape does not match the cache");
  if (rd[2] > cd[2] || start.element_count() != cd[0])
    return ffi::Error::InvalidArgument("ftjax_write_rows: more rows than the cache holds, or start is not [B]");
  const int64_t B = cd[0], G = cd[1], S = cd[2], T = rd[2];
  const size_t row = cache.size_bytes() / static_cast<size_t>(B * G * S);  // bytes of one [hd] row
  auto* dst = static_cast<char*>(out->untyped_data());
  if (dst != cache.untyped_data()) std::memcpy(dst, cache.untyped_data(), cache.size_bytes());
  const auto* src = static_cast<const char*>(rows.untyped_data());
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s0 = std::clamp<int64_t>(start.typed_data()[b], 0, S - T);  // as dynamic_update_slice
    for (int64_t g = 0; g < G; ++g)
      std::memcpy(dst + ((b * G + g) * S + s0) * row, src + (b * G + g) * T * row, T * row);
  }
  return ffi::Error::Success();
}

ffi::Error write_rows_impl(ffi::AnyBuffer cache, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> start,
                           ffi::Result<ffi::AnyBuffer> out) noexcept {
  return ftjax::guarded("ftjax_write_rows", [&] { return write_rows_body(cache, rows, start, out); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxLinear, linear_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, K]
                                  .Arg<ffi::AnyBuffer>()         // w [N, K] f32 | u16; u8 [N, row bytes]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, N]
                                  .Attr<int32_t>("wtype")        // WeightType code of w
                                  .Attr<int64_t>("threads")
                                  .Attr<int32_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxAttention, attention_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, T, H, hd]
                                  .Arg<ffi::AnyBuffer>()         // k [B, G, S, hd] f32 | bf16
                                  .Arg<ffi::AnyBuffer>()         // v [B, G, S, hd]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [B, T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_len [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [B, T, H, hd]
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("threads")
                                  .Attr<int32_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxExpertFfn, expert_ffn_impl,
                              ftjax::expert_pool_attrs(ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights [T, K]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, D]
                                  ));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxExpertStart, expert_start_impl,
                              ftjax::expert_pool_attrs(ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights [T, K]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // token [] (0: nothing queued)
                                  ));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxExpertFinish, expert_finish_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // token []
                                  .Arg<ffi::AnyBuffer>()         // after: ordering only, not read
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [T, D]

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxWriteRows, write_rows_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // cache [B, G, S, hd] (aliased to the result)
                                  .Arg<ffi::AnyBuffer>()         // rows [B, G, T, hd], the cache's dtype
                                  .Arg<ffi::Buffer<ffi::S32>>()  // start [B]
                                  .Ret<ffi::AnyBuffer>());       // cache with the rows written
