// XLA FFI handlers (CPU platform): the expert FFN and the dense linear layer.
//
// FtjaxExpertFfn:
// Operands: x [T, D] f32, layer [] s32, ids [T, K] s32, weights [T, K] f32.
// Result:   y [T, D] f32.
// Attributes (static, baked into the compiled program; one compile serves every
// layer and expert id; no addresses, so the program is the same in every process,
// see registry.h): pool_id (int32: the host pool's `register_expert_pool` id), num_layers,
// num_experts, d_model, d_ff (int64), dtype (int32: 0 f32, 1 bf16 bits, block formats),
// threads (int64: workers of the process's `shared_thread_pool`), isa (int32: 0 auto,
// 1 scalar, 2 avx2, 3 avx512). The Python owner keeps the pool registered and its arrays
// alive while any program naming its id can run.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxExpertFfn);

// FtjaxExpertStart / FtjaxExpertFinish: the expert FFN as a pair (async_experts.h).
// Start takes FtjaxExpertFfn's operands and attributes and returns a token [] s32
// (0: no id >= 0, nothing queued); finish takes (token, after) and returns y [T, D] f32,
// `after` being any buffer the caller wants computed first (the overlapped device work).
// Both are side-effecting custom calls: the program keeps them, in data-dependency order.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxExpertStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxExpertFinish);
#ifdef FTJAX_WITH_CUDA
// The same pair on the CUDA platform (async_experts_cuda.cc): stream-ordered, pinned staging.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxExpertStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxExpertFinishCuda);
#endif

// FtjaxLinear: y [T, N] f32 = x [T, K] f32 . w^T, w [N, K] an operand (uint16 bf16
// bits or f32, or a block format's uint8 rows [N, row bytes]; on the CPU backend a
// device buffer *is* host memory, read in place). Attributes: wtype (int32 WeightType
// code of w, which must match its dtype), threads, isa as above.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxLinear);

// FtjaxAttention: out [B, T, H, hd] f32 = causal (optionally windowed) GQA attention of
// q [B, T, H, hd] f32 over the keys s < kv_len[b] of k, v [B, G, S, hd] (f32 or bf16),
// read in place; positions [B, T] s32, kv_len [B] s32. Attributes: window (0 = full),
// threads, isa as above.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxAttention);

// FtjaxWriteRows: cache [B, G, S, hd] (any dtype) with rows [B, G, T, hd] written at
// row start[b] (clamped to [0, S - T], as dynamic_update_slice) of every (b, g). Called
// with the result aliased to the cache operand: an in-place write of T rows.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxWriteRows);

namespace ftjax {

// Test hook: the next n routed-expert kernel calls (this handler, and the numpy entry
// point the callback boundary uses) fail with an "injected host kernel fault" error
// instead of running; n = 0 clears. Process-wide; unused, it costs a call one relaxed
// atomic load.
void inject_expert_faults(int64_t n);
// True, consuming one injected fault, if this call is to fail.
bool take_injected_expert_fault();

}  // namespace ftjax
