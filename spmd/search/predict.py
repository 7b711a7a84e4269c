"""The cost model's prediction of one plan: an evaluation of the very numbers the solver
minimized (``spmd.search.costgraph``), split the way a person reads a step's time.

The solver's objective is ``Prediction.objective``: ``total_time`` plus the tie-break that
prefers holding less (an input's per-device bytes at 1e-3 of streaming them), which is no
time the step spends. What only the prediction needs is counted here too: the collectives
XLA emits (independent ones off the critical path combine into one per kind and mesh axes,
on XLA:GPU up to its combine threshold's bytes each; a value resharded once per target spec
and loop level), and the peak memory by liveness.

One exception to objective = prediction: where a value's reshards to two target specs
share their first steps (gathered whole for one reader, gathered whole and sliced for
another), XLA runs the shared steps once and so does the prediction, but the solver's
fan-outs pay each target's whole path (an upper bound, which steers the search away from
such plans; pricing the steps jointly would need a fan-out per path step).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from spmd.cost.partitioner import COLLECTIVE_KINDS, PARTIAL_SUM_KINDS
from spmd.memory.liveness import Buffer
from spmd.memory.offload import destination
from spmd.memory.remat import is_recomputed
from spmd.search.costgraph import CostGraph
from spmd.search.encode import Encoding
from spmd.sharding import Spec
from spmd.trace.graph import Value

__all__ = ["Prediction", "predict", "predict_with_peak"]


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The cost model's view of one plan, per device.

    Attributes:
      compute_time: seconds of FLOPs at the device's rate.
      memory_time: seconds memory-bound ops add beyond their FLOPs: a roofline per op, whose
        bytes are what its kernel reads and writes in device memory
        (``spmd.search.fusion``), at the device's achievable bandwidth.
      launch_time: the per-kernel overhead times the kernels the step runs.
      comm_time: seconds of collectives (the plan's own and its reshards).
      memory_bytes: peak bytes live at once (liveness over the op graph).
      collectives: kind -> (count, bytes) of what XLA is predicted to emit per step.
      objective: what the solver minimized: ``total_time`` plus the tie-break.
      recompute_time: seconds of rematerialized forward work: the recomputed ops' FLOPs,
        memory-bound excess and launches (``spmd.memory.remat``; their collectives are in
        ``comm_time``).
      transfer_time: seconds of copies between device and pinned host memory (offloaded
        state, ``spmd.memory.offload``), at the device's host link, not overlapped.
      bubble_time: seconds pipeline stages wait (0 for a single stage).
      overlap_time: seconds of communication hidden behind compute (0 until collectives
        are scheduled).
    """

    compute_time: float
    comm_time: float
    memory_bytes: float
    collectives: Mapping[str, tuple[int, float]]
    objective: float
    memory_time: float = 0.0
    launch_time: float = 0.0
    recompute_time: float = 0.0
    bubble_time: float = 0.0
    overlap_time: float = 0.0
    transfer_time: float = 0.0

    @property
    def total_time(self) -> float:
        """Seconds per step: compute (FLOPs, memory-bound excess, kernel launches),
        communication, recompute, host transfers and bubble, less overlap."""
        return (self.compute_time + self.memory_time + self.launch_time + self.comm_time
                + self.recompute_time + self.transfer_time + self.bubble_time
                - self.overlap_time)

    @property
    def collective_bytes(self) -> float:
        return float(sum(b for _, b in self.collectives.values()))

    def scaled(self, factor: float) -> "Prediction":
        """Every time multiplied by ``factor`` (memory and collectives unchanged)."""
        times = ("compute_time", "comm_time", "objective", "memory_time", "launch_time",
                 "recompute_time", "bubble_time", "overlap_time", "transfer_time")
        return dataclasses.replace(self, **{k: getattr(self, k) * factor for k in times})

    def to_dict(self) -> dict:
        return {"compute_time": self.compute_time, "comm_time": self.comm_time,
                "memory_time": self.memory_time, "launch_time": self.launch_time,
                "recompute_time": self.recompute_time, "bubble_time": self.bubble_time,
                "overlap_time": self.overlap_time, "transfer_time": self.transfer_time,
                "total_time": self.total_time,
                "objective": self.objective, "memory_bytes": self.memory_bytes,
                "collectives": {k: [int(c), float(b)] for k, (c, b) in self.collectives.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Prediction":
        return cls(float(d["compute_time"]), float(d["comm_time"]), float(d["memory_bytes"]),
                   {k: (int(v[0]), float(v[1])) for k, v in d["collectives"].items()},
                   float(d["objective"]), float(d.get("memory_time", 0.0)),
                   float(d.get("launch_time", 0.0)),
                   float(d.get("recompute_time", 0.0)), float(d.get("bubble_time", 0.0)),
                   float(d.get("overlap_time", 0.0)), float(d.get("transfer_time", 0.0)))


def predict(enc: Encoding, node_choice: Sequence[int]) -> Prediction:
    """Evaluate one plan (a root strategy per graph node, ``Encoding.node_choice``)."""
    return predict_with_peak(enc, node_choice)[0]


def predict_with_peak(enc: Encoding, node_choice: Sequence[int]) -> tuple[Prediction, int]:
    """``predict``, and the program point where the plan's memory peaks (where a search
    under a budget the plan exceeds looks closer: ``spmd.search.point_memory``)."""
    cg: CostGraph = enc.cg
    graph = cg.graph
    partitioner = cg.cost.partitioner
    compute = comm = memory = launch = tie_break = recompute = transfer = 0.0
    counts = {k: [0, 0.0] for k in COLLECTIVE_KINDS}
    combined_at: dict = {}  # (kind, axes, k) group XLA merged into one collective -> its last op
    filled: dict = {}  # (kind, axes) -> operand bytes of its group being filled
    groups: dict = {}  # (kind, axes) -> groups of it filled before the current one
    # partial sums a reduction collective reads: (op, its combine group or None, bytes)
    partials: list[tuple[int, Any, float]] = []
    picked: set[tuple[int, int]] = set()  # (root, root strategy) chosen: charges paid
    strategy = []  # the strategy of every node under the plan
    for n in graph.nodes:
        r = node_choice[n.id]
        j = int(enc.fmap[n.id][r])
        s = enc.strats[n.id][j]
        strategy.append(s)
        picked.add((cg.root[n.id], r))
        if n.kind != "op":
            tie_break += float(cg.tie_break(n.id, s.out_specs)[0])
            continue
        if is_recomputed(n.name):
            recompute += float(cg.compute[n.id][j])
        elif destination(n.op) is not None:
            transfer += float(cg.compute[n.id][j])
        else:
            compute += float(cg.compute[n.id][j])
            memory += float(cg.memory_bound[n.id][j])
            launch += cg.launch[n.id]
        comm += float(cg.comm[n.id][j])
        off = n.id in cg.off_path
        for c in s.collectives:
            row = counts.setdefault(c.kind, [0, 0.0])
            key = partitioner.combine_key(c) if off else None
            if key is not None:  # a new group once this one holds the threshold's bytes
                held = filled.get(key, 0.0)
                if held and held + c.bytes > partitioner.combine_threshold:
                    groups[key] = groups.get(key, 0) + 1
                    held = 0.0
                filled[key] = held + c.bytes
                key = (*key, groups.get(key, 0))
            if key is None:
                row[0] += n.repeat
            elif key not in combined_at:
                row[0] += 1
            if key is not None:
                combined_at[key] = n.id
            row[1] += c.bytes * n.repeat
            if c.kind in PARTIAL_SUM_KINDS:
                partials.append((n.id, key, c.bytes))
    comm += sum(lat for lat, members in cg.charges if any(m in picked for m in members))
    # Reshards: once per (value, target spec, loop level), as XLA reshards a value, and
    # the steps two targets' paths share from the same source once (XLA's CSE merges the
    # same collective of the same operand: a value gathered whole for one reader and
    # rematerialized, gathered whole and sliced, for another is gathered once); each target
    # spec's copy is a buffer from its first reader to its last (one a collective makes of
    # a step input, on XLA:CPU from the step's start: ``_made_first``). Priced as a compile
    # standing in for GPUs runs (``DeviceMesh.stands_in_for``), a step input's reshards
    # share no steps: each target spec's is made from a fenced copy of its own, where its
    # reader has a computed operand (``spmd.runtime.constrain``). The GPU mesh's own
    # prediction, virtual or not, shares them, as XLA:GPU's CSE does.
    copies: dict[tuple[Value, Spec], list[int]] = {}
    for v, reads in cg.reads.items():
        src = strategy[v.node].out_specs[v.index]
        paid = set()
        emitted: set[tuple] = set()  # (loop level, path prefix, target or None) of v's reshards
        apart = (cg.mesh.stands_in_for is not None
                 and cg.graph.nodes[v.node].kind == "input")
        for read in reads:
            dst = strategy[read.node].in_specs[read.operand]
            if dst == src:
                continue
            copies.setdefault((v, dst), []).append(read.node)
            if (dst, read.repeat) in paid:
                continue
            paid.add((dst, read.repeat))
            colls = cg.reshard(v, src, dst)[1]
            for k, c in enumerate(colls):
                step = (read.repeat, colls[:k + 1], dst if apart else None)
                if step in emitted:
                    continue
                emitted.add(step)
                comm += read.repeat * cg.cost.time(c)
                row = counts.setdefault(c.kind, [0, 0.0])
                row[0] += read.repeat
                row[1] += c.bytes * read.repeat
    live = cg.liveness
    # A value fused into its readers' kernel is never in memory, unless the plan reshards it
    # (a collective reads it from memory); one made from constants alone is made in the
    # spec each reader takes, so it is in memory in none.
    copies = {key: at for key, at in copies.items() if key[0].node not in cg.constant_made}
    resharded = {v for v, _ in copies}
    nbytes = np.array([0.0 if fused and v not in resharded else
                       float(cg.bytes_row(v, (strategy[v.node].out_specs[v.index],))[0])
                       for (v, _, _), fused in zip(live.intervals, live.fused)])
    # (a reshard without a collective is a slice, fused into its readers)
    early = [_made_first(cg, v) and bool(cg.reshard(v, strategy[v.node].out_specs[v.index],
                                                      dst)[1]) for v, dst in copies]
    extra = [Buffer(0 if first else min(at), max(at), float(cg.bytes_row(v, (dst,))[0]))
             for ((v, dst), at), first in zip(copies.items(), early)]
    extra += _relayout_copies(cg, strategy)
    extra += _partial_results(cg, strategy, partials, combined_at, nbytes)
    totals = live.totals(nbytes, extra)  # at every program point, the step's end included
    peak_at = int(np.argmax(totals))
    prediction = Prediction(compute - memory - launch, comm, float(totals[peak_at]),
                            {k: (c, b) for k, (c, b) in counts.items()},
                            objective=compute + recompute + transfer + comm + tie_break,
                            memory_time=memory, launch_time=launch, recompute_time=recompute,
                            transfer_time=transfer)
    return prediction, peak_at


def _made_first(cg: CostGraph, v: Value) -> bool:
    """Whether XLA makes a copy of ``v`` (a collective's, a matmul operand's transpose) at
    the step's start rather than at its first reader: a copy of a step input on XLA:CPU.
    XLA:CPU schedules a program with collectives breadth-first, for concurrency, so an op
    runs as soon as its operands are there, and what reads only the step's inputs runs
    first: gpt-13b's FSDP plan on 8 simulated devices gathers every layer's weights and
    copies every transposed weight at the step's start, 24 GiB of its temporaries at its
    peak. What reads computed values runs near its readers in either order; XLA:GPU's
    scheduler keeps every copy near its readers, and so does a compile standing in for
    GPUs, whose copies wait for their readers (``spmd.runtime.constrain``)."""
    return (cg.mesh.platform == "cpu" and not cg.mesh.stand_in
            and cg.graph.nodes[v.node].kind == "input")


def _relayout_copies(cg: CostGraph, strategy: Sequence) -> list[Buffer]:
    """The copies XLA makes of the matmul operands it puts in another dimension order first
    (``CostGraph.relayouts``). One made at the step's start (``_made_first``) is one per
    operand and spec (XLA's CSE merges the rest), held to its last reader; any other is its
    reader's, made and freed there (a transposed activation read in the forward and the
    backward pass is not held between them). Values made from constants alone are made in
    their readers' kernels, transposed there."""
    # (value, spec, its reader; None for the one copy made at the step's start) -> readers
    readers: dict[tuple, list[int]] = {}
    for n in cg.graph.nodes:
        for k in cg.relayouts(n):
            v = n.operands[k]
            if v is not None and v.node not in cg.constant_made:
                first = _made_first(cg, v)
                key = (v, strategy[n.id].in_specs[k], None if first else n.id)
                readers.setdefault(key, []).append(n.id)
    return [Buffer(0 if reader is None else min(at), max(at),
                   float(cg.bytes_row(v, (spec,))[0]))
            for (v, spec, reader), at in readers.items()]


def _partial_results(cg: CostGraph, strategy: Sequence, partials: Sequence[tuple[int, Any, float]],
                     combined_at: Mapping, value_bytes: np.ndarray) -> list[Buffer]:
    """The buffers of ops' partial sums (``partials``: op, combine group, bytes) that are not
    their result: a collective XLA combines with others of its kind (off the critical path:
    the weight gradients) reads its input when the last op of its group (``combined_at``)
    has run, so each input lives from its op to there, beside the group's results (XLA:CPU's
    combined all-reduce of dp's gradients: twice their bytes in its temporaries), which that
    collective makes: before it a result is not in memory, though the liveness counts it
    from its op (gpt-tiny dp on cpu-8: 1.01 -> 0.98 of the compile); any other
    partial sum larger than its result (a reduce-scatter's input; on XLA:CPU, the whole
    all-reduced array before its slice) lives at its op."""
    live = cg.liveness
    out = []
    for node, key, nbytes in partials:
        s = strategy[node]
        result = float(cg.bytes_row(Value(node, 0), (s.out_specs[0],))[0]) if s.out_specs else 0.0
        if key is not None:  # waits for its group, beside the group's results
            at = combined_at[key]
            out.append(Buffer(node, at, nbytes))
            i = live.position.get(Value(node, 0))
            if i is not None and node < at <= live.ends[i] and value_bytes[i]:
                # Its result is made by the group's collective: before it, only the partial
                # sum is in memory (the liveness counts the result from its op).
                out.append(Buffer(node, at - 1, -float(value_bytes[i])))
            elif i is not None and live.ends[i] < at:
                # Its readers wait for the group too: its result is in memory there, even
                # where the program reads it early (XLA:CPU's ZeRO: each gradient all-reduced
                # whole at the step's end, then sliced to the update's spec), in place of
                # what those readers make from it (``_made_after``).
                made = sum(value_bytes[j] for c in cg.graph.nodes[node].consumers
                           for j in _values_of(cg, c)
                           if live.starts[j] <= at <= live.ends[j])
                if result > made:
                    out.append(Buffer(at, at, result - made))
            out += _made_after(cg, node, at, value_bytes)
            continue
        if nbytes > result:
            out.append(Buffer(node, node, nbytes))
    return out


def _values_of(cg: CostGraph, node: int) -> list[int]:
    """Indices (into the liveness's intervals) of ``node``'s values that are in memory."""
    n = cg.graph.nodes[node]
    count = len(n.op.out_shapes) if n.op is not None else 1
    return [j for k in range(count) if (j := cg.liveness.position.get(Value(node, k))) is not None]


def _made_after(cg: CostGraph, node: int, at: int, value_bytes: np.ndarray) -> list[Buffer]:
    """The values of ``node``'s readers that come before ``at`` in the program, where its
    result waits for a combined collective made after its group's last op: XLA runs those
    readers after the collective, so a value still read there is in memory from ``at``,
    not from its op, and one read only before it is made and freed after it, in turn with
    the others (not counted; nor are their reshards' copies moved: counted all at ``at``,
    mlp-small's dp on cpu-8, whose gradients are resharded for their updates, is priced
    1.19x of its compile). Counted from their ops instead, moe-tiny's dp on cpu-8 holds its
    expert-weight gradients (split over experts, all-reduced with the others at the step's
    end, then gathered and transposed whole) from the backward pass: 1.16x."""
    live = cg.liveness
    out = []
    for c in cg.graph.nodes[node].consumers:
        if c >= at:
            continue
        for j in _values_of(cg, c):
            start, end, nbytes = int(live.starts[j]), int(live.ends[j]), float(value_bytes[j])
            if nbytes and start < at:
                out.append(Buffer(start, min(end, at - 1), -nbytes))
    return out
