"""Plan: the sharding of every input (and, for auto plans, chosen intermediates), with the
numbers behind it. Hand-written and searched plans are the same object, so they compare,
print and save alike.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from spmd.cluster.mesh import DeviceMesh
from spmd.cost.partitioner import COLLECTIVE_KINDS
from spmd.sharding import Spec, bytes_per_device, format_spec, to_partition_spec
from spmd.trace.signature import Leaf, StepSignature

FORMAT_VERSION = 1


def _spec_to_json(spec: Spec | None) -> list | None:
    return None if spec is None else [list(axes) for axes in spec]


def _spec_from_json(raw: list | None) -> Spec | None:
    return None if raw is None else tuple(tuple(axes) for axes in raw)


@dataclasses.dataclass
class Plan:
    """A sharding plan for one step on one mesh.

    ``input_specs[i]`` is the spec of ``leaves[i]``; ``output_specs[i]`` of the i-th flat output
    (None: left to XLA). ``prediction`` is the cost model's view (a dict with compute/comm time,
    collectives and memory), ``alternatives`` the same for each hand-written plan (or why it
    does not apply), ``measured`` what the compiled HLO showed (see :meth:`attach_measured`).
    """

    method: str
    mesh: DeviceMesh
    leaves: list[Leaf]
    input_specs: list[Spec]
    output_specs: list[Spec | None]
    prediction: dict | None = None
    search: dict | None = None
    constraints: dict[str, Spec] = dataclasses.field(default_factory=dict)
    alternatives: dict[str, Any] = dataclasses.field(default_factory=dict)
    measured: dict | None = None
    signature: StepSignature | None = dataclasses.field(default=None, repr=False)
    jax_mesh: Any = dataclasses.field(default=None, repr=False)
    jaxpr: Any = dataclasses.field(default=None, repr=False)  # the traced step (auto plans)

    # -- shardings -----------------------------------------------------------------------------
    def _sharding_mesh(self):
        if self.jax_mesh is None:
            try:
                self.jax_mesh = self.mesh.jax_mesh()
            except Exception:  # planning for a cluster that is not here: abstract mesh
                self.jax_mesh = self.mesh.abstract_mesh()
        return self.jax_mesh

    def input_shardings_flat(self) -> list:
        from jax.sharding import NamedSharding

        mesh = self._sharding_mesh()
        return [NamedSharding(mesh, to_partition_spec(s)) for s in self.input_specs]

    def output_shardings_flat(self) -> list:
        from jax.sharding import NamedSharding

        mesh = self._sharding_mesh()
        return [None if s is None else NamedSharding(mesh, to_partition_spec(s))
                for s in self.output_specs]

    @property
    def in_shardings(self) -> tuple:
        """NamedShardings arranged like the example arguments (NNX nodes: an nnx.State)."""
        return self._need_signature().unflatten_inputs(self.input_shardings_flat())

    @property
    def out_shardings(self) -> Any:
        return self._need_signature().unflatten_output_values(self.output_shardings_flat())

    def _need_signature(self) -> StepSignature:
        if self.signature is None:
            raise ValueError("this plan was loaded from JSON; bind it with spmd.plan(...) first")
        return self.signature

    # -- numbers -------------------------------------------------------------------------------
    def bytes_by_kind(self) -> dict[str, int]:
        """Per-device bytes of the step's inputs under this plan, by kind."""
        totals: dict[str, int] = {}
        for leaf, spec in zip(self.leaves, self.input_specs):
            totals[leaf.kind] = totals.get(leaf.kind, 0) + bytes_per_device(
                leaf.shape, leaf.dtype, spec, self.mesh.shape)
        return totals

    def attach_measured(self, report) -> None:
        """Record what the compiled program did (a spmd.analyze Report) beside the prediction."""
        comm, unpriced = report.comm_time(self.mesh)
        self.measured = {
            "collectives": {k: [c, b] for k, (c, b) in report.collectives.items()},
            "memory": None if report.memory is None else dataclasses.asdict(report.memory),
            "flops": report.flops, "comm_time": comm, "unpriced_collectives": unpriced}

    # -- explanation ---------------------------------------------------------------------------
    def describe(self, max_rows: int | None = 60) -> str:
        """A readable report: parameter specs, predicted collectives and time, alternatives,
        and predicted vs measured after compile."""
        from rich.console import Console
        from rich.table import Table

        buf = io.StringIO()
        console = Console(file=buf, width=120, record=False, force_terminal=False)
        console.print(f"plan: method={self.method}  {self.mesh.describe()}")
        table = Table(title="inputs", show_lines=False)
        for col in ("tensor", "kind", "shape", "logical", "spec", "bytes/device"):
            table.add_column(col, justify="right" if col == "bytes/device" else "left")
        rows = list(zip(self.leaves, self.input_specs))
        shown = rows if max_rows is None else rows[:max_rows]
        for leaf, spec in shown:
            logical = ",".join(n or "-" for n in leaf.logical) if leaf.logical else ""
            table.add_row(leaf.path, leaf.kind, str(leaf.shape), logical, format_spec(spec),
                          f"{bytes_per_device(leaf.shape, leaf.dtype, spec, self.mesh.shape):,}")
        if len(rows) > len(shown):
            table.add_row(f"... {len(rows) - len(shown)} more", "", "", "", "", "")
        console.print(table)
        totals = self.bytes_by_kind()
        console.print("state per device: " + ", ".join(f"{k} {v / 2**20:.2f} MiB"
                                                        for k, v in sorted(totals.items())))
        if self.search:
            summary = self._solver_summary()
            if summary:
                console.print(summary)
            console.print("search: " + ", ".join(f"{k}={v}" for k, v in self.search.items()
                                                  if not isinstance(v, (dict, list))))
            if self.search.get("fallbacks"):
                console.print(f"replicated (no sharding rule): {self.search['fallbacks']}")
        if self.prediction or self.alternatives:
            console.print(self._prediction_table())
        if self.measured and self.prediction:
            console.print(self._measured_table())
            if self.measured.get("comm_time") is not None:
                unpriced = self.measured.get("unpriced_collectives") or 0
                console.print(
                    f"communication priced by the cost model: predicted "
                    f"{self.prediction['comm_time'] * 1e3:.3f} ms, the HLO's collectives "
                    f"{self.measured['comm_time'] * 1e3:.3f} ms (each priced alone, so an upper "
                    f"bound where XLA combined them"
                    + (f"; {unpriced} not priced: no whole-axis replica groups" if unpriced else "")
                    + ")")
        elif self.measured and self.measured.get("memory"):
            console.print(f"compiled: peak {self.measured['memory']['peak_bytes'] / 2**20:.2f} "
                          f"MiB per device")
        return buf.getvalue()

    def _solver_summary(self) -> str | None:
        """How good the search's plan is: the objective against the proven lower bound."""
        s = self.search or {}
        if s.get("objective") is None or s.get("bound") is None:
            return None
        objective, bound = s["objective"], s["bound"]
        gap = (objective - bound) / objective if objective > 0 else 0.0
        how = ("; stopped at the time limit" if s.get("timed_out")
               else "; stopped early, no better plan coming" if s.get("stalled") else "")
        kept = (f"; the hand-written plan {s['kept_hand_written']} scored better and is used"
                if s.get("kept_hand_written") else "")
        return (f"solver: {s.get('status')} in {s.get('search_seconds', 0):.2f} s, objective "
                f"{objective * 1e3:.4g} ms, lower bound {bound * 1e3:.4g} ms "
                f"({s.get('bound_from', 'cp-sat')}): within {gap:.2%} of optimal{how}{kept}")

    def _prediction_table(self):
        from rich.table import Table

        table = Table(title="predicted cost per step (cost model)")
        for col in ("plan", "compute ms", "comm ms", "total ms", "collective MiB", "memory MiB",
                    "note"):
            table.add_column(col, justify="left" if col in ("plan", "note") else "right")
        entries = ([(f"{self.method} (this plan)", self.prediction)] if self.prediction else [])
        entries += [(name, pred) for name, pred in self.alternatives.items()]
        for name, pred in entries:
            if isinstance(pred, str) or pred is None:
                table.add_row(name, "", "", "", "", "", pred or "")
                continue
            coll = sum(b for _, b in pred["collectives"].values())
            table.add_row(name, f"{pred['compute_time'] * 1e3:.3f}",
                          f"{pred['comm_time'] * 1e3:.3f}", f"{pred['total_time'] * 1e3:.3f}",
                          f"{coll / 2**20:.3f}", f"{pred['memory_bytes'] / 2**20:.2f}", "")
        return table

    def _measured_table(self):
        from rich.table import Table

        table = Table(title="predicted vs compiled HLO (per device; XLA may combine "
                      "collectives, so compare bytes)")
        for col in ("kind", "pred count", "pred MiB", "HLO count", "HLO MiB"):
            table.add_column(col, justify="left" if col == "kind" else "right")
        pred = self.prediction["collectives"]
        meas = self.measured["collectives"]
        for kind in COLLECTIVE_KINDS:
            pc, pb = pred.get(kind, (0, 0))
            mc, mb = meas.get(kind, (0, 0))
            if pc or mc:
                table.add_row(kind, str(pc), f"{pb / 2**20:.3f}", str(mc), f"{mb / 2**20:.3f}")
        if self.measured.get("memory"):
            table.add_row("peak memory", "", f"{self.prediction['memory_bytes'] / 2**20:.3f}", "",
                          f"{self.measured['memory']['peak_bytes'] / 2**20:.3f}")
        return table

    # -- persistence ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "version": FORMAT_VERSION,
            "method": self.method,
            "mesh": {"name": self.mesh.name, "shape": self.mesh.shape,
                     "device": self.mesh.device.name},
            "inputs": [{"path": l.path, "kind": l.kind, "shape": list(l.shape),
                        "dtype": np.dtype(l.dtype).name,
                        "logical": list(l.logical) if l.logical else None,
                        "spec": _spec_to_json(s)} for l, s in zip(self.leaves, self.input_specs)],
            "outputs": [_spec_to_json(s) for s in self.output_specs],
            "constraints": {k: _spec_to_json(v) for k, v in self.constraints.items()},
            "prediction": self.prediction,
            "search": self.search,
            "alternatives": self.alternatives,
            "measured": self.measured,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, raw: Mapping, mesh: DeviceMesh) -> "Plan":
        leaves = [Leaf(e["path"], tuple(e["shape"]), np.dtype(e["dtype"]), e["kind"],
                       tuple(e["logical"]) if e["logical"] else None) for e in raw["inputs"]]
        return cls(
            method=raw["method"], mesh=mesh, leaves=leaves,
            input_specs=[_spec_from_json(e["spec"]) for e in raw["inputs"]],
            output_specs=[_spec_from_json(s) for s in raw["outputs"]],
            prediction=raw.get("prediction"), search=raw.get("search"),
            constraints={k: _spec_from_json(v) for k, v in raw.get("constraints", {}).items()},
            alternatives=raw.get("alternatives", {}), measured=raw.get("measured"),
        )

    @classmethod
    def load(cls, path: str | Path, mesh: DeviceMesh) -> "Plan":
        return cls.from_dict(json.loads(Path(path).read_text()), mesh)
