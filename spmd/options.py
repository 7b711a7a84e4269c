"""Options, one frozen dataclass per concern, each field with one default, validated on
construction: a bad value raises ``OptionsError`` naming the field and what is valid.

``SolverOptions`` are the integer program's knobs (when a seed is final, how CP-SAT runs and
when it stops); ``SearchOptions`` what ``method="auto"`` does (memory budget, time, which
hand-written plans to score, the plan cache) and holds the solver's.

>>> SearchOptions(time_limit=5).solver.gap
0.001
>>> SearchOptions(time_limit=0)
Traceback (most recent call last):
...
spmd.errors.OptionsError: SearchOptions.time_limit must be > 0 (seconds), got 0
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from spmd.errors import OptionsError
from spmd.units import readable_bytes

__all__ = ["CACHE_ENV", "PipelineOptions", "Rules", "SearchOptions", "SolverOptions",
           "normalize_rules"]

CACHE_ENV = "SPMD_CACHE_DIR"


def _check(owner: str, name: str, value: Any, ok: bool, valid: str) -> None:
    if not ok:
        raise OptionsError(f"{owner}.{name} must be {valid}, got {value!r}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: normalized rules: (logical name, mesh axes) pairs in the user's order
Rules = tuple[tuple[str, tuple[str, ...]], ...]

_FORMS = ("a mapping {name: axis | (axes...) | None}, or a sequence of (name, axis | "
          "(axes...) | None) pairs as nnx.logical_axis_rules and MaxText write them")


def _axes(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Iterable) and all(isinstance(a, str) for a in value):
        return tuple(value)
    raise OptionsError(f"SearchOptions.rules: {where} maps to {value!r}; a rule's mesh axes "
                       f"are one axis name, a sequence of them, or None")


def normalize_rules(rules: Any) -> Rules:
    """The rules in their one ordered form (OptionsError naming the rule at fault).

    >>> normalize_rules({"mlp": "model", "embed": None})
    (('mlp', ('model',)), ('embed', ()))
    >>> normalize_rules([["batch", ["data", "fsdp"]], ("heads", "tensor")])
    (('batch', ('data', 'fsdp')), ('heads', ('tensor',)))
    """
    if rules is None:
        return ()
    if isinstance(rules, Mapping):
        pairs = list(rules.items())
    elif isinstance(rules, Iterable) and not isinstance(rules, (str, bytes)):
        pairs = list(rules)
    else:
        raise OptionsError(f"SearchOptions.rules: got {rules!r}; valid: {_FORMS}")
    out = []
    for i, pair in enumerate(pairs):
        if (not isinstance(pair, Sequence) or isinstance(pair, str) or len(pair) != 2
                or not isinstance(pair[0], str)):
            raise OptionsError(f"SearchOptions.rules: rule {i} is {pair!r}, not a (logical "
                               f"name, mesh axes) pair; valid: {_FORMS}")
        out.append((pair[0], _axes(pair[1], f"rule {i} ({pair[0]!r})")))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class SolverOptions:
    """How the integer program is solved (``spmd.solver.solve``).

    Attributes:
      gap: a seed proven within this relative gap of the lower bound is final and CP-SAT is
        skipped (on 2 cores it would only spend its seconds confirming the seed).
      refine: run CP-SAT from the best seed when the gap is not closed; False returns the
        best seed (diffusion and local moves) as it is.
      solve_share: the least share of the time limit left to CP-SAT once its model is
        written; a model not written by then is dropped (the best seed is returned, timed out).
      workers: CP-SAT search workers.
      light_presolve_limit: models with more variables get one presolve round (the hinted
        first plan comes in ~0.6 s instead of ~2 s on a 7,000-variable model).
      presolve_limit: models with more variables skip presolve (on 2 cores it alone outlasts
        a time limit of seconds).
      stall_seconds: CP-SAT stops once no better plan came for max(this, ``stall_fraction``
        x the time limit): on 2 cores its bound stays loose and waiting rarely pays.
      stall_fraction: see ``stall_seconds``.
      stall_gain: only plans better by this (relative) restart the stall clock (on large
        models CP-SAT keeps finding plans better by a fraction of a percent).
    """

    gap: float = 1e-3
    refine: bool = True
    solve_share: float = 0.1
    workers: int = 2
    light_presolve_limit: int = 5_000
    presolve_limit: int = 20_000
    stall_seconds: float = 1.0
    stall_fraction: float = 0.05
    stall_gain: float = 0.005

    def __post_init__(self) -> None:
        own = "SolverOptions"
        _check(own, "gap", self.gap, _number(self.gap) and 0 <= self.gap < 1, "in [0, 1)")
        _check(own, "refine", self.refine, isinstance(self.refine, bool), "True or False")
        _check(own, "solve_share", self.solve_share,
               _number(self.solve_share) and 0 < self.solve_share <= 1, "in (0, 1]")
        for name in ("workers", "light_presolve_limit", "presolve_limit"):
            value = getattr(self, name)
            _check(own, name, value, isinstance(value, int) and not isinstance(value, bool)
                   and value >= (1 if name == "workers" else 0),
                   "an integer >= 1" if name == "workers" else "an integer >= 0")
        for name in ("stall_seconds", "stall_fraction", "stall_gain"):
            value = getattr(self, name)
            _check(own, name, value, _number(value) and value >= 0, "a number >= 0")

    def stall_window(self, time_limit: float) -> float:
        """How long CP-SAT may go without a better plan before the search stops early."""
        return max(self.stall_seconds, self.stall_fraction * time_limit)


#: the pipeline schedules ``spmd.stages.schedule`` runs
SCHEDULE_NAMES = ("gpipe", "1f1b")
RUNTIME_NAMES = ("auto", "spmd", "mpmd")


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """How a step is cut into pipeline stages (``spmd.stages``).

    Attributes:
      stage_axis: the mesh axis a hand-written pipeline plan (``pp_dp``, ``pp_tp``,
        ``pp_fsdp``) puts its stages along: one stage per index of it.
      microbatches: how many microbatches a step's batch is cut into; None: twice the
        stages for a hand-written plan (MaxText's advice), searched for auto.
      schedule: ``"1f1b"`` (at most ``stages - s`` microbatches' activations held on stage
        s) or ``"gpipe"`` (all of them); both idle ``(p - 1) / (m + p - 1)`` of the time.
        The MPMD runtime's; the SPMD runtime runs GPipe (or circular) whatever this says.
      min_stages: auto plans with fewer stages are not considered (2 forces a pipeline).
      max_stages: auto plans with more stages are not considered (1: no pipeline).
      layers: how many layers the step's forward pass is cut into (stages hold contiguous
        ranges of them); None: as many as a hand-written plan has stages, or for auto 8
        (``spmd.stages.auto.MAX_LAYERS``).
      runtime: how a hand-written pipeline runs. ``"spmd"``: one program on the whole
        mesh, the step's scanned layer stack spread over the stage axis, microbatches moved
        by collective-permute (``spmd.runtime.stacked``; the step must scan its layers);
        ``"mpmd"``: one program per stage and phase, driven from the host (any step; a
        scan stays whole in one stage); ``"auto"``: SPMD where the step scans a stack its
        stages can share equally, else MPMD.
      repeats: chunks of the stack per stage, the circular schedule (SPMD only): the
        bubble falls to ``(p - 1) / (repeats m + p - 1)``; needs ``m >= p`` microbatches.
    """

    stage_axis: str = "stage"
    microbatches: int | None = None
    schedule: str = "1f1b"
    min_stages: int = 1
    max_stages: int | None = None
    layers: int | None = None
    runtime: str = "auto"
    repeats: int = 1

    def __post_init__(self) -> None:
        own = "PipelineOptions"
        _check(own, "runtime", self.runtime, self.runtime in RUNTIME_NAMES,
               f"one of {', '.join(RUNTIME_NAMES)}")
        _check(own, "stage_axis", self.stage_axis, isinstance(self.stage_axis, str)
               and bool(self.stage_axis), "a mesh axis name")
        _check(own, "schedule", self.schedule, self.schedule in SCHEDULE_NAMES,
               f"one of {', '.join(SCHEDULE_NAMES)}")
        def count(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 1

        _check(own, "repeats", self.repeats, count(self.repeats), "a whole number >= 1")
        if self.repeats > 1 and self.runtime == "mpmd":
            raise OptionsError(f"PipelineOptions.repeats={self.repeats} (the circular "
                               f"schedule) needs runtime 'spmd' or 'auto', not 'mpmd'")
        for name in ("microbatches", "max_stages", "layers"):
            value = getattr(self, name)
            _check(own, name, value, value is None or count(value), "a whole number >= 1 or None")
        _check(own, "min_stages", self.min_stages, count(self.min_stages), "a whole number >= 1")
        if self.max_stages is not None and self.max_stages < self.min_stages:
            raise OptionsError(f"PipelineOptions.max_stages ({self.max_stages}) is below "
                               f"min_stages ({self.min_stages})")


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """How ``method="auto"`` searches.

    Attributes:
      memory_budget: bytes per device a plan may use (default: the device's memory).
      memory_headroom: the share of the budget plans leave free for the memory
        prediction's error: they are searched under ``(1 - memory_headroom) x`` the budget
        (``budget_for``). Predictions come within 15% of XLA's compiled memory on 45 of
        the benchmark table's 45 plans (0.87-1.12x, median 0.96x, bench/memory.py, Dec 8);
        a plan for a GPU mesh compiled on CPU devices holds what XLA:CPU adds of its own
        (whole gradients before their slice, buffers its breadth-first order makes early,
        copies at sharding constraints): gpt-bench on 8 A100s, planned under 0.8x its
        plain peak, was predicted at 0.89-0.92x its XLA:CPU compile and compiled within
        that budget in two runs, 0.02-2.7% over it in four (Dec 7-8).
      time_limit: seconds the solver may spend on the search; past it, the best plan found is
        used and a warning says so.
      compare: score every applicable hand-written plan on the search's own cost graph
        (shown by ``Plan.describe``; the best one also warm-starts the solver and is kept
        if the search ends slower).
      score_time_limit: solver seconds for scoring one hand-written plan (its inputs are
        fixed; at most ``time_limit``). 0.5 s scored six plans of a 24-layer GPT on 8 A100s
        as 0.75 s did, and four zoo models within 0.4%.
      score_refine: refine each hand-written plan's score with CP-SAT, as the search does.
        Off, a score is the solver's best seed (diffusion and local moves): it ranks the
        plans and seeds the search (which does run CP-SAT), at most a few percent above the
        refined score for most plans but up to 1.5x for some (bench/RESULTS.md), in a
        fraction of the time (CP-SAT took ~3 s per plan on a 24-layer GPT, most of the
        comparison). On, with a ``score_time_limit`` of seconds, the comparison is
        accurate and slow; ``bench/auto_vs_manual.py`` judges auto that way.
      rules: logical axis rules the user fixes, in Flax's forms (``normalize_rules``):
        every input with a dimension they name is pinned to what they give it, under auto
        and every hand-written method alike; the rest is searched (or the method's).
      cache: reuse a saved plan for the same jaxpr, mesh and options.
      cache_dir: where plans are saved (default ``$SPMD_CACHE_DIR`` or ~/.cache/spmd/plans).
      solver: the integer program's options.
      pipeline: how the step is cut into pipeline stages (``PipelineOptions``).
    """

    memory_budget: float | None = None
    memory_headroom: float = 0.1
    time_limit: float = 20.0
    compare: bool = True
    score_time_limit: float = 0.5
    score_refine: bool = False
    rules: Any = None
    cache: bool = True
    cache_dir: str | None = None
    solver: SolverOptions = SolverOptions()
    pipeline: PipelineOptions = PipelineOptions()

    def __post_init__(self) -> None:
        own = "SearchOptions"
        if self.memory_budget is not None:
            _check(own, "memory_budget", self.memory_budget,
                   _number(self.memory_budget) and self.memory_budget > 0,
                   "> 0 (bytes per device) or None (the device's memory)")
        _check(own, "memory_headroom", self.memory_headroom,
               _number(self.memory_headroom) and 0 <= self.memory_headroom < 0.5,
               "a share of the budget, at least 0 and below 0.5")
        for name in ("time_limit", "score_time_limit"):
            value = getattr(self, name)
            _check(own, name, value, _number(value) and value > 0, "> 0 (seconds)")
        for name in ("compare", "cache", "score_refine"):
            _check(own, name, getattr(self, name), isinstance(getattr(self, name), bool),
                   "True or False")
        normalize_rules(self.rules)  # raises, naming the rule at fault
        _check(own, "solver", self.solver, isinstance(self.solver, SolverOptions),
               "a SolverOptions")
        _check(own, "pipeline", self.pipeline, isinstance(self.pipeline, PipelineOptions),
               "a PipelineOptions")

    def directory(self) -> Path:
        """Where plans are cached."""
        default = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "spmd" / "plans"
        return Path(self.cache_dir or default)

    def plan_key(self) -> str:
        """Every option that can change a plan (not where or whether it is cached): a cached
        plan found under other options is not reused."""
        own = dataclasses.replace(self, rules=None, cache=True, cache_dir=None)
        return repr(own) + repr(self.logical_rules())

    def logical_rules(self) -> Rules:
        """``rules`` in their one ordered form (``normalize_rules``)."""
        return normalize_rules(self.rules)

    def budget_for(self, mesh) -> float:
        """Bytes per device a plan may use on ``mesh`` by its prediction: ``memory_budget``,
        else the memory of the mesh's device, less ``memory_headroom``."""
        return (1 - self.memory_headroom) * self.stated_budget(mesh)

    def stated_budget(self, mesh) -> float:
        """The budget as the user gave it (``memory_budget``), else the device's memory:
        what a compiled plan must fit, and what messages name."""
        return mesh.device.memory_bytes if self.memory_budget is None else self.memory_budget

    def budget_words(self, mesh) -> str:
        """The planning budget in words, with what it was made from: ``the memory budget of
        33.53 GiB per device (37.25 GiB less the 10% memory_headroom ...)``."""
        budget, stated = self.budget_for(mesh), self.stated_budget(mesh)
        words = f"the memory budget of {readable_bytes(budget, exact=True)} per device"
        if not self.memory_headroom:
            return words
        return (f"{words} ({readable_bytes(stated, exact=True)} less the "
                f"{self.memory_headroom:.0%} memory_headroom left for the memory "
                f"prediction's error)")

    def scoring(self) -> tuple[float, SolverOptions]:
        """The time limit and solver options for scoring one hand-written plan."""
        return (min(self.time_limit, self.score_time_limit),
                dataclasses.replace(self.solver, refine=self.score_refine))
