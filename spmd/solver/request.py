"""The solver's flat input and output, and the checks and scores that need no solver.

``SolverRequest`` / ``SolverResult`` are what the planner and the solver exchange;
``validate``, ``evaluate`` and ``memory_peak`` check and score any assignment (e.g. a
hand-written plan) with the same numbers the solver uses; ``reduce`` folds a request into
the per-group problem (``Reduced``) that the seeds and the CP-SAT model work on.

Besides node and edge costs a request holds two kinds of term that no single node or edge
can carry: *charges* (a cost paid once when any of its strategies is chosen: the latency
that collectives XLA combines share) and *fan-outs* (a value resharded once per distinct
spec its consumers want, however many consumers want it: XLA reshards a value once per
target spec, so an edge per consumer would pay it again for each).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from typing import Sequence

import numpy as np

from spmd.errors import PlanError

__all__ = ["Copy", "Fanout", "Reduced", "SolverRequest", "SolverResult", "add_pair",
           "copy_held", "copy_targets", "evaluate", "memory_peak", "reduce", "set_bytes",
           "validate"]

#: (producer node, costs[producer strategy][target], [(consumer node, target per strategy)])
Fanout = tuple[int, Sequence[Sequence[float]], list[tuple[int, Sequence[int]]]]
#: (producer node, bytes[producer strategy][target], readers up to a program point, readers
#: from it), each reader as (node, target per strategy): a value's copy in a target spec is
#: live at the point when readers on both sides want that target (0 bytes where the
#: producer's own spec is the target: no copy)
Copy = tuple[int, Sequence[Sequence[float]], list[tuple[int, Sequence[int]]],
             list[tuple[int, Sequence[int]]]]


@dataclasses.dataclass
class SolverRequest:
    """Everything the integer program needs, flat and serialisable.

    Attributes:
        node_names: one readable name per node.
        strategy_names: per node, readable strategy names, e.g.
            ``"SR = SS x SR @ {model} (all-reduce @ model)"``.
        node_costs: seconds per (node, strategy): compute plus its own communication;
            ``inf`` forbids the strategy.
        edges: (u, v) pairs: v consumes u's output.
        edge_costs: per edge, R[s_u][s_v] seconds of resharding; ``inf`` forbids the pair.
        same_as: per node, -1 or a node with the same number of strategies whose choice it
            shares (repeated layers).
        node_memory: bytes per device per (node, strategy) of the value the node produces.
        liveness: sets of node ids live together at some program point.
        memory_budget: bytes per device every liveness set must fit in, or None.
        warm_start: a strategy index per node used as the solver's hint, or None.
        time_limit: seconds the solver may take.
        charges: (seconds, [(node, strategy), ...]) paid once when any listed strategy is
            chosen: the latency that independent collectives of one kind over the same mesh
            axes share once XLA combines them (a cost no single node or edge can carry).
        fanouts: (producer, costs, consumers): each consumer's strategy names a target
            (``targets[strategy]``, an index into the columns of ``costs``); every distinct
            target the chosen strategies name costs ``costs[producer's strategy][target]``,
            once. A value read by several consumers is resharded once per spec they want.
        liveness_memory: per liveness set, per member (in its order), the member's bytes per
            strategy live at that set's point; None: each member's ``node_memory`` (a bound:
            a node standing for many values is charged all of them wherever one is live).
        liveness_copies: per liveness set, the copies of values it holds besides its
            members' values (``Copy``: a value's copy in a spec that readers on both sides
            of the set's point want, where its producer's spec differs); None: none.
    """

    node_names: list[str]
    strategy_names: list[list[str]]
    node_costs: list[list[float]]
    edges: list[tuple[int, int]]
    edge_costs: list[list[list[float]]]
    same_as: list[int]
    node_memory: list[list[float]]
    liveness: list[list[int]]
    memory_budget: float | None = None
    warm_start: list[int] | None = None
    time_limit: float = 30.0
    charges: list[tuple[float, list[tuple[int, int]]]] = dataclasses.field(default_factory=list)
    fanouts: list[Fanout] = dataclasses.field(default_factory=list)
    liveness_memory: list[list[list[float]]] | None = None
    liveness_copies: list[list[Copy]] | None = None

    def set_terms(self, i: int) -> list[tuple[int, Sequence[float]]]:
        """Liveness set ``i`` as (node, bytes per strategy) terms, each counted once."""
        if self.liveness_memory is None:
            return [(v, self.node_memory[v]) for v in dict.fromkeys(self.liveness[i])]
        return list(zip(self.liveness[i], self.liveness_memory[i]))

    def copy_terms(self, i: int) -> list[Copy]:
        """Liveness set ``i``'s copies (``liveness_copies``)."""
        return [] if self.liveness_copies is None else list(self.liveness_copies[i])

    def to_json(self) -> str:
        """Serialise (``inf`` as the string "inf") so a request can be saved and replayed."""
        return json.dumps(_encode(dataclasses.asdict(self)))

    @classmethod
    def from_json(cls, text: str) -> "SolverRequest":
        raw = _decode(json.loads(text))
        raw["edges"] = [tuple(e) for e in raw["edges"]]
        raw["charges"] = [(cost, [tuple(m) for m in members])
                          for cost, members in raw.get("charges", [])]
        raw["fanouts"] = [(producer, costs, [(node, targets) for node, targets in consumers])
                          for producer, costs, consumers in raw.get("fanouts", [])]
        if raw.get("liveness_copies") is not None:
            raw["liveness_copies"] = [
                [(producer, nbytes, [tuple(r) for r in before], [tuple(r) for r in after])
                 for producer, nbytes, before, after in terms]
                for terms in raw["liveness_copies"]]
        return cls(**raw)


@dataclasses.dataclass
class SolverResult:
    """The chosen strategy per node and how good it is.

    ``objective`` is the exact float cost of ``choice`` (seconds, via ``evaluate``);
    ``bound`` the best proven lower bound in seconds (``bound_from`` says whose; CP-SAT's is
    accurate to the rescaling precision). When CP-SAT was skipped, ``num_variables`` counts
    the strategy booleans it would have had and ``num_constraints`` is 0.
    """

    choice: list[int]
    objective: float
    bound: float
    status: str  # "optimal" | "feasible"
    solve_time: float
    num_variables: int
    num_constraints: int
    timed_out: bool
    #: CP-SAT stopped early, no better plan having come for a while
    #: (see ``SolverOptions.stall_seconds``)
    stalled: bool = False
    #: what proved ``bound``: "cp-sat", or "diffusion" (``spmd.solver.min_sum``), whose bound
    #: within ``SolverOptions.gap`` of a seed skips CP-SAT
    bound_from: str = "cp-sat"


def _encode(x):
    if isinstance(x, np.ndarray):
        x = x.tolist()
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if isinstance(x, (list, tuple)):
        return [_encode(v) for v in x]
    if isinstance(x, dict):
        return {k: _encode(v) for k, v in x.items()}
    return x


def _decode(x):
    if x in ("inf", "-inf"):
        return float(x)
    if isinstance(x, list):
        return [_decode(v) for v in x]
    if isinstance(x, dict):
        return {k: _decode(v) for k, v in x.items()}
    return x


# -- validate, evaluate ------------------------------------------------------------------


def validate(request: SolverRequest) -> None:
    """Check that every list agrees in length and every index is in range.

    Raises:
        PlanError: naming the node, edge or liveness set at fault.
    """
    r = request
    n = len(r.node_names)
    name = lambda v: f"node {v} ({r.node_names[v]!r})"  # noqa: E731
    for field in ("strategy_names", "node_costs", "same_as", "node_memory"):
        if len(getattr(r, field)) != n:
            raise PlanError(f"solver request: {field} has {len(getattr(r, field))} entries "
                            f"for {n} nodes")
    sizes = [len(s) for s in r.strategy_names]
    if 0 in sizes:
        raise PlanError(f"solver request: {name(sizes.index(0))} has no strategies")
    for field in ("node_costs", "node_memory"):
        for v, (row, k) in enumerate(zip(getattr(r, field), sizes)):
            if len(row) != k:
                raise PlanError(f"solver request: {name(v)} has {k} strategies but "
                                f"{len(row)} {field}")
    # One pass over every node's numbers; the node at fault is looked for only on a fault.
    costs = np.concatenate([np.asarray(c, dtype=float) for c in r.node_costs]) if n else np.zeros(0)
    memory = np.concatenate([np.asarray(m, dtype=float) for m in r.node_memory]) if n else np.zeros(0)
    owner = np.repeat(np.arange(n), sizes)
    if np.isnan(costs).any():
        raise PlanError(f"solver request: {name(int(owner[np.isnan(costs)][0]))} has a NaN cost")
    bad = ~np.isfinite(memory) | (memory < 0)
    if bad.any():
        raise PlanError(f"solver request: {name(int(owner[bad][0]))} has a negative or "
                        f"non-finite memory")
    for v in range(n):
        k = sizes[v]
        rep = r.same_as[v]
        if rep != -1:
            if not 0 <= rep < n or rep == v:
                raise PlanError(f"solver request: {name(v)} same_as {rep} is not another node")
            if len(r.strategy_names[rep]) != k:
                raise PlanError(f"solver request: {name(v)} has {k} strategies but its "
                                f"same_as {name(rep)} has {len(r.strategy_names[rep])}")
    _representatives(r)  # detects cycles
    if len(r.edge_costs) != len(r.edges):
        raise PlanError(f"solver request: {len(r.edges)} edges but {len(r.edge_costs)} edge_costs")
    for e, (u, v) in enumerate(r.edges):
        if not (0 <= u < n and 0 <= v < n) or u == v:
            raise PlanError(f"solver request: edge {e} ({u}, {v}) does not join two nodes of {n}")
        mat = r.edge_costs[e]
        ku, kv = len(r.strategy_names[u]), len(r.strategy_names[v])
        shape = mat.shape if isinstance(mat, np.ndarray) else None
        if (shape != (ku, kv) if shape is not None
                else len(mat) != ku or any(len(row) != kv for row in mat)):
            raise PlanError(f"solver request: edge {e} {name(u)} -> {name(v)} needs a "
                            f"{ku} x {kv} cost matrix")
    # NaNs: one pass over every edge's entries; the edge at fault only looked for on one.
    flat = [np.asarray(m, dtype=float).ravel() for m in r.edge_costs]
    if flat and np.isnan(np.concatenate(flat)).any():
        e = next(e for e, m in enumerate(flat) if np.isnan(m).any())
        u, v = r.edges[e]
        raise PlanError(f"solver request: edge {e} {name(u)} -> {name(v)} has a NaN cost")
    for i, live in enumerate(r.liveness):
        bad = [v for v in live if not 0 <= v < n]
        if bad:
            raise PlanError(f"solver request: liveness set {i} names unknown nodes {bad}")
    if r.liveness_memory is not None:
        if len(r.liveness_memory) != len(r.liveness):
            raise PlanError(f"solver request: liveness_memory has {len(r.liveness_memory)} "
                            f"sets for {len(r.liveness)} liveness sets")
        for i, (live, rows) in enumerate(zip(r.liveness, r.liveness_memory)):
            if len(rows) != len(live) or any(len(row) != sizes[v] for v, row in zip(live, rows)):
                raise PlanError(f"solver request: liveness set {i} needs one row per member, "
                                f"each with one entry per strategy of the member")
        # One pass over every set's numbers (a 24-layer GPT's sets hold ~1M of them); the
        # set at fault is looked for only on a fault.
        entries = np.fromiter(itertools.chain.from_iterable(
            itertools.chain.from_iterable(r.liveness_memory)), dtype=float)
        if not (np.isfinite(entries) & (entries >= 0)).all():
            i = next(i for i, rows in enumerate(r.liveness_memory)
                     if any(not (math.isfinite(m) and m >= 0) for row in rows for m in row))
            raise PlanError(f"solver request: liveness set {i} has a negative or "
                            f"non-finite memory")
    if r.liveness_copies is not None:
        _check_copies(r, sizes)
    for i, (cost, members) in enumerate(r.charges):
        if not (math.isfinite(cost) and cost >= 0):
            raise PlanError(f"solver request: charge {i} costs {cost}; it must be finite and "
                            f"non-negative")
        for v, k in members:
            if not (0 <= v < n and 0 <= k < len(r.strategy_names[v])):
                raise PlanError(f"solver request: charge {i} names strategy {k} of node {v}, "
                                f"which does not exist")
    for i, (producer, costs, consumers) in enumerate(r.fanouts):
        _check_fanout(r, i, producer, costs, consumers)
    if r.memory_budget is not None and not r.memory_budget > 0:
        raise PlanError(f"solver request: memory_budget must be positive, got {r.memory_budget}")
    if r.warm_start is not None:
        _check_choice(r, r.warm_start, "warm_start")
    if not r.time_limit > 0:
        raise PlanError(f"solver request: time_limit must be positive, got {r.time_limit}")


def _check_copies(r: SolverRequest, sizes: Sequence[int]) -> None:
    if len(r.liveness_copies) != len(r.liveness):
        raise PlanError(f"solver request: liveness_copies has {len(r.liveness_copies)} sets "
                        f"for {len(r.liveness)} liveness sets")
    n = len(sizes)
    for i, terms in enumerate(r.liveness_copies):
        for k, (producer, nbytes, before, after) in enumerate(terms):
            where = f"solver request: liveness set {i}'s copy {k}"
            if not 0 <= producer < n:
                raise PlanError(f"{where}: producer {producer} is not one of {n} nodes")
            m = np.asarray(nbytes, dtype=float)
            if m.ndim != 2 or m.shape[0] != sizes[producer]:
                raise PlanError(f"{where}: needs one row of bytes per strategy of node "
                                f"{producer} ({sizes[producer]}), got shape {m.shape}")
            if not (np.isfinite(m).all() and (m >= 0).all()):
                raise PlanError(f"{where}: has a negative or non-finite memory")
            if not before or not after:
                raise PlanError(f"{where}: needs readers on both sides of its point")
            for node, targets in [*before, *after]:
                if not 0 <= node < n or len(targets) != sizes[node]:
                    raise PlanError(f"{where}: reader {node} needs to be a node and name one "
                                    f"target per strategy")
                if len(targets) and not 0 <= min(targets) <= max(targets) < m.shape[1]:
                    raise PlanError(f"{where}: reader {node} names a target outside the "
                                    f"{m.shape[1]} columns of its bytes")


def _check_fanout(r: SolverRequest, i: int, producer: int, costs, consumers) -> None:
    n = len(r.node_names)
    where = f"solver request: fan-out {i}"
    if not 0 <= producer < n:
        raise PlanError(f"{where}: producer {producer} is not one of {n} nodes")
    mat = np.asarray(costs, dtype=float)
    k = len(r.strategy_names[producer])
    if mat.ndim != 2 or mat.shape[0] != k:
        raise PlanError(f"{where}: costs must have one row per strategy of node {producer} "
                        f"({k}), got shape {mat.shape}")
    if not (np.isfinite(mat).all() and (mat >= 0).all()):
        raise PlanError(f"{where}: costs must be finite and non-negative")
    if not consumers:
        raise PlanError(f"{where}: no consumers")
    for node, targets in consumers:
        if not 0 <= node < n:
            raise PlanError(f"{where}: consumer {node} is not one of {n} nodes")
        if len(targets) != len(r.strategy_names[node]):
            raise PlanError(f"{where}: consumer {node} needs one target per strategy "
                            f"({len(r.strategy_names[node])}), got {len(targets)}")
        picks = np.asarray(targets)
        if picks.size and not (0 <= picks.min() and picks.max() < mat.shape[1]):
            raise PlanError(f"{where}: consumer {node} names a target outside the "
                            f"{mat.shape[1]} columns of its costs")


def _fanout_cost(costs, pick_producer: int, targets: set[int]) -> float:
    return sum(float(costs[pick_producer][t]) for t in targets)


def _check_choice(r: SolverRequest, choice: Sequence[int], what: str) -> None:
    if len(choice) != len(r.node_names):
        raise PlanError(f"{what}: {len(choice)} entries for {len(r.node_names)} nodes")
    for v, s in enumerate(choice):
        if not 0 <= s < len(r.strategy_names[v]):
            raise PlanError(f"{what}: node {v} ({r.node_names[v]!r}) has no strategy {s}")


def _representatives(r: SolverRequest) -> list[int]:
    """Follow same_as links to the node that owns each choice."""
    rep = []
    for v in range(len(r.node_names)):
        seen, u = {v}, v
        while r.same_as[u] != -1:
            u = r.same_as[u]
            if u in seen:
                raise PlanError(f"solver request: same_as links of node {v} "
                                f"({r.node_names[v]!r}) form a cycle")
            seen.add(u)
        rep.append(u)
    return rep


def evaluate(request: SolverRequest, choice: Sequence[int]) -> float:
    """Objective (seconds) of an assignment: Σ node costs + Σ edge costs + the charges some
    chosen strategy incurs + each fan-out's distinct targets; ``inf`` if forbidden.

    It does not enforce same_as or memory; see ``memory_peak``.
    """
    _check_choice(request, choice, "evaluate")
    total = sum(request.node_costs[v][s] for v, s in enumerate(choice))
    total += sum(request.edge_costs[e][choice[u]][choice[v]]
                 for e, (u, v) in enumerate(request.edges))
    total += sum(cost for cost, members in request.charges
                 if any(choice[v] == k for v, k in members))
    total += sum(_fanout_cost(costs, choice[producer],
                              {int(targets[choice[v]]) for v, targets in consumers})
                 for producer, costs, consumers in request.fanouts)
    return float(total)


def copy_targets(term: Copy, choice: Sequence[int]) -> set[int]:
    """The targets of one ``Copy`` that readers on both sides of its point want under
    ``choice`` (a strategy per node): those it holds a copy in, where its producer differs."""
    _, _, before, after = term
    return {int(t[choice[v]]) for v, t in before} & {int(t[choice[v]]) for v, t in after}


def copy_held(term: Copy, choice: Sequence[int]) -> float:
    """Bytes of one ``Copy`` live at its point under ``choice`` (a strategy per node)."""
    producer, nbytes = term[:2]
    return sum(float(nbytes[choice[producer]][d]) for d in copy_targets(term, choice))


def set_bytes(request: SolverRequest, choice: Sequence[int]) -> list[float]:
    """Bytes per device each liveness set holds under ``choice``: its members' and copies'."""
    return [sum(row[choice[v]] for v, row in request.set_terms(i))
            + sum(copy_held(term, choice) for term in request.copy_terms(i))
            for i in range(len(request.liveness))]


def memory_peak(request: SolverRequest, choice: Sequence[int]) -> float:
    """Largest bytes per device over the liveness sets under ``choice`` (0 without sets)."""
    _check_choice(request, choice, "memory_peak")
    return max(set_bytes(request, choice), default=0.0)


# -- the reduced problem -------------------------------------------------------------------


@dataclasses.dataclass
class Reduced:
    """A request folded per representative group (tied nodes share one choice): costs per
    group, pairwise matrices between groups, and the charges and fan-outs left over, in
    group terms. The seeds and the CP-SAT model work on this."""

    groups: list[int]  # representative node ids
    group_of: list[int]  # node -> index into groups
    unary: list[np.ndarray]  # per group, seconds per strategy (inf: forbidden)
    pairs: dict[tuple[int, int], np.ndarray]  # (gu, gv), gu < gv -> matrix (inf: forbidden)
    charges: list[tuple[float, list[tuple[int, int]]]]  # as the request's, (group, strategy)
    #: (producer group, costs, [(consumer group, targets)]) with at least two consumer groups
    #: other than the producer's (fewer fold into unary and pairwise costs)
    fanouts: list[tuple[int, np.ndarray, list[tuple[int, np.ndarray]]]] = \
        dataclasses.field(default_factory=list)

    def total(self, pick: Sequence[int]) -> float:
        """Seconds of one strategy per group (``evaluate`` on the folded problem)."""
        return (sum(float(u[p]) for u, p in zip(self.unary, pick))
                + sum(float(m[pick[a], pick[b]]) for (a, b), m in self.pairs.items())
                + sum(cost for cost, members in self.charges
                      if any(pick[g] == k for g, k in members))
                + sum(_fanout_cost(costs, pick[gp], {int(t[pick[g]]) for g, t in consumers})
                      for gp, costs, consumers in self.fanouts))

    def pairwise(self, split: bool) -> "Reduced":
        """The same problem in pairwise terms, which the seeding moves and messages see.

        Each charge is spread evenly over the groups that can incur it, as node costs. Each
        fan-out becomes one edge per consumer. ``split``: each target's cost is split evenly
        between the consumers that can want it, exact when they all want it and lower
        otherwise, so a bound on this problem bounds the request's. Else every consumer pays
        its target in full: above the cost where consumers share a target, but moves and
        decodes that see it avoid resharding a value for two consumers, which a split lets
        each of them take for part of its price.
        """
        unary = [u.copy() for u in self.unary]
        for cost, members in self.charges:
            groups = {g for g, _ in members}
            for g, k in members:
                unary[g][k] += cost / len(groups)
        pairs = dict(self.pairs)
        for gp, costs, consumers in self.fanouts:
            paid = costs
            if split:
                wanting = np.zeros(costs.shape[1])
                for _, targets in consumers:
                    wanting[np.unique(targets)] += 1
                paid = costs / np.maximum(wanting, 1.0)[None, :]
            for g, targets in consumers:
                if g == gp:
                    unary[gp] += paid[np.arange(len(targets)), targets]
                else:
                    add_pair(pairs, gp, g, paid[:, targets])
        return Reduced(self.groups, self.group_of, unary, pairs, [], [])


def add_pair(pairs: dict, gu: int, gv: int, mat: np.ndarray) -> None:
    """Add a (gu strategies x gv strategies) matrix to the pair (gu, gv), stored gu < gv."""
    if gu > gv:
        gu, gv, mat = gv, gu, mat.T
    if (gu, gv) in pairs:
        pairs[(gu, gv)] = pairs[(gu, gv)] + mat
    else:
        pairs[(gu, gv)] = mat.copy()


def _distinct_sum(costs: np.ndarray, rows: list[np.ndarray], cols: list[np.ndarray],
                  width: int) -> np.ndarray:
    """M[i, j] = Σ over the distinct targets among ``rows[*][i]`` and ``cols[*][j]`` of
    ``costs[i, target]``: a fan-out whose consumers fold into the producer's group (rows,
    indexed by its strategy) and one other group (cols, indexed by that group's)."""
    k = costs.shape[0]
    out = np.zeros((k, width))
    index = np.arange(k)[:, None]
    seen: list[np.ndarray] = []
    for t in [r[:, None] for r in rows] + [c[None, :] for c in cols]:
        t = np.broadcast_to(t, (k, width))
        fresh = np.ones((k, width), dtype=bool)
        for s in seen:
            fresh &= t != s
        out += np.where(fresh, costs[index, t], 0.0)
        seen.append(t)
    return out


def reduce(r: SolverRequest) -> Reduced:
    """Fold a (valid) request per representative group; parallel edges merge, edges and
    fan-outs touching single-strategy groups fold into their neighbours' costs."""
    rep = _representatives(r)
    groups = sorted(set(rep))
    index = {g: i for i, g in enumerate(groups)}
    group_of = [index[rep[v]] for v in range(len(rep))]
    unary = [np.zeros(len(r.strategy_names[g])) for g in groups]
    for v, costs in enumerate(r.node_costs):
        unary[group_of[v]] += np.asarray(costs, dtype=float)
    pairs: dict[tuple[int, int], np.ndarray] = {}

    def pair(gu: int, gv: int, mat: np.ndarray) -> None:
        if not np.any(mat):
            return
        if gu == gv:  # both ends share one choice: only the diagonal can happen
            unary[gu] += np.diag(mat)
        elif len(unary[gu]) == 1:
            unary[gv] += mat[0, :]
        elif len(unary[gv]) == 1:
            unary[gu] += mat[:, 0]
        else:
            add_pair(pairs, gu, gv, mat)

    for e, (u, v) in enumerate(r.edges):
        pair(group_of[u], group_of[v], np.asarray(r.edge_costs[e], dtype=float))
    fanouts: dict[tuple, list] = {}
    for producer, costs, consumers in r.fanouts:
        gp = group_of[producer]
        costs = np.asarray(costs, dtype=float)
        # Consumers with one strategy want a fixed target: paid for sure, once.
        fixed = {int(t[0]) for v, t in consumers if len(unary[group_of[v]]) == 1}
        if fixed:
            unary[gp] += costs[:, sorted(fixed)].sum(axis=1)
            costs = costs.copy()
            costs[:, sorted(fixed)] = 0.0
        free = [(group_of[v], np.asarray(t, dtype=np.intp)) for v, t in consumers
                if len(unary[group_of[v]]) > 1]
        others = sorted({g for g, _ in free if g != gp})
        rows = [t for g, t in free if g == gp]
        if len(others) <= 1:
            width = len(unary[others[0]]) if others else 1
            cols = [t for g, t in free if g != gp]
            if rows or cols:
                mat = _distinct_sum(costs, rows, cols, width)
                if others:
                    pair(gp, others[0], mat)
                else:
                    unary[gp] += mat[:, 0]
            continue
        key = (gp, tuple((g, t.tobytes()) for g, t in free))
        if key in fanouts:
            fanouts[key][1] = fanouts[key][1] + costs
        else:
            fanouts[key] = [gp, costs, free]
    charges = [(float(cost), sorted({(group_of[v], k) for v, k in members}))
               for cost, members in r.charges if cost > 0 and members]
    return Reduced(groups, group_of, unary, pairs, charges,
                   [(gp, costs, free) for gp, costs, free in fanouts.values()])
