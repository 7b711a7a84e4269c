"""The devices a process will have, asked without starting jax's backend.

Mesh loading runs before any jax computation: the simulated CPU device count can only be set
before the backend starts, and ``jax.devices()`` would start it (on every platform, fixing
the CPU count at its default). So the count the user's ``XLA_FLAGS`` ask for and whether a
GPU can be present are read from the environment and the installed jax plugins instead.
"""

from __future__ import annotations

import importlib.metadata
import os
import pkgutil
import re

from spmd.errors import MeshError

__all__ = ["CPU_COUNT_FLAG", "NO_GPU_ADVICE", "gpu_absence", "set_cpu_device_count",
           "xla_flags_cpu_count"]

CPU_COUNT_FLAG = "--xla_force_host_platform_device_count"
#: what to do with a GPU mesh where there is no GPU (load_mesh's and jax_mesh's messages)
NO_GPU_ADVICE = ("to plan for it here, load it with virtual=True (spmd.load_mesh(..., "
                 "virtual=True)) or use `spmd plan`, which plans virtual meshes")
_GPU_PLATFORMS = {"cuda", "rocm", "gpu"}


def xla_flags_cpu_count() -> int | None:
    """The CPU device count the user's ``XLA_FLAGS`` ask for, if any (the last one, as XLA
    reads them)."""
    found = re.findall(rf"{CPU_COUNT_FLAG}=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else None


def set_cpu_device_count(count: int, who: str = "the mesh") -> None:
    """Ask for ``count`` simulated CPU devices; a no-op when the backend already has that many.

    jax's own setting silently wins over ``XLA_FLAGS``, so a different count there is refused
    rather than overridden.

    Raises:
      MeshError: ``XLA_FLAGS`` ask for another count, or jax already started with another
        count; ``who`` (e.g. ``"mesh 'cpu-8'"``) and both numbers are named.
    """
    flagged = xla_flags_cpu_count()
    if flagged is not None and flagged != count:
        raise MeshError(
            f"{who} needs {count} CPU devices but XLA_FLAGS sets {CPU_COUNT_FLAG}={flagged}; "
            f"set it to {count}, or remove it (loading a CPU mesh sets the count itself)")
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        have = len(jax.devices("cpu"))
        if have != count:
            raise MeshError(
                f"{who} needs {count} CPU devices but jax already started with {have}; "
                f"load the mesh before any jax computation, or set "
                f"XLA_FLAGS={CPU_COUNT_FLAG}={count}"
            ) from None


def gpu_absence() -> str | None:
    """Why jax cannot see a GPU here, or None when it may: ``JAX_PLATFORMS`` naming no GPU
    platform, or no jax GPU plugin (CUDA, ROCm) installed. Starts no backend; a GPU plugin
    with no GPU is found later, when the mesh asks for its devices (``DeviceMesh.jax_mesh``).
    """
    import jax

    platforms = jax.config.jax_platforms  # reading the setting starts nothing
    if platforms and not {p.strip().lower() for p in platforms.split(",")} & _GPU_PLATFORMS:
        return f"JAX_PLATFORMS is {platforms!r}"
    if not _gpu_plugins():
        return "no jax GPU plugin is installed (pip install 'jax[cuda12]')"
    return None


def _gpu_plugins() -> list[str]:
    """The installed jax plugins for GPUs, found as jax finds plugins: modules of the
    ``jax_plugins`` namespace package and ``jax_plugins`` entry points."""
    names = [ep.name for ep in importlib.metadata.entry_points(group="jax_plugins")]
    try:
        import jax_plugins
    except ImportError:
        pass
    else:
        names += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    return sorted(n for n in names if "cuda" in n.lower() or "rocm" in n.lower())
