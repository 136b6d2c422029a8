"""GGUF checkpoints (`ftjax.gguf_checkpoint`): tiny HF checkpoints written with
`write_gguf` load with `ftjax.load(path.gguf)` and equal the folder models (block-format
experts byte for byte: both sides quantise with the same quantiser, gguf's for Q8_0 / Q4_0,
ftjax's ports of llama.cpp's for Q4_K / Q6_K; Q4_K_M's Q4_K gate / up with Q6_K down load
into a pool of two part formats, and its down layers mixing Q4_K and Q6_K into tagged
blocks), the embedded default model's tokenizer and greedy
tokens survive the round trip, and bad files fail with an error naming the file and the
tensor."""

import gguf
import numpy as np
import pytest
import torch

import ftjax
import hf_models
from ftjax.checkpoint import CheckpointError
from ftjax.gguf_checkpoint import add_tensor, write_gguf
from ftjax.model import DEFAULT_MODEL_DIR

PROMPT = [int(t) for t in np.random.RandomState(0).randint(0, 96, size=12)]
# widths that are whole 32-weight blocks (d_model, expert FFN width)
BLOCK_SIZES = {
    "qwen3_moe": dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=64, head_dim=16, mlp_only_layers=[]),
    "olmoe": dict(hidden_size=64, intermediate_size=32),
}
# widths that are whole Q4_K super-blocks (256 weights)
Q4_K_SIZES = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, head_dim=16, mlp_only_layers=[])


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def rewrite(src, dst, *, arch=None, retype=None, garble=None, drop=(), meta=None):
    """Copy a GGUF with the gguf package, changing the architecture name, the type of some
    tensors (dequantised, then quantised to the new type), dropping tensors or metadata.
    garble: {name: type} gives tensors random bytes of a type nothing here quantises (Q6_K)."""
    retype, garble, meta = retype or {}, garble or {}, meta or {}
    r = gguf.GGUFReader(src)
    old_arch = r.get_field("general.architecture").contents()
    w = gguf.GGUFWriter(dst, arch or old_arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name in meta:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for key, value in meta.items():
        if value is not None:
            w.add_string(key, value)
    for t in r.tensors:
        if t.name in drop:
            continue
        if t.name in retype:
            a = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))
            add_tensor(w, t.name, a, retype[t.name])
        elif t.name in garble:
            q = gguf.GGMLQuantizationType[garble[t.name]]
            block, block_bytes = gguf.GGML_QUANT_SIZES[q]
            shape = tuple(int(n) for n in reversed(t.shape))
            raw = np.random.default_rng(0).integers(0, 256, (*shape[:-1], shape[-1] // block * block_bytes), np.uint8)
            w.add_tensor(t.name, raw, raw_dtype=q)
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    """(HF folder, its Q8_0-experts GGUF) of a tiny qwen3_moe with block-sized widths."""
    d = tmp_path_factory.mktemp("tiny")
    folder = hf_models.save(hf_models.build("qwen3_moe", seed=11, **BLOCK_SIZES["qwen3_moe"]), d / "hf")
    return folder, write_gguf(folder, d / "tiny-q8_0.gguf", "Q8_0")


@pytest.mark.parametrize("family", sorted(BLOCK_SIZES))
@pytest.mark.parametrize("expert_type,expert_dtype", [("Q8_0", "int8"), ("Q4_0", "int4")])
def test_block_experts_equal_quantised_folder(family, expert_type, expert_dtype, tmp_path):
    """Q8_0 / Q4_0 experts are copied as stored: the pool is byte-identical to the folder
    model quantised at load, and so are the logits."""
    folder = hf_models.save(hf_models.build(family, seed=7, **BLOCK_SIZES[family]), tmp_path / "hf")
    path = write_gguf(folder, tmp_path / f"{family}.gguf", expert_type)
    model = ftjax.load(path)
    ref = ftjax.load(folder, expert_dtype=expert_dtype)
    pool, ref_pool = model.checkpoint.pool, ref.checkpoint.pool
    assert pool.dtype == ref_pool.dtype == expert_type.lower()
    assert np.array_equal(pool.gate_up, ref_pool.gate_up) and np.array_equal(pool.down, ref_pool.down)
    assert model.config == ref.config and model.tokenizer is None  # no tokenizer.json: none in the GGUF
    assert rel_err(model.logits(PROMPT), ref.logits(PROMPT)) <= 1e-5


@pytest.fixture(scope="module")
def tiny_q4_k(tmp_path_factory):
    """(HF folder, its Q4_K-experts GGUF) of a tiny qwen3_moe whose widths are whole Q4_K
    super-blocks (D = F = 256), written by `write_gguf` through the gguf package's writer."""
    d = tmp_path_factory.mktemp("tiny_q4_k")
    folder = hf_models.save(hf_models.build("qwen3_moe", seed=12, **Q4_K_SIZES), d / "hf")
    return folder, write_gguf(folder, d / "tiny-q4_k.gguf", "Q4_K")


def test_q4_k_experts_kept_as_stored(tiny_q4_k):
    """Q4_K experts are copied as stored (no expansion): the pool holds the file's bytes, its
    dequantised weights are gguf's dequantisation of those bytes, and the model gives the
    logits of the folder model quantised to q4_k at load (the same dequantised weights and
    the same activation quantisation)."""
    folder, path = tiny_q4_k
    model, ref = ftjax.load(path), ftjax.load(folder, expert_dtype="q4_k")
    pool = model.checkpoint.pool
    assert pool.dtype == ref.checkpoint.pool.dtype == "q4_k" and model.config == ref.config
    F = model.config.d_ff_expert
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for m, bid in enumerate(model.config.moe_layer_ids):
        gate, down = tensors[f"blk.{bid}.ffn_gate_exps.weight"], tensors[f"blk.{bid}.ffn_down_exps.weight"]
        assert gate.tensor_type.name == down.tensor_type.name == "Q4_K"
        assert np.array_equal(pool.gate_up[m, :, :F], gate.data) and np.array_equal(pool.down[m], down.data)
        g, d = pool.dequantised(m, 3)
        assert np.array_equal(g[:F], gguf.quants.dequantize(gate.data[3], gate.tensor_type))
        assert np.array_equal(d, gguf.quants.dequantize(down.data[3], down.tensor_type))
    assert np.array_equal(pool.gate_up, ref.checkpoint.pool.gate_up) and np.array_equal(pool.down, ref.checkpoint.pool.down)
    assert pool.gate_up.nbytes == pool.gate_up.size  # uint8 blocks: 144 bytes per 256 weights
    assert rel_err(model.logits(PROMPT), ref.logits(PROMPT)) <= 1e-5
    assert ftjax.load(path, expert_dtype="q4_k").checkpoint.pool.dtype == "q4_k"
    with pytest.raises(CheckpointError, match=r"expert_dtype 'int4' does not match .*\(q4_k\)"):
        ftjax.load(path, expert_dtype="int4")


def test_a_process_reads_only_its_experts(tiny_q4_k):
    """`experts=` (one of several processes: the experts its devices own): the GGUF and
    the HF folder fill exactly those rows, as stored, and leave the others unread."""
    from ftjax.checkpoint import load_checkpoint
    from ftjax.gguf_checkpoint import load_gguf

    folder, path = tiny_q4_k
    for load, src, kw in ((load_gguf, path, {}), (load_checkpoint, folder, {"expert_dtype": "q4_k"})):
        whole = load(src, **kw)
        mine = load(src, experts=lambda E: np.arange(E) % 2 == 1, **kw)
        E = whole.config.num_experts
        assert whole.experts_read is None and list(mine.experts_read.nonzero()[0]) == list(range(1, E, 2))
        for part in ("gate_up", "down"):
            got, want = getattr(mine.pool, part), getattr(whole.pool, part)
            np.testing.assert_array_equal(got[:, 1::2], want[:, 1::2])


@pytest.mark.parametrize("policy", ["device", "host"])
def test_q4_k_m_experts(tiny_q4_k, tmp_path_factory, policy):
    """llama.cpp's Q4_K_M expert mix (Q4_K gate / up, Q6_K down; the file written through
    the gguf package) loads into a pool of two part formats, 'q4_k/q6_k', each part holding
    the file's bytes (dequantised: gguf's dequantisation of them), and gives the logits of
    the folder model quantised at load to the same formats (the same dequantised weights,
    the same activation quantisation) under the device and the host policy."""
    folder, _ = tiny_q4_k
    path = tmp_path_factory.getbasetemp() / "tiny-q4_k_m.gguf"
    if not path.exists():
        write_gguf(folder, path, "Q4_K", down_type="Q6_K")
    model = ftjax.load(path, policy=policy, threads=2)
    ref = ftjax.load(folder, expert_dtype="q4_k/q6_k", policy=policy, threads=2)
    pool = model.checkpoint.pool
    assert pool.dtype == ref.checkpoint.pool.dtype == "q4_k/q6_k" and model.config == ref.config
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    F = model.config.d_ff_expert
    for m, bid in enumerate(model.config.moe_layer_ids):
        gate, down = tensors[f"blk.{bid}.ffn_gate_exps.weight"], tensors[f"blk.{bid}.ffn_down_exps.weight"]
        assert (gate.tensor_type.name, down.tensor_type.name) == ("Q4_K", "Q6_K")
        assert np.array_equal(pool.gate_up[m, :, :F], gate.data) and np.array_equal(pool.down[m], down.data)
        assert np.array_equal(pool.dequantised(m, 2)[1], gguf.quants.dequantize(down.data[2], down.tensor_type))
    assert pool.down.shape[-1] == F // 256 * 210  # Q6_K: 210 bytes per 256 weights
    assert np.array_equal(pool.gate_up, ref.checkpoint.pool.gate_up) and np.array_equal(pool.down, ref.checkpoint.pool.down)
    assert rel_err(model.logits(PROMPT), ref.logits(PROMPT)) <= 1e-5
    with pytest.raises(CheckpointError, match=r"expert_dtype 'q4_k' does not match .*\(q4_k/q6_k\)"):
        ftjax.load(path, expert_dtype="q4_k")


@pytest.fixture(scope="module")
def tiny_q4_k_m(tiny_q4_k, tmp_path_factory):
    """A GGUF with llama.cpp's Q4_K_M expert types: gate / up Q4_K, down Q6_K in blocks 0
    and 2 and Q4_K in block 1 (its Q6_K weights dequantised and quantised to Q4_K)."""
    d = tmp_path_factory.mktemp("q4_k_m")
    mixed = write_gguf(tiny_q4_k[0], d / "q4_k-q6_k.gguf", "Q4_K", down_type="Q6_K")
    return rewrite(mixed, d / "q4_k_m.gguf", retype={"blk.1.ffn_down_exps.weight": "Q4_K"})


def test_q4_k_m_layer_mix_kept_as_stored(tiny_q4_k_m):
    """A down part whose layers mix Q4_K and Q6_K is stored as `q4_k_or_q6_k`: every layer's
    bytes as stored behind its tag, dequantised as gguf dequantises its own type; the device
    and the host policy give the same logits under numerics="exact" (int8 activations on
    both; "fast" prefills host K-format experts on AMX tiles with bf16 activations:
    tests/test_amx.py)."""
    runs = {}
    for policy in ("device", "host"):
        model = ftjax.load(tiny_q4_k_m, policy=policy, threads=2, numerics="exact")
        runs[policy] = model.logits(PROMPT)
    pool = model.checkpoint.pool
    assert pool.dtype == "q4_k/q4_k_or_q6_k"
    tensors = {t.name: t for t in gguf.GGUFReader(tiny_q4_k_m).tensors}
    for m, bid in enumerate(model.config.moe_layer_ids):
        down = tensors[f"blk.{bid}.ffn_down_exps.weight"]
        assert down.tensor_type.name == ("Q4_K" if bid == 1 else "Q6_K")
        blocks = pool.down[m].reshape(*down.data.shape[:-1], -1, 212)
        n = {"Q4_K": 144, "Q6_K": 210}[down.tensor_type.name]
        assert (blocks[..., 0] == int(down.tensor_type.name[1])).all()
        assert np.array_equal(blocks[..., 2:2 + n].reshape(down.data.shape), down.data)
        assert np.array_equal(pool.dequantised(m, 1)[1], gguf.quants.dequantize(down.data[1], down.tensor_type))
    assert rel_err(runs["device"], runs["host"]) <= 1e-5


def test_other_layer_mix_names_the_tensors(tiny_q4_k, tmp_path):
    """Other mixes within a part (here Q4_K and Q8_0 layers of ffn_down_exps) are refused:
    the error names both tensors and their types, and how to make a usable file."""
    bad = rewrite(tiny_q4_k[1], tmp_path / "bad.gguf", retype={"blk.1.ffn_down_exps.weight": "Q8_0"})
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_down_exps\.weight is Q4_K but blk\.1\.ffn_down_exps\.weight "
                                              r"is Q8_0: .*one format .*llama-quantize --pure"):
        ftjax.load(bad)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "qwen2_moe"])
def test_f32_experts_equal_safetensors(family, tmp_path):
    """Every family's metadata and tensor names round-trip: the default tiny geometries (a
    dense qwen3 layer, OLMoE's clip_qkv and full-width q/k norms, Qwen2-MoE's shared expert
    and qkv bias) give the safetensors model's logits."""
    folder = hf_models.save(hf_models.build(family, seed=8), tmp_path / "hf")
    path = write_gguf(folder, tmp_path / f"{family}-f32.gguf", "F32")
    model, ref = ftjax.load(path), ftjax.load(folder)
    assert model.checkpoint.pool.dtype == "float32" and model.config == ref.config
    assert rel_err(model.logits(PROMPT), ref.logits(PROMPT)) <= 1e-5


def test_bf16_file_stays_bf16(tmp_path):
    """BF16 experts go into a bfloat16 pool and BF16 dense matrices stay packed bf16 bits, as
    for a bf16 folder; dense_dtype="float32" unpacks them."""
    folder = hf_models.save(hf_models.build("qwen3_moe", seed=9), tmp_path / "hf", dtype=torch.bfloat16)
    path = write_gguf(folder, tmp_path / "bf16.gguf", "BF16")
    assert {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2} == {"BF16"}
    model, ref = ftjax.load(path), ftjax.load(folder)
    assert model.checkpoint.packed and model.checkpoint.pool.dtype == "bfloat16"
    assert np.array_equal(model.checkpoint.pool.gate_up, ref.checkpoint.pool.gate_up)
    assert rel_err(model.logits(PROMPT), ref.logits(PROMPT)) <= 1e-6
    # under "exact" (f32 activations everywhere: "fast" prefills packed bf16 matrices on AMX
    # tiles with bf16-rounded activations, f32 ones in f32)
    unpacked = ftjax.load(path, dense_dtype="float32", numerics="exact")
    assert not unpacked.checkpoint.packed
    assert rel_err(unpacked.logits(PROMPT), ftjax.load(folder, numerics="exact").logits(PROMPT)) <= 1e-5


def test_a_bf16_file_with_an_f32_router_stays_packed(tmp_path):
    """llama.cpp's converter writes a bf16 checkpoint's MoE router (ffn_gate_inp) as F32: its
    values are all bf16, so the file packs as if it were BF16 (half the dense bytes a
    decode step reads) and gives the all-BF16 file's logits to the bit. A router with a
    value bf16 cannot hold keeps the whole model in float32, as before."""
    folder = hf_models.save(hf_models.build("qwen3_moe", seed=9), tmp_path / "hf", dtype=torch.bfloat16)
    path = write_gguf(folder, tmp_path / "bf16.gguf", "BF16")
    routers = [t.name for t in gguf.GGUFReader(path).tensors if "ffn_gate_inp" in t.name]
    assert routers
    widened = rewrite(path, tmp_path / "f32-router.gguf", retype={n: "F32" for n in routers})
    assert {t.tensor_type.name for t in gguf.GGUFReader(widened).tensors if t.name in routers} == {"F32"}
    model, ref = ftjax.load(widened), ftjax.load(path)
    assert model.checkpoint.packed and model.checkpoint.dense_dtype == "bfloat16"
    np.testing.assert_array_equal(model.logits(PROMPT), ref.logits(PROMPT))
    r = gguf.GGUFReader(widened)
    router = next(t for t in r.tensors if t.name == routers[0])
    bits = np.memmap(widened, np.uint32, "r+", offset=int(router.data_offset), shape=(1,))
    bits[0] |= 1  # one value bf16 cannot hold
    bits.flush()
    del bits, r
    assert not ftjax.load(widened).checkpoint.packed


@pytest.fixture(scope="module")
def default_pair(tmp_path_factory):
    """The embedded default model as a Q8_0 GGUF, and the folder model with int8 experts."""
    path = write_gguf(DEFAULT_MODEL_DIR, tmp_path_factory.mktemp("default") / "default-q8_0.gguf", "Q8_0")
    return ftjax.load(path), ftjax.load(None, expert_dtype="int8")


TEXTS = ["It is a truth universally acknowledged, that a single man",
         "<|im_start|>user\nWho was Mr. Darcy?<|im_end|>\n<|im_start|>assistant\n",
         "  spaces,\ttabs\n\nnumbers 12345 and ünïcödé — “quotes” 😀",
         "<think>\nhmm\n</think><tool_call>{}</tool_call><|endoftext|>"]


def test_default_model_tokenizer_round_trips(default_pair):
    gg, folder = default_pair
    tok, ref = gg.tokenizer, folder.tokenizer
    assert tok is not None and tok.vocab_size == ref.vocab_size
    assert tok.added_token_ids == ref.added_token_ids and tok.special_ids == ref.special_ids
    assert tok.eos_token_ids == ref.eos_token_ids and gg.eos_ids == folder.eos_ids
    assert tok.special_tokens_map == {k: v for k, v in ref.special_tokens_map.items()}
    for text in TEXTS:
        ids = ref.encode(text)
        assert tok.encode(text) == ids
        assert tok.decode(ids) == ref.decode(ids)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False) == text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat) == ref.apply_chat_template(chat)


def test_default_model_generates_as_folder(default_pair):
    gg, folder = default_pair
    assert gg.config == folder.config and gg.checkpoint.packed == folder.checkpoint.packed
    assert np.array_equal(gg.checkpoint.pool.gate_up, folder.checkpoint.pool.gate_up)
    ids = folder.tokenizer.encode("It is a truth universally acknowledged")
    assert gg.generate(ids, 24) == folder.generate(ids, 24)
    assert len(gg.fingerprint) == 64 and gg.fingerprint != folder.fingerprint


def test_expert_dtype_must_match_the_file(tiny_q8):
    folder, path = tiny_q8
    assert ftjax.load(path, expert_dtype="q8_0").checkpoint.pool.dtype == "q8_0"
    with pytest.raises(CheckpointError, match=r"expert_dtype 'int4' does not match .*\(q8_0\)"):
        ftjax.load(path, expert_dtype="int4")


@pytest.mark.parametrize("retype,message", [
    ({"blk.1.ffn_up_exps.weight": "Q4_1"}, r"blk\.1\.ffn_up_exps\.weight is Q4_1: .*llama-quantize --pure"),
    ({"blk.0.ffn_down_exps.weight": "F16"},
     r"blk\.0\.ffn_down_exps\.weight is F16 but blk\.1\.ffn_down_exps\.weight is Q8_0: .*llama-quantize --pure"),
])
def test_unsupported_expert_types(tiny_q8, tmp_path, retype, message):
    bad = rewrite(tiny_q8[1], tmp_path / "bad.gguf", retype=retype)
    with pytest.raises(CheckpointError, match=message):
        ftjax.load(bad)


def test_quantised_dense_tensors_are_kept_or_dequantised(tiny_q8, tmp_path):
    """A dense matrix of a block type the kernels read (here a Q8_0 q projection) is kept as
    stored (a QuantMatrix of the file's bytes, the rest of the matrices packed bf16 bits as
    before); dense_dtype="float32" dequantises it by the gguf package to a float32 [in, out]
    parameter. A Q4_1 one (no kernel reads it) is dequantised either way."""
    from ftjax.models.ops import QuantMatrix

    path = rewrite(tiny_q8[1], tmp_path / "q8-attn.gguf", retype={"blk.0.attn_q.weight": "Q8_0"})
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
    assert t.tensor_type.name == "Q8_0"
    model, f32, ref = ftjax.load(path), ftjax.load(path, dense_dtype="float32"), ftjax.load(tiny_q8[1])
    wq = model._params["layers"][0]["attn"]["wq"][...]
    assert isinstance(wq, QuantMatrix) and wq.fmt == "q8_0" and np.array_equal(np.asarray(wq.data), t.data)
    assert model.checkpoint.dense_format == "q8_0" and model.checkpoint.packed == ref.checkpoint.packed
    wq = np.asarray(f32._params["layers"][0]["attn"]["wq"][...])
    assert np.array_equal(wq, gguf.quants.dequantize(t.data, t.tensor_type).T)
    assert f32.checkpoint.dense_format is None and not f32.checkpoint.packed
    assert 0 < rel_err(model.logits(PROMPT), ref.logits(PROMPT)) <= 0.05
    q41 = rewrite(tiny_q8[1], tmp_path / "q41-attn.gguf", retype={"blk.0.attn_q.weight": "Q4_1"})
    assert ftjax.load(q41).checkpoint.dense_format is None


@pytest.mark.parametrize("change,error,message", [
    (dict(arch="llama"), CheckpointError, r"architecture 'llama' is not supported"),
    (dict(drop=("blk.1.attn_k.weight",)), CheckpointError, r"missing tensors blk\.1\.attn_k\.weight"),
    (dict(drop=("blk.2.ffn_up_exps.weight",)), CheckpointError, r"block 2 has expert tensors \['down', 'gate'\]"),
    (dict(meta={"qwen3moe.expert_count": None}), ValueError, r"no metadata key qwen3moe\.expert_count"),
])
def test_malformed_files(tiny_q8, tmp_path, change, error, message):
    bad = rewrite(tiny_q8[1], tmp_path / "bad.gguf", **change)
    with pytest.raises(error, match=r"bad\.gguf: .*" + message):
        ftjax.load(bad)


def test_unsupported_tokenizer_model(tmp_path):
    """A tokenizer other than byte-level BPE is named, not guessed at."""
    src = tmp_path / "d.gguf"
    write_gguf(DEFAULT_MODEL_DIR, src, "Q4_0")
    bad = rewrite(src, tmp_path / "spm.gguf", meta={"tokenizer.ggml.model": "llama"})
    with pytest.raises(CheckpointError, match=r"spm\.gguf: tokenizer\.ggml\.model 'llama' is not supported"):
        ftjax.load(bad)
    bad = rewrite(src, tmp_path / "pre.gguf", meta={"tokenizer.ggml.pre": "deepseek-llm"})
    with pytest.raises(CheckpointError, match=r"tokenizer\.ggml\.pre 'deepseek-llm' is not supported"):
        ftjax.load(bad)


def test_no_vocabulary_file_loads_without_tokenizer(tiny_q8, tmp_path):
    """llama.cpp's converter writes tokenizer.ggml.model "none" for a folder without a
    tokenizer (the benchmarks' geometry checkpoints): the model loads, ids in, ids out."""
    none = rewrite(tiny_q8[1], tmp_path / "none.gguf", meta={"tokenizer.ggml.model": "none"})
    model = ftjax.load(none)
    assert model.tokenizer is None and len(model.generate([1, 2, 3], 4)) == 4


@pytest.mark.parametrize("keep", [0.5, 100])
def test_truncated_file(tiny_q8, tmp_path, keep):
    """A file cut short fails with an error naming it; a model already loaded is untouched."""
    folder, path = tiny_q8
    good = ftjax.load(path)
    before = good.logits(PROMPT)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(CheckpointError, match=r"cut\.gguf: .*truncated"):
        ftjax.load(cut)
    assert np.array_equal(good.logits(PROMPT), before)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        ftjax.load(tmp_path / "missing.gguf")
