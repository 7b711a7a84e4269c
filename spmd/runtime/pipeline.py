"""The MPMD pipeline runtime: one jitted program per task of a ``StageSplit`` (a stage's
forward, backward or update), each on its stage's own devices, driven from the host in a
``Schedule``'s order.

Why MPMD first: it runs any split (stages of unequal work, a tied embedding read by the
first and last stage) and any schedule, 1F1B included, on stock JAX; jax dispatches each
program asynchronously, so the host only orders the work and the stages' devices run side
by side. (An SPMD pipeline, stages stacked on a mesh axis inside one program, needs stages
of identical structure; MaxText's way.)

Per step:

1. each stage gets the step inputs its tasks read: parameters and optimizer state from the
   stage that keeps them between steps (``home``: the one whose update makes their new
   value, else the first reader), copied to any other stage that reads them; each batch
   leaf is cut into ``microbatches`` equal slices along its first dimension;
2. the forward and backward tasks run per microbatch in the schedule's order, activations
   and gradients crossing stages onto the reader's devices in the same partition spec (the
   stages' submeshes have the same axis names): by ``jax.device_put`` in one process, by a
   collective-permute program (``spmd.runtime.transfer``) across processes. The accumulated
   values (``StageSplit.accumulated``: gradients, the loss) are summed inside the producing
   task's program from the second microbatch on; a value is dropped once its last reader
   ran;
3. the update tasks run once, reading the sums times ``1 / microbatches`` (the average,
   exact for a mean loss); the new state leaves in the input's spec on its home stage, so the
   next step takes it as it is.

Several processes (a stage's devices on one host, as ``meshes/cpu-2x4-pp.yaml`` has it):
every process walks the same schedule, runs the tasks of the stages it holds devices of, and
takes part in each copy to or from them at the same point, so the collectives pair up. A
process sees another process's state as arrays with no shard here (``absent``); the loss
and the other results are copied to every stage, so every process can read them.

With ``donate`` (an NNX step's default, as for one program: spmd writes the new state
back), each update program is given the buffers of the old state it replaces, so the
stage does not hold the old and the new state at once; a leaf another stage's update also
reads is not donated.
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
from spmd.runtime.compile import donates
from spmd.runtime.constrain import constrained
from spmd.runtime.transfer import StageLinks, absent, abstract, holds
from spmd.search.regions import RegionPlan
from spmd.sharding import Spec, from_partition_spec, spread, to_partition_spec
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
    out_shardings: tuple              # of the outputs (None: as XLA chooses)
    then: Any = None                  # jitted: reads + sums -> outputs + new sums


class Pipeline:
    """A pipelined step: ``pipeline(leaves)`` takes the step's flat inputs at the whole
    batch and returns its flat outputs, as the step would."""

    def __init__(self, split: StageSplit, stages: Sequence[StagePlacement], sched: Schedule,
                 batch_inputs: Sequence[int], output_aliases: Mapping[int, int],
                 collective: bool = False, donate: bool = False):
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
        #: per stage, whether this process holds any of its devices (runs its tasks)
        self._runs = [holds(NamedSharding(m, PartitionSpec())) for m in self.meshes]
        #: copies between stages by collective-permute programs (``StageLinks``), not
        #: ``jax.device_put``: needed across processes, and on request in one
        self.collective = collective or jax.process_count() > 1
        self.donate = donate
        self.links = StageLinks(self.meshes)
        self._splitters: dict[tuple, Any] = {}
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
        #: per value a task makes: the stage it is made on and the spec its program gives it
        #: (None: as XLA chooses)
        self._made_on: dict[Value, int] = {}
        self._out_spec: dict[Value, PartitionSpec | None] = {}
        for (stage, _), program in self.programs.items():
            for v, sharding in zip(program.task.region.outputs, program.out_shardings):
                self._made_on[v] = stage
                self._out_spec[v] = None if sharding is None else sharding.spec
        #: the last call's copies between stages: (to stage, what, bytes per device), what
        #: being "activation" (a forward or backward value of a microbatch) or "state"
        self.transfers: list[tuple[int, str, int]] = []
        #: with ``measure`` on, the last call's most bytes per device each stage held in
        #: arrays between its programs (state, copies, activations, sums)
        self.measure = False
        self.held: list[int] = [0] * len(self.stages)
        #: per task: its jitted program and the last call's arguments, abstract (``compiled``)
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

    def _put(self, x: Any, stage: int, sharding: NamedSharding) -> Any:
        """``x`` (a host value, or an array on ``stage``'s devices) in ``sharding`` there;
        None where this process holds no device of the stage."""
        if not self._runs[stage]:
            return None
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        return jax.device_put(x, sharding)

    def _move(self, x: Any, src: int, dst: int, spec: PartitionSpec | None,
              shape: Sequence[int], dtype: Any, sharding: NamedSharding | None = None,
              what: str = "state") -> Any:
        """``x``, held by stage ``src`` in ``spec`` (None: as its program left it), on stage
        ``dst`` in ``sharding`` (default: the same spec there); None where this process holds
        no device of ``dst``. Every process calls it at the same point of the step, so a copy
        between processes (``StageLinks``) has both ends; a copy between stages is counted in
        ``transfers``, in the bytes one device sends. It goes in pieces no two devices share
        (``spmd.sharding.spread``) and is gathered into its spec on arrival, so a replicated
        value crosses the link between the stages once, not once per device."""
        if src == dst:
            return self._put(x, dst, sharding) if sharding is not None else x
        if not (self._runs[src] or self._runs[dst]):
            return None
        if spec is None:
            if not self.collective:  # one process: the spec its program left it in
                spec = (x.sharding.spec if isinstance(x.sharding, NamedSharding)
                        else PartitionSpec())
            else:  # a spec the other process cannot know: send the value whole
                spec = PartitionSpec()
                if x is not None:
                    x = self._put(x, src, NamedSharding(self.meshes[src], spec))
        sent = to_partition_spec(spread(from_partition_spec(spec, len(shape)), shape,
                                        dict(self.meshes[src].shape)))
        if x is not None and sent != spec:  # each device keeps its part: no copy
            x = self._put(x, src, NamedSharding(self.meshes[src], sent))
        arrival = sharding or NamedSharding(self.meshes[dst], spec)
        if not self.collective:  # one process: jax copies device to device
            moved = jax.device_put(x, arrival if sent == spec else
                                   NamedSharding(self.meshes[dst], sent))
        else:
            moved = self.links.send(x, src, dst, sent, shape, dtype)
        if moved is not None:
            per_device = max(shard.data.nbytes for shard in moved.addressable_shards)
            self.transfers.append((dst, what, per_device))
            if not moved.sharding.is_equivalent_to(arrival, len(shape)):
                moved = self._put(moved, dst, arrival)  # gathered on the stage's own links
        return moved

    def place(self, leaves: Sequence[Any]) -> list[Any]:
        """The state leaves on their home stages in their specs (batch leaves as given;
        None for a host value whose home stage this process holds no device of)."""
        return [x if i in self.batch_inputs
                else self._put(x, self.home[i], self._sharding(self.home[i], i))
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

            outs = self._out_shardings(task, plan)
            return _Program(task, reads, [], jax.jit(
                update, in_shardings=self._in_shardings(task.stage, reads), out_shardings=outs,
                donate_argnums=self._donated(task, reads)), outs)
        accumulates = [k for k, v in enumerate(region.outputs) if v in self._accumulated]

        def then(*xs):
            outs = call(*xs[:len(reads)])
            sums = xs[len(reads):]
            return (*outs, *[s + outs[k] for s, k in zip(sums, accumulates)])

        shardings = self._in_shardings(task.stage, reads)
        outs = self._out_shardings(task, plan)
        return _Program(task, reads, accumulates,
                        jax.jit(call, in_shardings=shardings, out_shardings=outs), outs,
                        jax.jit(then, in_shardings=shardings + (None,) * len(accumulates),
                                out_shardings=outs + tuple(outs[k] for k in accumulates)))

    def _donated(self, task: Task, reads: Sequence[Value]) -> tuple[int, ...]:
        """The positions in ``reads`` of the state leaves whose new value ``task`` (an
        update) makes on their home stage and no other update reads (with ``donate``)."""
        if not self.donate:
            return ()
        graph = self.split.graph
        made = set(task.region.outputs)
        replaced = {i for o, i in self.output_aliases.items()
                    if graph.outputs[o] in made and self.home[i] == task.stage}
        read_elsewhere = {graph.nodes[v.node].input_index for t in self.split.tasks
                          if t.phase == UPDATE and t is not task for v in t.region.inputs
                          if graph.nodes[v.node].kind == "input"}
        return tuple(k for k, v in enumerate(reads) if graph.nodes[v.node].kind == "input"
                     and graph.nodes[v.node].input_index in replaced - read_elsewhere)

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
            if not isinstance(x, jax.Array) or id(x) in seen or x.is_deleted():  # donated
                continue
            seen.add(id(x))
            for shard in x.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
        return [max((per_device.get(d, 0) for d in devices), default=0)
                for devices in self._devices]

    def compiled(self) -> dict[str, Any]:
        """Each task's compiled program (the first microbatch's variant), for the shapes and
        shardings of the last call's arguments."""
        if not self._last_args and not self.links.last_args:
            raise PlanError("the pipeline has not run yet: call the step once first")
        return {name: fn.lower(*args).compile()
                for name, (fn, args) in {**self._last_args, **self.links.last_args}.items()}

    # -- one step ------------------------------------------------------------------------------
    def _microbatches(self, leaves: Sequence[Any]) -> dict[int, list[Any]]:
        """Per batch leaf, its microbatches: slices of a host value (which every process
        has), else arrays on the leaf's home stage in its spec there (None where this process
        holds no device of that stage)."""
        m = self.schedule.microbatches
        out = {}
        for i in self.batch_inputs:
            x = leaves[i]
            rows = np.shape(x)[0] if np.ndim(x) else 0
            if rows % m:
                raise PlanError(f"batch input {i} has {rows} rows, which {m} microbatches "
                                f"cannot split evenly; use a batch that is a multiple of {m}")
            size = rows // m
            if not isinstance(x, jax.Array):
                x = np.asarray(x)
                out[i] = [x[j * size:(j + 1) * size] for j in range(m)]
                continue
            home, sharding = self.home[i], self._sharding(self.home[i], i)
            if not self._runs[home]:
                out[i] = [None] * m
                continue
            key = (i, size, x.shape)
            if key not in self._splitters:
                self._splitters[key] = jax.jit(
                    lambda a: [a[j * size:(j + 1) * size] for j in range(m)],
                    out_shardings=[sharding] * m)
            out[i] = list(self._splitters[key](self._put(x, home, sharding)))
        return out

    def _spec(self, stage: int, leaf: int) -> PartitionSpec:
        return to_partition_spec(self.stages[stage].input_specs[leaf])

    def __call__(self, leaves: Sequence[Any]) -> list[Any]:
        """One step, walked the same way by every process: each runs the tasks of the stages
        it holds devices of and takes part in the copies to and from them."""
        graph, split = self.split.graph, self.split
        leaves = self.place(leaves)
        slices = self._microbatches(leaves)
        copies: dict[tuple[int, int], Any] = {}  # (stage, leaf) -> the leaf on that stage
        envs: list[dict[Any, Any]] = [{} for _ in range(self.schedule.microbatches)]

        def step_input(v: Value, stage: int, j: int) -> Any:
            i = graph.nodes[v.node].input_index
            sharding = self._sharding(stage, i)
            if i in slices:
                x = slices[i][j]
                if isinstance(x, np.ndarray):  # a host value: put where it is read
                    return self._put(x, stage, sharding)
                key = ("batch", i, stage)
                if key not in envs[j]:
                    envs[j][key] = self._move(x, self.home[i], stage, self._spec(self.home[i], i),
                                              (np.shape(leaves[i])[0] // len(envs),
                                               *np.shape(leaves[i])[1:]),
                                              leaves[i].dtype, sharding)
                return envs[j][key]
            if (stage, i) not in copies:
                copies[stage, i] = self._move(leaves[i], self.home[i], stage,
                                              self._spec(self.home[i], i), self._leaf_shape(i),
                                              self._leaf_dtype(i), sharding)
            return copies[stage, i]

        self.transfers.clear()

        def moved(env: dict, v: Value, stage: int) -> Any:
            """A microbatch's value on ``stage``, copied there once however many of its
            tasks read it."""
            src = self._made_on[v]
            if src == stage:
                return env[v]
            key = (v, stage)
            if key not in env:
                env[key] = self._move(env[v], src, stage, self._out_spec[v],
                                      graph.value_shape(v), graph.value_dtype(v),
                                      what="activation")
            return env[key]

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
            produced = len(region.outputs)
            if not self._runs[stage]:  # another process's stage: its values are not here
                outs = [None] * (produced + len(program.accumulates))
            elif j == 0 or not program.accumulates:
                self._last_args[program.task.name] = (program.first, list(map(abstract, args)))
                outs = program.first(*args)
            else:
                outs = program.then(*args, *[sums[region.outputs[k]]
                                             for k in program.accumulates])
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
                    else self._move(sums[v] if v in sums else made[v], self._made_on[v],
                                    t.stage, self._out_spec[v], graph.value_shape(v),
                                    graph.value_dtype(v))
                    for v in program.reads]
            if self._runs[t.stage]:
                self._last_args[t.name] = (program.first, list(map(abstract, args)))
                outs = program.first(*args)
            else:
                outs = [None] * len(t.region.outputs)
            for v, x in zip(t.region.outputs, outs):
                made[v] = x
            measure(leaves, copies.values(), sums.values(), made.values())
        return self._outputs(leaves, sums, made)

    def _outputs(self, leaves: Sequence[Any], sums: Mapping[Value, Any],
                 made: Mapping[Value, Any]) -> list[Any]:
        """The step's flat outputs. Where this process holds none of a new state leaf it is
        an ``absent`` array in the leaf's sharding on its home stage; in a run of several
        processes every other output (the loss, metrics) is copied to each stage, so every
        process can read it."""
        graph = self.split.graph
        scale = 1.0 / self.schedule.microbatches
        aliased = dict(self.output_aliases)
        out = []
        for k, v in enumerate(graph.outputs):
            if v is None:
                out.append(graph.output_literals[k])
                continue
            node = graph.nodes[v.node]
            if node.kind == "input":
                x, src = leaves[node.input_index], self.home[node.input_index]
            elif v in made or v in sums:
                x = made[v] if v in made else None if sums[v] is None else sums[v] * scale
                src = self._made_on[v]
            else:
                out.append(graph.constants.get(v.node))
                continue
            if k in aliased:
                i = aliased[k]
                out.append(x if x is not None else absent(
                    self._leaf_shape(i), self._leaf_dtype(i), self._sharding(self.home[i], i)))
                continue
            if jax.process_count() > 1:
                copies = [x if s == src else self._move(x, src, s, None, graph.value_shape(v),
                                                        graph.value_dtype(v), what="result")
                          for s in range(len(self.stages))]
                x = next((c for c in copies if c is not None), None)
            out.append(x)
        return out

    def _leaf_shape(self, leaf: int) -> tuple[int, ...]:
        return self.split.graph.value_shape(Value(self.split.graph.inputs[leaf], 0))

    def _leaf_dtype(self, leaf: int) -> Any:
        return self.split.graph.value_dtype(Value(self.split.graph.inputs[leaf], 0))


class PipelineExecutable:
    """A ``PipelinePlan`` made runnable, with the interface ``spmd.api`` calls a plan's
    executable through (``plan``, ``place``, calling it on flat leaves)."""

    def __init__(self, plan: "PipelinePlan", donate: bool | None = None):
        """``donate`` (default: True for NNX steps, whose state spmd writes back, as
        ``spmd.runtime.compile.prepare`` does): the updates reuse the old state's buffers."""
        self.plan = plan
        sig = plan.signature
        leaves = sig.leaves
        self.pipeline = Pipeline(
            plan.split, [StagePlacement(st.mesh, st.input_specs,
                                        st.cost.plans if st.cost is not None else {})
                         for st in plan.stages],
            plan.schedule, [i for i, leaf in enumerate(leaves) if leaf.kind == "batch"],
            sig.output_aliases, donate=donates(sig, donate))

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
