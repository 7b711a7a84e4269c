"""Two processes x four CPU devices (gloo) train like one process with eight devices, and a
pipeline with a stage on each process (either runtime) trains like one device."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import FAST_COMPILE_FLAGS
from flax import nnx

from spmd import zoo
from spmd.cli import main

ROOT = Path(__file__).parent.parent


def _launch(output: Path, *run_args: str, model: str = "gpt-tiny") -> str:
    """``spmd launch -n 2 -- spmd run ...``: the first process's losses go to ``output``."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env["XLA_FLAGS"] = FAST_COMPILE_FLAGS
    run = [sys.executable, "-m", "spmd.cli", "run", "--model", model, *run_args]
    launched = subprocess.run(
        [sys.executable, "-m", "spmd.cli", "launch", "-n", "2", "--", *run,
         "--output-json", str(output)],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    assert "[p1]" in launched.stdout  # both processes ran and reported
    return launched.stdout


def test_two_processes_match_one_process(tmp_path, capsys):
    multi = tmp_path / "multi.json"
    _launch(multi, "--method", "dp_tp", "--steps", "3", "--mesh", "cpu-2x4")

    single = tmp_path / "single.json"
    try:
        main(["run", "--model", "gpt-tiny", "--method", "dp_tp", "--steps", "3",
              "--mesh", "cpu-8", "--output-json", str(single)])
    except SystemExit as done:
        assert done.code == 0
    capsys.readouterr()
    got = json.loads(multi.read_text())["losses"]
    want = json.loads(single.read_text())["losses"]
    assert len(got) == 3
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


@pytest.mark.parametrize("model,shown", [
    # MPMD: the activations, their gradients and the tied embedding cross by
    # collective-permute programs of their own
    ("gpt-tiny", ["send 0->1", "send 1->0"]),
    # SPMD: one program on both processes, the stack's halves on each one's devices
    ("gpt-tiny-scan", ["runtime SPMD (gpipe)", "compiled program (the SPMD pipeline"]),
])
def test_a_pipeline_across_two_processes_matches_one_device(tmp_path, model, shown):
    """pp_dp on cpu-2x4-pp, stage 0 on the first process and stage 1 on the second, by
    either runtime: both processes print the one device's losses."""
    multi = tmp_path / "multi.json"
    out = _launch(multi, "--method", "pp_dp", "--steps", "2", "--mesh", "cpu-2x4-pp",
                  model=model)
    assert all(text in out for text in shown), out[-2000:]
    spec = zoo.get(model)
    net, opt = spec.training_state(0)
    batch = spec.batch(spec.default_batch_size, 0)
    ref_step = nnx.jit(spec.train_step)
    want = [float(ref_step(net, opt, batch)["loss"]) for _ in range(2)]
    got = json.loads(multi.read_text())["losses"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # the second process printed the same losses as the first: it holds the loss too
    for k, loss in enumerate(got):
        assert f"[p1] step {k + 1:4d}  loss {loss:.6f}" in out, out[-2000:]
