"""``method="auto"``: trace the step, search its sharding, and explain the result beside the
hand-written plans scored by the same cost model. Plans are cached as JSON, keyed by the
step's jaxpr, the mesh and the options, so a second run skips the search.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping


from spmd.search.intra_op import SCORE_TIME_LIMIT, AutoResult, InputInfo, score_result, search
from spmd.errors import PlanError, warn
from spmd.trace.graph import Graph, build_graph
from spmd.manual import ManualMethod, applicable_methods, leaf_spec, manual_specs
from spmd.cluster.mesh import DeviceMesh
from spmd.plan import FORMAT_VERSION, Plan
from spmd.trace.signature import StepSignature

CACHE_ENV = "SPMD_CACHE_DIR"


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """How ``method="auto"`` searches.

    Attributes:
      memory_budget: bytes per device a plan may use (default: the device's memory).
      time_limit: seconds the solver may spend; past it, the best plan found is used and a
        warning says so.
      compare: score every applicable hand-written plan with the same cost model (shown by
        ``Plan.describe``; the best one also warm-starts the solver).
      rules: logical axis name -> mesh axes the user fixes (Flax-style logical rules);
        parameters with a named dimension covered here are pinned, the rest is searched.
      cache: reuse a saved plan for the same jaxpr, mesh and options.
      cache_dir: where plans are saved (default ``$SPMD_CACHE_DIR`` or ~/.cache/spmd/plans).
    """

    memory_budget: float | None = None
    time_limit: float = 20.0
    compare: bool = True
    rules: Mapping[str, tuple[str, ...]] | None = None
    cache: bool = True
    cache_dir: str | None = None

    def directory(self) -> Path:
        default = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "spmd" / "plans"
        return Path(self.cache_dir or default)


def _inputs(sig: StepSignature, mesh: DeviceMesh, options: SearchOptions) -> list[InputInfo]:
    pins_from_rules = None
    if options.rules:
        rules = {k: (v,) if isinstance(v, str) else tuple(v or ()) for k, v in options.rules.items()}
        pins_from_rules = ManualMethod("rules", "user's logical rules", (), rules)
    out = []
    for leaf in sig.leaves:
        pinned = leaf.pinned
        if (pinned is None and pins_from_rules is not None and leaf.logical
                and leaf.kind in ("param", "optimizer")
                and any(n in pins_from_rules.params for n in leaf.logical if n)):
            pinned = leaf_spec(leaf, pins_from_rules, mesh)
        out.append(InputInfo(leaf.path, leaf.shape, leaf.dtype, leaf.kind, pinned))
    return out


@functools.cache
def _code_version() -> str:
    """A digest of spmd's own source: a plan found by other code is not reused."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _cache_key(jaxpr, inputs: list[InputInfo], mesh: DeviceMesh, options: SearchOptions) -> str:
    digest = hashlib.sha256()
    digest.update(str(jaxpr).encode())
    digest.update(repr([(i.path, i.shape, str(i.dtype), i.kind, i.pinned) for i in inputs])
                  .encode())
    digest.update(repr((mesh.axis_names, mesh.axis_sizes, sorted(mesh.links.items()),
                        mesh.device, options.memory_budget, FORMAT_VERSION,
                        _code_version())).encode())
    return digest.hexdigest()[:32]


def _warn_trivial_axes(mesh: DeviceMesh) -> None:
    """A one-device mesh or a size-1 axis plans fine but splits nothing: say so, not fail."""
    if mesh.size == 1:
        warn(f"mesh {mesh.name!r} has one device: every plan is the same (nothing is split); "
             f"the step runs unsharded")
        return
    ones = [a for a, s in mesh.shape.items() if s == 1]
    if ones:
        warn(f"mesh {mesh.name!r}: axis {', '.join(ones)} has size 1 and cannot split "
             f"anything; it is ignored")


def score_manual(sig: StepSignature, mesh: DeviceMesh, method: str,
                 options: SearchOptions, graph: Graph | None = None) -> AutoResult:
    """The cost model's view of a hand-written plan (intermediates chosen by the ILP)."""
    specs = manual_specs(sig.leaves, method, mesh)
    return score_result(sig.jaxpr, _inputs(sig, mesh, options), mesh, specs,
                        output_aliases=sig.output_aliases,
                        time_limit=min(options.time_limit, SCORE_TIME_LIMIT), graph=graph)


def auto_plan(sig: StepSignature, mesh: DeviceMesh, options: SearchOptions) -> Plan:
    """Search a plan for the step (or load it from the cache)."""
    _warn_trivial_axes(mesh)
    jaxpr = sig.jaxpr
    inputs = _inputs(sig, mesh, options)
    path = None
    if options.cache:  # hashing a large jaxpr's text takes seconds: only when caching
        path = options.directory() / f"{_cache_key(jaxpr, inputs, mesh, options)}.json"
    if path is not None and path.exists():
        try:
            cached = Plan.from_dict(json.loads(path.read_text()), mesh)
        except (ValueError, KeyError, TypeError):
            cached = None
        if cached is not None and len(cached.input_specs) == len(sig.leaves):
            cached.leaves, cached.signature, cached.jaxpr = sig.leaves, sig, jaxpr
            cached.search = {**(cached.search or {}), "cache": f"loaded {path}"}
            return cached
    graph = build_graph(jaxpr)  # one op graph for every scoring and the search
    alternatives: dict[str, Any] = {}
    best: tuple[str, AutoResult] | None = None
    if options.compare and mesh.size > 1:
        for name, why_not in applicable_methods(sig.leaves, mesh).items():
            if why_not:
                alternatives[name] = f"does not apply: {why_not}"
                continue
            try:
                scored = score_manual(sig, mesh, name, options, graph)
            except PlanError as err:  # the cost model cannot express this hand-written plan
                alternatives[name] = f"not scored: {err}"
                continue
            alternatives[name] = scored.prediction.to_dict()
            if best is None or scored.prediction.total_time < best[1].prediction.total_time:
                best = (name, scored)
    result = search(jaxpr, inputs, mesh, output_aliases=sig.output_aliases,
                    memory_budget=options.memory_budget, time_limit=options.time_limit,
                    warm_start=best[1] if best else None, graph=graph)
    budget = mesh.device.memory_bytes if options.memory_budget is None else options.memory_budget
    kept_manual = (best is not None
                   and best[1].prediction.total_time < result.prediction.total_time
                   and best[1].prediction.memory_bytes <= budget)
    if kept_manual:
        # The search keeps small inputs replicated, so it can miss a hand-written plan
        # that splits them by a hair; never return a slower plan.
        result = dataclasses.replace(best[1], solver=result.solver, stats=result.stats)
    solver = result.solver
    if solver is not None and solver.timed_out:
        warn(f"the sharding search reached its time limit ({options.time_limit:g} s); using "
             f"the best plan found (objective {solver.objective:.4g} s, bound "
             f"{solver.bound:.4g} s). Raise SearchOptions.time_limit for a better one")
    stats = dict(result.stats)
    if solver is not None:
        # stalled: stopped early with no better plan coming (not a time-out: no warning)
        stats.update(objective=solver.objective, bound=solver.bound, status=solver.status,
                     bound_from=solver.bound_from, timed_out=solver.timed_out,
                     stalled=solver.stalled)
    stats["fallbacks"] = result.fallbacks
    stats["warm_start_from"] = best[0] if best else None
    stats["kept_hand_written"] = best[0] if kept_manual else None
    planned = Plan(method="auto", mesh=mesh, leaves=sig.leaves, input_specs=result.input_specs,
                   output_specs=list(result.output_specs), prediction=result.prediction.to_dict(),
                   search=stats, constraints=dict(result.constraints), alternatives=alternatives,
                   signature=sig, jaxpr=jaxpr)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            planned.save(path)
        except OSError as err:
            warn(f"could not save the plan cache {path}: {err}")
    return planned

