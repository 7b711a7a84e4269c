"""Verification, part of the product: the searched plan and every applicable hand-written
plan compiled side by side, each judged as XLA compiled it (collective bytes, their time
priced by the cost model, memory), beside what the cost model predicted.

``check_compiled`` compiles one plan the same way and reads its memory against the
prediction and the device's memory (``spmd plan --compile``; ``describe_check`` says it).
``compare`` plans a step with ``method="auto"`` (every hand-written plan scored on the same
cost graph), compiles auto's plan and each hand-written one from abstract arguments (nothing
is allocated: a 64-GPU plan compiles on as many simulated CPU devices) and returns a
JSON-ready record; ``judge`` reads the ``CRITERIA`` off such a record (so a saved one can be
judged again); ``describe`` prints both. ``spmd compare`` is its command line.

Criteria:

  A. pred:  auto's predicted step time <= the best hand-written plan's (same cost model).
  B. bytes: auto's HLO collective bytes <= 1.05 x those of the best hand-written plan at no
            more memory per device (arguments + temporaries): no hand-written plan needing
            no more memory than auto moves fewer bytes. Reported beside it, "B strict": <= 1.05
            x the fewest bytes of any hand-written plan *and* memory <= that plan's (1% slack
            for XLA's buffer assignment), which a plan trading memory for time cannot meet.
  B comm: B with each compiled program's collectives priced by the cost model instead of
            counted in bytes (bytes over NVLink and over InfiniBand are not worth the same).
  C. model: auto's predicted collective bytes within 10% of its HLO-measured bytes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Mapping, Sequence

from spmd.analysis.report import Report, analyze
from spmd.api import plan, plan_manual, runnable
from spmd.logical import user_pins
from spmd.manual import DOES_NOT_APPLY, applicable_methods, manual_specs
from spmd.options import SearchOptions
from spmd.plan import Plan
from spmd.runtime.compile import prepare
from spmd.search.predict import Prediction
from spmd.stages.plan import PipelinePlan
from spmd.trace.signature import StepSignature
from spmd.units import readable_bytes

__all__ = ["CRITERIA", "CompileCheck", "check_compiled", "compare", "describe", "describe_check",
           "judge", "memory_bytes"]

BYTES_SLACK = 1.05      # criterion B
MEMORY_SLACK = 1.01     # criterion B strict: XLA's peak moves by a little between equivalent plans
PRED_TOLERANCE = 0.10   # criterion C
TIME_EPS = 1e-9         # criterion A: relative float slack

#: what each criterion checks (stored with every record)
CRITERIA = {"A": "auto predicted time <= best hand-written predicted time",
            "B": f"auto HLO bytes <= {BYTES_SLACK} x the fewest of the hand-written "
                 f"plans whose arg+temp memory is no more than auto's",
            "B_strict": f"auto HLO bytes <= {BYTES_SLACK} x fewest hand-written HLO "
                        f"bytes, auto arg+temp memory <= {MEMORY_SLACK} x that plan's",
            "B_comm": f"auto HLO collectives priced by the cost model <= "
                      f"{BYTES_SLACK} x the least of the hand-written plans whose "
                      f"arg+temp memory is no more than auto's",
            "C": f"|predicted / HLO bytes - 1| <= {PRED_TOLERANCE}"}


def memory_bytes(entry: Mapping[str, Any]) -> int | None:
    """Per-device memory of a measured program: arguments + temporaries. On CPU XLA's own
    peak_memory_in_bytes comes out at the argument bytes and leaves temporaries out, so the
    reported peak would miss activations; outputs are donated into the arguments."""
    mem = entry.get("memory")
    if mem:
        return mem["argument_bytes"] + mem["temp_bytes"]
    return entry.get("peak_bytes")


#: compiled memory over the plan priced as the compiling platform runs it, past which the
#: check names XLA:CPU's order as the likely cause (the memory benchmark's target)
MEMORY_TOLERANCE = 0.15


@dataclasses.dataclass(frozen=True)
class CompileCheck:
    """One plan compiled from its abstract arguments on as many simulated CPU devices as its
    mesh has (``check_compiled``); memory per device.

    Attributes:
      devices: the simulated devices it compiled on.
      seconds: the compile's.
      compiled_bytes: XLA's arguments + temporaries (``memory_bytes``).
      predicted_bytes: the plan's prediction, for its mesh's platform (None: not priced).
      as_cpu: the plan priced as XLA:CPU runs it (its collectives, on the same mesh), what
        the compile is comparable with; None for a CPU mesh (the prediction is that) or a
        plan not searched in this process.
      device_bytes: the memory of one of the mesh's devices.
      gpu_mesh: whether the mesh is another platform's, stood in for by CPU devices.
      report: what XLA:CPU compiled (``spmd.analyze``: its own collectives and memory).
    """

    devices: int
    seconds: float
    compiled_bytes: int
    predicted_bytes: float | None
    as_cpu: Prediction | None
    device_bytes: float
    gpu_mesh: bool
    report: Report | None = None

    @property
    def fits(self) -> bool:
        return self.compiled_bytes <= self.device_bytes

    @property
    def as_cpu_bytes(self) -> float | None:
        return None if self.as_cpu is None else self.as_cpu.memory_bytes


#: XLA:CPU options for a compile that is read (its memory and collectives), never run: no
#: optimized machine code (gpt-1.3b planned for 8 A100s, on 8 CPU devices: 62 s instead of
#: 69, the same bytes)
CHECK_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def check_compiled(p: Plan | PipelinePlan) -> CompileCheck:
    """Compile ``p`` (shapes only: nothing is allocated) on the CPU devices of this process
    (with ``CHECK_OPTIONS``) and read its memory. A ``Plan`` gets what XLA emitted attached
    (``Plan.attach_measured``: ``describe()`` then shows predicted against compiled
    collectives); a pipeline is one program only under the SPMD runtime.

    Raises:
      ValueError: ``p`` is a pipeline of the MPMD runtime (its message says why it is not
        compiled here).
      MeshError: this process has fewer CPU devices than the mesh (set before jax starts:
        ``spmd.cluster.devices.set_cpu_device_count``).
    """
    if isinstance(p, PipelinePlan) and p.runtime != "spmd":
        raise ValueError("this pipeline runs a program per stage and phase (the MPMD "
                         "runtime), compiled when it runs (`spmd run`); one-program plans "
                         "are checked here (--max-stages 1, or a scanned model's SPMD "
                         "pipeline)")
    start = time.perf_counter()
    on_cpu = p.mesh.compile_backend == "cpu"
    report = analyze(runnable(p, compiler_options=CHECK_OPTIONS if on_cpu else None).compile())
    seconds = time.perf_counter() - start
    if isinstance(p, Plan):
        p.attach_measured(report)
        record = p.measured
    else:
        record = report.record(p.mesh)
    gpu_mesh = p.mesh.platform != "cpu"
    return CompileCheck(devices=p.mesh.size, seconds=seconds,
                        compiled_bytes=memory_bytes(record),
                        predicted_bytes=None if p.prediction is None
                        else p.prediction.memory_bytes,
                        as_cpu=p.priced_on("cpu") if gpu_mesh and isinstance(p, Plan) else None,
                        device_bytes=p.mesh.device.memory_bytes, gpu_mesh=gpu_mesh,
                        report=report)


def describe_check(c: CompileCheck) -> str:
    """The check in words: compiled memory beside the prediction and the device's memory,
    and, where XLA:CPU needed much more than the plan as XLA:CPU runs it, why."""
    size = readable_bytes
    predicted = ("no prediction" if not c.predicted_bytes else
                 f"predicted {size(c.predicted_bytes)} (compiled / predicted = "
                 f"{c.compiled_bytes / c.predicted_bytes:.2f})")
    lines = [f"compiled on {c.devices} simulated CPU devices (XLA:CPU, shapes only) in "
             f"{c.seconds:.0f} s: {size(c.compiled_bytes)} per device (arguments + "
             f"temporaries); {predicted}"]
    if c.as_cpu_bytes:
        lines.append(f"the plan priced as XLA:CPU runs it: {size(c.as_cpu_bytes)} (compiled / "
                     f"that = {c.compiled_bytes / c.as_cpu_bytes:.2f})")
    over = c.compiled_bytes - c.device_bytes
    lines.append(f"device memory {size(c.device_bytes)}: the compiled step "
                 + ("fits" if c.fits else f"needs {size(over)} more"))
    reference = c.as_cpu_bytes or c.predicted_bytes
    if reference and c.compiled_bytes > (1 + MEMORY_TOLERANCE) * reference:
        lines.append(
            "XLA:CPU schedules a program with collectives breadth-first, for concurrency, "
            "even where that needs more memory than its memory-minded order: each op, "
            "collectives included, runs as soon as its operands exist and its result waits "
            "for its reader; "
            + ("this compile stands in for the GPUs, whose memory only their own compile "
               "checks: its step inputs' reshards and transposed matmul operands wait for "
               "their readers and its gradient sums are buffers of their own, as there; the "
               "rest run as early as XLA:CPU can, where spmd's prediction keeps them in "
               "program order"
               if c.gpu_mesh else
               "spmd prices that for the copies of the step's inputs (weights gathered or "
               "transposed at the start), not for the rest, which it keeps in program "
               "order"))
    return "\n".join(lines)


def compare(step_fn: Callable, *args: Any, mesh, options: SearchOptions | None = None,
            logical_axes: Any = None, batch_argnums: Sequence[int] | None = None,
            auto: Plan | None = None) -> dict[str, Any]:
    """Plan ``step_fn`` with ``method="auto"`` (or take ``auto``, its plan for these
    arguments), compile it and every applicable hand-written plan from ``args`` (abstract or
    concrete; only shapes are used) and measure each.

    Returns a JSON-ready record: auto's ``prediction``, ``search`` and ``alternatives`` (the
    hand-written plans' scores), ``auto_hlo`` (its compiled program measured), ``manual``
    (per hand-written method: measured, why it does not apply, or its compile error),
    and ``plan_s`` (the planning phases' seconds, ``Plan.search["timings"]``); ``judge``
    reads the criteria off it.
    """
    kwargs = dict(logical_axes=logical_axes, batch_argnums=batch_argnums)
    options = options or SearchOptions()
    # one program each, compiled and measured: auto's single-stage plan, not a pipeline
    options = dataclasses.replace(options, pipeline=dataclasses.replace(
        options.pipeline, max_stages=1, min_stages=1))
    if auto is None:
        auto = plan(step_fn, *args, mesh=mesh, method="auto", options=options, **kwargs)
    pins = user_pins(auto.leaves, options.logical_rules(), mesh)
    # every hand-written plan from auto's trace (one loaded from JSON has none: traced once)
    sig = (auto.signature if auto.signature is not None
           else StepSignature(step_fn, args, **kwargs))
    manual_options = dataclasses.replace(options, compare=False)  # the user's rules, no scoring
    out: dict[str, Any] = {
        "plan_s": sum((auto.search or {}).get("timings", {}).values()),
        "prediction": auto.prediction.to_dict(), "search": auto.search,
        "alternatives": {k: v if isinstance(v, str) else v.to_dict()
                         for k, v in auto.alternatives.items()},
        "auto_specs": {l.path: [list(a) for a in s] for l, s in zip(auto.leaves, auto.input_specs)},
        "auto_state_bytes": auto.bytes_by_kind(),
    }
    start = time.perf_counter()
    out["auto_hlo"] = analyze(prepare(auto).compile()).record(mesh)
    out["auto_compile_s"] = time.perf_counter() - start
    manual: dict[str, Any] = {}
    for method, why_not in applicable_methods(auto.leaves, mesh, pins).items():
        if why_not:
            manual[method] = {"applicable": False, "reason": why_not}
            continue
        # A plan whose every input stays whole on every device (e.g. tp on 8x1: the model
        # axis has size 1) runs the whole step on each device: no collectives, no speed-up.
        specs = manual_specs(auto.leaves, method, mesh, pins)
        splits = any(mesh.axis_size(tuple(axes)) > 1 for spec in specs for axes in spec if axes)
        try:
            start = time.perf_counter()
            report = analyze(prepare(plan_manual(sig, mesh, method,
                                                 manual_options)).compile())
            manual[method] = {"applicable": True, "splits": splits,
                              "compile_s": time.perf_counter() - start, **report.record(mesh)}
        except Exception as err:  # noqa: BLE001 - recorded, the other plans still compile
            manual[method] = {"applicable": True, "splits": splits,
                              "error": f"{type(err).__name__}: {err}"}
    out["manual"] = manual
    out["devices"] = mesh.size
    return out


def _dominated(auto_value: float, manual_values: Mapping[str, float],
               compiled: Mapping[str, Any], auto_peak: float | None) -> list[str]:
    """Hand-written plans that beat auto on both: a measure (bytes or priced communication)
    below auto's beyond the 5% slack, at no more memory than auto needs."""
    return sorted(
        k for k, value in manual_values.items()
        if auto_value > BYTES_SLACK * value
        and (auto_peak is None or memory_bytes(compiled[k]) is None
             or memory_bytes(compiled[k]) <= auto_peak))


def _splits(entry: Mapping[str, Any], record: Mapping[str, Any]) -> bool:
    if "splits" in entry:
        return bool(entry["splits"])
    # older records: a train step split over >1 device always needs some collective
    return entry["total_collective_bytes"] > 0 or record.get("devices", 1) <= 1


def judge(record: Mapping[str, Any]) -> dict[str, Any]:
    """The table row and the ``CRITERIA`` for one ``compare`` record."""
    s: dict[str, Any] = {}
    pred = record["prediction"]
    s["auto_pred_s"] = pred["total_time"]
    scored = {k: v for k, v in record["alternatives"].items() if isinstance(v, dict)}
    s["not_scored"] = {k: v for k, v in record["alternatives"].items()
                       if isinstance(v, str) and not v.startswith(DOES_NOT_APPLY)}
    if scored:
        name = min(scored, key=lambda k: scored[k]["total_time"])
        s["best_manual_pred"] = (name, scored[name]["total_time"])
    else:
        s["best_manual_pred"] = None
    auto_hlo = record["auto_hlo"]
    s["auto_hlo_bytes"] = auto_hlo["total_collective_bytes"]
    s["auto_peak"] = memory_bytes(auto_hlo)
    compiled = {k: v for k, v in record["manual"].items()
                if v.get("applicable") and "error" not in v}
    # Hand-written plans that split nothing on this mesh (every device runs the whole step)
    # move no bytes but are no parallel plan: left out of the bytes comparison.
    s["replicated_manual"] = sorted(k for k, v in compiled.items() if not _splits(v, record))
    compiled = {k: v for k, v in compiled.items() if k not in s["replicated_manual"]}
    s["manual_errors"] = {k: v["error"] for k, v in record["manual"].items() if "error" in v}
    if compiled:
        name = min(compiled, key=lambda k: (compiled[k]["total_collective_bytes"],
                                            memory_bytes(compiled[k]) or 0))
        s["best_manual_hlo"] = (name, compiled[name]["total_collective_bytes"],
                                memory_bytes(compiled[name]))
    else:
        s["best_manual_hlo"] = None
    s["auto_hlo_comm_s"] = auto_hlo.get("comm_time")
    priced = {k: v["comm_time"] for k, v in compiled.items() if v.get("comm_time") is not None}
    s["best_manual_hlo_comm"] = min(priced.items(), key=lambda kv: kv[1]) if priced else None
    pb = float(sum(b for _, b in pred["collectives"].values()))
    s["pred_bytes"] = pb
    hb = s["auto_hlo_bytes"]
    s["pred_over_hlo"] = (pb / hb) if hb else (1.0 if pb == 0 else math.inf)
    # A: predicted time
    s["A"] = (None if s["best_manual_pred"] is None
              else s["auto_pred_s"] <= s["best_manual_pred"][1] * (1 + TIME_EPS))
    # B: HLO bytes at no more memory: fails exactly when a hand-written plan beats auto on
    # both (``dominated_by``); holds when none needs as little memory as auto.
    if s["best_manual_hlo"] is None:
        s["B"] = s["B_strict"] = None
    else:
        s["dominated_by"] = _dominated(
            hb, {k: v["total_collective_bytes"] for k, v in compiled.items()}, compiled,
            s["auto_peak"])
        s["B"] = not s["dominated_by"]
        # Stricter: against the fewest-bytes hand-written plan whatever its memory, auto
        # must match its bytes *and* its memory (fails wherever auto trades one for speed).
        _, mb, mpeak = s["best_manual_hlo"]
        s["B_strict"] = hb <= BYTES_SLACK * mb and (
            s["auto_peak"] is None or mpeak is None or s["auto_peak"] <= MEMORY_SLACK * mpeak)
    auto_comm = s["auto_hlo_comm_s"]
    if auto_comm is None or not priced:
        s["B_comm"] = None
    else:
        s["comm_dominated_by"] = _dominated(auto_comm, priced, compiled, s["auto_peak"])
        s["B_comm"] = not s["comm_dominated_by"]
    # C: predicted vs measured bytes
    s["C"] = abs(s["pred_over_hlo"] - 1.0) <= PRED_TOLERANCE
    return s


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def describe(record: Mapping[str, Any], width: int = 120) -> str:
    """A readable table of a ``compare`` record: every plan predicted and compiled, and the
    criteria."""
    import io

    from rich.console import Console
    from rich.table import Table

    console = Console(file=io.StringIO(), width=width, force_terminal=False)
    table = Table(title="auto and hand-written plans, as XLA compiled them (per device)")
    for col in ("plan", "pred ms", "HLO MiB", "HLO comm ms", "mem MiB", "note"):
        table.add_column(col, justify="left" if col in ("plan", "note") else "right")

    def row(name: str, pred: Any, hlo: Mapping[str, Any] | None, note: str = "") -> None:
        mib = lambda n: "" if n is None else f"{n / 2**20:.3f}"  # noqa: E731
        table.add_row(name, f"{pred['total_time'] * 1e3:.3f}" if isinstance(pred, dict) else "",
                      mib(hlo and hlo["total_collective_bytes"]),
                      "" if not hlo or hlo.get("comm_time") is None else f"{hlo['comm_time'] * 1e3:.3f}",
                      mib(hlo and memory_bytes(hlo)), note)

    row("auto", record["prediction"], record["auto_hlo"])
    for name, entry in record["manual"].items():
        pred = record["alternatives"].get(name)
        if not entry.get("applicable"):
            row(name, None, None, entry.get("reason", ""))
        elif "error" in entry:
            row(name, pred, None, entry["error"])
        else:
            row(name, pred, entry, "" if isinstance(pred, dict) else str(pred or ""))
    console.print(table)
    s = judge(record)
    console.print("criteria: " + ", ".join(f"{k} {_mark(s.get(k))}" for k in CRITERIA)
                  + (f"; dominated by {', '.join(s['dominated_by'])}"
                     if s.get("dominated_by") else ""))
    for k, text in CRITERIA.items():
        console.print(f"  {k}: {text}")
    return console.file.getvalue()
