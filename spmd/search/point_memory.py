"""What one plan holds at one program point, as solver terms: a liveness set that also sees
the buffers a plan adds beside the graph's values (``spmd.memory.liveness.Buffer``).

The busiest points' sets (``spmd.search.encode``) charge each group the values it makes that
are live there. A plan also holds copies of values in another spec (an all-gathered weight
for its matmuls) and partial sums before their reduction, which ``predict`` counts and those
sets do not. A value's copy in a spec lives from its first reader in that spec to its last,
so it is live at a point when readers on both sides of it want that spec and its producer's
spec differs: a ``spmd.solver.request.Copy``. Where a plan's predicted peak lies above the
budget at a point, the search adds that point's set (``IntraOp.search(points=...)``): its
values, the copies live there, and the partial sums of the op that runs at it.

Every term is one ``predict`` counts at that point for the same assignment, so the set
never shuts out a plan whose prediction fits there. It leaves out the partial sums of ops
before the point that wait there for a combined collective (they depend on where the
combined group ends).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from spmd.cost.partitioner import PARTIAL_SUM_KINDS
from spmd.solver.request import Copy, copy_held
from spmd.trace.graph import Value

if TYPE_CHECKING:
    from spmd.search.encode import Encoding

__all__ = ["held", "point_terms"]


def point_terms(enc: "Encoding", t: int) -> tuple[dict[int, np.ndarray], list[Copy]]:
    """The bytes per device live at program point ``t``: per request group, its values'
    (and, for the op at ``t``, its partial sums') bytes per strategy; and the copies."""
    cg = enc.cg
    live, nodes = cg.liveness, cg.graph.nodes
    unary: dict[int, np.ndarray] = {}

    def add(g: int, row: np.ndarray) -> None:
        unary[g] = unary[g] + row if g in unary else row.copy()

    for idx in live.live_at(t).tolist():
        if live.fused[idx]:  # in memory only when resharded: its copies count it
            continue
        v = live.intervals[idx][0]
        add(enc.index[cg.root[v.node]], cg.bytes_row(v, enc.spec_list(v.node, v.index, True)))
    if t < len(nodes) and nodes[t].kind == "op":
        add(enc.index[cg.root[t]], _partial_sums(enc, t))
    copies = [c for v, reads in cg.reads.items() if v.node not in cg.constant_made
              and (c := _copy(enc, v, [r for r in reads if r.node <= t],
                              [r for r in reads if r.node >= t])) is not None]
    return unary, copies


def _copy(enc: "Encoding", v: Value, before, after) -> Copy | None:
    """The copies of ``v`` that readers ``before`` and ``after`` a point may want."""
    if not before or not after:
        return None
    cg = enc.cg
    wanted = [(enc.index[cg.root[r.node]], enc.spec_list(r.node, r.operand, False))
              for r in (*before, *after)]
    targets = list(dict.fromkeys(spec for _, specs in wanted for spec in specs))
    src = enc.spec_list(v.node, v.index, True)
    full = cg.bytes_row(v, tuple(targets))
    nbytes = np.array([[0.0 if a == b else m for b, m in zip(targets, full)] for a in src])
    if not nbytes.any():
        return None
    at = {spec: k for k, spec in enumerate(targets)}
    readers = [(g, [at[spec] for spec in specs]) for g, specs in wanted]
    return (enc.index[cg.root[v.node]], nbytes, readers[:len(before)], readers[len(before):])


def held(unary: dict[int, np.ndarray], copies: list[Copy], choice) -> float:
    """Bytes ``point_terms`` hold under ``choice`` (a strategy per request group)."""
    return (sum(float(row[choice[g]]) for g, row in unary.items())
            + sum(copy_held(term, choice) for term in copies))


def _partial_sums(enc: "Encoding", t: int) -> np.ndarray:
    """Per strategy of ``t``'s group, the bytes of ``t``'s partial sums held beside its
    result at ``t`` (``predict._partial_results``): one its collective combines with others
    (off the critical path) from ``t`` to the group's end; any other where larger than the
    result (a reduce-scatter's input; on XLA:CPU, an all-reduced array before its slice)."""
    cg = enc.cg
    combine_key = cg.cost.partitioner.combine_key
    off = t in cg.off_path
    row = np.zeros(len(enc.strats[cg.root[t]]))
    for r in range(len(row)):
        s = enc.strategy_of(t, r)
        result = float(cg.bytes_row(Value(t, 0), (s.out_specs[0],))[0]) if s.out_specs else 0.0
        row[r] = sum(c.bytes for c in s.collectives
                     if c.kind in PARTIAL_SUM_KINDS
                     and ((off and combine_key(c) is not None) or c.bytes > result))
    return row
