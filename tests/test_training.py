"""ftjax.training on a tiny config: optimisation, load-balancing loss, training forward vs
the inference path, export -> ftjax.load / transformers, and exact resume."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
from ftjax import training
from ftjax.models.qwen3_moe import config_from_hf

HF = training.tiny_hf_config()
CFG = config_from_hf(HF)
PROMPT = [11, 250, 3021, 77, 4088, 900, 12, 5, 4000, 61, 1024, 4089]


def _trained(steps: int = 8, seed: int = 0):
    """Tiny params after a few steps on random tokens (so routing is not trivial)."""
    graphdef, params = training.init_params(CFG, seed)
    s = training.TrainSettings(steps=steps, batch_size=2, seq_len=16, warmup_steps=1, peak_lr=1e-2)
    step, _, opt = training.make_steps(graphdef, s)
    opt_state = opt.init(params)
    batch = jnp.asarray(np.random.default_rng(1).integers(0, HF["vocab_size"], (2, 17)), jnp.int32)
    losses = []
    for _ in range(steps):
        params, opt_state, m = step(params, opt_state, batch)
        losses.append(float(m["loss"]))
    return graphdef, params, losses


@pytest.fixture(scope="module")
def trained():
    return _trained()


def test_steps_reduce_loss_on_a_fixed_batch(trained):
    _, _, losses = trained
    assert losses[-1] < losses[0] - 0.5, losses


def test_aux_loss_uniform_vs_collapsed():
    N, E, K, D = 64, 8, 2, 16
    x = jax.random.normal(jax.random.PRNGKey(0), (N, D))
    valid = jnp.ones((N,))
    balanced = (jnp.arange(N * K) % E).reshape(N, K)
    uniform = training.load_balance_loss(x, jnp.zeros((D, E)), balanced, valid)
    assert float(uniform) == pytest.approx(1.0, abs=1e-5)
    # Every token prefers experts 0 and 1 strongly.
    w = jnp.zeros((D, E)).at[:, :2].set(1.0)
    x_pos = jnp.abs(x) + 1.0
    collapsed = training.load_balance_loss(x_pos, w, jnp.tile(jnp.array([[0, 1]]), (N, 1)), valid)
    assert float(collapsed) > 3.0 * float(uniform)
    assert float(collapsed) <= E / K + 1e-4  # the maximum for top-2


def test_expert_impls_agree_without_drops():
    N, E, K, D, F = 40, 4, 2, 8, 6
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    gu, dn = jax.random.normal(ks[0], (E, 2 * F, D)), jax.random.normal(ks[1], (E, D, F))
    x = jax.random.normal(ks[2], (N, D))
    w, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(ks[3], (N, E))), K)
    valid = jnp.ones((N,))
    run = jax.jit(lambda impl, cf: training.EXPERT_IMPLS[impl](gu, dn, x, ids, w, valid, capacity_factor=cf),
                  static_argnums=(0, 1))
    dense = run("dense", None)
    exact = run("capacity", E / K)
    np.testing.assert_allclose(np.asarray(exact), np.asarray(dense), rtol=1e-5, atol=1e-5)
    dropped = run("capacity", 0.5)
    assert not np.allclose(np.asarray(dropped), np.asarray(dense))


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    _, params, _ = trained
    f32 = training.export(HF, params, tmp_path_factory.mktemp("f32"), dtype="float32")
    bf16 = training.export(HF, params, tmp_path_factory.mktemp("bf16"), dtype="bfloat16")
    return f32, bf16


def test_training_forward_matches_ftjax_load(trained, exported):
    graphdef, params, _ = trained
    exact = training.TrainExperts("dense")
    forward = jax.jit(training.forward, static_argnums=(0, 3))
    logits, _ = forward(graphdef, params, jnp.asarray([PROMPT], jnp.int32), exact)
    served = ftjax.load(exported[0]).logits(PROMPT)
    np.testing.assert_allclose(served, np.asarray(logits[0]), rtol=1e-4, atol=1e-4)


def test_export_layout_and_transformers_agree(exported):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    path = exported[1]
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
    F, D, E = CFG.d_ff_expert, CFG.d_model, CFG.num_experts
    assert "lm_head.weight" not in names
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names and "model.layers.1.mlp.gate.weight" in names
    assert len([n for n in names if ".experts." in n]) == CFG.num_layers * E * 3
    hf_cfg = json.loads((path / "config.json").read_text())
    assert hf_cfg["model_type"] == "qwen3_moe" and hf_cfg["bos_token_id"] is None
    assert set(hf_cfg["eos_token_id"]) == {4087, 4089}

    ours = ftjax.load(path).logits(PROMPT)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    sd = model.state_dict()
    assert tuple(sd["model.layers.0.mlp.gate.weight"].shape) == (E, D)
    with torch.no_grad():
        theirs = model(torch.tensor([PROMPT])).logits[0].numpy()
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() <= 1e-3 * scale + 1e-5, np.abs(ours - theirs).max() / scale
    assert F > 0


def _small_corpus():
    from ftjax.data import corpus
    from ftjax.tokenizer import Tokenizer

    texts = {}
    for n in corpus.names():
        train, valid = corpus.split(n)
        texts[n] = (train[:60_000], valid[:6_000])
    return training.Corpus(Tokenizer.from_dir(training.DEFAULT_MODEL_DIR), texts=texts)


def test_batches_have_chats_and_are_deterministic():
    c = _small_corpus()
    a = c.batch(0, 5, 8, 64, chat_share=0.5)
    b = c.batch(0, 5, 8, 64, chat_share=0.5)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (8, 65) and a.dtype == np.int32
    tok = c.tok
    ids = set(np.concatenate([c.batch(0, s, 8, 64, chat_share=0.5).ravel() for s in range(4)]).tolist())
    assert {tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>")} <= ids
    assert tok.token_to_id("<|endoftext|>") in c.chat_row(np.random.default_rng(0), 2000)  # chats are packed
    rng = np.random.default_rng(0)
    rendered = "".join(tok.apply_chat_template(c.chat(rng), add_generation_prompt=False) for _ in range(40))
    for t in ("<tool_call>", "</tool_call>", "<tool_output>", "<think>"):
        assert t in rendered


def test_resume_reproduces_the_next_step(tmp_path):
    c = _small_corpus()
    s = training.TrainSettings(steps=6, batch_size=2, seq_len=32, warmup_steps=2, log_every=1, eval_every=100,
                               eval_windows=1, chat_share=0.3)
    quiet = lambda *_: None  # noqa: E731
    training.train(tmp_path / "a", HF, s, c, stop_at=4, log=quiet)
    training.train(tmp_path / "b", HF, s, c, stop_at=2, log=quiet)
    training.train(tmp_path / "b", HF, s, c, stop_at=4, resume=True, log=quiet)

    def loss_at(run, step):
        recs = [json.loads(ln) for ln in (tmp_path / run / "log.jsonl").read_text().splitlines()]
        return [r["loss"] for r in recs if r["step"] == step and "loss" in r]

    assert loss_at("a", 3) == loss_at("b", 3) and loss_at("a", 4) == loss_at("b", 4)
    assert len(loss_at("b", 3)) == 1
    # The schedule length may be re-planned on resume; anything else must match.
    _, meta = training.train(tmp_path / "b", HF, dataclasses.replace(s, steps=8), c, stop_at=5, resume=True, log=quiet)
    assert meta["step"] == 5 and meta["replans"] == [{"step": 4, "from": 6, "to": 8}]
    with pytest.raises(ValueError, match="different config or settings"):
        training.train(tmp_path / "b", HF, dataclasses.replace(s, peak_lr=1.0), c, resume=True, log=quiet)
