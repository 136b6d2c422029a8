"""Exceptions on the host kernels' worker threads, and the injected host-kernel fault.

A task that throws on a ThreadPool worker (std::bad_alloc, ...) must reach the caller as
a Python exception, end its job early and leave the pool usable, never std::terminate
the process. `pool_run_test` (a test hook in the extension) makes the first task on a
worker, or on the calling thread, throw. Those calls run in a subprocess, so a regression
fails the test instead of crashing pytest. `inject_host_fault` makes the next routed-expert
kernel calls fail as a failing kernel would: that request errors, the next one is served.
"""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.experts.pool import HostExpertPool
from ftjax.host import HostExecutor, inject_host_fault

SCRIPT = textwrap.dedent("""
    import numpy as np
    import jax.numpy as jnp
    from ftjax import _host_kernels as hk
    from ftjax.experts.pool import HostExpertPool
    from ftjax.host import HostExecutor, shared_threads

    n = 200
    for pool in (hk.ThreadPool(2), hk.ThreadPool(4)):
        for fail, error in (("bad_alloc", MemoryError), ("runtime", RuntimeError)):
            for on_worker in (True, False):
                counts = np.zeros(n, np.int64)
                try:
                    hk.pool_run_test(pool, counts, fail, on_worker)
                except error as e:
                    raised, message = type(e).__name__, str(e)
                else:
                    raise AssertionError(f"no {error.__name__} ({pool.num_threads} threads, {fail})")
                assert message, "the exception lost its message"
                if fail == "runtime":
                    assert ("on a worker thread" if on_worker else "on the calling thread") in message, message
                # each task ran at most once, and the job stopped handing out tasks
                ran = counts.sum()
                assert counts.max() == 1 and ran < n, ran
                counts[:] = 0
                hk.pool_run_test(pool, counts)  # the same pool runs a normal job
                assert (counts == 1).all()
                print(f"RAISED {pool.num_threads} {fail} {'worker' if on_worker else 'caller'} "
                      f"{raised}: {message} after {ran} tasks", flush=True)

    # The pool the FFI handlers use: a worker's exception, then an expert FFN call on it.
    pool = HostExpertPool.allocate(1, 4, 64, 32, "float32")
    pool.gate_up[:] = np.random.default_rng(0).standard_normal(pool.gate_up.shape) * 0.1
    pool.down[:] = np.random.default_rng(1).standard_normal(pool.down.shape) * 0.1
    ex = HostExecutor(pool.freeze(), threads=2)
    args = (jnp.ones((3, 64), jnp.float32), jnp.zeros((), jnp.int32),
            jnp.array([[0, 1], [2, 3], [1, 2]], jnp.int32), jnp.full((3, 2), 0.5, jnp.float32))
    ok = np.asarray(ex.expert_ffn(*args, boundary="ffi_cpu"))
    try:
        hk.pool_run_test(shared_threads(2), np.zeros(64, np.int64), "bad_alloc", True)
    except MemoryError:
        pass
    again = np.asarray(ex.expert_ffn(*args, boundary="ffi_cpu"))
    assert np.array_equal(again, ok)
    print("SURVIVED", flush=True)
""")


def test_worker_thread_exception_becomes_python_error_and_pool_survives():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"process died (rc {proc.returncode}):\n{out[-3000:]}"
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("RAISED") for line in lines) == 8, out
    assert "SURVIVED" in lines, out


def test_pool_run_test_rejects_a_failing_job_without_workers():
    from ftjax import _host_kernels as hk

    with pytest.raises(ValueError, match="2 or more threads"):
        hk.pool_run_test(hk.ThreadPool(1), np.zeros(4, np.int64), "runtime")
    with pytest.raises(ValueError, match="fail must be"):
        hk.pool_run_test(hk.ThreadPool(2), np.zeros(4, np.int64), "segfault")


@pytest.fixture
def executor():
    pool = HostExpertPool.allocate(2, 4, 32, 16, "float32")
    pool.gate_up[:] = np.random.default_rng(0).standard_normal(pool.gate_up.shape) * 0.1
    pool.down[:] = np.random.default_rng(1).standard_normal(pool.down.shape) * 0.1
    yield HostExecutor(pool.freeze(), threads=2)
    inject_host_fault(0)  # a failed test leaves no fault behind for the next


ARGS = (jnp.ones((2, 32), jnp.float32), jnp.ones((), jnp.int32), jnp.array([[0, 3], [1, 2]], jnp.int32),
        jnp.full((2, 2), 0.5, jnp.float32))


def test_injected_host_fault_fails_one_ffi_call_then_serves(executor):
    step = jax.jit(lambda *a: executor.expert_ffn(*a, boundary="ffi_cpu"))
    ok = np.asarray(step(*ARGS))
    calls = executor.work_done()[0]
    inject_host_fault()
    with pytest.raises(Exception, match="ftjax_expert_ffn: injected host kernel fault"):
        np.asarray(step(*ARGS))
    assert executor.work_done()[0] == calls  # the failed call did no work
    assert np.array_equal(np.asarray(step(*ARGS)), ok)

    inject_host_fault(2)  # n calls fail, then the kernel runs again
    for _ in range(2):
        with pytest.raises(Exception, match="injected"):
            np.asarray(step(*ARGS))
    assert np.array_equal(np.asarray(step(*ARGS)), ok)

    inject_host_fault(3)
    inject_host_fault(0)  # clears
    assert np.array_equal(np.asarray(step(*ARGS)), ok)
    with pytest.raises(ValueError):
        inject_host_fault(-1)


def test_injected_host_fault_reaches_the_callback_boundary(executor):
    """The numpy entry point (what the callback boundary calls) fails the same way."""
    x, layer, ids, w = (np.asarray(a) for a in ARGS)
    ok = executor.expert_ffn_numpy(x, layer, ids, w)
    inject_host_fault()
    with pytest.raises(RuntimeError, match="injected host kernel fault"):
        executor.expert_ffn_numpy(x, layer, ids, w)
    assert np.array_equal(executor.expert_ffn_numpy(x, layer, ids, w), ok)
