"""The cost graph: the step's op graph priced on one mesh, the same whichever inputs are
pinned, so the search and every hand-written plan's scoring share it.

For every node it holds the strategies (op nodes: the rules'; inputs: their free candidates;
constants: replicated) and, per strategy, compute seconds and the communication the node
itself does. Compute is a roofline (``spmd.search.roofline``): an op's FLOPs at the device's
achievable rate (that of one of its matmuls' size, ``DeviceSpec.flops``) against the bytes
its kernel reads and writes for it in device memory at the achievable bandwidth
(``spmd.search.fusion`` says which ops share a kernel): the longer of the two for an op
alone in its kernel, the term that bounds a fused kernel for each of its ops; plus the
per-kernel overhead once per kernel. Transposes move their bytes at the device's transpose
bandwidth (one that XLA folds into the matmul making its operand moves none of its own), and
a matmul whose operand XLA reorders first (``spmd.search.layout``) pays that copy and its
kernel too; a copy between host and device memory (``spmd.memory.offload``) moves its bytes
at the device's host link. For every value it prices a reshard once per (value, target spec,
loop level), as XLA's partitioner does it (``reshard_time``). ``spmd.search.encode`` lays
these numbers out as the solver's request under one set of pins, ``spmd.search.predict``
evaluates the same numbers for the chosen plan: one pricing path.

Keeping the program small (every reduction counted in ``stats``):

* **followers** (elementwise ops, converts, broadcasts; ``rules.is_follower``) share the
  choice of the op producing their main operand (their largest operand): they are merged
  into its group and add their cost to it. Inputs and constants never absorb followers, so
  an input's memory is its own (and pins, which only touch inputs, never change a group).
* **small inputs**: an input under ``small_bytes`` (``min(64 KiB, largest value / 256)``;
  the fraction keeps tiny test models meaningful, the cap keeps real models' biases, norms
  and scalars out of the search) is replicated, without a variable. Small *ops* keep all
  their strategies: restricting them to replicated outputs made gpt-tiny all-to-all its
  logits (a per-token statistic must stay split like its batch) and GPT's attention gather
  whole activations over heads (a bias gradient must stay split like its activation); their
  collectives are small anyway.
* **combined collectives**: ops no matmul/convolution depends on (``off_path``: weight
  gradients, the loss, the update) pay only the bandwidth of their all-reduces; XLA merges
  those into one per (kind, axes), whose latency is one charge (``charges``).
* **repeated layers**: op nodes whose structural colour (primitive, shapes, params, refined
  ``WL_ROUNDS`` times by their operands' colours: no program distances, so a layer's backward
  ops match although they read forward values at distances that differ per layer) repeats,
  with a window of ``MIN_PERIOD`` ops matching, at a distance of at least ``MIN_PERIOD`` ops
  share one choice (``same_as``). Inputs they read at the same position (``input_ties``)
  share it too when their candidates agree under the pins at hand. A structure that repeats
  with a shorter period (a stack of tiny MLP layers) is left untied, because alternating
  choices (column then row split) matter there.
* **aliased outputs** (the new value of a parameter or optimizer state) keep their own choice
  and, if a pin asks for it, the pinned spec among their candidates (``required``), so e.g.
  ZeRO (replicated parameter, sharded state) is expressible.
* strategies and costs are computed once per distinct op (repeated layers repeat them).
* **scans** are planned once for their body (``spmd.trace.graph``): a body node's compute and
  collectives, and every reshard into it, count ``Node.repeat`` times; a loop's carry
  pseudo-ops share one variable, so every iteration sees the same spec.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from spmd import rules as _rules
from spmd.cluster.mesh import DeviceMesh
from spmd.cost.time import CostModel
from spmd.errors import PlanError
from spmd.memory.liveness import Liveness
from spmd.memory.offload import (destination, host_values, memory_copies,
                                 separate_host_memory)
from spmd.search.fusion import (REMAKING, constant_made, fuse, never_in_memory,
                                 transposed_reads)
from spmd.search.layout import transposed_operands
from spmd.search.roofline import Price, kernel_bounds
from spmd.sharding import (Spec, all_specs, bytes_per_device, format_spec, is_valid, replicated,
                           shard_shape)
from spmd.trace.graph import Graph, Node, Value, array_bytes

__all__ = ["CostGraph", "InputInfo", "Read", "input_strategy"]

SMALL_BYTES_CAP = 64 * 1024
SMALL_FRACTION = 1 / 256
MIN_PERIOD = 16
#: rounds of colour refinement behind layer tying (how far a node's neighbourhood must match)
WL_ROUNDS = 2
#: an input costs this fraction of the time to stream its per-device bytes once: only breaks
#: ties (a batch split for free rather than replicated), never outweighs communication.
INPUT_BYTES_WEIGHT = 1e-3
#: ops whose inputs are on the step's critical path: a collective feeding one of them waits
#: for its own result and cannot be merged with the others.
_HEAVY = ("dot_general", "conv_general_dilated")


@dataclasses.dataclass(frozen=True)
class InputInfo:
    """One flattened input leaf of the step.

    ``kind`` is ``"param"``, ``"optimizer"``, ``"batch"``, ``"state"`` or, for a region of a
    step, ``"activation"`` (a value another region produces); ``pinned`` a spec the user
    fixed (a hard constraint).
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    kind: str = "param"
    pinned: Spec | None = None


@dataclasses.dataclass(frozen=True)
class Read:
    """One operand of a node reading a value: who reads it, where, how often per step."""

    node: int
    operand: int
    repeat: int


def input_strategy(spec: Spec) -> _rules.Strategy:
    """The one strategy of an input (or constant) that arrives in ``spec``."""
    return _rules.Strategy(format_spec(spec), (), (spec,))


def op_dtype(node: Node) -> Any:
    """The dtype an op computes in (its first typed output or operand)."""
    for d in tuple(node.op.out_dtypes) + tuple(node.op.in_dtypes):
        if d is not None:
            return d
    return np.float32


def off_critical_path(g: Graph) -> set[int]:
    """Op nodes no matmul or convolution depends on (weight gradients, the loss, optimizer
    updates): their collectives are independent of one another, and XLA combines them."""
    below = [False] * len(g.nodes)  # some heavy op depends on this node
    for n in reversed(g.nodes):
        if below[n.id] or (n.kind == "op" and n.op.primitive in _HEAVY):
            for v in n.operands:
                if v is not None:
                    below[v.node] = True
    return {n.id for n in g.nodes if n.kind == "op" and not below[n.id]}


class CostGraph:
    """Strategies and their seconds for every node of a step on one mesh (module docstring).

    Args:
      graph: the step's op graph.
      inputs: one InputInfo per flat input (their ``pinned`` is ignored here: pins are the
        encoding's business, ``spmd.search.encode``).
      mesh: the cluster to plan for.
      output_aliases: ``{output index: input index}`` for outputs that are the new value of
        an input.
      required: specs every candidate list of an array of that shape must include, e.g.
        every spec any plan to be scored pins an input to (so a value can always arrive in
        it, whatever the caps on candidates drop).
      share_layers: tie repeated layers (off: every node has its own choice).
      every_scatter: keep the scattered-output variants of partial sums that this
        platform finishes like the unscattered ones (``RuleContext.every_scatter``).
    """

    def __init__(self, graph: Graph, inputs: Sequence[InputInfo], mesh: DeviceMesh, *,
                 output_aliases: Mapping[int, int] = {},
                 required: Mapping[tuple[int, ...], Iterable[Spec]] | None = None,
                 share_layers: bool = True, every_scatter: bool = False):
        if len(inputs) != len(graph.inputs):
            raise PlanError(f"search: {len(inputs)} InputInfo given but the step has "
                            f"{len(graph.inputs)} flat inputs")
        self.graph, self.mesh = graph, mesh
        self.cost = CostModel.shared(mesh)
        self.inputs = list(inputs)
        self.mesh_shape = mesh.shape
        self.aliases = dict(output_aliases)
        nodes = graph.nodes
        largest = max((graph.value_bytes(Value(n.id, k)) for n in nodes
                       for k in range(len(n.op.out_shapes))), default=0)
        self.small_bytes = min(SMALL_BYTES_CAP, largest * SMALL_FRACTION)
        self.ctx = _rules.RuleContext(mesh, partitioner=self.cost.partitioner,
                                      required=required or {}, every_scatter=every_scatter)
        self.off_path = off_critical_path(graph)
        self.stats: dict[str, Any] = {"small": 0, "off_path": len(self.off_path)}
        #: per node, its strategies; an input's are its free candidates
        self.strats: list[list[_rules.Strategy]] = []
        #: per node and strategy: compute seconds, and seconds of the node's own
        #: communication (off the critical path: bandwidth only), both x ``Node.repeat``
        self.compute: list[np.ndarray] = []
        self.comm: list[np.ndarray] = []
        #: which ops run as one kernel: what each op reads and writes in device memory
        self.fusion = fuse(graph)
        #: per value a transpose remakes on XLA:CPU, how many times its own bytes the
        #: transpose reads (``transposed_reads``); 1 where absent
        self.transposed_reads = transposed_reads(graph, self.fusion, mesh.platform)
        #: per op node and strategy: the seconds its memory traffic adds beyond its FLOPs
        #: (the part of ``compute`` that is memory-bound), x ``Node.repeat``
        self.memory_bound: list[np.ndarray] = []
        #: per node: the per-kernel overhead it adds to every strategy's ``compute`` (the
        #: first node of each kernel carries its kernel's, a matmul those of the transposes
        #: of its operands), x ``Node.repeat``
        self.launch: list[float] = []
        overhead = mesh.device.kernel_overhead
        memo: dict[tuple, tuple[list[_rules.Strategy], Price]] = {}
        prices: list[Price] = []
        for n in nodes:
            off = n.id in self.off_path
            key = ((_op_key(n), off, self.fusion.key(n.id),
                    tuple(self.transposed_reads.get(v, 1.0) for v in n.operands))
                   if n.kind == "op" else None)
            if key is not None and key in memo:
                ss, price = memo[key]
            else:
                ss = self._strategies(n)
                price = self._price(n, ss, off)
                if key is not None:
                    memo[key] = (ss, price)
            self.strats.append(ss)
            prices.append(price)
        bounds = kernel_bounds(graph, self.fusion, prices)
        for n, price in zip(nodes, prices):
            compute, comm, excess = price.seconds(bounds.get(self.fusion.kernel[n.id]))
            kernels = (self.fusion.kernel[n.id] == n.id) + len(self.relayouts(n))
            launch = overhead * n.repeat * kernels
            self.compute.append(compute * n.repeat + launch)
            self.comm.append(comm * n.repeat if n.repeat != 1 else comm)
            self.memory_bound.append(excess * n.repeat if n.repeat != 1 else excess)
            self.launch.append(launch)
        self.reads = self._reads()
        self.aliased = {graph.outputs[o].node for o in self.aliases
                        if graph.outputs[o] is not None}
        self._merge_followers()
        self._tie_layers(share_layers)
        self.charges = self._shared_latency()
        #: ops computing values from constants alone: XLA makes them in whatever sharding
        #: their readers take, inside the readers' kernels (``spmd.search.fusion``)
        self.constant_made = frozenset(constant_made(graph))
        # On XLA:CPU host memory is the devices': offloaded values stay in device memory,
        # and the copies between the two are the same buffers.
        separate = separate_host_memory(mesh.platform)
        self.liveness = Liveness(graph, donated=set(self.aliases.values()),
                                 fused=never_in_memory(graph, self.fusion),
                                 host=host_values(graph) if separate else frozenset(),
                                 forwarded=frozenset() if separate else memory_copies(graph),
                                 remaking=REMAKING)
        # Repeated layers repeat shapes and spec lists: prices are memoized on them.
        self._reshards: dict[tuple, tuple[float, tuple]] = {}
        self._matrices: dict[tuple, tuple[np.ndarray, tuple, tuple]] = {}
        self._fanouts: dict[tuple, tuple] = {}
        self._own_rows: dict[tuple, tuple] = {}
        self._bytes_rows: dict[tuple, np.ndarray] = {}

    # -- strategies and their seconds ----------------------------------------------------
    def _strategies(self, n: Node) -> list[_rules.Strategy]:
        shape, dtype = (n.op.out_shapes[0], n.op.out_dtypes[0]) if n.op.out_shapes else ((), None)
        if n.kind == "const":
            return [input_strategy(replicated(len(shape)))]
        if n.kind == "input":
            if array_bytes(shape, dtype) < self.small_bytes:
                self.stats["small"] += 1
                return [input_strategy(replicated(len(shape)))]
            return [input_strategy(s) for s in all_specs(shape, self.mesh_shape, 2)]
        return _rules.strategies(n.op, self.ctx)

    def _price(self, n: Node, ss: Sequence[_rules.Strategy], off_path: bool) -> Price:
        """Per strategy: the seconds of the op's FLOPs at the device's achievable rate, of
        its memory traffic at its achievable bandwidth (the roofline's two terms, which
        ``Price.seconds`` weighs with its kernel's), of its operands' relayouts, and of its
        collectives. An op whose kind the device rates (``CostModel.op_rate``: a
        transcendental on XLA:CPU) computes its elements at that rate; any other, its FLOPs
        at the matmul rate (an elementwise op's FLOPs are its elements). A copy between host
        and device memory is all FLOP seconds: its link's."""
        zeros = np.zeros(len(ss))
        if n.kind != "op":
            return Price(zeros, zeros, zeros, zeros)
        if destination(n.op) is not None:  # a copy between host and device memory
            moved = np.array([self.cost.host_copy_time(bytes_per_device(
                n.op.out_shapes[0], n.op.out_dtypes[0], s.out_specs[0], self.mesh_shape))
                for s in ss])
            return Price(moved, zeros, zeros, zeros)
        dtype = op_dtype(n)
        conv = n.op.primitive == "conv_general_dilated"
        rate = self.cost.op_rate(n.op.primitive)
        if rate is not None:
            flop_time = np.array([s.flops / rate for s in ss])
        else:
            flop_time = np.array([self.cost.compute(s.flops, dtype, self._matmul_size(n, s),
                                                    conv) if s.flops else 0.0 for s in ss])
        transpose = n.op.primitive == "transpose" and n.id not in self.fusion.folded
        traffic = np.array([self.cost.memory_time(self._traffic(n, s), transpose)
                            for s in ss])
        relayouts = self.relayouts(n)
        relayout = np.array([self.cost.memory_time(self._relayout_bytes(n, s, relayouts), True)
                             for s in ss])
        # Off the critical path XLA combines a kind's collectives into one: each pays its
        # bandwidth here and, where the platform runs the combined op as one call, their
        # shared latency once per plan (``charges``; ``CostModel.latency_group``).
        comm = np.array([sum(self.cost.split(c)[0]
                             if off_path and self.cost.latency_group(c)
                             else self.cost.time(c) for c in s.collectives) for s in ss])
        return Price(flop_time, traffic, relayout, comm)

    def _matmul_size(self, n: Node, s: _rules.Strategy) -> float | None:
        """FLOPs of one matmul an op runs on a device under ``s`` (a batched dot runs one per
        local batch element), which sets its achievable rate; None for other ops."""
        if n.op.primitive == "dot_general":
            (_, _), (batch, _) = n.op.params["dimension_numbers"]
            local = shard_shape(n.op.in_shapes[0], s.in_specs[0], self.mesh_shape)
            return s.flops / max(1, math.prod(local[d] for d in batch))
        if n.op.primitive == "conv_general_dilated":
            return s.flops
        return None

    def relayouts(self, n: Node) -> tuple[int, ...]:
        """The operands of a matmul that XLA copies into another dimension order first on
        this mesh's platform (``spmd.search.layout``); () for other ops."""
        if n.kind != "op" or n.op.primitive != "dot_general":
            return ()
        return transposed_operands(*n.op.in_shapes[:2], n.op.params["dimension_numbers"],
                                   self.mesh.platform)

    def _relayout_bytes(self, n: Node, s: _rules.Strategy, operands: Sequence[int]) -> float:
        """Bytes one device's transposes read and write for a matmul's reordered
        ``operands`` (``relayouts``) under ``s``: each written once and read once, or
        remade from what its cheap producers read (``transposed_reads``)."""
        return sum((1.0 + self.transposed_reads.get(n.operands[k], 1.0)) * bytes_per_device(
            n.op.in_shapes[k], n.op.in_dtypes[k], s.in_specs[k], self.mesh_shape)
            for k in operands)

    def _traffic(self, n: Node, s: _rules.Strategy) -> float:
        """Bytes one device reads and writes in memory for an op under ``s``
        (``Fusion.traffic``), at the op's local shapes."""
        op = n.op

        def local(shapes, dtypes, specs) -> list[float]:
            return [0.0 if dtype is None else float(
                bytes_per_device(shape, dtype, spec, self.mesh_shape))
                for shape, dtype, spec in zip(shapes, dtypes, specs)]

        operands = local(op.in_shapes, op.in_dtypes, s.in_specs)
        if op.primitive == "transpose" and n.operands[0] is not None:
            operands[0] *= self.transposed_reads.get(n.operands[0], 1.0)
        return self.fusion.traffic(n.id, op.primitive, operands,
                                   local(op.out_shapes, op.out_dtypes, s.out_specs))

    def tie_break(self, node: int, specs: Sequence[Spec]) -> np.ndarray:
        """An input's or constant's own cost per spec: a tie-break between equally fast
        plans in favour of holding less (``INPUT_BYTES_WEIGHT``). In the objective, never in
        a prediction's time."""
        op = self.graph.nodes[node].op
        return np.array([INPUT_BYTES_WEIGHT * self.cost.memory_time(
            bytes_per_device(op.out_shapes[0], op.out_dtypes[0], s, self.mesh_shape))
            for s in specs])

    def input_candidates(self, node: int, pin: Spec | None) -> list[_rules.Strategy]:
        """An input's strategies under ``pin``: the pinned spec alone, or its free candidates.

        Raises:
          PlanError: the pin does not fit the mesh (naming the input, its shape and the mesh).
        """
        if pin is None:
            return self.strats[node]
        n = self.graph.nodes[node]
        info = self.inputs[n.input_index]
        pin = tuple(tuple(a) for a in pin)
        if not is_valid(pin, n.op.out_shapes[0], self.mesh_shape):
            raise PlanError(f"input {info.path} (shape {n.op.out_shapes[0]}): spec "
                            f"{format_spec(pin)} does not fit mesh {self.mesh_shape}")
        return [input_strategy(pin)]

    # -- resharding ----------------------------------------------------------------------
    def reshard(self, v: Value, src: Spec, dst: Spec) -> tuple[float, tuple]:
        """Seconds and collectives to reshard value ``v`` from ``src`` to ``dst`` once."""
        if src == dst:
            return 0.0, ()
        key = (self.graph.value_shape(v), self.graph.value_dtype(v), src, dst)
        if key not in self._reshards:
            self._reshards[key] = self.cost.reshard(*key)
        return self._reshards[key]

    def reshard_time(self, v: Value, src: Spec, dst: Spec) -> float:
        return self.reshard(v, src, dst)[0]

    def reshard_matrix(self, v: Value, src: tuple[Spec, ...], dst: tuple[Spec, ...]) -> np.ndarray:
        """Reshard seconds of ``v`` for every (src, dst) pair of two spec lists, each distinct
        pair priced once; memoized on the lists themselves (repeated layers share them)."""
        shape, dtype = self.graph.value_shape(v), self.graph.value_dtype(v)
        key = (shape, dtype, id(src), id(dst))
        hit = self._matrices.get(key)
        if hit is not None and hit[1] is src and hit[2] is dst:
            return hit[0]
        us, vs = {}, {}
        ui = np.array([us.setdefault(s, len(us)) for s in src])
        vi = np.array([vs.setdefault(s, len(vs)) for s in dst])
        small = np.array([[self.reshard_time(v, a, b) for b in vs] for a in us])
        out = small.reshape(len(us), len(vs))[np.ix_(ui, vi)]
        self._matrices[key] = (out, src, dst)  # holding src, dst keeps their ids unique
        return out

    def fanout_table(self, v: Value, src: tuple[Spec, ...],
                     reads: Sequence[tuple[tuple[Spec, ...], int]]) -> tuple[np.ndarray, list]:
        """For a value read by several groups: its distinct targets (spec, loop level) over
        the reads' spec lists, their reshard seconds per source spec (``repeat`` x seconds),
        and each read's target per strategy. Memoized on the spec lists: the targets on the
        reads' alone (a pinned input's source list is new under every scoring)."""
        readers = tuple((id(dst), rep) for dst, rep in reads)
        if readers not in self._fanouts:
            targets: dict[tuple[Spec, int], int] = {}
            per_read = [[targets.setdefault((b, rep), len(targets)) for b in dst]
                        for dst, rep in reads]
            self._fanouts[readers] = (list(targets), per_read, reads, {})  # holding the lists
        wanted, per_read, _, tables = self._fanouts[readers]               # keeps ids unique
        key = (self.graph.value_shape(v), self.graph.value_dtype(v), id(src))
        if key not in tables:
            tables[key] = (np.array([[rep * self.reshard_time(v, a, b) for b, rep in wanted]
                                     for a in src]), src)
        return tables[key][0], per_read

    def own_group_reshards(self, v: Value, src: tuple[Spec, ...],
                           reads: Sequence[tuple[tuple[Spec, ...], int]]) -> np.ndarray:
        """For a value read only inside its producer's group: per strategy of the group, each
        distinct target (spec, loop level) its reads want priced once. Memoized on the lists."""
        shape, dtype = self.graph.value_shape(v), self.graph.value_dtype(v)
        key = (shape, dtype, id(src), tuple((id(dst), rep) for dst, rep in reads))
        hit = self._own_rows.get(key)
        if hit is None:
            row = np.zeros(len(src))
            for k, a in enumerate(src):
                paid = {(dst[k], rep) for dst, rep in reads if dst[k] != a}
                row[k] = sum(rep * self.reshard_time(v, a, b) for b, rep in paid)
            hit = self._own_rows[key] = (row, src, reads)  # holding the lists keeps ids unique
        return hit[0]

    def bytes_row(self, v: Value, specs: tuple[Spec, ...]) -> np.ndarray:
        """Bytes per device of value ``v`` under each of ``specs``."""
        shape, dtype = self.graph.value_shape(v), self.graph.value_dtype(v)
        key = (shape, dtype, specs)
        hit = self._bytes_rows.get(key)
        if hit is None:
            hit = self._bytes_rows[key] = np.array(
                [float(bytes_per_device(shape, dtype, s, self.mesh_shape)) for s in specs])
        return hit

    def _reads(self) -> dict[Value, list[Read]]:
        """Every value read by some node, with its reads in program order."""
        out: dict[Value, list[Read]] = collections.defaultdict(list)
        for n in self.graph.nodes:
            for i, v in enumerate(n.operands):
                if v is not None:
                    out[v].append(Read(n.id, i, n.repeat))
        return out

    # -- followers -----------------------------------------------------------------------
    def own_cost(self, node: int) -> np.ndarray:
        """Seconds per strategy of an op node's own work (compute and communication)."""
        return self.compute[node] + self.comm[node]

    def _merge_followers(self) -> None:
        nodes = self.graph.nodes
        #: per node, the node whose choice decides its strategy (itself unless a follower)
        self.root = list(range(len(nodes)))
        #: per node, its strategy under each of its root's strategies
        self.fmap: list[np.ndarray] = [np.arange(len(ss)) for ss in self.strats]
        merged = 0
        # The new value of a parameter or optimizer state must come back in its input's
        # spec; merged into its operand's group it would share that group's spec, so the
        # update of a replicated parameter and of its sharded optimizer state (ZeRO) could
        # not both hold. Such outputs keep their own choice.
        for n in nodes:
            if n.kind != "op" or not _rules.is_follower(n.op.primitive) or n.id in self.aliased:
                continue
            cands = [(math.prod(n.op.in_shapes[i]), -i, i) for i, v in enumerate(n.operands)
                     if v is not None and nodes[v.node].kind == "op"]
            if not cands:
                continue
            m = max(cands)[2]
            v = n.operands[m]
            u, r = v.node, self.root[v.node]
            own = self.own_cost(n.id)
            best: dict[Spec, int] = {}
            for j, s in enumerate(self.strats[n.id]):
                key = s.in_specs[m]
                if key not in best or own[j] < own[best[key]]:
                    best[key] = j
            mapping = []
            for ri in range(len(self.strats[r])):
                spec = self.strats[u][self.fmap[u][ri]].out_specs[v.index]
                if spec not in best:
                    break
                mapping.append(best[spec])
            else:
                self.root[n.id] = r
                self.fmap[n.id] = np.array(mapping, dtype=int)
                merged += 1
        self.stats["followers_merged"] = merged
        self.members: dict[int, list[int]] = collections.defaultdict(list)
        for i, r in enumerate(self.root):
            self.members[r].append(i)
        #: the nodes that own a choice (a solver node each), in program order
        self.roots = sorted(self.members)

    # -- repeated layers -----------------------------------------------------------------
    def names(self, node: int) -> list[str]:
        return [s.name for s in self.strats[node]]

    def _tie_layers(self, enabled: bool) -> None:
        nodes = self.graph.nodes
        parent = {r: r for r in self.roots}

        def find(x):
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        def union(a, b):
            ra, rb = find(a), find(b)
            if ra != rb and self.names(ra) == self.names(rb):
                parent[max(ra, rb)] = min(ra, rb)
                return True
            return False

        tied = 0
        #: pairs of inputs that two tied ops read at the same position: tied too, when their
        #: candidates agree under the pins at hand
        self.input_ties: list[tuple[int, int]] = []
        if enabled:
            sig, tok = self._colours()
            by_sig: dict[int, list[int]] = collections.defaultdict(list)
            for n in nodes:
                if n.kind == "op" and self.root[n.id] == n.id and len(self.strats[n.id]) > 1:
                    by_sig[sig[n.id]].append(n.id)
            size = len(nodes)

            def window(a, b):
                return b + MIN_PERIOD <= size and all(sig[a + i] == sig[b + i] for i in range(MIN_PERIOD))

            for members in by_sig.values():
                for i, a in enumerate(members):
                    later = members[i + 1:]
                    if not later or (later[0] - a < MIN_PERIOD and window(a, later[0])):
                        continue  # no repeat, or a short period: leave it free
                    for b in later:
                        if b - a >= MIN_PERIOD and window(a, b):
                            if union(a, b):
                                tied += 1
                                self.input_ties += [
                                    (va.node, vb.node)
                                    for va, vb in zip(nodes[a].operands, nodes[b].operands)
                                    if va is not None and vb is not None and va.node != vb.node
                                    and nodes[va.node].kind == "input" == nodes[vb.node].kind
                                    and tok[va.node] == tok[vb.node]]
                            break
        # A loop-carried value has one spec in every iteration: its carry pseudo-ops share a
        # variable (or, when their candidates differ, get a hard edge in the request).
        self.untied_loops = [(a, b) for a, b in self.graph.loops
                             if find(self.root[a]) != find(self.root[b])
                             and not union(self.root[a], self.root[b])]
        #: per op root, the root whose choice it shares (itself when untied)
        self.same_op = {r: find(r) for r in self.roots if self.graph.nodes[r].kind == "op"}
        self.stats["tied"] = tied

    def _colours(self, rounds: int = WL_ROUNDS) -> tuple[list[int], list[int]]:
        """A structural colour per node (Weisfeiler-Lehman refinement): the op itself, then
        ``rounds`` times the colours of its operands (in order), and the first round's tokens.
        Unlike program distances, colours match between layers whose backward pass reads
        forward values at different distances; few rounds keep the first and last layer,
        whose neighbours differ, tied."""
        nodes = self.graph.nodes
        tok = [hash((n.kind, n.op.primitive, n.op.in_shapes, n.op.out_shapes, n.op.out_dtypes,
                     repr(sorted((k, repr(v)[:200]) for k, v in n.op.params.items())),
                     tuple(self.names(n.id)) if n.kind == "input" else ()))
               for n in nodes]
        col = tok
        for _ in range(rounds):
            col = [hash((col[n.id],
                         tuple(None if v is None else (col[v.node], v.index) for v in n.operands)))
                   for n in nodes]
        return col, tok

    # -- shared latencies ----------------------------------------------------------------
    def _shared_latency(self) -> list[tuple[float, list[tuple[int, int]]]]:
        """One charge per group of collectives XLA runs as one call off the critical path
        (``CostModel.latency_group``): its latency, paid once by the plan if any chosen
        strategy emits one (node costs carry only their bandwidth), as predicted. Members are
        (root node, root strategy)."""
        members: dict[tuple[str, tuple[str, ...]], set[tuple[int, int]]] = \
            collections.defaultdict(set)
        latency: dict[tuple[str, tuple[str, ...]], float] = {}
        for node in sorted(self.off_path):
            root = self.root[node]
            for k, j in enumerate(self.fmap[node].tolist()):
                for c in self.strats[node][j].collectives:
                    key, lat = self.cost.latency_group(c), self.cost.latency(c)
                    if key is not None and lat > 0:
                        members[key].add((root, k))
                        latency[key] = lat
        return [(latency[key], sorted(members[key])) for key in sorted(members)]


def _op_key(n: Node) -> tuple:
    """What decides an op's strategies and costs: equal keys share them (repeated layers)."""
    op = n.op
    return (op.primitive, op.in_shapes, op.in_dtypes, op.out_shapes, op.out_dtypes,
            repr(sorted(op.params.items())))
