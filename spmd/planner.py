"""``method="auto"``: the search beside the hand-written plans, all priced on one cost graph.

The step's op graph is built once and priced once (``IntraOp``: the cost graph, with every
spec a hand-written plan pins among its candidates); each applicable hand-written plan is
scored on it with its inputs pinned, the best one warm-starts the search, and if the search
ends predicted slower than that plan (its simplifications can exclude it), the plan is
returned instead, so auto is never predicted slower than the best of them. When no sharding
of the step as written fits the memory budget, layers are rematerialized (the fastest of the
fitting plans a search for the fewest layers tried), or the optimizer state is offloaded to
host memory where that is faster (``spmd.search.memory_fit``). Every phase's seconds are
recorded in ``Plan.search["timings"]``; plans are cached (``spmd.cache``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from spmd import cache
from spmd.cluster.mesh import DeviceMesh
from spmd.errors import PlanError, warn
from spmd.logical import user_pins
from spmd.manual import DOES_NOT_APPLY, applicable_methods, manual_specs
from spmd.options import SearchOptions
from spmd.plan import Plan
from spmd.search.intra_op import AutoResult, InputInfo, IntraOp, Searched, score_searched
from spmd.search.memory_fit import fit_memory, search_under
from spmd.sharding import Spec
from spmd.timing import Stopwatch
from spmd.trace.graph import Graph, build_graph
from spmd.trace.signature import StepSignature

__all__ = ["plan_auto", "score_manual", "step_inputs"]


def step_inputs(sig: StepSignature, mesh: DeviceMesh, options: SearchOptions) -> list[InputInfo]:
    """One InputInfo per input leaf, pinned where the user fixed a spec (an explicit
    PartitionSpec of mesh axes, or logical names ``options.rules`` covers)."""
    pins = user_pins(sig.leaves, options.logical_rules(), mesh)
    return [InputInfo(leaf.path, leaf.shape, leaf.dtype, leaf.kind, pin)
            for leaf, pin in zip(sig.leaves, pins)]


def _warn_trivial_axes(mesh: DeviceMesh) -> None:
    """A one-device mesh or a size-1 axis plans fine but splits nothing: say so, not fail."""
    if mesh.size == 1:
        warn(f"mesh {mesh.name!r} has one device: every plan is the same (nothing is split); "
             f"the step runs unsharded")
        return
    ones = [a for a, s in mesh.shape.items() if s == 1]
    if ones:
        warn(f"mesh {mesh.name!r}: axis {', '.join(ones)} has size 1 and cannot split "
             f"anything; it is ignored")


def _baselines(sig: StepSignature, mesh: DeviceMesh, options: SearchOptions,
               pins: list[Spec | None]) -> tuple[dict[str, list[Spec]], dict[str, str]]:
    """The hand-written plans to score (their input specs, the user's pins kept), and why
    the others are not."""
    specs: dict[str, list[Spec]] = {}
    skipped: dict[str, str] = {}
    if not options.compare or mesh.size == 1:
        return specs, skipped
    for name, why_not in applicable_methods(sig.leaves, mesh, pins).items():
        if why_not:
            skipped[name] = f"{DOES_NOT_APPLY}{why_not}"
        else:
            specs[name] = manual_specs(sig.leaves, name, mesh, pins)
    return specs, skipped


def score_manual(sig: StepSignature, mesh: DeviceMesh, method: str, options: SearchOptions,
                 graph: Graph | None = None,
                 inputs: list[InputInfo] | None = None) -> Searched:
    """The cost model's view of one hand-written plan (intermediates chosen by the ILP), with
    the sharding constraints that compile it as scored (``.result``), kept with what it was
    scored on (``Plan.priced_on`` prices it on another platform). ``inputs``:
    ``step_inputs`` already made for these options (else made here)."""
    limit, solver = options.scoring()
    inputs = inputs if inputs is not None else step_inputs(sig, mesh, options)
    return score_searched(sig.jaxpr, inputs, mesh,
                          manual_specs(sig.leaves, method, mesh, [i.pinned for i in inputs]),
                          output_aliases=sig.output_aliases, time_limit=limit, graph=graph,
                          solver=solver)


def _leanest(baselines: dict[str, list[Spec]], scores: dict[str, Any],
             count: int = 3) -> list[list[Spec]]:
    """The input specs of the ``count`` scored hand-written plans predicted to need the
    least memory, leanest first."""
    scored = sorted((p.memory_bytes, name) for name, p in scores.items()
                    if name in baselines and not isinstance(p, str))
    return [baselines[name] for _, name in scored[:count]]


def plan_auto(sig: StepSignature, mesh: DeviceMesh, options: SearchOptions,
              timings: Stopwatch | None = None) -> Plan:
    """Search a plan for the step (or load it from the cache)."""
    timings = timings if timings is not None else Stopwatch()
    _warn_trivial_axes(mesh)
    inputs = step_inputs(sig, mesh, options)
    with timings.phase("cache"):
        path = cache.cache_path(sig, inputs, mesh, options)
        cached = cache.load(path, sig, mesh)
    if cached is not None:  # this call's phases (tracing, the load), not the saved run's
        cached.search["timings"] = timings.as_dict()
        return cached
    with timings.phase("graph"):
        graph = build_graph(sig.jaxpr)  # one op graph for every scoring and the search
    baselines, alternatives = _baselines(sig, mesh, options, [i.pinned for i in inputs])
    with timings.phase("cost_graph"):
        job = IntraOp(graph, inputs, mesh, output_aliases=sig.output_aliases,
                      required=[(i.shape, s) for specs in baselines.values()
                                for i, s in zip(inputs, specs)])
    scores: dict[str, Any] = dict(alternatives)
    best: tuple[str, AutoResult] | None = None
    limit, scoring = options.scoring()
    scored_as: dict[tuple, str] = {}  # pins -> the hand-written plan first scored with them
    with timings.phase("baselines"):
        for name, specs in baselines.items():
            pins = tuple(specs)  # Specs are tuples: hashable as they are
            if pins in scored_as:  # e.g. tp and dp_tp where the data axis has size 1
                scores[name] = scores[scored_as[pins]]
                continue
            scored_as[pins] = name
            try:
                scored = job.score(specs, time_limit=limit, solver=scoring)
            except PlanError as err:  # the cost model cannot express this hand-written plan
                scores[name] = f"not scored: {err}"
                continue
            scores[name] = scored.prediction
            if best is None or scored.prediction.total_time < best[1].prediction.total_time:
                best = (name, scored)
    budget = options.budget_for(mesh)
    base_job, remat, moved, probes, notes, program = job, None, None, None, None, None
    with timings.phase("search"):
        result, _ = search_under(job, budget, options, best[1] if best else None)
    if result is None:
        with timings.phase("remat"):  # no sharding of the step as written fits
            fitted = fit_memory(sig.jaxpr, graph, inputs, mesh, leaves=sig.leaves,
                                output_aliases=sig.output_aliases, budget=budget,
                                options=options, lean=_leanest(baselines, scores))
        result, job, probes, notes = fitted.result, fitted.job, fitted.probes, fitted.notes
        remat, moved = fitted.remat, fitted.offload
        program = (sig, fitted.program)  # the plan runs what was searched: not rewritten again
    kept_manual = (best is not None
                   and best[1].prediction.total_time < result.prediction.total_time
                   and best[1].prediction.memory_bytes <= budget)
    if kept_manual:
        # The search keeps small inputs replicated, so it can miss a hand-written plan
        # that splits them by a hair; never return a slower plan.
        result = dataclasses.replace(best[1], solver=result.solver, stats=result.stats,
                                     constraints=base_job.constraints(best[1]))
        remat = moved = probes = notes = program = None
    solver = result.solver
    if solver is not None and solver.timed_out:
        warn(f"the sharding search reached its time limit ({options.time_limit:g} s); using "
             f"the best plan found (objective {solver.objective:.4g} s, bound "
             f"{solver.bound:.4g} s). Raise SearchOptions.time_limit for a better one")
    stats = dict(result.stats)
    if solver is not None:
        # stalled: stopped early with no better plan coming (not a time-out: no warning)
        stats.update(objective=solver.objective, bound=solver.bound, status=solver.status,
                     bound_from=solver.bound_from, timed_out=solver.timed_out,
                     stalled=solver.stalled)
    stats["fallbacks"] = result.fallbacks
    stats["warm_start_from"] = best[0] if best else None
    stats["kept_hand_written"] = best[0] if kept_manual else None
    stats["remat_probes"] = probes
    stats["memory_notes"] = notes
    stats["timings"] = timings.as_dict()  # the planning phases; "phases": the search's own
    planned = Plan(method="auto", mesh=mesh, leaves=sig.leaves, input_specs=result.input_specs,
                   output_specs=list(result.output_specs), prediction=result.prediction,
                   search=stats, constraints=dict(result.constraints), alternatives=scores,
                   remat=remat, offload=moved, signature=sig, _program=program,
                   _searched=Searched.of(base_job if kept_manual else job, result))
    cache.save(planned, path)
    return planned
