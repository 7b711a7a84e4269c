"""The entry points: ``plan`` a step on a mesh, ``parallelize`` it into a compiled callable,
``materialize`` its state directly into the plan's shardings."""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import jax
from flax import nnx

from spmd.cluster.mesh import DeviceMesh
from spmd.errors import PlanError, check_budget
from spmd.manual import get_method, manual_specs
from spmd.options import SearchOptions
from spmd.plan import Plan
from spmd.planner import score_manual, step_inputs
from spmd.runtime.compile import Executable, prepare
from spmd.runtime.pipeline import PipelineExecutable
from spmd.runtime.stacked import stacked_executable
from spmd.runtime.transfer import absent, holds
from spmd.runtime.nodes import NodeStateCache, StateRead
from spmd.sharding import Spec, replicated
from spmd.stages.levels import plan_levels
from spmd.stages.manual import PIPELINE_METHODS, is_pipeline, plan_manual_pipeline
from spmd.stages.plan import PipelinePlan
from spmd.timing import Stopwatch
from spmd.trace.signature import StepSignature, split_step_args


def _output_specs(sig: StepSignature, input_specs: Sequence[Spec]) -> list[Spec | None]:
    """State outputs keep their input's spec (steps chain); scalars are replicated; the rest
    is left to XLA."""
    specs: list[Spec | None] = []
    for i, aval in enumerate(sig.out_avals):
        if i in sig.output_aliases:
            specs.append(input_specs[sig.output_aliases[i]])
        elif aval.ndim == 0:
            specs.append(replicated(0))
        else:
            specs.append(None)
    return specs


def plan(step_fn: Callable, *example_args: Any, mesh: DeviceMesh, method: str = "auto",
         logical_axes: Any = None, batch_argnums: Sequence[int] | None = None,
         options: SearchOptions | None = None) -> Plan:
    """Plan how to shard ``step_fn`` on ``mesh``. Arguments may be concrete or abstract
    (``jax.ShapeDtypeStruct`` leaves, ``nnx.eval_shape`` models).

    ``method`` is ``"auto"`` (searched; see :class:`SearchOptions`), a hand-written plan
    from ``spmd.manual.METHODS``, or a hand-written pipeline plan from
    ``spmd.stages.manual.PIPELINE_METHODS`` (a ``PipelinePlan``, stages along the mesh's
    ``stage`` axis).

    >>> import spmd, jax.numpy as jnp
    >>> mesh = spmd.make_mesh({"data": 2}, virtual=True)
    >>> def step(w, batch): return w - 0.1 * (batch["x"] @ w).sum() * w
    >>> p = spmd.plan(step, jnp.ones((4, 4)), {"x": jnp.ones((8, 4))}, mesh=mesh, method="dp")
    >>> [str(s.spec) for s in jax.tree.leaves(p.in_shardings)]
    ['P()', "P('data',)"]
    """
    _check_method(method)
    timings = Stopwatch()
    with _old_heap_frozen():
        with timings.phase("trace"):
            sig = StepSignature(step_fn, example_args, logical_axes=logical_axes,
                                batch_argnums=batch_argnums)
        if method == "auto":
            return plan_levels(sig, example_args, mesh, options or SearchOptions(),
                               logical_axes, timings)
        if is_pipeline(method):
            return plan_manual_pipeline(sig, example_args, mesh, method,
                                        options or SearchOptions(), logical_axes)
        return plan_manual(sig, mesh, method, options)


def runnable(p: Plan | PipelinePlan, donate: bool | None = None,
             compiler_options: Mapping[str, Any] | None = None) -> Any:
    """The executable of a plan: one jitted program (``compile()`` gives it, with
    ``compiler_options``), or an MPMD pipeline of them (``PipelineExecutable``: compiled by
    its first step, with XLA's default options)."""
    if isinstance(p, PipelinePlan):
        return (stacked_executable(p, donate, compiler_options) if p.runtime == "spmd"
                else PipelineExecutable(p, donate))
    return prepare(p, donate, compiler_options)


def plan_manual(sig: StepSignature, mesh: DeviceMesh, method: str,
                options: SearchOptions | None = None) -> Plan:
    """A hand-written plan for an already traced step (``spmd.plan`` traces it first;
    ``spmd.analysis.verify.compare`` plans every method from auto's trace), the user's pins
    kept. Scored (a solve) only with ``options.compare`` or a ``memory_budget`` to check.

    A scored plan runs as scored: with the sharding constraints of the intermediates its
    score chose, so that its prediction (time, memory, collectives) is of the program that
    runs. Unscored, only its input and output shardings are given and XLA's propagation
    picks the rest: another program, often with more collectives (on cpu-8, fsdp of
    moe-tiny compiles 47 all-gathers and 26 all-reduces bare; as scored, the 26 all-gathers,
    one all-reduce and 8 all-to-alls its score predicts)."""
    inputs = step_inputs(sig, mesh, options or SearchOptions())
    input_specs = manual_specs(sig.leaves, method, mesh, [i.pinned for i in inputs])
    scored = (score_manual(sig, mesh, method, options, inputs=inputs) if options is not None
              and (options.compare or options.memory_budget is not None) else None)
    result = Plan(method=method, mesh=mesh, leaves=sig.leaves, input_specs=input_specs,
                  output_specs=_output_specs(sig, input_specs), signature=sig,
                  _searched=scored)
    if scored is not None:
        result.prediction = scored.result.prediction
        result.constraints = dict(scored.result.constraints)
        check_budget(method, result.prediction.memory_bytes, options.memory_budget,
                     "pick another method, or method='auto', which plans under the budget")
    return result


@contextlib.contextmanager
def _old_heap_frozen() -> Iterator[None]:
    """Planning allocates a traced step and its graph (10^5 objects at 24 layers) on top of
    jax's and flax's own heap; Python's cyclic collector rescanning that old heap took 1.5 s
    of a 9 s 24-layer plan on 2 cores. What exists before planning is moved out of its sight
    meanwhile (``gc.freeze``); new garbage is collected as usual. A heap the caller froze is
    left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _check_method(method: str) -> None:
    if method != "auto" and not is_pipeline(method):
        try:
            get_method(method)
        except PlanError as err:  # name the pipeline methods too
            raise PlanError(f"{err}, {', '.join(PIPELINE_METHODS)}") from None


def _avals(leaves: Sequence[Any]) -> tuple[tuple[tuple[int, ...], Any], ...]:
    """Each leaf's (shape, dtype) as jit sees it, to key the executables. A jax array's own
    dtype is already canonical; ``jnp.result_type`` (a numpy float64 array, a Python scalar,
    an abstract leaf) costs 35 us a leaf, 4 ms a call for gpt-tiny's 113 leaves."""
    return tuple((x.shape, x.dtype) if isinstance(x, jax.Array)
                 else (tuple(jax.numpy.shape(x)), jax.numpy.result_type(x)) for x in leaves)


class _Call(NamedTuple):
    """One use of a ``ParallelStep``: the executable for the arguments, their flat leaves,
    and how their NNX state was read (so that it is written back the same way)."""

    executable: Executable
    leaves: list[Any]
    nodes: tuple[Any, ...]
    read: StateRead


class ParallelStep:
    """A step compiled under a plan; planned on first use for each set of argument shapes.

    Behaves like ``jax.jit``: call it, or ``.lower(*args)`` / ``.compile(*args)`` to inspect
    the compiled program (the executable ``compile`` returns is the one later calls run).
    NNX graph nodes passed in are updated in place, as the user's step would have done.
    """

    def __init__(self, step_fn: Callable, mesh: DeviceMesh, method: str = "auto", *,
                 logical_axes: Any = None, batch_argnums: Sequence[int] | None = None,
                 donate: bool | None = None, options: SearchOptions | None = None) -> None:
        self.step_fn = step_fn
        self.mesh = mesh
        self.method = method
        self.logical_axes = logical_axes
        self.batch_argnums = batch_argnums
        self.donate = donate
        self.options = options
        self._prepared: dict[Any, Executable] = {}
        self._nodes = NodeStateCache()
        self._last: Plan | None = None

    @classmethod
    def from_plan(cls, plan: Plan, donate: bool | None = None, *, logical_axes: Any = None,
                  options: SearchOptions | None = None) -> "ParallelStep":
        """A step that runs ``plan`` (e.g. one ``spmd.plan`` returned, or loaded and bound)
        for arguments shaped like those it was planned for; other shapes are planned with
        its method, ``logical_axes`` and ``options``, as ``parallelize`` would."""
        sig = plan.bound_signature()
        step = cls(sig.step_fn, plan.mesh, plan.method, logical_axes=logical_axes,
                   batch_argnums=tuple(sig.batch_argnums), donate=donate, options=options)
        step._prepared[sig.in_treedef, _avals(sig.in_avals)] = runnable(plan, donate)
        return step

    @property
    def plan(self) -> Plan:
        if self._last is None:
            raise PlanError("no plan yet: call the step or .lower(*args) first, or use "
                            "spmd.plan(step_fn, *args, mesh=..., method=...)")
        return self._last

    def _prepare(self, args: Sequence[Any]) -> _Call:
        """The executable for these arguments and their flat leaves (flattened once: the same
        leaves key the cache, as jax.jit's cache is keyed, and feed the call)."""
        nodes, trees = split_step_args(args)
        read = self._nodes.read(nodes)
        tree_leaves, trees_treedef = jax.tree.flatten(trees)
        leaves = read.values + tree_leaves
        avals = _avals(leaves)
        if read.entry is None:
            prepared = self._executable(read, trees_treedef, avals, args)
        else:  # the same nodes as last call: their executables by the rest of the key
            memo = read.entry.executables
            prepared = memo.get((trees_treedef, avals))
            if prepared is None:
                prepared = memo[trees_treedef, avals] = self._executable(
                    read, trees_treedef, avals, args)
        self._last = prepared.plan
        return _Call(prepared, leaves, nodes, read)

    def _executable(self, read: StateRead, trees_treedef: Any, avals: tuple,
                    args: Sequence[Any]) -> Executable:
        """The executable keyed by the arguments' structure and avals, planned on a miss."""
        key = (jax.tree_util.treedef_tuple((read.state_treedef, trees_treedef)), avals)
        if key not in self._prepared:
            p = plan(self.step_fn, *args, mesh=self.mesh, method=self.method,
                     logical_axes=self.logical_axes, batch_argnums=self.batch_argnums,
                     options=self.options)
            self._prepared[key] = runnable(p, self.donate)
        return self._prepared[key]

    def plan_for(self, *args: Any) -> Plan:
        """The plan for these arguments (concrete or abstract), searched once per shape set."""
        return self._prepare(args).executable.plan

    def lower(self, *args: Any):
        return self._prepare(args).executable.lower()

    def compile(self, *args: Any):
        """Compile once and keep the executable: later calls with these shapes run it."""
        return self._prepare(args).executable.compile()

    def compiled(self, *args: Any) -> dict[str, Any]:
        """The compiled programs the step runs, by name: ``{"step": ...}``, or a pipeline's
        one per stage and phase (for the shapes of its last call: call it first)."""
        executable = self._prepare(args).executable
        if isinstance(executable, PipelineExecutable):
            return executable.compiled()
        return {"step": executable.compile()}

    def place(self, *args: Any) -> list[Any]:
        """The flat leaves of ``args`` placed in the plan's input shardings. In multi-process
        runs pass global arrays (``spmd.shard_batch`` builds them from process-local rows)."""
        call = self._prepare(args)
        return call.executable.place(call.leaves)

    def __call__(self, *args: Any) -> Any:
        call = self._prepare(args)
        flat_out = call.executable(call.leaves)
        sig = call.executable.plan.bound_signature()
        if not sig.state_round_trips:
            return sig.unflatten_outputs(args, flat_out)
        if call.read.entry is not None:  # the graph as last call left it: no walk
            call.read.entry.write(flat_out[:sig.num_state_leaves])
            return sig.unflatten_result(flat_out)
        result = sig.unflatten_outputs(args, flat_out)
        self._nodes.remember(call.nodes, call.read)  # nnx.update succeeded on this graph
        return result


def parallelize(step_fn: Callable, *, mesh: DeviceMesh, method: str = "auto",
                logical_axes: Any = None, batch_argnums: Sequence[int] | None = None,
                donate: bool | None = None, options: SearchOptions | None = None
                ) -> ParallelStep:
    """Wrap ``step_fn`` so each call runs sharded under a plan for ``mesh``.

    ``donate`` (default: True for NNX steps, whose state spmd writes back, False otherwise)
    lets XLA reuse the input state's buffers for the new state.
    """
    _check_method(method)
    return ParallelStep(step_fn, mesh, method, logical_axes=logical_axes,
                        batch_argnums=batch_argnums, donate=donate, options=options)


def eval_shape(create_fn: Callable[[], Any]) -> Any:
    """``nnx.eval_shape(create_fn)`` with Flax's eager sharding off: the abstract NNX nodes
    (or pytrees) to plan with. Variables made with ``nnx.with_partitioning`` carry logical
    names for the planner, not a request to place arrays on a mesh, which eager sharding
    would make (and refuse without a mesh: "An auto mesh context or metadata is required")."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(create_fn)


def materialize(create_fn: Callable[[], Any], p: Plan) -> Any:
    """Build the NNX graph nodes ``create_fn`` returns directly into the plan's shardings, so
    a model larger than one device is never whole on one device.

    ``create_fn`` must return the step's graph-node arguments in order (e.g. ``(model,
    optimizer)``) and be a pure function of nothing but constants (seeded initializers).
    A pipeline plan's state is built stage by stage, each stage's leaves by a program on its
    own devices (the initializers of the other stages' leaves are dead code there); a process
    holding none of a stage's devices gets its leaves as arrays with no shard here.
    """
    sig = p.bound_signature()
    abstract = eval_shape(create_fn)
    nodes = abstract if isinstance(abstract, tuple) else (abstract,)
    graphdef, abstract_state = nnx.split(nodes)
    flat_shardings = p.input_shardings_flat()[: sig.num_state_leaves]
    state_def = jax.tree.structure(abstract_state)

    def build():
        with nnx.use_eager_sharding(False):
            made = create_fn()
        return jax.tree.leaves(nnx.split(made if isinstance(made, tuple) else (made,))[1])

    by_devices: dict[frozenset, list[int]] = {}
    for i, sharding in enumerate(flat_shardings):
        by_devices.setdefault(frozenset(sharding.device_set), []).append(i)
    flat: list[Any] = [None] * len(flat_shardings)
    abstract_leaves = jax.tree.leaves(abstract_state)
    for chosen in by_devices.values():
        if not holds(flat_shardings[chosen[0]]):  # another process's stage builds these
            for i in chosen:
                flat[i] = absent(abstract_leaves[i].shape, abstract_leaves[i].dtype,
                                 flat_shardings[i])
            continue

        def pick(chosen=chosen):
            leaves = build()
            return [leaves[i] for i in chosen]

        part = jax.jit(pick, out_shardings=[flat_shardings[i] for i in chosen])()
        for i, x in zip(chosen, part):
            flat[i] = x
    made = nnx.merge(graphdef, jax.tree.unflatten(state_def, flat))
    return made if isinstance(abstract, tuple) else made[0]
