"""Device memory budget: one byte budget for everything a model keeps on the device.

It sizes the expert cache so that weights + states + scratch + the cache fit the budget,
and it gives the cache's bytes back to the allocator when states need them:

    budget >= weights          non-expert parameters (+ the whole expert pool under `device`)
            + states           every live session's state (KV cache, recurrent state), the
                               server's batched state, the state cache's device tier
            + prefill scratch  XLA's own temp-buffer size for the largest prompt chunk
                               (measured from the compiled prefill program: activations,
                               attention blocks, widened weights), + the double buffer of
                               a streamed layer when prompts stream; reserved up front, so
                               a prefill is never admitted to fail halfway
            + expert cache     its allocated capacity x bytes per slot: the part that gives way

States grow with the conversation; the expert cache gives way. Before a state grows,
`make_room(extra)` shrinks the cache to what is left (its least recently used residents
go first; the host pool is the source of truth, so tokens are unchanged, only where
experts run changes); when states shrink, `rebalance()` grows it back. A growth that
cannot fit even with no expert slot at all raises `DeviceMemoryError` before any
allocation, with the split in the message; nothing already held is touched.

The cache's size is its allocated capacity, in buckets of 1/8 of the configured slots
(k/8, k = 0..8), rounded down to what the budget leaves it, so a resize rarely
recompiles (the steps compile once per capacity) and never exceeds the budget; at most
one bucket of the room goes unused. A resize re-allocates the buffer
(`experts.executor.resize_cache`): the most recently used residents are carried over and
the old buffer is deleted, so its bytes go back to the allocator. At capacity 0 every
selected expert runs on the host. Growing back allocates the larger buffer before the
smaller one is freed (the carried-over residents are copied across), so a grow needs
the room of both for a moment; it only happens after states shrank.

On the CPU backend the "device" is host RAM and the budget is configured
(`--device-memory-gb`, `load(device_memory_bytes=...)`); the freed bytes are real RAM
(`jax.live_arrays()` falls by them).

Holders (sessions, the scheduler, the state cache) register themselves and report
`device_state_bytes()`; the manager sums them when asked, so a dropped session stops
counting as soon as it is gone (`Session.close()` releases at once).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.engine.shapes import bucket
from ftjax.experts.executor import cache_capacity

if TYPE_CHECKING:
    from ftjax.model import Model


# This build re-allocates the cache buffer smaller when states need room, so its bytes go back
# to the allocator. `ftjax bench paper` reads this (and checks it against the buffer's size)
# before it speaks to the paper's elastic-VRAM claim.
RELEASES_DEVICE_BYTES = True
CAPACITY_BUCKETS = 8  # the buffer is allocated at k/8 of the configured slots, k = 0..8


def capacity_for(room_slots: int, max_slots: int) -> int:
    """The largest bucket capacity within `room_slots`: all slots, or a multiple of
    ceil(max_slots / 8)."""
    if room_slots >= max_slots:
        return max_slots
    step = -(-max_slots // CAPACITY_BUCKETS)  # ceil
    return max(0, room_slots // step * step)


class DeviceMemoryError(ValueError):
    """A state would not fit the device budget even with an empty expert cache."""


def consumed(tree) -> bool:
    """Whether a step that failed donated (and so deleted) any buffer of `tree`."""
    return any(getattr(a, "is_deleted", lambda: False)() for a in jax.tree.leaves(tree))


def tree_bytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def device_budget() -> int | None:
    """The accelerator's usable bytes (its allocator's limit), None on the CPU backend
    (there the budget is configured)."""
    if jax.default_backend() == "cpu":
        return None
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def prefill_scratch_bytes(model: Model, tokens: int) -> int:
    """XLA's temp-buffer bytes for prefilling a `tokens`-token chunk into a state of the
    model's full context (AOT-compiled once; measured, not estimated), plus the double
    buffer of one streamed layer's experts when prompts of that length stream."""
    T = min(bucket(tokens), model.max_seq_len)
    state = jax.eval_shape(lambda: model.new_state(1, model.max_seq_len))
    i32 = jax.ShapeDtypeStruct((1,), jnp.int32)
    compiled = model._steps.prefill.lower(model._param_leaves, state, model._xstate, model._pool_dev,
                                          jax.ShapeDtypeStruct((1, T), jnp.int32), i32, i32,
                                          all_logits=False).compile()
    analysis = compiled.memory_analysis()
    temp = int(analysis.temp_size_in_bytes) if analysis is not None else 0
    stream = 0
    if model._streamed is not None and model.streams(T):
        stream = 2 * model.config.num_experts * model.checkpoint.pool.expert_bytes
    return temp + stream


class DeviceMemory:
    def __init__(self, model: Model, budget_bytes: int, prefill_tokens: int | None = None):
        if not isinstance(budget_bytes, (int, np.integer)) or budget_bytes <= 0:
            raise ValueError(f"device_memory_bytes must be a positive byte count, got {budget_bytes!r}")
        self.model = model
        self.budget = int(budget_bytes)
        self.weights = tree_bytes(model._params) + (tree_bytes(model._pool_dev) if model.policy == "device" else 0)
        ex = model._steps.executor
        self.max_slots = ex.slots
        self.slot_bytes = tree_bytes(model._xstate["cache"]) // ex.slots if ex.slots else 0
        tokens = prefill_tokens or min(model.prefill_chunk, model.max_seq_len)
        self.scratch = prefill_scratch_bytes(model, tokens)
        # A row: fixed leaves (rings, buffers) + per-token leaves x S. Measured between two large
        # capacities, so leaves of one row per `rate` tokens (compressed entries) count as well.
        R = 1 << 16
        one, two = (tree_bytes(jax.eval_shape(lambda n=n: model.new_state(1, n))) for n in (R, 2 * R))
        self._per_token, self._per_row = (two - one) / R, 2 * one - two
        self._holders: weakref.WeakSet = weakref.WeakSet()
        self.capacity = cache_capacity(model._xstate)  # slots allocated in the buffer
        self.counters = {"shrinks": 0, "grows": 0, "refused": 0}
        fixed = self.weights + self.scratch
        if fixed > self.budget:
            raise DeviceMemoryError(f"device memory budget {_mb(self.budget)} is below the weights ({_mb(self.weights)}) "
                                    f"+ prefill scratch ({_mb(self.scratch)}) alone")
        self.rebalance()

    # ---- accounting ------------------------------------------------------------------------
    def register(self, holder) -> None:
        """`holder.device_state_bytes()` counts as states from now on (while it lives)."""
        self._holders.add(holder)

    def state_bytes(self, capacity: int, batch: int = 1) -> int:
        """Bytes of a state of `batch` rows x `capacity` tokens (exact: every leaf is a
        fixed size, one row per token, or one row per `rate` tokens at a capacity that is a
        multiple of the rate, as the bucketed capacities are)."""
        return int(batch * (self._per_row + self._per_token * capacity))

    def room_alone(self) -> int:
        """Bytes the states may take with no expert cached and nothing else held."""
        return self.budget - self.weights - self.scratch

    def states(self) -> int:
        return sum(h.device_state_bytes() for h in list(self._holders))

    def active_slots(self) -> int:
        """Slots the expert cache holds (its allocated capacity)."""
        return self.capacity

    def sync(self) -> None:
        """Re-read the capacity after the executor state was replaced (cache cleared)."""
        self.capacity = cache_capacity(self.model._xstate)

    def split(self) -> dict:
        slots = self.active_slots()
        states = self.states()
        used = self.weights + states + self.scratch + slots * self.slot_bytes
        return {"budget_bytes": self.budget, "weights_bytes": self.weights, "states_bytes": states,
                "prefill_scratch_bytes": self.scratch, "expert_cache_bytes": slots * self.slot_bytes,
                "expert_slots_active": slots, "expert_slots_max": self.max_slots, "free_bytes": self.budget - used,
                **self.counters}

    def _slots_for(self, states: int) -> int:
        room = self.room_alone() - states
        return capacity_for(int(max(room, 0) // self.slot_bytes), self.max_slots) if self.slot_bytes else 0

    # ---- changes ---------------------------------------------------------------------------
    def make_room(self, extra: int, what: str = "a state") -> None:
        """Before `extra` more bytes of state are allocated: shrink the expert cache so
        they fit, or raise DeviceMemoryError (nothing changed) if they cannot."""
        states = self.states()
        if states + extra > self.room_alone():
            self.counters["refused"] += 1
            raise DeviceMemoryError(
                f"{what} of {_mb(extra)} does not fit the device memory budget of {_mb(self.budget)}, even with no "
                f"expert cached: weights {_mb(self.weights)}, states {_mb(states)}, prefill scratch {_mb(self.scratch)}")
        self._set(self._slots_for(states + extra), allow_grow=False)

    def fits(self, extra: int) -> bool:
        return self.states() + extra <= self.room_alone()

    def rebalance(self) -> None:
        """Give the expert cache whatever the states leave (after states shrank)."""
        self._set(self._slots_for(self.states()), allow_grow=True)

    def _set(self, n: int, allow_grow: bool) -> None:
        if not self.max_slots:
            return
        current = self.active_slots()
        if n == current or (n > current and not allow_grow):
            return
        self.model.resize_expert_cache(n)
        self.capacity = n
        self.counters["shrinks" if n < current else "grows"] += 1


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
