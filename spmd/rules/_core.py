"""The vocabulary of sharding rules: an op, a strategy, the rule context and the registry.

A *rule* maps one primitive application (:class:`Op`) to the ways it can run on the mesh
(:class:`Strategy`): the spec each input must arrive in, the spec of each output, the
communication the op itself then does and its per-device FLOPs (Alpa §4; DESIGN.md, "The
intra-op integer program"). Rules live in :data:`REGISTRY`, keyed by primitive name and filled
by one helper call per family; a primitive without a rule gets one fully replicated strategy
marked ``fallback``, so a plan can list what it could not shard.

Strategy names read like einsum over specs: each tensor prints one letter per dimension,
``R`` (replicated) or ``S(axes)`` (split over those mesh axes), inputs joined by `` x ``, then
`` = `` and the outputs, then the op's own collectives, e.g.
``RS(model) x S(model)R = RR (all-reduce @ model)``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from spmd.cluster.mesh import DeviceMesh, make_mesh
from spmd.cost.partitioner import Collective, Partitioner
from spmd.sharding import Spec, all_specs, is_valid, replicated, shard_shape
from spmd.trace.graph import Op

Shape = tuple[int, ...]

#: Default bound on the strategies of one op (the solver's size grows with it).
MAX_STRATEGIES = 60


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to run an op on the mesh.

    Attributes:
      name: readable einsum-style description (see the module docstring).
      in_specs: the spec each input must arrive in, one per op input.
      out_specs: the spec of each output.
      collectives: communication the op itself does (e.g. the all-reduce of partial sums).
      flops: per-device FLOPs; replicated work counts in full on every device.
      fallback: True when no rule could shard the op and it was replicated instead.
    """

    name: str
    in_specs: tuple[Spec, ...]
    out_specs: tuple[Spec, ...]
    collectives: tuple[Collective, ...] = ()
    flops: float = 0.0
    fallback: bool = False


class UnsupportedPattern(Exception):
    """Raised by a rule for a param pattern it does not shard; the op falls back to replicated."""


class RuleContext:
    """What rules need to know about the mesh, plus per-shape caches.

    Accepts a :class:`spmd.cluster.mesh.DeviceMesh` or a plain ``{axis: size}`` mapping (mesh order;
    it becomes a virtual CPU mesh). ``partitioner`` defaults to ``Partitioner(mesh)``.

    >>> ctx = RuleContext({"data": 2, "model": 4, "pipe": 1})
    >>> ctx.axes, ctx.size(("data", "model"))
    (('data', 'model'), 8)
    """

    def __init__(self, mesh: Any, max_strategies: int = MAX_STRATEGIES, max_axes_per_dim: int = 2,
                 partitioner: Partitioner | None = None,
                 required: Mapping[Shape, Iterable[Spec]] | None = None,
                 every_scatter: bool = False):
        if not isinstance(mesh, DeviceMesh):
            mesh = make_mesh({str(k): int(v) for k, v in dict(mesh).items()}, virtual=True)
        self.mesh: DeviceMesh = mesh
        #: which collectives finish a partial result on this mesh
        self.partitioner = partitioner if partitioner is not None else Partitioner(mesh)
        self.mesh_shape: dict[str, int] = dict(mesh.shape)
        #: mesh axes that can split anything (size > 1), in mesh order
        self.axes: tuple[str, ...] = tuple(a for a, n in self.mesh_shape.items() if n > 1)
        self.max_strategies = max_strategies
        self.max_axes_per_dim = max_axes_per_dim
        #: keep a partial sum's scattered-output variants where the platform emits the same
        #: collectives for them (XLA:CPU: all-reduce, then a slice): a plan made for another
        #: platform, whose outputs stay scattered, priced on this one (``IntraOp.price_on``)
        self.every_scatter = every_scatter
        #: shape -> specs every candidate list of that shape includes (pinned inputs' specs,
        #: so a value can always arrive in the spec the user fixed, whatever the caps drop)
        self.required: dict[Shape, tuple[Spec, ...]] = {
            tuple(int(d) for d in k): tuple(dict.fromkeys(tuple(tuple(a) for a in s) for s in v))
            for k, v in (required or {}).items()}
        self._specs: dict[tuple, list[Spec]] = {}

    def size(self, axes: Iterable[str]) -> int:
        """Number of devices a dim split over ``axes`` is spread on."""
        return math.prod(self.mesh_shape[a] for a in axes)

    def ordered(self, axes: Iterable[str]) -> tuple[str, ...]:
        """``axes`` in mesh order (the canonical form of a collective's axes)."""
        chosen = set(axes)
        return tuple(a for a in self.mesh_shape if a in chosen)

    def specs(self, shape: Sequence[int], unsplit: Iterable[int] = ()) -> list[Spec]:
        """Candidate specs of an array, at most ``max_strategies`` of them.

        All valid specs with up to ``max_axes_per_dim`` axes per dim, leaving the dims in
        ``unsplit`` whole; when that is too many, one axis per dim; when still too many, the
        specs that use the most axes (least redundant work), with the replicated spec kept.
        Specs in ``required`` for this shape (that leave ``unsplit`` whole) are always added.

        >>> RuleContext({"x": 2}).specs((4, 4), unsplit=[1])
        [((), ()), (('x',), ())]
        """
        fixed = set(unsplit)
        key = tuple(1 if d in fixed else int(n) for d, n in enumerate(shape))
        cache_key = (key, tuple(int(n) for n in shape))
        if cache_key not in self._specs:
            specs = all_specs(key, self.mesh_shape, self.max_axes_per_dim)
            if len(specs) > self.max_strategies:
                specs = all_specs(key, self.mesh_shape, 1)
            if len(specs) > self.max_strategies:
                rest = sorted(specs[1:], key=lambda s: -sum(len(a) for a in s))
                specs = [specs[0]] + rest[: self.max_strategies - 1]
            extra = [s for s in self.required.get(cache_key[1], ())
                     if s not in specs and is_valid(s, key, self.mesh_shape)
                     and not any(s[d] for d in fixed)]
            self._specs[cache_key] = specs + extra
        return self._specs[cache_key]

    def is_required(self, shape: Sequence[int], spec: Spec) -> bool:
        """Whether ``spec`` is one the caller asked every candidate list of ``shape`` to keep."""
        return spec in self.required.get(tuple(shape), ())

    def assignments(self, slot_sizes: Sequence[int]) -> Iterator[tuple[tuple[str, ...], ...]]:
        """Every way to give each mesh axis to at most one slot (a logical dim of an op).

        A slot may take up to ``max_axes_per_dim`` axes, in either order; each slot's size
        must divide by its axes. Yields one tuple of axes per slot.

        >>> sorted(RuleContext({"x": 2}).assignments([4, 3]))
        [((), ()), (('x',), ())]
        """
        n = len(slot_sizes)
        for choice in itertools.product(range(-1, n), repeat=len(self.axes)):
            groups: list[list[str]] = [[] for _ in range(n)]
            for axis, slot in zip(self.axes, choice):
                if slot >= 0:
                    groups[slot].append(axis)
            if any(len(g) > self.max_axes_per_dim for g in groups):
                continue
            if any(size % self.size(g) for size, g in zip(slot_sizes, groups)):
                continue
            for orders in itertools.product(*(itertools.permutations(g) for g in groups)):
                yield tuple(tuple(o) for o in orders)

    # -- collectives ---------------------------------------------------------------------

    def partial_sum(self, shape: Sequence[int], dtype: Any, out_spec: Spec,
                    groups: Iterable[Sequence[str]], spread: bool = False
                    ) -> tuple[Collective, ...]:
        """What finishes a result that is partial over the axes of each summed dim.

        ``groups`` holds, for each split dim that was summed away (contracting, reduced,
        looked-up), the axes splitting it. XLA finishes each such dim with its own
        collective (checked in tests/test_rules.py: two contracting dims split on ``data``
        and ``model`` give two all-reduces, one dim split on both gives one), so each group
        is one call of the partitioner, which picks the platform's collective: an
        all-reduce, or a reduce-scatter for the axes ``out_spec`` also splits on (``spread``:
        a dot's, ``Partitioner.partial_sum``).

        >>> RuleContext({"model": 4}).partial_sum((8, 16), "float32", ((), ()), [("model",)])
        (Collective(kind='all-reduce', axes=('model',), bytes=512.0),)
        """
        out: list[Collective] = []
        for axes in groups:
            if axes:
                out.extend(self.partitioner.partial_sum(shape, dtype, out_spec, self.ordered(axes),
                                                         spread))
        return tuple(out)


Rule = Callable[[Op, RuleContext], list[Strategy]]


@dataclasses.dataclass(frozen=True)
class RuleEntry:
    """A registered rule: the function, and whether its output spec follows its main operand."""

    fn: Rule
    follower: bool = False

    def __call__(self, op: Op, ctx: RuleContext) -> list[Strategy]:
        return self.fn(op, ctx)


#: primitive name -> rule; filled once at import by the family modules.
REGISTRY: dict[str, RuleEntry] = {}


def register(primitives: Iterable[str], fn: Rule, *, follower: bool = False) -> None:
    """Register ``fn`` as the rule of every primitive in ``primitives``."""
    for name in primitives:
        REGISTRY[name] = RuleEntry(fn, follower)


def has_rule(primitive: str) -> bool:
    """Whether the primitive has a rule (else it falls back to replicated).

    >>> has_rule("dot_general"), has_rule("no_such_primitive")
    (True, False)
    """
    return primitive in REGISTRY


def is_follower(primitive: str) -> bool:
    """Whether the op's output spec simply follows its main operand (elementwise, convert).

    >>> is_follower("add"), is_follower("dot_general")
    (True, False)
    """
    entry = REGISTRY.get(primitive)
    return bool(entry and entry.follower)


def strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """The strategies of ``op``: valid, deduplicated, bounded; never raises for unknown ops.

    >>> import jax, jax.numpy as jnp
    >>> eqn = jax.make_jaxpr(jnp.matmul)(jnp.zeros((8, 16)), jnp.zeros((16, 32))).eqns[0]
    >>> ss = strategies(Op.from_eqn(eqn), RuleContext({"data": 2, "model": 4}))
    >>> [s.name for s in ss if s.name.startswith("RR x RS(model)")]
    ['RR x RS(model) = RS(model)']
    """
    entry = REGISTRY.get(op.primitive)
    if entry is None:
        return [fallback(op, ctx, f"no rule for {op.primitive}")]
    try:
        found = entry(op, ctx)
    except UnsupportedPattern as err:
        return [fallback(op, ctx, str(err))]
    out: list[Strategy] = []
    seen: set = set()
    for s in found:
        key = (s.in_specs, s.out_specs, s.collectives)
        if key in seen or not _valid(s, op, ctx):
            continue
        seen.add(key)
        out.append(s)
    if not out:
        return [fallback(op, ctx, "no valid sharded strategy")]
    if len(out) > ctx.max_strategies:
        # Keep those with the least replicated work and the smallest per-device pieces.
        def footprint(s: Strategy) -> tuple[float, int]:
            pieces = zip(s.in_specs + s.out_specs, op.in_shapes + op.out_shapes)
            return s.flops, sum(local_size(shape, spec, ctx) for spec, shape in pieces)

        keep = [s for s in out if any(ctx.is_required(shape, spec) and any(spec)
                                      for spec, shape in zip(s.out_specs, op.out_shapes))]
        rest = sorted((s for s in out if s not in keep), key=footprint)
        out = keep + rest[: max(ctx.max_strategies - len(keep), 1)]
    return out


def _valid(s: Strategy, op: Op, ctx: RuleContext) -> bool:
    if len(s.in_specs) != len(op.in_shapes) or len(s.out_specs) != len(op.out_shapes):
        return False
    pairs = list(zip(s.in_specs, op.in_shapes)) + list(zip(s.out_specs, op.out_shapes))
    return all(is_valid(spec, shape, ctx.mesh_shape)
               and all(ctx.mesh_shape[a] > 1 for axes in spec for a in axes)
               for spec, shape in pairs)


def fallback(op: Op, ctx: RuleContext, reason: str) -> Strategy:
    """Everything replicated; flops estimated as one per output element."""
    ins = tuple(replicated(len(s)) for s in op.in_shapes)
    outs = tuple(replicated(len(s)) for s in op.out_shapes)
    flops = float(sum(math.prod(s) for s in op.out_shapes))
    return Strategy(f"fallback: {name(ins, outs)} [{reason}]", ins, outs, (), flops, fallback=True)


# -- naming and small helpers ---------------------------------------------------------------


def spec_name(spec: Spec) -> str:
    """``R``/``S(axes)`` per dim; ``-`` for a scalar.

    >>> spec_name((("data",), (), ("data", "model")))
    'S(data)RS(data,model)'
    """
    if not spec:
        return "-"
    return "".join("S(" + ",".join(axes) + ")" if axes else "R" for axes in spec)


def name(ins: Sequence[Spec], outs: Sequence[Spec], collectives: Sequence[Collective] = (),
         note: str = "") -> str:
    """``in x in = out (collective @ axes)``."""
    text = " x ".join(spec_name(s) for s in ins) + " = " + ", ".join(spec_name(s) for s in outs)
    extra = [f"{c.kind} @ {','.join(c.axes)}" for c in collectives]
    if note:
        extra.append(note)
    return text + (f" ({'; '.join(extra)})" if extra else "")


def make(ins: Sequence[Spec], outs: Sequence[Spec], collectives: Sequence[Collective] = (),
         flops: float = 0.0, note: str = "") -> Strategy:
    """A strategy whose name is derived from its specs."""
    ins, outs, collectives = tuple(ins), tuple(outs), tuple(collectives)
    return Strategy(name(ins, outs, collectives, note), ins, outs, collectives, float(flops))


def local_size(shape: Sequence[int], spec: Spec, ctx: RuleContext) -> int:
    """Elements one device holds."""
    return math.prod(shard_shape(shape, spec, ctx.mesh_shape))


def used(spec: Spec) -> tuple[str, ...]:
    return tuple(a for axes in spec for a in axes)


def itemsize(dtype: Any) -> int:
    return np.dtype(dtype).itemsize
