"""The inter-op search (Alpa, Zheng et al. OSDI'22, §5.2): which contiguous layer ranges
become stages, on which submeshes, with how many microbatches.

The step's forward pass is cut into ``L`` layers of balanced FLOPs (``LayeredStep``). For
``p`` stages the mesh is carved into ``p`` equal submeshes (``carve``: each stage takes the
innermost axes first, so a stage of 8 A100s is one host on NVLink and stages meet over the
slower links between them). Each layer is priced once per submesh shape and microbatch size
by the intra-op search of its tasks (``price_stage``; identical layers hit the region cache),
and a range of layers costs the sum of its layers (``combine``): the stage's own search
would only find the boundaries between its layers cheaper, never dearer, since they pass
the residual stream in the spec both sides chose.

For ``B`` microbatches the schedule takes ``sum(t_i) + (B - 1) max(t_i)`` (``t_i``: stage
i's forward and backward time per microbatch). As Alpa does, every stage time that some
range has is tried as the bound ``t_max``; for each, a dynamic program over the layers finds
the least ``sum(t_i)`` with every ``t_i <= t_max`` and every stage's memory, with as many
microbatches in flight as the schedule keeps on it, under the budget; candidates stop once
``B * t_max`` alone exceeds the best found. A range that does not fit as it runs is tried
recomputing its forward values in its backward task (``spmd.stages.price``: GPipe's
rematerialization, a stage's time for its memory); the stage recomputes only where it must. The update (each stage's own, at once) and the
state copies are added after. Uniform submeshes only: Alpa also mixes submesh sizes, which
needs a stage-by-stage device count in the program (not done yet).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from spmd.cluster.mesh import DeviceMesh, Link
from spmd.errors import PlanError
from spmd.stages.price import StageCost, combine
from spmd.stages.schedule import Schedule

__all__ = ["Partition", "best_partition", "carve", "stage_link"]


def carve(mesh: DeviceMesh, stages: int) -> list[DeviceMesh]:
    """``mesh`` cut into ``stages`` equal submeshes, each taking the innermost axes' devices
    first; stage ``s`` is the ``s``-th block in row-major order (neighbours share the
    fastest link the cut allows).

    >>> from spmd.cluster.mesh import make_mesh
    >>> mesh = make_mesh({"data": 2, "model": 4}, virtual=True)
    >>> [m.device_ids for m in carve(mesh, 4)]
    [(0, 1), (2, 3), (4, 5), (6, 7)]
    """
    if stages < 1 or mesh.size % stages:
        raise PlanError(f"cannot cut mesh {mesh.name!r} of {mesh.size} devices into {stages} "
                        f"equal stages; use a divisor of {mesh.size}")
    left = mesh.size // stages
    sizes: dict[str, int] = {}
    for name in reversed(mesh.axis_names):
        take = math.gcd(left, mesh.shape[name])
        sizes[name] = take
        left //= take
    if left != 1:
        raise PlanError(f"cannot cut mesh {mesh.name!r} (axes {mesh.shape}) into {stages} "
                        f"stages of {mesh.size // stages} devices along its axes")
    blocks = [mesh.shape[a] // sizes[a] for a in mesh.axis_names]
    out = []
    for s in range(stages):
        offset, rest = {}, s
        for name, count in reversed(list(zip(mesh.axis_names, blocks))):
            offset[name] = rest % count
            rest //= count
        out.append(mesh.submesh(sizes, offset))
    return out


def stage_link(mesh: DeviceMesh, stages: Sequence[DeviceMesh]) -> Link | None:
    """The link boundary activations cross between stages: the slowest of the axes the
    stages are cut along (None for one stage)."""
    cut = tuple(a for a in mesh.axis_names if stages[0].shape[a] != mesh.shape[a])
    return mesh.link(cut) if cut and len(stages) > 1 else None


@dataclasses.dataclass(frozen=True)
class Partition:
    """A cut of the layers into stages: where each starts, and each stage's cost."""

    starts: tuple[int, ...]
    costs: tuple[StageCost, ...]
    objective: float  # sum(t_i) + (B - 1) max(t_i), seconds

    @property
    def recompute(self) -> tuple[bool, ...]:
        """Per stage, whether it recomputes its forward values in its backward task."""
        return tuple(c.recompute for c in self.costs)


def best_partition(layers: Sequence[StageCost], sched: Schedule, link: Link | None,
                   budget: float) -> Partition | None:
    """The cut of ``layers`` (each priced alone) into ``sched.stages`` contiguous stages
    that minimizes Alpa's objective under ``budget`` bytes per device; None if none fits.
    A stage recomputes its forward values only where it would not fit otherwise."""
    n, p, m = len(layers), sched.stages, sched.microbatches
    if p > n:
        return None
    ranges: dict[tuple[int, int, int], StageCost] = {}

    def cost(a: int, b: int, s: int) -> StageCost:  # layers a..b-1 as stage s
        key = (a, b, s)
        if key not in ranges:
            first, last = s == 0, s == p - 1
            kept = combine(layers[a:b], link, first=first, last=last)
            if kept.memory(sched.in_flight(s)) > budget:
                redone = combine(layers[a:b], link, first=first, last=last, recompute=True)
                if redone.memory(sched.in_flight(s)) <= budget:
                    kept = redone
            ranges[key] = kept
        return ranges[key]

    def fits(a: int, b: int, s: int) -> bool:
        return cost(a, b, s).memory(sched.in_flight(s)) <= budget

    def time(a: int, b: int, s: int) -> float:
        c = cost(a, b, s)
        return c.forward + c.backward

    candidates = sorted({time(a, b, s) for s in range(p) for a in range(n)
                         for b in range(a + 1, n + 1) if b - a <= n - p + 1})
    best: Partition | None = None
    for t_max in candidates:
        if best is not None and m * t_max >= best.objective:
            break  # (B - 1) t_max + sum >= B t_max: no bound this high can win
        inf = float("inf")
        # least[s][k]: least sum of stage times putting layers 0..k-1 in stages 0..s-1
        least = [[inf] * (n + 1) for _ in range(p + 1)]
        back = [[-1] * (n + 1) for _ in range(p + 1)]
        least[0][0] = 0.0
        for s in range(1, p + 1):
            for b in range(s, n - (p - s) + 1):
                for a in range(s - 1, b):
                    if least[s - 1][a] == inf:
                        continue
                    t = time(a, b, s - 1)
                    if t > t_max or not fits(a, b, s - 1):
                        continue
                    if least[s - 1][a] + t < least[s][b]:
                        least[s][b], back[s][b] = least[s - 1][a] + t, a
        if least[p][n] == inf:
            continue
        starts, b = [], n
        for s in range(p, 0, -1):
            b = back[s][b]
            starts.append(b)
        starts.reverse()
        bounds = starts + [n]
        chosen = tuple(cost(bounds[s], bounds[s + 1], s) for s in range(p))
        slowest = max(c.forward + c.backward for c in chosen)
        objective = least[p][n] + (m - 1) * slowest
        if best is None or objective < best.objective:
            best = Partition(tuple(starts), chosen, objective)
    return best
