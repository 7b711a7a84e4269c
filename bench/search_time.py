"""How the sharding search scales with model depth: GPT (gpt-tiny's width) at 12, 24, 48 and
96 layers, planned on a virtual 2x4 mesh (meshes/cpu-8.yaml, ``virtual=True``) from the
abstract model (``nnx.eval_shape``; nothing is allocated or compiled).

    python bench/search_time.py                          # 12, 24, 48, 96 layers
    python bench/search_time.py --layers 12,24 --time-limit 10

Each depth runs in its own subprocess under a timeout (a crash or a hang is recorded with
its error text) with ``SearchOptions(cache=False, compare=False)``. Reported per depth: the
time split (tracing the step, building the graph, setting up the problem, the solver), the
graph before and after simplification (``Plan.search``: graph_nodes/edges, solver_nodes/
edges, free_nodes, variables, tied, ...), the solver status, and the growth ratio of the
whole ``spmd.plan`` call per doubling of depth.

Targets: 24 layers in <= 10 s on 2 cores; no worse than linear growth (ratio <= 2 per
doubling; 10% slack for a noisy shared machine).

Writes bench/results/search_time.json and the section
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
MESH = "meshes/cpu-8.yaml"
DEFAULT_LAYERS = (12, 24, 48, 96)
TARGET_LAYERS, TARGET_SECONDS = 24, 10.0
LINEAR_SLACK = 1.10  # growth per doubling must be <= 2 x this


class _Timers:
    """Wraps module functions to add up the time spent in them (restored on exit)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[tuple[Any, str, Any]] = []

    def _timed(self, fn: Any, label: str) -> Any:
        """``fn``, adding its calls and seconds to ``label``."""
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self.calls[label] += 1

        return timed

    def _replace(self, owner: Any, attr: str, label: str, make: Any) -> bool:
        fn = getattr(owner, attr, None)
        if fn is None or not callable(fn):
            return False
        self.seconds.setdefault(label, 0.0)
        self.calls.setdefault(label, 0)
        setattr(owner, attr, make(fn))
        self._undo.append((owner, attr, fn))
        return True

    def wrap(self, owner: Any, attr: str, label: str) -> bool:
        return self._replace(owner, attr, label, lambda fn: self._timed(fn, label))

    def wrap_factory(self, owner: Any, attr: str, label: str) -> bool:
        """Like wrap, for ``f(fn) -> callable`` (jax.make_jaxpr): times the returned callable."""
        return self._replace(owner, attr, label, lambda factory: lambda *a, **k:
                             self._timed(factory(*a, **k), label))

    def __enter__(self) -> "_Timers":
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)


def run_depth(layers: int, time_limit: float | None) -> dict[str, Any]:
    """Plan GPT with ``layers`` layers once, timing each phase."""
    import jax
    from flax import nnx

    import models
    import spmd
    import spmd.search.intra_op
    import spmd.search.costgraph
    import spmd.planner
    from spmd.planner import SearchOptions

    mesh = spmd.load_mesh(common.REPO_ROOT / MESH, virtual=True)
    spec = models.get("gpt-tiny").with_config(num_layers=layers)
    batch_size = spec.default_batch_size

    def create():
        net = spec.create(0)
        return net, spec.optimizer(net)

    t0 = time.perf_counter()
    abstract_model, abstract_opt = nnx.eval_shape(create)
    abstract_batch = jax.eval_shape(lambda: spec.batch(batch_size, 0))
    eval_shape_s = time.perf_counter() - t0
    kwargs = {} if time_limit is None else {"time_limit": time_limit}
    options = SearchOptions(cache=False, compare=False, **kwargs)

    with _Timers() as timers, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # jax.make_jaxpr as spmd.search calls it: the trace of the whole step
        timers.wrap_factory(jax, "make_jaxpr", "trace")
        # the op graph is built once, in spmd.search, before the search (and its scoring)
        timers.wrap(spmd.search, "build_graph", "graph_build")
        # _solve = the problem's solver request (p.request) + the solver call (solve)
        timers.wrap(getattr(spmd.problem, "Problem", None), "request", "request")
        timers.wrap(spmd.auto, "solve", "solve_call")
        t0 = time.perf_counter()
        plan = spmd.plan(spec.train_step, abstract_model, abstract_opt, abstract_batch,
                         mesh=mesh, method="auto", options=options)
        total_s = time.perf_counter() - t0
    stats = dict(plan.search or {})
    search_s = stats.get("search_seconds")
    split = {k: timers.seconds[k] for k in timers.seconds}
    # What the wrappers cannot see: the step's signature (flattening, classification) and the
    # cache key before the search, the problem set-up (strategies, costs, ties) inside it.
    if search_s is not None:
        split["outside_search"] = total_s - search_s
        if all(k in split for k in ("request", "solve_call")):
            split["problem_setup"] = (search_s - split["request"]
                                      - split["solve_call"])
    split["solver"] = stats.get("solve_seconds")
    return {
        "layers": layers, "param_count": spec.param_count(), "batch_size": batch_size,
        "config": {k: getattr(spec.config, k) for k in spec.config.__dataclass_fields__},
        "mesh": MESH, "time_limit": options.time_limit,
        "eval_shape_s": eval_shape_s, "total_s": total_s, "search_s": search_s,
        "split_s": split, "calls": dict(timers.calls), "stats": stats,
        "warnings": sorted({str(w.message) for w in caught}),
        "prediction": plan.prediction,
    }


def run_subprocess(layers: int, args) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        result_path = Path(fh.name)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(layers),
           "--result", str(result_path)]
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


def render(data: dict[str, Any]) -> str:
    headers = ["layers", "params", "total s", "x per doubling", "trace s", "graph s",
               "setup s", "request s", "solve s", "solver s", "other s", "graph nodes", "graph edges", "graph ops",
               "solver nodes", "solver edges", "free nodes", "variables", "tied",
               "followers merged", "status"]
    rows, failures, notes = [], [], []
    for r in data["runs"]:
        if "error" in r:
            rows.append([r["layers"], "", "error"] + [""] * (len(headers) - 3))
            failures.append(f"- {r['layers']} layers: `{r['error']}`")
            continue
        s, st = r["split_s"], r["stats"]
        rows.append([
            r["layers"], f"{r['param_count']:,}", _f(r["total_s"]),
            "" if r["growth"] is None else f"{r['growth']:.2f}",
            _f(s.get("trace")), _f(s.get("graph_build")), _f(s.get("problem_setup")),
            _f(s.get("request")), _f(s.get("solve_call")), _f(s.get("solver")),
            _f(None if s.get("outside_search") is None or s.get("trace") is None
               else s["outside_search"] - s["trace"] - s.get("graph_build", 0.0)),
            st.get("graph_nodes", ""), st.get("graph_edges", ""), st.get("graph_ops", ""),
            st.get("solver_nodes", ""), st.get("solver_edges", ""), st.get("free_nodes", ""),
            st.get("variables", ""), st.get("tied", ""), st.get("followers_merged", ""),
            st.get("status", ""),
        ])
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
        "Columns: total s is the whole `spmd.plan` call; the split: trace = `jax.make_jaxpr` "
        "of the step, graph = `spmd.graph.build_graph` (once, before the search), setup = the rest of the search "
        "(`spmd.problem.Problem`: strategies, costs, ties; stats), request = `Problem.request` (the "
        "solver's input: edge cost matrices, liveness), solve = `spmd.auto.solve` (model "
        "building and solving), of which solver = `plan.search['solve_seconds']`, other = "
        "the step's signature and the cache key. "
        "Graph columns are `plan.search`: graph_* before simplification, solver_* after "
        "(free nodes are those not tied to another layer's; variables = strategies over "
        "free nodes with a choice). x per doubling = total s over the previous depth's.",
        "",
        common.markdown_table(headers, rows, ["r"] * (len(headers) - 1) + ["l"]),
        "",
        f"Targets: {TARGET_LAYERS} layers in <= {TARGET_SECONDS:g} s: {v['target_time']}; "
        f"growth per doubling <= 2 (x{LINEAR_SLACK} slack): {v['linear']}.",
    ]
    if failures:
        lines += ["", "Depths that failed:", "", *failures]
    if notes:
        lines += ["", "Notes:", "", *notes]
    return "\n".join(lines)


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
    parser.add_argument("--case-timeout", type=float, default=300.0,
                        help="seconds per depth before it is recorded as timed out")
    common.add_output_arguments(parser, "search_time")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker is not None:
        return common.run_worker(lambda: run_depth(args.worker, args.time_limit),
                                 {"layers": args.worker}, args.result)

    depths = sorted(int(x) for x in args.layers.split(",") if x.strip())
    import models

    tiny = models.get("gpt-tiny")
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
        s, st = r["split_s"], r["stats"]
        print(f"{layers:4d} layers: total {r['total_s']:7.2f} s (trace {_f(s.get('trace'))}, "
              f"graph {_f(s.get('graph_build'))}, setup {_f(s.get('problem_setup'))}, request "
              f"{_f(s.get('request'))}, solve {_f(s.get('solve_call'))}, solver "
              f"{_f(s.get('solver'))}) graph {st.get('graph_nodes')}/{st.get('graph_edges')} "
              f"solver {st.get('solver_nodes')}/{st.get('solver_edges')} free "
              f"{st.get('free_nodes')} vars {st.get('variables')} tied {st.get('tied')} "
              f"status {st.get('status')}", flush=True)
        for w in r["warnings"]:
            print(f"      warning: {w}", flush=True)
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
