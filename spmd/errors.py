"""Errors a user can fix, and warnings about their input. The CLI prints errors as one
message, without a traceback."""

import os
import sys
import warnings

from spmd.units import readable_bytes

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class SpmdError(ValueError):
    """Bad input from the user: a mesh file, a model name, a sharding that cannot apply.

    The message names the file, key, tensor, axis or size at fault and what would be valid.
    """


class MeshError(SpmdError):
    """A mesh file or mesh description is malformed or does not match the devices present."""


class PlanError(SpmdError):
    """A plan cannot be built or applied (unknown method, indivisible dimension, missing names)."""


class SolverTimeoutError(PlanError):
    """The solver ran out of time before it found any assignment (a longer time limit, or
    a warm start, may find one)."""


class InfeasibleError(PlanError):
    """No plan fits the memory budget. ``least``: the least peak memory found, in words
    (e.g. ``"44.01 KiB (45064 bytes)"``), where the solver could tell."""

    def __init__(self, message: str, least: str | None = None):
        super().__init__(message)
        self.least = least


def check_budget(method: str, need: float, budget: float | None, hint: str,
                 where: str = "per device") -> None:
    """A hand-written plan is not searched under the memory budget: it fits, or this raises
    an ``InfeasibleError`` saying by how much it does not, and ``hint`` what would."""
    if budget is not None and need > budget:
        raise InfeasibleError(
            f"method {method!r} needs {readable_bytes(need)} {where} (predicted), over "
            f"memory_budget={budget:.4g} bytes ({readable_bytes(budget)}) by "
            f"{readable_bytes(need - budget, exact=True)}; "
            f"{hint}")


class OptionsError(SpmdError):
    """An option holds a value outside its valid range (the message names the field)."""


class ProfileError(SpmdError):
    """A measurement gave no figure: times that do not grow with size, or lost in noise."""


class CheckpointError(SpmdError):
    """A checkpoint directory holds none, or one whose tensors do not match the model (the
    message names the first tensor and both shapes)."""


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn at the user's line: the innermost frame outside spmd, however deep the call
    (``spmd.plan``, a ``ParallelStep`` call), so the location printed and ``-W`` filters
    name the user's code. A fixed ``stacklevel`` is right for one path only."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: warn's caller
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
