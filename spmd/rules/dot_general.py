"""Sharding rules of ``dot_general``: every assignment of mesh axes to its logical dims.

The dims of a dot_general fall into four kinds (from ``dimension_numbers``): batch (in lhs,
rhs and output), lhs-free and rhs-free (in one operand and the output) and contracting (in
both operands, not in the output). Giving a mesh axis to a batch or free dim splits the
operands and the output alike with no communication; giving it to a contracting dim leaves
each device a partial sum of the whole output, which an all-reduce over that axis completes
(Alpa §4.1; Megatron-LM's row-parallel layer). A reduce-scatter variant leaves the output
split on that axis along one of its unsplit dims instead (half the bytes on the wire);
the cost model decides which collective the platform really emits (CPU: all-reduce).

Output dims come in the order batch, lhs-free, rhs-free, which is also the order of the
*slots* below, so an assignment's first slots are the output spec.
"""

from __future__ import annotations

import math

from spmd.rules._core import RuleContext, Strategy, UnsupportedPattern, make, register, used
from spmd.sharding import Spec
from spmd.trace.graph import Op


def dot_general_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """Batch/free/contracting splits, each with its partial-sum all-reduce or reduce-scatter.

    >>> import jax, jax.numpy as jnp
    >>> from spmd.rules import Op, RuleContext
    >>> eqn = jax.make_jaxpr(jnp.matmul)(jnp.zeros((8, 16)), jnp.zeros((16, 32))).eqns[0]
    >>> ss = dot_general_strategies(Op.from_eqn(eqn), RuleContext({"data": 2, "model": 4}))
    >>> [s.name for s in ss if s.in_specs == ((("data",), ()), ((), ("model",)))]
    ['S(data)R x RS(model) = S(data)S(model)']
    """
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs, rhs = op.in_shapes[:2]
    if len(op.in_shapes) != 2:
        raise UnsupportedPattern("dot_general with extra operands")
    lfree = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rhs)) if d not in rc and d not in rb]
    # slot -> (lhs dim or None, rhs dim or None); order: batch, lhs-free, rhs-free, contracting
    slots = ([(l, r) for l, r in zip(lb, rb)] + [(l, None) for l in lfree]
             + [(None, r) for r in rfree] + [(l, r) for l, r in zip(lc, rc)])
    sizes = [lhs[l] if l is not None else rhs[r] for l, r in slots]
    n_out = len(lb) + len(lfree) + len(rfree)
    out_shape, out_dtype = op.out_shapes[0], op.out_dtypes[0]
    total_flops = 2.0 * math.prod(sizes)

    base: list[Strategy] = []
    variants: list[Strategy] = []
    saved: list[float] = []  # per variant: devices x bytes of the all-reduce it replaces
    for assign in ctx.assignments(sizes):
        lspec: list[tuple[str, ...]] = [()] * len(lhs)
        rspec: list[tuple[str, ...]] = [()] * len(rhs)
        for (l, r), axes in zip(slots, assign):
            if l is not None:
                lspec[l] = axes
            if r is not None:
                rspec[r] = axes
        ins = (tuple(lspec), tuple(rspec))
        out: Spec = tuple(assign[:n_out])
        summed = tuple(a for axes in assign[n_out:] for a in axes)
        flops = total_flops / ctx.size(used(assign))
        if not summed:
            base.append(make(ins, (out,), (), flops))
            continue
        groups = [axes for axes in assign[n_out:] if axes]
        reduced = ctx.partial_sum(out_shape, out_dtype, out, groups)
        base.append(make(ins, (out,), reduced, flops))
        if len(groups) > 1:
            continue
        # Reduce-scatter variants: the summed axes also split one unsplit output dim. Kept
        # only where the platform communicates differently (else: all-reduce + free slice),
        # unless the context keeps every one (``RuleContext.every_scatter``). Where XLA
        # spreads the result over free axes instead (``Partitioner.spread_axes``), each
        # device computes only its piece.
        for d in range(n_out):
            if not out[d] and out_shape[d] % ctx.size(summed) == 0:
                scattered = out[:d] + (summed,) + out[d + 1:]
                colls = ctx.partial_sum(out_shape, out_dtype, scattered, groups, spread=True)
                if colls != reduced or ctx.every_scatter:
                    spread = ctx.partitioner.spread_axes(scattered, summed)
                    variants.append(make(ins, (scattered,), colls,
                                         flops / ctx.size(summed) if spread else flops))
                    saved.append(ctx.size(summed) * sum(c.bytes for c in reduced))
    # When they do not all fit, keep the variants that save the most: a partial sum over the
    # most devices, of the largest result (a weight gradient reduced over every axis).
    variants = [v for _, v in sorted(zip(saved, variants), key=lambda p: -p[0])]
    room = max(ctx.max_strategies - len(base), 0)
    if len(base) > ctx.max_strategies:
        # Too many (3+ axes): keep those that leave the least work replicated.
        base = sorted(base, key=lambda s: s.flops)[: ctx.max_strategies]
    return base + variants[:room]


register(["dot_general"], dot_general_strategies)
