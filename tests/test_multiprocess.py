"""Two processes x four CPU devices (gloo) train like one process with eight devices."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import FAST_COMPILE_FLAGS
from spmd.cli import main

ROOT = Path(__file__).parent.parent


def test_two_processes_match_one_process(tmp_path, capsys):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env["XLA_FLAGS"] = FAST_COMPILE_FLAGS
    multi = tmp_path / "multi.json"
    run = [sys.executable, "-m", "spmd.cli", "run", "--model", "gpt-tiny", "--method", "dp_tp",
           "--steps", "3", "--mesh", "cpu-2x4"]
    launched = subprocess.run(
        [sys.executable, "-m", "spmd.cli", "launch", "-n", "2", "--", *run,
         "--output-json", str(multi)],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    assert "[p1]" in launched.stdout  # both processes ran and reported

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
