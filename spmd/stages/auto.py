"""``method="auto"`` at two levels: pipeline stages found by the inter-op search
(``spmd.stages.dp``) around the intra-op search of each stage, beside the single-stage plan.

For each stage count ``p`` (powers of two dividing the mesh, within
``PipelineOptions.min_stages``/``max_stages`` and the layers) and each microbatch count
``B`` of ``2p``, ``4p``, ``8p`` that cuts the batch evenly (``PipelineOptions.microbatches``
fixes one instead), every layer is priced on a stage's submesh at that microbatch size
(``LAYER_TIME_LIMIT`` seconds a search), and ``best_partition`` cuts the layers. More
microbatches idle the pipeline less (``(p - 1) / (B + p - 1)``) and hold less per
microbatch in flight, but shrink each microbatch's work, whose collectives and kernels do
not shrink as fast; each count is a trace and a pricing of its own, so the counts stop
rising for a ``p`` once one predicts no faster step than the one before.

The best ``(p, B, cut)`` by predicted step time is then planned for real: a stage's inputs
take the specs its layers' forward and backward searches chose for them (``_layer_specs``:
a stage keeps one spec per leaf), and its tasks are searched again with those pinned, the
update choosing the optimizer state's: the prediction the plan reports, and the sharding
constraints its programs run under (``spmd.runtime.pipeline``). ``stage_record`` and
``replan_stages`` make that plan again from those choices, without the search.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from spmd.cluster.mesh import DeviceMesh
from spmd.errors import InfeasibleError, PlanError
from spmd.logical import user_pins
from spmd.options import SearchOptions
from spmd.search.costgraph import InputInfo
from spmd.search.regions import RegionCache, step_input_specs
from spmd.sharding import Spec, replicated, spec_from_json, spec_to_json
from spmd.stages.dp import Partition, best_partition, carve, stage_link
from spmd.stages.manual import (PIPELINE_METHODS, MicroSteps, plan_manual_pipeline,
                                shared_copy_time)
from spmd.stages.plan import PipelinePlan, StagePlan, predict
from spmd.stages.price import StageCost, price_stage
from spmd.stages.schedule import schedule
from spmd.stages.split import BACKWARD, FORWARD, LayeredStep
from spmd.trace.layers import forward_ops
from spmd.trace.signature import Leaf, StepSignature
from spmd.timing import Stopwatch

__all__ = ["considers_pipelines", "hand_written_pipelines", "plan_two_level", "replan_stages",
           "stage_record"]

#: the layers the step is cut into for the stage search (fewer if its forward pass has
#: fewer ops): up to 8 stages, each layer priced once per submesh and microbatch size
MAX_LAYERS = 8


def considers_pipelines(mesh: DeviceMesh, options: SearchOptions) -> bool:
    """Whether auto searches pipeline stages here: where they can win (a mesh over several
    hosts, whose links between hosts are slow, or one with a stage axis) or are asked for
    (``min_stages`` >= 2), unless ``max_stages`` is 1."""
    pipe = options.pipeline
    if pipe.max_stages == 1 or mesh.size == 1:
        return False
    return pipe.min_stages >= 2 or mesh.hosts > 1 or pipe.stage_axis in mesh.shape


def hand_written_pipelines(full: StepSignature, args: Sequence[Any], mesh: DeviceMesh,
                           options: SearchOptions, logical_axes: Any = None,
                           micro_steps: MicroSteps | None = None,
                           methods: Sequence[str] = tuple(PIPELINE_METHODS),
                           ) -> dict[str, PipelinePlan | str]:
    """Each hand-written pipeline plan of ``methods`` auto compares itself with
    (``options.compare``), its stages along the mesh's stage axis or, without one, the
    outermost axis when it spans the hosts (one stage per host); a plan that does not
    apply, or does not fit the memory budget or the stage counts the options allow, is the
    reason why."""
    if not options.compare:
        return {}
    pipe = options.pipeline
    axis = pipe.stage_axis if pipe.stage_axis in mesh.shape else mesh.axis_names[0]
    if pipe.stage_axis not in mesh.shape and not (mesh.hosts > 1
                                                  and mesh.shape[axis] == mesh.hosts):
        return {}
    stages = mesh.shape[axis]
    if stages < max(pipe.min_stages, 2) or (pipe.max_stages and stages > pipe.max_stages):
        return {}
    budget = options.budget_for(mesh)
    along = dataclasses.replace(options, pipeline=dataclasses.replace(pipe, stage_axis=axis))
    out: dict[str, PipelinePlan | str] = {}
    for method in methods:
        try:
            plan = plan_manual_pipeline(full, args, mesh, method, along, logical_axes,
                                        micro_steps=micro_steps)
        except (PlanError, InfeasibleError) as err:
            out[method] = f"not a candidate: {err}"
            continue
        if plan.prediction.memory_bytes > budget:
            out[method] = (f"does not fit: {plan.prediction.memory_bytes / 2**30:.2f} GiB per "
                           f"device predicted, over {budget / 2**30:.2f} GiB")
        else:
            out[method] = plan
    return out


def _stage_counts(mesh: DeviceMesh, options: SearchOptions, layers: int) -> list[int]:
    pipe = options.pipeline
    top = min(pipe.max_stages or mesh.size, layers, mesh.size)
    return [p for p in (2 ** k for k in range(1, top.bit_length()))
            if max(pipe.min_stages, 2) <= p <= top and mesh.size % p == 0]


#: microbatches per stage the stage search tries (2: MaxText's advice; more idle less)
MICROBATCHES_PER_STAGE = (2, 4, 8)


def _microbatch_counts(rows: int, stages: int, options: SearchOptions) -> list[int]:
    """The microbatch counts tried for ``stages`` stages, fewest first: those of
    ``MICROBATCHES_PER_STAGE`` that cut the batch evenly, else the most below them that do
    (at least one per stage: a batch of 8 rows on 8 stages runs 8 microbatches)."""
    fixed = options.pipeline.microbatches
    if fixed:
        return [fixed] if rows % fixed == 0 else []
    wanted = [m for m in (f * stages for f in MICROBATCHES_PER_STAGE) if rows % m == 0]
    fewer = [m for m in range(stages, MICROBATCHES_PER_STAGE[0] * stages) if rows % m == 0]
    return wanted or fewer[-1:]


#: seconds each layer's task search may take while pricing (a layer is a small program)
LAYER_TIME_LIMIT = 1.0
#: seconds each task search of a chosen stage may take (its inputs pinned, what is left to
#: choose is its intermediates' specs and, in the update, the optimizer state's)
STAGE_TIME_LIMIT = 2.0


def _inputs(micro: StepSignature, mesh: DeviceMesh, options: SearchOptions) -> list[InputInfo]:
    pins = user_pins(micro.leaves, options.logical_rules(), mesh)
    return [InputInfo(leaf.path, leaf.shape, leaf.dtype, leaf.kind, pin)
            for leaf, pin in zip(micro.leaves, pins)]


@dataclasses.dataclass
class _Candidate:
    stages: int
    microbatches: int
    partition: Partition
    total: float
    per_layer: list[StageCost]  # each layer priced alone on a stage's submesh


def plan_two_level(full: StepSignature, args: Sequence[Any], mesh: DeviceMesh,
                   options: SearchOptions, logical_axes: Any = None,
                   timings: Stopwatch | None = None,
                   micro_steps: MicroSteps | None = None) -> PipelinePlan:
    """The best pipeline plan of two or more stages (``InfeasibleError`` if none fits the
    memory budget; ``PlanError`` if the step or mesh allows none). ``micro_steps``: traces
    of the step already made (else made here)."""
    timings = timings if timings is not None else Stopwatch()
    pipe = options.pipeline
    budget = options.budget_for(mesh)
    rows = min((leaf.shape[0] for leaf in full.leaves if leaf.kind == "batch" and leaf.shape),
               default=0)
    cache = RegionCache()
    micro_steps = micro_steps if micro_steps is not None else MicroSteps(full, args,
                                                                         logical_axes)
    traced: dict[int, tuple[StepSignature, LayeredStep]] = {}
    best: _Candidate | None = None
    tried = 0
    layers = pipe.layers or MAX_LAYERS
    counts = _stage_counts(mesh, options, layers)
    if not counts or not rows:
        raise PlanError(f"mesh {mesh.name!r} ({mesh.size} devices) and this step allow no "
                        f"pipeline of {max(pipe.min_stages, 2)} or more stages "
                        f"(PipelineOptions min_stages={pipe.min_stages}, "
                        f"max_stages={pipe.max_stages}, a batch of {rows} rows)")
    for p in counts:
        meshes = carve(mesh, p)
        link = stage_link(mesh, meshes)
        previous = float("inf")  # this p's best step at fewer microbatches
        for m in _microbatch_counts(rows, p, options):
            if m not in traced:
                with timings.phase("stage_trace"):
                    micro, graph = micro_steps.get(m)
                    count = min(layers, len(forward_ops(graph)))
                    traced[m] = (micro, LayeredStep(micro.jaxpr, count, graph))
            micro, layered = traced[m]
            if p > layered.num_layers:
                continue
            inputs = _inputs(micro, meshes[0], options)
            quick = dataclasses.replace(options, time_limit=min(options.time_limit,
                                                                 LAYER_TIME_LIMIT))
            with timings.phase("stage_pricing"):
                per_layer = [price_stage(layered, k, k + 1, meshes[0], step_inputs=inputs,
                                         output_aliases=micro.output_aliases, send_link=None,
                                         options=quick, cache=cache)
                             for k in range(layered.num_layers)]
            sched = schedule(pipe.schedule, p, m)
            with timings.phase("stage_dp"):
                partition = best_partition(per_layer, sched, link, budget)
            tried += 1
            if partition is None:
                continue
            total = predict(partition.costs, sched).total_time
            if best is None or total < best.total:
                best = _Candidate(p, m, partition, total, per_layer)
            if total >= previous:
                break
            previous = total
    if best is None:
        raise InfeasibleError(f"no pipeline of {', '.join(map(str, counts))} stages fits "
                              f"{options.budget_words(mesh)}")
    with timings.phase("stage_plans"):
        plan = _final_plan(full, mesh, options, traced[best.microbatches], best, cache)
    plan.search = {"stage_counts": counts, "candidates": tried,
                   "region_searches": cache.misses, "region_cache_hits": cache.hits,
                   "timings": timings.as_dict()}
    return plan


def _layer_specs(layered: LayeredStep, per_layer: Sequence[StageCost], start: int, stop: int,
                 leaves: Sequence[Leaf]) -> list[Spec | None]:
    """The spec of every step input the forward or backward work of layers ``start`` to
    ``stop - 1`` reads, as the first of their tasks' searches that reads it chose (None for
    the others: the optimizer state, which the stage's update then chooses with the
    parameters fixed). These tasks run once per microbatch, the update once per step: one
    search of the stage as a program weighs them alike, and its FSDP-like gathers per
    microbatch made gpt-6.7b's stages on 64 A100s 1.6x slower than their layers' own."""
    specs: list[Spec | None] = [None] * len(leaves)
    regions = {k: layered.regions(k, k + 1) for k in range(start, stop)}
    for phase in (FORWARD, BACKWARD):
        for k in range(start, stop):
            plan, region = per_layer[k].plans.get(phase), regions[k].get(phase)
            if plan is None or region is None:
                continue
            for i, spec in step_input_specs(region, plan).items():
                if specs[i] is None:
                    specs[i] = spec
    return specs


def _input_specs(layered: LayeredStep, start: int, stop: int, cost: StageCost,
                 chosen: Sequence[Spec | None], leaves: Sequence[Leaf]) -> list[Spec]:
    """Every step input's spec on the stage of layers ``start`` to ``stop - 1``:
    ``chosen``, else as the stage's tasks read it (the update: the optimizer state), else
    replicated (a leaf the stage does not read)."""
    specs = list(chosen)
    regions = layered.regions(start, stop, cost.recompute)
    for phase, plan in cost.plans.items():
        for k, spec in step_input_specs(regions[phase], plan).items():
            if specs[k] is None:
                specs[k] = spec
    return [spec if spec is not None else replicated(len(leaf.shape))
            for spec, leaf in zip(specs, leaves)]


def _final_plan(full: StepSignature, mesh: DeviceMesh, options: SearchOptions,
                traced: tuple[StepSignature, LayeredStep], best: _Candidate,
                cache: RegionCache) -> PipelinePlan:
    """The chosen cut planned stage by stage: its layers' searches fix the specs of the
    stage's inputs (``_layer_specs``), and its tasks are searched again with them pinned,
    recomputing where the stage search chose to, or where the stage as planned would not
    fit otherwise."""
    micro, layered = traced
    bounds = list(best.partition.starts) + [layered.num_layers]
    chosen = [_layer_specs(layered, best.per_layer, bounds[s], bounds[s + 1], micro.leaves)
              for s in range(best.stages)]
    return _plan_stages(full, mesh, options, traced, best.microbatches, best.partition.starts,
                        chosen, best.partition.recompute, cache)


def _plan_stages(full: StepSignature, mesh: DeviceMesh, options: SearchOptions,
                 traced: tuple[StepSignature, LayeredStep], microbatches: int,
                 starts: Sequence[int], chosen: Sequence[Sequence[Spec | None]],
                 recompute: Sequence[bool], cache: RegionCache) -> PipelinePlan:
    """Stages starting at layers ``starts`` on ``len(starts)`` carved submeshes, stage
    ``s``'s step inputs pinned to ``chosen[s]`` (None: its tasks choose), each task searched
    around them, recomputing where ``recompute`` says or where the stage would not fit."""
    micro, layered = traced
    meshes = carve(mesh, len(starts))
    link = stage_link(mesh, meshes)
    sched = schedule(options.pipeline.schedule, len(starts), microbatches)
    budget = options.budget_for(mesh)
    bounds = list(starts) + [layered.num_layers]
    inputs = _inputs(micro, meshes[0], options)
    # each task's intermediates searched around the pinned inputs (not only scored)
    stage_options = dataclasses.replace(
        options, time_limit=min(options.time_limit, STAGE_TIME_LIMIT))
    stages = []
    for s, sub in enumerate(meshes):
        pinned = [i if spec is None else dataclasses.replace(i, pinned=spec)
                  for i, spec in zip(inputs, chosen[s])]
        def priced(redo: bool):
            return price_stage(layered, bounds[s], bounds[s + 1], sub, step_inputs=pinned,
                               output_aliases=micro.output_aliases, send_link=link,
                               options=stage_options, cache=cache, recompute=redo)

        cost = priced(recompute[s])
        if not cost.recompute and cost.memory(sched.in_flight(s)) > budget:
            cost = priced(True)
        stages.append(StagePlan(bounds[s], bounds[s + 1], sub, "auto",
                                _input_specs(layered, bounds[s], bounds[s + 1], cost, chosen[s],
                                             micro.leaves), cost))
    split = layered.split(list(starts), [st.cost.recompute for st in stages])
    plan = PipelinePlan("auto", mesh, full.leaves, layered.num_layers, stages, sched, split,
                        full, micro)
    copies = shared_copy_time(split, micro.leaves, stages[0].input_specs, stages[0].mesh, link)
    plan.prediction = predict([st.cost for st in stages], sched, copy_time=copies)
    return plan


def stage_record(plan: PipelinePlan) -> dict[str, Any]:
    """What ``replan_stages`` needs to plan ``plan`` (the stage search's) again without the
    search (JSON-ready): its microbatches, layers, cut, recomputing stages and each stage's
    input specs."""
    return {"microbatches": plan.microbatches, "layers": plan.num_layers,
            "starts": [st.start for st in plan.stages],
            "recompute": [st.cost.recompute for st in plan.stages],
            "paths": [leaf.path for leaf in plan.micro.leaves],
            "specs": [[spec_to_json(spec) for spec in st.input_specs] for st in plan.stages],
            "search": plan.search}


def replan_stages(full: StepSignature, args: Sequence[Any], mesh: DeviceMesh,
                  options: SearchOptions, record: Mapping[str, Any],
                  logical_axes: Any = None) -> PipelinePlan:
    """The stage search's plan of ``record`` (``stage_record``) made again for this step:
    the step traced at its microbatch, each stage's tasks searched around the recorded
    specs (seconds, where the stage search takes minutes). ``ValueError`` if the record
    does not fit the step."""
    micro, graph = MicroSteps(full, args, logical_axes).get(int(record["microbatches"]))
    if [leaf.path for leaf in micro.leaves] != list(record["paths"]):
        raise ValueError("the recorded stages are for a step with other inputs")
    layered = LayeredStep(micro.jaxpr, int(record["layers"]), graph)
    chosen = [[spec_from_json(spec) for spec in stage] for stage in record["specs"]]
    plan = _plan_stages(full, mesh, options, (micro, layered), int(record["microbatches"]),
                        list(record["starts"]), chosen, list(record["recompute"]),
                        RegionCache())
    plan.search = dict(record.get("search") or {})
    return plan
