"""Fresh host memory per step: why a step on XLA:CPU can take longer than its kernels.

XLA:CPU takes a step's temporaries from the C library's ``malloc``. glibc gives a large
block back to the operating system when it is freed: blocks above its mmap threshold
(dynamic, at most 32 MiB unless set) are mapped and unmapped, and the heap is trimmed above
its trim threshold. The next step then touches fresh pages, and each first touch is a page
fault: about 1 us per 4 KiB page on this project's 2-core machines, more while a step's
threads fault at once. gpt-4x256 on one CPU device (32.4 MiB of temporaries, just above the
threshold) faulted 8,370 pages per step and took 46-74 ms, against 38-39 ms with the memory
kept. A GPU's allocator keeps its pool, so the cost model prices no such faults; ``spmd run``
counts them and says how to keep the memory.

glibc reads the settings that keep it (``KEEP_FREED_MEMORY``) from the environment when a
process starts, and only both together keep it: the mmap threshold alone still trims the
heap, the trim threshold alone turns the dynamic mmap threshold off. Even with both, the
first few steps may still fault (mlp-small at batch 1024 on one CPU device: 43 MiB in each
of its first 7 steps, none after).
spmd sets them for its own benchmark processes, never for a user's process.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

__all__ = ["KEEP_FREED_MEMORY", "NOTABLE_BYTES", "fresh_memory_note", "keep_settings",
           "keeps_freed_memory", "touched_pages"]

#: glibc's tunables that keep freed memory in the process: blocks up to 1 GiB from the heap,
#: and the heap not trimmed below 4 GiB
KEEP_FREED_MEMORY: Mapping[str, str] = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30),
                                        "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}
#: fresh memory per step worth a note: below this it is the Python side's own allocations
NOTABLE_BYTES = 1 << 20


def touched_pages() -> Optional[int]:
    """Bytes of fresh pages this process has touched so far (its minor page faults times
    the page size), or None where the operating system does not say (no ``resource``)."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt * resource.getpagesize()


def keep_settings() -> str:
    """``KEEP_FREED_MEMORY`` as a shell would set it: ``NAME=value NAME=value``."""
    return " ".join(f"{name}={value}" for name, value in KEEP_FREED_MEMORY.items())


def keeps_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process was started with ``KEEP_FREED_MEMORY`` (both settings)."""
    return all(name in environ for name in KEEP_FREED_MEMORY)


def fresh_memory_note(fresh_bytes: Optional[float], step_seconds: float, platform: str,
                      environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """What to tell a user whose steps on XLA:CPU touched ``fresh_bytes`` of fresh pages
    each: the faults are in the measured step time but not in the predicted one. None where
    there is nothing to say (another platform, or too little to matter)."""
    if platform != "cpu" or fresh_bytes is None or fresh_bytes < NOTABLE_BYTES:
        return None
    said = (f"host memory: each step touched {fresh_bytes / 2**20:.1f} MiB of fresh pages "
            f"(page faults, in the {step_seconds * 1e3:.3g} ms measured, not in the "
            f"prediction: a GPU keeps its memory pool)")
    if keeps_freed_memory(environ):
        return said + ("; the allocator is told to keep freed memory already, and then the "
                       "faults usually stop after a few steps: run more steps")
    return (said + f". glibc returned XLA:CPU's temporaries to the system after the last "
            f"step; start spmd with {keep_settings()} in the environment to keep them")
