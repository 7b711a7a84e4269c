"""The intra-op integer program as a self-contained solver: a flat request in, one strategy
per node out (``solve``). The request, its checks and its folded form (``request``), min-sum
diffusion (``min_sum``), local search (``local_search``), the CP-SAT model (``cpsat``) and
the driver that runs them (``driver``). It imports nothing of spmd but its errors and
options, so it is tested on hand-written cost matrices and a saved request replays alone.
"""

from spmd.solver.cpsat import Scaled as Scaled
from spmd.solver.cpsat import rescale as rescale
from spmd.solver.driver import solve as solve
from spmd.solver.request import Reduced as Reduced
from spmd.solver.request import SolverRequest as SolverRequest
from spmd.solver.request import SolverResult as SolverResult
from spmd.solver.request import evaluate as evaluate
from spmd.solver.request import memory_peak as memory_peak
from spmd.solver.request import reduce as reduce
from spmd.solver.request import validate as validate

__all__ = ["Reduced", "Scaled", "SolverRequest", "SolverResult", "evaluate", "memory_peak",
           "reduce", "rescale", "solve", "validate"]
