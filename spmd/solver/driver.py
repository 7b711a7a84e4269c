"""The intra-op integer program (Alpa, Zheng et al., OSDI'22 §4): flat request in, choice out.

The solver never sees the program. A ``SolverRequest`` lists nodes with their strategies and
costs, edges with resharding matrices, nodes that share a choice (repeated layers), liveness
sets and a memory budget; ``solve`` returns one strategy per node. Companions, as in XLA's
auto-sharding pass: ``validate`` (a consistent request, or a PlanError naming the node or
edge at fault), ``evaluate`` and ``memory_peak`` (score any assignment, e.g. a hand-written
plan, with the same numbers) and ``rescale`` (float seconds to the integers CP-SAT needs).
A request saved with ``to_json`` replays with ``SolverRequest.from_json`` to debug.

Min-sum diffusion (``spmd.solver.min_sum``) runs first: it decodes a plan that sees costs
paid far downstream, and proves a lower bound on every plan (the dual of the LP relaxation).
A fast local search (spanning-tree dynamic programs, coordinate descent) improves it and
other starts (every group's first strategy, greedy, every group's last / cheapest strategy,
the warm start); where the cheapest of them is over the memory budget and those that fit are
dearer, memory priced as time makes a fitting one near it (``spmd.solver.fit_seed``). A seed
within ``SolverOptions.gap`` of the bound is returned as it is: CP-SAT could only confirm
it. Otherwise CP-SAT starts from the best seed as a complete hint and stops once no plan
better by ``stall_gain`` came for a short window; large models get one presolve round or
none (``SolverOptions``), as on 2 cores presolve alone outlasts a limit of seconds.
Measured on 2 cores: a planner-like 2,000-node / 3,000-edge request (4-30 strategies)
returns in ~8 s with a 10 s limit, 2% above the bound (CP-SAT's own LP bound left it 13%
below); a 24-layer GPT's request in ~3 s, 0.1% above it.

This module drives the solver: ``solve`` (seeding, running CP-SAT, explaining an infeasible
request). The request and result types with ``validate``, ``evaluate`` and ``memory_peak``
live in ``spmd.solver.request``, the CP-SAT model (its formulation and ``rescale``) in
``spmd.solver.cpsat``, the seeding search in ``spmd.solver.local_search`` and
``spmd.solver.min_sum``.

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

import math
import time
from typing import Sequence

import numpy as np

from spmd.errors import InfeasibleError, SolverTimeoutError
from spmd.options import SolverOptions
from spmd.solver.cpsat import OutOfTime, Scaled, build, memory_unit, rescale, run
from spmd.solver.fit_seed import fitting_seed
from spmd.solver.local_search import local_search
from spmd.solver.min_sum import min_sum_seed
from spmd.solver.request import (Reduced, SolverRequest, SolverResult, evaluate, memory_peak,
                                 reduce, validate)
from spmd.units import readable_bytes

__all__ = ["solve"]


def solve(request: SolverRequest, options: SolverOptions = SolverOptions()) -> SolverResult:
    """Pick one strategy per node minimizing Σ node + edge costs under the memory budget.

    The best seed (the diffused plan, uniform and greedy starts and ``warm_start``, each
    improved by local moves) is returned when within ``options.gap`` of the diffusion bound;
    else it is CP-SAT's hint, and the fallback when CP-SAT finds nothing in the time limit.
    The bound reported is the better of diffusion's and CP-SAT's. Charges and fan-outs are
    exact in CP-SAT and in the seeds' ranking; the seeds see them as pairwise costs
    (``Reduced.pairwise``): a charge spread over the groups that can incur it; a fan-out
    target paid by every consumer that wants it (so seeds do not reshard a value for several
    consumers that would each pay part of it). That over-counts, so with fan-outs the bound
    comes from a second diffusion, of the problem where each target's cost is split between
    the consumers that can want it, which never exceeds the request's.

    Raises:
        PlanError: the request is inconsistent, or no solution was found in the time limit.
        InfeasibleError: no assignment avoids the forbidden strategies/pairs, or fits the
            memory budget (the message states the least peak memory any assignment needs).
    """
    from ortools.sat.python import cp_model

    start = time.perf_counter()
    validate(request)
    prob = reduce(request)
    gap = options.gap
    seeding = prob.pairwise(split=False)  # the seeds' moves see pairwise costs only

    def exact(choice: Sequence[int]) -> float:
        """A plan's objective, on the folded problem (``evaluate``, a fraction of its time)."""
        return prob.total([choice[g] for g in prob.groups])

    limit = request.time_limit
    # the seeds' share of the limit (all of it when no CP-SAT follows)
    window = max(0.15 * limit, min(2.0, 0.5 * limit)) if options.refine else limit
    # Diffusion sees costs that only pay off far downstream (a split the whole network
    # follows), which no local move reaches, and bounds every plan: its decoded plan,
    # improved by local moves, is the best start (gpt-1.3b on 64 A100s, dp_tp pinned:
    # 19.2 ms against 32.6 ms from greedy), and often proves itself near-optimal. It stops
    # once within the gap or converged; only large graphs use its full share of the limit.
    dual = min_sum_seed(seeding, deadline=start + max(0.6 * window, 0.4 * limit), gap=gap)
    # (Diffusion may end past its deadline on a large graph: its plan still gets moves.)
    first = local_search(seeding, start=dual.choice,
                         deadline=max(start + 0.7 * window, time.perf_counter() + 0.25 * window))
    if not prob.fanouts:
        proven = dual.bound
    else:
        # From where the first diffusion ended (the two differ only in fan-out targets). A
        # scoring, with no CP-SAT to follow, stops its starts once this proves the gap: two
        # of six hand-written plans of a 24-layer GPT on 8 A100s, in 0.04 s each.
        share = max(0.4 * window, 0.2 * limit) if options.refine else 0.2 * limit
        proven = min_sum_seed(prob.pairwise(split=True), target=exact(first), gap=gap,
                              messages=dual.messages,
                              deadline=time.perf_counter() + share).bound
    # The other starts get their time after diffusion, however long it took: on moe-tiny
    # over 16 A100s the all-first-strategy start is the best (0.094 ms, diffusion 0.119).
    after = time.perf_counter()
    # (Without CP-SAT to follow, the limit is the answer's: no start past it.)
    deadline = max(start + window, after + 0.5 * window) if options.refine else start + limit
    # Then, while the gap is open, more starts (local optima differ widely: on a 24-layer GPT
    # the all-first-strategy start, mostly replicated, ended 39% below the greedy one): that
    # one first (it scored fsdp there 14% below every other start), greedy, and while
    # seeding time is left every group's last and cheapest own strategy, each improved by
    # the same moves.
    def improved(init: list[int] | None) -> list[int] | None:
        """``init`` (one strategy per group; None: greedy) improved by local moves, if
        there is time left."""
        if time.perf_counter() > deadline:
            return None
        return local_search(seeding, deadline=deadline,
                            start=None if init is None else [init[g] for g in prob.group_of])

    starts = [lambda: first]
    starts += [lambda init=init: improved(init)
               for init in ([0] * len(prob.unary), None, [len(u) - 1 for u in prob.unary],
                            [int(np.argmin(u)) for u in seeding.unary])]
    own = len(starts)  # the starts before this one are the solver's own
    if request.warm_start is not None:
        # The warm start as given, and improved (repaired, where it forbids a pair; given
        # CP-SAT to follow, even past the seeds' time).
        warm = list(request.warm_start)
        extra = 0.5 if options.refine else 0.0
        starts += [lambda: warm, lambda: local_search(
            seeding, deadline=max(deadline, time.perf_counter() + extra), start=warm)]
    scored: list[tuple[float, int, list[int]]] = []
    over: tuple[float, list[int]] | None = None  # the cheapest start over the memory budget
    for i, make in enumerate(starts):
        if scored and _within_gap(scored[0][0], proven, gap):
            break
        seed = make()
        if seed is not None:
            value = exact(seed)
            if _admissible(request, prob, seed, value):
                scored.append((value, i, seed))
                scored.sort()
            elif (_admissible(request, prob, seed, value, memory=False)
                  and (over is None or value < over[0])):
                over = (value, seed)
    if over is not None and scored and over[0] < scored[0][0]:
        # The cheapest start is over the budget, and the ones that fit are dearer: from it,
        # price memory until it fits (``fit_seed``), a start near it for CP-SAT, which else
        # starts from one far from it (FSDP + remat under half its peak: 137 ms from there,
        # 75 ms from the priced start, tests/test_scale.py). Where no start fits, CP-SAT
        # does better from the cheapest itself, which it repairs (gpt-bench on 8 A100s
        # under 0.8 of its peak: 1.38 ms; from the priced start, 1.72 ms: doubled prices
        # jump to a plan that shards everything, and no local move finds one between).
        # Each of its rounds is a local search: the FSDP case takes four, 0.66 s. (Without
        # CP-SAT to follow, not past the limit.)
        fit = fitting_seed(request, seeding, over[1], exact,
                           deadline=max(deadline, time.perf_counter() + 0.75 * window)
                           if options.refine else deadline)
        if fit is not None:
            value = exact(fit)
            if _admissible(request, prob, fit, value):
                scored.append((value, -1, fit))  # the solver's own: CP-SAT's hint
                scored.sort()

    def best_seed(timed_out: bool, stalled: bool = False, built=None) -> SolverResult:
        """The best seed as the answer, bounded by diffusion (CP-SAT skipped or no better)."""
        _, _, choice = scored[0]
        value = evaluate(request, choice)  # the seeds were ranked on the folded problem
        status = "optimal" if _within_gap(value, proven, 1e-9) else "feasible"
        size = (built.num_variables, built.num_constraints) if built else (
            sum(len(u) for u in prob.unary), 0)
        return SolverResult(choice, value, min(proven, value), status,
                            time.perf_counter() - start, *size, timed_out=timed_out,
                            stalled=stalled, bound_from="diffusion")

    if scored and (_within_gap(scored[0][0], proven, gap) or not options.refine):
        return best_seed(timed_out=False)  # no plan is better by more than the gap
    # CP-SAT starts from the solver's own best seed: from a warm start (a hand-written plan,
    # already the answer if nothing better comes) it stalled near it (mlp-tiny on 2x4 at tp's
    # 0.0635 ms; from its own seed it proved 0.0499 optimal).
    mine = [s for s in scored if s[1] < own]
    hint = (mine or scored)[0][2] if scored else dual.choice
    scaled = rescale(prob.unary, prob.pairs, [cost for cost, _ in prob.charges],
                     fanouts=[costs for _, costs, _ in prob.fanouts])
    try:
        # Writing the model counts against the limit (a large one outlasted it), unless no
        # seed fits: then only CP-SAT can find a plan, or explain why there is none.
        built = build(request, prob, scaled, with_memory=True, objective=True, hint=hint,
                      deadline=start + (1 - options.solve_share) * limit if scored else None)
    except OutOfTime:
        return best_seed(timed_out=True)
    remaining = max(request.time_limit - (time.perf_counter() - start), 0.05 * request.time_limit)
    status, solver, stalled = run(built.model, remaining, options,
                                  stall=options.stall_window(request.time_limit),
                                  offset=scaled.offset * scaled.scale)
    if status == cp_model.INFEASIBLE:
        if not scored:
            _explain_infeasible(request, prob, scaled, options)
        # A seed fits: only the integer model's rounding (memory up, the budget down) shut
        # it out, so it is the answer.
        return best_seed(timed_out=False, built=built)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if not scored:
            raise SolverTimeoutError(
                f"solver found no assignment within time_limit={request.time_limit:g} s "
                f"({built.num_variables} variables); raise the time limit or pass a warm_start")
        return best_seed(timed_out=not stalled, stalled=stalled, built=built)
    choice = built.read(solver)
    value = evaluate(request, choice)
    if scored and scored[0][0] < value:  # rounding can hide a slightly better seed
        value, _, choice = scored[0]
    bound = solver.BestObjectiveBound() / scaled.scale + scaled.offset
    optimal = status == cp_model.OPTIMAL
    return SolverResult(
        choice=choice, objective=value, bound=min(max(bound, proven), value),
        bound_from="diffusion" if proven > bound else "cp-sat",
        status="optimal" if optimal else "feasible", solve_time=time.perf_counter() - start,
        num_variables=built.num_variables, num_constraints=built.num_constraints,
        timed_out=not optimal and not stalled, stalled=stalled and not optimal,
    )


def _within_gap(value: float, bound: float, gap: float) -> bool:
    """Is ``value`` proven within ``gap`` (relative) of the optimum?"""
    return math.isfinite(value) and value - bound <= gap * abs(value)


def _admissible(r: SolverRequest, prob: Reduced, choice: Sequence[int], value: float,
                memory: bool = True) -> bool:
    """A seed CP-SAT may start from: tied nodes agree, nothing forbidden (``value`` is its
    ``evaluate``), and (``memory``) it fits the memory budget."""
    return (all(choice[v] == choice[prob.groups[g]] for v, g in enumerate(prob.group_of))
            and math.isfinite(value)
            and (not memory or r.memory_budget is None
                 or memory_peak(r, choice) <= r.memory_budget))


def _explain_infeasible(r: SolverRequest, prob: Reduced, scaled: Scaled,
                        options: SolverOptions) -> None:
    """Raise InfeasibleError saying why: forbidden choices, or the least memory needed."""
    from ortools.sat.python import cp_model

    free = build(r, prob, scaled, with_memory=False, objective=False)
    status, _, _ = run(free.model, r.time_limit, options)
    if status == cp_model.INFEASIBLE or r.memory_budget is None or not r.liveness:
        raise InfeasibleError(
            "no assignment of strategies avoids the forbidden (infinite-cost) strategies and "
            "resharding pairs; some node has no compatible strategy with its neighbours")
    least = _least_peak(r, prob, scaled, options)
    raise InfeasibleError(
        f"no plan fits the memory budget of {readable_bytes(r.memory_budget, exact=True)} "
        f"per device: the least peak memory any assignment needs is {least}; rematerialize "
        f"activations (jax.checkpoint), or use more devices", least=least)


def _least_peak(r: SolverRequest, prob: Reduced, scaled: Scaled, options: SolverOptions) -> str:
    from ortools.sat.python import cp_model

    built = build(r, prob, scaled, with_memory=True, objective=False, minimize_memory=True)
    status, solver, _ = run(built.model, min(r.time_limit, 10.0), options)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        choice = built.read(solver)
        peak = memory_peak(r, choice)
        if status == cp_model.OPTIMAL:
            return readable_bytes(peak, exact=True)
        low = max(solver.BestObjectiveBound() - len(r.node_names), 0) * memory_unit(r)
        return f"between {readable_bytes(low, exact=True)} and {readable_bytes(peak, exact=True)}"
    # Lower bound without the solver: each set with every node at its smallest value.
    low = max(sum(min(row) for _, row in r.set_terms(i)) for i in range(len(r.liveness)))
    return f"at least {readable_bytes(low, exact=True)}"
