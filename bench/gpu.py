"""One GPU, measured: the device profiled, then each case's step time and compiled memory
against the cost model's prediction on the profiled figures, and spmd's step beside the same
step hand-written in plain JAX.

The one script a session with a lent GPU runs (issues 13 and 14), in this order, each part
saved to ``DIR/gpu.json`` as soon as it is measured (a run stopped at its time limit keeps
what it has), new cases no longer started past ``--budget`` seconds:

1. ``spmd profile`` of the mesh (``spmd.profile.profile_mesh``): written as
   ``DIR/<mesh>-profiled.yaml``, the calibrated figures for ``meshes/<mesh>.yaml``; every
   prediction below is made on it.
2. The cases (``CASES``): each zoo GPT planned by ``spmd.parallelize`` (auto: on one
   device, its remat choice under the device's memory), stepped, and compared with the
   prediction (step time, compiled memory). A ``remat`` override is the model's own
   ``jax.checkpoint`` per block (``spmd.zoo.gpt.Config.remat``), which spmd keeps.
3. The plain-JAX anchors (``PLAIN``): the same zoo step jitted by hand (``jax.jit`` of
   ``nnx.merge`` / ``nnx.split``, state donated), no spmd; issue 14's Table 1 GPU row puts
   spmd's measured step beside it.

On the GPU machine (``--out DIR``), then, here, ``python bench/gpu.py --report DIR/gpu.json``
writes the RESULTS.md section. There (the lent H200: jax, flax, optax, setuptools and wheel,
no ortools, no internet), carry the cp312 wheels of ortools, immutabledict and protobuf
(``.whl``: the device tool's README says how to fetch them) and run, from the repository::

    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site \
        .whl/*.whl . && PYTHONPATH=/tmp/site python3 bench/gpu.py --out $OUT

with a time limit that leaves room for a rerun (no case starts past ``--budget``, 420 s).
A dry run on this CPU checks the script end to end at tiny sizes (``tests/test_bench_gpu.py``
runs one)::

    python bench/gpu.py --out /tmp/gpu --mesh cpu-1 --quick-profile \\
        --cases gpt-tiny:float32:4,gpt-tiny:float32:4:remat=save_dots \\
        --plain gpt-tiny:float32:4:remat=save_dots
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RESULTS_MD, machine, machine_line, markdown_table, replace_section, utc_date, write_json,
)

TITLE = "## One GPU: compute and memory against the cost model (bench/gpu.py)"
#: (zoo model, compute dtype, global batch, config overrides), most wanted first: the lent
#: machine's minutes are few. gpt-1.3b without overrides is spmd's own choice (remat only
#: if it does not fit); with save_dots it is the plain-JAX anchor's step.
CASES: list[tuple[str, str, int, dict[str, Any]]] = [
    ("gpt-125m", "bfloat16", 8, {}),
    ("gpt-1.3b", "bfloat16", 8, {}),
    ("gpt-1.3b", "bfloat16", 8, {"remat": "save_dots"}),
    ("gpt-350m", "bfloat16", 8, {"remat": "save_dots"}),
    ("gpt-125m", "float32", 8, {}),
    ("gpt-125m", "bfloat16", 8, {"scan_layers": True}),
]
#: the steps also run hand-written in plain JAX (the anchor measured 58.1k tokens/s, 48.4% MFU
#: for gpt-1.3b bf16 with dots_with_no_batch_dims_saveable on one H200)
PLAIN: list[tuple[str, str, int, dict[str, Any]]] = [
    ("gpt-1.3b", "bfloat16", 8, {"remat": "save_dots"}),
]
#: stop starting new cases after this many seconds of the run
BUDGET_S = 420.0


def model_flops(config, batch: int) -> float:
    """Training FLOPs of one GPT step by the usual count (Kaplan et al. 2020; Megatron): 6 per
    parameter per token for the matmuls, plus 12 * layers * d_model * seq per token for the
    attention scores and values (forward and backward, causal mask not discounted). Recompute
    is not counted: MFU is of the model's FLOPs."""
    c = config
    per_layer = 4 * c.d_model * c.num_heads * c.head_dim + 2 * c.d_model * c.d_ff
    params = c.num_layers * per_layer + c.vocab_size * c.d_model  # the logits' matmul (tied)
    tokens = batch * c.seq_len
    return 6 * params * tokens + 12 * c.num_layers * c.num_heads * c.head_dim * c.seq_len * tokens


def parse_case(text: str) -> tuple[str, str, int, dict[str, Any]]:
    """``model:dtype:batch[:field=value...]``, e.g. ``gpt-1.3b:bfloat16:8:remat=save_dots``
    (``true``/``false`` are booleans, digits integers)."""
    parts = text.split(":")
    if len(parts) < 3:
        raise SystemExit(f"--cases/--plain: {text!r} is not model:dtype:batch[:field=value...]")
    overrides: dict[str, Any] = {}
    for item in parts[3:]:
        key, _, value = item.partition("=")
        overrides[key] = {"true": True, "false": False}.get(
            value, int(value) if value.isdigit() else value)
    return parts[0], parts[1], int(parts[2]), overrides


def _label(name: str, overrides: dict[str, Any]) -> str:
    extra = [("scan" if k == "scan_layers" and v is True else f"{k}={v}")
             for k, v in overrides.items() if v is not False]
    return " ".join([name, *extra])


def _timed(step, steps: int) -> tuple[float, float]:
    """(seconds per step: ``spmd.timing.median_step`` of ``steps`` + 1 timed steps, as
    ``spmd run`` reports it, the last loss); ``step()`` runs one step and returns its loss
    array (read back, so each time holds the whole step)."""
    import numpy as np

    from spmd.timing import median_step

    times, loss = [], float("nan")
    for _ in range(steps + 1):
        start = time.perf_counter()
        loss = float(np.asarray(step()))
        times.append(time.perf_counter() - start)
    return median_step(times), loss


def _rates(spec, batch_size: int, step_s: float, peak: float) -> dict[str, float]:
    flops = model_flops(spec.config, batch_size)
    return {"step_ms": step_s * 1e3, "tokens_per_s": spec.items_per_batch(batch_size) / step_s,
            "model_flops": flops, "achieved_tflops": flops / step_s / 1e12,
            "peak_tflops": peak / 1e12, "mfu": flops / step_s / peak}


def measure_spmd(mesh, datasheet, case, steps: int) -> dict[str, Any]:
    """One case planned on ``mesh`` (profiled), compiled and stepped through
    ``spmd.parallelize``; MFU against ``datasheet``'s (the bundled mesh's) peak."""
    import warnings

    from flax import nnx

    from spmd import zoo
    import spmd

    name, dtype, batch_size, overrides = case
    spec = zoo.get(name).with_config(dtype=dtype, **overrides)
    abstract_model, abstract_opt = nnx.eval_shape(spec.training_state)
    step = spmd.parallelize(spec.train_step, mesh=mesh, method="auto",
                            options=spmd.SearchOptions(cache=False))
    with warnings.catch_warnings():  # one device: "every plan is the same", known here
        warnings.filterwarnings("ignore", message=".*has one device")
        start = time.perf_counter()
        plan = step.plan_for(abstract_model, abstract_opt, spec.batch(batch_size, 0))
        plan_s = time.perf_counter() - start
        net, opt = spmd.materialize(spec.training_state, plan)
        batch = spmd.shard_batch(plan, spec.batch(batch_size, 0))
        start = time.perf_counter()
        report = spmd.analyze(step.compile(net, opt, batch))
        compile_s = time.perf_counter() - start
    step_s, loss = _timed(lambda: step(net, opt, batch)["loss"], steps)
    predicted = plan.prediction
    return {
        "model": _label(name, overrides), "dtype": dtype, "batch": batch_size,
        "params": spec.param_count(), "plan_s": plan_s, "compile_s": compile_s,
        **_rates(spec, batch_size, step_s, datasheet.peak_flops(dtype)),
        "xla_flops": report.flops,
        "remat": plan.remat.summary() if plan.remat else "none",
        "predicted_ms": predicted.total_time * 1e3,
        "predicted": predicted.to_dict(),
        "peak_memory_gib": report.memory.peak_bytes / 2**30 if report.memory else None,
        "predicted_memory_gib": predicted.memory_bytes / 2**30,
        "device_memory_gib": mesh.device.memory_bytes / 2**30, "loss": loss,
    }


def measure_plain(mesh, datasheet, case, steps: int) -> dict[str, Any]:
    """The same zoo step hand-written in plain JAX on ``mesh``'s device: the NNX graph split
    once, a pure step jitted with its state donated, nothing of spmd's in the step (its
    memory read by ``spmd.analyze``, as spmd's own)."""
    import jax
    from flax import nnx

    import spmd
    from spmd import zoo

    name, dtype, batch_size, overrides = case
    spec = zoo.get(name).with_config(dtype=dtype, **overrides)
    graphdef, _ = nnx.split(nnx.eval_shape(spec.training_state))
    device = mesh.jax_mesh().devices.flat[0]
    with jax.default_device(device):
        state = jax.jit(lambda: nnx.split(spec.training_state())[1])()
        batch = jax.device_put(spec.batch(batch_size, 0), device)

    def pure(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        out = spec.train_step(model, optimizer, batch)
        return nnx.split((model, optimizer))[1], out["loss"]

    jitted = jax.jit(pure, donate_argnums=0)
    start = time.perf_counter()
    compiled = jitted.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    memory = spmd.analyze(compiled).memory
    held = {"state": state}

    def one() -> Any:
        held["state"], loss = compiled(held["state"], batch)
        return loss

    step_s, loss = _timed(one, steps)
    return {
        "model": _label(name, overrides), "dtype": dtype, "batch": batch_size,
        "compile_s": compile_s, **_rates(spec, batch_size, step_s, datasheet.peak_flops(dtype)),
        "peak_memory_gib": memory.peak_bytes / 2**30 if memory else None, "loss": loss,
    }


def run(args) -> dict[str, Any]:
    import jax

    import spmd
    from spmd.profile import profile_mesh

    began = time.perf_counter()
    data: dict[str, Any] = {"command": " ".join(["python", "bench/gpu.py", *sys.argv[1:]]),
                            "machine": machine(), "date": utc_date(), "rows": [], "plain": [],
                            "skipped": []}
    source = spmd.load_mesh(args.mesh)  # before jax starts: sets the CPU device count
    data["device"] = str(jax.devices()[0].device_kind)
    start = time.perf_counter()
    profiled = profile_mesh(source, quick=args.quick_profile)
    mesh = profiled.mesh()
    profile_path = args.out / f"{source.name}-profiled.yaml"
    profile_path.write_text(profiled.yaml())
    data["profile"] = {"path": str(profile_path), "seconds": time.perf_counter() - start,
                       "summary": profiled.summary(), "mesh": mesh.describe()}
    print(profiled.summary(), flush=True)
    write_json(data, args.out / "gpu.json")
    for key, cases, measure in (("rows", args.cases, measure_spmd),
                                ("plain", args.plain, measure_plain)):
        for case in cases:
            label = f"{_label(case[0], case[3])} {case[1]} x{case[2]}"
            if time.perf_counter() - began > args.budget:
                data["skipped"].append(f"{key}: {label}: past the {args.budget:.0f} s budget")
                continue
            try:
                row = measure(mesh, source.device, case, args.steps)
            except Exception as err:  # noqa: BLE001 - e.g. out of memory: record, go on
                data["skipped"].append(f"{key}: {label}: {type(err).__name__}: "
                                       f"{str(err).splitlines()[0][:300]}")
            else:
                data[key].append(row)
                print(json.dumps(row), flush=True)
            write_json(data, args.out / "gpu.json")
    return data


def _findings(data: dict[str, Any]) -> list[str]:
    """What the numbers say about the cost model and about spmd against plain JAX (read off
    the data, not typed in)."""
    out = []
    for r in data["rows"]:
        ratio = r["step_ms"] / r["predicted_ms"]
        verdict = "within" if 0.8 <= ratio <= 1.25 else "outside"
        out.append(f"- {r['model']} {r['dtype']}: measured / predicted {ratio:.2f} ({verdict} "
                   f"0.8-1.25); compiled / predicted memory "
                   f"{r['peak_memory_gib'] / r['predicted_memory_gib']:.2f}")
    for p in data["plain"]:
        same = [r for r in data["rows"] if r["model"] == p["model"] and r["dtype"] == p["dtype"]
                and r["batch"] == p["batch"]]
        base = p["model"].split()[0]
        auto = [r for r in data["rows"] if r["model"] == base and r["dtype"] == p["dtype"]
                and r["batch"] == p["batch"]]
        for r, what in [(r, "the same step through spmd") for r in same] + [
                (r, f"spmd's own choice ({r['remat']})") for r in auto]:
            out.append(f"- {p['model']} {p['dtype']}: {what} {r['tokens_per_s']:,.0f} tokens/s "
                       f"(MFU {r['mfu']:.3f}) against plain JAX's {p['tokens_per_s']:,.0f} "
                       f"(MFU {p['mfu']:.3f}): {r['tokens_per_s'] / p['tokens_per_s']:.2f}x")
    out += [f"- not run: {s}" for s in data["skipped"]]
    return out


def write_report(path: Path, results: Path = RESULTS_MD) -> None:
    """The RESULTS.md section (in ``results``) from a run's ``gpu.json`` at ``path``."""
    data = json.loads(path.read_text())
    headers = ["model", "dtype", "batch", "remat (spmd)", "step ms", "tokens/s",
               "model TFLOP/s", "MFU", "predicted ms", "measured / predicted", "peak GiB",
               "predicted GiB", "compile s"]
    rows = [[r["model"], r["dtype"], r["batch"], r["remat"], f"{r['step_ms']:.1f}",
             f"{r['tokens_per_s']:,.0f}", f"{r['achieved_tflops']:.1f}", f"{r['mfu']:.3f}",
             f"{r['predicted_ms']:.1f}", f"{r['step_ms'] / r['predicted_ms']:.2f}",
             f"{r['peak_memory_gib']:.2f}", f"{r['predicted_memory_gib']:.2f}",
             f"{r['compile_s']:.1f}"] for r in data["rows"]]
    plain = [[p["model"], p["dtype"], p["batch"], f"{p['step_ms']:.1f}",
              f"{p['tokens_per_s']:,.0f}", f"{p['achieved_tflops']:.1f}", f"{p['mfu']:.3f}",
              f"{p['peak_memory_gib']:.2f}", f"{p['compile_s']:.1f}"] for p in data["plain"]]
    body = [
        f"Command (on the lent GPU machine): `{data['command']}`; report written here with "
        f"`python bench/gpu.py --report <gpu.json>`.",
        f"Machine: {data['device']}; {machine_line(data['machine'])}. Date: {data['date']}.",
        "", f"Profiled in {data['profile']['seconds']:.0f} s (`{data['profile']['path']}`): "
        f"{data['profile']['summary']}", "", "Through spmd (auto, on the profiled mesh):", "",
        markdown_table(headers, rows), ""]
    if plain:
        body += ["The same steps hand-written in plain JAX (`jax.jit` of the split NNX state, "
                 "donated; no spmd):", "",
                 markdown_table(["model", "dtype", "batch", "step ms", "tokens/s",
                                 "model TFLOP/s", "MFU", "peak GiB", "compile s"], plain), ""]
    body += [
        "model TFLOP/s = the step's training FLOPs by the usual count (6 x parameters x tokens "
        "+ attention, `model_flops`; recompute not counted) / measured step time (the median "
        "after the first step, as `spmd run` reports it); MFU = that over the datasheet peak of the bundled "
        "mesh's device (989 TFLOP/s bf16 on H200), as the plain-JAX anchor's 48.4% was "
        "counted; predicted ms = the cost model's step time on the profiled mesh "
        "(`Plan.prediction`, one device: compute, memory traffic, kernel launches); peak GiB "
        "is `memory_analysis()` of the compiled step (`spmd.analyze`: arguments + outputs + "
        "temporaries - aliased), "
        "predicted GiB the search's liveness peak. Target (issue 13): measured / predicted "
        "within 0.8-1.25 for every case.", "", *_findings(data)]
    replace_section(TITLE, "\n".join(body), results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="h200-1", help="bundled mesh name or mesh file")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cases", type=lambda s: [parse_case(c) for c in s.split(",")],
                        default=CASES, help="comma list of model:dtype:batch[:field=value]")
    parser.add_argument("--plain", type=lambda s: [parse_case(c) for c in s.split(",") if c],
                        default=PLAIN, help="the same, run hand-written in plain JAX")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help="seconds after which no new case starts")
    parser.add_argument("--quick-profile", action="store_true",
                        help="spmd profile --quick: seconds, rougher figures")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    if args.report:
        write_report(args.report)
        return
    if args.out is None:
        parser.error("give --out DIR (on the GPU machine) or --report DIR/gpu.json (here)")
    args.out.mkdir(parents=True, exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
