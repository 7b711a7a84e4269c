"""A user's train step made pure and flat, with every input leaf named and classified.

The user hands either a pure JAX function of pytrees, e.g. ``(params, opt_state, batch) ->
(params, opt_state, metrics)``, or a Flax NNX step ``(model, optimizer, batch) -> metrics``
that mutates its graph nodes. Both become one function of a flat list of arrays; each input
leaf gets a readable path, a kind (param, optimizer, batch, state) and its logical axis names,
so a plan (hand-written or searched) can be expressed leaf by leaf.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from spmd.dtypes import storage_dtype
from spmd.errors import PlanError
from spmd.sharding import Spec, from_partition_spec

KINDS = ("param", "optimizer", "batch", "state")
Logical = tuple  # tuple[str | None, ...]: one logical name (or None) per dimension


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One input array of the step as the planner sees it."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    kind: str
    logical: Logical | None = None  # logical axis names, one per dim
    pinned: Spec | None = None  # a spec the user fixed (explicit PartitionSpec)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def _keystr(path: tuple) -> str:
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def _arg_names(fn: Callable, count: int) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [names[i] if i < len(names) else f"arg{i}" for i in range(count)]


def _is_node(x: Any) -> bool:
    return isinstance(x, nnx.Pytree)


def _aval(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))


def flatten_step_args(args: Sequence[Any]) -> tuple[list[Any], Any]:
    """The flat leaves and structure of a step's arguments: the NNX graph nodes' state first
    (one ``nnx.State`` over all of them), then the plain pytrees, in argument order."""
    nodes = tuple(a for a in args if _is_node(a))
    trees = tuple(a for a in args if not _is_node(a))
    return jax.tree.flatten((nnx.state(nodes) if nodes else None, trees))


def _is_logical_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (tuple, PartitionSpec))


class StepSignature:
    """The flat, pure form of one train step for one set of argument shapes.

    ``flat_fn(*leaves) -> flat outputs``. For NNX steps the first outputs are the new state of
    the graph nodes (same order as their input leaves), then the user's return value.
    """

    def __init__(self, step_fn: Callable, args: Sequence[Any], *,
                 logical_axes: Any = None, batch_argnums: Sequence[int] = (-1,)) -> None:
        self.step_fn = step_fn
        self.num_args = len(args)
        names = _arg_names(step_fn, len(args))
        self.batch_argnums = {i % len(args) for i in batch_argnums} if args else set()
        self.node_positions = [i for i, a in enumerate(args) if _is_node(a)]
        self.tree_positions = [i for i in range(len(args)) if i not in self.node_positions]
        if self.node_positions:
            self.graphdef, state = nnx.split(tuple(args[i] for i in self.node_positions))
        else:
            self.graphdef, state = None, None
        trees = tuple(args[i] for i in self.tree_positions)
        leaves, self.in_treedef = jax.tree.flatten((state, trees))
        self.in_avals = [_aval(x) for x in leaves]
        self.num_state_leaves = len(jax.tree.leaves(state))
        self.leaves = self._classify(args, names, state, logical_axes)
        self._out_treedef = None
        # One trace gives both the output shapes and the jaxpr the planner searches over.
        self.jaxpr, shapes = jax.make_jaxpr(self.flat_fn, return_shape=True)(*self.in_avals)
        self.out_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(shapes)]
        self.output_aliases = self._aliases()

    # -- the pure function ------------------------------------------------------------------
    def flat_fn(self, *leaves: Any) -> tuple[Any, ...]:
        state, trees = jax.tree.unflatten(self.in_treedef, leaves)
        args: list[Any] = [None] * self.num_args
        for pos, tree in zip(self.tree_positions, trees):
            args[pos] = tree
        if self.graphdef is not None:
            nodes = nnx.merge(self.graphdef, state)
            for pos, node in zip(self.node_positions, nodes):
                args[pos] = node
        out = self.step_fn(*args)
        new_state = nnx.state(nodes) if self.graphdef is not None else None
        flat_out, treedef = jax.tree.flatten((new_state, out))
        self._out_treedef = treedef
        return tuple(flat_out)

    def flatten_args(self, args: Sequence[Any]) -> list[Any]:
        """The flat leaves of concrete arguments with the same structure as the example."""
        leaves, treedef = flatten_step_args(args)
        if treedef != self.in_treedef:
            raise PlanError("the arguments' structure differs from the one the step was planned for")
        return leaves

    def unflatten_outputs(self, args: Sequence[Any], flat_out: Sequence[Any]) -> Any:
        """Write new NNX state back into the user's objects; return the user's own result."""
        new_state, out = jax.tree.unflatten(self._out_treedef, flat_out)
        if self.graphdef is not None:
            nnx.update(tuple(args[i] for i in self.node_positions), new_state)
        return out

    def unflatten_inputs(self, flat: Sequence[Any]) -> tuple:
        """Arrange per-leaf values (e.g. shardings) like the example arguments; NNX nodes get
        an ``nnx.State`` of them."""
        state, trees = jax.tree.unflatten(self.in_treedef, flat)
        args: list[Any] = [None] * self.num_args
        for pos, tree in zip(self.tree_positions, trees):
            args[pos] = tree
        for k, pos in enumerate(self.node_positions):
            args[pos] = state[k]
        return tuple(args)

    def unflatten_output_values(self, flat: Sequence[Any]) -> Any:
        """Arrange per-output values (e.g. shardings) like the step's outputs."""
        return jax.tree.unflatten(self._out_treedef, flat)

    # -- classification -----------------------------------------------------------------------
    def _classify(self, args, names, state, logical_axes) -> list[Leaf]:
        out: list[Leaf] = []
        if self.graphdef is not None:
            variables = jax.tree_util.tree_flatten_with_path(
                state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
            specs = jax.tree.leaves(nnx.get_partition_spec(state))
            if len(specs) != len(variables):
                raise PlanError("cannot read the logical axes of the NNX state (metadata mismatch)")
            for (path, var), pspec in zip(variables, specs):
                value = var.get_value() if hasattr(var, "get_value") else var.value
                node_name = names[self.node_positions[path[0].key]]
                kind = ("param" if isinstance(var, nnx.Param) else
                        "optimizer" if isinstance(var, nnx.optimizer.OptState) else "state")
                logical = tuple(pspec) + (None,) * (np.ndim(value) - len(pspec)) if pspec else None
                out.append(Leaf(f"{node_name}/{_keystr(path[1:])}", tuple(np.shape(value)),
                                storage_dtype(jax.numpy.result_type(value)), kind, logical))
        param_names = self._param_names(args, logical_axes)
        for pos in self.tree_positions:
            for path, value in jax.tree_util.tree_flatten_with_path(args[pos])[0]:
                keys = tuple(_keystr((k,)) for k in path)
                shape = tuple(np.shape(value))
                pretty = "/".join((names[pos],) + keys)
                dtype = storage_dtype(jax.numpy.result_type(value))
                if pos in self.batch_argnums:
                    logical = ("batch",) + (None,) * (len(shape) - 1) if shape else None
                    out.append(Leaf(pretty, shape, dtype, "batch", logical))
                    continue
                match = _match_param(keys, shape, param_names, pos)
                if match is None:
                    out.append(Leaf(pretty, shape, dtype, "state", None))
                    continue
                is_param, names_or_spec = match
                kind = "param" if is_param else "optimizer"
                if isinstance(names_or_spec, PartitionSpec):
                    out.append(Leaf(pretty, shape, dtype, kind, None,
                                    from_partition_spec(names_or_spec, len(shape))))
                else:
                    out.append(Leaf(pretty, shape, dtype, kind, names_or_spec))
        return out

    def _param_names(self, args, logical_axes) -> dict | None:
        """Map params-relative key paths to (shape, logical names); find the params argument."""
        if logical_axes is None:
            return None
        ltree, ldef = jax.tree.flatten(logical_axes, is_leaf=_is_logical_leaf)
        for pos in self.tree_positions:
            if pos in self.batch_argnums:
                continue
            if jax.tree.structure(args[pos]) == ldef:
                entries = {}
                for (path, value), names in zip(
                        jax.tree_util.tree_flatten_with_path(args[pos])[0], ltree):
                    keys = tuple(_keystr((k,)) for k in path)
                    shape = tuple(np.shape(value))
                    if names is not None and not isinstance(names, PartitionSpec):
                        names = tuple(names)
                        if len(names) != len(shape):
                            raise PlanError(
                                f"logical_axes for parameter {'/'.join(keys)}: {names} names "
                                f"{len(names)} dimensions but the array has shape {shape}")
                    entries[keys] = (shape, names)
                return {"position": pos, "entries": entries}
        raise PlanError(
            "logical_axes does not match the structure of any argument; it must be a pytree of "
            "tuples of logical names (or PartitionSpecs) with the same structure as the parameters")

    def _aliases(self) -> dict[int, int]:
        """Outputs that are the new value of an input (NNX state; or pure-JAX outputs whose
        subtree repeats an input argument's structure), so steps chain without resharding."""
        aliases: dict[int, int] = {}
        if self.graphdef is not None:
            for i in range(self.num_state_leaves):
                aliases[i] = i
            return aliases
        _, out = jax.tree.unflatten(self._out_treedef, self.out_avals)  # (new NNX state, out)
        outs = out if isinstance(out, tuple) else (out,)
        offsets, start = [], 0
        for item in outs:
            offsets.append(start)
            start += len(jax.tree.leaves(item))
        arg_offsets, start = {}, self.num_state_leaves
        _, trees = jax.tree.unflatten(self.in_treedef, self.in_avals)
        for pos, tree in zip(self.tree_positions, trees):
            arg_offsets[pos] = (start, tree)
            start += len(jax.tree.leaves(tree))
        used = set()
        for item, off in zip(outs, offsets):
            for pos, (arg_off, tree) in arg_offsets.items():
                if pos in used or pos in self.batch_argnums:
                    continue
                if (jax.tree.structure(item) == jax.tree.structure(tree) and
                        [(a.shape, a.dtype) for a in jax.tree.leaves(item)] ==
                        [(a.shape, a.dtype) for a in jax.tree.leaves(tree)]):
                    for k in range(len(jax.tree.leaves(item))):
                        aliases[off + k] = arg_off + k
                    used.add(pos)
                    break
        return aliases


def _match_param(keys: tuple[str, ...], shape: tuple[int, ...], param_names: dict | None,
                 pos: int):
    """(is_param, names) when the leaf is a parameter or an optimizer state that mirrors one:
    its path ends with a parameter's path and the shapes agree."""
    if param_names is None:
        return None
    entries = param_names["entries"]
    if pos == param_names["position"] and keys in entries:
        return True, entries[keys][1]
    for start in range(len(keys)):
        suffix = keys[start:]
        if suffix in entries and entries[suffix][0] == shape:
            return False, entries[suffix][1]
    return None
