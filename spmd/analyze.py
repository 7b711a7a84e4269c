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
* Counts are **static**: a collective inside a while-loop body counts once, however many
  times the loop runs. ``CollectiveOp.in_while`` and ``CollectiveOp.computation`` tell a
  caller which ops sit in loops.

Bytes per device (``B`` in DESIGN.md's cost model): the bytes one device holds *before* the
op (its operands) for all-reduce, reduce-scatter, all-to-all and collective-permute, and
*after* it (its result) for all-gather. Combined (tuple-shaped) collectives sum their
elements.

Replica groups are expanded to explicit device lists from all three printed forms:
``{{0,1},{2,3}}``, iota ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, and the mesh-axes form
``mesh['axis_0'=2,'axis_1'=4] {'axis_0'}`` that recent XLA prints. The ids are *logical*
ids, i.e. positions in the executable's device assignment (for a jit over one mesh: the
mesh's flat device order), not ``jax.Device.id``.

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
import io
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveOp",
    "MemoryReport",
    "Report",
    "analyze",
    "analyze_hlo_text",
    "groups_to_mesh_axes",
    "memory_report",
    "parse_replica_groups",
    "shape_bytes",
]

# Always present in Report.collectives, in this order.
COLLECTIVE_KINDS = (
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
)  # fmt: skip
_EXTRA_KINDS = ("ragged-all-to-all", "collective-broadcast")
_ALL_KINDS = COLLECTIVE_KINDS + _EXTRA_KINDS

# Bits per element of each HLO primitive type (xla/xla_data.proto). Sub-byte types are
# rounded up to whole bytes per array.
_DTYPE_BITS = {
    "pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4,
    "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f4e2m1fn": 4, "f8e8m0fnu": 8, "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8,
    "f8e4m3fnuz": 8, "f8e4m3b11fnuz": 8, "f8e5m2": 8, "f8e5m2fnuz": 8,
    "token": 0, "opaque": 0,
}  # fmt: skip

# ---------------------------------------------------------------------------- data types


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of the optimized HLO.

    Attributes:
      kind: one of ``COLLECTIVE_KINDS`` (or an extra kind such as ``ragged-all-to-all``).
      name: the instruction name without ``%``.
      bytes: bytes per device, ``B`` (operands, or result for all-gather).
      shape_text: the instruction's printed result shape.
      replica_groups: explicit groups of logical device ids; ``[]`` means one group of all
        devices (HLO's ``{}``); ``None`` when the op has none (collective-permute).
      computation: name of the HLO computation whose body holds the instruction.
      opcode: the printed opcode, e.g. ``all-gather-start``.
      in_while: the computation is (transitively) called from a while loop body or
        condition, so the op runs once per iteration but is counted once.
      source_target_pairs: for collective-permute, the ``(source, target)`` pairs.
    """

    kind: str
    name: str
    bytes: int
    shape_text: str
    replica_groups: list[list[int]] | None
    computation: str
    opcode: str = ""
    in_while: bool = False
    source_target_pairs: list[tuple[int, int]] | None = None


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device memory XLA reports for a compiled executable (``memory_analysis()``).

    ``peak_bytes`` is ``argument + output + temp - alias`` unless the backend reports its own
    peak: arguments and outputs are all live when the step returns, ``temp`` is the scratch
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
    """What a compiled executable does: collectives, memory and flops, all per device."""

    ops: list[CollectiveOp]
    memory: MemoryReport | None = None
    flops: float | None = None

    @property
    def collectives(self) -> dict[str, tuple[int, int]]:
        """``kind -> (count, bytes per device)``; the five ``COLLECTIVE_KINDS`` always present."""
        out = {kind: (0, 0) for kind in COLLECTIVE_KINDS}
        for op in self.ops:
            count, nbytes = out.get(op.kind, (0, 0))
            out[op.kind] = (count + 1, nbytes + op.bytes)
        return out

    @property
    def total_collective_bytes(self) -> int:
        """Sum of ``bytes`` over every collective op (static count, see module docstring)."""
        return sum(op.bytes for op in self.ops)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of the whole report."""
        return {
            "collectives": {k: {"count": c, "bytes": b} for k, (c, b) in self.collectives.items()},
            "total_collective_bytes": self.total_collective_bytes,
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
        title = "Collectives emitted by XLA (per device, static count)"
        table = Table(title=title, box=box.SIMPLE_HEAD)
        table.add_column("collective")
        table.add_column("count", justify="right")
        table.add_column("bytes/device", justify="right")
        table.add_column("in while loops", justify="right")
        for kind, (count, nbytes) in self.collectives.items():
            looped = sum(1 for op in self.ops if op.kind == kind and op.in_while)
            table.add_row(kind, str(count), _fmt_bytes(nbytes), str(looped) if looped else "")
        table.add_row("total", str(len(self.ops)), _fmt_bytes(self.total_collective_bytes), "")
        console.print(table)
        if self.memory is None:
            console.print("memory: not reported by this backend (memory_analysis() is None)")
        else:
            mem = Table(title="Memory per device (memory_analysis)", box=box.SIMPLE_HEAD)
            mem.add_column("field")
            mem.add_column("bytes", justify="right")
            for field in dataclasses.fields(self.memory):
                mem.add_row(field.name, _fmt_bytes(getattr(self.memory, field.name)))
            console.print(mem)
        flops = "unknown" if self.flops is None else f"{self.flops:.4g}"
        console.print(f"flops per device: {flops}")
        return console.file.getvalue()


def _fmt_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------- shape parsing

_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_COMMENT_RE = re.compile(r"/\*.*?\*/")


def shape_bytes(shape_text: str) -> int:
    """Bytes of every array in an HLO shape (tuples summed, layouts ignored).

    >>> shape_bytes("f32[8,16]{1,0}"), shape_bytes("(bf16[4], s8[2,2])"), shape_bytes("f32[]")
    (512, 12, 4)
    """
    text = _COMMENT_RE.sub("", _strip_layouts(shape_text))
    total = 0
    for dtype, dims in _ARRAY_RE.findall(text):
        bits = _DTYPE_BITS.get(dtype)
        if bits is None:
            raise ValueError(f"unknown HLO element type {dtype!r} in shape {shape_text!r}")
        n = math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
        total += (n * bits + 7) // 8
    return total


def _strip_layouts(text: str) -> str:
    # Layouts `{1,0:T(8,128)}` follow `]`; drop them so their parentheses cannot confuse us.
    out, depth, i = [], 0, 0
    while i < len(text):
        ch = text[i]
        if ch == "{" and (depth or (i > 0 and text[i - 1] == "]")):
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
        elif not depth:
            out.append(ch)
        i += 1
    return "".join(out)


def _match_close(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``text[start]``."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = []
    for i in range(start, len(text)):
        ch = text[i]
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i
    raise ValueError(f"unbalanced brackets in {text[start:start + 80]!r}")


def _split_top(text: str, sep: str = ",") -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _tuple_elements(shape_text: str) -> list[str]:
    """Top-level elements of a tuple shape (an array shape is one element)."""
    text = _COMMENT_RE.sub("", _strip_layouts(shape_text)).strip()
    if text.startswith("(") and _match_close(text, 0) == len(text) - 1:
        return _split_top(text[1:-1])
    return [text]


# ------------------------------------------------------------------- instruction parsing

# `name = <shape> ...`, where a shape is a tuple `(...)` or an array `f32[...]`.
_INSTR_START = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=(){}]+)\s*=\s*(?P<rest>(?:\(|[a-z][a-z0-9]*\[).*)$"
)
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_OPCODE = re.compile(r"\s*(?P<opcode>[a-z][a-z0-9\-]*)\(")


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: str
    attrs: str
    computation: str


def _parse_instruction(line: str, computation: str) -> _Instr | None:
    m = _INSTR_START.match(line)
    if not m:
        return None
    rest = m.group("rest")
    try:
        if rest.startswith("("):
            end = _match_close(rest, 0) + 1
        else:
            end = 0
            while end < len(rest) and not rest[end].isspace():
                if rest[end] == "{":  # layout, may hold `T(8,128)`
                    end = _match_close(rest, end)
                end += 1
        shape, tail = rest[:end], rest[end:]
        om = _OPCODE.match(tail)
        if not om or not (shape.startswith("(") or _ARRAY_RE.match(shape)):
            return None
        open_at = om.end() - 1
        close_at = _match_close(tail, open_at)
    except ValueError:  # unbalanced: not an instruction we can read
        return None
    return _Instr(
        name=m.group("name"),
        shape=shape,
        opcode=om.group("opcode"),
        operands=tail[open_at + 1 : close_at],
        attrs=tail[close_at + 1 :],
        computation=computation,
    )


def _logical_lines(text: str) -> Iterable[str]:
    """Lines of HLO text, with hand-wrapped instructions joined back into one line."""
    current: str | None = None
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line.strip():
            continue
        starts = (
            _INSTR_START.match(line)
            or _HEADER.match(line)
            or line.strip().startswith(("}", "HloModule"))
        )
        if starts or current is None:
            if current is not None:
                yield current
            current = line
        else:
            current += " " + line.strip()
    if current is not None:
        yield current


_COLLECTIVE_HINT = re.compile(r"\s(?:" + "|".join(_ALL_KINDS) + r")(?:-start)?\(")


def _parse_module(text: str) -> list[_Instr]:
    instrs, computation = [], ""
    for line in _logical_lines(text):
        instr = _parse_instruction(line, computation)
        if instr is not None:
            instrs.append(instr)
            continue
        header = _HEADER.match(line)
        if header:
            computation = header.group("name")
        elif _COLLECTIVE_HINT.search(line):  # never drop a collective silently
            raise ValueError(f"cannot parse HLO instruction: {line.strip()[:160]!r}")
    return instrs


# ------------------------------------------------------------------------ replica groups

_IOTA_RE = re.compile(
    r"^\[(?P<dims>[\d,\s]+)\]<=\[(?P<reshape>[\d,\s]+)\](?:T\((?P<perm>[\d,\s]+)\))?"
)
_MESH_RE = re.compile(
    r"^mesh\[(?P<axes>[^\]]*)\]"
    r"(?:\s*,\s*device_ids=\((?P<ids>[^)]*\)?[^)]*)\))?"
    r"\s*\{(?P<groups>[^}]*)\}"
)


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def _iota(reshape: list[int], perm: list[int] | None) -> np.ndarray:
    arr = np.arange(math.prod(reshape)).reshape(reshape)
    return (arr.transpose(perm) if perm else arr).reshape(-1)


def parse_replica_groups(attrs: str) -> list[list[int]] | None:
    """Explicit replica groups from an instruction's attribute text; ``None`` if absent.

    ``[]`` is returned for ``replica_groups={}``, which HLO reads as one group of all devices.

    >>> parse_replica_groups("channel_id=1, replica_groups={{0,2},{1,3}}, dimensions={0}")
    [[0, 2], [1, 3]]
    >>> parse_replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)")
    [[0, 4], [1, 5], [2, 6], [3, 7]]
    >>> parse_replica_groups("replica_groups=mesh['x'=2,'y'=4] {'x'}")
    [[0, 4], [1, 5], [2, 6], [3, 7]]
    """
    at = attrs.find("replica_groups=")
    if at < 0:
        return None
    text = attrs[at + len("replica_groups=") :].lstrip()
    if text.startswith("{"):
        body = text[: _match_close(text, 0) + 1]
        return [_ints(g) for g in re.findall(r"\{([^{}]*)\}", body[1:-1])]
    m = _IOTA_RE.match(text)
    if m:
        dims = _ints(m.group("dims"))
        flat = _iota(_ints(m.group("reshape")), _ints(m.group("perm")) if m.group("perm") else None)
        return flat.reshape(dims).tolist()
    m = _MESH_RE.match(text)
    if m:
        return _mesh_axes_groups(m.group("axes"), m.group("ids"), m.group("groups"))
    raise ValueError(f"cannot parse replica_groups in {text[:120]!r}")


def _mesh_axes_groups(axes_text: str, ids_text: str | None, groups_text: str) -> list[list[int]]:
    """Expand XLA's MeshAxesReplicaGroupList (xla/hlo/ir/replica_group.cc)."""
    names, sizes = [], []
    for item in _split_top(axes_text):
        name, size = item.rsplit("=", 1)
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    n = math.prod(sizes)
    if not ids_text:
        devices = np.arange(n)
    elif ids_text.strip().startswith("["):  # iota: [reshape]T(perm) or [dims]<=[reshape]T(perm)
        parts = re.match(
            r"\s*(?:\[[\d,]+\]<=)?\[(?P<r>[\d,]+)\](?:T\((?P<p>[\d,]+)\))?", ids_text
        )
        perm = _ints(parts.group("p")) if parts.group("p") else None
        devices = _iota(_ints(parts.group("r")), perm)
    else:
        devices = np.array(_ints(ids_text))
    # Each referenced axis is either whole (`'x'`) or a sub-axis (`'x':(pre)size`). Split every
    # mesh axis into the pieces its references need, then group over the referenced pieces.
    refs = []  # (axis index, pre_size or None, size or None)
    for item in _split_top(groups_text):
        m = re.match(r"""\s*['"]?([^'":]+)['"]?\s*(?::\((\d+)\)(\d+))?\s*$""", item)
        axis = names.index(m.group(1))
        pre, size = (int(m.group(2)), int(m.group(3))) if m.group(2) else (None, None)
        refs.append((axis, pre, size))
    dims, ref_dim = [], {}
    for axis, full in enumerate(sizes):
        mine = sorted((r for r in refs if r[0] == axis), key=lambda r: r[1] or 1)
        if not mine or mine[0][1] is None:
            if mine:
                ref_dim[mine[0]] = len(dims)
            dims.append(full)
            continue
        done = 1
        for ref in mine:
            pre, size = ref[1], ref[2]
            if pre != done:
                dims.append(pre // done)
                done = pre
            ref_dim[ref] = len(dims)
            dims.append(size)
            done *= size
        if done != full:
            dims.append(full // done)
    grouped = [ref_dim[r] for r in refs]
    order = [d for d in range(len(dims)) if d not in grouped] + grouped
    group_size = math.prod(dims[d] for d in grouped)
    return devices.reshape(dims).transpose(order).reshape(-1, group_size).tolist()


def groups_to_mesh_axes(
    groups: Sequence[Sequence[int]],
    mesh_shape: dict[str, int],
    device_ids: Sequence[int] | None = None,
) -> tuple[str, ...] | None:
    """The mesh axes a collective's replica groups span, or ``None`` if not whole axes.

    Args:
      groups: replica groups as in ``CollectiveOp.replica_groups`` (``[]`` = all devices).
      mesh_shape: axis name -> size, in mesh order (``dict(mesh.shape)``).
      device_ids: the id each mesh position has in ``groups``, in mesh (row-major) order.
        Default ``range(n)``: HLO ids are positions in the executable's device assignment,
        which for a jit over one mesh is the mesh's flat device order.

    >>> groups_to_mesh_axes([[0, 4], [1, 5], [2, 6], [3, 7]], {"data": 2, "model": 4})
    ('data',)
    >>> groups_to_mesh_axes([[0, 1], [2, 3], [4, 5], [6, 7]], {"data": 2, "model": 4}) is None
    True
    """
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    n = math.prod(sizes)
    ids = list(range(n)) if device_ids is None else list(device_ids)
    if not groups:
        return tuple(name for name, size in zip(names, sizes) if size > 1)
    position = {d: i for i, d in enumerate(ids)}
    try:
        coords = [np.unravel_index([position[d] for d in g], sizes) for g in groups]
    except KeyError:
        return None
    varying = sorted({a for c in coords for a in range(len(sizes)) if len(set(c[a].tolist())) > 1})
    grid = np.array(ids).reshape(sizes)
    order = [a for a in range(len(sizes)) if a not in varying] + varying
    expected = grid.transpose(order).reshape(-1, math.prod(sizes[a] for a in varying))
    if {frozenset(g) for g in expected.tolist()} != {frozenset(g) for g in groups}:
        return None
    return tuple(names[a] for a in varying)


# -------------------------------------------------------------------- collective parsing


def _kind_of(opcode: str) -> str | None:
    """The collective kind an opcode counts as, or None (``-done``/``-update``/others)."""
    if opcode in _ALL_KINDS:
        return opcode
    if opcode.endswith("-start") and opcode[: -len("-start")] in _ALL_KINDS:
        return opcode[: -len("-start")]
    return None


def _operand_bytes(
    instr: _Instr, shapes: dict[tuple[str, str], str], by_name: dict[str, str]
) -> int | None:
    """Summed operand bytes, shapes printed inline or looked up by name; None if unknown."""
    total = 0
    for operand in _split_top(instr.operands):
        if not operand:
            continue
        name = operand.split()[-1].lstrip("%")
        inline = operand[: len(operand) - len(operand.split()[-1])].strip()
        shape = inline or shapes.get((instr.computation, name)) or by_name.get(name)
        if shape is None:
            return None
        total += shape_bytes(shape)
    return total


def _collective_bytes(instr: _Instr, kind: str, groups, shapes, by_name) -> int:
    is_start = instr.opcode.endswith("-start")
    elements = _tuple_elements(instr.shape)
    if kind == "all-gather":
        # all-gather-start returns (operands, results); the sync form returns the results.
        if is_start and len(elements) >= 2:
            return shape_bytes(elements[1])
        return shape_bytes(instr.shape)
    known = _operand_bytes(instr, shapes, by_name)
    if known is not None:
        return known
    # Operands not found: read them off the result shape.
    if is_start and kind != "all-reduce":
        # collective-permute-start: (operand, result, context...);
        # async sugar (reduce-scatter-start, ...): ((operands...), results, context...).
        return shape_bytes(elements[0])
    nbytes = shape_bytes(instr.shape)
    if kind == "reduce-scatter":
        size = len(groups[0]) if groups else 1
        nbytes *= size
    return nbytes


_CALL_ATTRS = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|"
    r"branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)


def _loop_computations(instrs: list[_Instr]) -> set[str]:
    """Computations that run inside a while loop (bodies, conditions and all they call)."""
    calls: dict[str, set[str]] = {}
    roots: set[str] = set()
    for instr in instrs:
        for attr, target in _CALL_ATTRS.findall(instr.attrs):
            names = {t.strip().lstrip("%") for t in target.strip("{}").split(",") if t.strip()}
            calls.setdefault(instr.computation, set()).update(names)
            if instr.opcode == "while" and attr in ("body", "condition"):
                roots |= names
    seen, todo = set(), list(roots)
    while todo:
        comp = todo.pop()
        if comp not in seen:
            seen.add(comp)
            todo.extend(calls.get(comp, ()))
    return seen


def _source_target_pairs(attrs: str) -> list[tuple[int, int]] | None:
    m = re.search(r"source_target_pairs=\{((?:\{[^}]*\},?\s*)*)\}", attrs)
    if not m:
        return None
    return [tuple(_ints(p)) for p in re.findall(r"\{([^{}]*)\}", m.group(1))]


def analyze_hlo_text(
    text: str, memory: MemoryReport | None = None, flops: float | None = None
) -> Report:
    """Parse optimized HLO text into a :class:`Report` (see module docstring for the rules).

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
    instrs = _parse_module(text)
    shapes = {(i.computation, i.name): i.shape for i in instrs}
    by_name = {i.name: i.shape for i in instrs}
    looped = _loop_computations(instrs)
    ops = []
    for instr in instrs:
        kind = _kind_of(instr.opcode)
        if kind is None:
            continue
        groups = parse_replica_groups(instr.attrs)
        ops.append(
            CollectiveOp(
                kind=kind,
                name=instr.name,
                bytes=_collective_bytes(instr, kind, groups, shapes, by_name),
                shape_text=instr.shape,
                replica_groups=groups,
                computation=instr.computation,
                opcode=instr.opcode,
                in_while=instr.computation in looped,
                source_target_pairs=_source_target_pairs(instr.attrs),
            )
        )
    return Report(ops=ops, memory=memory, flops=flops)


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
    peak = get("peak_memory_in_bytes") or argument + output + temp - alias
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
    return analyze_hlo_text(compiled.as_text(), memory=memory, flops=flops)
