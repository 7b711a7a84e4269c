"""`spmd run | plan | compare | models | meshes | launch`: the command line.

User errors (a bad mesh file, an unknown model, a dimension that cannot be split) print one
message and exit with status 2, without a traceback.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from spmd.errors import SpmdError
from spmd.options import SearchOptions

app = typer.Typer(add_completion=False,
                  help="spmd: searched sharding plans for JAX/Flax training steps.")

DEFAULT_MESH = "cpu-8"  # a bundled mesh: spmd/meshes/cpu-8.yaml
DEFAULT_MODEL = "gpt-tiny"
#: the search's defaults, one place (``spmd.options``)
DEFAULT_TIME_LIMIT = SearchOptions.time_limit


def _error(message: str) -> None:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)


def _fail(message: str) -> None:
    _error(message)
    raise typer.Exit(code=2)


def _model(name: str):
    from spmd import zoo

    try:
        return zoo.get(name)
    except zoo.UnknownModelError as err:
        _fail(str(err))


def _say(message: str) -> None:
    """Print from one process only, so multi-process logs stay readable."""
    import jax

    if jax.process_index() == 0:
        typer.echo(message)


@app.command()
def run(
    model: str = typer.Option(DEFAULT_MODEL, help="model name (see `spmd models`)"),
    mesh: str = typer.Option(DEFAULT_MESH, help="bundled mesh name (see `spmd meshes`) or "
                             "a mesh file"),
    method: str = typer.Option("auto", help="auto (searched), or dp, zero, fsdp, tp, dp_tp, "
                               "fsdp_tp, ep"),
    time_limit: float = typer.Option(DEFAULT_TIME_LIMIT, help="seconds the sharding search may take"),
    memory_budget: Optional[float] = typer.Option(None, help="bytes per device (auto)"),
    steps: int = typer.Option(20, min=1, help="training steps"),
    batch_size: Optional[int] = typer.Option(None, help="global batch size (model default)"),
    seed: int = typer.Option(0, help="initialization and data seed"),
    describe: bool = typer.Option(False, help="list every tensor in the plan table"),
    output_json: Optional[Path] = typer.Option(None, help="write losses and the report here"),
) -> None:
    """Train a zoo model for a few steps under a plan; report losses, speed and the HLO."""
    import spmd

    device_mesh = spmd.load_mesh(mesh)  # before jax starts: sets the CPU device count
    spmd.init_distributed(device_mesh)
    import jax
    import numpy as np
    from flax import nnx
    from rich.progress import Progress

    spec = _model(model)
    size = batch_size or spec.default_batch_size

    def create():
        return spec.training_state(seed)

    abstract_model, abstract_opt = nnx.eval_shape(create)
    batch = spec.batch(size, seed)
    options = spmd.SearchOptions(time_limit=time_limit, memory_budget=memory_budget)
    step = spmd.parallelize(spec.train_step, mesh=device_mesh, method=method, options=options)
    plan = step.plan_for(abstract_model, abstract_opt, batch)
    net, opt = spmd.materialize(create, plan)
    # Each process reads only its rows, as a real input pipeline would.
    local_batch = spmd.shard_batch(plan, spmd.process_local_batch(plan, batch))
    compiled = step.compile(net, opt, local_batch)  # the executable the steps below run
    report = spmd.analyze(compiled)
    plan.attach_measured(report)
    _say(device_mesh.describe())
    _say(f"model {spec.name}: {spec.param_count():,} parameters; method {method}; "
         f"global batch {size}")
    losses: list[float] = []
    times: list[float] = []
    with Progress(disable=jax.process_index() != 0, transient=True) as progress:
        task = progress.add_task("training", total=steps)
        for i in range(steps):
            start = time.perf_counter()
            metrics = step(net, opt, local_batch)
            loss = float(np.asarray(jax.device_get(metrics["loss"])))
            times.append(time.perf_counter() - start)
            losses.append(loss)
            progress.update(task, advance=1, description=f"step {i + 1} loss {loss:.4f}")
            progress.console.print(f"step {i + 1:4d}  loss {loss:.6f}  {times[-1] * 1e3:8.1f} ms")
    steady = times[1:] or times
    step_time = float(np.median(steady))
    per_second = spec.items_per_batch(size) / step_time
    _say(f"step time {step_time * 1e3:.1f} ms (median after the first), "
         f"{per_second:,.0f} {spec.unit}/s")
    _say(plan.describe(max_rows=None if describe else 12))
    _say(report.describe())
    if output_json is not None and jax.process_index() == 0:
        output_json.write_text(json.dumps({
            "model": spec.name, "mesh": device_mesh.name, "method": method, "losses": losses,
            "step_time": step_time, f"{spec.unit}_per_second": per_second,
            "report": report.to_dict()}, indent=1))


@app.command("plan")
def plan_cmd(
    model: str = typer.Option(DEFAULT_MODEL, help="model name (see `spmd models`)"),
    mesh: str = typer.Option(DEFAULT_MESH, help="bundled mesh name or a mesh file; planned as "
                             "a virtual mesh"),
    method: str = typer.Option("auto", help="plan to show: auto or a hand-written one"),
    batch_size: Optional[int] = typer.Option(None, help="global batch size (model default)"),
    time_limit: float = typer.Option(DEFAULT_TIME_LIMIT, help="seconds the sharding search may take"),
    memory_budget: Optional[float] = typer.Option(None, help="bytes per device (auto)"),
    save: Optional[Path] = typer.Option(None, help="save the plan as JSON"),
) -> None:
    """Plan without running anything: any mesh, even a cluster you do not have."""
    import spmd

    device_mesh = spmd.load_mesh(mesh, virtual=True)
    from flax import nnx

    spec = _model(model)
    size = batch_size or spec.default_batch_size

    abstract_model, abstract_opt = nnx.eval_shape(spec.training_state)
    abstract_batch = jax_abstract(spec.batch, size)
    options = spmd.SearchOptions(time_limit=time_limit, memory_budget=memory_budget)
    plan = spmd.plan(spec.train_step, abstract_model, abstract_opt, abstract_batch,
                     mesh=device_mesh, method=method, options=options)
    typer.echo(f"model {spec.name}: {spec.param_count():,} parameters, global batch {size}")
    typer.echo(plan.describe())
    if save:
        plan.save(save)
        typer.echo(f"saved {save}")


@app.command()
def compare(
    model: str = typer.Option(DEFAULT_MODEL, help="model name (see `spmd models`)"),
    mesh: str = typer.Option(DEFAULT_MESH, help="bundled mesh name or a mesh file; compiled "
                             "on as many simulated CPU devices"),
    batch_size: Optional[int] = typer.Option(None, help="global batch size (model default)"),
    time_limit: float = typer.Option(DEFAULT_TIME_LIMIT, help="seconds the sharding search may take"),
    output_json: Optional[Path] = typer.Option(None, help="write the comparison here"),
) -> None:
    """Auto beside every hand-written plan, each compiled: predicted and measured, judged."""
    import spmd
    from spmd.analysis import verify
    from spmd.cluster.devices import set_cpu_device_count

    device_mesh = spmd.load_mesh(mesh, virtual=True)
    # compiled, not run: on as many simulated CPU devices
    set_cpu_device_count(device_mesh.size, f"`spmd compare` on mesh {device_mesh.name!r}")
    from flax import nnx

    spec = _model(model)
    size = batch_size or spec.default_batch_size

    args = (*nnx.eval_shape(spec.training_state), jax_abstract(spec.batch, size))
    record = verify.compare(spec.train_step, *args, mesh=device_mesh,
                            options=spmd.SearchOptions(time_limit=time_limit))
    typer.echo(f"model {spec.name}: {spec.param_count():,} parameters, global batch {size}; "
               f"{device_mesh.describe()}")
    typer.echo(verify.describe(record))
    if output_json is not None:
        output_json.write_text(json.dumps(record, indent=1, default=str))


def jax_abstract(make_batch, size: int):
    """The batch's shapes without computing it (planning a 64-GPU job on a laptop)."""
    import jax

    return jax.eval_shape(lambda: make_batch(size, 0))


@app.command()
def models() -> None:
    """List the model zoo."""
    from spmd import zoo
    from rich.console import Console
    from rich.table import Table

    table = Table(title="models")
    for col in ("name", "family", "parameters", "default batch", "unit"):
        table.add_column(col)
    for name in zoo.names():
        spec = zoo.get(name)
        table.add_row(name, spec.family, f"{spec.param_count():,}",
                      str(spec.default_batch_size), spec.unit)
    Console().print(table)


@app.command()
def meshes(directory: Optional[Path] = typer.Option(
        None, help="also list the mesh files (*.yaml) in this folder")) -> None:
    """List the bundled meshes (use them by name: --mesh cpu-8), and your own in a folder."""
    import spmd
    from spmd.cluster.mesh import bundled_meshes

    for name, path in bundled_meshes().items():
        typer.echo(f"{name}: {spmd.load_mesh(path, virtual=True).describe()}")
    if directory is not None:
        files = sorted(directory.glob("*.yaml"))
        if not files:
            _fail(f"--directory {directory}: no mesh files (*.yaml) there")
        for path in files:
            typer.echo(f"{path}: {spmd.load_mesh(path, virtual=True).describe()}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    n: int = typer.Option(2, "-n", min=1, help="number of local processes"),
    port: int = typer.Option(0, help="coordinator port (0: pick a free one)"),
) -> None:
    """Start N local processes of a command, joined by jax.distributed (testing multi-host).

    Example: spmd launch -n 2 -- spmd run --mesh cpu-2x4
    """
    from spmd.cluster.distributed import launch_local

    command = list(ctx.args)
    if not command:
        _fail("give the command to launch after `--`, e.g. spmd launch -n 2 -- spmd run")
    raise typer.Exit(code=launch_local(command, n, port))


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry point. User errors, spmd's and the command line's own (an unknown option
    or command, a bad value), become one line on stderr and exit status 2; no arguments show
    the help."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        code = app(args=args or ["--help"], prog_name="spmd", standalone_mode=False)
    except SpmdError as err:
        _error(str(err))
        sys.exit(2)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except typer.Abort:
        sys.exit(1)
    except typer.TyperException as err:  # usage errors (exit_code 2), raised unprinted here
        ctx = getattr(err, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        _error(f"{err.format_message().rstrip('.')}{hint}")
        sys.exit(err.exit_code)
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
