"""The Python API: `ftjax.load(path, **runtime) -> Model`, and `Model.session()`.

A `Model` owns what every request shares, and nothing per request:
- the device parameters (split NNX state of `models.common.CausalLM`),
- the host expert pool (source of truth for routed experts) and its device view,
- an expert executor (policy + device state: cache slots, slot table, stamps) — one
  global expert cache that every session's steps read and update,
- the compiled steps (`engine.steps.Steps`, `engine.streamed.StreamedPrefill`),
- telemetry (`engine.telemetry`: cumulative counters + a bounded per-step log).

`prefill_step` and `decode_step` are the one place the compiled steps run: they donate
the state they are given, replace the expert-cache state, record telemetry and feed the
online calibration. Sessions (the Python API) and the server's scheduler both go
through them. A step that fails may have consumed (donated) or poisoned the expert-cache
state; `recover()` rebuilds it, so the model keeps serving after any failure.

A conversation's state lives in a `Session` (`engine.session`): `model.session()`,
`model.session(snapshot)`. `generate`, `generate_stream`, `chat` and `logits` are thin
wrappers over a fresh session; `generate_many` decodes several prompts together in one
batched step per token.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ftjax.checkpoint import Checkpoint, load_checkpoint, safetensors_files
from ftjax.compilation import enable_persistent_cache
from ftjax.config import ModelConfig
from ftjax.engine import faults
from ftjax.engine.memory import consumed
from ftjax.engine.sampling import bias_arrays
from ftjax.engine.session import GenerationStats, Session, Snapshot, bucket, generate_batch  # noqa: F401
from ftjax.engine.steps import Steps
from ftjax.engine.streamed import StreamedPrefill, stream_threshold
from ftjax.engine.telemetry import DEFAULT_KEEP_RECORDS, Telemetry
from ftjax.experts.calibration import Calibration
from ftjax.experts.executor import FETCHED, HIT, HOST, STREAMED, make_executor, resize_cache
from ftjax.experts.policy import get_policy, transfer_ratio
from ftjax.host import default_threads, memory_kind_of, pool_view
from ftjax import distributed
from ftjax.placement import Placement, placement_for
from ftjax.models import FAMILIES
from ftjax.models.common import causal_lm, fresh_state

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
NUMERICS = ("auto", "exact", "fast")
API_MAX_BATCH = 64  # rows the Python API decodes together; more sessions queue and join as rows leave


@dataclass(eq=False)
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
    _telemetry: Telemetry = field(default_factory=Telemetry, repr=False)
    _streamed: StreamedPrefill | None = field(default=None, repr=False)
    prefill_mode: str = "auto"  # "auto" | "cached" | "streamed"
    stream_threshold: int = 0  # prompt length from which "auto" streams (accelerators only)
    fingerprint: str = ""  # config + weights identity, checked when a snapshot is restored
    prefill_chunk: int = 4096  # longer prompts prefill in chunks of this many tokens
    kv_dtype: Any = jnp.float32  # storage of cached activations (attention K/V)
    numerics: str = "exact"  # "exact" (f32 K/V) or "fast" (bf16 K/V): `load(numerics=...)`
    last_generation: GenerationStats | None = None
    memory: Any = field(default=None, repr=False)  # engine.memory.DeviceMemory (elastic budget) or None
    calibration: Calibration | None = field(default=None, repr=False)  # live B_P / B_H (adaptive split)
    _host: Any = field(default=None, repr=False)  # the HostExecutor of the routed experts (None: device)
    _scheduler: Any = field(default=None, repr=False)  # the Python API's decode loop (api_scheduler)
    _placement: Placement = field(default_factory=Placement, repr=False)  # one device or a mesh (`ftjax.placement`)

    def __post_init__(self):
        self._param_leaves = self._steps.param_leaves(self._params)  # what the steps take (Steps.param_leaves)

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({c.model_type}, {c.num_layers} layers, {c.num_experts} experts top-{c.top_k}, "
                f"policy={self.policy!r}, cache_slots={self.cache_slots}, max_seq_len={self.max_seq_len}, "
                f"path={str(self.checkpoint.path)!r})")

    @property
    def cache_slots(self) -> int:
        """Device expert-cache slots (per device on a mesh; 0: no cache)."""
        return self._steps.executor.slots

    # ---- validation ------------------------------------------------------------------------
    def check_ids(self, ids: Sequence[int]) -> np.ndarray:
        """A 1-D, non-empty sequence of in-vocabulary token ids -> int32 array."""
        if isinstance(ids, (str, bytes)):
            raise ValueError("ids must be token ids, not text: encode it with model.tokenizer.encode(...)")
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
        if arr.ndim != 1:
            raise ValueError(f"ids must be a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.size == 0:
            raise ValueError("ids is empty: need at least one prompt token")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"ids must be integers, got dtype {arr.dtype}")
        if arr.min() < 0 or arr.max() >= self.config.vocab_size:
            raise ValueError(f"token id out of range 0..{self.config.vocab_size - 1}: min {arr.min()}, max {arr.max()}")
        return arr.astype(np.int32)

    def _check_prompt(self, ids: Sequence[int]) -> np.ndarray:
        arr = self.check_ids(ids)
        if arr.size >= self.max_seq_len:
            raise ValueError(
                f"prompt of {arr.size} tokens does not fit the context of {self.max_seq_len} tokens "
                f"(max_seq_len; leave room for at least one new token)")
        return arr

    def streams(self, num_tokens: int) -> bool:
        """Whether a prompt of this length takes the streamed prefill path. `auto` never
        streams where the device is the host (the CPU backend): the host kernels already
        read the pool in place, and a "transfer" would copy RAM to RAM."""
        if self._streamed is None:
            return False
        return streams(self.prefill_mode, self.stream_threshold, num_tokens, jax.default_backend() == "cpu")

    @property
    def eos_ids(self) -> frozenset[int]:
        """Token ids that end a generation: the config's and the tokenizer's."""
        tok = frozenset(self.tokenizer.eos_token_ids) if self.tokenizer else frozenset()
        return frozenset(self.config.eos_token_ids) | tok

    # ---- sessions ------------------------------------------------------------------------------
    def new_state(self, batch: int, capacity: int):
        """Empty per-layer state for `batch` rows of `capacity` tokens (see models.layers),
        committed to device memory like the states the steps return (one compile each)."""
        p = self._placement
        return p.put(fresh_state(self.config, batch, capacity, self.kv_dtype), p.replicated())

    def api_scheduler(self):
        """The decode loop of the Python API (`generate*`, `Session.generate`): an
        `engine.scheduler.Scheduler` stepped by the calling thread. A server builds its own."""
        if self._scheduler is None:
            from ftjax.engine.scheduler import Scheduler
            self._scheduler = Scheduler(self, max_batch=API_MAX_BATCH, prefill_chunk=self.prefill_chunk,
                                        max_queue=1 << 20)
        return self._scheduler

    def session(self, snapshot: Snapshot | None = None) -> Session:
        """A new conversation: empty, or resumed exactly where `snapshot` was taken."""
        return Session(self, snapshot)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Full causal forward over a 1-D prompt -> [T, V] float32."""
        return self.session().logits(self._check_prompt(ids))

    def generate_stream(self, ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                        top_p: float = 1.0, seed: int = 0, stop: Sequence[str] | None = None,
                        step_logits: list | None = None) -> Iterator[int]:
        """Yield new token ids as they are produced. `step_logits`, if a list, receives the
        [V] logits each token was sampled from (for tests and research)."""
        arr = self._check_prompt(ids)
        s = self.session()
        stream = s.generate_stream(max_new_tokens, temperature, top_k, top_p, seed, stop, prompt=arr,
                                   step_logits=step_logits)
        self.last_generation = None
        try:
            for tok in stream:
                self.last_generation = s.last_generation
                yield tok
        finally:
            stream.close()
            self.last_generation = s.last_generation

    def generate(self, ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop: Sequence[str] | None = None) -> list[int]:
        """Generate up to max_new_tokens; returns the new ids only (EOS included if hit)."""
        return list(self.generate_stream(ids, max_new_tokens, temperature, top_k, top_p, seed, stop))

    def generate_many(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                      top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                      stop: Sequence[str] | None = None) -> list[list[int]]:
        """Several prompts (any lengths): each is prefilled, then all decode together, one
        batched step per token. Returns each prompt's new ids, as its own `generate` would."""
        arrs = [self._check_prompt(p) for p in prompts]
        sessions = []
        for arr in arrs:
            s = self.session()
            if max_new_tokens:
                s.append(arr)
            sessions.append(s)
        if not max_new_tokens:
            return [[] for _ in arrs]
        out = generate_batch(sessions, max_new_tokens, temperature, top_k, top_p, seed, stop)
        self.last_generation = sessions[-1].last_generation if sessions else None
        return out

    def chat(self, messages: list[dict], max_new_tokens: int = 256, **sampling) -> str:
        """Render messages with the chat template, generate, return the reply text."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (the model folder has no tokenizer.json)")
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt)
        return self.tokenizer.decode(self.generate(ids, max_new_tokens, **sampling))

    # ---- the steps: the one place that runs the compiled programs and owns what they update ----
    def prefill_step(self, state, tokens: np.ndarray, start: np.ndarray, length: np.ndarray,
                     all_logits: bool = False):
        """Feed tokens [B, T] (padded) from start [B], length [B] real tokens per row ->
        (logits [B, V] or [B, T, V], the new state). `state` is donated; the expert cache
        state, telemetry and calibration are updated here."""
        if self.streams(int(np.max(length))):
            tokens = jnp.asarray(tokens)
            logits, state, codes, nbytes = self._streamed.run(
                self._params, state, self._xstate, self.checkpoint.pool, tokens, start, length, all_logits=all_logits)
            self._telemetry.timing.bytes_streamed += nbytes
        else:
            logits, state, xstate, codes = self._steps.prefill(  # numpy in: no eager transfer op
                self._param_leaves, state, self._xstate, self._pool_dev, _host_copy(tokens), start, length,
                all_logits=all_logits)
            faults.check("prefill")  # here: the donated inputs are gone, as after a real failure
            self._xstate = xstate
        self._telemetry.record("prefill", codes)
        self.calibrate()
        return logits, state

    def decode_step(self, state, token, pos: np.ndarray, active: np.ndarray, keys, counters: np.ndarray,
                    temperature, top_k, top_p, bias: tuple[np.ndarray, np.ndarray] | None = None):
        """One token for every row of `state` [B, ...] (donated) -> (next token [B],
        logits [B, V] before the bias, the new state). Per-row sampling settings and
        `bias` (ids, values [B, K]: `engine.sampling.bias_arrays`; None: no bias)."""
        B = pos.shape[0]
        bias = bias if bias is not None else bias_arrays([None] * B, self.config.vocab_size)
        # copies: on the CPU backend jit may alias a numpy argument, and callers reuse these
        nxt, logits, state, xstate, codes = self._steps.decode(
            self._param_leaves, state, self._xstate, self._pool_dev, _host_copy(token), pos.copy(), active.copy(), keys,
            counters.copy(), temperature, top_k, top_p, *bias)
        faults.check("decode")
        self._xstate = xstate
        self._telemetry.record("decode", codes)
        self.calibrate()
        return nxt, logits, state

    def add_time(self, **spent) -> None:
        """Prefill / decode seconds and tokens a caller measured around the steps
        (`Timing.add` keywords), into the model's cumulative timing."""
        self._telemetry.timing.add(**spent)

    def resize_expert_cache(self, capacity: int) -> None:
        """Re-allocate the expert cache at `capacity` slots (elastic memory:
        `engine.memory`); the most recently used residents are carried over and the old
        buffer is freed at once. The steps compile once per capacity."""
        old = self._xstate["cache"]
        self._xstate = jax.device_put(resize_cache(self._xstate, capacity), self._placement.per_device())
        jax.block_until_ready(self._xstate["cache"])
        for part in jax.tree.leaves(old):
            part.delete()  # nothing else holds the old buffer: its bytes go back now

    @contextlib.contextmanager
    def recovering(self):
        """Run steps; if they raise, `recover` before the error goes on."""
        try:
            yield
        except Exception as e:
            err = distributed.step_error(e)  # several processes: a peer that is gone, named
            if err is not e:
                raise err from e
            self.recover()
            raise

    def recover(self) -> bool:
        """After a failed step: rebuild the expert-cache state if the failure consumed it
        (the steps donate it) or poisoned it (a failed program's outputs carry its error)
        -> True if it was rebuilt. Outputs do not depend on it (the host pool is the source
        of truth), only where experts run."""
        try:
            usable = not consumed(self._xstate)
            if usable:
                jax.block_until_ready(self._xstate)  # raises if a failed program produced them
        except Exception:
            usable = False
        if usable:
            return False
        self._xstate = _initial_xstate(self._steps.executor, self.checkpoint.pool, self._placement,
                                       self._capacity())  # q from the profile again
        if self.memory is not None:
            self.memory.sync()
            self.memory.rebalance()
        self.calibrate()
        return True

    # ---- telemetry -------------------------------------------------------------------------------------
    def expert_log(self) -> list[dict]:
        """One record per (step, MoE layer) of the last `keep_records` steps: selected /
        hits / fetched / host / streamed expert ids."""
        out = []
        for rec in self._telemetry.records():
            for layer, c in enumerate(rec.codes):
                out.append({"step": rec.step, "layer": layer, "phase": rec.phase,
                            "selected": np.flatnonzero(c).tolist(), "hits": np.flatnonzero(c == HIT).tolist(),
                            "fetched": np.flatnonzero(c == FETCHED).tolist(), "host": np.flatnonzero(c == HOST).tolist(),
                            "streamed": np.flatnonzero(c == STREAMED).tolist()})
        return out

    def stats(self) -> dict[str, Any]:
        """Cumulative counters since load or reset_stats().

        selections = hits + misses; misses = fetched + host_computed + streamed, where
        `streamed` counts prefill experts that arrived in a streamed layer block."""
        counts = self._telemetry.totals()
        hits, fetched, host, streamed = (int(counts[c]) for c in (HIT, FETCHED, HOST, STREAMED))
        t = self._telemetry.timing
        return {
            "policy": self.policy, "cache_slots": self.cache_slots, "numerics": self.numerics,
            "kv_dtype": jnp.dtype(self.kv_dtype).name, "host_overlap": self._steps.executor.host_pair is not None,
            "host_isa": None if self._host is None else self._host.isa.name.lower(),
            "selections": hits + fetched + host + streamed, "hits": hits, "misses": fetched + host + streamed,
            "fetched": fetched, "host_computed": host, "streamed": streamed, "bytes_streamed": t.bytes_streamed,
            "bytes_fetched": fetched * self.checkpoint.pool.expert_bytes,
            "bytes_host": host * self.checkpoint.pool.expert_bytes,
            "prefill_s": t.prefill_s, "decode_s": t.decode_s,
            "prefill_tokens": t.prefill_tokens, "decode_tokens": t.decode_tokens,
            "steps": self._telemetry.step, "log_steps_dropped": self._telemetry.dropped,
            "placement": self.placement(), "devices": self.device_stats(),
            **({"bandwidth": self.calibration.stats()} if self.calibration else {}),
        }

    def device_stats(self) -> list[dict[str, Any]]:
        """Per device of the placement: the experts it owns, its cache slots, and its
        share of the selections (hits, fetched, host-computed, streamed; bytes fetched)
        since load or reset_stats(). One device: one entry with every expert."""
        E = self.config.num_experts
        owner = self._placement.owner(E)
        by_expert = self._telemetry.totals_by_expert()
        out = []
        for d, device in enumerate(self._placement.describe()):
            mine = owner == d
            counts = by_expert[:, mine].sum(axis=1) if by_expert is not None else np.zeros(5, np.int64)
            hits, fetched, host, streamed = (int(counts[c]) for c in (HIT, FETCHED, HOST, STREAMED))
            out.append({"device": device, "experts_owned": int(mine.sum()), "cache_slots": self.cache_slots,
                        "hits": hits, "fetched": fetched, "host_computed": host, "streamed": streamed,
                        "hit_rate": round(hits / max(1, hits + fetched + host + streamed), 4),
                        "bytes_fetched": fetched * self.checkpoint.pool.expert_bytes})
        return out

    def calibrate(self) -> None:
        """Fold the host expert work done since the last call into the live bandwidth
        estimates (`ftjax.experts.calibration`) and, when the q table of the new r differs
        from the executor's, swap it in (data: nothing recompiles). The decode and prefill
        loops call this after every step; cheap (three integers read, no device sync)."""
        if self.calibration is None:
            return
        table = self.calibration.poll(self._host.work_done())
        if table is not None:
            q = self._xstate["q_of_misses"]
            leaf = self._placement.put(self._steps.executor.q_leaf(table), q.sharding)  # this process's devices only
            self._xstate = {**self._xstate, "q_of_misses": leaf}

    def _capacity(self) -> int | None:
        """The expert cache's allocated slots as elastic memory last sized it (None: all)."""
        return self.memory.capacity if self.memory is not None else None

    def placement(self) -> dict[str, str | None]:
        """Where each part of the model lives, read off the arrays themselves (memory
        kinds): the expert pool ("pinned_host"; "device" under the `device` reference
        policy), the expert cache (None without one), the per-session state, and the
        dense weights. E.g. {"expert_pool": "pinned_host", "expert_cache": "device",
        "state": "device", "dense": "device"}. States are not held by the model: theirs is
        the kind `new_state` commits them to (no state is made to ask)."""
        return {"expert_pool": memory_kind_of(self._pool_dev),
                "expert_cache": memory_kind_of(self._xstate.get("cache", {})),
                "state": self._placement.replicated().memory_kind,
                "dense": memory_kind_of(self._params)}

    def reset_stats(self) -> None:
        self._telemetry.reset()

    def clear_expert_cache(self) -> None:
        """Back to the policy's initial placement: every slot emptied (pinned policies
        re-pinned), every stamp forgotten."""
        q = self._xstate.get("q_of_misses")
        self._xstate = _initial_xstate(self._steps.executor, self.checkpoint.pool, self._placement, self._capacity())
        if q is not None and not q.is_deleted():  # the calibrated split stays
            self._xstate["q_of_misses"] = q
        if self.memory is not None:
            self.memory.sync()
            self.memory.rebalance()  # back to the size the budget leaves


def _host_copy(x):
    """A numpy argument copied (jit on the CPU backend may alias it, and callers reuse
    theirs); a jax array as it is."""
    return x.copy() if isinstance(x, np.ndarray) else x


def _initial_xstate(executor, pool, placement: Placement, capacity: int | None = None) -> dict:
    """Committed to device memory, as the steps return it: the first step after load then
    compiles the same program as every later one (one row per device on a mesh).
    capacity: the cache buffer's slots (None: all; elastic memory keeps a rebuilt cache
    at the size it had)."""
    state = executor.init_state(pool.parts, capacity)
    state.pop("codes")
    return placement.put(state, placement.per_device())


def _param_state(graphdef_state, params: dict[str, np.ndarray], put=jnp.asarray):
    """The loaded values as the model's param state (a `QuantMatrix` value stays one: its
    array goes to the device, its format rides in the tree structure). put: host array ->
    device array (a mesh: committed to every device, straight from the host copy)."""
    leaves = [(path, v.replace(jax.tree.map(put, params[".".join(map(str, path))])))
              for path, v in nnx.to_flat_state(graphdef_state)]
    return nnx.from_flat_state(leaves)


def load(path: str | Path | None = None, *, policy: str = "device", cache_slots: int | None = None,
         cache_bytes: int | None = None, bandwidth: tuple[float, float] | None = None, threads: int | None = None,
         max_seq_len: int | None = None, expert_dtype: str | None = None, dense_dtype: str | None = None,
         frequency: np.ndarray | None = None, prefill: str = "auto",
         prefill_stream_threshold: int | None = None, keep_records: int | None = DEFAULT_KEEP_RECORDS,
         prefill_chunk: int = 4096, kv_dtype: str | None = None, numerics: str = "auto",
         device_memory_bytes: int | str | None = None, calibrate: bool | None = None,
         overlap_host: bool | None = None, devices: int | list | None = None) -> Model:
    """Load a Hugging Face MoE checkpoint folder or a .gguf file (`ftjax.gguf_checkpoint`;
    its experts are used as stored: Q8_0 / Q4_0 / BF16 / F32), None = the embedded default model.

    policy: where experts run (`ftjax.experts.policy.POLICIES`); cache_slots / cache_bytes:
    size of the device expert cache; bandwidth: (B_P, B_H) in GB/s, overriding the
    measured profile; threads: worker threads of every host kernel the model runs (routed
    experts and packed dense layers; default: every core the process may run on; XLA's
    own CPU threads are set by XLA_FLAGS before JAX starts); expert_dtype / dense_dtype: storage of the expert pool
    and of the other matrices, "bfloat16" (default for bf16 checkpoints; exact, and the
    fast path of the CPU backend) or "float32"; dense_dtype may also name a block format
    ("int8" = "q8_0", "int4", "q4_k", "q6_k", "mxfp4") to quantise the projection matrices
    and LM head at load (`checkpoint.quantisable`); a GGUF's Q8_0 / Q4_0 / Q4_K / Q6_K /
    MXFP4 dense matrices are kept as stored unless dense_dtype="float32"; frequency [Lm, E]: selection
    counts for static-frequency; prefill: "auto" (on an accelerator, stream whole MoE
    layers once a prompt reaches `prefill_stream_threshold` tokens; never on the CPU
    backend), "cached" or "streamed"; keep_records: how many recent steps `expert_log()`
    keeps (0 = none, None = all; the counters of `stats()` are cumulative regardless);
    prefill_chunk: prompts longer than this prefill in chunks (attention memory O(chunk));
    numerics: "exact" keeps every cached activation in f32 (what the parity suite checks
    against transformers); "fast" stores the attention K/V cache in bf16 and, where the
    CPU has AMX tiles, prefills host experts and dense products on them (bf16, Q4_K,
    Q6_K weights with bf16-rounded activations, Q8_0 on the int8 tiles: `host.expert_isa`,
    `host.dense_settings`), as llama.cpp does (half the bytes a long-context decode step
    reads, ~3x the expert prefill rate; perplexity within 0.5% of exact, greedy tokens
    equal on the suite's prompts, checked by a test); "auto"
    (default): fast for checkpoints whose weights are bf16 / fp16 / quantised, exact for
    f32 ones (`numerics_for`); activations between layers are f32 in both; kv_dtype:
    "float32" or "bfloat16" overrides the K/V storage numerics chose; device_memory_bytes: one
    budget for weights, states, prefill scratch and the expert cache, whose buffer is
    re-allocated smaller as states grow (its bytes given back) and larger as they
    shrink (`ftjax.engine.memory`; "auto": the
    accelerator's memory; None: no budget); calibrate: under the bandwidth-adaptive split
    (`lru`), re-estimate B_H from the host work the model does and move q with it
    (`Model.calibrate`, `ftjax.experts.calibration`); False keeps q as the bandwidths give
    it; None (default): on with the measured profile, off when `bandwidth` is given (the
    numbers the caller gave pin the split: every record's q is the q* rule with them);
    overlap_host: under the cache policies, start the missed experts' host work before a
    layer's transfers and device half and collect it after (`HostExecutor.expert_ffn_start`),
    so the layer costs max(host, device) rather than their sum; False: one blocking call
    after the device half; None (default): the pair on the CPU backend, the blocking call
    on a GPU (the CUDA handlers build but have not run on a GPU yet: True asks for them);
    devices: split the experts over this many devices (or these jax devices) of a mesh,
    each with its own `cache_slots` and bookkeeping; attention and dense layers run
    replicated (`ftjax.placement`, `ftjax.experts.parallel`); None or 1: one device. Not
    yet combined with device_memory_bytes, streamed prefill or overlap_host.
    """
    enable_persistent_cache()  # a restarted process reads its compiled programs back ($FTJAX_COMPILATION_CACHE)
    kv_dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    if kv_dtype is not None and kv_dtype not in kv_dtypes:
        raise ValueError(f"kv_dtype must be one of {sorted(kv_dtypes)}, got {kv_dtype!r}")
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive number of tokens, got {prefill_chunk!r}")
    cores = default_threads()
    if threads is not None and (not isinstance(threads, int) or not 1 <= threads <= 4 * cores):
        raise ValueError(f"threads must be in 1..{4 * cores} (4x the {cores} cores this process may use), got {threads!r}")
    if prefill not in ("auto", "cached", "streamed"):
        raise ValueError(f"prefill must be 'auto', 'cached' or 'streamed', got {prefill!r}")
    model_dir = Path(path) if path is not None else DEFAULT_MODEL_DIR
    if path is None and not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"the embedded default model is missing from {model_dir}")
    pol = get_policy(policy)
    placement = placement_for(devices)
    # several processes: each reads only the experts its devices own (the `device` policy
    # puts every expert on every device, so it needs them all)
    owned = placement.local_experts if jax.process_count() > 1 and pol.name != "device" else None
    if model_dir.suffix == ".gguf" and not model_dir.is_dir():  # one GGUF file (ftjax.gguf_checkpoint)
        from ftjax.gguf_checkpoint import load_gguf
        ckpt = load_gguf(model_dir, expert_dtype, dense_dtype, experts=owned)
    else:
        ckpt = load_checkpoint(model_dir, expert_dtype, dense_dtype, experts=owned)
    cfg = ckpt.config
    numerics = numerics_for(ckpt) if numerics == "auto" else numerics
    kv_dtype = kv_dtype or ("float32" if numerics == "exact" else "bfloat16")
    fam = FAMILIES.get(cfg.model_type)  # its optional hooks (None: a GGUF's own config)
    streamable = getattr(fam, "streamed_prefill", lambda cfg: True)(cfg)  # one layer per program possible
    if prefill == "streamed" and not streamable:
        raise ValueError(f"prefill='streamed' is not available for {cfg.model_type} (its decoder layers need more "
                         "than one layer's program can be given); use 'cached' or 'auto'")
    pool = ckpt.pool
    if placement.mesh is not None:
        for name, given in (("device_memory_bytes", device_memory_bytes is not None), ("overlap_host", overlap_host),
                            ("prefill='streamed'", prefill == "streamed")):
            if given:
                raise ValueError(f"{name} is not available with devices={placement.size} yet (one device only)")
        overlap_host = False

    slots = 0
    if pol.uses_slots:
        if cache_slots is None and cache_bytes is None:
            raise ValueError(f"policy {policy!r} needs cache_slots=N or cache_bytes=B")
        slots = cache_slots if cache_slots is not None else int(cache_bytes // pool.expert_bytes)
    ratio = 1.0
    explicit_bandwidth = bandwidth
    if pol.split == "adaptive":
        if bandwidth is None:
            from ftjax.experts.profile import get_or_measure
            bandwidth = get_or_measure(pool.dtype, cfg.d_model, cfg.d_ff_expert, threads=threads, top_k=cfg.top_k)
        ratio = transfer_ratio(*bandwidth)

    host_fn = host = calibration = None
    expert_options = fam.executor_options(cfg) if hasattr(fam, "executor_options") else {}  # e.g. a SwiGLU clamp
    from ftjax.host import HostExecutor, expert_formats, expert_isa
    # every policy's device half computes a record as the host kernel would (fast: prompts
    # on the bf16 tiles round to bf16), so results never depend on where experts ran
    formats_for = functools.partial(expert_formats, pool.dtype, expert_isa(numerics), pool.d_model, pool.d_ff)
    if pol.name != "device":
        host = HostExecutor(pool, threads=threads, isa=expert_isa(numerics),
                            swiglu_limit=expert_options.get("swiglu_limit"))
        host_fn = host.expert_ffn
        if calibrate is None:
            calibrate = explicit_bandwidth is None
        if pol.split == "adaptive" and calibrate:
            calibration = Calibration(bandwidth, pool.expert_bytes, pol, cfg.num_experts)
    if overlap_host is None:  # the pair where its handlers have run: the CPU backend's FFI boundary
        overlap_host = host is not None and host.overlaps and jax.default_backend() == "cpu"
    if overlap_host and host is not None and not host.overlaps:
        raise ValueError(f"overlap_host=True: this build has no start / finish handlers for the "
                         f"{jax.default_backend()} backend (the CUDA ones are built only with the CUDA toolkit)")
    pair = (host.expert_ffn_start, host.expert_ffn_finish, host.after_start) if host is not None and overlap_host \
        else None
    executor = make_executor(pol, num_layers=cfg.num_moe_layers, num_experts=cfg.num_experts, slots=slots,
                             transfer_ratio=ratio, host_fn=host_fn, frequency=frequency, weight_format=pool.dtype,
                             host_pair=pair, formats_for=formats_for, **expert_options)
    if placement.mesh is not None:
        from ftjax.experts.parallel import ExpertParallel
        executor = ExpertParallel(executor, placement, frequency)

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: causal_lm(cfg, packed=ckpt.packed)))
    # a mesh: committed to every device (uncommitted ones would be sent at every step)
    params = _param_state(abstract, ckpt.params, put=jnp.asarray if placement.mesh is None else
                          lambda a: placement.put(a, placement.replicated()))
    ckpt.params.clear()  # the device state owns them now; don't keep a second host copy
    tokenizer = getattr(ckpt, "tokenizer", None)  # a GGUF carries its own
    if tokenizer is None and (model_dir / "tokenizer.json").is_file():
        from ftjax.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_dir(model_dir)
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or not 2 <= max_seq_len <= cfg.max_position):
        raise ValueError(f"max_seq_len must be in 2..{cfg.max_position} (the model's context, "
                         f"max_position_embeddings), got {max_seq_len!r}")
    max_len = max_seq_len or cfg.max_position
    dense_isa = expert_isa(numerics)  # fast: prefill's dense products on AMX tiles too
    streamed = StreamedPrefill(graphdef, executor, cfg.moe_layers, threads, dense_isa) \
        if pol.name != "device" and streamable and placement.mesh is None else None
    threshold = prefill_stream_threshold or stream_threshold(cfg.num_experts, cfg.top_k)
    model = Model(config=cfg, tokenizer=tokenizer, checkpoint=ckpt, policy=policy, max_seq_len=max_len,
                  bandwidth=bandwidth, _graphdef=graphdef, _params=params,
                  _pool_dev=pool_view(pool, "device" if pol.name == "device" else "pinned_host", placement),
                  _steps=Steps(graphdef, executor, threads, dense_isa), _xstate=_initial_xstate(executor, pool, placement),
                  _telemetry=Telemetry(keep_records), _streamed=streamed, prefill_mode=prefill,
                  stream_threshold=threshold, fingerprint=fingerprint(ckpt, kv_dtype), prefill_chunk=prefill_chunk,
                  kv_dtype=kv_dtypes[kv_dtype], numerics=numerics, calibration=calibration, _host=host,
                  _placement=placement)
    if device_memory_bytes is not None:
        from ftjax.engine.memory import DeviceMemory, device_budget

        if device_memory_bytes == "auto":
            device_memory_bytes = device_budget()
            if device_memory_bytes is None:
                raise ValueError("device_memory_bytes='auto' needs an accelerator; on the CPU backend give a byte count")
        model.memory = DeviceMemory(model, device_memory_bytes)
    return model


def numerics_for(ckpt: Checkpoint) -> str:
    """What numerics="auto" means for a checkpoint: "exact" when its weights are all kept
    in f32, else "fast" (their own rounding already exceeds bf16 K/V's)."""
    f32 = ckpt.dense_dtype == "float32" and ckpt.pool.dtype == "float32" and not ckpt.dense_format
    return "exact" if f32 else "fast"


def streams(mode: str, threshold: int, num_tokens: int, device_is_host: bool) -> bool:
    """The prefill path rule: "streamed" always, "cached" never, "auto" from `threshold`
    tokens on, except where the device is the host."""
    if mode == "auto":
        return not device_is_host and num_tokens >= threshold
    return mode == "streamed"


def fingerprint(ckpt: Checkpoint, kv_dtype: str = "float32") -> str:
    """Identity of a loaded model for snapshots: the config, the storage formats, and each
    weight file's name, size, header and first and last 64 KiB."""
    quantised = (ckpt.dense_format,) if ckpt.dense_format else ()  # (none: the fingerprints of before)
    h = hashlib.sha256(repr((ckpt.config, ckpt.dense_dtype, ckpt.pool.dtype, kv_dtype, *quantised)).encode())
    if ckpt.path.is_file():  # a GGUF: its header instead of safetensors headers
        from ftjax.gguf_checkpoint import update_fingerprint
        update_fingerprint(h, ckpt)
        return h.hexdigest()
    for path in safetensors_files(ckpt.path):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 16))
            f.seek(max(0, size - (1 << 16)))
            h.update(f.read())
    return h.hexdigest()
