"""Per-device hardware figures used by the cost model, each with its datasheet source.

A mesh file names a device (``device: a100-40gb``) or gives these fields itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from spmd.errors import MeshError

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """What one accelerator can do; the planner's compute and memory model reads these."""

    name: str
    peak_flops_bf16: float  # dense FLOP/s
    # fp32 matmul FLOP/s as JAX runs them by default: on GPUs, TF32 tensor cores (XLA's
    # default precision; bench/gpu.py measured 91 TFLOP/s of fp32 GPT matmuls on an H200,
    # above its 67 TFLOP/s non-tensor-core fp32 peak). Set it to the plain fp32 rate for steps
    # run under jax_default_matmul_precision="highest".
    peak_flops_fp32: float
    memory_bytes: int  # usable device memory
    memory_bandwidth: float  # bytes/s, HBM (or DRAM) bandwidth

    def peak_flops(self, dtype_name: str) -> float:
        """Peak FLOP/s for a compute dtype: 16-bit types run on tensor cores, the rest at fp32 rate."""
        return self.peak_flops_bf16 if dtype_name in ("bfloat16", "float16") else self.peak_flops_fp32


# Sources: NVIDIA A100 datasheet (2021): 312 TFLOP/s bf16 dense, 156 TFLOP/s TF32 dense,
# 40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at 2,039 GB/s.
# NVIDIA H100 SXM datasheet (2023): 989 TFLOP/s bf16 dense, 494.7 TFLOP/s TF32 dense (the
# sheet's 989 is with sparsity), 80 GB at 3.35 TB/s.
# NVIDIA H200 SXM datasheet (2024): H100's compute, 141 GB HBM3e at 4.8 TB/s.
# "cpu": one simulated XLA CPU device sharing a small host; figures are rough so that plans for
# cpu-8 weigh compute against the in-process copies that stand in for collectives.
KNOWN_DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec("a100-40gb", 312e12, 156e12, 40 * 10**9, 1555e9),
        DeviceSpec("a100-80gb", 312e12, 156e12, 80 * 10**9, 2039e9),
        DeviceSpec("h100-80gb", 989e12, 494.7e12, 80 * 10**9, 3350e9),
        DeviceSpec("h200-141gb", 989e12, 494.7e12, 141 * 10**9, 4800e9),
        DeviceSpec("cpu", 50e9, 50e9, 2 * GIB, 10e9),
    )
}

_FIELDS = tuple(f.name for f in dataclasses.fields(DeviceSpec))


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
        missing = sorted(set(_FIELDS) - set(value) - {"name"})
        if unknown or missing:
            raise MeshError(
                f"{where}: device mapping has unknown keys {unknown} and lacks keys {missing}; "
                f"valid keys: {', '.join(_FIELDS)}"
            )
        fields = {"name": "custom", **value}
        try:
            return DeviceSpec(
                name=str(fields["name"]),
                peak_flops_bf16=float(fields["peak_flops_bf16"]),
                peak_flops_fp32=float(fields["peak_flops_fp32"]),
                memory_bytes=int(float(fields["memory_bytes"])),
                memory_bandwidth=float(fields["memory_bandwidth"]),
            )
        except (TypeError, ValueError) as err:
            raise MeshError(f"{where}: device fields must be numbers: {err}") from None
    raise MeshError(f"{where}: expected a device name or a mapping, got {type(value).__name__}")
