"""What XLA's SPMD partitioner emits for a sharded op: the collectives, never their seconds.

The rules (``spmd.rules``) ask it which collective finishes a partial sum; the cost graph asks
it what a sharding change becomes; ``spmd.cost.time`` prices what it answers. Bytes are
counted the way ``spmd.analysis`` counts HLO bytes, so a prediction can be checked against
the compiled program: B is the bytes one device holds before the op (all-reduce,
reduce-scatter, all-to-all, collective-permute) or after it (all-gather). Axes of size 1
split nothing and produce no collective.

**Platform.** XLA:CPU has no reduce-scatter pass: it all-reduces and slices. XLA:GPU emits a
reduce-scatter (its ReduceScatterCreator pass turns the partitioner's all-reduce +
dynamic-slice into one). The platform is the mesh's own, virtual or not: a plan for a cluster
that is not present (compiled on simulated CPU devices to check it) is priced as that
cluster's XLA:GPU would run it, not as the CPU stand-in does. ``spmd.analysis.reconcile``
reads a CPU compile of a GPU plan back into XLA:GPU's collectives, so the check still holds.

**Combining.** XLA's combiner passes (AllReduceCombiner, ReduceScatterCombiner) merge
collectives of one kind over the same devices when none depends on another: the per-parameter
gradient all-reduces of a train step become one or two (38 -> 2 on gpt-tiny).
``Partitioner.combine_key`` names the group a collective merges into (``COMBINED_KINDS``):
one HLO op, whose members share one latency on XLA:GPU but not on XLA:CPU, which runs it
operand by operand (``CostModel.latency_group``).
XLA:GPU merges only up to ``combine_threshold`` bytes of operands into one (its default,
30 MiB): a large model's gradients go in many groups, each waiting only for its own
members, where XLA:CPU's single group holds every partial gradient until the last.

**A dot's scattered partial sum.** Where a dot's result, partial over some axes, is wanted
split on them too, and axes that neither sum nor split it hold a multiple of their devices,
XLA's dot handler spreads the result over those instead: it all-reduces one piece per device
and permutes it into place (``Partitioner.spread_axes``), on every platform.

``Partitioner.reshard`` predicts what the partitioner emits for a sharding change (checked
against compiled HLO on 8 CPU devices in tests/test_cost.py), in this order of rules:

1. same sharding: nothing;
2. the same number of tiles on every dim, only the devices differ (an axis reorder such as
   ``(data, model) -> (model, data)``, or ``a -> b`` with equal sizes): one collective-permute
   of the per-device piece;
3. every dim split at least as finely in ``dst``: a free local slice when each dst dim extends
   its src axes, else slice + collective-permute of the (smaller) dst piece;
4. every dim split at most as finely: one all-gather per shrinking dim, last dim first, over
   the dropped axes of that dim (several axes of one dim gather together); when the dropped
   axes are not a suffix of the dim's axes, XLA first permutes the src piece;
5. an axis moving to another dim: gather the axes that disappear, slice the new ones, then one
   all-to-all over the moving axes (plus a collective-permute when the device order that
   results is not the one asked for); not when one dim would both lose an axis and send one
   away (``(-, (model, data)) -> (model, -)``): XLA rematerializes that (rule 6);
6. otherwise XLA's "involuntary full rematerialization": all-gather everything, then slice.

>>> from spmd.cluster.mesh import make_mesh
>>> Partitioner(make_mesh({"data": 2, "model": 4})).reshard((16, 32), "float32", (("data",), ()), ((), ()))
(Collective(kind='all-gather', axes=('data',), bytes=2048.0),)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from spmd.cluster.mesh import DeviceMesh
from spmd.sharding import Spec

__all__ = ["COLLECTIVE_KINDS", "COMBINED_KINDS", "PARTIAL_SUM_KINDS", "Collective", "Partitioner"]

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
#: kinds XLA combines into one op when independent (one per kind and axes)
COMBINED_KINDS = ("all-reduce", "reduce-scatter")
#: kinds that read a partial sum, a buffer of its own beside the op's result
PARTIAL_SUM_KINDS = ("all-reduce", "reduce-scatter")
#: operand bytes per device XLA:GPU combines into one collective at most
#: (``kDefault{AllReduce,ReduceScatter}CombineThreshold``)
GPU_COMBINE_THRESHOLD = 30 * 2**20 + 7

_Dims = list[tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One predicted collective, as seen by one device.

    Attributes:
        kind: one of ``COLLECTIVE_KINDS``.
        axes: the mesh axes it runs over.
        bytes: B as defined in the module docstring (matches ``spmd.analysis``'s counting).
    """

    kind: str
    axes: tuple[str, ...]
    bytes: float


def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


class Partitioner:
    """Which collectives XLA emits on one mesh: partial sums, sharding changes, combining."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self._sizes = mesh.shape
        #: the platform whose XLA emits the collectives: the mesh's own, even when it is
        #: virtual (a GPU cluster compile-checked on CPU devices is priced as XLA:GPU runs it)
        self.platform = mesh.platform
        #: operand bytes per device one combined collective holds at most
        self.combine_threshold = GPU_COMBINE_THRESHOLD if self.platform == "gpu" else math.inf

    def active(self, axes: Sequence[str] | str | None) -> tuple[str, ...]:
        """The axes that really split devices (size > 1), in the given order."""
        if axes is None:
            return ()
        if isinstance(axes, str):
            axes = (axes,)
        for a in axes:
            if a not in self._sizes:
                raise KeyError(f"unknown mesh axis {a!r}; mesh axes: {list(self._sizes)}")
        return tuple(a for a in axes if self._sizes[a] > 1)

    def group_size(self, axes: tuple[str, ...]) -> int:
        """Devices in one group of a collective over ``axes``."""
        return math.prod(self._sizes[a] for a in axes)

    def combine_key(self, c: Collective) -> tuple[str, tuple[str, ...]] | None:
        """The group (one HLO op) XLA merges ``c`` into when it is independent of others of
        its group, or None for a kind that is never combined."""
        return (c.kind, self.active(c.axes)) if c.kind in COMBINED_KINDS else None

    # -- partial sums -----------------------------------------------------------------------
    def partial_sum(self, shape: Sequence[int], dtype, out_spec: Spec,
                    sum_axes, spread: bool = False) -> tuple[Collective, ...]:
        """What finishes a result that is a partial sum over ``sum_axes`` (a split contraction).

        Summed axes that ``out_spec`` also splits the result on become a reduce-scatter
        (B = per-device bytes before scattering); the rest an all-reduce with B = per-device
        bytes of the result under ``out_spec``. On CPU, XLA all-reduces the unscattered result
        over every summed axis, then slices locally.

        ``spread`` (a dot): where the result is scattered over every summed axis and
        ``spread_axes`` finds axes to spread it over, XLA's dot handler computes each
        device's piece there, all-reduces it over the summed axes and collective-permutes it
        into place (B = the piece, for both), on every platform: no reduce-scatter.

        >>> from spmd.cluster.mesh import make_mesh
        >>> Partitioner(make_mesh({"data": 2, "model": 4})).partial_sum(
        ...     (8, 16), "float32", ((), ()), ("model",))
        (Collective(kind='all-reduce', axes=('model',), bytes=512.0),)
        >>> Partitioner(make_mesh({"data": 4, "model": 2})).partial_sum(
        ...     (8, 16), "float32", (("model",), ()), ("model",), spread=True)
        (Collective(kind='all-reduce', axes=('model',), bytes=256.0), \
Collective(kind='collective-permute', axes=('model', 'data'), bytes=256.0))
        """
        sum_axes = self.active(sum_axes)
        out = self._strip(out_spec)
        used = {a for d in out for a in d}
        scatter = tuple(a for a in sum_axes if a in used)
        reduce = tuple(a for a in sum_axes if a not in used)
        spread_over = self.spread_axes(out_spec, sum_axes) if spread else ()
        if spread_over:
            piece = self._bytes(shape, dtype, out)
            return (Collective("all-reduce", sum_axes, piece),
                    Collective("collective-permute", scatter + spread_over, piece))
        before = [tuple(a for a in d if a not in scatter) for d in out]
        if scatter and self.platform == "cpu":
            return (Collective("all-reduce", sum_axes, self._bytes(shape, dtype, before)),)
        colls: list[Collective] = []
        if scatter:
            colls.append(Collective("reduce-scatter", scatter, self._bytes(shape, dtype, before)))
        if reduce:
            colls.append(Collective("all-reduce", reduce, self._bytes(shape, dtype, out)))
        return tuple(colls)

    def spread_axes(self, out_spec: Spec, sum_axes) -> tuple[str, ...]:
        """The axes XLA's dot handler spreads a scattered partial sum over instead, or ().

        A dot whose result is partial over ``sum_axes`` and split on all of them by
        ``out_spec`` has its operands replicated over the axes that neither sum nor split
        (their slots hold no axis). Where those hold a multiple of the summed group's
        devices, XLA slices the operands over them (free), so each device computes only its
        piece of the result, and all-reduces that piece over the summed axes, then permutes
        it to the device ``out_spec`` puts it on. Seen in compiled HLO on 4x2, 4x4 and 8x8
        meshes (tests/test_cost.py); on 2x4, scattered over ``data`` of 2 with ``model`` of 4
        free, too; scattered over ``model`` of 4 with ``data`` of 2 free, not (the
        all-reduce and slice of a reduce-scatter)."""
        sum_axes = self.active(sum_axes)
        out = self._strip(out_spec)
        used = {a for d in out for a in d}
        if not sum_axes or any(a not in used for a in sum_axes):
            return ()
        free = tuple(a for a in self._sizes if self._sizes[a] > 1
                     and a not in used and a not in sum_axes)
        if not free or self.group_size(free) % self.group_size(sum_axes):
            return ()
        return free

    # -- resharding -------------------------------------------------------------------------
    def reshard(self, shape: Sequence[int], dtype, src: Spec, dst: Spec) -> tuple[Collective, ...]:
        """The collectives that turn an array of full ``shape`` from ``src`` into ``dst``
        (the rules of the module docstring, which mirror XLA's SPMD partitioner)."""
        if len(src) != len(shape) or len(dst) != len(shape):
            raise ValueError(f"reshard: specs {src} -> {dst} do not match rank of shape {tuple(shape)}")
        return tuple(self._reshard(tuple(shape), _itemsize(dtype), self._strip(src),
                                   self._strip(dst)))

    def _strip(self, spec: Spec) -> _Dims:
        return [self.active(d) for d in spec]

    def _bytes(self, shape, dtype_or_size, dims: _Dims) -> float:
        size = dtype_or_size if isinstance(dtype_or_size, int) else _itemsize(dtype_or_size)
        elems = math.prod(max(1, s // self.group_size(d)) for s, d in zip(shape, dims))
        return float(elems * size)

    def _tiles(self, dims: _Dims) -> list[int]:
        return [self.group_size(d) for d in dims]

    def _reshard(self, shape, size, src: _Dims, dst: _Dims) -> list[Collective]:
        if src == dst:
            return []
        nbytes = lambda dims: self._bytes(shape, size, dims)  # noqa: E731
        ts, td = self._tiles(src), self._tiles(dst)
        changed = tuple(sorted({a for s, d in zip(src, dst) if s != d for a in s + d},
                               key=list(self._sizes).index))
        # Rule 2: same tiling, other devices -> one collective-permute.
        if ts == td:
            return [Collective("collective-permute", changed, nbytes(src))]
        # Rule 3: dst at least as fine on every dim -> slice (+ permute).
        if all(b % a == 0 for a, b in zip(ts, td)):
            if all(d[: len(s)] == s for s, d in zip(src, dst)):
                return []
            return [Collective("collective-permute", changed, nbytes(dst))]
        # Rule 4: dst at most as fine on every dim -> all-gathers (after a permute if needed).
        if all(a % b == 0 for a, b in zip(ts, td)):
            out: list[Collective] = []
            if not all(s[: len(d)] == d for s, d in zip(src, dst)):
                out.append(Collective("collective-permute", changed, nbytes(src)))
            cur = list(src)
            for i in reversed(range(len(shape))):
                if ts[i] != td[i]:
                    cur[i] = dst[i]
                    out.append(Collective("all-gather", self._gather_axes(src[i], dst[i]),
                                          nbytes(cur)))
            return out
        # Rule 5: axes moving between dims -> all-to-all.
        moved = self._all_to_all_path(shape, size, src, dst)
        if moved is not None:
            return moved
        # Rule 6: full rematerialization.
        return self._gather_all(shape, size, src)

    def _gather_axes(self, s: tuple[str, ...], d: tuple[str, ...]) -> tuple[str, ...]:
        """Axes an all-gather from ``s`` to ``d`` (on one dim) runs over.

        The dropped suffix when ``d`` is a prefix of ``s``; otherwise (after a permute) the
        shortest suffix of the axes not in ``d`` whose size is the gathered factor, or all of
        them when no such suffix exists (then the group size is approximate).
        """
        if s[: len(d)] == d:
            return s[len(d):]
        gone = tuple(a for a in s if a not in d)
        factor = self.group_size(s) // self.group_size(d)
        for k in range(1, len(gone) + 1):
            if self.group_size(gone[-k:]) == factor:
                return gone[-k:]
        return gone or s

    def _gather_all(self, shape, size, src: _Dims) -> list[Collective]:
        out = []
        cur = list(src)
        for i in reversed(range(len(shape))):
            if cur[i]:
                axes = cur[i]
                cur[i] = ()
                out.append(Collective("all-gather", axes, self._bytes(shape, size, cur)))
        return out

    def _all_to_all_path(self, shape, size, src: _Dims, dst: _Dims) -> list[Collective] | None:
        dst_dim = {a: i for i, d in enumerate(dst) for a in d}
        src_dim = {a: i for i, d in enumerate(src) for a in d}
        moving = [a for a in src_dim if a in dst_dim and src_dim[a] != dst_dim[a]]
        if not moving:
            return None
        out: list[Collective] = []
        cur = [list(d) for d in src]
        # Gather the axes that disappear; each must be a suffix of its dim, on a dim no axis
        # moves away from (XLA does not gather and all-to-all one dim in a row: it
        # rematerializes the whole array instead).
        for i in reversed(range(len(shape))):
            gone = [a for a in cur[i] if a not in dst_dim]
            if gone:
                if cur[i][-len(gone):] != gone or any(a in moving for a in cur[i]):
                    return None
                del cur[i][-len(gone):]
                out.append(Collective("all-gather", tuple(gone),
                                      self._bytes(shape, size, [tuple(d) for d in cur])))
        # Slice the new axes (free), appended to their dst dim.
        for i, d in enumerate(dst):
            cur[i].extend(a for a in d if a not in src_dim)
        # Move: per source dim, the moving axes must be a suffix going to one target dim.
        pairs: dict[int, int] = {}
        for i in range(len(shape)):
            m = [a for a in cur[i] if a in moving]
            if not m:
                continue
            targets = {dst_dim[a] for a in m}
            if cur[i][-len(m):] != m or len(targets) != 1:
                return None
            pairs[i] = targets.pop()
        if len(set(pairs.values())) != len(pairs):
            return None  # two dims feeding one: XLA rematerializes
        before = self._bytes(shape, size, [tuple(d) for d in cur])
        taken = {i: [a for a in cur[i] if a in moving] for i in pairs}
        for i, j in pairs.items():
            del cur[i][-len(taken[i]):]
        for i, j in pairs.items():
            cur[j].extend(taken[i])
        axes = tuple(a for a in self._sizes if a in moving)
        out.append(Collective("all-to-all", axes, before))
        final = [tuple(d) for d in cur]
        if final != dst or len(pairs) > 1:
            if self._tiles(final) != self._tiles(dst):
                return None
            changed = tuple(a for a in self._sizes
                            if any(a in f + d for f, d in zip(final, dst) if f != d)) or axes
            out.append(Collective("collective-permute", changed, self._bytes(shape, size, dst)))
        return out
