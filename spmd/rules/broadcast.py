"""Sharding rules of shape ops: broadcast_in_dim, reshape, squeeze, transpose.

None of these communicates when the input arrives in the spec the output implies: each
strategy picks an output spec and derives the input spec from it. Slicing a replicated input
is free, so a broadcast may split the dims it creates while its input stays replicated
there. (``jnp.expand_dims`` binds ``broadcast_in_dim``; there is no expand_dims primitive.)
"""

from __future__ import annotations

import math
from typing import Sequence

from spmd.rules._core import RuleContext, Strategy, UnsupportedPattern, make, register
from spmd.sharding import Spec
from spmd.trace.graph import Op


def _extra_inputs(op: Op) -> tuple[Spec, ...]:
    """Dynamic-shape operands after the first, replicated."""
    return tuple(((),) * len(s) for s in op.in_shapes[1:])


def broadcast_in_dim_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """Output specs freely; an input dim follows its output dim only if sizes match.

    >>> import jax, jax.numpy as jnp
    >>> from spmd.rules import Op, RuleContext
    >>> f = lambda b: jnp.broadcast_to(b, (4, 8))
    >>> eqn = jax.make_jaxpr(f)(jnp.zeros((8,))).eqns[0]
    >>> [s.name for s in broadcast_in_dim_strategies(Op.from_eqn(eqn), RuleContext({"x": 2}))]
    ['R = RR', 'S(x) = RS(x)', 'R = S(x)R']
    """
    in_shape, out_shape = op.in_shapes[0], op.out_shapes[0]
    dims = op.params["broadcast_dimensions"]
    out: list[Strategy] = []
    for spec in ctx.specs(out_shape):
        ins: Spec = tuple(spec[d] if in_shape[i] == out_shape[d] else ()
                          for i, d in enumerate(dims))
        out.append(make((ins,) + _extra_inputs(op), (spec,)))
    return out


def transpose_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """Output dim ``i`` is input dim ``permutation[i]``: specs permute."""
    perm = op.params["permutation"]
    out: list[Strategy] = []
    for spec in ctx.specs(op.out_shapes[0]):
        ins = [()] * len(perm)
        for i, p in enumerate(perm):
            ins[p] = spec[i]
        out.append(make((tuple(ins),), (spec,)))
    return out


def squeeze_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """The removed size-1 dims are unsplit; the others keep their splits."""
    in_shape = op.in_shapes[0]
    removed = {d % len(in_shape) for d in op.params["dimensions"]}
    kept = [d for d in range(len(in_shape)) if d not in removed]
    out: list[Strategy] = []
    for spec in ctx.specs(op.out_shapes[0]):
        ins = [()] * len(in_shape)
        for i, d in enumerate(kept):
            ins[d] = spec[i]
        out.append(make((tuple(ins),), (spec,)))
    return out


def reshape_groups(in_shape: Sequence[int],
                   out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input and output dims with equal products (size-1 dims are left out).

    >>> reshape_groups((4, 6, 8), (4, 48))
    [([0], [0]), ([1, 2], [1])]
    >>> reshape_groups((2, 1, 12), (2, 3, 4))
    [([0], [0]), ([2], [1, 2])]
    """
    ins = [d for d, n in enumerate(in_shape) if n != 1]
    outs = [d for d, n in enumerate(out_shape) if n != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(ins) and j < len(outs):
        gi, gj = [ins[i]], [outs[j]]
        pi, pj = in_shape[ins[i]], out_shape[outs[j]]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(ins[i]); pi *= in_shape[ins[i]]; i += 1  # noqa: E702
            else:
                gj.append(outs[j]); pj *= out_shape[outs[j]]; j += 1  # noqa: E702
        groups.append((gi, gj))
    return groups


def _block_axes(dims: list[int], spec: Spec, shape: Sequence[int], sizes) -> tuple[str, ...] | None:
    """The axes splitting a group of dims into contiguous blocks of its flattening, major first.

    That holds when only a prefix of the dims is split and every split dim but the last is
    split completely (one element per device); ``None`` otherwise.
    """
    axes: list[str] = []
    open_ = True
    for d in dims:
        if not spec[d]:
            open_ = False
            continue
        if not open_:
            return None
        axes.extend(spec[d])
        open_ = math.prod(sizes[a] for a in spec[d]) == shape[d]
    return tuple(axes)


def _place_axes(dims: list[int], axes: tuple[str, ...], shape: Sequence[int], sizes) -> dict | None:
    """Spread block axes over a group's dims, major first: the inverse of ``_block_axes``."""
    placed: dict[int, tuple[str, ...]] = {}
    it = iter(dims)
    d = next(it, None)
    left = shape[d] if d is not None else 1
    for a in axes:
        while d is not None and left == 1:
            d = next(it, None)
            left = shape[d] if d is not None else 1
        if d is None or left % sizes[a]:
            return None
        placed[d] = placed.get(d, ()) + (a,)
        left //= sizes[a]
    return placed


def reshape_strategies(op: Op, ctx: RuleContext) -> list[Strategy]:
    """Splits that survive a reshape without moving data.

    In each group of dims with equal products, a split is free when it cuts the flattened
    group into contiguous blocks on both sides: the major dim split, or the major dims split
    completely and the next one partly (e.g. ``(2, 16) -> (32,)`` with ``S(data)S(model)`` ->
    ``S(data,model)``).

    >>> import jax, jax.numpy as jnp
    >>> from spmd.rules import Op, RuleContext
    >>> eqn = jax.make_jaxpr(lambda x: x.reshape(4, 2, 3))(jnp.zeros((4, 6))).eqns[0]
    >>> [s.name for s in reshape_strategies(Op.from_eqn(eqn), RuleContext({"x": 2}))]
    ['RR = RRR', 'RS(x) = RS(x)R', 'S(x)R = S(x)RR']
    """
    if op.params.get("dimensions") is not None:
        raise UnsupportedPattern("reshape with dimensions (a transpose first)")
    in_shape, out_shape = op.in_shapes[0], op.out_shapes[0]
    groups = reshape_groups(in_shape, out_shape)
    sizes = ctx.mesh_shape
    out: list[Strategy] = []
    for spec in ctx.specs(out_shape):
        ins: list[tuple[str, ...]] = [()] * len(in_shape)
        for gi, gj in groups:
            axes = _block_axes(gj, spec, out_shape, sizes)
            placed = _place_axes(gi, axes, in_shape, sizes) if axes is not None else None
            if placed is None:
                break
            for d, a in placed.items():
                ins[d] = a
        else:
            out.append(make((tuple(ins),) + _extra_inputs(op), (spec,)))
    return out


register(["broadcast_in_dim"], broadcast_in_dim_strategies)
register(["transpose"], transpose_strategies)
register(["squeeze"], squeeze_strategies)
register(["reshape"], reshape_strategies)
