"""One answer on every process of a multi-process run.

Each process traces the step and plans it itself, and planning is deterministic except
where it reads the clock or its own disk: the solver's seeds and CP-SAT stop at wall-clock
deadlines, and the plan cache is a file that one process may have written before another
looks. Two processes that end a solve differently compile different programs whose
collectives never meet, and the run hangs (seen under load: a two-process pipeline waited
out its 600 s). So such a decision is made on the first process and sent to the others
(``first_process``), which then go on from the same answer.
"""

from __future__ import annotations

import json
from typing import Any, Callable, TypeVar

import numpy as np

from spmd import errors

__all__ = ["first_process"]

T = TypeVar("T")


def first_process(make: Callable[[], T], *, encode: Callable[[T], Any] = lambda v: v,
                  decode: Callable[[Any], T] = lambda v: v) -> T:
    """``make()`` on the first process, the same value on every other (not run there).

    ``encode`` turns the value into JSON-ready data and ``decode`` back. An error ``make``
    raises on the first process is raised on every process: spmd's own as the same class
    with the same message, any other as a ``PlanError`` naming it (so that no process is
    left waiting for an answer that never comes).
    """
    import jax

    if jax.process_count() == 1:
        return make()
    failure: BaseException | None = None
    payload: dict = {}
    if jax.process_index() == 0:
        try:
            payload = {"value": encode(make())}
        except Exception as err:  # sent on, then raised here as it was
            failure = err
            payload = {"error": type(err).__name__, "message": str(err),
                       "least": getattr(err, "least", None)}
    answer = json.loads(_broadcast(json.dumps(payload).encode()))
    if failure is not None:
        raise failure
    if "error" in answer:
        raise _error(answer)
    return decode(answer["value"])


def _error(answer: dict) -> Exception:
    """The first process's error, for another process to raise."""
    kind = getattr(errors, answer["error"], None)
    message = answer["message"]
    if kind is errors.InfeasibleError:
        return errors.InfeasibleError(message, answer["least"])
    if isinstance(kind, type) and issubclass(kind, errors.SpmdError):
        return kind(message)
    return errors.PlanError(f"the first process failed while planning: "
                            f"{answer['error']}: {message}")


def _broadcast(data: bytes) -> bytes:
    """The first process's ``data`` on every process: its length, then the bytes padded to
    a power of two (each new length compiles the broadcast again)."""
    from jax.experimental import multihost_utils

    size = int(multihost_utils.broadcast_one_to_all(np.array(len(data), np.int32)))
    buffer = np.zeros(1 << max(size - 1, 0).bit_length(), np.uint8)
    shown = min(len(data), size)  # (only the first process's bytes are taken)
    buffer[:shown] = np.frombuffer(data, np.uint8)[:shown]
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer))[:size])
