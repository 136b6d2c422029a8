"""Fuzzing the checkpoint reader: damaged safetensors files (truncated, wrong header
length, bad JSON, wrong dtypes / shapes / offsets), index files and config.json values.
Every case must end in a loaded model or a clear error (a ValueError or FileNotFoundError
subclass such as CheckpointError / ConfigError), never a crash, a hang or another
exception type. Hypothesis shrinks a failure to the smallest damaged file."""

import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ftjax
import hf_models

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
CLEAR = (ValueError, FileNotFoundError)


class Base(tuple):
    """(folder, header dict, tensor data bytes) with a short repr for failure reports."""

    def __repr__(self):
        return f"Base({self[0]})"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny qwen3_moe checkpoint: (folder, header dict, tensor data bytes)."""
    path = hf_models.save(hf_models.build("qwen3_moe", seed=11), tmp_path_factory.mktemp("fuzz_base"))
    raw = (path / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return Base((path, json.loads(raw[8:8 + n]), raw[8 + n:]))


def attempt(folder: Path) -> None:
    try:
        ftjax.load(folder)
    except CLEAR as e:
        assert str(e), f"{type(e).__name__} without a message"


def with_copy(base_dir: Path, edit) -> None:
    with tempfile.TemporaryDirectory(prefix="ftjax-fuzz-") as tmp:
        folder = Path(tmp) / "ckpt"
        shutil.copytree(base_dir, folder)
        edit(folder)
        attempt(folder)


def safetensors_bytes(header, data: bytes, header_len: int | None = None) -> bytes:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(blob) if header_len is None else header_len) + blob + data


# ---------------------------------------------------------------------------- safetensors

JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                     max_size=3), max_leaves=8)
DTYPES = st.sampled_from(["F32", "BF16", "F16", "F64", "I32", "U8", "BOOL", "F8_E4M3", "Q4", "", "f32"])
SHAPES = st.lists(st.integers(-3, 2**40) | st.sampled_from([0, 1, 2, 16, 32]), max_size=4) | JSONISH
OFFSETS = st.lists(st.integers(-10, 2**64 - 1), min_size=0, max_size=3) | JSONISH


@st.composite
def header_edits(draw):
    """(kind, args) describing one or more edits of the header dict."""
    return draw(st.lists(st.tuples(st.sampled_from(["dtype", "shape", "offsets", "drop", "field", "rename",
                                                    "metadata", "add"]),
                                   st.integers(0, 10**6), DTYPES, SHAPES, OFFSETS, JSONISH),
                         min_size=1, max_size=3))


@SETTINGS
@given(edits=header_edits())
def test_fuzz_safetensors_header_fields(base, edits):
    base_dir, header, data = base
    names = sorted(k for k in header if k != "__metadata__")

    def edit(folder):
        h = json.loads(json.dumps(header))
        for kind, i, dtype, shape, offsets, junk in edits:
            name = names[i % len(names)]
            if name not in h or (kind in ("dtype", "shape", "offsets") and not isinstance(h[name], dict)):
                continue  # gone, or already replaced by junk (a "field" edit): nothing to edit in it
            if kind == "dtype":
                h[name]["dtype"] = dtype
            elif kind == "shape":
                h[name]["shape"] = shape
            elif kind == "offsets":
                h[name]["data_offsets"] = offsets
            elif kind == "drop":
                h.pop(name)
            elif kind == "field":
                h[name] = junk
            elif kind == "rename":
                h[f"model.layers.{i % 7}.mlp.experts.{i % 9}.gate_proj.weight"] = h.pop(name)
            elif kind == "metadata":
                h["__metadata__"] = junk
            else:
                h[f"model.layers.{i % 5}.extra.weight"] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        (folder / "model.safetensors").write_bytes(safetensors_bytes(h, data))

    with_copy(base_dir, edit)


@SETTINGS
@given(cut=st.integers(0, 10**6), header_len=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
       garbage=st.binary(max_size=64), where=st.integers(0, 10**6))
def test_fuzz_safetensors_bytes(base, cut, header_len, garbage, where):
    """Truncation, a wrong header length, and raw bytes overwriting part of the file."""
    base_dir, header, data = base

    def edit(folder):
        raw = bytearray(safetensors_bytes(header, data, header_len))
        if garbage:
            at = where % len(raw)
            raw[at:at + len(garbage)] = garbage
        raw = raw[:cut % (len(raw) + 1)] if cut % 3 == 0 else raw  # truncate a third of the cases
        (folder / "model.safetensors").write_bytes(bytes(raw))

    with_copy(base_dir, edit)


@SETTINGS
@given(blob=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_fuzz_safetensors_header_json_text(base, blob):
    """A header that is not (valid) JSON, or JSON of the wrong shape."""
    base_dir, _, data = base
    with_copy(base_dir, lambda folder: (folder / "model.safetensors").write_bytes(safetensors_bytes(blob, data)))


# ---------------------------------------------------------------------------- index files


@SETTINGS
@given(index=JSONISH | st.fixed_dictionaries({"weight_map": st.dictionaries(
    st.text(max_size=40), st.sampled_from(["model.safetensors", "missing.safetensors", "../model.safetensors",
                                          "", ".", "config.json"]) | JSONISH, max_size=4)}),
    keep_real=st.booleans(), text=st.none() | st.text(max_size=40))
def test_fuzz_index_file(base, index, keep_real, text):
    base_dir, header, _ = base

    def edit(folder):
        doc = index
        if keep_real and isinstance(doc, dict) and isinstance(doc.get("weight_map"), dict):
            doc = {"weight_map": {**{n: "model.safetensors" for n in header if n != "__metadata__"},
                                  **doc["weight_map"]}}
        body = text if text is not None else json.dumps(doc)
        (folder / "model.safetensors.index.json").write_text(body)

    with_copy(base_dir, edit)


# ---------------------------------------------------------------------------- config.json

CONFIG_KEYS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
               "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
               "mlp_only_layers", "decoder_sparse_step", "norm_topk_prob", "tie_word_embeddings", "eos_token_id",
               "bos_token_id", "hidden_act", "sliding_window", "use_sliding_window", "layer_types", "model_type",
               "attention_bias", "num_local_experts", "clip_qkv"]
VALUES = (st.integers(-5, 70) | st.sampled_from([0, -1, 2**31, 2**63, 10**30, 1e308, float("nan"), float("inf"),
                                                   -0.0, 0.5, True, False, None, "", "silu", "gelu", "mixtral",
                                                   "olmoe", "qwen2_moe", [], [1, 2], [0, "x"], {}, {"rope_type": "yarn"},
                                                   {"rope_theta": -1}, {"rope_theta": "x"}])
          | JSONISH)


@SETTINGS
@given(edits=st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), st.one_of(st.just("<delete>"), VALUES)),
                      min_size=1, max_size=3),
       whole=st.none() | JSONISH.filter(lambda v: not isinstance(v, dict)))
def test_fuzz_config_values(base, edits, whole):
    base_dir, _, _ = base

    def edit(folder):
        if whole is not None:  # config.json that is valid JSON but not an object
            (folder / "config.json").write_text(json.dumps(whole))
            return
        cfg = json.loads((folder / "config.json").read_text())
        for key, value in edits:
            if value == "<delete>":
                cfg.pop(key, None)
            else:
                cfg[key] = value
        (folder / "config.json").write_text(json.dumps(cfg))

    with_copy(base_dir, edit)


def test_unmodified_base_loads(base):
    model = ftjax.load(base[0])
    assert model.config.num_experts == 6
