"""C++ exceptions never escape the XLA FFI handlers: a kernel that throws (here
std::bad_alloc / std::length_error from an absurd scratch size baked into the call's
attributes) surfaces in Python as an exception naming the target, instead of
std::terminate killing the process. The calls run in a subprocess, so a regression
fails the test instead of crashing pytest."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from ftjax.experts.pool import HostExpertPool
    from ftjax.host import HostExecutor, FFI_TARGET, _register_ffi_targets

    pool = HostExpertPool.allocate(1, 4, 8, 4, "float32")
    pool.gate_up.fill(0.01); pool.down.fill(0.01)
    pool.freeze()
    ex = HostExecutor(pool, threads=2)
    x = jnp.ones((1, 8), jnp.float32)
    layer = jnp.zeros((), jnp.int32)
    ids = jnp.array([[0, 1]], jnp.int32)
    w = jnp.full((1, 2), 0.5, jnp.float32)
    ok = np.asarray(ex.expert_ffn(x, layer, ids, w, boundary="ffi_cpu"))  # the normal path works
    assert ok.shape == (1, 8) and np.isfinite(ok).all()

    _register_ffi_targets()
    for field, value in (("d_ff", 1 << 52), ("num_experts", 1 << 61)):
        attrs = ex._ffi_attributes()
        attrs[field] = np.int64(value)  # scratch of value floats / int64s: cannot be allocated
        call = jax.ffi.ffi_call(FFI_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32))
        try:
            jax.block_until_ready(call(x, layer, ids, w, **attrs))
        except Exception as e:
            print(f"RAISED {field} {type(e).__name__}: {e}", flush=True)
        else:
            print(f"NO ERROR {field}", flush=True)
    # the process (and the kernels) still work after the errors
    again = np.asarray(ex.expert_ffn(x, layer, ids, w, boundary="ffi_cpu"))
    assert np.array_equal(again, ok)
    print("SURVIVED", flush=True)
""")


def test_cpp_exception_in_ffi_handler_becomes_python_error():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"process died (rc {proc.returncode}):\n{out[-3000:]}"
    lines = proc.stdout.splitlines()
    d_ff = next(line for line in lines if " d_ff " in line)
    assert d_ff.startswith("RAISED") and "ftjax_expert_ffn" in d_ff and "bad_alloc" in d_ff, out
    num_experts = next(line for line in lines if " num_experts " in line)
    assert num_experts.startswith("RAISED") and "ftjax_expert_ffn" in num_experts, out
    assert "SURVIVED" in lines, out


def test_programs_hold_no_addresses_and_a_freed_pool_is_a_clear_error():
    """The expert handler finds its pool by a registered id and its workers by their
    count, so a program names no address: a second executor over another pool of the
    same shape (made after the first is freed) lowers to the same program text — the
    persistent compile cache can serve it. An id nobody registered is an error naming it."""
    import gc

    import jax
    import jax.numpy as jnp
    import numpy as np
    import pytest

    from ftjax.experts.pool import HostExpertPool
    from ftjax.host import FFI_TARGET, HostExecutor, _register_ffi_targets

    def executor():
        pool = HostExpertPool.allocate(1, 4, 8, 4, "float32")
        pool.gate_up.fill(0.01)
        pool.down.fill(0.01)
        return HostExecutor(pool.freeze(), threads=1)

    args = (jnp.ones((1, 8), jnp.float32), jnp.zeros((), jnp.int32), jnp.array([[0, 1]], jnp.int32),
            jnp.full((1, 2), 0.5, jnp.float32))

    def lowered(ex):
        return jax.jit(lambda *a: ex.expert_ffn(*a, boundary="ffi_cpu")).lower(*args).as_text()

    first = executor()
    text, address = lowered(first), first.pool.gate_up.ctypes.data
    assert str(address) not in text
    del first
    gc.collect()
    second = executor()
    assert lowered(second) == text
    attrs = second._ffi_attributes()
    attrs["pool_id"] = np.int32(12345)
    _register_ffi_targets()
    call = jax.ffi.ffi_call(FFI_TARGET, jax.ShapeDtypeStruct((1, 8), jnp.float32))
    with pytest.raises(Exception, match="no expert pool is registered as 12345"):
        jax.block_until_ready(call(*args, **attrs))
    assert np.isfinite(np.asarray(second.expert_ffn(*args, boundary="ffi_cpu"))).all()
