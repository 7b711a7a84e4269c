"""A step cut into pipeline tasks: for each stage, the forward work of one microbatch, the
backward work of one microbatch, and the update that runs once per step.

The step is traced at the size of one microbatch. Its op graph (``spmd.trace.graph``) falls
into two phases:

- the **microbatch phase**: the forward ops (``jvp(...)``), the backward ops
  (``transpose(...)``) and everything they read that is computed in the step (the causal
  mask, a one-hot of the targets); it runs once per microbatch. Within it, an op is
  *backward* when it is a backward op or reads one's output, else *forward*;
- the **update phase**: every other op (the optimizer); it runs once per step, on the
  microbatch phase's *accumulated* values (those it reads, and the step outputs the
  microbatch phase makes: the gradients, the loss) averaged over the microbatches. That
  average is exactly the whole batch's value for a loss that is a mean over the batch (the
  zoo's, and most): the mean of equal-sized microbatches' means. A sum of gradient
  contributions that only the update reads (``add_any``: a tied embedding's, from its first
  layer and its last) is update work too: each contribution is accumulated where it is made
  and crosses stages once per step.

Each op's stage is that of its layer (``spmd.trace.layers.layer_of``): ``stage_starts`` says
which layer each stage starts at. A task is one (stage, phase) region
(``spmd.trace.regions.Region``), so it is a program of its own. Data flows forward through
the forward tasks, backward through the backward ones (a backward op takes the lowest stage
among what it reads), and the update of a stage reads only its own or later stages' update
values; a step whose layers read each other otherwise cannot be pipelined this way, and is
told so (``PlanError`` naming the op).

>>> import jax, jax.numpy as jnp
>>> def step(ws, x):
...     loss = lambda ws: jnp.mean(jnp.tanh(jnp.tanh(x @ ws[0]) @ ws[1]))
...     value, g = jax.value_and_grad(loss)(ws)
...     return [w - 0.1 * d for w, d in zip(ws, g)], value
>>> split = split_step(jax.make_jaxpr(step)([jnp.ones((8, 8))] * 2, jnp.ones((4, 8))),
...                    num_layers=2, stage_starts=(0, 1))
>>> [(t.stage, t.phase) for t in split.tasks]
[(0, 'forward'), (1, 'forward'), (1, 'backward'), (0, 'backward'), (1, 'update'), (0, 'update')]
>>> len(split.accumulated)  # the two gradients and the loss
3
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

from spmd.errors import PlanError
from spmd.trace.graph import Graph, Node, Value, build_graph
from spmd.trace.layers import forward_ops, is_backward, layer_of
from spmd.trace.regions import Region

__all__ = ["BACKWARD", "FORWARD", "UPDATE", "LayeredStep", "StageSplit", "Task", "split_step",
           "sums_for_the_update"]

FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"


@dataclasses.dataclass
class Task:
    """One stage's work of one phase: its region of the step (a program of its own)."""

    stage: int
    phase: str
    region: Region

    @property
    def name(self) -> str:
        return f"stage {self.stage} {self.phase}"


@dataclasses.dataclass
class StageSplit:
    """The step's ops by stage and phase, and the tasks they make.

    ``tasks`` are in an order that respects their data flow within one microbatch: the
    forward tasks by stage, the backward tasks by stage from the last, then the updates
    from the last stage. ``accumulated`` are the microbatch phase's values the update phase
    or the step's outputs read (summed over microbatches, then averaged).
    """

    graph: Graph
    num_stages: int
    stage_of: list[int]   # per node: its stage (-1: an input or constant)
    phase_of: list[str]   # per node: FORWARD, BACKWARD or UPDATE ("" for inputs, constants)
    tasks: list[Task]
    accumulated: list[Value]
    recompute: tuple[bool, ...] = ()  # per stage: its backward task reruns its forward ops

    def homes(self, output_aliases: Mapping[int, int]) -> list[int]:
        """The stage each step input is kept on between steps: the one whose update makes
        its new value (``output_aliases``: the step's output -> input map), else the first
        that reads it, else 0."""
        graph = self.graph
        home = [-1] * len(graph.inputs)
        for o, i in output_aliases.items():
            v = graph.outputs[o]
            made = self.producer(v) if v is not None else None
            if made is not None:
                home[i] = made[0]
        for t in sorted(self.tasks, key=lambda t: t.stage):
            for v in t.region.inputs:
                node = graph.nodes[v.node]
                if node.kind == "input" and home[node.input_index] < 0:
                    home[node.input_index] = t.stage
        return [h if h >= 0 else 0 for h in home]

    def producer(self, v: Value) -> tuple[int, str] | None:
        """The (stage, phase) of the task that makes ``v``; None for a step input or
        constant."""
        node = self.graph.nodes[v.node]
        return (self.stage_of[v.node], self.phase_of[v.node]) if node.kind == "op" else None


def _phases(graph: Graph, layer: Sequence[int]) -> list[str]:
    """FORWARD, BACKWARD or UPDATE per node, as the module docstring defines them."""
    ops = [n for n in graph.nodes if n.kind == "op"]
    micro = set(forward_ops(graph)) | {n.id for n in ops if is_backward(n)}
    if not any(is_backward(n) for n in ops):
        raise PlanError("the step has no backward pass (no op traced under jax.grad's "
                        "transpose): there is nothing to pipeline across microbatches")
    # what the microbatch phase reads is in it too, and a scan is in it whole
    stack = list(micro)
    while stack:
        node = graph.nodes[stack.pop()]
        reached = [v.node for v in node.operands
                   if v is not None and graph.nodes[v.node].kind == "op"]
        if node.scan >= 0:  # the whole scan, and all it reads (a region runs the equation)
            scan = graph.scans[node.scan]
            reached += [*scan.nodes, *(v.node for v in scan.operands if v is not None
                                        and graph.nodes[v.node].kind == "op")]
        for m in reached:
            if m not in micro:
                micro.add(m)
                stack.append(m)
    phase = [""] * len(graph.nodes)
    for n in ops:
        if n.id not in micro:
            phase[n.id] = UPDATE
            continue
        reads_backward = any(v is not None and phase[v.node] == BACKWARD for v in n.operands)
        phase[n.id] = BACKWARD if is_backward(n) or reads_backward else FORWARD
    for scan in graph.scans:  # a scan is one unit: of the microbatch phase if any of its
        order = (FORWARD, BACKWARD, UPDATE)  # nodes is (its dead ops are not), the latest
        phases = {phase[n] for n in scan.nodes}
        latest = max(phases - {UPDATE} or phases, key=order.index)
        for n in scan.nodes:
            phase[n] = latest
    # A sum of gradient contributions only the update reads (a tied embedding's, from the
    # first layer and the last) is a sum of sums: each contribution accumulates on its own
    # stage, and they are added once per step, not sent across stages every microbatch.
    # Contributions of one layer are on one stage: summed per microbatch, they keep one sum.
    sources = _contribution_layers(graph, ops, layer)
    sums_for_the_update(graph, phase, lambda n: len(sources[n.id]) > 1)
    return phase


def sums_for_the_update(graph: Graph, phase: list[str],
                        moves: Callable[[Node], bool] = lambda n: True) -> None:
    """Move to the update (in ``phase``, in place) every backward ``add_any`` outside a scan
    that only the update or the step's results read and ``moves`` accepts: a sum of
    gradient contributions is then summed over the microbatches part by part and added
    once per step (exact: a sum of averages is the average of the sums). Through chains of
    such sums, from the last."""
    outputs = {v.node for v in graph.outputs if v is not None}
    for n in reversed(graph.nodes):
        if (n.kind == "op" and n.op.primitive == "add_any" and phase[n.id] == BACKWARD
                and n.scan < 0 and (n.consumers or n.id in outputs)
                and all(phase[c] == UPDATE for c in n.consumers) and moves(n)):
            phase[n.id] = UPDATE


def _contribution_layers(graph: Graph, ops: Sequence[Node], layer: Sequence[int]
                         ) -> dict[int, frozenset[int]]:
    """For each ``add_any``, the layers of the contributions it sums, through the sums it
    adds (a weight read three times is summed by a chain of two)."""
    sources: dict[int, frozenset[int]] = {}
    for n in ops:
        if n.op.primitive != "add_any":
            continue
        found: set[int] = set()
        for v in n.operands:
            if v is None or graph.nodes[v.node].kind != "op":
                continue
            found |= sources.get(v.node, {layer[v.node]})
        sources[n.id] = frozenset(found)
    return sources


def _check_flow(graph: Graph, stage: list[int], phase: list[str]) -> None:
    """Every op reads only what tasks before its own (in ``StageSplit.tasks``' order, the
    same microbatch) make; else name the op and what it reads."""
    rank = {FORWARD: lambda s: (0, s), BACKWARD: lambda s: (1, -s), UPDATE: lambda s: (2, -s)}
    for n in graph.nodes:
        if n.kind != "op":
            continue
        mine = rank[phase[n.id]](stage[n.id])
        for v in n.operands:
            if v is None or graph.nodes[v.node].kind != "op":
                continue
            theirs = rank[phase[v.node]](stage[v.node])
            if theirs > mine:
                where = n.name or "no name"
                raise PlanError(
                    f"cannot pipeline the step: {n.op.primitive} at {n.key} ({where}, stage "
                    f"{stage[n.id]} {phase[n.id]}) reads a value made by stage "
                    f"{stage[v.node]} {phase[v.node]} ({graph.nodes[v.node].key}), which runs "
                    f"after it; move the layer cuts (stage_starts) or use fewer stages")


class LayeredStep:
    """A step's op graph cut into ``num_layers`` layers (``layer_of``) and phases, once, so
    that any stage layout of it (``split``) and any layer range's tasks (``regions``) are
    quick to make: the stage dynamic program asks for many."""

    def __init__(self, closed_jaxpr, num_layers: int, graph: Graph | None = None):
        self.graph = graph if graph is not None else build_graph(closed_jaxpr)
        self.num_layers = num_layers
        self.layer = layer_of(self.graph, num_layers)
        self.phase = _phases(self.graph, self.layer)
        self._read_by: dict[Value, set[int]] | None = None

    def regions(self, start: int, stop: int, recompute: bool = False) -> dict[str, Region]:
        """The tasks of layers ``start`` to ``stop - 1`` as one stage, by phase (a phase
        with no op there is left out).

        ``recompute``: the stage keeps none of its forward values for its backward task,
        which runs the forward ops again before its own (GPipe's rematerialization, per
        stage): the forward task returns only what other stages, the update or the step's
        results read; the backward task holds the forward ops too and returns what the
        backward task alone would."""
        members: dict[str, list[int]] = {FORWARD: [], BACKWARD: [], UPDATE: []}
        for n in self.graph.nodes:
            if n.kind == "op" and start <= self.layer[n.id] < stop:
                members[self.phase[n.id]].append(n.id)
        out = {p: Region(self.graph, nodes) for p, nodes in members.items() if nodes}
        if recompute and FORWARD in out and BACKWARD in out:
            own = set(members[BACKWARD])
            step_outputs = {v for v in self.graph.outputs if v is not None}
            readers = self._readers()
            sent = [v for v in out[FORWARD].outputs
                    if v in step_outputs or not readers.get(v, set()) <= own | set(members[FORWARD])]
            out[FORWARD] = Region(self.graph, members[FORWARD], outputs=sent)
            out[BACKWARD] = Region(self.graph, members[FORWARD] + members[BACKWARD],
                                   outputs=out[BACKWARD].outputs)
        return out

    def _readers(self) -> dict[Value, set[int]]:
        """Per value, the nodes that read it (every node of a scan reading it)."""
        if self._read_by is None:
            read_by: dict[Value, set[int]] = {}
            for n in self.graph.nodes:
                for v in n.operands:
                    if v is not None:
                        read_by.setdefault(v, set()).add(n.id)
            for scan in self.graph.scans:
                for v in scan.operands:
                    if v is not None:
                        read_by.setdefault(v, set()).update(scan.nodes)
            self._read_by = read_by
        return self._read_by

    def split(self, stage_starts: Sequence[int], recompute: Sequence[bool] = ()
              ) -> StageSplit:
        """Stage ``s`` holds layers ``stage_starts[s]`` to ``stage_starts[s + 1] - 1``;
        ``recompute[s]``: stage ``s`` recomputes its forward values in its backward task
        (``regions``; default: none does)."""
        starts, count = list(stage_starts), self.num_layers
        if not starts or starts[0] != 0 or starts != sorted(set(starts)) or starts[-1] >= count:
            raise PlanError(f"stage_starts {tuple(starts)} must begin at layer 0 and rise, "
                            f"each below the {count} layers")
        recompute = tuple(recompute) or (False,) * len(starts)
        if len(recompute) != len(starts):
            raise PlanError(f"recompute has {len(recompute)} flags for {len(starts)} stages")
        stage_of_layer = [max(s for s, start in enumerate(starts) if start <= k)
                          for k in range(count)]
        stage = [stage_of_layer[k] if k >= 0 else -1 for k in self.layer]
        _check_flow(self.graph, stage, self.phase)
        bounds = starts + [count]
        tasks = []
        by_stage = [self.regions(bounds[s], bounds[s + 1], recompute[s])
                    for s in range(len(starts))]
        for s, p in ([(s, FORWARD) for s in range(len(starts))]
                     + [(s, BACKWARD) for s in reversed(range(len(starts)))]
                     + [(s, UPDATE) for s in reversed(range(len(starts)))]):
            if p in by_stage[s]:
                tasks.append(Task(s, p, by_stage[s][p]))
        graph = self.graph
        update_reads = {v for n in graph.nodes if n.kind == "op" and self.phase[n.id] == UPDATE
                        for v in n.operands if v is not None}
        outputs = {v for v in graph.outputs if v is not None}
        accumulated = [v for t in tasks if t.phase != UPDATE for v in t.region.outputs
                       if v in update_reads or v in outputs]
        return StageSplit(graph, len(starts), stage, self.phase, tasks, accumulated,
                          recompute)


def split_step(closed_jaxpr, num_layers: int, stage_starts: Sequence[int],
               graph: Graph | None = None) -> StageSplit:
    """Cut a step (traced at one microbatch) into ``num_layers`` layers and those into
    stages: stage ``s`` holds layers ``stage_starts[s]`` to ``stage_starts[s + 1] - 1``."""
    return LayeredStep(closed_jaxpr, num_layers, graph).split(stage_starts)
