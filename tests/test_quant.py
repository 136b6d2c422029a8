"""Quantised experts (GGUF Q8_0 / Q4_0 / Q4_K / Q6_K / MXFP4 blocks and DeepSeek-V3's FP8
with 128 x 128 tile scales, `load(expert_dtype="int8" | "int4" | "q4_k" | "q6_k" | "mxfp4" |
"fp8_e4m3")`, and pools whose two parts differ, e.g. "q4_k/q6_k").

- the host kernel of each block format equals its numpy reference (gguf's dequantiser
  + the numpy twin of the kernels' int8 activation quantiser) on every ISA the CPU
  has, for one token (the gemv path) and many (the tile path), 1 and 3 threads;
- the XLA decoders and activation quantiser equal their numpy twins; the Q4_K quantiser
  round-trips through gguf's dequantiser and handles constant, all-positive and all-
  negative sub-blocks; the Q6_K quantiser gives llama.cpp's bytes;
- every format stays within a stated error of the bf16 experts it came from;
- a quantised model gives the same tokens under every placement policy (device and host
  by default, the cross-product behind `slow`);
- a DeepSeek-V3 FP8 checkpoint (float8_e4m3fn + weight_scale_inv) loads with its experts
  as stored and gives transformers' logits on the dequantised weights;
- bad requests (rows that are not whole blocks, unknown dtypes) fail with clear errors.
Letters: Lm MoE layers, E experts, D model dim, F expert FFN dim, T tokens, K top-k.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import ftjax
import hf_models
from ftjax.bench.quality import held_out_nll
from ftjax.config import ConfigError
from ftjax.experts.pool import HostExpertPool
from ftjax.experts.storage import (FORMATS, act_q8, act_q8_numpy, part_formats, quantise_activations, quantise_q4_k,
                                   quantise_q6_k, tagged_k_blocks)
from ftjax import host
from ftjax.host import HostExecutor, Isa, available_isas, reference_expert_ffn

KERNEL_ISAS = [i for i in available_isas() if i not in host.tile_isas()]  # the tile ISAs: tests/test_amx.py

BLOCK_FORMATS = ["q8_0", "q4_0", "q4_k", "q6_k", "mxfp4", "fp8_e4m3"]  # q4_k_or_q6_k: test_tagged_k_layers
# gate_up / down (an ActQ8 down after a float gate_up is left out: an h within f32 rounding of an
# int8 boundary would round apart in the kernel and the f64 reference, see KERNEL_SHAPES)
MIXED_FORMATS = ["q4_k/q6_k", "mxfp4/fp8_e4m3", "bfloat16/fp8_e4m3"]
# (d_model, d_ff, tokens, top_k) of the kernel checks: widths whole blocks of each format
# (Q4_K: 256). Kept small: an h value within f32 rounding of an int8 rounding boundary
# would quantise one step apart in the kernel (f32) and the reference (f64)
KERNEL_SHAPES = {32: [(64, 32, 1, 2), (96, 160, 7, 3), (256, 64, 50, 4)],
                 128: [(128, 128, 1, 2), (384, 256, 5, 3), (256, 384, 16, 3)],
                 256: [(256, 256, 1, 2), (512, 256, 5, 3), (256, 512, 16, 3)]}


def block_of(fmt: str) -> int:
    """Weights per block of a pool format (the larger of its parts')."""
    return max(f.block for f in part_formats(fmt).values())


def random_pool(rng, num_layers, num_experts, d_model, d_ff) -> HostExpertPool:
    gate_up = rng.standard_normal((num_layers, num_experts, 2 * d_ff, d_model)) * (1.5 / np.sqrt(d_model))
    down = rng.standard_normal((num_layers, num_experts, d_model, d_ff)) * (1.0 / np.sqrt(d_ff))
    return HostExpertPool.from_arrays(gate_up.astype(np.float32), down.astype(np.float32))


@pytest.mark.parametrize("fmt,d_model,d_ff,num_tokens,top_k",
                         [(fmt, *shape) for fmt in BLOCK_FORMATS[:3] for shape in KERNEL_SHAPES[block_of(fmt)]]
                         + [pytest.param(fmt, *shape, marks=pytest.mark.slow)
                            for fmt in BLOCK_FORMATS[3:] + MIXED_FORMATS for shape in KERNEL_SHAPES[block_of(fmt)]])
@pytest.mark.parametrize("isa", KERNEL_ISAS, ids=lambda i: i.name)
@pytest.mark.parametrize("threads", [1, 3])
def test_block_kernel_matches_reference(fmt, isa, threads, d_model, d_ff, num_tokens, top_k):
    rng = np.random.default_rng(d_model + d_ff + num_tokens)
    pool = random_pool(rng, 2, 6, d_model, d_ff).converted(fmt)
    assert pool.dtype == fmt
    x = rng.standard_normal((num_tokens, d_model)).astype(np.float32)
    ids = rng.integers(-1, pool.num_experts, (num_tokens, top_k)).astype(np.int32)  # -1: skipped; repeats allowed
    weights = rng.random((num_tokens, top_k)).astype(np.float32)
    executor = HostExecutor(pool, threads=threads, isa=isa)
    for layer in range(pool.num_layers):
        ref = reference_expert_ffn(pool.gate_up, pool.down, layer, x, ids, weights, dtype=pool.dtype, isa=isa)
        y = executor.expert_ffn_numpy(x, layer, ids, weights)
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * max(1.0, float(np.abs(ref).max())))


@pytest.mark.parametrize("fmt,num_tokens", [(fmt, t) for fmt in BLOCK_FORMATS[3:] + MIXED_FORMATS for t in (1, 5)])
@pytest.mark.parametrize("isa", KERNEL_ISAS, ids=lambda i: i.name)
def test_newer_block_kernels_match_reference(fmt, isa, num_tokens):
    """The default share of the matrix above for Q6_K / MXFP4 / FP8 and mixed-part pools
    (the whole matrix is `slow`): one token (gemv) and five (tiles), 2 threads."""
    rng = np.random.default_rng(num_tokens)
    d_model = d_ff = block_of(fmt)
    pool = random_pool(rng, 2, 4, 2 * d_model, d_ff).converted(fmt)
    x = rng.standard_normal((num_tokens, 2 * d_model)).astype(np.float32)
    ids = rng.integers(-1, pool.num_experts, (num_tokens, 3)).astype(np.int32)
    weights = rng.random((num_tokens, 3)).astype(np.float32)
    y = HostExecutor(pool, threads=2, isa=isa).expert_ffn_numpy(x, 1, ids, weights)
    ref = reference_expert_ffn(pool.gate_up, pool.down, 1, x, ids, weights, dtype=pool.dtype, isa=isa)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * max(1.0, float(np.abs(ref).max())))


def random_block_rows(rng, fmt: str, rows: int, n: int) -> np.ndarray:
    """[rows, n / block * block_bytes] uint8: blocks of random bytes (any level, scale and min
    the format can hold; Q8_0's -128 too) with f16 scales in [0.5, 2) (Q4_K: d and dmin;
    MXFP4: exponents 2^-3 .. 2^3)."""
    f = FORMATS[fmt]
    blocks = rng.integers(0, 256, (rows, n // f.block, f.block_bytes), dtype=np.uint8)
    if fmt == "mxfp4":
        blocks[..., 0] = rng.integers(124, 132, blocks.shape[:2])
        return blocks.reshape(rows, -1)
    at = {"q4_k": slice(0, 4), "q6_k": slice(f.block_bytes - 2, f.block_bytes)}.get(fmt, slice(0, 2))
    halves = rng.uniform(0.5, 2.0, (rows, n // f.block, (at.stop - at.start) // 2)).astype(np.float16)
    blocks[..., at] = halves.view(np.uint8).reshape(rows, n // f.block, -1)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
@pytest.mark.parametrize("isa", KERNEL_ISAS, ids=lambda i: i.name)
def test_k_kernels_on_extreme_blocks(fmt, isa):
    """The K kernels' int32 super-block sums (ActQ8K: one activation scale per 256, bsums for
    Q4_K's mins and Q6_K's -32 offset) hold at the extremes: random block bytes (every
    level, scales -128..127, mins 63), activations at +-127 after quantisation (one
    outlier per 256 or all equal) and all-zero blocks; 1 and 5 tokens."""
    rng = np.random.default_rng(5)
    n, rows = 1024, 24
    w = random_block_rows(rng, fmt, rows, n)
    if fmt == "q6_k":  # a row of the largest levels and scales of both signs
        w.reshape(rows, -1, 210)[0, :, :192] = 0xFF
        w.reshape(rows, -1, 210)[0, :, 192:208] = np.array([128, 127] * 8, np.uint8)
    else:  # nibbles 15, every 6-bit scale and min 63
        w.reshape(rows, -1, 144)[0, :, 4:] = 0xFF
    x = rng.standard_normal((5, n)).astype(np.float32)
    x[0] = np.sign(x[0])  # every |q_x| = 127
    x[1, ::256] = 1e3  # an outlier per super-block: the rest quantise to small levels
    x[2, 256:512] = 0.0  # an all-zero super-block: scale 0
    for t in (1, 5):
        y = host.linear_numpy(x[:t], w, threads=2, isa=isa, wtype=fmt)
        ref = host.reference_linear(x[:t], w, wtype=fmt, isa=isa)
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * float(np.abs(ref).max()))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "mxfp4"])
@pytest.mark.parametrize("isa", KERNEL_ISAS, ids=lambda i: i.name)
def test_32_blocks_on_extreme_bytes(fmt, isa):
    """The 32-weight block kernels (the VNNI build offsets the weights to unsigned bytes and
    takes 128 * sum(a) back) hold for any block bytes: every level, Q8_0's -128, activations
    at +-127 after quantisation, an all-zero block; 1 and 5 tokens; and the integer ISAs
    agree to the bit."""
    rng = np.random.default_rng(6)
    n, rows = 256, 24
    w = random_block_rows(rng, fmt, rows, n)
    quants = 32 if fmt == "q8_0" else 16  # a block's weight bytes, at its end
    w.reshape(rows, -1, FORMATS[fmt].block_bytes)[0, :, -quants:] = 0x80 if fmt == "q8_0" else 0x88  # -128 | nibble 8
    x = rng.standard_normal((5, n)).astype(np.float32)
    x[0] = np.sign(x[0])  # every |q_x| = 127
    x[1, ::32] = 1e3  # an outlier per block
    x[2, 64:96] = 0.0  # an all-zero block: scale 0
    for t in (1, 5):
        y = host.linear_numpy(x[:t], w, threads=2, isa=isa, wtype=fmt)
        ref = host.reference_linear(x[:t], w, wtype=fmt, isa=isa)
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * float(np.abs(ref).max()))
        if isa is not host.Isa.SCALAR and host.Isa.AVX2 in available_isas():
            np.testing.assert_array_equal(y, host.linear_numpy(x[:t], w, threads=2, isa=host.Isa.AVX2, wtype=fmt))


def tagged_k_pool(rng, d_model: int, d_ff: int) -> HostExpertPool:
    """Two MoE layers of 4 experts: gate_up Q4_K; down Q4_K in layer 0 and Q6_K in layer 1,
    both behind tags (a GGUF Q4_K_M file's ffn_down_exps), 'q4_k/q4_k_or_q6_k'."""
    f32 = random_pool(rng, 2, 4, d_model, d_ff)
    down = np.stack([tagged_k_blocks(quantise_q4_k(f32.down[0]), "q4_k"),
                     tagged_k_blocks(quantise_q6_k(f32.down[1]), "q6_k")])
    return HostExpertPool.from_arrays(quantise_q4_k(f32.gate_up), down, "q4_k/q4_k_or_q6_k")


@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("isa", KERNEL_ISAS, ids=lambda i: i.name)
def test_tagged_k_layers_match_reference(isa, num_tokens):
    """A part whose layers mix Q4_K and Q6_K (tagged blocks): each layer's kernel equals the
    reference, and each layer dequantises to gguf's dequantisation of its own type."""
    rng = np.random.default_rng(17)
    pool = tagged_k_pool(rng, 256, 256)
    assert pool.down.shape[-1] == 212 and pool.expert_bytes == 512 * 144 + 256 * 212
    for layer, fmt in enumerate(("q4_k", "q6_k")):
        raw = pool.down[layer, 1].reshape(256, 212)
        assert (raw[:, 0] == {"q4_k": 4, "q6_k": 6}[fmt]).all()
        stored = np.ascontiguousarray(raw[:, 2:2 + FORMATS[fmt].block_bytes])
        np.testing.assert_array_equal(pool.dequantised(layer, 1)[1], FORMATS[fmt].to_f32_numpy(stored))
        x = rng.standard_normal((num_tokens, 256)).astype(np.float32)
        ids = rng.integers(-1, 4, (num_tokens, 2)).astype(np.int32)
        weights = rng.random((num_tokens, 2)).astype(np.float32)
        y = HostExecutor(pool, threads=2, isa=isa).expert_ffn_numpy(x, layer, ids, weights)
        ref = reference_expert_ffn(pool.gate_up, pool.down, layer, x, ids, weights, dtype=pool.dtype, isa=isa)
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * max(1.0, float(np.abs(ref).max())))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS + MIXED_FORMATS[:1])
def test_jitted_boundary_reads_block_pool(fmt):
    rng = np.random.default_rng(1)
    d_model, d_ff = 2 * block_of(fmt), block_of(fmt)
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


# sha256 of libggml-base's quantize_row_q6_K_ref bytes (llama-cpp-python 0.3.36's ggml 0.25.3, via ctypes) for the
# rows of `q6_k_rows`; the port was also checked against it on 6.5k super-blocks (Gaussian,
# Student-t, all-positive, all-negative, quarter-step values, zero and constant sub-blocks)
Q6_K_LLAMA_CPP_SHA256 = "9e338ff17b8efad3418144981de3a41790637c11cf3ef628c7d32d7e87bb9787"


def q6_k_rows() -> np.ndarray:
    rng = np.random.default_rng(0)
    w = np.concatenate([rng.standard_normal((24, 256)), rng.standard_t(2, (8, 256)),
                        np.round(rng.standard_normal((4, 256)) * 4) / 4, np.zeros((1, 256))]).astype(np.float32)
    w[2, :16] = 0.0
    w[3, 16:32] = 1.5
    w[4] = np.abs(w[4])
    return w


def test_q6_k_quantiser():
    """Q6_K (the gguf package only dequantises it): `quantise_q6_k` gives the bytes of
    llama.cpp's quantize_row_q6_K_ref, and gguf's dequantiser reads them back within the
    format's error (6-bit levels with an int8 scale per 16: ~2.6% of a Gaussian row)."""
    import hashlib

    w = q6_k_rows()
    stored = quantise_q6_k(w)
    assert stored.shape == (w.shape[0], 210) and stored.dtype == np.uint8
    assert hashlib.sha256(stored.tobytes()).hexdigest() == Q6_K_LLAMA_CPP_SHA256
    back = FORMATS["q6_k"].to_f32_numpy(stored)
    assert not back[-1].any() and not back[2, :16].any()
    assert np.abs(back[3, 16:32] - 1.5).max() < 1.5 / 31  # within one level of its sub-block
    for row in range(24):
        assert np.linalg.norm(back[row] - w[row]) / np.linalg.norm(w[row]) < 0.04
    with pytest.raises(ValueError, match="multiple of 256"):
        quantise_q6_k(np.zeros((2, 288), np.float32))


def test_fp8_and_mxfp4_codecs():
    """fp8_e4m3: per 128 x 128 tile scale_inv = amax / 448 (the tile's largest weight is
    exactly +-448 * scale), rows of {f32 scale, 128 e4m3 bytes} (a relayout of the tile
    scales); ragged tiles (rows not a multiple of 128) keep their own scale. mxfp4: gguf's
    codec (e8m0 exponent byte + 16 bytes of e2m1 nibbles)."""
    import ml_dtypes

    from ftjax.experts.storage import fp8_blocks, mxfp4_blocks

    rng = np.random.default_rng(5)
    w = (rng.standard_normal((200, 256)) * np.linspace(0.1, 3, 256)).astype(np.float32)
    stored = FORMATS["fp8_e4m3"].from_f32_numpy(w)
    assert stored.shape == (200, 2 * 132)
    blocks = stored.reshape(200, 2, 132)
    scale = blocks[..., :4].copy().view(np.float32)[..., 0]  # [200, 2]
    tiles = np.abs(w).reshape(200, 2, 128).max(-1)
    np.testing.assert_array_equal(scale[:128], np.broadcast_to(tiles[:128].max(0) / np.float32(448), (128, 2)))
    np.testing.assert_array_equal(scale[128:], np.broadcast_to(tiles[128:].max(0) / np.float32(448), (72, 2)))
    q = blocks[..., 4:].copy().view(ml_dtypes.float8_e4m3fn).reshape(200, 256)
    np.testing.assert_array_equal(fp8_blocks(q, scale[::128]), stored)  # the stored layout is a relayout
    back = FORMATS["fp8_e4m3"].to_f32_numpy(stored)
    assert np.linalg.norm(back - w) / np.linalg.norm(w) < 0.04  # 3 mantissa bits
    with pytest.raises(ValueError, match="expected"):
        fp8_blocks(q, scale[:1])
    m = FORMATS["mxfp4"].from_f32_numpy(w[:4])
    assert m.shape == (4, 8 * 17)
    back = FORMATS["mxfp4"].to_f32_numpy(m)
    assert np.linalg.norm(back - w[:4]) / np.linalg.norm(w[:4]) < 0.2
    # gpt-oss's layout (element 2j in the low nibble of byte j, e8m0 scales apart), decoded as
    # its reference does (FP4 values, ldexp by scale - 127), relays to the same weights
    codes = rng.integers(0, 16, (3, 4, 32)).astype(np.uint8)  # [rows, groups, 32]
    scales = rng.integers(118, 136, (3, 4)).astype(np.uint8)
    lut = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    want = np.ldexp(lut[codes], scales[..., None].astype(np.int32) - 127).reshape(3, 128)
    gpt_oss = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [3, 4, 16]
    np.testing.assert_array_equal(FORMATS["mxfp4"].to_f32_numpy(mxfp4_blocks(gpt_oss, scales)), want)


def test_activation_quantiser_twins():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 128)) * np.array([1e-3, 1.0, 30.0, 0.0])[:, None]).astype(np.float32)
    q, d = quantise_activations(x)
    assert q.dtype == np.int8 and np.abs(q).max() <= 127 and d.shape == (4, 4)
    assert not q[3].any() and not d[3].any()  # an all-zero block: scale 0, no division
    # XLA may fold the /127 into a multiply: the same values up to one float rounding
    np.testing.assert_allclose(np.asarray(act_q8(jnp.asarray(x))), act_q8_numpy(x), rtol=1e-6, atol=0)
    np.testing.assert_allclose(act_q8_numpy(x), x, rtol=0, atol=float(np.abs(x).max()) / 254 + 1e-12)
    # the K formats' blocks of 256 (ActQ8K): one scale per row here
    x = np.concatenate([x, x[:, ::-1] * 0.5], axis=1)  # [4, 256]
    q, d = quantise_activations(x, 256)
    assert d.shape == (4, 1) and np.abs(q).max(axis=-1).tolist() == [127, 127, 127, 0]
    np.testing.assert_allclose(np.asarray(act_q8(jnp.asarray(x), 256)), act_q8_numpy(x, 256), rtol=1e-6, atol=0)
    np.testing.assert_allclose(act_q8_numpy(x, 256), x, rtol=0, atol=float(np.abs(x).max(axis=-1).max()) / 254)
    assert FORMATS["q4_k"].act_block == FORMATS["q6_k"].act_block == FORMATS["q4_k_or_q6_k"].act_block == 256
    assert FORMATS["q8_0"].act_block == FORMATS["q4_0"].act_block == FORMATS["mxfp4"].act_block == 32
    assert FORMATS["fp8_e4m3"].act_block == FORMATS["bfloat16"].act_block == 0


@pytest.mark.parametrize("block", [32, 256])
@pytest.mark.parametrize("isa", KERNEL_ISAS, ids=lambda i: i.name)
def test_native_activation_quantiser_equals_numpy(isa, block):
    """The host kernels' quantiser (scalar, or 8 values at a time with AVX2 for the SIMD
    tables) gives the numpy twin's bytes and scales exactly, and ActQ8K's bsums are the sums
    of each 16 q: rows of mixed scales, exact halves (x * id on a .5: round to even),
    an all-zero row, values that round to +-127."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((6, 512)) * np.array([1e-3, 1.0, 30.0, 0.0, 1.0, 1.0])[:, None]).astype(np.float32)
    x[4] = np.clip(np.round(rng.standard_normal(512) * 40), -126, 126) + 0.5  # d = 1: q = x rounds exact halves
    x[4, ::block] = 127.0
    x[5, ::7] = -x[5, ::7] * 50
    q, d, bsums = host.quantise_activations_native(x, block, isa=isa)
    q_ref, d_ref = quantise_activations(x, block)
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(d, d_ref)
    assert not q[3].any() and np.abs(q).max() == 127
    assert (d[4] == 1).all() and (q[4] % 2 == 0)[x[4] % 1 == 0.5].all()  # halves went to even
    if block == 256:
        np.testing.assert_array_equal(bsums, q.reshape(6, -1, 16).astype(np.int32).sum(-1))
    else:
        assert bsums.shape == (6, 0)


@pytest.mark.parametrize("fmt,tolerance", [("q8_0", 0.025), ("q4_0", 0.2), ("q4_k", 0.16), ("q6_k", 0.05),
                                           ("mxfp4", 0.25), ("fp8_e4m3", 0.06), ("q4_k/q6_k", 0.14)])
def test_quantised_experts_close_to_bf16(fmt, tolerance):
    """Relative error (Frobenius) of the expert output against the bf16 experts the
    quantised pool was made from, weights and activations quantised: int8 within 2.5%,
    int4 within 20%, q4_k within 16%, q6_k within 5%, mxfp4 within 25%, fp8_e4m3 within 6%,
    q4_k gate/up with q6_k down within 14% on random Gaussian experts and inputs (measured:
    1.5%, 15%, 12.7%, 3.6%, 20.3%, 4.6%, 10.9%: Q4_K's fitted scale and min beat Q4_0 at the
    same 4.5 bits; MXFP4's power-of-two scale and 8 levels per sign cost more; FP8 keeps
    float activations, its error is the weights' 3 mantissa bits. The K formats' activations
    carry one scale per 256 values: with one per 32 they measured 12.6%, 3.3%, 10.8%)."""
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
def fp8_checkpoint(tmp_path_factory):
    """A tiny qwen3_moe checkpoint whose widths are whole fp8_e4m3 blocks (D = F = 128)."""
    hf = hf_models.build("qwen3_moe", seed=7, hidden_size=128, moe_intermediate_size=128, intermediate_size=128,
                         head_dim=16, mlp_only_layers=[])
    return hf_models.save(hf, tmp_path_factory.mktemp("quant_fp8"))


@pytest.fixture(scope="module")
def q4_k_checkpoint(tmp_path_factory):
    """A tiny qwen3_moe checkpoint whose widths are whole Q4_K super-blocks (D = F = 256)."""
    hf = hf_models.build("qwen3_moe", seed=7, hidden_size=256, moe_intermediate_size=256, intermediate_size=256,
                         head_dim=16, mlp_only_layers=[])
    return hf_models.save(hf, tmp_path_factory.mktemp("quant_q4_k"))


POLICIES = [("device", {}), ("host", {}), ("lru", dict(cache_slots=4, bandwidth=(4.0, 8.0))),
            ("lru-transfer-only", dict(cache_slots=4)), ("static-layer", dict(cache_slots=5))]


CHECKPOINT_OF = {"int8": "quant_checkpoint", "int4": "quant_checkpoint", "mxfp4": "quant_checkpoint",
                 "q4_k": "q4_k_checkpoint", "q6_k": "q4_k_checkpoint", "q4_k/q6_k": "q4_k_checkpoint",
                 "fp8_e4m3": "fp8_checkpoint"}
POOL_FORMAT = {"int8": "q8_0", "int4": "q4_0"}


def policy_tokens(request, expert_dtype, policies) -> dict[str, list[int]]:
    checkpoint = request.getfixturevalue(CHECKPOINT_OF[expert_dtype])
    prompt = [5, 17, 3, 60, 22, 9, 41, 2]
    runs = {}
    for policy, kw in policies:
        model = ftjax.load(checkpoint, expert_dtype=expert_dtype, policy=policy, **kw)
        assert model.checkpoint.pool.dtype == POOL_FORMAT.get(expert_dtype, expert_dtype)
        runs[policy] = model.generate(prompt, 12)
    return runs


# every policy: int8 by default; the other formats are `slow` (35-90 s each): their kernels,
# decoders, device FFN and host model path are covered above and below, and device against
# host for each format by the next test
SLOW_DTYPES = ("int4", "q4_k", "q6_k", "mxfp4", "fp8_e4m3", "q4_k/q6_k")


@pytest.mark.parametrize("expert_dtype", ["int8", *(pytest.param(d, marks=pytest.mark.slow) for d in SLOW_DTYPES)])
def test_every_policy_gives_device_tokens(request, expert_dtype):
    runs = policy_tokens(request, expert_dtype, POLICIES)
    assert all(tokens == runs["device"] for tokens in runs.values()), runs


# q6_k and fp8_e4m3 are `slow` here: their device and host model paths run by default in
# test_gguf.py::test_q4_k_m_experts (Q6_K down) and test_fp8_checkpoint_as_stored below
@pytest.mark.parametrize("expert_dtype", ["mxfp4", *(pytest.param(d, marks=pytest.mark.slow)
                                                     for d in ("q6_k", "fp8_e4m3"))])
def test_host_gives_device_logits(request, expert_dtype):
    """The host kernel and the device FFN (XLA dequantiser) give one model of each newer
    format the same logits (the greedy tokens of every policy: the `slow` test above)."""
    checkpoint = request.getfixturevalue(CHECKPOINT_OF[expert_dtype])
    prompt = [5, 17, 3, 60, 22, 9, 41, 2]
    logits = [ftjax.load(checkpoint, expert_dtype=expert_dtype, policy=p, threads=2).logits(prompt)
              for p in ("device", "host")]
    np.testing.assert_allclose(logits[1], logits[0], rtol=0, atol=1e-5 * float(np.abs(logits[0]).max()))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS + MIXED_FORMATS)
def test_device_ffn_matches_host_kernel(fmt):
    """The device FFN of a block format (XLA dequantiser + the same int8 activation
    quantisation, `executor.swiglu`) computes what the host kernel does, up to float
    rounding: the model-level check of every policy is the `slow` test above."""
    from ftjax.experts.executor import swiglu

    rng = np.random.default_rng(10)
    d_model, d_ff = 2 * block_of(fmt), block_of(fmt)
    pool = random_pool(rng, 1, 3, d_model, d_ff).converted(fmt)
    x = rng.standard_normal((3, d_model)).astype(np.float32)
    gate_up, down = pool.expert(0, 2)
    y = jax.jit(lambda g, d, x: swiglu(g, d, x, part_formats(fmt)))(gate_up, down, x)
    float_acts = host.auto_isa()  # as XLA: bf16 parts meet f32 activations
    ref = HostExecutor(pool, threads=2, isa=float_acts).expert_ffn_numpy(x, 0, np.full((3, 1), 2, np.int32),
                                                                      np.ones((3, 1), np.float32))
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


def fp8_tiles(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's FP8 weight quantisation, written with torch (independent of
    `storage.quantise_fp8_e4m3`): w [out, in] -> (float8_e4m3fn [out, in], scale_inv
    [ceil(out/128), ceil(in/128)] f32 = tile amax / 448); ragged edge tiles included."""
    out, inp = w.shape
    R, C = -(-out // 128), -(-inp // 128)
    padded = torch.zeros(R * 128, C * 128)
    padded[:out, :inp] = w.float()
    scale = padded.abs().reshape(R, 128, C, 128).amax(dim=(1, 3)) / 448.0
    per = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :inp]
    q = torch.where(per > 0, w.float() / torch.where(per > 0, per, 1.0), 0.0).to(torch.float8_e4m3fn)
    return q, scale


@pytest.fixture(scope="module")
def fp8_deepseek(tmp_path_factory):
    """A tiny deepseek_v3 checkpoint in the layout of DeepSeek-V3's FP8 release: routed
    experts and the attention / dense-MLP / shared-expert matrices float8_e4m3fn with
    `weight_scale_inv` per 128 x 128 tile (D = F = 128 for the experts; the dense matrices
    are smaller than a tile: ragged tiles), norms, router, embedding and LM head as they
    were, and quantization_config in config.json. -> (folder, the HF model holding the
    dequantised weights: the reference)."""
    import copy
    import json

    from safetensors.torch import save_file

    hf = hf_models.build("deepseek_v3", seed=21, hidden_size=128, moe_intermediate_size=128)
    ref = copy.deepcopy(hf)
    sd, deq = {}, {}

    def put(name, w):  # -> the dequantised w
        q, scale = fp8_tiles(w)
        sd[name], sd[name + "_scale_inv"] = q.contiguous(), scale.contiguous()
        return q.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:w.shape[0], :w.shape[1]]

    for name, w in hf.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # transformers' fused experts ->
            stem, F = name.rsplit(".", 1)[0], hf.config.moe_intermediate_size  # the release's per-expert ones
            parts = {"gate_proj": lambda e: w[e, :F], "up_proj": lambda e: w[e, F:]} if "gate_up" in name \
                else {"down_proj": lambda e: w[e]}
            deq[name] = torch.stack([torch.cat([put(f"{stem}.{e}.{p}.weight", get(e)) for p, get in parts.items()])
                                     for e in range(w.shape[0])])
        elif name.endswith("_proj.weight") and w.ndim == 2:
            deq[name] = put(name, w)
        else:
            sd[name] = w.contiguous()
    ref.load_state_dict(deq, strict=False)
    path = tmp_path_factory.mktemp("fp8_deepseek")
    hf.config.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(cfg))
    sd.pop("lm_head.weight", None) if hf.config.tie_word_embeddings else None
    save_file(sd, str(path / "model.safetensors"))
    return path, ref


@pytest.mark.parametrize("policy", ["device", "host"])
def test_fp8_checkpoint_as_stored(fp8_deepseek, policy):
    """The FP8 experts land in an fp8_e4m3 pool byte for byte (the e4m3 bytes as stored,
    each tile's scale on its rows), the dense FP8 matrices are dequantised at load, and the
    model gives transformers' logits on the dequantised weights (FP8 meets float
    activations: no activation quantisation, so the match is to float rounding)."""
    from safetensors.torch import load_file

    from test_parity import PROMPT, rel_err

    path, ref = fp8_deepseek
    model = ftjax.load(path, policy=policy, threads=2, numerics="exact")  # the parity suite's numerics
    pool = model.checkpoint.pool
    assert pool.dtype == "fp8_e4m3" and not model.checkpoint.packed
    stored = load_file(str(path / "model.safetensors"))
    m, bid = 0, model.config.moe_layer_ids[0]
    q = stored[f"model.layers.{bid}.mlp.experts.5.down_proj.weight"].view(torch.uint8).numpy()
    scale = stored[f"model.layers.{bid}.mlp.experts.5.down_proj.weight_scale_inv"].numpy()  # [1, 1]
    rows = pool.down[m, 5].reshape(128, 1, 132)
    assert np.array_equal(rows[..., 4:].reshape(128, 128), q)
    assert np.all(rows[..., :4].copy().view(np.float32)[..., 0] == scale[0, 0])
    assert rel_err(model.logits(PROMPT), hf_models.hf_logits(ref, PROMPT).numpy()) <= 1e-4
    if policy == "host":  # quantised at load from the dequantised weights: the same pool
        assert ftjax.load(path, expert_dtype="fp8_e4m3").checkpoint.pool.dtype == "fp8_e4m3"
