"""Helpers shared by the benchmarks in bench/: the machine, the date, markdown tables and
RESULTS.md sections.

Each benchmark owns one ``## `` section of ``bench/RESULTS.md`` (found by its exact title)
and rewrites only that section, so benchmarks can be rerun independently:

    from common import machine, replace_section, markdown_table   # run as a script
    replace_section(RESULTS, "## Hand-written plans on cpu-8 (bench/manual_plans.py)", body)
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_MD = BENCH_DIR / "RESULTS.md"
RESULTS_DIR = BENCH_DIR / "results"

_HEADER = "# Benchmark results\n\nEach section is written by the benchmark named in its title; rerun it to refresh.\n"

MiB = 1024 * 1024


def machine() -> dict[str, Any]:
    """What ran the benchmark: OS, CPU count and library versions (jax imported lazily)."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        import jax
        import jaxlib

        info["jax"] = jax.__version__
        info["jaxlib"] = jaxlib.__version__
    except ImportError:  # pragma: no cover - every benchmark here uses jax
        pass
    return info


def machine_line(info: dict[str, Any] | None = None) -> str:
    """One markdown line describing the machine."""
    info = info or machine()
    parts = [f"`{info['platform']}`", f"{info['cpu_count']} CPUs", f"python {info['python']}"]
    for lib in ("jax", "jaxlib"):
        if lib in info:
            parts.append(f"{lib} {info[lib]}")
    return ", ".join(parts)


def utc_date() -> str:
    """The date as ``date -u`` prints it, e.g. ``Tue Mar  4 12:00:00 UTC 2025``."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%a %b ") + f"{now.day:2d}" + now.strftime(" %H:%M:%S UTC %Y")


def command_line(script: str | None = None, argv: Sequence[str] | None = None) -> str:
    """The command that ran this benchmark, as one copy-pasteable line from the repo root."""
    argv = list(sys.argv if argv is None else argv)
    if script is None:
        path = Path(argv[0]).resolve()
        try:
            script = str(path.relative_to(REPO_ROOT))
        except ValueError:
            script = argv[0]
    return shlex.join(["python", script, *argv[1:]])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
                   align: Sequence[str] | None = None) -> str:
    """A GitHub markdown table; ``align`` holds "l" or "r" per column (default: text left,
    numbers right, judged from the first row)."""
    if align is None:
        first = rows[0] if rows else [""] * len(headers)
        align = ["r" if isinstance(v, (int, float)) or _numeric(v) else "l" for v in first]
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        out = []
        for v, w, a in zip(values, widths, align):
            out.append(v.rjust(w) if a == "r" else v.ljust(w))
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2))
                         for w, a in zip(widths, align)) + "|"
    return "\n".join([line(list(headers)), sep, *(line(r) for r in cells)])


def _numeric(v: Any) -> bool:
    try:
        float(str(v).rstrip("x%"))
        return True
    except ValueError:
        return False


def _cell(v: Any) -> str:
    if v is None:
        return ""
    return str(v).replace("|", "\\|").replace("\n", " ")


def replace_section(title: str, body: str, path: Path = RESULTS_MD) -> None:
    """Replace (or append) the ``## `` section called ``title`` in ``path``, keeping the rest.

    ``title`` is the heading line, with or without the leading ``## ``. The section runs to
    the next ``## `` heading (or a ``# `` one) or the end of the file. ``body`` is the text
    under the heading.
    """
    heading = title if title.startswith("## ") else f"## {title}"
    text = path.read_text() if path.exists() else _HEADER
    lines = text.splitlines()
    new_section = [heading, "", *body.strip("\n").splitlines(), ""]
    start = next((i for i, l in enumerate(lines) if l.rstrip() == heading), None)
    if start is None:
        while lines and not lines[-1].strip():
            lines.pop()
        lines += ["", *new_section]
    else:
        end = start + 1
        while end < len(lines) and not lines[end].startswith(("## ", "# ")):
            end += 1
        lines[start:end] = new_section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip("\n") + "\n")


def add_output_arguments(parser: Any, name: str) -> None:
    """``--output`` and ``--results-md``, the same for every benchmark (see ``outputs``)."""
    parser.add_argument("--output", type=Path, default=None,
                        help=f"JSON output (default bench/results/{name}.json)")
    parser.add_argument("--results-md", type=Path, default=None,
                        help="markdown file to update (default bench/RESULTS.md unless "
                             "--output is given)")


def outputs(args: Any, name: str, default_json: Path | None = None) -> tuple[Path, Path | None]:
    """Where a run writes its JSON and which RESULTS.md it updates (None: none): a run sent
    elsewhere with ``--output`` leaves bench/RESULTS.md alone unless ``--results-md`` says."""
    out = args.output or default_json or RESULTS_DIR / f"{name}.json"
    md = args.results_md or (RESULTS_MD if args.output is None else None)
    return out, md


def write_json(data: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")


def publish(data: dict, out_json: Path, md: Path | None, section: str,
            render: Callable[[dict], str]) -> None:
    """Write a run's JSON, its section of ``md`` (None: no markdown) and print the section."""
    write_json(data, out_json)
    text = render(data)
    if md is not None:
        replace_section(section, text, md)
    print(text)


def run_worker(work: Callable[[], dict], context: dict, result_path: Path | None) -> int:
    """Run one benchmark case in this (sub)process and hand its result to the driver as JSON;
    an exception becomes a recorded error, so one broken case never stops a run."""
    try:
        result = work()
    except Exception as err:  # noqa: BLE001 - reported by the driver
        result = {**context, "error": f"{type(err).__name__}: {err}",
                  "traceback": traceback.format_exc()}
    text = json.dumps(result, default=str)
    if result_path:
        result_path.write_text(text)
    else:
        print(text)
    return 0


def run_in_subprocess(script: str, model: str, mesh: str, extra: Sequence[str],
                      timeout: float) -> dict[str, Any]:
    """One (model, mesh) case of ``script`` in a process of its own (``--worker MODEL
    MESH --result FILE`` plus ``extra``), its result read back; a case that runs over
    ``timeout`` seconds or writes nothing is an error entry, so the run goes on."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "case.json"
        cmd = [sys.executable, script, "--worker", model, mesh, *extra, "--result", str(result)]
        try:
            subprocess.run(cmd, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return {"model": model, "mesh": mesh, "error": f"over {timeout:.0f} s"}
        if not result.exists():
            return {"model": model, "mesh": mesh, "error": "the worker wrote no result"}
        return json.loads(result.read_text())


def run_grid(script: str, argv: Sequence[str] | None, models: Sequence[str],
             meshes: Sequence[str], run_case: Callable[[str, str], dict], out_json: Path,
             md: Path | None, section: str, render: Callable[[dict], str]) -> None:
    """Every (model, mesh) case in turn, the run's JSON and markdown section written after
    each (what is done so far survives a run cut short)."""
    data = {"cases": [], "date": utc_date(), "machine": machine(),
            "command": command_line(script, None if argv is None
                                    else [Path(script).name, *argv])}
    for model in models:
        for mesh in meshes:
            data["cases"].append(run_case(model, mesh))
            publish(data, out_json, md, section, render)


def grid_main(args: Any, argv: Sequence[str] | None, script: str, name: str, section: str,
              render: Callable[[dict], str], devices: Callable[[str], int],
              work: Callable[[str, str], dict],
              extra: Callable[[str, str], list[str]] = lambda model, mesh: []) -> int:
    """The main of a benchmark over (model, mesh) cases (``add_grid_arguments`` parsed into
    ``args``): as ``--worker``, one case's ``work`` on ``devices(mesh)`` simulated CPU devices
    (set before jax starts); with ``--report``, an earlier run rendered again; else every
    case in a subprocess of its own (``run_in_subprocess``, with ``extra(model, mesh)``
    arguments), the results published as they come (``run_grid``)."""
    if args.worker:
        from spmd.cluster.devices import set_cpu_device_count

        model, mesh = args.worker
        set_cpu_device_count(devices(mesh), script)
        return run_worker(lambda: work(model, mesh), {"model": model, "mesh": mesh},
                          args.result)
    out_json, md = outputs(args, name)
    if args.report:
        publish(json.loads(args.report.read_text()), out_json, md, section, render)
        return 0
    path = str(REPO_ROOT / script)
    run_grid(script, argv, args.models.split(","), args.meshes.split(","),
             lambda model, mesh: run_in_subprocess(path, model, mesh, extra(model, mesh),
                                                   args.case_timeout),
             out_json, md, section, render)
    return 0


def add_grid_arguments(parser: Any, name: str, models: Sequence[str],
                       meshes: Sequence[str], case_timeout: float = 1800) -> None:
    """The arguments of a benchmark over (model, mesh) cases run in subprocesses
    (``run_grid``): which cases, their time limit, the worker's own (hidden), ``--report``
    and the outputs (``add_output_arguments``)."""
    import argparse

    parser.add_argument("--models", default=",".join(models))
    parser.add_argument("--meshes", default=",".join(meshes))
    parser.add_argument("--case-timeout", type=float, default=case_timeout)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "MESH"), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, metavar="JSON",
                        help="render an earlier run's JSON again, running nothing")
    add_output_arguments(parser, name)

