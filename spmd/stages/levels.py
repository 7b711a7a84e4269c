"""``method="auto"`` where pipelines can win: the single-stage plan, the stage search's and
the hand-written pipelines compared, the fastest returned, the others named among its
alternatives.

Which one won is recorded beside the plan cache (``spmd.cache``, under the same key: the
step, its inputs, the mesh, the options and spmd's own code), so that planning the same step
again makes that plan again without the searches that lost: a stage search of a large model
takes minutes, the winner's own planning seconds (the single-stage plan from its cache; a
pipeline's tasks searched around the specs recorded for each stage).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

from spmd import cache
from spmd.cluster.mesh import DeviceMesh
from spmd.errors import InfeasibleError, PlanError
from spmd.options import SearchOptions
from spmd.plan import Plan
from spmd.planner import plan_auto, step_inputs
from spmd.stages.auto import (considers_pipelines, hand_written_pipelines, plan_two_level,
                              replan_stages, stage_record)
from spmd.stages.manual import PIPELINE_METHODS, MicroSteps
from spmd.stages.plan import PipelinePlan
from spmd.timing import Stopwatch
from spmd.trace.signature import StepSignature

__all__ = ["RecordedPrediction", "plan_levels"]

#: the name of the alternative a single-stage plan keeps for the pipeline it beat, and a
#: pipeline plan for the single-stage plan
PIPELINE_ALTERNATIVE, SINGLE_ALTERNATIVE = "pipeline (auto)", "single stage (auto)"


@dataclasses.dataclass(frozen=True)
class RecordedPrediction:
    """An alternative's prediction as the record keeps it: its step time and peak memory."""

    total_time: float
    memory_bytes: float


def plan_levels(sig: StepSignature, args: Sequence[Any], mesh: DeviceMesh,
                options: SearchOptions, logical_axes: Any, timings: Stopwatch
                ) -> Plan | PipelinePlan:
    """Auto: the single-stage plan, and where pipelines can win (``considers_pipelines``)
    the best two-level one beside it, made again from the record where there is one."""
    if not considers_pipelines(mesh, options):
        return plan_auto(sig, mesh, options, timings)
    with timings.phase("cache"):
        path = cache.record_path(cache.cache_path(sig, step_inputs(sig, mesh, options), mesh,
                                                  options), "levels")
        record = cache.load_record(path)
    if record is not None:
        try:
            return _replay(record, path, sig, args, mesh, options, logical_axes, timings)
        except (ValueError, KeyError, TypeError, PlanError, InfeasibleError):
            pass  # a record this step no longer matches: plan afresh, and record that
    chosen = _compare_levels(sig, args, mesh, options, logical_axes, timings)
    cache.save_record(_record(chosen), path)
    return chosen


def _compare_levels(sig: StepSignature, args: Sequence[Any], mesh: DeviceMesh,
                    options: SearchOptions, logical_axes: Any,
                    timings: Stopwatch) -> Plan | PipelinePlan:
    """The faster of the single-stage plan and the best pipeline (the stage search's, or a
    hand-written one it missed); ``min_stages`` >= 2 leaves the single-stage plan out."""
    single, why_single = None, None
    if options.pipeline.min_stages < 2:
        try:
            single = plan_auto(sig, mesh, options, timings)
        except InfeasibleError as err:
            why_single = f"not a candidate: {err}"
    staged, why_staged = None, None
    micro_steps = MicroSteps(sig, args, logical_axes)  # one trace per microbatch count
    try:
        staged = plan_two_level(sig, args, mesh, options, logical_axes, timings, micro_steps)
    except (InfeasibleError, PlanError) as err:
        why_staged = f"not a candidate: {err}"
    with timings.phase("pipeline_baselines"):
        hand = hand_written_pipelines(sig, args, mesh, options, logical_axes, micro_steps)
    fitting = [p for p in hand.values() if not isinstance(p, str)]
    best_hand = min(fitting, key=lambda p: p.prediction.total_time, default=None)
    if best_hand is not None and (staged is None or best_hand.prediction.total_time
                                  < staged.prediction.total_time):
        # the stage search's simplifications (equal submeshes, each layer's own plan) can
        # miss a hand-written pipeline: never return a slower one
        kept = best_hand.method
        best_hand.search = {**(staged.search if staged is not None else {}),
                            "kept_hand_written": kept}
        best_hand.method = "auto"
        staged = best_hand
    if staged is None:
        if single is None:
            raise InfeasibleError(why_staged or "no pipeline plan fits")
        single.alternatives[PIPELINE_ALTERNATIVE] = why_staged
        return single
    staged.alternatives.update({name: p if isinstance(p, str) else p.prediction
                                for name, p in hand.items()})
    if single is not None and single.prediction.total_time <= staged.prediction.total_time:
        pred = staged.prediction
        found = staged.search_summary()
        single.alternatives[PIPELINE_ALTERNATIVE] = (
            f"slower: predicted {pred.total_time * 1e3:.3f} ms, "
            f"{pred.memory_bytes / 2**20:.2f} MiB, with {len(staged.stages)} stages and "
            f"{staged.microbatches} microbatches" + (f" ({found})" if found else ""))
        return single
    staged.alternatives[SINGLE_ALTERNATIVE] = (single.prediction if single is not None
                                               else why_single or "not considered "
                                               "(PipelineOptions.min_stages >= 2)")
    return staged


def _record(chosen: Plan | PipelinePlan) -> dict[str, Any]:
    """Which plan won, and what making it again takes (JSON-ready)."""
    if isinstance(chosen, Plan):
        return {"choice": "single", "pipeline": chosen.alternatives.get(PIPELINE_ALTERNATIVE)}
    kept = (chosen.search or {}).get("kept_hand_written")
    return {"choice": kept or "stage search", "search": chosen.search,
            "stages": None if kept else stage_record(chosen),
            "alternatives": {name: p if isinstance(p, str) else {
                "total_time": p.total_time, "memory_bytes": p.memory_bytes}
                for name, p in chosen.alternatives.items()}}


def _replay(record: Mapping[str, Any], path: Path, sig: StepSignature, args: Sequence[Any],
            mesh: DeviceMesh, options: SearchOptions, logical_axes: Any,
            timings: Stopwatch) -> Plan | PipelinePlan:
    """The plan ``record`` names, made again: the single-stage plan (from its own cache), the
    hand-written pipeline auto kept, or the stage search's stages searched around their
    recorded specs; the alternatives as recorded."""
    choice = record["choice"]
    if choice == "single":
        single = plan_auto(sig, mesh, options, timings)
        if record.get("pipeline") is not None:
            single.alternatives[PIPELINE_ALTERNATIVE] = record["pipeline"]
        return single
    with timings.phase("levels_replay"):
        if choice in PIPELINE_METHODS:
            made = hand_written_pipelines(sig, args, mesh, options, logical_axes,
                                          methods=(choice,)).get(choice)
            if not isinstance(made, PipelinePlan):
                raise ValueError(f"the recorded {choice} plan is no longer made: {made}")
            made.method = "auto"
        else:
            made = replan_stages(sig, args, mesh, options, record["stages"], logical_axes)
    made.search = {**(record.get("search") or {}), "cache": f"loaded {path}"}
    made.alternatives = {name: p if isinstance(p, str) else RecordedPrediction(**p)
                         for name, p in record["alternatives"].items()}
    return made
