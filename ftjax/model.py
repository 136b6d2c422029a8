"""The Python API: `ftjax.load(path, **runtime) -> Model`.

A `Model` owns four things and nothing else:
- the device parameters (split NNX state of `models.common.CausalLM`),
- the host expert pool (source of truth for routed experts) and its device view,
- an expert executor (policy + device state: cache slots, slot table, stamps),
- the compiled steps (`engine.steps.Steps`), one per shape bucket.

Generation is prefill (prompt padded to a power-of-two bucket) then one jitted decode
call per token; the sampled token stays a device array fed to the next step, and only
its id is read back to check stop conditions. Telemetry (`stats`, `expert_log`) is
derived from the per-step `codes [Lm, E]` arrays the steps return, kept on the device
and decoded only when asked for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ftjax.checkpoint import Checkpoint, load_checkpoint
from ftjax.config import ModelConfig
from ftjax.engine.sampling import sample
from ftjax.engine.steps import Steps
from ftjax.engine.streamed import StreamedPrefill, stream_threshold
from ftjax.experts.executor import FETCHED, HIT, HOST, STREAMED, make_executor
from ftjax.experts.policy import get_policy, transfer_ratio
from ftjax.host import pool_view
from ftjax.models.common import CausalLM, empty_kv_cache

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
_MIN_BUCKET = 16
_sample = jax.jit(sample)


def bucket(n: int, minimum: int = _MIN_BUCKET) -> int:
    """Smallest power of two >= n (and >= minimum): one compile serves a range of lengths."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


@dataclass
class _Record:
    phase: str  # "prefill" | "decode"
    step: int
    codes: jax.Array  # [Lm, E] int8 (device)


@dataclass
class _Timing:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    bytes_streamed: int = 0


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = ""

    @property
    def decode_tok_per_s(self) -> float:
        n = self.new_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


@dataclass
class Model:
    config: ModelConfig
    tokenizer: Any
    checkpoint: Checkpoint
    policy: str
    max_seq_len: int
    bandwidth: tuple[float, float] | None
    _graphdef: Any = field(repr=False)
    _params: Any = field(repr=False)
    _pool_dev: dict = field(repr=False)
    _steps: Steps = field(repr=False)
    _xstate: Any = field(repr=False)
    _log: list = field(default_factory=list, repr=False)
    _timing: _Timing = field(default_factory=_Timing, repr=False)
    _streamed: StreamedPrefill | None = field(default=None, repr=False)
    prefill_mode: str = "auto"  # "auto" | "cached" | "streamed"
    stream_threshold: int = 0  # prompt length from which "auto" streams
    _step: int = 0
    last_generation: GenerationStats | None = None

    # ---- shapes and validation -------------------------------------------------------------
    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
        if arr.ndim != 1:
            raise ValueError(f"ids must be a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError("ids is empty: need at least one prompt token")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"ids must be integers, got dtype {arr.dtype}")
        if arr.min() < 0 or arr.max() >= self.config.vocab_size:
            raise ValueError(f"token id out of range 0..{self.config.vocab_size - 1}: min {arr.min()}, max {arr.max()}")
        if arr.size >= self.max_seq_len:
            raise ValueError(
                f"prompt of {arr.size} tokens does not fit the context of {self.max_seq_len} tokens "
                f"(max_seq_len; leave room for at least one new token)")
        return arr.astype(np.int32)

    def _padded(self, ids: np.ndarray, cache_len: int) -> jax.Array:
        tokens = np.zeros((1, min(bucket(ids.size), cache_len)), np.int32)  # [B, T bucket]
        tokens[0, : ids.size] = ids
        return jnp.asarray(tokens)

    def streams(self, num_tokens: int) -> bool:
        """Whether a prompt of this length takes the streamed prefill path."""
        if self._streamed is None or self.prefill_mode == "cached":
            return False
        return self.prefill_mode == "streamed" or num_tokens >= self.stream_threshold

    def _prefill(self, ids: np.ndarray, cache_len: int, all_logits: bool):
        T = ids.size
        tokens = self._padded(ids, cache_len)
        kv = empty_kv_cache(self.config, 1, cache_len)
        t0 = time.perf_counter()
        if self.streams(T):
            logits, kv, codes, nbytes = self._streamed.run(
                self._params, kv, self._xstate, self.checkpoint.pool, tokens, T, all_logits=all_logits)
            self._timing.bytes_streamed += nbytes
        else:
            logits, kv, self._xstate, codes = self._steps.prefill(
                self._params, kv, self._xstate, self._pool_dev, tokens, jnp.int32(0), jnp.int32(T),
                all_logits=all_logits)
        self._record("prefill", codes)
        return logits, kv, t0

    def calibrate_prefill(self, max_tokens: int = 512, repeats: int = 3, seed: int = 0) -> dict:
        """Measure cached vs streamed prefill per prompt bucket on this machine and set
        `stream_threshold` to the smallest bucket from which streaming stays faster.
        The cached runs fill the expert cache, so it is cleared afterwards.
        Returns {"threshold", "buckets": [{"tokens", "cached_s", "streamed_s"}]}."""
        if self._streamed is None:
            raise ValueError(f"policy {self.policy!r} keeps every expert on the device: nothing to stream")
        rng = np.random.default_rng(seed)
        mode, rows = self.prefill_mode, []
        n = _MIN_BUCKET
        while n <= min(max_tokens, self.max_seq_len - 1):
            ids = rng.integers(0, self.config.vocab_size, n).astype(np.int32)
            row = {"tokens": n}
            for path in ("cached", "streamed"):
                self.prefill_mode = path
                times = []
                for _ in range(repeats + 1):  # the first run compiles
                    self.clear_expert_cache()  # every run starts cold, as a new prompt would
                    t0 = time.perf_counter()
                    jax.block_until_ready(self._prefill(ids, n, all_logits=False)[0])
                    times.append(time.perf_counter() - t0)
                    self._log.pop()
                    self._step -= 1
                row[f"{path}_s"] = float(np.median(times[1:]))
            rows.append(row)
            n *= 2
        self.prefill_mode = mode
        self.clear_expert_cache()
        faster = [r["streamed_s"] < r["cached_s"] for r in rows]
        wins = [i for i in range(len(rows)) if all(faster[i:])]
        self.stream_threshold = rows[wins[0]]["tokens"] if wins else self.max_seq_len
        return {"threshold": self.stream_threshold, "buckets": rows}

    def prefill_breakdown(self, ids: Sequence[int]) -> dict[str, float]:
        """Streamed prefill of `ids`, timed three ways: pipelined (T_prefill), transfers
        alone (T_transfer) and compute alone with every block preloaded (T_compute)."""
        if self._streamed is None:
            raise ValueError(f"policy {self.policy!r} keeps every expert on the device: nothing to stream")
        arr = self._check_ids(ids)
        cache_len = bucket(arr.size)
        return self._streamed.breakdown(self._params, lambda: empty_kv_cache(self.config, 1, cache_len),
                                        self._xstate, self.checkpoint.pool, self._padded(arr, cache_len), arr.size)

    def _record(self, phase: str, codes: jax.Array) -> None:
        self._step += 1
        self._log.append(_Record(phase, self._step, codes))

    # ---- public API ------------------------------------------------------------------------------
    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Full causal forward over a 1-D prompt -> [T, V] float32."""
        arr = self._check_ids(ids)
        logits, _, t0 = self._prefill(arr, bucket(arr.size), all_logits=True)
        out = np.asarray(logits[0, : arr.size], dtype=np.float32)
        self._timing.prefill_s += time.perf_counter() - t0
        self._timing.prefill_tokens += arr.size
        return out

    def generate_stream(self, ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                        top_p: float = 1.0, seed: int = 0, stop: Sequence[str] | None = None,
                        step_logits: list | None = None) -> Iterator[int]:
        """Yield new token ids as they are produced. `step_logits`, if a list, receives the
        [V] logits each token was sampled from (for tests and research)."""
        arr = self._check_ids(ids)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if not 0.0 < top_p <= 1.0 or top_k < 0 or temperature < 0:
            raise ValueError(f"bad sampling settings: temperature={temperature} top_k={top_k} top_p={top_p}")
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (the model folder has no tokenizer.json)")
        stats = self.last_generation = GenerationStats(prompt_tokens=arr.size)
        if max_new_tokens == 0:
            return
        T = arr.size
        cache_len = min(self.max_seq_len, bucket(T + max_new_tokens, 128))
        cache_len = max(cache_len, min(bucket(T), self.max_seq_len))
        budget = min(max_new_tokens, cache_len - T)
        logits, kv, t0 = self._prefill(arr, cache_len, all_logits=False)
        key = jax.random.PRNGKey(seed)
        settings = (jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))
        token = _sample(logits, jax.random.fold_in(key, 0), *settings)
        eos = set(self.config.eos_token_ids) | (set(self.tokenizer.eos_token_ids) if self.tokenizer else set())
        new = []
        for i in range(budget):
            if i > 0:
                token, logits, kv, self._xstate, codes = self._steps.decode(
                    self._params, kv, self._xstate, self._pool_dev, token, jnp.int32(T + i - 1),
                    jax.random.fold_in(key, i), *settings)
                self._record("decode", codes)
            tok = int(token[0])
            if i == 0:
                stats.ttft_s = time.perf_counter() - t0
                self._timing.prefill_s += stats.ttft_s
                self._timing.prefill_tokens += T
                t_dec = time.perf_counter()
            if step_logits is not None:
                step_logits.append(np.asarray(logits[0], dtype=np.float32))
            new.append(tok)
            stats.new_tokens = len(new)
            yield tok
            if tok in eos:
                stats.stop_reason = "eos"
                break
            if stop:
                text = self.tokenizer.decode(new)  # re-decoded per token: stop strings can span tokens
                if any(s in text for s in stop):
                    stats.stop_reason = "stop"
                    break
        else:
            stats.stop_reason = "length" if budget == max_new_tokens else "context"
        stats.decode_s = time.perf_counter() - t_dec
        self._timing.decode_s += stats.decode_s
        self._timing.decode_tokens += max(len(new) - 1, 0)

    def generate(self, ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop: Sequence[str] | None = None) -> list[int]:
        """Generate up to max_new_tokens; returns the new ids only (EOS included if hit)."""
        return list(self.generate_stream(ids, max_new_tokens, temperature, top_k, top_p, seed, stop))

    def chat(self, messages: list[dict], max_new_tokens: int = 256, **sampling) -> str:
        """Render messages with the chat template, generate, return the reply text."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (the model folder has no tokenizer.json)")
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt)
        return self.tokenizer.decode(self.generate(ids, max_new_tokens, **sampling))

    # ---- telemetry -------------------------------------------------------------------------------------
    def expert_log(self) -> list[dict]:
        """One record per (step, MoE layer): selected / hits / fetched / host expert ids."""
        out = []
        for rec in self._log:
            codes = np.asarray(rec.codes)
            for layer in range(codes.shape[0]):
                c = codes[layer]
                out.append({"step": rec.step, "layer": layer, "phase": rec.phase,
                            "selected": np.flatnonzero(c).tolist(), "hits": np.flatnonzero(c == HIT).tolist(),
                            "fetched": np.flatnonzero(c == FETCHED).tolist(), "host": np.flatnonzero(c == HOST).tolist(),
                            "streamed": np.flatnonzero(c == STREAMED).tolist()})
        return out

    def stats(self) -> dict[str, Any]:
        """Cumulative counters since load or reset_stats().

        selections = hits + misses; misses = fetched + host_computed + streamed, where
        `streamed` counts prefill experts that arrived in a streamed layer block."""
        counts = np.zeros(5, np.int64)
        for rec in self._log:
            counts += np.bincount(np.asarray(rec.codes).ravel().astype(np.int64), minlength=5)[:5]
        hits, fetched, host, streamed = (int(counts[c]) for c in (HIT, FETCHED, HOST, STREAMED))
        t = self._timing
        return {
            "policy": self.policy, "cache_slots": self._steps.executor.slots,
            "selections": hits + fetched + host + streamed, "hits": hits, "misses": fetched + host + streamed,
            "fetched": fetched, "host_computed": host, "streamed": streamed, "bytes_streamed": t.bytes_streamed,
            "bytes_fetched": fetched * self.checkpoint.pool.expert_bytes,
            "bytes_host": host * self.checkpoint.pool.expert_bytes,
            "prefill_s": t.prefill_s, "decode_s": t.decode_s,
            "prefill_tokens": t.prefill_tokens, "decode_tokens": t.decode_tokens,
        }

    def reset_stats(self) -> None:
        self._log.clear()
        self._timing = _Timing()
        self._step = 0

    def clear_expert_cache(self) -> None:
        """Back to the policy's initial placement: every slot emptied (pinned policies
        re-pinned), every stamp forgotten."""
        pool = self.checkpoint.pool
        self._xstate = _initial_xstate(self._steps.executor, pool)


def _initial_xstate(executor, pool) -> dict:
    state = executor.init_state(pool.gate_up, pool.down)
    state.pop("codes")
    return state


def _param_state(graphdef_state, params: dict[str, np.ndarray]):
    leaves = [(path, v.replace(jnp.asarray(params[".".join(map(str, path))])))
              for path, v in nnx.to_flat_state(graphdef_state)]
    return nnx.from_flat_state(leaves)


def load(path: str | Path | None = None, *, policy: str = "device", cache_slots: int | None = None,
         cache_bytes: int | None = None, bandwidth: tuple[float, float] | None = None, threads: int | None = None,
         max_seq_len: int | None = None, expert_dtype: str | None = None, dense_dtype: str | None = None,
         frequency: np.ndarray | None = None, prefill: str = "auto",
         prefill_stream_threshold: int | None = None) -> Model:
    """Load a Hugging Face MoE checkpoint folder (None = the embedded default model).

    policy: where experts run (`ftjax.experts.policy.POLICIES`); cache_slots / cache_bytes:
    size of the device expert cache; bandwidth: (B_P, B_H) in GB/s, overriding the
    measured profile; threads: host expert kernel worker threads (dense layers use every
    core the process may run on); expert_dtype / dense_dtype: storage of the expert pool
    and of the other matrices, "bfloat16" (default for bf16 checkpoints; exact, and the
    fast path of the CPU backend) or "float32"; frequency [Lm, E]: selection
    counts for static-frequency; prefill: "auto" (stream whole MoE layers once a prompt
    reaches `prefill_stream_threshold` tokens), "cached" or "streamed".
    """
    if prefill not in ("auto", "cached", "streamed"):
        raise ValueError(f"prefill must be 'auto', 'cached' or 'streamed', got {prefill!r}")
    model_dir = Path(path) if path is not None else DEFAULT_MODEL_DIR
    if path is None and not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"the embedded default model is missing from {model_dir}")
    ckpt = load_checkpoint(model_dir, expert_dtype, dense_dtype)
    cfg = ckpt.config
    pol = get_policy(policy)
    pool = ckpt.pool

    slots = 0
    if pol.uses_slots:
        if cache_slots is None and cache_bytes is None:
            raise ValueError(f"policy {policy!r} needs cache_slots=N or cache_bytes=B")
        slots = cache_slots if cache_slots is not None else int(cache_bytes // pool.expert_bytes)
    ratio = 1.0
    if pol.split == "adaptive":
        if bandwidth is None:
            from ftjax.experts.profile import get_or_measure
            bandwidth = get_or_measure(pool.dtype, cfg.d_model, cfg.d_ff_expert, threads=threads)
        ratio = transfer_ratio(*bandwidth)

    host_fn = None
    if pol.name != "device":
        from ftjax.host import HostExecutor
        host = HostExecutor(pool, threads=threads)
        host_fn = host.expert_ffn
    executor = make_executor(pol, num_layers=cfg.num_moe_layers, num_experts=cfg.num_experts, slots=slots,
                             transfer_ratio=ratio, host_fn=host_fn, frequency=frequency)

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, packed=ckpt.packed)))
    params = _param_state(abstract, ckpt.params)
    ckpt.params.clear()  # the device state owns them now; don't keep a second host copy
    tokenizer = None
    if (model_dir / "tokenizer.json").is_file():
        from ftjax.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_dir(model_dir)
    max_len = min(max_seq_len or cfg.max_position, cfg.max_position)
    streamed = StreamedPrefill(graphdef, executor, cfg.moe_layers) if pol.name != "device" else None
    threshold = prefill_stream_threshold or stream_threshold(cfg.num_experts, cfg.top_k)
    return Model(config=cfg, tokenizer=tokenizer, checkpoint=ckpt, policy=policy, max_seq_len=max_len,
                 bandwidth=bandwidth, _graphdef=graphdef, _params=params,
                 _pool_dev=pool_view(pool),
                 _steps=Steps(graphdef, executor), _xstate=_initial_xstate(executor, pool),
                 _streamed=streamed, prefill_mode=prefill, stream_threshold=threshold)
