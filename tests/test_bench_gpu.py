"""bench/gpu.py, the script a session with a lent GPU runs, end to end on one CPU device at a
tiny size: the device profiled, a step through spmd and the same step in plain JAX, and the
RESULTS.md section rendered from what it saved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import gpu  # noqa: E402  (bench/ is scripts, not a package)


def test_parse_case():
    assert gpu.parse_case("gpt-1.3b:bfloat16:8:remat=save_dots:scan_layers=true") == (
        "gpt-1.3b", "bfloat16", 8, {"remat": "save_dots", "scan_layers": True})
    with pytest.raises(SystemExit, match="model:dtype:batch"):
        gpu.parse_case("gpt-1.3b:bfloat16")


def test_a_dry_run_on_one_cpu_device(tmp_path):
    """As a session runs it, in a process of its own (one CPU device, as --mesh cpu-1 asks)."""
    case = "gpt-tiny:float32:2:remat=save_dots"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, str(BENCH / "gpu.py"), "--out", str(tmp_path),
                           "--mesh", "cpu-1", "--quick-profile", "--steps", "1", "--cases", case,
                           "--plain", case],
                          env=env, cwd=BENCH.parent, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads((tmp_path / "gpu.json").read_text())
    assert saved["skipped"] == []
    assert (tmp_path / "cpu-1-profiled.yaml").exists()
    (row,), (plain,) = saved["rows"], saved["plain"]
    # the same step from the same initial state, three steps each: the same loss
    assert row["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert row["model"] == plain["model"] == "gpt-tiny remat=save_dots"
    assert row["predicted_ms"] > 0 and row["step_ms"] > 0 and plain["peak_memory_gib"] > 0
    results = tmp_path / "RESULTS.md"
    gpu.write_report(tmp_path / "gpu.json", results)
    text = results.read_text()
    assert gpu.TITLE in text and "plain JAX's" in text and "measured / predicted" in text
