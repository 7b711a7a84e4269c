"""One GPU, measured: step time, achieved FLOP/s against the datasheet peak the cost model
uses, and compiled memory against the device's memory.

Run on the GPU machine (``--out DIR`` writes gpu.json there); then, here,
``python bench/gpu.py --report DIR/gpu.json`` writes the RESULTS.md section. With one device
every plan is the same, so this checks the compute and memory side of the cost model, not
communication.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    machine, machine_line, markdown_table, replace_section, utc_date, write_json,
)

TITLE = "## One GPU: compute and memory against the cost model (bench/gpu.py)"
# (zoo model, compute dtype, batch, config overrides)
CASES = [("gpt-125m", "bfloat16", 8, {}), ("gpt-125m", "float32", 8, {}),
         ("gpt-125m", "bfloat16", 8, {"scan_layers": True})]
#: stop starting new cases after this many seconds (the lent machine's time is short)
BUDGET_S = 240.0


def model_flops(config, batch: int) -> float:
    """Training FLOPs of one GPT step by the usual count (Kaplan et al. 2020; Megatron): 6 per
    parameter per token for the matmuls, plus 12 * layers * d_model * seq per token for the
    attention scores and values (forward and backward, causal mask not discounted)."""
    c = config
    per_layer = 4 * c.d_model * c.num_heads * c.head_dim + 2 * c.d_model * c.d_ff
    params = c.num_layers * per_layer + c.vocab_size * c.d_model  # the logits' matmul (tied)
    tokens = batch * c.seq_len
    return 6 * params * tokens + 12 * c.num_layers * c.num_heads * c.head_dim * c.seq_len * tokens


def measure(mesh_path: str, cases, steps: int, out: Path | None) -> list[dict]:
    import jax
    import numpy as np
    from flax import nnx

    from spmd import zoo
    import spmd

    mesh = spmd.load_mesh(mesh_path)
    rows: list[dict] = []
    began = time.perf_counter()
    for name, dtype, batch_size, overrides in cases:
        if time.perf_counter() - began > BUDGET_S:
            print(f"skipped {name} {dtype} {overrides}: past the {BUDGET_S:.0f} s budget")
            continue
        spec = zoo.get(name).with_config(dtype=dtype, **overrides)

        abstract_model, abstract_opt = nnx.eval_shape(spec.training_state)
        batch = spec.batch(batch_size, 0)
        # compare=True: the hand-written plan is scored by the cost model (its prediction)
        options = spmd.SearchOptions(compare=True, time_limit=5.0, cache=False)
        step = spmd.parallelize(spec.train_step, mesh=mesh, method="dp", options=options)
        plan = step.plan_for(abstract_model, abstract_opt, batch)
        net, opt = spmd.materialize(spec.training_state, plan)
        batch = spmd.shard_batch(plan, batch)
        start = time.perf_counter()
        compiled = step.compile(net, opt, batch)
        compile_s = time.perf_counter() - start
        report = spmd.analyze(compiled)
        for _ in range(2):
            jax.block_until_ready(step(net, opt, batch))
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            loss = float(np.asarray(step(net, opt, batch)["loss"]))
            times.append(time.perf_counter() - start)
        step_s = float(np.median(times))
        peak = mesh.device.peak_flops(dtype)
        flops = model_flops(spec.config, batch_size)
        predicted = plan.prediction or {}
        rows.append({
            "model": name + ("-scan" if overrides.get("scan_layers") else ""), "dtype": dtype,
            "batch": batch_size, "params": spec.param_count(), "compile_s": compile_s,
            "step_ms": step_s * 1e3, "tokens_per_s": spec.items_per_batch(batch_size) / step_s,
            "model_flops": flops, "xla_flops": report.flops,
            "achieved_tflops": flops / step_s / 1e12, "peak_tflops": peak / 1e12,
            "mfu": flops / step_s / peak, "roofline_ms": flops / peak * 1e3,
            "predicted_ms": predicted.get("total_time", float("nan")) * 1e3,
            "predicted_compute_ms": predicted.get("compute_time", float("nan")) * 1e3,
            "peak_memory_gib": report.memory.peak_bytes / 2**30 if report.memory else None,
            "predicted_memory_gib": predicted.get("memory_bytes", float("nan")) / 2**30,
            "device_memory_gib": mesh.device.memory_bytes / 2**30,
            "state_gib": sum(plan.bytes_by_kind().values()) / 2**30, "loss": loss,
        })
        print(json.dumps(rows[-1]), flush=True)
        if out is not None:  # after every case: a run stopped at its limit keeps what it has
            _save(out, rows)
    return rows


def _save(out: Path, rows: list[dict]) -> None:
    import jax

    result = {"command": " ".join(["python", "bench/gpu.py", *sys.argv[1:]]),
              "device": str(jax.devices()[0].device_kind), "machine": machine(),
              "date": utc_date(), "rows": rows}
    write_json(result, out / "gpu.json")


def _findings(rows: list[dict]) -> list[str]:
    """What the numbers say about the cost model, per row (read off the data, not typed in)."""
    out = []
    for r in rows:
        what = f"- {r['model']} {r['dtype']}: measured {r['step_ms'] / r['predicted_ms']:.2f}x " \
               f"the predicted step time"
        if r["mfu"] > 1:
            what += (f"; {r['achieved_tflops']:.0f} TFLOP/s is above the {r['peak_tflops']:.0f} "
                     f"TFLOP/s fp32 peak: XLA runs fp32 matmuls on TF32 tensor cores by default")
        elif r["step_ms"] > 2 * r["predicted_ms"]:
            what += (f"; matmuls at peak would take {r['roofline_ms']:.1f} ms: the rest is "
                     f"memory-bound work (norms, softmax, elementwise) the model prices at peak FLOP/s")
        out.append(what)
    return out


def write_report(path: Path) -> None:
    data = json.loads(path.read_text())
    headers = ["model", "dtype", "batch", "step ms", "tokens/s", "model TFLOP/s", "MFU",
               "roofline ms", "predicted ms", "measured / predicted", "peak GiB",
               "predicted GiB", "compile s"]
    rows = [[r["model"], r["dtype"], r["batch"], f"{r['step_ms']:.1f}",
             f"{r['tokens_per_s']:,.0f}", f"{r['achieved_tflops']:.1f}", f"{r['mfu']:.2f}",
             f"{r['roofline_ms']:.1f}", f"{r['predicted_ms']:.1f}",
             f"{r['step_ms'] / r['predicted_ms']:.1f}", f"{r['peak_memory_gib']:.2f}",
             f"{r['predicted_memory_gib']:.2f}", f"{r['compile_s']:.1f}"] for r in data["rows"]]
    body = "\n".join([
        f"Command (on the lent GPU machine): `{data['command']}`; report written here with "
        f"`python bench/gpu.py --report <gpu.json>`.",
        f"Machine: {data['device']}; {machine_line(data['machine'])}. Date: {data['date']}.",
        "", markdown_table(headers, rows), "",
        "model TFLOP/s = the step's training FLOPs by the usual count (6 x parameters x tokens "
        "+ attention, `model_flops`) / measured step time; MFU = that over the datasheet peak "
        "the cost model used in that run (`peak_tflops` in the JSON: 989 bf16 on H200; fp32 was "
        "67 then, TF32's 494.7 since); roofline ms = those FLOPs at that peak; predicted ms = the cost model's step time for the plan "
        "(`Plan.prediction`, one device: compute only). peak GiB is `memory_analysis()` of "
        "the compiled step, predicted GiB the search's liveness peak.",
        "", *_findings(data["rows"]),
    ])
    replace_section(TITLE, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mesh", default="h200-1", help="bundled mesh name or mesh file")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--models", default=None, help="comma list of model:dtype:batch")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    if args.report:
        write_report(args.report)
        return
    cases = CASES
    if args.models:
        cases = [(m, d, int(b), {}) for m, d, b in (c.split(":") for c in args.models.split(","))]
    measure(args.mesh, cases, args.steps, args.out)


if __name__ == "__main__":
    main()
