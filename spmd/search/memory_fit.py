"""Fitting a plan under the memory budget by rematerialization and host offload: a search
around the integer program.

When no sharding of the step as written fits the budget, layers are rematerialized
(``spmd.memory.remat``): for each policy, least recompute first (``POLICIES``), the step with
every layer recomputed is searched; the first that fits fixes the policy, and a binary search
over how many layers (the first ``k``: their activations are kept longest) finds the fewest
that fit. Of the probes that fit (the fewest layers, every layer, and those the binary search
tried between), the fastest plan is kept: recomputing more layers can let a sharding with
less communication fit (gpt-2.6b on 64 A100s), and a user wants the faster step, not the
least recompute. Each probe is a full sharding search of the rewritten step under the budget, so the
sharding is chosen jointly with the remat it runs with: recomputed ops are priced, split and
resharded like any other, and their memory is the rewritten program's liveness.

Host offload (``spmd.memory.offload``: the optimizer state in pinned host memory between
steps) is the other lever, where the device has a host link (``DeviceSpec.host_bandwidth``)
and a host memory of its own (not XLA:CPU's: ``separate_host_memory``).
It is searched the same way, the offloaded step first without remat and then with the
fewest layers recomputed (only fewer, or under a lighter policy, than remat alone needed),
and the faster of the two plans is kept. It is not tried when its
copies alone (the state in and out once, at the least bytes per device a sharding can give
it) take longer than the recompute it could save: that is said in the plan's notes.

Why a search around the integer program rather than inside it: a layer's activation bytes
depend on the strategies chosen for its ops (a Megatron split holds a quarter of them), so a
remat variable in the program would multiply every strategy's memory term (a product of
variables to linearize per value and liveness set), while the layers of a model are alike:
``k`` is one number, and ``log2(layers)`` searches find it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Sequence, TypeVar

from spmd.cluster.mesh import DeviceMesh
from spmd.errors import InfeasibleError, PlanError
from spmd.units import readable_bytes
from spmd.memory.offload import OffloadPlan, offload, offloadable, separate_host_memory
from spmd.memory.remat import (POLICIES, RECOMPUTE_ALL, RematPlan, block_count, recomputable,
                               rematerialize)
from spmd.options import SearchOptions
from spmd.search.intra_op import AutoResult, InputInfo, IntraOp
from spmd.sharding import Spec
from spmd.trace.graph import Graph, array_bytes, build_graph
from spmd.trace.signature import Leaf

__all__ = ["Fitted", "fewest", "fit_memory", "search_under"]

T = TypeVar("T")


@dataclasses.dataclass
class Fitted:
    """The plan found with remat and offload: its search result, the rewritten step
    (``program``) and the cost graph it was found on (the constraints' keys name its
    equations), the remat and offload (None: none), every probe (``{"remat", "offload",
    "fits", "peak_bytes", "seconds"}``) in the order run, and ``notes`` on what was not tried
    and why."""

    result: AutoResult
    job: IntraOp
    program: Any
    remat: RematPlan | None
    offload: OffloadPlan | None
    probes: list[dict]
    notes: list[str] = dataclasses.field(default_factory=list)


def fewest(fits: Callable[[int], T | None], known: int) -> tuple[int, T]:
    """The least ``k`` in ``1..known`` for which ``fits(k)`` answers (not None), by binary
    search, with that answer; ``fits(known)`` is taken to answer and ``fits(0)`` not (more
    layers recomputed, less memory: monotone up to the search's own variance); the answer
    is None when only ``known`` fits.

    >>> fewest(lambda k: f"{k} layers" if k >= 3 else None, 8)
    (3, '3 layers')
    """
    low, high, best = 0, known, None
    while high - low > 1:
        mid = (low + high) // 2
        answer = fits(mid)
        if answer is None:
            low = mid
        else:
            high, best = mid, answer
    return high, best


def fastest(found: Sequence[Fitted]) -> Fitted | None:
    """The plan of least predicted step time among ``found`` (None if empty)."""
    return min(found, key=lambda f: f.result.prediction.total_time, default=None)


def search_under(job: IntraOp, budget: float, options: SearchOptions,
                 warm: AutoResult | None = None,
                 attempts: int = 4) -> tuple[AutoResult | None, str | None]:
    """The search's plan within ``budget`` by its prediction, or None and why (the least
    memory, in words; None when no plan was found in the time limit).

    The integer program's memory rows, at the busiest program points, leave out what the
    prediction adds beside the graph's values (resharded copies, partial sums:
    ``spmd.memory.liveness.Buffer``), so a plan it fits to the budget can be over it by
    those. Where a plan's peak lies over the budget at a point whose set, holding the copies
    and partial sums live there too (``spmd.search.point_memory``: a lower bound of the
    prediction, so no plan that fits is shut out), would shut the plan out, the search is
    run again with that set. Else (the set leaves out what the plan holds there: partial
    sums that wait for a combined collective) the program's budget (its target) is lowered
    by the overshoot, and where a target proves infeasible, halfway back to the last target
    that found a plan, up to ``attempts`` searches in all. (One lowering was not enough: on
    a step of 8 tanh layers with every layer recomputed, a target of 5.8 MiB gave a plan
    predicted at 7.1 MiB and the lowered one none, while a target of 5.0 MiB gave one at
    5.1 MiB.) Where the plan's own rows sat below the lowered target too, they did not bind
    and the same plan would come again: the target goes to those rows less the overshoot
    instead. (gpt-13b on 8 A100s, save_dots on every layer, with the reduce-scatter variants
    of an experiment: rows at 31.72 GiB, the prediction 33.68, 0.15 over; the same plan
    came at targets 33.53, 33.38, 33.23 and 33.08.)"""
    target, infeasible, over, least = budget, 0.0, None, None
    points: list[int] = []
    for _ in range(attempts):
        try:
            result = job.search(memory_budget=target, time_limit=options.time_limit,
                                solver=options.solver, warm_start=warm, points=points)
        except InfeasibleError as err:
            if over is None or target >= budget:
                # even the program's own rows (lower bounds of the prediction) do not fit
                return None, None if err.least is None else (
                    f"the least peak memory any assignment needs is {err.least}")
            infeasible, target = target, (target + over[0]) / 2
            continue
        except PlanError:  # no plan found in the time limit
            break
        peak = result.prediction.memory_bytes
        if peak <= budget:
            return result, None
        least = peak if least is None else min(least, peak)
        over = (target, peak)
        if result.stats.get("peak_point_held", 0.0) > target:
            # the point's set holds more of this plan than the target: it shuts it out
            points.append(result.stats["peak_point"])
            continue
        lowered = target * budget / peak
        program_peak = result.stats.get("program_peak_bytes")
        if program_peak and program_peak <= lowered:
            # The rows did not bind (the plan would fit the lowered target as well, and be
            # found again): they must make room for what the prediction adds beside them.
            lowered = program_peak - (peak - budget)
        target = max(lowered, (infeasible + target) / 2)
    return None, (None if least is None
                  else f"the least peak memory found is {readable_bytes(least, exact=True)}")


def fit_memory(jaxpr, graph: Graph, inputs: Sequence[InputInfo], mesh: DeviceMesh, *,
               leaves: Sequence[Leaf], output_aliases: Mapping[int, int], budget: float,
               options: SearchOptions, lean: Sequence[Sequence[Spec]] = ()) -> Fitted:
    """The fastest plan of ``jaxpr`` (its op graph ``graph``, its flat inputs ``leaves``)
    within ``budget`` bytes per device with layers recomputed, the optimizer state offloaded
    or not (module docstring). ``lean``: the input specs of the hand-written plans
    that need the least memory, leanest first: on each rewritten step they are scored until
    one fits, which seeds its search (under a tight budget the solver's own seeds may all be
    over it, and CP-SAT alone found no plan for gpt-13b on 8 A100s in 20 s).

    Raises:
      InfeasibleError: not even every layer recomputed (``RECOMPUTE_ALL``) with the
        optimizer state offloaded fits; the message gives the least peak memory then.
    """
    layers = block_count(graph)
    remat_ok = recomputable(jaxpr, graph, layers)
    state = offloadable(leaves, output_aliases)
    separate = separate_host_memory(mesh.platform)
    host = state if mesh.device.host_bandwidth > 0 and separate else OffloadPlan(())
    # why offload is not tried where host memory is the devices' own (XLA:CPU)
    shared_note = (f"host offload not tried: on the {mesh.platform} platform host memory is "
                   f"the devices' own, so an offloaded array takes the same memory"
                   if state.active and not separate else None)
    if not remat_ok and not host.active:
        raise InfeasibleError(
            f"no plan fits {options.budget_words(mesh)}, and spmd "
            f"adds no rematerialization to this step: it calls jax.checkpoint itself (that "
            f"choice is kept), or its layers run in a scan (give its body a jax.checkpoint "
            f"policy); use more devices, or a smaller batch")
    probes: list[dict] = []
    notes: list[str] = [shared_note] if shared_note else []
    least = ["not known: no plan was found in the time limit"]  # the last probe's, in words

    def probe(remat: RematPlan | None, moved: OffloadPlan | None) -> Fitted | None:
        """The plan of the step with ``remat`` and ``moved`` under the budget, or None
        (``least`` says how much the best attempt needed)."""
        start = time.perf_counter()
        rewritten = rematerialize(jaxpr, remat, graph) if remat is not None else jaxpr
        if moved is not None:
            rewritten = offload(rewritten, moved, output_aliases)
        job = IntraOp(build_graph(rewritten), inputs, mesh, output_aliases=output_aliases,
                      required=[(i.shape, s) for specs in lean for i, s in zip(inputs, specs)])
        warm = None
        limit, scoring = options.scoring()
        for specs in lean:
            try:
                warm = job.score(specs, time_limit=limit, solver=scoring)
            except PlanError:  # a seed only
                continue
            if warm.prediction.memory_bytes <= budget:
                break
        seed_fits = warm is not None and warm.prediction.memory_bytes <= budget
        result, why = search_under(job, budget, options, warm)
        if why is not None:
            least[0] = why
        if seed_fits and (result is None
                          or warm.prediction.total_time < result.prediction.total_time):
            # The hand-written seed fits where the search found nothing that does (its
            # repair of the seed, which keeps small inputs replicated, went over), or
            # nothing faster: keep it.
            result = dataclasses.replace(warm, constraints=job.constraints(warm))
        recomputed = 0 if remat is None else sum(p is not None for p in remat.policies)
        probes.append({"remat": remat.summary() if remat is not None else "none",
                       "recomputed": recomputed,
                       "offload": moved.summary(leaves) if moved is not None else "none",
                       "fits": result is not None,
                       "peak_bytes": None if result is None else result.prediction.memory_bytes,
                       "step_seconds": None if result is None else result.prediction.total_time,
                       "seconds": time.perf_counter() - start})
        return None if result is None else Fitted(result, job, rewritten, remat, moved, probes,
                                                  notes)

    def fewest_layers(moved: OffloadPlan | None,
                      within: tuple[str, int] | None = None) -> Fitted | None:
        """The fastest fitting plan the binary search for the fewest layers recomputed
        probed (none recomputed, where the offloaded step fits without), or None.
        ``within``: the (policy, layers) found without offload; only plans that recompute
        less are searched then (a lighter policy, or fewer layers)."""
        if moved is not None and (plain := probe(None, moved)) is not None:
            return plain
        if not remat_ok:
            return None
        for policy in POLICIES:
            fitting: list[Fitted] = []

            def first(k: int) -> Fitted | None:
                found = probe(RematPlan.first(layers, k, policy), moved)
                if found is not None:
                    fitting.append(found)
                return found

            if within is not None and policy == within[0]:
                fewest(first, within[1])
                return fastest(fitting)
            if first(layers) is not None:
                fewest(first, layers)
                return fastest(fitting)
        return None

    found = fewest_layers(None) if remat_ok else None
    if host.active:
        copies = 2 * sum(array_bytes(leaves[i].shape, leaves[i].dtype)
                         for i in host.inputs) / mesh.size / mesh.device.host_bandwidth
        saved = found.result.prediction.recompute_time if found is not None else float("inf")
        within = None
        if found is not None:
            chosen = [p for p in found.remat.policies if p is not None]
            within = (chosen[0], len(chosen))
        if copies < saved:
            other = fewest_layers(host, within)
            if other is not None and (found is None or other.result.prediction.total_time
                                      < found.result.prediction.total_time):
                found = other
        else:
            notes.append(f"host offload of the optimizer state not tried: its copies take at "
                         f"least {copies * 1e3:.4g} ms per step over the "
                         f"{mesh.device.host_bandwidth / 1e9:.4g} GB/s host link, more than "
                         f"the {saved * 1e3:.4g} ms of recompute it could save")
    if found is None:
        everything = RematPlan.first(layers, layers, RECOMPUTE_ALL).summary()
        what = (f"every layer's activations recomputed in the backward pass ({everything})"
                if remat_ok else "no layer recomputed (the step's own jax.checkpoint is kept)")
        if host.active:
            what += f" and the {host.summary(leaves)}"
        elif shared_note:
            what += f" ({shared_note})"
        raise InfeasibleError(
            f"no plan fits {options.budget_words(mesh)}, even with "
            f"{what}: {least[0]}; use more devices, or a smaller batch")
    return found
