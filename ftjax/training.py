"""Training the embedded default model: a small Qwen3-MoE fitted to the public-domain corpus.

Purpose: ship a model that makes `ftjax.load()` work offline and gives the cache
experiments a *trained* router (real temporal locality), built from the same Flax
modules and `ModelConfig` the runtime runs, so what is trained is what is served.

Design
- The architecture is a Hugging Face `qwen3_moe` config dict (`hf_config`); the
  `ModelConfig` comes from `ftjax.models.qwen3_moe.config_from_hf` of that exact dict,
  and export writes the same dict as `config.json`.
- Parameters are one pytree `{"model": nnx.State of CausalLM, "experts": {"gate_up":
  [Lm, E, 2F, D], "down": [Lm, E, D, F]}}` (the HF fused layout of the host pool). The
  forward is `CausalLM.__call__` with a training expert call (`ExpertCall`) that reads
  the experts from the threaded `expert_state`, which also carries each MoE layer's
  router weights (the same traced arrays as the model's, so gradients add up) and
  collects the load-balancing loss.
- Expert computation is a named strategy (`EXPERT_IMPLS`). "capacity" is the default:
  each expert takes its C = ceil(cf·N·K/E) highest-weight assignments (gather ->
  batched matmul [E, C, ·] -> scatter-add); assignments over capacity are dropped (a
  training-only approximation; with cf = E/K nothing is dropped and it is exact).
  Measured fwd+bwd on this 2-core CPU for N=4096, E=16, K=2, D=256, F=128: capacity
  (cf 1.25) 170 ms, dense "all experts on all tokens" 590 ms, sort + `ragged_dot`
  2210 ms (XLA:CPU lowers ragged_dot to a slow loop), hence capacity.
- Load balancing (Switch / Qwen): aux = E·Σ_e f_e·P_e per MoE layer (f_e share of
  assignments, P_e mean router probability), averaged over layers; 1.0 when uniform.
- Data (`Corpus`): the training splits of the three texts, tokenized, joined with
  `<|endoftext|>`; each batch row is a random window, or with probability `chat_share`
  a packed run of synthetic chat-template conversations built from corpus passages
  (plain turns, `<think>` reasoning, `<tool_call>` / `<tool_output>` rounds).
  A batch is a pure function of (seed, step), so the data RNG needs no saved state
  and `--resume` continues exactly.
- Optimisation: AdamW (weight decay on matrices only), linear warmup + cosine decay,
  global-norm clipping, fp32. Checkpoints are one `.npz` (every leaf of params and
  optimizer state + step + settings), written atomically every few minutes.
- Export (`export`): bf16 (or f32) `model.safetensors` with the per-expert tensor
  names transformers' `save_pretrained` writes, plus config.json and
  generation_config.json.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ftjax.config import ModelConfig
from ftjax.models.common import CausalLM, init_state
from ftjax.models.qwen3_moe import config_from_hf

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TEXT_TITLES = {"austen": "Jane Austen", "shakespeare": "Shakespeare", "kjv": "the King James Bible"}


# ---- architecture -------------------------------------------------------------------

def hf_config(*, vocab_size: int = 4096, hidden_size: int = 256, num_layers: int = 6, num_heads: int = 4,
              num_kv_heads: int = 2, head_dim: int = 64, num_experts: int = 16, top_k: int = 2,
              moe_intermediate_size: int = 128, eos_token_id: tuple[int, ...] = (4089, 4087),
              pad_token_id: int | None = 4087, max_position_embeddings: int = 2048,
              rope_theta: float = 10000.0, aux_loss_coef: float = 0.01) -> dict[str, Any]:
    """The qwen3_moe config.json of the default model (every layer MoE, tied embeddings)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 4 * hidden_size,  # dense-MLP width; unused (no mlp_only_layers)
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": True,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": moe_intermediate_size,
        "num_experts": num_experts,
        "num_local_experts": num_experts,  # transformers 5 spelling; 4.x reads num_experts
        "num_experts_per_tok": top_k,
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": aux_loss_coef,
        "bos_token_id": None,
        "eos_token_id": list(eos_token_id),
        "pad_token_id": pad_token_id,
        "dtype": "bfloat16",
    }


def tiny_hf_config(**overrides) -> dict[str, Any]:
    """A seconds-to-train config for tests (same vocabulary and special ids)."""
    kw = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=4, top_k=2,
              moe_intermediate_size=32, max_position_embeddings=256)
    return hf_config(**{**kw, **overrides})


# ---- parameters -----------------------------------------------------------------------

def init_params(cfg: ModelConfig, seed: int = 0) -> tuple[nnx.GraphDef, dict[str, Any]]:
    """(graphdef, params): normal(0.02) matrices, residual outputs (o_proj, expert down)
    scaled by 1/sqrt(2L) (GPT-2), norms = 1."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg)))
    key = jax.random.PRNGKey(seed)
    out_scale = 1.0 / math.sqrt(2 * cfg.num_layers)
    leaves = []
    for i, (path, v) in enumerate(nnx.to_flat_state(state)):
        name = ".".join(map(str, path))
        if "norm" in name:
            value = jnp.ones(v.shape, jnp.float32)
        else:
            std = 0.02 * (out_scale if name.endswith("attn.wo") else 1.0)
            value = std * jax.random.normal(jax.random.fold_in(key, i), v.shape, jnp.float32)
        leaves.append((path, v.replace(value)))
    model = nnx.from_flat_state(leaves)
    Lm, E, D, F = cfg.num_moe_layers, cfg.num_experts, cfg.d_model, cfg.d_ff_expert
    k1, k2 = jax.random.split(jax.random.fold_in(key, 10_000))
    experts = {"gate_up": 0.02 * jax.random.normal(k1, (Lm, E, 2 * F, D), jnp.float32),
               "down": 0.02 * out_scale * jax.random.normal(k2, (Lm, E, D, F), jnp.float32)}
    return graphdef, {"model": model, "experts": experts}


def flat_model_params(params: dict[str, Any]) -> dict[str, np.ndarray]:
    """Dotted CausalLM path (as in `ftjax.checkpoint`) -> array."""
    return {".".join(map(str, p)): np.asarray(v.get_value() if hasattr(v, "get_value") else v.value)
            for p, v in nnx.to_flat_state(params["model"])}


def num_params(params: dict[str, Any]) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


# ---- routed experts for training ---------------------------------------------------------
# Shapes: x [N, D], ids / weights [N, K], gate_up [E, 2F, D], down [E, D, F].

def _swiglu_batched(gate_up: jax.Array, down: jax.Array, xs: jax.Array) -> jax.Array:
    """xs [E, C, D] through each expert's SwiGLU -> [E, C, D]."""
    F = down.shape[-1]
    h = jnp.einsum("ecd,efd->ecf", xs, gate_up)  # [E, C, 2F]
    return jnp.einsum("ecf,edf->ecd", jax.nn.silu(h[..., :F]) * h[..., F:], down)


def _combine_weights(ids: jax.Array, weights: jax.Array, valid: jax.Array, num_experts: int) -> jax.Array:
    """[N, E] routing weight of each (token, expert); 0 where not selected or not valid."""
    N = ids.shape[0]
    w = jnp.zeros((N, num_experts), jnp.float32).at[jnp.arange(N)[:, None], ids].add(weights.astype(jnp.float32))
    return w * valid[:, None]


def dense_experts(gate_up, down, x, ids, weights, valid, capacity_factor=None):
    """Every expert on every token, masked by the routing weights (the reference)."""
    comb = _combine_weights(ids, weights, valid, gate_up.shape[0])  # [N, E]
    y = _swiglu_batched(gate_up, down, jnp.broadcast_to(x, (gate_up.shape[0], *x.shape)))  # [E, N, D]
    return jnp.einsum("end,ne->nd", y, comb)


def capacity_experts(gate_up, down, x, ids, weights, valid, capacity_factor: float = 1.25):
    """Each expert takes its C highest-weight assignments; the rest are dropped."""
    N, K = ids.shape
    E, D = gate_up.shape[0], x.shape[1]
    C = N if capacity_factor * K >= E else min(N, math.ceil(capacity_factor * N * K / E))
    comb = _combine_weights(ids, weights, valid, E).T  # [E, N]
    cw, tok = jax.lax.top_k(comb, C)  # [E, C]: weight 0 = empty slot
    y = _swiglu_batched(gate_up, down, x[tok]) * cw[..., None]  # [E, C, D]
    return jnp.zeros((N, D), y.dtype).at[tok.reshape(-1)].add(y.reshape(E * C, D))


EXPERT_IMPLS: dict[str, Callable] = {"capacity": capacity_experts, "dense": dense_experts}


def load_balance_loss(x: jax.Array, w_router: jax.Array, ids: jax.Array, valid: jax.Array) -> jax.Array:
    """E·Σ_e f_e·P_e: f_e share of the top-k assignments, P_e mean router probability."""
    E = w_router.shape[1]
    probs = jax.nn.softmax((x @ w_router).astype(jnp.float32), axis=-1)  # [N, E]
    n = jnp.maximum(jnp.sum(valid), 1.0)
    counts = jnp.sum(jax.nn.one_hot(ids, E) * valid[:, None, None], axis=(0, 1))  # [E]
    f = jax.lax.stop_gradient(counts / (n * ids.shape[1]))
    p = jnp.sum(probs * valid[:, None], axis=0) / n
    return E * jnp.sum(f * p)


@dataclasses.dataclass(frozen=True)
class TrainExperts:
    """An `ExpertCall` for training. State: {"gate_up", "down", "routers": [Lm x [D, E]],
    "aux": [Lm]} -> the routed output and, per layer, the load-balancing loss."""

    impl: str = "capacity"
    capacity_factor: float = 1.25

    def __call__(self, layer: int, x, ids, weights, valid, state):
        valid = valid.astype(jnp.float32)
        y = EXPERT_IMPLS[self.impl](state["gate_up"][layer], state["down"][layer], x, ids, weights, valid,
                                    capacity_factor=self.capacity_factor)
        aux = load_balance_loss(x, state["routers"][layer], ids, valid)
        return y.astype(x.dtype), {**state, "aux": state["aux"].at[layer].set(aux)}


def forward(graphdef, params, tokens: jax.Array, experts: TrainExperts) -> tuple[jax.Array, jax.Array]:
    """tokens [B, T] -> logits [B, T, V] f32, aux [Lm] (one full-length causal pass)."""
    model = nnx.merge(graphdef, params["model"])
    cfg: ModelConfig = model.cfg
    B, T = tokens.shape
    state = {**params["experts"], "aux": jnp.zeros((cfg.num_moe_layers,), jnp.float32),
             "routers": [model.layers[i].moe.w_router[...] for i in cfg.moe_layer_ids]}
    valid = jnp.ones((B, T), bool)
    logits, _, state = model(tokens, jnp.int32(0), valid, init_state(cfg, B, T), experts, state)
    return logits, state["aux"]


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# ---- optimisation -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TrainSettings:
    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 256
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.01
    chat_share: float = 0.05
    seed: int = 0
    expert_impl: str = "capacity"
    capacity_factor: float = 1.25
    log_every: int = 10
    eval_every: int = 100
    eval_windows: int = 8  # validation windows per text
    checkpoint_every_s: float = 300.0


def make_optimizer(s: TrainSettings) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, s.peak_lr, s.warmup_steps, max(s.steps, s.warmup_steps + 1),
                                                  end_value=s.peak_lr * s.min_lr_ratio)
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731  (no decay on norms)
    return optax.chain(optax.clip_by_global_norm(s.grad_clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=s.weight_decay, mask=decay_mask))


@functools.lru_cache(maxsize=4)
def make_steps(graphdef, s: TrainSettings):
    """(train_step, eval_loss, optimizer), jitted, compiled once per (graphdef, settings).
    train_step(params, opt_state, batch [B, T+1]) -> params, opt_state, metrics; params
    and opt_state are donated."""
    opt = make_optimizer(s)
    experts = TrainExperts(s.expert_impl, s.capacity_factor)

    def loss_fn(params, batch):
        logits, aux = forward(graphdef, params, batch[:, :-1], experts)
        ce = cross_entropy(logits, batch[:, 1:])
        aux = jnp.mean(aux)
        return ce + s.aux_loss_coef * aux, (ce, aux)

    def train_step(params, opt_state, batch):
        (loss, (ce, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "ce": ce, "aux": aux, "grad_norm": optax.tree.norm(grads)}

    # Evaluation never drops assignments: the exact (inference) expert computation.
    exact = TrainExperts("capacity", capacity_factor=float("inf"))

    def eval_loss(params, batch):
        logits, _ = forward(graphdef, params, batch[:, :-1], exact)
        return cross_entropy(logits, batch[:, 1:])

    return jax.jit(train_step, donate_argnums=(0, 1)), jax.jit(eval_loss), opt


# ---- data --------------------------------------------------------------------------------------

_CHUNK_END = re.compile(r"\n(?=\S)")


def encode_long(tokenizer, text: str, chunk_chars: int = 1 << 16) -> list[int]:
    """Encode a long text in chunks (batch encoding uses every core). Chunks end after a
    newline that is followed by a non-space character, where the pre-tokenizer always
    splits, so the ids equal those of one `encode(text)`."""
    chunks, i = [], 0
    while i < len(text):
        m = _CHUNK_END.search(text, i + chunk_chars)
        j = m.end() if m else len(text)
        chunks.append(text[i:j])
        i = j
    return [t for enc in tokenizer.backend.encode_batch(chunks, add_special_tokens=False) for t in enc.ids]


class Corpus:
    """Tokenized training/validation splits and the batch sampler (a function of seed, step)."""

    def __init__(self, tokenizer, names: tuple[str, ...] | None = None, texts: dict[str, tuple[str, str]] | None = None):
        from ftjax.data import corpus

        self.tok = tokenizer
        self.eot = tokenizer.token_to_id(EOT)
        self.names = names or corpus.names()
        self.texts = texts or {n: corpus.split(n) for n in self.names}  # name -> (train, valid)
        parts = []
        for n in self.names:
            parts += [np.asarray(self.encode_long(self.texts[n][0]), np.int32), np.array([self.eot], np.int32)]
        self.train = np.concatenate(parts)  # [num_train_tokens]
        self.valid = {n: np.asarray(self.encode_long(self.texts[n][1]), np.int32) for n in self.names}

    def encode_long(self, text: str) -> list[int]:
        return encode_long(self.tok, text)

    # -- synthetic chats
    def passage(self, rng: np.random.Generator, name: str | None = None, min_chars: int = 150,
                max_chars: int = 500) -> tuple[str, str, str]:
        """(name, passage, the passage that follows) from a text's training split, line-aligned."""
        name = name or self.names[rng.integers(len(self.names))]
        text = self.texts[name][0]
        n = int(rng.integers(min_chars, max_chars))
        start = text.find("\n", int(rng.integers(0, max(len(text) - 3 * max_chars, 1)))) + 1
        mid = text.rfind("\n", start, start + n) + 1 or start + n
        end = text.rfind("\n", mid, mid + n) + 1 or mid + n
        return name, text[start:mid].strip(), text[mid:end].strip()

    def chat(self, rng: np.random.Generator) -> list[dict]:
        name, first, nxt = self.passage(rng)
        title = TEXT_TITLES.get(name, name)
        kind = rng.integers(4)
        msgs = [{"role": "system", "content": f"You write in the style of {title}."}] if rng.random() < 0.3 else []
        if kind == 0:
            msgs += [{"role": "user", "content": f"Continue this passage:\n{first}"},
                     {"role": "assistant", "content": nxt}]
        elif kind == 1:
            msgs += [{"role": "user", "content": f"Write a passage in the style of {title}."},
                     {"role": "assistant", "content": first,
                      "reasoning_content": f"The user wants text like {title}. I will write a passage."}]
        elif kind == 2:
            words = " ".join(first.split()[:4])
            msgs += [{"role": "user", "content": f"Find the passage of {title} that begins \"{words}\"."},
                     {"role": "assistant", "content": "",
                      "tool_calls": [{"function": {"name": "search_corpus",
                                                   "arguments": {"book": name, "query": words}}}]},
                     {"role": "tool", "content": first},
                     {"role": "assistant", "content": f"Here it is:\n{first}"}]
        else:
            msgs += [{"role": "user", "content": first}, {"role": "assistant", "content": nxt},
                     {"role": "user", "content": "Go on."}, {"role": "assistant", "content": self.passage(rng, name)[1]}]
        return msgs

    def chat_row(self, rng: np.random.Generator, length: int) -> np.ndarray:
        """Conversations joined by <|endoftext|>, cut to `length` ids."""
        ids: list[int] = []
        while len(ids) < length:
            ids += self.tok.encode(self.tok.apply_chat_template(self.chat(rng), add_generation_prompt=False))
            ids.append(self.eot)
        return np.asarray(ids[:length], np.int32)

    def batch(self, seed: int, step: int, batch_size: int, seq_len: int, chat_share: float) -> np.ndarray:
        """[B, T+1] int32 of the given step (deterministic in seed and step)."""
        rng = np.random.default_rng([seed, step])
        out = np.empty((batch_size, seq_len + 1), np.int32)
        starts = rng.integers(0, len(self.train) - seq_len - 1, batch_size)
        for b in range(batch_size):
            if rng.random() < chat_share:
                out[b] = self.chat_row(rng, seq_len + 1)
            else:
                out[b] = self.train[starts[b]: starts[b] + seq_len + 1]
        return out

    def valid_batches(self, windows: int, seq_len: int) -> dict[str, np.ndarray]:
        """Per text, `windows` evenly spaced [T+1] windows of its validation split."""
        out = {}
        for n, ids in self.valid.items():
            L = seq_len + 1
            starts = np.linspace(0, max(len(ids) - L, 0), windows).astype(int)
            out[n] = np.stack([ids[s: s + L] for s in starts]).astype(np.int32)
        return out


# ---- checkpoints ---------------------------------------------------------------------------------

CHECKPOINT = "checkpoint.npz"


def save_checkpoint(run_dir: Path, params, opt_state, step: int, meta: dict) -> Path:
    """Every leaf of (params, opt_state) + step + meta, written atomically."""
    run_dir.mkdir(parents=True, exist_ok=True)
    leaves = jax.tree.leaves((params, opt_state))
    arrays = {f"leaf_{i:05d}": np.asarray(x) for i, x in enumerate(leaves)}
    tmp = run_dir / (CHECKPOINT + ".tmp.npz")
    np.savez(tmp, step=np.int64(step), meta=np.asarray(json.dumps(meta)), **arrays)
    os.replace(tmp, run_dir / CHECKPOINT)
    return run_dir / CHECKPOINT


def load_checkpoint(run_dir: Path, like) -> tuple[Any, int, dict]:
    """(tree shaped like `like` = (params, opt_state), step, meta)."""
    with np.load(run_dir / CHECKPOINT) as z:
        leaves, treedef = jax.tree.flatten(like)
        loaded = [jnp.asarray(z[f"leaf_{i:05d}"]) for i in range(len(leaves))]
        for i, (a, b) in enumerate(zip(leaves, loaded)):
            if a.shape != b.shape:
                raise ValueError(f"{run_dir / CHECKPOINT}: leaf {i} has shape {b.shape}, expected {a.shape}")
        return jax.tree.unflatten(treedef, loaded), int(z["step"]), json.loads(str(z["meta"]))


# ---- the training loop ---------------------------------------------------------------------------

def train(run_dir: str | Path, hf: dict, s: TrainSettings, corpus: Corpus, *, resume: bool = False,
          max_minutes: float | None = None, stop_at: int | None = None, log=print) -> tuple[Any, dict]:
    """Train (or resume) to s.steps, checkpointing to run_dir; returns (params, meta).

    stop_at: stop (and checkpoint) after this step even if the schedule is longer (tests).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = config_from_hf(hf)
    graphdef, params = init_params(cfg, s.seed)
    train_step, eval_loss, opt = make_steps(graphdef, s)
    opt_state = opt.init(params)
    step, meta = 0, {"hf_config": hf, "settings": dataclasses.asdict(s), "elapsed_s": 0.0, "tokens": 0}
    log_path = run_dir / "log.jsonl"
    if resume and (run_dir / CHECKPOINT).is_file():
        (params, opt_state), step, saved = load_checkpoint(run_dir, (params, opt_state))
        same = lambda a, b: {**a, "steps": 0} == {**b, "steps": 0}  # noqa: E731
        if saved["hf_config"] != hf or not same(saved["settings"], meta["settings"]):
            raise ValueError(f"{run_dir}: checkpoint was made with a different config or settings")
        if saved["settings"]["steps"] != s.steps:
            # Re-planning the schedule length (e.g. the machine got slower): the cosine
            # continues from this step on the new length. Recorded in the meta.
            saved.setdefault("replans", []).append({"step": step, "from": saved["settings"]["steps"], "to": s.steps})
            saved["settings"]["steps"] = s.steps
            log(f"schedule re-planned at step {step}: {saved['replans'][-1]['from']} -> {s.steps} steps")
        meta = saved
        if log_path.is_file():  # drop log lines past the checkpoint (they will be redone)
            lines = [ln for ln in log_path.read_text().splitlines() if json.loads(ln).get("step", 0) <= step]
            log_path.write_text("".join(ln + "\n" for ln in lines))
        log(f"resumed from step {step}")
    elif log_path.is_file():
        log_path.unlink()
    meta["max_minutes"] = max_minutes  # of this training run (recorded for the report's reproduce line)
    valid = {n: jnp.asarray(b) for n, b in corpus.valid_batches(s.eval_windows, s.seq_len).items()}
    tokens_per_step = s.batch_size * s.seq_len
    t_start, t_ckpt = time.time(), time.time()
    elapsed0 = meta["elapsed_s"]
    last = stop_at if stop_at is not None else s.steps

    def write(rec):
        with open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def evaluate(step):
        losses = {n: float(eval_loss(params, b)) for n, b in valid.items()}
        write({"step": step, "valid": losses, "elapsed_s": meta["elapsed_s"]})
        log(f"step {step:6d}  valid " + "  ".join(f"{n} {v:.3f}" for n, v in losses.items()))

    while step < last:
        batch = jnp.asarray(corpus.batch(s.seed, step, s.batch_size, s.seq_len, s.chat_share))
        params, opt_state, m = train_step(params, opt_state, batch)
        step += 1
        meta["tokens"] += tokens_per_step
        meta["elapsed_s"] = elapsed0 + time.time() - t_start
        if step % s.log_every == 0 or step == last:
            m = {k: float(v) for k, v in m.items()}
            lr = float(make_lr(s)(step))
            write({"step": step, **m, "lr": lr, "tokens": meta["tokens"], "elapsed_s": meta["elapsed_s"]})
            log(f"step {step:6d}  loss {m['loss']:.4f}  ce {m['ce']:.4f}  aux {m['aux']:.3f}  "
                f"|g| {m['grad_norm']:.2f}  lr {lr:.2e}  {meta['elapsed_s'] / 60:.1f} min")
        if step % s.eval_every == 0 or step == last:
            evaluate(step)
        out_of_time = max_minutes is not None and time.time() - t_start > 60 * max_minutes
        if time.time() - t_ckpt > s.checkpoint_every_s or step == last or out_of_time:
            save_checkpoint(run_dir, params, opt_state, step, meta)
            t_ckpt = time.time()
        if out_of_time:
            log(f"stopping at step {step}: --max-minutes {max_minutes} reached")
            if step % s.eval_every:
                evaluate(step)
            break
    meta["step"] = step
    return params, meta


def make_lr(s: TrainSettings):
    return optax.warmup_cosine_decay_schedule(0.0, s.peak_lr, s.warmup_steps, max(s.steps, s.warmup_steps + 1),
                                              end_value=s.peak_lr * s.min_lr_ratio)


def load_params(run_dir: str | Path) -> tuple[dict, Any, dict]:
    """(hf_config, params, meta) of a run's checkpoint (the optimizer state is skipped)."""
    run_dir = Path(run_dir)
    with np.load(run_dir / CHECKPOINT) as z:
        meta = json.loads(str(z["meta"]))
        hf = meta["hf_config"]
        _, params = init_params(config_from_hf(hf))
        leaves, treedef = jax.tree.flatten(params)
        params = jax.tree.unflatten(treedef, [jnp.asarray(z[f"leaf_{i:05d}"]) for i in range(len(leaves))])
        meta["step"] = int(z["step"])
    return hf, params, meta


# ---- export --------------------------------------------------------------------------------------------

def hf_tensors(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
    """HF qwen3_moe tensor name -> f32 array (Linear weights [out, in], experts per expert)."""
    flat = flat_model_params(params)
    out = {"model.embed_tokens.weight": flat["embed"], "model.norm.weight": flat["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = flat["lm_head"].T
    gate_up, down = (np.asarray(params["experts"][k]) for k in ("gate_up", "down"))
    F = cfg.d_ff_expert
    for i in range(cfg.num_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out[q + "input_layernorm.weight"] = flat[p + "attn_norm.weight"]
        out[q + "post_attention_layernorm.weight"] = flat[p + "mlp_norm.weight"]
        for w in "qkvo":
            out[q + f"self_attn.{w}_proj.weight"] = flat[p + f"attn.w{w}"].T
        for w in "qk":
            out[q + f"self_attn.{w}_norm.weight"] = flat[p + f"attn.{w}_norm.weight"]
        out[q + "mlp.gate.weight"] = flat[p + "moe.w_router"].T
        m = cfg.moe_index(i)
        for e in range(cfg.num_experts):
            out[q + f"mlp.experts.{e}.gate_proj.weight"] = gate_up[m, e, :F]
            out[q + f"mlp.experts.{e}.up_proj.weight"] = gate_up[m, e, F:]
            out[q + f"mlp.experts.{e}.down_proj.weight"] = down[m, e]
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def generation_config(hf: dict) -> dict:
    return {"bos_token_id": None, "eos_token_id": hf["eos_token_id"], "pad_token_id": hf.get("pad_token_id"),
            "do_sample": False, "max_new_tokens": 256}


def export(hf: dict, params, out_dir: str | Path, dtype: str = "bfloat16",
           tokenizer_dir: str | Path | None = DEFAULT_MODEL_DIR, training_record: dict | None = None) -> Path:
    """Write a Hugging Face folder: config.json, generation_config.json, model.safetensors
    (and the tokenizer files, when out_dir is not tokenizer_dir). `training_record` (run
    meta + loss log) is stored as JSON in the safetensors metadata under "ftjax_training",
    so the shipped file carries its own provenance for the report."""
    from safetensors.flax import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = config_from_hf(hf)
    jdtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[dtype]
    tensors = {k: jnp.asarray(v, jnp.float32).astype(jdtype) for k, v in hf_tensors(cfg, params).items()}
    metadata = {"format": "pt"}
    if training_record is not None:
        metadata["ftjax_training"] = json.dumps(training_record, separators=(",", ":"))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata=metadata)
    os.chmod(out_dir / "model.safetensors", 0o644)  # safetensors creates it owner-only
    (out_dir / "config.json").write_text(json.dumps({**hf, "dtype": dtype}, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config(hf), indent=2) + "\n")
    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != out_dir.resolve():
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (Path(tokenizer_dir) / f).is_file():
                shutil.copy(Path(tokenizer_dir) / f, out_dir / f)
    return out_dir


def training_record(run_dir: str | Path, meta: dict, max_log_lines: int = 400) -> dict:
    """The run's meta and its loss log (train lines thinned to about max_log_lines)."""
    log_path = Path(run_dir) / "log.jsonl"
    recs = [json.loads(ln) for ln in log_path.read_text().splitlines()] if log_path.is_file() else []
    train_recs = [r for r in recs if "loss" in r]
    every = max(1, math.ceil(len(train_recs) / max_log_lines))
    keep = set(id(r) for r in train_recs[::every]) | ({id(train_recs[-1])} if train_recs else set())
    return {**meta, "log": [r for r in recs if "valid" in r or id(r) in keep]}


def read_training_record(model_dir: str | Path) -> dict | None:
    """The "ftjax_training" metadata of an exported model.safetensors (None if absent)."""
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="numpy") as f:
        raw = (f.metadata() or {}).get("ftjax_training")
    return json.loads(raw) if raw else None


def params_from_folder(model_dir: str | Path) -> tuple[dict, nnx.GraphDef, dict]:
    """(hf_config, graphdef, params) of an exported folder, in f32 (for analysis)."""
    from ftjax.checkpoint import load_checkpoint as load_hf
    from ftjax.config import read_config_json

    hf = read_config_json(model_dir)
    ckpt = load_hf(model_dir, expert_dtype="float32", dense_dtype="float32")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(ckpt.config)))
    leaves = [(p, v.replace(jnp.asarray(ckpt.params[".".join(map(str, p))]))) for p, v in nnx.to_flat_state(state)]
    experts = {"gate_up": jnp.asarray(ckpt.pool.gate_up), "down": jnp.asarray(ckpt.pool.down)}
    return hf, graphdef, {"model": nnx.from_flat_state(leaves), "experts": experts}


@dataclasses.dataclass(frozen=True)
class RecordingExperts(TrainExperts):
    """Exact expert call that also records each MoE layer's routing (state["ids"] [Lm, N, K])."""

    impl: str = "capacity"
    capacity_factor: float = float("inf")

    def __call__(self, layer, x, ids, weights, valid, state):
        y, state = super().__call__(layer, x, ids, weights, valid, state)
        return y, {**state, "ids": state["ids"].at[layer].set(ids)}


def route_ids(graphdef, params, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced routing: tokens [B, T] -> (logits [B, T, V], ids [Lm, B, T, K])."""
    model = nnx.merge(graphdef, params["model"])
    cfg: ModelConfig = model.cfg
    B, T = tokens.shape
    state = {**params["experts"], "aux": jnp.zeros((cfg.num_moe_layers,), jnp.float32),
             "routers": [model.layers[i].moe.w_router[...] for i in cfg.moe_layer_ids],
             "ids": jnp.zeros((cfg.num_moe_layers, B * T, cfg.top_k), jnp.int32)}
    logits, _, state = model(tokens, jnp.int32(0), jnp.ones((B, T), bool), init_state(cfg, B, T),
                             RecordingExperts(), state)
    return logits, state["ids"].reshape(cfg.num_moe_layers, B, T, cfg.top_k)
