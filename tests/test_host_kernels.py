"""Host expert kernel (host_kernels/, via ftjax.host) against the numpy reference.

Covers f32 and bf16 weights, odd D and F (not multiples of 8 or 16), T = 1 and
many, K = 1..4, ids < 0 and repeated ids, the AVX2 and the scalar path, 1 and
several threads (AVX-512 too where the CPU has it), and both jit boundaries (XLA FFI and pure_callback) on CPU.
Letters: Lm MoE layers, E experts, D model dim, F expert FFN dim, T tokens, K top-k.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax import host
from ftjax.experts.pool import HostExpertPool, to_bf16_bits
from ftjax.host import Boundary, HostExecutor, Isa, available_isas, read_bandwidth_gbps, reference_expert_ffn

# scalar always; AVX2 / AVX-512 where the CPU has them (the tile ISAs, AUTO's kernels but
# for prefill: tests/test_amx.py)
ISAS = [i for i in available_isas() if i not in host.tile_isas()]


def make_pool(rng, num_layers, num_experts, d_model, d_ff, dtype):
    # Scales keep gate/up pre-activations O(1), so silu is exercised on both sides.
    gate_up = rng.standard_normal((num_layers, num_experts, 2 * d_ff, d_model)) * (1.5 / np.sqrt(d_model))
    down = rng.standard_normal((num_layers, num_experts, d_model, d_ff)) * (1.0 / np.sqrt(d_ff))
    gate_up, down = gate_up.astype(np.float32), down.astype(np.float32)
    if dtype == "bfloat16":
        gate_up, down = to_bf16_bits(gate_up), to_bf16_bits(down)
    return HostExpertPool.from_arrays(gate_up, down)


def make_batch(rng, num_tokens, top_k, d_model, num_experts):
    x = rng.standard_normal((num_tokens, d_model)).astype(np.float32)  # [T, D]
    ids = rng.integers(-1, num_experts, (num_tokens, top_k)).astype(np.int32)  # [T, K]
    weights = rng.random((num_tokens, top_k)).astype(np.float32)  # [T, K]
    return x, ids, weights


def assert_close(y, ref):
    scale = max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5 * scale)


def reference(pool, layer, x, ids, weights, isa=Isa.AUTO):
    return reference_expert_ffn(pool.gate_up, pool.down, layer, x, ids, weights, isa=isa)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("d_model,d_ff,num_tokens,top_k", [
    (37, 29, 1, 1), (37, 29, 7, 3), (64, 48, 1, 4), (130, 70, 50, 2), (16, 200, 3, 4), (301, 19, 2, 2),
    (288, 160, 1, 3),  # full SIMD steps (multiples of 16, 32 and 128 elements) plus tails
])
def test_kernel_matches_reference(dtype, isa, threads, d_model, d_ff, num_tokens, top_k):
    rng = np.random.default_rng(d_model * 1000 + d_ff + num_tokens)
    pool = make_pool(rng, 2, 6, d_model, d_ff, dtype)
    x, ids, weights = make_batch(rng, num_tokens, top_k, d_model, pool.num_experts)
    executor = HostExecutor(pool, threads=threads, isa=isa)
    for layer in range(pool.num_layers):
        assert_close(executor.expert_ffn_numpy(x, layer, ids, weights), reference(pool, layer, x, ids, weights, isa))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_many_tokens_and_duplicates(dtype):
    """T in the hundreds, experts shared by many tokens and repeated within a token."""
    rng = np.random.default_rng(1)
    pool = make_pool(rng, 1, 8, 72, 40, dtype)
    x, ids, weights = make_batch(rng, 300, 4, 72, pool.num_experts)
    ids[::3, 1] = ids[::3, 0]  # same expert twice in one token: weights add up
    ids[::5] = -1  # tokens with nothing computed here
    y = HostExecutor(pool, threads=2).expert_ffn_numpy(x, 0, ids, weights)
    assert_close(y, reference(pool, 0, x, ids, weights))
    assert not y[::5].any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "q8_0"])
@pytest.mark.parametrize("boundary", ["numpy", "ffi_cpu"])
def test_clamped_swiglu_matches_reference(dtype, boundary):
    """DeepSeek-V4's clamped SwiGLU (gate <= L, |up| <= L before silu(gate) * up) in the
    kernel, from numpy and through the FFI handler, equals the reference; with a limit
    the pre-activations reach, it differs from plain SwiGLU."""
    rng = np.random.default_rng(7)
    pool = make_pool(rng, 1, 6, 64, 64, "float32" if dtype == "q8_0" else dtype)
    if dtype == "q8_0":
        pool = pool.converted("q8_0")
    x, ids, weights = make_batch(rng, 5, 3, 64, pool.num_experts)
    x *= 3.0  # pre-activations of a few units: a limit of 0.5 bites
    ex = HostExecutor(pool, threads=2, swiglu_limit=0.5)
    if boundary == "numpy":
        y = ex.expert_ffn_numpy(x, 0, ids, weights)
    else:
        y = np.asarray(jax.jit(lambda *a: ex.expert_ffn(*a, boundary="ffi_cpu"))(x, np.int32(0), ids, weights))
    fmt = None if dtype != "q8_0" else "q8_0"
    ref = reference_expert_ffn(pool.gate_up, pool.down, 0, x, ids, weights, fmt, swiglu_limit=0.5)
    assert_close(y, ref)
    plain = reference_expert_ffn(pool.gate_up, pool.down, 0, x, ids, weights, fmt)
    assert np.abs(plain - ref).max() > 10 * 2e-5 * max(1.0, float(np.abs(ref).max()))


def test_all_ids_negative_gives_zeros():
    rng = np.random.default_rng(2)
    pool = make_pool(rng, 1, 4, 24, 16, "bfloat16")
    x, _, weights = make_batch(rng, 5, 2, 24, 4)
    y = HostExecutor(pool, threads=2).expert_ffn_numpy(x, 0, np.full((5, 2), -1, np.int32), weights)
    assert y.shape == (5, 24) and not y.any()


def test_isa_paths_and_thread_counts_agree():
    """The summation order does not depend on threads; ISAs differ only by rounding (and
    AVX512_BF16 by its bf16 activations: held to the reference that rounds them)."""
    rng = np.random.default_rng(3)
    pool = make_pool(rng, 1, 8, 200, 96, "bfloat16")
    x, ids, weights = make_batch(rng, 4, 4, 200, 8)
    runs = {(isa, t): HostExecutor(pool, threads=t, isa=isa).expert_ffn_numpy(x, 0, ids, weights)
            for isa in ISAS for t in (1, 2, 4)}
    for isa in ISAS:
        np.testing.assert_array_equal(runs[isa, 1], runs[isa, 2])
        np.testing.assert_array_equal(runs[isa, 1], runs[isa, 4])
    for isa in ISAS:
        if host.rounds_activations_to_bf16(isa):
            assert_close(runs[isa, 1], reference(pool, 0, x, ids, weights, isa))
        else:
            assert_close(runs[isa, 1], runs[Isa.SCALAR, 1])


def test_bad_arguments_raise():
    rng = np.random.default_rng(4)
    pool = make_pool(rng, 2, 4, 24, 16, "float32")
    executor = HostExecutor(pool, threads=1)
    x, ids, weights = make_batch(rng, 2, 2, 24, 4)
    with pytest.raises(ValueError, match="expert id"):
        executor.expert_ffn_numpy(x, 0, np.full((2, 2), 4, np.int32), weights)
    with pytest.raises(ValueError, match="layer"):
        executor.expert_ffn_numpy(x, 2, ids, weights)
    with pytest.raises(ValueError):
        executor.expert_ffn_numpy(x[:, :10], 0, ids, weights)
    writable = HostExpertPool.allocate(1, 2, 8, 8, "float32")
    with pytest.raises(ValueError, match="freeze"):
        HostExecutor(writable)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("boundary", [Boundary.FFI_CPU, Boundary.CALLBACK], ids=lambda b: b.value)
def test_jit_boundaries_match_reference(dtype, boundary):
    """Inside jax.jit, traced layer and ids: one compile serves every layer and id."""
    rng = np.random.default_rng(5)
    pool = make_pool(rng, 3, 6, 37, 29, dtype)
    executor = HostExecutor(pool, threads=2)
    step = jax.jit(lambda x, layer, ids, w: executor.expert_ffn(x, layer, ids, w, boundary=boundary) * 2.0)
    for layer, num_tokens in [(0, 1), (2, 1), (1, 1)]:
        x, ids, weights = make_batch(rng, num_tokens, 3, 37, pool.num_experts)
        y = step(jnp.asarray(x), jnp.int32(layer), jnp.asarray(ids), jnp.asarray(weights))
        assert_close(np.asarray(y) / 2.0, reference(pool, layer, x, ids, weights))
    assert step._cache_size() == 1
    x, ids, weights = make_batch(rng, 9, 3, 37, pool.num_experts)  # prefill-sized T
    y = step(jnp.asarray(x), jnp.int32(1), jnp.asarray(ids), jnp.asarray(weights))
    assert_close(np.asarray(y) / 2.0, reference(pool, 1, x, ids, weights))


def test_ffi_and_callback_agree_and_default_is_ffi_on_cpu():
    rng = np.random.default_rng(6)
    pool = make_pool(rng, 1, 4, 40, 24, "bfloat16")
    executor = HostExecutor(pool, threads=2)
    x, ids, weights = make_batch(rng, 3, 2, 40, 4)
    ffi = jax.jit(lambda *a: executor.expert_ffn(*a, boundary=Boundary.FFI_CPU))
    text = ffi.lower(x, jnp.int32(0), ids, weights).as_text()
    assert "ftjax_expert_ffn" in text and "callback" not in text
    default = jax.jit(executor.expert_ffn)(x, jnp.int32(0), ids, weights)
    callback = jax.jit(lambda *a: executor.expert_ffn(*a, boundary=Boundary.CALLBACK))(x, jnp.int32(0), ids, weights)
    np.testing.assert_array_equal(np.asarray(default), np.asarray(callback))


def test_ffi_reports_bad_expert_id():
    rng = np.random.default_rng(7)
    pool = make_pool(rng, 1, 4, 16, 8, "float32")
    executor = HostExecutor(pool, threads=1)
    x, _, weights = make_batch(rng, 1, 2, 16, 4)
    with pytest.raises(Exception, match="expert id"):
        jax.block_until_ready(jax.jit(executor.expert_ffn)(x, jnp.int32(0), jnp.array([[1, 9]], jnp.int32), weights))


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name)
def test_read_bandwidth_probe_positive(isa):
    assert read_bandwidth_gbps(threads=1, num_bytes=4 << 20, repeats=2, isa=isa) > 0
    assert read_bandwidth_gbps(threads=2, num_bytes=4 << 20, repeats=2, isa=isa) > 0


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name)
def test_the_probes_streams_read_every_value_once(isa):
    """The probe reads a chunk as 1-8 streams side by side, 512 bytes of each in turn
    (`sum_streams`): every value counts once, whatever the length (a remainder past the
    equal parts, parts shorter than a piece, an empty range)."""
    from ftjax.host import _hk

    rng = np.random.default_rng(3)
    for n in (0, 5, 1000, 1024 * 8, 262144, 262144 + 37):
        x = rng.standard_normal(n).astype(np.float32)
        for streams in (1, 2, 3, 4, 8):
            got = _hk.sum_streams(x, streams, isa.value)
            np.testing.assert_allclose(got, np.sum(x, dtype=np.float64), rtol=0, atol=1e-3 + 1e-5 * np.abs(x).sum())
    with pytest.raises(ValueError, match="streams"):
        _hk.sum_streams(np.ones(8, np.float32), 0, isa.value)


def test_missing_isa_is_reported():
    rng = np.random.default_rng(8)
    pool = make_pool(rng, 1, 2, 16, 8, "float32")
    x, ids, weights = make_batch(rng, 1, 1, 16, 2)
    for isa in set(Isa) - set(available_isas()) - {Isa.AUTO}:
        with pytest.raises(ValueError, match="ISA"):
            HostExecutor(pool, threads=1, isa=isa).expert_ffn_numpy(x, 0, ids, weights)


def test_concurrent_callers_share_one_pool():
    """Python threads calling one executor at once (the kernel drops the GIL): the
    thread pool serialises jobs and every result is exact."""
    import threading

    rng = np.random.default_rng(9)
    pool = make_pool(rng, 1, 8, 96, 40, "bfloat16")
    executor = HostExecutor(pool, threads=3)
    batches = [make_batch(rng, 1 + k, 3, 96, 8) for k in range(4)]
    expected = [executor.expert_ffn_numpy(*b[:1], 0, *b[1:]) for b in batches]
    failures = []

    def worker(k):
        x, ids, weights = batches[k]
        for _ in range(50):
            if not np.array_equal(executor.expert_ffn_numpy(x, 0, ids, weights), expected[k]):
                failures.append(k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_the_decode_gemv_prefetch_moves_no_bit_and_its_variable_is_checked(monkeypatch):
    """The float / bf16 decode GEMV prefetches into L2 on Intel (4096 bytes ahead) and on
    AMD without AVX-512 (1024), not elsewhere: every ISA's output is the same to the bit at
    any distance; the benchmark lines name the distance; $FTJAX_GEMV_PREFETCH replaces it,
    and a value that is not a whole number of lines is an error naming the variable."""
    from ftjax.host import _hk

    before = _hk.gemv_prefetch_bytes()
    if not host.os.environ.get(host.GEMV_PREFETCH_ENV):
        vendor = next((line.split(":")[1].strip() for line in open("/proc/cpuinfo") if line.startswith("vendor_id")), "")
        want = 4096 if vendor == "GenuineIntel" else 1024 if vendor == "AuthenticAMD" and not _hk.has_avx512() else 0
        assert before == want, (vendor, before)
    assert host.isa_report()["gemv_prefetch_bytes"] == before
    rng = np.random.default_rng(3)
    try:
        for dtype in ("float32", "bfloat16"):
            pool = make_pool(rng, 1, 4, 288, 160, dtype)  # whole SIMD steps and tails
            x, ids, weights = make_batch(rng, 1, 3, 288, 4)
            for isa in ISAS:
                outs = []
                for ahead in (0, 64, 4096):
                    _hk.set_gemv_prefetch_bytes(ahead)
                    outs.append(HostExecutor(pool, threads=2, isa=isa).expert_ffn_numpy(x, 0, ids, weights))
                assert all(np.array_equal(outs[0], o) for o in outs[1:]), (dtype, isa)
        for bad in ("-64", "100", "lots"):
            monkeypatch.setenv(host.GEMV_PREFETCH_ENV, bad)
            with pytest.raises(ValueError, match="FTJAX_GEMV_PREFETCH"):
                host.set_gemv_prefetch_from_env()
        monkeypatch.setenv(host.GEMV_PREFETCH_ENV, "8192")
        host.set_gemv_prefetch_from_env()
        assert _hk.gemv_prefetch_bytes() == 8192 and host.isa_report()["gemv_prefetch_bytes"] == 8192
    finally:
        _hk.set_gemv_prefetch_bytes(before)
