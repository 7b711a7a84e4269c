"""The intra-op integer program (Alpa, Zheng et al., OSDI'22 §4): flat request in, choice out.

The solver never sees the program. A ``SolverRequest`` lists nodes with their strategies and
costs, edges with resharding matrices, nodes that share a choice (repeated layers), liveness
sets and a memory budget; ``solve`` returns one strategy per node. Companions, as in XLA's
auto-sharding pass: ``validate`` (a consistent request, or a PlanError naming the node or
edge at fault), ``evaluate`` and ``memory_peak`` (score any assignment, e.g. a hand-written
plan, with the same numbers) and ``rescale`` (float seconds to the integers CP-SAT needs).
A request saved with ``to_json`` replays with ``SolverRequest.from_json`` to debug.

Formulation: one boolean x[v,s] per strategy of each representative node, exactly one true.
Nodes with ``same_as`` reuse their representative's booleans (their costs add to its). Edges
whose one end has a single strategy fold into the other end's costs; all-zero matrices are
dropped; parallel edges merge. A remaining edge (u, v) costs R[i][j] when x[u,i] and x[v,j].
Strategies whose rows (columns) of R are identical, i.e. that produce (want) the same spec,
share one class literal, so a 30 x 30 matrix is usually a handful of classes. Small class
matrices (<= ``MARGINAL_LIMIT`` entries) get edge booleans e[i,j] whose rows sum to the
u-class and columns to the v-class literals (the tight "local polytope" relaxation); larger
ones an integer c >= sum_j R[i][j] * y[v,j] enforced by y[u,i] (k_u constraints, no k_u * k_v
booleans). ``inf`` means forbidden: the strategy or the pair is excluded, never scaled.

CP-SAT (2 workers) starts from a complete hint: the best of ``warm_start`` and a fast local
search (spanning-tree dynamic programs, coordinate descent) run from several starts (greedy,
every group's first / last / cheapest strategy, the warm start). It stops once no plan better
by ``STALL_GAIN`` came for a short window; models over ``LIGHT_PRESOLVE_LIMIT`` variables get
one presolve round. On large models (> ``PRESOLVE_LIMIT``
variables) presolve is skipped, as on 2 cores it alone outlasts a limit of seconds. Measured
on 2 cores: a planner-like 2,000-node / 3,000-edge request (4-30 strategies) returns a
feasible plan in ~10 s with a 10 s limit, ~13% above the proven bound; the LP bound, not the
plan, is what stays loose (see tests/test_solver.py).

>>> req = SolverRequest(
...     node_names=["a", "b"], strategy_names=[["R", "S"], ["R", "S"]],
...     node_costs=[[1.0, 0.5], [1.0, 0.5]], edges=[(0, 1)],
...     edge_costs=[[[0.0, 2.0], [2.0, 0.0]]], same_as=[-1, -1],
...     node_memory=[[0.0, 0.0], [0.0, 0.0]], liveness=[], memory_budget=None, warm_start=None)
>>> res = solve(req)
>>> res.choice, res.objective, res.status
([1, 1], 1.0, 'optimal')
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Sequence

import numpy as np

from spmd.errors import InfeasibleError, PlanError

__all__ = [
    "SolverRequest", "SolverResult", "Scaled", "validate", "evaluate", "memory_peak",
    "rescale", "solve",
]

# Largest finite cost maps to this many integer units (see ``rescale``).
COST_UNITS = 1e6
# Per-liveness-set memory is scaled so the budget maps to this many units.
MEMORY_UNITS = 1e9
# Edge matrices (after merging identical rows/columns) up to this many entries get edge
# booleans; bigger ones enforced rows.
MARGINAL_LIMIT = 16
NUM_WORKERS = 2
# Models with more variables than this skip CP-SAT's presolve (see ``_run``).
PRESOLVE_LIMIT = 20_000
# ... and above this many, run a single presolve iteration (see ``_run``).
LIGHT_PRESOLVE_LIMIT = 5_000
# CP-SAT stops early when no better plan came for max(STALL_MIN_SECONDS, STALL_FRACTION x
# time limit): on 2 cores its bound stays loose, so waiting out the limit rarely pays (the
# plan is then reported "feasible", not timed out; the bound says how far it may be off).
STALL_MIN_SECONDS = 1.5
STALL_FRACTION = 0.05
# Only plans at least this much (relative) better than the last such one restart the stall
# clock: on large models CP-SAT keeps finding plans better by a fraction of a percent, and
# waiting for each of them ran the search to its limit (20 s on a 24-layer GPT, for < 1%).
STALL_GAIN = 0.005


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

    def to_json(self) -> str:
        """Serialise (``inf`` as the string "inf") so a request can be saved and replayed."""
        return json.dumps(_encode(dataclasses.asdict(self)))

    @classmethod
    def from_json(cls, text: str) -> "SolverRequest":
        raw = _decode(json.loads(text))
        raw["edges"] = [tuple(e) for e in raw["edges"]]
        return cls(**raw)


@dataclasses.dataclass
class SolverResult:
    """The chosen strategy per node and how good it is.

    ``objective`` is the exact float cost of ``choice`` (seconds, via ``evaluate``);
    ``bound`` the solver's best lower bound in seconds (accurate to the rescaling precision).
    """

    choice: list[int]
    objective: float
    bound: float
    status: str  # "optimal" | "feasible"
    solve_time: float
    num_variables: int
    num_constraints: int
    timed_out: bool
    #: CP-SAT stopped early, no better plan having come for a while (see ``STALL_FRACTION``)
    stalled: bool = False


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
    for v in range(n):
        k = len(r.strategy_names[v])
        if k == 0:
            raise PlanError(f"solver request: {name(v)} has no strategies")
        for field in ("node_costs", "node_memory"):
            if len(getattr(r, field)[v]) != k:
                raise PlanError(f"solver request: {name(v)} has {k} strategies but "
                                f"{len(getattr(r, field)[v])} {field}")
        if any(math.isnan(c) for c in r.node_costs[v]):
            raise PlanError(f"solver request: {name(v)} has a NaN cost")
        if any(not math.isfinite(m) or m < 0 for m in r.node_memory[v]):
            raise PlanError(f"solver request: {name(v)} has a negative or non-finite memory")
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
        if np.isnan(np.asarray(mat, dtype=float)).any():
            raise PlanError(f"solver request: edge {e} {name(u)} -> {name(v)} has a NaN cost")
    for i, live in enumerate(r.liveness):
        bad = [v for v in live if not 0 <= v < n]
        if bad:
            raise PlanError(f"solver request: liveness set {i} names unknown nodes {bad}")
    if r.memory_budget is not None and not r.memory_budget > 0:
        raise PlanError(f"solver request: memory_budget must be positive, got {r.memory_budget}")
    if r.warm_start is not None:
        _check_choice(r, r.warm_start, "warm_start")
    if not r.time_limit > 0:
        raise PlanError(f"solver request: time_limit must be positive, got {r.time_limit}")


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
    """Objective (seconds) of an assignment: Σ node costs + Σ edge costs; ``inf`` if forbidden.

    It does not enforce same_as or memory; see ``memory_peak``.
    """
    _check_choice(request, choice, "evaluate")
    total = sum(request.node_costs[v][s] for v, s in enumerate(choice))
    total += sum(request.edge_costs[e][choice[u]][choice[v]]
                 for e, (u, v) in enumerate(request.edges))
    return float(total)


def memory_peak(request: SolverRequest, choice: Sequence[int]) -> float:
    """Largest bytes per device over the liveness sets under ``choice`` (0 without sets)."""
    _check_choice(request, choice, "memory_peak")
    return max((sum(request.node_memory[v][choice[v]] for v in set(live))
                for live in request.liveness), default=0.0)


# -- the reduced problem -------------------------------------------------------------------


@dataclasses.dataclass
class _Problem:
    """Costs per representative group, edges between groups, after folding and merging."""

    groups: list[int]  # representative node ids
    group_of: list[int]  # node -> index into groups
    unary: list[np.ndarray]  # per group, seconds per strategy (inf: forbidden)
    pairs: dict[tuple[int, int], np.ndarray]  # (gu, gv), gu < gv -> matrix (inf: forbidden)


def _reduce(r: SolverRequest) -> _Problem:
    rep = _representatives(r)
    groups = sorted(set(rep))
    index = {g: i for i, g in enumerate(groups)}
    group_of = [index[rep[v]] for v in range(len(rep))]
    unary = [np.zeros(len(r.strategy_names[g])) for g in groups]
    for v, costs in enumerate(r.node_costs):
        unary[group_of[v]] += np.asarray(costs, dtype=float)
    pairs: dict[tuple[int, int], np.ndarray] = {}
    for e, (u, v) in enumerate(r.edges):
        mat = np.asarray(r.edge_costs[e], dtype=float)
        gu, gv = group_of[u], group_of[v]
        if not np.any(mat):
            continue
        if gu == gv:  # both ends share one choice: only the diagonal can happen
            unary[gu] += np.diag(mat)
        elif len(unary[gu]) == 1:
            unary[gv] += mat[0, :]
        elif len(unary[gv]) == 1:
            unary[gu] += mat[:, 0]
        else:
            if gu > gv:
                gu, gv, mat = gv, gu, mat.T
            pairs[(gu, gv)] = pairs[(gu, gv)] + mat if (gu, gv) in pairs else mat.copy()
    return _Problem(groups, group_of, unary, pairs)


@dataclasses.dataclass
class Scaled:
    """Integer costs for CP-SAT and the map back: seconds = units / scale + offset.

    Arrays hold non-negative integers, ``FORBIDDEN`` (-1) where the cost was ``inf``.
    """

    scale: float
    offset: float
    unary: list[np.ndarray]
    pairs: dict[tuple[int, int], np.ndarray]


FORBIDDEN = -1


def rescale(unary: Sequence[Sequence[float]],
            pairs: dict[tuple[int, int], Sequence[Sequence[float]]] | None = None,
            units: float = COST_UNITS) -> Scaled:
    """Turn float seconds into non-negative integers CP-SAT handles well.

    Each group's costs are shifted by their finite minimum (the shifts add up to ``offset``,
    the same for every assignment), edge matrices likewise. Then the largest finite cost maps
    to ``units`` (1e6): a term is off by at most 0.5 / scale, i.e. 5e-7 of the largest cost,
    so the solver's optimum is within (number of terms) x 0.5 units of the true one; the
    reported objective is always recomputed in float seconds. A positive cost that would
    round to 0 becomes 1 unit, so tiny costs still break ties (over-weighting each by at most
    1 unit). ``inf`` becomes ``FORBIDDEN`` (never scaled).

    >>> s = rescale([[1.0, 3.0], [2.0, float("inf")]])
    >>> [u.tolist() for u in s.unary], s.offset, s.scale
    ([[0, 1000000], [0, -1]], 3.0, 500000.0)
    """
    pairs = pairs or {}
    arrays = [np.asarray(c, dtype=float) for c in unary]
    keys = list(pairs)
    arrays += [np.asarray(pairs[k], dtype=float) for k in keys]
    offset, shifted = 0.0, []
    largest = 0.0
    for arr in arrays:
        finite = np.isfinite(arr)
        low = float(arr[finite].min()) if finite.any() else 0.0
        offset += low
        arr = np.where(finite, arr - low, np.inf)
        shifted.append(arr)
        if finite.any():
            largest = max(largest, float(arr[finite].max()))
    scale = units / largest if largest > 0 else 1.0
    out = []
    for arr in shifted:
        finite = np.isfinite(arr)
        val = np.where(finite, arr, 0.0) * scale
        ints = np.rint(val).astype(np.int64)
        ints[(ints == 0) & (val > 0)] = 1
        ints[~finite] = FORBIDDEN
        out.append(ints)
    n = len(unary)
    return Scaled(scale, offset, out[:n], dict(zip(keys, out[n:])))


# -- solve -----------------------------------------------------------------------------------


def solve(request: SolverRequest) -> SolverResult:
    """Pick one strategy per node minimizing Σ node + edge costs under the memory budget.

    A fast local search (greedy, then spanning-tree dynamic programs and coordinate descent;
    also run from ``warm_start``) seeds CP-SAT's hint together with ``warm_start``, whichever
    is better, and is the fallback when CP-SAT finds nothing in the time limit.

    Raises:
        PlanError: the request is inconsistent, or no solution was found in the time limit.
        InfeasibleError: no assignment avoids the forbidden strategies/pairs, or fits the
            memory budget (the message states the least peak memory any assignment needs).
    """
    from ortools.sat.python import cp_model

    start = time.perf_counter()
    validate(request)
    prob = _reduce(request)
    scaled = rescale(prob.unary, prob.pairs)
    limit = request.time_limit
    deadline = start + max(0.15 * limit, min(2.0, 0.5 * limit))
    seeds = [_local_search(prob, deadline=deadline)]
    # More starts (local optima differ widely: on a 24-layer GPT the all-first-strategy start,
    # mostly replicated, ended 39% below the greedy one): every group's first, last, and
    # cheapest own strategy, each improved by the same moves while time allows.
    for init in ([0] * len(prob.unary), [len(u) - 1 for u in prob.unary],
                 [int(np.argmin(u)) for u in prob.unary]):
        if time.perf_counter() > deadline:
            break
        seeds.append(_local_search(prob, deadline=deadline,
                                   start=[init[g] for g in prob.group_of]))
    if request.warm_start is not None:
        seeds.append(list(request.warm_start))
        # The warm start improved (and repaired, where it forbids a pair) by the same moves.
        seeds.append(_local_search(prob, deadline=max(deadline, time.perf_counter() + 0.5),
                                   start=request.warm_start))
    scored = sorted((evaluate(request, c), i, c) for i, c in enumerate(seeds)
                    if _admissible(request, c))
    hint = scored[0][2] if scored else seeds[0]
    built = _build(request, prob, scaled, with_memory=True, objective=True, hint=hint)
    remaining = max(request.time_limit - (time.perf_counter() - start), 0.05 * request.time_limit)
    status, solver, stalled = _run(built.model, remaining, _stall_seconds(request.time_limit),
                                   offset=scaled.offset * scaled.scale)
    if status == cp_model.INFEASIBLE:
        _explain_infeasible(request, prob, scaled)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if not scored:
            raise PlanError(
                f"solver found no assignment within time_limit={request.time_limit:g} s "
                f"({built.num_variables} variables); raise the time limit or pass a warm_start")
        value, _, choice = scored[0]
        return SolverResult(choice, value, -math.inf, "feasible", time.perf_counter() - start,
                            built.num_variables, built.num_constraints, not stalled, stalled)
    choice = built.read(solver)
    value = evaluate(request, choice)
    if scored and scored[0][0] < value:  # rounding can hide a slightly better seed
        value, _, choice = scored[0]
    bound = solver.BestObjectiveBound() / scaled.scale + scaled.offset
    optimal = status == cp_model.OPTIMAL
    return SolverResult(
        choice=choice, objective=value, bound=min(bound, value),
        status="optimal" if optimal else "feasible", solve_time=time.perf_counter() - start,
        num_variables=built.num_variables, num_constraints=built.num_constraints,
        timed_out=not optimal and not stalled, stalled=stalled and not optimal,
    )


def _admissible(r: SolverRequest, choice: Sequence[int]) -> bool:
    rep = _representatives(r)
    return (all(choice[v] == choice[rep[v]] for v in range(len(choice)))
            and math.isfinite(evaluate(r, choice))
            and (r.memory_budget is None or memory_peak(r, choice) <= r.memory_budget))


def _local_search(prob: _Problem, deadline: float, sweeps: int = 60,
                  patience: int = 3, start: Sequence[int] | None = None) -> list[int]:
    """A feasible seed in well under a second: greedy in group order (or ``start``, one
    strategy per node), then rounds of (a) an exact min-sum dynamic program over a spanning
    forest of the group graph (program order first, then random trees), the other edges'
    neighbours held fixed, kept when it lowers the total, (b) coordinate descent (each
    group's best reply to its neighbours) and (c) the same for the two ends of each edge
    jointly (a parameter and its new value are tied by ``inf`` and only move together) until
    ``patience`` rounds bring no gain or the deadline passes."""
    n = len(prob.groups)
    adj: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for (gu, gv), mat in prob.pairs.items():
        adj[gu].append((gv, mat))
        adj[gv].append((gu, mat.T))
    pick = [-1] * n

    def best(g: int) -> int:
        cost = prob.unary[g].copy()
        for h, mat in adj[g]:
            if pick[h] >= 0:
                cost += mat[:, pick[h]]
        return int(np.argmin(cost))

    def reply(g: int, other: int) -> np.ndarray:
        """g's cost per strategy given its neighbours' picks, ``other`` left out."""
        cost = prob.unary[g].copy()
        for h, mat in adj[g]:
            if h != other and pick[h] >= 0:
                cost += mat[:, pick[h]]
        return cost

    def total(p: list[int]) -> float:
        return (sum(float(prob.unary[g][p[g]]) for g in range(n))
                + sum(float(m[p[u], p[v]]) for (u, v), m in prob.pairs.items()))

    rng = np.random.default_rng(0)
    edge_keys = list(prob.pairs)

    def tree_dp(weights: np.ndarray) -> list[int]:
        """Exact min over a spanning forest of the group graph (a minimum spanning forest
        under ``weights``), the other edges' neighbours held at their current picks: moves
        whole chains at once (a parameter, its gradient's reduction and its update)."""
        parent = list(range(n))

        def find(a: int) -> int:
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a

        tree: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
        in_tree = set()
        for e in np.argsort(weights, kind="stable").tolist():
            gu, gv = edge_keys[e]
            ru, rv = find(gu), find(gv)
            if ru != rv:
                parent[ru] = rv
                in_tree.add((gu, gv))
                tree[gu].append((gv, prob.pairs[(gu, gv)]))
                tree[gv].append((gu, prob.pairs[(gu, gv)].T))
        local = [prob.unary[g].copy() for g in range(n)]
        for (gu, gv), mat in prob.pairs.items():
            if (gu, gv) not in in_tree:
                local[gu] += mat[:, pick[gv]]
                local[gv] += mat[pick[gu], :]
        out = list(pick)
        seen = [False] * n
        for root in range(n):
            if seen[root]:
                continue
            order, up = [], {root: (-1, None)}
            stack = [root]
            seen[root] = True
            while stack:  # DFS order: parents before children
                a = stack.pop()
                order.append(a)
                for b, mat in tree[a]:
                    if not seen[b]:
                        seen[b] = True
                        up[b] = (a, mat)  # parent strategies x child strategies
                        stack.append(b)
            belief = {a: local[a].copy() for a in order}
            arg = {}
            for a in reversed(order):  # children first: send min-sum messages up
                p, mat = up[a]
                if p >= 0:
                    step = mat + belief[a][None, :]
                    arg[a] = np.argmin(step, axis=1)
                    belief[p] += step[np.arange(step.shape[0]), arg[a]]
            out[root] = int(np.argmin(belief[root]))
            for a in order[1:]:
                out[a] = int(arg[a][out[up[a][0]]])
        return out

    if start is not None:  # improve a given assignment (a warm start) instead of greedy
        pick = [int(start[g]) for g in prob.groups]
    else:
        for g in range(n):
            pick[g] = best(g)
    current = total(pick)
    idle = 0
    for _ in range(sweeps):
        if time.perf_counter() > deadline:
            break
        before = current
        if edge_keys:
            # First along the program order (consecutive groups), then random trees.
            w = (np.array([abs(v - u) for u, v in edge_keys], dtype=float) if _ == 0
                 else rng.random(len(edge_keys)))
            trial = tree_dp(w)
            value = total(trial)
            if value < current:
                pick, current = trial, value
        for g in range(n):
            pick[g] = best(g)
        for (gu, gv), mat in prob.pairs.items():  # joint moves: ends tied by inf must move together
            joint = reply(gu, gv)[:, None] + reply(gv, gu)[None, :] + mat
            i, j = np.unravel_index(int(np.argmin(joint)), joint.shape)
            pick[gu], pick[gv] = int(i), int(j)
        current = total(pick)
        idle = 0 if current < before * (1 - 1e-9) else idle + 1
        if idle >= patience or not edge_keys and idle:
            break
    return [pick[g] for g in prob.group_of]


@dataclasses.dataclass
class _Built:
    model: object
    x: list[list[object]]  # per group, one literal per strategy
    group_of: list[int]
    num_variables: int
    num_constraints: int

    def read(self, solver) -> list[int]:
        picks = [next(i for i, lit in enumerate(lits) if solver.BooleanValue(lit))
                 for lits in self.x]
        return [picks[g] for g in self.group_of]


def _build(r: SolverRequest, prob: _Problem, scaled: Scaled, *, with_memory: bool,
           objective: bool, minimize_memory: bool = False,
           hint: Sequence[int] | None = None) -> _Built:
    from ortools.sat.python import cp_model

    weighted = cp_model.LinearExpr.weighted_sum
    model = cp_model.CpModel()
    obj_vars: list[object] = []
    obj_coefs: list[int] = []
    x: list[list[object]] = []
    for gi, costs in enumerate(scaled.unary):
        lits = [model.NewBoolVar("") for _ in range(len(costs))]
        if len(lits) == 1:
            model.Add(lits[0] == 1)
        else:
            model.AddExactlyOne(lits)
        for s, c in enumerate(costs.tolist()):
            if c == FORBIDDEN:
                model.Add(lits[s] == 0)
            elif c and objective:
                obj_vars.append(lits[s])
                obj_coefs.append(c)
        x.append(lits)
    classes: dict[tuple[int, tuple[int, ...]], object] = {}
    # The hint must cover every variable, or CP-SAT cannot start from it.
    pick = None if hint is None else [hint[g] for g in prob.groups]
    if pick is not None:
        for gi, lits in enumerate(x):
            for s, lit in enumerate(lits):
                model.AddHint(lit, s == pick[gi])

    def class_literal(g: int, members: tuple[int, ...]):
        """One literal that is true when group g picks any of ``members`` (shared by edges)."""
        if len(members) == 1:
            return x[g][members[0]]
        key = (g, members)
        if key not in classes:
            lit = model.NewBoolVar("")
            model.Add(sum(x[g][s] for s in members) == lit)
            if pick is not None:
                model.AddHint(lit, pick[g] in members)
            classes[key] = lit
        return classes[key]

    for (gu, gv), mat in scaled.pairs.items():
        xu, xv = x[gu], x[gv]
        for i, j in zip(*np.nonzero(mat == FORBIDDEN)):
            model.AddBoolOr([xu[i].Not(), xv[j].Not()])
        if not objective or not (mat > 0).any():
            continue
        # Strategies with identical rows (columns) reshard alike: one literal per class.
        rows_u, inv_u = np.unique(mat, axis=0, return_inverse=True)
        small, inv_v = np.unique(rows_u, axis=1, return_inverse=True)
        inv_u, inv_v = inv_u.reshape(-1), inv_v.reshape(-1)
        cu = [class_literal(gu, tuple(np.nonzero(inv_u == c)[0].tolist()))
              for c in range(small.shape[0])]
        cv = [class_literal(gv, tuple(np.nonzero(inv_v == c)[0].tolist()))
              for c in range(small.shape[1])]
        rows = small.tolist()
        ku, kv = small.shape
        hu = hv = -1
        if pick is not None:
            hu, hv = int(inv_u[pick[gu]]), int(inv_v[pick[gv]])
        if ku * kv <= MARGINAL_LIMIT:
            e = [[None if rows[i][j] == FORBIDDEN else model.NewBoolVar("") for j in range(kv)]
                 for i in range(ku)]
            for i in range(ku):
                model.Add(sum(v for v in e[i] if v is not None) == cu[i])
            for j in range(kv):
                model.Add(sum(e[i][j] for i in range(ku) if e[i][j] is not None) == cv[j])
            if pick is not None:
                for i in range(ku):
                    for j in range(kv):
                        if e[i][j] is not None:
                            model.AddHint(e[i][j], i == hu and j == hv)
            for i in range(ku):
                for j in range(kv):
                    if rows[i][j] > 0:
                        obj_vars.append(e[i][j])
                        obj_coefs.append(rows[i][j])
        else:
            cost = model.NewIntVar(0, int(small.max()), "")
            for i in range(ku):
                js = [j for j in range(kv) if rows[i][j] > 0]
                if js:
                    model.Add(weighted([cv[j] for j in js], [rows[i][j] for j in js]) <= cost
                              ).OnlyEnforceIf(cu[i])
            obj_vars.append(cost)
            obj_coefs.append(1)
            if pick is not None:
                model.AddHint(cost, max(rows[hu][hv], 0))
    if with_memory and r.liveness:
        mem_terms = _memory_terms(r, prob, x)
        if minimize_memory:
            top = sum(sum(c for _, c in t) for t in mem_terms) + 1
            peak = model.NewIntVar(0, top, "peak")
            for t in mem_terms:
                if t:
                    model.Add(weighted([v for v, _ in t], [c for _, c in t]) <= peak)
            obj_vars, obj_coefs = [peak], [1]
        elif r.memory_budget is not None:
            budget = math.floor(r.memory_budget / _memory_unit(r))
            for t in mem_terms:
                if t:
                    model.Add(weighted([v for v, _ in t], [c for _, c in t]) <= budget)
    if obj_vars:
        model.Minimize(weighted(obj_vars, obj_coefs))
    proto = model.Proto()
    return _Built(model, x, prob.group_of, len(proto.variables), len(proto.constraints))


def _memory_unit(r: SolverRequest) -> float:
    """Bytes per integer unit: the budget (or the largest set) maps to ~MEMORY_UNITS units."""
    ref = r.memory_budget or max((sum(max(r.node_memory[v]) for v in set(live))
                                  for live in r.liveness), default=1.0)
    return max(ref / MEMORY_UNITS, 1e-12)


def _memory_terms(r: SolverRequest, prob: _Problem, x) -> list[list[tuple[object, int]]]:
    """Per liveness set, (literal, units) terms; memory rounds up so a fit is a real fit."""
    unit = _memory_unit(r)
    out = []
    for live in r.liveness:
        coef: dict[tuple[int, int], int] = {}
        for v in set(live):
            g = prob.group_of[v]
            for s, m in enumerate(r.node_memory[v]):
                if m:
                    coef[(g, s)] = coef.get((g, s), 0) + math.ceil(m / unit)
        out.append([(x[g][s], c) for (g, s), c in coef.items()])
    return out


def _stall_seconds(time_limit: float) -> float:
    """How long CP-SAT may go without a better plan before the search stops early."""
    return max(STALL_MIN_SECONDS, STALL_FRACTION * time_limit)


def _run(model, time_limit: float, stall: float | None = None, offset: float = 0.0):
    """Solve; with ``stall``, stop once no solution better by ``STALL_GAIN`` (relative to
    the objective plus ``offset``, in the model's units) came for ``stall`` seconds.

    Returns (status, solver, stalled): ``stalled`` is True when the search was stopped early
    that way (the plan is then the best found, not proven optimal)."""
    import threading

    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = NUM_WORKERS
    solver.parameters.max_time_in_seconds = float(time_limit)
    size = len(model.Proto().variables)
    if size > LIGHT_PRESOLVE_LIMIT:
        # One presolve round: the (hinted) first plan comes in ~0.6 s instead of ~2 s on a
        # 7,000-variable model, which is most of the search's time once the hint is good.
        solver.parameters.max_presolve_iterations = 1
    if size > PRESOLVE_LIMIT:
        # On 2 cores CP-SAT's presolve of a large model alone outlasts a time limit of
        # seconds; without it the search starts at once from the (complete) hint.
        solver.parameters.cp_model_presolve = False
    if stall is None or stall >= time_limit:
        return solver.Solve(model), solver, False

    last = [time.perf_counter()]
    mark = [math.inf]  # objective (plus offset) of the last plan that restarted the clock
    stopped = threading.Event()
    done = threading.Event()

    class _Improved(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self) -> None:
            value = self.ObjectiveValue() + offset
            if not math.isfinite(mark[0]) or value < mark[0] - STALL_GAIN * abs(mark[0]):
                mark[0] = value
                last[0] = time.perf_counter()

    def watch() -> None:
        while not done.wait(0.05):
            # Loading a large model takes a while before the first (hinted) plan: allow
            # twice the window for it.
            wait = stall if math.isfinite(mark[0]) else 2 * stall
            if time.perf_counter() - last[0] > wait:
                stopped.set()
                solver.stop_search()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        status = solver.Solve(model, _Improved())
    finally:
        done.set()
        watcher.join()
    return status, solver, stopped.is_set()


def _explain_infeasible(r: SolverRequest, prob: _Problem, scaled: Scaled) -> None:
    """Raise InfeasibleError saying why: forbidden choices, or the least memory needed."""
    from ortools.sat.python import cp_model

    free = _build(r, prob, scaled, with_memory=False, objective=False)
    status, _, _ = _run(free.model, r.time_limit)
    if status == cp_model.INFEASIBLE or r.memory_budget is None or not r.liveness:
        raise InfeasibleError(
            "no assignment of strategies avoids the forbidden (infinite-cost) strategies and "
            "resharding pairs; some node has no compatible strategy with its neighbours")
    least = _least_peak(r, prob, scaled)
    raise InfeasibleError(
        f"no plan fits the memory budget of {_fmt_bytes(r.memory_budget)} per device: the "
        f"least peak memory any assignment needs is {least}; rematerialize activations "
        f"(jax.checkpoint), or use more devices")


def _least_peak(r: SolverRequest, prob: _Problem, scaled: Scaled) -> str:
    from ortools.sat.python import cp_model

    built = _build(r, prob, scaled, with_memory=True, objective=False, minimize_memory=True)
    status, solver, _ = _run(built.model, min(r.time_limit, 10.0))
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        choice = built.read(solver)
        peak = memory_peak(r, choice)
        if status == cp_model.OPTIMAL:
            return _fmt_bytes(peak)
        low = max(solver.BestObjectiveBound() - len(r.node_names), 0) * _memory_unit(r)
        return f"between {_fmt_bytes(low)} and {_fmt_bytes(peak)}"
    # Lower bound without the solver: each set with every node at its smallest value.
    low = max(sum(min(r.node_memory[v]) for v in set(live)) for live in r.liveness)
    return f"at least {_fmt_bytes(low)}"


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n:.0f} bytes)"
    return f"{n:.0f} bytes"
