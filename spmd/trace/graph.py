"""The train step's jaxpr as a flat graph of ops, the unit the sharding search works on.

Nested jaxprs that only group code (``jit``/``pjit``, ``custom_jvp_call``,
``custom_vjp_call``, ``remat``/``checkpoint``, ``closed_call``/``core_call``) are inlined,
so a layer's matmul is one node whatever wrapped it.

A ``scan`` (a loop over stacked layers, ``nnx.scan``/``lax.scan``) is planned once for its
body: the body's ops become nodes that run ``repeat`` times per step (the trip count, times
that of any enclosing scan), so one choice serves every iteration and the stacked dim stays
whole. Four pseudo-ops carry values across the loop's boundary, each one node per value
(rules in ``spmd.rules.loop``): ``scan_carry`` (the carry as the body reads it, fed by the
initial value; path ``(..., i, "carry", k)``), ``scan_slice`` (one iteration's slice of a
stacked input, ``"xs"``), ``scan_carry_out`` (the carry as the body leaves it and the loop
returns it, ``"carry_out"``; ``Graph.loops`` pairs it with its ``scan_carry``, which must
hold the same spec) and ``scan_stack`` (a per-iteration output stacked, ``"ys"``). Other
loops and branches (``while``, ``cond``) stay one node each, with a replicated fallback.

Every graph input (a flattened argument of the step) and every constant is a node too, of
kind ``"input"`` or ``"const"``; literals (Python scalars baked into an equation) are not
nodes and have no edges. A node's *path* names its equation: ``(17,)`` is equation 17 of the
top jaxpr, ``(17, 3)`` equation 3 of the jaxpr nested in equation 17 (inlined or a scan's
body). ``spmd.trace.interpret`` evaluates the equations with the same paths, so the
sharding constraints of ``spmd.runtime.constrain`` and the graph agree on names.

>>> import jax, jax.numpy as jnp
>>> g = build_graph(jax.make_jaxpr(lambda w, x: jnp.tanh(x @ w))(jnp.ones((4, 2)), jnp.ones((3, 4))))
>>> [n.op.primitive if n.op else n.kind for n in g.nodes]
['input', 'input', 'dot_general', 'tanh']
>>> g.num_edges
3
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

import numpy as np
from jax.extend import core as jcore

from spmd.dtypes import storage_dtype


# Primitive name -> the param holding the jaxpr to inline. Only primitives whose body runs
# once, in place: the graph and the interpreter treat them as plain code.
INLINE_PARAMS: dict[str, tuple[str, ...]] = {
    "pjit": ("jaxpr",),
    "jit": ("jaxpr",),
    "closed_call": ("call_jaxpr",),
    "core_call": ("call_jaxpr",),
    "custom_jvp_call": ("call_jaxpr",),
    "custom_vjp_call": ("call_jaxpr", "fun_jaxpr"),
    "custom_vjp_call_jaxpr": ("fun_jaxpr", "call_jaxpr"),
    "remat": ("jaxpr",),
    "remat2": ("jaxpr",),
    "checkpoint": ("jaxpr",),
}

#: A loop planned once for its body (see the module docstring).
SCAN = "scan"

Path = tuple[int | str, ...]
Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
    """One primitive application, as the graph builder hands it over.

    ``params`` are the equation's params (they may hold jaxprs, so an ``Op`` is compared by
    identity and not hashed by value).

    >>> import jax, jax.numpy as jnp
    >>> eqn = jax.make_jaxpr(jnp.tanh)(jnp.zeros((4, 8))).eqns[0]
    >>> op = Op.from_eqn(eqn)
    >>> op.primitive, op.in_shapes, op.out_shapes
    ('tanh', ((4, 8),), ((4, 8),))
    """

    primitive: str
    params: Mapping[str, Any]
    in_shapes: tuple[Shape, ...]
    in_dtypes: tuple[Any, ...]
    out_shapes: tuple[Shape, ...]
    out_dtypes: tuple[Any, ...]

    @classmethod
    def from_eqn(cls, eqn: Any) -> "Op":
        """Build from a ``jax.core.JaxprEqn`` (literals and tokens included)."""

        def shape(v: Any) -> Shape:
            return tuple(int(d) for d in getattr(v.aval, "shape", ()))

        def dtype(v: Any) -> Any:
            raw = getattr(v.aval, "dtype", None)
            return None if raw is None else storage_dtype(raw)

        return cls(
            primitive=eqn.primitive.name,
            params=dict(eqn.params),
            in_shapes=tuple(shape(v) for v in eqn.invars),
            in_dtypes=tuple(dtype(v) for v in eqn.invars),
            out_shapes=tuple(shape(v) for v in eqn.outvars),
            out_dtypes=tuple(dtype(v) for v in eqn.outvars),
        )


def inner_jaxpr(eqn) -> tuple[Any, Sequence[Any]] | None:
    """The (open jaxpr, consts) an inlinable equation runs, or None for any other equation."""
    for name in INLINE_PARAMS.get(eqn.primitive.name, ()):
        sub = eqn.params.get(name)
        if sub is None:
            continue
        if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):  # ClosedJaxpr
            return sub.jaxpr, sub.consts
        if hasattr(sub, "eqns"):  # open Jaxpr (remat)
            return sub, ()
    return None


@dataclasses.dataclass(frozen=True)
class Value:
    """One array of the program: output ``index`` of node ``node``."""

    node: int
    index: int


@dataclasses.dataclass
class Node:
    """One op, graph input or constant.

    Attributes:
      id: position in ``Graph.nodes`` (a topological order: jaxpr order, inlined).
      kind: ``"op"``, ``"input"`` (argument ``input_index`` of the step) or ``"const"``.
      op: what the rules see (for inputs and constants: a pseudo-op ``"input"``/``"const"``
        with one output).
      operands: per operand of the op, the Value it reads, or None for a literal.
      consumers: ids of nodes reading any output of this node (each once, in order).
      path: equation path (see module docstring); ``()`` for inputs and constants.
      name: the equation's name stack within the whole step, e.g.
        ``jvp(Block_0)/transpose(jvp())``, or "": an equation inlined from a call (a
        ``jit`` inside the step, such as ``jnp.where``) records only its name within the call,
        so the call's own (``scope``) comes first.
      scope: the name stack of the calls an inlined equation sits in (a ``NameStack``;
        None outside any), which a re-traced equation is bound under (``named_like``).
      repeat: how often the node runs per step (the trip counts of the scans around it).
      eqn: the equation an op node runs (its body's, for a node inside a scan).
      scan: index into ``Graph.scans`` of the outermost scan the node belongs to, or -1.
    """

    id: int
    kind: str
    op: Op
    operands: tuple[Value | None, ...]
    consumers: list[int]
    path: Path
    name: str = ""
    input_index: int = -1
    repeat: int = 1
    eqn: Any = dataclasses.field(default=None, repr=False)
    scan: int = -1
    scope: Any = dataclasses.field(default=None, repr=False)

    @property
    def key(self) -> str:
        return key_of(self.path) if self.kind == "op" else f"{self.kind} {self.input_index if self.kind == 'input' else self.id}"


def key_of(path: Path) -> str:
    """Stable name of an equation: ``"eqn 17"`` or ``"eqn 17.3"``."""
    return "eqn " + ".".join(str(i) for i in path)


def value_key(path: Path, index: int) -> str:
    """Stable name of an equation's output, used as a constraint key."""
    return f"{key_of(path)} out {index}"


def operand_key(path: Path, index: int) -> str:
    """Stable name of the value an equation reads as operand ``index`` (a reshard point)."""
    return f"{key_of(path)} in {index}"


@dataclasses.dataclass(frozen=True)
class Scan:
    """One scan equation of the step: the nodes it became (boundary pseudo-ops and its body,
    ``nodes``), the values it reads and the ones it yields, as a unit that cannot be cut."""

    eqn: Any
    operands: tuple[Value | None, ...]
    results: tuple[Value | None, ...]
    nodes: tuple[int, ...]


@dataclasses.dataclass
class Graph:
    nodes: list[Node]
    inputs: list[int]                  # node id of each top-level invar
    outputs: list[Value | None]        # the Value of each top-level outvar (None: literal)
    output_literals: list[Any]
    #: (scan_carry node, scan_carry_out node) per loop-carried value: one spec for both
    loops: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    #: every scan equation (inner ones before the scans around them)
    scans: list[Scan] = dataclasses.field(default_factory=list)
    #: the value of each constant node, by node id (None where the program did not say)
    constants: dict[int, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_edges(self) -> int:
        return sum(1 for n in self.nodes for v in n.operands if v is not None)

    def value_shape(self, v: Value) -> tuple[int, ...]:
        return self.nodes[v.node].op.out_shapes[v.index]

    def value_dtype(self, v: Value):
        return self.nodes[v.node].op.out_dtypes[v.index]

    def value_bytes(self, v: Value) -> int:
        return array_bytes(self.value_shape(v), self.value_dtype(v))

    def size(self) -> dict[str, int]:
        """How many nodes, op nodes and edges the graph has."""
        ops = sum(1 for n in self.nodes if n.kind == "op")
        return {"nodes": len(self.nodes), "ops": ops, "edges": self.num_edges}

    def last_use(self) -> list[int]:
        """Per node, the id of the last node reading it (itself if unread; len(nodes) for outputs)."""
        last = [n.id for n in self.nodes]
        for n in self.nodes:
            for v in n.operands:
                if v is not None:
                    last[v.node] = max(last[v.node], n.id)
        for v in self.outputs:
            if v is not None:
                last[v.node] = len(self.nodes)
        return last


def _aval(var) -> tuple[tuple[int, ...], Any]:
    aval = var.aval
    shape = tuple(int(d) for d in getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", None)
    return shape, np.dtype("float32") if dtype is None else storage_dtype(dtype)


def build_graph(closed_jaxpr) -> Graph:
    """Flatten a ClosedJaxpr (the whole train step) into a Graph; see the module docstring."""
    nodes: list[Node] = []
    env: dict[Any, Value] = {}

    loops: list[tuple[int, int]] = []
    scans: list[Scan] = []

    def add(kind: str, op: Op, operands, path: Path, name: str = "", input_index: int = -1,
            repeat: int = 1, eqn: Any = None, scope: Any = None) -> Node:
        node = Node(len(nodes), kind, op, tuple(operands), [], path, name, input_index, repeat,
                    eqn, scope=scope)
        nodes.append(node)
        for v in operands:
            if v is not None and (not nodes[v.node].consumers or nodes[v.node].consumers[-1] != node.id):
                nodes[v.node].consumers.append(node.id)
        return node

    constants: dict[int, Any] = {}

    def leaf(var, kind: str, input_index: int = -1, value: Any = None) -> None:
        shape, dtype = _aval(var)
        op = Op(kind, {}, (), (), (shape,), (dtype,))
        node = add(kind, op, (), (), input_index=input_index)
        env[var] = Value(node.id, 0)
        if kind == "const":
            constants[node.id] = value

    def read(atom) -> Value | None:
        if isinstance(atom, jcore.Literal):
            return None
        return env[atom]

    def boundary(primitive: str, operand: Value | None, var, path: Path, repeat: int,
                 stacked_in: int | None = None, stacked_out: int | None = None,
                 scope: Any = None) -> Value:
        """A pseudo-op moving one value across a scan's boundary (see module docstring);
        ``stacked_*``: the loop length leading the stacked side's shape."""
        shape, dtype = _aval(var)
        lead_in = () if stacked_in is None else (stacked_in,)
        lead_out = () if stacked_out is None else (stacked_out,)
        op = Op(primitive, {}, (lead_in + shape,), (dtype,), (lead_out + shape,), (dtype,))
        return Value(add("op", op, (operand,), path, str(scope or ""), repeat=repeat,
                         scope=scope).id, 0)

    def scan(eqn, operands: list[Value | None], path: Path, repeat: int,
             scope: Any) -> list[Value | None]:
        body, length = eqn.params["jaxpr"], int(eqn.params["length"])
        nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
        invars, outvars = body.jaxpr.invars, body.jaxpr.outvars
        inner = repeat * length
        first = len(nodes)
        carried = [boundary("scan_carry", v, var, path + ("carry", k), repeat, scope=scope)
                   for k, (v, var) in enumerate(zip(operands[nc:nc + nk], invars[nc:nc + nk]))]
        sliced = [boundary("scan_slice", v, var, path + ("xs", k), repeat, stacked_in=length,
                           scope=scope)
                  for k, (v, var) in enumerate(zip(operands[nc + nk:], invars[nc + nk:]))]
        outs = run(body.jaxpr, body.consts, [*operands[:nc], *carried, *sliced], path, inner,
                   scope=scope)
        results = []
        for k, (v, var) in enumerate(zip(outs[:nk], outvars[:nk])):
            results.append(boundary("scan_carry_out", v, var, path + ("carry_out", k), inner,
                                    scope=scope))
            loops.append((carried[k].node, results[-1].node))
        results += [boundary("scan_stack", v, var, path + ("ys", k), inner, stacked_out=length,
                             scope=scope)
                    for k, (v, var) in enumerate(zip(outs[nk:], outvars[nk:]))]
        members = tuple(n.id for n in nodes[first:] if n.kind == "op")
        for n in members:  # the scans around this one come later and mark their own
            nodes[n].scan = len(scans)
        scans.append(Scan(eqn, tuple(operands), tuple(results), members))
        return results

    def run(jaxpr, consts: Sequence[Any], args: Sequence[Value | None], path: Path,
            repeat: int = 1, literals: Sequence[Any] = (), scope: Any = None
            ) -> list[Value | None]:
        for var, c in zip(jaxpr.constvars, consts):
            leaf(var, "const", value=c)
        for k, (var, a) in enumerate(zip(jaxpr.invars, args)):
            if a is not None:
                env[var] = a
            else:  # a literal passed into an inlined call
                leaf(var, "const", value=literals[k] if k < len(literals) else None)
        for i, eqn in enumerate(jaxpr.eqns):
            operands = [read(a) for a in eqn.invars]
            inner = inner_jaxpr(eqn)
            if inner is not None or eqn.primitive.name == SCAN:
                given = [a.val if isinstance(a, jcore.Literal) else None for a in eqn.invars]
                within = scoped(scope, eqn)
                outs = (run(inner[0], inner[1], operands, path + (i,), repeat, given, within)
                        if inner is not None
                        else scan(eqn, operands, path + (i,), repeat, within))
                returned = inner[0].outvars if inner is not None else ()
                for k, (var, v) in enumerate(zip(eqn.outvars, outs)):
                    if v is None:  # the inner program returns a literal
                        atom = returned[k] if k < len(returned) else None
                        leaf(var, "const", value=getattr(atom, "val", None))
                    else:
                        env[var] = v
                continue
            op = Op.from_eqn(eqn)
            node = add("op", op, operands, path + (i,), str(scoped(scope, eqn) or ""),
                       repeat=repeat, eqn=eqn, scope=scope)
            for k, var in enumerate(eqn.outvars):
                env[var] = Value(node.id, k)
        return [read(a) for a in jaxpr.outvars]

    jaxpr = closed_jaxpr.jaxpr
    for var, c in zip(jaxpr.constvars, closed_jaxpr.consts):
        leaf(var, "const", value=c)
    inputs = []
    for i, var in enumerate(jaxpr.invars):
        leaf(var, "input", i)
        inputs.append(env[var].node)
    outs = run(jaxpr, (), [env[v] for v in jaxpr.invars], ())
    literals = [a.val if isinstance(a, jcore.Literal) else None for a in jaxpr.outvars]
    return Graph(nodes, inputs, outs, literals, loops, scans, constants)


def scoped(scope: Any, eqn) -> Any:
    """``eqn``'s name stack within the calls around it (``scope``: their name stack, or
    None): a ``NameStack``, or None where the equation carries none."""
    own = getattr(getattr(eqn, "source_info", None), "name_stack", None)
    if scope is None or own is None:
        return own if own is not None else scope
    return scope + own


@functools.lru_cache(maxsize=None)
def array_bytes(shape: tuple[int, ...], dtype) -> int:
    """Bytes of an array; 0 for values that are not arrays (tokens). (Typed PRNG keys come
    here as their ``storage_dtype``.)"""
    if dtype is None:
        return 0
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
