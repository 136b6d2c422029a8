"""Routing traces: which experts each MoE layer selected, record by record.

A trace is the sequence of routing decisions a run made, one record per
(step, MoE layer) in execution order -- exactly what the runtime's
`Model.expert_log()` returns:

    {"step": int, "layer": int, "phase": "prefill" | "decode", "selected": [ids]}

`layer` is the MoE-layer index 0..num_layers-1 (dense layers are not counted) and
`selected` the sorted unique expert ids of that record (the union over the tokens of
the step). Extra fields of the runtime log ("hits", "fetched", "host") are accepted
and dropped: a trace is the routing only, so every cache policy can be replayed on it.

Design: the records are stored column-wise (step, layer, phase code per record) with
the ragged expert ids flattened into one array plus offsets, so a 100k-record trace
is a few numpy arrays and saves to a small compressed `.npz`. `rows()` is the fast
iterator the simulators use; `records()` gives back the runtime's dict form.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

PHASES = ("prefill", "decode")  # phase code = index in this tuple


@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
    """A routing trace over `num_layers` MoE layers of `num_experts` experts each.

    Columns (R records, N selections in total):
      step    [R] int64   decode step / prefill chunk index
      layer   [R] int64   MoE-layer index
      phase   [R] uint8   index into PHASES
      offsets [R+1] int64 record i selected ids[offsets[i]:offsets[i+1]]
      ids     [N] int64   expert ids, sorted and unique within a record
    `meta` holds free-form descriptions (model, text, top_k, ...), JSON-serialisable.
    """

    num_layers: int
    num_experts: int
    step: np.ndarray
    layer: np.ndarray
    phase: np.ndarray
    offsets: np.ndarray
    ids: np.ndarray
    meta: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        num_records = len(self.step)
        if not (len(self.layer) == len(self.phase) == num_records):
            raise ValueError("step, layer and phase must have one entry per record")
        if len(self.offsets) != num_records + 1 or self.offsets[0] != 0:
            raise ValueError("offsets must have num_records + 1 entries starting at 0")
        if self.offsets[-1] != len(self.ids) or np.any(np.diff(self.offsets) < 0):
            raise ValueError("offsets must be non-decreasing and end at len(ids)")
        if num_records and (self.layer.min() < 0 or self.layer.max() >= self.num_layers):
            raise ValueError(f"layer ids must lie in [0, {self.num_layers})")
        if len(self.ids) and (self.ids.min() < 0 or self.ids.max() >= self.num_experts):
            raise ValueError(f"expert ids must lie in [0, {self.num_experts})")
        if num_records and self.phase.max() >= len(PHASES):
            raise ValueError("unknown phase code")

    # -- construction --------------------------------------------------------------

    @classmethod
    def from_records(
        cls,
        records: Iterable[Mapping[str, Any]],
        num_layers: int,
        num_experts: int,
        meta: Mapping[str, Any] | None = None,
    ) -> "Trace":
        """Build a trace from runtime-style dict records (extra keys are ignored)."""
        steps, layers, phases, offsets, chunks = [], [], [], [0], []
        for rec in records:
            selected = np.unique(np.asarray(rec["selected"], dtype=np.int64))
            steps.append(int(rec["step"]))
            layers.append(int(rec["layer"]))
            phases.append(PHASES.index(rec.get("phase", "decode")))
            chunks.append(selected)
            offsets.append(offsets[-1] + len(selected))
        ids = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
        return cls(
            num_layers=int(num_layers),
            num_experts=int(num_experts),
            step=np.asarray(steps, np.int64),
            layer=np.asarray(layers, np.int64),
            phase=np.asarray(phases, np.uint8),
            offsets=np.asarray(offsets, np.int64),
            ids=ids.astype(np.int64),
            meta=dict(meta or {}),
        )

    # -- access --------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.step)

    @property
    def num_selections(self) -> int:
        return len(self.ids)

    def selected(self, i: int) -> np.ndarray:
        """Sorted unique expert ids of record i."""
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    def rows(self) -> Iterator[tuple[int, int, str, np.ndarray]]:
        """Yield (step, layer, phase, selected ids) per record, in order."""
        steps, layers, phases = self.step.tolist(), self.layer.tolist(), self.phase.tolist()
        offs = self.offsets.tolist()
        for i in range(len(steps)):
            yield steps[i], layers[i], PHASES[phases[i]], self.ids[offs[i] : offs[i + 1]]

    def records(self) -> list[dict]:
        """The runtime's dict form: [{"step", "layer", "phase", "selected"}, ...]."""
        return [
            {"step": s, "layer": l, "phase": p, "selected": sel.tolist()}
            for s, l, p, sel in self.rows()
        ]

    def flat_ids(self) -> np.ndarray:
        """Global expert ids layer * num_experts + expert, one per selection.  # [N]"""
        record_of = np.repeat(np.arange(len(self)), np.diff(self.offsets))
        return self.layer[record_of] * self.num_experts + self.ids

    # -- selection -----------------------------------------------------------------

    def subset(self, keep: np.ndarray) -> "Trace":
        """The records where the boolean mask `keep` [R] is true, order preserved."""
        keep = np.asarray(keep, bool)
        lengths = np.diff(self.offsets)[keep]
        id_mask = np.repeat(keep, np.diff(self.offsets))
        return dataclasses.replace(
            self,
            step=self.step[keep],
            layer=self.layer[keep],
            phase=self.phase[keep],
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            ids=self.ids[id_mask],
            meta=dict(self.meta),
        )

    def filter(self, phase: str) -> "Trace":
        """Only the records of one phase ("prefill" or "decode")."""
        return self.subset(self.phase == PHASES.index(phase))

    def decode_only(self) -> "Trace":
        return self.filter("decode")

    # -- persistence ---------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write a compressed .npz (ids stored in the smallest unsigned dtype)."""
        id_dtype = np.uint8 if self.num_experts <= 256 else np.uint16
        if self.num_experts > 65536:
            id_dtype = np.uint32
        np.savez_compressed(
            path,
            num_layers=np.int64(self.num_layers),
            num_experts=np.int64(self.num_experts),
            step=self.step.astype(np.int32),
            layer=self.layer.astype(np.uint16),
            phase=self.phase.astype(np.uint8),
            offsets=self.offsets.astype(np.int64),
            ids=self.ids.astype(id_dtype),
            meta=np.array(json.dumps(self.meta)),
        )

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        with np.load(path, allow_pickle=False) as f:
            return cls(
                num_layers=int(f["num_layers"]),
                num_experts=int(f["num_experts"]),
                step=f["step"].astype(np.int64),
                layer=f["layer"].astype(np.int64),
                phase=f["phase"].astype(np.uint8),
                offsets=f["offsets"].astype(np.int64),
                ids=f["ids"].astype(np.int64),
                meta=json.loads(str(f["meta"])),
            )
