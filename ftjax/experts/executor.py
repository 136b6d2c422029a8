"""The expert executor: where each routed (token, expert) assignment runs, decided and
bookkept inside the jitted step.

    router ids [N, K] ──► U = unique selected experts of this record (mask [E])
                          │
              slot table ─┤ hits = U ∩ resident      misses = U \\ resident (m of them)
                          │ q = q_table[m], capped by free+evictable slots
                          │ fetched = q most recently used misses; host = the rest
                          │ victims = free slots, then oldest-stamped residents ∉ U
                          ▼
        device part: hits + fetched, from cache slots      host part: `host` ids
        (fetched rows copied pool -> cache first)           (C++ kernel via ftjax.host)
                          └──────────── y = y_device + y_host ────────────┘

A *record* is one call of the executor: one MoE layer of one step (decode: 1 token;
prefill: all prompt tokens of the layer). State (a pytree of device arrays, donated
through the step):
    cache      {"gate_up": [slots, 2F, D], "down": [slots, D, F]}   storage dtype
    slot_of    [Lm*E] int32   global expert id (layer*E + e) -> slot, -1 = not resident
    id_of_slot [slots] int32  slot -> global expert id, -1 = free
    (slots: the buffer's capacity; elastic memory re-allocates it, `resize_cache`)
    stamp      [Lm*E] int32   last record that selected the expert (0 = never)
    t          [] int32       record counter
    q_of_misses [E+1] int32   q for each miss count (data: online calibration replaces it
                              between steps without recompiling; see `calibration.py`)
    codes      [Lm, E] int8   this step's outcome per expert: 0 unused, 1 hit,
                              2 fetched, 3 host, 4 streamed (the telemetry log; read lazily)
The host pool itself enters as `pool` {"gate_up": [Lm, E, 2F, D], "down": [Lm, E, D, F]},
a read-only device view (zero-copy on the CPU backend). Parts and formats are built and
sliced only through `ftjax.experts.storage`.

Exact rules are those of `ftjax.lab` (the offline simulator is the test oracle); the
policy table is in `policy.py`. bf16 weights are stored as uint16 and converted to f32
per expert at use (XLA CPU would otherwise convert whole buffers).

Cost model (decode, XLA CPU): every op of the step costs ~0.2-1 us to dispatch, a sort
~10 us at 64 slots (growing with the cache), a cond or loop ~1 us; the data of a decode
record is tiny. So the bookkeeping comes in two forms with the same rules (tests check
one against the other and both against the lab):
    few assignments (A = N*K <= 64: decode,   `lru_few`: comparisons over the A
    up to 8 sessions at top-8)                    assignments ([A, A], [E, A], [slots, A]) and
        one two-key minimum over the slots per possible fetch, in a loop; P = a static bound on
        fetches per record from the q table (0 for lru-host-only and the static policies:
        no victim search, no transfer code); the transfers are a loop over those fetched
        (both loops, not unrolled: a prompt bucket of 8 tokens at top-2 can fetch 16 experts
        a layer, and unrolled they doubled its compile time, at the same speed). The device FFN
        is unrolled over the assignments up to A = 16 and loops over the record's
        distinct experts above (each read once for all the batch's tokens).
    many assignments (prefill)                `lru_many`: stable sorts over all E experts
        and all slots, transfers in a loop; the device FFN scans the candidate rows.
The expert pool is indexed whole, never through a layer's slice (XLA copies such a
slice on every record): the `device` policy reads it reshaped to [Lm*E, ...] (free).
A = N*K assignments (legend in `ftjax.models.common`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.experts.policy import Policy, q_table, static_residents
from ftjax.experts.storage import Format, as_f32, empty_cache, flat_rows, part_formats, put_expert, take_expert

HIT, FETCHED, HOST, STREAMED = 1, 2, 3, 4
# Up to this many assignments per record the device FFN is unrolled over the assignments.
# Unrolling prompt buckets too (up to 64 assignments) ran no faster and made the first
# prefill compile 5x slower (1.7 -> 8 s, default model).
_FEW_ASSIGNMENTS = 16
# Assignments per tile of the prompt form (`_grouped_rows_ffn`): a row's group is padded to
# whole tiles, so at most R * (this - 1) padding rows run.
_TILE_ROWS = 64
# Up to this many assignments per record (a decode step of up to 8 sessions at top-8) the
# cache bookkeeping works over the assignments themselves (no sorts) and the device FFN
# loops over the record's distinct experts; above it (prompts), both loop over experts
# and slots.
_BATCH_ASSIGNMENTS = 64

HostFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]  # (x, layer, ids, w) -> y


def swiglu(gate_up: jax.Array, down: jax.Array, x: jax.Array, fmt: Format | dict | None = None,
           limit: float | None = None) -> jax.Array:
    """One expert: gate_up [2F, D], down [D, F] as stored in `fmt` (None: f32 or bf16
    bits, told by dtype; a dict {part: Format}, `part_formats`, where the parts differ),
    x [N, D] -> [N, D]. Block formats dequantise here (the cache and the link hold the
    small bytes) and meet activations quantised as the host
    kernels quantise them (`Format.act`), so every placement computes the same sums.
    limit: clamped SwiGLU (DeepSeek-V4): gate <= limit, |up| <= limit before the product."""
    fmts = fmt if isinstance(fmt, dict) else {"gate_up": fmt, "down": fmt}  # per part (`part_formats`)
    (g_f32, g_act), (d_f32, d_act) = ((f.to_f32, f.act) if f else (as_f32, lambda a: a)
                                      for f in (fmts["gate_up"], fmts["down"]))
    gate_up, down = g_f32(gate_up), d_f32(down)
    F = down.shape[-1]
    h = g_act(x) @ gate_up.T  # [N, 2F]
    gate, up = h[:, :F], h[:, F:]
    if limit is not None:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return d_act(jax.nn.silu(gate) * up) @ down.T


def device_ffn(gate_up: jax.Array, down: jax.Array, x: jax.Array, rows: jax.Array, weights: jax.Array, *,
               row_range: tuple[int, int] | None = None, fmt: Format | None = None,
               limit: float | None = None) -> jax.Array:
    """y [N, D] = Σ_k weights[n,k] · expert_{rows[n,k]}(x[n]); rows index gate_up/down's
    first axis ([R, 2F, D], [R, D, F]); rows < 0 are skipped. row_range = (first, count):
    the rows that can occur (default: all), so a caller can pass a whole pool
    ([Lm*E, ...], a free reshape) instead of a layer's slice, which XLA would copy.
    fmt, limit: the weight format and the optional clamp (see `swiglu`)."""
    N, K = rows.shape
    x32 = x.astype(jnp.float32)
    if N * K <= _FEW_ASSIGNMENTS:
        # decode: unrolled over the few assignments (a scan's loop costs more than its body
        # here); each reads only its selected expert, skipped when not placed on the device
        y = jnp.zeros_like(x32)
        for n in range(N):
            for k in range(K):
                r = rows[n, k]

                def run(y, n=n, k=k, r=r):
                    g = jax.lax.dynamic_index_in_dim(gate_up, r, keepdims=False)
                    d = jax.lax.dynamic_index_in_dim(down, r, keepdims=False)
                    return y.at[n].add(weights[n, k].astype(jnp.float32) * swiglu(g, d, x32[n:n + 1], fmt, limit)[0])

                y = jax.lax.cond(r >= 0, run, lambda y: y, y)
        return y.astype(x.dtype)
    if N * K <= _BATCH_ASSIGNMENTS:
        return _distinct_rows_ffn(gate_up, down, x32, rows, weights, fmt, limit).astype(x.dtype)

    first, R = row_range or (0, gate_up.shape[0])
    fmt_key = tuple(sorted(fmt.items())) if isinstance(fmt, dict) else fmt  # hashable: a static argument
    return _grouped_rows_ffn(gate_up, down, x32, rows, weights, jnp.int32(first), R=R, fmt=fmt_key,
                             limit=limit).astype(x.dtype)


# A jitted function inside the step: traced once per shape and format and reused by every
# layer (a model's MoE layers share them; `first` is an argument, not a constant), where
# inlined it was traced once per layer (default model, restarted process: 0.26 s of a
# 2,048-token prompt's 0.5 s of tracing).
@functools.partial(jax.jit, static_argnames=("R", "fmt", "limit"))
def _grouped_rows_ffn(gate_up, down, x32, rows, weights, first, *, R, fmt, limit=None):
    """Prompts: the A = N*K assignments sorted by row and cut into tiles of _TILE_ROWS,
    each row's group padded to whole tiles, so a tile belongs to one row: a scan over
    the (static) A / _TILE_ROWS + R tiles gathers its tokens, runs its row's expert on
    them and adds the weighted results back (the tiles past the last used one are
    skipped). Each token meets only its own K experts: about N*K rows of work where
    running every used expert on all N tokens costs N*R (8x at top-2 of 16)."""
    fmt = dict(fmt) if isinstance(fmt, tuple) else fmt  # per part, as device_ffn got it
    N, K = rows.shape
    A, C = N * K, _TILE_ROWS
    tiles = A // C + R + 1  # >= ceil(sum over rows of count rounded up to C) / C
    local = rows.reshape(-1) - first
    key = jnp.where(rows.reshape(-1) >= 0, jnp.clip(local, 0, R - 1), R)  # [A]: unused assignments last (R)
    order = jnp.argsort(key, stable=True)  # [A] assignments grouped by row
    counts = jnp.bincount(key, length=R + 1)[:R]  # [R]
    padded = (counts + C - 1) // C * C
    ends = jnp.cumsum(padded)  # [R] end of each row's padded group
    sorted_key = key[order]
    row_of = jnp.minimum(sorted_key, R - 1)
    rank = jnp.arange(A) - (jnp.cumsum(counts) - counts)[row_of]  # place within its row's group
    slot = jnp.where(sorted_key < R, ends[row_of] - padded[row_of] + rank, tiles * C)  # out of range: dropped
    token_of_slot = jnp.full((tiles * C,), N, jnp.int32).at[slot].set((order // K).astype(jnp.int32), mode="drop")
    weight_of_slot = jnp.zeros((tiles * C,), jnp.float32).at[slot].set(
        weights.reshape(-1).astype(jnp.float32)[order], mode="drop")
    tile_row = jnp.searchsorted(ends, jnp.arange(tiles) * C, side="right")  # [tiles]
    x_pad = jnp.concatenate([x32, jnp.zeros((1, x32.shape[1]), x32.dtype)])  # row N: padding slots read zeros

    def per_tile(y, i):
        def run(y):
            tokens = jax.lax.dynamic_slice_in_dim(token_of_slot, i * C, C)  # [C]
            w = jax.lax.dynamic_slice_in_dim(weight_of_slot, i * C, C)
            r = first + tile_row[i]
            out = swiglu(gate_up[r], down[r], x_pad[tokens], fmt, limit)  # [C, D]
            return y.at[tokens].add(w[:, None] * out)  # padding slots add 0 into row N
        return jax.lax.cond(i * C < ends[-1], run, lambda y: y, y), None

    y, _ = jax.lax.scan(per_tile, jnp.zeros_like(x_pad), jnp.arange(tiles))
    return y[:N]


def _distinct_rows_ffn(gate_up, down, x32, rows, weights, fmt, limit=None):
    """Batched decode: a loop over the A = N*K assignments that runs each distinct row once
    (at its first occurrence) on all N tokens, weighted per token (0 where unused): every
    selected expert is read once per record, whatever the batch."""
    N, K = rows.shape
    flat = rows.reshape(-1)  # [A]
    j = jnp.arange(flat.shape[0])
    repeat = jnp.any((flat[None, :] == flat[:, None]) & (j[None, :] < j[:, None]), axis=1)
    first = (flat >= 0) & ~repeat  # [A]
    combine = jnp.sum(jnp.where(rows[None] == flat[:, None, None], weights[None].astype(jnp.float32), 0.0), axis=2)  # [A, N]

    def body(y, i):
        def run(y):
            g = jax.lax.dynamic_index_in_dim(gate_up, flat[i], keepdims=False)
            d = jax.lax.dynamic_index_in_dim(down, flat[i], keepdims=False)
            return y + combine[i][:, None] * swiglu(g, d, x32, fmt, limit)
        return jax.lax.cond(first[i], run, lambda y: y, y), None

    y, _ = jax.lax.scan(body, jnp.zeros_like(x32), jnp.arange(flat.shape[0]))
    return y


@functools.partial(jax.jit, static_argnames=("num_experts",))
def selected_mask(ids: jax.Array, num_experts: int) -> jax.Array:
    """U as a mask [E]: experts chosen by at least one assignment. ids [N, K] (< 0: no
    expert: an invalid token, or one another device owns)."""
    N, K = ids.shape
    if N * K <= _FEW_ASSIGNMENTS:  # one [E, N*K] comparison fuses into its users; a scatter does not
        return jnp.any(ids[None] == jnp.arange(num_experts)[:, None, None], axis=(1, 2))
    return jnp.zeros(num_experts, bool).at[jnp.where(ids >= 0, ids, num_experts).reshape(-1)].set(True, mode="drop")


_BIG = int(np.iinfo(np.int32).max)  # sorts after every stamp, id and slot
FREE = -1  # id_of_slot of a slot holding no expert


def outcome_codes(hit, fetched, host) -> jax.Array:
    """Per-expert telemetry codes from the record's outcome masks (0 = not selected)."""
    return jnp.where(hit, HIT, jnp.where(fetched, FETCHED, jnp.where(host, HOST, 0))).astype(jnp.int8)


# The bookkeeping functions are jitted with the layer's offset `base` as data: a model
# traces and lowers them once for all its layers (XLA inlines the calls, so the compiled
# step is the same), instead of once per layer: half the tracing of a cache policy's step.
@functools.partial(jax.jit, static_argnames=("E", "slots", "max_fetch"))
def lru_few(a, sel, base, E, slots, q_of_misses, max_fetch, slot_of, id_of_slot, stamp, t):
    """Rules 1-5 (see `ftjax.lab.lru`) for a record of few assignments (decode), worked
    out over the A assignments themselves: [A, A], [E, A] and [slots, A] comparisons and
    one two-key minimum over the slots per possible fetch, no sort (on XLA CPU a sort of
    64 slots costs ~10 us and grows with the cache; each op here ~0.2 us).

    a [A] expert ids of this layer (-1 = invalid token); sel [E] = U; max_fetch: static bound on the
    experts fetched per record (0: never, e.g. lru-host-only); t [] this record's stamp;
    base [] the layer's first global id (data).
    -> (slot_of, id_of_slot, stamp) updated, codes [E] int8, and the transfers:
       (expert ids [P], slots [P], do [P]), P = max_fetch."""
    layer_stamp = jnp.where(sel, t, jax.lax.dynamic_slice(stamp, (base,), (E,)))  # [E] rule 5

    P = max_fetch
    if P == 0:  # nothing is ever fetched: hits and host work only, the slot table stays
        resident = jax.lax.dynamic_slice(slot_of, (base,), (E,)) >= 0
        codes = outcome_codes(sel & resident, False, sel & ~resident)
        stamp = jax.lax.dynamic_update_slice(stamp, layer_stamp, (base,))
        return (slot_of, id_of_slot, stamp), codes, (jnp.zeros(0, jnp.int32),) * 2 + (jnp.zeros(0, bool),)

    A = a.shape[0]
    j = jnp.arange(A)
    repeat = jnp.any((a[None, :] == a[:, None]) & (j[None, :] < j[:, None]), axis=1)  # [A] seen at j' < j
    first = (a >= 0) & ~repeat  # [A]: U, each expert once
    g = base + jnp.maximum(a, 0)  # [A] global ids
    slot, last = slot_of[g], stamp[g]
    hit, miss = first & (slot >= 0), first & (slot < 0)
    n_hit, n_miss = jnp.sum(hit), jnp.sum(miss)
    q = jnp.minimum(q_of_misses[n_miss], slots - n_hit)
    # rule 3: the q misses used most recently (never = stamp 0 = oldest), ties -> lower id;
    # before[j, j'] = j' comes before j in that order
    before = (last[None, :] > last[:, None]) | ((last[None, :] == last[:, None]) & (a[None, :] < a[:, None]))
    fetched = miss & (jnp.sum(miss[None, :] & before, axis=1) < q)  # [A]
    host = miss & ~fetched

    # rule 4: the i-th fetched expert in ascending id order takes the i-th victim slot
    order = jnp.sum(fetched[None, :] & (a[None, :] < a[:, None]), axis=1)  # [A]
    pick = jnp.arange(P)
    do = pick < jnp.sum(fetched)  # [P]
    expert = jnp.sum(jnp.where(fetched[None, :] & (order[None, :] == pick[:, None]), a[None, :], 0), axis=1)  # [P]
    occupant = id_of_slot  # [slots]
    free = occupant == FREE
    needed = jnp.any(hit[None, :] & (g[None, :] == occupant[:, None]), axis=1)  # [slots] residents in U
    victim = victim_slots(
        k1=jnp.where(free, -1, jnp.where(needed, _BIG, stamp[jnp.maximum(occupant, 0)])),
        k2=jnp.where(free, jnp.arange(slots, dtype=jnp.int32), occupant),
        slot_of=slot_of, count=P)  # [P]
    evicted = occupant[victim]  # [P] (-1: was free)

    stamp = jax.lax.dynamic_update_slice(stamp, layer_stamp, (base,))
    oob = slot_of.shape[0]  # out-of-bounds index: dropped by mode="drop"
    # evicted experts are resident, fetched ones are not: one scatter sets both
    where = jnp.concatenate([jnp.where(do & (evicted >= 0), evicted, oob), jnp.where(do, base + expert, oob)])
    slot_of = slot_of.at[where].set(jnp.concatenate([jnp.full(P, -1, jnp.int32), victim]), mode="drop")
    id_of_slot = id_of_slot.at[jnp.where(do, victim, slots)].set(base + expert, mode="drop")

    code = outcome_codes(hit, fetched, host)  # [A] (0 on repeats)
    codes = jnp.max(jnp.where(a[None, :] == jnp.arange(E)[:, None], code[None, :], 0), axis=1)  # [E]
    return (slot_of, id_of_slot, stamp), codes, (expert, victim, do)


def victim_slots(k1, k2, slot_of, count):
    """The first `count` slots in (k1, k2) order, one two-key minimum per pick.

    k1, k2 [slots]: free slot s -> (-1, s); resident expert g -> (stamp[g], g);
    slots that must not be taken -> k1 = BIG. The pair is unique per slot.
    -> [count] slots (past the number of eligible slots: meaningless)."""
    def pick(i, carry):  # a loop, not unrolled (module docstring)
        k1, picks = carry
        m1 = jnp.min(k1)
        m2 = jnp.min(jnp.where(k1 == m1, k2, _BIG))
        picks = picks.at[i].set(jnp.where(m1 < 0, m2, slot_of[jnp.clip(m2, 0, slot_of.shape[0] - 1)]))
        return jnp.where((k1 == m1) & (k2 == m2), _BIG, k1), picks

    _, picks = jax.lax.fori_loop(0, count, pick, (k1, jnp.zeros(count, jnp.int32)))
    return jnp.clip(picks, 0, k1.shape[0] - 1)


@functools.partial(jax.jit, static_argnames=("E", "slots"))
def lru_many(sel, base, E, slots, q_of_misses, slot_of, id_of_slot, stamp, t):
    """Rules 1-5 for a record of many assignments (prefill), over all E experts and all
    slots with sorts. sel [E] = U.
    -> (slot_of, id_of_slot, stamp) updated, codes [E] int8, fetched [E], target [E] slot."""
    gidx = base + jnp.arange(E, dtype=jnp.int32)  # [E] global ids of this layer
    resident = slot_of[gidx] >= 0
    hit, miss = sel & resident, sel & ~resident
    n_hit, n_miss = jnp.sum(hit), jnp.sum(miss)
    q = jnp.minimum(q_of_misses[n_miss], slots - n_hit)

    # fetched = the q misses used most recently (never = stamp 0 = oldest), ties -> lower id
    recency = jnp.where(miss, -stamp[gidx], _BIG)
    order = jnp.argsort(recency, stable=True)
    rank = jnp.zeros(E, jnp.int32).at[order].set(jnp.arange(E, dtype=jnp.int32))
    fetched = miss & (rank < q)
    host = miss & ~fetched

    # victim order: free slots (by index), then residents not in U by (stamp, global id);
    # residents in U never
    occupant = id_of_slot  # [slots]
    free = occupant == FREE
    occ = jnp.maximum(occupant, 0)
    needed = (occ >= base) & (occ < base + E) & sel[jnp.clip(occ - base, 0, E - 1)] & ~free
    klass = jnp.where(free, 0, jnp.where(needed, 2, 1))
    slot_ids = jnp.arange(slots, dtype=jnp.int32)
    candidates = jnp.lexsort((jnp.where(free, 0, occ), jnp.where(free, slot_ids, stamp[occ]), klass))
    fetch_pos = jnp.cumsum(fetched) - 1  # i-th fetched expert in ascending id order
    target = jnp.where(fetched, candidates[jnp.clip(fetch_pos, 0, slots - 1)], -1)  # [E] slot per fetched

    oob = slot_of.shape[0]  # out-of-bounds index: dropped by mode="drop"
    evicted = jnp.where(fetched, occupant[jnp.maximum(target, 0)], -1)  # [E]
    slot_of = slot_of.at[jnp.where(evicted >= 0, evicted, oob)].set(-1, mode="drop")
    slot_of = slot_of.at[jnp.where(fetched, gidx, oob)].set(target, mode="drop")
    id_of_slot = id_of_slot.at[jnp.where(fetched, target, slots)].set(gidx, mode="drop")
    stamp = stamp.at[jnp.where(sel, gidx, oob)].set(t, mode="drop")
    return (slot_of, id_of_slot, stamp), outcome_codes(hit, fetched, host), fetched, target


def to_device(tree):
    """An explicit move into device memory: the pool lives in `pinned_host` memory, so the
    rows a transfer takes from it cross here (a host-to-device copy of exactly those bytes
    on an accelerator; nothing on the CPU backend, where both kinds are the same RAM)."""
    return jax.device_put(tree, jax.memory.Space.Device)


def copy_expert(cache, pool, layer, e, s):
    """cache slot s <- pool expert (layer, e), every part."""
    return put_expert(cache, to_device(take_expert(pool, layer, e)), s)


@jax.jit
def copy_in(cache, pool, layer, experts, slots, count):
    """Transfer of fetched experts: cache slot slots[i] <- pool expert (layer, experts[i])
    for i < count, as a loop (one compiled body; see the module docstring). Jitted, the
    layer as data: traced once for every layer."""
    if experts.shape[0] == 0:  # a policy that never fetches
        return cache
    return jax.lax.fori_loop(0, count, lambda i, c: copy_expert(c, pool, layer, experts[i], slots[i]), cache)


def resize_cache(state: dict[str, Any], capacity: int) -> dict[str, Any]:
    """The executor state with its cache buffer re-allocated at `capacity` slots (elastic
    memory: the bytes of the slots given up go back to the allocator). The `capacity`
    most recently used residents stay, moved to the first slots with their stamps; the
    others are evicted (their experts run where a miss runs until fetched again; the host
    pool is the source of truth, so output is unchanged). Which slot an expert sits in
    never matters to the rules (victims: free slots, then residents by (stamp, id)), so
    placement continues as if the cache had always had this size and the evicted experts
    had gone first. The steps compile once per capacity. Host-side: it reads the slot
    table back (a sync; a resize is rare)."""
    id_of_slot, stamp = np.asarray(state["id_of_slot"]), np.asarray(state["stamp"])
    resident = np.flatnonzero(id_of_slot >= 0)  # [R] old slots holding an expert
    experts = id_of_slot[resident]
    keep = resident[np.lexsort((experts, -stamp[experts]))][:capacity]  # most recent first, ties -> lower id
    new_id = np.full(capacity, FREE, np.int32)
    new_id[:keep.size] = id_of_slot[keep]
    slot_of = np.full(state["slot_of"].shape, -1, np.int32)
    slot_of[id_of_slot[keep]] = np.arange(keep.size, dtype=np.int32)
    cache = {name: jnp.zeros((capacity, *part.shape[1:]), part.dtype).at[:keep.size].set(part[jnp.asarray(keep)])
             for name, part in state["cache"].items()}
    return {**state, "cache": cache, "slot_of": jnp.asarray(slot_of), "id_of_slot": jnp.asarray(new_id)}


def cache_capacity(state: dict[str, Any]) -> int:
    """Slots in the cache buffer (0 for the policies without one)."""
    return int(state["id_of_slot"].shape[0]) if "id_of_slot" in state else 0


class Executor:
    """A policy bound to a pool geometry; `__call__` is traced into the model's steps."""

    def __init__(self, policy: Policy, *, num_layers: int, num_experts: int, slots: int,
                 transfer_ratio: float, host_fn: HostFn | None, residents: np.ndarray | None = None,
                 weight_format: str = "float32", swiglu_limit: float | None = None,
                 host_pair: tuple[Callable, Callable, Callable] | None = None,
                 formats_for: Callable[[int], dict[str, Format]] | None = None):
        self.policy, self.num_layers, self.num_experts = policy, num_layers, num_experts
        self.swiglu_limit = swiglu_limit  # clamped SwiGLU on the device (the host_fn must clamp alike)
        self.weight_format = weight_format
        self.fmt = part_formats(weight_format)
        # a record of N tokens -> the part formats its device half computes with: those the
        # host kernel computes that record with (`ftjax.host.expert_formats`: a prompt on the
        # bf16 tiles rounds to bf16 under numerics="fast"), so that which experts were
        # cached never changes a result; None: the plain formats always
        self._formats_for = formats_for
        self.slots = slots if policy.uses_slots else 0
        if policy.uses_slots and not 1 <= self.slots <= num_layers * num_experts:
            raise ValueError(f"cache_slots must be in 1..{num_layers * num_experts} for policy {policy.name!r}, got {slots}")
        if policy.name != "device" and host_fn is None:
            raise ValueError(f"policy {policy.name!r} needs the host expert kernel")
        self.host_fn = host_fn
        # (start, finish, after_start): the host kernel split so that the device half runs
        # in between (`HostExecutor.expert_ffn_start`); None: one blocking call after it
        self.host_pair = host_pair
        self.q_of_misses = q_table(policy, num_experts, transfer_ratio)  # [E+1] (the initial table)
        self.residents = residents if residents is not None else np.zeros(0, np.int32)

    def formats(self, num_tokens: int) -> dict[str, Format]:
        """The part formats the device half of a record of num_tokens tokens computes with."""
        return self._formats_for(num_tokens) if self._formats_for is not None else self.fmt

    def max_fetch(self, assignments: int, capacity: int) -> int:
        """Static bound on the experts one record of `assignments` can fetch: the
        largest q over its possible miss counts, at most the cache's `capacity` in slots.
        The adaptive split's table is data that calibration may move anywhere in 0..m,
        so its bound is m."""
        m = min(assignments, self.num_experts)
        bound = m if self.policy.split == "adaptive" else self.q_of_misses[: m + 1].max()
        return int(min(capacity, bound))

    # ---- state -------------------------------------------------------------------------
    def init_state(self, pool_parts: dict[str, np.ndarray], capacity: int | None = None,
                   residents: np.ndarray | None = None) -> dict[str, Any]:
        """Fresh state: empty cache, or the policy's pinned experts copied in.
        pool_parts: the host pool's parts pytree (`HostExpertPool.parts`); capacity: the
        cache buffer's slots (default: all `slots`; elastic memory allocates fewer);
        residents: the pinned experts (global ids) instead of the policy's own."""
        Lm, E = self.num_layers, self.num_experts
        state: dict[str, Any] = {"codes": jnp.zeros((Lm, E), jnp.int8)}
        if not self.policy.uses_slots:
            return state
        S = self.slots if capacity is None else int(np.clip(capacity, 0, self.slots))
        cache = empty_cache(pool_parts, S)
        slot_of = np.full(Lm * E, -1, np.int32)
        id_of_slot = np.full(S, -1, np.int32)
        for slot, g in enumerate((self.residents if residents is None else residents)[:S]):
            for name, part in pool_parts.items():
                cache[name][slot] = part[g // E, g % E]
            slot_of[g], id_of_slot[slot] = slot, g
        state.update(
            cache={k: jnp.asarray(v) for k, v in cache.items()},
            slot_of=jnp.asarray(slot_of), id_of_slot=jnp.asarray(id_of_slot),
            stamp=jnp.zeros(Lm * E, jnp.int32), t=jnp.zeros((), jnp.int32),
            q_of_misses=jnp.asarray(self.q_of_misses),
        )
        return state

    def fresh_codes(self) -> jax.Array:
        """The step's telemetry log, empty: codes [Lm, E]."""
        return jnp.zeros((self.num_layers, self.num_experts), jnp.int8)

    def merged_codes(self, codes: jax.Array) -> jax.Array:
        """The step's log as codes [Lm, E] (one device: as written)."""
        return codes

    def q_leaf(self, table: np.ndarray) -> np.ndarray:
        """The state's q_of_misses leaf for a new q table (one device: the table)."""
        return table

    # ---- one record ------------------------------------------------------------------------
    def __call__(self, layer: int, x, ids, weights, valid, state, pool):
        """x [N, D], ids/weights [N, K], valid [N] -> y [N, D], state."""
        ids = jnp.where(valid[:, None], ids, -1)
        sel = selected_mask(ids, self.num_experts)
        if self.policy.name == "device":
            E = self.num_experts
            flat = flat_rows(pool)  # [Lm*E, ...]: no copy
            rows = jnp.where(ids >= 0, layer * E + ids, -1)
            y = device_ffn(flat["gate_up"], flat["down"], x, rows, weights, row_range=(layer * E, E),
                           fmt=self.formats(x.shape[0]), limit=self.swiglu_limit)
            return y, {**state, "codes": state["codes"].at[layer].set(jnp.where(sel, HIT, 0).astype(jnp.int8))}
        if self.policy.name == "host":
            y = self._host_part(x, layer, ids, weights)
            return y, {**state, "codes": state["codes"].at[layer].set(jnp.where(sel, HOST, 0).astype(jnp.int8))}
        return self._cached(layer, x, ids, weights, sel, state, pool)

    def _cached(self, layer, x, ids, weights, sel, state, pool):
        """The slot-cache policies: bookkeeping (decode or prefill form), transfers, then
        device part from the cache + host part."""
        E, S = self.num_experts, state["id_of_slot"].shape[0]  # the buffer's capacity (elastic memory resizes it)
        base = layer * E
        A = ids.size
        table = state["q_of_misses"]
        t = state["t"] + 1
        if S == 0:  # elastic memory gave the whole cache back: every selection runs on the host, stamps still count
            y = self._host_part(x, layer, ids, weights).astype(x.dtype)
            stamp = state["stamp"].at[base:base + E].set(jnp.where(sel, t, state["stamp"][base:base + E]))
            codes = jnp.where(sel, HOST, 0).astype(jnp.int8)
            return y, {**state, "stamp": stamp, "t": t, "codes": state["codes"].at[layer].set(codes)}
        book = (state["slot_of"], state["id_of_slot"], state["stamp"])
        if A <= _BATCH_ASSIGNMENTS:
            (slot_of, id_of_slot, stamp), codes, copies = lru_few(ids.reshape(A), sel, base, E, S, table,
                                                                  self.max_fetch(A, S), *book, t)
            expert, victim, do = copies
            n_copies = jnp.sum(do)
        else:
            (slot_of, id_of_slot, stamp), codes, fetched, target = lru_many(sel, base, E, S, table, *book, t)
            expert = jnp.nonzero(fetched, size=E, fill_value=0)[0]  # ascending
            victim, n_copies = target[expert], jnp.sum(fetched)

        # after the update, an assignment runs on the device iff its expert is resident
        safe = jnp.maximum(ids, 0)
        slot = slot_of[base + safe]  # [N, K]
        dev_rows = jnp.where(ids >= 0, slot, -1)
        host_ids = jnp.where((ids >= 0) & (slot < 0), ids, -1)
        if self.host_pair is not None:  # host work starts first; transfers and the device half run meanwhile
            start, finish, after_start = self.host_pair
            token = start(x, jnp.int32(layer), host_ids, weights)
            expert, dev_rows = after_start(token, expert), after_start(token, dev_rows)
        cache = copy_in(state["cache"], pool, layer, expert, victim, n_copies)
        y = device_ffn(cache["gate_up"], cache["down"], x, dev_rows, weights, fmt=self.formats(x.shape[0]),
                       limit=self.swiglu_limit)
        if self.host_pair is None:
            y = y + self._host_part(x, layer, host_ids, weights).astype(y.dtype)
        else:
            y = y + finish(token, y, x.shape).astype(y.dtype)  # waits after the device half (y is its operand)
        return y, {**state, "cache": cache, "slot_of": slot_of, "id_of_slot": id_of_slot, "stamp": stamp,
                   "t": t, "codes": state["codes"].at[layer].set(codes)}

    def _host_part(self, x, layer, ids, weights):
        """The host kernel on the assignments with ids >= 0; a record with none crosses
        nothing (the call sits in a cond: no host call, no sync, no copy of x)."""
        def call(x):
            return self.host_fn(x, jnp.int32(layer), ids, weights).astype(jnp.float32)
        return jax.lax.cond(jnp.any(ids >= 0), call, lambda x: jnp.zeros(x.shape, jnp.float32), x)

    # ---- one streamed prefill record ---------------------------------------------------------
    def streamed(self, layer: int, x, ids, weights, valid, state, block):
        """Prefill with the layer's experts streamed in as one block (`block`: gate_up
        [E, 2F, D], down [E, D, F] on the device). Experts resident in the decode cache
        run from their slots (hits) and were not sent; the rest run from the block.
        The decode cache, stamps and counter are left untouched."""
        ids = jnp.where(valid[:, None], ids, -1)
        sel = selected_mask(ids, self.num_experts)
        safe = jnp.maximum(ids, 0)
        y = jnp.zeros_like(x)
        hit = jnp.zeros_like(sel)
        fmt = self.formats(x.shape[0])
        if self.policy.uses_slots and state["id_of_slot"].shape[0] > 0:
            slot = state["slot_of"][layer * self.num_experts + jnp.arange(self.num_experts)]
            hit = sel & (slot >= 0)
            rows = jnp.where((ids >= 0) & hit[safe], slot[safe], -1)
            y = device_ffn(state["cache"]["gate_up"], state["cache"]["down"], x, rows, weights, fmt=fmt,
                           limit=self.swiglu_limit)
        rows = jnp.where((ids >= 0) & ~hit[safe], ids, -1)
        y = y + device_ffn(block["gate_up"], block["down"], x, rows, weights, fmt=fmt, limit=self.swiglu_limit)
        codes = jnp.where(hit, HIT, jnp.where(sel, STREAMED, 0)).astype(jnp.int8)
        return y, {**state, "codes": state["codes"].at[layer].set(codes)}


def make_executor(policy: Policy, *, num_layers: int, num_experts: int, slots: int, transfer_ratio: float,
                  host_fn: HostFn | None, frequency: np.ndarray | None = None,
                  weight_format: str = "float32", swiglu_limit: float | None = None,
                  host_pair: tuple[Callable, Callable, Callable] | None = None,
                  formats_for: Callable[[int], dict[str, Format]] | None = None) -> Executor:
    residents = static_residents(policy, slots, num_layers, num_experts, frequency)
    return Executor(policy, num_layers=num_layers, num_experts=num_experts, slots=slots,
                    transfer_ratio=transfer_ratio, host_fn=host_fn, residents=residents,
                    weight_format=weight_format, swiglu_limit=swiglu_limit, host_pair=host_pair,
                    formats_for=formats_for)
