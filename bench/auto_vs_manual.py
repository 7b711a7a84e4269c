"""``method="auto"`` against every hand-written plan, model by model and mesh by mesh.

For each model x mesh this searches an auto plan (``SearchOptions(compare=True)``, so every
applicable hand-written plan is scored by the same cost model: ``Plan.alternatives``),
compiles the auto plan and every applicable hand-written plan, and reads what XLA emitted
(``spmd.analyze``: collective bytes and memory per device). On the 8-device CPU meshes
(1x8, 2x4, 8x1) the auto plan is also run for a few steps on 8 simulated CPU devices; the
16- and 64-device meshes (the bundled a100-2x8 and a100-8x8, virtual) are compiled
on as many simulated CPU devices but not run.

    python bench/auto_vs_manual.py                        # everything
    python bench/auto_vs_manual.py --models gpt-tiny,mlp-tiny --meshes 2x4,a100-2x8

Every case runs in its own subprocess (``XLA_FLAGS=--xla_force_host_platform_device_count=N``
must be set before jax starts), under a per-case timeout, so a crash or a hang in one case is
recorded with its error text and the others still run. ``--worker MODEL MESH`` runs one case
in-process and prints its JSON (what the driver calls).

Each case is ``spmd.analysis.verify.compare`` (plan, compile every plan, measure) judged by
``spmd.analysis.verify.judge`` against its ``CRITERIA`` (A: predicted time, B: HLO bytes at no
more memory, B strict, B comm: priced communication, C: predicted vs HLO bytes); this script
only picks the cases, runs each in its subprocess, runs auto's plan a few steps on the
8-device meshes, and renders the table.

Writes bench/results/auto_vs_manual.json and the section
"## Auto vs hand-written plans (bench/auto_vs_manual.py)" of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

try:  # run as a script (python bench/auto_vs_manual.py): bench/ is on sys.path
    import common
except ImportError:  # python -m bench.auto_vs_manual
    from bench import common

from spmd.analysis import verify
from spmd.options import PipelineOptions

SECTION = "## Auto vs hand-written plans (bench/auto_vs_manual.py)"

# Models: name -> (zoo model, config overrides, batch size). The GPT variants grow gpt-tiny in
# width and depth while still compiling in seconds on CPU.
MODELS: dict[str, tuple[str, dict[str, Any], int | None]] = {
    "gpt-tiny": ("gpt-tiny", {}, None),
    # the same as bench/manual_plans.py's gpt-bench (~3.4 M parameters)
    "gpt-bench": ("gpt-tiny", dict(num_layers=4, d_model=256, num_heads=8, head_dim=32,
                                   d_ff=1024, vocab_size=2048, seq_len=64), 16),
    # ~27 M parameters
    "gpt-wide": ("gpt-tiny", dict(num_layers=8, d_model=512, num_heads=8, head_dim=64,
                                  d_ff=2048, vocab_size=4096, seq_len=128), 16),
    # gpt-tiny with its 2 blocks stacked and applied by nnx.scan (the body is planned
    # once); not the zoo's gpt-tiny-scan, which scans 4 (a pipeline of 2 stages x 2 repeats)
    "gpt-tiny-scan2": ("gpt-tiny", dict(scan_layers=True), None),
    "moe-tiny": ("moe-tiny", {}, None),
    "wresnet-tiny": ("wresnet-tiny", {}, None),
    "mlp-tiny": ("mlp-tiny", {}, None),
    "mlp-small": ("mlp-small", {}, None),
    # a real size for the virtual GPU meshes (compiled, not run): its state (~21 GB with
    # AdamW) and activations make memory matter on 40 GB A100s (64 sequences fit no plan
    # without remat on 16 of them: the search says it needs 63.7 GiB per device)
    "gpt-1.3b": ("gpt-1.3b", {}, 16),
}

# Link figures of the bundled cpu-8 mesh (spmd/meshes/cpu-8.yaml), for the 8-device meshes built in code.
CPU_BANDWIDTH, CPU_LATENCY = 10.0e9, 10.0e-6
# Mesh name -> (devices, how to build it). "file:" meshes are loaded (virtual ones with
# virtual=True: compiled on as many CPU devices, not run).
MESHES: dict[str, tuple[int, str, bool]] = {
    "1x8": (8, "make:1,8", True),
    "2x4": (8, "file:cpu-8", True),
    "8x1": (8, "make:8,1", True),
    "a100-2x8": (16, "file:a100-2x8", False),
    "a100-8x8": (64, "file:a100-8x8", False),
}
#: gpt-1.3b only on the virtual meshes (--models gpt-1.3b --meshes a100-2x8,a100-8x8): run on
#: 8 simulated CPU devices its replicated state alone would need 8 x 21 GB
DEFAULT_MODELS = [m for m in MODELS if m != "gpt-1.3b"]
DEFAULT_MESHES = list(MESHES)


# ------------------------------------------------------------------------------ one case


def _build_mesh(name: str):
    import spmd

    devices, how, runnable = MESHES[name]
    if how.startswith("make:"):
        d, m = (int(x) for x in how[5:].split(","))
        return spmd.make_mesh({"data": d, "model": m}, bandwidth=CPU_BANDWIDTH,
                              latency=CPU_LATENCY, device="cpu", platform="cpu",
                              name=f"cpu-{d}x{m}")
    return spmd.load_mesh(how[5:], virtual=not runnable)


def _get_model(name: str):
    from spmd import zoo

    base, overrides, batch = MODELS[name]
    spec = zoo.get(base)
    if overrides:
        spec = spec.with_config(**overrides)
    return spec, batch or spec.default_batch_size, overrides


def run_case(model_name: str, mesh_name: str, time_limit: float, steps: int) -> dict[str, Any]:
    """Plan, compile and judge one model on one mesh (``spmd.analysis.verify.compare``), and on
    the 8-device meshes run auto's plan a few steps; JSON-ready numbers."""
    import jax
    import numpy as np
    from flax import nnx

    import spmd
    from spmd.analysis import verify

    devices, _, runnable = MESHES[mesh_name]
    mesh = _build_mesh(mesh_name)
    assert len(jax.devices("cpu")) >= devices, (len(jax.devices("cpu")), devices)
    spec, batch_size, overrides = _get_model(model_name)
    out: dict[str, Any] = {
        "model": model_name, "zoo_model": spec.name, "config_overrides": overrides,
        "batch_size": batch_size, "param_count": spec.param_count(),
        "mesh": mesh_name, "mesh_shape": mesh.shape, "devices": devices,
        "mesh_describe": mesh.describe(), "run": runnable, "time_limit": time_limit,
    }

    args = (*nnx.eval_shape(spec.training_state), jax.eval_shape(lambda: spec.batch(batch_size, 0)))
    # Hand-written plans scored as accurately as the search itself (CP-SAT refining each,
    # up to the same limit): the criteria compare auto with the best of them.
    options = spmd.SearchOptions(time_limit=time_limit, compare=True, cache=False,
                                 pipeline=PipelineOptions(max_stages=1),
                                 score_refine=True, score_time_limit=time_limit)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = spmd.plan(spec.train_step, *args, mesh=mesh, method="auto", options=options)
        out.update(verify.compare(spec.train_step, *args, mesh=mesh, auto=plan))
    out["warnings"] = sorted({str(w.message) for w in caught})
    if runnable:  # the auto plan, run a few steps on the 8 simulated devices
        step = spmd.ParallelStep.from_plan(plan)
        net, opt = spmd.materialize(spec.training_state, plan)
        batch = spmd.shard_batch(plan, spmd.process_local_batch(plan, spec.batch(batch_size, 0)))
        losses, times = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            metrics = step(net, opt, batch)
            losses.append(float(np.asarray(jax.device_get(metrics["loss"]))))
            times.append(time.perf_counter() - t0)
        out["auto_losses"], out["auto_step_s"] = losses, times
    return out


# ------------------------------------------------------------------------------ driver


def _mib(n: float | None) -> str:
    return "" if n is None else f"{n / common.MiB:.3f}"


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def run_worker_subprocess(model: str, mesh: str, args) -> dict[str, Any]:
    """One case in a fresh process with the right CPU device count; errors become records."""
    devices = MESHES[mesh][0]
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        result_path = fh.name
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", model, mesh,
           "--time-limit", str(args.time_limit), "--steps", str(args.steps),
           "--result", result_path]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=common.REPO_ROOT, capture_output=True,
                              text=True, timeout=args.case_timeout)
        rc, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as err:
        rc, stderr = "timeout", (err.stderr or b"").decode() if isinstance(err.stderr, bytes) \
            else (err.stderr or "")
    wall = time.perf_counter() - t0
    try:
        case = json.loads(Path(result_path).read_text())
    except (OSError, ValueError):
        case = None
    finally:
        Path(result_path).unlink(missing_ok=True)
    if case is None or "error" in case:
        err = (case or {}).get("error") or (
            f"case timed out after {args.case_timeout} s" if rc == "timeout"
            else f"worker exited with {rc}")
        tail = "\n".join(stderr.strip().splitlines()[-25:])
        return {"model": model, "mesh": mesh, "devices": devices, "error": err,
                "traceback": (case or {}).get("traceback") or tail, "wall_s": wall}
    case["wall_s"] = wall
    return case


def render(data: dict[str, Any]) -> str:
    headers = ["model", "mesh", "auto pred ms", "best manual pred ms (name)", "auto HLO MiB",
               "best manual HLO MiB (name)", "ratio", "auto mem MiB", "manual mem MiB",
               "pred/HLO bytes", "auto HLO comm ms", "least manual HLO comm ms (name)",
               "search s", "plan s", "A pred", "B bytes", "C model", "B strict", "B comm",
               "dominated by"]
    rows, failures, notes = [], [], []
    for case in data["cases"]:
        if "error" in case:
            rows.append([case["model"], case["mesh"], "error"] + [""] * (len(headers) - 3))
            failures.append(f"- {case['model']} on {case['mesh']}: `{case['error']}`")
            continue
        s = case["summary"]
        bmp = s["best_manual_pred"]
        bmh = s["best_manual_hlo"]
        ratio = (s["auto_hlo_bytes"] / bmh[1]) if bmh and bmh[1] else None
        rows.append([
            case["model"], case["mesh"], f"{s['auto_pred_s'] * 1e3:.3f}",
            f"{bmp[1] * 1e3:.3f} ({bmp[0]})" if bmp else "none scored",
            _mib(s["auto_hlo_bytes"]),
            f"{_mib(bmh[1])} ({bmh[0]})" if bmh else "none compiled",
            "" if ratio is None else f"{ratio:.2f}",
            _mib(s["auto_peak"]), _mib(bmh[2]) if bmh else "",
            f"{s['pred_over_hlo']:.2f}",
            "" if s.get("auto_hlo_comm_s") is None else f"{s['auto_hlo_comm_s'] * 1e3:.3f}",
            "" if not s.get("best_manual_hlo_comm") else
            f"{s['best_manual_hlo_comm'][1] * 1e3:.3f} ({s['best_manual_hlo_comm'][0]})",
            f"{case['search'].get('search_seconds', 0):.1f}",
            f"{case['plan_s']:.1f}", _mark(s["A"]), _mark(s["B"]), _mark(s["C"]),
            _mark(s.get("B_strict")), _mark(s.get("B_comm")),
            ", ".join(s.get("dominated_by") or []),
        ])
        if s.get("replicated_manual"):
            notes.append(f"- {case['model']} on {case['mesh']}: left out of the bytes "
                         f"comparison, as they split nothing on this mesh (every device runs the "
                         f"whole step, no collectives): {', '.join(s['replicated_manual'])}")
        by_reason: dict[str, list[str]] = {}
        for k, v in s["not_scored"].items():
            by_reason.setdefault(v.removeprefix("not scored: "), []).append(k)
        for reason, names in by_reason.items():
            notes.append(f"- {case['model']} on {case['mesh']}: not scored by the cost model: "
                         f"{', '.join(names)} ({reason})")
        if s["manual_errors"]:
            notes.append(f"- {case['model']} on {case['mesh']}: hand-written plans that failed "
                         f"to compile: " + "; ".join(f"{k} ({v})" for k, v in
                                                     s["manual_errors"].items()))
        for w in case.get("warnings", []):
            if "cannot split anything" in w:  # 1x8 and 8x1 have a size-1 axis by design
                continue
            notes.append(f"- {case['model']} on {case['mesh']}: warning: {w}")
        if case.get("auto_losses") and not all(math.isfinite(x) for x in case["auto_losses"]):
            notes.append(f"- {case['model']} on {case['mesh']}: non-finite loss {case['auto_losses']}")
    ok = [c for c in data["cases"] if "error" not in c]
    counts = {k: (sum(1 for c in ok if c["summary"].get(k)),
                  sum(1 for c in ok if c["summary"].get(k) is not None))
              for k in ("A", "B", "C", "B_strict", "B_comm")}
    commands = data["command"] if isinstance(data["command"], list) else [data["command"]]
    align = ["l", "l", "r", "l", "r", "l"] + ["r"] * 5 + ["l"] + ["r"] * 7 + ["l"]
    lines = [
        "Command: " + "; then ".join(f"`{c}`" for c in commands)
        + (" (each later run's cases added with `--append`)" if len(commands) > 1 else ""),
        "",
        f"Machine: {common.machine_line(data['machine'])}. Date: {data['date']}. "
        f"Solver time limit {data['time_limit']:g} s per solve (the search, and each "
        f"hand-written plan's score, refined by CP-SAT: `score_refine=True`); total run "
        f"{data['total_wall_s']:.0f} s.",
        "",
        "Meshes: `1x8`, `2x4`, `8x1` are data x model on 8 simulated CPU devices with the link "
        "figures of `spmd/meshes/cpu-8.yaml` (`2x4` is that file); auto's plan is compiled and run "
        f"({data['steps']} steps). `a100-2x8` (16 devices) and `a100-8x8` (64) are the mesh "
        "files loaded with `virtual=True`: planned with A100 figures, compiled on as many "
        "simulated CPU devices, not run. Hand-written plans are compiled, not run.",
        "",
        "Columns: predicted ms is the cost model's step time (`Plan.prediction` / "
        "`Plan.alternatives`, the best scored hand-written plan in brackets); HLO MiB is the "
        "per-device collective bytes of the optimized HLO (`spmd.analyze`, per execution: a "
        "loop's collectives times its trip count), the "
        "hand-written plan with the fewest in brackets, `ratio` = auto / that plan; mem is the "
        "per-device memory of the compiled step, arguments + temporaries from XLA's "
        "`memory_analysis` (manual: of that same plan; XLA's own peak on CPU leaves "
        "temporaries out, see the hand-written plans section); pred/HLO is auto's predicted "
        "collective bytes over its measured ones; HLO comm ms is a compiled program's "
        "collectives priced by the same cost model, each alone (`Report.comm_time`: the plans "
        "as XLA runs them, on the predictions' scale; an upper bound where XLA combines "
        "collectives), the hand-written plan with the least in brackets; search s is the "
        "search alone "
        "(`plan.search['search_seconds']`), plan s the planning phases the plan records "
        "(`plan.search['timings']`: tracing, the op graph, the cost graph, scoring every "
        "hand-written plan, the search).",
        "",
        "Criteria: A pred = auto predicted time <= best hand-written predicted time; B bytes = "
        "auto HLO bytes <= 1.05 x those of the best hand-written plan at no more memory per "
        "device (the fewest bytes among hand-written plans needing no more memory than auto; "
        "it fails when a plan in `dominated by` beats auto on both, and holds when none needs "
        "as little memory); C model = predicted bytes within 10% of HLO bytes. B strict, the "
        "stricter reading: auto HLO bytes <= 1.05 x the fewest of any hand-written plan *and* "
        "memory <= that plan's (+1%), whatever its speed (it fails wherever auto's plan "
        "trades memory or bytes for predicted time, e.g. replicating a tiny model on 16 GPUs). "
        "B comm, B with time for bytes: auto's HLO comm ms <= 1.05 x the least of the "
        "hand-written plans needing no more memory (bytes over NVLink and over InfiniBand "
        "are not worth the same). "
        f"Passed: A {counts['A'][0]}/{counts['A'][1]}, B {counts['B'][0]}/{counts['B'][1]}, "
        f"C {counts['C'][0]}/{counts['C'][1]}; B strict {counts['B_strict'][0]}/"
        f"{counts['B_strict'][1]}; B comm {counts['B_comm'][0]}/{counts['B_comm'][1]}"
        + (f"; {len(failures)} case(s) failed to run" if failures else "") + "."
        + ("" if data.get("complete", True) else
           f" **Partial run: {len(data['cases'])} of {data.get('planned_cases', '?')} cases.**"),
        "",
        common.markdown_table(headers, rows, align),
    ]
    lines += ["", "Models:", ""]
    seen = set()
    for case in data["cases"]:
        if "error" in case or case["model"] in seen:
            continue
        seen.add(case["model"])
        over = case["config_overrides"]
        lines.append(f"- {case['model']}: {case['zoo_model']}"
                     + (f" with {', '.join(f'{k}={v}' for k, v in over.items())}" if over else "")
                     + f", batch {case['batch_size']}, {case['param_count']:,} parameters")
    if failures:
        lines += ["", "Cases that failed:", "", *failures]
    if notes:
        lines += ["", "Notes:", "", *notes]
    lines += ["", "Each mesh is priced with its own platform's collectives. On the CPU meshes "
              "XLA:CPU all-reduces and slices where XLA:GPU reduce-scatters, and runs a "
              "combined all-reduce one rendezvous per operand, so each operand pays a latency "
              "(bytes are then not the whole cost: B comm prices them). The A100 meshes are "
              "priced with XLA:GPU's collectives (reduce-scatters; one latency per combined "
              "group) and their CPU compile is read back as XLA:GPU's "
              "(`spmd.analysis.reconcile`) before its bytes are compared."]
    return "\n".join(lines)


def print_row(case: dict[str, Any]) -> None:
    if "error" in case:
        print(f"  {case['model']:13s} {case['mesh']:9s} ERROR {case['error']} "
              f"({case['wall_s']:.0f} s)\n    " + case["traceback"].replace("\n", "\n    "),
              flush=True)
        return
    s = case["summary"]
    bmp, bmh = s["best_manual_pred"], s["best_manual_hlo"]
    print(f"  {case['model']:13s} {case['mesh']:9s} pred {s['auto_pred_s'] * 1e3:8.3f} ms vs "
          + (f"{bmp[1] * 1e3:8.3f} ({bmp[0]})" if bmp else "none scored") +
          f" | HLO {_mib(s['auto_hlo_bytes'])} MiB vs "
          + (f"{_mib(bmh[1])} ({bmh[0]})" if bmh else "none") +
          f" | mem {_mib(s['auto_peak'])} vs {_mib(bmh[2]) if bmh else ''} MiB"
          f" | pred/HLO {s['pred_over_hlo']:.2f} | search {case['search'].get('search_seconds', 0):.1f} s"
          f" plan {case['plan_s']:.1f} s | A {_mark(s['A'])} B {_mark(s['B'])} C {_mark(s['C'])}"
          f" ({case['wall_s']:.0f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help="comma-separated, from: " + ", ".join(MODELS))
    parser.add_argument("--meshes", default=",".join(DEFAULT_MESHES),
                        help="comma-separated, from: " + ", ".join(MESHES))
    parser.add_argument("--time-limit", type=float, default=20.0,
                        help="SearchOptions.time_limit: seconds per solve (default 20)")
    parser.add_argument("--steps", type=int, default=3, help="steps run on 8-device meshes")
    parser.add_argument("--case-timeout", type=float, default=600.0,
                        help="seconds per model x mesh before it is recorded as timed out")
    common.add_output_arguments(parser, "auto_vs_manual")
    parser.add_argument("--rerender", type=Path, default=None, metavar="JSON",
                        help="recompute the criteria and the RESULTS.md section from a JSON "
                             "this script wrote, without running anything")
    parser.add_argument("--append", type=Path, default=None, metavar="JSON",
                        help="add this run's cases to a JSON this script wrote (replacing "
                             "any of the same model and mesh) and render both together")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "MESH"), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        model, mesh = args.worker
        return common.run_worker(lambda: run_case(model, mesh, args.time_limit, args.steps),
                                 {"model": model, "mesh": mesh}, args.result)

    if args.rerender:
        data = json.loads(args.rerender.read_text())
        for case in data["cases"]:
            if "error" not in case:
                case["summary"] = verify.judge(case)
        data["criteria"] = verify.CRITERIA
        out, md = common.outputs(args, "auto_vs_manual", default_json=args.rerender)
        common.write_json(data, out)
        if md is not None:
            common.replace_section(SECTION, render(data), md)
        for case in data["cases"]:
            print_row(case)
        print(f"rewrote {out}" + (f" and {md}" if md else ""))
        return 0

    model_names = [m.strip() for m in args.models.split(",") if m.strip()]
    mesh_names = [m.strip() for m in args.meshes.split(",") if m.strip()]
    for what, names, table in (("model", model_names, MODELS), ("mesh", mesh_names, MESHES)):
        unknown = [n for n in names if n not in table]
        if unknown:
            parser.error(f"unknown {what}(s) {unknown}; valid: {', '.join(table)}")

    start = time.perf_counter()
    data: dict[str, Any] = {
        "command": common.command_line(argv=None if argv is None
                                       else ["bench/auto_vs_manual.py", *argv]),
        "machine": common.machine(),
        "date": common.utc_date(),
        "time_limit": args.time_limit,
        "steps": args.steps,
        "criteria": verify.CRITERIA,
        "planned_cases": len(model_names) * len(mesh_names),
        "cases": [],
    }
    earlier = {"cases": [], "command": [], "total_wall_s": 0.0}
    if args.append:
        earlier = json.loads(args.append.read_text())
        if earlier.get("time_limit") != args.time_limit:
            parser.error(f"--append {args.append}: its runs used --time-limit "
                         f"{earlier.get('time_limit')}, this one {args.time_limit:g}; one "
                         f"table needs one limit")
        rerun = {(m, h) for m in model_names for h in mesh_names}
        earlier["cases"] = [c for c in earlier["cases"] if (c["model"], c["mesh"]) not in rerun]
        commands = earlier["command"]
        data["command"] = [*(commands if isinstance(commands, list) else [commands]),
                           data["command"]]
        data["planned_cases"] += len(earlier["cases"])
    print(f"{len(model_names)} models x {len(mesh_names)} meshes, solver limit "
          f"{args.time_limit:g} s", flush=True)
    out, md = common.outputs(args, "auto_vs_manual", default_json=args.append)
    data["cases"] = list(earlier["cases"])
    for mesh in mesh_names:
        for model in model_names:
            case = run_worker_subprocess(model, mesh, args)
            if "error" not in case:
                case["summary"] = verify.judge(case)
            data["cases"].append(case)
            print_row(case)
            # after every case, so an interrupted run keeps what it measured
            data["total_wall_s"] = earlier["total_wall_s"] + time.perf_counter() - start
            data["complete"] = len(data["cases"]) == data["planned_cases"]
            common.write_json(data, out)
            if md is not None:
                common.replace_section(SECTION, render(data), md)
    ok = [c for c in data["cases"] if "error" not in c]
    for k in "ABC":
        bad = [f"{c['model']}@{c['mesh']}" for c in ok if c["summary"][k] is False]
        print(f"criterion {k}: {'all pass' if not bad else 'FAIL on ' + ', '.join(bad)}")
    errs = [f"{c['model']}@{c['mesh']}" for c in data["cases"] if "error" in c]
    if errs:
        print("errors: " + ", ".join(errs))
    print(f"wrote {out}" + (f" and {md}" if md else "") + f" in {data['total_wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
