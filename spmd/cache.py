"""The plan cache: a searched plan saved as JSON, keyed by the step's jaxpr, its inputs, the
mesh, the memory budget and spmd's own source, so a second run of the same step skips the
search. A file that no longer parses, or belongs to a step of another shape, is ignored.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Sequence

from spmd.cluster.agree import first_process
from spmd.cluster.mesh import DeviceMesh
from spmd.errors import warn
from spmd.options import SearchOptions
from spmd.plan import FORMAT_VERSION, Plan
from spmd.search.costgraph import InputInfo
from spmd.trace.signature import StepSignature

__all__ = ["cache_path", "load", "load_record", "record_path", "save", "save_record"]


@functools.cache
def _code_version() -> str:
    """A digest of spmd's own source: a plan found by other code is not reused."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_path(sig: StepSignature, inputs: Sequence[InputInfo], mesh: DeviceMesh,
               options: SearchOptions) -> Path | None:
    """Where the plan of this step is cached, or None when caching is off. (Hashing a
    large jaxpr's text takes seconds: only done when caching.)"""
    if not options.cache:
        return None
    digest = hashlib.sha256()
    digest.update(str(sig.jaxpr).encode())
    digest.update(repr([(i.path, i.shape, str(i.dtype), i.kind, i.pinned) for i in inputs])
                  .encode())
    digest.update(repr((mesh.axis_names, mesh.axis_sizes, sorted(mesh.links.items()),
                        mesh.device, options.plan_key(), FORMAT_VERSION,
                        _code_version())).encode())
    return options.directory() / f"{digest.hexdigest()[:32]}.json"


def _read(path: Path | None) -> str | None:
    """The text of a cache file, or None when there is none. In a multi-process run, the
    first process's file: another process may not have it yet (or, on another host, at
    all), and every process must go on from the same plan."""
    if path is None:
        return None
    return first_process(lambda: path.read_text() if path.exists() else None)


def load(path: Path | None, sig: StepSignature, mesh: DeviceMesh) -> Plan | None:
    """The cached plan bound to ``sig``, or None when there is none that fits."""
    text = _read(path)
    if text is None:
        return None
    try:
        cached = Plan.from_dict(json.loads(text), mesh)
    except (ValueError, KeyError, TypeError):
        return None
    if len(cached.input_specs) != len(sig.leaves):
        return None
    cached.leaves, cached.signature = sig.leaves, sig
    cached.search = {**(cached.search or {}), "cache": f"loaded {path}"}
    return cached


def save(plan: Plan, path: Path | None) -> None:
    """Save ``plan`` at ``path`` (a warning, not an error, when the disk refuses)."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        plan.save(path)
    except OSError as err:
        warn(f"could not save the plan cache {path}: {err}")


def record_path(plan_path: Path | None, kind: str) -> Path | None:
    """Where a record of ``kind`` about the plan cached at ``plan_path`` lives (beside it,
    under the same key), or None when caching is off."""
    return None if plan_path is None else plan_path.with_name(f"{plan_path.stem}-{kind}.json")


def load_record(path: Path | None) -> dict | None:
    """A record ``save_record`` wrote, or None when there is none or it does not parse."""
    text = _read(path)
    if text is None:
        return None
    try:
        raw = json.loads(text)
    except ValueError:
        return None
    return raw if isinstance(raw, dict) and raw.get("version") == FORMAT_VERSION else None


def save_record(record: dict, path: Path | None) -> None:
    """Save ``record`` at ``path`` (a warning, not an error, when the disk refuses)."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**record, "version": FORMAT_VERSION}, indent=1,
                                   default=str))
    except OSError as err:
        warn(f"could not save the plan cache {path}: {err}")
