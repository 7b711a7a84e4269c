"""The sharding search's problem: the op graph with every node's strategies and costs,
shrunk for the solver, and the flat request it hands over.

Keeping the program small (every reduction documented in ``AutoResult.stats``):

* **followers** (elementwise ops, converts, broadcasts; ``rules.is_follower``) share the
  choice of the op producing their main operand (their largest operand): they are merged
  into its group and add their cost to it. Inputs and constants never absorb followers, so
  an input's memory is its own.
* **small inputs**: an input under ``small_bytes`` (``min(64 KiB, largest value / 256)``;
  the fraction keeps tiny test models meaningful, the cap keeps real models' biases, norms
  and scalars out of the search) is replicated, without a variable. Small *ops* keep all
  their strategies: restricting them to replicated outputs made gpt-tiny all-to-all its
  logits (a per-token statistic must stay split like its batch) and GPT's attention gather
  whole activations over heads (a bias gradient must stay split like its activation); their
  collectives are small anyway.
* **combined collectives**: ops no matmul/convolution depends on (``_off_critical_path``:
  weight gradients, the loss, the update) pay only the bandwidth of their all-reduces; XLA
  merges those into one per (kind, axes) (``CostModel.combined``, used by the prediction).
* **repeated layers**: nodes whose structural colour (primitive, shapes, params, refined
  ``WL_ROUNDS`` times by their operands' colours: no program distances, so a layer's backward
  ops match although they read forward values at distances that differ per layer) repeats,
  with a window of ``MIN_PERIOD`` ops matching, at a distance of at least ``MIN_PERIOD`` ops
  share one choice (``same_as``), as do the inputs they read at the same position. A
  structure that repeats with a shorter period (a stack of tiny MLP layers) is left untied,
  because alternating choices (column then row split) matter there.
* **aliased outputs** (the new value of a parameter or optimizer state) keep their own choice
  and, if the input is pinned, its spec among their candidates, so e.g. ZeRO (replicated
  parameter, sharded state) is expressible.
* strategies and costs are computed once per distinct op (repeated layers repeat them).
* **scans** are planned once for their body (``spmd.graph``): a body node's compute and
  collectives, and every reshard on an edge into it, count ``Node.repeat`` times; a loop's
  carry pseudo-ops share one variable, so every iteration sees the same spec.

Memory: every value is live from its producer to its last consumer (program order = jaxpr
order); inputs live throughout unless an output aliases them (donated: they die at their
last use, their new value lives to the end). A group's memory is its values' bytes at the
point where the group's own live bytes peak; the budget binds at the ``LIVENESS_POINTS``
program points with the most live bytes (replicated measure).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from spmd import rules as _rules
from spmd.cost.time import CostModel
from spmd.errors import PlanError
from spmd.trace.graph import Graph, Value
from spmd.cluster.mesh import DeviceMesh
from spmd.sharding import Spec, all_specs, bytes_per_device, format_spec, is_valid, replicated
from spmd.solver.driver import SolverRequest

__all__ = ["InputInfo", "Problem"]

SMALL_BYTES_CAP = 64 * 1024
SMALL_FRACTION = 1 / 256
MIN_PERIOD = 16
#: rounds of colour refinement behind layer tying (how far a node's neighbourhood must match)
WL_ROUNDS = 2
LIVENESS_POINTS = 50
#: an input costs this fraction of the time to stream its per-device bytes once: only breaks
#: ties (a batch split for free rather than replicated), never outweighs communication.
INPUT_BYTES_WEIGHT = 1e-3


@dataclasses.dataclass(frozen=True)
class InputInfo:
    """One flattened input leaf of the step.

    ``kind`` is ``"param"``, ``"optimizer"``, ``"batch"`` or ``"state"``; ``pinned`` a spec
    the user fixed (a hard constraint).
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    kind: str = "param"
    pinned: Spec | None = None


def _input_strategy(spec: Spec) -> _rules.Strategy:
    return _rules.Strategy(format_spec(spec), (), (spec,))


def _dtype(op) -> Any:
    for d in tuple(op.out_dtypes) + tuple(op.in_dtypes):
        if d is not None:
            return d
    return np.float32


def _nbytes(shape, dtype) -> int:
    if dtype is None:
        return 0
    try:
        return math.prod(shape) * np.dtype(dtype).itemsize
    except TypeError:  # tokens and other non-array values
        return 0


class Problem:
    """Graph + strategies + groups: everything needed to build a request and read a choice."""

    def __init__(self, graph: Graph, inputs: Sequence[InputInfo], mesh: DeviceMesh,
                 cost: CostModel, pins: Sequence[Spec | None], output_aliases: Mapping[int, int],
                 share_layers: bool = True):
        self.g, self.mesh, self.cost = graph, mesh, cost
        self.mesh_shape = mesh.shape
        self.aliases = dict(output_aliases)
        nodes = graph.nodes
        if len(inputs) != len(graph.inputs):
            raise PlanError(f"search: {len(inputs)} InputInfo given but the step has "
                            f"{len(graph.inputs)} flat inputs")
        largest = max((graph.value_bytes(Value(n.id, k)) for n in nodes
                       for k in range(len(n.op.out_shapes))
                       if n.op.out_dtypes[k] is not None), default=0)
        self.small_bytes = min(SMALL_BYTES_CAP, largest * SMALL_FRACTION)
        required: dict[tuple, list[Spec]] = collections.defaultdict(list)
        for i, pin in zip(graph.inputs, pins):
            if pin is not None and any(pin):
                required[nodes[i].op.out_shapes[0]].append(tuple(tuple(a) for a in pin))
        ctx = _rules.RuleContext(mesh, required=required)
        self.strats: list[list[_rules.Strategy]] = []
        self.stats: dict[str, Any] = {"small": 0}
        self.own_cost: list[np.ndarray] = []
        # Repeated layers repeat their ops: strategies and costs are computed once per
        # distinct (primitive, shapes, dtypes, params).
        memo: dict[tuple, tuple[list[_rules.Strategy], np.ndarray]] = {}
        self.aliased = {graph.outputs[o].node for o in self.aliases if graph.outputs[o] is not None}
        self.off_path = _off_critical_path(graph)
        self.stats["off_path"] = len(self.off_path)
        for n in nodes:
            off = n.id in self.off_path
            key = (self._op_key(n), off) if n.kind == "op" else None
            if key is not None and key in memo:
                ss, costs = memo[key]
            else:
                ss = self._strategies(n, ctx, inputs, pins)
                costs = np.array([self._cost(n, s, off) for s in ss])
                if key is not None:
                    memo[key] = (ss, costs)
            self.strats.append(ss)
            self.own_cost.append(costs * n.repeat if n.repeat != 1 else costs)
        self._merge_followers()
        self._tie_layers(share_layers)

    # -- strategies ----------------------------------------------------------------------
    @staticmethod
    def _op_key(n) -> tuple:
        op = n.op
        return (op.primitive, op.in_shapes, op.in_dtypes, op.out_shapes, op.out_dtypes,
                repr(sorted(op.params.items())))

    def _strategies(self, n, ctx, inputs, pins) -> list[_rules.Strategy]:
        shape, dtype = (n.op.out_shapes[0], n.op.out_dtypes[0]) if n.op.out_shapes else ((), None)
        if n.kind == "const":
            return [_input_strategy(replicated(len(shape)))]
        if n.kind == "input":
            info, pin = inputs[n.input_index], pins[n.input_index]
            if pin is not None:
                pin = tuple(tuple(a) for a in pin)
                if not is_valid(pin, shape, self.mesh_shape):
                    raise PlanError(f"input {info.path} (shape {shape}): spec {format_spec(pin)} "
                                    f"does not fit mesh {self.mesh_shape}")
                return [_input_strategy(pin)]
            if _nbytes(shape, dtype) < self.small_bytes:
                self.stats["small"] += 1
                return [_input_strategy(replicated(len(shape)))]
            return [_input_strategy(s) for s in all_specs(shape, self.mesh_shape, 2)]
        return _rules.strategies(n.op, ctx)

    def _cost(self, n, s: _rules.Strategy, off_path: bool = False) -> float:
        if n.kind != "op":  # tie-break: between equally fast plans, hold less
            return INPUT_BYTES_WEIGHT * self.cost.memory_time(
                bytes_per_device(n.op.out_shapes[0], n.op.out_dtypes[0], s.out_specs[0], self.mesh_shape))
        # Off the critical path XLA combines a kind's collectives into one: each pays its
        # bandwidth here, their shared latency once per plan (``_shared_latency``).
        return (self.cost.compute(s.flops, _dtype(n.op)) if s.flops else 0.0) + \
            sum(self.cost.split(c)[0] if off_path and self.cost.partitioner.combine_key(c)
                else self.cost.time(c) for c in s.collectives)

    # -- followers -----------------------------------------------------------------------
    def _merge_followers(self) -> None:
        nodes = self.g.nodes
        self.root = list(range(len(nodes)))
        self.fmap: list[np.ndarray] = [np.arange(len(ss)) for ss in self.strats]
        merged = 0
        # The new value of a parameter or optimizer state must come back in its input's
        # spec; merged into its operand's group it would share that group's spec, so the
        # update of a replicated parameter and of its sharded optimizer state (ZeRO) could
        # not both hold. Such outputs keep their own choice.
        for n in nodes:
            if n.kind != "op" or not _rules.is_follower(n.op.primitive) or n.id in self.aliased:
                continue
            cands = [(math.prod(n.op.in_shapes[i]), -i, i) for i, v in enumerate(n.operands)
                     if v is not None and nodes[v.node].kind == "op"]
            if not cands:
                continue
            m = max(cands)[2]
            v = n.operands[m]
            u, r = v.node, self.root[v.node]
            best: dict[Spec, int] = {}
            for j, s in enumerate(self.strats[n.id]):
                key = s.in_specs[m]
                if key not in best or self.own_cost[n.id][j] < self.own_cost[n.id][best[key]]:
                    best[key] = j
            mapping = []
            for ri in range(len(self.strats[r])):
                spec = self.strats[u][self.fmap[u][ri]].out_specs[v.index]
                if spec not in best:
                    break
                mapping.append(best[spec])
            else:
                self.root[n.id] = r
                self.fmap[n.id] = np.array(mapping, dtype=int)
                merged += 1
        self.stats["followers_merged"] = merged
        self.groups: dict[int, list[int]] = collections.defaultdict(list)
        for i, r in enumerate(self.root):
            self.groups[r].append(i)
        self.roots = sorted(self.groups)
        self.index = {r: i for i, r in enumerate(self.roots)}

    # -- repeated layers -----------------------------------------------------------------
    def _tie_layers(self, enabled: bool) -> None:
        nodes = self.g.nodes
        parent = {r: r for r in self.roots}

        def find(x):
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        def union(a, b):
            ra, rb = find(a), find(b)
            if ra != rb and self._names(ra) == self._names(rb):
                parent[max(ra, rb)] = min(ra, rb)
                return True
            return False

        tied = 0
        if enabled:
            sig = self._colours()
            tok = self._tokens
            by_sig: dict[int, list[int]] = collections.defaultdict(list)
            for n in nodes:
                if n.kind == "op" and self.root[n.id] == n.id and len(self.strats[n.id]) > 1:
                    by_sig[sig[n.id]].append(n.id)
            size = len(nodes)

            def window(a, b):
                return b + MIN_PERIOD <= size and all(sig[a + i] == sig[b + i] for i in range(MIN_PERIOD))

            for members in by_sig.values():
                for i, a in enumerate(members):
                    later = members[i + 1:]
                    if not later or (later[0] - a < MIN_PERIOD and window(a, later[0])):
                        continue  # no repeat, or a short period: leave it free
                    for b in later:
                        if b - a >= MIN_PERIOD and window(a, b):
                            if union(a, b):
                                tied += 1
                                for va, vb in zip(nodes[a].operands, nodes[b].operands):
                                    if (va is not None and vb is not None and va.node != vb.node
                                            and nodes[va.node].kind == "input" == nodes[vb.node].kind
                                            and tok[va.node] == tok[vb.node] and union(va.node, vb.node)):
                                        tied += 1
                            break
        # A loop-carried value has one spec in every iteration: its carry pseudo-ops share a
        # variable (or, when their candidates differ, get a hard edge in ``request``).
        self.untied_loops = [(a, b) for a, b in self.g.loops
                             if find(self.root[a]) != find(self.root[b])
                             and not union(self.root[a], self.root[b])]
        self.same_as = [-1] * len(self.roots)
        for r in self.roots:
            rep = find(r)
            if rep != r:
                self.same_as[self.index[r]] = self.index[rep]
        self.stats["tied"] = tied

    def _colours(self, rounds: int = WL_ROUNDS) -> list[int]:
        """A structural colour per node (Weisfeiler-Lehman refinement): the op itself, then
        ``rounds`` times the colours of its operands (in order). Unlike program distances,
        colours match between layers whose backward pass reads forward values at different
        distances; few rounds keep the first and last layer, whose neighbours differ, tied."""
        nodes = self.g.nodes
        tok = [hash((n.kind, n.op.primitive, n.op.in_shapes, n.op.out_shapes, n.op.out_dtypes,
                     repr(sorted((k, repr(v)[:200]) for k, v in n.op.params.items())),
                     tuple(self._names(n.id)) if n.kind == "input" else ()))
               for n in nodes]
        self._tokens = tok
        col = tok
        for _ in range(rounds):
            col = [hash((col[n.id],
                         tuple(None if v is None else (col[v.node], v.index) for v in n.operands)))
                   for n in nodes]
        return col

    def _names(self, r: int) -> list[str]:
        return [s.name for s in self.strats[r]]

    # -- looking things up under a choice of root strategies -----------------------------
    def strategy_of(self, node: int, root_choice: int) -> _rules.Strategy:
        return self.strats[node][self.fmap[node][root_choice]]

    def out_spec(self, v: Value, root_choice: int) -> Spec:
        return self.strategy_of(v.node, root_choice).out_specs[v.index]

    def _spec_list(self, node: int, index: int, out: bool) -> tuple[Spec, ...]:
        """The spec of ``node``'s output (``out``) or operand ``index`` under each of its
        root's strategies; repeated layers share their strategy lists, so this is memoized
        on the list and the follower map."""
        ss, fm = self.strats[node], self.fmap[node]
        key = (id(ss), fm.tobytes(), index, out)
        cache = self.__dict__.setdefault("_scache", {})
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = (tuple(ss[k].out_specs[index] for k in fm.tolist()) if out else
                                tuple(ss[k].in_specs[index] for k in fm.tolist()), ss)
        return hit[0]

    # -- the request ---------------------------------------------------------------------
    def request(self, memory_budget: float | None, time_limit: float) -> SolverRequest:
        g, nodes = self.g, self.g.nodes
        costs = [np.zeros(len(self.strats[r])) for r in self.roots]
        for n in nodes:
            costs[self.index[self.root[n.id]]] += self.own_cost[n.id][self.fmap[n.id]]
        edges: dict[tuple[int, int], np.ndarray] = {}

        def add_edge(a: int, b: int, mat: np.ndarray) -> None:
            if a > b:
                a, b, mat = b, a, mat.T
            edges[(a, b)] = edges[(a, b)] + mat if (a, b) in edges else mat

        for n in nodes:
            rv = self.root[n.id]
            for i, v in enumerate(n.operands):
                if v is None:
                    continue
                ru = self.root[v.node]
                shape, dtype = g.value_shape(v), g.value_dtype(v)
                src = self._spec_list(v.node, v.index, True)
                dst = self._spec_list(n.id, i, False)
                # A reshard inside a loop body happens on every iteration.
                if ru == rv:
                    if src != dst:
                        costs[self.index[rv]] += [n.repeat * self._reshard_time(shape, dtype, a, b)
                                                  for a, b in zip(src, dst)]
                    continue
                mat = self._matrix(shape, dtype, src, dst)
                add_edge(self.index[ru], self.index[rv], mat * n.repeat if n.repeat != 1 else mat)
        # Equal specs, as hard edges: an output aliasing its input; a loop's carry pair that
        # could not share one variable (``_tie_layers``).
        equal = [(g.outputs[o], Value(g.inputs[i], 0)) for o, i in self.aliases.items()]
        equal += [(Value(b, 0), Value(a, 0)) for a, b in self.untied_loops]
        for v, w in equal:
            if v is None or self.root[v.node] == self.root[w.node]:
                continue
            src = self._spec_list(v.node, v.index, True)
            dst = self._spec_list(w.node, w.index, True)
            mat = np.array([[0.0 if a == b else math.inf for b in dst] for a in src])
            add_edge(self.index[self.root[v.node]], self.index[self.root[w.node]], mat)
        memory, liveness = self._memory()
        edge_list = sorted(edges)
        return SolverRequest(
            node_names=[nodes[r].key + (f" {nodes[r].op.primitive}" if nodes[r].kind == "op" else "")
                        for r in self.roots],
            strategy_names=[self._names(r) for r in self.roots],
            node_costs=[c.tolist() for c in costs],
            edges=edge_list, edge_costs=[edges[e] for e in edge_list],  # arrays: no copy
            same_as=list(self.same_as), node_memory=memory, liveness=liveness,
            memory_budget=memory_budget, warm_start=None, time_limit=time_limit,
            charges=self._shared_latency())

    def _shared_latency(self) -> list[tuple[float, list[tuple[int, int]]]]:
        """One charge per (kind, mesh axes) of the collectives XLA combines off the critical
        path: their latency, paid once by the plan if any chosen strategy emits one (node
        costs carry only their bandwidth, see ``_cost``), as ``_predict`` prices them."""
        members: dict[tuple[str, tuple[str, ...]], set[tuple[int, int]]] = \
            collections.defaultdict(set)
        latency: dict[tuple[str, tuple[str, ...]], float] = {}
        for node in sorted(self.off_path):
            root = self.index[self.root[node]]
            for k, j in enumerate(self.fmap[node].tolist()):
                for c in self.strats[node][j].collectives:
                    key, lat = self.cost.partitioner.combine_key(c), self.cost.latency(c)
                    if key is not None and lat > 0:
                        members[key].add((root, k))
                        latency[key] = lat
        return [(latency[key], sorted(members[key])) for key in sorted(members)]

    def _reshard_time(self, shape, dtype, src: Spec, dst: Spec) -> float:
        return self._reshard(shape, dtype, src, dst)[0]

    def _reshard(self, shape, dtype, src: Spec, dst: Spec):
        if src == dst:
            return 0.0, ()
        key = (shape, dtype, src, dst)
        cache = self.__dict__.setdefault("_cache", {})
        if key not in cache:
            cache[key] = self.cost.reshard(shape, dtype, src, dst)
        return cache[key]

    def _matrix(self, shape, dtype, src: Sequence[Spec], dst: Sequence[Spec]) -> np.ndarray:
        """Reshard seconds for every (src, dst) pair, each distinct pair priced once."""
        full = self.__dict__.setdefault("_fcache", {})
        fkey = (shape, dtype, id(src), id(dst))
        hit = full.get(fkey)
        if hit is not None and hit[1] is src and hit[2] is dst:
            return hit[0]
        us, vs = {}, {}
        ui = np.array([us.setdefault(s, len(us)) for s in src])
        vi = np.array([vs.setdefault(s, len(vs)) for s in dst])
        key = (shape, dtype, tuple(us), tuple(vs))
        cache = self.__dict__.setdefault("_mcache", {})
        if key not in cache:
            cache[key] = np.array([[self._reshard_time(shape, dtype, a, b) for b in vs]
                                   for a in us]).reshape(len(us), len(vs))
        out = cache[key][np.ix_(ui, vi)]
        full[fkey] = (out, src, dst)  # holding src, dst keeps their ids unique
        return out

    # -- memory --------------------------------------------------------------------------
    def intervals(self) -> list[tuple[Value, int, int]]:
        """Every array value with its live range [start, end] in program points."""
        g, nodes = self.g, self.g.nodes
        end_all = len(nodes)
        last = g.last_use()
        donated = set(self.aliases.values())
        out = []
        for n in nodes:
            for k, (shape, dtype) in enumerate(zip(n.op.out_shapes, n.op.out_dtypes)):
                if _nbytes(shape, dtype) == 0:
                    continue
                if n.kind == "input":
                    end = last[n.id] if n.input_index in donated else end_all
                    out.append((Value(n.id, k), 0, min(end, end_all)))
                elif n.kind == "const":
                    out.append((Value(n.id, k), 0, end_all))
                else:
                    out.append((Value(n.id, k), n.id, last[n.id]))
        return out

    def _value_bytes(self, v: Value, spec: Spec) -> float:
        shape, dtype = self.g.value_shape(v), self.g.value_dtype(v)
        key = (shape, dtype, spec)
        cache = self.__dict__.setdefault("_bcache", {})
        if key not in cache:
            cache[key] = float(bytes_per_device(shape, dtype, spec, self.mesh_shape))
        return cache[key]

    def _bytes_row(self, v: Value) -> np.ndarray:
        """Bytes per device of value ``v`` under each strategy of its root (memoized)."""
        specs = self._spec_list(v.node, v.index, True)
        shape, dtype = self.g.value_shape(v), self.g.value_dtype(v)
        cache = self.__dict__.setdefault("_rcache", {})
        key = (shape, dtype, specs)
        if key not in cache:
            cache[key] = np.array([self._value_bytes(v, s) for s in specs], dtype=float)
        return cache[key]

    def _memory(self) -> tuple[list[list[float]], list[list[int]]]:
        ivs = self.intervals()
        npts = len(self.g.nodes) + 1
        by_group: dict[int, list] = collections.defaultdict(list)
        diff = np.zeros(npts + 1)
        for v, a, b in ivs:
            by_group[self.root[v.node]].append((v, a, b))
            size = self.g.value_bytes(v)
            diff[a] += size
            diff[b + 1] -= size
        memory = []
        for r in self.roots:
            vals = by_group.get(r, [])
            ev = sorted([(a, self.g.value_bytes(v)) for v, a, b in vals] +
                        [(b + 1, -self.g.value_bytes(v)) for v, a, b in vals])
            best_t, best, cur = 0, -1.0, 0.0
            for t, d in ev:
                cur += d
                if cur > best:
                    best, best_t = cur, t
            live = [v for v, a, b in vals if a <= best_t <= b]
            row = np.zeros(len(self.strats[r]))
            for v in live:
                row += self._bytes_row(v)
            memory.append(row.tolist())
        totals = np.cumsum(diff)[:npts]
        points = np.argsort(-totals, kind="stable")[:LIVENESS_POINTS]
        sets, seen = [], set()
        starts = np.array([a for _, a, _ in ivs], dtype=np.int64)
        ends = np.array([b for _, _, b in ivs], dtype=np.int64)
        owner = np.array([self.index[self.root[v.node]] for v, _, _ in ivs], dtype=np.int64)
        for t in sorted(points.tolist()):
            live = frozenset(np.unique(owner[(starts <= t) & (t <= ends)]).tolist())
            if live and live not in seen:
                seen.add(live)
                sets.append(sorted(live))
        return memory, sets

    # -- reading a choice back -----------------------------------------------------------
    def node_choice(self, choice: Sequence[int]) -> list[int]:
        """Root strategy index chosen for each graph node."""
        return [int(choice[self.index[self.root[n.id]]]) for n in self.g.nodes]


#: ops whose inputs are on the step's critical path: a collective feeding one of them waits
#: for its own result and cannot be merged with the others.
_HEAVY = ("dot_general", "conv_general_dilated")


def _off_critical_path(g: Graph) -> set[int]:
    """Op nodes no matmul or convolution depends on (weight gradients, the loss, optimizer
    updates): their collectives are independent of one another, and XLA combines them."""
    below = [False] * len(g.nodes)  # some heavy op depends on this node
    for n in reversed(g.nodes):
        if below[n.id] or (n.kind == "op" and n.op.primitive in _HEAVY):
            for v in n.operands:
                if v is not None:
                    below[v.node] = True
    return {n.id for n in g.nodes if n.kind == "op" and not below[n.id]}
