"""The cost model's predicted step time against the step time measured on this CPU (issue 13:
"price a step as the GPU spends it").

1. One device: ``spmd profile`` of the bundled cpu-1 mesh (``spmd.profile.profile_mesh``),
   then for a 4-layer GPT of width 256, mlp-small, moe-tiny and wresnet-tiny the auto plan
   on that profiled mesh, compiled and run. M/P = measured / predicted per model; the
   issue's target is 0.7 <= M/P <= 1.4.
2. Ranking on cpu-8 (8 simulated devices, data=2 x model=4): the bundled mesh profiled the
   same way, then for each small zoo model auto and every applicable hand-written plan,
   each predicted and measured; Spearman's rank correlation between the two over a model's
   plans. The issue's target is >= 0.8 per model.

Measured is the step time as ``spmd run`` reports it: the wall time of
``jax.block_until_ready(step(model, optimizer, batch))`` through spmd's ``ParallelStep``,
the median after the first call (``spmd.timing.median_step``). Beside it, each step also
calls the compiled XLA executable alone on already placed flat arrays (the state fed back as the
step's outputs), timed the same way, so the wrapper's per-call Python work (flattening the
NNX state, checking placements, writing the new state back) shows as the difference.
Predicted is ``plan.prediction.total_time`` on the profiled mesh.

    python bench/step_time.py                      # both parts (~8 min on 2 shared cores)
    python bench/step_time.py --quick              # a smoke run (~75 s): mlp-tiny, 3 steps
    python bench/step_time.py --report bench/results/step_time.json   # re-render only

The machine is shared and noisy, so a model's plans are compiled first and then stepped in
turns (one step of each plan per round, the wrapper and the bare executable alternating
which goes first), and every figure is a median. Each part runs in its own subprocess
(``--worker PART``): jax fixes the CPU device count when it starts, so cpu-1 and cpu-8
cannot share a process.

Writes bench/results/step_time.json, the profiled meshes beside it
(cpu-1-profiled.yaml, cpu-8-profiled.yaml: ``spmd run --mesh FILE`` reproduces a row), and
the section "## Predicted vs measured step time on this CPU (bench/step_time.py)" of
bench/RESULTS.md. ``--quick`` writes nothing unless ``--output`` or ``--results-md`` says
where; it prints the section.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

try:  # run as a script (python bench/step_time.py): bench/ is on sys.path
    import common
    from manual_plans import Initial
except ImportError:  # python -m bench.step_time
    from bench import common
    from bench.manual_plans import Initial

SECTION = "## Predicted vs measured step time on this CPU (bench/step_time.py)"
PARTS = ("one-device", "cpu-8")
#: the issue's targets: M/P within this range on one device, Spearman at least this on cpu-8
TARGET_RATIO = (0.7, 1.4)
TARGET_SPEARMAN = 0.8
#: model label -> (zoo model, config overrides); the batch is the zoo model's default
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # gpt-tiny grown to 4 layers of width 256 (~3.2 M parameters): compute outweighs dispatch
    "gpt-4x256": ("gpt-tiny", dict(num_layers=4, d_model=256, num_heads=8, head_dim=32,
                                   d_ff=1024)),
    **{name: (name, {}) for name in ("gpt-tiny", "mlp-tiny", "mlp-small", "moe-tiny",
                                     "wresnet-tiny")},
}
#: (part, quick) -> the models it runs
PART_MODELS: dict[tuple[str, bool], tuple[str, ...]] = {
    ("one-device", False): ("gpt-tiny", "gpt-4x256", "mlp-small", "moe-tiny", "wresnet-tiny"),
    ("one-device", True): ("gpt-tiny", "mlp-tiny"),
    ("cpu-8", False): ("gpt-tiny", "mlp-tiny", "mlp-small", "moe-tiny", "wresnet-tiny"),
    ("cpu-8", True): ("mlp-tiny",),  # 7 plans that compile in about a second each
}
#: timed steps per plan: a plan's steps spread 10-25% (interquartile over median) on a shared
#: 2-core host, and a model's plans often lie within 5% of each other
DEFAULT_STEPS, QUICK_STEPS = 20, 3
PART_TIMEOUT_S = 900.0


# -- statistics ---------------------------------------------------------------------------

def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties given the mean of the ranks they span (as Spearman's rho needs).

    >>> ranks([30.0, 10.0, 20.0, 10.0])
    [4.0, 1.5, 3.0, 1.5]
    """
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            out[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation: Pearson's r of the tie-averaged ranks. None where it
    says nothing: fewer than 3 pairs, or one side all ties.

    >>> spearman([1, 2, 3, 4], [10, 20, 30, 40]), spearman([1, 2, 3], [3, 2, 1])
    (1.0, -1.0)
    """
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} values against {len(ys)}")
    if len(xs) < 3:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)
    return None if var == 0 else cov / var ** 0.5


def spread(times: Sequence[float]) -> float:
    """Interquartile range over the median: how noisy one plan's step times were."""
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / statistics.median(times)


# -- one plan, compiled and stepped -------------------------------------------------------

@dataclasses.dataclass
class Case:
    """One plan of one model, compiled, with its own copy of the state (the step donates
    it), and the step times measured so far."""

    model: str
    method: str
    plan: Any
    step: Any
    args: tuple  # (model, optimizer, batch): NNX objects the step updates in place
    compiled: Any
    plan_s: float
    compile_s: float
    wrapper_s: list[float] = dataclasses.field(default_factory=list)
    executable_s: list[float] = dataclasses.field(default_factory=list)
    fresh_bytes: list[int] = dataclasses.field(default_factory=list)  # per wrapper step
    losses: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None

    def call_wrapper(self) -> float:
        """One step as ``spmd run`` times it: through ``ParallelStep``, blocked on (and, as
        ``spmd run`` counts them, the fresh host pages it touched)."""
        import jax

        from spmd.runtime.host_memory import touched_pages

        touched = touched_pages()
        start = time.perf_counter()
        metrics = jax.block_until_ready(self.step(*self.args))
        seconds = time.perf_counter() - start
        if touched is not None:
            self.fresh_bytes.append(touched_pages() - touched)
        self.losses.append(float(metrics["loss"]))
        return seconds

    def call_executable(self) -> float:
        """One step of the compiled executable alone, on leaves already flat and placed;
        the new state is written back untimed, so the next wrapper call trains on."""
        import jax

        leaves = self.step.place(*self.args)
        start = time.perf_counter()
        outputs = jax.block_until_ready(self.compiled(*leaves))
        seconds = time.perf_counter() - start
        self.plan.bound_signature().unflatten_outputs(self.args, outputs)
        return seconds


def model_spec(label: str) -> tuple[Any, dict[str, Any]]:
    """The zoo model behind ``label`` with its overrides, and the overrides."""
    from spmd import zoo

    name, overrides = MODELS[label]
    spec = zoo.get(name)
    return (spec.with_config(**overrides) if overrides else spec), overrides


def build_case(label: str, spec: Any, initial: Initial, mesh: Any, method: str) -> Case:
    """Plan, place and compile one method, as ``spmd run`` does but from host copies of one
    initial state shared by every plan (``spmd.materialize`` would compile a sharded
    initializer per plan: seconds each on this machine). Hand-written plans are scored with
    the default ``SearchOptions`` (``spmd run --method M`` asks for the same prediction) and
    so run as scored, with the constraints of the intermediates their score chose."""
    import jax
    import numpy as np
    from flax import nnx

    import spmd

    step = spmd.parallelize(spec.train_step, mesh=mesh, method=method,
                            options=spmd.SearchOptions())
    start = time.perf_counter()
    plan = step.plan_for(initial.abstract_model, initial.abstract_opt, initial.batch)
    plan_s = time.perf_counter() - start
    # a rebuilt tree: nnx.merge reuses the State's Variable objects, which the step updates
    net, opt = nnx.merge(initial.graphdef, jax.tree.map(np.array, initial.state))
    batch = spmd.shard_batch(plan, spmd.process_local_batch(plan, initial.batch))
    start = time.perf_counter()
    compiled = step.compile(net, opt, batch)
    return Case(label, method, plan, step, (net, opt, batch), compiled, plan_s,
                time.perf_counter() - start)


def step_in_turns(cases: list[Case], steps: int) -> None:
    """``steps + 1`` rounds, each one burst of every case in turn: slow drifts in the host's
    load fall on every plan alike. A burst is one untimed step (the case's first since
    another case ran: it refills the caches the other evicted, which a training loop,
    stepping one plan back to back, does not pay), then one wrapper step and one
    bare-executable step, alternating which of the two goes first. A case that fails is
    dropped from later rounds with its error."""
    for round_ in range(steps + 1):
        for case in cases:
            if case.error is not None:
                continue
            try:
                case.call_executable()
                if round_ % 2 == 0:
                    case.wrapper_s.append(case.call_wrapper())
                    case.executable_s.append(case.call_executable())
                else:
                    case.executable_s.append(case.call_executable())
                    case.wrapper_s.append(case.call_wrapper())
            except Exception as err:  # noqa: BLE001 - one plan's failure is a result
                case.error = f"{type(err).__name__}: {err}"


def show(cases: list[Case]) -> None:
    """Progress on the terminal: each case's planning and compile time and its steps."""
    for c in cases:
        print(f"  {c.model:13s} {c.method:8s} plan {c.plan_s:5.1f} s  compile "
              f"{c.compile_s:5.1f} s  steps {' '.join(f'{t * 1e3:.0f}' for t in c.wrapper_s)}"
              f" ms" + (f"  failed: {c.error}" if c.error else ""), flush=True)


def case_result(case: Case) -> dict[str, Any]:
    """A case's numbers for the JSON: medians after the first call, as ``spmd run``."""
    from spmd.timing import median_step

    pred = case.plan.prediction
    out: dict[str, Any] = {
        "model": case.model, "method": case.method, "plan_s": case.plan_s,
        "compile_s": case.compile_s,
        "predicted_s": None if pred is None else pred.total_time,
        "prediction": None if pred is None else pred.to_dict(),
        "kept_hand_written": (case.plan.search or {}).get("kept_hand_written"),
        "wrapper_times_s": case.wrapper_s, "executable_times_s": case.executable_s,
        "losses": case.losses, "error": case.error,
    }
    if case.wrapper_s and case.error is None:
        out["measured_s"] = median_step(case.wrapper_s)
        out["executable_s"] = median_step(case.executable_s)
        out["spread"] = spread(case.wrapper_s[1:])
        if case.fresh_bytes:
            out["fresh_bytes"] = median_step(case.fresh_bytes)
    return out


# -- the two parts (each in its own process) ----------------------------------------------

def profiled(mesh_name: str, quick: bool) -> tuple[Any, dict[str, Any]]:
    """The bundled mesh as ``spmd profile`` measures it here, and what to record of it."""
    import spmd
    from spmd.profile import profile_mesh

    mesh = spmd.load_mesh(mesh_name)  # before jax starts: sets the CPU device count
    start = time.perf_counter()
    profile = profile_mesh(mesh, quick=quick)
    return profile.mesh(), {"mesh": mesh_name, "profile_s": time.perf_counter() - start,
                            "profile_summary": profile.summary(), "profile_yaml": profile.yaml()}


def build_model_cases(label: str, mesh, every_method: bool
                      ) -> tuple[list[Case], list[dict[str, Any]], list[str], dict[str, Any]]:
    """One model's cases: auto, and with ``every_method`` each hand-written method that
    applies (``spmd.manual.applicable_methods``). Returns the cases, the failed plans'
    records, the warnings raised while planning, and the model's facts."""
    import spmd
    from spmd.manual import METHODS, applicable_methods

    spec, overrides = model_spec(label)
    initial = Initial.build(spec, spec.default_batch_size)
    cases: list[Case] = []
    failures: list[dict[str, Any]] = []

    def attempt(method: str) -> None:
        try:
            cases.append(build_case(label, spec, initial, mesh, method))
        except Exception as err:  # noqa: BLE001 - one plan's failure is a result
            failures.append({"model": label, "method": method,
                             "error": f"{type(err).__name__}: {err}"})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attempt("auto")
        if every_method:  # the leaves as auto's plan read them (else traced again)
            leaves = cases[0].plan.leaves if cases else spmd.plan(
                spec.train_step, initial.abstract_model, initial.abstract_opt,
                initial.batch, mesh=mesh, method="dp").leaves
            reasons = applicable_methods(leaves, mesh)
            for method in METHODS:
                if reasons.get(method) is None:
                    attempt(method)
    facts = {"model": label, "zoo_model": spec.name, "config_overrides": overrides,
             "batch_size": spec.default_batch_size, "param_count": spec.param_count()}
    return cases, failures, sorted({str(w.message) for w in caught}), facts


def one_device(quick: bool, steps: int) -> dict[str, Any]:
    """Part 1: the auto plan of each model on the profiled cpu-1 mesh, all models stepped
    in turns."""
    mesh, part = profiled("cpu-1", quick)
    cases, runs, models = [], [], []
    for label in PART_MODELS[("one-device", quick)]:
        print(f"one-device: {label}", flush=True)
        got, failures, caught, facts = build_model_cases(label, mesh, every_method=False)
        cases += got
        runs += failures
        models.append({**facts, "warnings": caught})
    step_in_turns(cases, steps)
    show(cases)
    runs += [case_result(c) for c in cases]
    return {**part, "models": models, "runs": runs}


def cpu_8(quick: bool, steps: int) -> dict[str, Any]:
    """Part 2: every plan of each model on the profiled cpu-8 mesh, one model at a time
    (its plans stepped in turns), then rank correlation per model."""
    mesh, part = profiled("cpu-8", quick)
    runs, models = [], []
    for label in PART_MODELS[("cpu-8", quick)]:
        print(f"cpu-8: {label}", flush=True)
        cases, failures, caught, facts = build_model_cases(label, mesh, every_method=True)
        step_in_turns(cases, steps)
        runs += failures + [case_result(c) for c in cases]
        show(cases)
        models.append({**facts, "warnings": caught})
        del cases
        gc.collect()
    return {**part, "models": models, "runs": runs}


def worker(part: str, quick: bool, steps: int, result: Path) -> int:
    """One part in this process; its JSON goes to ``result`` (an error is recorded there)."""
    work = {"one-device": one_device, "cpu-8": cpu_8}[part]
    return common.run_worker(lambda: work(quick, steps), {"part": part}, result)


def run_part(part: str, quick: bool, steps: int, keep_freed_memory: bool) -> dict[str, Any]:
    """One part in a fresh process (its output streamed here); a crash is recorded. With
    ``keep_freed_memory`` the process starts with glibc told to keep the memory it frees
    (``spmd.runtime.host_memory``): else XLA:CPU's temporaries are page-faulted afresh each
    step once they pass glibc's mmap threshold, a cost of the host's allocator that a GPU
    does not have and the cost model does not price."""
    from spmd.runtime.host_memory import KEEP_FREED_MEMORY

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        result = Path(fh.name)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", part,
           "--result", str(result), "--steps", str(steps), *(["--quick"] if quick else [])]
    start = time.perf_counter()
    try:
        env = {**os.environ, **(KEEP_FREED_MEMORY if keep_freed_memory else {})}
        proc = subprocess.run(cmd, cwd=common.REPO_ROOT, timeout=PART_TIMEOUT_S, env=env)
        data = json.loads(result.read_text()) if result.stat().st_size else {
            "part": part, "error": f"worker exited with {proc.returncode} (output above)"}
    except subprocess.TimeoutExpired:
        data = {"part": part, "error": f"timed out after {PART_TIMEOUT_S:.0f} s"}
    finally:
        result.unlink(missing_ok=True)
    data["wall_s"] = time.perf_counter() - start
    return data


# -- the report ---------------------------------------------------------------------------

def correlations(part: dict[str, Any]) -> list[dict[str, Any]]:
    """Per model, Spearman's rho of predicted against measured (and against the bare
    executable's time: its median, and its fastest step, the one the shared host disturbed
    least) over the plans that ran."""
    out = []
    for model in part.get("models", []):
        runs = [r for r in part["runs"] if r["model"] == model["model"] and "measured_s" in r
                and r.get("predicted_s") is not None]
        predicted = [r["predicted_s"] for r in runs]
        out.append({"model": model["model"], "plans": len(runs),
                    "spearman": spearman(predicted, [r["measured_s"] for r in runs]),
                    "spearman_executable": spearman(predicted,
                                                    [r["executable_s"] for r in runs]),
                    "spearman_fastest": spearman(predicted, [
                        min(r["executable_times_s"][1:]) for r in runs])
                    if all(len(r.get("executable_times_s", ())) > 1 for r in runs) else None})
    return out


def ratio(run: dict[str, Any], key: str = "measured_s") -> float | None:
    """Measured (or executable-only) over predicted; None where either is missing."""
    pred = run.get("predicted_s")
    return run[key] / pred if key in run and pred else None


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.3g}"


def _x(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def _rho(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def run_rows(part: dict[str, Any], with_target: bool) -> list[list[str]]:
    """One table row per plan: measured, executable, predicted, their ratios."""
    lo, hi = TARGET_RATIO
    rows = []
    for r in part.get("runs", []):
        mp = ratio(r)
        name = r["method"] + (f" (= {r['kept_hand_written']})" if r.get("kept_hand_written")
                              else "")
        row = [r["model"], name, _ms(r.get("measured_s")), _ms(r.get("executable_s")),
               _ms(r.get("predicted_s")), _x(mp), _x(ratio(r, "executable_s"))]
        if with_target:
            row.append("" if mp is None else ("yes" if lo <= mp <= hi else "no"))
        row.append(f"{r['fresh_bytes'] / 2**20:.1f}" if "fresh_bytes" in r else "")
        row.append(f"{r['spread']:.0%}" if "spread" in r else f"failed: {r['error']}")
        rows.append(row)
    return rows


def part_lines(part: dict[str, Any], title: str, with_target: bool) -> list[str]:
    """A part's subsection: its profile, its table, and for cpu-8 the correlations."""
    lines = [f"### {title}", ""]
    if "error" in part:
        return lines + [f"Failed: {part['error']}", ""]
    lines += [f"`spmd profile` of `{part['mesh']}` ({part['profile_s']:.0f} s; the file is "
              f"bench/results/{part['mesh']}-profiled.yaml):", "",
              *(f"    {line}" for line in part["profile_summary"].splitlines()), ""]
    headers = ["model", "plan", "measured ms", "executable ms", "predicted ms", "M/P", "E/P"]
    headers += ["M/P in target"] if with_target else []
    lines += [common.markdown_table(headers + ["fresh MiB", "spread"],
                                    run_rows(part, with_target)), ""]
    if not with_target:
        rows = [[c["model"], str(c["plans"]), _rho(c["spearman"]),
                 _rho(c["spearman_executable"]), _rho(c.get("spearman_fastest")),
                 "" if c["spearman"] is None else
                 ("yes" if c["spearman"] >= TARGET_SPEARMAN else "no")]
                for c in correlations(part)]
        lines += [common.markdown_table(
            ["model", "plans", "Spearman (measured)", "Spearman (executable)",
             "Spearman (executable, fastest step)", f">= {TARGET_SPEARMAN}"], rows,
            ["l", "r", "r", "r", "r", "l"]), ""]
    caught = [f"- {m['model']}: {w}" for m in part.get("models", []) for w in m["warnings"]]
    if caught:
        lines += ["Warnings while planning:", "", *caught, ""]
    return lines


def findings(data: dict[str, Any]) -> list[str]:
    """Plain statements computed from this run's numbers."""
    notes = []
    lo, hi = TARGET_RATIO
    one, eight = data["parts"].get("one-device", {}), data["parts"].get("cpu-8", {})
    for key, what in (("measured_s", "M/P"), ("executable_s", "the executable alone (E/P)")):
        ratios = [m for m in (ratio(r, key) for r in one.get("runs", [])) if m is not None]
        if ratios:
            inside = sum(lo <= m <= hi for m in ratios)
            notes.append(f"One device: {what} within {lo}-{hi} for {inside} of {len(ratios)} "
                         f"models (from {min(ratios):.2f} to {max(ratios):.2f}).")
    cors = [c for c in correlations(eight) if c["spearman"] is not None]
    if cors:
        met = [c["model"] for c in cors if c["spearman"] >= TARGET_SPEARMAN]
        fastest = [c["spearman_fastest"] for c in cors if c.get("spearman_fastest") is not None]
        notes.append(f"cpu-8: Spearman >= {TARGET_SPEARMAN} for {len(met)} of {len(cors)} "
                     f"models ({', '.join(met) or 'none'}); median rho "
                     f"{statistics.median(c['spearman'] for c in cors):.2f} against the "
                     f"wrapper's time, "
                     f"{statistics.median(c['spearman_executable'] for c in cors):.2f} "
                     f"against the executable's"
                     + (f", {statistics.median(fastest):.2f} against its fastest step"
                        if fastest else "") + ".")
    ran8 = [r for r in eight.get("runs", []) if ratio(r) is not None]
    if ran8:
        mps = [ratio(r) for r in ran8]
        notes.append(f"cpu-8: M/P from {min(mps):.2f} to {max(mps):.2f} (median "
                     f"{statistics.median(mps):.2f}) over {len(ran8)} plans.")
        notes += _best_plans(ran8)
    everything = [r for p in data["parts"].values() for r in p.get("runs", [])]
    timed = [r for r in everything if "measured_s" in r]
    if timed:
        extra = [(r["measured_s"] - r["executable_s"]) for r in timed]
        share = [e / r["measured_s"] for e, r in zip(extra, timed)]
        notes.append(f"The wrapper (`ParallelStep`: flatten, place check, state write-back) "
                     f"adds {statistics.median(extra) * 1e3:.1f} ms per step (median; "
                     f"{min(extra) * 1e3:.1f} to {max(extra) * 1e3:.1f} ms), "
                     f"{statistics.median(share):.0%} of the measured step (median).")
        fresh = [r for r in timed if "fresh_bytes" in r]
        if fresh:
            most = max(fresh, key=lambda r: r["fresh_bytes"])
            notes.append(f"Host memory: a measured step touched at most "
                         f"{most['fresh_bytes'] / 2**20:.1f} MiB of fresh pages "
                         f"({most['model']} / {most['method']}; median over plans "
                         f"{statistics.median(r['fresh_bytes'] for r in fresh) / 2**20:.1f} MiB).")
        notes.append(f"Noise: a plan's step times spread (interquartile range / median) "
                     f"{statistics.median(r['spread'] for r in timed):.0%} in the median "
                     f"plan, {max(r['spread'] for r in timed):.0%} at worst.")
    notes += _losses_agree(eight.get("runs", []))
    broken = [f"{r['model']} / {r['method']}" for r in everything if r.get("error")]
    notes.append(f"Plans that failed to plan, compile or run: {', '.join(broken) or 'none'}.")
    return notes


def _losses_agree(runs: list[dict[str, Any]]) -> list[str]:
    """How far apart a model's plans end, in loss: they start from one state and take as
    many steps, so a plan that computes something else shows here."""
    worst: dict[str, float] = {}
    for model in sorted({r["model"] for r in runs if r.get("losses")}):
        finals = [r["losses"][-1] for r in runs if r["model"] == model and not r.get("error")]
        if len(finals) > 1:
            worst[model] = (max(finals) - min(finals)) / max(abs(statistics.median(finals)),
                                                             1e-12)
    if not worst:
        return []
    model = max(worst, key=worst.get)
    return [f"cpu-8: a model's plans end at the same loss to within {worst[model]:.1e} "
            f"(relative; the widest, {model})."]


def _best_plans(runs: list[dict[str, Any]]) -> list[str]:
    """Whether the plan predicted fastest was measured fastest, and where auto stood."""
    models = sorted({r["model"] for r in runs}, key=[r["model"] for r in runs].index)
    hits, places = [], []
    for model in models:
        mine = [r for r in runs if r["model"] == model]
        fastest = min(mine, key=lambda r: r["measured_s"])
        hits.append(fastest["predicted_s"] == min(r["predicted_s"] for r in mine))
        auto = next((r for r in mine if r["method"] == "auto"), None)
        if auto is not None:
            place = 1 + sum(r["measured_s"] < auto["measured_s"] for r in mine)
            places.append(f"{model} {place}/{len(mine)}")
    return [f"cpu-8: the plan measured fastest was predicted fastest (or tied for it) for "
            f"{sum(hits)} of {len(hits)} models.",
            f"cpu-8: auto's place by measured step time: {', '.join(places)}."]


def _allocator_line(data: dict[str, Any]) -> str:
    """How the parts' processes were started, as to freed host memory."""
    from spmd.runtime.host_memory import keep_settings

    if data.get("keep_freed_memory"):
        return (f"The parts ran with glibc told to keep freed memory "
                f"(`{keep_settings()}`, "
                f"`spmd.runtime.host_memory`): by default it returns XLA:CPU's temporaries "
                f"to the system once they pass 32 MiB, and each step faults them in afresh, "
                f"a cost a GPU's allocator does not have (`--allocator-default` runs without).")
    return ("The parts ran with glibc's default thresholds: steps with more than 32 MiB of "
            "temporaries fault them in afresh each step, which the prediction leaves out.")


def render(data: dict[str, Any]) -> str:
    """The RESULTS.md section body."""
    steps = data["steps"]
    lines = [
        f"Command: `{data['command']}`", "",
        f"Machine: {common.machine_line(data['machine'])}. Date: {data['date']}. "
        f"Total run {data['total_wall_s']:.0f} s ("
        + ", ".join(f"{name} {part['wall_s']:.0f} s" for name, part in data["parts"].items())
        + ").", "",
        f"Measured: the step as `spmd run` times it (the wall time of "
        f"`jax.block_until_ready(step(model, optimizer, batch))` through `ParallelStep`), the "
        f"median of {steps} steps after one warm-up step. Executable: the compiled XLA "
        f"executable alone on already placed flat arrays, timed the same way in the same "
        f"rounds (the two alternate which goes first). Predicted: `plan.prediction.total_time` "
        f"on the mesh as profiled at the start of the part. A model's plans are compiled "
        f"first, then stepped in turns: each turn one untimed step (it refills the caches the "
        f"plan stepped before evicted; a training loop steps one plan back to back), then one "
        f"timed step of each. E/P: executable over predicted. Fresh MiB: the host memory a "
        f"measured step touched for the first time (minor page faults; the median). "
        f"{_allocator_line(data)} Spread: interquartile "
        f"range over median of the measured steps. Hand-written plans are scored with the "
        f"default `SearchOptions` and run as scored (with the sharding constraints of the "
        f"intermediates their score chose); `auto (= m)` is an auto plan that kept hand-written `m`.",
        "",
    ]
    lines += part_lines(data["parts"]["one-device"], "One device: cpu-1, auto plans "
                        f"(target {TARGET_RATIO[0]} <= M/P <= {TARGET_RATIO[1]})", True)
    lines += part_lines(data["parts"]["cpu-8"], "Ranking on cpu-8: 8 simulated devices "
                        f"(data=2 x model=4), every plan (target Spearman >= "
                        f"{TARGET_SPEARMAN})", False)
    grown = {m["model"]: f"{m['model']} is {m['zoo_model']} with " + ", ".join(
        f"{k}={v}" for k, v in m["config_overrides"].items())
        for p in data["parts"].values() for m in p.get("models", []) if m["config_overrides"]}
    lines += [*(f"{g}." for g in grown.values()), "On cpu-8 the simulated devices share the host's "
              "cores, so a step's time tracks the work of all 8.", "",
              "Findings (computed from this run):", "", *(f"- {n}" for n in findings(data))]
    return "\n".join(lines)


def save(data: dict[str, Any], out: Path | None, md: Path | None) -> None:
    """The JSON and the profiled mesh files beside it, and the RESULTS.md section (a path
    that is None: not written; with neither, the section is printed)."""
    if out is not None:
        common.write_json(data, out)
        for part in data["parts"].values():
            if "profile_yaml" in part:
                (out.parent / f"{part['mesh']}-profiled.yaml").write_text(part["profile_yaml"])
    if md is not None:
        common.replace_section(SECTION, render(data), md)
    if out is None and md is None:
        print(render(data))
    written = " and ".join(str(p) for p in (out, md) if p)
    print(f"wrote {written}" if written else "wrote nothing (--output, --results-md: where to)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run (about a minute): fewer models, {QUICK_STEPS} steps, "
                             f"quick profiles; writes only where told")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"timed steps per plan (default {DEFAULT_STEPS}, quick "
                             f"{QUICK_STEPS}), after one warm-up step")
    parser.add_argument("--report", type=Path, default=None, metavar="JSON",
                        help="only rewrite the section from this saved JSON")
    parser.add_argument("--allocator-default", action="store_true",
                        help="run the parts with glibc's default thresholds (then steps with "
                             "over 32 MiB of temporaries page-fault them afresh each step)")
    parser.add_argument("--worker", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    common.add_output_arguments(parser, "step_time")
    args = parser.parse_args(argv)
    steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    if args.worker:
        return worker(args.worker, args.quick, steps, args.result)
    out, md = common.outputs(args, "step_time")
    if args.report is not None:
        save(json.loads(args.report.read_text()), None, md or common.RESULTS_MD)
        return 0
    if args.quick:  # a smoke run leaves the committed results alone unless told
        out, md = args.output, args.results_md

    start = time.perf_counter()
    data: dict[str, Any] = {
        "command": common.command_line(argv=None if argv is None else
                                       ["bench/step_time.py", *argv]),
        "machine": common.machine(), "date": common.utc_date(), "quick": args.quick,
        "steps": steps, "keep_freed_memory": not args.allocator_default,
        "parts": {part: run_part(part, args.quick, steps, not args.allocator_default)
                  for part in PARTS},
    }
    data["total_wall_s"] = time.perf_counter() - start
    save(data, out, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
