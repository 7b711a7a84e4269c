"""The seed's case (issue 14, item 5): gpt-13b planned for 8 A100s (40 GB) by ``spmd plan``'s
search, remat and host offload chosen by it, and the plan compiled on 8 simulated CPU devices with shapes only
(nothing materialized) to check its memory against the budget and the prediction.

    python bench/gpt13b.py            # ~7 min on 2 cores (plan ~4, XLA:CPU compile ~2-5)
    python bench/gpt13b.py --no-compile

Writes bench/results/gpt13b.json and the section "## gpt-13b on 8 A100s (bench/gpt13b.py)"
of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any

try:  # run as a script (python bench/gpt13b.py): bench/ is on sys.path
    import common
except ImportError:  # python -m bench.gpt13b
    from bench import common

SECTION = "## gpt-13b on 8 A100s (bench/gpt13b.py)"
MODEL, MESH = "gpt-13b", "a100-8"
TARGET = 0.15


def run(compile_it: bool) -> dict[str, Any]:
    import jax
    from flax import nnx

    import spmd
    from spmd import zoo
    from spmd.analysis import verify

    spec = zoo.get(MODEL)
    mesh = spmd.load_mesh(MESH, virtual=True)
    args = (*nnx.eval_shape(spec.training_state),
            jax.eval_shape(lambda: spec.batch(spec.default_batch_size, 0)))
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = spmd.plan(spec.train_step, *args, mesh=mesh,
                         options=spmd.SearchOptions(cache=False))
    out: dict[str, Any] = {
        "model": MODEL, "mesh": MESH, "plan_seconds": time.perf_counter() - start,
        "budget_bytes": mesh.device.memory_bytes,
        "planned_under_bytes": spmd.SearchOptions().budget_for(mesh),
        "remat": plan.remat.to_dict() if plan.remat else None,
        "remat_summary": plan.remat.summary() if plan.remat else "none",
        "offload_summary": (plan.offload.summary(plan.leaves) if plan.offload else "none"),
        "memory_notes": plan.search.get("memory_notes") or [],
        "probes": plan.search.get("remat_probes"),
        "prediction": plan.prediction.to_dict(),
        "tokens_per_step": spec.items_per_batch(spec.default_batch_size),
        "alternatives": {k: v if isinstance(v, str) else v.to_dict()
                         for k, v in plan.alternatives.items()},
    }
    if compile_it:  # `spmd plan --compile`'s check
        check = verify.check_compiled(plan)
        out["compile_seconds"] = check.seconds
        memory = check.report.memory
        out["compiled"] = {"argument_bytes": memory.argument_bytes,
                           "temp_bytes": memory.temp_bytes,
                           "total_bytes": check.compiled_bytes,
                           "collectives": {k: list(v)
                                           for k, v in check.report.collectives.items()}}
        # the same plan as XLA:CPU runs it: what compiled
        out["as_cpu"] = None if check.as_cpu is None else check.as_cpu.to_dict()
    return out


def _collectives(by_kind: dict[str, Any]) -> str:
    """GB per device by collective kind, those the step has."""
    return ", ".join(f"{kind} {nbytes / 1e9:.1f} GB" for kind, (count, nbytes) in by_kind.items()
                     if count)


def render(data: dict[str, Any]) -> str:
    gib = 2**30
    p = data["prediction"]
    budget = data["budget_bytes"]
    tokens = data["tokens_per_step"] / p["total_time"]
    rows = [["predicted peak", f"{p['memory_bytes'] / gib:.2f} GiB"],
            ["budget (the device's memory)", f"{budget / gib:.2f} GiB"],
            ["planned under (less the memory headroom)",
             f"{data.get('planned_under_bytes', budget) / gib:.2f} GiB"],
            ["rematerialized", data["remat_summary"]],
            ["offloaded to host memory", data.get("offload_summary", "none")],
            ["predicted step", f"{p['total_time'] * 1e3:.0f} ms, {tokens:,.0f} tokens/s"],
            ["of it recompute", f"{p['recompute_time'] * 1e3:.0f} ms "
                                f"({p['recompute_time'] / p['total_time']:.0%})"],
            ["communication", f"{p['comm_time'] * 1e3:.0f} ms"],
            ["planning", f"{data['plan_seconds']:.0f} s, "
                         f"{len(data['probes'] or [])} remat searches"]]
    compiled = data.get("compiled")
    if compiled:
        total = compiled["total_bytes"]
        ratio = p["memory_bytes"] / total
        rows += [["compiled (8 simulated CPU devices)",
                  f"{total / gib:.2f} GiB (arguments {compiled['argument_bytes'] / gib:.2f}, "
                  f"temporaries {compiled['temp_bytes'] / gib:.2f}), in "
                  f"{data['compile_seconds']:.0f} s"],
                 ["predicted / compiled", f"{ratio:.2f} (target {1 - TARGET:.2f}-"
                                          f"{1 + TARGET:.2f})"],
                 ["compiled within the budget", "yes" if total <= budget else "no"]]
        as_cpu = data.get("as_cpu")
        if as_cpu:
            rows += [["predicted as XLA:CPU runs the plan",
                      f"{as_cpu['memory_bytes'] / gib:.2f} GiB, / compiled "
                      f"{as_cpu['memory_bytes'] / total:.2f}; collectives "
                      + _collectives(as_cpu["collectives"])],
                     ["compiled collectives (XLA:CPU)", _collectives(compiled["collectives"])],
                     ["predicted collectives (XLA:GPU)", _collectives(p["collectives"])]]
    notes = ["XLA:CPU stands in for XLA:GPU in the compile (no GPU was lent to this run). It "
             "emits no reduce-scatter (a gradient is all-reduced whole, then sliced) and "
             "combines a step's gradient reductions into a few all-reduces at its end, so its "
             "temporaries are not XLA:GPU's, which reduce-scatters in groups of at most "
             "30 MiB as the gradients are made. Nor is its order: it schedules any program "
             "with collectives breadth-first, for concurrency, so what reads only the step's "
             "inputs runs at its start (every layer's weights all-gathered, every weight it "
             "transposes for a matmul copied) and is held to its reader. The prediction is "
             "for the GPU mesh; 'as XLA:CPU runs the plan' prices the same shardings with "
             "XLA:CPU's collectives and those early copies (`Plan.priced_on`). The same check "
             "is `spmd plan --model gpt-13b --mesh a100-8 --compile`. The compile on a GPU "
             "was not run.",
             *data.get("memory_notes", [])]
    probes = [[q["remat"], q.get("offload", "none"), "yes" if q["fits"] else "no",
               "" if q["peak_bytes"] is None else f"{q['peak_bytes'] / gib:.2f}",
               "" if q.get("step_seconds") is None else f"{q['step_seconds'] * 1e3:.0f}",
               f"{q['seconds']:.0f}"] for q in data["probes"] or []]
    lines = [f"Command: `{data['command']}`", "",
             f"Machine: {common.machine_line(data['machine'])}. Date: {data['date']}.", "",
             common.markdown_table(["", "gpt-13b, global batch 8 x 1024 tokens, fp32"], rows,
                                   ["l", "l"]), "", *notes, ""]
    if probes:
        lines += ["The searches the memory fit ran, in order (each a full sharding search "
                  "of the rewritten step under the budget; the fastest that fits is the plan):",
                  "", common.markdown_table(["remat", "offload", "fits", "predicted GiB",
                                             "predicted ms", "seconds"], probes,
                                            ["l", "l", "l", "r", "r", "r"]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-compile", action="store_true", help="plan only")
    common.add_output_arguments(parser, "gpt13b")
    args = parser.parse_args(argv)
    from spmd.cluster.devices import set_cpu_device_count

    set_cpu_device_count(8, "bench/gpt13b.py")
    out_json, md = common.outputs(args, "gpt13b")
    data = run(not args.no_compile)
    data.update(command=common.command_line("bench/gpt13b.py",
                                            None if argv is None else ["gpt13b.py", *argv]),
                date=common.utc_date(), machine=common.machine())
    common.publish(data, out_json, md, SECTION, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
