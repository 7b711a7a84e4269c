"""A value made to wait for another: the data dependence spmd writes into a program where
XLA's scheduler must not move an op earlier than a point of the step (a recomputation to
the backward pass, ``spmd.memory.remat``; a matmul operand's gather or copy to the matmul,
``spmd.runtime.constrain``).

>>> import jax.numpy as jnp
>>> after(jnp.arange(3.0), jnp.ones((2, 2))).tolist()
[0.0, 1.0, 2.0]
>>> chain = Chain()
>>> [chain.after(jnp.arange(2.0), f).tolist() for f in (jnp.ones(3), jnp.zeros((2, 2)))]
[[0.0, 1.0], [0.0, 1.0]]
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["Chain", "after", "fenceable", "materialized"]


def after(x, fence):
    """``x``, made to depend on ``fence`` in a way no XLA pass folds: ``select(p, x, 0)``
    with ``p = (c == c) | (c != c)``, always true, ``c`` the fence itself where its shape is
    ``x``'s (elementwise: no communication under equal specs), else its maximum (one scalar
    all-reduce where the fence is split).

    A data dependence, not an ``optimization_barrier``: XLA:CPU expands barriers before its
    CSE, which then merges a recomputation with the forward pass it repeats (a
    ``jax.checkpoint``-ed step compiles to the plain one's memory there); and a barrier over
    values of many shapes is one op, which no sharding rule splits. A data dependence
    survives on every backend."""
    import jax.numpy as jnp

    c = fence if jnp.shape(fence) == jnp.shape(x) else _scalar(fence)
    return _select(c, x)


class Chain:
    """Fences that hold in the order they are made: each one's ``fence`` is read only once
    the previous fence's is there. Fences apart would each reduce their fence to a scalar
    across the devices, all-reduces that XLA combines into one where no data orders them,
    which waits for the last fence: every fenced value would wait for the step's end."""

    def __init__(self) -> None:
        self._last: Any = None

    def after(self, x, fence):
        """``x``, made to depend on ``fence``, and ``fence`` on the previous fence."""
        if self._last is not None:
            fence = _select(self._last, fence)
        self._last = _scalar(fence)
        return _select(self._last, x)

    def materialized(self, x):
        """``x`` as a buffer of its own (``materialized``), made once the last fence is
        there; ``x`` as it is before the first fence."""
        return x if self._last is None else materialized(x, self._last)


def materialized(x, c):
    """``x`` as a buffer of its own, not an expression its readers' kernels evaluate again:
    the result of a conditional on an always-true predicate of the scalar ``c``, an op XLA
    fuses into no kernel (one whose predicate XLA cannot fold: ``c`` a fence's scalar).

    XLA:CPU fuses an elementwise op into every reader's kernel, duplicating it where it has
    several, with no bound on a kernel's operands; XLA:GPU bounds them. The residual
    stream's gradient, a chain of sums through every layer's backward pass, so became one
    kernel per layer that remade the chain and read every later layer's forward values,
    held to the step's end (gpt-1.3b for 8 A100s: kernels of up to 220 operands)."""
    import jax.numpy as jnp

    return jax.lax.cond(_always(c), lambda v: v, jnp.zeros_like, x)


def _scalar(fence):
    """A float scalar of ``fence`` (its maximum) that XLA cannot compute before it."""
    import jax.numpy as jnp

    c = jnp.max(fence)
    return c if jnp.issubdtype(c.dtype, jnp.inexact) else c.astype(jnp.float32)


def _select(c, x):
    """``x``, through a select on an always-true predicate of ``c`` (``c``'s shape or a
    scalar)."""
    import jax.numpy as jnp

    if not jnp.issubdtype(jnp.result_type(c), jnp.inexact):
        c = c.astype(jnp.float32)
    return jax.lax.select(jnp.broadcast_to(_always(c), jnp.shape(x)), x, jnp.zeros_like(x))


def _always(c):
    """True, elementwise over the float ``c``, in a form no XLA pass folds (NaN makes both
    ``c == c`` and ``c != c`` data-dependent)."""
    return (c == c) | (c != c)


def fenceable(x: Any) -> bool:
    """Whether ``after`` can fence ``x``: a numeric array (not a typed PRNG key)."""
    return not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
