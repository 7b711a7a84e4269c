"""What one pipeline stage costs: a layer range of the step on a submesh, its forward and
backward work per microbatch, its update once per step, and its memory with ``k``
microbatches in flight.

Each of the stage's three tasks is planned on the submesh by the intra-op search
(``spmd.search.regions.search_region``: identical layer ranges are solved once), with the
step inputs pinned where a hand-written plan fixes them. From those plans:

- **time per microbatch**: the forward's and backward's predicted time, plus sending what
  other stages read (the activation the next stage starts from, the gradient the stage
  before continues with) over the link between the stages: bytes per device over the
  link's bandwidth, plus its latency, each device sending a part no other sends
  (``spmd.sharding.spread``: a replicated activation goes in pieces and the receiving
  stage gathers it on its own links, which is not priced: over NVLink a twentieth of the
  send between hosts or less);
- **memory**: the optimizer state the update alone reads, the gradient sums, the larger of
  the forward's and the backward's own peak (each holds one microbatch's residuals: the
  forward values the backward reads, its own and those other stages sent it), and ``k - 1``
  more microbatches' residuals: a schedule holding ``k`` microbatches at once (1F1B:
  ``stages - s`` on stage s; GPipe: all) needs ``k`` sets. The update's own peak (state,
  gradients and new state) is the other bound.

A stage that **recomputes** (``recompute=True``; GPipe's rematerialization) keeps of each
microbatch only the forward values other stages sent it, and runs its forward ops again in
its backward task: its residuals shrink to those, its backward takes its forward's time
more, and its backward task's peak holds one microbatch's forward values at once. The
stage search prices each layer once, as it runs without recomputing, and derives a range's
recomputing cost from those (``combine``); a chosen stage is then priced as it runs.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from spmd.cluster.mesh import DeviceMesh, Link
from spmd.errors import PlanError
from spmd.options import SearchOptions
from spmd.search.costgraph import InputInfo
from spmd.search.regions import RegionCache, RegionPlan, search_region, step_input_specs
from spmd.sharding import bytes_per_device, spread_bytes
from spmd.stages.split import BACKWARD, FORWARD, UPDATE, LayeredStep
from spmd.trace.graph import Value
from spmd.trace.regions import Region

__all__ = ["StageCost", "combine", "link_time", "price_stage"]

#: the budget a task is searched under once the device's own is out of reach (finite, as
#: ``SearchOptions`` asks): the schedule's memory model then judges the stage
UNBOUNDED = 1e30


@dataclasses.dataclass(frozen=True)
class StageCost:
    """A stage's prediction (seconds; bytes per device of its submesh). Ranges of layers
    priced one by one add up (``combine``): times, state and residuals add, the transient
    working memory is the largest of theirs.

    ``received``: the forward values made before the stage's first layer that its tasks
    read, as ``(value, the layer that makes it, bytes)``: what a recomputing stage keeps
    of each microbatch."""

    forward: float         # one microbatch's forward (sends to other stages included)
    backward: float        # one microbatch's backward (sends included)
    update: float          # the update, once per step
    params: float          # the step inputs the forward and backward read (parameters)
    state: float           # what the update alone reads (optimizer state)
    sums: float            # the gradient sums (accumulated over microbatches), as made
    residuals: float       # one microbatch's forward values its backward reads
    work: float            # the forward's or backward's peak beyond params and residuals
    update_work: float     # the update's peak beyond params, state and sums
    sent_forward: float    # bytes per device the forward sends to later layers
    sent_backward: float   # bytes per device the backward sends to earlier layers
    comm: float            # seconds of collectives: forward and backward, plus the update
    forward_comm: float = 0.0  # seconds of the forward's collectives (once per microbatch)
    first_layer: int = 0
    received: tuple[tuple[Value, int, float], ...] = ()
    recompute: bool = False  # the backward task runs the forward ops again
    plans: Mapping[str, RegionPlan] = dataclasses.field(default_factory=dict, repr=False)
    fits: bool = True      # every task's search found a plan under the device's memory

    @property
    def sent(self) -> float:
        return self.sent_forward + self.sent_backward

    def memory(self, in_flight: int) -> float:
        """Peak bytes per device with ``in_flight`` microbatches' residuals held."""
        held = self.params + self.state + self.sums
        return held + max(max(in_flight, 1) * self.residuals + self.work, self.update_work)


def link_time(nbytes: float, link: Link | None) -> float:
    """Seconds to send ``nbytes`` per device over ``link`` (0 without one or bytes)."""
    return nbytes / link.bandwidth + link.latency if link is not None and nbytes else 0.0


def combine(costs: Sequence[StageCost], link: Link | None, first: bool, last: bool,
            recompute: bool = False) -> StageCost:
    """Consecutive layers' costs (each priced without sends, none recomputing) as one
    stage: what crosses its outer cuts goes over ``link`` (none before the ``first``
    stage or after the ``last``). ``recompute``: the stage recomputes its forward values
    in its backward task (module docstring)."""
    add = lambda name: sum(getattr(c, name) for c in costs)  # noqa: E731
    forward_send = 0.0 if last else costs[-1].sent_forward
    backward_send = 0.0 if first else costs[0].sent_backward
    start = costs[0].first_layer
    received: dict[Value, tuple[Value, int, float]] = {}
    for c in costs:
        for v, made_in, nbytes in c.received:
            if made_in < start:
                received.setdefault(v, (v, made_in, nbytes))
    residuals, work = add("residuals"), max(c.work for c in costs)
    backward, comm = add("backward"), add("comm")
    if recompute:  # one microbatch's forward values all live again in the backward task
        kept = sum(nbytes for _, _, nbytes in received.values())
        residuals, work = kept, work + max(residuals - kept, 0.0)
        backward, comm = backward + add("forward"), comm + add("forward_comm")
    return StageCost(
        add("forward") + link_time(forward_send, link),
        backward + link_time(backward_send, link),
        add("update"), add("params"), add("state"), add("sums"), residuals, work,
        max(c.update_work for c in costs), forward_send, backward_send, comm,
        add("forward_comm"), start, tuple(received.values()), recompute,
        fits=all(c.fits for c in costs))


def _as_microbatches_read(step_inputs: Sequence[InputInfo], regions: Mapping[str, Region],
                          plans: Mapping[str, RegionPlan]) -> list[InputInfo]:
    """``step_inputs`` with each one the forward (else the backward) task reads and nothing
    pins taken in the spec that task's plan chose: a stage keeps one spec per leaf, and its
    forward and backward work run once per microbatch, the update once per step, so the
    update is planned around theirs (left free, it split the parameters its own way, and a
    stage planned from those layer prices paid 10x their update once its forward's specs
    were kept)."""
    out = list(step_inputs)
    for p in (BACKWARD, FORWARD):  # the forward's choice wins
        if p not in plans:
            continue
        for k, spec in step_input_specs(regions[p], plans[p]).items():
            if step_inputs[k].pinned is None:
                out[k] = dataclasses.replace(step_inputs[k], pinned=spec)
    return out


def price_stage(layered: LayeredStep, start: int, stop: int, mesh: DeviceMesh, *,
                step_inputs: Sequence[InputInfo], output_aliases: Mapping[int, int],
                send_link: Link | None, options: SearchOptions = SearchOptions(),
                cache: RegionCache | None = None, recompute: bool = False) -> StageCost:
    """The cost of layers ``start`` to ``stop - 1`` as one stage on ``mesh``.

    ``step_inputs``: the microbatch step's InputInfos (pins: a hand-written plan's specs on
    this submesh, or the user's); ``send_link``: the link to the neighbouring stages (None:
    sends are counted in bytes, not time); ``recompute``: the stage's backward task runs
    its forward ops again (``LayeredStep.regions``).
    """
    regions = layered.regions(start, stop, recompute)
    graph, layer, phase = layered.graph, layered.layer, layered.phase
    plans: dict[str, RegionPlan] = {}
    fits = True
    for p, region in regions.items():  # forward, backward, then the update
        inputs = step_inputs if p != UPDATE else _as_microbatches_read(
            step_inputs, regions, plans)
        try:
            plans[p] = search_region(region, mesh, step_inputs=inputs,
                                     output_aliases=output_aliases, options=options, cache=cache)
        except PlanError:  # over the device's memory, or no assignment found within it
            fits = False
            unbounded = dataclasses.replace(options, memory_budget=UNBOUNDED)
            plans[p] = search_region(region, mesh, step_inputs=inputs,
                                     output_aliases=output_aliases, options=unbounded,
                                     cache=cache)

    specs = {(p, True): dict(zip(regions[p].outputs, plans[p].result.output_specs))
             for p in plans}
    specs.update({(p, False): dict(zip(regions[p].inputs, plans[p].result.input_specs))
                  for p in plans})

    def size(v: Value, p: str, output: bool = True) -> int:
        shape = graph.value_shape(v)
        return bytes_per_device(shape, graph.value_dtype(v),
                                specs[p, output].get(v) or ((),) * len(shape), mesh.shape)

    def outside(v: Value) -> bool:  # read by another stage's microbatch work
        return any(not start <= layer[c] < stop and phase[c] != UPDATE
                   for c in graph.nodes[v.node].consumers)

    def sent_size(v: Value, p: str) -> int:  # in the pieces a copy to another stage sends
        shape = graph.value_shape(v)
        return spread_bytes(shape, graph.value_dtype(v),
                            specs[p, True].get(v) or ((),) * len(shape), mesh.shape)

    seconds, sent = {FORWARD: 0.0, BACKWARD: 0.0}, {FORWARD: 0.0, BACKWARD: 0.0}
    for p in (FORWARD, BACKWARD):
        if p in plans:
            sent[p] = sum(sent_size(v, p) for v in regions[p].outputs if outside(v))
            seconds[p] = plans[p].prediction.total_time + link_time(sent[p], send_link)
    bwd_reads = set(regions[BACKWARD].inputs) if BACKWARD in regions else set()
    own = set(regions[FORWARD].outputs) if FORWARD in regions else set()
    residuals = sum(size(v, FORWARD) for v in own if v in bwd_reads)
    received: dict[Value, tuple[Value, int, float]] = {}
    for p in (FORWARD, BACKWARD):
        for v in regions[p].inputs if p in regions else ():
            if (graph.nodes[v.node].kind == "op" and phase[v.node] == FORWARD
                    and layer[v.node] < start and v not in received):
                received[v] = (v, layer[v.node], size(v, p, output=False))
    residuals += sum(nbytes for v, _, nbytes in received.values() if v in bwd_reads)
    params = 0.0
    micro_inputs: set[Value] = set()
    for p in (FORWARD, BACKWARD):
        for v in regions[p].inputs if p in regions else ():
            if graph.nodes[v.node].kind == "input" and v not in micro_inputs:
                micro_inputs.add(v)
                params += size(v, p, output=False)
    state = sums = 0.0
    update_time = update_peak = update_comm = 0.0
    if UPDATE in plans:
        for v in regions[UPDATE].inputs:
            node = graph.nodes[v.node]
            if node.kind == "input" and v not in micro_inputs:
                state += size(v, UPDATE, output=False)
            elif node.kind == "op" and phase[v.node] != UPDATE:
                # held as the task that makes it returns it (the runtime sums it there); a
                # sum another stage makes arrives for the update alone (its peak)
                made = next((p for p in (BACKWARD, FORWARD) if p in regions
                             and v in specs[p, True]), None)
                sums += size(v, made) if made else 0
        update_time = plans[UPDATE].prediction.total_time
        update_peak = plans[UPDATE].prediction.memory_bytes
        update_comm = plans[UPDATE].prediction.comm_time
    peak = max((plans[p].prediction.memory_bytes for p in (FORWARD, BACKWARD) if p in plans),
               default=0.0)
    comm = sum(plans[p].prediction.comm_time for p in (FORWARD, BACKWARD) if p in plans)
    forward_comm = plans[FORWARD].prediction.comm_time if FORWARD in plans else 0.0
    return StageCost(seconds[FORWARD], seconds[BACKWARD], update_time, params, state, sums,
                     residuals, max(peak - params - residuals, 0.0),
                     max(update_peak - params - state - sums, 0.0), sent[FORWARD],
                     sent[BACKWARD], comm + update_comm, forward_comm, start,
                     tuple(received.values()), recompute, plans, fits)
