"""The entry points: ``plan`` a step on a mesh, ``parallelize`` it into a compiled callable."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from flax import nnx

from spmd.apply import constrained
from spmd.errors import PlanError
from spmd.manual import METHODS, manual_specs
from spmd.search import SearchOptions, auto_plan, predict_manual
from spmd.mesh import DeviceMesh
from spmd.plan import Plan
from spmd.sharding import Spec, replicated
from spmd.signature import StepSignature


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
         logical_axes: Any = None, batch_argnums: Sequence[int] = (-1,),
         options: SearchOptions | None = None) -> Plan:
    """Plan how to shard ``step_fn`` on ``mesh``. Arguments may be concrete or abstract
    (``jax.ShapeDtypeStruct`` leaves, ``nnx.eval_shape`` models).

    ``method`` is ``"auto"`` (searched; see :class:`SearchOptions`) or a hand-written plan
    from ``spmd.manual.METHODS``.

    >>> import spmd, jax.numpy as jnp
    >>> mesh = spmd.make_mesh({"data": 2}, virtual=True)
    >>> def step(w, batch): return w - 0.1 * (batch["x"] @ w).sum() * w
    >>> p = spmd.plan(step, jnp.ones((4, 4)), {"x": jnp.ones((8, 4))}, mesh=mesh, method="dp")
    >>> [str(s.spec) for s in jax.tree.leaves(p.in_shardings)]
    ['P()', "P('data',)"]
    """
    _check_method(method)
    sig = StepSignature(step_fn, example_args, logical_axes=logical_axes,
                        batch_argnums=batch_argnums)
    if method == "auto":
        return auto_plan(sig, mesh, options or SearchOptions())
    input_specs = manual_specs(sig.leaves, method, mesh)
    result = Plan(method=method, mesh=mesh, leaves=sig.leaves, input_specs=input_specs,
                  output_specs=_output_specs(sig, input_specs), signature=sig)
    if options is not None and options.compare:  # scoring costs a solve: only when asked
        result.prediction = predict_manual(sig, mesh, method, options).to_dict()
    return result


def _check_method(method: str) -> None:
    if method != "auto" and method not in METHODS:
        raise PlanError(f"unknown method {method!r}; valid methods: auto, {', '.join(METHODS)}")


class ParallelStep:
    """A step compiled under a plan; planned on first use for each set of argument shapes.

    Behaves like ``jax.jit``: call it, or ``.lower(*args)`` to inspect the compiled program.
    NNX graph nodes passed in are updated in place, as the user's step would have done.
    """

    def __init__(self, step_fn: Callable, mesh: DeviceMesh, method: str = "auto", *,
                 logical_axes: Any = None, batch_argnums: Sequence[int] = (-1,),
                 donate: bool | None = None, options: SearchOptions | None = None) -> None:
        self.step_fn = step_fn
        self.mesh = mesh
        self.method = method
        self.logical_axes = logical_axes
        self.batch_argnums = batch_argnums
        self.donate = donate
        self.options = options
        self._compiled: dict[Any, tuple[Plan, Any]] = {}
        self._last: Plan | None = None

    @property
    def plan(self) -> Plan:
        if self._last is None:
            raise PlanError("no plan yet: call the step or .lower(*args) first, or use "
                            "spmd.plan(step_fn, *args, mesh=..., method=...)")
        return self._last

    def _key(self, args: Sequence[Any]) -> Any:
        """Plans are per argument structure and shapes, as jax.jit's cache is."""
        nodes = tuple(a for a in args if isinstance(a, nnx.Pytree))
        trees = tuple(a for a in args if not isinstance(a, nnx.Pytree))
        shapes = jax.tree.map(lambda x: (tuple(jax.numpy.shape(x)), str(jax.numpy.result_type(x))),
                              (nnx.state(nodes) if nodes else None, trees))
        return jax.tree.structure(shapes), tuple(jax.tree.leaves(shapes))

    def _prepare(self, args: Sequence[Any]) -> tuple[Plan, Any]:
        key = self._key(args)
        if key not in self._compiled:
            p = plan(self.step_fn, *args, mesh=self.mesh, method=self.method,
                     logical_axes=self.logical_axes, batch_argnums=self.batch_argnums,
                     options=self.options)
            sig = p.signature
            donate = self.donate if self.donate is not None else sig.graphdef is not None
            donated = tuple(sorted(set(sig.output_aliases.values()))) if donate else ()
            fn = sig.flat_fn
            if p.constraints:
                run = constrained(p.jaxpr, p.constraints, p._sharding_mesh())
                fn = lambda *leaves: tuple(run(*leaves))  # noqa: E731 (jit wants a tuple)
            jitted = jax.jit(fn, in_shardings=tuple(p.input_shardings_flat()),
                             out_shardings=tuple(p.output_shardings_flat()),
                             donate_argnums=donated)
            self._compiled[key] = (p, jitted)
        self._last = self._compiled[key][0]
        return self._compiled[key]

    def plan_for(self, *args: Any) -> Plan:
        """The plan for these arguments (concrete or abstract), searched once per shape set."""
        return self._prepare(args)[0]

    def lower(self, *args: Any):
        p, jitted = self._prepare(args)
        return jitted.lower(*p.signature.in_avals)

    def place(self, *args: Any) -> list[Any]:
        """The flat leaves of ``args`` placed in the plan's input shardings. In multi-process
        runs pass global arrays (``spmd.shard_batch`` builds them from process-local rows)."""
        p, _ = self._prepare(args)
        leaves = p.signature.flatten_args(args)
        placed = []
        for leaf, x, sharding in zip(p.leaves, leaves, p.input_shardings_flat()):
            if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
                placed.append(x)
            else:
                placed.append(jax.device_put(x, sharding))
        return placed

    def __call__(self, *args: Any) -> Any:
        p, jitted = self._prepare(args)
        flat_out = jitted(*self.place(*args))
        return p.signature.unflatten_outputs(args, flat_out)


def parallelize(step_fn: Callable, *, mesh: DeviceMesh, method: str = "auto",
                logical_axes: Any = None, batch_argnums: Sequence[int] = (-1,),
                donate: bool | None = None, options: SearchOptions | None = None
                ) -> ParallelStep:
    """Wrap ``step_fn`` so each call runs sharded under a plan for ``mesh``.

    ``donate`` (default: True for NNX steps, whose state spmd writes back, False otherwise)
    lets XLA reuse the input state's buffers for the new state.
    """
    _check_method(method)
    return ParallelStep(step_fn, mesh, method, logical_axes=logical_axes,
                        batch_argnums=batch_argnums, donate=donate, options=options)


def materialize(create_fn: Callable[[], Any], p: Plan) -> Any:
    """Build the NNX graph nodes ``create_fn`` returns directly into the plan's shardings, so
    a model larger than one device is never whole on one device.

    ``create_fn`` must return the step's graph-node arguments in order (e.g. ``(model,
    optimizer)``) and be a pure function of nothing but constants (seeded initializers).
    """
    sig = p._need_signature()
    abstract = nnx.eval_shape(create_fn)
    nodes = abstract if isinstance(abstract, tuple) else (abstract,)
    graphdef, _ = nnx.split(nodes)
    flat_shardings = p.input_shardings_flat()[: sig.num_state_leaves]
    state_shardings = jax.tree.unflatten(
        jax.tree.structure(nnx.split(nodes)[1]), flat_shardings)

    def build():
        made = create_fn()
        return nnx.split(made if isinstance(made, tuple) else (made,))[1]

    state = jax.jit(build, out_shardings=state_shardings)()
    made = nnx.merge(graphdef, state)
    return made if isinstance(abstract, tuple) else made[0]
