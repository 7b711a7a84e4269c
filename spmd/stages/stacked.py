"""A hand-written pipeline plan run by the SPMD runtime (``spmd.runtime.stacked``): the
step's scanned layer stack shared equally by the stages of the mesh's ``stage`` axis, the
named intra-op plan inside each stage, everything else of the step on every stage.

The specs: a leaf with one entry per layer of the stack (a stacked parameter, its optimizer
moments) is split over the stage axis along its layer dim, and inside a stage as the
intra-op method puts it; every other leaf is as the method puts it on one stage, the same
on each (the embedding, the head and their optimizer state are replicated over the stages,
as MaxText has them).

The prediction prices each part of the step with the intra-op search on one stage's devices,
its inputs pinned to those specs (``spmd.search.regions.search_region``):

- the microbatch regions (before, between and after the stacks) once per microbatch;
- each stack's loop: ``m v + p - 1`` ticks, each one chunk (``L / (p v)`` layers) of the
  stack's time plus sending the carry to the next stage over the stage link;
- the update, on the whole mesh (the stacked state split over the stages);
- with ``v > 1``, the stacked parameters moved into the circular layout and their gradients
  back, each device sending all but a ``1 / v`` of its share (an all-to-all over the stage
  link).

Memory per device: the step inputs as held, the gradients of the stacked parameters summed
on their stage, what the stacks keep per microbatch for the backward stack (``m`` sets of
the stage's ``L / p`` layers), the microbatch regions' values kept per microbatch, and the
largest working peak of one region beyond what it reads.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from spmd.cluster.mesh import DeviceMesh
from spmd.errors import PlanError
from spmd.options import SearchOptions
from spmd.runtime.stacked import LayerStack, StackedPipeline, find_stack, stacked_leaves
from spmd.search.costgraph import InputInfo
from spmd.search.regions import RegionCache, RegionPlan, search_region
from spmd.sharding import Spec, bytes_per_device
from spmd.stages.plan import PipelinePlan, PipelinePrediction, StagePlan
from spmd.stages.price import link_time
from spmd.stages.schedule import schedule
from spmd.stages.split import LayeredStep
from spmd.trace.graph import Graph, Scan, Value
from spmd.trace.regions import Region
from spmd.trace.signature import StepSignature

__all__ = ["check_runtime", "global_specs", "plan_stacked_pipeline", "stack_of"]


def stack_of(layered: LayeredStep) -> LayerStack | None:
    """The step's scanned layer stack, if it has one (``find_stack``)."""
    return find_stack(layered.graph, layered.phase)


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
                          microbatches: int, options: SearchOptions, priced: bool,
                          cache: RegionCache | None = None) -> PipelinePlan:
    """The SPMD pipeline plan ``method`` (``intra`` inside each stage, whose leaves' specs on
    one stage are ``specs``), priced where ``priced`` (module docstring)."""
    pipe = options.pipeline
    p, m, v = len(meshes), microbatches, pipe.repeats
    L = stack.length
    batch = [i for i, leaf in enumerate(micro.leaves) if leaf.kind == "batch"]
    runtime = StackedPipeline(layered.graph, layered.phase, stack, microbatches=m, stages=p,
                              repeats=v, stage_axis=pipe.stage_axis, batch_inputs=batch)
    chunk = L // (p * v)
    scoring = dataclasses.replace(options, time_limit=options.scoring()[0])
    on_stage = [InputInfo(leaf.path, leaf.shape, leaf.dtype, leaf.kind, spec)
                for leaf, spec in zip(micro.leaves, specs)]
    graph = layered.graph
    regions = {"forward stack": Region(graph, stack.forward.nodes),
               "backward stack": Region(graph, stack.backward.nodes)}
    if priced:
        regions.update({k: r for k, r in runtime.parts.items() if k != "update"})
    searched = {name: (region, search_region(region, meshes[0], step_inputs=on_stage,
                                             output_aliases=micro.output_aliases,
                                             options=scoring, cache=cache))
                for name, region in regions.items()}
    stage_plans = [StagePlan(s * chunk, (s + 1) * chunk, sub, intra, list(specs))
                   for s, sub in enumerate(meshes)]
    name = "circular" if v > 1 else "gpipe"
    plan = PipelinePlan(method, mesh, full.leaves, L, stage_plans, schedule("gpipe", p, m),
                        None, full, micro, runtime="spmd", repeats=v,
                        why_runtime=(
                            f"SPMD ({name}): the step scans its {L} layers, so one program on "
                            f"the whole mesh runs them, {L // p} per stage over "
                            f"{pipe.stage_axis!r}"
                            + (f" in {v} chunks of {chunk} taken in turn" if v > 1 else "")
                            + ", microbatches moved by collective-permute; everything else "
                            "of the step runs on every stage"),
                        specs=global_specs(graph, stack, specs, pipe.stage_axis),
                        stage_axis=pipe.stage_axis,
                        stack_specs={
                            "forward": _scan_specs(stack.forward, *searched["forward stack"]),
                            "backward": _scan_specs(stack.backward,
                                                    *searched["backward stack"])})
    if priced:
        plan.prediction = _predict(runtime, searched, micro, meshes[0], mesh, specs,
                                   plan.specs, scoring, cache)
    return plan


def _scan_specs(scan: Scan, region: Region, plan: RegionPlan
                ) -> tuple[list[Spec | None], list[Spec | None]]:
    """The specs ``plan`` (of the region holding just ``scan``) gives the scan's operands
    and results."""
    given = dict(zip(region.inputs, plan.result.input_specs))
    made = dict(zip(region.outputs, plan.result.output_specs))
    return ([given.get(v) if v is not None else None for v in scan.operands],
            [made.get(v) if v is not None else None for v in scan.results])


def _predict(runtime: StackedPipeline, searched: dict[str, tuple[Region, RegionPlan]],
             micro: StepSignature, stage_mesh: DeviceMesh, mesh: DeviceMesh,
             specs: Sequence[Spec], whole_specs: Sequence[Spec], scoring: SearchOptions,
             cache: RegionCache | None) -> PipelinePrediction:
    graph, stack = runtime.graph, runtime.stack
    p, m, v = runtime.p, runtime.m, runtime.v
    aliases = micro.output_aliases

    def infos(chosen: Sequence[Spec]) -> list[InputInfo]:
        return [InputInfo(leaf.path, leaf.shape, leaf.dtype, leaf.kind, spec)
                for leaf, spec in zip(micro.leaves, chosen)]

    time = {k: plan.prediction.total_time for k, (_, plan) in searched.items()}
    link = mesh.link(scoring.pipeline.stage_axis) if p > 1 else None

    def held(v_: Value, region: Region, plan, output: bool = True) -> int:
        values = region.outputs if output else region.inputs
        chosen = plan.result.output_specs if output else plan.result.input_specs
        spec = dict(zip(values, chosen)).get(v_)
        shape = graph.value_shape(v_)
        return bytes_per_device(shape, graph.value_dtype(v_), spec or ((),) * len(shape),
                                stage_mesh.shape)

    def carry_bytes(name: str) -> int:
        region, plan = searched[name]
        scan = stack.forward if name == "forward stack" else stack.backward
        nc, nk = scan.eqn.params["num_consts"], scan.eqn.params["num_carry"]
        return sum(held(r, region, plan) for r in scan.results[:nk] if r is not None) if nk \
            else 0

    ticks = runtime.ticks
    loops = {}
    for name in ("forward stack", "backward stack"):
        loops[name] = ticks * (time[name] / (p * v) + link_time(carry_bytes(name), link))
    per_micro = sum(time.get(k, 0.0) for k in ("before", "between", "after"))
    span = m * per_micro + sum(loops.values())
    bubble = (ticks - m * v) * (time["forward stack"] + time["backward stack"]) / (p * v)
    update_time = 0.0
    update_peak = 0.0
    if "update" in runtime.parts:
        update = search_region(runtime.parts["update"], mesh, step_inputs=infos(whole_specs),
                               output_aliases=aliases, options=scoring, cache=cache)
        update_time = update.prediction.total_time
        update_peak = update.prediction.memory_bytes
    stacked = stacked_leaves(graph, stack)
    copy_time = 0.0
    if v > 1 and link is not None:  # the stacked parameters into the circular layout, and back
        moved = sum(bytes_per_device(leaf.shape, leaf.dtype, spec, mesh.shape)
                    for i, (leaf, spec) in enumerate(zip(micro.leaves, whole_specs))
                    if i in stacked and leaf.kind == "param") * (v - 1) / v
        copy_time = 2 * link_time(moved, link)
    # memory per device
    state = sum(bytes_per_device(leaf.shape, leaf.dtype, spec, mesh.shape)
                for leaf, spec in zip(micro.leaves, whole_specs) if leaf.kind != "batch")
    batch_bytes = m * sum(bytes_per_device(leaf.shape, leaf.dtype, spec, stage_mesh.shape)
                          for leaf, spec in zip(micro.leaves, specs) if leaf.kind == "batch")
    grads = sum(bytes_per_device(leaf.shape, leaf.dtype, spec, mesh.shape)
                for leaf, spec in zip(micro.leaves, whole_specs) if leaf.kind == "param")
    f_region, f_plan = searched["forward stack"]
    b_region, _ = searched["backward stack"]
    saved = set(b_region.inputs)
    residuals = m * sum(held(r, f_region, f_plan) for r in f_region.outputs
                        if r in saved and r not in stack.forward.results[
                            :stack.forward.eqn.params["num_carry"]]) / p
    kept = 0.0
    for name in ("before", "between", "after"):
        if name in searched:
            region, plan = searched[name]
            kept += m * sum(held(r, region, plan) for r in region.outputs
                            if runtime.varies[r.node] and runtime.kept_per_microbatch(r))
    work = 0.0
    for name, (region, plan) in searched.items():
        reads = sum(held(r, region, plan, output=False) for r in region.inputs)
        scale = 1.0 / (p * v) if name.endswith("stack") else 1.0
        work = max(work, max(plan.prediction.memory_bytes - reads, 0.0) * scale)
    import os
    if os.environ.get("SPMD_DEBUG"): print("PRED state", state/2**20, "batch", batch_bytes/2**20, "grads", grads/2**20, "res", residuals/2**20, "kept", kept/2**20, "work", work/2**20, "upd", (update_peak-state)/2**20)
    memory = state + batch_bytes + grads + residuals + kept + max(work, update_peak - state)
    comm = m * sum(searched[k][1].prediction.comm_time for k in searched
                   if not k.endswith("stack")) + ticks * sum(
        searched[k][1].prediction.comm_time / (p * v) for k in ("forward stack", "backward stack"))
    transfers = tuple((f"{name}'s carry", float(carry_bytes(name)), ticks)
                      for name in ("forward stack", "backward stack") if p > 1)
    return PipelinePrediction(span, update_time, copy_time, bubble, memory, (memory,) * p, comm,
                              transfers)


def check_runtime(layered: LayeredStep, stages: int, options: SearchOptions
                  ) -> LayerStack | None:
    """The layer stack the SPMD runtime pipelines, where ``options.pipeline.runtime`` asks
    for it (or ``auto`` finds a stack the stages share equally); None: the MPMD runtime."""
    pipe = options.pipeline
    if pipe.runtime == "mpmd":
        return None
    stack = stack_of(layered)
    share = stages * pipe.repeats
    if stack is not None and stack.length % share == 0:
        return stack
    if pipe.runtime == "auto" and pipe.repeats == 1:
        return None
    why = ("the step scans no layer stack (nnx.scan or lax.scan over stacked parameters, "
           "read again by its backward pass)" if stack is None else
           f"its scanned stack has {stack.length} layers, which {stages} stages x "
           f"{pipe.repeats} repeats cannot share equally")
    raise PlanError(f"the SPMD pipeline runtime cannot run this step: {why}; use "
                    f"PipelineOptions(runtime='mpmd', repeats=1) or another stage count")
