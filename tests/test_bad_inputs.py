"""Bad checkpoints and bad requests give clear errors naming the problem, and never
touch the files on disk."""

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import ftjax
import hf_models
from ftjax.checkpoint import CheckpointError
from ftjax.config import ConfigError


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    return hf_models.save(hf_models.build("qwen3_moe", seed=5), tmp_path_factory.mktemp("good"))


@pytest.fixture
def ckpt(good_dir, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(good_dir, out)
    return out


def digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def rewrite_tensors(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def expect_error(path, exc, *fragments):
    before = digest(path)
    with pytest.raises(exc) as info:
        ftjax.load(path)
    for f in fragments:
        assert f in str(info.value), str(info.value)
    assert digest(path) == before  # nothing on disk was changed


def test_missing_tensor(ckpt):
    rewrite_tensors(ckpt, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    expect_error(ckpt, CheckpointError, "missing tensors", "model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(CheckpointError) as info:
        ftjax.load(ckpt)
    assert "attn.wk" not in str(info.value)  # the checkpoint's name, not our parameter path


def test_missing_tensors_name_the_checkpoint_tensors(ckpt):
    def drop(t):
        for name in ("model.norm.weight", "model.layers.1.mlp.gate_proj.weight", "model.layers.2.mlp.gate.weight",
                     "model.layers.0.self_attn.q_norm.weight"):
            t.pop(name)

    rewrite_tensors(ckpt, drop)
    expect_error(ckpt, CheckpointError, "model.norm.weight", "model.layers.1.mlp.gate_proj.weight",
                 "model.layers.2.mlp.gate.weight", "model.layers.0.self_attn.q_norm.weight")


def test_missing_expert(ckpt):
    rewrite_tensors(ckpt, lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"))
    expect_error(ckpt, CheckpointError, "model.layers.2.mlp.experts.3.up_proj.weight")


def test_unexpected_tensor(ckpt):
    rewrite_tensors(ckpt, lambda t: t.__setitem__("model.layers.0.mlp.mystery.weight", torch.zeros(2)))
    expect_error(ckpt, CheckpointError, "unexpected tensor model.layers.0.mlp.mystery.weight", "model.safetensors")


def test_wrong_shape(ckpt):
    rewrite_tensors(ckpt, lambda t: t.__setitem__("model.layers.1.self_attn.q_proj.weight", torch.zeros(8, 32)))
    expect_error(ckpt, CheckpointError, "model.layers.1.self_attn.q_proj.weight", "shape [8, 32]", "expected [32, 32]")


def test_wrong_expert_shape(ckpt):
    rewrite_tensors(ckpt, lambda t: t.__setitem__("model.layers.0.mlp.experts.0.down_proj.weight", torch.zeros(32, 15)))
    expect_error(ckpt, CheckpointError, "experts.0.down_proj.weight", "expected [32, 16]")


def test_truncated_file(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    expect_error(ckpt, CheckpointError, "model.safetensors", "truncated")


def test_garbage_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64)
    expect_error(ckpt, CheckpointError, "model.safetensors")


def test_unknown_model_type(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama5_moe"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    expect_error(ckpt, ConfigError, "unknown model_type 'llama5_moe'")


def test_corrupt_config(ckpt):
    (ckpt / "config.json").write_text("{not json")
    expect_error(ckpt, ConfigError, "config.json", "not valid JSON")


def test_missing_config_and_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        ftjax.load(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ftjax.load(tmp_path)


def test_missing_shard(tmp_path):
    path = hf_models.save(hf_models.build("mixtral", seed=6), tmp_path, max_shard_size="20KB")
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    expect_error(path, CheckpointError, victim.name, "missing")


def test_bad_requests(good_dir):
    model = ftjax.load(good_dir, max_seq_len=32)
    with pytest.raises(ValueError, match="does not fit the context of 32 tokens"):
        model.generate(list(range(40)), 4)
    with pytest.raises(ValueError, match="out of range"):
        model.logits([1, 2, 500])
    with pytest.raises(ValueError, match="empty"):
        model.generate([], 3)
    with pytest.raises(ValueError, match="1-D"):
        model.logits(np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="sampling"):
        model.generate([1, 2], 3, top_p=0.0)
    with pytest.raises(ValueError, match="tokenizer"):
        model.chat([{"role": "user", "content": "hi"}])
    # the model still works after every rejected request; generation stops at the context end
    out = model.generate(list(range(30)), 10)
    assert len(out) == 2 and model.last_generation.stop_reason == "context"
