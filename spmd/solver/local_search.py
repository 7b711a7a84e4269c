"""The solver's fast local search: a complete, feasible seed for CP-SAT in under a second.

Exact min-sum dynamic programs over spanning trees of the group graph plus coordinate
descent, run by ``spmd.solver.driver`` from several starts; the best plan found is CP-SAT's
hint and the fallback when CP-SAT finds nothing in its time limit.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from spmd.solver.request import Reduced


def local_search(prob: Reduced, deadline: float, sweeps: int = 60,
                  patience: int = 3, start: Sequence[int] | None = None) -> list[int]:
    """A feasible seed in well under a second: greedy in group order (or ``start``, one
    strategy per node), then rounds of (a) an exact min-sum dynamic program over a spanning
    forest of the group graph (program order first, then random trees), the other edges'
    neighbours held fixed, kept when it lowers the total, (b) coordinate descent (each
    group's best reply to its neighbours) and (c) the same for the two ends of each edge
    jointly (a parameter and its new value are tied by ``inf`` and only move together) until
    ``patience`` rounds bring no gain or the deadline passes."""
    n = len(prob.groups)
    adj: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for (gu, gv), mat in prob.pairs.items():
        adj[gu].append((gv, mat))
        adj[gv].append((gu, mat.T))
    pick = [-1] * n

    def best(g: int) -> int:
        cost = prob.unary[g].copy()
        for h, mat in adj[g]:
            if pick[h] >= 0:
                cost += mat[:, pick[h]]
        return int(np.argmin(cost))

    def reply(g: int, other: int) -> np.ndarray:
        """g's cost per strategy given its neighbours' picks, ``other`` left out."""
        cost = prob.unary[g].copy()
        for h, mat in adj[g]:
            if h != other and pick[h] >= 0:
                cost += mat[:, pick[h]]
        return cost

    rng = np.random.default_rng(0)
    edge_keys = list(prob.pairs)

    def tree_dp(weights: np.ndarray) -> list[int]:
        """Exact min over a spanning forest of the group graph (a minimum spanning forest
        under ``weights``), the other edges' neighbours held at their current picks: moves
        whole chains at once (a parameter, its gradient's reduction and its update)."""
        parent = list(range(n))

        def find(a: int) -> int:
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a

        tree: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
        in_tree = set()
        for e in np.argsort(weights, kind="stable").tolist():
            gu, gv = edge_keys[e]
            ru, rv = find(gu), find(gv)
            if ru != rv:
                parent[ru] = rv
                in_tree.add((gu, gv))
                tree[gu].append((gv, prob.pairs[(gu, gv)]))
                tree[gv].append((gu, prob.pairs[(gu, gv)].T))
        local = [prob.unary[g].copy() for g in range(n)]
        for (gu, gv), mat in prob.pairs.items():
            if (gu, gv) not in in_tree:
                local[gu] += mat[:, pick[gv]]
                local[gv] += mat[pick[gu], :]
        out = list(pick)
        seen = [False] * n
        for root in range(n):
            if seen[root]:
                continue
            order, up = [], {root: (-1, None)}
            stack = [root]
            seen[root] = True
            while stack:  # DFS order: parents before children
                a = stack.pop()
                order.append(a)
                for b, mat in tree[a]:
                    if not seen[b]:
                        seen[b] = True
                        up[b] = (a, mat)  # parent strategies x child strategies
                        stack.append(b)
            belief = {a: local[a].copy() for a in order}
            arg = {}
            for a in reversed(order):  # children first: send min-sum messages up
                p, mat = up[a]
                if p >= 0:
                    step = mat + belief[a][None, :]
                    arg[a] = np.argmin(step, axis=1)
                    belief[p] += step[np.arange(step.shape[0]), arg[a]]
            out[root] = int(np.argmin(belief[root]))
            for a in order[1:]:
                out[a] = int(arg[a][out[up[a][0]]])
        return out

    if start is not None:  # improve a given assignment (a warm start) instead of greedy
        pick = [int(start[g]) for g in prob.groups]
    else:
        for g in range(n):
            pick[g] = best(g)
    current = prob.total(pick)
    idle = 0
    for _ in range(sweeps):
        if time.perf_counter() > deadline:
            break
        before = current
        if edge_keys:
            # First along the program order (consecutive groups), then random trees.
            w = (np.array([abs(v - u) for u, v in edge_keys], dtype=float) if _ == 0
                 else rng.random(len(edge_keys)))
            trial = tree_dp(w)
            value = prob.total(trial)
            if value < current:
                pick, current = trial, value
        for g in range(n):
            pick[g] = best(g)
        for (gu, gv), mat in prob.pairs.items():  # joint moves: ends tied by inf must move together
            joint = reply(gu, gv)[:, None] + reply(gv, gu)[None, :] + mat
            i, j = np.unravel_index(int(np.argmin(joint)), joint.shape)
            pick[gu], pick[gv] = int(i), int(j)
        current = prob.total(pick)
        idle = 0 if current < before * (1 - 1e-9) else idle + 1
        if idle >= patience or not edge_keys and idle:
            break
    return [pick[g] for g in prob.group_of]
