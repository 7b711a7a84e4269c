"""Reading the text of optimized HLO: shapes, instructions, replica groups and collectives.

``spmd.analyze`` reports what XLA emitted for a compiled step; this module does the parsing
under it (``compiled.as_text()`` in, one ``CollectiveOp`` per collective out), so the report
and its summaries stay apart from the grammar of the printed HLO. The counting rules (which
opcodes count, async pairs, bytes per device, replica-group forms) are in ``spmd.analyze``'s
docstring.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence

import numpy as np

from spmd.cost.partitioner import COLLECTIVE_KINDS

__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveOp",
    "Instruction",
    "collective_ops",
    "groups_to_mesh_axes",
    "parse_instructions",
    "parse_replica_groups",
    "shape_bytes",
    "tuple_elements",
]

# COLLECTIVE_KINDS (spmd.cost.partitioner) are always present in Report.collectives, in that order.
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
        condition, so the op runs once per iteration.
      runs: how often the op runs per execution: the product of the known trip counts
        (``backend_config`` ``known_trip_count``, which XLA sets for scans) of the loops
        around it; a loop without a known count counts once.
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
    runs: int = 1
    source_target_pairs: list[tuple[int, int]] | None = None


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


def tuple_elements(shape_text: str) -> list[str]:
    """Top-level elements of a tuple shape (an array shape is one element).

    >>> tuple_elements("(f32[4]{0}, bf16[2,2])"), tuple_elements("f32[8]")
    (['f32[4]', 'bf16[2,2]'], ['f32[8]'])
    """
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
class Instruction:
    """One printed HLO instruction: ``name = shape opcode(operands), attrs``, in the
    computation whose body holds it (``spmd.analysis.reconcile`` follows values through them)."""

    name: str
    shape: str
    opcode: str
    operands: str
    attrs: str
    computation: str
    root: bool = False

    def operand_names(self) -> list[str]:
        """The operands' instruction names (without ``%``), in order."""
        return [o.split()[-1].lstrip("%") for o in _split_top(self.operands) if o]

    def called(self) -> list[str]:
        """The computations this instruction calls (fusion bodies, reducers, loop bodies)."""
        return [t.strip().lstrip("%") for _, target in _CALL_ATTRS.findall(self.attrs)
                for t in target.strip("{}").split(",") if t.strip()]


def _parse_instruction(line: str, computation: str) -> Instruction | None:
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
    return Instruction(
        name=m.group("name"),
        shape=shape,
        opcode=om.group("opcode"),
        operands=tail[open_at + 1 : close_at],
        attrs=tail[close_at + 1 :],
        computation=computation,
        root=line.lstrip().startswith("ROOT"),
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


def parse_instructions(text: str) -> list[Instruction]:
    """Every instruction of HLO text, in printed order (a collective it cannot read raises)."""
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
    instr: Instruction, shapes: dict[tuple[str, str], str], by_name: dict[str, str]
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


def _collective_bytes(instr: Instruction, kind: str, groups, shapes, by_name) -> int:
    is_start = instr.opcode.endswith("-start")
    elements = tuple_elements(instr.shape)
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


_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def _loop_runs(instrs: list[Instruction]) -> tuple[set[str], dict[str, int]]:
    """Computations inside a while loop (bodies, conditions, all they call), and how often
    each computation runs per execution (1 unless loops with known trip counts enclose it):
    one walk of the call graph from the computations nothing calls."""
    # caller -> [(callee, runs per call, whether the call enters a loop)]
    calls: dict[str, list[tuple[str, int, bool]]] = {}
    called: set[str] = set()
    for instr in instrs:
        trips = 1
        if instr.opcode == "while":
            m = _TRIP_COUNT.search(instr.attrs)
            trips = int(m.group(1)) if m else 1
        for attr, target in _CALL_ATTRS.findall(instr.attrs):
            names = {t.strip().lstrip("%") for t in target.strip("{}").split(",") if t.strip()}
            in_loop = instr.opcode == "while" and attr in ("body", "condition")
            calls.setdefault(instr.computation, []).extend(
                (n, trips if attr == "body" and in_loop else 1, in_loop) for n in names)
            called |= names
    looped: set[str] = set()
    runs: dict[str, int] = {}
    todo = [(c, 1, False) for c in calls if c not in called]
    while todo:
        comp, n, in_loop = todo.pop()
        if runs.get(comp, 0) >= n and (comp in looped or not in_loop):
            continue
        runs[comp] = max(runs.get(comp, 0), n)
        if in_loop:
            looped.add(comp)
        todo.extend((callee, n * k, in_loop or enters)
                    for callee, k, enters in calls.get(comp, ()))
    return looped, runs


def _source_target_pairs(attrs: str) -> list[tuple[int, int]] | None:
    m = re.search(r"source_target_pairs=\{((?:\{[^}]*\},?\s*)*)\}", attrs)
    if not m:
        return None
    return [tuple(_ints(p)) for p in re.findall(r"\{([^{}]*)\}", m.group(1))]


def collective_ops(text: str | Sequence[Instruction]) -> list[CollectiveOp]:
    """Every collective of optimized HLO text (or its ``parse_instructions``), in printed
    order (rules: ``spmd.analyze``)."""
    instrs = parse_instructions(text) if isinstance(text, str) else list(text)
    shapes = {(i.computation, i.name): i.shape for i in instrs}
    by_name = {i.name: i.shape for i in instrs}
    looped, runs = _loop_runs(instrs)
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
                runs=runs.get(instr.computation, 1),
                source_target_pairs=_source_target_pairs(instr.attrs),
            )
        )
    return ops
