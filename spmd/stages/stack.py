"""A step whose layers are one scanned stack (``nnx.scan``, ``lax.scan`` over stacked
parameters), traced at one microbatch, seen as the SPMD pipeline runtime
(``spmd.runtime.stacked``) runs it and its plan (``spmd.stages.stacked``) prices it:

- the **stack**: the forward scan over its ``L`` layers and the backward scan over them;
- ``before``: the microbatch ops that need neither scan (the embedding, masks);
- ``between``: what reads the forward scan's results but not the backward one's (the
  logits, the loss, their gradients);
- ``after``: what reads the backward scan's results (the embedding's gradient);
- ``update``: the rest, once per step (the optimizer).

A value *varies* when it differs between microbatches (it depends on a batch input).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from spmd.errors import PlanError
from spmd.sharding import Spec
from spmd.stages.split import BACKWARD, FORWARD, UPDATE, sums_for_the_update
from spmd.trace.graph import Graph, Scan, Value
from spmd.trace.regions import Region

__all__ = ["LayerStack", "RegionLayout", "StackedStep", "find_stack", "stacked_leaves", "ticks"]


def ticks(microbatches: int, repeats: int, stages: int) -> int:
    """Ticks of one stack's pipeline loop: ``m v + p - 1``."""
    return microbatches * repeats + stages - 1


@dataclasses.dataclass(frozen=True)
class RegionLayout:
    """How one part of the step is laid out, from its intra-op plan on one stage's devices
    (the update's: on the whole mesh): the region's program the plan was made on (its
    inputs in, its outputs out: the runtime runs it, not a second trace of the region), the
    sharding constraints inside it, keyed by that program's paths; for a stack, the specs
    its scan's operands and results get (the loops keep their state in them)."""

    program: Any  # ClosedJaxpr
    constraints: Mapping[str, Spec]
    operands: Sequence[Spec | None] = ()
    results: Sequence[Spec | None] = ()


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """The step's scanned layer stack: its forward and backward scans over ``length``
    layers."""

    forward: Scan
    backward: Scan
    length: int


def find_stack(graph: Graph, phase: Sequence[str]) -> LayerStack | None:
    """The longest forward scan of the microbatch phase whose results a backward (reverse)
    scan of the same length reads; None when the step has no such pair."""
    best = None
    for fwd in graph.scans:
        if not fwd.nodes or phase[fwd.nodes[0]] != FORWARD or fwd.eqn.params["reverse"]:
            continue
        length = int(fwd.eqn.params["length"])
        made = {v for v in fwd.results if v is not None}
        for bwd in graph.scans:
            if (bwd.nodes and phase[bwd.nodes[0]] == BACKWARD and bwd.eqn.params["reverse"]
                    and int(bwd.eqn.params["length"]) == length
                    and any(v in made for v in bwd.operands)):
                if best is None or len(fwd.nodes) > len(best.forward.nodes):
                    best = LayerStack(fwd, bwd, length)
    return best


def stacked_leaves(graph: Graph, stack: LayerStack) -> set[int]:
    """The step inputs that hold one entry per layer of the stack: those a stack's scan reads
    as per-layer values, and every other input of one of their shapes and dtypes (the
    optimizer's moments of a stacked parameter)."""
    read = set()
    for scan in (stack.forward, stack.backward):
        first = scan.eqn.params["num_consts"] + scan.eqn.params["num_carry"]
        for v in scan.operands[first:]:
            if v is not None and graph.nodes[v.node].kind == "input":
                read.add(graph.nodes[v.node].input_index)
    shapes = {(graph.value_shape(Value(graph.inputs[i], 0)),
               str(graph.value_dtype(Value(graph.inputs[i], 0)))) for i in read}
    return {i for i, n in enumerate(graph.inputs)
            if (graph.value_shape(Value(n, 0)), str(graph.value_dtype(Value(n, 0)))) in shapes}


class StackedStep:
    """The step's op ``graph`` (phases ``phase``) around its layer ``stack``, in the parts
    the module docstring names; ``batch_inputs``: the leaves cut into microbatches."""

    def __init__(self, graph: Graph, phase: Sequence[str], stack: LayerStack,
                 batch_inputs: Sequence[int]):
        self.graph, self.stack = graph, stack
        # a tied embedding's gradient is summed over the microbatches part by part (the
        # head's, the lookup's) and added once, not each part kept per microbatch
        self.phase = list(phase)
        sums_for_the_update(graph, self.phase)
        self.batch_inputs = set(batch_inputs)
        self.varies = self._varies()
        self.parts = self._parts()

    def check(self, microbatches: int, stages: int, repeats: int) -> None:
        """``check_counts`` for this step's stack."""
        self.check_counts(self.stack.length, microbatches, stages, repeats)

    @staticmethod
    def check_counts(length: int, microbatches: int, stages: int, repeats: int) -> None:
        """That ``stages`` x ``repeats`` share a stack of ``length`` layers equally, and a
        circular schedule has a microbatch for each stage; else a PlanError that says what
        would do."""
        m, p, v, L = microbatches, stages, repeats, length
        if L % (p * v):
            valid = [r for r in range(1, L // p + 1) if L % (p * r) == 0] if L % p == 0 else []
            fix = (f"PipelineOptions(repeats=...) one of {valid}" if valid else
                   f"a stage count that divides {L}")
            raise PlanError(f"the scanned stack has {L} layers, which {p} stages x {v} "
                            f"repeats cannot share equally; use {fix}")
        if v > 1 and m < p:
            raise PlanError(f"the circular schedule ({v} repeats) needs at least as many "
                            f"microbatches as stages ({m} < {p}): set "
                            f"PipelineOptions(microbatches=...) to {p} or more, or repeats=1")

    def _scan_of(self, n: int) -> Scan | None:
        node = self.graph.nodes[n]
        return self.graph.scans[node.scan] if node.scan >= 0 else None

    def _operands(self, n: int) -> list[Value]:
        scan = self._scan_of(n)
        operands = scan.operands if scan is not None else self.graph.nodes[n].operands
        return [v for v in operands if v is not None]

    def _varies(self) -> list[bool]:
        """Per node: whether its values differ between microbatches (they depend on a batch
        input)."""
        graph = self.graph
        varies = [False] * len(graph.nodes)
        for n in graph.nodes:
            if n.kind == "input":
                varies[n.id] = n.input_index in self.batch_inputs
            elif n.kind == "op":
                varies[n.id] = any(varies[v.node] for v in self._operands(n.id))
        return varies

    def _parts(self) -> dict[str, Region]:
        """The regions ``before``, ``between``, ``after`` and ``update`` (those with ops)."""
        graph, stack = self.graph, self.stack
        fwd, bwd = set(stack.forward.nodes), set(stack.backward.nodes)
        after_f = [False] * len(graph.nodes)
        after_b = [False] * len(graph.nodes)
        members: dict[str, list[int]] = {"before": [], "between": [], "after": [], "update": []}
        for n in graph.nodes:
            if n.kind != "op":
                continue
            if n.id in fwd or n.id in bwd:
                after_f[n.id] = True
                after_b[n.id] = n.id in bwd
                continue
            ops = self._operands(n.id)
            after_f[n.id] = any(after_f[v.node] for v in ops)
            after_b[n.id] = any(after_b[v.node] for v in ops)
            part = ("update" if self.phase[n.id] == UPDATE else "after" if after_b[n.id]
                    else "between" if after_f[n.id] else "before")
            members[part].append(n.id)
        return {name: Region(graph, nodes) for name, nodes in members.items() if nodes}

    def recomputable(self, v: Value) -> bool:
        """Whether ``v`` (a forward stack result) is a saved value the backward loop can
        make again: the backward stack alone reads it, as a per-layer input, and it is not
        one of the step's results."""
        backward = self.stack.backward
        readers = set(self.graph.nodes[v.node].consumers)
        first = backward.eqn.params["num_consts"] + backward.eqn.params["num_carry"]
        return (bool(readers) and readers <= set(backward.nodes)
                and v not in self.graph.outputs and v in backward.operands[first:]
                and v not in backward.operands[:first])

    def kept_per_microbatch(self, v: Value) -> bool:
        """Whether a microbatch region's varying result is read by microbatch work (kept
        per microbatch) rather than only by the update or as the step's result (summed)."""
        return any(self.phase[c] != UPDATE for c in self.graph.nodes[v.node].consumers)
