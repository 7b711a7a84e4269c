"""The roofline of an op and of the fused kernel it runs in.

An op alone in its kernel (a matmul, a transpose, a gather) takes the longer of its FLOPs'
seconds and its memory traffic's. A fused kernel streams its operands while it computes, so
it takes the longer of the two sums over its ops, not the sum of each op's longer one: an
AdamW update (divisions and roots inside, four arrays read and three written per parameter)
ran in 1.5 ms per device on cpu-8 (wresnet-tiny, every device updating all 304,480
parameters, all 8 at once) where its ops' rooflines summed to 2.5 ms and the longer of the
two sums is 1.55 ms. Which term bounds a kernel is decided once (``kernel_bounds``), and each
op then pays its own share of that term, so the cost stays a sum over ops, as the solver
needs.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from spmd.search.fusion import Fusion
from spmd.trace.graph import Graph

__all__ = ["Price", "kernel_bounds"]


@dataclasses.dataclass(frozen=True)
class Price:
    """One op's figures per strategy (``CostGraph._price``): seconds of its FLOPs, of its
    memory traffic, of the relayout copies of its operands, and of its collectives."""

    flop_time: np.ndarray
    traffic: np.ndarray
    relayout: np.ndarray
    comm: np.ndarray

    def seconds(self, bound: bool | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(compute, comm, memory-bound part of compute) per strategy. Alone in its kernel
        (``bound`` None) an op takes the longer of its FLOPs and its traffic; in a fused
        kernel, the term that bounds the kernel (``bound``: True for its memory traffic,
        False for its FLOPs), the other hidden. Relayout copies are memory-bound time."""
        busy = (np.maximum(self.flop_time, self.traffic) if bound is None
                else self.traffic if bound else self.flop_time)
        return busy + self.relayout, self.comm, busy + self.relayout - self.flop_time


def kernel_bounds(graph: Graph, fusion: Fusion, prices: Sequence[Price]) -> dict[int, bool]:
    """Per fused kernel (its ``Fusion.kernel`` id, for kernels of two ops or more): whether
    its memory traffic (True) or its FLOPs (False) bound it. The sums are compared at each
    op's largest (replicated) figures: the ops of a kernel split alike, so the same term
    bounds it under every strategy."""
    flops: dict[int, float] = {}
    traffic: dict[int, float] = {}
    for n, price in zip(graph.nodes, prices):
        k = fusion.kernel[n.id]
        if k >= 0 and len(price.flop_time):
            flops[k] = flops.get(k, 0.0) + float(price.flop_time.max())
            traffic[k] = traffic.get(k, 0.0) + float(price.traffic.max())
    sizes = np.bincount([k for k in fusion.kernel if k >= 0], minlength=len(graph.nodes))
    return {k: traffic[k] >= flops[k] for k in flops if sizes[k] > 1}
