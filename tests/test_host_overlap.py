"""The host expert kernel as a start / finish pair (`HostExecutor.expert_ffn_start` /
`expert_ffn_finish`, host_kernels/async_experts.cc): the same result as the blocking
call, in the order the data dependencies give (start, device work, finish), a failure
reported at finish as a Python error with the next call fine, and nothing left behind."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
from ftjax import host
from ftjax.host import HostExecutor

from test_host_kernels import make_batch, make_pool

L, E, D, F, T, K = 2, 6, 64, 32, 5, 2


@pytest.fixture(scope="module")
def executor():
    return HostExecutor(make_pool(np.random.default_rng(0), L, E, D, F, "bfloat16"), threads=2)


def overlapped(ex: HostExecutor):
    """start -> a device matmul chain -> finish, ordered by data (`after_start`, `after`)."""
    @jax.jit
    def step(x, ids, w, a):
        token = ex.expert_ffn_start(x, jnp.int32(1), ids, w)
        a = ex.after_start(token, a)
        for _ in range(3):
            a = jnp.tanh(a @ a)
        return ex.expert_ffn_finish(token, a, x.shape), a
    return step


def test_the_pair_gives_the_blocking_calls_result(executor):
    x, ids, w = make_batch(np.random.default_rng(1), T, K, D, E)
    a = jnp.eye(16, dtype=jnp.float32)
    y, _ = overlapped(executor)(x, ids, w, a)
    want = executor.expert_ffn_numpy(x, 1, ids, w)
    np.testing.assert_array_equal(np.asarray(y), want)
    none, _ = overlapped(executor)(x, np.full_like(ids, -1), w, a)  # nothing for the host: no call, zeros
    assert not np.asarray(none).any()
    assert host.pending_host_calls() == 0


def test_start_comes_before_the_device_work_and_finish_after(executor):
    x, ids, w = make_batch(np.random.default_rng(2), T, K, D, E)
    text = overlapped(executor).lower(x, ids, w, jnp.eye(16, dtype=jnp.float32)).compile().as_text()
    lines = text.splitlines()
    entry = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    body = lines[entry:]
    where = lambda key: next(i for i, line in enumerate(body) if key in line)  # noqa: E731
    dots = [i for i, line in enumerate(body) if "} fusion(" in line and "f32[16,16]" in line.split("=")[1]]  # the chain
    assert where("ftjax_expert_start") < min(dots) and max(dots) < where("ftjax_expert_finish"), text


def test_a_failed_host_task_raises_at_finish_and_the_next_call_runs(executor):
    x, ids, w = make_batch(np.random.default_rng(3), T, K, D, E)
    ids[0, 0] = 1  # at least one host id
    step, a = overlapped(executor), jnp.eye(16, dtype=jnp.float32)
    ftjax.host.inject_host_fault(1)
    with pytest.raises(Exception, match="injected host kernel fault"):
        jax.block_until_ready(step(x, ids, w, a))
    y, _ = step(x, ids, w, a)
    np.testing.assert_array_equal(np.asarray(y), executor.expert_ffn_numpy(x, 1, ids, w))
    assert host.pending_host_calls() == 0


def test_a_step_that_fails_between_start_and_finish_leaves_nothing_behind(executor):
    """A start whose finish never runs (the step failed in between): drop_host_calls,
    which Model.recover calls, forgets it."""
    x, ids, w = make_batch(np.random.default_rng(4), T, K, D, E)
    ids[0, 0] = 1
    token = jax.jit(lambda x, ids, w: executor.expert_ffn_start(x, jnp.int32(0), ids, w))(x, ids, w)
    assert int(token) > 0 and host.pending_host_calls() == 1
    assert host.drop_host_calls() == 1 and host.pending_host_calls() == 0
    with pytest.raises(Exception, match="no pending host call"):
        jax.block_until_ready(jax.jit(lambda t: executor.expert_ffn_finish(t, t, (T, D)))(token))


def test_a_model_with_and_without_overlap_gives_the_same_tokens():
    ids = list(range(5, 60))
    kw = dict(policy="lru", cache_slots=24, bandwidth=(1.0, 4.0), calibrate=False)
    a, b = ftjax.load(**kw), ftjax.load(**kw, overlap_host=False)
    assert a._steps.executor.host_pair is not None and b._steps.executor.host_pair is None
    assert a.generate(ids, 10) == b.generate(ids, 10)
    counters = ("selections", "hits", "misses", "fetched", "host_computed")
    sa, sb = a.stats(), b.stats()
    assert sa["host_computed"] > 0 and [sa[k] for k in counters] == [sb[k] for k in counters]


@pytest.mark.skipif(not host.CUDA_PAIR, reason="built without the CUDA toolkit: no CUDA handlers to register")
def test_the_cuda_handlers_are_built_and_register():
    """Where the package build found the CUDA toolkit, the pair's CUDA handlers are in the
    module and register with XLA for the CUDA platform (running them needs a GPU:
    tests/test_gpu.py)."""
    from ftjax import _host_kernels as hk

    assert hk.built_with_cuda and hk.ffi_expert_start_cuda() is not None and hk.ffi_expert_finish_cuda() is not None
    host._register_ffi_targets()  # CPU and CUDA targets under the same names
    assert host.pair_available("gpu") and host.pair_available("cpu")
