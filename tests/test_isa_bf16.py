"""The AVX512_BF16 kernels (host_kernels/kernels_avx512_bf16.cc, the VNNI half of
kernels_quant_simd.inc) and how an ISA is chosen (`host.resolve_isa`, $FTJAX_ISA).

Against their numpy references these kernels run in every ISA-parametrised test of
test_host_kernels / test_linear_kernel / test_quant / test_quant_dense; here: what only
they promise. Skipped where the CPU lacks AVX-512 BF16 + VNNI (the ISA tests still run)."""

import numpy as np
import pytest

from ftjax import host
from ftjax.experts.pool import HostExpertPool, to_bf16_bits
from ftjax.experts.storage import FORMATS
from ftjax.host import HostExecutor, Isa, available_isas, linear_numpy, reference_linear, resolve_isa

HAS_BF16 = Isa.AVX512_BF16 in available_isas()
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="CPU lacks AVX-512 BF16 / VNNI")
BLOCK_FORMATS = [n for n, f in FORMATS.items() if f.block > 1 and n != "fp8_e4m3" and "_or_" not in n]


def random_pool(rng, d_model, d_ff, fmt):
    gate_up = (rng.standard_normal((1, 4, 2 * d_ff, d_model)) / np.sqrt(d_model)).astype(np.float32)
    down = (rng.standard_normal((1, 4, d_model, d_ff)) / np.sqrt(d_ff)).astype(np.float32)
    return HostExpertPool.from_arrays(gate_up, down, "float32").converted(fmt)


@needs_bf16
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_vnni_block_dots_equal_avx2_bit_for_bit(fmt, num_tokens):
    """vpdpbusd sums the same int8 products exactly, as maddubs + madd do: the VNNI table's
    outputs equal the AVX2 table's to the bit (expert FFN and dense linear; gemv and tiles)."""
    rng = np.random.default_rng(num_tokens)
    size = max(256, FORMATS[fmt].block)
    pool = random_pool(rng, size, size, fmt)
    x = rng.standard_normal((num_tokens, size)).astype(np.float32)
    ids = rng.integers(0, 4, (num_tokens, 2)).astype(np.int32)
    weights = rng.random((num_tokens, 2)).astype(np.float32)
    runs = [HostExecutor(pool, threads=2, isa=isa).expert_ffn_numpy(x, 0, ids, weights)
            for isa in (Isa.AVX2, Isa.AVX512, Isa.AVX512_BF16)]  # AVX512: VNNI where the CPU has it
    np.testing.assert_array_equal(runs[1], runs[0])
    np.testing.assert_array_equal(runs[2], runs[0])
    w = np.ascontiguousarray(pool.gate_up[0, 1])  # [2F, row bytes]
    np.testing.assert_array_equal(linear_numpy(x, w, isa=Isa.AVX512_BF16, wtype=fmt),
                                  linear_numpy(x, w, isa=Isa.AVX2, wtype=fmt))


@needs_bf16
def test_bf16_weights_meet_rounded_activations():
    """bf16 rows meet activations rounded to bf16 (vdpbf16ps): the kernel equals the
    reference that rounds them, to float rounding, and is measurably off the float32 one
    (so the rounding does happen); a token alone gets its row of the batch, to float order."""
    rng = np.random.default_rng(0)
    w = to_bf16_bits((rng.standard_normal((96, 320)) / 18).astype(np.float32))  # [N, K], K = 10 x 32
    x = rng.standard_normal((7, 320)).astype(np.float32)
    y = linear_numpy(x, w, isa=Isa.AVX512_BF16)
    rounded, exact = reference_linear(x, w, isa=Isa.AVX512_BF16), reference_linear(x, w, isa=Isa.AVX512)
    scale = float(np.abs(exact).max())
    assert np.abs(y - rounded).max() <= 2e-5 * scale < np.abs(y - exact).max() <= 1e-2 * scale
    alone = np.concatenate([linear_numpy(x[t:t + 1], w, isa=Isa.AVX512_BF16) for t in range(7)])
    np.testing.assert_allclose(alone, y, rtol=0, atol=2e-5 * scale)  # rounding per value: only sum order differs
    assert host.rounds_activations_to_bf16(Isa.AVX512_BF16) and not host.rounds_activations_to_bf16(Isa.AVX512)


def test_resolve_isa_follows_the_environment(monkeypatch):
    """AUTO is the widest exact ISA the CPU has (never AVX512_BF16, which rounds), unless
    $FTJAX_ISA names one; a name that is no
    ISA, or one this CPU lacks, is an error naming the choices; explicit ISAs pass as given."""
    monkeypatch.delenv(host.ISA_ENV, raising=False)
    rounding = (Isa.AVX512_BF16, *host.tile_isas())
    assert resolve_isa() is host.auto_isa() is [i for i in available_isas() if i not in rounding][-1]
    assert not host.rounds_activations_to_bf16()
    if HAS_BF16:
        monkeypatch.setenv(host.ISA_ENV, "AVX512_bf16")
        assert resolve_isa() is Isa.AVX512_BF16 and host.rounds_activations_to_bf16()
    assert resolve_isa(Isa.SCALAR) is Isa.SCALAR
    monkeypatch.setenv(host.ISA_ENV, "scalar")
    assert resolve_isa() is Isa.SCALAR and not host.rounds_activations_to_bf16()
    x = np.ones((1, 32), np.float32)
    w = to_bf16_bits(np.full((2, 32), 0.5, np.float32))
    np.testing.assert_array_equal(linear_numpy(x, w), np.full((1, 2), 16.0, np.float32))
    monkeypatch.setenv(host.ISA_ENV, "avx9")
    with pytest.raises(ValueError, match=r"FTJAX_ISA='avx9' is not an ISA \(auto, scalar, avx2"):
        resolve_isa()
    missing = [i for i in Isa if i is not Isa.AUTO and i not in available_isas()]
    if missing:
        monkeypatch.setenv(host.ISA_ENV, missing[0].name.lower())
        with pytest.raises(ValueError, match="this CPU has only scalar"):
            resolve_isa()


@needs_bf16
def test_bf16_model_under_avx512_bf16(tmp_path, monkeypatch):
    """A whole bf16 model on the host policy with FTJAX_ISA=avx512_bf16: every host kernel
    call (expert FFN and packed dense `linear`, inside the jitted steps) meets rounded
    activations; the logits stay within 2% of the exact path's and are not equal to them."""
    import torch

    import ftjax
    import hf_models

    folder = hf_models.save(hf_models.build("olmoe", seed=3, hidden_size=64, intermediate_size=32), tmp_path / "hf",
                            dtype=torch.bfloat16)
    prompt = [5, 17, 3, 60, 22, 9, 41, 2]
    monkeypatch.delenv(host.ISA_ENV, raising=False)
    exact = ftjax.load(folder, policy="host", threads=2).logits(prompt)
    monkeypatch.setenv(host.ISA_ENV, "avx512_bf16")
    rounded = ftjax.load(folder, policy="host", threads=2).logits(prompt)
    err = np.abs(rounded - exact).max() / np.abs(exact).max()
    assert 0 < err <= 0.02, err
