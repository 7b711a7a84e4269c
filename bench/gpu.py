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
from common import machine, machine_line, markdown_table, replace_section, utc_date  # noqa: E402

TITLE = "## One GPU: compute and memory against the cost model (bench/gpu.py)"
CASES = [("gpt-125m", "bfloat16", 8), ("gpt-125m", "float32", 8), ("gpt-350m", "bfloat16", 8)]


def measure(mesh_path: str, cases, steps: int) -> list[dict]:
    import spmd

    mesh = spmd.load_mesh(mesh_path)
    import jax
    import numpy as np
    from flax import nnx

    import models

    rows = []
    for name, dtype, batch_size in cases:
        spec = models.get(name).with_config(dtype=dtype)

        def create():
            net = spec.create(0)
            return net, spec.optimizer(net)

        abstract_model, abstract_opt = nnx.eval_shape(create)
        batch = spec.batch(batch_size, 0)
        step = spmd.parallelize(spec.train_step, mesh=mesh, method="dp")
        plan = step.plan_for(abstract_model, abstract_opt, batch)
        net, opt = spmd.materialize(create, plan)
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
        flops = report.flops or 0.0
        rows.append({
            "model": name, "dtype": dtype, "batch": batch_size, "params": spec.param_count(),
            "compile_s": compile_s, "step_ms": step_s * 1e3,
            "tokens_per_s": spec.items_per_batch(batch_size) / step_s,
            "flops": flops, "achieved_tflops": flops / step_s / 1e12,
            "peak_tflops": peak / 1e12, "mfu": flops / step_s / peak,
            "predicted_compute_ms": flops / peak * 1e3,
            "peak_memory_gib": report.memory.peak_bytes / 2**30 if report.memory else None,
            "device_memory_gib": mesh.device.memory_bytes / 2**30,
            "state_gib": sum(plan.bytes_by_kind().values()) / 2**30, "loss": loss,
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def write_report(path: Path) -> None:
    data = json.loads(path.read_text())
    headers = ["model", "dtype", "batch", "step ms", "tokens/s", "TFLOP/s", "MFU",
               "roofline ms", "peak GiB", "state GiB", "compile s"]
    rows = [[r["model"], r["dtype"], r["batch"], f"{r['step_ms']:.1f}",
             f"{r['tokens_per_s']:,.0f}", f"{r['achieved_tflops']:.1f}", f"{r['mfu']:.2f}",
             f"{r['predicted_compute_ms']:.1f}", f"{r['peak_memory_gib']:.2f}",
             f"{r['state_gib']:.2f}", f"{r['compile_s']:.1f}"] for r in data["rows"]]
    body = "\n".join([
        f"Command (on the lent GPU machine): `{data['command']}`; report written here with "
        f"`python bench/gpu.py --report <gpu.json>`.",
        f"Machine: {data['device']}; {machine_line(data['machine'])}. Date: {data['date']}.",
        "", markdown_table(headers, rows), "",
        "roofline ms = XLA's FLOP count / the datasheet peak the cost model uses "
        "(989 TFLOP/s bf16, 67 fp32 for H200); MFU = roofline / measured. peak GiB is "
        "`memory_analysis()` of the compiled step; state GiB = parameters + AdamW state.",
    ])
    replace_section(TITLE, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mesh", default="meshes/h200-1.yaml")
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
        cases = [(m, d, int(b)) for m, d, b in (c.split(":") for c in args.models.split(","))]
    rows = measure(args.mesh, cases, args.steps)
    import jax

    result = {"command": " ".join(["python", "bench/gpu.py", *sys.argv[1:]]),
              "device": str(jax.devices()[0].device_kind), "machine": machine(),
              "date": utc_date(), "rows": rows}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
