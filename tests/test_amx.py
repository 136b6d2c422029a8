"""AMX tiles for expert prefill (host_kernels/amx.cc, the tile path of
host_kernels/expert_ffn.cc): AMX-BF16 and the bf16 tiles' vector form (AVX512_BF16_TILES:
the same layouts on vdpbf16ps, for CPUs without AMX) against the numpy reference that
rounds the activations as the tiles do, AMX-INT8 (Q8_0 experts) and the int8 tiles' VNNI
vector form (host_kernels/int8_vector.cc: Q8_0, Q4_K, Q6_K under AVX512_BF16_TILES) against
the exact integer kernels or the reference that quantises activations per 32 values; the
self-checks and every fallback.

The tile tests run where the CPU, the OS and Linux's permission give AMX-BF16 tiles
(`host.amx_bf16_status() == ""`), the vector forms' where the CPU has AVX512-BF16 and
VNNI (`host.bf16_vector_status() == ""`, `host.int8_vector_status() == ""`), and are
skipped elsewhere with the reason; the
fallback tests run everywhere. Letters: D model dim, F expert FFN dim, T tokens, K top-k.
"""

import numpy as np
import pytest

import ftjax
from ftjax import host
from ftjax.experts.storage import FORMATS, Q46_K_BYTES, quantise_q4_k, quantise_q6_k, tagged_k_blocks, to_bf16_bits
from ftjax.host import AMX_MIN_TOKENS, HostExecutor, Isa, available_isas, takes_amx_tiles
from test_host_kernels import make_batch, make_pool, reference

STATUS = host.amx_bf16_status()
needs_amx = pytest.mark.skipif(STATUS != "", reason=f"no AMX-BF16 tiles here: {STATUS}")
VECTOR = host.bf16_vector_status()
needs_vector = pytest.mark.skipif(VECTOR != "", reason=f"no AVX512-BF16 vector form here: {VECTOR}")
# the bf16 tiles' two engines: each test below runs on every one this CPU has
TILE_ISAS = [pytest.param(Isa.AMX_BF16, marks=needs_amx, id="amx"),
             pytest.param(Isa.AVX512_BF16_TILES, marks=needs_vector, id="vector")]
INT8_STATUS = host.amx_int8_status()
needs_amx_int8 = pytest.mark.skipif(INT8_STATUS != "", reason=f"no AMX-INT8 tiles here: {INT8_STATUS}")
INT8_VECTOR = host.int8_vector_status()
needs_int8_vector = pytest.mark.skipif(INT8_VECTOR != "", reason=f"no AVX512-VNNI int8 vector form here: {INT8_VECTOR}")
# the int8 tiles' two engines (Q8_0 on AMX-INT8; every block format in the VNNI vector form)
INT8_ISAS = [pytest.param(Isa.AMX_BF16, marks=[needs_amx, needs_amx_int8], id="amx"),
             pytest.param(Isa.AVX512_BF16_TILES, marks=[needs_vector, needs_int8_vector], id="vector")]


def test_the_self_check_is_reported_and_decides_availability():
    """One answer per process: "" (usable) or a reason naming what failed; the ISA list,
    the benchmark lines (`isa_report`) and the model's choice follow it."""
    assert isinstance(STATUS, str) and host.amx_bf16_status() == STATUS
    assert (Isa.AMX_BF16 in available_isas()) == (STATUS == "")
    assert (Isa.AVX512_BF16_TILES in available_isas()) == (VECTOR == "")
    report = host.isa_report()
    assert {k: report[k] for k in ("auto", "amx_bf16", "amx_int8", "bf16_vector", "fast")} == {
        "auto": host.auto_isa().name.lower(), "amx_bf16": STATUS or "ok", "amx_int8": host.amx_int8_status() or "ok",
        "bf16_vector": VECTOR or "ok", "fast": host.expert_isa("fast").name.lower()}
    assert host.auto_isa() not in host.tile_isas()  # AUTO stays exact
    if STATUS:
        assert any(word in STATUS for word in ("CPUID", "XSAVE", "XCR0", "arch_prctl", "self-check", "x86-64"))
    if VECTOR:
        assert any(word in VECTOR for word in ("CPUID", "self-check", "x86-64"))
    assert (VECTOR == "") == host._hk.has_avx512_bf16() or "self-check" in VECTOR
    # what numerics="fast" asks for: AMX where it passed, else the vector form, else exact
    assert host.expert_isa("fast") is (Isa.AMX_BF16 if STATUS == "" else
                                       Isa.AVX512_BF16_TILES if VECTOR == "" else Isa.AUTO)


@pytest.mark.skipif(STATUS == "", reason="this CPU has AMX-BF16 tiles: the refusal is for CPUs without them")
def test_without_tiles_asking_for_them_is_a_clear_error(monkeypatch):
    pool = make_pool(np.random.default_rng(0), 1, 4, 64, 32, "bfloat16")
    with pytest.raises(ValueError, match="not available"):
        HostExecutor(pool, threads=1, isa=Isa.AMX_BF16).expert_ffn_numpy(
            np.ones((16, 64), np.float32), 0, np.zeros((16, 1), np.int32), np.ones((16, 1), np.float32))
    monkeypatch.setenv(host.ISA_ENV, "amx_bf16")
    with pytest.raises(ValueError, match="this CPU has only"):
        host.resolve_isa()
    monkeypatch.delenv(host.ISA_ENV)
    assert host.expert_isa("fast") is (Isa.AVX512_BF16_TILES if VECTOR == "" else Isa.AUTO)


@pytest.mark.skipif(VECTOR == "", reason="this CPU has the vector form: the refusal is for CPUs without AVX512-BF16")
def test_without_the_vector_form_asking_for_it_is_a_clear_error():
    pool = make_pool(np.random.default_rng(0), 1, 4, 64, 32, "bfloat16")
    with pytest.raises(ValueError, match="not available"):
        HostExecutor(pool, threads=1, isa=Isa.AVX512_BF16_TILES).expert_ffn_numpy(
            np.ones((16, 64), np.float32), 0, np.zeros((16, 1), np.int32), np.ones((16, 1), np.float32))


@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("d_model,d_ff,num_tokens,top_k", [
    (64, 32, 16, 1),     # one tile pass, one token block
    (96, 64, 17, 2),     # a second, partial token block; 3 row tiles of D (a half pass)
    (256, 128, 64, 4),   # several token pairs: the copied-rows path for the busiest experts
    (64, 96, 200, 8),    # > 4 token blocks per expert: rows copied before the passes
])
def test_tiles_match_the_rounding_reference(isa, threads, d_model, d_ff, num_tokens, top_k):
    rng = np.random.default_rng(d_model + d_ff + num_tokens)
    pool = make_pool(rng, 2, 6, d_model, d_ff, "bfloat16")
    x, ids, weights = make_batch(rng, num_tokens, top_k, d_model, pool.num_experts)
    executor = HostExecutor(pool, threads=threads, isa=isa)
    assert takes_amx_tiles(isa, num_tokens, d_model, d_ff, "bfloat16")
    for layer in range(pool.num_layers):
        y = executor.expert_ffn_numpy(x, layer, ids, weights)
        ref = reference(pool, layer, x, ids, weights, isa)
        # h is rounded to bf16 on both sides, from f32 sums here and f64 there: a value at a
        # rounding boundary may go either way (one bf16 step, 2^-8 of it, through down)
        scale = max(1.0, float(np.abs(ref).max()))
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-3 * scale)
        assert np.mean(np.abs(y - ref) > 2e-5 * scale) < 0.01  # ... which few values are
        exact = reference(pool, layer, x, ids, weights, Isa.AVX512)
        assert np.abs(y - exact).max() > np.abs(y - ref).max()  # the rounding is the tiles', not the exact path's


@pytest.mark.parametrize("isa", TILE_ISAS)
def test_tiles_clamp_the_swiglu_and_keep_nans(isa):
    """The tile path's vector SwiGLU (amx_swiglu): a clamped SwiGLU (gpt-oss's limit) as the
    reference clamps it, and a NaN in a token's activations stays in that token's output
    (the min / max keep it, as the scalar std::min / std::clamp do) and in no other."""
    rng = np.random.default_rng(29)
    pool = make_pool(rng, 1, 4, 64, 64, "bfloat16")
    x, ids, weights = make_batch(rng, 32, 2, 64, 4)
    x *= 4  # pre-activations well past the limit
    tiles = HostExecutor(pool, threads=2, isa=isa, swiglu_limit=0.5)
    y = tiles.expert_ffn_numpy(x, 0, ids, weights)
    ref = host.reference_expert_ffn(pool.gate_up, pool.down, 0, x, ids, weights, swiglu_limit=0.5, isa=isa)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-3 * max(1.0, float(np.abs(ref).max())))
    x[3, 5] = np.nan
    ids[3] = [0, -1]
    y = tiles.expert_ffn_numpy(x, 0, ids, weights)
    assert np.isnan(y[3]).all() and not np.isnan(np.delete(y, 3, axis=0)).any()


@pytest.mark.parametrize("isa", TILE_ISAS)
def test_thread_count_does_not_change_the_sums(isa):
    rng = np.random.default_rng(5)
    pool = make_pool(rng, 1, 8, 128, 64, "bfloat16")
    x, ids, weights = make_batch(rng, 48, 4, 128, 8)
    runs = [HostExecutor(pool, threads=t, isa=isa).expert_ffn_numpy(x, 0, ids, weights) for t in (1, 2, 4)]
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[0], runs[2])


@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize("case", ["decode", "f32 experts", "D not whole passes"])
def test_calls_the_tiles_do_not_take_keep_the_exact_kernels(isa, case):
    """Fewer than AMX_MIN_TOKENS tokens (decode), f32 experts and widths that are not whole
    32-row passes run the exact kernels under AMX_BF16: the same numbers as AUTO."""
    rng = np.random.default_rng(7)
    d_model, d_ff, tokens, dtype = {"decode": (64, 32, AMX_MIN_TOKENS - 1, "bfloat16"),
                                    "f32 experts": (64, 32, 40, "float32"),
                                    "D not whole passes": (80, 32, 40, "bfloat16")}[case]
    pool = make_pool(rng, 1, 4, d_model, d_ff, dtype)
    x, ids, weights = make_batch(rng, tokens, 2, d_model, 4)
    assert not takes_amx_tiles(isa, tokens, d_model, d_ff, dtype)
    tiles = HostExecutor(pool, threads=2, isa=isa).expert_ffn_numpy(x, 0, ids, weights)
    auto = HostExecutor(pool, threads=2, isa=Isa.AUTO).expert_ffn_numpy(x, 0, ids, weights)
    np.testing.assert_array_equal(tiles, auto)


def test_the_model_takes_tiles_under_fast_numerics_only(monkeypatch):
    """numerics="fast" (the default for bf16 checkpoints) runs host experts with AMX_BF16
    where the self-check passed, else with the vector form where that one passed; "exact"
    and a set $FTJAX_ISA keep their own choice; stats() names the path."""
    monkeypatch.delenv(host.ISA_ENV, raising=False)
    fast = ftjax.load(policy="host")
    assert fast.numerics == "fast"
    exact = host.auto_isa().name.lower()
    assert fast.stats()["host_isa"] == ("amx_bf16" if STATUS == "" else "avx512_bf16_tiles" if VECTOR == "" else exact)
    assert ftjax.load(policy="host", numerics="exact").stats()["host_isa"] == exact
    assert ftjax.load().stats()["host_isa"] is None  # the device policy: no host experts
    monkeypatch.setenv(host.ISA_ENV, "scalar")
    assert ftjax.load(policy="host").stats()["host_isa"] == "scalar"


ROUNDING_ISAS = [*TILE_ISAS, pytest.param(Isa.AVX512_BF16, marks=pytest.mark.skipif(
    Isa.AVX512_BF16 not in available_isas(), reason="no AVX512-BF16 here"), id="avx512_bf16")]


@pytest.mark.parametrize("isa", ROUNDING_ISAS)
@pytest.mark.parametrize("num_tokens", [40, AMX_MIN_TOKENS - 1])
def test_the_device_half_rounds_as_the_host_kernel_does(isa, num_tokens):
    """`host.expert_formats`: the formats the device FFN computes a record with are those
    the host kernel computes it with — bf16-rounded activations for a prompt on the tiles
    (and for every call under AVX512_BF16), the plain formats for a decode-sized call on
    the tiles — so an expert's output does not depend on where it ran (beyond f32
    summation order and the rare bf16 step of a value at a rounding boundary)."""
    import jax.numpy as jnp

    from ftjax.experts.executor import device_ffn
    from ftjax.experts.storage import flat_rows, part_formats

    rng = np.random.default_rng(num_tokens)
    pool = make_pool(rng, 2, 6, 128, 64, "bfloat16")
    x, ids, weights = make_batch(rng, num_tokens, 4, 128, pool.num_experts)
    fmts = host.expert_formats("bfloat16", isa, 128, 64, num_tokens)
    rounds = isa is Isa.AVX512_BF16 or num_tokens >= AMX_MIN_TOKENS
    assert (fmts == part_formats("bfloat16")) != rounds
    flat = flat_rows({"gate_up": jnp.asarray(pool.gate_up), "down": jnp.asarray(pool.down)})
    layer = 1
    rows = jnp.asarray(np.where(ids >= 0, layer * pool.num_experts + ids, -1))
    y_host = HostExecutor(pool, threads=2, isa=isa).expert_ffn_numpy(x, layer, ids, weights)
    y_dev, y_plain = (np.asarray(device_ffn(flat["gate_up"], flat["down"], jnp.asarray(x), rows, jnp.asarray(weights),
                                            fmt=f)) for f in (fmts, part_formats("bfloat16")))
    scale = max(1.0, float(np.abs(y_host).max()))
    np.testing.assert_allclose(y_dev, y_host, rtol=0, atol=1e-3 * scale)
    assert np.mean(np.abs(y_dev - y_host) > 2e-5 * scale) < 0.01
    if rounds:  # the plain formats (f32 activations) are what the device half computed before
        assert np.abs(y_plain - y_host).max() > 10 * np.abs(y_dev - y_host).max()


# ---- int8: Q8_0 experts on AMX-INT8 or the VNNI vector form -------------------------------------


def test_the_int8_self_check_is_reported_and_decides_the_q8_0_tiles():
    """One answer per process, in the benchmark lines; Q8_0 calls take the tiles under
    AMX_BF16 only where it passed (and never other block formats, nor mixed parts)."""
    assert isinstance(INT8_STATUS, str) and host.amx_int8_status() == INT8_STATUS
    assert host.isa_report()["amx_int8"] == (INT8_STATUS or "ok")
    if INT8_STATUS:
        assert any(word in INT8_STATUS for word in ("CPUID", "XSAVE", "XCR0", "arch_prctl", "self-check", "x86-64"))
    takes = STATUS == "" and INT8_STATUS == ""
    assert takes_amx_tiles(Isa.AMX_BF16, 64, 128, 64, "q8_0") == takes
    assert host.tile_kind("q8_0", Isa.AMX_BF16) == ("int8" if takes else "bf16" if STATUS == "" and WIDENS else None)
    assert host.tile_kind("q8_0", Isa.AVX512_BF16_TILES) == (
        None if VECTOR else "int8_vector" if INT8_VECTOR == "" else "bf16" if WIDENS else None)
    for dtype in ("q4_0", "mxfp4", "fp8_e4m3", "float32"):  # no tiles, no vector widening
        assert host.tile_kind(dtype, Isa.AMX_BF16) is None and host.tile_kind(dtype, Isa.AVX512_BF16_TILES) is None
        assert not takes_amx_tiles(Isa.AMX_BF16, 64, 256, 256, dtype)
    assert not takes_amx_tiles(Isa.AUTO, 64, 128, 64, "q8_0")


def q8_0_pool(rng, num_layers, num_experts, d_model, d_ff):
    return make_pool(rng, num_layers, num_experts, d_model, d_ff, "float32").converted("q8_0")


def test_the_int8_vector_self_check_is_reported_and_decides_the_block_formats():
    """One answer per process, in the benchmark lines: under AVX512_BF16_TILES every block
    format the vector form knows (Q8_0, Q4_K, Q6_K, the tagged one) takes it where it
    passed, the bf16 vector form where it did not; bf16 weights always the bf16 one."""
    assert isinstance(INT8_VECTOR, str) and host.int8_vector_status() == INT8_VECTOR
    assert host.isa_report()["int8_vector"] == (INT8_VECTOR or "ok")
    if INT8_VECTOR:
        assert any(word in INT8_VECTOR for word in ("CPUID", "self-check", "x86-64"))
    for dtype in ("q8_0", "q4_k", "q6_k", "q4_k_or_q6_k"):
        want = None if VECTOR else "int8_vector" if INT8_VECTOR == "" else "bf16" if WIDENS else None
        assert host.tile_kind(dtype, Isa.AVX512_BF16_TILES) == want
        assert host.tile_kind(dtype, Isa.AMX_BF16) != "int8_vector"
    assert host.tile_kind("bfloat16", Isa.AVX512_BF16_TILES) == (None if VECTOR else "bf16")


@pytest.mark.parametrize("isa", INT8_ISAS)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("d_model,d_ff,num_tokens,top_k", [
    (64, 32, 16, 1),     # one 16-row block, one token block, one K block pair
    (96, 64, 17, 2),     # a partial second token block; an odd number of K blocks (3)
    (256, 128, 64, 4),   # several token blocks per expert
    (64, 96, 200, 8),    # many tokens per expert
])
def test_q8_0_tiles_match_the_exact_kernels(isa, threads, d_model, d_ff, num_tokens, top_k):
    """The tiles compute the exact path's integer block sums and scale them as it does: the
    same numbers up to float summation order, on the same int8 activations (the numpy
    reference quantises them as the kernels do)."""
    rng = np.random.default_rng(d_model + d_ff + num_tokens)
    pool = q8_0_pool(rng, 2, 6, d_model, d_ff)
    x, ids, weights = make_batch(rng, num_tokens, top_k, d_model, pool.num_experts)
    assert takes_amx_tiles(isa, num_tokens, d_model, d_ff, "q8_0")
    tiles = HostExecutor(pool, threads=threads, isa=isa)
    exact = HostExecutor(pool, threads=threads, isa=Isa.AUTO)
    for layer in range(pool.num_layers):
        y = tiles.expert_ffn_numpy(x, layer, ids, weights)
        y_exact = exact.expert_ffn_numpy(x, layer, ids, weights)
        scale = max(1.0, float(np.abs(y_exact).max()))
        # h is quantised to int8 on both sides from f32 sums in another order: a value at a
        # rounding boundary may move one int8 step (1/127 of its block's largest)
        np.testing.assert_allclose(y, y_exact, rtol=0, atol=2e-3 * scale)
        assert np.mean(np.abs(y - y_exact) > 1e-5 * scale) < 0.01
        ref = host.reference_expert_ffn(pool.gate_up, pool.down, layer, x, ids, weights, "q8_0")
        np.testing.assert_allclose(y, ref, rtol=0, atol=2e-3 * scale)


@pytest.mark.parametrize("isa", INT8_ISAS)
def test_q8_0_tiles_do_not_depend_on_the_thread_count(isa):
    rng = np.random.default_rng(11)
    pool = q8_0_pool(rng, 1, 8, 128, 64)
    x, ids, weights = make_batch(rng, 48, 4, 128, 8)
    runs = [HostExecutor(pool, threads=t, isa=isa).expert_ffn_numpy(x, 0, ids, weights) for t in (1, 2, 4)]
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[0], runs[2])


@needs_amx
@pytest.mark.parametrize("case", ["decode", "q4_0 experts"])
def test_q8_0_calls_the_tiles_do_not_take_keep_the_exact_kernels(case):
    """Decode-sized calls and other block formats (a Q8_0 row is always whole passes:
    32 | D and 32 | F) run the exact integer kernels under AMX_BF16: the same numbers as AUTO, to the bit."""
    rng = np.random.default_rng(13)
    d_model, d_ff, tokens, dtype = {"decode": (64, 32, AMX_MIN_TOKENS - 1, "q8_0"),
                                    "q4_0 experts": (64, 32, 40, "q4_0")}[case]
    pool = make_pool(rng, 1, 4, d_model, d_ff, "float32").converted(dtype)
    x, ids, weights = make_batch(rng, tokens, 2, d_model, 4)
    assert not takes_amx_tiles(isa, tokens, d_model, d_ff, dtype)
    tiles = HostExecutor(pool, threads=2, isa=isa).expert_ffn_numpy(x, 0, ids, weights)
    auto = HostExecutor(pool, threads=2, isa=Isa.AUTO).expert_ffn_numpy(x, 0, ids, weights)
    np.testing.assert_array_equal(tiles, auto)


@pytest.mark.skipif(host.tile_kind("q8_0", host.expert_isa("fast")) not in ("int8", "int8_vector"),
                    reason="numerics='fast' puts no Q8_0 expert on int8 tiles here (no AMX-INT8, no VNNI vector form)")
def test_a_q8_0_model_prefills_on_the_int8_tiles_with_the_exact_paths_tokens(monkeypatch):
    """The default model with Q8_0 experts: numerics="fast" (the default for quantised
    experts) prefills its host experts on the int8 tiles (AMX-INT8 or their VNNI vector
    form), and with the same K/V dtype its
    greedy tokens are the exact path's and its logits within a few 1e-3: each layer's h
    is quantised to int8 from sums added in another order, so a value at a rounding
    boundary moves one int8 step, and later layers carry it on. (Dense weights in f32, which
    take no tiles: bf16 ones would prefill on the bf16 tiles under "fast". The prompt's
    attention, which "fast" puts on the bf16 tiles too, is kept on the f32 path here, so
    that only the experts differ.)"""
    monkeypatch.delenv(host.ISA_ENV, raising=False)
    monkeypatch.setattr(host, "attention_takes_tiles", lambda *args: False)
    prompt = list(range(5, 45))  # 40 tokens: prefill calls of >= AMX_MIN_TOKENS
    fast = ftjax.load(policy="host", expert_dtype="int8", dense_dtype="float32", kv_dtype="float32")
    exact = ftjax.load(policy="host", expert_dtype="int8", dense_dtype="float32", kv_dtype="float32", numerics="exact")
    assert fast.checkpoint.pool.dtype == "q8_0" and fast.numerics == "fast"
    isa = host.expert_isa("fast")
    assert (fast.stats()["host_isa"], exact.stats()["host_isa"]) == (isa.name.lower(), host.auto_isa().name.lower())
    assert takes_amx_tiles(isa, len(prompt), fast.config.d_model, fast.config.d_ff_expert, "q8_0")
    a, b = fast.logits(prompt), exact.logits(prompt)
    scale = float(np.abs(b).max())
    np.testing.assert_allclose(a, b, rtol=0, atol=5e-3 * scale)
    assert np.mean(np.abs(a - b) > 1e-3 * scale) < 0.01 and not np.array_equal(a, b)
    assert fast.generate(prompt, 8) == exact.generate(prompt, 8)



# ---- K formats (Q4_K, Q6_K): rows widened to bf16 (host_kernels/dequant.cc), then the bf16 tiles --

WIDENS = host.dequant_bf16_fast("q4_k")
needs_widening = pytest.mark.skipif(not WIDENS, reason="no vector widening of Q4_K / Q6_K to bf16 here "
                                                       "(it needs AVX512-BF16)")


def block_rows(rng, dtype, rows, cols):
    """Rows of a block format from floats of varied magnitude (a zero row, tiny and large
    rows), Q4_K-or-Q6_K with both tags (blocks alternate)."""
    a = rng.standard_normal((rows, cols)).astype(np.float32) * np.logspace(-4, 2, rows, dtype=np.float32)[:, None]
    a[0] = 0.0
    if dtype != "q4_k_or_q6_k":
        return FORMATS[dtype].from_f32_numpy(a)
    q4 = tagged_k_blocks(quantise_q4_k(a), "q4_k").reshape(rows, -1, Q46_K_BYTES)
    q6 = tagged_k_blocks(quantise_q6_k(a), "q6_k").reshape(rows, -1, Q46_K_BYTES)
    q4[:, 1::2] = q6[:, 1::2]
    return q4.reshape(rows, -1)


@pytest.mark.parametrize("dtype", ["q4_k", "q6_k", "q4_k_or_q6_k", "q8_0", "q4_0", "mxfp4"])
def test_widening_equals_the_numpy_twin_rounded_to_bf16(dtype):
    """A widened row is the format's numpy twin (gguf's float32 operations) rounded to bf16,
    bit for bit: the scalar reference for every block format it knows, and the vector code
    the tiles use where this CPU runs it."""
    rng = np.random.default_rng(len(dtype))
    w = block_rows(rng, dtype, 12, 512)
    want = to_bf16_bits(FORMATS[dtype].to_f32_numpy(w).reshape(12, 512))
    np.testing.assert_array_equal(host.dequant_bf16(w, dtype, simd=False), want)
    if host.dequant_bf16_fast(dtype):
        np.testing.assert_array_equal(host.dequant_bf16(w, dtype, simd=True), want)
    assert host.dequant_bf16_fast(dtype) == (dtype in ("q4_k", "q6_k", "q4_k_or_q6_k", "q8_0") and WIDENS)


def k_pool(rng, dtype, num_layers, num_experts, d_model, d_ff):
    return make_pool(rng, num_layers, num_experts, d_model, d_ff, "float32").converted(dtype)


@needs_widening
@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype,d_model,d_ff,num_tokens,top_k", [
    ("q4_k", 256, 256, 16, 1),             # one token block
    ("q6_k", 512, 256, 40, 2),             # a partial token block
    ("q4_k/q6_k", 256, 512, 200, 8),       # llama.cpp's Q4_K_M parts, many tokens per expert
    ("q4_k/q4_k_or_q6_k", 256, 256, 64, 4),  # a GGUF Q4_K_M's tagged down part
    pytest.param("q8_0/q6_k", 256, 256, 48, 4, marks=needs_amx_int8),  # int8 tiles for gate/up, bf16 for down
])
def test_k_format_tiles_match_the_widening_reference(isa, threads, dtype, d_model, d_ff, num_tokens, top_k):
    """Q4_K / Q6_K experts on the tiles: the weights widened to bf16 and the activations
    rounded to bf16 (the numpy reference does the same); further from the exact path's
    int8 activations than from that reference. In the int8 vector form: the exact path's
    int8 activations and sums, so its numbers up to float order (h quantised from sums in
    another order may move one int8 step, as for Q8_0)."""
    rng = np.random.default_rng(d_model + d_ff + num_tokens)
    pool = k_pool(rng, dtype, 2, 6, d_model, d_ff)
    x, ids, weights = make_batch(rng, num_tokens, top_k, d_model, pool.num_experts)
    assert takes_amx_tiles(isa, num_tokens, d_model, d_ff, dtype)
    int8 = host.tile_kind("q4_k", isa) == "int8_vector"
    executor = HostExecutor(pool, threads=threads, isa=isa)
    for layer in range(pool.num_layers):
        y = executor.expert_ffn_numpy(x, layer, ids, weights)
        ref = host.reference_expert_ffn(pool.gate_up, pool.down, layer, x, ids, weights, dtype, isa=isa)
        scale = max(1.0, float(np.abs(ref).max()))
        # as for bf16 experts: h rounded to bf16 from f32 sums here, f64 there (each y sums
        # F * K of them: a few percent of the outputs carry one such step)
        np.testing.assert_allclose(y, ref, rtol=0, atol=(2e-3 if int8 else 1e-3) * scale)
        assert np.mean(np.abs(y - ref) > 2e-5 * scale) < 0.05
        if not int8:
            exact = host.reference_expert_ffn(pool.gate_up, pool.down, layer, x, ids, weights, dtype)
            assert np.abs(y - exact).max() > np.abs(y - ref).max()


@needs_widening
@pytest.mark.parametrize("isa", TILE_ISAS)
def test_k_format_tiles_are_closer_to_the_float_model_than_int8_activations(isa):
    """What "fast" trades for Q4_K / Q6_K experts: bf16 activations (2^-9 relative) on the
    bf16 tiles, where the exact kernels quantise them to int8 per 256 values (llama.cpp's
    Q8_K). Against the dequantised weights times the f32 activations, the tiles are the
    closer of the two, by 2x and more. The int8 vector form trades nothing: it multiplies
    the exact path's int8 activations, so its error is the exact path's."""
    rng = np.random.default_rng(23)
    pool = k_pool(rng, "q4_k/q6_k", 1, 4, 256, 256)
    x, ids, weights = make_batch(rng, 32, 2, 256, 4)
    truth = np.zeros((32, 256))
    for t, k in zip(*np.nonzero(ids >= 0)):
        gate_up, down = (a.astype(np.float64) for a in pool.dequantised(0, ids[t, k]))
        gate, up = np.split(gate_up @ x[t], 2)
        truth[t] += weights[t, k] * (down @ (gate / (1 + np.exp(-gate)) * up))
    err = {i: np.abs(HostExecutor(pool, threads=2, isa=i).expert_ffn_numpy(x, 0, ids, weights) - truth).max()
           for i in (isa, Isa.AUTO)}
    if host.tile_kind("q4_k", isa) == "int8_vector":
        assert abs(err[isa] - err[Isa.AUTO]) < 0.02 * err[Isa.AUTO], err
    else:
        assert err[isa] < err[Isa.AUTO] / 2, err


@needs_widening
@pytest.mark.parametrize("isa", TILE_ISAS)
def test_k_format_tiles_do_not_depend_on_the_thread_count(isa):
    rng = np.random.default_rng(17)
    pool = k_pool(rng, "q4_k/q6_k", 1, 8, 256, 256)
    x, ids, weights = make_batch(rng, 48, 4, 256, 8)
    runs = [HostExecutor(pool, threads=t, isa=isa).expert_ffn_numpy(x, 0, ids, weights) for t in (1, 2, 4)]
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[0], runs[2])


@pytest.mark.skipif(host.expert_isa("fast") is Isa.AUTO, reason="neither AMX-BF16 tiles nor their vector form here")
def test_fast_numerics_prefill_the_dense_products_on_the_tiles(monkeypatch):
    """Under numerics="fast" a model traces its steps with the dense kernel on the tile ISA
    (`host.expert_isa`: AMX_BF16, else AVX512_BF16_TILES; `host.dense_settings`): a prompt's attention projections and dense FFNs multiply on
    the bf16 tiles (activations rounded to bf16) and its attention runs on them too
    (q, k, v and the softmax weights rounded to bf16); decode's single tokens keep the
    exact kernels. The default model with f32 K/V on both sides and its experts on the
    device (XLA, the same either way): only the dense products and the prompt's attention
    differ. The quality bar for that is test_numerics' (perplexity within 0.5% of exact,
    the same greedy tokens); here the 40-token prompt's logits move by ~0.2% of their
    range (up to ~7% where a rounding flips a near-tie in a router's top-k)."""
    monkeypatch.delenv(host.ISA_ENV, raising=False)
    prompt = list(range(5, 45))
    fast, exact = ftjax.load(kv_dtype="float32"), ftjax.load(numerics="exact")
    isa = host.expert_isa("fast")
    assert (fast._steps.dense_isa, exact._steps.dense_isa) == (isa, Isa.AUTO)
    cfg = fast.config
    assert host.linear_takes_tiles(isa, len(prompt), cfg.d_model, cfg.d_model, "bfloat16")
    assert not host.linear_takes_tiles(isa, 1, cfg.d_model, cfg.d_model, "bfloat16")
    assert host.attention_takes_tiles(isa, len(prompt), cfg.head_dim)
    a, b = fast.logits(prompt), exact.logits(prompt)
    scale = float(np.abs(b).max())
    np.testing.assert_allclose(a, b, rtol=0, atol=0.1 * scale)
    assert np.mean(np.abs(a - b) > 1e-2 * scale) < 0.05 and not np.array_equal(a, b)
    assert fast.generate(prompt, 8) == exact.generate(prompt, 8)


@needs_vector
@needs_int8_vector
def test_the_int8_vector_form_keeps_mixed_tags_right():
    """A tagged Q4_K-or-Q6_K matrix whose blocks alternate between the two (a GGUF layer never
    does; an array built by hand may): the int8 vector form multiplies such a row pass
    plainly (weights widened to bf16) instead of in its one-format unpacking, so the result
    is still the product, within the bf16 rounding of the weights."""
    rng = np.random.default_rng(29)
    w = block_rows(rng, "q4_k_or_q6_k", 48, 512)
    x = rng.standard_normal((40, 512)).astype(np.float32)
    isa = Isa.AVX512_BF16_TILES
    assert host.tile_kind("q4_k_or_q6_k", isa) == "int8_vector" and host.linear_takes_tiles(isa, 40, 48, 512, "q4_k_or_q6_k")
    y = host.linear_numpy(x, w, threads=2, isa=isa, wtype="q4_k_or_q6_k")
    ref = host.reference_linear(x, w, "q4_k_or_q6_k", isa=isa)  # exact weights, int8 activations per 32
    scale = np.abs(ref).max(axis=1, keepdims=True) + 1e-30
    assert np.abs(y - ref).max() > 0 and np.all(np.abs(y - ref) <= 1e-2 * scale)
    uniform = block_rows(rng, "q4_k", 48, 512)  # one format: the fast unpacking, float order only
    y = host.linear_numpy(x, uniform, threads=2, isa=isa, wtype="q4_k")
    ref = host.reference_linear(x, uniform, "q4_k", isa=isa)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
