"""A train step of the user's own, named on the command line as ``module:function``
(``spmd plan --step mypkg.train:make``), the way ``python -m`` names a module: the current
directory is importable.

The contract: ``make()``, called with no arguments, returns ``(step_fn, args)``, ``args`` the
tuple of ``step_fn``'s positional arguments, among them the batch (found as ``spmd.plan``
finds it: the last argument whose arrays share one leading dimension). ``spmd plan`` needs only their shapes, so they may be abstract
(``nnx.eval_shape``, ``jax.ShapeDtypeStruct``). ``spmd run`` calls the step ``--steps``
times and needs concrete ones. NNX models and optimizers among the arguments are updated in
place, as spmd writes their state back, and the step returns its metrics; a step with no
NNX argument is functional and must return ``(new_state, metrics)``, its new state shaped
like its first argument, which the next call receives in its place (re-running it on the
same state would not train). Metrics holding a ``"loss"`` (or a scalar) are printed.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from spmd.errors import SpmdError
from spmd.trace.signature import flatten_step_args

__all__ = ["advance", "is_in_place", "load_step", "loss_of"]


def load_step(ref: str, *, concrete: bool) -> tuple[Callable, tuple]:
    """Import ``module:function``, call it, and check what it returns: ``(step_fn, args)``.

    ``concrete``: the arguments will be run on (``spmd run``), so abstract leaves are refused.

    Raises:
      SpmdError: a malformed reference, a module that cannot be imported, a missing or
        uncallable attribute, or a return value off the contract; each names the culprit.
    """
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise SpmdError(f"--step {ref!r}: expected module:function, e.g. mypkg.train:make")
    if os.getcwd() not in sys.path:  # as `python -m` does: the current directory first
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise SpmdError(f"--step {ref}: cannot import module {module_name!r} ({err}); "
                        f"searched the current directory {os.getcwd()} and sys.path") from None
    make = getattr(module, attr, None)
    if not callable(make):
        what = "has no attribute" if make is None else "has a non-callable"
        raise SpmdError(f"--step {ref}: module {module_name!r} ({module.__file__}) {what} "
                        f"{attr!r}; expected a function returning (step_fn, args)")
    made = make()
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])
            and isinstance(made[1], (tuple, list))):
        raise SpmdError(f"--step {ref}: {attr}() returned {_brief(made)}; expected "
                        f"(step_fn, args), args a tuple of step_fn's arguments")
    step_fn, args = made[0], tuple(made[1])
    if concrete:
        leaves, _ = flatten_step_args(args)
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            raise SpmdError(f"--step {ref}: {attr}() returned abstract arguments "
                            f"(jax.ShapeDtypeStruct leaves); `spmd run` runs the step, so it "
                            f"needs arrays (abstract ones are enough for `spmd plan`)")
    return step_fn, args


def is_in_place(args: tuple) -> bool:
    """Whether the step updates its state in place: it takes NNX graph nodes (models,
    optimizers), whose new state spmd writes back after each call."""
    return any(isinstance(a, nnx.Pytree) for a in args)


def advance(args: tuple, out: Any, in_place: bool) -> tuple[tuple, Any]:
    """The next call's arguments and this call's metrics, from what the step returned.

    Raises:
      SpmdError: a functional step whose output is not ``(new_state, metrics)`` with the
        new state structured like its first argument.
    """
    if in_place:
        return args, out
    if (isinstance(out, tuple) and len(out) == 2
            and jax.tree.structure(out[0]) == jax.tree.structure(args[0])):
        return (out[0], *args[1:]), out[1]
    raise SpmdError(f"the step takes no NNX model or optimizer, so `spmd run` needs it to return "
                    f"(new_state, metrics), new_state shaped like its first argument, to feed "
                    f"it back; it returned {_brief(out)}")


def loss_of(metrics: Any) -> float | None:
    """The loss to print: ``metrics["loss"]``, or the metrics themselves when a scalar."""
    value = metrics.get("loss") if isinstance(metrics, Mapping) else metrics
    if value is not None and getattr(value, "shape", None) == ():
        return float(jax.device_get(value))
    return None


def _brief(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__
