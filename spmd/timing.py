"""Seconds per phase of planning, recorded by the code that runs each phase, so a plan says
where its time went (``Plan.search["timings"]``) and a benchmark reads it instead of timing
spmd's internals from outside.

>>> watch = Stopwatch()
>>> with watch.phase("trace"):
...     pass
>>> sorted(watch.seconds)
['trace']

Step times are reported as ``median_step``: the median after the first step.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Iterator

__all__ = ["Stopwatch", "median_step"]


class Stopwatch:
    """Adds up wall-clock seconds per named phase (a phase entered twice adds up)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def as_dict(self) -> dict[str, float]:
        return dict(self.seconds)


def median_step(times: list[float]) -> float:
    """The step time reported (by ``spmd run`` and the benchmarks): the median after the
    first step, which may compile.

    >>> median_step([5.0, 1.0, 3.0, 2.0])
    2.0
    """
    return float(statistics.median(times[1:] or times))
