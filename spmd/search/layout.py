"""Which operands of a matmul XLA copies into another dimension order first, by platform.

A ``dot_general`` names its batch, contracting and free dimensions in any positions; the
matmul libraries XLA calls take only a few orders, and layout assignment inserts a transpose
(a kernel of its own, or fused into the operand's producer) for an operand in any other:

* **XLA:GPU** (cuBLAS/cuBLASLt): batch dimensions leading, in the order they pair with the
  other operand's; after them the contracting and the free dimensions each contiguous, in
  either order (the library transposes a matrix for free).
* **XLA:CPU** (YNNPACK, Eigen): an operand that is a matrix (one contracting and at most
  one free dimension, after the batch) is read in either order, as on the GPU; any other
  is put in one order: a left operand free dimensions first, a right one contracting
  dimensions first. A weight gradient of a 2-D activation, ``x^T @ dy``, needs no copy;
  one of a (batch, token, feature) activation, contracting two dimensions, does, as does a
  weight ``w[h, k, e]`` read as ``x[b, s, e] . w -> [b, s, h, k]`` (the backward pass of
  attention's output projection). Seen in XLA:CPU's compiled HLO (jax 0.10.2): such
  operands get a ``copy``/``transpose`` fusion before the ``ynn_fusion``, as do
  attention's dots whose batch dimensions are not leading; a 2-D ``x^T @ dy`` compiles
  to one ``dot`` with ``lhs_contracting_dims={0}``, a 2-D ``x @ w.T`` to one
  ``ynn_fusion``.

Dimensions of size 1 are placed anywhere (the copy would be a bitcast). The rule knows
nothing of layouts chosen elsewhere (an operand XLA already keeps transposed), so it can
count a copy XLA avoided, or miss one it makes for a reason of its own (e.g. a donated
parameter still read after its update).

>>> transposed_operands((4, 8), (8, 16), (((1,), (0,)), ((), ())), "cpu")  # x @ w
()
>>> transposed_operands((8, 4), (8, 16), (((0,), (0,)), ((), ())), "cpu")  # x^T @ dy
()
>>> # x[b, t, e]^T @ dy[b, t, f]: contracting (b, t) first
>>> transposed_operands((2, 8, 4), (2, 8, 16), (((0, 1), (0, 1)), ((), ())), "cpu")
(0,)
>>> # x[b, s, e] . w[h, k, e]: w's contracting dimension last, behind two free ones
>>> transposed_operands((2, 8, 4), (3, 5, 4), (((2,), (2,)), ((), ())), "cpu")
(1,)
>>> transposed_operands((2, 8, 4), (3, 5, 4), (((2,), (2,)), ((), ())), "gpu")
()
>>> transposed_operands((8, 4), (8, 16), (((0,), (0,)), ((), ())), "gpu")
()
>>> # attention's scores, q[b, t, h, k] . k[b, h, s, k]: q's batch dims (b, h) are not leading
>>> transposed_operands((2, 5, 3, 7), (2, 3, 5, 7), (((3,), (3,)), ((0, 2), (0, 1))), "gpu")
(0,)
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["transposed_operands"]


def transposed_operands(lhs: Sequence[int], rhs: Sequence[int], dimension_numbers,
                        platform: str) -> tuple[int, ...]:
    """Indices (0: lhs, 1: rhs) of a dot's operands, of these shapes, that XLA transposes
    before the matmul on ``platform`` ("cpu" or "gpu")."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    out = []
    for k, (shape, contract, batch) in enumerate(((lhs, lhs_contract, lhs_batch),
                                                  (rhs, rhs_contract, rhs_batch))):
        one_order = platform == "cpu" and not _matrix(shape, contract, batch)
        if not _in_order(shape, contract, batch, free_first=k == 0 or not one_order,
                         contract_first=k == 1 or not one_order):
            out.append(k)
    return tuple(out)


def _matrix(shape: Sequence[int], contract: Sequence[int], batch: Sequence[int]) -> bool:
    """Whether an operand is, beside its batch dimensions, a matrix: one contracting and at
    most one free dimension of size above 1."""
    big = [d for d in range(len(shape)) if shape[d] != 1 and d not in batch]
    return sum(d in contract for d in big) == 1 and len(big) <= 2


def _in_order(shape: Sequence[int], contract: Sequence[int], batch: Sequence[int],
              free_first: bool, contract_first: bool) -> bool:
    """Whether an operand's dimensions (those of size 1 left out) run batch, then
    contracting and free dimensions each contiguous, in one of the orders allowed: free
    dimensions first, contracting dimensions first."""
    def kept(dims: Sequence[int]) -> list[int]:
        return [d for d in dims if shape[d] != 1]

    free = [d for d in range(len(shape)) if d not in contract and d not in batch]
    actual = kept(range(len(shape)))
    orders = ([kept(batch) + kept(free) + kept(contract)] if free_first else []) + (
        [kept(batch) + kept(contract) + kept(free)] if contract_first else [])
    return actual in orders
