"""Per-device hardware figures used by the cost model, each with its source.

A mesh file names a device (``device: a100-40gb``) or gives these fields itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from spmd.errors import MeshError

GIB = 1024**3


#: Fractions of the datasheet a device achieves, measured on one H200 in this project
#: (bench/gpu.py, jax 0.11.2): a bf16 8192^3 matmul ran at 638 TFLOP/s (65% of 989) and a
#: copy at 3.41 TB/s (71% of 4.8). A device without figures of its own gets these.
MATMUL_FRACTION = 0.65
BANDWIDTH_FRACTION = 0.71
#: Seconds a GPU kernel costs beyond its work (launch and XLA:GPU's thunk dispatch; a few
#: microseconds on recent CUDA, NVIDIA's CUDA C++ Best Practices Guide, "kernel launch
#: overhead"). Not measured here: ``spmd profile`` on a GPU measures it.
GPU_KERNEL_OVERHEAD = 4e-6
#: Achieved / datasheet bandwidth of a copy between a GPU and pinned host memory: large
#: pinned copies reach about 80% of a PCIe link's rate (NVIDIA's bandwidthTest, typical;
#: 25-26 GB/s of PCIe 4.0 x16's 32). Not measured here: ``spmd profile`` on a GPU measures it.
HOST_LINK_FRACTION = 0.8
#: the kinds of op besides matmuls and convolutions whose compute a device may rate
#: (``DeviceSpec.op_rates``, elements per second): plain elementwise arithmetic (adds, muls,
#: compares, selects, converts), divisions, roots (sqrt, rsqrt), exponentials (exp, log,
#: tanh, logistic, erf, pow...: the transcendentals), and reductions (per element reduced).
#: ``spmd.cost.time.OP_KINDS`` says which primitive is which kind.
OP_RATE_KINDS = ("elementwise", "divide", "root", "exponential", "reduce")


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """What one accelerator can do; the planner's compute and memory model reads these.

    The ``peak_*`` figures and ``memory_bandwidth`` are the datasheet's (or, for a profiled
    device, the measured ones); the cost model prices what the device achieves:
    ``flops(dtype)`` and ``bandwidth``, the datasheet times ``matmul_fraction`` and
    ``bandwidth_fraction``, plus ``kernel_overhead`` per kernel. ``source`` says where the
    figures come from.
    """

    name: str
    peak_flops_bf16: float  # dense FLOP/s
    # fp32 matmul FLOP/s as JAX runs them by default: on GPUs, TF32 tensor cores (XLA's
    # default precision; bench/gpu.py measured 91 TFLOP/s of fp32 GPT matmuls on an H200,
    # above its 67 TFLOP/s non-tensor-core fp32 peak). Set it to the plain fp32 rate for steps
    # run under jax_default_matmul_precision="highest".
    peak_flops_fp32: float
    memory_bytes: int  # usable device memory
    memory_bandwidth: float  # bytes/s, HBM (or DRAM) bandwidth
    matmul_fraction: float = 1.0  # achieved / peak FLOP/s of large matmuls
    bandwidth_fraction: float = 1.0  # achieved / peak memory bandwidth of a large copy
    kernel_overhead: float = 0.0  # seconds per kernel beyond its work
    source: str = ""  # where the figures come from
    #: (FLOPs of one matmul, the fraction of ``flops`` it achieves) by size, as profiled:
    #: small matmuls run far below a large one's rate. Empty: every size at ``flops``.
    matmul_curve: tuple[tuple[float, float], ...] = ()
    #: achieved bandwidth of a transpose (a copy into another dimension order) / of a plain
    #: copy: XLA:CPU's transposes run far below its copies (profiled: 5-30x on a 2-core
    #: host); XLA:GPU tiles them through shared memory, near its copy rate (1.0, not measured
    #: here: ``spmd profile`` on a GPU measures it)
    transpose_fraction: float = 1.0
    #: achieved FLOP/s of a convolution / of a matmul as large: convolutions run through
    #: other kernels (cuDNN, oneDNN/Eigen on CPU); 1.0 unless profiled
    conv_fraction: float = 1.0
    #: bytes/s one device copies to or from pinned host memory, each way, as achieved (PCIe
    #: or NVLink-C2C; a host offload's link); 0: not known, and nothing is offloaded
    host_bandwidth: float = 0.0
    #: (kind of op in ``OP_RATE_KINDS``, elements per second it computes), as profiled: an
    #: op of a rated kind takes at least its elements at that rate, however few bytes it
    #: moves. XLA:CPU computes a transcendental at 1-2 G elements/s on a 2-core host, slower
    #: than it reads the operand; a GPU's special function units run them far faster than
    #: its memory feeds them, so a GPU's ops are priced by their bytes alone (none rated).
    op_rates: tuple[tuple[str, float], ...] = ()

    def peak_flops(self, dtype_name: str) -> float:
        """Peak FLOP/s for a compute dtype: 16-bit types run on tensor cores, the rest at fp32 rate."""
        return self.peak_flops_bf16 if dtype_name in ("bfloat16", "float16") else self.peak_flops_fp32

    def flops(self, dtype_name: str, matmul: float | None = None, conv: bool = False) -> float:
        """Achievable FLOP/s for a compute dtype (what the cost model prices); ``matmul``,
        the FLOPs of one matmul (per batch element), scales it by ``matmul_curve``,
        interpolated in log FLOPs and held at its ends; ``conv``: of a convolution
        (``conv_fraction`` of that)."""
        rate = self.peak_flops(dtype_name) * self.matmul_fraction * (
            self.conv_fraction if conv else 1.0)
        if matmul is None or not self.matmul_curve:
            return rate
        work, fraction = zip(*self.matmul_curve)
        return rate * float(np.interp(np.log(max(matmul, 1.0)), np.log(work), fraction))

    def op_rate(self, kind: str) -> float | None:
        """Elements per second of an op of ``kind`` (``OP_RATE_KINDS``); None: not rated."""
        return dict(self.op_rates).get(kind)

    @property
    def bandwidth(self) -> float:
        """Achievable memory bandwidth, bytes read + written per second."""
        return self.memory_bandwidth * self.bandwidth_fraction

    @property
    def transpose_bandwidth(self) -> float:
        """Achievable bandwidth of a transpose, bytes read + written per second."""
        return self.bandwidth * self.transpose_fraction


def _gpu(name: str, bf16: float, fp32: float, memory: int, bandwidth: float, host_link: float,
         sheet: str) -> DeviceSpec:
    return DeviceSpec(name, bf16, fp32, memory, bandwidth, MATMUL_FRACTION, BANDWIDTH_FRACTION,
                      GPU_KERNEL_OVERHEAD,
                      f"{sheet}; achievable: {MATMUL_FRACTION:.0%} of the matmul and "
                      f"{BANDWIDTH_FRACTION:.0%} of the bandwidth figures (as measured on an "
                      f"H200), {GPU_KERNEL_OVERHEAD * 1e6:.0f} us per kernel (typical CUDA "
                      f"launch), {HOST_LINK_FRACTION:.0%} of the PCIe link to the host; run "
                      f"`spmd profile` on the devices to measure them",
                      host_bandwidth=host_link * HOST_LINK_FRACTION)


# Sources: NVIDIA A100 datasheet (2021): 312 TFLOP/s bf16 dense, 156 TFLOP/s TF32 dense,
# 40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at 2,039 GB/s.
# NVIDIA H100 SXM datasheet (2023): 989 TFLOP/s bf16 dense, 494.7 TFLOP/s TF32 dense (the
# sheet's 989 is with sparsity), 80 GB at 3.35 TB/s.
# NVIDIA H200 SXM datasheet (2024): H100's compute, 141 GB HBM3e at 4.8 TB/s.
# Host links, from the same sheets: A100 PCIe Gen4 at 64 GB/s, H100 and H200 PCIe Gen5 at
# 128 GB/s, both directions together (32 and 64 GB/s each way).
# "cpu": one simulated XLA CPU device sharing a small host. Its figures keep the ratios that
# `spmd profile --mesh cpu-8` measured on a 2-core host (2026-12-01, 8 devices at once: 9.2
# GFLOP/s fp32 matmul, 4.0 GB/s memory, 1.0-1.4 GB/s links, 50-95 us latency; 0.3-1.5 us per
# kernel on one device alone), scaled by 8 to the bundled meshes' 10 GB/s link (33 GB/s, 76
# GFLOP/s, kept at 50); its "host" memory is the same DRAM, a copy there moving 15 GB/s each
# way (half the read + write bandwidth), so that plans for cpu-8 weigh compute, memory
# traffic and the in-process copies that stand in for collectives as that host does. Profile
# your own host for figures that predict its step times.
KNOWN_DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        _gpu("a100-40gb", 312e12, 156e12, 40 * 10**9, 1555e9, 32e9,
             "NVIDIA A100 datasheet (2021)"),
        _gpu("a100-80gb", 312e12, 156e12, 80 * 10**9, 2039e9, 32e9,
             "NVIDIA A100 datasheet (2021)"),
        _gpu("h100-80gb", 989e12, 494.7e12, 80 * 10**9, 3350e9, 64e9,
             "NVIDIA H100 SXM datasheet (2023)"),
        _gpu("h200-141gb", 989e12, 494.7e12, 141 * 10**9, 4800e9, 64e9,
             "NVIDIA H200 SXM datasheet (2024)"),
        DeviceSpec("cpu", 50e9, 50e9, 2 * GIB, 30e9, 1.0, 1.0, 1e-6,
                   "ratios of a 2-core host's cpu-8 profile, scaled to a 10 GB/s link",
                   host_bandwidth=15e9),
    )
}

_FIELDS = tuple(f.name for f in dataclasses.fields(DeviceSpec))
#: what a mesh file's device mapping must give (the rest have defaults)
_REQUIRED = ("peak_flops_bf16", "peak_flops_fp32", "memory_bytes", "memory_bandwidth")


def device_spec(value: str | Mapping[str, Any] | DeviceSpec, where: str = "device") -> DeviceSpec:
    """Resolve a device given by name, by a mapping of DeviceSpec fields, or as a DeviceSpec.

    >>> device_spec("a100-40gb").memory_bytes
    40000000000
    """
    if isinstance(value, DeviceSpec):
        return value
    if isinstance(value, str):
        if value not in KNOWN_DEVICES:
            raise MeshError(
                f"{where}: unknown device {value!r}; known devices: {', '.join(KNOWN_DEVICES)}, "
                f"or a mapping with keys {', '.join(_FIELDS)}"
            )
        return KNOWN_DEVICES[value]
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(_FIELDS))
        missing = sorted(set(_REQUIRED) - set(value))
        if unknown or missing:
            raise MeshError(
                f"{where}: device mapping has unknown keys {unknown} and lacks keys {missing}; "
                f"valid keys: {', '.join(_FIELDS)}"
            )
        fields = {"name": "custom", **value}
        for key in ("matmul_fraction", "bandwidth_fraction", "transpose_fraction",
                    "conv_fraction"):
            if key in fields and not _positive(fields[key]):
                raise MeshError(f"{where}.{key}: expected a fraction above 0 (achieved / "
                                f"peak), got {fields[key]!r}")
        try:
            return DeviceSpec(
                name=str(fields["name"]),
                peak_flops_bf16=float(fields["peak_flops_bf16"]),
                peak_flops_fp32=float(fields["peak_flops_fp32"]),
                memory_bytes=int(float(fields["memory_bytes"])),
                memory_bandwidth=float(fields["memory_bandwidth"]),
                matmul_fraction=float(fields.get("matmul_fraction", 1.0)),
                bandwidth_fraction=float(fields.get("bandwidth_fraction", 1.0)),
                kernel_overhead=float(fields.get("kernel_overhead", 0.0)),
                source=str(fields.get("source", "")),
                matmul_curve=_curve(fields.get("matmul_curve", ()), where),
                transpose_fraction=float(fields.get("transpose_fraction", 1.0)),
                conv_fraction=float(fields.get("conv_fraction", 1.0)),
                host_bandwidth=float(fields.get("host_bandwidth", 0.0)),
                op_rates=_op_rates(fields.get("op_rates", {}), where),
            )
        except (TypeError, ValueError) as err:
            raise MeshError(f"{where}: device fields must be numbers: {err}") from None
    raise MeshError(f"{where}: expected a device name or a mapping, got {type(value).__name__}")


def _positive(value: Any) -> bool:
    try:
        return float(value) > 0
    except (TypeError, ValueError):
        return False


def _op_rates(value: Any, where: str) -> tuple[tuple[str, float], ...]:
    """A device's ``op_rates`` as read from a mesh file: a mapping of kinds in
    ``OP_RATE_KINDS`` to elements per second above 0 (kept in that order); empty (as a
    file without rates writes it, ``[]``): none rated."""
    if value is None or (isinstance(value, (list, tuple, Mapping)) and not value):
        return ()
    if not isinstance(value, Mapping):
        raise MeshError(f"{where}.op_rates: expected a mapping of op kind to elements per "
                        f"second, e.g. {{exponential: 1.5e9}}, got {value!r}")
    unknown = sorted(set(value) - set(OP_RATE_KINDS))
    if unknown:
        raise MeshError(f"{where}.op_rates: unknown kinds {unknown}; valid kinds: "
                        f"{', '.join(OP_RATE_KINDS)}")
    bad = [kind for kind, rate in value.items() if not _positive(rate)]
    if bad:
        raise MeshError(f"{where}.op_rates: {bad[0]}: expected elements per second above 0, "
                        f"got {value[bad[0]]!r}")
    return tuple((kind, float(value[kind])) for kind in OP_RATE_KINDS if kind in value)


def _curve(value: Any, where: str) -> tuple[tuple[float, float], ...]:
    """A device's ``matmul_curve`` as read from a mesh file: [FLOPs, fraction] pairs with
    FLOPs increasing and fractions in (0, 1]."""
    try:
        pairs = tuple((float(work), float(fraction)) for work, fraction in value)
    except (TypeError, ValueError):
        raise MeshError(f"{where}.matmul_curve: expected a list of [FLOPs, fraction] pairs, "
                        f"got {value!r}") from None
    works = [w for w, _ in pairs]
    if works != sorted(set(works)) or any(w <= 0 or not 0 < f <= 1 for w, f in pairs):
        raise MeshError(f"{where}.matmul_curve: FLOPs must be positive and increasing and "
                        f"fractions in (0, 1], got {value!r}")
    return pairs
