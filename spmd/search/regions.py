"""The intra-op search of one region of a step on one (sub)mesh: what a pipeline stage of
those layers on those devices costs and needs, and its plan. The stage dynamic program asks
it once per (layer range, submesh); identical layer ranges (``Region.key``) on the same
submesh are served from a ``RegionCache``, not the solver.

>>> import jax, jax.numpy as jnp
>>> from spmd.cluster.mesh import make_mesh
>>> from spmd.trace.graph import build_graph
>>> from spmd.trace.regions import Region
>>> layer = lambda w, h: jnp.tanh(h @ w)
>>> g = build_graph(jax.make_jaxpr(lambda w, x: layer(w, layer(w, layer(w, x))))(
...     jnp.ones((64, 64)), jnp.ones((256, 64))))
>>> mesh = make_mesh({"data": 2, "model": 4}, virtual=True)
>>> cache = RegionCache()  # the second and third layers: the same program
>>> first = search_region(Region(g, [4, 5]), mesh.submesh({"data": 1}), cache=cache)
>>> again = search_region(Region(g, [6, 7]), mesh.submesh({"data": 1}), cache=cache)
>>> first.cached, again.cached, again.key == first.key
(False, True, True)
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping, Sequence

from spmd.cluster.mesh import DeviceMesh
from spmd.errors import InfeasibleError
from spmd.options import SearchOptions
from spmd.search.costgraph import InputInfo
from spmd.search.intra_op import AutoResult, IntraOp
from spmd.sharding import Spec
from spmd.trace.graph import Value, build_graph
from spmd.trace.regions import Region

__all__ = ["RegionCache", "RegionPlan", "search_region", "step_input_specs"]


@dataclasses.dataclass
class RegionPlan:
    """A region's plan on a submesh: its program, the specs of its inputs and outputs, its
    sharding constraints and its prediction (time and memory per device)."""

    key: str
    program: Any  # ClosedJaxpr: the region's inputs in, its outputs out
    inputs: list[InputInfo]
    output_aliases: dict[int, int]
    result: AutoResult
    cached: bool = False

    @property
    def prediction(self):
        return self.result.prediction


class RegionCache:
    """Searched regions by (region key, submesh, options): an identical layer range on an
    identical submesh is planned once."""

    def __init__(self) -> None:
        self._plans: dict[str, RegionPlan] = {}
        self.hits = 0
        self.misses = 0

    def get(self, key: str, inputs: list[InputInfo]) -> RegionPlan | None:
        """The plan stored under ``key``, for a region whose inputs are ``inputs``: alike
        in everything the key holds (shapes, kinds, pins), not in their paths, which the
        plan then carries as this region's (another stage's leaves, found by path)."""
        found = self._plans.get(key)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        return dataclasses.replace(found, inputs=inputs, cached=True)

    def put(self, key: str, plan: RegionPlan) -> None:
        self._plans[key] = plan


def _mesh_key(mesh: DeviceMesh) -> tuple:
    """What of a mesh a plan depends on (not which devices: a plan moves between them)."""
    return (mesh.axis_names, mesh.axis_sizes, sorted(mesh.links.items()), mesh.device,
            mesh.platform, mesh.virtual)


def region_inputs(region: Region, step_inputs: Sequence[InputInfo] | None) -> list[InputInfo]:
    """One InputInfo per region input: a step input keeps its own (kind, pin); a value
    another region produces is an ``activation``."""
    graph = region.graph
    out = []
    for v in region.inputs:
        node = graph.nodes[v.node]
        if node.kind == "input" and step_inputs is not None:
            out.append(step_inputs[node.input_index])
            continue
        kind = "activation" if node.kind == "op" else node.kind
        out.append(InputInfo(f"{node.key} out {v.index}", graph.value_shape(v),
                             graph.value_dtype(v), kind))
    return out


def region_aliases(region: Region, output_aliases: Mapping[int, int]) -> dict[int, int]:
    """Region outputs that are the new value of a region input (a step output aliasing a
    step input, both in the region)."""
    graph = region.graph
    position = {v: i for i, v in enumerate(region.inputs)}
    returned = {v: i for i, v in enumerate(region.outputs)}
    out = {}
    for o, i in output_aliases.items():
        v, src = graph.outputs[o], Value(graph.inputs[i], 0)
        if v is not None and v in returned and src in position:
            out[returned[v]] = position[src]
    return out


def step_input_specs(region: Region, plan: RegionPlan) -> dict[int, Spec]:
    """The spec ``plan`` chose for each step input ``region`` reads, by the input's index
    in the step (a stage keeps one spec per leaf, whichever of its tasks chose it)."""
    graph = region.graph
    return {graph.nodes[v.node].input_index: spec
            for v, spec in zip(region.inputs, plan.result.input_specs)
            if graph.nodes[v.node].kind == "input"}


def search_region(region: Region, mesh: DeviceMesh, *,
                  step_inputs: Sequence[InputInfo] | None = None,
                  output_aliases: Mapping[int, int] = {},
                  options: SearchOptions = SearchOptions(),
                  cache: RegionCache | None = None) -> RegionPlan:
    """The intra-op plan of ``region`` on ``mesh`` (a submesh of the step's, for a stage).

    ``step_inputs`` (the step's InputInfos) carry the pins and kinds of the step inputs the
    region reads; ``output_aliases`` the step's, so a parameter's update stays in its spec.
    """
    inputs = region_inputs(region, step_inputs)
    aliases = region_aliases(region, output_aliases)
    digest = hashlib.sha256(repr((
        region.key(), [(i.shape, str(i.dtype), i.kind, i.pinned) for i in inputs],
        sorted(aliases.items()), _mesh_key(mesh), options.plan_key())).encode()).hexdigest()[:32]
    if cache is not None:
        hit = cache.get(digest, inputs)
        if hit is not None:
            return hit
    program = region.program()
    graph = build_graph(program)
    job = IntraOp(graph, inputs, mesh, output_aliases=aliases)
    try:
        result = job.search(memory_budget=options.memory_budget, time_limit=options.time_limit,
                            solver=options.solver)
    except InfeasibleError:
        # Repeated layers share one choice per op; pins that differ between them (a
        # pipeline stage's parameters, each as its own layer's search chose) can leave the
        # shared choice no spec that meets every layer's: search them apart.
        job = IntraOp(graph, inputs, mesh, output_aliases=aliases, share_layers=False)
        result = job.search(memory_budget=options.memory_budget, time_limit=options.time_limit,
                            solver=options.solver)
    plan = RegionPlan(digest, program, inputs, aliases, result)
    if cache is not None:
        cache.put(digest, plan)
    return plan
