"""Sharding rules of indexing ops: embedding gather/scatter-add, slices, pads, concat, sort.

*Embedding lookups.* ``jnp.take(table, ids, axis=k)`` and ``table[ids]`` bind a ``gather``
that takes whole slices of the table along one dim ``k``; its gradient is the matching
``scatter-add``. Split the indices' batch dims and the output's batch dims follow; split
the table's other dims and the output's slice dims follow; split the table's dim ``k``
(the vocabulary) and each device looks up only the rows it owns, leaving zeros elsewhere:
a partial sum that an all-reduce completes (what XLA's partitioner does for a vocab-split
table). The scatter-add mirrors it: batch-split updates give partial table gradients
(all-reduce, or reduce-scatter onto a table dim), a vocab-split table needs no
communication. Other gather/scatter patterns fall back to replicated.

*Positional ops* (slice, dynamic_slice, dynamic_update_slice, pad, concatenate, split, rev,
sort, top_k): a dim the op cuts, pads, joins, reverses or sorts along stays unsplit; the
other dims are free and keep their splits.
"""

from __future__ import annotations

import math

from spmd.rules._core import RuleContext, Strategy, UnsupportedPattern, local_size, make, register
from spmd.sharding import Spec
from spmd.trace.graph import Op


# -- gather / scatter-add ---------------------------------------------------------------------


def _lookup_slots(operand, indices, other, k, operand_batching, indices_batching, window_dims):
    """Slots of a take-like gather/scatter: ``(operand dim, indices dim, other dim)`` each.

    ``other`` is the gather output or the scatter updates: its ``window_dims`` hold the
    operand dims taken whole (neither ``k`` nor batching), the rest the indices dims but
    the last (the index vector, of size 1), in order. The last slot is the looked-up dim
    ``k`` (operand only).
    """
    if not indices or indices[-1] != 1 or len(operand_batching) != len(indices_batching):
        raise UnsupportedPattern("gather/scatter pattern other than an embedding lookup")
    whole = [d for d in range(len(operand)) if d != k and d not in operand_batching]
    scatter_dims = [d for d in range(len(other)) if d not in window_dims]
    if len(whole) != len(window_dims) or len(scatter_dims) != len(indices) - 1:
        raise UnsupportedPattern("gather/scatter with unexpected output dims")
    paired = dict(zip(indices_batching, operand_batching))
    slots = [(paired.get(i), i, o) for i, o in zip(range(len(indices) - 1), scatter_dims)]
    slots += [(d, None, o) for d, o in zip(whole, window_dims)]
    for d, i, o in slots:
        sizes = {other[o], indices[i] if i is not None else other[o],
                 operand[d] if d is not None else other[o]}
        if len(sizes) != 1:
            raise UnsupportedPattern("gather/scatter of partial slices")
    return slots + [(k, None, None)]


def _lookup_specs(slots, assign, ranks):
    specs = [[()] * n for n in ranks]
    for dims, axes in zip(slots, assign):
        for which, d in enumerate(dims):
            if d is not None:
                specs[which][d] = axes
    return [tuple(s) for s in specs]


def gather_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """Take-like lookups (embeddings, ``take_along_axis``): batch, whole-dim and vocab splits.

    A split of the looked-up dim (the vocabulary) leaves each device the rows it owns and
    zeros elsewhere: all-reduce of the output.

    >>> import jax, jax.numpy as jnp
    >>> from spmd.rules import Op, RuleContext
    >>> f = lambda t, i: t[i]
    >>> eqn = jax.make_jaxpr(f)(jnp.zeros((8, 4)), jnp.zeros((2, 3), "int32")).eqns[-1]
    >>> for s in gather_strategies(Op.from_eqn(eqn), RuleContext({"x": 2})):
    ...     print(s.name)
    RR x RRR = RRR
    RR x S(x)RR = S(x)RR
    RS(x) x RRR = RRS(x)
    S(x)R x RRR = RRR (all-reduce @ x)
    """
    dn = op.params["dimension_numbers"]
    operand, indices = op.in_shapes
    out_shape, dtype = op.out_shapes[0], op.out_dtypes[0]
    collapsed = tuple(dn.collapsed_slice_dims)
    if len(collapsed) != 1 or tuple(dn.start_index_map) != collapsed:
        raise UnsupportedPattern("gather pattern other than an embedding lookup")
    k = dn.collapsed_slice_dims[0]
    slots = _lookup_slots(operand, indices, out_shape, k, dn.operand_batching_dims,
                          dn.start_indices_batching_dims, dn.offset_dims)
    expected = [1 if d == k or d in dn.operand_batching_dims else n for d, n in enumerate(operand)]
    if list(op.params["slice_sizes"]) != expected:
        raise UnsupportedPattern("gather of partial slices")
    sizes = [operand[d] if d is not None else indices[i] for d, i, _ in slots]
    out: list[Strategy] = []
    for assign in ctx.assignments(sizes):
        t, i, o = _lookup_specs(slots, assign, (len(operand), len(indices), len(out_shape)))
        out.append(make((t, i), (o,), ctx.partial_sum(out_shape, dtype, o, [assign[-1]])))
    return out


def scatter_add_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """Gradient of a take-like lookup: vocab split free; batch-split updates -> partial sums.

    Updates split along an indices dim that is not paired with a table dim hold partial
    sums of the whole table gradient: all-reduce, or (platform permitting) reduce-scatter
    onto an unsplit table dim.
    """
    dn = op.params["dimension_numbers"]
    if len(op.in_shapes) != 3:
        raise UnsupportedPattern("variadic scatter-add")
    operand, indices, updates = op.in_shapes
    out_shape, dtype = op.out_shapes[0], op.out_dtypes[0]
    if (len(dn.inserted_window_dims) != 1
            or tuple(dn.scatter_dims_to_operand_dims) != tuple(dn.inserted_window_dims)):
        raise UnsupportedPattern("scatter-add pattern other than an embedding gradient")
    slots = _lookup_slots(operand, indices, updates, dn.inserted_window_dims[0],
                          dn.operand_batching_dims, dn.scatter_indices_batching_dims,
                          dn.update_window_dims)
    sizes = [operand[d] if d is not None else indices[i] for d, i, _ in slots]
    base: list[Strategy] = []
    variants: list[Strategy] = []
    for assign in ctx.assignments(sizes):
        t, i, u = _lookup_specs(slots, assign, (len(operand), len(indices), len(updates)))
        ins = (t, i, u)
        flops = local_size(updates, u, ctx)
        groups = [axes for (d, _, _), axes in zip(slots, assign) if d is None and axes]
        reduced = ctx.partial_sum(out_shape, dtype, t, groups)
        base.append(make(ins, (t,), reduced, flops))
        if len(groups) != 1:
            continue
        summed = groups[0]
        for d in range(len(out_shape)):
            if not t[d] and out_shape[d] % ctx.size(summed) == 0:
                scattered = t[:d] + (summed,) + t[d + 1:]
                colls = ctx.partial_sum(out_shape, dtype, scattered, groups)
                if colls != reduced:
                    variants.append(make(ins, (scattered,), colls, flops))
    return base + variants[: max(ctx.max_strategies - len(base), 0)]


# -- positional ops ---------------------------------------------------------------------------


def _scalars(op: Op, start: int) -> tuple[Spec, ...]:
    return tuple(((),) * len(s) for s in op.in_shapes[start:])


def _same_spec(op: Op, ctx: RuleContext, shape, unsplit, n_in: int, extra_start: int | None = None,
               flops_per_elem: float = 0.0) -> list[Strategy]:
    """``n_in`` array operands and every output share a spec; ``unsplit`` dims stay whole."""
    out: list[Strategy] = []
    for spec in ctx.specs(shape, unsplit):
        outs = tuple(tuple(spec[:len(s)]) if len(s) == len(shape) else ((),) * len(s)
                     for s in op.out_shapes)
        ins = (spec,) * n_in + (_scalars(op, extra_start) if extra_start is not None else ())
        out.append(make(ins, outs, (), flops_per_elem * local_size(shape, spec, ctx)))
    return out


def slice_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """Dims taken whole are free; cut dims unsplit."""
    shape = op.in_shapes[0]
    strides = op.params.get("strides") or (1,) * len(shape)
    starts, limits = op.params["start_indices"], op.params["limit_indices"]
    cut = [d for d in range(len(shape)) if (starts[d], limits[d], strides[d]) != (0, shape[d], 1)]
    return _same_spec(op, ctx, shape, cut, 1)


def dynamic_slice_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    shape = op.in_shapes[0]
    cut = [d for d, s in enumerate(op.params["slice_sizes"]) if s != shape[d]]
    return _same_spec(op, ctx, shape, cut, 1, extra_start=1)


def dynamic_update_slice_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    shape, update = op.in_shapes[:2]
    cut = [d for d in range(len(shape)) if update[d] != shape[d]]
    out: list[Strategy] = []
    for spec in ctx.specs(shape, cut):
        out.append(make((spec, spec) + _scalars(op, 2), (spec,)))
    return out


def pad_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    shape = op.in_shapes[0]
    padded = [d for d, cfg in enumerate(op.params["padding_config"]) if tuple(cfg) != (0, 0, 0)]
    out: list[Strategy] = []
    for spec in ctx.specs(shape, padded):
        out.append(make((spec, ()), (spec,)))
    return out


def concatenate_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    dim = op.params["dimension"]
    return _same_spec(op, ctx, op.out_shapes[0], [dim], len(op.in_shapes))


def split_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    return _same_spec(op, ctx, op.in_shapes[0], [op.params["axis"]], 1)


def rev_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    return _same_spec(op, ctx, op.in_shapes[0], op.params["dimensions"], 1)


def sort_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    shape = op.in_shapes[0]
    if any(s != shape for s in op.in_shapes):
        raise UnsupportedPattern("sort of operands with unequal shapes")
    n = shape[op.params["dimension"]]
    per_elem = max(math.log2(n), 1.0) if n > 1 else 1.0
    return _same_spec(op, ctx, shape, [op.params["dimension"]], len(op.in_shapes),
                      flops_per_elem=per_elem)


def top_k_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    shape = op.in_shapes[0]
    axis = op.params.get("axis", len(shape) - 1) % len(shape)
    return _same_spec(op, ctx, shape, [axis], 1, flops_per_elem=1.0)


def iota_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """No inputs; each device makes its own piece."""
    shape = op.out_shapes[0]
    return [make(_scalars(op, 0), (spec,)) for spec in ctx.specs(shape)]


register(["gather"], gather_strategies)
register(["scatter-add", "scatter_add"], scatter_add_strategies)
register(["slice"], slice_strategies)
register(["dynamic_slice"], dynamic_slice_strategies)
register(["dynamic_update_slice"], dynamic_update_slice_strategies)
register(["pad"], pad_strategies)
register(["concatenate"], concatenate_strategies)
register(["split"], split_strategies)
register(["rev"], rev_strategies)
register(["sort"], sort_strategies)
register(["top_k"], top_k_strategies)
register(["iota"], iota_strategies)
