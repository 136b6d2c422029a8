"""What the serving engine's state cache and device memory budget do on this machine, measured
for `ftjax bench paper` (the paper's claims 'semantic state caching saves re-prefill' and
'elastic VRAM'). Each function returns a result dict with `available` (False: `reason` says
why nothing was measured); the report decides the verdicts from these dicts
(`report._claims_state_cache`, `report._claims_memory`), never from fixed text.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np


def state_cache_reuse(model, ids: list[int], prefix_tokens: int, turn_tokens: int, repeats: int,
                      log: Callable[[str], None] = lambda m: None) -> dict:
    """An agent turn that extends a cached conversation: the first `prefix_tokens` of a
    window are prefilled into a fresh semantic StateCache (the previous turn), then the
    whole window (+ `turn_tokens`) is timed twice — prefilled from scratch in a new
    session ("off") and through the cache (`StateCache.prefill`: restore the deepest
    snapshot, prefill the rest, snapshot the end). One untimed round first compiles every
    shape; each round uses another window of `ids` and a fresh cache. The next greedy token
    of both sessions is compared (reuse must not change the output)."""
    try:
        from ftjax.engine.state_cache import StateCache
    except ImportError as e:  # a build without the state cache says so
        return {"available": False, "reason": f"ftjax.engine.state_cache does not import ({e})"}
    if prefix_tokens <= 0 or turn_tokens <= 0:
        return {"available": False, "reason": "skipped (state_cache_tokens = 0)"}
    window = prefix_tokens + turn_tokens
    if window + 2 > model.max_seq_len:
        return {"available": False, "reason": f"a {window}-token turn does not fit the model's context "
                                              f"({model.max_seq_len} tokens)"}
    rounds = repeats + 1
    if len(ids) < rounds * window:
        return {"available": False, "reason": f"{len(ids)} corpus tokens, {rounds} windows of {window} needed"}
    t_off, t_reuse, reused, same, cuttable = [], [], [], [], None
    for i in range(rounds):
        turn = [int(t) for t in ids[i * window:(i + 1) * window]]
        s_off = model.session()
        t0 = time.perf_counter()
        s_off.append(turn)
        dt_off = time.perf_counter() - t0
        cache = StateCache(model, "semantic")
        cuttable = cache.cuttable
        previous, _ = cache.prefill(turn[:prefix_tokens])
        previous.close()
        t0 = time.perf_counter()
        s_reuse, n = cache.prefill(turn)
        dt_reuse = time.perf_counter() - t0
        same_token = s_off.generate(1) == s_reuse.generate(1)
        for s in (s_off, s_reuse):
            s.close()
        if i == 0:
            continue  # the compile round
        t_off.append(dt_off)
        t_reuse.append(dt_reuse)
        reused.append(n)
        same.append(same_token)
        log(f"state cache round {i}: {window}-token turn, {n} tokens reused: {dt_reuse * 1e3:.1f} ms with the cache, "
            f"{dt_off * 1e3:.1f} ms without")
    return {"available": True, "mode": "semantic", "cuttable": cuttable, "prefix_tokens": prefix_tokens,
            "turn_tokens": window, "repeats": repeats, "reused_tokens": reused, "t_off_s": t_off,
            "t_reuse_s": t_reuse, "t_off_median_s": statistics.median(t_off),
            "t_reuse_median_s": statistics.median(t_reuse), "same_next_token": all(same)}


def memory_budget(model_dir, slots: int, threads: int | None, tokens: int,
                  log: Callable[[str], None] = lambda m: None) -> dict:
    """A session grown bucket by bucket under a device budget that holds the weights, the
    prefill scratch and every expert slot with no state (or the largest state with no
    slot, whichever is more): how many slots stay active as the
    state grows, what the expert-cache buffer holds meanwhile, whether a growth is refused,
    and what comes back when the session closes. `releases_bytes` is the build's own
    statement (`engine.memory.RELEASES_DEVICE_BYTES`), checked against the buffer sizes
    (`cache_buffer_bytes`: what the re-allocated buffer holds at each step)."""
    try:
        import ftjax
        from ftjax.engine import memory as memory_module
        from ftjax.engine.memory import DeviceMemoryError, tree_bytes
        from ftjax.engine.shapes import MIN_CAPACITY, bucket
    except ImportError as e:
        return {"available": False, "reason": f"ftjax.engine.memory does not import ({e})"}
    if tokens <= 0:
        return {"available": False, "reason": "skipped (memory_tokens = 0)"}
    model = ftjax.load(model_dir, policy="lru", cache_slots=slots, bandwidth=(1.0, 1.0), threads=threads,
                       device_memory_bytes=1 << 50)  # sized below, once weights and scratch are known
    mem = model.memory
    target = min(tokens, model.max_seq_len - 1)
    # all slots fit while no state is held, and the largest state fits once the slots have yielded
    full_state = mem.state_bytes(min(model.max_seq_len, bucket(target, MIN_CAPACITY)))
    mem.budget = mem.weights + mem.scratch + max(mem.max_slots * mem.slot_bytes, full_state)
    mem.rebalance()
    ids = np.random.RandomState(0).randint(0, model.config.vocab_size, target).tolist()
    ends = [n for n in (128, 256, 512, 1024, 2048, 4096, 8192) if n < target] + [target]
    session, steps, refused = model.session(), [], None
    start = {"active_slots": mem.active_slots(), "cache_buffer_bytes": tree_bytes(model._xstate["cache"])}
    for end in ends:
        try:
            session.append(ids[session.position:end])
        except DeviceMemoryError as e:  # the budget's answer to a state that cannot fit: recorded, not raised
            refused = {"tokens": end, "error": str(e)}
            break
        steps.append({"tokens": end, "capacity": session.capacity, "states_bytes": mem.states(),
                      "active_slots": mem.active_slots(), "cache_buffer_bytes": tree_bytes(model._xstate["cache"])})
        log(f"device memory: session at {end} tokens, {mem.active_slots()} of {mem.max_slots} expert slots active, "
            f"cache buffer {steps[-1]['cache_buffer_bytes'] / 2**20:.1f} MiB")
    session.close()
    end_slots = mem.active_slots()
    result = {"available": True, "releases_bytes": bool(getattr(memory_module, "RELEASES_DEVICE_BYTES", False)),
              "budget_bytes": mem.budget, "weights_bytes": mem.weights, "scratch_bytes": mem.scratch,
              "slot_bytes": mem.slot_bytes, "max_slots": mem.max_slots, "start": start, "steps": steps,
              "refused": refused, "active_slots_after_close": end_slots, "counters": dict(mem.counters)}
    del model
    return result
