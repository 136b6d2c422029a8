"""Semantic state cache: a radix tree of conversation states keyed by token ids.

Agents resend their whole history every turn, and rewrite it at block boundaries: old
reasoning dropped, tool output trimmed, a tool call re-echoed. A cache that only knows
"the previous prompt" loses everything after the first rewritten token; re-prefilling
tens of thousands of tokens is the tail TTFT an agent times out on. This cache keeps
snapshots at the *semantic* boundaries — just after `</think>`, `</tool_call>` and
`</tool_output>` (or `</tool_response>`), whatever ids the tokenizer gives those tags,
multi-token tags by their encoding — and at the end of every prompt, so a rewritten
history is still reused up to the boundary before its first changed token.

Tree. A node is a snapshot of the state after ids[:depth]. It owns
    edge      the tokens from its parent's end to its own (parent.depth .. depth)
    segment   the state for those tokens (`models.common.take_segment`): each layer
              kind's per-token leaves (attention K/V) for the edge, rounded up to a
              power-of-two length (so the jitted cut and paste compile once per size, not
              per prompt), its fixed-size leaves (a Gated DeltaNet state) as at `depth`
    logits    [V] after its last token
so a prefix shared by many snapshots is stored once; restoring node n joins the
segments on the path root -> n into a fresh state, in order (`put_segment`).

Where reuse can stop depends on the state. Attention-only models are *cuttable*: every
leaf is per-token, so any prefix of a snapshot is a state, and a request reuses up to
its first changed token, inside an edge if need be (SGLang's radix cache does the same
per token); boundary snapshots add nothing there and are not taken. A model with a
fixed-size leaf (Gated DeltaNet's recurrent state, a compressed cache) can resume only
where a snapshot was saved, so in "semantic" mode its prompts are prefilled in pieces
that end at the block boundaries, with a snapshot after each; a rewritten history
then reuses up to the boundary before its first changed token.

Tiers. A node's segment lives on the device (jax arrays), on the host (numpy) or on
disk (one orbax folder per node, `Snapshot.save`), each tier with a byte budget and
LRU order: over budget, the device's least recently used nodes move to the host, the
host's to disk (or are dropped without a disk tier), the disk's are deleted. A lookup
that lands on host or disk nodes brings their segments back to the device. Using a
node touches it and then its ancestors, so an ancestor is never older than its
descendants; only leaves are dropped (a child's segment needs its ancestors').

The newest snapshot (not a block boundary inside a prompt) is also kept whole (one per
cache, device memory, counted in the device tier's budget): a request that continues it is restored with one copy instead
of one paste per node of its path, which on a long agent session is dozens of nodes.

Persistence. With `disk_dir`, `close()` writes every device and host node to disk,
and a new cache on the same folder and model (same fingerprint) rebuilds the tree:
a restarted server resumes its sessions.

Modes: "semantic" (boundaries + prompt ends), "prefix" (prompt ends only: on a model
with a recurrent state, the baseline that reuses a previous prompt only while it is an
unchanged prefix). On a cuttable model both reuse to the first changed token.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import jax
import numpy as np

from ftjax.engine import faults
from ftjax.engine.memory import DeviceMemoryError, tree_bytes
from ftjax.engine.session import Snapshot
from ftjax.engine.shapes import MIN_CAPACITY, bucket
from ftjax.models.common import put_segment, resize_state, take_segment
from ftjax.models.layers import kind_class

if TYPE_CHECKING:
    from ftjax.engine.session import Session
    from ftjax.model import Model

log = logging.getLogger("ftjax.engine")
BOUNDARY_TAGS = ("</think>", "</tool_call>", "</tool_output>", "</tool_response>")
MODES = ("off", "prefix", "semantic")  # off: no StateCache at all
TIERS = ("device", "host", "disk")


def boundary_patterns(tokenizer) -> list[tuple[int, ...]]:
    """The id sequences that close a block: each tag's own token if the tokenizer has
    one, else the tag's encoding (several tokens)."""
    out = []
    if tokenizer is None:
        return out
    for tag in BOUNDARY_TAGS:
        tok = tokenizer.added_token_ids.get(tag)
        ids = (tok,) if tok is not None else tuple(tokenizer.encode(tag))
        if ids and ids not in out:
            out.append(ids)
    return out


def boundary_ends(ids: Sequence[int], patterns: list[tuple[int, ...]]) -> list[int]:
    """Positions just after each occurrence of a pattern in ids (sorted, distinct)."""
    arr = np.asarray(ids)
    ends: set[int] = set()
    for pat in patterns:
        n = len(pat)
        if n == 1:
            ends.update((np.flatnonzero(arr == pat[0]) + 1).tolist())
            continue
        starts = np.flatnonzero(arr[: arr.size - n + 1] == pat[0]) if arr.size >= n else []
        ends.update(int(s) + n for s in starts if tuple(arr[s:s + n].tolist()) == pat)
    return sorted(ends)


@dataclass
class _Hot:
    ids: tuple[int, ...]
    state: tuple  # batch 1, whole (every layer's leaves at their capacity)
    logits: object  # [V] after the last id
    nbytes: int


@dataclass(eq=False)
class _Node:
    parent: _Node | None
    edge: tuple[int, ...]
    depth: int
    kind: str = "root"  # what made it: boundary | prompt | request | split (a radix split point: no logits)
    children: list[_Node] = field(default_factory=list)
    segment: tuple | None = None  # per-layer pytrees (device: jax arrays; host: numpy; disk: None)
    logits: object = None  # [V]
    tier: str = "device"
    nbytes: int = 0
    used: int = 0  # LRU clock
    name: str = ""  # disk folder name

    def ids(self) -> list[int]:
        out, n = [], self
        while n.parent is not None:
            out[:0] = n.edge
            n = n.parent
        return out


class StateCache:
    def __init__(self, model: Model, mode: str = "semantic", device_bytes: int = 1 << 30, host_bytes: int = 4 << 30,
                 disk_dir: str | Path | None = None, disk_bytes: int = 32 << 30,
                 patterns: list[Sequence[int]] | None = None):
        """Budgets in bytes per tier (a node larger than a tier's budget passes through
        it); `disk_dir` adds the disk tier. `patterns`: the id sequences that close a
        block (default: the tags' ids from the model's tokenizer)."""
        if mode not in MODES[1:]:
            raise ValueError(f"state cache mode must be 'prefix' or 'semantic' ('off': no cache), got {mode!r}")
        for name, v in (("device_bytes", device_bytes), ("host_bytes", host_bytes), ("disk_bytes", disk_bytes)):
            if not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"state cache {name} must be a byte count >= 0, got {v!r}")
        self.model, self.mode = model, mode
        self.budget = {"device": int(device_bytes), "host": int(host_bytes), "disk": int(disk_bytes)}
        if patterns is not None:
            patterns = [tuple(int(t) for t in p) for p in patterns]
            if any(not p for p in patterns):
                raise ValueError("state cache patterns must be non-empty id sequences")
        else:
            patterns = boundary_patterns(model.tokenizer)
        # a state is *cuttable* when every leaf is per-token (attention K/V only): any prefix
        # of a snapshot is then itself a state, so reuse runs to the first changed token
        # and boundary snapshots add nothing; a fixed-size leaf (a recurrent state) exists
        # only where it was saved, so those models snapshot at the block boundaries
        shapes = jax.eval_shape(lambda: model.new_state(1, 1))
        self.cuttable = all(set(layer) == set(kind_class(model.config.layer_kind(i)).SEQ_AXES)
                            for i, layer in enumerate(shapes))
        self.patterns = patterns if mode == "semantic" and not self.cuttable else []
        self.root = _Node(None, (), 0)
        self._clock = itertools.count(1)
        self._names = itertools.count()
        self.counters = {k: 0 for k in ("lookups", "hits", "misses", "tokens_reused", "tokens_prefilled", "inserts",
                                        "to_host", "to_disk", "dropped", "from_host", "from_disk", "disk_errors")}
        self.hit_kinds: collections.Counter = collections.Counter()  # restores by the node they ended on
        self._hot: _Hot | None = None  # the newest snapshot's whole state (`_keep_hot`)
        self.memory = model.memory  # elastic device budget: the device tier counts as states
        if self.memory is not None:
            self.memory.register(self)
        self.disk_dir = Path(disk_dir).absolute() if disk_dir is not None else None
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
            self._load_disk()

    # ---- what to snapshot ---------------------------------------------------------------
    def boundaries(self, ids: Sequence[int]) -> list[int]:
        """Positions in a prompt after which a snapshot is taken: block ends (semantic
        mode, models with a recurrent state) and the prompt's end."""
        ends = boundary_ends(ids, self.patterns) if self.patterns else []
        return sorted(set(e for e in ends if 0 < e < len(ids)) | {len(ids)})

    # ---- the tree ------------------------------------------------------------------------
    def _nodes(self):
        stack = list(self.root.children)
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children)

    def _walk(self, ids: Sequence[int]) -> _Node:
        """The deepest node whose path spells a prefix of ids (the root if none)."""
        return self._match(ids)[0]

    def _match(self, ids: Sequence[int]) -> tuple[_Node, _Node | None, int]:
        """(deepest node whose path prefixes ids, the child that continues it furthest,
        how many tokens of that child's edge match: 0 if none)."""
        node, ids = self.root, list(ids)
        while True:
            nxt, part, k = None, None, 0
            for c in node.children:
                n = _common(c.edge, ids[node.depth:])
                if n == len(c.edge) and (nxt is None or c.depth > nxt.depth):
                    nxt = c
                elif n > k:
                    part, k = c, n
            if nxt is None:
                return node, part, k
            node = nxt

    def _reuse(self, ids: Sequence[int]) -> tuple[list[_Node], int]:
        """The nodes whose segments a restore joins (root excluded; the last may be used
        in part) and the tokens reused. Whole nodes only, unless the state is cuttable;
        a cut leaves at least one token to prefill (its logits are needed)."""
        node, part, k = self._match(ids)
        path = []
        n = node
        while n is not self.root:
            path.append(n)
            n = n.parent
        path.reverse()
        depth = node.depth
        if self.cuttable and part is not None:
            k = min(k, len(ids) - 1 - node.depth)
            if k > 0:
                path.append(part)
                depth += k
        while path and depth == path[-1].depth and path[-1].kind == "split":
            # a split point has no logits: reuse one token less, so the prefill of the
            # rest gives them (a split exists only on cuttable states, where a cut inside
            # its edge is a state too)
            depth -= 1
            if depth == path[-1].parent.depth:
                path.pop()
        return path, depth

    def _touch(self, node: _Node) -> None:
        while node is not None and node.parent is not None:  # the node first, then its ancestors
            node.used = next(self._clock)
            node = node.parent

    def bytes(self, tier: str) -> int:
        return sum(n.nbytes for n in self._nodes() if n.tier == tier)

    def device_state_bytes(self) -> int:
        return self.bytes("device") + (self._hot.nbytes if self._hot is not None else 0)

    def _room_on_device(self, nbytes: int) -> bool:
        """Under a device-memory budget, make the expert cache yield `nbytes` for the
        device tier; False if even an empty expert cache leaves no room."""
        if self.memory is None:
            return True
        try:
            self.memory.make_room(nbytes, "a state-cache snapshot")
            return True
        except DeviceMemoryError:
            return False

    def stats(self) -> dict:
        nodes = list(self._nodes())
        return {"mode": self.mode, **self.counters, "hit_kinds": dict(self.hit_kinds),
                "entries": {t: sum(n.tier == t for n in nodes) for t in TIERS},
                "bytes": {t: sum(n.nbytes for n in nodes if n.tier == t) for t in TIERS},
                "budget_bytes": dict(self.budget)}

    # ---- reuse ---------------------------------------------------------------------------
    def lookup(self, ids: Sequence[int]) -> int:
        """How many leading tokens of ids a restore would reuse (no side effects)."""
        return self._reuse(ids)[1]

    def restore(self, ids: Sequence[int], capacity: int | None = None) -> tuple[Session, int]:
        """A session holding the deepest cached prefix of ids (empty if none) and that
        prefix's length. Counts the lookup; the rest of ids is for the caller to prefill
        (when the prefix is shorter than ids, the session's logits come from that).
        `capacity`: the restored state's size (default: the next power of two)."""
        path, depth = self._reuse(ids)
        hot = self._hot
        if hot is not None and depth <= len(hot.ids) <= len(ids) and tuple(ids[:len(hot.ids)]) == hot.ids:
            return self._restore_hot(hot, ids, path, capacity)
        for n in path:  # disk -> host -> device (host-tier segments stay there without device room)
            if n.tier == "disk":
                try:
                    self._from_disk(n)
                except Exception as e:  # unreadable: forget it (and what hangs off it), reuse less
                    log.warning("state cache: dropping node %s, its disk copy is unreadable (%s: %s)", n.name,
                                type(e).__name__, e)
                    self.counters["disk_errors"] += 1
                    self._forget(n)
                    return self.restore(ids, capacity)
            if n.tier == "host" and self._room_on_device(n.nbytes):
                self._to_device(n)
        self.counters["lookups"] += 1
        session = self.model.session()
        if not path:
            self.counters["misses"] += 1
            self.counters["tokens_prefilled"] += len(ids)
            return session, 0
        faults.check("restore")
        last = path[-1]
        self._touch(last)
        m = self.model
        cap = capacity or min(m.max_seq_len, bucket(depth + 1, MIN_CAPACITY))
        state = m.new_state(1, cap)
        for i, n in enumerate(path):  # host segments are copied to the device; a cut one is pasted whole
            state = put_segment(m.config, state, jax.tree.map(jax.numpy.asarray, n.segment),
                                jax.numpy.int32(n.parent.depth), last=i == len(path) - 1)
        # after a cut no logits were saved; at least one token is left to prefill, which gives them
        logits = last.logits if depth == last.depth else jax.numpy.zeros(self.model.config.vocab_size, jax.numpy.float32)
        session._adopt(state, list(ids[:depth]), logits, cap)
        self._count_hit(last.kind if depth == last.depth else "cut", depth, len(ids))
        self._enforce()
        return session, depth

    def _count_hit(self, kind: str, depth: int, num_ids: int) -> None:
        self.counters["hits"] += 1
        self.hit_kinds[kind] += 1
        self.counters["tokens_reused"] += depth
        self.counters["tokens_prefilled"] += num_ids - depth

    def _restore_hot(self, hot: _Hot, ids: Sequence[int], path: list[_Node], capacity: int | None):
        """`restore` from the newest snapshot's whole state: one copy, however many
        nodes its path has."""
        m = self.model
        cap = capacity or min(m.max_seq_len, bucket(len(hot.ids) + 1, MIN_CAPACITY))
        state = resize_state(m.config, jax.tree.map(jax.numpy.copy, hot.state), cap)
        session = m.session()
        session._adopt(state, list(hot.ids), hot.logits, cap)
        if path:
            self._touch(path[-1])
        self.counters["lookups"] += 1
        self._count_hit("newest", len(hot.ids), len(ids))
        return session, len(hot.ids)

    def _keep_hot(self, ids: Sequence[int], state: tuple, logits, kind: str) -> None:
        """Keep a copy of the newest snapshot's whole state (one per cache). Restoring a
        node pastes one segment per node on its path, and a long agent session's path is
        dozens of nodes; the conversation that just ran is the likeliest to come back
        (its next turn, or its idle re-prefill), and this restores it with one copy.
        Not for a block boundary inside a prompt (the prompt's own end follows in the
        same prefill), nor again for the ids it holds; skipped when it does not fit the
        device tier's budget or the device memory."""
        if kind == "boundary" or (self._hot is not None and self._hot.ids == tuple(ids)):
            return
        self._hot = None  # the previous one goes first
        nbytes = tree_bytes(state) + tree_bytes(logits)
        if nbytes > self.budget["device"] or not self._room_on_device(nbytes):
            return
        self._hot = _Hot(tuple(int(t) for t in ids), jax.tree.map(jax.numpy.copy, state),
                         jax.numpy.array(logits), nbytes)

    def prefill(self, ids: Sequence[int]) -> tuple[Session, int]:
        """`restore`, then prefill the rest of ids, taking a snapshot at every boundary and
        at the end -> (session holding ids, tokens reused). The Python API's form of what
        the server's scheduler does chunk by chunk."""
        arr = self.model.check_ids(ids)
        session, reused = self.restore(arr)
        done = reused
        for end in self.boundaries(arr):
            if end > done:
                session.append(arr[done:end])
                done = end
                self.insert(session, "prompt" if end == arr.size else "boundary")
        return session, reused

    def warmup(self, capacities: Sequence[int]) -> None:
        """Compile the cut and paste of every segment size into states of these
        capacities (otherwise the first request of each size pays for it)."""
        m = self.model
        for cap in capacities:
            state = m.new_state(1, cap)
            size = bucket(1)
            while size <= cap:
                seg = take_segment(m.config, state, jax.numpy.int32(0), size=size)
                for last in (False, True):
                    state = put_segment(m.config, state, seg, jax.numpy.int32(0), last=last)
                size *= 2
            jax.block_until_ready(state)

    # ---- snapshots -------------------------------------------------------------------------
    def insert(self, session: Session, kind: str = "request") -> bool:
        """Snapshot `session` at its position (pending token fed first); False if that
        exact prefix is cached already (then it is only marked as used)."""
        session._flush()
        ids = session.ids
        if not ids:
            raise ValueError("the session is empty: nothing to cache")
        return self.insert_state(ids, session._state, session._next_logits[0], kind)

    def insert_state(self, ids: Sequence[int], state: tuple, logits, kind: str) -> bool:
        """Snapshot a batch-1 state that holds exactly `ids` (its capacity may be larger)
        with the logits [V] after the last one."""
        ids = [int(t) for t in ids]
        parent, part, k = self._match(ids)
        if self.cuttable and part is not None and k > 0:  # radix split: the shared part of part's edge
            parent = self._split(part, k)
        if parent.depth == len(ids):
            if parent.kind == "split":  # a prompt ends at a split point: it gets logits now
                if parent.tier == "disk":
                    self._from_disk(parent)
                parent.kind = kind
                parent.logits = jax.numpy.array(logits) if parent.tier == "device" else np.asarray(logits)
                parent.nbytes += tree_bytes(parent.logits)
            self._touch(parent)
            self._keep_hot(ids, state, logits, kind)
            return False
        seg = take_segment(self.model.config, state, jax.numpy.int32(parent.depth), size=bucket(len(ids) - parent.depth))
        node = _Node(parent, tuple(ids[parent.depth:]), len(ids), kind, segment=seg, logits=jax.numpy.array(logits),
                     name=f"n{next(self._names):06d}")
        node.nbytes = tree_bytes(seg) + tree_bytes(node.logits)
        if not self._room_on_device(node.nbytes):
            self._to_host(node)
        parent.children.append(node)
        self._touch(node)
        self.counters["inserts"] += 1
        self._enforce()
        self._keep_hot(ids, state, logits, kind)
        return True

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut child's edge after k tokens (cuttable states): a new node between child and
        its parent holds the first k (no logits), child keeps the rest. -> the new node."""
        if child.tier == "disk":
            self._from_disk(child)
        cfg, parent = self.model.config, child.parent
        mid = _Node(parent, child.edge[:k], parent.depth + k, "split", children=[child], tier=child.tier,
                    used=child.used, name=f"n{next(self._names):06d}")
        seg = jax.tree.map(jax.numpy.asarray, child.segment)
        mid.segment = take_segment(cfg, seg, jax.numpy.int32(0), size=bucket(k))
        child.segment = take_segment(cfg, seg, jax.numpy.int32(k), size=bucket(len(child.edge) - k))
        if child.tier == "host":
            mid.segment, child.segment = jax.device_get((mid.segment, child.segment))
        child.edge, child.parent = child.edge[k:], mid
        parent.children[parent.children.index(child)] = mid
        for n in (mid, child):
            n.nbytes = tree_bytes(n.segment) + tree_bytes(n.logits)
        return mid

    # ---- tiers ---------------------------------------------------------------------------------
    def _from_disk(self, n: _Node) -> None:
        faults.check("disk_read")
        snap = Snapshot.load(self.disk_dir / n.name)
        if snap.ids != n.ids():
            raise ValueError(f"{self.disk_dir / n.name} holds other tokens than its place in the tree")
        n.segment, n.tier = snap.state, "host"
        n.logits = None if n.kind == "split" else snap.next_logits  # a split point has none
        n.nbytes = tree_bytes(n.segment) + tree_bytes(n.logits)
        self._delete_disk(n)
        self.counters["from_disk"] += 1

    def _to_device(self, n: _Node) -> None:
        n.segment, n.logits = jax.tree.map(jax.numpy.asarray, (n.segment, n.logits))
        n.tier = "device"
        self.counters["from_host"] += 1

    def _to_host(self, n: _Node) -> None:
        n.segment, n.logits = jax.device_get((n.segment, n.logits))
        n.tier = "host"
        self.counters["to_host"] += 1

    def _to_disk(self, n: _Node) -> None:
        """Write n's folder; on any failure no half-written folder stays and n is unchanged."""
        # a split point has no logits: a one-value stand-in (orbax writes no empty array), dropped on reading
        host = jax.device_get(n.segment), np.asarray(n.logits if n.logits is not None else np.zeros(1, np.float32))
        path = self.disk_dir / n.name
        try:
            faults.check("snapshot_write")
            if path.exists():
                shutil.rmtree(path)
            Snapshot(host[0], n.ids(), host[1], self.model.fingerprint).save(path)
            (path / "node.json").write_text(json.dumps({"start": n.parent.depth, "kind": n.kind, "used": n.used}))
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        n.segment, n.logits, n.tier = None, None, "disk"
        self.counters["to_disk"] += 1

    def _delete_disk(self, n: _Node) -> None:
        shutil.rmtree(self.disk_dir / n.name, ignore_errors=True)

    def _drop(self, n: _Node) -> None:
        if n.tier == "disk":
            self._delete_disk(n)
        n.parent.children.remove(n)
        n.segment = n.logits = None
        self.counters["dropped"] += 1

    def _forget(self, n: _Node) -> None:
        """Drop n and every node below it (their segments continue n's)."""
        for child in list(n.children):
            self._forget(child)
        self._drop(n)

    def _enforce(self) -> None:
        """Bring every tier within its budget, least recently used first."""
        for tier, lower in (("device", "host"), ("host", "disk"), ("disk", None)):
            if lower == "disk" and self.disk_dir is None:
                lower = None
            nodes = sorted((n for n in self._nodes() if n.tier == tier), key=lambda n: n.used)
            total = sum(n.nbytes for n in nodes)
            for n in nodes:
                if total <= self.budget[tier]:
                    break
                if n not in n.parent.children:  # forgotten above, with an ancestor
                    continue
                if lower is None and n.children:  # not a leaf: its descendants need it
                    continue
                total -= n.nbytes
                if lower == "host":
                    self._to_host(n)
                elif lower == "disk":
                    try:
                        self._to_disk(n)
                    except Exception as e:  # the budget holds all the same: the node goes
                        log.warning("state cache: node %s not written to disk (%s: %s); dropped", n.name,
                                    type(e).__name__, e)
                        self.counters["disk_errors"] += 1
                        self._forget(n)
                else:
                    self._drop(n)
        if self.memory is not None:
            self.memory.rebalance()

    # ---- persistence ------------------------------------------------------------------------------
    def close(self) -> None:
        """Write every device and host node to the disk tier (if any): a new cache on the
        same folder resumes them."""
        if self.disk_dir is None:
            return
        for n in sorted(self._nodes(), key=lambda n: n.depth):
            if n.tier != "disk" and n.parent is not None and (n.parent is self.root or n.parent.tier == "disk"):
                try:
                    self._to_disk(n)
                except Exception as e:  # what is below it is useless on disk without it
                    log.warning("state cache: node %s not persisted (%s: %s)", n.name, type(e).__name__, e)
                    self.counters["disk_errors"] += 1

    def _load_disk(self) -> None:
        """Rebuild the tree from the disk folder: nodes of this model whose parent is there."""
        found = []
        for path in sorted(self.disk_dir.iterdir()):
            try:
                meta = json.loads((path / "snapshot.json").read_text())
                node_meta = json.loads((path / "node.json").read_text())
            except (OSError, ValueError):
                continue  # not a node folder (or a half-written one)
            if meta.get("fingerprint") != self.model.fingerprint:
                continue
            found.append((len(meta["ids"]), path.name, [int(t) for t in meta["ids"]], node_meta))
        for depth, name, ids, node_meta in sorted(found):
            parent = self._walk(ids[:node_meta["start"]])
            if parent.depth != node_meta["start"]:
                continue  # its parent is gone: the segment alone is useless
            node = _Node(parent, tuple(ids[parent.depth:]), depth, node_meta.get("kind", "prompt"), tier="disk",
                         name=name, used=int(node_meta.get("used", 0)))
            node.nbytes = sum(f.stat().st_size for f in (self.disk_dir / name).rglob("*") if f.is_file())
            parent.children.append(node)
        nums = [int(n.name[1:]) for n in self._nodes() if n.name[1:].isdigit()]
        self._names = itertools.count(max(nums, default=-1) + 1)
        self._clock = itertools.count(max((n.used for n in self._nodes()), default=0) + 1)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two id sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
