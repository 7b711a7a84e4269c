"""A user's train step made pure and flat, with every input leaf named and classified.

The user hands either a pure JAX function of pytrees, e.g. ``(params, opt_state, batch) ->
(params, opt_state, metrics)``, or a Flax NNX step ``(model, optimizer, batch) -> metrics``
that mutates its graph nodes. Both become one function of a flat list of arrays; each input
leaf gets a readable path, a kind (param, optimizer, batch, state) and its logical axis names,
so a plan (hand-written or searched) can be expressed leaf by leaf.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from spmd.dtypes import storage_dtype
from spmd.errors import PlanError, warn

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
    #: a PartitionSpec the user gave in ``logical_axes``: of mesh axes (a pin) or of logical
    #: names (then also in ``logical``); which, only the mesh can tell (``spmd.logical``)
    partition_spec: PartitionSpec | None = None

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


def split_step_args(args: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """A step's NNX graph nodes and its plain pytrees, each in argument order."""
    return (tuple(a for a in args if _is_node(a)), tuple(a for a in args if not _is_node(a)))


def flatten_step_args(args: Sequence[Any]) -> tuple[list[Any], Any]:
    """The flat leaves and structure of a step's arguments: the NNX graph nodes' state first
    (one ``nnx.State`` over all of them), then the plain pytrees, in argument order."""
    nodes, trees = split_step_args(args)
    return jax.tree.flatten((nnx.state(nodes) if nodes else None, trees))


class StepSignature:
    """The flat, pure form of one train step for one set of argument shapes.

    ``flat_fn(*leaves) -> flat outputs``. For NNX steps the first outputs are the new state of
    the graph nodes (same order as their input leaves), then the user's return value.
    """

    def __init__(self, step_fn: Callable, args: Sequence[Any], *,
                 logical_axes: Any = None, batch_argnums: Sequence[int] | None = None) -> None:
        self.step_fn = step_fn
        self.num_args = len(args)
        names = _arg_names(step_fn, len(args))
        self.node_positions = [i for i, a in enumerate(args) if _is_node(a)]
        self.tree_positions = [i for i in range(len(args)) if i not in self.node_positions]
        given = {i % len(args) for i in batch_argnums} if args and batch_argnums is not None else None
        params = _find_params(args, self.tree_positions, logical_axes, given or set())
        self.batch_argnums = given if given is not None else self._find_batch(args, names, params)
        if self.node_positions:
            self.graphdef, state = nnx.split(tuple(args[i] for i in self.node_positions))
        else:
            self.graphdef, state = None, None
        trees = tuple(args[i] for i in self.tree_positions)
        leaves, self.in_treedef = jax.tree.flatten((state, trees))
        self.in_avals = [_aval(x) for x in leaves]
        self.num_state_leaves = len(jax.tree.leaves(state))
        self.leaves = self._classify(args, names, state, params)
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

    @functools.cached_property
    def state_round_trips(self) -> bool:
        """Whether the new NNX state has the input state's structure, Variable metadata
        included: then ``nnx.update`` only replaces each Variable's value, in input order,
        which ``spmd.runtime.nodes`` does without walking the graph. A step that adds a
        Variable (``sow``) or changes metadata does not, and goes through ``nnx.update``."""
        return self.in_treedef.children()[0] == self._out_treedef.children()[0]

    @functools.cached_property
    def _result_treedef(self) -> Any:
        return self._out_treedef.children()[1]

    def unflatten_result(self, flat_out: Sequence[Any]) -> Any:
        """The user's own result from the flat outputs, the new NNX state (the first
        ``num_state_leaves``, when ``state_round_trips``) left to the caller."""
        return jax.tree.unflatten(self._result_treedef, flat_out[self.num_state_leaves:])

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
    def _classify(self, args, names, state, params: "_Params | None") -> list[Leaf]:
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
                match = params.match(pos, keys, shape) if params is not None else None
                if match is None:
                    out.append(Leaf(pretty, shape, dtype, "state", None))
                    continue
                kind, (logical, pspec) = match
                out.append(Leaf(pretty, shape, dtype, kind, logical, pspec))
        return out

    def _find_batch(self, args, names: list[str], params: "_Params | None") -> set[int]:
        """The batch found by what it is: the last plain argument (not the parameters) whose
        arrays all share one leading dimension, keys excluded (a trailing ``rng``)."""
        for pos in reversed(self.tree_positions):
            if (params is None or pos != params.position) and _looks_like_batch(args[pos]):
                return {pos}
        if self.tree_positions:
            warn(f"found no batch among the step's arguments {[names[i] for i in self.tree_positions]}"
                 f" (an argument whose arrays share one leading dimension); it is planned "
                 f"without one. Pass batch_argnums= with the batch's position")
        return set()

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


def _looks_like_batch(tree: Any) -> bool:
    leaves = jax.tree.leaves(tree)
    leading = set()
    for x in leaves:
        dtype = jax.numpy.result_type(x)
        if (np.ndim(x) == 0 or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
                or (dtype == np.uint32 and np.shape(x)[-1:] == (2,))):  # a key, typed or legacy
            return False
        leading.add(np.shape(x)[0])
    return len(leading) == 1


def _is_names(x: Any) -> bool:
    """A ``logical_axes`` entry for one array: None, a PartitionSpec, or a tuple of names."""
    return x is None or isinstance(x, PartitionSpec) or (
        isinstance(x, (tuple, list)) and all(n is None or isinstance(n, str) for n in x))


def _logical_entry(names: Any, path: str, shape: tuple[int, ...]
                   ) -> tuple[Logical | None, PartitionSpec | None]:
    """One array's logical names, padded to its rank (the rest not split), and the
    PartitionSpec they were given as (a PartitionSpec naming nothing names nothing)."""
    if names is None:
        return None, None
    entries = tuple(names)
    if len(entries) > len(shape):
        raise PlanError(f"logical_axes for {path}: {names} names {len(entries)} dimensions but "
                        f"the array has shape {shape}; give at most {len(shape)} (the rest are "
                        f"not split)")
    pad = (None,) * (len(shape) - len(entries))
    if not isinstance(names, PartitionSpec):
        return entries + pad, None
    if all(e is None for e in entries):
        return None, None
    return tuple(e if isinstance(e, str) else None for e in entries) + pad, names


def _subtrees(tree: Any, depth: int = 3):
    """(key path, subtree) of ``tree`` and its nodes, outermost first (where params live:
    an argument itself, or a field of it such as a TrainState's ``params``)."""
    level = [((), tree)]
    for _ in range(depth + 1):
        nxt = []
        for keys, sub in level:
            yield keys, sub
            if sub is None or jax.tree_util.treedef_is_leaf(jax.tree.structure(sub)):
                continue
            children = jax.tree_util.tree_flatten_with_path(sub, is_leaf=lambda y: y is not sub)[0]
            nxt.extend((keys + tuple(_keystr((k,)) for k in path), child)
                       for path, child in children)
        level = nxt


@dataclasses.dataclass(frozen=True)
class _Params:
    """Where the parameters are (an argument, or a subtree of it at ``prefix``) and each one's
    logical names, keyed by its path below ``prefix``."""

    position: int
    prefix: tuple[str, ...]
    entries: dict[tuple[str, ...], tuple[tuple[int, ...], tuple]]

    def match(self, pos: int, keys: tuple[str, ...], shape: tuple[int, ...]):
        """(kind, (logical, partition spec)) for a parameter, or for optimizer state that
        mirrors one (its path ends with the parameter's path, same shape); else None."""
        n = len(self.prefix)
        if pos == self.position and keys[:n] == self.prefix and keys[n:] in self.entries:
            return "param", self.entries[keys[n:]][1]
        for start in range(len(keys)):
            found = self.entries.get(keys[start:])
            if found is not None and found[0] == shape:
                return "optimizer", found[1]
        return None


def _find_params(args: Sequence[Any], positions: Sequence[int], logical_axes: Any,
                 batch: set[int]) -> _Params | None:
    """The argument, or subtree of one, that ``logical_axes`` annotates."""
    if logical_axes is None:
        return None
    for pos in positions:
        if pos in batch:
            continue
        for prefix, sub in _subtrees(args[pos]):
            try:
                pieces = jax.tree.structure(sub).flatten_up_to(logical_axes)
            except (ValueError, TypeError):
                continue
            if not all(_is_names(p) for p in pieces):
                continue
            entries = {}
            for (path, value), names in zip(jax.tree_util.tree_flatten_with_path(sub)[0], pieces):
                keys = tuple(_keystr((k,)) for k in path)
                shape = tuple(np.shape(value))
                entries[keys] = (shape, _logical_entry(names, "/".join(prefix + keys), shape))
            return _Params(pos, prefix, entries)
    raise PlanError(
        "logical_axes does not match the structure of any argument or part of one; it must be "
        "a pytree shaped like the parameters (e.g. a TrainState's params), with a tuple of "
        "logical names, a PartitionSpec or None for each array")
