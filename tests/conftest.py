"""Test setup: 8 simulated CPU devices, set before jax initializes its backend.

``--xla_backend_optimization_level=0`` only lowers LLVM's effort when compiling the CPU
kernels (the HLO and SPMD partitioning passes are unchanged); most of the suite's time is
compiling tiny programs, so this halves it. ``--xla_cpu_use_fusion_emitters=false`` emits each
CPU fusion's kernel with XLA's older elemental emitter rather than its MLIR fusion emitters,
in about half the time. The partitioned program is the same (the same collectives, counts and
bytes; only the wrapping of lone ops into fusions differs, and with it temp buffers by a few
hundred bytes of 1.4 MB on gpt-tiny). An unknown flag aborts XLA ("Unknown flag"), so that
one is first tried in a subprocess (about 2 s) and left out where this jaxlib lacks it.
"""

import os
import subprocess
import sys
import tempfile

#: compile-speed flags every test process (and test_multiprocess.py's workers) runs with
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0"
_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib starts with ``flag`` in XLA_FLAGS (it aborts on one it lacks)."""
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                         capture_output=True, timeout=120)
    return run.returncode == 0


if _xla_knows(_EMITTERS):
    FAST_COMPILE_FLAGS += " " + _EMITTERS
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 " + FAST_COMPILE_FLAGS
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Plans searched in tests are cached per test session, never in the user's cache.
os.environ["SPMD_CACHE_DIR"] = tempfile.mkdtemp(prefix="spmd-plans-")


def traced_zoo_step(name: str, batch: int = 8, **config):
    """A zoo model's train step traced from abstract arguments: (StepSignature, op graph)."""
    import jax
    from flax import nnx

    from spmd import zoo
    from spmd.trace.graph import build_graph
    from spmd.trace.signature import StepSignature

    spec = zoo.get(name)
    if config:
        spec = spec.with_config(**config)

    model, opt = nnx.eval_shape(spec.training_state)
    sig = StepSignature(spec.train_step, (model, opt, jax.eval_shape(lambda: spec.batch(batch, 0))))
    return sig, build_graph(sig.jaxpr)


def assert_grads_close(got, want, *, atol: float = 1e-5, rtol: float = 1e-4,
                       what: str = "") -> None:
    """Gradient trees ``got`` (a parallel run) and ``want`` (one device) agree in fp32.

    Each leaf's absolute tolerance is ``atol`` times its own largest gradient, but at least
    a thousandth of the largest of the whole tree: fp32 noise follows the magnitudes
    summed, not the result, and a gradient that is zero in exact arithmetic (a key bias,
    which softmax ignores) came out as noise of ~1e-11 of either sign (gpt-tiny under
    pp_tp with gpipe on cpu-pp)."""
    import jax
    import numpy as np

    refs = [np.asarray(r) for r in jax.tree.leaves(want)]
    overall = max(float(np.abs(r).max()) for r in refs)
    for (path, leaf), ref in zip(jax.tree_util.tree_leaves_with_path(got), refs):
        scale = max(float(np.abs(ref).max()), 1e-3 * overall)
        np.testing.assert_allclose(np.asarray(leaf), ref, atol=atol * scale, rtol=rtol,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}".strip())
