"""What communication and compute cost: the one place that turns collectives and FLOPs into
seconds. Which collectives XLA emits is ``spmd.cost.partitioner``'s answer; this module
prices it.

Collective times follow the ring algorithms (Thakur, Rabenseifner & Gropp, "Optimization of
collective communication operations in MPICH", IJHPCA 2005; the NCCL performance notes,
docs/performance.md in NVIDIA/nccl-tests, whose "bus bandwidth" factors are the same
``2(n-1)/n`` and ``(n-1)/n``), as used by Alpa (Zheng et al., OSDI'22, §4). For a group of ``n``
devices over a link of bandwidth ``bw`` (bytes/s per device) and latency ``alpha``:

* all-reduce      ``2(n-1)/n * B / bw + alpha``, B = bytes each device holds (before = after)
* all-gather      ``(n-1)/n * B / bw + alpha``,  B = bytes each device holds *after* the op
* reduce-scatter  ``(n-1)/n * B / bw + alpha``,  B = bytes each device holds *before* the op
* all-to-all      ``(n-1)/n * b / bw + alpha``,  b = bytes each device holds (it keeps 1/n)
* collective-permute ``b / bw + alpha``,         b = bytes each device sends (its whole piece)

A collective over several mesh axes runs at the slowest of their links (``DeviceMesh.link``);
on XLA:CPU it pays each axis's latency (``CostModel._latency``).
*Independent* collectives that XLA combines (``Partitioner.combine_key``) pay their bandwidth
each but, where the platform runs a combined collective as one call (``latency_group``:
XLA:GPU, not XLA:CPU), the latency once per (kind, axes): ``split`` separates the two parts,
and the cost graph charges each shared latency once per plan. Which collectives are independent is
the caller's call (the cost graph takes those of ops no matmul or convolution depends on).

>>> from spmd.cluster.mesh import make_mesh
>>> cm = CostModel(make_mesh({"data": 2, "model": 4}, bandwidth=100e9, latency=0.0))
>>> t, cs = cm.reshard((16, 32), "float32", (("data",), ()), ((), ()))
>>> cs
(Collective(kind='all-gather', axes=('data',), bytes=2048.0),)
>>> round(t * 1e9, 3)  # (2-1)/2 * 2048 B / 100 GB/s, in ns
10.24
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from spmd.cluster.mesh import DeviceMesh
from spmd.cost.partitioner import COLLECTIVE_KINDS, COMBINED_KINDS, Collective, Partitioner
from spmd.rules.elementwise import ELEMENTWISE
from spmd.rules.reduce import ARG_REDUCTIONS, REDUCTIONS
from spmd.sharding import Spec

__all__ = ["OP_KINDS", "CostModel"]

_NAMED_KINDS = {
    "divide": ("div", "rem"),
    "root": ("sqrt", "rsqrt", "cbrt"),
    "exponential": ("exp", "exp2", "expm1", "log", "log1p", "logistic", "tanh", "erf", "erfc",
                    "erf_inv", "pow", "sin", "cos", "tan", "asin", "acos", "atan", "atan2",
                    "sinh", "cosh", "asinh", "acosh", "atanh", "lgamma", "digamma", "igamma",
                    "igammac", "igamma_grad_a", "polygamma", "zeta", "bessel_i0e",
                    "bessel_i1e", "regularized_incomplete_beta", "random_gamma_grad"),
    "reduce": REDUCTIONS + ARG_REDUCTIONS,
}
#: primitive -> its kind in ``DeviceSpec.op_rates`` (``spmd.cluster.hardware.OP_RATE_KINDS``):
#: the named ones above, every other elementwise primitive "elementwise"
OP_KINDS: dict[str, str] = {
    **{p: "elementwise" for p in ELEMENTWISE},
    **{p: kind for kind, primitives in _NAMED_KINDS.items() for p in primitives},
}

#: ``CostModel.shared``'s models, by what of a mesh prices a collective
_SHARED: dict[str, "CostModel"] = {}


class CostModel:
    """Seconds for collectives, resharding, FLOPs and memory traffic on one ``DeviceMesh``."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        #: which collectives XLA emits on this mesh (priced here)
        self.partitioner = Partitioner(mesh)
        #: reshard answers by (shape, dtype, src, dst): the same on every mesh of this shape
        self._reshards: dict[tuple, tuple[float, tuple[Collective, ...]]] = {}

    @classmethod
    def shared(cls, mesh: DeviceMesh) -> "CostModel":
        """The one model of every mesh with these axes, links and devices (which devices
        does not matter: a pipeline's stages, and every plan of one mesh, share its reshard
        answers, most of a cost graph's making)."""
        key = repr((mesh.axis_names, mesh.axis_sizes, sorted(mesh.links.items()), mesh.device,
                    mesh.platform, mesh.virtual, mesh.hosts))
        model = _SHARED.get(key)
        if model is None:
            model = _SHARED[key] = cls(mesh)
        return model

    def _ring(self, factor_fn, nbytes: float, axes, point_to_point: bool = False) -> float:
        axes = self.partitioner.active(axes)
        if not axes:
            return 0.0
        n = self.partitioner.group_size(axes)
        return (factor_fn(n) * float(nbytes) / self.mesh.link(axes).bandwidth
                + self._latency(axes, point_to_point))

    def _latency(self, axes: tuple[str, ...], point_to_point: bool) -> float:
        """The latency of a collective over ``axes`` (its active ones). Over one axis, that
        axis's link's. Over several, the slowest link's; on XLA:CPU, where a collective is a
        rendezvous of the devices' threads, each axis's latency, added: on 8 CPU devices
        (data=2 x model=4, interleaved with compute) an all-gather took 44 us over data,
        86 us over model and 156-173 us over both, an all-reduce 40, 96 and 158 us. A
        collective-permute is one hop: the slowest link's latency on every platform."""
        if point_to_point or self.partitioner.platform != "cpu":
            return self.mesh.link(axes).latency
        return sum(self.mesh.links[axis].latency for axis in axes)

    # -- one method per collective -------------------------------------------------------
    def all_reduce(self, nbytes: float, axes) -> float:
        """Ring all-reduce: ``2(n-1)/n * B / bw + alpha`` (B: bytes per device)."""
        return self._ring(lambda n: 2.0 * (n - 1) / n, nbytes, axes)

    def all_gather(self, nbytes: float, axes) -> float:
        """Ring all-gather: ``(n-1)/n * B / bw + alpha`` (B: bytes per device after gathering)."""
        return self._ring(lambda n: (n - 1) / n, nbytes, axes)

    def reduce_scatter(self, nbytes: float, axes) -> float:
        """Ring reduce-scatter: ``(n-1)/n * B / bw + alpha`` (B: bytes per device before)."""
        return self._ring(lambda n: (n - 1) / n, nbytes, axes)

    def all_to_all(self, nbytes: float, axes) -> float:
        """All-to-all: ``(n-1)/n * b / bw + alpha`` (b: bytes each device holds, keeps 1/n)."""
        return self._ring(lambda n: (n - 1) / n, nbytes, axes)

    def collective_permute(self, nbytes: float, axes) -> float:
        """Point-to-point exchange of each device's whole piece: ``b / bw + alpha``."""
        return self._ring(lambda n: 1.0, nbytes, axes, point_to_point=True)

    def time(self, c: Collective) -> float:
        """Seconds for one predicted collective."""
        fn = {
            "all-reduce": self.all_reduce, "all-gather": self.all_gather,
            "reduce-scatter": self.reduce_scatter, "all-to-all": self.all_to_all,
            "collective-permute": self.collective_permute,
        }.get(c.kind)
        if fn is None:
            raise ValueError(f"unknown collective kind {c.kind!r}; known: {COLLECTIVE_KINDS}")
        return fn(c.bytes, c.axes)

    def latency(self, c: Collective) -> float:
        """The latency part of ``time(c)`` (0 when no axis of ``c`` splits devices)."""
        axes = self.partitioner.active(c.axes)
        return self._latency(axes, c.kind == "collective-permute") if axes else 0.0

    def latency_group(self, c: Collective) -> tuple[str, tuple[str, ...]] | None:
        """The group whose members share ``c``'s latency (paid once per plan), or None where
        ``c`` pays its own. XLA combines independent all-reduces (reduce-scatters) into one
        op on every platform (``Partitioner.combine_key``), but only XLA:GPU runs that op as
        one call (one grouped NCCL launch). XLA:CPU runs it as one rendezvous of the device
        threads per operand: one all-reduce over 8 CPU devices of 1, 4, 16 and 38 operands
        (64 floats each) took 0.44, 1.16, 3.83 and 9.47 ms, a latency per operand."""
        return None if self.partitioner.platform == "cpu" else self.partitioner.combine_key(c)

    def op_time(self, c: Collective, operands: int) -> float:
        """Seconds for one HLO op that combines ``operands`` collectives like ``c`` (``c``
        holding all their bytes): one latency where the platform runs the op as one call,
        one per operand where it does not (``latency_group``)."""
        per_operand = c.kind in COMBINED_KINDS and self.latency_group(c) is None
        return self.time(c) + (max(operands, 1) - 1) * self.latency(c) * per_operand

    def split(self, c: Collective) -> tuple[float, float]:
        """``time(c)`` as (bandwidth seconds, latency seconds)."""
        lat = self.latency(c)
        return self.time(c) - lat, lat

    # -- resharding -------------------------------------------------------------------------
    def reshard(self, shape: Sequence[int], dtype, src: Spec,
                dst: Spec) -> tuple[float, tuple[Collective, ...]]:
        """Seconds and collectives to turn an array of full ``shape`` from ``src`` into ``dst``
        (``Partitioner.reshard`` says which collectives)."""
        key = (tuple(shape), dtype, src, dst)
        hit = self._reshards.get(key)
        if hit is None:
            colls = self.partitioner.reshard(shape, dtype, src, dst)
            hit = self._reshards[key] = (sum(self.time(c) for c in colls), colls)
        return hit

    # -- compute ----------------------------------------------------------------------------
    def compute(self, flops: float, dtype, matmul: float | None = None,
                conv: bool = False) -> float:
        """Seconds for ``flops`` at the device's achievable rate for ``dtype``, that of a
        matmul of ``matmul`` FLOPs (per batch element) when given, of a convolution with
        ``conv`` (``DeviceSpec.flops``)."""
        return float(flops) / self.mesh.device.flops(np.dtype(dtype).name, matmul, conv)

    def op_rate(self, primitive: str) -> float | None:
        """Elements per second the device computes of ``primitive`` (an elementwise op's
        output elements, a reduction's input elements) at its rate for the primitive's kind
        (``OP_KINDS``, ``DeviceSpec.op_rates``); None where the device rates no such op."""
        kind = OP_KINDS.get(primitive)
        return self.mesh.device.op_rate(kind) if kind else None

    def host_copy_time(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` between device and pinned host memory, one way, at the
        device's ``host_bandwidth``; a device whose host link is not known (0) at its own
        memory's copy rate (half the read + write bandwidth)."""
        device = self.mesh.device
        return float(nbytes) / (device.host_bandwidth or device.bandwidth / 2)

    def memory_time(self, nbytes: float, transpose: bool = False) -> float:
        """Seconds to read or write ``nbytes`` of device memory (the roofline's memory term);
        ``transpose``: by a kernel that reorders dimensions (``DeviceSpec.transpose_bandwidth``)."""
        device = self.mesh.device
        return float(nbytes) / (device.transpose_bandwidth if transpose else device.bandwidth)
