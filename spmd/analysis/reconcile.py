"""A CPU compile of a GPU plan, its collectives read back as XLA:GPU emits them.

A plan for a GPU cluster that is not present (a virtual mesh) is priced with XLA:GPU's
collectives (``spmd.cost.partitioner``) but compile-checked on simulated CPU devices, and
XLA:CPU emits two things differently:

* **No reduce-scatter.** The SPMD partitioner finishes a partial sum that each device keeps a
  piece of as an all-reduce whose result is dynamic-sliced along the reduced group. XLA:GPU's
  ReduceScatterCreator pass turns that pair into one reduce-scatter (same B, the bytes before
  it; half the ring traffic); XLA:CPU leaves the all-reduce and slices after it (often inside
  a fusion, after the all-reduce combiner merged it with others into one tuple).
* **Promotion.** XLA:CPU's AllReducePromotion runs bf16 (and f16) all-reduces in f32: it
  converts, all-reduces with a reducer renamed ``*_promoted``, and converts back. XLA:GPU
  reduces them at their own width.

``gpu_collectives`` undoes both on the parsed program, so predicted and compiled bytes stay
comparable: per tensor of each all-reduce (a combined one holds several), it follows the
result through get-tuple-element, bitcast, reshape and copy (and the convert back, for a
promoted one), into and out of fusions, to where it is used; a tensor used only by
dynamic-slices that keep 1/n of it along one dim, n the all-reduce's group size, is counted
as a reduce-scatter, and a promoted tensor at the width it is converted back to. Everything
else is left as XLA:CPU emitted it. ``spmd.analyze`` applies it to every CPU compile and
``Report.on_platform("gpu")`` reads the result; the raw counts stay in the report.

>>> hlo = '''
... ENTRY %main (p: f32[8,16]) -> f32[8,4] {
...   %p = f32[8,16]{1,0} parameter(0)
...   %pid = u32[] partition-id()
...   %ar = f32[8,16]{1,0} all-reduce(%p), replica_groups=[2,4]<=[8], to_apply=%add
...   %i = s32[] convert(%pid)
...   ROOT %ds = f32[8,4]{1,0} dynamic-slice(%ar, %i, %i), dynamic_slice_sizes={8,4}
... }'''
>>> view = gpu_collectives(parse_instructions(hlo))
>>> [(op.kind, op.bytes) for op in view.ops], view.scattered
([('reduce-scatter', 512)], 1)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from spmd.analysis.hlo import (
    CollectiveOp,
    Instruction,
    collective_ops,
    parse_instructions,
    shape_bytes,
    tuple_elements,
)

__all__ = ["GpuView", "gpu_collectives", "parse_instructions"]

#: opcodes a value passes through unchanged on its way to a dynamic-slice
_TRANSPARENT = ("bitcast", "reshape", "copy")
_INDEX = re.compile(r"\bindex=(\d+)")
_ARRAY = re.compile(r"^\s*([a-z][a-z0-9]*)\[([^\]]*)\]")
_FLOAT_BITS = {"f16": 16, "bf16": 16, "f32": 32, "f64": 64}


@dataclasses.dataclass(frozen=True)
class GpuView:
    """A CPU-compiled program's collectives as XLA:GPU would emit them.

    Attributes:
      ops: the collectives, all-reduce + slice pairs as reduce-scatters and promoted
        all-reduces at their own width (an all-reduce holding both kinds of tensor split in
        two ops of one name).
      scattered: all-reduces (instructions) with a tensor counted as a reduce-scatter.
      promoted: all-reduces (instructions) XLA:CPU promoted, counted at their own width.
    """

    ops: list[CollectiveOp]
    scattered: int = 0
    promoted: int = 0


@dataclasses.dataclass(frozen=True)
class _Use:
    """Where a value ends up: a dynamic-slice (how it splits its operand), or anything else."""

    slice_shape: tuple[tuple[int, ...], tuple[int, ...]] | None  # (operand dims, result dims)
    narrowed_to: str | None = None  # the float type a convert on the way narrowed it to


class _Program:
    """Instructions by name, their users, fusion parameters and callers: the data flow."""

    def __init__(self, instrs: Sequence[Instruction]):
        self.by_key = {(i.computation, i.name): i for i in instrs}
        self.users: dict[tuple[str, str], list[Instruction]] = {}
        self.params: dict[tuple[str, int], Instruction] = {}
        #: each computation's ROOT instruction
        self.roots = {i.computation: i.name for i in instrs if i.root}
        self.callers: dict[str, list[Instruction]] = {}
        for i in instrs:
            for name in i.operand_names():
                self.users.setdefault((i.computation, name), []).append(i)
            if i.opcode == "parameter":
                self.params[(i.computation, int(i.operands.strip() or 0))] = i
            for callee in i.called():
                self.callers.setdefault(callee, []).append(i)

    def uses(self, comp: str, name: str, promoted: bool, narrowed: str | None,
             seen: set[tuple[str, str]]) -> list[_Use]:
        """Every final use of value ``name`` of computation ``comp``, through the ops a
        reduce-scatter's result may pass on the way to its slice."""
        if (comp, name) in seen:
            return []
        seen.add((comp, name))
        out: list[_Use] = []
        if self.roots.get(comp) == name:  # a fusion's result: continue after the fusion
            callers = self.callers.get(comp, [])
            if not callers or any(c.opcode != "fusion" for c in callers):
                return [_Use(None, narrowed)]  # the program's output, or a loop's or call's result
            for fusion in callers:
                out += self.uses(fusion.computation, fusion.name, promoted, narrowed, seen)
        for user in self.users.get((comp, name), []):
            if user.opcode in _TRANSPARENT or user.opcode == "get-tuple-element":
                out += self.uses(comp, user.name, promoted, narrowed, seen)
            elif user.opcode == "convert" and promoted:  # back to its width (or on to f32)
                out += self.uses(comp, user.name, promoted, _narrower(narrowed, _dtype(user.shape)),
                                 seen)
            elif user.opcode == "dynamic-slice" and user.operand_names()[0] == name:
                operand = self.by_key.get((comp, name))
                dims = (_dims(operand.shape) if operand else (), _dims(user.shape))
                out.append(_Use(dims, narrowed))
            elif user.opcode == "fusion":
                body = user.called()[0]
                for k, operand in enumerate(user.operand_names()):
                    param = self.params.get((body, k))
                    if operand == name and param is not None:
                        out += self.uses(body, param.name, promoted, narrowed, seen)
            else:
                out.append(_Use(None, narrowed))
        return out


def _dtype(shape: str) -> str | None:
    m = _ARRAY.match(shape)
    return m.group(1) if m else None


def _narrower(a: str | None, b: str | None) -> str | None:
    """The narrower of two float types (either may be None or not a float)."""
    bits = lambda t: _FLOAT_BITS.get(t or "", 1 << 10)  # noqa: E731
    return a if bits(a) <= bits(b) else b


def _dims(shape: str) -> tuple[int, ...]:
    m = _ARRAY.match(shape)
    if not m:
        return ()
    return tuple(int(d.strip().lstrip("<=")) for d in m.group(2).split(",") if d.strip())


def _scattered(uses: list[_Use], group: int | None) -> bool:
    """Every use a dynamic-slice keeping 1/group of its operand along one dim (the piece of
    a reduce-scatter): what XLA:GPU's ReduceScatterCreator would fuse with the all-reduce.
    ``group`` None (replica groups ``{}``: all devices, count unknown here) takes any n > 1."""
    if not uses:
        return False
    for use in uses:
        if use.slice_shape is None:
            return False
        before, after = use.slice_shape
        if len(before) != len(after) or not before:
            return False
        shrunk = [(b, a) for b, a in zip(before, after) if b != a]
        if len(shrunk) != 1 or shrunk[0][1] == 0 or shrunk[0][0] % shrunk[0][1]:
            return False
        factor = shrunk[0][0] // shrunk[0][1]
        if factor <= 1 or (group is not None and factor != group):
            return False
    return True


def _narrow_bytes(element: str, uses: list[_Use]) -> int:
    """A promoted tensor's bytes at the width it is converted back to (its own)."""
    nbytes = shape_bytes(element)
    widths = {u.narrowed_to for u in uses}
    wide, narrow = _dtype(element), (widths.pop() if len(widths) == 1 else None)
    if narrow in _FLOAT_BITS and wide in _FLOAT_BITS and _FLOAT_BITS[narrow] < _FLOAT_BITS[wide]:
        return nbytes * _FLOAT_BITS[narrow] // _FLOAT_BITS[wide]
    return nbytes


def _reconcile(op: CollectiveOp, instr: Instruction,
               program: _Program) -> tuple[list[CollectiveOp], bool, bool]:
    """One all-reduce as XLA:GPU emits it: (ops, whether scattered, whether promoted)."""
    promoted = any(t.endswith("_promoted") or t.endswith(".promoted") for t in instr.called())
    group = len(op.replica_groups[0]) if op.replica_groups else None
    elements = tuple_elements(instr.shape)
    is_tuple = instr.shape.lstrip().startswith("(")
    reduced = scattered = 0
    for k, element in enumerate(elements):
        if is_tuple:
            starts = [u.name for u in program.users.get((instr.computation, instr.name), [])
                      if u.opcode == "get-tuple-element" and _INDEX.search(u.attrs)
                      and int(_INDEX.search(u.attrs).group(1)) == k]
        else:
            starts = [instr.name]
        uses = [u for s in starts for u in program.uses(instr.computation, s, promoted, None, set())]
        nbytes = _narrow_bytes(element, uses) if promoted else shape_bytes(element)
        if _scattered(uses, group):
            scattered += nbytes
        else:
            reduced += nbytes
    out = []
    if reduced or not scattered:
        out.append(dataclasses.replace(op, bytes=reduced))
    if scattered:
        out.append(dataclasses.replace(op, kind="reduce-scatter", bytes=scattered))
    return out, bool(scattered), promoted and sum(o.bytes for o in out) != op.bytes


def gpu_collectives(instrs: Sequence[Instruction],
                    ops: Sequence[CollectiveOp] | None = None) -> GpuView:
    """The collectives of a CPU-compiled program (``parse_instructions`` of its optimized
    HLO; ``ops`` its ``collective_ops`` when already read) as XLA:GPU would emit them
    (the rules of the module docstring)."""
    ops = collective_ops(instrs) if ops is None else ops
    program = _Program(instrs)
    out: list[CollectiveOp] = []
    scattered = promoted = 0
    for op in ops:
        instr = program.by_key.get((op.computation, op.name))
        if op.kind != "all-reduce" or instr is None or instr.opcode != "all-reduce":
            out.append(op)
            continue
        got, was_scattered, was_promoted = _reconcile(op, instr, program)
        out += got
        scattered += was_scattered
        promoted += was_promoted
    return GpuView(ops=out, scattered=scattered, promoted=promoted)
