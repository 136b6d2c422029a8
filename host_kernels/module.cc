// nanobind module `ftjax._host_kernels`: numpy entry points into the host expert
// kernels (expert FFN, dense linear), the persistent ThreadPool, the XLA FFI handlers
// as PyCapsules, the read-bandwidth probe, two test hooks (a pool job whose task
// throws, injected expert-kernel faults), and a process's last words on SIGABRT. Every long call releases the GIL. Pool arrays
// are taken without conversion (a silent copy of a multi-GB pool would be a bug).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <new>
#include <stdexcept>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "dequant.h"
#include "attention.h"
#include "bandwidth.h"
#include "expert_ffn.h"
#include "async_experts.h"
#include "ffi_handler.h"
#include "kernels.h"
#include "linear.h"
#include "registry.h"
#include "thread_pool.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace ftjax {
namespace {

// A process of a multi-process model whose coordination client loses the service (in
// process 0) is aborted by that client, from its own C++ thread: JAX offers no way to
// survive it. `exit_on_abort` makes that abort print why and exit with a chosen code.
char g_abort_message[1024];
size_t g_abort_length = 0;
int g_abort_code = 1;

void on_abort(int) {
  ssize_t written = write(STDERR_FILENO, g_abort_message, g_abort_length);
  (void)written;
  _exit(g_abort_code);  // async-signal-safe, unlike exit()
}

void exit_on_abort(const std::string& message, int code) {
  g_abort_length = std::min(message.size() + 1, sizeof(g_abort_message) - 1);
  std::memcpy(g_abort_message, message.data(), g_abort_length - 1);
  g_abort_message[g_abort_length - 1] = '\n';
  g_abort_code = code;
  struct sigaction action {};
  action.sa_handler = on_abort;
  sigemptyset(&action.sa_mask);
  sigaction(SIGABRT, &action, nullptr);
}

using Pool4 = nb::ndarray<nb::ro, nb::ndim<4>, nb::c_contig, nb::device::cpu>;
using X2 = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Ids2 = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Y2 = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

template <typename Array>
WeightType weight_type_of(const Array& a) {
  if (a.dtype() == nb::dtype<uint16_t>()) return WeightType::kBF16;
  if (a.dtype() == nb::dtype<float>()) return WeightType::kF32;
  throw std::invalid_argument("weights must be float32 or uint16 (bf16 bits)");
}

// Weights per row of `bytes` bytes of a block type (throws unless whole blocks).
int64_t block_row_len(WeightType w, int64_t bytes) {
  const int64_t block = row_bytes(w, block_weights(w));
  if (bytes % block) throw std::invalid_argument("row of " + std::to_string(bytes) + " bytes is not whole blocks");
  return bytes / block * block_weights(w);
}

// gate_up [Lm, E, 2F, D], down [Lm, E, D, F] -> a validated PoolView. Block types
// (wtype / down_wtype codes of a block type) come as uint8 rows of blocks: gate_up
// [Lm, E, 2F, bytes(D)]; down_wtype < 0: the type of gate_up.
WeightType part_type(const Pool4& a, int code) {
  if (code < 0) return weight_type_of(a);
  if (!is_weight_type(code)) throw std::invalid_argument("unknown weight type code");
  const WeightType w = static_cast<WeightType>(code);
  if (!is_block_type(w)) throw std::invalid_argument("wtype is only for block types");
  if (a.dtype() != nb::dtype<uint8_t>()) throw std::invalid_argument("block-quantised pools must be uint8 arrays of blocks");
  return w;
}

PoolView pool_view(const Pool4& gate_up, const Pool4& down, int wtype_code, int down_code) {
  const WeightType wtype = part_type(gate_up, wtype_code);
  const WeightType down_wtype = part_type(down, down_code < 0 ? wtype_code : down_code);
  if (wtype_code < 0 && down_code < 0 && down_wtype != wtype)
    throw std::invalid_argument("gate_up and down must have the same dtype");
  int64_t D = gate_up.shape(3), F = down.shape(3);
  if (is_block_type(wtype)) D = block_row_len(wtype, D);
  if (is_block_type(down_wtype)) F = block_row_len(down_wtype, F);
  PoolView v{gate_up.data(), down.data(), (int64_t)gate_up.shape(0),
             (int64_t)gate_up.shape(1), D, (int64_t)gate_up.shape(2) / 2, wtype, down_wtype};
  if (gate_up.shape(2) % 2 != 0 || v.d_model <= 0 || v.d_ff <= 0)
    throw std::invalid_argument("gate_up must be [Lm, E, 2F, D] with D, F > 0");
  if ((int64_t)down.shape(0) != v.num_layers || (int64_t)down.shape(1) != v.num_experts ||
      (int64_t)down.shape(2) != v.d_model || F != v.d_ff)
    throw std::invalid_argument("down must be [Lm, E, D, F] matching gate_up");
  return v;
}

void py_expert_ffn(const Pool4& gate_up, const Pool4& down, int64_t layer, const X2& x,
                   const Ids2& ids, const X2& weights, const Y2& y, ThreadPool* threads,
                   int isa, int wtype, int down_wtype, float swiglu_limit) {
  PoolView pool = pool_view(gate_up, down, wtype, down_wtype);
  pool.swiglu_limit = swiglu_limit;
  const int64_t T = x.shape(0), K = ids.shape(1);
  if ((int64_t)x.shape(1) != pool.d_model)
    throw std::invalid_argument("x must be [T, D] with D = " + std::to_string(pool.d_model));
  if ((int64_t)ids.shape(0) != T || (int64_t)weights.shape(0) != T ||
      (int64_t)weights.shape(1) != K)
    throw std::invalid_argument("ids and weights must both be [T, K]");
  if ((int64_t)y.shape(0) != T || (int64_t)y.shape(1) != pool.d_model)
    throw std::invalid_argument("y must be [T, D]");
  TokenBatch batch{x.data(), ids.data(), weights.data(), y.data(), T, K};
  if (take_injected_expert_fault()) throw std::runtime_error("expert_ffn: injected host kernel fault (test hook)");
  std::string err;
  {
    nb::gil_scoped_release release;
    err = expert_ffn(pool, layer, batch, threads, static_cast<Isa>(isa));
  }
  if (!err.empty()) throw std::invalid_argument(err);
}

using W2 = nb::ndarray<nb::ro, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// wtype_code < 0: f32 or bf16 bits, told by w's dtype; a block type: w is uint8 rows of
// its blocks [N, row bytes].
// The int8 activation quantiser of the block formats (kernels.h) under `isa`, unpacked:
// x [T, n] -> q [T, n] int8, d [T, n / block] float32, bsums [T, n / 16] int16 (block 256,
// ActQ8K; block 32 writes none).
bool py_dequant_bf16(nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig> w, int wtype,
                     nb::ndarray<uint16_t, nb::ndim<2>, nb::c_contig> out, bool simd) {
  const WeightType t = static_cast<WeightType>(wtype);
  const int64_t N = out.shape(0), K = out.shape(1);
  if ((int64_t)w.shape(0) != N || (int64_t)w.shape(1) != row_bytes(t, K))
    throw std::invalid_argument("w must be [N, row bytes of K weights] for out [N, K]");
  if (K % kQuantBlock) throw std::invalid_argument("K must be a multiple of 32");
  const bool fast = simd && dequant_bf16_fast(t);
  for (int64_t r = 0; r < N; ++r) {
    const uint8_t* row = w.data() + r * w.shape(1);
    if (fast) dequant_bf16(t, row, K, out.data() + r * K, kQuantBlock);
    else if (!dequant_bf16_scalar(t, row, K, out.data() + r * K, kQuantBlock))
      throw std::invalid_argument("no bf16 widening of this weight type");
  }
  return fast;
}

void py_quantise_activations(const X2& x, int64_t block, nb::ndarray<int8_t, nb::ndim<2>, nb::c_contig> q,
                             nb::ndarray<float, nb::ndim<2>, nb::c_contig> d,
                             nb::ndarray<int16_t, nb::ndim<2>, nb::c_contig> bsums, int isa) {
  const int64_t T = x.shape(0), n = x.shape(1);
  if (block != kQuantBlock && block != ActQ8K::kValues) throw std::invalid_argument("block must be 32 or 256");
  if (n % block) throw std::invalid_argument("x rows must be whole blocks");
  if ((int64_t)q.shape(0) != T || (int64_t)q.shape(1) != n || (int64_t)d.shape(0) != T ||
      (int64_t)d.shape(1) != n / block || (block == ActQ8K::kValues && ((int64_t)bsums.shape(0) != T ||
                                                                       (int64_t)bsums.shape(1) != n / 16)))
    throw std::invalid_argument("q must be [T, n], d [T, n / block], bsums [T, n / 16] (block 256)");
  const Kernels& kernels = require_kernels(static_cast<Isa>(isa));
  std::vector<float> buf(n);  // n floats hold a row's blocks (kernels.h)
  auto unpack = [&](auto* blocks, int64_t t) {  // blocks [n / block] of row t -> q, d (, bsums)
    for (int64_t b = 0; b < n / block; ++b) {
      std::memcpy(q.data() + t * n + b * block, blocks[b].qs, block);
      d.data()[t * (n / block) + b] = blocks[b].d;
      if constexpr (std::is_same_v<std::remove_pointer_t<decltype(blocks)>, ActQ8K>)
        std::memcpy(bsums.data() + t * (n / 16) + b * 16, blocks[b].bsums, sizeof blocks[b].bsums);
    }
  };
  for (int64_t t = 0; t < T; ++t) {
    if (block == kQuantBlock) {
      auto* blocks = reinterpret_cast<ActQ8*>(buf.data());
      quantise_act_q8(x.data() + t * n, n, blocks, kernels.simd_quantise);
      unpack(blocks, t);
    } else {
      auto* blocks = reinterpret_cast<ActQ8K*>(buf.data());
      quantise_act_q8k(x.data() + t * n, n, blocks, kernels.simd_quantise);
      unpack(blocks, t);
    }
  }
}

void py_linear(const W2& w, const X2& x, const Y2& y, ThreadPool* threads, int isa, int wtype_code) {
  WeightType wtype;
  int64_t K = w.shape(1);
  if (wtype_code < 0) {
    wtype = weight_type_of(w);
  } else {
    if (!is_weight_type(wtype_code)) throw std::invalid_argument("unknown weight type code " + std::to_string(wtype_code));
    wtype = static_cast<WeightType>(wtype_code);
    if (!is_block_type(wtype)) {
      if (weight_type_of(w) != wtype) throw std::invalid_argument("wtype does not match w's dtype");
    } else {
      if (w.dtype() != nb::dtype<uint8_t>()) throw std::invalid_argument("block-quantised w must be uint8 rows of blocks");
      K = block_row_len(wtype, K);
    }
  }
  const int64_t N = w.shape(0), T = x.shape(0);
  if ((int64_t)x.shape(1) != K)
    throw std::invalid_argument("x must be [T, K] with K = " + std::to_string(K));
  if ((int64_t)y.shape(0) != T || (int64_t)y.shape(1) != N)
    throw std::invalid_argument("y must be [T, N]");
  DenseView view{w.data(), N, K, wtype};
  std::string err;
  {
    nb::gil_scoped_release release;
    err = linear(view, x.data(), T, y.data(), threads, static_cast<Isa>(isa));
  }
  if (!err.empty()) throw std::invalid_argument(err);
}

using F4 = nb::ndarray<const float, nb::ndim<4>, nb::c_contig, nb::device::cpu>;
using I2 = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using I1 = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Out4 = nb::ndarray<float, nb::ndim<4>, nb::c_contig, nb::device::cpu>;

// q [B, T, H, hd], k / v [B, G, S, hd] float32 or uint16 (bf16 bits), positions [B, T],
// kv_len [B] -> out [B, T, H, hd] (written in place).
void py_attention(const F4& q, const Pool4& k, const Pool4& v, const I2& positions, const I1& kv_len,
                  int64_t window, const Out4& out, ThreadPool* threads, int isa) {
  const WeightType kv_type = weight_type_of(k);
  if (weight_type_of(v) != kv_type) throw std::invalid_argument("k and v must have the same dtype");
  for (int i = 0; i < 4; ++i) {
    if (k.shape(i) != v.shape(i)) throw std::invalid_argument("k and v must have the same shape");
    if (out.shape(i) != q.shape(i)) throw std::invalid_argument("out must have q's shape");
  }
  if (k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) || positions.shape(0) != q.shape(0) ||
      positions.shape(1) != q.shape(1) || kv_len.shape(0) != q.shape(0))
    throw std::invalid_argument("need q [B, T, H, hd], k/v [B, G, S, hd], positions [B, T], kv_len [B]");
  AttentionArgs a{q.data(), k.data(), v.data(), kv_type, positions.data(), kv_len.data(),
                  (int64_t)q.shape(0), (int64_t)q.shape(1), (int64_t)q.shape(2), (int64_t)k.shape(1),
                  (int64_t)k.shape(2), (int64_t)q.shape(3), window, out.data()};
  std::string err;
  {
    nb::gil_scoped_release release;
    err = attention(a, threads, static_cast<Isa>(isa));
  }
  if (!err.empty()) throw std::invalid_argument(err);
}

// Test hook for the pool's exception path: a job of counts.size() tasks, task i adding
// 1 to counts[i]. fail "bad_alloc" / "runtime": the first task to run on a worker
// (on_worker) or on the calling thread throws that exception; every other task waits
// (up to 10 s) for the throw, so which side throws is certain, then sleeps 100 us, so a
// job that went on handing out tasks would show in counts. fail "": a normal job.
void py_pool_run_test(ThreadPool& threads, nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> counts,
                      const std::string& fail, bool on_worker) {
  const int64_t n = counts.shape(0);
  if (fail != "" && fail != "bad_alloc" && fail != "runtime")
    throw std::invalid_argument("fail must be \"\", \"bad_alloc\" or \"runtime\"");
  if (!fail.empty() && (threads.num_threads() < 2 || n < threads.num_threads()))
    throw std::invalid_argument("a failing job needs 2 or more threads and at least one task per thread");
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<bool> claimed{false}, thrown{false};
  auto task = [&](int64_t i) {
    __atomic_fetch_add(counts.data() + i, 1, __ATOMIC_RELAXED);
    if (fail.empty()) return;
    if ((std::this_thread::get_id() != caller) == on_worker && !claimed.exchange(true)) {
      thrown.store(true);
      if (fail == "bad_alloc") throw std::bad_alloc();
      throw std::runtime_error("injected fault in task " + std::to_string(i) + " on " +
                               (on_worker ? "a worker" : "the calling") + " thread");
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!thrown.load() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  };
  nb::gil_scoped_release release;
  parallel_for(&threads, n, task);
}

std::vector<double> py_read_bandwidth(ThreadPool* threads, int64_t num_bytes, int repeats,
                                      int isa) {
  nb::gil_scoped_release release;
  return read_bandwidth_gbps(threads, num_bytes, repeats, static_cast<Isa>(isa));
}

float py_sum_streams(nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> data, int streams,
                     int isa) {
  return sum_streams(require_kernels(static_cast<Isa>(isa)), data.data(), static_cast<int64_t>(data.shape(0)), streams);
}

}  // namespace
}  // namespace ftjax

NB_MODULE(_host_kernels, m) {
  using namespace ftjax;
  m.doc() = "Host (CPU) expert kernels for ftjax: SwiGLU expert FFN, thread pool, XLA FFI.";

  nb::class_<ThreadPool>(m, "ThreadPool",
                         "Persistent worker threads; the caller is one of num_threads.")
      .def(nb::init<int>(), "num_threads"_a = 0)
      .def_prop_ro("num_threads", &ThreadPool::num_threads);
  m.def("pool_run_test", &py_pool_run_test, "threads"_a, "counts"_a.noconvert(), "fail"_a = "",
        "on_worker"_a = true,
        "Test hook: runs a pool job of counts.size() tasks (task i adds 1 to counts[i]); fail "
        "\"bad_alloc\" / \"runtime\": the first task on a worker (on_worker) or on the calling "
        "thread throws it, and the call raises MemoryError / RuntimeError.");
  m.def("inject_expert_faults", &inject_expert_faults, "n"_a,
        "Test hook: the next n routed-expert kernel calls (FFI handler or expert_ffn) fail with an "
        "\"injected host kernel fault\" error; 0 clears.");
  m.def("shared_thread_pool", &shared_thread_pool, "num_threads"_a, nb::rv_policy::reference,
        "The process's pool of num_threads workers, the one the FFI handlers use for the "
        "`threads` attribute (created on first use, never freed).");
  m.def(
      "register_expert_pool",
      [](int64_t gate_up, int64_t down, int64_t work) {
        return register_expert_pool({reinterpret_cast<const void*>(gate_up), reinterpret_cast<const void*>(down),
                                     reinterpret_cast<int64_t*>(work)});
      },
      "gate_up_address"_a, "down_address"_a, "work_address"_a,
      "Register a host expert pool (and its int64[3] work counters, or 0) -> the id the "
      "expert FFI handler's pool_id attribute names (the lowest free one).");
  m.def("unregister_expert_pool", &unregister_expert_pool, "pool_id"_a);

  m.def("expert_ffn", &py_expert_ffn, "gate_up"_a.noconvert(), "down"_a.noconvert(),
        "layer"_a, "x"_a, "ids"_a, "weights"_a, "y"_a.noconvert(), "threads"_a.none(),
        "isa"_a = 0, "wtype"_a = -1, "down_wtype"_a = -1,
        "swiglu_limit"_a = std::numeric_limits<float>::infinity(),
        "y[t] = sum_k weights[t,k] * FFN_{ids[t,k]}(x[t]) for MoE layer `layer` (SwiGLU clamped at "
        "swiglu_limit); "
        "writes y [T, D] in place.");
  m.def("linear", &py_linear, "w"_a.noconvert(), "x"_a, "y"_a.noconvert(), "threads"_a.none(),
        "isa"_a = 0, "wtype"_a = -1,
        "y [T, N] = x [T, K] . w^T, w [N, K] float32 or bf16 bits (wtype -1), or a block type's "
        "uint8 rows [N, row bytes] (wtype its DTYPE_ code); writes y in place.");
  m.def("quantise_activations", &py_quantise_activations, "x"_a, "block"_a, "q"_a.noconvert(), "d"_a.noconvert(),
        "bsums"_a.noconvert(), "isa"_a = 0,
        "The block formats' int8 activation quantiser, unpacked into q [T, n], d [T, n / block] and "
        "(block 256) bsums [T, n / 16].");
  m.def("attention", &py_attention, "q"_a, "k"_a.noconvert(), "v"_a.noconvert(), "positions"_a, "kv_len"_a,
        "window"_a, "out"_a.noconvert(), "threads"_a.none(), "isa"_a = 0,
        "Causal GQA attention over the keys in use of a head-major KV cache; writes out in place.");
  m.def("ffi_attention", [] { return nb::capsule(reinterpret_cast<void*>(FtjaxAttention)); },
        "PyCapsule of the decode-attention XLA FFI handler (CPU platform).");
  m.def("read_bandwidth_gbps", &py_read_bandwidth, "threads"_a.none(),
        "num_bytes"_a = int64_t(256) << 20, "repeats"_a = 5, "isa"_a = 0,
        "GB/s of each timed round summing a num_bytes buffer (the best of its stream counts).");
  m.def("sum_streams", &py_sum_streams, "data"_a, "streams"_a, "isa"_a = 0,
        "Sum of a float32 vector read as `streams` sequential streams side by side (the probe's read).");
  m.def("ffi_expert_ffn", [] { return nb::capsule(reinterpret_cast<void*>(FtjaxExpertFfn)); },
        "PyCapsule of the XLA FFI handler (CPU platform).");
  m.def("ffi_expert_start", [] { return nb::capsule(reinterpret_cast<void*>(FtjaxExpertStart)); },
        "XLA FFI handler: queue a routed-expert call on the host runner -> token");
  m.def("ffi_expert_finish", [] { return nb::capsule(reinterpret_cast<void*>(FtjaxExpertFinish)); },
        "XLA FFI handler: wait for a token's routed-expert call -> y");
#ifdef FTJAX_WITH_CUDA
  m.attr("built_with_cuda") = true;
  m.def("ffi_expert_start_cuda", [] { return nb::capsule(reinterpret_cast<void*>(FtjaxExpertStartCuda)); },
        "XLA FFI handler (CUDA platform): stage the inputs, queue the routed-expert call -> token");
  m.def("ffi_expert_finish_cuda", [] { return nb::capsule(reinterpret_cast<void*>(FtjaxExpertFinishCuda)); },
        "XLA FFI handler (CUDA platform): wait for the call on the stream, copy y to the device");
#else
  m.attr("built_with_cuda") = false;
#endif
  m.def("pending_expert_calls", &ftjax::pending_expert_calls,
        "Host expert calls started and not yet collected by their finish.");
  m.def("drop_finished_calls", &ftjax::drop_finished_calls, nb::arg("older_than_s"),
        "Wait for queued host expert calls, then forget the uncollected ones done at least older_than_s ago "
        "-> how many.");
  m.def("ffi_write_rows", [] { return nb::capsule(reinterpret_cast<void*>(FtjaxWriteRows)); },
        "XLA FFI handler: in-place row write into a KV cache");
  m.def("ffi_linear", [] { return nb::capsule(reinterpret_cast<void*>(FtjaxLinear)); },
        "PyCapsule of the dense linear XLA FFI handler (CPU platform).");
  m.def("has_avx2", &cpu_has_avx2_fma);
  m.def("has_avx512", &cpu_has_avx512);
  m.def("has_avx512_bf16", &cpu_has_avx512_bf16);
  m.def("amx_bf16_status", [] { return amx_bf16_status(); },
        "'' when AMX-BF16 tiles run here and passed the self-check, else why not");
  m.def("amx_int8_status", [] { return amx_int8_status(); },
        "'' when AMX-INT8 tiles run here and passed the self-check, else why not");
  m.def("gemv_prefetch_bytes", &gemv_prefetch_bytes,
        "Bytes ahead the float / bf16 decode GEMV prefetches into L2 (0: none; by CPU vendor unless set).");
  m.def("set_gemv_prefetch_bytes", &set_gemv_prefetch_bytes, "bytes"_a);
  m.def("hardware_cores", &hardware_cores);
  m.def("exit_on_abort", &exit_on_abort, "message"_a, "code"_a,
        "From now on SIGABRT (abort(), std::terminate) writes message to stderr and _exit(code)s.");
  m.attr("ISA_AUTO") = (int)Isa::kAuto;
  m.attr("ISA_SCALAR") = (int)Isa::kScalar;
  m.attr("ISA_AVX2") = (int)Isa::kAvx2;
  m.attr("ISA_AVX512") = (int)Isa::kAvx512;
  m.attr("ISA_AVX512_BF16") = (int)Isa::kAvx512Bf16;
  m.attr("ISA_AMX_BF16") = (int)Isa::kAmxBf16;
  m.attr("ISA_AVX512_BF16_TILES") = (int)Isa::kAvx512Bf16Tiles;
  m.attr("AMX_MIN_TOKENS") = kAmxMinTokens;
  m.def("expert_ffn_takes_tiles", [](int isa, int wtype, int down_wtype, int64_t d_model, int64_t d_ff,
                                     int64_t num_tokens) {
          return expert_ffn_takes_tiles(static_cast<Isa>(isa), static_cast<WeightType>(wtype),
                                        static_cast<WeightType>(down_wtype), d_model, d_ff, num_tokens);
        }, "Whether an expert FFN call of these shapes multiplies on AMX tiles (expert_ffn.cc's rule).");
  m.def("attention_takes_tiles", [](int isa, int64_t num_tokens, int64_t head_dim) {
          return attention_takes_tiles(static_cast<Isa>(isa), num_tokens, head_dim);
        }, "isa"_a, "num_tokens"_a, "head_dim"_a,
        "Whether attention of num_tokens query tokens per row runs on the AMX-BF16 tiles under isa.");
  m.def("linear_takes_tiles", [](int isa, int wtype, int64_t rows, int64_t cols, int64_t num_tokens) {
          return linear_takes_tiles(static_cast<Isa>(isa), static_cast<WeightType>(wtype), rows, cols, num_tokens);
        }, "Whether a dense linear call of these shapes multiplies on AMX tiles (linear.cc's rule).");
  m.def("dequant_bf16", &py_dequant_bf16, "w"_a, "wtype"_a, "out"_a.noconvert(), "simd"_a,
        "Rows of a block format (uint8 [N, row bytes]; bf16 bits: uint16 viewed as bytes) -> bf16 bits out "
        "[N, K], as the AMX tiles widen them (simd) or by the scalar reference; returns whether simd ran.");
  m.def("amx_tile_kind", [](int isa, int wtype) {
          AmxTiles kind;
          return amx_tiles_for(static_cast<Isa>(isa), static_cast<WeightType>(wtype), &kind)
                     ? (kind == AmxTiles::kInt8 ? "int8" : int8_tiles(kind) ? "int8_vector" : "bf16")
                     : "";
        }, "isa"_a, "wtype"_a,
        "The tiles a weight type multiplies on under isa ('bf16': AMX-BF16 or their vector form, 'int8': AMX-INT8, "
        "'int8_vector': their AVX512-VNNI form, '' for none): amx_tiles_for.");
  m.def("int8_vector_status", [] { return int8_vector_status(); },
        "'' when the int8 tiles' vector form (AVX512-VNNI) runs here and passed the self-check, else why not");
  m.def("bf16_vector_status", [] { return bf16_vector_status(); },
        "'' when the bf16 tiles' vector form (AVX512-BF16) runs here and passed the self-check, else why not");
  m.def("dequant_bf16_fast", [](int wtype) { return dequant_bf16_fast(static_cast<WeightType>(wtype)); },
        "Whether the AMX tiles widen this weight type to bf16 with vector code here.");
  m.attr("DTYPE_F32") = (int)WeightType::kF32;
  m.attr("DTYPE_BF16") = (int)WeightType::kBF16;
  m.attr("DTYPE_Q8_0") = (int)WeightType::kQ8_0;
  m.attr("DTYPE_Q4_0") = (int)WeightType::kQ4_0;
  m.attr("DTYPE_Q4_K") = (int)WeightType::kQ4_K;
  m.attr("DTYPE_Q6_K") = (int)WeightType::kQ6_K;
  m.attr("DTYPE_MXFP4") = (int)WeightType::kMXFP4;
  m.attr("DTYPE_FP8_E4M3") = (int)WeightType::kFP8_E4M3;
  m.attr("DTYPE_Q4_K_OR_Q6_K") = (int)WeightType::kQ4_K_OR_Q6_K;
}
