"""The seed's Table 1 on spmd (issue 14, item 6): gpt-13b on a virtual 8 x A100 (40 GB) mesh,
predicted by the cost model, beside the figures the seed reports.

Rows:

* data parallel that fits: the hand-written data-parallel plans (dp, ZeRO-1/2 ``zero``,
  ZeRO-3 ``fsdp``), each with the fewest layers rematerialized (``recompute_all``, the first
  ``k``) that bring its predicted peak under the budget, found by binary search; the fastest
  that fits is the row (dp and ZeRO-1/2 cannot fit: their replicated fp32 parameters alone
  are 48 GiB).
* + operator fusion: not applicable. XLA fuses by default and spmd's cost model prices the
  fused kernels (``spmd.search.fusion``); a step without fusion is not a program spmd plans
  (XLA:GPU has no supported switch for it), and pricing the same plan as if unfused would be
  the same plan priced two ways.
* + AutoParallel: ``spmd.plan``'s auto plan (sharding and remat chosen together).
* + communication overlap: left for the collective-scheduling work (issue 13's scheduling).

Columns: tokens/s (global batch tokens / predicted step time), GiB per GPU (predicted peak),
communication ms per step, and MFU: the model's FLOPs (3 x the forward pass's, recompute not
counted) over the step time and the devices' peak fp32 (TF32) FLOP/s.

    python bench/table1.py        # ~6 min on 2 shared cores

Writes bench/results/table1.json and the section "## Table 1: gpt-13b on 8 A100s
(bench/table1.py)" of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any

try:  # run as a script (python bench/table1.py): bench/ is on sys.path
    import common
except ImportError:  # python -m bench.table1
    from bench import common

SECTION = "## Table 1: gpt-13b on 8 A100s (bench/table1.py)"
MODEL, MESH = "gpt-13b", "a100-8"
DATA_PARALLEL = ("dp", "zero", "fsdp")
#: the seed's Table 1 (13B on 8 A100s): tokens/s, GB per GPU, communication ms per step
SEED = {"data parallel": (1280, 32, 8.5), "+ operator fusion": (1420, 28, None),
        "+ AutoParallel": (1650, 25, 6.2), "+ communication overlap": (1820, 25, 4.8)}


def _fitted_manual(sig, graph, inputs, mesh, method: str, budget: float, layers: int):
    """A hand-written plan with the fewest first layers recomputed that fit, or its peak with
    every layer recomputed when none does."""
    from spmd.manual import manual_specs
    from spmd.memory.remat import RECOMPUTE_ALL, RematPlan, rematerialize
    from spmd.options import SearchOptions
    from spmd.search.intra_op import IntraOp
    from spmd.search.memory_fit import fewest
    from spmd.trace.graph import build_graph

    specs = manual_specs(sig.leaves, method, mesh, [i.pinned for i in inputs])
    limit, scoring = SearchOptions().scoring()

    def score(k: int):
        program = (rematerialize(sig.jaxpr, RematPlan.first(layers, k, RECOMPUTE_ALL), graph)
                   if k else sig.jaxpr)
        job = IntraOp(build_graph(program), inputs, mesh, output_aliases=sig.output_aliases,
                      required=[(i.shape, s) for i, s in zip(inputs, specs)])
        return job.score(specs, time_limit=limit, solver=scoring).prediction

    full = score(layers)
    if full.memory_bytes > budget:
        return {"method": method, "fits": False, "layers": layers, "prediction": full.to_dict()}
    plain = score(0)
    if plain.memory_bytes <= budget:
        return {"method": method, "fits": True, "layers": 0, "prediction": plain.to_dict()}
    def fitting(k: int):
        p = score(k)
        return p if p.memory_bytes <= budget else None

    k, best = fewest(fitting, layers)
    return {"method": method, "fits": True, "layers": k, "prediction": (best or full).to_dict()}


def run() -> dict[str, Any]:
    import jax
    from flax import nnx

    import spmd
    from spmd import zoo
    from spmd.memory.remat import block_count
    from spmd.options import SearchOptions
    from spmd.planner import step_inputs
    from spmd.trace.graph import build_graph
    from spmd.trace.layers import forward_ops, op_flops
    from spmd.trace.signature import StepSignature

    spec = zoo.get(MODEL)
    mesh = spmd.load_mesh(MESH, virtual=True)
    budget = SearchOptions().budget_for(mesh)  # as auto plans: the device less the headroom
    args = (*nnx.eval_shape(spec.training_state),
            jax.eval_shape(lambda: spec.batch(spec.default_batch_size, 0)))
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = spmd.plan(spec.train_step, *args, mesh=mesh)
    auto_seconds = time.perf_counter() - start
    sig = StepSignature(spec.train_step, args)
    graph = build_graph(sig.jaxpr)
    inputs = step_inputs(sig, mesh, SearchOptions())
    layers = block_count(graph)
    manual = [_fitted_manual(sig, graph, inputs, mesh, m, budget, layers) for m in DATA_PARALLEL]
    forward = sum(op_flops(graph.nodes[i]) for i in forward_ops(graph))
    return {"model": MODEL, "mesh": MESH, "budget_bytes": budget, "layers": layers,
            "tokens_per_step": spec.items_per_batch(spec.default_batch_size),
            "model_flops": 3.0 * forward, "devices": mesh.size,
            "peak_flops": mesh.device.peak_flops("float32"),
            "auto": {"prediction": auto.prediction.to_dict(),
                     "remat": auto.remat.summary() if auto.remat else "none",
                     "offload": (auto.offload.summary(auto.leaves) if auto.offload
                                 else "no offload"),
                     "notes": auto.search.get("memory_notes") or [],
                     "seconds": auto_seconds},
            "data_parallel": manual}


def render(data: dict[str, Any]) -> str:
    gib = 2**30

    def cells(p: dict[str, Any]) -> list[str]:
        t = p["total_time"]
        mfu = data["model_flops"] / (t * data["devices"] * data["peak_flops"])
        return [f"{data['tokens_per_step'] / t:,.0f}", f"{p['memory_bytes'] / gib:.1f}",
                f"{p['comm_time'] * 1e3:.0f}", f"{mfu:.1%}"]

    def seed(row: str) -> list[str]:
        tokens, gb, comm = SEED[row]
        return [f"{tokens:,}", str(gb), "" if comm is None else f"{comm}"]

    fits = [m for m in data["data_parallel"] if m["fits"]]
    best = min(fits, key=lambda m: m["prediction"]["total_time"]) if fits else None
    rows = []
    if best:
        rows.append(["data parallel", f"{best['method']} + recompute_all on {best['layers']} of "
                     f"{data['layers']} layers", *cells(best["prediction"]),
                     *seed("data parallel")])
    else:
        rows.append(["data parallel", "none fits", "", "", "", "", *seed("data parallel")])
    rows.append(["+ operator fusion", "not applicable: XLA fuses by default, and the cost "
                 "model prices fused kernels", "", "", "", "", *seed("+ operator fusion")])
    rows.append(["+ AutoParallel", f"auto (sharding + {data['auto']['remat']}; "
                 f"{data['auto'].get('offload', 'no offload')})",
                 *cells(data["auto"]["prediction"]), *seed("+ AutoParallel")])
    rows.append(["+ communication overlap", "left for collective scheduling", "", "", "", "",
                 *seed("+ communication overlap")])
    others = "; ".join(
        f"{m['method']}: {'fits with' if m['fits'] else 'does not fit even with'} "
        f"recompute_all on {m['layers']} of {data['layers']} layers "
        f"({m['prediction']['memory_bytes'] / gib:.1f} GiB, "
        f"{data['tokens_per_step'] / m['prediction']['total_time']:,.0f} tokens/s)"
        for m in data["data_parallel"])
    lines = [f"Command: `{data['command']}`", "",
             f"Machine: {common.machine_line(data['machine'])}. Date: {data['date']}. "
             f"Predicted by the cost model with the bundled a100-8 mesh file (datasheet "
             f"figures; not calibrated on an A100: no A100 here), global batch "
             f"{data['tokens_per_step']:,} tokens, fp32 parameters and compute, every plan "
             f"fitted under {data['budget_bytes'] / gib:.2f} GiB per GPU (the device's "
             f"memory less spmd's memory headroom).", "",
             common.markdown_table(
                 ["row", "spmd plan", "tokens/s", "GiB per GPU", "comm ms", "MFU",
                  "seed tokens/s", "seed GB", "seed comm ms"], rows,
                 ["l", "l", "r", "r", "r", "r", "r", "r", "r"]), "",
             f"Hand-written data-parallel plans with remat: {others}.", "",
             "The seed's model and precision are not stated beyond '13B'; its figures are "
             "beside spmd's, not the same run. MFU counts 3x the forward FLOPs (recompute "
             "not counted) against the devices' fp32 (TF32) peak.", "",
             *[f"Auto: {note}." for note in data["auto"].get("notes", [])], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_output_arguments(parser, "table1")
    args = parser.parse_args(argv)
    out_json, md = common.outputs(args, "table1")
    data = run()
    data.update(command=common.command_line("bench/table1.py",
                                            None if argv is None else ["table1.py", *argv]),
                date=common.utc_date(), machine=common.machine())
    common.publish(data, out_json, md, SECTION, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
