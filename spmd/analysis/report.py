"""What XLA actually emitted: collectives, bytes moved and memory of a compiled step.

The planner predicts which collectives a sharded train step needs and how many bytes each
moves; this module reads the *optimized* HLO of the compiled executable
(``compiled.as_text()``) and reports what XLA really did, so the two can be compared.

Counting rules:

* An instruction is a collective when its **opcode** (not its name) is one of
  ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all``, ``collective-permute``
  (plus ``ragged-all-to-all`` and ``collective-broadcast``, reported under their own keys
  when present). ``%all-reduce.3 = f32[8] fusion(...)`` is a fusion, not a collective.
* Async pairs count once: the ``-start`` form (``all-reduce-start``, ``all-gather-start``,
  ``collective-permute-start``, and the ``reduce-scatter-start``/``all-to-all-start``
  sugar for async-wrapped ops) counts, ``-update``/``-done`` never do. A generic
  ``async-start(...), calls=%wrapped`` is not counted itself; the collective inside the
  printed ``%wrapped`` computation is (so each op counts exactly once).
* Counts are **per execution**: a collective inside a while-loop body (a scan over layers)
  counts as often as the loop runs when XLA knows the trip count (``CollectiveOp.runs``);
  ``Report.static_collectives`` counts each printed instruction once.
  ``CollectiveOp.in_while`` and ``CollectiveOp.computation`` tell a caller which ops sit in
  loops.

Bytes per device (``B`` in DESIGN.md's cost model): the bytes one device holds *before* the
op (its operands) for all-reduce, reduce-scatter, all-to-all and collective-permute, and
*after* it (its result) for all-gather. Combined (tuple-shaped) collectives sum their
elements.

Replica groups are expanded to explicit device lists from all three printed forms:
``{{0,1},{2,3}}``, iota ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, and the mesh-axes form
``mesh['axis_0'=2,'axis_1'=4] {'axis_0'}`` that recent XLA prints. The ids are *logical*
ids, i.e. positions in the executable's device assignment (for a jit over one mesh: the
mesh's flat device order), not ``jax.Device.id``.

**Platform.** A report knows the platform its program was compiled for (``platform``). A
GPU plan compile-checked on CPU devices holds XLA:CPU's collectives; ``Report.on_platform("gpu")``
reads them as XLA:GPU emits them (``spmd.analysis.reconcile``: all-reduce + slice as a
reduce-scatter, a promoted bf16 all-reduce at bf16), and ``Report.record(mesh)`` does so for
a GPU mesh, keeping the raw CPU counts beside the reconciled ones.

>>> text = '''
... ENTRY %main (p: f32[8,16]) -> f32[8,16] {
...   %p = f32[8,16]{1,0} parameter(0)
...   ROOT %all-reduce.1 = f32[8,16]{1,0} all-reduce(%p), replica_groups=[2,4]<=[8], to_apply=%add
... }'''
>>> report = analyze_hlo_text(text)
>>> report.collectives["all-reduce"]
(1, 512)
>>> report.ops[0].replica_groups
[[0, 1, 2, 3], [4, 5, 6, 7]]
"""

from __future__ import annotations

import dataclasses
import functools
import io
from typing import Any, Sequence

from spmd.cost.partitioner import Collective
from spmd.cost.time import CostModel
from spmd.analysis.hlo import (
    COLLECTIVE_KINDS,
    CollectiveOp,
    Instruction,
    collective_ops,
    groups_to_mesh_axes,
    parse_instructions,
    parse_replica_groups,
    shape_bytes,
    tuple_elements,
)
from spmd.analysis.reconcile import GpuView, gpu_collectives
from spmd.units import readable_bytes

__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveOp",
    "MemoryReport",
    "Report",
    "analyze",
    "analyze_hlo_text",
    "compiled_platform",
    "groups_to_mesh_axes",
    "memory_report",
    "parse_replica_groups",
    "shape_bytes",
]


# ---------------------------------------------------------------------------- data types


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device memory XLA reports for a compiled executable (``memory_analysis()``).

    ``peak_bytes`` is ``argument + output + temp - alias`` unless the backend reports a peak
    of its own that holds the arguments and temporaries (XLA:CPU's leaves the temporaries
    out): arguments and outputs are all live when the step returns, ``temp`` is the scratch
    allocation XLA's buffer assignment sized for the live-range peak, and an aliased
    (donated) output reuses its argument's buffer, so it would otherwise be counted twice.
    Generated code is excluded (it is host memory on CPU and small on accelerators).
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    peak_bytes: int


@dataclasses.dataclass(frozen=True)
class Report:
    """What a compiled executable does: collectives, memory and flops, all per device.

    ``platform`` is the one whose collectives ``ops`` are (None: unknown, as for bare HLO
    text); ``instructions``, for a CPU compile, the parsed program, from which ``gpu`` reads
    the same collectives as XLA:GPU would emit them, when first asked (a GPU mesh's check:
    a CPU mesh never pays for it); ``reconciled_from`` is set on the report ``on_platform``
    made from it (the raw one).
    """

    ops: list[CollectiveOp]
    memory: MemoryReport | None = None
    flops: float | None = None
    platform: str | None = None
    instructions: Sequence[Instruction] | None = dataclasses.field(
        default=None, repr=False, compare=False)
    reconciled_from: "Report | None" = None

    @functools.cached_property
    def gpu(self) -> GpuView | None:
        """A CPU compile's collectives as XLA:GPU would emit them (None for any other)."""
        if self.platform != "cpu" or self.instructions is None:
            return None
        return gpu_collectives(self.instructions, self.ops)

    def on_platform(self, platform: str) -> "Report":
        """This report with the collectives ``platform``'s XLA emits: for a CPU compile read
        as ``"gpu"``, XLA:CPU's all-reduce + slice pairs as reduce-scatters and its promoted
        bf16 all-reduces at bf16 (``spmd.analysis.reconcile``); otherwise itself."""
        if platform != "gpu" or self.gpu is None:
            return self
        return dataclasses.replace(self, ops=self.gpu.ops, platform="gpu", instructions=None,
                                   reconciled_from=self)

    @property
    def collectives(self) -> dict[str, tuple[int, int]]:
        """``kind -> (count, bytes per device)`` per execution (loops' runs included); the
        five ``COLLECTIVE_KINDS`` always present."""
        return self._summary(per_run=True)

    @property
    def static_collectives(self) -> dict[str, tuple[int, int]]:
        """Like ``collectives``, each printed instruction counted once."""
        return self._summary(per_run=False)

    def _summary(self, per_run: bool) -> dict[str, tuple[int, int]]:
        out = {kind: (0, 0) for kind in COLLECTIVE_KINDS}
        for op in self.ops:
            count, nbytes = out.get(op.kind, (0, 0))
            runs = op.runs if per_run else 1
            out[op.kind] = (count + runs, nbytes + runs * op.bytes)
        return out

    def record(self, mesh) -> dict[str, Any]:
        """JSON-ready: collectives per kind as ``mesh``'s platform emits them
        (``on_platform``) and their total bytes, their time priced by the cost model on
        ``mesh`` (``comm_time``), memory (``peak_bytes`` and its parts) and FLOPs per device.
        ``platform`` says whose collectives they are; ``reconciled``, for a CPU compile read
        as XLA:GPU's, how many all-reduces became reduce-scatters or were counted at their
        own width, and the raw CPU ``collectives``. ``Plan.measured`` and every compared
        plan's entry hold this."""
        view = self.on_platform(mesh.platform)
        mem = self.memory
        comm, unpriced = view.comm_time(mesh)
        raw = view.reconciled_from
        return {
            "collectives": {k: [c, b] for k, (c, b) in view.collectives.items()},
            "total_collective_bytes": view.total_collective_bytes,
            "platform": view.platform,
            "reconciled": None if raw is None else {
                "compiled_on": raw.platform, "reduce_scatters": raw.gpu.scattered,
                "promoted": raw.gpu.promoted,
                "collectives": {k: [c, b] for k, (c, b) in raw.collectives.items()},
                "total_collective_bytes": raw.total_collective_bytes},
            "comm_time": comm, "unpriced_collectives": unpriced,
            "peak_bytes": None if mem is None else mem.peak_bytes,
            "memory": None if mem is None else dataclasses.asdict(mem),
            "flops": self.flops,
        }

    def comm_time(self, mesh) -> tuple[float, int]:
        """Seconds per execution of the collectives XLA emitted, each priced alone by spmd's
        cost model on ``mesh`` (a ``DeviceMesh``), and how many could not be priced (a
        collective-permute, or replica groups that are not whole mesh axes).

        Prices a program the search did not plan (a hand-written plan as XLA propagates it)
        on the same scale as a prediction's ``comm_time``. A combined op pays one latency
        where the platform runs it as one call, one per operand where it does not
        (XLA:CPU: ``CostModel.op_time``).
        """
        cost = CostModel(mesh)
        seconds, unpriced = 0.0, 0
        for op in self.ops:
            axes = (None if op.replica_groups is None
                    else groups_to_mesh_axes(op.replica_groups, dict(mesh.shape)))
            if axes is None:
                unpriced += op.runs
                continue
            # a synchronous op's tuple result holds one element per operand (an async
            # start's holds its operands and results: XLA:GPU's, one call whatever it holds)
            operands = len(tuple_elements(op.shape_text)) if op.opcode == op.kind else 1
            seconds += op.runs * cost.op_time(Collective(op.kind, axes, float(op.bytes)),
                                              operands)
        return seconds, unpriced

    @property
    def total_collective_bytes(self) -> int:
        """Bytes over every collective per execution (see module docstring)."""
        return sum(op.runs * op.bytes for op in self.ops)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the whole report."""
        return {
            "collectives": {k: {"count": c, "bytes": b} for k, (c, b) in self.collectives.items()},
            "total_collective_bytes": self.total_collective_bytes,
            "platform": self.platform,
            "memory": None if self.memory is None else dataclasses.asdict(self.memory),
            "flops": self.flops,
            "ops": [
                {
                    **dataclasses.asdict(op),
                    "source_target_pairs": (
                        None
                        if op.source_target_pairs is None
                        else [list(p) for p in op.source_target_pairs]
                    ),
                }
                for op in self.ops
            ],
        }

    def describe(self, width: int = 100) -> str:
        """A readable summary table (collectives, memory, flops) as plain text."""
        from rich import box
        from rich.console import Console
        from rich.table import Table

        console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
        title = (f"Collectives emitted by XLA{':' + self.platform.upper() if self.platform else ''}"
                 " (per device, per execution)")
        table = Table(title=title, box=box.SIMPLE_HEAD)
        table.add_column("collective")
        table.add_column("count", justify="right")
        table.add_column("bytes/device", justify="right")
        table.add_column("in while loops", justify="right")
        for kind, (count, nbytes) in self.collectives.items():
            looped = sum(1 for op in self.ops if op.kind == kind and op.in_while)
            table.add_row(kind, str(count), readable_bytes(nbytes), str(looped) if looped else "")
        table.add_row("total", str(len(self.ops)), readable_bytes(self.total_collective_bytes), "")
        console.print(table)
        if self.memory is None:
            console.print("memory: not reported by this backend (memory_analysis() is None)")
        else:
            mem = Table(title="Memory per device (memory_analysis)", box=box.SIMPLE_HEAD)
            mem.add_column("field")
            mem.add_column("bytes", justify="right")
            for field in dataclasses.fields(self.memory):
                mem.add_row(field.name, readable_bytes(getattr(self.memory, field.name)))
            console.print(mem)
        flops = "unknown" if self.flops is None else f"{self.flops:.4g}"
        console.print(f"flops per device: {flops}")
        return console.file.getvalue()


# ------------------------------------------------------------------------------ HLO text


def analyze_hlo_text(
    text: str, memory: MemoryReport | None = None, flops: float | None = None,
    platform: str | None = None,
) -> Report:
    """Parse optimized HLO text into a :class:`Report` (see module docstring for the rules).
    ``platform`` is the one it was compiled for; for ``"cpu"`` the report also holds its
    collectives as XLA:GPU would emit them (``Report.on_platform``).

    >>> hlo = '''
    ... %fusion.7 (p: f32[4]) -> f32[4] {
    ...   %p = f32[4]{0} parameter(0)
    ...   ROOT %n = f32[4]{0} negate(%p)
    ... }
    ... ENTRY %main (x: f32[4]) -> f32[4] {
    ...   %x = f32[4]{0} parameter(0)
    ...   %all-reduce.3 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fusion.7
    ...   %ag = (f32[4]{0}, f32[16]{0}) all-gather-start(%all-reduce.3), dimensions={0}
    ...   ROOT %agd = f32[16]{0} all-gather-done(%ag)
    ... }'''
    >>> collectives = analyze_hlo_text(hlo).collectives
    >>> collectives["all-gather"], collectives["all-reduce"]
    ((1, 64), (0, 0))
    """
    instrs = parse_instructions(text)
    return Report(ops=collective_ops(instrs), memory=memory, flops=flops, platform=platform,
                  instructions=instrs if platform == "cpu" else None)


# ------------------------------------------------------------------ compiled executables


def memory_report(compiled: Any) -> MemoryReport | None:
    """Per-device :class:`MemoryReport` of a ``jax.stages.Compiled``; None if unavailable."""
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):
        return None
    if stats is None:
        return None
    if isinstance(stats, (list, tuple)):  # older jax: one entry per program
        if not stats:
            return None
        stats = stats[0]

    def get(field: str) -> int:
        return int(getattr(stats, field, 0) or 0)

    argument, output = get("argument_size_in_bytes"), get("output_size_in_bytes")
    temp, alias = get("temp_size_in_bytes"), get("alias_size_in_bytes")
    # A program's temporaries are one allocation, held while its arguments are: a reported
    # peak under their sum leaves the temporaries out (XLA:CPU reports its arguments alone).
    reported = get("peak_memory_in_bytes")
    peak = reported if reported >= argument + temp else argument + output + temp - alias
    return MemoryReport(
        argument_bytes=argument,
        output_bytes=output,
        temp_bytes=temp,
        alias_bytes=alias,
        generated_code_bytes=get("generated_code_size_in_bytes"),
        peak_bytes=peak,
    )


def _flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except (NotImplementedError, RuntimeError):
        return None
    if isinstance(cost, (list, tuple)):  # older jax: a list with one dict per program
        cost = cost[0] if cost else None
    if not cost or cost.get("flops") is None:
        return None
    return float(cost["flops"])


def compiled_platform(compiled: Any) -> str | None:
    """The platform (``"cpu"``, ``"gpu"``, ...) a compiled executable runs on, read off the
    devices of its input and output shardings; None when it has neither."""
    import jax

    for sharding in jax.tree.leaves((compiled.input_shardings, compiled.output_shardings)):
        devices = getattr(sharding, "device_set", None)
        if devices:
            platform = next(iter(devices)).platform
            return "gpu" if platform in ("cuda", "rocm") else platform
    return None


def analyze(compiled: Any) -> Report:
    """Report the collectives, memory and flops of a compiled (sharded) executable.

    Args:
      compiled: a ``jax.stages.Compiled``, from ``jax.jit(f).lower(*args).compile()``.

    Returns:
      A :class:`Report`; all numbers are per device (the SPMD-partitioned program).

    >>> import jax, jax.numpy as jnp
    >>> report = analyze(jax.jit(lambda x: x @ x).lower(jnp.ones((4, 4))).compile())
    >>> report.collectives["all-reduce"], report.flops > 0
    ((0, 0), True)
    """
    memory, flops = memory_report(compiled), _flops(compiled)
    return analyze_hlo_text(compiled.as_text(), memory=memory, flops=flops,
                            platform=compiled_platform(compiled))
