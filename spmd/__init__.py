"""spmd: an automatic parallelizer for JAX/Flax training steps.

Public API: meshes (``load_mesh``, ``make_mesh``), plans (``plan``, ``Plan``), the compiled
step (``parallelize``), initialization into shardings (``materialize``), and the report of
what XLA emitted (``analyze``).
"""

from spmd.analyze import analyze as analyze  # binds the function over the submodule name
from spmd.data import process_local_batch as process_local_batch
from spmd.data import shard_batch as shard_batch
from spmd.errors import InfeasibleError as InfeasibleError
from spmd.errors import MeshError as MeshError
from spmd.errors import PlanError as PlanError
from spmd.errors import SpmdError as SpmdError
from spmd.mesh import DeviceMesh as DeviceMesh
from spmd.mesh import init_distributed as init_distributed
from spmd.mesh import load_mesh as load_mesh
from spmd.mesh import make_mesh as make_mesh
from spmd.parallelize import ParallelStep as ParallelStep
from spmd.parallelize import materialize as materialize
from spmd.parallelize import parallelize as parallelize
from spmd.parallelize import plan as plan
from spmd.plan import Plan as Plan
from spmd.search import SearchOptions as SearchOptions

__all__ = [
    "DeviceMesh", "InfeasibleError", "MeshError", "ParallelStep", "Plan", "PlanError", "SearchOptions",
    "SpmdError", "analyze", "init_distributed", "load_mesh", "make_mesh", "materialize",
    "parallelize", "plan", "process_local_batch",
    "shard_batch",
]
