"""Evaluate a step's jaxpr equation by equation, with the same equation paths as
:func:`spmd.trace.graph.build_graph`, so a hook can act on the values the graph names (the
sharding-constraint interpreter of ``spmd.runtime.constrain``).

>>> import jax, jax.numpy as jnp
>>> cj = jax.make_jaxpr(lambda x: jnp.tanh(x) * 2)(jnp.ones(3))
>>> seen = []
>>> out = eval_jaxpr_with(cj.jaxpr, cj.consts, [jnp.ones(3)],
...                       lambda path, eqn, outs: seen.append(path) or outs)
>>> seen
[(0,), (1,)]
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

from jax.extend import core as jcore
from jax.extend import source_info_util

from spmd.trace.graph import SCAN, Path, inner_jaxpr, scoped

__all__ = ["eval_jaxpr_with", "named_like"]


def eval_jaxpr_with(jaxpr, consts: Sequence[Any], args: Sequence[Any],
                    hook: Callable[[Path, Any, list[Any]], list[Any]],
                    operand_hook: Callable[[Path, Any, list[Any]], list[Any]] | None = None,
                    path: Path = (), scope: Any = None) -> list[Any]:
    """Evaluate a jaxpr, inlining what ``build_graph`` inlines, each equation under its name
    stack within the whole step (``scope``: the calls' around it, as ``Node.scope``).

    ``operand_hook(path, eqn, args)`` may replace an equation's operands before it runs and
    ``hook(path, eqn, outs)`` its outputs after (the constraint interpreter of ``spmd.runtime.constrain``). A scan
    runs as ``lax.scan`` over its body, evaluated the same way; its boundary pseudo-ops
    (module docstring) get both hooks too, with ``eqn=None``.
    """
    import jax

    env: dict[Any, Any] = {}

    def read(atom):
        return atom.val if isinstance(atom, jcore.Literal) else env[atom]

    for var, c in zip(jaxpr.constvars, consts):
        env[var] = c
    for var, a in zip(jaxpr.invars, args):
        env[var] = a
    for i, eqn in enumerate(jaxpr.eqns):
        here = path + (i,)
        invals = [read(a) for a in eqn.invars]
        inner = inner_jaxpr(eqn)
        if inner is not None:
            if eqn.primitive.name in ("remat", "remat2", "checkpoint"):
                invals = _remat_barrier(eqn, invals, jax)
            outs = eval_jaxpr_with(inner[0], inner[1], invals, hook, operand_hook, here,
                                   scoped(scope, eqn))
        elif eqn.primitive.name == SCAN:
            outs = _eval_scan(eqn, invals, hook, operand_hook, here, scoped(scope, eqn))
        else:
            if operand_hook is not None:
                invals = operand_hook(here, eqn, invals)
            with named_like(eqn, scope=scope):
                outs = eqn.primitive.bind(*invals, **eqn.params)
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
            outs = hook(here, eqn, outs)
        for var, val in zip(eqn.outvars, outs):
            env[var] = val
    return [read(a) for a in jaxpr.outvars]


@contextlib.contextmanager
def named_like(eqn, prefix: str | None = None, scope: Any = None) -> Iterator[None]:
    """Bind under ``eqn``'s name stack within the step (``scope``: the name stack of the
    calls it was inlined from; ``prefix/`` before both), so a re-traced step keeps the names
    that tell its forward ops from its backward ones (``spmd.trace.layers``)."""
    info = eqn.source_info
    stack = scoped(scope, eqn)
    if prefix:
        stack = source_info_util.new_name_stack(prefix) + stack
    with source_info_util.user_context(info.traceback, name_stack=stack):
        yield


def _eval_scan(eqn, invals: list[Any], hook, operand_hook, path: Path,
               scope: Any) -> list[Any]:
    """One scan equation as ``lax.scan``, its body through ``eval_jaxpr_with`` (``scope``:
    the scan's name stack within the step)."""
    import jax

    params = eqn.params
    body, nc, nk = params["jaxpr"], params["num_consts"], params["num_carry"]

    def into(kind: str, k: int, x):  # a boundary pseudo-op's operand
        return operand_hook(path + (kind, k), None, [x])[0] if operand_hook is not None else x

    def out(kind: str, k: int, x):  # and its output
        return hook(path + (kind, k), None, [x])[0]

    def step(carry, xs):
        carry = [out("carry", k, c) for k, c in enumerate(carry)]
        xs = [out("xs", k, x) for k, x in enumerate(xs)]
        outs = eval_jaxpr_with(body.jaxpr, body.consts, [*invals[:nc], *carry, *xs], hook,
                               operand_hook, path, scope)
        outs = [jax.numpy.asarray(o, var.aval.dtype) if isinstance(var, jcore.Literal) else o
                for o, var in zip(outs, body.jaxpr.outvars)]
        new = [out("carry_out", k, into("carry_out", k, c)) for k, c in enumerate(outs[:nk])]
        return new, [into("ys", k, y) for k, y in enumerate(outs[nk:])]

    init = [out("carry", k, into("carry", k, c)) for k, c in enumerate(invals[nc:nc + nk])]
    xs = [into("xs", k, x) for k, x in enumerate(invals[nc + nk:])]
    carry, ys = jax.lax.scan(step, init, xs, length=params["length"], reverse=params["reverse"],
                             unroll=params["unroll"])
    return [*carry, *(out("ys", k, y) for k, y in enumerate(ys))]


def _remat_barrier(eqn, invals: list[Any], jax) -> list[Any]:
    """What remat's lowering does: an optimization barrier on the inputs of a differentiated
    checkpoint, so XLA does not merge the recomputation with the forward pass."""
    prevent = eqn.params.get("prevent_cse", True)
    if not eqn.params.get("differentiated", False):
        return invals
    if isinstance(prevent, bool):
        prevent = (prevent,) * len(invals)
    idx = [i for i, p in enumerate(prevent) if p]
    if not idx:
        return invals
    barred = jax.lax.optimization_barrier([invals[i] for i in idx])
    out = list(invals)
    for i, v in zip(idx, barred):
        out[i] = v
    return out
