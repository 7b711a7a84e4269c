"""Sharding rules of reductions, arg-reductions and cumulative scans.

A reduction over a split dim leaves each device the reduction of its slice: a partial
result that an all-reduce (sum, max, min, prod, and, or) over that dim's axes completes.
``argmax``/``argmin`` would need the winning value *and* index from every device, so their
reduced dims stay unsplit; so do the scanned dims of ``cumsum`` and friends.
"""

from __future__ import annotations

from spmd.rules._core import RuleContext, Strategy, local_size, make, register
from spmd.trace.graph import Op

REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
              "reduce_or", "reduce_xor")
ARG_REDUCTIONS = ("argmax", "argmin")
CUMULATIVE = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")


def reduce_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """Any input spec; the reduced dims' axes become an all-reduce of the output.

    >>> import jax, jax.numpy as jnp
    >>> from spmd.rules import Op, RuleContext
    >>> eqn = jax.make_jaxpr(lambda x: x.sum(1))(jnp.zeros((4, 8))).eqns[0]
    >>> [s.name for s in reduce_strategies(Op.from_eqn(eqn), RuleContext({"x": 2}))]
    ['RR = R', 'RS(x) = R (all-reduce @ x)', 'S(x)R = S(x)']
    """
    in_shape, out_shape, dtype = op.in_shapes[0], op.out_shapes[0], op.out_dtypes[0]
    axes = {d % len(in_shape) for d in op.params["axes"]} if in_shape else set()
    out: list[Strategy] = []
    for spec in ctx.specs(in_shape):
        kept = tuple(a for d, a in enumerate(spec) if d not in axes)
        colls = ctx.partial_sum(out_shape, dtype, kept, [spec[d] for d in sorted(axes)])
        out.append(make((spec,), (kept,), colls, local_size(in_shape, spec, ctx)))
    return out


def arg_reduce_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """The reduced dims unsplit, the others free."""
    in_shape = op.in_shapes[0]
    axes = {d % len(in_shape) for d in op.params["axes"]}
    out: list[Strategy] = []
    for spec in ctx.specs(in_shape, unsplit=axes):
        kept = tuple(a for d, a in enumerate(spec) if d not in axes)
        out.append(make((spec,), (kept,), (), local_size(in_shape, spec, ctx)))
    return out


def cumulative_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """The scanned dim unsplit; output spec equals input spec."""
    in_shape = op.in_shapes[0]
    axis = op.params["axis"] % len(in_shape)
    return [make((spec,), (spec,), (), local_size(in_shape, spec, ctx))
            for spec in ctx.specs(in_shape, unsplit=[axis])]


register(REDUCTIONS, reduce_strategies)
register(ARG_REDUCTIONS, arg_reduce_strategies)
register(CUMULATIVE, cumulative_strategies)
