"""Quantised experts (GGUF Q8_0 / Q4_0 / Q4_K blocks, `load(expert_dtype="int8" | "int4" |
"q4_k")`).

- the host kernel of each block format equals its numpy reference (gguf's dequantiser
  + the numpy twin of the kernels' int8 activation quantiser) on every ISA the CPU
  has, for one token (the gemv path) and many (the tile path), 1 and 3 threads;
- the XLA decoders and activation quantiser equal their numpy twins; the Q4_K quantiser
  round-trips through gguf's dequantiser and handles constant, all-positive and all-
  negative sub-blocks;
- int8 / int4 / q4_k experts stay within a stated error of the bf16 experts they came from;
- a quantised model gives the same tokens under every placement policy;
- bad requests (rows that are not whole blocks, unknown dtypes) fail with clear errors.
Letters: Lm MoE layers, E experts, D model dim, F expert FFN dim, T tokens, K top-k.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
import hf_models
from ftjax.bench.quality import held_out_nll
from ftjax.config import ConfigError
from ftjax.experts.pool import HostExpertPool
from ftjax.experts.storage import FORMATS, act_q8, act_q8_numpy, quantise_activations, quantise_q4_k
from ftjax.host import HostExecutor, available_isas, reference_expert_ffn

BLOCK_FORMATS = ["q8_0", "q4_0", "q4_k"]
# (d_model, d_ff, tokens, top_k) of the kernel checks: widths whole blocks of each format
# (Q4_K: 256). Kept small: an h value within f32 rounding of an int8 rounding boundary
# would quantise one step apart in the kernel (f32) and the reference (f64)
KERNEL_SHAPES = {32: [(64, 32, 1, 2), (96, 160, 7, 3), (256, 64, 50, 4)],
                 256: [(256, 256, 1, 2), (512, 256, 5, 3), (256, 512, 16, 3)]}


def random_pool(rng, num_layers, num_experts, d_model, d_ff) -> HostExpertPool:
    gate_up = rng.standard_normal((num_layers, num_experts, 2 * d_ff, d_model)) * (1.5 / np.sqrt(d_model))
    down = rng.standard_normal((num_layers, num_experts, d_model, d_ff)) * (1.0 / np.sqrt(d_ff))
    return HostExpertPool.from_arrays(gate_up.astype(np.float32), down.astype(np.float32))


@pytest.mark.parametrize("fmt,d_model,d_ff,num_tokens,top_k",
                         [(fmt, *shape) for fmt in BLOCK_FORMATS for shape in KERNEL_SHAPES[FORMATS[fmt].block]])
@pytest.mark.parametrize("isa", available_isas(), ids=lambda i: i.name)
@pytest.mark.parametrize("threads", [1, 3])
def test_block_kernel_matches_reference(fmt, isa, threads, d_model, d_ff, num_tokens, top_k):
    rng = np.random.default_rng(d_model + d_ff + num_tokens)
    pool = random_pool(rng, 2, 6, d_model, d_ff).converted(fmt)
    x = rng.standard_normal((num_tokens, d_model)).astype(np.float32)
    ids = rng.integers(-1, pool.num_experts, (num_tokens, top_k)).astype(np.int32)  # -1: skipped; repeats allowed
    weights = rng.random((num_tokens, top_k)).astype(np.float32)
    executor = HostExecutor(pool, threads=threads, isa=isa)
    for layer in range(pool.num_layers):
        ref = reference_expert_ffn(pool.gate_up, pool.down, layer, x, ids, weights, dtype=fmt)
        y = executor.expert_ffn_numpy(x, layer, ids, weights)
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * max(1.0, float(np.abs(ref).max())))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_jitted_boundary_reads_block_pool(fmt):
    rng = np.random.default_rng(1)
    d_model, d_ff = 2 * FORMATS[fmt].block, FORMATS[fmt].block
    pool = random_pool(rng, 1, 4, d_model, d_ff).converted(fmt)
    executor = HostExecutor(pool, threads=2)
    x = rng.standard_normal((3, d_model)).astype(np.float32)
    ids = np.array([[0, 3], [1, -1], [2, 2]], np.int32)
    w = rng.random((3, 2)).astype(np.float32)
    y = jax.jit(lambda x, i, w: executor.expert_ffn(x, 0, i, w))(x, ids, w)
    np.testing.assert_allclose(np.asarray(y), executor.expert_ffn_numpy(x, 0, ids, w), rtol=0, atol=1e-6)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_device_decoder_equals_gguf(fmt):
    rng = np.random.default_rng(2)
    n = 3 * FORMATS[fmt].block
    w = (rng.standard_normal((2, 5, n)) * 0.05).astype(np.float32)
    stored = FORMATS[fmt].from_f32_numpy(w)  # [2, 5, 3 * block_bytes] uint8
    assert stored.dtype == np.uint8 and stored.shape == (2, 5, FORMATS[fmt].row_bytes(n))
    np.testing.assert_array_equal(np.asarray(FORMATS[fmt].to_f32(jnp.asarray(stored))), FORMATS[fmt].to_f32_numpy(stored))


def test_q4_k_quantiser():
    """GGUF's Q4_K layout (gguf's dequantiser reads our bytes back within the format's
    error), and the sub-blocks a min/scale fit can trip on: all zero (d = 0: zeros), one
    constant, all positive (min clamped to 0), all negative."""
    rng = np.random.default_rng(9)
    w = rng.standard_normal((4, 512)).astype(np.float32)
    w[1, :32] = 0.0
    w[1, 32:64] = 0.75
    w[2] = np.abs(w[2]) + 0.5
    w[3] = -np.abs(w[3])
    stored = quantise_q4_k(w)
    assert stored.shape == (4, 2 * 144) and stored.dtype == np.uint8
    back = FORMATS["q4_k"].to_f32_numpy(stored)
    assert np.abs(back[1, :32]).max() == 0.0 and np.abs(back[1, 32:64] - 0.75).max() < 0.75 / 15
    for row in range(4):  # 4-bit levels with a fitted min: ~7% of the row's norm (Q4_0: ~8.6%)
        assert np.linalg.norm(back[row] - w[row]) / np.linalg.norm(w[row]) < 0.1
    assert (back[2] >= 0).all()  # all positive: the fitted min is clamped to 0, no offset
    zeros = quantise_q4_k(np.zeros((1, 256), np.float32))
    assert not FORMATS["q4_k"].to_f32_numpy(zeros).any()
    with pytest.raises(ValueError, match="multiple of 256"):
        quantise_q4_k(np.zeros((2, 288), np.float32))


def test_activation_quantiser_twins():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 128)) * np.array([1e-3, 1.0, 30.0, 0.0])[:, None]).astype(np.float32)
    q, d = quantise_activations(x)
    assert q.dtype == np.int8 and np.abs(q).max() <= 127 and d.shape == (4, 4)
    assert not q[3].any() and not d[3].any()  # an all-zero block: scale 0, no division
    # XLA may fold the /127 into a multiply: the same values up to one float rounding
    np.testing.assert_allclose(np.asarray(act_q8(jnp.asarray(x))), act_q8_numpy(x), rtol=1e-6, atol=0)
    np.testing.assert_allclose(act_q8_numpy(x), x, rtol=0, atol=float(np.abs(x).max()) / 254 + 1e-12)


@pytest.mark.parametrize("fmt,tolerance", [("q8_0", 0.025), ("q4_0", 0.2), ("q4_k", 0.16)])
def test_quantised_experts_close_to_bf16(fmt, tolerance):
    """Relative error (Frobenius) of the expert output against the bf16 experts the
    quantised pool was made from, weights and activations quantised: int8 within 2.5%,
    int4 within 20%, q4_k within 16% on random Gaussian experts and inputs (measured:
    1.5%, 15% and 12.6%: Q4_K's fitted scale and min beat Q4_0 at the same 4.5 bits)."""
    rng = np.random.default_rng(4)
    bf16 = random_pool(rng, 1, 8, 256, 256).converted("bfloat16")
    x = rng.standard_normal((16, 256)).astype(np.float32)
    ids = np.stack([rng.permutation(8)[:2] for _ in range(16)]).astype(np.int32)
    w = rng.random((16, 2)).astype(np.float32)
    y_ref = HostExecutor(bf16, threads=2).expert_ffn_numpy(x, 0, ids, w)
    y = HostExecutor(bf16.converted(fmt), threads=2).expert_ffn_numpy(x, 0, ids, w)
    err = np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref)
    assert err < tolerance, f"{fmt}: relative error {err:.4f}"


def test_pool_shapes_and_bytes():
    pool = random_pool(np.random.default_rng(5), 2, 3, 64, 96)
    q8, q4 = pool.converted("int8"), pool.converted("int4")
    assert (q8.dtype, q4.dtype) == ("q8_0", "q4_0")
    for q, block_bytes in ((q8, 34), (q4, 18)):
        assert (q.d_model, q.d_ff, q.num_experts, q.num_layers) == (64, 96, 3, 2)
        assert q.gate_up.shape == (2, 3, 192, 2 * block_bytes) and q.down.shape == (2, 3, 64, 3 * block_bytes)
        assert q.expert_bytes == 3 * 64 * 96 * block_bytes // 32
        g, d = q.dequantised(1, 2)
        assert g.shape == (192, 64) and d.shape == (64, 96)
    with pytest.raises(ValueError, match="multiple of 32"):
        random_pool(np.random.default_rng(6), 1, 2, 48, 32).converted("q8_0")
    q4k = random_pool(np.random.default_rng(6), 1, 2, 256, 512).converted("q4_k")
    assert q4k.dtype == "q4_k" and (q4k.d_model, q4k.d_ff) == (256, 512)
    assert q4k.gate_up.shape == (1, 2, 1024, 144) and q4k.down.shape == (1, 2, 256, 2 * 144)
    assert q4k.expert_bytes == 3 * 256 * 512 * 144 // 256
    with pytest.raises(ValueError, match="multiple of 256"):
        pool.converted("q4_k")  # D = 64


@pytest.fixture(scope="module")
def quant_checkpoint(tmp_path_factory):
    """A tiny qwen3_moe checkpoint whose widths are whole blocks (D = 64, F = 32)."""
    hf = hf_models.build("qwen3_moe", seed=7, hidden_size=64, moe_intermediate_size=32, intermediate_size=64,
                         head_dim=16, mlp_only_layers=[])
    return hf_models.save(hf, tmp_path_factory.mktemp("quant"))


@pytest.fixture(scope="module")
def q4_k_checkpoint(tmp_path_factory):
    """A tiny qwen3_moe checkpoint whose widths are whole Q4_K super-blocks (D = F = 256)."""
    hf = hf_models.build("qwen3_moe", seed=7, hidden_size=256, moe_intermediate_size=256, intermediate_size=256,
                         head_dim=16, mlp_only_layers=[])
    return hf_models.save(hf, tmp_path_factory.mktemp("quant_q4_k"))


POLICIES = [("device", {}), ("host", {}), ("lru", dict(cache_slots=4, bandwidth=(4.0, 8.0))),
            ("lru-transfer-only", dict(cache_slots=4)), ("static-layer", dict(cache_slots=5))]


# int4 / q4_k under every policy are `slow` (35 s, 90 s): their kernels, decoders, device FFN and host model path
# are covered above and below
@pytest.mark.parametrize("expert_dtype", ["int8", pytest.param("int4", marks=pytest.mark.slow),
                                          pytest.param("q4_k", marks=pytest.mark.slow)])
def test_every_policy_gives_device_tokens(request, expert_dtype):
    checkpoint = request.getfixturevalue("q4_k_checkpoint" if expert_dtype == "q4_k" else "quant_checkpoint")
    prompt = [5, 17, 3, 60, 22, 9, 41, 2]
    runs = {}
    for policy, kw in POLICIES:
        model = ftjax.load(checkpoint, expert_dtype=expert_dtype, policy=policy, **kw)
        assert model.checkpoint.pool.dtype == {"int8": "q8_0", "int4": "q4_0", "q4_k": "q4_k"}[expert_dtype]
        runs[policy] = model.generate(prompt, 12)
    assert all(tokens == runs["device"] for tokens in runs.values()), runs


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_device_ffn_matches_host_kernel(fmt):
    """The device FFN of a block format (XLA dequantiser + the same int8 activation
    quantisation, `executor.swiglu`) computes what the host kernel does, up to float
    rounding: the model-level check of every policy is the `slow` test above."""
    from ftjax.experts.executor import swiglu

    rng = np.random.default_rng(10)
    d_model, d_ff = 2 * FORMATS[fmt].block, FORMATS[fmt].block
    pool = random_pool(rng, 1, 3, d_model, d_ff).converted(fmt)
    x = rng.standard_normal((3, d_model)).astype(np.float32)
    gate_up, down = pool.expert(0, 2)
    y = jax.jit(lambda g, d, x: swiglu(g, d, x, FORMATS[fmt]))(gate_up, down, x)
    ref = HostExecutor(pool, threads=2).expert_ffn_numpy(x, 0, np.full((3, 1), 2, np.int32), np.ones((3, 1), np.float32))
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=1e-5 * float(np.abs(ref).max()))


def test_default_model_perplexity_int8_within_one_percent():
    """Quality on a trained model (tiny random models amplify any activation noise,
    even bf16 rounding, ~20x): held-out perplexity of the embedded default model with
    int8 experts within 1% of bf16 (measured +0.003%), int4 within 3% (+0.3%)."""
    from ftjax.data import corpus

    base = ftjax.load(policy="host")
    ids = base.tokenizer.encode(corpus.split(corpus.names()[0])[1][:4000])[:513]
    ppl = {"bfloat16": np.exp(held_out_nll(base, ids))}
    for dtype in ("int8", "int4"):
        ppl[dtype] = np.exp(held_out_nll(ftjax.load(policy="host", expert_dtype=dtype), ids))
    assert ppl["int8"] / ppl["bfloat16"] < 1.01, ppl
    assert ppl["int4"] / ppl["bfloat16"] < 1.03, ppl


def test_bad_expert_dtypes(quant_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="expert_dtype must be"):
        ftjax.load(quant_checkpoint, expert_dtype="int3")
    odd = hf_models.save(hf_models.build("qwen3_moe", seed=8), tmp_path / "odd")  # D = 32, F = 16
    with pytest.raises(ConfigError, match=r"blocks of 32 weights: the expert FFN width \(16\) must be a multiple"):
        ftjax.load(odd, expert_dtype="int8")
    with pytest.raises(ConfigError, match=r"'q4_k' stores rows as blocks of 256 weights: hidden_size \(64\) and "
                                          r"the expert FFN width \(32\) must be a multiple of 256"):
        ftjax.load(quant_checkpoint, expert_dtype="q4_k")
