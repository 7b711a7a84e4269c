"""Sharding rules of ``conv_general_dilated``: batch, output-feature and input-feature splits.

A convolution is a dot_general whose spatial dims slide: the batch dim (lhs and output), the
output feature (rhs and output) and the input feature (lhs and rhs, contracted) may be split
like a dot_general's batch, free and contracting dims; the input-feature split leaves partial
sums completed by an all-reduce (Alpa §4.1). Spatial dims stay whole (splitting them needs
halo exchange). Grouped convolutions (``feature_group_count`` or ``batch_group_count`` > 1)
are replicated and reported as fallbacks. The kernel gradient is itself a conv whose
"input feature" is the data batch, so the data-parallel gradient all-reduce appears here.
"""

from __future__ import annotations

import math

from spmd.rules._core import RuleContext, Strategy, UnsupportedPattern, make, register
from spmd.trace.graph import Op


def conv_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """Each mesh axis on the batch, the output feature, the input feature, or nothing.

    >>> import jax, jax.numpy as jnp
    >>> from spmd.rules import Op, RuleContext
    >>> f = lambda x, w: jax.lax.conv(x, w, (1, 1), "SAME")   # NCHW x OIHW
    >>> eqn = jax.make_jaxpr(f)(jnp.zeros((2, 4, 5, 5)), jnp.zeros((6, 4, 3, 3))).eqns[0]
    >>> for s in conv_strategies(Op.from_eqn(eqn), RuleContext({"x": 2})):
    ...     print(s.name)
    RRRR x RRRR = RRRR
    S(x)RRR x RRRR = S(x)RRR
    RRRR x S(x)RRR = RS(x)RR
    RS(x)RR x RS(x)RR = RRRR (all-reduce @ x)
    """
    if op.params["feature_group_count"] != 1 or op.params["batch_group_count"] != 1:
        raise UnsupportedPattern("grouped convolution")
    dn = op.params["dimension_numbers"]
    lhs, rhs = op.in_shapes
    out_shape, dtype = op.out_shapes[0], op.out_dtypes[0]
    lb, lf = dn.lhs_spec[:2]
    ro, ri = dn.rhs_spec[:2]
    ob, of = dn.out_spec[:2]
    sizes = [lhs[lb], rhs[ro], lhs[lf]]  # slots: batch, output feature, input feature
    window = math.prod(rhs[d] for d in dn.rhs_spec[2:])
    total = 2.0 * math.prod(out_shape) * rhs[ri] * window
    out: list[Strategy] = []
    for batch, feat_out, feat_in in ctx.assignments(sizes):
        ls = [()] * len(lhs)
        rs = [()] * len(rhs)
        os_ = [()] * len(out_shape)
        ls[lb] = os_[ob] = batch
        rs[ro] = os_[of] = feat_out
        ls[lf] = rs[ri] = feat_in
        o = tuple(os_)
        colls = ctx.partial_sum(out_shape, dtype, o, [feat_in])
        flops = total / ctx.size(batch + feat_out + feat_in)
        out.append(make((tuple(ls), tuple(rs)), (o,), colls, flops))
    return out


register(["conv_general_dilated"], conv_strategies)
