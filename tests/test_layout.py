"""The package's shape: data flows one way through its layers, no module reaches into
another's private names, and modules stay small."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "spmd"

#: each module may import only from its own layer or those before it
LAYERS = [
    {"spmd.units", "spmd.errors", "spmd.sharding", "spmd.options", "spmd.timing", "spmd.dtypes"},
    {"spmd.cluster.hardware", "spmd.cluster.devices", "spmd.cluster.mesh",
     "spmd.cluster.distributed", "spmd.cluster.agree"},
    {"spmd.trace.graph", "spmd.trace.interpret", "spmd.trace.signature", "spmd.trace.layers",
     "spmd.trace.regions", "spmd.trace.fence"},
    {"spmd.cost.partitioner"},  # what XLA emits: the rules ask it which collective
    {"spmd.rules"},
    {"spmd.cost.time"},
    {"spmd.kernel_timer"},  # ops timed in loops on every device at once
    {"spmd.profile"},  # measured figures for a mesh file, fitted to the cost model's formulas
    {"spmd.solver"},  # self-contained: errors, options and units only
    {"spmd.memory.liveness", "spmd.memory.remat", "spmd.memory.offload"},
    {"spmd.search.fusion", "spmd.search.layout", "spmd.search.roofline",
     "spmd.search.costgraph", "spmd.search.encode", "spmd.search.predict",
     "spmd.search.intra_op", "spmd.search.regions", "spmd.search.memory_fit",
     "spmd.search.point_memory"},
    {"spmd.stages.split", "spmd.stages.stack", "spmd.stages.schedule", "spmd.stages.price",
     "spmd.stages.dp"},  # the inter-op level
    {"spmd.plan", "spmd.explain", "spmd.logical", "spmd.manual", "spmd.stages.plan"},
    {"spmd.planner", "spmd.cache", "spmd.stages.stacked", "spmd.stages.manual",
     "spmd.stages.auto", "spmd.stages.levels"},
    {"spmd.runtime.constrain", "spmd.runtime.compile", "spmd.runtime.nodes",
     "spmd.runtime.pipeline", "spmd.runtime.stacked", "spmd.runtime.transfer"},
    {"spmd.analysis.hlo", "spmd.analysis.reconcile", "spmd.analysis.report", "spmd.data"},
    {"spmd.api"},
    {"spmd.checkpoint"},  # a step's state on disk, restored into any plan's shardings
    {"spmd.analysis.verify"},
    {"spmd.zoo"},  # the repository's models/ folder: Flax models, importing no spmd layer
    {"spmd.user_step", "spmd.cli", "spmd"},
]


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in layer):
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_layout.py")


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("spmd"):
            yield node.module, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("spmd"):
                    yield a.name, [], node.lineno


MODULES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module(p))
def test_imports_point_one_way(path):
    here = _module(path)
    if here == "spmd":
        return  # the public API re-exports every layer
    for module, names, line in _imports(path):
        target = f"spmd.{names[0]}" if module == "spmd" and names else module
        assert _layer(target) <= _layer(here), (
            f"{here} (layer {_layer(here)}) imports {target} (layer {_layer(target)}) at line "
            f"{line}: data flows cluster -> trace -> rules -> cost -> search -> plan -> "
            f"runtime -> analysis")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module(p))
def test_no_private_names_cross_modules(path):
    for module, names, line in _imports(path):
        private = [n for n in names if n.startswith("_")]
        assert not private, f"{_module(path)} imports {private} from {module} at line {line}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module(p))
def test_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= 600, f"{_module(path)} has {lines} lines; split it by concern"
