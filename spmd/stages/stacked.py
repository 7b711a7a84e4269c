"""A hand-written pipeline plan run by the SPMD runtime (``spmd.runtime.stacked``): the
step's scanned layer stack shared equally by the stages of the mesh's ``stage`` axis, the
named intra-op plan inside each stage, everything else of the step on every stage.

The specs: a leaf with one entry per layer of the stack (a stacked parameter, its optimizer
moments) is split over the stage axis along its layer dim, and inside a stage as the
intra-op method puts it; every other leaf is as the method puts it on one stage, the same
on each (the embedding, the head and their optimizer state are replicated over the stages,
as MaxText has them).

Each part of the step is planned by the intra-op search on one stage's devices, its inputs
pinned to those specs (``spmd.search.regions.search_region``); the runtime lays the part out
as its plan does (``RegionLayout``: the plan's constraints, and the specs of a stack's
loop state). The prediction prices:

- the microbatch regions (before, between and after the stacks) once per microbatch;
- each stack's loop: ``m v + p - 1`` ticks, each one chunk (``L / (p v)`` layers) of the
  stack's time plus sending the carry to the next stage over the stage link, each device a
  piece no other of its stage sends (``spmd.sharding.spread``; the stage gathers it on its
  own links, not priced, as for the MPMD runtime); then the
  stack's results (all microbatches') from the flow's last stage to the others;
- the update, on the whole mesh (the stacked state split over the stages);
- with ``v > 1``, the stacked parameters moved into the circular layout and their gradients
  back, each device sending all but a ``1 / v`` of its share (an all-to-all over the stage
  link).

Where that does not fit the device (or the memory budget), every stage recomputes: the
forward loop keeps of each microbatch only what entered each chunk, and the backward tick
runs the chunk's forward again before its backward (the backward's time grows by the
forward's; one chunk's saved values are its working set).

Memory per device: the step inputs as held, the parameters' gradients summed (the stacked
ones on their stage) (with ``v > 1`` the stacked parameters and their gradients once more, in the
circular layout), what the stacks keep per microbatch for the backward stack (``m`` sets of
the stage's ``L / p`` layers), the microbatch regions' values kept per microbatch, and the
largest working peak of one region beyond what it reads.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from spmd.cluster.mesh import DeviceMesh, Link
from spmd.errors import PlanError, SolverTimeoutError
from spmd.options import SearchOptions
from spmd.stages.stack import (LayerStack, RegionLayout, StackedStep, find_stack,
                               stacked_leaves, ticks)
from spmd.search.costgraph import InputInfo
from spmd.search.regions import RegionCache, RegionPlan, search_region
from spmd.sharding import Spec, bytes_per_device, spread_bytes
from spmd.stages.plan import PipelinePlan, PipelinePrediction, StagePlan
from spmd.stages.price import UNBOUNDED, link_time
from spmd.stages.schedule import schedule
from spmd.stages.split import LayeredStep
from spmd.trace.graph import Graph, Scan, Value
from spmd.trace.regions import Region
from spmd.trace.signature import StepSignature

__all__ = ["check_runtime", "global_specs", "plan_stacked_pipeline"]


def global_specs(graph: Graph, stack: LayerStack, specs: Sequence[Spec],
                 stage_axis: str) -> list[Spec]:
    """Each leaf's spec on the whole mesh: a stacked leaf's layer dim over ``stage_axis``
    (and what the stage's spec put there, after it), the rest as on one stage."""
    stacked = stacked_leaves(graph, stack)
    out = []
    for i, spec in enumerate(specs):
        if i in stacked and spec:
            first = tuple(a for a in spec[0] if a != stage_axis)
            out.append(((stage_axis, *first), *spec[1:]))
        else:
            out.append(tuple(spec))
    return out


def plan_stacked_pipeline(full: StepSignature, micro: StepSignature, layered: LayeredStep,
                          stack: LayerStack, mesh: DeviceMesh, meshes: Sequence[DeviceMesh],
                          method: str, intra: str, specs: Sequence[Spec], *,
                          microbatches: int, options: SearchOptions,
                          cache: RegionCache | None = None) -> PipelinePlan:
    """The SPMD pipeline plan ``method`` (``intra`` inside each stage, whose leaves' specs on
    one stage are ``specs``; ``meshes``: the stages' devices). Every part of the step is
    planned, whatever ``options.compare`` says: the runtime lays each part out as its plan
    does, so the plan is always priced (module docstring)."""
    pipe = options.pipeline
    p, m, v = len(meshes), microbatches, pipe.repeats
    L, graph = stack.length, layered.graph
    step = StackedStep(graph, layered.phase, stack,
                       [i for i, leaf in enumerate(micro.leaves) if leaf.kind == "batch"])
    # Every step input is pinned: each part's search is timed as a scoring, and under no
    # budget of its own (a stack's region holds all its layers; the pipeline's memory is
    # judged as a whole, ``_predict``). One that finds nothing so soon gets the full time.
    scoring = dataclasses.replace(options, time_limit=options.scoring()[0],
                                  memory_budget=UNBOUNDED)
    whole_specs = global_specs(graph, stack, specs, pipe.stage_axis)

    def planned(region: Region, on: DeviceMesh, chosen: Sequence[Spec]) -> RegionPlan:
        inputs = [InputInfo(leaf.path, leaf.shape, leaf.dtype, leaf.kind, spec)
                  for leaf, spec in zip(micro.leaves, chosen)]
        try:
            return search_region(region, on, step_inputs=inputs,
                                 output_aliases=micro.output_aliases, options=scoring,
                                 cache=cache)
        except SolverTimeoutError:  # the scoring's short limit: once more with the full one
            return search_region(region, on, step_inputs=inputs,
                                 output_aliases=micro.output_aliases, cache=cache,
                                 options=dataclasses.replace(scoring,
                                                             time_limit=options.time_limit))

    regions = {"forward stack": Region(graph, stack.forward.nodes),
               "backward stack": Region(graph, stack.backward.nodes),
               **{k: r for k, r in step.parts.items() if k != "update"}}
    searched = {name: (region, planned(region, meshes[0], specs))
                for name, region in regions.items()}
    # the update on the whole mesh: the stacked state split over the stages
    update = planned(step.parts["update"], mesh, whole_specs) if (
        "update" in step.parts) else None
    layouts = {name: (_stack_layout(stack.forward if name.startswith("forward")
                                    else stack.backward, region, plan)
                      if name.endswith("stack") else RegionLayout(plan.program,
                                                                  plan.result.constraints))
               for name, (region, plan) in searched.items()}
    if update is not None:
        layouts["update"] = RegionLayout(update.program, update.result.constraints)
    chunk = L // (p * v)
    name = "circular" if v > 1 else "gpipe"
    plan = PipelinePlan(method, mesh, full.leaves, L,
                        [StagePlan(s * chunk, (s + 1) * chunk, sub, intra, list(specs))
                         for s, sub in enumerate(meshes)],
                        schedule("gpipe", p, m), None, full, micro, runtime="spmd", repeats=v,
                        why_runtime=(
                            f"SPMD ({name}): the step scans its {L} layers, so one program on "
                            f"the whole mesh runs them, {L // p} per stage over "
                            f"{pipe.stage_axis!r}"
                            + (f" in {v} chunks of {chunk} taken in turn" if v > 1 else "")
                            + ", microbatches moved by collective-permute; everything else "
                            "of the step runs on every stage (1F1B, holding fewer "
                            "microbatches, needs PipelineOptions(runtime='mpmd'))"),
                        specs=whole_specs, stage_axis=pipe.stage_axis, stacked=step,
                        layouts=layouts)
    link = mesh.link(pipe.stage_axis) if p > 1 else None
    plan.prediction = _predict(step, (m, p, v), searched, update, micro, meshes[0], mesh,
                               specs, whole_specs, link)
    budget = options.budget_for(mesh)
    if plan.prediction.memory_bytes > budget:  # every stage recomputes, as an expert turns
        plan.recompute = True                  # on remat where memory needs it
        plan.prediction = _predict(step, (m, p, v), searched, update, micro, meshes[0], mesh,
                                   specs, whole_specs, link, recompute=True)
    return plan


def _stack_layout(scan: Scan, region: Region, plan: RegionPlan) -> RegionLayout:
    """How ``plan`` (of the region holding just ``scan``) lays the stack out: its
    constraints, and the specs it gives the scan's operands and results."""
    given = dict(zip(region.inputs, plan.result.input_specs))
    made = dict(zip(region.outputs, plan.result.output_specs))
    return RegionLayout(plan.program, plan.result.constraints,
                        [given.get(v) if v is not None else None for v in scan.operands],
                        [made.get(v) if v is not None else None for v in scan.results])


def _predict(step: StackedStep, counts: tuple[int, int, int],
             searched: dict[str, tuple[Region, RegionPlan]], update: RegionPlan | None,
             micro: StepSignature, stage_mesh: DeviceMesh, mesh: DeviceMesh,
             specs: Sequence[Spec], whole_specs: Sequence[Spec], link: Link | None,
             recompute: bool = False) -> PipelinePrediction:
    """Time and memory of the SPMD pipeline (module docstring) with ``counts``: microbatches,
    stages and repeats, from each part's plan; ``recompute``: the backward loop runs each
    chunk's forward again, and the forward keeps only what entered each chunk."""
    graph, stack = step.graph, step.stack
    m, p, v = counts
    time = {k: plan.prediction.total_time for k, (_, plan) in searched.items()}
    if recompute:
        time["backward stack"] += time["forward stack"]

    def held(value: Value, region: Region, plan: RegionPlan, output: bool = True) -> int:
        values = region.outputs if output else region.inputs
        chosen = plan.result.output_specs if output else plan.result.input_specs
        spec = dict(zip(values, chosen)).get(value)
        shape = graph.value_shape(value)
        return bytes_per_device(shape, graph.value_dtype(value), spec or ((),) * len(shape),
                                stage_mesh.shape)

    def carry_bytes(name: str) -> int:
        """What each device sends of a stack's carries: its piece (``spread_bytes``)."""
        region, plan = searched[name]
        scan = stack.forward if name == "forward stack" else stack.backward
        made = dict(zip(region.outputs, plan.result.output_specs))
        return sum(spread_bytes(graph.value_shape(r), graph.value_dtype(r),
                                made.get(r) or ((),) * len(graph.value_shape(r)),
                                stage_mesh.shape)
                   for r in scan.results[:scan.eqn.params["num_carry"]] if r is not None)

    stacks = ("forward stack", "backward stack")
    loop_ticks = ticks(m, v, p)
    # each loop: a chunk of its stack per tick, then the carries one stage along; then its
    # results from the last stage of the flow to every stage
    loops = sum(loop_ticks * (time[k] / (p * v) + link_time(carry_bytes(k), link))
                + link_time(m * carry_bytes(k), link) for k in stacks)
    span = m * sum(time.get(k, 0.0) for k in ("before", "between", "after")) + loops
    bubble = (loop_ticks - m * v) * sum(time[k] for k in stacks) / (p * v)
    stacked = stacked_leaves(graph, stack)
    stacked_params = sum(bytes_per_device(leaf.shape, leaf.dtype, spec, mesh.shape)
                         for i, (leaf, spec) in enumerate(zip(micro.leaves, whole_specs))
                         if i in stacked and leaf.kind == "param")
    # circular: the stacked parameters copied into the circular layout, and their gradients
    # back, each device sending all but 1 / v of its share
    copy_time = 2 * link_time(stacked_params * (v - 1) / v, link) if v > 1 else 0.0
    relaid = 2 * stacked_params if v > 1 else 0.0
    # memory per device
    state = sum(bytes_per_device(leaf.shape, leaf.dtype, spec, mesh.shape)
                for leaf, spec in zip(micro.leaves, whole_specs) if leaf.kind != "batch")
    batch = m * sum(bytes_per_device(leaf.shape, leaf.dtype, spec, stage_mesh.shape)
                    for leaf, spec in zip(micro.leaves, specs) if leaf.kind == "batch")
    grads = sum(bytes_per_device(leaf.shape, leaf.dtype, spec, mesh.shape)
                for leaf, spec in zip(micro.leaves, whole_specs) if leaf.kind == "param")
    f_region, f_plan = searched["forward stack"]
    saved = set(searched["backward stack"][0].inputs)
    carries = set(stack.forward.results[:stack.forward.eqn.params["num_carry"]])
    residuals = m * sum(held(r, f_region, f_plan) for r in f_region.outputs
                        if r in saved and r not in carries) / p
    recomputed = 0.0
    if recompute:  # kept: what entered each chunk; made again: one chunk's saved values
        again = m * sum(held(r, f_region, f_plan) for r in f_region.outputs
                        if r in saved and r not in carries and step.recomputable(r)) / p
        entered = m * v * sum(held(r, f_region, f_plan) for r in carries if r is not None)
        residuals, recomputed = residuals - again + entered, again / (m * v)
    kept = sum(m * held(r, region, plan) for name, (region, plan) in searched.items()
               if not name.endswith("stack") for r in region.outputs
               if step.varies[r.node] and step.kept_per_microbatch(r))
    work = 0.0
    for name, (region, plan) in searched.items():  # a part's peak beyond what it reads
        beyond = plan.prediction.memory_bytes - sum(
            held(r, region, plan, output=False) for r in region.inputs)
        if name in stacks:  # a chunk at a time, each layer's results written in place into
            beyond -= sum(held(r, region, plan) for r in region.outputs)  # the loop's buffers
            beyond /= p * v
        work = max(work, beyond + (recomputed if name == "backward stack" else 0.0))
    update_time = update.prediction.total_time if update is not None else 0.0
    update_work = update.prediction.memory_bytes - state if update is not None else 0.0
    # the loops hold the saved values, the update (after them) its own working set
    memory = state + batch + grads + relaid + max(residuals + kept + work, update_work)
    comm = (m * sum(plan.prediction.comm_time for k, (_, plan) in searched.items()
                    if k not in stacks)
            + loop_ticks * sum(searched[k][1].prediction.comm_time for k in stacks) / (p * v))
    transfers = tuple((f"{k}'s carry", float(carry_bytes(k)), loop_ticks)
                      for k in stacks if p > 1)
    parts = tuple((k, t / (p * v) if k in stacks else t) for k, t in time.items())
    return PipelinePrediction(span, update_time, copy_time, bubble, memory, (memory,) * p,
                              comm, transfers, parts)


def check_runtime(layered: LayeredStep, stages: int, microbatches: int,
                  options: SearchOptions) -> LayerStack | None:
    """The layer stack the SPMD runtime pipelines, where ``options.pipeline.runtime`` asks
    for it (or ``auto`` finds a stack the stages share equally); None: the MPMD runtime."""
    pipe = options.pipeline
    if pipe.runtime == "mpmd":
        return None
    stack = find_stack(layered.graph, layered.phase)
    if stack is None:
        if pipe.runtime == "auto" and pipe.repeats == 1:
            return None
        raise PlanError("the SPMD pipeline runtime cannot run this step: it scans no layer "
                        "stack (nnx.scan or lax.scan over stacked parameters, read again by "
                        "its backward pass); use PipelineOptions(runtime='mpmd', repeats=1)")
    if stack.length % (stages * pipe.repeats) and pipe.runtime == "auto" and pipe.repeats == 1:
        return None  # stages the stack cannot be shared by: MPMD keeps it in one stage
    StackedStep.check_counts(stack.length, microbatches, stages, pipe.repeats)
    return stack
