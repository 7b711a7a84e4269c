"""Sharding constraints inside a step: re-run its jaxpr with a constraint wherever the plan
chose a spec that XLA's propagation might not guess.

The interpreter walks the same flattened program as :func:`spmd.trace.graph.build_graph` (nested
``jit``, ``custom_jvp``/``custom_vjp`` and ``checkpoint`` jaxprs inlined; a differentiated
checkpoint keeps its optimization barrier), so the keys of ``AutoResult.constraints``
(``"eqn 17 out 0"``: an equation's output; ``"eqn 17 in 1"``: what it reads as operand 1, a
reshard point) name the same values here.

>>> import jax, jax.numpy as jnp
>>> from spmd.cluster.mesh import make_mesh
>>> cj = jax.make_jaxpr(lambda w, x: x @ w)(jnp.ones((4, 8)), jnp.ones((2, 4)))
>>> f = constrained(cj, {"eqn 0 out 0": ((), ("model",))}, make_mesh({"model": 1}, virtual=True))
>>> f(jnp.ones((4, 8)), jnp.ones((2, 4)))[0].shape
(2, 8)
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import NamedSharding

from spmd.cluster.mesh import DeviceMesh
from spmd.sharding import Spec, to_partition_spec
from spmd.search.layout import transposed_operands
from spmd.trace.fence import Chain, fenceable
from spmd.trace.graph import operand_key, value_key
from spmd.trace.interpret import eval_jaxpr_with


def constrained(closed_jaxpr, constraints: Mapping[str, Spec], mesh: DeviceMesh | Any,
                in_order: bool = False, input_shardings: Sequence[Any] = ()) -> Callable:
    """A function of the step's flat inputs that returns its flat outputs, with
    ``with_sharding_constraint`` on every value named in ``constraints``.

    ``mesh`` is a DeviceMesh or a concrete ``jax.sharding.Mesh``. The caller jits the result
    with in/out shardings from the plan's input and output specs. ``in_order``: the
    matmuls' copies are made where they are read, the step inputs' reshards too where
    their shardings (``input_shardings``, in the step's flat order) are given, and each sum
    of gradients is a buffer of its own (``constraint_hooks``).
    """
    def run(*args):
        inputs = {id(a): s for a, s in zip(args, input_shardings)}
        after, before = constraint_hooks(constraints, mesh, in_order, inputs)  # a chain per trace
        return eval_jaxpr_with(closed_jaxpr.jaxpr, closed_jaxpr.consts, args, after, before)

    return run


def constraint_hooks(constraints: Mapping[str, Spec], mesh: DeviceMesh | Any,
                     in_order: bool = False, inputs: Mapping[int, Any] | None = None
                     ) -> tuple[Callable, Callable | None]:
    """The ``hook`` and ``operand_hook`` of ``eval_jaxpr_with`` that put ``constraints``
    (keyed by the paths of the program they were planned on) on the values they name.

    ``in_order``: the copies XLA:CPU makes of a matmul's operands in another dimension
    order (``spmd.search.layout``) are made at that matmul, as XLA:GPU's scheduler places
    them: each such operand waits for the matmul's other operand (``spmd.trace.fence``, one
    chain of fences in program order). Without the fences XLA:CPU's breadth-first order
    copies a value as soon as it exists and holds the copy to its reader: on 8 simulated
    devices, gpt-13b's plan for 8 A100s held 16 GiB of transposed activations from the
    forward to the backward pass. A compile standing in for another platform's devices
    uses it (``spmd.runtime.compile.prepare``); the fences' scalar all-reduces (4 bytes
    each) are in its collectives. And each sum of gradients (``add_any``: the residual
    stream's among them) is a buffer of its own (``Chain.materialized``), as XLA:GPU's
    bounded kernels keep it: XLA:CPU remade the residual stream's gradient in one kernel per
    layer, holding every later layer's forward values for it (gpt-1.3b recomputing every
    layer, for 8 A100s: 12.07 GiB compiled so, 6.90 GiB with the sums apart, against 6.63
    priced as XLA:CPU runs the plan).

    The step inputs in ``inputs`` (the traced value's ``id`` -> its sharding) are resharded
    at the first reader that takes them in another spec, after its computed operands are
    there, as XLA:GPU's scheduler gathers a weight: XLA:CPU would gather it at the step's
    start and hold it for its readers (gpt-13b, save_dots on 33 of 40 layers, for 8 A100s
    on 8 simulated devices: 37.20 GiB compiled so, 45.17 without). The step's later
    readers in that spec share the copy, as XLA's CSE would share one. The fenced value
    is constrained to the input's own sharding before its reshard: else XLA's
    propagation gives the fence the reader's spec, gathers the input at the step's start
    all the same and copies it whole at the fence (a plan recomputing 30 layers: 46.25
    GiB so, 46.12 without the fences).
    """
    jmesh = mesh.jax_mesh() if isinstance(mesh, DeviceMesh) else mesh
    shardings = {k: NamedSharding(jmesh, to_partition_spec(tuple(tuple(a) for a in s)))
                 for k, s in constraints.items()}
    outs_at = {k for k in shardings if " out " in k}
    ins_at = {k for k in shardings if " in " in k}

    def constrain_outputs(path, eqn, outs):
        return [jax.lax.with_sharding_constraint(x, shardings[value_key(path, k)])
                if value_key(path, k) in outs_at else x for k, x in enumerate(outs)]

    def pinned(key, x):
        """``x`` in the spec of the operand constraint at ``key`` (as it is where none)."""
        return jax.lax.with_sharding_constraint(x, shardings[key]) if key in ins_at else x

    def pin_operands(path, eqn, args):
        return [pinned(operand_key(path, i), x) for i, x in enumerate(args)]

    if not in_order:
        return constrain_outputs, (pin_operands if ins_at else None)
    chain = Chain()
    inputs = inputs or {}

    def after(path, eqn, outs):
        outs = constrain_outputs(path, eqn, outs)
        if eqn is None or eqn.primitive.name != "add_any":
            return outs
        # (its result constrained too: else XLA's propagation may give it another spec)
        return constrain_outputs(path, eqn, [chain.materialized(x) if fenceable(x)
                                             and jax.numpy.ndim(x) else x for x in outs])

    resharded: dict[tuple[int, Any], Any] = {}  # (id of a step input, sharding) -> its copy

    def before(path, eqn, args):
        args = [operand(path, eqn, args, i) for i in range(len(args))]
        if eqn is None or eqn.primitive.name != "dot_general":
            return args
        x, y = args
        for k in transposed_operands(jax.numpy.shape(x), jax.numpy.shape(y),
                                     eqn.params["dimension_numbers"], "cpu"):
            if fenceable((x, y)[k]):
                x, y = (chain.after(x, y), y) if k == 0 else (x, chain.after(y, x))
        return [x, y]

    def operand(path, eqn, args, i):
        """Operand ``i`` in its constraint's spec; a step input, the first time it is read
        in that spec, resharded after the op's computed operands."""
        x, key = args[i], operand_key(path, i)
        if key not in ins_at or eqn is None or id(x) not in inputs:
            return pinned(key, x)
        made = (id(x), shardings[key])
        if made not in resharded:
            # computed operands (a literal would be folded: no order)
            others = [a for a in args if isinstance(a, jax.core.Tracer)
                      and id(a) not in inputs and fenceable(a)]
            if others and fenceable(x):
                x = jax.lax.with_sharding_constraint(chain.after(x, others[0]), inputs[id(x)])
            resharded[made] = pinned(key, x)
        return resharded[made]

    return after, before
