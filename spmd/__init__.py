"""spmd: an automatic parallelizer for JAX/Flax training steps.

Public API: meshes (``load_mesh``, ``make_mesh``), plans (``plan``, ``Plan``, ``Prediction``),
the compiled step (``parallelize``), initialization into shardings (``materialize``),
checkpoints restored under any plan (``save_checkpoint``, ``restore_checkpoint``,
``is_checkpoint``), the report of what XLA emitted (``analyze``), and the options
(``SearchOptions``, ``SolverOptions``, ``PipelineOptions``); pipeline plans are
``PipelinePlan``s.
"""

from spmd.analysis.report import analyze as analyze
from spmd.api import ParallelStep as ParallelStep
from spmd.api import eval_shape as eval_shape
from spmd.api import materialize as materialize
from spmd.api import parallelize as parallelize
from spmd.api import plan as plan  # binds the function over the submodule spmd.plan
from spmd.checkpoint import is_checkpoint as is_checkpoint
from spmd.checkpoint import restore as restore_checkpoint
from spmd.checkpoint import save as save_checkpoint
from spmd.cluster.mesh import DeviceMesh as DeviceMesh
from spmd.cluster.mesh import load_mesh as load_mesh
from spmd.cluster.mesh import make_mesh as make_mesh
from spmd.cluster.distributed import init_distributed as init_distributed
from spmd.data import process_local_batch as process_local_batch
from spmd.data import shard_batch as shard_batch
from spmd.errors import CheckpointError as CheckpointError
from spmd.errors import InfeasibleError as InfeasibleError
from spmd.errors import MeshError as MeshError
from spmd.errors import OptionsError as OptionsError
from spmd.errors import PlanError as PlanError
from spmd.errors import SpmdError as SpmdError
from spmd.options import PipelineOptions as PipelineOptions
from spmd.options import SearchOptions as SearchOptions
from spmd.options import SolverOptions as SolverOptions
from spmd.plan import Plan as Plan
from spmd.search.predict import Prediction as Prediction
from spmd.stages.plan import PipelinePlan as PipelinePlan

__all__ = [
    "CheckpointError", "DeviceMesh", "InfeasibleError", "MeshError", "OptionsError",
    "ParallelStep", "PipelineOptions", "PipelinePlan", "Plan", "PlanError", "Prediction",
    "SearchOptions", "SolverOptions",
    "SpmdError", "analyze", "eval_shape", "init_distributed", "is_checkpoint", "load_mesh",
    "make_mesh", "materialize", "parallelize", "plan", "process_local_batch",
    "restore_checkpoint", "save_checkpoint", "shard_batch",
]
