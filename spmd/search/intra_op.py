"""The intra-operator search (Alpa §4; DESIGN.md, "The intra-op integer program"): a step, or
a region of one, on a mesh or submesh, searched or scored on one cost graph.

``IntraOp`` holds the cost graph of one program on one mesh (``spmd.search.costgraph``) and
its encoder (``spmd.search.encode``). ``IntraOp.search`` solves it with the inputs the user
pinned; ``IntraOp.score`` with every input pinned to a hand-written plan, so the search and
each plan it is compared with are priced on the same graph, only their pins differ. Both
answer an ``AutoResult``: a spec for every input and output, sharding constraints on the
intermediates worth constraining, and the ``Prediction`` (``spmd.search.predict``) of the
numbers the solver minimized. ``search``, ``score`` and ``score_result`` are the one-shot
forms for a traced step.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Iterable, Mapping, Sequence

import numpy as np

from spmd import rules as _rules
from spmd.cluster.agree import first_process
from spmd.cluster.mesh import DeviceMesh
from spmd.errors import PlanError
from spmd.options import SearchOptions, SolverOptions
from spmd.search.costgraph import CostGraph, InputInfo
from spmd.search.encode import Encoder, Encoding
from spmd.search.point_memory import held, point_terms
from spmd.search.predict import Prediction, predict, predict_with_peak
from spmd.sharding import Spec, replicated, spec_from_json, spec_to_json
from spmd.solver import SolverRequest, SolverResult, memory_peak, solve
from spmd.timing import Stopwatch
from spmd.trace.graph import Graph, Value, build_graph, operand_key, value_key

__all__ = ["AutoResult", "InputInfo", "IntraOp", "Prediction", "Searched", "score", "score_result",
           "score_searched", "search"]

@dataclasses.dataclass
class AutoResult:
    """What a search (or a scoring) found: specs, the prediction, the solver's report, and
    the sharding constraints that apply it (empty for a scoring: ``IntraOp.constraints``)."""

    input_specs: list[Spec]
    output_specs: list[Spec]
    prediction: Prediction
    solver: SolverResult | None
    stats: dict
    fallbacks: list[str]
    constraints: dict[str, Spec]
    #: the strategy chosen for every graph node (not saved): lets a scored plan seed a
    #: search over the same graph without solving it again
    node_strategies: list[_rules.Strategy] | None = dataclasses.field(default=None, repr=False)

    def to_dict(self) -> dict:
        return {
            "input_specs": [spec_to_json(s) for s in self.input_specs],
            "output_specs": [spec_to_json(s) for s in self.output_specs],
            "prediction": self.prediction.to_dict(),
            "solver": dataclasses.asdict(self.solver) if self.solver is not None else None,
            "stats": dict(self.stats), "fallbacks": list(self.fallbacks),
            "constraints": {k: spec_to_json(s) for k, s in self.constraints.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "AutoResult":
        return cls(
            [spec_from_json(s) for s in d["input_specs"]],
            [spec_from_json(s) for s in d["output_specs"]],
            Prediction.from_dict(d["prediction"]),
            SolverResult(**d["solver"]) if d.get("solver") else None,
            dict(d["stats"]), list(d["fallbacks"]),
            {k: spec_from_json(s) for k, s in d["constraints"].items()},
        )


class IntraOp:
    """The cost graph of one program on one mesh, to search and to score plans on.

    Args:
      graph: the program's op graph (``build_graph``).
      inputs: one InputInfo per flat input; their ``pinned`` specs bind ``search``.
      mesh: the mesh (or submesh) to plan for.
      output_aliases: ``{output index: input index}`` for outputs that are the new value of
        an input (parameters, optimizer state): their specs are made equal.
      required: specs every candidate list of that shape keeps (e.g. the pins of every plan
        to be scored); the inputs' own pins are added.
      share_layers: tie repeated layers (``spmd.search.costgraph``).

    Each answer's ``stats["phases"]`` holds the seconds its request, solve and prediction
    took.
    """

    def __init__(self, graph: Graph, inputs: Sequence[InputInfo], mesh: DeviceMesh, *,
                 output_aliases: Mapping[int, int] = {},
                 required: Iterable[tuple[tuple[int, ...], Spec]] = (),
                 share_layers: bool = True, every_scatter: bool = False):
        self.graph, self.inputs, self.mesh = graph, list(inputs), mesh
        shapes: dict[tuple[int, ...], list[Spec]] = collections.defaultdict(list)
        for shape, spec in list(required) + [(i.shape, i.pinned) for i in inputs]:
            if spec is not None and any(spec):
                shapes[tuple(shape)].append(tuple(tuple(a) for a in spec))
        self.cost_graph = CostGraph(graph, self.inputs, mesh, output_aliases=output_aliases,
                                    required=shapes, share_layers=share_layers,
                                    every_scatter=every_scatter)
        self.encoder = Encoder(self.cost_graph)

    # -- entry points --------------------------------------------------------------------
    def search(self, *, memory_budget: float | None = None,
               time_limit: float = SearchOptions.time_limit,
               solver: SolverOptions = SolverOptions(),
               warm_start: "AutoResult | None" = None,
               points: Sequence[int] = ()) -> AutoResult:
        """The best plan with the inputs' own pins, under ``memory_budget`` bytes per device
        (default: the device's memory), seeded by ``warm_start`` (a scoring on this graph);
        at ``points`` the budget binds on what the plan holds there with its copies and
        partial sums (``spmd.search.point_memory``). ``stats["peak_point"]`` is the program
        point where the answer's predicted memory peaks; over the budget,
        ``stats["peak_point_held"]`` the bytes that point's set holds of it.

        Raises:
          InfeasibleError: no plan fits the memory budget.
        """
        start = time.perf_counter()
        enc = self.encoder.encode([i.pinned for i in self.inputs])
        warm = None
        if warm_start is not None and warm_start.node_strategies is not None:
            warm = _warm_choice(enc, warm_start.node_strategies)
        budget = self.mesh.device.memory_bytes if memory_budget is None else memory_budget
        result = self._solve(enc, float(budget), time_limit, solver, warm, start,
                             points=points)
        result.stats["warm_start"] = warm is not None
        return result

    def score(self, pins: Sequence[Spec], *, time_limit: float = SearchOptions.score_time_limit,
              solver: SolverOptions = SolverOptions()) -> AutoResult:
        """A hand-written plan priced by the search's own model: inputs pinned to ``pins``,
        intermediates chosen by the integer program (no memory budget) in the search's own
        space, repeated layers alike."""
        start = time.perf_counter()
        enc = self.encoder.encode([tuple(tuple(a) for a in s) for s in pins])
        return self._solve(enc, None, time_limit, solver, None, start, constrain=False)

    def constraints(self, result: AutoResult) -> dict[str, Spec]:
        """The sharding constraints of a result on this graph (a scoring leaves them out:
        only a kept hand-written plan needs them)."""
        return _constraints(self.graph, result.node_strategies)

    # -- solving and reading the answer --------------------------------------------------
    def _solve(self, enc: Encoding, budget: float | None, time_limit: float,
               options: SolverOptions, warm: list[int] | None, start: float,
               constrain: bool = True, points: Sequence[int] = ()) -> AutoResult:
        watch = Stopwatch()
        with watch.phase("request"):
            req = enc.request(budget, time_limit, points)
            req.warm_start = warm
        with watch.phase("solve"):  # (a clock-bounded answer: the same on every process)
            res = first_process(lambda: solve(req, options), encode=dataclasses.asdict,
                                decode=lambda raw: SolverResult(**raw))
        with watch.phase("predict"):
            node_choice = enc.node_choice(res.choice)
            pred, peak_point = predict_with_peak(enc, node_choice)
            result = _result(enc, node_choice, pred, res, constrain)
        result.stats.update(_stats(enc, req, res, time.perf_counter() - start))
        result.stats["peak_point"] = peak_point
        if budget is not None and pred.memory_bytes > budget:
            # what a set at the peak's point would hold of this plan: whether one shuts it out
            result.stats["peak_point_held"] = held(*point_terms(enc, peak_point), res.choice)
        result.stats["phases"] = watch.as_dict()
        return result


def _result(enc: Encoding, node_choice: list[int], pred: Prediction,
            res: SolverResult, constrain: bool) -> AutoResult:
    g = enc.cg.graph
    chosen = [enc.strategy_of(n.id, node_choice[n.id]) for n in g.nodes]
    ins = [chosen[i].out_specs[0] for i in g.inputs]
    outs = [chosen[v.node].out_specs[v.index] if v is not None else replicated(np.ndim(lit))
            for v, lit in zip(g.outputs, g.output_literals)]
    fallbacks = collections.Counter(n.op.primitive for n in g.nodes
                                    if n.kind == "op" and chosen[n.id].fallback)
    return AutoResult(ins, outs, pred, res, {}, [f"{k} x{c}" for k, c in sorted(fallbacks.items())],
                      _constraints(g, chosen) if constrain else {}, chosen)


def _constraints(g: Graph, chosen: Sequence[_rules.Strategy]) -> dict[str, Spec]:
    """Every op output's spec, however small, and every reshard point with its target spec.

    A constraint equal to what XLA would propagate costs nothing; leaving one out let XLA
    re-slice a value the plan had gathered, which doubled a step's all-gathers, and
    partition a scatter-add around batch-split indices the plan had gathered, which
    all-reduced a whole table gradient."""
    out: dict[str, Spec] = {}
    for n in g.nodes:
        if n.kind != "op":
            continue
        s = chosen[n.id]
        for k, spec in enumerate(s.out_specs):
            if g.value_bytes(Value(n.id, k)):
                out[value_key(n.path, k)] = spec
        for i, v in enumerate(n.operands):
            # Every reshard point, however small, and every consumer of it: left out, XLA
            # may partition the op around the operand's old spec instead (a scatter-add with
            # batch-split indices then all-reduced the whole table gradient; a second
            # weight-gradient dot reading the same resharded activation gathered both its
            # operands over all devices).
            if (v is not None and g.value_bytes(v)
                    and chosen[v.node].out_specs[v.index] != s.in_specs[i]):
                out[operand_key(n.path, i)] = s.in_specs[i]
    return out


@dataclasses.dataclass(frozen=True)
class Searched:
    """What an answer was found on, kept so it can be priced again elsewhere
    (``price_on``): the op graph, its inputs and output aliases, and the answer (not the
    cost graph, which is large and rebuilt for the other mesh)."""

    graph: Graph
    inputs: list[InputInfo]
    output_aliases: dict[int, int]
    result: AutoResult

    @classmethod
    def of(cls, job: IntraOp, result: AutoResult) -> "Searched":
        return cls(job.graph, job.inputs, dict(job.cost_graph.aliases), result)

    def price_on(self, mesh: DeviceMesh) -> Prediction:
        """The answer priced on ``mesh``: another mesh of the same shape, e.g. this cluster
        as another platform's XLA compiles it (XLA:CPU, where a virtual GPU plan is
        compile-checked). Each node keeps its own strategy: a matmul's reduce-scatter
        becomes the other platform's finish of the same partial sum, its output still
        scattered as the plan's constraints keep it (XLA:CPU all-reduces, slices, and
        reshards from the slice for readers that want another spec)."""
        inputs = [dataclasses.replace(i, pinned=spec)
                  for i, spec in zip(self.inputs, self.result.input_specs)]
        other = IntraOp(self.graph, inputs, mesh, output_aliases=self.output_aliases,
                        share_layers=False, every_scatter=True)
        enc = other.encoder.encode([i.pinned for i in inputs])
        return predict(enc, enc.node_choice(_warm_choice(enc, self.result.node_strategies)))


def _warm_choice(enc: Encoding, chosen: Sequence[_rules.Strategy]) -> list[int]:
    """The solver's choice (per request node of ``enc``) closest to a plan given per graph
    node (a scoring on the same cost graph)."""
    warm = []
    for r in enc.roots:
        s = chosen[r]
        names = enc.names(r)
        if s.name in names:
            warm.append(names.index(s.name))
            continue
        # Not among the search's candidates (e.g. a small input it keeps replicated), or
        # one of another platform's (XLA:GPU's reduce-scatter variant of a matmul is, on
        # XLA:CPU, the all-reduce of the same operands, sliced by its readers): the
        # candidate producing the same specs from the same ones, else reading the same,
        # else producing the same, else the first; the solver's local search repairs what
        # that breaks.
        strats = enc.strats[r]
        same = ([k for k, t in enumerate(strats)
                 if t.out_specs == s.out_specs and t.in_specs == s.in_specs]
                or [k for k, t in enumerate(strats) if t.in_specs == s.in_specs and t.in_specs]
                or [k for k, t in enumerate(strats) if t.out_specs == s.out_specs])
        warm.append(same[0] if same else 0)
    # Tied nodes must agree with their representative.
    for i, rep in enumerate(enc.same_as):
        if rep >= 0:
            warm[i] = warm[rep]
    return warm


def _stats(enc: Encoding, req: SolverRequest, res: SolverResult, seconds: float) -> dict:
    cg, graph = enc.cg, enc.cg.graph
    free = [i for i, s in enumerate(req.same_as) if s < 0]
    return {
        **{f"graph_{k}": v for k, v in graph.size().items()},
        "solver_nodes": len(req.node_names), "solver_edges": len(req.edges),
        "fanouts": len(req.fanouts), "free_nodes": len(free),
        "variables": int(sum(len(req.strategy_names[i]) for i in free
                             if len(req.strategy_names[i]) > 1)),
        "followers_merged": cg.stats["followers_merged"], "small": cg.stats["small"],
        "tied": cg.stats["tied"] + enc.input_ties, "liveness_sets": len(req.liveness),
        "small_bytes": cg.small_bytes, "search_seconds": seconds,
        "solve_seconds": res.solve_time, "status": res.status, "stalled": res.stalled,
        "off_path": cg.stats["off_path"],
        # the peak the program's own memory rows see under a budget (the prediction adds
        # buffers beside them); not read for a scoring, so not summed there
        "program_peak_bytes": (memory_peak(req, res.choice)
                               if req.liveness and req.memory_budget is not None else None),
    }


# ------------------------------------------------------------------------------ one shot


def search(closed_jaxpr, inputs: Sequence[InputInfo], mesh: DeviceMesh, *,
           output_aliases: Mapping[int, int] = {}, memory_budget: float | None = None,
           time_limit: float = SearchOptions.time_limit,
           warm_start: Sequence[Spec] | None = None, share_layers: bool = True,
           graph: Graph | None = None, solver: SolverOptions = SolverOptions()) -> AutoResult:
    """Search the sharding of every tensor of a traced train step.

    Args:
      closed_jaxpr: the whole step (forward, backward, update), e.g. from ``jax.make_jaxpr``.
      inputs: one InputInfo per flat input, in order.
      mesh: the cluster to plan for.
      output_aliases: ``{output index: input index}`` for outputs that are the new value of
        an input (parameters, optimizer state): their specs are made equal.
      memory_budget: bytes per device (default: the device's memory).
      time_limit: solver seconds.
      warm_start: a known-good plan's input specs: it is scored first (intermediates chosen
        with its inputs pinned) and seeds the solver.
      graph: ``build_graph(closed_jaxpr)`` when the caller already has it.

    Raises:
      InfeasibleError: no plan fits the memory budget.

    >>> import jax, jax.numpy as jnp
    >>> from spmd.cluster.mesh import make_mesh
    >>> f = lambda w, x: jnp.tanh(x @ w).sum()
    >>> cj = jax.make_jaxpr(f)(jnp.ones((64, 64)), jnp.ones((512, 64)))
    >>> res = search(cj, [InputInfo("w", (64, 64), "float32", "param"),
    ...                   InputInfo("x", (512, 64), "float32", "batch")], make_mesh({"data": 4}))
    >>> res.input_specs[1]
    (('data',), ())
    """
    graph = graph if graph is not None else build_graph(closed_jaxpr)
    warm_pins = list(warm_start) if warm_start is not None else []
    job = IntraOp(graph, inputs, mesh, output_aliases=output_aliases, share_layers=share_layers,
                  required=[(i.shape, s) for i, s in zip(inputs, warm_pins)])
    warm = None
    if warm_pins and all(s is not None for s in warm_pins):
        scoring = SearchOptions(time_limit=time_limit, solver=solver)  # as plan_auto scores
        limit, seeds_only = scoring.scoring()
        try:
            warm = job.score(warm_pins, time_limit=limit, solver=seeds_only)
        except PlanError:  # a hint only: an infeasible or unmappable hand plan is skipped
            warm = None
    return job.search(memory_budget=memory_budget, time_limit=time_limit, solver=solver,
                      warm_start=warm)


def score_result(closed_jaxpr, inputs: Sequence[InputInfo], mesh: DeviceMesh,
                 input_specs: Sequence[Spec], **kwargs) -> AutoResult:
    """The answer of ``score_searched``."""
    return score_searched(closed_jaxpr, inputs, mesh, input_specs, **kwargs).result


def score_searched(closed_jaxpr, inputs: Sequence[InputInfo], mesh: DeviceMesh,
                   input_specs: Sequence[Spec], *, output_aliases: Mapping[int, int] = {},
                   time_limit: float = SearchOptions.score_time_limit,
                   graph: Graph | None = None,
                   solver: SolverOptions = SolverOptions()) -> Searched:
    """Score a hand-written plan with the search's own model (``IntraOp.score``), with the
    sharding constraints that compile it as scored; kept with what it was scored on, so
    that it can be priced on another platform too (``Searched.price_on``)."""
    graph = graph if graph is not None else build_graph(closed_jaxpr)
    job = IntraOp(graph, inputs, mesh, output_aliases=output_aliases,
                  required=[(i.shape, s) for i, s in zip(inputs, input_specs)])
    result = job.score(input_specs, time_limit=time_limit, solver=solver)
    result.constraints = job.constraints(result)
    return Searched.of(job, result)


def score(closed_jaxpr, inputs: Sequence[InputInfo], mesh: DeviceMesh,
          input_specs: Sequence[Spec], **kwargs) -> Prediction:
    """The prediction of ``score_result``."""
    return score_result(closed_jaxpr, inputs, mesh, input_specs, **kwargs).prediction
