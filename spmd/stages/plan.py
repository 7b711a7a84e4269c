"""A pipeline plan: the step's layers cut into stages, each on its own submesh with its own
intra-op plan, the microbatches and the schedule, and what the cost model predicts for it.

The step time is the schedule's span (``Schedule.timeline`` with each stage's forward and
backward time per microbatch, its sends included), then the updates (each stage updates
its own state, all stages at once: the slowest one counts), plus copying the step inputs
that more than one stage reads (a tied embedding) to the stages that do not keep them.
The bubble is the span less the busiest stage's own work. A stage's memory is its
``StageCost.memory`` with the schedule's most microbatches in flight on it.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any, Sequence

from spmd.cluster.mesh import DeviceMesh
from spmd.sharding import Spec, spec_to_json, to_partition_spec
from spmd.stages.price import StageCost
from spmd.stages.schedule import Schedule, bubble_formula
from spmd.stages.split import StageSplit
from spmd.trace.signature import Leaf, StepSignature

__all__ = ["PipelinePlan", "PipelinePrediction", "StagePlan", "predict"]


@dataclasses.dataclass
class StagePlan:
    """One stage: its layers ``[start, stop)``, its devices, the intra-op plan inside it (a
    hand-written method's name, or ``auto``), every step input's spec there, its cost."""

    start: int
    stop: int
    mesh: DeviceMesh
    method: str
    input_specs: list[Spec]
    cost: StageCost | None = None


@dataclasses.dataclass(frozen=True)
class PipelinePrediction:
    """The cost model's view of a pipelined step (seconds; bytes per device)."""

    span: float                  # the schedule's forward and backward work, bubbles included
    update_time: float           # the slowest stage's update
    copy_time: float             # step inputs copied to the stages that do not keep them
    bubble_time: float           # the span less the busiest stage's own work
    memory_bytes: float          # the most any stage's device needs
    stage_memory: tuple[float, ...]
    comm_time: float             # the stages' collectives and sends on the busiest stage
    #: the SPMD runtime's moves between stages: (what moves, bytes each device sends each
    #: time, times per step); one collective-permute each
    transfers: tuple[tuple[str, float, int], ...] = ()
    #: the SPMD runtime's parts: seconds of each (per microbatch; a stack's: per chunk)
    parts: tuple[tuple[str, float], ...] = ()

    @property
    def total_time(self) -> float:
        return self.span + self.update_time + self.copy_time

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_time / self.span if self.span > 0 else 0.0


def predict(costs: Sequence[StageCost], sched: Schedule, copy_time: float = 0.0
            ) -> PipelinePrediction:
    """What ``costs`` (one per stage) come to under ``sched``."""
    forward = [c.forward for c in costs]
    backward = [c.backward for c in costs]
    times = sched.timeline(forward, backward)
    span = max(end for _, end in times.values())
    work = [sched.microbatches * (f + b) for f, b in zip(forward, backward)]
    busiest = max(range(len(costs)), key=lambda s: work[s])
    memory = tuple(c.memory(sched.in_flight(s)) for s, c in enumerate(costs))
    comm = sched.microbatches * costs[busiest].comm
    return PipelinePrediction(span, max(c.update for c in costs), copy_time,
                              span - work[busiest], max(memory), memory, comm)


@dataclasses.dataclass
class PipelinePlan:
    """A pipelined step on ``mesh``: ``stages`` over the layers of ``split``, ``microbatches``
    per step in ``schedule``'s order, run by the MPMD runtime (``spmd.runtime.pipeline``);
    or (``runtime == "spmd"``) over the layers of the step's scanned stack, ``repeats``
    chunks per stage, run as one program (``spmd.runtime.stacked``) with every leaf in its
    spec on the whole mesh (``specs``), and no ``split``.

    ``signature`` is the step at its whole batch (what the user calls), ``micro`` the step
    at one microbatch (what the stages run).
    """

    method: str
    mesh: DeviceMesh
    leaves: list[Leaf]
    num_layers: int
    stages: list[StagePlan]
    schedule: Schedule
    split: StageSplit | None
    signature: StepSignature = dataclasses.field(repr=False)
    micro: StepSignature = dataclasses.field(repr=False)
    prediction: PipelinePrediction | None = None
    runtime: str = "mpmd"
    why_runtime: str = ("MPMD: one program per stage and phase, driven from the host, runs "
                        "stages of any structure and the 1F1B schedule, in one process or "
                        "across several")
    alternatives: dict[str, Any] = dataclasses.field(default_factory=dict)
    search: dict | None = None
    repeats: int = 1
    specs: list[Spec] | None = None
    stage_axis: str = "stage"
    #: the SPMD runtime's step around its layer stack (``spmd.stages.stack.StackedStep``)
    #: and its parts, each as its intra-op plan lays it out (``RegionLayout``)
    stacked: Any = dataclasses.field(default=None, repr=False)
    layouts: dict[str, Any] | None = None
    #: SPMD runtime: every stage recomputes its chunks' forward in the backward loop
    recompute: bool = False

    @property
    def microbatches(self) -> int:
        return self.schedule.microbatches

    def bound_signature(self) -> StepSignature:
        return self.signature

    def homes(self) -> list[int]:
        """The stage keeping each step input between steps (``StageSplit.homes``)."""
        return self.split.homes(self.signature.output_aliases)

    def input_shardings_flat(self) -> list:
        """Each input leaf's sharding on the stage that keeps it: where ``materialize``
        builds the state and ``shard_batch`` puts the batch."""
        from jax.sharding import NamedSharding

        if self.runtime == "spmd":
            whole = self.mesh.sharding_mesh()
            return [NamedSharding(whole, to_partition_spec(spec)) for spec in self.specs]
        return [NamedSharding(self.stages[h].mesh.sharding_mesh(),
                              to_partition_spec(self.stages[h].input_specs[i]))
                for i, h in enumerate(self.homes())]

    def output_shardings_flat(self) -> list:
        """Per flat output of the SPMD runtime's one program: the new value of an input in
        that input's sharding (the state stays where it is), anything else left to XLA."""
        aliased = self.signature.output_aliases
        inputs = self.input_shardings_flat()
        return [inputs[aliased[o]] if o in aliased else None
                for o in range(len(self.signature.out_avals))]

    def to_dict(self) -> dict:
        """A record of the plan (JSON-ready): its stages, their devices and every input's
        spec there, the schedule and the prediction. It is not loaded back: a pipeline is
        planned again from its step (``spmd.plan`` with the same method and options)."""
        pred = self.prediction
        return {
            "kind": "pipeline", "method": self.method, "runtime": self.runtime,
            "mesh": {"name": self.mesh.name, "shape": self.mesh.shape,
                     "device": self.mesh.device.name},
            "layers": self.num_layers, "microbatches": self.microbatches,
            "schedule": self.schedule_name, "repeats": self.repeats,
            **({"specs": {leaf.path: spec_to_json(spec)
                          for leaf, spec in zip(self.leaves, self.specs)}}
               if self.specs is not None else {}),
            "stages": [{"layers": self.stage_layers(s), "devices": list(st.mesh.device_ids or ()),
                        "shape": st.mesh.shape, "method": st.method,
                        "specs": {leaf.path: spec_to_json(spec)
                                  for leaf, spec in zip(self.leaves, st.input_specs)},
                        "cost": None if st.cost is None else {
                            f.name: getattr(st.cost, f.name)
                            for f in dataclasses.fields(st.cost)
                            if f.name not in ("plans", "received")}}
                       for s, st in enumerate(self.stages)],
            "prediction": None if pred is None else {
                **dataclasses.asdict(pred), "total_time": pred.total_time,
                "bubble_fraction": pred.bubble_fraction},
            "alternatives": {k: v if isinstance(v, str) else {"total_time": v.total_time,
                                                              "memory_bytes": v.memory_bytes}
                             for k, v in self.alternatives.items()},
            "search": self.search,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, default=str))

    def describe(self) -> str:
        """Stages (layers, devices, intra-op plan, time and memory), microbatches, schedule,
        bubble predicted beside the formula's, and the alternatives."""
        out = io.StringIO()
        p, m = len(self.stages), self.microbatches
        out.write(f"pipeline plan: method={self.method}  {self.mesh.describe()}\n")
        over = "layers of the scanned stack" if self.runtime == "spmd" else "layers"
        out.write(f"{p} stages over {self.num_layers} {over}, {m} microbatches of "
                  f"{self._micro_rows()} rows, schedule {self.schedule_name}; runtime "
                  f"{self.why_runtime}\n")
        out.write(f"{'stage':>5}  {'layers':>7}  {'devices':<28} {'plan':<8} "
                  f"{'fwd ms':>8} {'bwd ms':>8} {'update ms':>9} {'held':>4} {'GiB':>7} "
                  f"{'sent MB':>8}  recompute\n")
        for s, st in enumerate(self.stages):
            if self.runtime == "spmd":  # the stages run alike: the same times and memory
                out.write(self._stacked_row(st, s))
                continue
            c = st.cost
            cells = (f"{c.forward * 1e3:8.3f} {c.backward * 1e3:8.3f} {c.update * 1e3:9.3f} "
                     f"{self.schedule.in_flight(s):4d} "
                     f"{c.memory(self.schedule.in_flight(s)) / 2**30:7.3f} "
                     f"{c.sent / 1e6:8.2f}  {'yes' if c.recompute else 'no'}"
                     ) if c is not None else "(not priced)"
            out.write(f"{s:5d}  {st.start:>3}-{st.stop - 1:<3}  {_devices(st.mesh):<28} "
                      f"{st.method:<8} {cells}\n")
        if self.runtime == "spmd":
            out.write(self._stacked_parts())
            if self.recompute:
                out.write("recompute: each stage keeps of each microbatch only what entered "
                          "its chunks, and runs a chunk's forward again before its backward "
                          "(it would not fit its memory otherwise)\n")
        if any(st.cost is not None and st.cost.recompute for st in self.stages):
            out.write("recompute: the stage keeps of each microbatch only what other stages "
                      "sent it, and its backward task runs its forward ops again (it would "
                      "not fit its memory otherwise)\n")
        pred = self.prediction
        if pred is not None:
            formula = ("(p-1)/(v m+p-1)" if self.repeats > 1 else "(p-1)/(m+p-1)")
            out.write(f"predicted step {pred.total_time * 1e3:.3f} ms: schedule "
                      f"{pred.span * 1e3:.3f} ms (bubble {pred.bubble_fraction:.1%}; "
                      f"{formula} = {bubble_formula(p, m * self.repeats):.1%}), update "
                      f"{pred.update_time * 1e3:.3f} ms, copies {pred.copy_time * 1e3:.3f} ms; "
                      f"peak memory {pred.memory_bytes / 2**30:.3f} GiB per device\n")
        found = self.search_summary()
        if found:
            out.write(f"{found}\n")
        for name, other in self.alternatives.items():
            if isinstance(other, str):
                out.write(f"  {name}: {other}\n")
            else:
                out.write(f"  {name}: predicted {other.total_time * 1e3:.3f} ms, "
                          f"{other.memory_bytes / 2**30:.3f} GiB per device\n")
        return out.getvalue()

    @property
    def schedule_name(self) -> str:
        """The schedule the runtime runs: the SPMD runtime's is GPipe, or circular."""
        if self.runtime != "spmd":
            return self.schedule.name
        return f"circular ({self.repeats} repeats)" if self.repeats > 1 else "gpipe"

    def stage_layers(self, s: int) -> list[tuple[int, int]]:
        """Stage ``s``'s layer ranges ``[start, stop)``: one, or with the SPMD runtime's
        ``repeats`` one per chunk (every ``stages`` chunks)."""
        st, p = self.stages[s], len(self.stages)
        width = st.stop - st.start
        return [(st.start + r * p * width, st.stop + r * p * width)
                for r in range(self.repeats)]

    def _stacked_row(self, st: StagePlan, s: int) -> str:
        """A stage of the SPMD runtime: the stack's layers it runs, its devices, its plan,
        a chunk's forward and backward time per microbatch, the update, the memory (every
        stage alike), and what it sends per tick."""
        chunks = ", ".join(f"{a}-{b - 1}" for a, b in self.stage_layers(s))
        row = f"{s:5d}  {chunks:>7}  {_devices(st.mesh):<28} {st.method:<8}"
        pred = self.prediction
        if pred is None:
            return row + "\n"
        part = dict(pred.parts)
        sent = sum(nbytes for _, nbytes, _ in pred.transfers)
        return (f"{row} {part.get('forward stack', 0.0) * 1e3:8.3f} "
                f"{part.get('backward stack', 0.0) * 1e3:8.3f} {pred.update_time * 1e3:9.3f} "
                f"{self.microbatches:4d} {pred.stage_memory[s] / 2**30:7.3f} "
                f"{sent / 1e6:8.2f}  {'yes' if self.recompute else 'no'}\n")

    def _stacked_parts(self) -> str:
        """The SPMD runtime's work outside the stack, per microbatch, on every stage."""
        part = dict(self.prediction.parts) if self.prediction is not None else {}
        outside = [f"{name} {part[name] * 1e3:.3f} ms" for name in ("before", "between", "after")
                   if name in part]
        return ("outside the stack, per microbatch on every stage: " + ", ".join(outside)
                + "\n") if outside else ""

    def search_summary(self) -> str:
        """How the stage search went, in a line ("" for a plan not searched)."""
        found = self.search or {}
        if "region_searches" not in found:
            return ""
        seconds = sum(t for k, t in found.get("timings", {}).items() if k.startswith("stage_"))
        loaded = f"; this plan made again from its record, {found['cache']}" if (
            "cache" in found) else ""
        return (f"stage search: {found['candidates']} (stages, microbatches) candidates over "
                f"{', '.join(map(str, found['stage_counts']))} stages, "
                f"{found['region_searches']} intra-op solves "
                f"({found['region_cache_hits']} answered by the cache), {seconds:.1f} s"
                + loaded)

    def _micro_rows(self) -> str:
        rows = {leaf.shape[0] for leaf in self.micro.leaves if leaf.kind == "batch" and leaf.shape}
        return ", ".join(str(r) for r in sorted(rows)) or "?"


def _devices(mesh: DeviceMesh) -> str:
    """A stage's devices in a few characters: ``4 (4-7) data=2 model=2``."""
    ids = mesh.device_ids or tuple(range(mesh.size))
    span = (f"{ids[0]}-{ids[-1]}" if list(ids) == list(range(ids[0], ids[-1] + 1))
            else ",".join(map(str, ids[:4])) + ("..." if len(ids) > 4 else ""))
    shape = " ".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1)
    return f"{mesh.size} ({span}) {shape}"[:28]
