"""Where a model's arrays live: one device, or a mesh of devices with the experts split
among them (expert parallelism).

    one device     every array on `jax.devices()[0]` (`host.sharding`), as always
    a mesh         one axis, "expert", over the chosen devices:
                     replicated   dense weights, attention, the K/V and recurrent states,
                                  the host pool's view (zero-copy aliases of the one host
                                  copy on the CPU backend): every device runs attention
                     per device   the expert executor's state (cache slots, slot table,
                                  stamps, q table: leading axis [P]): each device owns the
                                  experts e with e % P == its index, and caches and
                                  bookkeeps only those (`experts.parallel`)

Replicating attention and splitting experts is the layout that needs one collective per
MoE layer (a sum of the devices' partial outputs, which XLA emits from the sharding: an
all-reduce); splitting attention by heads as well would add two more per layer. Data,
not code paths: the model asks its `Placement` for a sharding and gets the one-device or
the mesh answer.

Several processes (`jax.distributed`) give the same mesh over every process's devices;
see `ftjax.distributed`. Host values reach it through `put`: each process gives its
own devices their part, with no cross-process traffic (`jax.device_put` would first
check that every process passed the same value: an all-gather of all of it, which for
the expert pool is every byte, and which must not differ: each process loads only the
experts its devices own).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ftjax.host import memory_kinds, sharding

AXIS = "expert"


@dataclasses.dataclass(frozen=True)
class Placement:
    mesh: Mesh | None = None  # None: one device

    @property
    def size(self) -> int:
        """Devices the experts are split over (P)."""
        return 1 if self.mesh is None else int(self.mesh.size)

    def replicated(self, memory_kind: str = "device") -> jax.sharding.Sharding:
        """Every device holds the whole array."""
        if self.mesh is None:
            return sharding(memory_kind)
        return NamedSharding(self.mesh, PartitionSpec(), memory_kind=_kind(memory_kind))

    def per_device(self, memory_kind: str = "device") -> jax.sharding.Sharding:
        """Axis 0 split over the devices: [P, ...] -> one row each (one device: whole)."""
        if self.mesh is None:
            return sharding(memory_kind)
        return NamedSharding(self.mesh, PartitionSpec(AXIS), memory_kind=_kind(memory_kind))

    def put(self, tree, sharding: jax.sharding.Sharding):
        """Host values (numpy or single-device arrays) onto `sharding`, one of this
        placement's. One process: `jax.device_put` (zero-copy for aligned numpy on the CPU
        backend). Several: each process's devices get their part of this process's values
        (`jax.make_array_from_callback`), trusted to agree where they must (the SPMD
        program computed them alike) and free to differ where no device of this process
        reads them (another process's experts)."""
        if jax.process_count() == 1:
            return jax.device_put(tree, sharding)

        def one(x):
            if isinstance(x, jax.core.Tracer):  # traced (jax.eval_shape): only its shape matters
                return jax.device_put(x, sharding)
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
        return jax.tree.map(one, tree)

    def owner(self, num_experts: int) -> np.ndarray:
        """owner [E]: the device index that owns each expert (e % P)."""
        return np.arange(num_experts) % self.size

    def local_experts(self, num_experts: int) -> np.ndarray:
        """bool [E]: the experts a device of this process owns (every one with one process)."""
        if self.mesh is None:
            return np.ones(num_experts, bool)
        mine = [d for d, dev in enumerate(self.mesh.devices.flat) if dev.process_index == jax.process_index()]
        return np.isin(self.owner(num_experts), mine)

    def describe(self) -> list[str]:
        """The devices, in axis order, by name."""
        return [str(d) for d in ([jax.devices()[0]] if self.mesh is None else self.mesh.devices.flat)]


def _kind(memory_kind: str) -> str | None:
    return memory_kind if memory_kind in memory_kinds() else None


def placement_for(devices: int | list | None) -> Placement:
    """devices: None or 1 (one device), a count (the first that many of `jax.devices()`,
    every process's under `jax.distributed`), or a list of devices."""
    if devices is None:
        return Placement()
    available = jax.devices()
    if isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        if not 1 <= devices <= len(available):
            raise ValueError(f"devices must be in 1..{len(available)} (the devices JAX sees: "
                             f"{[str(d) for d in available]}), got {devices}")
        if devices == 1 and jax.process_count() == 1:
            return Placement()
        chosen = available[:devices]
    elif isinstance(devices, (list, tuple)) and devices and all(isinstance(d, jax.Device) for d in devices):
        chosen = list(devices)
    else:
        raise ValueError(f"devices must be a device count or a list of jax devices, got {devices!r}")
    return Placement(Mesh(np.array(chosen), (AXIS,)))
