"""spmd: an automatic parallelizer for JAX/Flax training steps.

Public API: meshes (``load_mesh``, ``make_mesh``), plans (``plan``, ``Plan``), the compiled
step (``parallelize``), initialization into shardings (``materialize``), and the report of
what XLA emitted (``analyze``).
"""

from spmd.analysis.report import analyze as analyze  # binds the function over the submodule name
from spmd.data import process_local_batch as process_local_batch
from spmd.data import shard_batch as shard_batch
from spmd.errors import InfeasibleError as InfeasibleError
from spmd.errors import MeshError as MeshError
from spmd.errors import PlanError as PlanError
from spmd.errors import SpmdError as SpmdError
from spmd.cluster.mesh import DeviceMesh as DeviceMesh
from spmd.cluster.mesh import init_distributed as init_distributed
from spmd.cluster.mesh import load_mesh as load_mesh
from spmd.cluster.mesh import make_mesh as make_mesh
from spmd.api import ParallelStep as ParallelStep
from spmd.api import materialize as materialize
from spmd.api import parallelize as parallelize
from spmd.api import plan as plan
from spmd.plan import Plan as Plan
from spmd.planner import SearchOptions as SearchOptions

__all__ = [
    "DeviceMesh", "InfeasibleError", "MeshError", "ParallelStep", "Plan", "PlanError", "SearchOptions",
    "SpmdError", "analyze", "init_distributed", "load_mesh", "make_mesh", "materialize",
    "parallelize", "plan", "process_local_batch",
    "shard_batch",
]
