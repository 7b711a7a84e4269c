"""The cost graph under one set of pins, laid out as the solver's flat request, and the way
back from the solver's choice to a strategy per graph node.

Pins only touch inputs (a pinned input has one strategy, its pin), so what the op nodes
contribute to a request (their groups' costs, the reshards between them, the shared
latencies, their memory) is built once per cost graph and reused by every ``Encoding`` of
it: the search and the scoring of each hand-written plan differ only in their inputs' part.

Request nodes are the cost graph's roots (an op and its merged followers, an input, a
constant). Terms:

* node costs: the members' compute and own communication, the tie-break of inputs and
  constants, and reshards between members of one group;
* a value read by one other group: an edge matrix, ``repeat x reshard seconds``;
* a value read by several groups: a fan-out, so that each distinct (target spec, loop level)
  is paid once, as XLA reshards a value once per spec its consumers want;
* an aliased output and its input, a loop's carry pair that could not share one variable:
  hard equality edges (``inf`` off the diagonal);
* charges: the latency XLA's combined collectives share;
* memory: at each of the busiest program points (``Liveness.busiest_points``), each group's
  bytes per strategy of its values live there (``liveness_memory``), so the budget binds on
  what the liveness holds at that point (a group's own-peak row, ``node_memory``, would
  charge a weight gradient's group the moments its update makes all through the backward
  pass: 25% over an offloaded step's real peak on mlp-small). Resharded copies and partial
  sums (``predict``'s buffers) are not in these rows; a request for given points adds sets
  that hold those too (``spmd.search.point_memory``).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from spmd import rules as _rules
from spmd.memory.liveness import LIVENESS_POINTS
from spmd.search.costgraph import CostGraph, Read
from spmd.search.point_memory import point_terms
from spmd.sharding import Spec
from spmd.solver import SolverRequest
from spmd.trace.graph import Value

__all__ = ["Encoder", "Encoding"]


class Encoder:
    """Encodes one cost graph under any set of pins; what the op nodes contribute to a
    request is built by the first request and kept for the others."""

    def __init__(self, cg: CostGraph):
        self.cg = cg
        self.shared: _SharedPart | None = None
        #: the op nodes' and constants' spec lists (``Encoding.spec_list``): the same under
        #: any pins, so every encoding shares them, and the memos the cost graph keys on
        #: their identity hit for every scoring, not only within one
        self.spec_lists: dict[tuple, tuple[tuple[Spec, ...], list]] = {}

    def encode(self, pins: Sequence[Spec | None]) -> "Encoding":
        return Encoding(self, pins)


class Encoding:
    """A cost graph with its inputs pinned to ``pins`` (None: free)."""

    def __init__(self, encoder: Encoder, pins: Sequence[Spec | None]):
        cg = encoder.cg
        if len(pins) != len(cg.graph.inputs):
            raise ValueError(f"{len(pins)} pins for {len(cg.graph.inputs)} inputs")
        self.encoder, self.cg = encoder, cg
        nodes = cg.graph.nodes
        self.strats = list(cg.strats)
        #: per node, its strategy under each of its root's strategies (an input is its own
        #: root: the identity over its candidates under these pins)
        self.fmap = list(cg.fmap)
        for node, pin in zip(cg.graph.inputs, pins):
            self.strats[node] = cg.input_candidates(node, pin)
            self.fmap[node] = np.arange(len(self.strats[node]))
        self.roots = cg.roots
        self.index = {r: i for i, r in enumerate(self.roots)}
        # Tied inputs share a choice only when their candidates agree under these pins.
        rep = {r: cg.same_op.get(r, r) for r in self.roots}
        parent: dict[int, int] = {}

        def find(x: int) -> int:
            while parent.get(x, x) != x:
                x = parent[x]
            return x

        tied = 0
        for a, b in cg.input_ties:
            ra, rb = find(a), find(b)
            if ra != rb and self.names(ra) == self.names(rb):
                parent[max(ra, rb)] = min(ra, rb)
                tied += 1
        for r in self.roots:
            if nodes[r].kind == "input":
                rep[r] = find(r)
        self.same_as = [-1 if rep[r] == r else self.index[rep[r]] for r in self.roots]
        self.input_ties = tied
        #: the inputs' spec lists (under these pins); the others' are the encoder's
        self._spec_lists: dict[tuple, tuple[tuple[Spec, ...], list]] = {}

    # -- strategies under a choice of root strategies ------------------------------------
    def names(self, node: int) -> list[str]:
        return [s.name for s in self.strats[node]]

    def strategy_of(self, node: int, root_choice: int) -> _rules.Strategy:
        return self.strats[node][self.fmap[node][root_choice]]

    def out_spec(self, v: Value, root_choice: int) -> Spec:
        return self.strategy_of(v.node, root_choice).out_specs[v.index]

    def node_choice(self, choice: Sequence[int]) -> list[int]:
        """The root strategy chosen for each graph node, from one choice per request node."""
        return [int(choice[self.index[r]]) for r in self.cg.root]

    def spec_list(self, node: int, index: int, out: bool) -> tuple[Spec, ...]:
        """The spec of ``node``'s output (``out``) or operand ``index`` under each of its
        root's strategies; repeated layers share their strategy lists, so this is memoized
        on the list and the follower map."""
        ss, fm = self.strats[node], self.fmap[node]
        key = (id(ss), fm.tobytes(), index, out)
        memo = (self._spec_lists if self.cg.graph.nodes[node].kind == "input"
                else self.encoder.spec_lists)
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = (
                tuple(ss[k].out_specs[index] for k in fm.tolist()) if out else
                tuple(ss[k].in_specs[index] for k in fm.tolist()), ss)
        return hit[0]

    # -- the request ---------------------------------------------------------------------
    def request(self, memory_budget: float | None, time_limit: float,
                points: Sequence[int] = ()) -> SolverRequest:
        """The solver's request: the op part built once per cost graph, the inputs' here.
        ``points``: program points whose liveness sets also hold the copies and partial
        sums live there (``spmd.search.point_memory``), besides the busiest points'."""
        cg, nodes = self.cg, self.cg.graph.nodes
        shared = self.encoder.shared
        if shared is None:
            shared = self.encoder.shared = _SharedPart(cg, self)
        costs = [c.copy() for c in shared.costs]
        edges = dict(shared.edges)
        fanouts = list(shared.fanouts)
        memory = list(shared.memory)
        # An input's values are live at most busiest points alike: its row is made once.
        input_rows: dict[tuple[int, bytes], list[float]] = {}

        def input_row(g: int, ix: np.ndarray) -> list[float]:
            key = (g, ix.tobytes())
            if key not in input_rows:
                input_rows[key] = _memory_row(cg, self, self.roots[g], ix).tolist()
            return input_rows[key]

        set_memory = [[row if row is not None else input_row(g, values[g])
                       for g, row in zip(values, rows)]
                      for values, rows in zip(shared.set_values, shared.set_memory)]
        liveness, copies = list(shared.liveness), None
        if points:
            copies = [[] for _ in liveness]
            for t in points:
                unary, held = point_terms(self, t)
                liveness.append(list(unary))
                set_memory.append([row.tolist() for row in unary.values()])
                copies.append(held)
        for node in cg.graph.inputs:
            i = self.index[node]
            specs = self.spec_list(node, 0, True)
            costs[i] = cg.tie_break(node, specs)
            memory[i] = _memory_row(cg, self, node, shared.own_values.get(i))
            for k in range(len(nodes[node].op.out_shapes)):
                v = Value(node, k)
                if v in cg.reads:
                    _price_reads(cg, self, v, cg.reads[v], costs, edges, fanouts)
        # Equal specs, as hard edges: an output aliasing its input; a loop's carry pair that
        # could not share one variable (``CostGraph.untied_loops``).
        equal = [(cg.graph.outputs[o], Value(cg.graph.inputs[i], 0)) for o, i in cg.aliases.items()]
        equal += [(Value(b, 0), Value(a, 0)) for a, b in cg.untied_loops]
        for v, w in equal:
            if v is None or cg.root[v.node] == cg.root[w.node]:
                continue
            src = self.spec_list(v.node, v.index, True)
            dst = self.spec_list(w.node, w.index, True)
            mat = np.array([[0.0 if a == b else math.inf for b in dst] for a in src])
            _add_edge(edges, self.index[cg.root[v.node]], self.index[cg.root[w.node]], mat)
        edge_list = sorted(edges)
        return SolverRequest(
            node_names=[nodes[r].key + (f" {nodes[r].op.primitive}" if nodes[r].kind == "op" else "")
                        for r in self.roots],
            strategy_names=[self.names(r) for r in self.roots],
            node_costs=[c.tolist() for c in costs],
            edges=edge_list, edge_costs=[edges[e] for e in edge_list],  # arrays: no copy
            same_as=list(self.same_as), node_memory=[m.tolist() for m in memory],
            liveness=liveness, liveness_memory=set_memory, liveness_copies=copies,
            memory_budget=memory_budget, warm_start=None,
            time_limit=time_limit,
            charges=[(lat, [(self.index[r], k) for r, k in members])
                     for lat, members in cg.charges],
            fanouts=fanouts)


class _SharedPart:
    """What the op nodes and constants contribute to every request of one cost graph."""

    def __init__(self, cg: CostGraph, enc: Encoding):
        nodes = cg.graph.nodes
        self.costs: list[np.ndarray] = [np.zeros(len(enc.strats[r])) for r in enc.roots]
        self.edges: dict[tuple[int, int], np.ndarray] = {}
        self.fanouts: list = []
        for n in nodes:
            if n.kind == "input":
                continue
            i = enc.index[cg.root[n.id]]
            if n.kind == "const":
                self.costs[i] += cg.tie_break(n.id, enc.spec_list(n.id, 0, True))
            else:
                self.costs[i] += cg.own_cost(n.id)[cg.fmap[n.id]]
            for k in range(len(n.op.out_shapes)):
                v = Value(n.id, k)
                if v in cg.reads:
                    _price_reads(cg, enc, v, cg.reads[v], self.costs, self.edges, self.fanouts)
        # Memory: a value belongs to its producer's group; the busiest program points bind.
        live = cg.liveness
        owner = [enc.index[cg.root[v.node]] for v, _, _ in live.intervals]
        self.own_values = live.own_peaks(owner)
        self.memory = [np.zeros(len(enc.strats[r])) for r in enc.roots]
        for i, r in enumerate(enc.roots):
            if nodes[r].kind != "input":
                self.memory[i] = _memory_row(cg, enc, r, self.own_values.get(i))
        # Per busiest point, each group's values live there and their bytes per strategy:
        # a group's bytes at that point, not at its own peak (a weight gradient's group,
        # with the moments its update makes, would be charged those all through the
        # backward pass). Inputs' rows depend on the pins: made per request.
        sets: list[dict[int, np.ndarray]] = []
        seen: set[tuple] = set()
        for t in live.busiest_points(LIVENESS_POINTS):
            members: dict[int, list[int]] = {}
            for idx in live.live_at(t).tolist():
                if not live.fused[idx]:
                    members.setdefault(owner[idx], []).append(idx)
            key = tuple(sorted((g, tuple(ix)) for g, ix in members.items()))
            if members and key not in seen:
                seen.add(key)
                sets.append({g: np.array(ix, dtype=np.int64) for g, ix in sorted(members.items())})
        self.set_values = sets
        self.liveness = [list(s) for s in sets]
        self.set_memory = [[None if nodes[enc.roots[g]].kind == "input"
                            else _memory_row(cg, enc, enc.roots[g], ix).tolist()
                            for g, ix in s.items()] for s in sets]


def _memory_row(cg: CostGraph, enc: Encoding, root: int, values: np.ndarray | None) -> np.ndarray:
    """Per strategy of ``root``'s group, the bytes per device of the group's values live at
    its own peak (``Liveness.own_peaks``)."""
    row = np.zeros(len(enc.strats[root]))
    if values is None:
        return row
    for idx in values.tolist():
        if cg.liveness.fused[idx]:  # never in memory unless resharded: not known here
            continue
        v = cg.liveness.intervals[idx][0]
        row += cg.bytes_row(v, enc.spec_list(v.node, v.index, True))
    return row


def _add_edge(edges: dict, a: int, b: int, mat: np.ndarray) -> None:
    if a > b:
        a, b, mat = b, a, mat.T
    edges[(a, b)] = edges[(a, b)] + mat if (a, b) in edges else mat


def _price_reads(cg: CostGraph, enc: Encoding, v: Value, reads: list[Read],
                 costs: list[np.ndarray], edges: dict, fanouts: list) -> None:
    """The reshard terms of value ``v``: unary when only its own group reads it, an edge
    when one other group does, a fan-out when several do."""
    producer = enc.index[cg.root[v.node]]
    src = enc.spec_list(v.node, v.index, True)
    wanted = [(enc.index[cg.root[r.node]], enc.spec_list(r.node, r.operand, False), r.repeat)
              for r in reads]
    groups = {g for g, _, _ in wanted}
    if groups == {producer}:  # read only inside the producer's group
        costs[producer] += cg.own_group_reshards(v, src, [(dst, rep) for _, dst, rep in wanted])
        return
    if len(wanted) == 1:
        g, dst, rep = wanted[0]
        mat = cg.reshard_matrix(v, src, dst)
        _add_edge(edges, producer, g, mat * rep if rep != 1 else mat)
        return
    table, targets = cg.fanout_table(v, src, [(dst, rep) for _, dst, rep in wanted])
    consumers = [(g, t) for (g, _, _), t in zip(wanted, targets)]
    if table.any():  # e.g. a scalar read by every update: never resharded
        fanouts.append((producer, table, consumers))
