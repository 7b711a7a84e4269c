"""`spmd profile`: measure the devices present and their links, as a mesh file's figures.

The bundled mesh files hold datasheet figures, and a predicted step time is only as good as
them. This module times, on every device of a mesh at once (as a training step uses them):

* the device: matmul FLOP/s per dtype (bf16, and fp32 at JAX's default precision), that of
  the largest of a few square shapes, and from the others the curve of rate by size (the
  smallest run batched, as attention's per-head matmuls do, so that their kernel is long
  enough to time); memory bandwidth (an elementwise op over a large buffer, bytes read plus
  written); the host link (a buffer copied to pinned host memory and back, each way's
  bytes per second); the bandwidth of a transpose (a square matrix copied transposed); a 3x3
  convolution's FLOP/s beside the matmul's; the per-kernel overhead (what one more
  kernel adds to a program: a chain of tiny dependent matmuls, each its own kernel, timed
  at two lengths); and the elements per second of each kind of op besides matmuls
  (elementwise arithmetic, divisions, roots, exponentials, reductions: ``op_rates``),
  several per element in one kernel, so that the compute and not the memory is timed;
* per mesh axis of size > 1, each collective kind over a range of sizes, the other axes
  running their own groups meanwhile. Latency alpha and inverse bandwidth beta are fitted
  to ``t = alpha + beta * x``, where x is the bytes the cost model's ring formula charges
  (``CostModel`` on a unit link), so the fitted bandwidth means what a mesh file's link
  means. The axis's link is the joint fit of all-reduce and all-gather, the collectives a
  training step mostly runs; the other kinds' fits are reported beside it.

Each op is timed as a loop inside one jitted program (``spmd.kernel_timer.Timer``), run for
1 and for k iterations: the difference over k - 1 iterations is its time without the call's
dispatch, as it runs inside a step. Every time is the median of repeats.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np

from spmd.cluster.hardware import DeviceSpec
from spmd.cluster.mesh import BUNDLED_DIR, DeviceMesh, Link, make_mesh, mesh_yaml
from spmd.cost.partitioner import COLLECTIVE_KINDS, Collective
from spmd.cost.time import CostModel
from spmd.errors import MeshError, ProfileError
from spmd.kernel_timer import OP_CHAIN, Timer
from spmd.units import readable_bytes

__all__ = ["DEFAULT_SIZES", "QUICK_SIZES", "DeviceFigures", "Fit", "Profile", "TimedShapes",
           "fit_link", "profile_mesh"]

KIB, MIB = 1024, 1024**2
#: bytes per device of each collective timed (B as the cost model counts it): 4 KiB .. 16 MiB
DEFAULT_SIZES = tuple(4 * KIB * 8**i for i in range(5))
QUICK_SIZES = (4 * KIB, 64 * KIB, 1 * MIB)
#: the collectives an axis's link is fitted from (the others are reported beside it)
LINK_KINDS = ("all-reduce", "all-gather")


@dataclasses.dataclass(frozen=True)
class TimedShapes:
    """What a platform's device is timed on."""

    sides: tuple[int, ...]  # square matmuls
    batched_below: int  # a side below this runs as (batched_below / side)^3 matmuls at once
    buffer: int  # the elementwise op's buffer, bytes per device
    transpose_side: int  # the square fp32 matrix transposed
    conv_shape: tuple[int, int, int, int]  # NHWC of a 3x3 convolution keeping its channels
    op_side: int  # ops of each rated kind run on a square fp32 matrix of this side


#: by platform, then in quick mode
_DEVICE_SHAPES = {
    ("cpu", False): TimedShapes((8, 16, 32, 64, 128, 256, 512), 64, 32 * MIB, 256,
                                (8, 16, 16, 64), 256),
    ("cpu", True): TimedShapes((8, 32, 128), 64, 4 * MIB, 128, (4, 8, 8, 64), 128),
    ("gpu", False): TimedShapes((64, 128, 256, 1024, 2048, 4096, 8192), 256, 1024 * MIB, 4096,
                                (32, 32, 32, 256), 8192),
    ("gpu", True): TimedShapes((64, 256, 2048), 256, 256 * MIB, 2048, (8, 32, 32, 256), 4096),
}
#: the k-iteration run of ``Timer.loop``: about this many seconds (by quick)
_LOOP_SECONDS = {False: 0.05, True: 0.01}


@dataclasses.dataclass(frozen=True)
class Fit:
    """``seconds = latency + charged_bytes / bandwidth`` fitted to measured points.

    ``residual`` is the fit's root-mean-square relative error over its points; ``points``
    are (bytes per device B, seconds) as measured.
    """

    latency: float
    bandwidth: float
    residual: float
    points: tuple[tuple[float, float], ...]


@dataclasses.dataclass(frozen=True)
class DeviceFigures:
    """One device's measured rates (every device of the mesh busy at once)."""

    rates: dict[str, dict[int, float]]  # dtype name -> square matmul side -> FLOP/s
    conv_rates: dict[str, float]  # dtype name -> FLOP/s of the 3x3 convolution
    memory_bandwidth: float  # bytes read + written per second
    transpose_bandwidth: float  # bytes read + written per second by a transpose
    host_bandwidth: float  # bytes per second to or from pinned host memory, each way
    memory_bytes: int
    kernel_overhead: float  # seconds one more kernel adds to a program
    shapes: TimedShapes  # what was timed
    op_rates: dict[str, float]  # kind of op (OP_RATE_KINDS) -> elements per second

    @property
    def flops(self) -> dict[str, float]:
        """dtype name -> the FLOP/s of the largest matmul timed. Not the best of all sides:
        on a shared host each timing varies (a 512^3 fp32 matmul, timed 12 times within a
        minute on 2 cores: 75-120 GFLOP/s), and the best of seven such timings is mostly the
        luckiest, which would price every matmul as if undisturbed."""
        largest = max(self.shapes.sides)
        return {dtype: rates[largest] for dtype, rates in self.rates.items()}

    def curve(self) -> tuple[tuple[float, float], ...]:
        """``DeviceSpec.matmul_curve``: per side timed, its FLOPs and the fraction of
        ``flops`` it ran at (the mean over dtypes, at most 1)."""
        return tuple((2.0 * side**3, _round(self._fraction(
            {dtype: rates[side] for dtype, rates in self.rates.items()})))
            for side in self.shapes.sides)

    def conv_fraction(self) -> float:
        """``DeviceSpec.conv_fraction``: the convolution's rate over the matmul's (the mean
        over dtypes, at most 1)."""
        return self._fraction(self.conv_rates)

    def _fraction(self, rates: dict[str, float]) -> float:
        """The mean over dtypes of ``rates`` (dtype -> FLOP/s) over ``flops``, each at most 1."""
        best = self.flops
        return float(np.mean([min(1.0, rate / best[dtype]) for dtype, rate in rates.items()]))


@dataclasses.dataclass(frozen=True)
class Profile:
    """What ``profile_mesh`` measured on ``source``'s devices, and the mesh file it makes."""

    source: DeviceMesh
    device: DeviceFigures
    collectives: dict[str, dict[str, Fit]]  # axis -> collective kind -> its fit
    links: dict[str, Fit]  # axis -> the joint fit of LINK_KINDS
    environment: dict[str, str]  # date, jax, jaxlib, platform, device_kind
    repeats: int  # each time is the median of this many runs

    def mesh(self) -> DeviceMesh:
        """The source mesh with the measured device and links (4 significant digits: no
        more are measured); axes of size 1 keep the source's link (nothing crosses it). A
        mesh of its own, as its file will load: a submesh profiled is no longer one."""
        figures = self.device
        device = DeviceSpec(
            name=f"{_slug(self.environment['device_kind'])}-profiled",
            peak_flops_bf16=_round(figures.flops["bfloat16"]),
            peak_flops_fp32=_round(figures.flops["float32"]),
            memory_bytes=figures.memory_bytes, memory_bandwidth=_round(figures.memory_bandwidth),
            kernel_overhead=_round(figures.kernel_overhead), matmul_curve=figures.curve(),
            # a transpose faster than the copy is noise: at most the copy's rate
            transpose_fraction=_round(min(
                1.0, figures.transpose_bandwidth / figures.memory_bandwidth)),
            conv_fraction=_round(figures.conv_fraction()),
            host_bandwidth=_round(figures.host_bandwidth),
            op_rates=tuple((kind, _round(rate)) for kind, rate in figures.op_rates.items()),
            source=f"measured by spmd profile, {self.environment['date']}, jax "
                   f"{self.environment['jax']}")
        links = {axis: Link(_round(self.links[axis].bandwidth), _round(self.links[axis].latency))
                 if axis in self.links else link for axis, link in self.source.links.items()}
        return dataclasses.replace(self.source, name=f"{self.source.name}-profiled",
                                   device=device, links=links, source=None, device_ids=None)

    def yaml(self) -> str:
        """The mesh file: ``mesh()``, and as comments where and how it was measured, the
        kernel overhead, every collective's fit and the measured times."""
        env, figures = self.environment, self.device
        shapes = figures.shapes
        sides = ", ".join(map(str, shapes.sides))
        header = [
            f"spmd profile of mesh {self.source.name}"
            + (f" ({_where(self.source.source)})" if self.source.source else "")
            + f", {env['date']}",
            f"jax {env['jax']}, jaxlib {env['jaxlib']}, platform {env['platform']}, device "
            f"kind {env['device_kind']}, "
            + (f"{self.source.size} devices measured at once" if self.source.size > 1
               else "1 device"),
        ]
        if env["platform"] == "cpu":
            who = (f"the {self.source.size} simulated devices share" if self.source.size > 1
                   else "one CPU device runs on")
            header.append(f"CPU: {who} this host's {os.cpu_count()} cores, so these figures "
                          f"describe this host, not a GPU.")
        header += [
            f"matmul (sides {sides}, the largest sets the rate): bf16 "
            f"{_rate(figures.flops['bfloat16'])}FLOP/s, "
            f"fp32 {_rate(figures.flops['float32'])}FLOP/s at JAX's default precision; "
            f"per side (bf16/fp32): " + ", ".join(
                f"{side} {_rate(figures.rates['bfloat16'][side])}/"
                f"{_rate(figures.rates['float32'][side])}" for side in shapes.sides),
            f"matmuls of side below {shapes.batched_below} run batched, "
            f"({shapes.batched_below} / side)^3 at once",
            f"memory bandwidth: an elementwise op over {readable_bytes(shapes.buffer)} per "
            f"device, bytes read + written",
            f"host link: {readable_bytes(shapes.buffer)} per device copied to pinned host memory "
            f"and back, {_rate(figures.host_bandwidth)}B/s each way",
            f"transpose: a {shapes.transpose_side}x{shapes.transpose_side} fp32 matrix, "
            f"{_rate(figures.transpose_bandwidth)}B/s read + written",
            f"convolution: 3x3, NHWC {'x'.join(map(str, shapes.conv_shape))} keeping its "
            f"channels: bf16 {_rate(figures.conv_rates['bfloat16'])}FLOP/s, fp32 "
            f"{_rate(figures.conv_rates['float32'])}FLOP/s",
            f"kernel overhead: {figures.kernel_overhead * 1e6:.2f} us per kernel (a chain of "
            f"tiny matmuls, each its own kernel, timed at two lengths)",
            f"op rates (op_rates, elements per second; {OP_CHAIN} ops of a kind per element "
            f"of a {shapes.op_side}x{shapes.op_side} fp32 matrix, in one kernel): "
            + ", ".join(f"{kind} {_rate(rate)}" for kind, rate in figures.op_rates.items()),
            f"collectives: medians of {self.repeats} repeats, dispatch excluded; each "
            f"axis's link is the joint fit of {' and '.join(LINK_KINDS)}" if self.links
            else "collectives: none timed (no axis of size > 1)",
        ]
        notes = {axis: _axis_notes(axis, self.source.shape[axis], self.links.get(axis),
                                   self.collectives.get(axis, {}))
                 for axis in self.source.axis_names}
        return mesh_yaml(self.mesh(), header=header, notes=notes)

    def summary(self) -> str:
        """A few lines for the terminal: the device's figures and each axis's link."""
        figures = self.device
        lines = [f"device {self.mesh().device.name}: matmul bf16 "
                 f"{_rate(figures.flops['bfloat16'])}FLOP/s, fp32 "
                 f"{_rate(figures.flops['float32'])}FLOP/s; memory "
                 f"{_rate(figures.memory_bandwidth)}B/s, transposed "
                 f"{_rate(figures.transpose_bandwidth)}B/s; kernel overhead "
                 f"{figures.kernel_overhead * 1e6:.2f} us per kernel",
                 "op rates (elements/s): " + ", ".join(
                     f"{kind} {_rate(rate)}" for kind, rate in figures.op_rates.items())]
        for axis, fit in self.links.items():
            lines.append(f"axis {axis} ({self.source.shape[axis]} devices): "
                         f"{_rate(fit.bandwidth)}B/s, {fit.latency * 1e6:.1f} us "
                         f"(residual {fit.residual:.0%})")
        return "\n".join(lines)


def profile_mesh(mesh: DeviceMesh, sizes: Sequence[int] | None = None, quick: bool = False,
                 repeats: int | None = None) -> Profile:
    """Measure ``mesh``'s devices and, for each axis of size > 1, its collectives at
    ``sizes`` bytes per device (default ``DEFAULT_SIZES``, or ``QUICK_SIZES`` with
    ``quick``, which also shrinks the device's shapes and the loops), each time the median
    of ``repeats`` (default 5, quick 3).

    Raises:
      MeshError: a virtual or multi-process mesh (only this process's devices are timed).
      ProfileError: timings that do not grow with size (too few or too small sizes).
    """
    import jax
    import jaxlib

    if mesh.virtual:
        raise MeshError(f"mesh {mesh.name!r} is virtual (a cluster that is not here); profile "
                        f"measures the devices present: give a mesh of them, e.g. cpu-8")
    if mesh.distributed is not None:
        raise MeshError(f"mesh {mesh.name!r} spans {mesh.distributed.num_processes} processes; "
                        f"profile measures one process's devices: give a one-process mesh")
    sizes = tuple(sizes or (QUICK_SIZES if quick else DEFAULT_SIZES))
    if len(sizes) < 2 or min(sizes) <= 0:
        raise ProfileError(f"sizes: give at least two positive byte counts, got {sizes}")
    jmesh = mesh.jax_mesh()
    first = jmesh.devices.flat[0]
    platform = "cpu" if first.platform == "cpu" else "gpu"
    shapes = _DEVICE_SHAPES[(platform, quick)]
    repeats = repeats or (3 if quick else 5)
    timer = Timer(jmesh, repeats, _LOOP_SECONDS[quick])
    collectives, links = {}, {}
    for axis, size in mesh.shape.items():
        if size > 1:
            collectives[axis], links[axis] = _profile_axis(timer, mesh, axis, sizes)
    stats = first.memory_stats() or {}
    overhead = timer.overhead()
    return Profile(
        source=mesh,
        device=DeviceFigures(
            rates={dtype: {n: timer.matmul(n, dtype, overhead,
                                           max(1, shapes.batched_below // n) ** 3)
                           for n in shapes.sides}
                   for dtype in ("bfloat16", "float32")},
            memory_bandwidth=timer.bandwidth(shapes.buffer),
            transpose_bandwidth=timer.transpose(shapes.transpose_side),
            host_bandwidth=timer.host_link(shapes.buffer),
            conv_rates={dtype: timer.conv(shapes.conv_shape, dtype)
                        for dtype in ("bfloat16", "float32")},
            memory_bytes=int(stats.get("bytes_limit", mesh.device.memory_bytes)),
            kernel_overhead=overhead, shapes=shapes, op_rates=timer.op_rates(shapes.op_side)),
        collectives=collectives, links=links, repeats=repeats,
        environment={"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                     "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                     "platform": first.platform, "device_kind": first.device_kind})


def fit_link(charged: Sequence[float], seconds: Sequence[float]) -> tuple[float, float, float]:
    """(latency, bandwidth, residual) of ``seconds ~ latency + charged / bandwidth``.

    Least squares on relative error, so 4 KiB and 16 MiB weigh alike (absolute error would
    leave the latency to the largest sizes' noise); the latency is held >= 0. ``residual``
    is the root-mean-square relative error.

    >>> latency, bandwidth, residual = fit_link([1e3, 1e6, 1e7], [11e-6, 1.01e-3, 10.01e-3])
    >>> round(latency * 1e6, 6), round(bandwidth / 1e9, 6), round(residual, 6)  # 10 us, 1 GB/s
    (10.0, 1.0, 0.0)

    Raises:
      ProfileError: the times do not grow with the bytes (no bandwidth to fit).
    """
    x, t = np.asarray(charged, float), np.asarray(seconds, float)
    rows = np.stack([1.0 / t, x / t], axis=1)  # (alpha + beta x) / t ~ 1
    (alpha, beta), *_ = np.linalg.lstsq(rows, np.ones_like(t), rcond=None)
    if alpha < 0:  # latency below the noise: fit the bandwidth through the origin
        alpha, beta = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    if not beta > 0:
        raise ProfileError(f"times {list(t)} do not grow with bytes {list(x)}: no bandwidth "
                           f"to fit; give larger sizes")
    residual = float(np.sqrt(np.mean(((alpha + beta * x - t) / t) ** 2)))
    return float(alpha), float(1.0 / beta), residual


def _profile_axis(timer: Timer, mesh: DeviceMesh, axis: str, sizes: Sequence[int]
                  ) -> tuple[dict[str, Fit], Fit]:
    """Each collective over ``axis`` at each size, fitted per kind and jointly for the link."""
    unit = CostModel(make_mesh(mesh.shape, bandwidth=1.0, latency=0.0, virtual=True))
    fits: dict[str, Fit] = {}
    joint_charged: list[float] = []
    joint_points: list[tuple[float, float]] = []
    for kind in COLLECTIVE_KINDS:
        points = _plausible([(nbytes, timer.collective(kind, axis, nbytes))
                             for nbytes in sorted(sizes)])
        if len(points) < 2:
            raise ProfileError(f"{kind} over axis {axis!r}: too few sizes timed above the "
                               f"noise ({sizes}); give larger sizes")
        charged = [unit.time(Collective(kind, (axis,), b)) for b, _ in points]
        latency, bandwidth, residual = fit_link(charged, [t for _, t in points])
        fits[kind] = Fit(latency, bandwidth, residual, tuple(points))
        if kind in LINK_KINDS:
            joint_charged += charged
            joint_points += points
    latency, bandwidth, residual = fit_link(joint_charged, [t for _, t in joint_points])
    return fits, Fit(latency, bandwidth, residual, tuple(joint_points))


def _plausible(points: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The (bytes, seconds) points, ascending in bytes, that noise has not visibly spoiled:
    a loop lost in noise (not above 0) tells nothing, and of times that do not grow with
    size some were taken while the host was busy elsewhere. Kept: the most points whose
    times grow with their sizes (earliest first among as many), so one slow early timing
    does not take the later ones with it.

    >>> _plausible([(4096, 4e-5), (65536, 4e-7), (1048576, 2e-3), (4194304, 0.0)])
    [(4096, 4e-05), (1048576, 0.002)]
    >>> _plausible([(4096, 9e-4), (65536, 1e-5), (1048576, 2e-4)])  # a slow first timing
    [(65536, 1e-05), (1048576, 0.0002)]
    """
    timed = [p for p in points if p[1] > 0]
    # chain[i]: the longest run of growing times ending at point i
    chain: list[list[tuple[int, float]]] = []
    for i, point in enumerate(timed):
        before = [chain[j] for j in range(i) if timed[j][1] <= point[1]]
        chain.append(max(before, key=len, default=[]) + [point])
    return max(chain, key=len, default=[])


def _axis_notes(axis: str, size: int, link: Fit | None, fits: dict[str, Fit]) -> list[str]:
    """The comment lines above an axis: its link's source, each kind's fit, the times."""
    if link is None:
        return [f"{axis}: size {size}, nothing crosses it: the source mesh's link"]
    lines = [f"{axis}: {size} devices; link = joint fit of {' and '.join(LINK_KINDS)} "
             f"(residual {link.residual:.0%})"]
    lines += [f"  {kind:<19} {_rate(fit.bandwidth) + 'B/s':>10} {fit.latency * 1e6:8.1f} us  "
              f"residual {fit.residual:.0%}" for kind, fit in fits.items()]
    sizes = sorted({b for fit in fits.values() for b, _ in fit.points})
    lines.append(f"  {'us at B per device':<19}"
                 + "".join(f"{readable_bytes(b):>9}" for b in sizes))
    for kind, fit in fits.items():
        times = dict(fit.points)
        lines.append(f"  {kind:<19}" + "".join(
            f"{times[b] * 1e6:9.1f}" if b in times else f"{'-':>9}" for b in sizes))
    return lines


def _where(path: str) -> str:
    """A mesh file as the profile's header names it: a bundled one by its name (its path is
    an install's), any other as given."""
    try:
        return f"bundled {Path(path).resolve().relative_to(BUNDLED_DIR.resolve()).stem}"
    except ValueError:
        return path


def _round(value: float) -> float:
    """4 significant digits: as many as a median of a few repeats supports."""
    return float(f"{value:.3e}")


def _rate(value: float) -> str:
    """``value`` with an SI prefix: 12.3 G, 1.23 T (the unit follows)."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}"
    return f"{value:.3g} "


def _slug(text: str) -> str:
    """A device kind as a device name: ``NVIDIA H200`` -> ``nvidia-h200``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"
