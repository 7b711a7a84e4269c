"""The CP-SAT model of a solver request: integer costs, the model, and running it.

Kept apart from ``spmd.solver.driver``, which drives it: ``rescale`` turns seconds into
integers, ``build`` makes the model (hinted, under the memory budget, or minimizing peak
memory), ``run`` solves it under the presolve and early-stop limits of ``SolverOptions``.

Formulation: one boolean x[v,s] per strategy of each representative node, exactly one true.
Nodes with ``same_as`` reuse their representative's booleans (their costs add to its). Edges
whose one end has a single strategy fold into the other end's costs; all-zero matrices are
dropped; parallel edges merge. A remaining edge (u, v) costs R[i][j] when x[u,i] and x[v,j].
Strategies whose rows (columns) of R are identical, i.e. that produce (want) the same spec,
share one class literal, so a 30 x 30 matrix is usually a handful of classes. Small class
matrices (<= ``MARGINAL_LIMIT`` entries) get edge booleans e[i,j] whose rows sum to the
u-class and columns to the v-class literals (the tight "local polytope" relaxation); larger
ones an integer c >= sum_j R[i][j] * y[v,j] enforced by y[u,i] (k_u constraints, no k_u * k_v
booleans). A charge (a cost shared by several strategies, paid once) is one boolean that
each of its strategies implies. A fan-out (a value resharded once per distinct target its
consumers want) gets, per target t, a boolean y[t] that every consumer strategy wanting t
implies, and an integer c[t] >= sum_i costs[i][t] * x[producer, i] enforced by y[t]: exact,
with one constraint per (consumer, target) and one per target. ``inf`` means forbidden: the
strategy or the pair is excluded, never scaled.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Sequence

import numpy as np

from spmd.options import SolverOptions
from spmd.solver.request import Reduced, SolverRequest

__all__ = ["FORBIDDEN", "OutOfTime", "Scaled", "build", "memory_unit", "rescale", "run"]

# Largest finite cost maps to this many integer units (see ``rescale``).
COST_UNITS = 1e6
# Per-liveness-set memory is scaled so the budget maps to this many units.
MEMORY_UNITS = 1e9
# Edge matrices (after merging identical rows/columns) up to this many entries get edge
# booleans; bigger ones enforced rows.
MARGINAL_LIMIT = 16


@dataclasses.dataclass
class Scaled:
    """Integer costs for CP-SAT and the map back: seconds = units / scale + offset.

    Arrays hold non-negative integers, ``FORBIDDEN`` (-1) where the cost was ``inf``.
    """

    scale: float
    offset: float
    unary: list[np.ndarray]
    pairs: dict[tuple[int, int], np.ndarray]
    charges: list[int] = dataclasses.field(default_factory=list)
    fanouts: list[np.ndarray] = dataclasses.field(default_factory=list)  # per fan-out, costs


FORBIDDEN = -1


def rescale(unary: Sequence[Sequence[float]],
            pairs: dict[tuple[int, int], Sequence[Sequence[float]]] | None = None,
            charges: Sequence[float] = (), units: float = COST_UNITS,
            fanouts: Sequence[np.ndarray] = ()) -> Scaled:
    """Turn float seconds into non-negative integers CP-SAT handles well.

    Each group's costs are shifted by their finite minimum (the shifts add up to ``offset``,
    the same for every assignment), edge matrices likewise. Then the largest finite cost maps
    to ``units`` (1e6): a term is off by at most 0.5 / scale, i.e. 5e-7 of the largest cost,
    so the solver's optimum is within (number of terms) x 0.5 units of the true one; the
    reported objective is always recomputed in float seconds. A positive cost that would
    round to 0 becomes 1 unit, so tiny costs still break ties (over-weighting each by at most
    1 unit). ``inf`` becomes ``FORBIDDEN`` (never scaled). Charges and fan-out costs (finite,
    >= 0) scale alike, unshifted.

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
    fanouts = [np.asarray(f, dtype=float) for f in fanouts]
    largest = max([largest, *charges, *(float(f.max()) for f in fanouts if f.size)])
    scale = units / largest if largest > 0 else 1.0

    def integer(arr: np.ndarray) -> np.ndarray:
        finite = np.isfinite(arr)
        val = np.where(finite, arr, 0.0) * scale
        ints = np.rint(val).astype(np.int64)
        ints[(ints == 0) & (val > 0)] = 1
        ints[~finite] = FORBIDDEN
        return ints

    out = [integer(arr) for arr in shifted]
    n = len(unary)
    return Scaled(scale, offset, out[:n], dict(zip(keys, out[n:])),
                  [max(int(round(c * scale)), 1 if c > 0 else 0) for c in charges],
                  [integer(f) for f in fanouts])


@dataclasses.dataclass
class _Built:
    model: object
    x: list[list[object]]  # per group, one literal per strategy
    group_of: list[int]
    num_variables: int
    num_constraints: int

    def read(self, solver) -> list[int]:
        picks = [next(i for i, lit in enumerate(lits) if solver.boolean_value(lit))
                 for lits in self.x]
        return [picks[g] for g in self.group_of]


class OutOfTime(Exception):
    """The model was not built by its deadline (``build``): there is no time left to solve it."""


#: pairs of groups written between two looks at the clock in ``build``
_CLOCK_EVERY = 256


def _distinct_rows(mat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of ``mat`` (first-seen order) and each row's index among them.
    A dict of row bytes: ``np.unique(axis=0)`` took 16 of a 55 s build on a 6,588-group
    request (edge matrices are small, and it sorts structured views)."""
    mat = np.ascontiguousarray(mat)
    index: dict[bytes, int] = {}
    firsts: list[int] = []
    inverse = np.empty(len(mat), dtype=np.intp)
    for i, row in enumerate(mat):
        c = index.setdefault(row.tobytes(), len(firsts))
        if c == len(firsts):
            firsts.append(i)
        inverse[i] = c
    return mat[firsts], inverse


def build(r: SolverRequest, prob: Reduced, scaled: Scaled, *, with_memory: bool,
           objective: bool, minimize_memory: bool = False,
           hint: Sequence[int] | None = None, deadline: float | None = None) -> _Built:
    """The CP-SAT model (module docstring). Raises ``OutOfTime`` past ``deadline``
    (``time.perf_counter()`` seconds): a 6,588-group request takes ~5 s to write out."""
    from ortools.sat.python import cp_model

    weighted, total = cp_model.LinearExpr.weighted_sum, cp_model.LinearExpr.sum
    model = cp_model.CpModel()
    obj_vars: list[object] = []
    obj_coefs: list[int] = []
    x: list[list[object]] = []
    for gi, costs in enumerate(scaled.unary):
        lits = [model.new_bool_var("") for _ in range(len(costs))]
        if len(lits) == 1:
            model.add(lits[0] == 1)
        else:
            model.add_exactly_one(lits)
        for s, c in enumerate(costs.tolist()):
            if c == FORBIDDEN:
                model.add(lits[s] == 0)
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
                model.add_hint(lit, s == pick[gi])

    def class_literal(g: int, members: list[int]):
        """One literal that is true when group g picks any of ``members`` (shared by edges)."""
        if len(members) == 1:
            return x[g][members[0]]
        key = (g, tuple(members))
        if key not in classes:
            lit = model.new_bool_var("")
            model.add(total([x[g][s] for s in members]) == lit)
            if pick is not None:
                model.add_hint(lit, pick[g] in members)
            classes[key] = lit
        return classes[key]

    def class_literals(g: int, inverse: np.ndarray, count: int) -> list[object]:
        members: list[list[int]] = [[] for _ in range(count)]
        for s, c in enumerate(inverse.tolist()):
            members[c].append(s)
        return [class_literal(g, m) for m in members]

    for n, ((gu, gv), mat) in enumerate(scaled.pairs.items()):
        if deadline is not None and n % _CLOCK_EVERY == 0 and time.perf_counter() > deadline:
            raise OutOfTime
        xu, xv = x[gu], x[gv]
        for i, j in zip(*np.nonzero(mat == FORBIDDEN)):
            model.add_bool_or([~xu[i], ~xv[j]])
        if not objective or not (mat > 0).any():
            continue
        # Strategies with identical rows (columns) reshard alike: one literal per class.
        rows_u, inv_u = _distinct_rows(mat)
        cols, inv_v = _distinct_rows(rows_u.T)
        small = cols.T
        ku, kv = small.shape
        cu = class_literals(gu, inv_u, ku)
        cv = class_literals(gv, inv_v, kv)
        rows = small.tolist()
        hu = hv = -1
        if pick is not None:
            hu, hv = int(inv_u[pick[gu]]), int(inv_v[pick[gv]])
        if ku * kv <= MARGINAL_LIMIT:
            e = [[None if rows[i][j] == FORBIDDEN else model.new_bool_var("") for j in range(kv)]
                 for i in range(ku)]
            for i in range(ku):
                model.add(total([v for v in e[i] if v is not None]) == cu[i])
            for j in range(kv):
                model.add(total(
                    [e[i][j] for i in range(ku) if e[i][j] is not None]) == cv[j])
            for i in range(ku):
                for j in range(kv):
                    if e[i][j] is None:
                        continue
                    if pick is not None:
                        model.add_hint(e[i][j], i == hu and j == hv)
                    if rows[i][j] > 0:
                        obj_vars.append(e[i][j])
                        obj_coefs.append(rows[i][j])
        else:
            cost = model.new_int_var(0, int(small.max()), "")
            for i in range(ku):
                js = [j for j in range(kv) if rows[i][j] > 0]
                if js:
                    model.add(weighted([cv[j] for j in js], [rows[i][j] for j in js]) <= cost
                              ).only_enforce_if(cu[i])
            obj_vars.append(cost)
            obj_coefs.append(1)
            if pick is not None:
                model.add_hint(cost, max(rows[hu][hv], 0))
    for n, ((gp, _, consumers), costs) in enumerate(zip(prob.fanouts, scaled.fanouts)):
        if not objective:
            break
        if deadline is not None and n % _CLOCK_EVERY == 0 and time.perf_counter() > deadline:
            raise OutOfTime
        rows, inv = _distinct_rows(costs)  # producer strategies that reshard alike
        cls = class_literals(gp, inv, len(rows))
        for t in range(costs.shape[1]):
            col = rows[:, t].tolist()
            if not any(col):
                continue
            wanted = [(g, np.nonzero(targets == t)[0].tolist()) for g, targets in consumers]
            wanted = [(g, ss) for g, ss in wanted if ss]
            if not wanted:
                continue
            paid = model.new_bool_var("")  # some consumer wants target t
            for g, ss in wanted:
                model.add(total([x[g][s] for s in ss]) <= paid)
            cost = model.new_int_var(0, max(col), "")
            js = [j for j, c in enumerate(col) if c]
            model.add(weighted([cls[j] for j in js], [col[j] for j in js]) <= cost
                      ).only_enforce_if(paid)
            obj_vars.append(cost)
            obj_coefs.append(1)
            if pick is not None:
                wants = any(pick[g] in ss for g, ss in wanted)
                model.add_hint(paid, wants)
                model.add_hint(cost, col[int(inv[pick[gp]])] if wants else 0)
    for (_, members), units in zip(prob.charges, scaled.charges):
        if not objective or not units:
            continue
        paid = model.new_bool_var("")  # true when any member strategy is chosen
        for g, k in members:
            model.add_implication(x[g][k], paid)
        obj_vars.append(paid)
        obj_coefs.append(units)
        if pick is not None:
            model.add_hint(paid, any(pick[g] == k for g, k in members))
    if with_memory and r.liveness:
        # Minimizing the peak needs every set; under a budget, only those that can exceed it.
        mem_terms = _memory_terms(r, prob, model, x,
                                  None if minimize_memory else r.memory_budget, pick)
        if minimize_memory:
            top = sum(sum(most for _, _, most in t) for t in mem_terms) + 1
            peak = model.new_int_var(0, top, "peak")
            for t in mem_terms:
                if t:
                    model.add(weighted([v for v, _, _ in t], [c for _, c, _ in t]) <= peak)
            obj_vars, obj_coefs = [peak], [1]
        elif r.memory_budget is not None:
            budget = math.floor(r.memory_budget / memory_unit(r))
            for t in mem_terms:
                if t:
                    model.add(weighted([v for v, _, _ in t], [c for _, c, _ in t]) <= budget)
    if obj_vars:
        model.minimize(weighted(obj_vars, obj_coefs))
    proto = model.proto
    return _Built(model, x, prob.group_of, len(proto.variables), len(proto.constraints))


def memory_unit(r: SolverRequest) -> float:
    """Bytes per integer unit: the budget (or the largest set) maps to ~MEMORY_UNITS units."""
    ref = r.memory_budget or max((sum(max(row) for _, row in r.set_terms(i))
                                  + sum(float(np.max(nbytes, axis=0).sum())
                                        for _, nbytes, _, _ in r.copy_terms(i))
                                  for i in range(len(r.liveness))), default=1.0)
    return max(ref / MEMORY_UNITS, 1e-12)


def _memory_terms(r: SolverRequest, prob: Reduced, model, x, budget: float | None = None,
                  pick: Sequence[int] | None = None) -> list[list[tuple[object, int, int]]]:
    """Per liveness set, (variable, units per unit of it, most units) terms; memory rounds
    up so a fit is a real fit.

    With a ``budget``, a set that fits it even with every node at its largest strategy and
    every copy made can never bind and gets no terms: on a 24-layer GPT under a GPU's memory
    that is every set, and writing them out took 0.65 s of a 4 s solve. A copy
    (``liveness_copies``) is an integer variable per target, at least its bytes under the
    producer's strategy when readers on both sides of the point want that target
    (``pick``: the hinted strategy per group, which hints those variables too)."""
    unit = memory_unit(r)
    cap = math.floor(budget / unit) if budget is not None else None
    out = []
    for i in range(len(r.liveness)):
        terms, copies = r.set_terms(i), r.copy_terms(i)
        units = [np.ceil(np.asarray(nbytes, dtype=float) / unit).astype(np.int64)
                 for _, nbytes, _, _ in copies]
        if cap is not None and (
                sum(max((math.ceil(m / unit) for m in row), default=0) for _, row in terms)
                + sum(int(u.max(axis=0).sum()) for u in units) <= cap):
            out.append([])
            continue
        coef: dict[tuple[int, int], int] = {}
        for v, row in terms:
            g = prob.group_of[v]
            for s, m in enumerate(row):
                if m:
                    coef[(g, s)] = coef.get((g, s), 0) + math.ceil(m / unit)
        held = []
        for (producer, _, before, after), table in zip(copies, units):
            gp = prob.group_of[producer]
            for d in np.nonzero(table.max(axis=0))[0].tolist():
                sides = [_wanting(model, x, prob, side, d, pick) for side in (before, after)]
                if any(lit is None for lit in sides):
                    continue  # no reader on one side can want this target
                var = model.new_int_var(0, int(table[:, d].max()), "")
                for s in np.nonzero(table[:, d])[0].tolist():
                    model.add(var >= int(table[s, d])).only_enforce_if([x[gp][s], *sides])
                if pick is not None:
                    wanted = all(any(int(t[pick[prob.group_of[v]]]) == d for v, t in side)
                                 for side in (before, after))
                    model.add_hint(var, int(table[pick[gp], d]) if wanted else 0)
                held.append((var, 1, int(table[:, d].max())))
        out.append([(x[g][s], c, c) for (g, s), c in coef.items()] + held)
    return out


def _wanting(model, x, prob: Reduced, readers, target: int, pick: Sequence[int] | None):
    """A literal true when some of ``readers`` ((node, target per strategy)) wants
    ``target`` (forced true then; free otherwise, and false where it helps), or None when
    none of them can."""
    lits = [x[prob.group_of[v]][s] for v, targets in readers
            for s, t in enumerate(targets) if int(t) == target]
    lits = list({id(lit): lit for lit in lits}.values())
    if not lits:
        return None
    if len(lits) == 1:
        return lits[0]
    some = model.new_bool_var("")
    for lit in lits:
        model.add_implication(lit, some)
    if pick is not None:
        model.add_hint(some, any(int(t[pick[prob.group_of[v]]]) == target for v, t in readers))
    return some


def run(model, time_limit: float, options: SolverOptions, stall: float | None = None,
        offset: float = 0.0):
    """Solve; with ``stall``, stop once no solution better by ``options.stall_gain``
    (relative to the objective plus ``offset``, in the model's units) came for ``stall``
    seconds.

    Returns (status, solver, stalled): ``stalled`` is True when the search was stopped early
    that way (the plan is then the best found, not proven optimal)."""
    import threading

    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = options.workers
    solver.parameters.max_time_in_seconds = float(time_limit)
    size = len(model.proto.variables)
    if size > options.light_presolve_limit:
        # One presolve round: the (hinted) first plan comes in ~0.6 s instead of ~2 s on a
        # 7,000-variable model, which is most of the search's time once the hint is good.
        solver.parameters.max_presolve_iterations = 1
    if size > options.presolve_limit:
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
            if not math.isfinite(mark[0]) or value < mark[0] - options.stall_gain * abs(mark[0]):
                mark[0] = value
                last[0] = time.perf_counter()

    def watch() -> None:
        while not done.wait(0.05):
            # Loading a large model takes a while before the first (hinted) plan: allow
            # twice the window for it.
            wait = stall if math.isfinite(mark[0]) else 2 * stall
            if time.perf_counter() - last[0] > wait:
                stopped.set()
                solver.StopSearch()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        status = solver.Solve(model, _Improved())
    finally:
        done.set()
        watcher.join()
    return status, solver, stopped.is_set()
