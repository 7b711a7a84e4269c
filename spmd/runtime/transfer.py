"""Copies of arrays between two pipeline stages as collective-permute programs.

Why a collective: in a run of several processes a stage's devices belong to one process and
``jax.device_put`` cannot move an array to another process's devices (XLA:CPU has no
cross-host transfer at all). A jitted program over both stages' devices can: the union of
the two submeshes is a mesh with one more axis (``PAIR``, the sender at 0 and the receiver at
1), the array is declared on it in its spec on the inner axes, and a ``ppermute`` along
``PAIR`` moves each device's shard to the device at the same place of the receiving
submesh. Every process holding a device of either stage calls the program at the same point
of the schedule; the sender's shards go in as they are (no copy), the receiver's devices
contribute zeros, and the receiver keeps what arrived. In the compiled HLO each copy is one
collective-permute of one shard's bytes, which is what the stage pricing predicts.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd.errors import PlanError

__all__ = ["PAIR", "StageLinks", "absent", "holds"]

#: the axis of a transfer program's mesh that tells the sending stage (0) from the receiving
PAIR = "_stage_pair"


def holds(sharding: jax.sharding.Sharding) -> bool:
    """Whether this process holds any device of ``sharding`` (always, in one process)."""
    return bool(sharding.addressable_devices)


def absent(shape: Sequence[int], dtype: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """The array of ``shape`` and ``dtype`` in ``sharding`` as a process that holds none of
    its devices sees it: no shard here, the same global shape and sharding everywhere, so a
    pipelined step returns the same structure on every process."""
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [],
                                                    dtype=np.dtype(dtype))


def abstract(x: Any) -> Any:
    """An array as its shape, dtype and sharding (what compiling for it needs), keeping no
    buffer alive: a program's arguments are kept so, for reports, between calls."""
    return (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array) else x)


class StageLinks:
    """Transfer programs between the stages' submeshes (of one shape and axis names)."""

    def __init__(self, meshes: Sequence[Mesh]):
        self.meshes = list(meshes)
        self._programs: dict[tuple[int, int, PartitionSpec], Any] = {}
        self._zeros: dict[tuple[Any, tuple[int, ...], str], jax.Array] = {}
        #: per transfer program and shape: the program and its last call's arguments
        #: (``abstract``)
        self.last_args: dict[str, tuple[Any, list[Any]]] = {}

    def _union(self, src: int, dst: int) -> Mesh:
        a, b = self.meshes[src], self.meshes[dst]
        if a.axis_names != b.axis_names or a.devices.shape != b.devices.shape:
            raise PlanError(f"stages {src} and {dst} have submeshes of different shapes "
                            f"({dict(a.shape)} and {dict(b.shape)}): a copy between "
                            f"processes moves each shard to the device at the same place, "
                            f"so the stages' submeshes must be alike")
        return Mesh(np.stack([a.devices, b.devices]), (PAIR, *a.axis_names))

    def _program(self, src: int, dst: int, spec: PartitionSpec) -> Any:
        key = (src, dst, spec)
        if key not in self._programs:
            union = self._union(src, dst)

            def permute(shard):
                return jax.lax.ppermute(shard, PAIR, [(0, 1)])

            # The union array claims to be alike along PAIR, which it is not (the receiver
            # holds zeros); check_vma=False lets that stand: only the receiver's shards of
            # the result are read.
            self._programs[key] = (union, jax.jit(jax.shard_map(
                permute, mesh=union, in_specs=spec, out_specs=spec, check_vma=False)))
        return self._programs[key]

    def _zero(self, device: Any, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
        key = (device, shape, dtype.str)
        if key not in self._zeros:
            self._zeros[key] = jax.device_put(np.zeros(shape, dtype), device)
        return self._zeros[key]

    def send(self, x: jax.Array | None, src: int, dst: int, spec: PartitionSpec,
             shape: Sequence[int], dtype: Any) -> jax.Array | None:
        """``x`` (in ``spec`` on stage ``src``; None where this process holds none of it) on
        stage ``dst`` in the same spec; None where this process holds no device of
        ``dst``. Every process holding a device of either stage must call it, in the same
        order."""
        shape, dtype = tuple(shape), np.dtype(dtype)
        union, program = self._program(src, dst, spec)
        sharding = NamedSharding(union, spec)
        shard_shape = sharding.shard_shape(shape)
        sent = {} if x is None else {s.device: s.data for s in x.addressable_shards}
        senders = set(self.meshes[src].devices.flat)
        buffers = []
        for device in sharding.addressable_devices:
            if device in senders and device not in sent:
                raise PlanError(f"a copy from stage {src}: this process holds no shard of "
                                f"the value on its device {device}")
            buffers.append(sent[device] if device in senders
                           else self._zero(device, shard_shape, dtype))
        joined = jax.make_array_from_single_device_arrays(shape, sharding, buffers, dtype=dtype)
        self.last_args[f"send {src}->{dst} {dtype.name}{list(shape)}"] = (program, [abstract(joined)])
        arrived = program(joined)
        receivers = set(self.meshes[dst].devices.flat)
        mine = [s.data for s in arrived.addressable_shards if s.device in receivers]
        if not mine:
            return None
        return jax.make_array_from_single_device_arrays(
            shape, NamedSharding(self.meshes[dst], spec), mine, dtype=dtype)
