"""Two processes take the first process's answer to a decision each would make alone (a
clock-bounded solve, a cache read): its value, or its error, the same on both."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import FAST_COMPILE_FLAGS

ROOT = Path(__file__).parent.parent

# Each process answers with its own index (as two clock-bounded solves may differ), then
# fails on the first process only; both must print the first process's answer and error.
SCRIPT = """
import jax
from spmd.cluster.agree import first_process
from spmd.cluster.distributed import init_distributed
from spmd.cluster.mesh import load_mesh
from spmd.errors import InfeasibleError

init_distributed(load_mesh("cpu-2x4"))
me = jax.process_index()
got = first_process(lambda: {"chosen": [me] * 300, "by": f"process {me}"})
print("answer", got["by"], len(got["chosen"]), set(got["chosen"]))

def fails():
    raise InfeasibleError(f"over budget on process {me}", least="3 GiB")
try:
    first_process(fails)
except InfeasibleError as err:
    print("error", err, err.least)
"""


def test_every_process_takes_the_first_process_answer_and_error():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = FAST_COMPILE_FLAGS
    launched = subprocess.run(
        [sys.executable, "-m", "spmd.cli", "launch", "-n", "2", "--",
         sys.executable, "-c", SCRIPT],
        env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = launched.stdout + launched.stderr
    assert launched.returncode == 0, out[-3000:]
    for p in ("p0", "p1"):
        assert f"[{p}] answer process 0 300 {{0}}" in out, out[-3000:]
        assert f"[{p}] error over budget on process 0 3 GiB" in out, out[-3000:]
