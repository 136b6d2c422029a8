"""The dense linear host kernel (host_kernels/linear.cc) against its numpy reference,
directly and through `ftjax.host.linear` inside jit (FFI on CPU, XLA's dot on the
callback boundary), and the packed (bf16 bits [out, in]) weights of `models.common.linear`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax import host
from ftjax.experts.pool import to_bf16_bits
from ftjax.experts.storage import FORMATS
from ftjax.host import Boundary, Isa, available_isas, linear_numpy, reference_linear
from ftjax.models.common import linear as model_linear
from test_amx import TILE_ISAS  # the bf16 tiles' engines, each skipped where this CPU lacks it

ISAS = [i for i in available_isas() if i not in host.tile_isas()]  # the tile ISAs: the tile tests below


def make(rng, n_out, n_in, tokens, dtype):
    w = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)  # [N, K]
    if dtype == "bfloat16":
        w = to_bf16_bits(w)
    x = rng.standard_normal((tokens, n_in)).astype(np.float32)  # [T, K]
    return x, w


def assert_close(y, ref):
    np.testing.assert_allclose(y, ref, rtol=0, atol=2e-5 * max(1.0, float(np.abs(ref).max())))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("isa", ISAS, ids=lambda i: i.name)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n_out,n_in,tokens", [
    (1, 1, 1), (7, 13, 1), (33, 64, 1), (130, 97, 2), (9, 31, 3), (200, 160, 5), (17, 300, 50),
    (1000, 64, 4),
])
def test_linear_matches_reference(dtype, isa, threads, n_out, n_in, tokens):
    rng = np.random.default_rng(n_out * 1000 + n_in + tokens)
    x, w = make(rng, n_out, n_in, tokens, dtype)
    assert_close(linear_numpy(x, w, threads=threads, isa=isa), reference_linear(x, w, isa=isa))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 3, 16, 77])
def test_jit_linear_matches_reference(dtype, tokens):
    rng = np.random.default_rng(tokens)
    x, w = make(rng, 70, 48, tokens, dtype)
    y = jax.jit(host.linear)(jnp.asarray(x), jnp.asarray(w))
    assert y.shape == (tokens, 70) and y.dtype == jnp.float32
    assert_close(np.asarray(y), reference_linear(x, w))


def test_leading_axes_and_lowering():
    rng = np.random.default_rng(1)
    x, w = make(rng, 24, 16, 6, "bfloat16")
    x3 = jnp.asarray(x.reshape(2, 3, 16))  # [B, T, K]
    y = jax.jit(host.linear)(x3, jnp.asarray(w))
    assert y.shape == (2, 3, 24)
    assert_close(np.asarray(y).reshape(6, 24), reference_linear(x, w))
    assert host.LINEAR_FFI_TARGET in jax.jit(host.linear).lower(x3, jnp.asarray(w)).as_text()


def test_callback_boundary_uses_xla():
    rng = np.random.default_rng(2)
    x, w = make(rng, 10, 12, 2, "bfloat16")
    fn = jax.jit(lambda x, w: host.linear(x, w, boundary=Boundary.CALLBACK))
    assert host.LINEAR_FFI_TARGET not in fn.lower(x, w).as_text()
    assert_close(np.asarray(fn(x, w)), reference_linear(x, w, isa=Isa.SCALAR))  # XLA: float32 activations


def test_model_linear_dispatches_on_storage():
    """float [in, out] weights multiply as x @ w; uint16 [out, in] go to the kernel."""
    rng = np.random.default_rng(3)
    x, w_bits = make(rng, 12, 8, 2, "bfloat16")
    w_f32 = (w_bits.astype(np.uint32) << 16).view(np.float32)  # the same values
    packed = np.asarray(model_linear(jnp.asarray(x), jnp.asarray(w_bits)))
    plain = np.asarray(model_linear(jnp.asarray(x), jnp.asarray(w_f32.T)))
    if host.rounds_activations_to_bf16():  # the kernel met bf16-rounded activations
        assert_close(packed, reference_linear(x, w_bits))
        assert_close(plain, reference_linear(x, w_bits, isa=Isa.SCALAR))
    else:
        assert_close(packed, plain)


def test_packed_linear_uses_gemm_for_many_rows(monkeypatch):
    """Packed weights: below PACKED_GEMM_MIN_TOKENS rows the host kernel (FFI target in
    the program), from it XLA's dot on the widened matrix unless that would exceed
    PACKED_GEMM_MAX_BYTES; every path equals the reference."""
    from ftjax.models import ops
    from ftjax.models.ops import PACKED_GEMM_MIN_TOKENS

    rng = np.random.default_rng(4)
    cases = [(PACKED_GEMM_MIN_TOKENS - 1, True, None), (PACKED_GEMM_MIN_TOKENS, False, None),
             (PACKED_GEMM_MIN_TOKENS, True, 4 * 24 * 40 - 1)]  # widened matrix over the byte cap
    for rows, kernel, max_bytes in cases:
        if max_bytes is not None:
            monkeypatch.setattr(ops, "PACKED_GEMM_MAX_BYTES", max_bytes)
        x, w_bits = make(rng, 24, 40, rows, "bfloat16")
        fn = jax.jit(lambda x, w: model_linear(x, w))  # a fresh trace for each case
        ref = reference_linear(x, w_bits, isa=Isa.AUTO if kernel else Isa.SCALAR)  # XLA's GEMM: float32 activations
        assert_close(np.asarray(fn(jnp.asarray(x), jnp.asarray(w_bits))), ref)
        assert (host.LINEAR_FFI_TARGET in fn.lower(jnp.asarray(x), jnp.asarray(w_bits)).as_text()) == kernel



def test_bad_arguments_raise():
    rng = np.random.default_rng(4)
    x, w = make(rng, 8, 6, 2, "float32")
    with pytest.raises(ValueError, match="x must be"):
        linear_numpy(x[:, :5], w)
    with pytest.raises(ValueError, match="float32 or uint16"):
        linear_numpy(x, w.astype(np.float64))
    if Isa.AVX512 not in ISAS:
        with pytest.raises(ValueError, match="ISA"):
            linear_numpy(x, w, isa=Isa.AVX512)


def test_dense_settings_cap_the_pool_and_choose_the_isa():
    """`load(threads=N)` traces its steps inside `host.dense_settings(N, isa)`: the dense
    kernel's FFI call then names the N-thread pool (`threads` attribute, the process's
    shared pool of that size), not the all-cores one, and the block's ISA (numerics="fast":
    AMX_BF16) unless the call names its own."""
    x, w = jnp.ones((1, 64), jnp.float32), jnp.ones((32, 64), jnp.uint16)
    lowered = lambda **kw: jax.jit(lambda x, w: host.linear(x, w, **kw)).lower(x, w).as_text()  # noqa: E731
    with host.dense_settings(1, Isa.SCALAR):
        capped, named = lowered(), lowered(isa=Isa.AUTO if host.auto_isa() is Isa.SCALAR else host.auto_isa())
    assert "threads = 1 : i64" in capped  # the handler runs on the process's 1-thread pool
    assert f"isa = {Isa.SCALAR.value} : i32" in capped
    assert f"isa = {host.auto_isa().value} : i32" in named
    plain = lowered()
    assert f"threads = {host.default_threads()} : i64" in plain
    assert f"isa = {host.resolve_isa(Isa.AUTO).value} : i32" in plain


# ---- bf16 tiles (a prompt's tokens under AMX_BF16 or its vector form: linear.cc `linear_amx`) ----


def stored(w32: np.ndarray, wtype: str) -> tuple[np.ndarray, str | None]:
    """float32 weights [N, K] in the storage `linear` takes for `wtype` (bf16 bits; a block
    format's rows, named)."""
    if wtype == "bfloat16":
        return to_bf16_bits(w32), None
    return FORMATS[wtype].from_f32_numpy(w32), wtype


@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize("wtype", ["bfloat16", "q8_0", "q4_k", "q6_k", "q4_k_or_q6_k"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n_out,n_in,tokens", [
    (48, 256, 16),   # a 16-row last pass, one token block
    (64, 512, 40),   # a partial token block
    (96, 256, 600),  # three token chunks (256 tokens each), the last partial
])
def test_tiles_match_the_rounding_reference(isa, wtype, threads, n_out, n_in, tokens):
    """On the bf16 tiles (AMX or their vector form) the activations are rounded to bf16
    and block weights widened to bf16, as the reference does; Q8_0 on AMX-INT8 tiles keeps
    the exact path's int8 sums (where those are not granted it is widened to bf16 too). In
    the vector form block weights take the int8 one where AVX512-VNNI passed its self-check:
    the exact path's int8 activations and sums, so its numbers up to float order."""
    kind = host.tile_kind(wtype, isa)  # where the bf16 tiles run, so does the AVX512-BF16 widening
    int8_vector = isa is Isa.AVX512_BF16_TILES and wtype != "bfloat16" and host.int8_vector_status() == ""
    assert kind == ("int8" if wtype == "q8_0" and isa is Isa.AMX_BF16 and host.amx_int8_status() == ""
                    else "int8_vector" if int8_vector else "bf16")
    rng = np.random.default_rng(n_out + n_in + tokens)
    x, w32 = make(rng, n_out, n_in, tokens, "float32")
    w, name = stored(w32, wtype)
    assert host.linear_takes_tiles(isa, tokens, n_out, n_in, wtype)
    y = linear_numpy(x, w, threads=threads, isa=isa, wtype=name)
    ref = reference_linear(x, w, name, isa=isa)
    assert_close(y, ref)
    exact = reference_linear(x, w, name)
    if kind == "bf16":  # the rounding is the tiles'
        assert np.abs(y - exact).max() > 10 * np.abs(y - ref).max()
    else:
        assert_close(y, exact)
    assert np.array_equal(y, linear_numpy(x, w, threads=2, isa=isa, wtype=name))  # threads change no bit


@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize("case", ["decode", "rows not whole tiles", "q4_0"])
def test_calls_the_tiles_do_not_take_keep_the_exact_kernels(isa, case):
    """Fewer than 16 tokens, N not a multiple of 16 and formats without tiles (Q4_0) run the
    exact kernels under AMX_BF16: AUTO's numbers, to the bit."""
    n_out, n_in, tokens, wtype = {"decode": (64, 256, 1, "q4_k"), "rows not whole tiles": (40, 256, 32, "bfloat16"),
                                  "q4_0": (64, 256, 32, "q4_0")}[case]
    rng = np.random.default_rng(3)
    x, w32 = make(rng, n_out, n_in, tokens, "float32")
    w, name = stored(w32, wtype)
    assert not host.linear_takes_tiles(isa, tokens, n_out, n_in, wtype)
    np.testing.assert_array_equal(linear_numpy(x, w, threads=2, isa=isa, wtype=name),
                                  linear_numpy(x, w, threads=2, isa=Isa.AUTO, wtype=name))


@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize("wtype", ["bfloat16", "q8_0"])
def test_a_prompt_on_the_tiles_keeps_the_kernel_at_every_row_count(isa, wtype):
    """Under a tile ISA (numerics="fast": `host.dense_settings`) a packed or quantised
    matrix stays on the host kernel from PACKED_GEMM_MIN_TOKENS rows too — its bf16 tiles
    beat XLA's GEMM on the widened matrix — and gives the tiles' rounding reference; where
    the tiles do not take the matrix (Q8_0 under AMX without AMX-INT8) XLA's GEMM stays."""
    from ftjax.models.ops import PACKED_GEMM_MIN_TOKENS, QuantMatrix

    rows = PACKED_GEMM_MIN_TOKENS + 9
    x, w32 = make(np.random.default_rng(11), 48, 64, rows, "float32")
    w, name = stored(w32, wtype)
    takes = host.linear_takes_tiles(isa, rows, 48, 64, wtype)
    weight = jnp.asarray(w) if name is None else QuantMatrix(jnp.asarray(w), name)
    with host.dense_settings(2, isa):
        fn = jax.jit(lambda x, w: model_linear(x, w))
        text = fn.lower(jnp.asarray(x), weight).as_text()
        y = np.asarray(fn(jnp.asarray(x), weight))
    assert (host.LINEAR_FFI_TARGET in text) == takes
    if takes:
        assert_close(y, reference_linear(x, w, name, isa=isa))
