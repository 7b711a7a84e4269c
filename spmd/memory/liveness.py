"""Which arrays are alive together: the memory half of the search.

Every array value of the op graph is live from the node that produces it to its last
consumer (program order = jaxpr order, as XLA's buffer assignment roughly schedules it);
step inputs live throughout unless an output aliases them (donated: they die at their last
use, while their new value lives to the end); constants live throughout. A cheap
elementwise value is not kept for its later fusible readers: XLA's fusion computes it again
inside each such reader's kernel from values it holds anyway or holds for them instead (the
primitives it does this for are handed over as ``Remaking``:
``spmd.search.fusion.DUPLICABLE``), so it lives only as long as a matmul or another reader
that cannot fuse it needs it (e.g. the backward pass's GELU pieces, remade from the saved
pre-activation). This module knows nothing about strategies: callers hand it the bytes each
value takes per device (under one plan, or under each strategy of its group). Values in
host memory (``spmd.memory.offload``) take no device memory and are left out, where the
platform has a host memory of its own; on XLA:CPU they are device memory, and a copy
between the two memories is no buffer of its own (``forwarded``). What a plan adds beside
the values (resharded copies, collectives' buffers) it hands over as ``Buffer``s.

>>> import jax, jax.numpy as jnp
>>> from spmd.trace.graph import build_graph
>>> g = build_graph(jax.make_jaxpr(lambda w, x: jnp.tanh(x @ w).sum())(jnp.ones((4, 4)), jnp.ones((8, 4))))
>>> live = Liveness(g, donated=set())
>>> [(g.nodes[v.node].kind, a, b) for v, a, b in live.intervals]
[('input', 0, 5), ('input', 0, 5), ('op', 2, 3), ('op', 3, 4), ('op', 4, 5)]
>>> live.peak(live.full_bytes)  # unsharded: both inputs, the product and its tanh
448.0
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Sequence

import numpy as np

from spmd.trace.graph import Graph, Value

__all__ = ["LIVENESS_POINTS", "Buffer", "Liveness", "Remaking"]

#: program points with the most live bytes (replicated measure) at which a memory budget binds
LIVENESS_POINTS = 50


@dataclasses.dataclass(frozen=True)
class Remaking:
    """The primitives that decide which values XLA's fusion remakes in their readers'
    kernels (the search layer's fusion model: ``spmd.search.fusion``)."""

    duplicable: frozenset[str]  # cheap ops it computes again in each reader's kernel
    fusible: frozenset[str]  # ops a producer can be fused into
    loop_boundary: frozenset[str]  # pseudo-ops carrying values across a loop's boundary


@dataclasses.dataclass(frozen=True)
class Buffer:
    """Memory a plan adds that is no value of the graph, live from program point ``start``
    to ``end`` (both included): e.g. a value's copy in another spec, made for the ops that
    read it so (an all-gathered weight, live from its first such reader to its last), or an
    op's partial result before its reduce-scatter. Negative where a plan makes a value later
    than its op (a gradient made by a combined collective after it)."""

    start: int
    end: int
    nbytes: float


class Liveness:
    """The live range of every array value of ``graph``.

    Attributes:
      intervals: ``(value, start, end)`` per array value (zero-byte values left out), in
        program points: node ids, ``len(graph.nodes)`` being the step's end.
      full_bytes: each value's unsharded bytes, in the order of ``intervals``.
    """

    def __init__(self, graph: Graph, donated: set[int], fused: frozenset[Value] = frozenset(),
                 host: frozenset[Value] = frozenset(), remaking: "Remaking | None" = None,
                 forwarded: frozenset[Value] = frozenset()):
        """``donated``: input indices whose buffer an output reuses (aliased outputs);
        ``fused``: values that never reach memory, made and read inside one kernel (an
        elementwise chain XLA fuses: Adam's bias-corrected moments inside the update);
        ``host``: values in host memory (offloaded state), left out; ``remaking``: which
        ops XLA's fusion remakes in their readers' kernels (none when not given);
        ``forwarded``: values that are their one operand's buffer (a copy between memories
        that XLA:CPU, whose host memory is the devices', does not make): not buffers of
        their own, their operand lives as long as they are read."""
        self.graph = graph
        end_all = len(graph.nodes)
        last = graph.last_use()
        out: list[tuple[Value, int, int]] = []
        for n in graph.nodes:
            for k in range(len(n.op.out_shapes)):
                v = Value(n.id, k)
                if graph.value_bytes(v) == 0 or v in host:
                    continue
                if n.kind == "input":
                    end = last[n.id] if n.input_index in donated else end_all
                    out.append((v, 0, min(end, end_all)))
                elif n.kind == "const":
                    out.append((v, 0, end_all))
                else:
                    out.append((v, n.id, last[n.id]))
        owner: dict[Value, Value] = {}
        if forwarded:
            out, owner = _forward(graph, out, forwarded)
        if remaking is not None:
            out = _duplicated_at_readers(graph, out, remaking, fused, owner)
        self.intervals = out
        #: each value's index into ``intervals``
        self.position = {v: i for i, (v, _, _) in enumerate(out)}
        self.starts = np.array([a for _, a, _ in out], dtype=np.int64)
        self.ends = np.array([b for _, _, b in out], dtype=np.int64)
        self.full_bytes = np.array([graph.value_bytes(v) for v, _, _ in out], dtype=float)
        #: per interval: whether its value is ``fused`` (in memory only if a plan makes it so)
        self.fused = np.array([v in fused for v, _, _ in out], dtype=bool)
        #: ``full_bytes``, fused values at 0: what the search weighs where memory binds
        self.resident_bytes = np.where(self.fused, 0.0, self.full_bytes)
        self.points = end_all + 1

    def totals(self, nbytes: np.ndarray, extra: Sequence[Buffer] = ()) -> np.ndarray:
        """Live bytes at every program point, each value taking ``nbytes`` (per interval),
        plus ``extra`` buffers that are not values of the graph (``Buffer``)."""
        diff = np.zeros(self.points + 1)
        np.add.at(diff, self.starts, nbytes)
        np.add.at(diff, self.ends + 1, -nbytes)
        for buffer in extra:
            diff[buffer.start] += buffer.nbytes
            diff[buffer.end + 1] -= buffer.nbytes
        return np.cumsum(diff)[: self.points]

    def peak(self, nbytes: np.ndarray, extra: Sequence[Buffer] = ()) -> float:
        """The most bytes live at once, each value taking ``nbytes`` (per interval), with
        ``extra`` buffers."""
        return float(self.totals(nbytes, extra).max()) if len(nbytes) or extra else 0.0

    def busiest_points(self, count: int = LIVENESS_POINTS) -> list[int]:
        """The ``count`` program points with the most live bytes unsharded, in program order:
        where a memory budget can bind (a plan shards values alike, roughly)."""
        totals = self.totals(self.resident_bytes)
        return sorted(np.argsort(-totals, kind="stable")[:count].tolist())

    def live_at(self, point: int) -> np.ndarray:
        """Indices (into ``intervals``) of the values live at ``point``."""
        return np.nonzero((self.starts <= point) & (point <= self.ends))[0]

    def own_peaks(self, owner: Sequence[int]) -> dict[int, np.ndarray]:
        """Per owner (e.g. the solver group deciding each value's spec), the indices of its
        values live at the point where its own values' unsharded bytes peak: the bytes a
        group is charged per strategy in a liveness set."""
        by_owner: dict[int, list[int]] = collections.defaultdict(list)
        for i, o in enumerate(owner):
            by_owner[o].append(i)
        out = {}
        for o, members in by_owner.items():
            events = sorted([(int(self.starts[i]), self.resident_bytes[i]) for i in members] +
                            [(int(self.ends[i]) + 1, -self.resident_bytes[i]) for i in members])
            best_t, best, cur = 0, -1.0, 0.0
            for t, d in events:
                cur += d
                if cur > best:
                    best, best_t = cur, t
            out[o] = np.array([i for i in members
                               if self.starts[i] <= best_t <= self.ends[i]], dtype=np.int64)
        return out


def _forward(graph: Graph, intervals: list[tuple[Value, int, int]],
             forwarded: frozenset[Value]
             ) -> tuple[list[tuple[Value, int, int]], dict[Value, Value]]:
    """``intervals`` with each ``forwarded`` value folded into the value whose buffer it is
    (its operand's, through chains of them): that one lives to the later of their ends.
    Also returns that owner of each folded value."""
    owner: dict[Value, Value] = {}
    for v, _, _ in intervals:
        if v in forwarded:
            (u,) = [u for u in graph.nodes[v.node].operands if u is not None]
            owner[v] = owner.get(u, u)
    end = {v: b for v, _, b in intervals}
    for v, root in owner.items():
        if root in end:
            end[root] = max(end[root], end[v])
    return [(v, a, end[v]) for v, a, _ in intervals if v not in owner], owner


def _duplicated_at_readers(graph: Graph, intervals: list[tuple[Value, int, int]],
                           remaking: Remaking, fused: frozenset[Value],
                           owner: Mapping[Value, Value]) -> list[tuple[Value, int, int]]:
    """``intervals`` with each value XLA's fusion remakes in its later readers' kernels
    kept in memory only as long as a reader that cannot fuse it needs it: a ``DUPLICABLE``
    op's result that is no step output nor read across a loop boundary. It lives from where
    it is made to its last reader that is no fusible op (a matmul reads it from memory);
    read only by fusible ops, it is never in memory when its chain remakes it (below), else
    only at its last reader (made inside that kernel).

    Which results, as XLA's fusion weighs duplication (``ComputeGloballyUnfusible``):
    one whose distinct operands hold no more elements than it (a unary op, a product of
    broadcasts) is remade from the values its chain of such ops starts from, which are held
    as long as its fusible readers after the last unfused one need them (GELU's ``3 x^2``
    from ``x``; moe-tiny's dispatch masks from the small arrays they broadcast); such an
    operand fused inside one kernel counts only where the op grows it. One with larger
    operands (a sum of two arrays) is remade only where each operand is a constant or kept
    in memory at least as long, and not remade itself: counting chains of those fell 14%
    under XLA:CPU's buffers on cpu-8. ``fused``: the values never in memory (``Liveness``);
    ``owner``: the value whose buffer a ``forwarded`` one is (held in its place)."""
    end_all = len(graph.nodes)
    spans: dict[Value, list[int]] = {v: [a, b] for v, a, b in intervals}
    crosses, unfused = set(), {}  # read across a loop boundary; last reader it can't fuse into
    for n in graph.nodes:
        for u in n.operands:
            if u is None:
                continue
            if n.kind == "op" and n.op.primitive in remaking.loop_boundary:
                crosses.add(u)
            elif n.kind != "op" or n.op.primitive not in remaking.fusible:
                unfused[u] = n.id
    heads: dict[Value, frozenset[Value]] = {}  # remade by a chain -> the values it is made of
    remade: set[Value] = set()
    for v, _, end in intervals:
        n = graph.nodes[v.node]
        if not (n.kind == "op" and n.op.primitive in remaking.duplicable and end < end_all
                and v not in crosses):
            continue
        ins = list(dict.fromkeys(u for u in n.operands
                                 if u is not None and graph.nodes[u.node].kind != "const"))
        read = sum(int(np.prod(graph.value_shape(u))) for u in ins)
        made = int(np.prod(graph.value_shape(v)))
        if ins and read <= made and all(
                u in heads or (u not in remade and (u not in fused or read < made))
                for u in ins):
            heads[v] = frozenset().union(*(heads.get(u, {u}) for u in ins))
            # held for the fusible readers after its last unfused one (that one reads v
            # itself from memory), if any
            for source in heads[v] if unfused.get(v, -1) < end else ():
                source = owner.get(source, source)
                if source in spans and graph.nodes[source.node].kind != "input":
                    # held for the readers that make v again, to the last one, whose result
                    # XLA may write in its place (a step input is held to the end, or,
                    # donated, to the update that writes its new value in its place)
                    spans[source][1] = max(spans[source][1], end - 1)
        elif not all(u not in remade and spans.get(u, (0, -1))[1] >= end for u in ins):
            continue
        remade.add(v)
        if v in unfused:
            spans[v][1] = unfused[v]
        elif v in heads:  # never in memory: its readers read what it is made of
            spans[v] = [end + 1, end]
        else:  # made inside its last reader's kernel, from its operands
            spans[v][0] = end
    return [(v, *spans[v]) for v, _, _ in intervals]
