"""Exact elimination of the groups diffusion need not sweep: what is left is the core.

A group joined to at most two others, or with a single strategy, is solved exactly by
dynamic programming (variable elimination on the min-sum problem): a leaf's best reply,
as a cost over its neighbour's strategies, joins that neighbour's own costs; a link of a
chain, as a cost over the pairs of strategies of its two neighbours, joins the pair
between them (series reduction); a single strategy's edges join its neighbours' own costs.
Every plan of the core then costs what its best completion costs in the whole problem, so
the core's lower bounds bound the whole and its plans complete to plans of the same cost
(``Elimination.complete``). On a 24-layer GPT on 8 devices, 477 groups and 584 pairs leave
83 groups and 172 pairs (layer norms, residual adds and elementwise chains are chains and
leaves); diffusion's sweeps then move only what the exact part cannot settle.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from spmd.solver.request import add_pair

__all__ = ["Elimination", "eliminate"]


@dataclasses.dataclass
class _Step:
    """One eliminated group: its own costs and its pairs to the neighbours still in the
    problem when it went, each with the group's strategies on the rows."""

    group: int
    own: np.ndarray
    sides: list[tuple[int, np.ndarray]]


@dataclasses.dataclass
class Elimination:
    """The core left by ``eliminate``, and how to complete a plan of it."""

    core: list[int]  # the groups left, ascending
    offset: float  # the cost the eliminated isolated groups add to every plan
    steps: list[_Step]

    def complete(self, pick: list[int]) -> list[int]:
        """``pick`` (a strategy for every core group; others ignored) with every eliminated
        group's best reply, last eliminated first: its neighbours at elimination went later
        (or stayed), so they are picked."""
        pick = list(pick)
        for step in reversed(self.steps):
            cost = step.own.copy()
            for v, view in step.sides:
                cost += view[:, pick[v]]
            pick[step.group] = int(np.argmin(cost))
        return pick


def eliminate(own: list[np.ndarray], pairs: dict[tuple[int, int], np.ndarray]) -> Elimination:
    """Eliminate, in place, groups of degree <= 2 or with one strategy until none is left
    (an elimination can make a neighbour one) (``own``: per group; ``pairs``: (gu, gv) with
    gu < gv, rows gu's strategies). Eliminated groups' pairs leave ``pairs``; pairs a
    chain's link made join it."""
    n = len(own)
    neighbours: list[set[int]] = [set() for _ in range(n)]
    for gu, gv in pairs:
        neighbours[gu].add(gv)
        neighbours[gv].add(gu)

    def view(u: int, v: int) -> np.ndarray:
        """The pair (u, v) with u's strategies on the rows."""
        return pairs[(u, v)] if u < v else pairs[(v, u)].T

    def eliminable(u: int) -> bool:
        return len(neighbours[u]) <= 2 or len(own[u]) == 1

    alive = [True] * n
    offset = 0.0
    steps: list[_Step] = []
    queue = [u for u in range(n) if eliminable(u)]
    while queue:
        u = queue.pop()
        if not alive[u] or not eliminable(u):
            continue
        alive[u] = False
        others = sorted(neighbours[u])
        sides = [(v, view(u, v).copy()) for v in others]
        steps.append(_Step(u, own[u].copy(), sides))
        if not others:
            offset += float(own[u].min())
        elif len(own[u]) == 1:  # each edge is a cost of the neighbour's own
            offset += float(own[u][0])
            for v, mat in sides:
                own[v] = own[v] + mat[0]
        elif len(others) == 1:  # a leaf: its best reply per strategy of its neighbour
            (v, mat), = sides
            own[v] = own[v] + (mat + own[u][:, None]).min(axis=0)
        else:  # a link of a chain: its best reply per pair of its neighbours' strategies
            (v, to_v), (w, to_w) = sides
            link = (to_v[:, :, None] + own[u][:, None, None] + to_w[:, None, :]).min(axis=0)
            add_pair(pairs, v, w, link)
            neighbours[v].add(w)
            neighbours[w].add(v)
        for v in others:
            del pairs[(u, v) if u < v else (v, u)]
            neighbours[v].discard(u)
            if alive[v] and eliminable(v):
                queue.append(v)
        neighbours[u].clear()
    return Elimination([u for u in range(n) if alive[u]], offset, steps)
