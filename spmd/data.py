"""Feeding batches per process: each process holds only the rows its devices need."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from spmd.plan import Plan
from spmd.runtime.transfer import absent, holds


def _local_rows(sharding, shape: tuple[int, ...]) -> slice:
    """The contiguous range of dim 0 that this process's devices hold."""
    index_map = sharding.addressable_devices_indices_map(shape)
    if not index_map:  # none of its devices here (another process's pipeline stage)
        return slice(0, 0)
    starts, stops = [], []
    for index in index_map.values():
        rows = index[0] if index else slice(None)
        start, stop, _ = rows.indices(shape[0])
        starts.append(start)
        stops.append(stop)
    return slice(min(starts), max(stops))


def process_local_batch(plan: Plan, batch: Any) -> Any:
    """This process's share of a global batch (unchanged in a single-process run).

    A real input pipeline reads only these rows; the planned step then assembles the global
    array with ``jax.make_array_from_process_local_data``.
    """
    if jax.process_count() == 1:
        return batch
    shardings = plan.input_shardings_flat()
    by_path = {leaf.path: (leaf, sharding) for leaf, sharding in zip(plan.leaves, shardings)
               if leaf.kind == "batch"}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(batch)
    batch_paths = [leaf.path for leaf in plan.leaves if leaf.kind == "batch"]
    if len(batch_paths) != len(leaves):
        raise ValueError("the batch does not match the plan's batch structure")
    local = []
    for path, (_, value) in zip(batch_paths, leaves):
        leaf, sharding = by_path[path]
        value = np.asarray(value)
        local.append(value[_local_rows(sharding, leaf.shape)] if leaf.shape else value)
    return jax.tree.unflatten(jax.tree.structure(batch), local)


def shard_batch(plan: Plan, local_batch: Any) -> Any:
    """Global arrays, in the plan's batch shardings, from each process's rows of the batch.

    In a single-process run ``local_batch`` is the whole batch and this is a device_put.
    """
    shardings = [s for leaf, s in zip(plan.leaves, plan.input_shardings_flat())
                 if leaf.kind == "batch"]
    shapes = [leaf.shape for leaf in plan.leaves if leaf.kind == "batch"]
    leaves = jax.tree.leaves(local_batch)
    if len(leaves) != len(shardings):
        raise ValueError("the batch does not match the plan's batch structure")
    out = [jax.device_put(x, s) if jax.process_count() == 1
           else jax.make_array_from_process_local_data(s, np.asarray(x), shape) if holds(s)
           else absent(shape, np.asarray(x).dtype, s)
           for x, s, shape in zip(leaves, shardings, shapes)]
    return jax.tree.unflatten(jax.tree.structure(local_batch), out)
