"""Sharding rules of a scan's boundary: the pseudo-ops ``spmd.trace.graph`` puts where a value
enters or leaves a loop body planned once for all iterations.

``scan_carry`` / ``scan_carry_out`` pass the loop-carried value through unchanged (any spec,
the same in and out; the graph pairs them so every iteration agrees). ``scan_slice`` reads
one iteration of a stacked input and ``scan_stack`` writes one iteration of a stacked output:
the stacked (leading) dim stays whole, since every device runs every iteration, and the
other dims keep the body's spec. None of them communicates: a value arriving in another spec
is resharded on the edge, once per iteration where the edge is inside the loop.

>>> from spmd.rules import Op, RuleContext, strategies
>>> op = Op("scan_slice", {}, ((12, 8, 4),), ("float32",), ((8, 4),), ("float32",))
>>> [s.name for s in strategies(op, RuleContext({"x": 2}))]
['RRR = RR', 'RRS(x) = RS(x)', 'RS(x)R = S(x)R']
"""

from __future__ import annotations

from spmd.rules._core import RuleContext, Strategy, make, register
from spmd.trace.graph import Op


def carry_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    return [make((spec,), (spec,)) for spec in ctx.specs(op.out_shapes[0])]


def slice_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    return [make((spec,), (spec[1:],)) for spec in ctx.specs(op.in_shapes[0], unsplit=[0])]


def stack_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    return [make((spec[1:],), (spec,)) for spec in ctx.specs(op.out_shapes[0], unsplit=[0])]


register(["scan_carry", "scan_carry_out"], carry_strategies)
register(["scan_slice"], slice_strategies)
register(["scan_stack"], stack_strategies)
