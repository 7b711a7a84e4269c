"""Hand-written pipeline plans, as an expert writes them with MaxText: stages along the
mesh's ``stage`` axis, equal shares of the layers per stage, a named intra-op plan inside
every stage, and twice as many microbatches as stages.

- ``pp_dp``: data parallel inside each stage (the batch over all of its devices);
- ``pp_tp``: the batch over ``data`` and Megatron over ``model`` inside each stage (the
  intra-op plan ``dp_tp``: on a ``stage x data x model`` mesh that is what "tensor
  parallel stages" means, not leaving ``data`` idle);
- ``pp_fsdp``: FSDP inside each stage.

"Equal layers" is the step's forward pass cut into as many ranges of balanced FLOPs as
there are stages (``spmd.trace.layers``): for a GPT, whole blocks, with the embedding and
the logits counted as the work they are. Where the plan is priced (``SearchOptions.compare``
or a ``memory_budget``), a stage whose microbatches in flight would not fit the device's
memory (or the budget) recomputes its forward values in its backward task, as an expert
turns on rematerialization where memory needs it; unpriced, no stage recomputes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax

from spmd.cluster.mesh import DeviceMesh, Link
from spmd.errors import PlanError, check_budget
from spmd.logical import user_pins
from spmd.manual import manual_specs
from spmd.options import SearchOptions
from spmd.search.costgraph import InputInfo
from spmd.search.regions import RegionCache
from spmd.stages.plan import PipelinePlan, StagePlan, predict
from spmd.stages.price import link_time, price_stage
from spmd.stages.schedule import schedule
from spmd.stages.stacked import check_runtime, plan_stacked_pipeline
from spmd.sharding import Spec, replicated, spread_bytes
from spmd.stages.split import UPDATE, LayeredStep, StageSplit
from spmd.trace.graph import Graph, build_graph
from spmd.trace.signature import Leaf, StepSignature

__all__ = ["PIPELINE_METHODS", "MicroSteps", "default_microbatches", "is_pipeline", "micro_signature",
           "plan_manual_pipeline", "shared_copy_time", "stage_meshes"]

#: pipeline method -> (the intra-op method inside each stage, what it is)
PIPELINE_METHODS: dict[str, tuple[str, str]] = {
    "pp_dp": ("dp", "pipeline stages over 'stage', data parallel inside each"),
    "pp_tp": ("dp_tp", "pipeline stages over 'stage', batch over 'data' and Megatron over "
                       "'model' inside each"),
    "pp_fsdp": ("fsdp", "pipeline stages over 'stage', FSDP inside each"),
}


def is_pipeline(method: str) -> bool:
    return method in PIPELINE_METHODS


def stage_meshes(mesh: DeviceMesh, axis: str) -> list[DeviceMesh]:
    """One submesh per index of ``axis``: the stages' devices."""
    if axis not in mesh.shape:
        raise PlanError(f"a pipeline plan puts its stages along mesh axis {axis!r}, and mesh "
                        f"{mesh.name!r} has axes {list(mesh.axis_names)}; use a mesh with a "
                        f"{axis!r} axis (e.g. cpu-pp) or PipelineOptions(stage_axis=...)")
    return [mesh.submesh({axis: 1}, offset={axis: s}) for s in range(mesh.shape[axis])]


def micro_signature(full: StepSignature, args: Sequence[Any], microbatches: int,
                    logical_axes: Any = None) -> StepSignature:
    """The step traced at one microbatch: every batch argument's leaves cut to
    ``1 / microbatches`` of their rows (abstract: nothing is computed)."""

    def cut(x: Any, where: str) -> jax.ShapeDtypeStruct:
        shape = jax.numpy.shape(x)
        rows = shape[0] if shape else 0
        if not shape or rows % microbatches:
            raise PlanError(f"batch input {where} has shape {tuple(shape)}: its {rows} rows "
                            f"cannot be cut into {microbatches} equal microbatches; use a batch "
                            f"that is a multiple of {microbatches} or other microbatches "
                            f"(PipelineOptions.microbatches)")
        return jax.ShapeDtypeStruct((shape[0] // microbatches, *shape[1:]),
                                    jax.numpy.result_type(x))

    micro_args = [jax.tree_util.tree_map_with_path(
        lambda path, x: cut(x, jax.tree_util.keystr(path) or f"argument {i}"), a)
        if i in full.batch_argnums else a for i, a in enumerate(args)]
    return StepSignature(full.step_fn, micro_args, logical_axes=logical_axes,
                         batch_argnums=tuple(full.batch_argnums))


class MicroSteps:
    """The step traced at one microbatch and its op graph, once per microbatch count:
    auto's stage search and the hand-written pipelines it compares itself with plan the
    same step at the same counts (each trace of a large model takes seconds)."""

    def __init__(self, full: StepSignature, args: Sequence[Any], logical_axes: Any = None):
        self.full, self.args, self.logical_axes = full, args, logical_axes
        self._made: dict[int, tuple[StepSignature, Graph]] = {}

    def get(self, microbatches: int) -> tuple[StepSignature, Graph]:
        if microbatches not in self._made:
            micro = micro_signature(self.full, self.args, microbatches, self.logical_axes)
            self._made[microbatches] = (micro, build_graph(micro.jaxpr))
        return self._made[microbatches]


def default_microbatches(full: StepSignature, mesh: DeviceMesh, intra: str, stages: int,
                         options: SearchOptions) -> int:
    """Twice the stages (MaxText's advice), or the most microbatches below that which cut
    the batch into equal microbatches the stage's plan can split (1 if none does: the
    error then comes from the plan itself)."""
    batch = [leaf for leaf in full.leaves if leaf.kind == "batch" and leaf.shape]
    if not batch:
        return 2 * stages
    pins = user_pins(full.leaves, options.logical_rules(), mesh)
    try:
        specs = manual_specs(full.leaves, intra, mesh, pins)
    except PlanError:
        return 2 * stages
    split = max(mesh.axis_size(specs[full.leaves.index(leaf)][0]) for leaf in batch)
    rows = min(leaf.shape[0] for leaf in batch)
    for m in range(2 * stages, 0, -1):
        if rows % m == 0 and (rows // m) % split == 0:
            return m
    return 1


def plan_manual_pipeline(full: StepSignature, args: Sequence[Any], mesh: DeviceMesh,
                         method: str, options: SearchOptions = SearchOptions(),
                         logical_axes: Any = None, cache: RegionCache | None = None,
                         micro_steps: MicroSteps | None = None) -> PipelinePlan:
    """The hand-written pipeline plan ``method`` for the step ``full`` (traced at the
    whole batch from ``args``), priced stage by stage where ``options.compare`` or a
    ``memory_budget`` asks (as ``spmd.api.plan_manual`` scores a plan). ``micro_steps``:
    traces already made of this step (else made here)."""
    if method not in PIPELINE_METHODS:
        raise PlanError(f"unknown pipeline method {method!r}; valid: "
                        f"{', '.join(PIPELINE_METHODS)}")
    pipe = options.pipeline
    meshes = stage_meshes(mesh, pipe.stage_axis)
    p = len(meshes)
    intra = PIPELINE_METHODS[method][0]
    m = pipe.microbatches or default_microbatches(full, meshes[0], intra, p, options)
    micro_steps = micro_steps if micro_steps is not None else MicroSteps(full, args,
                                                                         logical_axes)
    micro, graph = micro_steps.get(m)
    layers = pipe.layers or p
    if layers < p:
        raise PlanError(f"PipelineOptions.layers={layers} is fewer than the {p} stages of "
                        f"mesh axis {pipe.stage_axis!r}")
    layered = LayeredStep(micro.jaxpr, layers, graph)
    starts = [s * layers // p for s in range(p)]
    pins = user_pins(micro.leaves, options.logical_rules(), meshes[0])
    try:
        specs = manual_specs(micro.leaves, intra, meshes[0], pins)
    except PlanError as err:
        raise PlanError(f"{err} (method {method!r} runs {intra!r} inside each stage on "
                        f"microbatches of 1/{m} of the batch; PipelineOptions.microbatches "
                        f"sets how many)") from None
    cache = cache if cache is not None else RegionCache()
    priced = options.compare or options.memory_budget is not None  # as plan_manual scores
    stack = check_runtime(layered, p, m, options)
    if stack is not None:
        plan = plan_stacked_pipeline(full, micro, layered, stack, mesh, meshes, method, intra,
                                     specs, microbatches=m, options=options, cache=cache)
        _check_budget(plan, options)
        return plan
    inputs = [InputInfo(leaf.path, leaf.shape, leaf.dtype, leaf.kind, spec)
              for leaf, spec in zip(micro.leaves, specs)]
    # every step input is pinned: each stage's search is a scoring, and is timed like one
    scoring = dataclasses.replace(options, time_limit=options.scoring()[0])
    link = mesh.link(pipe.stage_axis) if p > 1 else None
    bounds = starts + [layers]
    budget = options.budget_for(mesh)
    sched = schedule(pipe.schedule, p, m)
    stages = []
    for s, sub in enumerate(meshes):
        cost = None
        for recompute in (False, True) if priced else ():
            cost = price_stage(layered, bounds[s], bounds[s + 1], sub, step_inputs=inputs,
                               output_aliases=micro.output_aliases, send_link=link,
                               options=scoring, cache=cache, recompute=recompute)
            if cost.memory(sched.in_flight(s)) <= budget:
                break
        stages.append(StagePlan(bounds[s], bounds[s + 1], sub, intra, list(specs), cost))
    split = layered.split(starts, [st.cost is not None and st.cost.recompute for st in stages])
    plan = PipelinePlan(method, mesh, full.leaves, layers, stages, sched, split, full, micro)
    if priced:
        copies = shared_copy_time(split, micro.leaves, specs, meshes[0], link)
        plan.prediction = predict([st.cost for st in stages], sched, copy_time=copies)
        _check_budget(plan, options)
    return plan


def _check_budget(plan: PipelinePlan, options: SearchOptions) -> None:
    """A priced plan over ``options.memory_budget`` is an error that says by how much."""
    check_budget(plan.method, plan.prediction.memory_bytes, options.memory_budget,
                 "pick another method, more stages or "
                 + ("repeats, or PipelineOptions(runtime='mpmd') for 1F1B (fewer microbatches "
                    "held)" if plan.runtime == "spmd" else "more microbatches"),
                 where="per device on its fullest stage")


def shared_copy_time(split: StageSplit, leaves: Sequence[Leaf], specs: Sequence[Spec],
                     mesh: DeviceMesh, link: Link | None) -> float:
    """Seconds per step copying between stages what is not a microbatch's: the state that
    more than one stage reads (a tied embedding) from the stage keeping it to each other
    reader, and the sums one stage accumulates for another's update (the tied embedding's
    gradient from the last stage), at the stage link, each device sending a part
    (``spmd.sharding.spread``; ``specs``: the leaves' specs on a stage's ``mesh``)."""
    if link is None:
        return 0.0
    graph = split.graph
    readers: dict[int, set[int]] = {}
    for t in split.tasks:
        for v in t.region.inputs:
            node = graph.nodes[v.node]
            if node.kind == "input" and leaves[node.input_index].kind != "batch":
                readers.setdefault(node.input_index, set()).add(t.stage)
    copies = [((len(stages) - 1), leaves[i].shape, leaves[i].dtype, specs[i])
              for i, stages in readers.items() if len(stages) > 1]
    accumulated = set(split.accumulated)
    for t in split.tasks:
        if t.phase == UPDATE:
            copies += [(1, graph.value_shape(v), graph.value_dtype(v), replicated(
                len(graph.value_shape(v)))) for v in t.region.inputs
                if v in accumulated and split.stage_of[v.node] != t.stage]
    return sum(count * link_time(spread_bytes(shape, dtype, spec, mesh.shape), link)
               for count, shape, dtype, spec in copies)
