"""Pipeline schedules: the order in which each stage runs the forward and backward work of
each microbatch, and what that order costs in idle time and in activations held.

- **GPipe** (Huang et al. 2019): every microbatch's forward, then every backward. A stage
  holds the activations of all ``m`` microbatches at the turn.
- **1F1B** (PipeDream-flush, Narayanan et al. 2021): stage ``s`` runs ``p - s - 1``
  forwards to fill the pipe, then alternates one forward with one backward, then drains.
  It idles as long as GPipe but holds at most ``p - s`` microbatches' activations.

Both idle ``(p - 1) / (m + p - 1)`` of the time when every stage takes as long (Alpa,
§5.1). ``Schedule.order`` is the order a host dispatches the tasks in: by their start time
in a simulation of the stages running side by side, so a runtime that issues work
asynchronously keeps every stage fed.

>>> s = schedule("1f1b", stages=2, microbatches=3)
>>> s.per_stage(0)
[(0, 'forward'), (1, 'forward'), (0, 'backward'), (2, 'forward'), (1, 'backward'), (2, 'backward')]
>>> s.in_flight(0), s.in_flight(1), schedule("gpipe", 2, 3).in_flight(0)
(2, 1, 3)
>>> round(s.bubble(), 4), round(1 / 4, 4)  # (p - 1) / (m + p - 1)
(0.25, 0.25)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from spmd.errors import PlanError
from spmd.stages.split import BACKWARD, FORWARD

__all__ = ["SCHEDULES", "Schedule", "bubble_formula", "schedule"]

#: a task of one microbatch on one stage: (stage, microbatch, FORWARD or BACKWARD)
Slot = tuple[int, int, str]


def _gpipe(stages: int, microbatches: int, stage: int) -> list[tuple[int, str]]:
    return ([(j, FORWARD) for j in range(microbatches)]
            + [(j, BACKWARD) for j in range(microbatches)])


def _one_f_one_b(stages: int, microbatches: int, stage: int) -> list[tuple[int, str]]:
    warmup = min(stages - stage - 1, microbatches)
    out = [(j, FORWARD) for j in range(warmup)]
    for i in range(microbatches - warmup):
        out += [(warmup + i, FORWARD), (i, BACKWARD)]
    return out + [(j, BACKWARD) for j in range(microbatches - warmup, microbatches)]


SCHEDULES = {"gpipe": _gpipe, "1f1b": _one_f_one_b}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One schedule for ``stages`` stages and ``microbatches`` microbatches."""

    name: str
    stages: int
    microbatches: int
    sequences: tuple[tuple[tuple[int, str], ...], ...]  # per stage: (microbatch, phase)

    def per_stage(self, stage: int) -> list[tuple[int, str]]:
        return list(self.sequences[stage])

    def in_flight(self, stage: int) -> int:
        """The most microbatches whose forward the stage has run and backward not yet: how
        many microbatches' activations it holds at its peak."""
        held = most = 0
        for _, phase in self.sequences[stage]:
            held += 1 if phase == FORWARD else -1
            most = max(most, held)
        return most

    def timeline(self, forward: Sequence[float], backward: Sequence[float]
                 ) -> dict[Slot, tuple[float, float]]:
        """(start, end) of every task, each stage running its sequence in order as soon as
        what it reads is done: a forward reads the stage before's forward of the same
        microbatch, a backward the stage after's backward (the last stage: its own
        forward). ``forward[s]``, ``backward[s]``: stage s's time per microbatch."""
        p = self.stages
        done: dict[Slot, tuple[float, float]] = {}
        free = [0.0] * p
        position = [0] * p
        while any(position[s] < len(self.sequences[s]) for s in range(p)):
            progressed = False
            for s in range(p):
                if position[s] == len(self.sequences[s]):
                    continue
                j, phase = self.sequences[s][position[s]]
                if phase == FORWARD:
                    need = [(s - 1, j, FORWARD)] if s > 0 else []
                else:
                    need = [(s + 1, j, BACKWARD) if s < p - 1 else (s, j, FORWARD)]
                if any(n not in done for n in need):
                    continue
                start = max([free[s]] + [done[n][1] for n in need])
                end = start + (forward[s] if phase == FORWARD else backward[s])
                done[s, j, phase] = (start, end)
                free[s] = end
                position[s] += 1
                progressed = True
            if not progressed:  # pragma: no cover - both schedules are deadlock-free
                raise PlanError(f"schedule {self.name!r} deadlocks at {position}")
        return done

    @property
    def order(self) -> list[Slot]:
        """Every task, in the order a host should dispatch them (by start time with equal
        stage times, a backward taking twice a forward; ties by stage)."""
        ones = [1.0] * self.stages
        times = self.timeline(ones, [2.0] * self.stages)
        return sorted(times, key=lambda slot: (times[slot][0], slot[0]))

    def bubble(self, forward: Sequence[float] | None = None,
               backward: Sequence[float] | None = None) -> float:
        """The fraction of the stages' time spent idle (default: equal stage times)."""
        forward = list(forward) if forward is not None else [1.0] * self.stages
        backward = list(backward) if backward is not None else [2 * f for f in forward]
        times = self.timeline(forward, backward)
        span = max(end for _, end in times.values())
        busy = self.microbatches * (sum(forward) + sum(backward))
        return 1.0 - busy / (self.stages * span) if span > 0 else 0.0


def bubble_formula(stages: int, microbatches: int) -> float:
    """GPipe's and 1F1B's idle fraction with equal stages: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """The schedule ``name`` (``"gpipe"`` or ``"1f1b"``) for these counts."""
    if name not in SCHEDULES:
        raise PlanError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    for what, n in (("stages", stages), ("microbatches", microbatches)):
        if not isinstance(n, int) or n < 1:
            raise PlanError(f"a pipeline needs a positive whole number of {what}, not {n!r}")
    make = SCHEDULES[name]
    return Schedule(name, stages, microbatches,
                    tuple(tuple(make(stages, microbatches, s)) for s in range(stages)))
