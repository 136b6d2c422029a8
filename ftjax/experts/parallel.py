"""Expert parallelism: the executor run on every device of a mesh, each device on the
experts it owns (e % P == its index), with its own cache and bookkeeping.

    x [N, D], ids / weights [N, K]  (replicated: every device ran attention and the router)
        │ shard_map over the "expert" axis
        ▼ device d: ids of experts it does not own -> -1 (no expert)
    Executor(layer, x, mine, ...) with device d's state: hit / miss / victims / slot
    remap inside the step, its cache slots, its misses to the host boundary (the one
    host pool), its q table (q* from the same B_P / B_H: each device has its own link)
        │ partial y_d [N, D]
        ▼ psum over the axis (an all-reduce XLA emits from the sharding)
    y [N, D] replicated

The per-device state is the single-device executor's state with a leading axis [P]
(placed with `Placement.per_device`), so every rule, test and oracle of
`experts.executor` holds per device; only the partition of experts is new. Each device
caches `slots` experts (the cache budget is per device). The telemetry log comes back
per device [P, Lm, E] and merges into [Lm, E] (each expert's code is written only by its
owner).

An expert's contribution is summed on its owner and the partial sums are added across
devices, so logits differ from one device's by float reordering only (a test holds them
to rel 1e-5 and the greedy tokens equal).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from ftjax.experts.executor import Executor
from ftjax.experts.policy import static_residents
from ftjax.placement import AXIS, Placement


class ExpertParallel:
    """An `Executor` over a mesh (module docstring); quacks like one to the steps."""

    def __init__(self, local: Executor, placement: Placement, frequency: np.ndarray | None = None):
        if placement.mesh is None:
            raise ValueError("expert parallelism needs a mesh (Placement with devices)")
        if local.host_pair is not None:
            raise ValueError("the host start / finish pair is not available with several devices yet")
        self.local, self.placement = local, placement
        self.size = placement.size
        # what the model and the steps read off an executor
        self.policy, self.num_layers, self.num_experts = local.policy, local.num_layers, local.num_experts
        self.slots, self.host_pair = local.slots, None
        owner = placement.owner(local.num_experts)
        if local.slots and local.policy.initial != "empty":
            ranked = static_residents(local.policy, local.slots * self.size, local.num_layers, local.num_experts,
                                      frequency)
            self.residents = [ranked[owner[ranked % local.num_experts] == d] for d in range(self.size)]
        else:
            self.residents = [None] * self.size

    def init_state(self, pool_parts: dict[str, np.ndarray], capacity: int | None = None) -> dict[str, Any]:
        """Every device's fresh state, stacked: leaves [P, ...]."""
        states = [self.local.init_state(pool_parts, capacity, residents=r) for r in self.residents]
        return jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)

    def fresh_codes(self) -> jax.Array:
        return jnp.zeros((self.size, self.num_layers, self.num_experts), jnp.int8)

    def merged_codes(self, codes: jax.Array) -> jax.Array:
        return jnp.max(codes, axis=0)

    def q_leaf(self, table: np.ndarray) -> np.ndarray:
        return np.broadcast_to(table, (self.size, *table.shape)).copy()

    def __call__(self, layer: int, x, ids, weights, valid, state, pool):
        """x [N, D], ids / weights [N, K], valid [N], state leaves [P, ...] -> y [N, D], state."""
        P = self.size

        def on_device(x, ids, weights, valid, state, pool):
            d = jax.lax.axis_index(AXIS)
            mine = jnp.where((ids >= 0) & (ids % P == d), ids, -1)
            y, state = self.local(layer, x, mine, weights, valid, jax.tree.map(lambda a: a[0], state), pool)
            y = jax.lax.psum(y.astype(jnp.float32), AXIS).astype(x.dtype)
            return y, jax.tree.map(lambda a: a[None], state)

        split = jax.tree.map(lambda _: PartitionSpec(AXIS), state)
        every = PartitionSpec()
        return jax.shard_map(on_device, mesh=self.placement.mesh, in_specs=(every, every, every, every, split, every),
                             out_specs=(every, split), check_vma=False)(x, ids, weights, valid, state, pool)
