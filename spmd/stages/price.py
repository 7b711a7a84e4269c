"""What one pipeline stage costs: a layer range of the step on a submesh, its forward and
backward work per microbatch, its update once per step, and its memory with ``k``
microbatches in flight.

Each of the stage's three tasks is planned on the submesh by the intra-op search
(``spmd.search.regions.search_region``: identical layer ranges are solved once), with the
step inputs pinned where a hand-written plan fixes them. From those plans:

- **time per microbatch**: the forward's and backward's predicted time, plus sending what
  other stages read (the activation the next stage starts from, the gradient the stage
  before continues with) over the link between the stages: bytes per device (each device
  sends its own shard) over the link's bandwidth, plus its latency;
- **memory**: the optimizer state the update alone reads, the gradient sums, the larger of
  the forward's and the backward's own peak (each holds one microbatch's residuals: the
  forward values the backward reads), and ``k - 1`` more microbatches' residuals: a
  schedule holding ``k`` microbatches at once (1F1B: ``stages - s`` on stage s; GPipe: all)
  needs ``k`` sets. The update's own peak (state, gradients and new state) is the other
  bound.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from spmd.cluster.mesh import DeviceMesh, Link
from spmd.errors import InfeasibleError
from spmd.options import SearchOptions
from spmd.search.costgraph import InputInfo
from spmd.search.regions import RegionCache, RegionPlan, search_region
from spmd.sharding import bytes_per_device
from spmd.stages.split import BACKWARD, FORWARD, UPDATE, LayeredStep
from spmd.trace.graph import Value

__all__ = ["StageCost", "price_stage"]


@dataclasses.dataclass(frozen=True)
class StageCost:
    """A stage's prediction (seconds; bytes per device of its submesh)."""

    forward: float         # one microbatch's forward, with its sends
    backward: float        # one microbatch's backward, with its sends
    update: float          # the update, once per step
    peak: float            # the larger of the forward's and backward's own peaks
    residuals: float       # one microbatch's forward values its backward reads
    state: float           # what the update alone reads (optimizer state)
    sums: float            # the gradient sums (accumulated over microbatches)
    update_peak: float
    sent: float            # bytes per device sent to other stages per microbatch
    comm: float            # seconds of the tasks' own collectives per microbatch, and update's
    plans: Mapping[str, RegionPlan] = dataclasses.field(default_factory=dict, repr=False)
    fits: bool = True      # every task's search found a plan under the device's memory

    def memory(self, in_flight: int) -> float:
        """Peak bytes per device with ``in_flight`` microbatches' residuals held."""
        micro = self.state + self.sums + self.peak + max(in_flight - 1, 0) * self.residuals
        return max(micro, self.update_peak)


def price_stage(layered: LayeredStep, start: int, stop: int, mesh: DeviceMesh, *,
                step_inputs: Sequence[InputInfo], output_aliases: Mapping[int, int],
                send_link: Link | None, options: SearchOptions = SearchOptions(),
                cache: RegionCache | None = None) -> StageCost:
    """The cost of layers ``start`` to ``stop - 1`` as one stage on ``mesh``.

    ``step_inputs``: the microbatch step's InputInfos (pins: a hand-written plan's specs on
    this submesh, or the user's); ``send_link``: the link to the neighbouring stages (None:
    the stage is the whole pipeline).
    """
    regions = layered.regions(start, stop)
    graph, layer, phase = layered.graph, layered.layer, layered.phase
    plans: dict[str, RegionPlan] = {}
    fits = True
    for p, region in regions.items():
        try:
            plans[p] = search_region(region, mesh, step_inputs=step_inputs,
                                     output_aliases=output_aliases, options=options, cache=cache)
        except InfeasibleError:
            fits = False
            unbounded = dataclasses.replace(options, memory_budget=float("inf"))
            plans[p] = search_region(region, mesh, step_inputs=step_inputs,
                                     output_aliases=output_aliases, options=unbounded,
                                     cache=cache)

    def size(v: Value, p: str, output: bool = True) -> int:
        spec = dict(zip(regions[p].outputs if output else regions[p].inputs,
                        plans[p].result.output_specs if output else plans[p].result.input_specs))
        shape = graph.value_shape(v)
        return bytes_per_device(shape, graph.value_dtype(v), spec.get(v) or ((),) * len(shape),
                                mesh.shape)

    def outside(v: Value) -> bool:  # read by another stage's microbatch work
        return any(not start <= layer[c] < stop and phase[c] != UPDATE
                   for c in graph.nodes[v.node].consumers)

    seconds = {}
    sent = 0.0
    for p in (FORWARD, BACKWARD):
        if p not in plans:
            seconds[p] = 0.0
            continue
        out = [v for v in regions[p].outputs if outside(v)]
        nbytes = sum(size(v, p) for v in out)
        sent += nbytes
        link = 0.0 if send_link is None or not out else (nbytes / send_link.bandwidth
                                                         + send_link.latency)
        seconds[p] = plans[p].prediction.total_time + link
    bwd_reads = set(regions[BACKWARD].inputs) if BACKWARD in regions else set()
    residuals = (sum(size(v, FORWARD) for v in regions[FORWARD].outputs if v in bwd_reads)
                 if FORWARD in regions else 0)
    micro_inputs = {v for p in (FORWARD, BACKWARD) if p in regions for v in regions[p].inputs}
    state = sums = 0.0
    update_time = update_peak = update_comm = 0.0
    if UPDATE in plans:
        upd = regions[UPDATE]
        for v in upd.inputs:
            node = graph.nodes[v.node]
            if node.kind == "input" and v not in micro_inputs:
                state += size(v, UPDATE, output=False)
            elif node.kind == "op" and phase[v.node] != UPDATE:
                sums += size(v, UPDATE, output=False)
        update_time = plans[UPDATE].prediction.total_time
        update_peak = plans[UPDATE].prediction.memory_bytes
        update_comm = plans[UPDATE].prediction.comm_time
    peak = max((plans[p].prediction.memory_bytes for p in (FORWARD, BACKWARD) if p in plans),
               default=0.0)
    comm = sum(plans[p].prediction.comm_time for p in (FORWARD, BACKWARD) if p in plans)
    return StageCost(seconds[FORWARD], seconds[BACKWARD], update_time, peak, residuals,
                     state, sums, update_peak, sent, comm + update_comm, plans, fits)
