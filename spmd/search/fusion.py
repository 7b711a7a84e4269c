"""Which ops XLA runs as one kernel, so that the cost graph can price what a kernel reads and
writes in device memory (the roofline's bytes) and how many kernels a step launches.

XLA's fusion passes (``InstructionFusion``, ``MultiOutputFusion``, on GPU and CPU alike) merge
elementwise ops, broadcasts, reshapes, slices and concatenations with one another into loop
fusions, and merge such producers into a reduction that consumes them (an input fusion). A
value passed inside a fusion never touches device memory; one that crosses a fusion's edge
is written once by its producer and read by every kernel that consumes it. Matmuls,
convolutions, transposes, gathers, scatters, sorts, cumulative ops and loops are kernels of
their own (a library call or a fusion root XLA does not merge across).

The approximation here (``fuse``): an edge producer -> consumer is *inside* a kernel when both
ops are fusible, the producer is not a reduction (a reduction ends its fusion: its consumers
read its result from memory) and both run in the same loop body; kernels are the connected
components of such edges. Where XLA differs:

* it may refuse a fusion that would duplicate expensive work or exceed its size limits (then
  there are more kernels and more traffic than counted here), or duplicate a cheap producer
  into two consumers (the same traffic, counted here as one kernel; but where a consumer
  transposes on XLA:CPU, it reads the producer's inputs at the transpose's bandwidth:
  ``transposed_reads``);
* a layer norm's statistics and its normalization are usually two fusions on GPU (the input
  is read twice); here they form one kernel that reads it once;
* a matmul's bias or activation can be a cuBLAS epilogue on GPU (its output is not written
  and read again); here it is;
* XLA:CPU runs a ``dot`` inside a loop fusion when its operands are small.

A transpose that only reorders a matmul's result as the matmul with its operands swapped
would make it (``dot_general``'s transpose rule writes every weight gradient ``x^T dy`` so)
is no kernel: XLA's algebraic simplifier swaps the operands and the matmul writes the
transposed result itself (``folded_transposes``; checked on XLA:CPU, jax 0.10.2: no
transpose or copy is left; taken to hold on XLA:GPU too, where cuBLAS writes either order,
not checked there). It joins the matmul's kernel here, so the matmul's own result is neither
written nor held in memory.

Scan boundary pseudo-ops (``scan_carry``, ``scan_slice``, ...) move no data of their own and
launch nothing: their consumers read what they carry, their producers write it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from spmd.memory.liveness import Remaking
from spmd.rules.elementwise import ELEMENTWISE
from spmd.rules.random import KEY_OPS
from spmd.rules.reduce import ARG_REDUCTIONS, REDUCTIONS
from spmd.search.layout import transposed_operands
from spmd.trace.graph import Graph, Value

__all__ = ["DUPLICABLE", "FREE", "FUSIBLE", "REMAKING", "Fusion", "constant_made",
           "folded_transposes", "fuse", "never_in_memory", "transposed_reads"]

#: ops XLA merges with their neighbours into loop fusions
FUSIBLE = frozenset(ELEMENTWISE) | frozenset(REDUCTIONS) | frozenset(ARG_REDUCTIONS) | {
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "iota", "slice", "dynamic_slice",
    "pad", "concatenate", "rev", "split", "random_bits", *KEY_OPS}
#: ends a fusion: its consumers read its result from memory
_ROOTS = frozenset(REDUCTIONS) | frozenset(ARG_REDUCTIONS)
#: pseudo-ops carrying values across a scan's boundary: no kernel, no traffic
FREE = frozenset({"scan_carry", "scan_carry_out", "scan_slice", "scan_stack"})
#: cheap ops XLA's fusion duplicates into each consumer's kernel (``InstructionFusion`` with
#: duplication allowed, as on CPU and GPU), rather than keep their result in memory for a
#: later reader; it does not duplicate what ``HloInstruction::IsExpensive`` calls expensive
#: (divide, exp, log, tanh, sqrt, rsqrt, power and the other transcendentals)
DUPLICABLE = frozenset({
    "abs", "neg", "not", "sign", "floor", "ceil", "round", "integer_pow", "square",
    "convert_element_type", "copy", "copy_p", "reduce_precision", "stop_gradient",
    "bitcast_convert_type", "add", "sub", "mul", "max", "min", "and", "or", "xor", "eq", "ne",
    "lt", "gt", "le", "ge", "select_n", "clamp", "add_any", "broadcast_in_dim", "reshape",
    "squeeze", "expand_dims"})
#: what the liveness model needs of the above (``spmd.memory.liveness.Remaking``)
REMAKING = Remaking(DUPLICABLE, FUSIBLE, FREE)
#: ops that read only the part of operand 0 they return (as many bytes as their output)
SLICING = frozenset({"gather", "slice", "dynamic_slice"})
#: ops that update operand 0 in place: they read and write only the update (operand 1 for
#: dynamic_update_slice, 2 for scatters), not the whole buffer
IN_PLACE = {"dynamic_update_slice": 1, "scatter-add": 2, "scatter_add": 2, "scatter": 2}


@dataclasses.dataclass(frozen=True)
class Fusion:
    """A step's ops grouped into kernels.

    Attributes:
      kernel: per node, the id of the kernel it runs in (the id of the kernel's first node),
        or -1 (inputs, constants, scan boundary pseudo-ops: no kernel).
      reads: per node, per operand: whether the node reads it from device memory (its
        producer is in another kernel, or is an input or constant, and no op of its kernel
        before it, nor an earlier operand of its own, reads the same value: a kernel loads
        each value once).
      writes: per node, per output: whether it is written to device memory (read by another
        kernel or a loop boundary, or a step output).
      launches: kernels the step runs, each counted once per iteration of the loops around it.
      folded: transposes in the kernel of the matmul making their operand
        (``folded_transposes``): they move no data of their own.
    """

    kernel: tuple[int, ...]
    reads: tuple[tuple[bool, ...], ...]
    writes: tuple[tuple[bool, ...], ...]
    launches: int
    folded: frozenset[int] = frozenset()

    def key(self, node: int) -> tuple:
        """What of the fusion decides a node's traffic (part of its pricing memo's key)."""
        return self.reads[node], self.writes[node]

    def traffic(self, node: int, primitive: str, operand_bytes: Sequence[float],
                output_bytes: Sequence[float]) -> float:
        """Bytes a node's kernel moves for it in device memory, given each operand's and
        output's bytes on one device: the operands it reads from outside its kernel and the
        outputs it writes out. ``SLICING`` ops read as much of operand 0 as they return;
        ``IN_PLACE`` ops read and write only their update of it."""
        reads, writes = self.reads[node], self.writes[node]
        outs = list(output_bytes)
        whole = range(1 if primitive in SLICING or primitive in IN_PLACE else 0,
                      len(operand_bytes))
        total = sum(operand_bytes[k] for k in whole if reads[k])
        if primitive in SLICING and reads[0]:
            total += outs[0]  # the rows or window it returns, read from operand 0
        if primitive in IN_PLACE:  # its update, written into operand 0's buffer
            outs[0] = operand_bytes[IN_PLACE[primitive]]
        return total + sum(b for b, w in zip(outs, writes) if w)


def fuse(graph: Graph) -> Fusion:
    """Group ``graph``'s ops into kernels (module docstring)."""
    nodes = graph.nodes
    parent = list(range(len(nodes)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def fusible(i: int) -> bool:
        n = nodes[i]
        return n.kind == "op" and n.op.primitive in FUSIBLE

    def inside(producer: int, consumer: int) -> bool:
        return (fusible(producer) and fusible(consumer)
                and nodes[producer].op.primitive not in _ROOTS
                and nodes[producer].repeat == nodes[consumer].repeat
                and nodes[producer].scan == nodes[consumer].scan)

    folded = folded_transposes(graph)
    for n in nodes:
        for v in n.operands:
            if v is not None and (inside(v.node, n.id) or n.id in folded):
                a, b = find(v.node), find(n.id)
                parent[max(a, b)] = min(a, b)
    launches_at = {}
    kernel = []
    for n in nodes:
        if n.kind != "op" or n.op.primitive in FREE:
            kernel.append(-1)
            continue
        root = find(n.id)
        kernel.append(root)
        launches_at[root] = max(launches_at.get(root, 0), n.repeat)
    reads: list[tuple[bool, ...]] = []
    read_outside: set[tuple[int, int]] = set()  # (node, output) read across a kernel's edge
    loaded: set[tuple[int, int, int]] = set()  # (kernel, node, output) a kernel reads already
    for n in nodes:
        row = []
        for v in n.operands:  # a kernel reads a value once, however many of its ops use it
            outside = v is not None and kernel[n.id] != -1 and kernel[v.node] != kernel[n.id]
            row.append(outside and (kernel[n.id], v.node, v.index) not in loaded)
            if outside:
                loaded.add((kernel[n.id], v.node, v.index))
        reads.append(tuple(row))
        for v in n.operands:
            if v is not None and (kernel[n.id] == -1 or kernel[v.node] != kernel[n.id]):
                read_outside.add((v.node, v.index))
    outputs = {(v.node, v.index) for v in graph.outputs if v is not None}
    writes = tuple(tuple(kernel[n.id] != -1 and ((n.id, k) in read_outside
                                                 or (n.id, k) in outputs)
                         for k in range(len(n.op.out_shapes)))
                   for n in nodes)
    return Fusion(tuple(kernel), tuple(reads), writes, sum(launches_at.values()),
                  frozenset(folded))


def folded_transposes(graph: Graph) -> set[int]:
    """Transposes XLA folds into the matmul making their operand (module docstring): the
    operand is a ``dot_general``'s result that nothing else reads, in the same loop body, and
    the permutation keeps the batch dimensions and puts the rhs's free dimensions before
    the lhs's, each in order: the result of the matmul with its operands swapped."""
    nodes = graph.nodes
    outputs = {v.node for v in graph.outputs if v is not None}
    folded = set()
    for n in nodes:
        if n.kind != "op" or n.op.primitive != "transpose" or n.operands[0] is None:
            continue
        d = nodes[n.operands[0].node]
        if (d.kind != "op" or d.op.primitive != "dot_general" or d.consumers != [n.id]
                or d.id in outputs or (d.repeat, d.scan) != (n.repeat, n.scan)):
            continue
        (contract, _), (batch, _) = d.op.params["dimension_numbers"]
        nb = len(batch)
        nl = len(d.op.in_shapes[0]) - nb - len(contract)
        rank = len(d.op.out_shapes[0])
        swapped = (*range(nb), *range(nb + nl, rank), *range(nb, nb + nl))
        if tuple(n.op.params["permutation"]) == swapped:
            folded.add(n.id)
    return folded


def never_in_memory(graph: Graph, fusion: Fusion) -> frozenset[Value]:
    """Values no kernel writes to memory (``Fusion.writes``) whose last reader runs before
    any op of a kernel that fuses nothing (a matmul, a gather, a loop), as in the optimizer
    update: XLA keeps those inside one kernel. A value read across such an op (a forward
    activation read by the backward pass) is taken to be in memory: XLA:CPU fuses far less
    than ``fuse`` does (gpt-tiny: 345 fusions against 145 kernels), and taking those out too
    under-predicted its tensor-parallel plans 2x.

    Also never in memory, wherever they are read: values the step computes from constants
    alone by fusible ops (``constant_made``), such as an attention mask broadcast to
    (batch, heads, q, t) and the select of zeros its gradient reads. XLA computes them inside
    each reader's kernel (broadcasts and iotas are duplicated into their consumers); kept,
    they held 8 of the 34 GiB predicted per device for gpt-2.6b under FSDP on 64 A100s."""
    nodes = graph.nodes
    # unfused[i]: how many kernels of an op that fuses nothing begin among nodes[:i + 1]
    # (a transpose folded into its matmul begins none)
    unfused = np.cumsum([n.kind == "op" and n.op.primitive not in FUSIBLE | FREE
                         and fusion.kernel[n.id] == n.id for n in nodes])
    last = graph.last_use()
    made = constant_made(graph)
    return frozenset(
        Value(n.id, k) for n in nodes if fusion.kernel[n.id] >= 0
        for k, written in enumerate(fusion.writes[n.id])
        if n.id in made
        or (not written and unfused[min(last[n.id], len(nodes) - 1)] == unfused[n.id]))


def transposed_reads(graph: Graph, fusion: Fusion, platform: str) -> dict[Value, float]:
    """On XLA:CPU (empty on any other ``platform``), per value a transpose reads (a
    transpose op's operand, a matmul operand XLA reorders first: ``spmd.search.layout``)
    and made by a cheap op (``DUPLICABLE``): how many times its own bytes the transpose's
    kernel reads. XLA:CPU fuses a transpose with the cheap ops producing its operand,
    duplicated when the operand has other readers, and its kernel then reads every input
    of that cone of cheap producers (in their loop body), each once, in the transposed
    order, at the transpose's bandwidth. A layer's input gradient runs down the residual
    stream, so the transpose before a backward matmul remakes every layer's residual sum
    above it: in a GPT of 4 layers of width 256 on one CPU device, six such fusions of 27
    to 73 operands took 11 ms of a profiled step (62 ms without the profiler), where the
    cost model had one 256 KiB transpose each. Values made by other ops are not in the
    result: a kernel reads them themselves. XLA:GPU's transposes and its fusion's
    duplication were not checked."""
    if platform != "cpu":
        return {}
    nodes = graph.nodes

    def cheap(i: int, body: tuple[int, int]) -> bool:
        n = nodes[i]
        return (n.kind == "op" and n.op.primitive in DUPLICABLE
                and (n.repeat, n.scan) == body)

    transposed: set[Value] = set()
    for n in nodes:
        if n.kind != "op":
            continue
        if n.op.primitive == "transpose" and n.id not in fusion.folded:
            transposed.add(n.operands[0])
        if n.op.primitive == "dot_general":
            transposed.update(n.operands[k] for k in transposed_operands(
                *n.op.in_shapes[:2], n.op.params["dimension_numbers"], platform))
    out: dict[Value, float] = {}
    for v in transposed - {None}:
        body = (nodes[v.node].repeat, nodes[v.node].scan)
        if not cheap(v.node, body):
            continue
        seen, stack, read = {v.node}, [v.node], set()
        while stack:
            for u in nodes[stack.pop()].operands:
                if u is not None and not cheap(u.node, body):
                    read.add(u)
                elif u is not None and u.node not in seen:
                    seen.add(u.node)
                    stack.append(u.node)
        out[v] = max(1.0, sum(map(graph.value_bytes, read)) / max(1, graph.value_bytes(v)))
    return out


def constant_made(graph: Graph) -> set[int]:
    """The fusible ops (outside loops) that read only constants, literals and such ops'
    results: whatever the step's inputs, they compute the same values."""
    made: set[int] = set()
    for n in graph.nodes:
        if (n.kind == "op" and n.op.primitive in FUSIBLE and n.scan < 0
                and all(v is None or graph.nodes[v.node].kind == "const" or v.node in made
                        for v in n.operands)):
            made.add(n.id)
    return made
