"""The SPMD pipeline runtime at realistic sizes (issue 15): scanned GPTs on virtual A100
clusters, ``pp_tp`` with the stack spread over the host axis, GPipe and circular, beside the
MPMD runtime's ``pp_tp`` (1F1B) of the same model unrolled, predicted; each SPMD program
compiled on as many simulated CPU devices (shapes only) and read: its loop transfers
(collective-permutes: bytes per device and how often they run) and its memory (arguments
and temporaries, XLA:CPU) beside the prediction.

    python bench/spmd_pipeline.py                  # gpt-2.6b, 6.7b, 13b on a100-2x8, a100-8x8
    python bench/spmd_pipeline.py --models gpt-2.6b --meshes a100-2x8
    python bench/spmd_pipeline.py --report bench/results/spmd_pipeline.json

Writes bench/results/spmd_pipeline.json and the section "## SPMD pipeline runtime
(bench/spmd_pipeline.py)" of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

try:  # run as a script (python bench/spmd_pipeline.py): bench/ is on sys.path
    import common
except ImportError:  # python -m bench.spmd_pipeline
    from bench import common

SECTION = "## SPMD pipeline runtime (bench/spmd_pipeline.py)"
MODELS = ["gpt-2.6b", "gpt-6.7b", "gpt-13b"]
MESHES = ["a100-2x8", "a100-8x8"]
#: global batch (sequences of 1024 tokens) per mesh: 2 per GPU
BATCH = {"a100-2x8": 32, "a100-8x8": 128}
#: (schedule, repeats) of each SPMD plan
SCHEDULES = [("gpipe", 1), ("circular", 2)]


def run_case(model: str, mesh_name: str) -> dict[str, Any]:
    """Every SPMD plan of ``model`` on ``mesh_name`` planned, compiled and read, and the
    MPMD plan of the unrolled model planned."""
    import jax

    import spmd
    from spmd import zoo
    from spmd.analysis.hlo import collective_ops
    from spmd.errors import PlanError
    from spmd.runtime.stacked import stacked_executable
    from spmd.stages.schedule import bubble_formula
    from spmd.stages.stack import ticks

    mesh = spmd.load_mesh(mesh_name, virtual=True)
    axis = mesh.axis_names[0]  # one stage per host
    p = mesh.shape[axis]
    m = 2 * p
    out: dict[str, Any] = {"model": model, "mesh": mesh_name, "stages": p, "microbatches": m,
                           "plans": []}
    for scan in (True, False):
        spec = zoo.get(model).with_config(scan_layers=scan)
        batch = jax.eval_shape(lambda: spec.batch(BATCH[mesh_name], 0))  # noqa: B023
        abstract = spmd.eval_shape(spec.training_state)
        for name, repeats in SCHEDULES if scan else [("1f1b", 1)]:
            pipeline = spmd.PipelineOptions(stage_axis=axis, microbatches=m, repeats=repeats,
                                            runtime="spmd" if scan else "mpmd")
            start = time.perf_counter()
            try:
                plan = spmd.plan(spec.train_step, *abstract, batch, mesh=mesh, method="pp_tp",
                                 options=spmd.SearchOptions(pipeline=pipeline))
            except PlanError as err:  # e.g. a stack the stages x repeats cannot share
                out["plans"].append({"runtime": pipeline.runtime, "schedule": name,
                                     "error": str(err)})
                continue
            entry = {"runtime": plan.runtime, "schedule": name, "repeats": repeats,
                     "recompute": plan.recompute or any(
                         st.cost is not None and st.cost.recompute for st in plan.stages),
                     "plan_s": time.perf_counter() - start,
                     "predicted_ms": plan.prediction.total_time * 1e3,
                     "bubble": plan.prediction.bubble_fraction,
                     "bubble_formula": bubble_formula(p, m * repeats),
                     "predicted_gib": plan.prediction.memory_bytes / 2**30}
            if plan.runtime == "spmd":
                start = time.perf_counter()
                compiled = stacked_executable(plan).compile()
                entry["compile_s"] = time.perf_counter() - start
                memory = compiled.memory_analysis()
                entry["compiled_gib"] = (memory.argument_size_in_bytes
                                         + memory.temp_size_in_bytes) / 2**30
                loop = ticks(m, repeats, p)
                entry["hlo_transfers"] = sorted(
                    [op.bytes, op.runs] for op in collective_ops(compiled.as_text())
                    if op.kind == "collective-permute" and op.runs == loop)
                entry["predicted_transfers"] = sorted(
                    [int(nbytes), runs] for _, nbytes, runs in plan.prediction.transfers)
            out["plans"].append(entry)
    return out


def render(data: dict[str, Any]) -> str:
    headers = ["model", "mesh", "runtime", "schedule", "recompute", "predicted ms",
               "bubble (formula)",
               "predicted GiB", "compiled GiB (XLA:CPU)", "ratio", "loop permutes: HLO",
               "predicted", "plan s", "compile s"]
    rows = []
    for case in data["cases"]:
        if "error" in case:
            rows.append([case["model"], case["mesh"], "error: " + case["error"][:80]]
                        + [""] * (len(headers) - 3))
            continue
        for e in case["plans"]:
            if "error" in e:
                why = e["error"].split(";")[0].removeprefix(
                    "the SPMD pipeline runtime cannot run this step: ")
                rows.append([case["model"], case["mesh"], e["runtime"], e["schedule"],
                             f"not run: {why}"] + [""] * (len(headers) - 5))
                continue
            compiled = e.get("compiled_gib")
            rows.append([
                case["model"], f"{case['mesh']} ({case['stages']} stages, "
                               f"{case['microbatches']} microbatches)",
                e["runtime"], e["schedule"], "yes" if e.get("recompute") else "no",
                f"{e['predicted_ms']:.0f}",
                f"{e['bubble']:.1%} ({e['bubble_formula']:.1%})", f"{e['predicted_gib']:.2f}",
                "" if compiled is None else f"{compiled:.2f}",
                "" if compiled is None else f"{compiled / e['predicted_gib']:.2f}",
                _transfers(e.get("hlo_transfers")), _transfers(e.get("predicted_transfers")),
                f"{e['plan_s']:.1f}", "" if "compile_s" not in e else f"{e['compile_s']:.1f}"])
    return "\n".join([
        f"Command: `{data['command']}`. Machine: {common.machine_line(data['machine'])}. "
        f"Date: {data['date']}.", "",
        "Scanned GPTs (`scan_layers=True`), fp32, 2 sequences of 1024 tokens per GPU, "
        "`pp_tp` with one stage per host (Megatron inside each), 2x the stages microbatches. "
        "The SPMD runtime runs the scanned stack as one program (GPipe, or circular with 2 "
        "chunks per stage); the MPMD row is the same model unrolled, run one program per "
        "stage and phase with 1F1B. Recompute: where a plan would not fit 40 GB, its stages "
        "(the SPMD plan: all; MPMD: those over) run their forward again in the backward. "
        "Compiled: the SPMD program on as many simulated CPU "
        "devices; its loops' collective-permutes as (bytes per device, runs per step).", "",
        common.markdown_table(headers, rows), ""])


def _transfers(pairs) -> str:
    return "" if not pairs else ", ".join(f"{b / 2**20:.1f} MiB x{r}" for b, r in pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_grid_arguments(parser, "spmd_pipeline", MODELS, MESHES)
    args = parser.parse_args(argv)

    def devices(mesh: str) -> int:  # the program compiles on as many as the mesh has
        import spmd

        return spmd.load_mesh(mesh, virtual=True).size

    return common.grid_main(args, argv, "bench/spmd_pipeline.py", "spmd_pipeline", SECTION,
                            render, devices, run_case)

if __name__ == "__main__":
    sys.exit(main())
