"""Plan: the sharding of every input (and, for auto plans, chosen intermediates), with the
numbers behind it. Hand-written and searched plans are the same object, so they compare,
print and save alike. A plan is data: running it is ``spmd.runtime``'s business.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from spmd.cluster.mesh import DeviceMesh
from spmd.errors import PlanError
from spmd.explain import describe as explain
from spmd.memory.offload import HOST_MEMORY_KIND, OffloadPlan, offload
from spmd.memory.remat import RematPlan, rematerialize
from spmd.search.predict import Prediction
from spmd.sharding import Spec, bytes_per_device, spec_from_json, spec_to_json, to_partition_spec
from spmd.trace.signature import Leaf, StepSignature

__all__ = ["FORMAT_VERSION", "Plan"]

FORMAT_VERSION = 2


@dataclasses.dataclass
class Plan:
    """A sharding plan for one step on one mesh.

    ``input_specs[i]`` is the spec of ``leaves[i]``; ``output_specs[i]`` of the i-th flat output
    (None: left to XLA). ``prediction`` is the cost model's view (``Prediction``),
    ``alternatives`` the same for each hand-written plan (or why it was not scored),
    ``measured`` what the compiled HLO showed (see :meth:`attach_measured`). ``remat`` is
    which layers recompute what in the backward pass (``spmd.memory.remat``; None: none),
    ``offload`` which inputs live in pinned host memory between steps
    (``spmd.memory.offload``; None: none). ``signature`` is the traced step the plan belongs
    to (None for a plan loaded from JSON until ``spmd.plan`` binds it).
    """

    method: str
    mesh: DeviceMesh
    leaves: list[Leaf]
    input_specs: list[Spec]
    output_specs: list[Spec | None]
    prediction: Prediction | None = None
    search: dict | None = None
    constraints: dict[str, Spec] = dataclasses.field(default_factory=dict)
    alternatives: dict[str, Prediction | str] = dataclasses.field(default_factory=dict)
    measured: dict | None = None
    remat: RematPlan | None = None
    offload: OffloadPlan | None = None
    signature: StepSignature | None = dataclasses.field(default=None, repr=False)
    #: (signature, ClosedJaxpr) of ``program()`` once built: the planner hands over the
    #: rewritten step it searched, so a fresh plan does not rewrite it again
    _program: Any = dataclasses.field(default=None, repr=False, compare=False)
    #: ``spmd.search.intra_op.Searched``: the answer and the graph it was found on, what
    #: ``priced_on`` prices again (a plan loaded from JSON has none)
    _searched: Any = dataclasses.field(default=None, repr=False, compare=False)

    # -- shardings -----------------------------------------------------------------------------
    def input_shardings_flat(self) -> list:
        """Per flat input its NamedSharding; an offloaded one in pinned host memory."""
        from jax.sharding import NamedSharding

        mesh = self.mesh.sharding_mesh()
        host = self._host_inputs()
        return [NamedSharding(mesh, to_partition_spec(s),
                              memory_kind=HOST_MEMORY_KIND if i in host else None)
                for i, s in enumerate(self.input_specs)]

    def output_shardings_flat(self) -> list:
        """Per flat output its NamedSharding (None: left to XLA); the new value of an
        offloaded input in pinned host memory."""
        from jax.sharding import NamedSharding

        mesh = self.mesh.sharding_mesh()
        host = self._host_inputs()
        aliases = self.bound_signature().output_aliases if host else {}
        return [None if s is None else NamedSharding(
                    mesh, to_partition_spec(s),
                    memory_kind=HOST_MEMORY_KIND if aliases.get(o) in host else None)
                for o, s in enumerate(self.output_specs)]

    def _host_inputs(self) -> set[int]:
        return set(self.offload.inputs) if self.offload is not None else set()

    @property
    def in_shardings(self) -> tuple:
        """NamedShardings arranged like the example arguments (NNX nodes: an nnx.State)."""
        return self.bound_signature().unflatten_inputs(self.input_shardings_flat())

    @property
    def out_shardings(self) -> Any:
        return self.bound_signature().unflatten_output_values(self.output_shardings_flat())

    def bound_signature(self) -> StepSignature:
        """The traced step; a plan loaded from JSON has none until ``spmd.plan`` binds it."""
        if self.signature is None:
            raise ValueError("this plan was loaded from JSON; bind it with spmd.plan(...) first")
        return self.signature

    def program(self):
        """The ClosedJaxpr this plan runs: the step's, with ``remat``'s recomputation written
        into its backward pass and ``offload``'s copies between host and device (the
        constraints' keys name its equations)."""
        sig = self.bound_signature()
        remat = self.remat is not None and self.remat.active
        offloaded = self.offload is not None and self.offload.active
        if not (remat or offloaded):
            return sig.jaxpr
        if self._program is None or self._program[0] is not sig:
            program = rematerialize(sig.jaxpr, self.remat) if remat else sig.jaxpr
            if offloaded:
                program = offload(program, self.offload, sig.output_aliases)
            self._program = (sig, program)
        return self._program[1]

    @property
    def rewritten(self) -> bool:
        """Whether ``program()`` differs from the step as traced (remat or offload)."""
        return any(p is not None and p.active for p in (self.remat, self.offload))

    # -- numbers -------------------------------------------------------------------------------
    def priced_on(self, platform: str) -> Prediction | None:
        """This plan as ``platform``'s XLA would run it on the same cluster: its mesh's
        shape and figures, that platform's collectives (XLA:CPU all-reduces and slices what
        XLA:GPU reduce-scatters, and combines a step's reductions into one). How a plan for
        a GPU mesh compiled on simulated CPU devices is read; None for a plan not searched
        or scored in this process (loaded from the cache)."""
        if self._searched is None:
            return None
        if platform == self.mesh.platform:
            return self._searched.result.prediction
        return self._searched.price_on(dataclasses.replace(
            self.mesh, platform=platform, stands_in_for=self.mesh.platform
            if self.mesh.compile_backend == platform else None))

    def bytes_by_kind(self) -> dict[str, int]:
        """Per-device bytes of the step's inputs under this plan, by kind."""
        totals: dict[str, int] = {}
        for leaf, spec in zip(self.leaves, self.input_specs):
            totals[leaf.kind] = totals.get(leaf.kind, 0) + bytes_per_device(
                leaf.shape, leaf.dtype, spec, self.mesh.shape)
        return totals

    def attach_measured(self, report) -> None:
        """Record what the compiled program did (a ``spmd.analyze`` Report) beside the
        prediction."""
        self.measured = report.record(self.mesh)

    def describe(self, max_rows: int | None = 60) -> str:
        """A readable report: parameter specs, predicted collectives and time, alternatives,
        and predicted vs measured after compile (``spmd.explain``)."""
        return explain(self, max_rows)

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
                        "spec": spec_to_json(s)} for l, s in zip(self.leaves, self.input_specs)],
            "outputs": [spec_to_json(s) for s in self.output_specs],
            "constraints": {k: spec_to_json(v) for k, v in self.constraints.items()},
            "prediction": None if self.prediction is None else self.prediction.to_dict(),
            "search": self.search,
            "alternatives": {k: v if isinstance(v, str) else v.to_dict()
                             for k, v in self.alternatives.items()},
            "measured": self.measured,
            "remat": None if self.remat is None else self.remat.to_dict(),
            "offload": None if self.offload is None else self.offload.to_dict(),
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, raw: Mapping, mesh: DeviceMesh) -> "Plan":
        if raw.get("kind") == "pipeline":
            raise PlanError(f"this is a record of a pipeline plan (method "
                            f"{raw.get('method')!r}, {len(raw.get('stages', []))} stages), "
                            f"which is not loaded back: plan the step again with spmd.plan")
        if raw.get("version") != FORMAT_VERSION:
            raise ValueError(f"plan format {raw.get('version')}, expected {FORMAT_VERSION}")
        leaves = [Leaf(e["path"], tuple(e["shape"]), np.dtype(e["dtype"]), e["kind"],
                       tuple(e["logical"]) if e["logical"] else None) for e in raw["inputs"]]
        prediction = raw.get("prediction")
        return cls(
            method=raw["method"], mesh=mesh, leaves=leaves,
            input_specs=[spec_from_json(e["spec"]) for e in raw["inputs"]],
            output_specs=[spec_from_json(s) for s in raw["outputs"]],
            prediction=None if prediction is None else Prediction.from_dict(prediction),
            search=raw.get("search"),
            constraints={k: spec_from_json(v) for k, v in raw.get("constraints", {}).items()},
            alternatives={k: v if isinstance(v, str) else Prediction.from_dict(v)
                          for k, v in raw.get("alternatives", {}).items()},
            measured=raw.get("measured"),
            remat=RematPlan.from_dict(raw["remat"]) if raw.get("remat") else None,
            offload=OffloadPlan.from_dict(raw["offload"]) if raw.get("offload") else None,
        )

    @classmethod
    def load(cls, path: str | Path, mesh: DeviceMesh) -> "Plan":
        return cls.from_dict(json.loads(Path(path).read_text()), mesh)
