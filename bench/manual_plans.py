"""Hand-written plans side by side on 8 simulated CPU devices (the bundled cpu-8 mesh).

For each model x method (dp, zero, fsdp, tp, dp_tp, fsdp_tp, ep) this compiles the AdamW
train step as ``spmd run`` does (eval_shape -> plan -> parallelize -> lower().compile() ->
analyze; the state is initialized once per model and placed into each plan's shardings
instead of ``materialize``d per plan), records what XLA emitted (collectives per kind, bytes per
device, peak memory, FLOPs) and times a few steps. Methods that do not apply to a model are
listed with the reason ``spmd.manual.applicable_methods`` gives.

    python bench/manual_plans.py                                  # everything (~6 min on 2 busy cores)
    python bench/manual_plans.py --models gpt-tiny --methods dp,fsdp --steps 3

Writes bench/results/manual_plans.json (all numbers) and the section
"## Hand-written plans on cpu-8 (bench/manual_plans.py)" of bench/RESULTS.md (with
``--output``: the JSON goes there and RESULTS.md is left alone unless ``--results-md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import sys
import time
from typing import Any

try:  # run as a script (python bench/manual_plans.py): bench/ is on sys.path
    import common
except ImportError:  # python -m bench.manual_plans
    from bench import common

MESH = "cpu-8"
SECTION = "## Hand-written plans on cpu-8 (bench/manual_plans.py)"
DEFAULT_MODELS = ["gpt-tiny", "mlp-tiny", "mlp-small", "moe-tiny", "wresnet-tiny", "gpt-bench"]
# Models defined here, not in the zoo: (zoo model, config overrides, batch size).
# gpt-bench: gpt-tiny grown to 4 layers of width 128, vocab 1024, 64 tokens (~0.9 M
# parameters, 1024 tokens a step), so compute and communication outweigh the fixed cost.
BENCH_MODELS: dict[str, tuple[str, dict[str, Any], int]] = {
    "gpt-bench": ("gpt-tiny", dict(num_layers=4, d_model=128, num_heads=8, head_dim=16,
                                   d_ff=512, vocab_size=1024, seq_len=64), 16),
}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
WARMUP = 2


@dataclasses.dataclass
class Initial:
    """One model's starting point, shared by every method: host (numpy) copies."""

    abstract_model: Any
    abstract_opt: Any
    graphdef: Any
    state: Any
    batch: Any
    items: int  # tokens or samples per batch

    @classmethod
    def build(cls, spec, batch_size: int) -> "Initial":
        import jax
        import numpy as np
        from flax import nnx

        abstract_model, abstract_opt = nnx.eval_shape(spec.training_state)
        graphdef, _ = nnx.split((abstract_model, abstract_opt))
        state = jax.device_get(jax.jit(lambda: nnx.split(spec.training_state())[1])())
        batch = jax.tree.map(np.asarray, spec.batch(batch_size, 0))
        return cls(abstract_model, abstract_opt, graphdef, state, batch,
                   spec.items_per_batch(batch_size))


def get_model(name: str):
    """(ModelSpec, batch size, config overrides) for a zoo name or one of BENCH_MODELS."""
    from spmd import zoo

    if name in BENCH_MODELS:
        base, overrides, batch = BENCH_MODELS[name]
        return zoo.get(base).with_config(**overrides), batch, overrides
    spec = zoo.get(name)
    return spec, spec.default_batch_size, {}


def bench_one(spec, initial: "Initial", method: str, mesh, steps: int) -> dict[str, Any]:
    """Compile and time one model under one method; every number per device."""
    import jax
    import numpy as np
    from flax import nnx

    import spmd
    from spmd.analysis.report import groups_to_mesh_axes

    step = spmd.parallelize(spec.train_step, mesh=mesh, method=method)
    plan = step.plan_for(initial.abstract_model, initial.abstract_opt, initial.batch)
    # The same initial values for every method: fresh NNX objects over host copies of the
    # state, placed into this plan's shardings by the step (spmd.materialize would build
    # them sharded directly, but compiles a sharded init per plan: 5-20 s each here).
    # (a rebuilt tree: nnx.merge reuses the State's Variable objects, which the step updates)
    net, opt = nnx.merge(initial.graphdef, jax.tree.map(np.array, initial.state))
    batch = spmd.shard_batch(plan, spmd.process_local_batch(plan, initial.batch))
    t0 = time.perf_counter()
    compiled = step.compile(net, opt, batch)  # the executable the calls below run
    compile_s = time.perf_counter() - t0
    report = spmd.analyze(compiled)

    def run() -> float:
        metrics = step(net, opt, batch)
        return float(np.asarray(jax.device_get(metrics["loss"])))

    losses, times = [], []
    for i in range(WARMUP + steps):
        start = time.perf_counter()
        losses.append(run())
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    step_s = float(np.median(times))
    mem = report.memory
    out = {
        "method": method,
        "applicable": True,
        "collectives": {k: {"count": c, "bytes": b} for k, (c, b) in report.collectives.items()},
        "total_collective_bytes": report.total_collective_bytes,
        "collectives_in_while": sum(1 for op in report.ops if op.in_while),
        # One row per collective: kind, printed result shape, bytes per device, and the mesh
        # axes its groups span (None: not whole mesh axes, e.g. a collective-permute).
        "ops": [[op.kind, op.shape_text.split("{")[0] if "(" not in op.shape_text
                 else op.shape_text, op.bytes,
                 None if op.replica_groups is None else
                 list(groups_to_mesh_axes(op.replica_groups, dict(mesh.shape)) or ["?"])]
                for op in report.ops],
        "memory": None if mem is None else {
            "argument_bytes": mem.argument_bytes, "output_bytes": mem.output_bytes,
            "temp_bytes": mem.temp_bytes, "alias_bytes": mem.alias_bytes,
            "argument_plus_temp_bytes": mem.argument_bytes + mem.temp_bytes,
            "peak_bytes": mem.peak_bytes},
        "flops": report.flops,
        "compile_s": compile_s,
        "step_times_s": times,
        "step_s": step_s,
        "items_per_s": initial.items / step_s,
        "losses": losses,
    }
    del net, opt, compiled, step
    gc.collect()
    return out


def bench_model(name: str, methods: list[str], mesh, steps: int) -> dict[str, Any]:
    import spmd
    from spmd.manual import applicable_methods

    spec, batch_size, overrides = get_model(name)
    t0 = time.perf_counter()
    initial = Initial.build(spec, batch_size)
    init_s = time.perf_counter() - t0
    leaves = spmd.plan(spec.train_step, initial.abstract_model, initial.abstract_opt,
                       initial.batch, mesh=mesh, method="dp").leaves
    reasons = applicable_methods(leaves, mesh)
    params = spec.param_count()
    state_bytes = sum(l.nbytes for l in leaves if l.kind in ("param", "optimizer", "state"))
    result: dict[str, Any] = {
        "model": name, "zoo_model": spec.name, "config_overrides": overrides,
        "batch_size": batch_size, "unit": spec.unit,
        "items_per_batch": spec.items_per_batch(batch_size),
        "param_count": params, "param_bytes_fp32": 4 * params,
        "state_bytes": state_bytes, "init_s": init_s, "runs": [],
    }
    for method in methods:
        if reasons.get(method) is not None:
            result["runs"].append({"method": method, "applicable": False,
                                   "reason": reasons[method]})
            print(f"  {name:13s} {method:8s} skipped: {reasons[method]}", flush=True)
            continue
        t0 = time.perf_counter()
        run = bench_one(spec, initial, method, mesh, steps)
        run["wall_s"] = time.perf_counter() - t0
        result["runs"].append(run)
        print(f"  {name:13s} {method:8s} coll {run['total_collective_bytes'] / common.MiB:8.3f} MiB"
              f"  peak {run['memory']['peak_bytes'] / common.MiB:8.2f} MiB"
              f"  step {run['step_s'] * 1e3:8.1f} ms  loss {run['losses'][-1]:.4f}"
              f"  ({run['wall_s']:.1f} s)", flush=True)
    dp = next((r for r in result["runs"] if r["method"] == "dp" and r["applicable"]), None)
    for r in result["runs"]:
        if r["applicable"]:
            r["step_vs_dp"] = r["step_s"] / dp["step_s"] if dp else None
    return result


def _mib(n: float) -> str:
    return f"{n / common.MiB:.3f}"


def render(data: dict[str, Any]) -> str:
    """The RESULTS.md section body."""
    rows, skipped = [], []
    for model in data["models"]:
        for r in model["runs"]:
            if not r["applicable"]:
                skipped.append(f"- {model['model']} / {r['method']}: {r['reason']}")
                continue
            c = r["collectives"]
            mem = r["memory"] or {}
            vs = "" if r.get("step_vs_dp") is None else f"{r['step_vs_dp']:.2f}"
            rows.append([
                model["model"], r["method"],
                *(_mib(c[k]["bytes"]) for k in KINDS),
                _mib(r["total_collective_bytes"]),
                _mib(mem["peak_bytes"]) if mem else "",
                _mib(mem["argument_plus_temp_bytes"]) if mem else "",
                f"{r['step_s'] * 1e3:.1f}", vs, f"{r['items_per_s']:,.0f}",
            ])
    headers = ["model", "method", "all-reduce MiB", "all-gather MiB", "reduce-scatter MiB",
               "all-to-all MiB", "permute MiB", "total MiB", "peak MiB", "arg+temp MiB",
               "step ms", "vs dp", "items/s"]
    align = ["l", "l"] + ["r"] * 11
    models_rows = [[m["model"], f"{m['param_count']:,}", _mib(m["param_bytes_fp32"]),
                    str(m["batch_size"]), f"{m['items_per_batch']:,} {m['unit']}"]
                   for m in data["models"]]
    lines = [
        f"Command: `{data['command']}`",
        "",
        f"Machine: {common.machine_line(data['machine'])}. Date: {data['date']}. "
        f"Mesh: `{data['mesh']}` (8 simulated CPU devices, data=2 x model=4). "
        f"Step time: median of {data['steps']} steps after {WARMUP} warm-up steps; total "
        f"run {data['total_wall_s']:.0f} s.",
        "",
        "Models (fp32 parameters; AdamW, so optimizer state is 2x the parameters):",
        "",
        common.markdown_table(["model", "parameters", "param MiB", "batch", "items/step"],
                              models_rows, ["l", "r", "r", "r", "r"]),
        "",
        "Collective bytes are per device and static (what one device sends into each "
        "collective of the optimized HLO, from `spmd.analyze`). `peak` is "
        "`report.memory.peak_bytes`, per device; `arg+temp` is XLA's argument plus temporary "
        "buffer bytes per device (`memory_analysis`). "
        "`vs dp` is the step time relative to `dp` for the same model in this run (the "
        "machine is shared and noisy: compare within a model, not across runs). items/s "
        "counts tokens for gpt/moe and samples for mlp/wresnet.",
        "",
        common.markdown_table(headers, rows, align),
        "",
        "Notes:",
        "",
        "- On CPU XLA emits no reduce-scatter: it all-reduces and then slices, so the "
        "gradient reduction of `zero` and `fsdp` shows as all-reduce here (the full "
        "gradient bytes), not as reduce-scatter. On GPU the same plans reduce-scatter.",
        "- On CPU the backend's own `peak_memory_in_bytes` comes out at the argument bytes "
        "(the sharded state), leaving out temporaries; `peak` is then arguments + outputs + "
        "temporaries - aliased (`spmd.analysis.report.MemoryReport`), `arg+temp` without the "
        "outputs that alias no argument.",
        "- `dp` all-reduces the gradients once: its all-reduce bytes are about 4 bytes x "
        "parameters, plus the scalar loss; for wresnet also the BatchNorm batch statistics "
        "(mean and variance over the global batch); for gpt/moe also one more token-"
        "embedding-sized buffer: the output projection is tied to the embedding, and XLA "
        "all-reduces the lookup's and the projection's gradient before adding them.",
        "- Step times come from 8 simulated devices sharing the machine's cores, so they track "
        "the total work of all 8 (e.g. `tp` replicates the batch over the `data` axis and so "
        "does 2x dp's FLOPs per device), not what 8 real devices would take.",
    ]
    if data.get("observations"):
        lines += ["", "Flagged automatically (against `dp` for the same model, this run):", "",
                  *(f"- {o}" for o in data["observations"])]
    if skipped:
        lines += ["", "Not applicable (reason from `spmd.manual.applicable_methods`):", "",
                  *skipped]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help="comma-separated zoo names or " + ", ".join(BENCH_MODELS))
    parser.add_argument("--methods", default="dp,zero,fsdp,tp,dp_tp,fsdp_tp,ep",
                        help="comma-separated hand-written methods")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up)")
    common.add_output_arguments(parser, "manual_plans")
    args = parser.parse_args(argv)

    import spmd

    mesh = spmd.load_mesh(MESH)  # before jax starts: 8 CPU devices
    from spmd.manual import METHODS

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; valid: {', '.join(METHODS)}")
    if "dp" not in methods:
        print("note: without dp there is no 'vs dp' column", file=sys.stderr)
    model_names = [m.strip() for m in args.models.split(",") if m.strip()]

    start = time.perf_counter()
    data: dict[str, Any] = {
        "command": common.command_line(argv=None if argv is None else ["bench/manual_plans.py", *argv]),
        "machine": common.machine(),
        "date": common.utc_date(),
        "mesh": MESH,
        "steps": args.steps,
        "warmup_steps": WARMUP,
        "models": [],
    }
    for name in model_names:
        print(f"{name}:", flush=True)
        data["models"].append(bench_model(name, methods, mesh, args.steps))
    data["total_wall_s"] = time.perf_counter() - start
    data["observations"] = observations(data)

    out, md = common.outputs(args, "manual_plans")
    common.write_json(data, out)
    if md is not None:
        common.replace_section(SECTION, render(data), md)
    print(f"wrote {out}" + (f" and {md}" if md else "") + f" in {data['total_wall_s']:.0f} s")
    return 0


def observations(data: dict[str, Any]) -> list[str]:
    """Automatic flags against dp: 1.5x its step time or more, more argument+temp memory,
    or a loss trajectory that differs from dp's (all methods start from the same state)."""
    notes = []
    for model in data["models"]:
        runs = [r for r in model["runs"] if r["applicable"]]
        for r in runs:
            if not all(math.isfinite(x) for x in r["losses"]):
                notes.append(f"{model['model']} / {r['method']}: non-finite loss")
        dp = next((r for r in runs if r["method"] == "dp"), None)
        if dp is None:
            continue
        for r in runs:
            if r is dp:
                continue
            what = []
            if r["step_vs_dp"] is not None and r["step_vs_dp"] >= 1.5:
                what.append(f"{r['step_vs_dp']:.1f}x dp's step time")
            mine = r["memory"]["argument_plus_temp_bytes"]
            theirs = dp["memory"]["argument_plus_temp_bytes"]
            if mine > theirs * 1.001:
                what.append(f"argument+temp {mine / common.MiB:.2f} MiB > dp's "
                            f"{theirs / common.MiB:.2f} MiB")
            ratio = r["total_collective_bytes"] / max(dp["total_collective_bytes"], 1)
            if ratio >= 2:
                what.append(f"{ratio:.1f}x dp's collective bytes")
            diff = max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(r["losses"], dp["losses"]))
            r["max_rel_loss_diff_vs_dp"] = diff
            if diff > 1e-3:
                what.append(f"losses differ from dp's by up to {diff:.1e} (relative)")
            if what:
                notes.append(f"{model['model']} / {r['method']}: " + "; ".join(what))
    return notes


if __name__ == "__main__":
    sys.exit(main())
