"""Checkpoints of a step's state that restore under any plan and mesh (orbax-checkpoint).

A checkpoint holds the state a step takes (NNX graph nodes such as ``(model, optimizer)``,
or the plain pytrees of a functional step) as one flat dict of arrays named by their paths,
so it does not depend on how the state was sharded when saved. Each process writes its own
shards, nothing is gathered to one device; ``restore`` reads each shard straight into the
*target* plan's sharding, so a state saved under ``fsdp`` on a 2x4 mesh resumes under
``dp_tp`` on 1x8.

A directory holds orbax step folders (``0``, ``1``, ...). ``save`` writes the next one
(orbax writes into a temporary folder and renames it when complete) and only then deletes
the previous one, so saving over the checkpoint a run resumed from never leaves the
directory without a complete checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from spmd.api import eval_shape
from spmd.errors import CheckpointError, PlanError
from spmd.plan import Plan
from spmd.trace.signature import flatten_step_args

__all__ = ["is_checkpoint", "restore", "save"]


def _manager(directory: Path, create: bool) -> ocp.CheckpointManager:
    """One checkpoint kept per directory. Saving (``create=True``) first deletes what an
    interrupted save left; ``create=False`` leaves the disk untouched."""
    options = ocp.CheckpointManagerOptions(max_to_keep=1, create=create,
                                           cleanup_tmp_directories=create)
    return ocp.CheckpointManager(directory, options=options,
                                 item_handlers=ocp.StandardCheckpointHandler())


def _absolute(directory: str | os.PathLike) -> Path:
    return Path(directory).expanduser().absolute()  # orbax requires absolute paths


def _named_leaves(state: tuple) -> tuple[list[str], list[Any], Any]:
    """The state's flat leaves in the order a step's plan lists them (``flatten_step_args``),
    each named ``<position in state>/<path>``, e.g. ``1/opt_state/0/mu/embed/wte``."""
    leaves, treedef = flatten_step_args(state)  # (the nodes' nnx.State, the plain pytrees)
    nodes = [i for i, x in enumerate(state) if isinstance(x, nnx.Pytree)]
    positions = (nodes, [i for i in range(len(state)) if i not in nodes])
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(treedef, leaves))[0]:
        (part, index), rest = (_key(k) for k in path[:2]), path[2:]
        if part == 0 and rest and getattr(rest[-1], "name", None) == "value":
            rest = rest[:-1]  # a graph node's Variable: its array is its `.value`
        inner = jax.tree_util.keystr(rest, simple=True, separator="/")
        names.append("/".join(filter(None, [str(positions[part][index]), inner])))
    return names, leaves, treedef


def _key(entry: Any) -> Any:
    """A path entry's index or dict key (nnx.State keys its nodes by int DictKeys)."""
    return entry.idx if isinstance(entry, jax.tree_util.SequenceKey) else entry.key


def save(directory: str | os.PathLike, *state: Any) -> None:
    """Save a step's state (``save(dir, model, optimizer)``; for a functional step its
    pytrees) as it is sharded. A checkpoint already in ``directory`` is replaced only once
    the new one is complete. In multi-process runs every process calls it."""
    if not state:
        raise CheckpointError(f"{directory}: nothing to save; pass the step's state, "
                              "e.g. save_checkpoint(directory, model, optimizer)")
    names, leaves, _ = _named_leaves(state)
    with _manager(_absolute(directory), create=True) as manager:
        latest = manager.latest_step()
        manager.save(0 if latest is None else latest + 1,
                     args=ocp.args.StandardSave(dict(zip(names, leaves))))
        manager.wait_until_finished()


def is_checkpoint(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a complete checkpoint (``save`` wrote one)."""
    with _manager(_absolute(directory), create=False) as manager:
        return manager.latest_step() is not None


def _stored(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype as orbax stores a leaf: a typed PRNG key as its key data."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.eval_shape(jax.random.key_data, leaf)
    return tuple(leaf.shape), np.dtype(leaf.dtype)


def _check_matches(directory: Path, stored: dict[str, Any], names: list[str],
                   leaves: list[Any]) -> None:
    """Raise, naming the first tensor whose shape or dtype differs or that only one side has."""
    wanted = {n: _stored(leaf) for n, leaf in zip(names, leaves)}
    saved = {n: (tuple(m.shape), np.dtype(m.dtype)) for n, m in stored.items()}
    wrong = [n for n in names if saved.get(n) != wanted[n]] + [n for n in saved if n not in wanted]
    if not wrong:
        return
    name = wrong[0]

    def show(entry):
        return "absent" if entry is None else f"{entry[0]} {entry[1].name}"

    more = f" ({len(wrong) - 1} more tensors differ)" if len(wrong) > 1 else ""
    raise CheckpointError(
        f"{directory}: the checkpoint does not match the state create_fn builds: tensor "
        f"{name} is {show(saved.get(name))} in the checkpoint, {show(wanted.get(name))} from "
        f"create_fn{more}; restore it with the create_fn of the model it was saved from")


def restore(directory: str | os.PathLike, create_fn: Callable[[], Any], plan: Plan) -> Any:
    """The state ``create_fn`` would build (as for ``spmd.materialize``: the step's leading
    arguments, a tuple for several), its values read from the checkpoint in ``directory``
    directly into ``plan``'s input shardings, whatever plan and mesh it was saved under.

    Raises ``CheckpointError`` if the directory holds no checkpoint or one whose tensors'
    names, shapes or dtypes differ from ``create_fn``'s; nothing is written either way.
    """
    path = _absolute(directory)
    abstract = eval_shape(create_fn)
    state = abstract if isinstance(abstract, tuple) else (abstract,)
    names, leaves, treedef = _named_leaves(state)
    shardings = plan.input_shardings_flat()[: len(leaves)]
    for name, leaf, planned in zip(names, leaves, plan.leaves):
        if tuple(leaf.shape) != tuple(planned.shape):
            raise PlanError(
                f"create_fn's tensor {name} has shape {tuple(leaf.shape)} but the plan's "
                f"input {planned.path} has {planned.shape}: pass the plan of this step")
    with _manager(path, create=False) as manager:
        step = manager.latest_step()
        if step is None:
            raise CheckpointError(f"{path}: no checkpoint here (spmd.save_checkpoint writes "
                                  "one; spmd.is_checkpoint tells)")
        _check_matches(path, manager.item_metadata(step), names, leaves)
        target = {n: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s)
                  for n, leaf, s in zip(names, leaves, shardings)}
        values = manager.restore(step, args=ocp.args.StandardRestore(target))
    node_state, trees = jax.tree.unflatten(treedef, [values[n] for n in names])
    nodes = [i for i, x in enumerate(state) if isinstance(x, nnx.Pytree)]
    made = dict(zip([i for i in range(len(state)) if i not in nodes], trees))
    if nodes:
        graphdef = nnx.split(tuple(state[i] for i in nodes))[0]
        made.update(zip(nodes, nnx.merge(graphdef, node_state)))
    return tuple(made[i] for i in range(len(state))) if isinstance(abstract, tuple) else made[0]
