"""The step cut into layers: contiguous ranges of its forward pass, each with the backward
and update work that belongs to it, so a range of layers is a region of the op graph that a
pipeline stage can run (``spmd.trace.regions``).

Forward ops are those a differentiated step traces under ``jvp(...)`` (backward ones under
``transpose(...)``); a step with neither is all forward. The forward ops are cut into
``count`` contiguous ranges of balanced FLOPs (within a factor ``1 +- eps`` of the mean,
``eps`` doubled until a cut exists) that minimize the activation bytes crossing the cuts (Alpa,
Zheng et al. OSDI'22, §5.2: the cuts of an unrolled transformer fall between its blocks,
where only the residual stream crosses). A backward op takes the latest layer whose
forward values it reads (the activations its layer saved; the backward pass runs the layers
in reverse), a value crossing a cut counting as the latest layer that reads it up to that
of the gradient the op reads (the weight gradient of a layer's first matmul reads the
activation the layer below made, and is its own layer's); reading none, it takes the lowest
among the backward values it reads (the gradient coming from the layer above, or both
halves of a tied embedding's gradient). Every other
node takes the lowest layer among the non-forward values it reads (an update, its
gradient's), else among the forward values and parameters. Ops outside ``jvp(...)`` that
feed forward ones (an embedding's gather) are forward work of the earliest layer they feed.
A node that reads no layered value takes the lowest layer among its readers if they are
all forward ones, else the latest (a scalar of the optimizer's step count, read by every
layer's update). Inputs and constants are no layer's: every region that reads them gets
them as inputs.

>>> import jax, jax.numpy as jnp
>>> from spmd.trace.graph import build_graph
>>> def step(ws, x):
...     loss = lambda ws: jnp.sum(jnp.tanh(jnp.tanh(x @ ws[0]) @ ws[1]))
...     g = jax.grad(loss)(ws)
...     return [w - 0.1 * d for w, d in zip(ws, g)]
>>> g = build_graph(jax.make_jaxpr(step)([jnp.ones((8, 8))] * 2, jnp.ones((4, 8))))
>>> assign = layer_of(g, 2)
>>> sorted({assign[n.id] for n in g.nodes if n.kind == "op"})
[0, 1]
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from spmd.trace.graph import Graph, Node, Value

__all__ = ["forward_ops", "is_backward", "layer_of", "op_flops"]

#: how far from the mean a layer's FLOPs may stray at first (doubled until a cut exists):
#: 0.5 lets an unrolled GPT's last block carry its logits and loss (23% above the mean on
#: gpt-tiny) and still be cut between blocks
EPS = 0.5


def op_flops(node: Node) -> float:
    """FLOPs of an op unsharded: 2 x output x contracted size for matmuls and convolutions,
    one per output element otherwise (what balances layers, not what prices them)."""
    op = node.op
    out = sum(math.prod(s) for s in op.out_shapes) if op.out_shapes else 0
    if op.primitive == "dot_general":
        (contract, _), _ = op.params["dimension_numbers"]
        return 2.0 * out * math.prod(op.in_shapes[0][d] for d in contract)
    if op.primitive == "conv_general_dilated":
        # each output element: its kernel window over the input features of its group
        kernel = op.in_shapes[1]
        spec = op.params["dimension_numbers"]
        out_feature = spec.rhs_spec[0] if spec is not None else 0
        return 2.0 * out * math.prod(kernel) / max(kernel[out_feature], 1)
    return float(out)


def is_backward(node: Node) -> bool:
    """An op of the backward pass (traced under ``transpose(...)``)."""
    return node.kind == "op" and "transpose(" in node.name


def forward_ops(graph: Graph) -> list[int]:
    """The op nodes of the step's forward pass, in program order."""
    ops = [n for n in graph.nodes if n.kind == "op"]
    fwd = [n.id for n in ops if n.name.startswith("jvp(") and not is_backward(n)]
    return fwd or [n.id for n in ops]


def _crossing(graph: Graph, fwd: Sequence[int]) -> np.ndarray:
    """Bytes of forward values produced before each gap and read by a forward op after it
    (gap t lies between forward ops t-1 and t)."""
    position = {node: i for i, node in enumerate(fwd)}
    diff = np.zeros(len(fwd) + 1)
    last: dict[tuple[int, int], int] = {}
    for i, node in enumerate(fwd):
        for v in graph.nodes[node].operands:
            if v is not None and v.node in position:
                last[(v.node, v.index)] = i
    for (node, k), q in last.items():
        p = position[node]
        if q > p:
            nbytes = graph.value_bytes(Value(node, k))
            diff[p + 1] += nbytes
            diff[q + 1] -= nbytes
    return np.cumsum(diff)[: len(fwd)]


def _cuts(flops: np.ndarray, crossing: np.ndarray, count: int) -> list[int]:
    """Start positions of layers 1..count-1 among the forward ops: a dynamic program over
    the gaps where the crossing bytes are a local minimum."""
    n = len(flops)
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    gaps = [t for t in range(1, n) if crossing[t] <= crossing[t - 1]
            and (t + 1 >= n or crossing[t] <= crossing[t + 1])]
    if len(gaps) < count - 1:  # too few local minima for that many layers: any gap
        gaps = list(range(1, n))
    points = [0] + gaps + [n]
    mean = prefix[-1] / count
    # Among cuts of equal crossing bytes (every block boundary of a transformer crosses the
    # same residual stream), the more even one: a layer straying a fraction f from the mean
    # costs f times half the least crossing, less than any cut that crosses more.
    positive = [crossing[t] for t in gaps if crossing[t] > 0]
    weight = 0.5 * min(positive) if positive else 1.0
    eps = EPS
    # plain floats: the loops below index them element by element
    at = [float(prefix[t]) for t in points]
    crossed = [float(crossing[t]) for t in points[:-1]] + [0.0]
    inf = float("inf")
    while True:
        limit, least = (1 + eps) * mean, (1 - eps) * mean
        # best[k][j]: least crossing bytes splitting ops[:points[j]] into k layers
        best = [[inf] * len(points) for _ in range(count + 1)]
        back = [[0] * len(points) for _ in range(count + 1)]
        best[0][0] = 0.0
        for k in range(1, count + 1):
            previous, row, rows_back = best[k - 1], best[k], back[k]
            for j in range(1, len(points)):
                for i in range(j - 1, -1, -1):
                    span = at[j] - at[i]
                    if span > limit:
                        break
                    if span < least or previous[i] == inf:
                        continue
                    cost = previous[i] + weight * abs(span - mean) / mean + crossed[j]
                    if cost < row[j]:
                        row[j], rows_back[j] = cost, i
        if best[count][-1] < inf:
            break
        if eps > 1e6:  # unreachable while count <= n: then every split is balanced enough
            raise ValueError(f"cannot cut {n} forward ops into {count} layers")
        eps *= 2
    cuts, j = [], len(points) - 1
    for k in range(count, 0, -1):
        j = back[k][j]
        cuts.append(points[j])
    return sorted(cuts)[1:]


def layer_of(graph: Graph, count: int) -> list[int]:
    """The layer (0 to ``count - 1``) of every op node; -1 for inputs and constants."""
    fwd = forward_ops(graph)
    if not 1 <= count <= len(fwd):
        raise ValueError(f"cannot cut {len(fwd)} forward ops into {count} layers")
    flops = np.array([op_flops(graph.nodes[i]) for i in fwd])
    starts = _cuts(flops, _crossing(graph, fwd), count) if count > 1 else []
    layer = [-1] * len(graph.nodes)
    k = 0
    for i, node in enumerate(fwd):
        while k < len(starts) and i >= starts[k]:
            k += 1
        layer[node] = k
    forward = set(fwd)
    # Ops outside jvp(...) that feed forward ones (an embedding's gather of the tokens, a
    # mask) go with the earliest forward op they feed, as forward work.
    for n in reversed(graph.nodes):
        if n.kind == "op" and n.id not in forward and not is_backward(n):
            fed = [layer[c] for c in n.consumers if c in forward]
            if fed:
                layer[n.id] = min(fed)
                forward.add(n.id)
    fwd = sorted(forward)
    # Inputs: the lowest layer reading them in the forward pass (parameters), for the
    # gradient and update work that reads them; they stay -1 in the answer.
    reads = [-1] * len(graph.nodes)
    for node in fwd:
        for v in graph.nodes[node].operands:
            if v is not None and graph.nodes[v.node].kind != "op":
                r = reads[v.node]
                reads[v.node] = layer[node] if r < 0 else min(r, layer[node])
    used = {node: {layer[node]} for node in fwd}  # the layers whose forward ops read a value
    for node in fwd:
        for v in graph.nodes[node].operands:
            if v is not None and v.node in forward:
                used[v.node].add(layer[node])
    pending = []
    for n in graph.nodes:
        if n.kind != "op" or layer[n.id] >= 0:
            continue
        operands = [v.node for v in n.operands if v is not None]
        saved = [m for m in operands if m in forward]
        later = [layer[m] for m in operands
                 if graph.nodes[m].kind == "op" and m not in forward and layer[m] >= 0]
        if is_backward(n) and saved:
            cap = min(later) if later else -1
            seen = [max((u for u in used[m] if u <= cap), default=layer[m])
                    for m in operands if m in forward]
            seen = [max(seen)]
        else:
            seen = later or [s for s in (layer[m] if graph.nodes[m].kind == "op" else reads[m]
                                         for m in operands) if s >= 0]
        if seen:
            layer[n.id] = min(seen)
        else:
            pending.append(n.id)
    for node in reversed(pending):  # with its earliest forward reader, else its latest one
        consumers = graph.nodes[node].consumers
        readers = [layer[c] for c in consumers if layer[c] >= 0]
        early = all(c in forward for c in consumers)
        layer[node] = (min(readers) if early else max(readers)) if readers else count - 1
    for scan in graph.scans:  # a scan is one unit: its body is not cut
        low = min(layer[n] for n in scan.nodes)
        for n in scan.nodes:
            layer[n] = low
    return layer
