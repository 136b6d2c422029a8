"""AMX-BF16 tiles for expert prefill (host_kernels/amx.cc, the tile path of
host_kernels/expert_ffn.cc) against the numpy reference that rounds the activations as
the tiles do; the self-check and every fallback.

The tile tests run where the CPU, the OS and Linux's permission give AMX-BF16 tiles
(`host.amx_bf16_status() == ""`) and are skipped elsewhere with the reason; the
fallback tests run everywhere. Letters: D model dim, F expert FFN dim, T tokens, K top-k.
"""

import numpy as np
import pytest

import ftjax
from ftjax import host
from ftjax.host import AMX_MIN_TOKENS, HostExecutor, Isa, available_isas, takes_amx_tiles
from test_host_kernels import make_batch, make_pool, reference

STATUS = host.amx_bf16_status()
needs_amx = pytest.mark.skipif(STATUS != "", reason=f"no AMX-BF16 tiles here: {STATUS}")


def test_the_self_check_is_reported_and_decides_availability():
    """One answer per process: "" (usable) or a reason naming what failed; the ISA list,
    the benchmark lines (`isa_report`) and the model's choice follow it."""
    assert isinstance(STATUS, str) and host.amx_bf16_status() == STATUS
    assert (Isa.AMX_BF16 in available_isas()) == (STATUS == "")
    assert host.isa_report() == {"auto": host.auto_isa().name.lower(), "amx_bf16": STATUS or "ok"}
    assert host.auto_isa() is not Isa.AMX_BF16  # AUTO stays exact
    if STATUS:
        assert any(word in STATUS for word in ("CPUID", "XSAVE", "XCR0", "arch_prctl", "self-check", "x86-64"))


@pytest.mark.skipif(STATUS == "", reason="this CPU has AMX-BF16 tiles: the refusal is for CPUs without them")
def test_without_tiles_asking_for_them_is_a_clear_error(monkeypatch):
    pool = make_pool(np.random.default_rng(0), 1, 4, 64, 32, "bfloat16")
    with pytest.raises(ValueError, match="not available"):
        HostExecutor(pool, threads=1, isa=Isa.AMX_BF16).expert_ffn_numpy(
            np.ones((16, 64), np.float32), 0, np.zeros((16, 1), np.int32), np.ones((16, 1), np.float32))
    monkeypatch.setenv(host.ISA_ENV, "amx_bf16")
    with pytest.raises(ValueError, match="this CPU has only"):
        host.resolve_isa()
    assert host.expert_isa("fast") is Isa.AUTO  # fast numerics without tiles: the exact kernels


@needs_amx
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("d_model,d_ff,num_tokens,top_k", [
    (64, 32, 16, 1),     # one tile pass, one token block
    (96, 64, 17, 2),     # a second, partial token block; 3 row tiles of D (a half pass)
    (256, 128, 64, 4),   # several token pairs: the copied-rows path for the busiest experts
    (64, 96, 200, 8),    # > 4 token blocks per expert: rows copied before the passes
])
def test_tiles_match_the_rounding_reference(threads, d_model, d_ff, num_tokens, top_k):
    rng = np.random.default_rng(d_model + d_ff + num_tokens)
    pool = make_pool(rng, 2, 6, d_model, d_ff, "bfloat16")
    x, ids, weights = make_batch(rng, num_tokens, top_k, d_model, pool.num_experts)
    executor = HostExecutor(pool, threads=threads, isa=Isa.AMX_BF16)
    assert takes_amx_tiles(Isa.AMX_BF16, num_tokens, d_model, d_ff, True)
    for layer in range(pool.num_layers):
        y = executor.expert_ffn_numpy(x, layer, ids, weights)
        ref = reference(pool, layer, x, ids, weights, Isa.AMX_BF16)
        # h is rounded to bf16 on both sides, from f32 sums here and f64 there: a value at a
        # rounding boundary may go either way (one bf16 step, 2^-8 of it, through down)
        scale = max(1.0, float(np.abs(ref).max()))
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-3 * scale)
        assert np.mean(np.abs(y - ref) > 2e-5 * scale) < 0.01  # ... which few values are
        exact = reference(pool, layer, x, ids, weights, Isa.AVX512)
        assert np.abs(y - exact).max() > np.abs(y - ref).max()  # the rounding is the tiles', not the exact path's


@needs_amx
def test_thread_count_does_not_change_the_sums():
    rng = np.random.default_rng(5)
    pool = make_pool(rng, 1, 8, 128, 64, "bfloat16")
    x, ids, weights = make_batch(rng, 48, 4, 128, 8)
    runs = [HostExecutor(pool, threads=t, isa=Isa.AMX_BF16).expert_ffn_numpy(x, 0, ids, weights) for t in (1, 2, 4)]
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[0], runs[2])


@needs_amx
@pytest.mark.parametrize("case", ["decode", "f32 experts", "D not whole passes"])
def test_calls_the_tiles_do_not_take_keep_the_exact_kernels(case):
    """Fewer than AMX_MIN_TOKENS tokens (decode), f32 experts and widths that are not whole
    32-row passes run the exact kernels under AMX_BF16: the same numbers as AUTO."""
    rng = np.random.default_rng(7)
    d_model, d_ff, tokens, dtype = {"decode": (64, 32, AMX_MIN_TOKENS - 1, "bfloat16"),
                                    "f32 experts": (64, 32, 40, "float32"),
                                    "D not whole passes": (80, 32, 40, "bfloat16")}[case]
    pool = make_pool(rng, 1, 4, d_model, d_ff, dtype)
    x, ids, weights = make_batch(rng, tokens, 2, d_model, 4)
    assert not takes_amx_tiles(Isa.AMX_BF16, tokens, d_model, d_ff, dtype == "bfloat16")
    tiles = HostExecutor(pool, threads=2, isa=Isa.AMX_BF16).expert_ffn_numpy(x, 0, ids, weights)
    auto = HostExecutor(pool, threads=2, isa=Isa.AUTO).expert_ffn_numpy(x, 0, ids, weights)
    np.testing.assert_array_equal(tiles, auto)


def test_the_model_takes_tiles_under_fast_numerics_only(monkeypatch):
    """numerics="fast" (the default for bf16 checkpoints) runs host experts with AMX_BF16
    where the self-check passed; "exact" and a set $FTJAX_ISA keep their own choice;
    stats() names the path."""
    monkeypatch.delenv(host.ISA_ENV, raising=False)
    fast = ftjax.load(policy="host")
    assert fast.numerics == "fast"
    exact = host.auto_isa().name.lower()
    assert fast.stats()["host_isa"] == ("amx_bf16" if STATUS == "" else exact)
    assert ftjax.load(policy="host", numerics="exact").stats()["host_isa"] == exact
    assert ftjax.load().stats()["host_isa"] is None  # the device policy: no host experts
    monkeypatch.setenv(host.ISA_ENV, "scalar")
    assert ftjax.load(policy="host").stats()["host_isa"] == "scalar"
