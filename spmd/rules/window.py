"""Sharding rules of windowed reductions (pooling) and their gradient.

``reduce_window_{max,min,sum}`` and ``select_and_scatter_add`` (the max-pool gradient) slide
a window over some dims. A dim whose window is 1 wide, with stride 1, no padding and no
dilation, is a plain batch-like dim and may be split; a windowed dim stays whole (splitting
it would need halo exchange).
"""

from __future__ import annotations

from spmd.rules._core import RuleContext, Strategy, local_size, make, register
from spmd.trace.graph import Op


def _windowed_dims(params, ndim: int) -> list[int]:
    ones = (1,) * ndim
    dims = []
    for d in range(ndim):
        plain = (params["window_dimensions"][d] == 1 and params["window_strides"][d] == 1
                 and tuple(params["padding"][d]) == (0, 0)
                 and params.get("base_dilation", ones)[d] == 1
                 and params.get("window_dilation", ones)[d] == 1)
        if not plain:
            dims.append(d)
    return dims


def reduce_window_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """Plain dims free (input and output alike), windowed dims unsplit."""
    shape = op.in_shapes[0]
    window = _windowed_dims(op.params, len(shape))
    per_elem = 1
    for d in window:
        per_elem *= op.params["window_dimensions"][d]
    out: list[Strategy] = []
    for spec in ctx.specs(shape, window):
        flops = per_elem * local_size(op.out_shapes[0], spec, ctx)
        out.append(make((spec,), (spec,), (), flops))
    return out


def select_and_scatter_add_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """Operands (source, operand) and output share the plain dims' splits."""
    shape = op.in_shapes[1]
    window = _windowed_dims(op.params, len(shape))
    out: list[Strategy] = []
    for spec in ctx.specs(shape, window):
        out.append(make((spec, spec), (spec,), (), local_size(shape, spec, ctx)))
    return out


register(["reduce_window_max", "reduce_window_min", "reduce_window_sum"], reduce_window_strategies)
register(["select_and_scatter_add"], select_and_scatter_add_strategies)
