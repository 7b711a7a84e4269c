"""Two-level plans (issue 15): pipeline stages found by the stage search beside the
single-stage auto plan and the hand-written pipeline plans, predicted step time, for GPTs
on virtual A100 clusters (nothing materialized; planned on this CPU box).

    python bench/two_level.py          # gpt-2.6b, 6.7b, 13b on a100-2x8, a100-8x8, a100-8x8-eth
    python bench/two_level.py --models gpt-2.6b --meshes a100-2x8
    python bench/two_level.py --report bench/results/two_level.json   # render again

For each case: auto at one level (``PipelineOptions(max_stages=1)``: the intra-op search
with remat where memory needs it), auto at two levels forced to >= 2 stages (the stage
search), and ``pp_dp``, ``pp_tp``, ``pp_fsdp`` with their stages along the host axis
(``data``: one stage per host, 2x the stages microbatches). The two-level auto plan is the
faster of the first two (``spmd.plan``'s choice). Each case runs in a subprocess of its own
with a time limit.

Writes bench/results/two_level.json and the section "## Two-level plans
(bench/two_level.py)" of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any

try:  # run as a script (python bench/two_level.py): bench/ is on sys.path
    import common
except ImportError:  # python -m bench.two_level
    from bench import common

SECTION = "## Two-level plans (bench/two_level.py)"
MODELS = ["gpt-2.6b", "gpt-6.7b", "gpt-13b"]
MESHES = ["a100-2x8", "a100-8x8", "a100-8x8-eth"]
#: global batch (sequences of 1024 tokens) per mesh: 2 per GPU
BATCH = {"a100-2x8": 32, "a100-8x8": 128, "a100-8x8-eth": 128}
HAND_WRITTEN = ["pp_dp", "pp_tp", "pp_fsdp"]


def _timed(fn) -> tuple[Any, float]:
    start = time.perf_counter()
    return fn(), time.perf_counter() - start


def compile_stage(plan, stage: int = 0) -> dict[str, Any]:
    """Stage ``stage``'s forward, backward and update programs compiled on as many
    simulated CPU devices (shapes only), their collectives read as the mesh's platform
    emits them, beside the prediction for them."""
    import jax

    import spmd
    from spmd.runtime.compile import jit_region

    st = plan.stages[stage]
    out = {}
    for phase, region_plan in st.cost.plans.items():
        avals = [jax.ShapeDtypeStruct(i.shape, i.dtype) for i in region_plan.inputs]
        start = time.perf_counter()
        compiled = jit_region(region_plan, st.mesh).lower(*avals).compile()
        report = spmd.analyze(compiled).on_platform(st.mesh.platform)
        out[phase] = {"seconds": time.perf_counter() - start,
                      "compiled_bytes": sum(b for _, b in report.collectives.values()),
                      "predicted_bytes": region_plan.prediction.collective_bytes,
                      "compiled": {k: list(v) for k, v in report.collectives.items()},
                      "predicted": {k: list(v)
                                    for k, v in region_plan.prediction.collectives.items()}}
    return out


def run_case(model: str, mesh_name: str, time_limit: float, compile_it: bool
             ) -> dict[str, Any]:
    import jax
    from flax import nnx

    import spmd
    from spmd import zoo
    from spmd.options import PipelineOptions
    from spmd.stages.auto import plan_two_level
    from spmd.trace.signature import StepSignature

    spec = zoo.get(model)
    mesh = spmd.load_mesh(mesh_name, virtual=True)
    batch = BATCH[mesh_name]
    args = (*nnx.eval_shape(spec.training_state), jax.eval_shape(lambda: spec.batch(batch, 0)))
    tokens = spec.items_per_batch(batch)
    out: dict[str, Any] = {"model": model, "mesh": mesh_name, "batch": batch,
                           "tokens_per_step": tokens}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            single, seconds = _timed(lambda: spmd.plan(
                spec.train_step, *args, mesh=mesh, options=spmd.SearchOptions(
                    cache=False, time_limit=time_limit,
                    pipeline=PipelineOptions(max_stages=1))))
            out["single"] = {"time": single.prediction.total_time,
                             "memory": single.prediction.memory_bytes, "seconds": seconds,
                             "remat": single.remat.summary() if single.remat else "none"}
        except spmd.SpmdError as err:
            out["single"] = {"error": str(err)}
        full = StepSignature(spec.train_step, args)
        try:
            staged, seconds = _timed(lambda: plan_two_level(
                full, args, mesh, spmd.SearchOptions(cache=False, time_limit=time_limit,
                                                     pipeline=PipelineOptions(min_stages=2))))
            pred = staged.prediction
            out["staged"] = {
                "time": pred.total_time, "memory": pred.memory_bytes, "seconds": seconds,
                "stages": [(st.start, st.stop) for st in staged.stages],
                "devices_per_stage": staged.stages[0].mesh.size,
                "microbatches": staged.microbatches, "bubble": pred.bubble_fraction,
                "recompute": [st.cost.recompute for st in staged.stages],
                "layers": staged.num_layers, "search": staged.search}
            if compile_it:
                out["staged"]["compiled_stage_0"] = compile_stage(staged)
        except spmd.SpmdError as err:
            out["staged"] = {"error": str(err)}
        for method in HAND_WRITTEN:
            try:
                plan, seconds = _timed(lambda: spmd.plan(
                    spec.train_step, *args, mesh=mesh, method=method,
                    options=spmd.SearchOptions(cache=False, time_limit=time_limit,
                                               pipeline=PipelineOptions(stage_axis="data"))))
                fits = plan.prediction.memory_bytes <= mesh.device.memory_bytes
                out[method] = {"time": plan.prediction.total_time,
                               "memory": plan.prediction.memory_bytes, "fits": fits,
                               "microbatches": plan.microbatches, "seconds": seconds,
                               "recompute": [st.cost.recompute for st in plan.stages]}
            except spmd.SpmdError as err:
                out[method] = {"error": str(err)}
    return out


def _ms(entry: dict | None) -> str:
    """A plan's predicted ms, with how many of its stages recompute and whether it fits."""
    if not entry or "time" not in entry:
        return "n/a" if not entry else "error (below)"
    redone = sum(entry.get("recompute") or ())
    notes = ([f"{redone} recompute"] if redone else []) + (
        [] if entry.get("fits", True) else ["over memory"])
    return f"{entry['time'] * 1e3:.1f}" + (f" ({', '.join(notes)})" if notes else "")


def render(data: dict[str, Any]) -> str:
    rows, notes = [], []
    for case in data["cases"]:
        if "error" in case:
            rows.append([case["model"], case["mesh"], *["error"] * 8])
            notes.append(f"- {case['model']} on {case['mesh']}: {case['error']}")
            continue
        single, staged = case.get("single", {}), case.get("staged", {})
        hand = {m: case.get(m) for m in HAND_WRITTEN}
        # what spmd.plan returns: the fastest of the single-stage plan, the stage search's
        # and the hand-written pipelines that fit (its keep-the-best guard)
        candidates = {"intra-only": single.get("time"), "stage search": staged.get("time"),
                      **{m: h["time"] for m, h in hand.items()
                         if h and "time" in h and h["fits"]}}
        candidates = {k: t for k, t in candidates.items() if t is not None}
        chosen = min(candidates, key=candidates.get) if candidates else None
        auto = candidates.get(chosen)
        two_level = [t for k, t in candidates.items() if k != "intra-only"]
        ratio = (f"{single['time'] / min(two_level):.2f}" if "time" in single and two_level
                 else "n/a")
        shape = (f"{len(staged['stages'])} x {staged['devices_per_stage']} dev, "
                 f"B={staged['microbatches']}, bubble {staged['bubble']:.0%}"
                 if "stages" in staged else "")
        ok = auto is not None and all(auto <= t * (1 + 1e-9) for t in candidates.values())
        rows.append([case["model"], case["mesh"], _ms(single), _ms(staged), shape,
                     *[_ms(hand[m]) for m in HAND_WRITTEN],
                     f"{auto * 1e3:.1f} ({chosen})" if auto is not None else "n/a", ratio,
                     "PASS" if ok else "FAIL",
                     f"{staged.get('seconds', 0):.0f} s, "
                     f"{(staged.get('search') or {}).get('region_searches', 0)} solves"])
        for key in ("single", "staged", *HAND_WRITTEN):
            if case.get(key, {}).get("error"):
                notes.append(f"- {case['model']} on {case['mesh']}, {key}: "
                             f"{case[key]['error']}")
    checks = []
    for case in data["cases"]:
        compiled = (case.get("staged") or {}).get("compiled_stage_0")
        for phase, c in (compiled or {}).items():
            ratio = (c["compiled_bytes"] / c["predicted_bytes"] if c["predicted_bytes"]
                     else (1.0 if not c["compiled_bytes"] else float("inf")))
            checks.append([case["model"], case["mesh"], phase,
                           f"{c['predicted_bytes'] / 2**20:.1f}",
                           f"{c['compiled_bytes'] / 2**20:.1f}", f"{ratio:.3f}",
                           "PASS" if abs(ratio - 1) <= 0.10 else "FAIL",
                           f"{c['seconds']:.0f}"])
    headers = ["model", "mesh", "intra-only ms", "stage search (>= 2 stages) ms", "stages",
               *[f"{m} ms" for m in HAND_WRITTEN], "auto ms (its plan)",
               "intra / best two-level", "auto <= each", "stage search"]
    lines = [f"Command: `{data['command']}`", "",
             f"Machine: {common.machine_line(data['machine'])}. Date: {data['date']}.", "",
             "Predicted step time (cost model, A100 datasheet figures; virtual meshes, nothing "
             "run). Global batch: " + ", ".join(f"{k} {v}" for k, v in BATCH.items())
             + " sequences of 1024 tokens, fp32. Intra-only: auto with "
             "`PipelineOptions(max_stages=1)` (remat and host offload where memory needs "
             "them). Stage search: `plan_two_level` forced to >= 2 stages. Hand-written: stages "
             "along `data` (one per host), 2 x stages microbatches, stages recomputing where "
             "over memory. '(k recompute)': stages that recompute their forward pass in "
             "their backward task, where they would not fit otherwise; '(over memory)' "
             "marks a plan over 40 GB per GPU even so. auto: what `spmd.plan` "
             "returns, the fastest of the intra-only plan, the stage search's and the "
             "hand-written pipelines that fit (its keep-the-best guard), and which it is. "
             "'intra / best two-level': the intra-only time over the best pipeline's. "
             "'stage search': its seconds and intra-op solves.", "",
             common.markdown_table(headers, rows), ""]
    if checks:
        lines += ["Stage 0 of each two-level plan compiled on 8 simulated CPU devices (shapes "
                  "only), its collectives read as XLA:GPU emits them, beside the prediction "
                  "for that stage's programs (within 10%):", "",
                  common.markdown_table(["model", "mesh", "program", "predicted MiB",
                                         "compiled MiB", "ratio", "within 10%", "compile s"],
                                        checks), ""]
    if notes:
        lines += ["Errors:", "", *notes, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_grid_arguments(parser, "two_level", MODELS, MESHES)
    parser.add_argument("--time-limit", type=float, default=5.0,
                        help="seconds per intra-op search")
    parser.add_argument("--compile-on", default="a100-2x8",
                        help="meshes whose cases compile stage 0's programs (comma-separated)")
    parser.add_argument("--compile-stage", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    def extra(model: str, mesh: str) -> list[str]:
        return ["--time-limit", str(args.time_limit)] + (
            ["--compile-stage"] if mesh in args.compile_on.split(",") else [])

    return common.grid_main(
        args, argv, "bench/two_level.py", "two_level", SECTION, render,
        lambda mesh: 8,  # a stage of 8 GPUs compiles on 8
        lambda model, mesh: run_case(model, mesh, args.time_limit, args.compile_stage), extra)

if __name__ == "__main__":
    sys.exit(main())
