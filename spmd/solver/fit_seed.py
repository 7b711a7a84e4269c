"""A start under the memory budget from a cheaper one over it.

Under a tight budget (a step whose activations outgrow the device, remat already chosen)
the cheapest start the driver makes can be over it: the starts minimize time alone. CP-SAT
then starts from a fitting start far from it, or must repair one, and a clock-bound solve may
end far from the optimum. This makes a fitting start near the cheap one the way a Lagrangian
relaxation does: the bytes of each liveness set over the budget are charged as time (seconds
per byte, a price per set), the local moves run on those costs from the current plan, and
the prices of the sets still over rise until the plan fits. The price starts at the plan's
own seconds per budget byte, so that one set's whole budget costs about the plan; each round
doubles the price of every set still over.

A set's members are charged their bytes per strategy. A resharded copy it holds (``Copy``)
is charged where the current plan holds it: to the producer's strategies, by the bytes each
leaves the copy, and to the readers' strategies that want its spec, by its bytes, so either
side may move to free it (readers and producer together see it pairwise only as a cost).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from spmd.solver.local_search import local_search
from spmd.solver.request import Reduced, SolverRequest, copy_targets, set_bytes

__all__ = ["fitting_seed"]

#: rounds of pricing at most (each doubles the price of the sets still over the budget)
ROUNDS = 12


def fitting_seed(request: SolverRequest, seeding: Reduced, start: Sequence[int],
                 value: Callable[[Sequence[int]], float], deadline: float) -> list[int] | None:
    """A plan (one strategy per node) within ``request.memory_budget``, from ``start`` (one
    per node, over the budget), or None when the rounds or the time run out first.

    ``seeding`` is the pairwise problem the local moves see; ``value`` a plan's seconds
    (``start``'s sets the price's unit)."""
    budget = request.memory_budget
    if budget is None or not request.liveness:
        return None
    rows = _set_rows(request, seeding)
    copies = [request.copy_terms(i) for i in range(len(request.liveness))]
    unit = max(value(start), 1e-12) / budget
    price = np.zeros(len(rows))
    choice = list(start)
    for _ in range(ROUNDS):
        if time.perf_counter() > deadline:
            return None
        over = np.array(set_bytes(request, choice)) > budget
        if not over.any():
            return choice
        price[over] = np.maximum(2 * price[over], unit)
        unary = [u.copy() for u in seeding.unary]
        for p, terms, set_copies in zip(price, rows, copies):
            if not p:
                continue
            for g, row in terms:
                unary[g] += p * row
            for term in set_copies:
                _charge_copy(unary, seeding, term, choice, p)
        choice = local_search(dataclasses.replace(seeding, unary=unary), deadline=deadline,
                              start=choice)
    return None


def _charge_copy(unary: list[np.ndarray], prob: Reduced, term, choice: Sequence[int],
                 price: float) -> None:
    """Charge one copy where ``choice`` holds it (the module docstring)."""
    producer, nbytes, before, after = term
    nbytes = np.asarray(nbytes, dtype=float)
    for d in copy_targets(term, choice):
        unary[prob.group_of[producer]] += price * nbytes[:, d]
        held = price * nbytes[choice[producer], d]
        for v, targets in (*before, *after):
            unary[prob.group_of[v]] += held * (np.asarray(targets) == d)


def _set_rows(request: SolverRequest, prob: Reduced) -> list[list[tuple[int, np.ndarray]]]:
    """Per liveness set, its members' bytes per strategy folded onto their groups (tied
    nodes share their group's choice, so their rows add)."""
    out = []
    for i in range(len(request.liveness)):
        folded: dict[int, np.ndarray] = {}
        for v, row in request.set_terms(i):
            g = prob.group_of[v]
            row = np.asarray(row, dtype=float)
            folded[g] = folded[g] + row if g in folded else row.copy()
        out.append(list(folded.items()))
    return out
