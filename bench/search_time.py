"""How long planning takes: the search against model depth, and what comparing it with the
hand-written plans adds.

1. Depth: GPT (gpt-tiny's width) at 12, 24, 48 and 96 layers, planned on a virtual 2x4 mesh
   (the bundled cpu-8 mesh, ``virtual=True``) from the abstract model (``nnx.eval_shape``; nothing
   is allocated or compiled) with ``SearchOptions(cache=False, compare=False)``. Reported per
   depth: the phases the plan records itself (``Plan.search["timings"]``: tracing the step,
   building the op graph, pricing the cost graph, the search's request, solve and
   prediction), the graph before and after simplification, the solver status, and the
   growth of the whole ``spmd.plan`` call per doubling of depth.
   Targets: 24 layers in <= 10 s on 2 cores; no worse than linear growth (ratio <= 2 per
   doubling; 10% slack for a noisy shared machine).
2. Comparison: a 24-layer GPT of width 256 (adamw) on the virtual 2x4 A100 mesh
   (the bundled a100-8), planned with ``compare=False`` and with the default
   ``compare=True`` (every applicable hand-written plan scored on the search's cost graph),
   one after the other in one run. Target: the default at most 1.5x the ``compare=False``
   time.

    python bench/search_time.py                          # both
    python bench/search_time.py --layers 12,24 --time-limit 10 --no-compare

Each case runs in its own subprocess under a timeout (a crash or a hang is recorded with its
error text). Writes bench/results/search_time.json and the section
"## Search time vs depth (bench/search_time.py)" of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

try:  # run as a script (python bench/search_time.py): bench/ is on sys.path
    import common
except ImportError:  # python -m bench.search_time
    from bench import common

SECTION = "## Search time vs depth (bench/search_time.py)"
MESH = "cpu-8"
DEFAULT_LAYERS = (12, 24, 48, 96)
TARGET_LAYERS, TARGET_SECONDS = 24, 10.0
LINEAR_SLACK = 1.10  # growth per doubling must be <= 2 x this
#: the comparison case: a 24-layer GPT of width 256 on a virtual 2x4 A100 mesh
COMPARE_MESH = "a100-8"
COMPARE_WIDTH = dict(num_layers=24, d_model=256, num_heads=8, head_dim=32, d_ff=1024,
                     vocab_size=2048, seq_len=64)
COMPARE_BATCH = 16
COMPARE_TARGET = 1.5


def run_case(layers: int, time_limit: float | None, compare: bool, wide: bool) -> dict[str, Any]:
    """Plan one GPT once; the plan says where its time went."""
    import jax
    from flax import nnx

    from spmd import zoo
    import spmd
    from spmd.options import PipelineOptions

    mesh = spmd.load_mesh(COMPARE_MESH if wide else MESH, virtual=True)
    base = zoo.get("gpt-tiny")
    spec = base.with_config(**COMPARE_WIDTH) if wide else base.with_config(num_layers=layers)
    batch_size = COMPARE_BATCH if wide else spec.default_batch_size

    abstract_model, abstract_opt = nnx.eval_shape(spec.training_state)
    abstract_batch = jax.eval_shape(lambda: spec.batch(batch_size, 0))
    kwargs = {} if time_limit is None else {"time_limit": time_limit}
    options = spmd.SearchOptions(cache=False, compare=compare,
                                 pipeline=PipelineOptions(max_stages=1), **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        plan = spmd.plan(spec.train_step, abstract_model, abstract_opt, abstract_batch,
                         mesh=mesh, method="auto", options=options)
        total_s = time.perf_counter() - t0
    stats = dict(plan.search or {})
    return {
        "layers": spec.config.num_layers, "param_count": spec.param_count(),
        "batch_size": batch_size, "compare": compare, "wide": wide,
        "config": {k: getattr(spec.config, k) for k in spec.config.__dataclass_fields__},
        "mesh": COMPARE_MESH if wide else MESH, "time_limit": options.time_limit,
        "total_s": total_s, "stats": stats,
        # the planning phases, and the search's own split of its request, solve and predict
        "timings": {**stats.get("timings", {}), **stats.get("phases", {})},
        "warnings": sorted({str(w.message) for w in caught}),
        "prediction": plan.prediction.to_dict(),
        "alternatives": {k: v if isinstance(v, str) else v.to_dict()
                         for k, v in plan.alternatives.items()},
    }


def run_subprocess(layers: int, args, compare: bool = False, wide: bool = False) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        result_path = Path(fh.name)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(layers),
           "--result", str(result_path)] + (["--worker-compare"] if compare else []) + (
           ["--worker-wide"] if wide else [])
    if args.time_limit is not None:
        cmd += ["--time-limit", str(args.time_limit)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=common.REPO_ROOT, capture_output=True, text=True,
                              timeout=args.case_timeout)
        rc, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as err:
        rc = "timeout"
        stderr = err.stderr.decode() if isinstance(err.stderr, bytes) else (err.stderr or "")
    wall = time.perf_counter() - t0
    try:
        result = json.loads(result_path.read_text())
    except (OSError, ValueError):
        result = None
    finally:
        result_path.unlink(missing_ok=True)
    if result is None or "error" in result:
        err = (result or {}).get("error") or (
            f"timed out after {args.case_timeout:g} s" if rc == "timeout"
            else f"worker exited with {rc}")
        tail = "\n".join(stderr.strip().splitlines()[-25:])
        return {"layers": layers, "error": err,
                "traceback": (result or {}).get("traceback") or tail, "wall_s": wall}
    result["wall_s"] = wall
    return result


def _f(x: float | None, digits: int = 2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def growth(runs: list[dict[str, Any]]) -> None:
    """Adds ``growth`` (total time over the previous depth's, per doubling) to each run."""
    prev = None
    for r in runs:
        r["growth"] = None
        if "error" in r:
            prev = None
            continue
        if prev is not None and r["layers"] == 2 * prev["layers"] and prev["total_s"] > 0:
            r["growth"] = r["total_s"] / prev["total_s"]
        prev = r


#: the phases ``Plan.search["timings"]`` records, in the order they run
PHASES = [("trace", "trace"), ("graph", "graph"), ("cost graph", "cost_graph"),
          ("baselines", "baselines"), ("request", "request"), ("solve", "solve"),
          ("predict", "predict")]


def _other(r: dict[str, Any]) -> float:
    """Seconds of the plan call outside the recorded phases."""
    t = r["timings"]
    return r["total_s"] - sum(t.get(k, 0.0) for k in ("trace", "cache", "graph", "cost_graph",
                                                       "baselines", "search"))


def render(data: dict[str, Any]) -> str:
    headers = (["layers", "params", "total s", "x per doubling"]
               + [f"{name} s" for name, _ in PHASES if name != "baselines"] + ["other s"]
               + ["graph nodes", "graph ops", "solver nodes", "solver edges", "fan-outs",
                  "free nodes", "variables", "tied", "followers merged", "status"])
    rows, failures, notes = [], [], []
    for r in data["runs"]:
        if "error" in r:
            rows.append([r["layers"], "", "error"] + [""] * (len(headers) - 3))
            failures.append(f"- {r['layers']} layers: `{r['error']}`")
            continue
        t, st = r["timings"], r["stats"]
        rows.append([r["layers"], f"{r['param_count']:,}", _f(r["total_s"]),
                     "" if r["growth"] is None else f"{r['growth']:.2f}"]
                    + [_f(t.get(key)) for name, key in PHASES if name != "baselines"]
                    + [_f(_other(r))]
                    + [st.get(k, "") for k in ("graph_nodes", "graph_ops", "solver_nodes",
                                                "solver_edges", "fanouts", "free_nodes",
                                                "variables", "tied", "followers_merged",
                                                "status")])
        for w in r["warnings"]:
            notes.append(f"- {r['layers']} layers: warning: {w}")
    v = data["verdict"]
    lines = [
        f"Command: `{data['command']}`",
        "",
        f"Machine: {common.machine_line(data['machine'])}. Date: {data['date']}. Total run "
        f"{data['total_wall_s']:.0f} s.",
        "",
        f"Model: gpt-tiny's width (d_model {data['width']['d_model']}, {data['width']['num_heads']} "
        f"heads, d_ff {data['width']['d_ff']}, vocab {data['width']['vocab_size']}, seq "
        f"{data['width']['seq_len']}, batch {data['batch_size']}) at each depth, AdamW step, "
        f"abstract (`nnx.eval_shape`), planned on `{MESH}` loaded with `virtual=True` "
        f"(data=2 x model=4), `SearchOptions(cache=False, compare=False"
        + (f", time_limit={data['time_limit']:g}" if data["time_limit"] is not None else "")
        + ")`, one fresh process per depth. Nothing is compiled.",
        "",
        "Columns: total s is the whole `spmd.plan` call; the phases are what the plan records "
        "itself in `plan.search['timings']`: trace = the step's signature and `jax.make_jaxpr`, "
        "graph = `build_graph`, cost graph = strategies, costs, followers and ties "
        "(`spmd.search.costgraph`), request / solve / predict = the search's (solve: diffusion, "
        "local moves and, when the gap stays open, CP-SAT), other = the rest (warnings, the "
        "plan object). Graph columns are `plan.search`: graph_* before simplification, "
        "solver_* after (fan-outs: values read by several groups, resharded once per target; "
        "free nodes are those not tied to another layer's; variables = strategies over free "
        "nodes with a choice). x per doubling = total s over the previous depth's.",
        "",
        common.markdown_table(headers, rows, ["r"] * (len(headers) - 1) + ["l"]),
        "",
        f"Targets: {TARGET_LAYERS} layers in <= {TARGET_SECONDS:g} s: {v['target_time']}; "
        f"growth per doubling <= 2 (x{LINEAR_SLACK} slack): {v['linear']}.",
    ]
    if data.get("comparison"):
        lines += ["", *render_comparison(data["comparison"])]
    if failures:
        lines += ["", "Cases that failed:", "", *failures]
    if notes:
        lines += ["", "Notes:", "", *notes]
    return "\n".join(lines)


def render_comparison(cases: list[dict[str, Any]]) -> list[str]:
    """The comparison's overhead: compare=False and True side by side."""
    ok = [c for c in cases if "error" not in c]
    if len(ok) != 2:
        return ["Comparison overhead: " + "; ".join(c.get("error", "") for c in cases)]
    off, on = sorted(ok, key=lambda c: c["compare"])
    headers = ["compare", "total s"] + [f"{name} s" for name, _ in PHASES] + [
        "auto pred ms", "best hand-written pred ms"]
    rows = []
    for c in (off, on):
        scored = {k: v["total_time"] for k, v in c["alternatives"].items() if isinstance(v, dict)}
        best = min(scored.items(), key=lambda kv: kv[1]) if scored else None
        rows.append([str(c["compare"]), _f(c["total_s"])]
                    + [_f(c["timings"].get(key)) for _, key in PHASES]
                    + [f"{c['prediction']['total_time'] * 1e3:.4f}",
                       f"{best[1] * 1e3:.4f} ({best[0]})" if best else ""])
    ratio = on["total_s"] / off["total_s"]
    verdict = "PASS" if ratio <= COMPARE_TARGET else "FAIL"
    w = on["config"]
    return [
        f"Comparison overhead: GPT of {w['num_layers']} layers, width {w['d_model']} "
        f"({w['num_heads']} heads, d_ff {w['d_ff']}, vocab {w['vocab_size']}, seq "
        f"{w['seq_len']}, batch {on['batch_size']}, {on['param_count']:,} parameters), AdamW, "
        f"on `{on['mesh']}` (virtual 2x4 A100), planned with `compare=False` and then with "
        "the default `compare=True` (each applicable hand-written plan scored on the "
        "search's cost graph: baselines s), each in a fresh process of this run.",
        "",
        common.markdown_table(headers, rows, ["l"] + ["r"] * (len(headers) - 2) + ["l"]),
        "",
        f"Default over compare=False: {ratio:.2f}x; target <= {COMPARE_TARGET:g}x: {verdict}.",
    ]


def verdict(runs: list[dict[str, Any]]) -> dict[str, str]:
    target = next((r for r in runs if r["layers"] == TARGET_LAYERS), None)
    if target is None:
        t = "not measured"
    elif "error" in target:
        t = "FAIL (error)"
    else:
        t = ("PASS" if target["total_s"] <= TARGET_SECONDS else "FAIL") + \
            f" ({target['total_s']:.1f} s)"
    ratios = [(r["layers"], r["growth"]) for r in runs if r.get("growth") is not None]
    if not ratios:
        lin = "not measured"
    else:
        worst = max(g for _, g in ratios)
        lin = ("PASS" if worst <= 2 * LINEAR_SLACK else "FAIL") + " (" + ", ".join(
            f"{l // 2}->{l}: {g:.2f}x" for l, g in ratios) + ")"
    return {"target_time": t, "linear": lin}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default=",".join(map(str, DEFAULT_LAYERS)),
                        help="comma-separated depths (default 12,24,48,96)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="SearchOptions.time_limit (default: SearchOptions' own)")
    parser.add_argument("--no-compare", action="store_true",
                        help="skip the comparison-overhead case")
    parser.add_argument("--case-timeout", type=float, default=300.0,
                        help="seconds per case before it is recorded as timed out")
    common.add_output_arguments(parser, "search_time")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-compare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-wide", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker is not None:
        return common.run_worker(
            lambda: run_case(args.worker, args.time_limit, args.worker_compare, args.worker_wide),
            {"layers": args.worker}, args.result)

    depths = sorted(int(x) for x in args.layers.split(",") if x.strip())
    from spmd import zoo

    tiny = zoo.get("gpt-tiny")
    start = time.perf_counter()
    data: dict[str, Any] = {
        "command": common.command_line(argv=None if argv is None
                                       else ["bench/search_time.py", *argv]),
        "machine": common.machine(),
        "date": common.utc_date(),
        "mesh": MESH,
        "time_limit": args.time_limit,
        "width": {k: getattr(tiny.config, k) for k in
                  ("d_model", "num_heads", "head_dim", "d_ff", "vocab_size", "seq_len")},
        "batch_size": tiny.default_batch_size,
        "runs": [],
    }
    for layers in depths:
        r = run_subprocess(layers, args)
        data["runs"].append(r)
        if "error" in r:
            print(f"{layers:4d} layers: ERROR {r['error']} ({r['wall_s']:.0f} s)\n    "
                  + r["traceback"].replace("\n", "\n    "), flush=True)
            continue
        t = r["timings"]
        print(f"{layers:4d} layers: total {r['total_s']:7.2f} s ("
              + ", ".join(f"{name} {_f(t.get(key))}" for name, key in PHASES if key in t)
              + f") status {r['stats'].get('status')}", flush=True)
    if not args.no_compare:
        data["comparison"] = [run_subprocess(COMPARE_WIDTH["num_layers"], args, compare=c,
                                             wide=True) for c in (False, True)]
        for line in render_comparison(data["comparison"])[-1:]:
            print(line, flush=True)
    growth(data["runs"])
    data["verdict"] = verdict(data["runs"])
    data["total_wall_s"] = time.perf_counter() - start

    out, md = common.outputs(args, "search_time")
    common.write_json(data, out)
    if md is not None:
        common.replace_section(SECTION, render(data), md)
    print(f"{TARGET_LAYERS} layers <= {TARGET_SECONDS:g} s: {data['verdict']['target_time']}; "
          f"linear growth: {data['verdict']['linear']}")
    print(f"wrote {out}" + (f" and {md}" if md else "") + f" in {data['total_wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
