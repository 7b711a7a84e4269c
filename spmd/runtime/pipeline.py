"""The MPMD pipeline runtime: one jitted program per task of a ``StageSplit`` (a stage's
forward, backward or update), each on its stage's own devices, driven from the host in a
``Schedule``'s order.

Why MPMD first: it runs any split (stages of unequal work, a tied embedding read by the
first and last stage) and any schedule, 1F1B included, on stock JAX; jax dispatches each
program asynchronously, so the host only orders the work and the stages' devices run side
by side. (An SPMD pipeline, stages stacked on a mesh axis inside one program, needs stages
of identical structure; MaxText's way, and the runtime for the multi-process case.)

Per step:

1. each stage gets the step inputs its tasks read: parameters and optimizer state from the
   stage that keeps them between steps (``home``: the one whose update makes their new
   value, else the first reader), copied to any other stage that reads them; each batch
   leaf is cut into ``microbatches`` equal slices along its first dimension;
2. the forward and backward tasks run per microbatch in the schedule's order, activations
   and gradients crossing stages by ``jax.device_put`` onto the reader's devices (same
   partition spec: the stages' submeshes have the same axis names). The accumulated values
   (``StageSplit.accumulated``: gradients, the loss) are summed inside the producing task's
   program from the second microbatch on; a value is dropped once its last reader ran;
3. the update tasks run once, reading the sums times ``1 / microbatches`` (the average,
   exact for a mean loss); the new state leaves in the input's spec on its home stage, so the
   next step takes it as it is.

Not done yet: donation of the old state's buffers (the update's inputs stay alive until it
returns), and more than one process (each process would drive the tasks of its own stages
and the transfers would become cross-process sends).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import jax
import numpy as np
from jax.extend.core import jaxpr_as_fun
from jax.sharding import NamedSharding, PartitionSpec

from spmd.cluster.mesh import DeviceMesh
from spmd.errors import PlanError
from spmd.runtime.constrain import constrained
from spmd.search.regions import RegionPlan
from spmd.sharding import Spec, to_partition_spec
from spmd.stages.schedule import Schedule
from spmd.stages.split import UPDATE, StageSplit, Task
from spmd.trace.graph import Value

if TYPE_CHECKING:
    from spmd.stages.plan import PipelinePlan

__all__ = ["Pipeline", "PipelineExecutable", "StagePlacement"]


@dataclasses.dataclass(frozen=True)
class StagePlacement:
    """A stage's devices and the spec on them of every step input leaf it may read."""

    mesh: DeviceMesh
    input_specs: Sequence[Spec]
    #: per phase, the intra-op plan the stage's task was priced with: its program runs
    #: under that plan's sharding constraints and returns its outputs in their specs
    plans: Mapping[str, RegionPlan] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Program:
    """One task made runnable: which of its region's inputs are step inputs (their leaf
    index), constants (baked in) or values of other tasks, and its jitted functions."""

    task: Task
    reads: list[Value]                # the region inputs it is called with, in order
    accumulates: list[int]            # positions in region.outputs that are accumulated
    first: Any                        # jitted: reads -> outputs
    then: Any = None                  # jitted: reads + sums -> outputs + new sums


class Pipeline:
    """A pipelined step: ``pipeline(leaves)`` takes the step's flat inputs at the whole
    batch and returns its flat outputs, as the step would."""

    def __init__(self, split: StageSplit, stages: Sequence[StagePlacement], sched: Schedule,
                 batch_inputs: Sequence[int], output_aliases: Mapping[int, int]):
        if len(stages) != split.num_stages or sched.stages != split.num_stages:
            raise PlanError(f"the split has {split.num_stages} stages, the placement "
                            f"{len(stages)} and the schedule {sched.stages}")
        self.split = split
        self.stages = list(stages)
        self.schedule = sched
        self.batch_inputs = set(batch_inputs)
        self.output_aliases = dict(output_aliases)
        self.meshes = [s.mesh.jax_mesh() for s in self.stages]
        self._devices = [frozenset(m.devices.flat) for m in self.meshes]
        graph = split.graph
        self._accumulated = set(split.accumulated)
        for v in split.accumulated:
            dtype = np.dtype(graph.value_dtype(v))
            if not np.issubdtype(dtype, np.inexact):
                raise PlanError(f"cannot pipeline the step: it makes {graph.nodes[v.node].key} "
                                f"({dtype}) once per microbatch for its update or its result, "
                                f"and only floating values can be averaged over microbatches")
        self.home = split.homes(self.output_aliases)
        self.programs = {(t.stage, t.phase): self._program(t) for t in split.tasks}
        #: the last call's copies between stages: (to stage, what, bytes per device), what
        #: being "activation" (a forward or backward value of a microbatch) or "state"
        self.transfers: list[tuple[int, str, int]] = []
        #: with ``measure`` on, the last call's most bytes per device each stage held in
        #: arrays between its programs (state, copies, activations, sums)
        self.measure = False
        self.held: list[int] = [0] * len(self.stages)
        #: per task: its jitted program and the arguments of the last call (``compiled``)
        self._last_args: dict[str, tuple[Any, list[Any]]] = {}
        #: per microbatch-phase value: how many of one microbatch's tasks read it
        self._readers: dict[Value, int] = {}
        for t in split.tasks:
            if t.phase != UPDATE:
                for v in self.programs[t.stage, t.phase].reads:
                    self._readers[v] = self._readers.get(v, 0) + 1

    def rescheduled(self, sched: Schedule) -> "Pipeline":
        """The same stages and programs in another schedule of as many microbatches (the
        programs, compiled once, are shared)."""
        if (sched.stages, sched.microbatches) != (self.schedule.stages,
                                                  self.schedule.microbatches):
            raise PlanError(f"schedule {sched.name!r} has {sched.stages} stages and "
                            f"{sched.microbatches} microbatches; this pipeline "
                            f"{self.schedule.stages} and {self.schedule.microbatches}")
        other = copy.copy(self)
        other.schedule = sched
        other._last_args = {}
        other.transfers = []
        return other

    # -- placement ---------------------------------------------------------------------------
    def _sharding(self, stage: int, leaf: int) -> NamedSharding:
        spec = self.stages[stage].input_specs[leaf]
        return NamedSharding(self.meshes[stage], to_partition_spec(spec))

    def _onto(self, x: Any, stage: int, sharding: NamedSharding | None = None,
              what: str = "state") -> Any:
        """``x`` on the stage's devices: as it is if already there, else copied with its
        partition spec (or ``sharding``); a copy between stages is counted in
        ``transfers``."""
        if sharding is None:
            if isinstance(x, jax.Array) and set(x.devices()) == self._devices[stage]:
                return x
            spec = x.sharding.spec if isinstance(getattr(x, "sharding", None),
                                                 NamedSharding) else PartitionSpec()
            sharding = NamedSharding(self.meshes[stage], spec)
        elif isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        moved = jax.device_put(x, sharding)
        if isinstance(x, jax.Array) and set(x.devices()) != self._devices[stage]:
            per_device = max(shard.data.nbytes for shard in moved.addressable_shards)
            self.transfers.append((stage, what, per_device))
        return moved

    def place(self, leaves: Sequence[Any]) -> list[Any]:
        """The state leaves on their home stages in their specs (batch leaves as given)."""
        return [x if i in self.batch_inputs else self._onto(x, self.home[i],
                                                             self._sharding(self.home[i], i))
                for i, x in enumerate(leaves)]

    # -- programs ----------------------------------------------------------------------------
    def _program(self, task: Task) -> _Program:
        graph, region = self.split.graph, task.region
        closed = region.program()
        plan = self.stages[task.stage].plans.get(task.phase)
        if plan is not None and (len(plan.program.jaxpr.eqns) != len(closed.jaxpr.eqns)
                                 or len(plan.inputs) != len(region.inputs)):
            raise PlanError(f"{task.name}: the plan given for it is of another region "
                            f"({len(plan.program.jaxpr.eqns)} equations, not "
                            f"{len(closed.jaxpr.eqns)})")
        run = (constrained(closed, plan.result.constraints, self.meshes[task.stage])
               if plan is not None and plan.result.constraints else jaxpr_as_fun(closed))
        reads = [v for v in region.inputs if graph.nodes[v.node].kind != "const"]
        constants = {k: np.asarray(graph.constants.get(v.node))
                     for k, v in enumerate(region.inputs) if graph.nodes[v.node].kind == "const"}
        missing = [region.inputs[k] for k, c in constants.items() if c.dtype == object]
        if missing:
            raise PlanError(f"{task.name}: the value of constant node {missing[0].node} is not "
                            f"known (a literal of a scan's body); this step cannot be split here")
        count = len(region.inputs)

        def call(*xs):
            given = iter(xs)
            return tuple(run(*[constants[k] if k in constants else next(given)
                               for k in range(count)]))

        scale = 1.0 / self.schedule.microbatches
        if task.phase == UPDATE:
            averaged = [k for k, v in enumerate(reads) if v in self._accumulated]

            def update(*xs):
                return call(*[x * scale if k in averaged else x for k, x in enumerate(xs)])

            return _Program(task, reads, [], jax.jit(update, in_shardings=self._in_shardings(
                task.stage, reads), out_shardings=self._out_shardings(task, plan)))
        accumulates = [k for k, v in enumerate(region.outputs) if v in self._accumulated]

        def then(*xs):
            outs = call(*xs[:len(reads)])
            sums = xs[len(reads):]
            return (*outs, *[s + outs[k] for s, k in zip(sums, accumulates)])

        shardings = self._in_shardings(task.stage, reads)
        outs = self._out_shardings(task, plan)
        return _Program(task, reads, accumulates,
                        jax.jit(call, in_shardings=shardings, out_shardings=outs),
                        jax.jit(then, in_shardings=shardings + (None,) * len(accumulates),
                                out_shardings=outs + tuple(outs[k] for k in accumulates)))

    def _in_shardings(self, stage: int, reads: Sequence[Value]) -> tuple:
        graph = self.split.graph
        return tuple(self._sharding(stage, graph.nodes[v.node].input_index)
                     if graph.nodes[v.node].kind == "input" else None for v in reads)

    def _out_shardings(self, task: Task, plan: RegionPlan | None) -> tuple:
        """A new state leaf leaves in its input's spec on its home stage; the rest in the
        spec the task's plan gives it, or as XLA chooses without one."""
        graph = self.split.graph
        aliased = {graph.outputs[o]: i for o, i in self.output_aliases.items()}
        mesh = self.meshes[task.stage]
        planned = plan.result.output_specs if plan is not None else [None] * len(
            task.region.outputs)
        return tuple(self._sharding(task.stage, aliased[v])
                     if v in aliased and self.home[aliased[v]] == task.stage
                     else None if spec is None else NamedSharding(mesh, to_partition_spec(spec))
                     for v, spec in zip(task.region.outputs, planned))

    def _held_bytes(self, arrays: Sequence[Any]) -> list[int]:
        """Per stage, the most bytes one of its devices holds of ``arrays`` (each once)."""
        per_device: dict[Any, int] = {}
        seen: set[int] = set()
        for x in arrays:
            if not isinstance(x, jax.Array) or id(x) in seen:
                continue
            seen.add(id(x))
            for shard in x.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
        return [max((per_device.get(d, 0) for d in devices), default=0)
                for devices in self._devices]

    def compiled(self) -> dict[str, Any]:
        """Each task's compiled program (the first microbatch's variant), for the shapes and
        shardings of the last call's arguments."""
        if not self._last_args:
            raise PlanError("the pipeline has not run yet: call the step once first")
        def abstract(x: Any) -> Any:
            return (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                    if isinstance(x, jax.Array) else x)

        return {name: fn.lower(*map(abstract, args)).compile()
                for name, (fn, args) in self._last_args.items()}

    # -- one step ------------------------------------------------------------------------------
    def _microbatches(self, leaves: Sequence[Any]) -> dict[int, list[Any]]:
        m = self.schedule.microbatches
        out = {}
        for i in self.batch_inputs:
            x = leaves[i]
            rows = np.shape(x)[0] if np.ndim(x) else 0
            if rows % m:
                raise PlanError(f"batch input {i} has {rows} rows, which {m} microbatches "
                                f"cannot split evenly; use a batch that is a multiple of {m}")
            size = rows // m
            out[i] = [x[j * size:(j + 1) * size] for j in range(m)]
        return out

    def __call__(self, leaves: Sequence[Any]) -> list[Any]:
        graph, split = self.split.graph, self.split
        leaves = self.place(leaves)
        slices = self._microbatches(leaves)
        copies: dict[tuple[int, int], Any] = {}  # (stage, leaf) -> the leaf on that stage

        def step_input(v: Value, stage: int, j: int) -> Any:
            i = graph.nodes[v.node].input_index
            if i in slices:
                return self._onto(slices[i][j], stage, self._sharding(stage, i))
            if (stage, i) not in copies:
                copies[stage, i] = self._onto(leaves[i], stage, self._sharding(stage, i))
            return copies[stage, i]

        self.transfers.clear()

        def moved(env: dict, v: Value, stage: int) -> Any:
            """A microbatch's value on ``stage``, copied there once however many of its
            tasks read it."""
            key = (v, stage)
            if key not in env:
                env[key] = self._onto(env[v], stage, what="activation")
            return env[key]

        envs: list[dict[Any, Any]] = [{} for _ in range(self.schedule.microbatches)]
        left: list[dict[Value, int]] = [dict(self._readers) for _ in envs]
        sums: dict[Value, Any] = {}
        self.held = [0] * len(self.stages)

        def measure(*pools) -> None:
            if self.measure:
                now = self._held_bytes([x for pool in pools for x in pool])
                self.held = [max(a, b) for a, b in zip(self.held, now)]

        for stage, j, phase in self.schedule.order:
            program = self.programs.get((stage, phase))
            if program is None:
                continue
            env = envs[j]
            args = [step_input(v, stage, j) if graph.nodes[v.node].kind == "input"
                    else moved(env, v, stage) for v in program.reads]
            region = program.task.region
            if j == 0 or not program.accumulates:
                self._last_args[program.task.name] = (program.first, args)
                outs = program.first(*args)
            else:
                outs = program.then(*args, *[sums[region.outputs[k]]
                                             for k in program.accumulates])
            produced = len(region.outputs)
            for k, v in enumerate(region.outputs):
                env[v] = outs[k]
            for n, k in enumerate(program.accumulates):
                sums[region.outputs[k]] = outs[k] if j == 0 else outs[produced + n]
            for v in program.reads:  # drop what no later task of this microbatch reads
                if v in left[j]:
                    left[j][v] -= 1
                    if left[j][v] == 0:
                        env.pop(v, None)
                        for s in range(len(self.stages)):
                            env.pop((v, s), None)
            for v in region.outputs:
                if v not in left[j] and v in env:  # read by no microbatch task at all
                    del env[v]
            measure(leaves, copies.values(), sums.values(), *(e.values() for e in envs))
        made: dict[Value, Any] = {}
        for t in split.tasks:  # the updates, from the last stage (their data flow)
            if t.phase != UPDATE:
                continue
            program = self.programs[t.stage, t.phase]
            args = [step_input(v, t.stage, 0) if graph.nodes[v.node].kind == "input"
                    else self._onto(sums[v] if v in sums else made[v], t.stage)
                    for v in program.reads]
            self._last_args[t.name] = (program.first, args)
            for v, x in zip(t.region.outputs, program.first(*args)):
                made[v] = x
            measure(leaves, copies.values(), sums.values(), made.values())
        scale = 1.0 / self.schedule.microbatches
        out = []
        for k, v in enumerate(graph.outputs):
            if v is None:
                out.append(graph.output_literals[k])
            elif v in made:
                out.append(made[v])
            elif v in sums:
                out.append(sums[v] * scale)
            elif graph.nodes[v.node].kind == "input":
                out.append(leaves[graph.nodes[v.node].input_index])
            else:
                out.append(graph.constants.get(v.node))
        return out


class PipelineExecutable:
    """A ``PipelinePlan`` made runnable, with the interface ``spmd.api`` calls a plan's
    executable through (``plan``, ``place``, calling it on flat leaves)."""

    def __init__(self, plan: "PipelinePlan"):
        if jax.process_count() > 1:
            raise PlanError(f"method {plan.method!r}: the MPMD pipeline runtime drives every "
                            f"stage from one process, and this run has {jax.process_count()}; "
                            f"run it in one process (a mesh without `distributed:`)")
        self.plan = plan
        leaves = plan.signature.leaves
        self.pipeline = Pipeline(
            plan.split, [StagePlacement(st.mesh, st.input_specs,
                                        st.cost.plans if st.cost is not None else {})
                         for st in plan.stages],
            plan.schedule, [i for i, leaf in enumerate(leaves) if leaf.kind == "batch"],
            plan.signature.output_aliases)

    def place(self, leaves: Sequence[Any]) -> list[Any]:
        return self.pipeline.place(leaves)

    def __call__(self, leaves: Sequence[Any]) -> list[Any]:
        return self.pipeline(leaves)

    def lower(self):
        raise PlanError(f"method {self.plan.method!r} runs one program per stage and phase "
                        f"({len(self.pipeline.programs)} of them), not one: there is no single "
                        f"program to lower; call the step, then .compiled() on its executable")

    compile = lower

    def compiled(self) -> dict[str, Any]:
        """Each task's compiled program, for the shapes of the last call (``Report`` them
        with ``spmd.analyze``)."""
        return self.pipeline.compiled()
