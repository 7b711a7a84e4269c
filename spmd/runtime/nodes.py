"""A step's NNX state read and written back without walking the NNX graph on every call.

``nnx.state`` and ``nnx.update`` walk the whole graph (each module, dict and Variable) on
each call: 8 ms each for gpt-tiny's 110 Variables on a 2-core host, as long as the compiled
step. A training loop calls the step on the same objects every time, so what one walk found
(which Variable holds which input leaf) is kept for those objects, and each later call only
checks that the graph is still the one walked:

- the same argument objects, in the same trace context and graph mode;
- every container (module, dict, list, ``nnx.State``, other pytree node) reachable from
  them holding the same children, compared by identity, static attributes included;
- each Variable with the same metadata (part of the state's tree structure, so of the key
  that picks the executable) and a value of the same array type.

Anything else (a submodule added or replaced, a Variable replaced or given new metadata, a
raw array attribute, a Variable holding a ``Ref`` or a pytree) falls back to the walk, as
before. The cache keeps the walked containers and Variables alive but not the argument
objects themselves: when one of those is collected, the entry is dropped.

Flax internals relied on (flax 0.12; a Flax without the modules imported below gets the
walk on every call): a Variable's ``_raw_value`` slot, written as
``nnx.update`` writes it but without its per-Variable trace check (5 us each), and its
``_var_metadata`` dict, read without the copy ``get_metadata`` makes.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import jax
from flax import nnx

try:  # Flax internals (checked on flax 0.12.8): without them every call walks the graph
    from flax.nnx import graphlib, tracers, variablelib
    from flax.nnx.pytreelib import PytreeState

    _FAST = (all(hasattr(nnx.Variable, name) for name in ("get_raw_value", "hijax"))
             and {"_raw_value", "_var_metadata"} <= set(getattr(nnx.Variable, "__slots__", ())))
except ImportError:  # pragma: no cover - a Flax that moved them
    _FAST = False

__all__ = ["NodeState", "NodeStateCache", "StateRead"]

#: a container's children as (keys, values); a sequence's keys are ()
Children = tuple[tuple[Any, ...], tuple[Any, ...]]


def _children(node: Any) -> Children:
    """The children NNX's graph walk reaches from ``node``: a module's attributes (static ones
    too, so that any reassignment is seen), a mapping's items, a sequence's elements."""
    if type(node) is dict:
        return tuple(node), tuple(node.values())
    if isinstance(node, nnx.Pytree):
        attributes = vars(node)
        return tuple(attributes), tuple(attributes.values())
    if isinstance(node, (tuple, list)):
        return (), tuple(node)
    if isinstance(node, nnx.State):
        mapping = node.raw_mapping  # its items() wrap nested dicts in new States each time
        return tuple(mapping), tuple(mapping.values())
    children = graphlib.get_node_impl(node).node_dict(node)
    return tuple(children), tuple(children.values())


def _same(children: Children, expected: Children) -> bool:
    keys, values = children
    return (keys == expected[0] and len(values) == len(expected[1])
            and all(map(operator.is_, values, expected[1])))


def _walk(roots: Sequence[Any]) -> tuple[list[Children], list[tuple[Any, Children]]]:
    """The roots' children, then every other container reachable from them with its own.
    The roots are left out of the second list so that the cache does not keep them alive."""
    root_children = [_children(root) for root in roots]
    seen = {id(root) for root in roots}
    inner: list[tuple[Any, Children]] = []
    stack = [value for _, values in root_children for value in values]
    is_node: dict[type, bool] = {}  # graphlib.is_node, by type: 5 us a Variable otherwise
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind not in is_node:
            is_node[kind] = graphlib.is_node(node) and not _fixed(node)  # Variables: False
        if not is_node[kind] or id(node) in seen:
            continue
        seen.add(id(node))
        children = _children(node)
        inner.append((node, children))
        stack.extend(children[1])
    return root_children, inner


def _fixed(node: Any) -> bool:
    """Node types that never have children: None, and a module's own bookkeeping (its
    ``_pytree__state``, flattened with none): 16 of the 64 containers that gpt-tiny's model
    and optimizer reach."""
    return node is None or type(node) is PytreeState


def _not_mapping(x: Any) -> bool:
    """The leaves of a nested ``nnx.State``, which holds States and dicts down to them."""
    return not isinstance(x, (dict, nnx.State))


def _plain_variables(state: nnx.State) -> list[nnx.Variable] | None:
    """The state's Variables in leaf order, if each is one leaf that ``nnx.update`` sets by
    replacing the Variable's raw value: not hijax, holding a jax array, not a ``Ref``. What
    an array is depends on its type only (one of each type is asked: ``is_array_ref`` costs
    20 us)."""
    variables = jax.tree.leaves(state, is_leaf=_not_mapping)
    if not all(isinstance(v, nnx.Variable) and not v.hijax for v in variables):
        return None
    one_of_each = {type(v.get_raw_value()): v.get_raw_value() for v in variables}
    if not all(isinstance(x, jax.Array) and not variablelib.is_array_ref(x)
               for x in one_of_each.values()):
        return None
    return variables


class NodeState:
    """What one walk of a step's NNX arguments found, and the check that it still holds."""

    def __init__(self, nodes: Sequence[Any], roots: tuple[weakref.ref, ...],
                 variables: list[nnx.Variable], state_treedef: Any) -> None:
        self.roots = roots
        self.variables = variables
        self.state_treedef = state_treedef
        self.metadata = [dict(v._var_metadata) for v in variables]
        self.types = tuple(type(v.get_raw_value()) for v in variables)
        self.trace = tracers.current_jax_trace()
        self.graph_mode = nnx.set_graph_mode.current_value()
        self.root_children, self.inner = _walk(nodes)
        #: executables already chosen for these nodes, by (plain pytrees' treedef, avals)
        self.executables: dict[tuple[Any, tuple], Any] = {}

    def values(self, nodes: Sequence[Any]) -> list[Any] | None:
        """The Variables' current values, the state's flat leaves, if ``nodes`` still are the
        graph walked; else None."""
        if (len(nodes) != len(self.roots)
                or not all(map(operator.is_, (r() for r in self.roots), nodes))
                or tracers.current_jax_trace() != self.trace
                or nnx.set_graph_mode.current_value() != self.graph_mode
                or not all(map(_same, map(_children, nodes), self.root_children))
                or not all(_same(_children(node), children) for node, children in self.inner)
                or not all(map(operator.eq, (v._var_metadata for v in self.variables),
                               self.metadata))):
            return None
        values = [v.get_raw_value() for v in self.variables]
        if not all(map(operator.is_, map(type, values), self.types)):
            return None
        return values

    def write(self, values: Sequence[Any]) -> None:
        """The new state into the user's Variables, as ``nnx.update`` writes a state of the
        same structure and metadata (``Variable.update_from_state``: the raw value replaced),
        without its walk or its per-Variable trace check: ``values()`` compared the trace
        context with the one a successful ``nnx.update`` ran in."""
        for variable, value in zip(self.variables, values):
            object.__setattr__(variable, "_raw_value", value)


class StateRead(NamedTuple):
    """The flat state of a step's NNX arguments: from a cache entry still valid for them, or
    from ``nnx.state`` (kept, to make an entry from once ``nnx.update`` has succeeded)."""

    values: list[Any]
    state_treedef: Any
    entry: NodeState | None = None
    state: nnx.State | None = None


class NodeStateCache:
    """One ``NodeState``, for the NNX arguments a step was last called with."""

    def __init__(self) -> None:
        self._entry: NodeState | None = None

    def read(self, nodes: tuple[Any, ...]) -> StateRead:
        """The flat state of ``nodes`` (none: an empty one), through the entry if it holds."""
        entry = self._entry
        if entry is not None and nodes:
            values = entry.values(nodes)
            if values is not None:
                return StateRead(values, entry.state_treedef, entry)
        state = nnx.state(nodes) if nodes else None
        values, state_treedef = jax.tree.flatten(state)
        return StateRead(values, state_treedef, state=state)

    def remember(self, nodes: tuple[Any, ...], read: StateRead) -> None:
        """Keep what ``read`` walked of ``nodes``, once ``nnx.update`` has written the step's
        new state of the same structure (``StepSignature.state_round_trips``) into them."""
        if _FAST:
            self._entry = _entry(nodes, read, _forget(weakref.ref(self)))


def _entry(nodes: tuple[Any, ...], read: StateRead,
           on_collect: Callable[[weakref.ref], None]) -> NodeState | None:
    """An entry for what ``read`` walked, or None where the fast path would not be exact."""
    variables = _plain_variables(read.state) if read.state is not None else None
    if variables is None:
        return None
    try:
        roots = tuple(weakref.ref(node, on_collect) for node in nodes)
    except TypeError:  # a graph node type without weak references (__slots__)
        return None
    return NodeState(nodes, roots, variables, read.state_treedef)


def _forget(cache_ref: weakref.ref) -> Callable[[weakref.ref], None]:
    """A weakref callback that drops the cache's entry when one of its argument objects is
    collected (holding only a weak reference to the cache: no cycle keeps either alive)."""

    def forget(dead: weakref.ref) -> None:
        cache = cache_ref()
        entry = cache._entry if cache is not None else None
        if entry is not None and any(r is dead for r in entry.roots):
            cache._entry = None

    return forget
