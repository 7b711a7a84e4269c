"""`spmd run | plan | compare | profile | models | meshes | launch`: the command line.

A step is a zoo model's (``--model``) or the user's own (``--step module:function``, see
``spmd.user_step``). User errors (a bad mesh file, an unknown model or option, a dimension that
cannot be split) print one message and exit with status 2, without a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional

import typer

from spmd.cluster.mesh import DeviceMesh
from spmd.errors import SpmdError
from spmd.options import SearchOptions
from spmd.runtime.host_memory import fresh_memory_note, touched_pages
from spmd.timing import median_step

app = typer.Typer(add_completion=False,
                  help="spmd: searched sharding plans for JAX/Flax training steps.")

DEFAULT_MESH = "cpu-8"  # a bundled mesh: spmd/meshes/cpu-8.yaml
DEFAULT_MODEL = "gpt-tiny"
#: the search's defaults, one place (``spmd.options``)
DEFAULT_TIME_LIMIT = SearchOptions.time_limit
STEP_HELP = ("your own step instead of a zoo model: module:function returning (step_fn, args) "
             "(see README); the current directory is importable")


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


def _check_step_options(model: Optional[str], step_ref: Optional[str],
                        batch_size: Optional[int]) -> None:
    """A step is a zoo model's or the user's own (``--step``), never both."""
    if step_ref is None:
        return
    if model is not None:
        _fail("--model and --step are mutually exclusive: name a zoo model or your own step")
    if batch_size is not None:
        _fail("--batch-size sizes a zoo model's batch; with --step, make() returns the batch")


def _abstract_step(model: Optional[str], step_ref: Optional[str], batch_size: Optional[int]
                   ) -> tuple[Callable, tuple, str]:
    """The step to plan, its arguments (shapes suffice) and a line naming it: a zoo model's
    train step, or the user's own (``spmd.user_step``)."""
    if step_ref is not None:
        from spmd.user_step import load_step

        step_fn, args = load_step(step_ref, concrete=False)
        return step_fn, args, f"step {step_ref}"
    from flax import nnx

    spec = _model(model or DEFAULT_MODEL)
    size = batch_size or spec.default_batch_size
    args = (*nnx.eval_shape(spec.training_state), jax_abstract(spec.batch, size))
    return (spec.train_step, args,
            f"model {spec.name}: {spec.param_count():,} parameters, global batch {size}")


@contextlib.contextmanager
def _working(what: str) -> Iterator[None]:
    """A spinner and the seconds elapsed while ``what`` runs (a search can take a minute),
    on stderr and gone when done; only on a terminal and in the first process, so logs and
    captured output stay as they were."""
    import jax
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True,
                  disable=not console.is_terminal or jax.process_index() != 0) as progress:
        progress.add_task(what, total=None)
        yield


@dataclasses.dataclass
class _Steps:
    """What ``_train`` measured: each step's loss (None where its metrics hold none), its
    seconds, and the bytes of fresh host pages it touched (None where the system does not
    count them)."""

    losses: list[Optional[float]]
    times: list[float]
    fresh_bytes: list[Optional[int]]

    @property
    def step_time(self) -> float:
        """The step time reported: the median after the first step (``median_step``)."""
        return median_step(self.times)

    @property
    def fresh_per_step(self) -> Optional[float]:
        """Fresh host pages a step touched (bytes; the median after the first step)."""
        return None if None in self.fresh_bytes else median_step(self.fresh_bytes)


def _train(call: Callable[[], Any], steps: int) -> _Steps:
    """Run ``call`` (one step, returning its metrics) ``steps`` times under a progress bar."""
    import jax
    from rich.progress import Progress

    from spmd.user_step import loss_of

    done = _Steps([], [], [])
    with Progress(disable=jax.process_index() != 0, transient=True) as progress:
        task = progress.add_task("training", total=steps)
        for i in range(steps):
            touched = touched_pages()
            start = time.perf_counter()
            metrics = jax.block_until_ready(call())
            done.times.append(time.perf_counter() - start)
            after = touched_pages()
            done.fresh_bytes.append(None if touched is None else after - touched)
            done.losses.append(loss_of(metrics))
            loss = done.losses[-1]
            shown = "" if loss is None else f"  loss {loss:.6f}"
            progress.update(task, advance=1, description=f"step {i + 1}{shown}")
            progress.console.print(f"step {i + 1:4d}{shown}  {done.times[-1] * 1e3:8.1f} ms")
    return done


@app.command()
def run(
    model: Optional[str] = typer.Option(None, help=f"zoo model name (see `spmd models`; "
                                        f"default {DEFAULT_MODEL})"),
    step_ref: Optional[str] = typer.Option(None, "--step", help=STEP_HELP),
    mesh: str = typer.Option(DEFAULT_MESH, help="bundled mesh name (see `spmd meshes`) or "
                             "a mesh file"),
    method: str = typer.Option("auto", help="auto (searched), or dp, zero, fsdp, tp, dp_tp, "
                               "fsdp_tp, ep; pipelines: pp_dp, pp_tp, pp_fsdp (a mesh with "
                               "a 'stage' axis, e.g. cpu-pp)"),
    time_limit: float = typer.Option(DEFAULT_TIME_LIMIT, help="seconds the sharding search may take"),
    memory_budget: Optional[float] = typer.Option(None, help="bytes per device (auto)"),
    steps: int = typer.Option(20, min=1, help="training steps"),
    batch_size: Optional[int] = typer.Option(None, help="global batch size (model default)"),
    seed: int = typer.Option(0, help="a zoo model's initialization and data seed"),
    describe: bool = typer.Option(False, help="list every tensor in the plan table"),
    output_json: Optional[Path] = typer.Option(None, help="write losses and the report here"),
    checkpoint: Optional[Path] = typer.Option(None, help="resume from this directory if it "
                                              "holds a checkpoint; save there at the end"),
) -> None:
    """Train a zoo model, or your own step, for a few steps under a plan; report losses,
    speed and the HLO."""
    import spmd

    _check_step_options(model, step_ref, batch_size)
    if step_ref is not None and checkpoint is not None:
        _fail("--checkpoint resumes a zoo model (--model), whose state spmd builds; with "
              "--step, call spmd.save_checkpoint / spmd.restore_checkpoint in make() or your loop")
    device_mesh = spmd.load_mesh(mesh)  # before jax starts: sets the CPU device count
    spmd.init_distributed(device_mesh)
    import jax
    from flax import nnx

    options = spmd.SearchOptions(time_limit=time_limit, memory_budget=memory_budget)
    if step_ref is not None:
        _run_own_step(step_ref, device_mesh, method, options, steps, describe, output_json)
        return
    spec = _model(model or DEFAULT_MODEL)
    size = batch_size or spec.default_batch_size

    def create():
        return spec.training_state(seed)

    abstract_model, abstract_opt = nnx.eval_shape(create)
    batch = spec.batch(size, seed)
    step = spmd.parallelize(spec.train_step, mesh=device_mesh, method=method, options=options)
    with _working(f"planning {spec.name} on {device_mesh.name} ({method})"):
        plan = step.plan_for(abstract_model, abstract_opt, batch)
    if checkpoint is not None and spmd.is_checkpoint(checkpoint):  # under this run's plan
        net, opt = spmd.restore_checkpoint(checkpoint, create, plan)
        _say(f"resumed from {checkpoint} (optimizer step {int(opt.step[...])})")
    else:
        net, opt = spmd.materialize(create, plan)
    # Each process reads only its rows, as a real input pipeline would.
    local_batch = spmd.shard_batch(plan, spmd.process_local_batch(plan, batch))
    from spmd.stages.plan import PipelinePlan

    pipelined = isinstance(plan, PipelinePlan)  # a pipeline method, or auto's choice
    report = None
    if not pipelined:  # a pipeline compiles each stage's programs on its first step
        with _working("compiling"):
            compiled = step.compile(net, opt, local_batch)  # the executable the steps run
        report = spmd.analyze(compiled)
        plan.attach_measured(report)
    _say(device_mesh.describe())
    _say(f"model {spec.name}: {spec.param_count():,} parameters; method {method}; "
         f"global batch {size}")
    steps_run = _train(lambda: step(net, opt, local_batch), steps)
    if checkpoint is not None:
        spmd.save_checkpoint(checkpoint, net, opt)  # replaces the one resumed from once written
        _say(f"saved {checkpoint}")
    step_time = steps_run.step_time
    per_second = spec.items_per_batch(size) / step_time
    _say(f"step time {step_time * 1e3:.1f} ms (median after the first), "
         f"{per_second:,.0f} {spec.unit}/s")
    _say_predicted(steps_run, plan)
    if pipelined:
        _say(plan.describe())
        _say(_programs_summary(step.compiled(net, opt, local_batch), plan.runtime))
    else:
        _say(plan.describe(max_rows=None if describe else 12))
        _say(report.describe())
    if output_json is not None and jax.process_index() == 0:
        output_json.write_text(json.dumps({
            "model": spec.name, "mesh": device_mesh.name, "method": method,
            "losses": steps_run.losses, "step_time": step_time,
            "fresh_host_bytes_per_step": steps_run.fresh_per_step,
            f"{spec.unit}_per_second": per_second,
            "report": report.to_dict() if report is not None else None}, indent=1))


def _programs_summary(compiled: dict, runtime: str) -> str:
    """A pipeline's compiled programs, one line each: the collectives XLA emitted in it."""
    import spmd

    lines = ["compiled program (the SPMD pipeline: one, on the whole mesh):"
             if runtime == "spmd" else
             f"compiled programs ({len(compiled)}: one per stage and phase this process "
             f"runs, and the copies between stages across processes):"]
    for name, program in compiled.items():
        report = spmd.analyze(program)
        kinds = ", ".join(f"{kind} x{count} ({nbytes / 1e6:.2f} MB)"
                          for kind, (count, nbytes) in sorted(report.collectives.items())
                          if count) or "no collectives"
        lines.append(f"  {name}: {kinds}")
    return "\n".join(lines)


def _say_predicted(steps_run: _Steps, plan) -> None:
    """The measured step time beside the cost model's (a plan has a prediction when searched
    or scored, as `run`'s options ask for hand-written ones): M/P is how far off the mesh
    file's figures are; a profiled mesh (`spmd profile`) brings it nearer 1. Then what the
    measured time holds that the prediction leaves out (XLA:CPU's fresh host pages)."""
    import jax

    measured = steps_run.step_time
    if plan.prediction is not None and plan.prediction.total_time > 0:
        predicted = plan.prediction.total_time
        _say(f"step time: measured {measured * 1e3:.3g} ms, predicted {predicted * 1e3:.3g} ms "
             f"(M/P = {measured / predicted:.3g})")
    note = fresh_memory_note(steps_run.fresh_per_step, measured, jax.default_backend())
    if note is not None:
        _say(note)


def _run_own_step(step_ref: str, device_mesh: DeviceMesh, method: str, options: SearchOptions,
                  steps: int, describe: bool, output_json: Optional[Path]) -> None:
    """``spmd run --step``: the user's step on the arguments its make() returns, fed back
    as ``spmd.user_step`` says (NNX state in place, else ``(state, metrics)``)."""
    import spmd
    from spmd.user_step import advance, is_in_place, load_step

    step_fn, args = load_step(step_ref, concrete=True)
    step = spmd.parallelize(step_fn, mesh=device_mesh, method=method, options=options)
    with _working(f"planning {step_ref} on {device_mesh.name} ({method})"):
        plan = step.plan_for(*args)
    with _working("compiling"):
        report = spmd.analyze(step.compile(*args))
    plan.attach_measured(report)
    in_place = is_in_place(args)

    def call():
        nonlocal args
        args, metrics = advance(args, step(*args), in_place)
        return metrics

    _say(device_mesh.describe())
    _say(f"step {step_ref}; method {method}")
    steps_run = _train(call, steps)
    _say(f"step time {steps_run.step_time * 1e3:.1f} ms (median after the first)")
    _say_predicted(steps_run, plan)
    _say(plan.describe(max_rows=None if describe else 12))
    _say(report.describe())
    if output_json is not None:
        output_json.write_text(json.dumps({
            "step": step_ref, "mesh": device_mesh.name, "method": method,
            "losses": steps_run.losses, "step_time": steps_run.step_time,
            "fresh_host_bytes_per_step": steps_run.fresh_per_step,
            "report": report.to_dict()}, indent=1))


@app.command("plan")
def plan_cmd(
    model: Optional[str] = typer.Option(None, help=f"zoo model name (see `spmd models`; "
                                        f"default {DEFAULT_MODEL})"),
    step_ref: Optional[str] = typer.Option(None, "--step", help=STEP_HELP + "; its arguments "
                                           "may be abstract (nnx.eval_shape)"),
    mesh: str = typer.Option(DEFAULT_MESH, help="bundled mesh name or a mesh file; planned as "
                             "a virtual mesh"),
    method: str = typer.Option("auto", help="plan to show: auto or a hand-written one"),
    batch_size: Optional[int] = typer.Option(None, help="global batch size (model default)"),
    time_limit: float = typer.Option(DEFAULT_TIME_LIMIT, help="seconds the sharding search may take"),
    memory_budget: Optional[float] = typer.Option(None, help="bytes per device (auto)"),
    min_stages: int = typer.Option(1, min=1, help="auto: pipeline stages at least (2: a "
                                   "pipeline only)"),
    max_stages: Optional[int] = typer.Option(None, min=1, help="auto: pipeline stages at most "
                                             "(1: no stage search)"),
    save: Optional[Path] = typer.Option(None, help="save the plan as JSON"),
    compile_check: bool = typer.Option(False, "--compile", help="also compile the plan on as "
                                       "many simulated CPU devices (shapes only, nothing "
                                       "allocated): collectives and memory per device beside "
                                       "the prediction and the device's memory"),
) -> None:
    """Plan without running anything: any mesh, even a cluster you do not have."""
    import spmd

    _check_step_options(model, step_ref, batch_size)
    device_mesh = spmd.load_mesh(mesh, virtual=True)
    if compile_check:  # before jax starts: as many CPU devices as the mesh has
        from spmd.cluster.devices import set_cpu_device_count

        set_cpu_device_count(device_mesh.size, f"`spmd plan --compile` on mesh "
                             f"{device_mesh.name!r}")
    step_fn, args, title = _abstract_step(model, step_ref, batch_size)
    options = spmd.SearchOptions(time_limit=time_limit, memory_budget=memory_budget,
                                 pipeline=spmd.PipelineOptions(min_stages=min_stages,
                                                               max_stages=max_stages))
    with _working(f"planning {step_ref or model or DEFAULT_MODEL} on {device_mesh.name} "
                  f"({method})"):
        plan = spmd.plan(step_fn, *args, mesh=device_mesh, method=method, options=options)
    check = _compile_checked(plan) if compile_check else None
    typer.echo(title)
    typer.echo(plan.describe())
    if check is not None:
        typer.echo(check)
    if save:
        plan.save(save)
        typer.echo(f"saved {save}")


def _compile_checked(plan) -> str:
    """``spmd plan --compile``: the plan compiled and read (``verify.check_compiled``), in
    words; an MPMD pipeline's programs are compiled by its first step, so it says so."""
    from spmd.analysis import verify

    try:
        with _working(f"compiling on {plan.mesh.size} simulated CPU devices"):
            return verify.describe_check(verify.check_compiled(plan))
    except ValueError as why_not:  # an MPMD pipeline
        return f"--compile: not compiled: {why_not}"


@app.command()
def compare(
    model: Optional[str] = typer.Option(None, help=f"zoo model name (see `spmd models`; "
                                        f"default {DEFAULT_MODEL})"),
    step_ref: Optional[str] = typer.Option(None, "--step", help=STEP_HELP),
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

    _check_step_options(model, step_ref, batch_size)
    device_mesh = spmd.load_mesh(mesh, virtual=True)
    # compiled, not run: on as many simulated CPU devices
    set_cpu_device_count(device_mesh.size, f"`spmd compare` on mesh {device_mesh.name!r}")
    step_fn, args, title = _abstract_step(model, step_ref, batch_size)
    with _working(f"planning and compiling every plan of {step_ref or model or DEFAULT_MODEL} "
                  f"on {device_mesh.name}"):
        record = verify.compare(step_fn, *args, mesh=device_mesh,
                                options=spmd.SearchOptions(time_limit=time_limit))
    typer.echo(f"{title}; {device_mesh.describe()}")
    typer.echo(verify.describe(record))
    if output_json is not None:
        output_json.write_text(json.dumps(record, indent=1, default=str))


@app.command()
def profile(
    mesh: str = typer.Option(DEFAULT_MESH, help="bundled mesh name or a mesh file: its devices "
                             "are measured (on CPU, as many simulated devices)"),
    output: Optional[Path] = typer.Option(None, help="the mesh file to write (default "
                                          "MESH-profiled.yaml here)"),
    quick: bool = typer.Option(False, help="fewer and smaller sizes: seconds, rougher figures"),
) -> None:
    """Measure the devices present and their links; write a mesh file with the figures
    (then pass it as --mesh FILE)."""
    import spmd
    from spmd.profile import profile_mesh

    device_mesh = spmd.load_mesh(mesh)  # before jax starts: sets the CPU device count
    with _working(f"profiling {device_mesh.size} device(s) of {device_mesh.name}"):
        measured = profile_mesh(device_mesh, quick=quick)
    path = output or Path(f"{measured.mesh().name}.yaml")
    path.write_text(measured.yaml())
    typer.echo(measured.summary())
    typer.echo(f"wrote {path}: {spmd.load_mesh(path).describe()}")


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
