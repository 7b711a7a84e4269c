"""Times ops on every device of a mesh at once, as a training step runs them: the programs
``spmd profile`` (``spmd.profile``) measures a device and its links with.

Most ops run as a loop inside one jitted program, for 1 and for k iterations: the difference
over k - 1 iterations is its time without the call's dispatch (``Timer.loop``). Matmuls and
the per-kernel overhead are timed at a program's top level instead, as a step's kernels run,
unrolled 1 and 1 + n times (``Timer.unrolled``): XLA:CPU runs a small matmul at the top
level at up to twice its cost in a loop's body. Every time is the median of repeats.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Sequence

import numpy as np

from spmd.errors import ProfileError

__all__ = ["OP_CHAIN", "Timer", "above_noise"]

#: the k-iteration run: 4 to 63 iterations more than the 1-iteration run it is compared
#: with (enough that their noise does not dominate)
_EXTRA_ITERATIONS = (4, 63)
#: how many more matmuls the long program of ``Timer.matmul`` runs than the short one
_CHAIN = 16
#: the same for ``Timer.overhead``'s tiny matmuls (each a few hundred nanoseconds)
_OVERHEAD_CHAIN = 64
#: at least this many paired timings in ``Timer.unrolled``: a few kernels' difference
#: between two calls of a program is small beside the calls' own jitter
_UNROLLED_PAIRS = 15
#: ops of one kind per element in ``Timer.op_rates``'s loop body (one fused kernel), so
#: that their compute outweighs the kernel's read and write of the matrix
OP_CHAIN = 8
#: how many times longer a timing lost in noise runs on each retry (``above_noise``)
_LONGER = (1, 4, 16)


class Timer:
    """Times ops on every device of a jax mesh at once, each device on its own block."""

    def __init__(self, jmesh, repeats: int, loop_seconds: float):
        from jax.sharding import NamedSharding, PartitionSpec

        self.jmesh, self.repeats, self.loop_seconds = jmesh, repeats, loop_seconds
        self.devices = jmesh.devices.size
        self.spec = PartitionSpec(tuple(jmesh.axis_names))  # dim 0 split over every axis
        self.sharding = NamedSharding(jmesh, self.spec)

    def _zeros(self, local_shape: tuple[int, ...], dtype):
        import jax
        import jax.numpy as jnp

        shape = (local_shape[0] * self.devices, *local_shape[1:])
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self.sharding)()

    @staticmethod
    def _seconds(fn: Callable, *args) -> float:
        import jax

        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        return time.perf_counter() - start

    def loop(self, body: Callable, operands: Sequence[tuple[tuple[int, ...], object]]) -> float:
        """Seconds of one ``body(carry, *rest)`` (the carry's shape kept) on every device at
        once: a loop run for 1 and for k iterations, k sized so the run is long beside the
        dispatch, which the difference cancels. The median of paired differences, each pair
        run back to back so both see the same load of a shared host. Lost in noise (not above
        0), it is run longer (``above_noise``)."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import PartitionSpec

        def per_device(k, carry, *rest):
            return jax.lax.fori_loop(0, k, lambda _, y: body(y, *rest), carry)

        fn = jax.jit(jax.shard_map(per_device, mesh=self.jmesh, out_specs=self.spec,
                                   in_specs=(PartitionSpec(),) + (self.spec,) * len(operands),
                                   check_vma=False))
        arrays = [self._zeros(shape, dtype) for shape, dtype in operands]
        one = jnp.int32(1)
        self._seconds(fn, one, *arrays)  # compiled and warm
        single = self._seconds(fn, one, *arrays)
        low, high = _EXTRA_ITERATIONS

        def timed(longer: int) -> float:
            k = 1 + int(np.clip(round(longer * self.loop_seconds / single), low, longer * high))
            many = jnp.int32(k)
            self._seconds(fn, many, *arrays)
            return statistics.median(
                (self._seconds(fn, many, *arrays) - self._seconds(fn, one, *arrays)) / (k - 1)
                for _ in range(self.repeats))

        return above_noise(timed)

    def unrolled(self, body: Callable, operands: Sequence[tuple[tuple[int, ...], object]],
                 extra: int) -> float:
        """Seconds one more ``body(carry, *rest)`` adds to a program's top level on every
        device at once: programs running it 1 and ``1 + extra`` times back to back, unrolled;
        the median of paired differences over ``extra``. A step's kernels run at the top of
        its program, and XLA:CPU runs small matmuls dearer there than inside a loop's body:
        a 64x64 fp32 matmul took 6.2 us unrolled against 3.5 us in a loop (jax 0.10.2, 2
        cores; 256x256: 180 against 171 us). A tiny one's overhead, 0.28 against 0.36 us,
        is the same within the noise. Lost in noise, the long program runs more
        (``above_noise``): one of six profiles of one CPU device read a kernel overhead of
        0 before it did."""
        import jax

        def program(length: int) -> Callable:
            def per_device(carry, *rest):
                for _ in range(length):
                    carry = body(carry, *rest)
                return carry
            return jax.jit(jax.shard_map(per_device, mesh=self.jmesh, out_specs=self.spec,
                                         in_specs=(self.spec,) * len(operands),
                                         check_vma=False))

        arrays = [self._zeros(shape, dtype) for shape, dtype in operands]
        short = program(1)
        self._seconds(short, *arrays)  # compiled and warm
        pairs = max(3 * self.repeats, _UNROLLED_PAIRS)

        def timed(longer: int) -> float:
            more = extra * longer
            long = program(1 + more)
            self._seconds(long, *arrays)  # compiled and warm
            return statistics.median(
                (self._seconds(long, *arrays) - self._seconds(short, *arrays)) / more
                for _ in range(pairs))

        return above_noise(timed)

    def matmul(self, side: int, dtype: str, overhead: float, batch: int = 1) -> float:
        """FLOP/s of a square matmul per device (``batch`` of them in one kernel), beyond
        the kernel's ``overhead`` (priced apart): dependent matmuls at a program's top level
        (``unrolled``), as a step runs them."""
        square = [((batch, side, side) if batch > 1 else (side, side), dtype)] * 2
        seconds = self.unrolled(_matmul, square, _CHAIN)
        return _per_second(2.0 * batch * side**3, max(seconds - overhead, 0.5 * seconds),
                           f"{dtype} matmul")

    def bandwidth(self, nbytes: int) -> float:
        """Bytes read + written per second by an elementwise op per device."""
        seconds = self.loop(lambda y: y * 0.5 + 1.0, [((nbytes // 4,), "float32")])
        return _per_second(2.0 * nbytes, seconds, "memory bandwidth")

    def host_link(self, nbytes: int) -> float:
        """Bytes per second each device copies to pinned host memory or back (the median
        round trip's, each way), every device at once: a host offload's link. Timed from
        the host, as the copies are calls of their own (XLA:GPU's offload runs them as
        asynchronous copies inside the step)."""
        import jax

        buffer = self._zeros((nbytes // 4,), "float32")
        host = self.sharding.with_memory_kind("pinned_host")
        device = self.sharding.with_memory_kind("device")
        jax.block_until_ready(jax.device_put(jax.device_put(buffer, host), device))  # warm
        trips = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            there = jax.block_until_ready(jax.device_put(buffer, host))
            jax.block_until_ready(jax.device_put(there, device))
            trips.append(time.perf_counter() - start)
        return _per_second(2.0 * nbytes, statistics.median(trips), "host link bandwidth")

    def transpose(self, side: int) -> float:
        """Bytes read + written per second by a transpose of a square fp32 matrix per
        device (scaled on the way, so that it is a kernel of its own)."""
        seconds = self.loop(lambda y: y.T * 0.5, [((side, side), "float32")])
        return _per_second(2.0 * 4 * side * side, seconds, "transpose bandwidth")

    def conv(self, shape: tuple[int, int, int, int], dtype: str) -> float:
        """FLOP/s of a 3x3 convolution per device (NHWC ``shape``, as many channels out as
        in, padded to keep its size)."""
        import jax

        channels = shape[-1]

        def body(y, kernel):
            return jax.lax.conv_general_dilated(y, kernel, (1, 1), "SAME",
                                                dimension_numbers=("NHWC", "HWIO", "NHWC"))

        seconds = self.loop(body, [(shape, dtype), ((3, 3, channels, channels), dtype)])
        return _per_second(2.0 * 9 * math.prod(shape) * channels, seconds, f"{dtype} convolution")

    def op_rates(self, side: int) -> dict[str, float]:
        """Elements per second of each kind of op in ``OP_RATE_KINDS`` per device: a loop
        body of ``OP_CHAIN`` such ops per element of a ``side`` x ``side`` fp32 matrix,
        which XLA fuses into one kernel. Exponentials alternate exp and tanh. A division
        (``1 / (y + 1)``: one by its own result would simplify away) and a reduction (over
        the minor and the major dimension in turn, its result scaled and added back) come
        with elementwise ops, whose time at the elementwise rate is taken off theirs."""
        import jax.numpy as jnp

        matrix = [((side, side), "float32")]
        elements = float(OP_CHAIN * side * side)

        def chain(op: Callable) -> Callable:
            def body(y):
                for i in range(OP_CHAIN):
                    y = op(y, i)
                return y
            return body

        def rate(kind: str, op: Callable, plain: int = 0) -> float:
            seconds = self.loop(chain(op), matrix)
            if plain:
                seconds = max(seconds - plain * elements / rates["elementwise"], 0.5 * seconds)
            return _per_second(elements, seconds, f"{kind} ops")

        rates: dict[str, float] = {}
        rates["elementwise"] = rate("elementwise", lambda y, i: y + 1e-3 if i % 2 else y * 0.999)
        rates["divide"] = rate("divide", lambda y, _: 1.0 / (y + 1.0), plain=1)
        rates["root"] = rate("root", lambda y, _: jnp.sqrt(y))
        rates["exponential"] = rate("exponential",
                                    lambda y, i: jnp.exp(-y) if i % 2 else jnp.tanh(y))
        rates["reduce"] = rate("reduce", lambda y, i: y + 1e-3 * jnp.sum(
            y, axis=i % 2, keepdims=True), plain=2)
        return rates

    def overhead(self) -> float:
        """Seconds one more kernel adds to a program on every device: dependent 8x8 matmuls
        (each its own kernel, its work negligible) at the program's top level
        (``unrolled``)."""
        return max(self.unrolled(_matmul, [((8, 8), "float32")] * 2, _OVERHEAD_CHAIN), 0.0)

    def collective(self, kind: str, axis: str, nbytes: int) -> float:
        """Seconds of one ``kind`` over ``axis`` with ``nbytes`` per device (B as the cost
        model counts it: after an all-gather, before a reduce-scatter)."""
        import jax.lax as lax

        n = self.jmesh.shape[axis]
        elements = max(n, nbytes // 4 // n * n)
        bodies = {
            "all-reduce": lambda y: lax.psum(y, axis),
            "all-gather": lambda y: lax.all_gather(y[: elements // n], axis, tiled=True),
            "reduce-scatter": lambda y: lax.dynamic_update_slice(
                y, lax.psum_scatter(y, axis, tiled=True), (0,)),
            "all-to-all": lambda y: lax.all_to_all(y, axis, 0, 0, tiled=True),
            "collective-permute": lambda y: lax.ppermute(
                y, axis, [(i, (i + 1) % n) for i in range(n)]),
        }
        return self.loop(bodies[kind], [((elements,), "float32")])


def above_noise(timed: Callable[[int], float]) -> float:
    """``timed(longer)``: seconds per op from a run ``longer`` times the usual length, first
    1, then 4 and 16 times where the difference a run measures was lost in the noise of a
    busy host (not above 0); still lost, not above 0."""
    seconds = 0.0
    for longer in _LONGER:
        seconds = timed(longer)
        if seconds > 0:
            break
    return seconds


def _matmul(y, w):
    """One matmul of a chain: its result is the next one's operand."""
    return y @ w


def _per_second(work: float, seconds: float, what: str) -> float:
    """``work / seconds``, refusing a timing lost in noise even when run longer
    (``above_noise``)."""
    if not seconds > 0:
        raise ProfileError(f"{what}: the timing was lost in noise; run again on an idle "
                           f"machine")
    return work / seconds
