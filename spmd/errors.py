"""Errors a user can fix. The CLI prints these as one message, without a traceback."""


class SpmdError(ValueError):
    """Bad input from the user: a mesh file, a model name, a sharding that cannot apply.

    The message names the file, key, tensor, axis or size at fault and what would be valid.
    """


class MeshError(SpmdError):
    """A mesh file or mesh description is malformed or does not match the devices present."""


class PlanError(SpmdError):
    """A plan cannot be built or applied (unknown method, indivisible dimension, missing names)."""


class InfeasibleError(PlanError):
    """No plan fits the memory budget."""
