"""Fitting a plan under the memory budget by rematerialization: a layer-level search around
the integer program.

When no sharding of the step as written fits the budget, layers are rematerialized
(``spmd.memory.remat``): for each policy, least recompute first (``POLICIES``), the step with
every layer recomputed is searched; the first that fits fixes the policy, and a binary search
over how many layers (the first ``k``: their activations are kept longest) finds the fewest
that fit. Each probe is a full sharding search of the rewritten step under the budget, so the
sharding is chosen jointly with the remat it runs with: recomputed ops are priced, split and
resharded like any other, and their memory is the rewritten program's liveness.

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
from spmd.memory.remat import (POLICIES, RECOMPUTE_ALL, RematPlan, block_count, recomputable,
                               rematerialize)
from spmd.options import SearchOptions
from spmd.search.intra_op import AutoResult, InputInfo, IntraOp
from spmd.sharding import Spec
from spmd.solver.driver import format_bytes
from spmd.trace.graph import Graph, build_graph

__all__ = ["Fitted", "fewest", "fit_with_remat"]

T = TypeVar("T")


@dataclasses.dataclass
class Fitted:
    """The plan found with remat: its search result, the rewritten step (``program``) and the
    cost graph it was found on (the constraints' keys name its equations), the remat, and
    every probe (``{"remat", "fits", "peak_bytes", "seconds"}``) in the order run."""

    result: AutoResult
    job: IntraOp
    program: Any
    remat: RematPlan
    probes: list[dict]


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


def fit_with_remat(jaxpr, graph: Graph, inputs: Sequence[InputInfo], mesh: DeviceMesh, *,
                   output_aliases: Mapping[int, int], budget: float, options: SearchOptions,
                   lean: Sequence[Sequence[Spec]] = ()) -> Fitted:
    """The fewest layers recomputed, and how, for a plan of ``jaxpr`` (its op graph
    ``graph``) within ``budget`` bytes per device (module docstring). ``lean``: the input
    specs of the hand-written plans that need the least memory, leanest first: on each
    rewritten step they are scored until one fits, which seeds its search (under a tight
    budget the solver's own seeds may all be over it, and CP-SAT alone found no plan for
    gpt-13b on 8 A100s in 20 s).

    Raises:
      InfeasibleError: not even every layer recomputed (``RECOMPUTE_ALL``) fits; the message
        gives the least peak memory then.
    """
    layers = block_count(graph)
    if not recomputable(jaxpr, graph, layers):
        raise InfeasibleError(
            f"no plan fits the memory budget of {format_bytes(budget)} per device, and spmd "
            f"adds no rematerialization to this step: it calls jax.checkpoint itself (that "
            f"choice is kept), or its layers run in a scan (give its body a jax.checkpoint "
            f"policy); use more devices, or a smaller batch")
    probes: list[dict] = []
    least = ["not known: no plan was found in the time limit"]  # the last probe's, in words

    def probe(remat: RematPlan) -> Fitted | None:
        """The plan of the step with ``remat`` under the budget, or None (``least`` says
        how much the best attempt needed)."""
        start = time.perf_counter()
        rewritten = rematerialize(jaxpr, remat, graph)
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
        try:
            result = job.search(memory_budget=budget, time_limit=options.time_limit,
                                solver=options.solver, warm_start=warm)
        except InfeasibleError as err:
            result = None
            if err.least is not None:
                least[0] = f"the least peak memory any assignment needs is {err.least}"
        except PlanError:  # no plan found in the time limit
            result = None
        if result is not None and result.prediction.memory_bytes > budget:
            # the program's liveness sets are an approximation of the prediction
            least[0] = (f"the least peak memory found is "
                        f"{format_bytes(result.prediction.memory_bytes)}")
            result = None
        if seed_fits and (result is None
                          or warm.prediction.total_time < result.prediction.total_time):
            # The hand-written seed fits where the search found nothing that does (its
            # repair of the seed, which keeps small inputs replicated, went over), or
            # nothing faster: keep it.
            result = dataclasses.replace(warm, constraints=job.constraints(warm))
        probes.append({"remat": remat.summary(), "fits": result is not None,
                       "peak_bytes": None if result is None else result.prediction.memory_bytes,
                       "seconds": time.perf_counter() - start})
        return None if result is None else Fitted(result, job, rewritten, remat, probes)

    for policy in POLICIES:
        every = probe(RematPlan.first(layers, layers, policy))
        if every is not None:
            break
    else:
        raise InfeasibleError(
            f"no plan fits the memory budget of {format_bytes(budget)} per device, even with "
            f"every layer's activations recomputed in the backward pass "
            f"({RematPlan.first(layers, layers, RECOMPUTE_ALL).summary()}): {least[0]}; use "
            f"more devices, or a smaller batch")
    _, best = fewest(lambda k: probe(RematPlan.first(layers, k, policy)), layers)
    return best or every
