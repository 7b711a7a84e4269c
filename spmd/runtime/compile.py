"""A plan made runnable: the step jitted with the plan's input and output shardings, its
sharding constraints applied inside (``spmd.runtime.constrain``), donated state, and the
per-compile XLA options (``Lowered.compile(compiler_options=...)``: an unknown name there is
a catchable error, unlike a global ``XLA_FLAGS``), compiled once and kept.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax

from spmd.cluster.mesh import DeviceMesh
from spmd.plan import Plan
from spmd.runtime.constrain import constrained
from spmd.search.regions import RegionPlan
from spmd.sharding import to_partition_spec

__all__ = ["Executable", "backend_options", "jit_region", "prepare"]


@dataclasses.dataclass
class Executable:
    """One plan's step, ready to lower, compile and call on flat leaves."""

    plan: Plan
    jitted: Any
    shardings: list
    compiler_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    compiled: Any = None

    def lower(self):
        return self.jitted.lower(*self.plan.bound_signature().in_avals)

    def compile(self):
        """Compile once and keep the executable: later calls run it."""
        if self.compiled is None:
            self.compiled = self.lower().compile(compiler_options=dict(self.compiler_options)
                                                 or None)
        return self.compiled

    def place(self, leaves: Sequence[Any]) -> list[Any]:
        """Leaves already in their sharding pass through; the rest are put there. Last call's
        outputs carry a sharding equal to the input's (the state's output specs are its
        input specs): ``==`` settles those at a tenth of ``is_equivalent_to``'s cost."""
        return [x if isinstance(x, jax.Array) and _placed(x, s) else jax.device_put(x, s)
                for x, s in zip(leaves, self.shardings)]

    def __call__(self, leaves: Sequence[Any]) -> Any:
        run = self.compiled or self.jitted
        return run(*self.place(leaves))


def _placed(x: jax.Array, sharding: Any) -> bool:
    return x.sharding == sharding or x.sharding.is_equivalent_to(sharding, x.ndim)


def donates(sig, donate: bool | None) -> bool:
    """Whether the step's new state reuses the old state's buffers: ``donate``, by default
    for NNX steps (spmd writes their state back: the old buffers are not read again)."""
    return donate if donate is not None else sig.graphdef is not None


def donated_inputs(sig, donate: bool | None) -> tuple[int, ...]:
    """The flat inputs whose buffers the step's outputs reuse: those an output aliases, when
    it ``donates``."""
    return tuple(sorted(set(sig.output_aliases.values()))) if donates(sig, donate) else ()


def jit_step(plan: Any, fn, donate: bool | None = None,
             compiler_options: Mapping[str, Any] | None = None) -> Executable:
    """``fn`` (flat inputs -> tuple of flat outputs) jitted with ``plan``'s input and
    output shardings, the aliased inputs donated (``donated_inputs``), compiled with the
    options of its mesh's backend (``backend_options``) and ``compiler_options``."""
    shardings = plan.input_shardings_flat()
    jitted = jax.jit(fn, in_shardings=tuple(shardings),
                     out_shardings=tuple(plan.output_shardings_flat()),
                     donate_argnums=donated_inputs(plan.bound_signature(), donate))
    return Executable(plan, jitted, shardings,
                      {**backend_options(plan.mesh), **(compiler_options or {})})


def prepare(plan: Plan, donate: bool | None = None,
            compiler_options: Mapping[str, Any] | None = None) -> Executable:
    """Jit ``plan``'s step. ``donate`` (default: True for NNX steps, whose state spmd writes
    back) lets XLA reuse the input state's buffers for the new state. A plan for another
    platform's devices, compiled here for a check (``DeviceMesh.stand_in``), has its
    transposed matmul operands made at their matmuls and its inputs resharded at their
    first readers in each other spec, as that platform's scheduler would
    (``constrained(..., in_order=True)``)."""
    fn = plan.bound_signature().flat_fn
    stand_in = plan.mesh.stand_in
    if plan.constraints or plan.rewritten or stand_in:
        run = constrained(plan.program(), plan.constraints, plan.mesh.sharding_mesh(),
                          in_order=stand_in,
                          input_shardings=plan.input_shardings_flat() if stand_in else ())
        fn = lambda *flat: tuple(run(*flat))  # noqa: E731 (jit wants a tuple)
    return jit_step(plan, fn, donate, compiler_options)


def backend_options(mesh: DeviceMesh) -> dict[str, Any]:
    """Per-compile XLA options for the devices ``mesh`` compiles on
    (``DeviceMesh.compile_backend``). On CPU devices: copy insertion by region analysis,
    which leaves out the copies of donated parameters that the default analysis makes where
    an op reading the old value is not data-ordered before the update (gpt-13b on 8
    simulated devices: 1.1 GiB of temporaries). An XLA:CPU option: other platforms' compiles
    are left as they are."""
    if mesh.compile_backend == "cpu":
        return {"xla_cpu_copy_insertion_use_region_analysis": True}
    return {}


def jit_region(plan: RegionPlan, mesh: DeviceMesh):
    """A region's program jitted on its (sub)mesh under its plan: what a pipeline stage
    runs. Lower it with the avals of ``plan.inputs``."""
    from jax.sharding import NamedSharding

    jm = mesh.sharding_mesh()
    run = constrained(plan.program, plan.result.constraints, jm)
    shard = lambda spec: NamedSharding(jm, to_partition_spec(spec))  # noqa: E731
    return jax.jit(lambda *flat: tuple(run(*flat)),
                   in_shardings=tuple(shard(s) for s in plan.result.input_specs),
                   out_shardings=tuple(shard(s) for s in plan.result.output_specs))
