"""The intra-op integer program as a self-contained solver: a flat request in, one strategy
per node out (``solve``); the request and its checks (``request``), min-sum diffusion
(``min_sum``), local search (``local_search``) and the CP-SAT model (``cpsat``)."""

from spmd.solver.cpsat import Scaled as Scaled
from spmd.solver.cpsat import rescale as rescale
from spmd.solver.request import SolverRequest as SolverRequest
from spmd.solver.request import SolverResult as SolverResult
from spmd.solver.request import evaluate as evaluate
from spmd.solver.request import memory_peak as memory_peak
from spmd.solver.request import validate as validate
from spmd.solver.driver import GAP as GAP
from spmd.solver.driver import solve as solve

__all__ = ["GAP", "Scaled", "SolverRequest", "SolverResult", "evaluate", "memory_peak",
           "rescale", "solve", "validate"]
