"""How one array is split over a mesh, in the planner's own terms.

A ``Spec`` holds, for each array dimension, the tuple of mesh axes that split it (empty:
not split). It is hashable, so strategies and cost tables can key on it, and converts to and
from ``jax.sharding.PartitionSpec``.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import numpy as np
from jax.sharding import PartitionSpec

Spec = tuple[tuple[str, ...], ...]


def replicated(ndim: int) -> Spec:
    """The spec of an array that every device holds whole.

    >>> replicated(2)
    ((), ())
    """
    return ((),) * ndim


def spec_to_json(spec: Spec | None) -> list | None:
    """A spec as JSON holds it (lists of axis names; None stays None)."""
    return None if spec is None else [list(axes) for axes in spec]


def spec_from_json(raw: list | None) -> Spec | None:
    """The inverse of ``spec_to_json``.

    >>> spec_from_json(spec_to_json((("data",), ())))
    (('data',), ())
    """
    return None if raw is None else tuple(tuple(axes) for axes in raw)


def to_partition_spec(spec: Spec) -> PartitionSpec:
    """Convert to jax's form; trailing unsplit dimensions are dropped.

    >>> to_partition_spec(((), ("data", "model")))
    P(None, ('data', 'model'))
    """
    entries = [None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def from_partition_spec(pspec: PartitionSpec | None, ndim: int) -> Spec:
    """Convert from jax's form; ``None`` means replicated.

    >>> from_partition_spec(PartitionSpec("data"), 2)
    (('data',), ())
    """
    if pspec is None:
        return replicated(ndim)
    out: list[tuple[str, ...]] = []
    for entry in tuple(pspec) + (None,) * (ndim - len(pspec)):
        if entry is None or entry == PartitionSpec.UNCONSTRAINED:
            out.append(())
        elif isinstance(entry, str):
            out.append((entry,))
        else:
            out.append(tuple(entry))
    return tuple(out[:ndim])


def used_axes(spec: Spec) -> tuple[str, ...]:
    return tuple(a for axes in spec for a in axes)


def is_valid(spec: Spec, shape: Sequence[int], mesh_shape: Mapping[str, int]) -> bool:
    """Each mesh axis used at most once, and each dimension divisible by its axes' sizes."""
    axes = used_axes(spec)
    if len(axes) != len(set(axes)) or len(spec) != len(shape):
        return False
    return all(dim % math.prod(mesh_shape[a] for a in split) == 0
               for dim, split in zip(shape, spec))


def shard_shape(shape: Sequence[int], spec: Spec, mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
    """The shape of the piece one device holds.

    >>> shard_shape((8, 6), (("data",), ()), {"data": 2})
    (4, 6)
    """
    return tuple(dim // math.prod(mesh_shape[a] for a in split) for dim, split in zip(shape, spec))


def bytes_per_device(shape: Sequence[int], dtype, spec: Spec, mesh_shape: Mapping[str, int]) -> int:
    return math.prod(shard_shape(shape, spec, mesh_shape)) * np.dtype(dtype).itemsize


def spread(spec: Spec, shape: Sequence[int], mesh_shape: Mapping[str, int]) -> Spec:
    """``spec`` with every mesh axis it leaves unused (of size > 1) also splitting a dim
    that its size still divides (the largest piece first): each device then holds a piece
    no other holds. A copy between pipeline stages sends a replicated activation so, each
    device a part, and the receiving stage gathers it on its own links (Megatron's
    scatter-gather of pipeline sends), not each device all of it over the slower link
    between stages.

    >>> spread((("data",), ()), (8, 6), {"data": 2, "model": 3})
    (('data',), ('model',))
    >>> spread(((), ()), (8, 5), {"data": 2, "model": 4})
    (('data', 'model'), ())
    """
    dims = [list(axes) for axes in spec]
    for axis, size in mesh_shape.items():
        if size <= 1 or axis in used_axes(spec):
            continue
        pieces = shard_shape(shape, tuple(tuple(d) for d in dims), mesh_shape)
        fits = [k for k in range(len(dims)) if pieces[k] % size == 0]
        if fits:
            dims[max(fits, key=lambda k: pieces[k])].append(axis)
    return tuple(tuple(d) for d in dims)


def spread_bytes(shape: Sequence[int], dtype, spec: Spec, mesh_shape: Mapping[str, int]) -> int:
    """Bytes each device sends of a copy between pipeline stages of an array in ``spec``:
    its piece under ``spread`` (no two devices send the same bytes)."""
    return bytes_per_device(shape, dtype, spread(spec, shape, mesh_shape), mesh_shape)


def format_spec(spec: Spec) -> str:
    """Readable form for plans: ``S(data)R`` style would hide axis names, so print P-like text.

    >>> format_spec((("data",), (), ("data", "model")))
    'P(data, -, data+model)'
    """
    return "P(" + ", ".join("+".join(axes) if axes else "-" for axes in spec) + ")"


def all_specs(shape: Sequence[int], mesh_shape: Mapping[str, int],
              max_axes_per_dim: int = 2, axes: Iterable[str] | None = None) -> list[Spec]:
    """Every valid spec of an array on the mesh (axes of size 1 are never used)."""
    names = [a for a in (axes if axes is not None else mesh_shape) if mesh_shape[a] > 1]
    results: list[Spec] = []

    def extend(dim: int, free: tuple[str, ...], prefix: list[tuple[str, ...]]) -> None:
        if dim == len(shape):
            results.append(tuple(prefix))
            return
        options: list[tuple[str, ...]] = [()]
        for a in free:
            options.append((a,))
            if max_axes_per_dim >= 2:
                options.extend((a, b) for b in free if b != a)
        for opt in options:
            if shape[dim] % math.prod(mesh_shape[a] for a in opt) == 0:
                extend(dim + 1, tuple(a for a in free if a not in opt), prefix + [opt])

    extend(0, tuple(names), [])
    return results
