"""Block-quantised dense matrices (`ftjax.models.ops.QuantMatrix`): the dense linear kernel
(host_kernels/linear.cc) on Q8_0 / Q4_0 / Q4_K / Q6_K / MXFP4 / FP8 rows equals its numpy
reference (the format's dequantiser, activations int8-quantised as the kernel does), from
numpy and inside jit through FFI, and XLA's dequantising path off the FFI boundary; a tiny
Q8_0 GGUF loads with its projection matrices and LM head kept as Q8_0, and its logits /
greedy tokens match the same file dequantised to float32 (dense_dtype="float32") under the
device, host and lru policies; a folder quantises its matrices at load (dense_dtype="int8");
bad types are errors that name them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
import hf_models
from ftjax import host
from ftjax.checkpoint import CheckpointError
from ftjax.experts.storage import FORMATS
from ftjax.gguf_checkpoint import write_gguf
from ftjax.host import Boundary, Isa, available_isas, linear_numpy, reference_linear
from ftjax.models.ops import QuantMatrix
from ftjax.models.ops import linear as model_linear

KERNEL_ISAS = [i for i in available_isas() if i not in host.tile_isas()]  # the tile ISAs: tests/test_amx.py

# the block formats the kernel reads, and a K (input width) of whole blocks of each
TYPES = {"q8_0": 96, "q4_0": 96, "q4_k": 512, "q6_k": 512, "mxfp4": 96, "fp8_e4m3": 384}
PROMPT = [int(t) for t in np.random.RandomState(0).randint(0, 96, size=12)]
OLMOE_BLOCKS = dict(hidden_size=64, intermediate_size=32)  # every width whole 32-weight blocks


def make(rng, fmt, n_out, n_in, tokens):
    """x [T, K] float32, w [N, row bytes] uint8 blocks of fmt."""
    w = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
    x = rng.standard_normal((tokens, n_in)).astype(np.float32)
    return x, FORMATS[fmt].from_f32_numpy(w)


def assert_close(y, ref):
    """Float summation order only: the products are the reference's exactly."""
    np.testing.assert_allclose(y, ref, rtol=0, atol=3e-5 * max(1.0, float(np.abs(ref).max())))


@pytest.mark.parametrize("fmt", sorted(TYPES))
@pytest.mark.parametrize("isa", KERNEL_ISAS, ids=lambda i: i.name)
@pytest.mark.parametrize("n_out,blocks,tokens", [(1, 1, 1), (37, 3, 1), (70, 5, 2), (9, 2, 5), (130, 7, 50)])
def test_block_linear_matches_reference(fmt, isa, n_out, blocks, tokens):
    """K = 1..7 blocks of the format (odd counts: K is no multiple of the kernels' SIMD
    tiles), 1..50 tokens (the gemv path and the R x J tiles), 1 and 2 threads."""
    K = FORMATS[fmt].block * blocks
    rng = np.random.default_rng(n_out * 100 + blocks * 10 + tokens)
    x, w = make(rng, fmt, n_out, K, tokens)
    ref = reference_linear(x, w, fmt)
    for threads in (1, 2):
        assert_close(linear_numpy(x, w, threads=threads, isa=isa, wtype=fmt), ref)


@pytest.mark.parametrize("fmt", sorted(TYPES))
def test_jit_block_linear(fmt):
    """Inside jit: the FFI handler on the CPU backend (the wtype attribute in the program),
    XLA's dequantise-and-dot on the callback boundary; both equal the reference."""
    rng = np.random.default_rng(7)
    x, w = make(rng, fmt, 40, TYPES[fmt], 3)
    ref = reference_linear(x, w, fmt)
    ffi = jax.jit(lambda x, w: host.linear(x, w, wtype=fmt))
    xla = jax.jit(lambda x, w: host.linear(x, w, wtype=fmt, boundary=Boundary.CALLBACK))
    assert_close(np.asarray(ffi(x, w)), ref)
    assert_close(np.asarray(xla(x, w)), ref)
    assert host.LINEAR_FFI_TARGET in ffi.lower(x, w).as_text()
    assert host.LINEAR_FFI_TARGET not in xla.lower(x, w).as_text()


def test_model_linear_takes_a_quant_matrix():
    """`ops.linear` on a QuantMatrix (the value an nnx.Param holds; `[...]` gives it back
    whole) with leading axes, traced: equals the reference; the format is static."""
    from flax import nnx

    rng = np.random.default_rng(3)
    x, w = make(rng, "q8_0", 24, 64, 6)
    p = nnx.Param(QuantMatrix(jnp.asarray(w), "q8_0"))
    q = p[...]
    assert isinstance(q, QuantMatrix) and q.shape == (24, 64) and q.fmt == "q8_0"
    leaves, tree = jax.tree.flatten(q)
    assert len(leaves) == 1 and leaves[0].dtype == jnp.uint8 and "q8_0" in str(tree)
    y = jax.jit(model_linear)(jnp.asarray(x.reshape(2, 3, 64)), q)
    assert y.shape == (2, 3, 24)
    assert_close(np.asarray(y).reshape(6, 24), reference_linear(x, w, "q8_0"))
    np.testing.assert_array_equal(np.asarray(q.to_f32()), FORMATS["q8_0"].to_f32_numpy(w))


def test_quant_matrix_uses_xla_for_many_rows():
    """As for packed weights: from PACKED_GEMM_MIN_TOKENS rows XLA dequantises the matrix
    and multiplies (no FFI target in the program), below it the host kernel; both equal
    the reference (the activations int8-rounded on both)."""
    from ftjax.models.ops import PACKED_GEMM_MIN_TOKENS

    rng = np.random.default_rng(5)
    for rows, kernel in ((PACKED_GEMM_MIN_TOKENS - 1, True), (PACKED_GEMM_MIN_TOKENS, False)):
        x, w = make(rng, "q4_0", 24, 64, rows)
        q = QuantMatrix(jnp.asarray(w), "q4_0")
        fn = jax.jit(model_linear)
        assert_close(np.asarray(fn(jnp.asarray(x), q)), reference_linear(x, w, "q4_0"))
        assert (host.LINEAR_FFI_TARGET in fn.lower(jnp.asarray(x), q).as_text()) == kernel


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_k_quant_matrix_always_uses_the_kernel(fmt):
    """The K super-block formats stay on the host kernel at any row count (it beats XLA's
    dequantise + f32 GEMM there, `ops.linear`), and equal the reference."""
    from ftjax.models.ops import PACKED_GEMM_MIN_TOKENS

    rng = np.random.default_rng(6)
    for rows in (1, PACKED_GEMM_MIN_TOKENS):
        x, w = make(rng, fmt, 24, 256, rows)
        q = QuantMatrix(jnp.asarray(w), fmt)
        fn = jax.jit(model_linear)
        assert_close(np.asarray(fn(jnp.asarray(x), q)), reference_linear(x, w, fmt))
        assert host.LINEAR_FFI_TARGET in fn.lower(jnp.asarray(x), q).as_text()


def test_bad_weight_types_raise():
    rng = np.random.default_rng(4)
    x, w = make(rng, "q8_0", 8, 64, 2)
    with pytest.raises(ValueError, match=r"weight type 'q5_k' does not describe a uint8 matrix"):
        linear_numpy(x, w, wtype="q5_k")
    with pytest.raises(ValueError, match=r"weight type 'q8_0' does not describe a float32 matrix"):
        host.linear(jnp.asarray(x), jnp.ones((8, 64), jnp.float32), wtype="q8_0")
    with pytest.raises(ValueError, match=r"x has 32 features but the q8_0 matrix rows hold 64 weights"):
        host.linear(jnp.asarray(x[:, :32]), jnp.asarray(w), wtype="q8_0")
    with pytest.raises(ValueError, match="not whole blocks"):  # 33 bytes: no whole Q8_0 block
        linear_numpy(x, np.zeros((8, 33), np.uint8), wtype="q8_0")
    with pytest.raises(ValueError, match=r"'bfloat16' is not a block format"):
        QuantMatrix(jnp.asarray(w), "bfloat16")
    if Isa.AVX512 not in available_isas():
        with pytest.raises(ValueError, match="ISA"):
            linear_numpy(x, w, isa=Isa.AVX512, wtype="q8_0")


# ---- models ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    """(HF folder, a GGUF of it with Q8_0 experts and Q8_0 dense matrices) of a tiny OLMoE."""
    d = tmp_path_factory.mktemp("quant_dense")
    folder = hf_models.save(hf_models.build("olmoe", seed=7, **OLMOE_BLOCKS), d / "hf")
    return folder, write_gguf(folder, d / "olmoe-q8_0.gguf", "Q8_0", dense_type="Q8_0")


@pytest.fixture(scope="module")
def dequantised(q8_gguf):
    """The same file with every dense matrix dequantised to float32: its logits and
    greedy tokens (the reference the kept-Q8_0 model is held to). Both sides "exact": the
    int8 activations of the Q8_0 kernels are what these tests measure ("fast" widens Q8_0
    to bf16 on CPUs without AMX-INT8: tests/test_amx.py, tests/test_linear_kernel.py)."""
    ref = ftjax.load(q8_gguf[1], dense_dtype="float32", numerics="exact")
    assert ref.checkpoint.dense_format is None
    return ref.logits(PROMPT), ref.generate(PROMPT, 8)


def assert_near_float(logits, ref, tol=0.05):
    """logits [T, V] within tol of the largest reference logit at every prompt position but
    at most one, and not equal. The one: int8 activations move a router's scores by ~1e-3,
    and where two experts nearly tie (position 4 of PROMPT in the int8 folder model) the
    SIMD kernels' summation order, 1e-6 away from the scalar one, can pick the other expert;
    that position then differs by ~10% (measured on AVX2 and AVX-512; scalar 2.6%)."""
    err = np.abs(logits - ref).max(-1) / np.abs(ref).max()  # [T]
    assert err.max() > 0 and np.sum(err > tol) <= 1, np.round(err, 3)


def quant_params(model) -> dict[str, str]:
    """path -> format of every QuantMatrix param."""
    flat = jax.tree_util.tree_flatten_with_path(model._params, is_leaf=lambda v: isinstance(v, QuantMatrix))[0]
    return {jax.tree_util.keystr(p): v.fmt for p, v in flat if isinstance(v, QuantMatrix)}


def test_gguf_q8_0_dense_kept_as_stored(q8_gguf, dequantised):
    """Every projection matrix and the LM head stay Q8_0 rows (uint8 [out, 34 * in / 32]),
    the embedding and routers float32; the logits are the dequantised model's up to the
    int8 rounding of the activations (<= 5% of the largest logit at this tiny width)."""
    model = ftjax.load(q8_gguf[1], numerics="exact")
    ck = model.checkpoint
    assert ck.dense_format == "q8_0" and not ck.packed
    fmts = quant_params(model)
    L = model.config.num_layers
    assert len(fmts) == 4 * L + 1 and set(fmts.values()) == {"q8_0"}  # wq, wk, wv, wo per layer + lm_head
    lm_head = model._params["lm_head"][...]
    assert isinstance(lm_head, QuantMatrix) and lm_head.data.dtype == jnp.uint8
    assert lm_head.data.shape == (model.config.vocab_size, model.config.d_model // 32 * 34)
    assert model._params["embed"][...].dtype == jnp.float32
    assert model._params["layers"][0]["moe"]["w_router"][...].dtype == jnp.float32
    ref_logits, _ = dequantised
    assert_near_float(model.logits(PROMPT), ref_logits)
    assert model.fingerprint != ftjax.load(q8_gguf[1], dense_dtype="float32", numerics="exact").fingerprint


@pytest.mark.parametrize("policy,options", [("device", {}), ("host", {}), ("lru", dict(cache_slots=4))])
def test_gguf_q8_0_dense_greedy_tokens(q8_gguf, dequantised, policy, options):
    model = ftjax.load(q8_gguf[1], policy=policy, bandwidth=(1.0, 1.0), numerics="exact", **options)
    assert model.checkpoint.dense_format == "q8_0"
    assert model.generate(PROMPT, 8) == dequantised[1]


def test_folder_quantised_at_load(q8_gguf):
    """dense_dtype="int8" on a float32 folder quantises the matrices the GGUF keeps as Q8_0,
    to the same bytes (both are gguf's quantiser); the embedding and routers stay float32
    (the GGUF's are Q8_0, dequantised), and the logits are the float model's up to Q8_0."""
    folder, path = q8_gguf
    model = ftjax.load(folder, dense_dtype="int8")
    gg = ftjax.load(path)
    assert model.checkpoint.dense_format == "q8_0" and quant_params(model) == quant_params(gg)
    np.testing.assert_array_equal(np.asarray(model._params["layers"][1]["attn"]["wo"][...].data),
                                  np.asarray(gg._params["layers"][1]["attn"]["wo"][...].data))
    assert_near_float(model.logits(PROMPT), ftjax.load(folder).logits(PROMPT))
    with pytest.raises(ValueError, match=r"dense_dtype must be .*got 'q5_k'"):
        ftjax.load(folder, dense_dtype="q5_k")


def test_gguf_dense_type_the_kernels_cannot_read(q8_gguf, tmp_path):
    """A dense matrix of a type neither kept nor dequantisable is an error naming the
    tensor and its type."""
    from test_gguf import rewrite

    bad = rewrite(q8_gguf[1], tmp_path / "bad.gguf", garble={"blk.0.attn_q.weight": "Q8_1"})
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_q\.weight is Q8_1"):
        ftjax.load(bad)
