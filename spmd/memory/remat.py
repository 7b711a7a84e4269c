"""Rematerialization of a step as the user wrote it: forward values the backward pass reads
are recomputed there instead of kept, layer by layer, by rewriting the step's jaxpr.

A train step already holds its backward pass (``jax.grad`` inside it), so ``jax.checkpoint``
cannot be added from outside. Instead the step is re-traced equation by equation
(``spmd.trace.interpret``) and, for each layer chosen for remat, the backward op that first
reads one of the layer's *residuals* (forward values a backward op reads) is preceded by a
recomputation of them from what the layer keeps: its inputs (the previous layer's output,
parameters) and, under ``SAVE_DOTS``, its matmul outputs without batch dims (jax's
``dots_with_no_batch_dims_saveable``); under ``RECOMPUTE_ALL`` only its inputs (jax's
``nothing_saveable``). Every backward op reads the recomputed copies, so the forward ones
die at their last forward reader. The activations and parameters the recomputation reads
are made to depend on a backward value that op reads (``spmd.trace.fence.after``), so XLA
can neither merge the recomputation with the forward pass (CSE: a weight split FSDP-style
would be gathered once for both, its whole copy held from the forward to the backward pass, as
``jax.checkpoint`` avoids) nor hoist it before the backward pass reaches the layer.

The result is a plain ``ClosedJaxpr`` whose recomputed equations carry the name stack
``REMAT_SCOPE/...``, so the op graph, the cost model (recompute time is compute like any
other), the liveness (``spmd.memory.liveness``) and the sharding constraints
(``spmd.runtime.constrain``) all work on it unchanged.

Layers are the forward pass cut by ``spmd.trace.layers.layer_of`` into ``block_count``
ranges: the step's repeated blocks. What is never recomputed: ops inside a scan (a scanned
model is rematerialized by ``jax.checkpoint`` policies in its own body), ops with effects,
and any op of a step with a ``jax.checkpoint`` of its own (the user's choice is kept: a
pin).

>>> import jax, jax.numpy as jnp
>>> def step(ws, x):
...     loss = lambda ws: jnp.sum(jnp.tanh(jnp.tanh(x @ ws[0]) @ ws[1]))
...     return jax.grad(loss)(ws)
>>> cj = jax.make_jaxpr(step)([jnp.ones((8, 8))] * 2, jnp.ones((4, 8)))
>>> out = rematerialize(cj, RematPlan(2, (RECOMPUTE_ALL, None)))
>>> sum(REMAT_SCOPE in str(e.source_info.name_stack) for e in out.jaxpr.eqns) > 0
True
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any, Mapping

import jax

from spmd.trace.fence import after, fenceable
from spmd.trace.graph import Graph, Path, Value, build_graph, inner_jaxpr
from spmd.trace.interpret import eval_jaxpr_with, named_like
from spmd.trace.layers import forward_ops, is_backward, layer_of

__all__ = ["POLICIES", "POLICY_MEANING", "RECOMPUTE_ALL", "REMAT_SCOPE", "SAVE_DOTS", "RematPlan", "block_count",
           "is_recomputed", "recomputable", "rematerialize"]

#: keep matmul outputs without batch dims, recompute the rest (dots_with_no_batch_dims_saveable)
SAVE_DOTS = "save_dots"
#: keep only the layer's inputs (nothing_saveable)
RECOMPUTE_ALL = "recompute_all"
#: the policies, least memory saved (and least recompute) first
POLICIES = (SAVE_DOTS, RECOMPUTE_ALL)
#: what each policy keeps, in words
POLICY_MEANING = {SAVE_DOTS: "matmul outputs kept, the rest recomputed",
                  RECOMPUTE_ALL: "only the layer's input kept"}
#: the name-stack scope of recomputed equations
REMAT_SCOPE = "rematerialized"

_USER_CHECKPOINTS = ("remat", "remat2", "checkpoint")


@dataclasses.dataclass(frozen=True)
class RematPlan:
    """Which layers recompute what: ``policies[k]`` for layer ``k`` of the forward pass cut
    into ``layers`` ranges (``layer_of``); None keeps everything that layer's backward reads."""

    layers: int
    policies: tuple[str | None, ...]

    def __post_init__(self):
        if len(self.policies) != self.layers:
            raise ValueError(f"RematPlan: {len(self.policies)} policies for {self.layers} layers")
        bad = sorted({p for p in self.policies if p is not None and p not in POLICIES})
        if bad:
            raise ValueError(f"RematPlan: unknown policy {bad[0]!r}; valid: {', '.join(POLICIES)}")

    @classmethod
    def first(cls, layers: int, count: int, policy: str) -> "RematPlan":
        """``policy`` on the first ``count`` layers (their activations are kept longest)."""
        return cls(layers, tuple(policy if k < count else None for k in range(layers)))

    @property
    def active(self) -> bool:
        return any(p is not None for p in self.policies)

    def summary(self) -> str:
        """e.g. ``recompute_all on 12 of 40 layers``."""
        counts = Counter(p for p in self.policies if p is not None)
        if not counts:
            return f"none of {self.layers} layers"
        return ", ".join(f"{p} on {c} of {self.layers} layers" for p, c in sorted(counts.items()))

    def to_dict(self) -> dict:
        return {"layers": self.layers, "policies": list(self.policies)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "RematPlan":
        return cls(int(d["layers"]), tuple(d["policies"]))


def is_recomputed(name: str) -> bool:
    """Whether a graph node's name stack marks it as a recomputation."""
    return name.startswith(REMAT_SCOPE)


def block_count(graph: Graph) -> int:
    """How many repeated blocks the forward pass holds: the greatest common divisor of how
    often each repeated matmul signature (shapes, dims, dtypes) occurs in it (a transformer's
    QKV projections occur 3 per block, its attention matmuls 1 or 2 each), or 1."""
    counts = Counter()
    for i in forward_ops(graph):
        op = graph.nodes[i].op
        if op.primitive in ("dot_general", "conv_general_dilated") and graph.nodes[i].scan < 0:
            counts[(op.in_shapes, op.in_dtypes, repr(op.params))] += 1
    repeated = [c for c in counts.values() if c > 1]
    return math.gcd(*repeated) if repeated else 1


def _checkpoints_itself(closed_jaxpr) -> bool:
    """Whether the step holds a ``jax.checkpoint`` its author wrote, at any depth."""

    def walk(jaxpr) -> bool:
        for eqn in jaxpr.eqns:
            inner = inner_jaxpr(eqn)
            if inner is not None and (eqn.primitive.name in _USER_CHECKPOINTS or walk(inner[0])):
                return True
        return False

    return walk(closed_jaxpr.jaxpr)


@dataclasses.dataclass
class _Layer:
    """One rematerialized layer: what it recomputes (in program order) and which of those
    values the backward pass reads."""

    recompute: list[int]
    residuals: set[Value]


def _layers(graph: Graph, closed_jaxpr, plan: RematPlan) -> dict[int, _Layer]:
    """Per layer with a policy, what it recomputes.

    A step with a ``jax.checkpoint`` of its own recomputes what its author chose: nothing
    more (its forward ops are plain equations, indistinguishable from the others).
    A backward op belongs to the latest layer whose forward values it reads (the causal
    mask made in the first block is read by every block's backward pass). A layer's value
    that a later layer's backward op reads is kept, not recomputed: recomputing it there
    would recompute the whole layer as soon as the backward pass starts."""
    if _checkpoints_itself(closed_jaxpr):  # the user chose what to recompute: a pin
        return {}
    layer = layer_of(graph, plan.layers)
    forward = set(forward_ops(graph))
    nodes = graph.nodes

    def eligible(n: int) -> bool:
        node = nodes[n]
        return node.scan < 0 and node.eqn is not None and not node.eqn.effects

    def backward_layer(c: int) -> int:
        return max((layer[v.node] for v in nodes[c].operands
                    if v is not None and v.node in forward), default=-1)

    out: dict[int, _Layer] = {}
    for k, policy in enumerate(plan.policies):
        if policy is None:
            continue
        members = [n for n in sorted(forward) if layer[n] == k and eligible(n)]
        kept = set()
        if policy == SAVE_DOTS:
            kept = {n for n in members if nodes[n].op.primitive == "dot_general"
                    and not nodes[n].op.params["dimension_numbers"][1][0]}
        computable = set(members) - kept
        residuals = set()
        for n in computable:
            for j in range(len(nodes[n].op.out_shapes)):
                v = Value(n, j)
                readers = [c for c in nodes[n].consumers
                           if is_backward(nodes[c]) and v in nodes[c].operands]
                if readers and all(backward_layer(c) == k for c in readers):
                    residuals.add(v)
        # what the residuals need, back to what the layer keeps
        need, stack = set(), [v.node for v in residuals]
        while stack:
            n = stack.pop()
            if n in need:
                continue
            need.add(n)
            stack += [v.node for v in nodes[n].operands if v is not None and v.node in computable]
        if residuals:
            out[k] = _Layer(sorted(need), residuals)
    return out


def recomputable(closed_jaxpr, graph: Graph, layers: int) -> bool:
    """Whether recomputing every layer changes anything (not for a step that checkpoints
    itself, nor for a scanned one)."""
    return bool(_layers(graph, closed_jaxpr, RematPlan.first(layers, layers, RECOMPUTE_ALL)))


def rematerialize(closed_jaxpr, plan: RematPlan, graph: Graph | None = None):
    """The step's jaxpr with ``plan``'s layers recomputed in the backward pass (module
    docstring); ``graph``: ``build_graph(closed_jaxpr)`` when the caller has it."""
    graph = graph if graph is not None else build_graph(closed_jaxpr)
    layers = _layers(graph, closed_jaxpr, plan)
    nodes = graph.nodes
    by_path = {n.path: n.id for n in nodes if n.kind == "op"}
    owner = {v: k for k, lay in layers.items() for v in lay.residuals}
    recomputed_nodes = {n for lay in layers.values() for n in lay.recompute}

    def run(*args):
        seen: dict[int, list[Any]] = {}  # a recomputed node's operands, as it first read them
        copies: dict[Value, Any] = {}  # residual -> its recomputed value

        def recompute(k: int, fence: Any) -> None:
            lay = layers[k]
            members = set(lay.recompute)
            saved: dict[Value, Any] = {}
            for n in lay.recompute:
                for v, x in zip(nodes[n].operands, seen[n]):
                    if v is not None and v.node not in members:
                        saved.setdefault(v, x)
            if fence is not None:  # what it reads waits for the backward pass
                with jax.named_scope(REMAT_SCOPE):
                    saved = {v: after(x, fence) if nodes[v.node].kind != "const"
                             and fenceable(x) else x for v, x in saved.items()}
            values: dict[Value, Any] = {}
            for n in lay.recompute:
                node = nodes[n]
                ins = [x if v is None else values[v] if v.node in members else saved[v]
                       for v, x in zip(node.operands, seen[n])]
                with named_like(node.eqn, prefix=REMAT_SCOPE, scope=node.scope):
                    outs = node.eqn.primitive.bind(*ins, **node.eqn.params)
                outs = list(outs) if node.eqn.primitive.multiple_results else [outs]
                for j, x in enumerate(outs):
                    values[Value(n, j)] = x
            copies.update({v: values[v] for v in lay.residuals})

        def before(path: Path, eqn: Any, args: list[Any]) -> list[Any]:
            n = by_path.get(path)
            if n is None:
                return args
            if n in recomputed_nodes:
                seen.setdefault(n, list(args))
                return args
            if not is_backward(nodes[n]) or nodes[n].scan >= 0:
                return args
            operands = nodes[n].operands
            # (a layer whose forward has not run yet, as in a second gradient of the same
            # step, is not recomputed: its readers read what it kept)
            due = sorted({owner[v] for v in operands if v in owner and v not in copies
                          and all(m in seen for m in layers[owner[v]].recompute)})
            if not due:
                return [copies.get(v, x) if v is not None else x for v, x in zip(operands, args)]
            # a backward value this op reads fences the recomputation to this point
            fence = next((x for v, x in zip(operands, args) if v is not None and v not in owner
                          and is_backward(nodes[v.node]) and fenceable(x)), None)
            for k in due:
                recompute(k, fence)
            return [copies.get(v, x) if v is not None else x for v, x in zip(operands, args)]

        return eval_jaxpr_with(closed_jaxpr.jaxpr, closed_jaxpr.consts, args,
                               lambda path, eqn, outs: outs, before)

    avals = [v.aval for v in closed_jaxpr.jaxpr.invars]
    return jax.make_jaxpr(run)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
