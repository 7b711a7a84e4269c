"""bench/step_time.py's arithmetic and report, without running a step: Spearman's rho with
ties, and a section rendered from a saved run (``--report``) stating what its numbers say."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import step_time  # noqa: E402  (bench/ is scripts, not a package)


def test_ranks_average_ties():
    assert step_time.ranks([5.0, 1.0, 5.0, 3.0, 5.0]) == [4.0, 1.0, 4.0, 2.0, 4.0]


def test_spearman():
    assert step_time.spearman([1, 2, 3, 4], [2, 4, 8, 16]) == pytest.approx(1.0)
    assert step_time.spearman([1, 2, 3, 4], [9, 7, 5, 1]) == pytest.approx(-1.0)
    # ranks (1, 2.5, 2.5, 4) against (1, 3, 2, 4): Pearson of the ranks
    assert step_time.spearman([1, 2, 2, 3], [10, 30, 20, 40]) == pytest.approx(0.9486833)
    assert step_time.spearman([1, 2], [1, 2]) is None  # too few to rank
    assert step_time.spearman([1, 1, 1], [1, 2, 3]) is None  # one side all ties


def _run(model: str, method: str, measured_ms: float, predicted_ms: float) -> dict:
    return {"model": model, "method": method, "predicted_s": predicted_ms / 1e3,
            "measured_s": measured_ms / 1e3, "executable_s": measured_ms / 2e3,
            "executable_times_s": [measured_ms / 1e3, measured_ms / 2e3, measured_ms / 3e3],
            "spread": 0.1, "kept_hand_written": None, "error": None,
            "fresh_bytes": measured_ms * 2**20}


def _part(mesh: str, runs: list[dict]) -> dict:
    models = sorted({r["model"] for r in runs})
    return {"mesh": mesh, "wall_s": 2.0, "profile_s": 1.0,
            "profile_summary": "device cpu-profiled: ...",
            "models": [{"model": m, "zoo_model": m, "config_overrides": {}, "warnings": []}
                       for m in models], "runs": runs}


def test_report_from_saved_json(tmp_path):
    data = {
        "command": "python bench/step_time.py", "date": "today", "steps": 10,
        "total_wall_s": 5.0, "quick": False, "keep_freed_memory": True,
        "machine": {"platform": "Linux", "cpu_count": 2, "python": "3.11"},
        "parts": {
            "one-device": _part("cpu-1", [_run("a", "auto", 10, 9), _run("b", "auto", 30, 10)]),
            "cpu-8": _part("cpu-8", [
                _run("a", "auto", 10, 1), _run("a", "dp", 20, 2), _run("a", "tp", 30, 3),
                _run("b", "auto", 30, 1), _run("b", "dp", 20, 2), _run("b", "tp", 10, 3),
                {"model": "b", "method": "fsdp", "error": "RuntimeError: boom"}]),
        },
    }
    saved, md = tmp_path / "run.json", tmp_path / "RESULTS.md"
    saved.write_text(json.dumps(data))
    assert step_time.main(["--report", str(saved), "--results-md", str(md)]) == 0
    text = md.read_text()
    assert step_time.SECTION in text
    assert any("| fsdp " in line and "failed: RuntimeError: boom" in line
               for line in text.splitlines())
    assert "M/P within 0.7-1.4 for 1 of 2 models (from 1.11 to 3.00)" in text
    assert "(E/P) within 0.7-1.4 for 0 of 2 models (from 0.56 to 1.50)" in text
    assert "Spearman >= 0.8 for 1 of 2 models (a)" in text
    assert "0.00 against the executable's, 0.00 against its fastest step." in text
    assert "predicted fastest (or tied for it) for 1 of 2 models" in text
    assert "auto's place by measured step time: a 1/3, b 3/3" in text
    assert "Plans that failed to plan, compile or run: b / fsdp." in text
    # fresh host pages per step: a column, and the worst case named
    assert "| fresh MiB |" in text and "MALLOC_MMAP_THRESHOLD_=1073741824" in text
    assert "at most 30.0 MiB of fresh pages (b / auto; median over plans 20.0 MiB)" in text
