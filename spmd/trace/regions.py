"""A region of a step: a set of its op nodes (a range of layers, ``spmd.trace.layers``) as a
program of its own, whose inputs are the values it reads from outside (parameters, the
activations and gradients other regions produce) and whose outputs are the values it
produces for outside (or for the step's result), so it can be planned on a submesh,
compiled and run as a pipeline stage.

A region holds whole equations: an op of the step, or a whole scan (a scan's body cannot be
cut). ``Region.key`` names its structure (primitives, shapes, params, how its equations
read each other and its inputs, never where it sits in the step), so two identical layer
ranges have the same key and one search serves both.

>>> import jax, jax.numpy as jnp
>>> from spmd.trace.graph import build_graph
>>> g = build_graph(jax.make_jaxpr(lambda x: jnp.sin(jnp.tanh(jnp.tanh(x))))(jnp.ones(3)))
>>> [n.op.primitive for n in g.nodes[1:]]
['tanh', 'tanh', 'sin']
>>> first, second, last = Region(g, [1]), Region(g, [2]), Region(g, [3])
>>> first.key() == second.key() != last.key()
True
>>> [e.primitive.name for e in Region(g, [2, 3]).program().jaxpr.eqns]
['tanh', 'sin']
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import jax

from spmd.errors import PlanError
from spmd.trace.graph import Graph, Value

__all__ = ["Region", "layer_region"]


class Region:
    """The op nodes ``nodes`` of ``graph`` (whole scans only) as a program of their own.

    ``outputs``: the values it returns, where not all it makes for outside (a pipeline stage
    that recomputes its forward pass in its backward task returns from each task only what
    that task makes for others: ``spmd.stages.split``); each must be made by ``nodes``."""

    def __init__(self, graph: Graph, nodes: Sequence[int],
                 outputs: Sequence[Value] | None = None):
        self.graph = graph
        chosen = set(nodes)
        for n in chosen:
            if graph.nodes[n].kind != "op":
                raise PlanError(f"a region holds op nodes; node {n} is a step "
                                f"{graph.nodes[n].kind}")
        #: the equations it runs, in program order: (eqn, operand Values, result Values)
        self.units: list[tuple[Any, tuple[Value | None, ...], tuple[Value | None, ...]]] = []
        seen_scans: set[int] = set()
        for n in sorted(chosen):
            node = graph.nodes[n]
            if node.scan >= 0:
                if node.scan in seen_scans:
                    continue
                scan = graph.scans[node.scan]
                missing = [m for m in scan.nodes if m not in chosen]
                if missing:
                    raise PlanError(f"a region cannot cut a scan: it holds node {n} of the scan "
                                    f"at {graph.nodes[scan.nodes[0]].key} but not node "
                                    f"{missing[0]}; take the whole scan or none of it")
                seen_scans.add(node.scan)
                self.units.append((scan.eqn, scan.operands, scan.results))
            else:
                self.units.append((node.eqn, node.operands,
                                   tuple(Value(n, k) for k in range(len(node.op.out_shapes)))))
        produced = {v for _, _, outs in self.units for v in outs if v is not None}
        inputs: dict[Value, None] = {}
        for _, operands, _ in self.units:
            for v in operands:
                if v is not None and v not in produced:
                    inputs.setdefault(v)
        #: the values it reads from outside, in order of first use
        self.inputs: list[Value] = list(inputs)
        if outputs is None:
            outputs = self._made_for_outside(produced)
        stray = [v for v in outputs if v not in produced]
        if stray:
            raise PlanError(f"a region returns what its nodes make; node {stray[0].node} "
                            f"({graph.nodes[stray[0].node].key}) is not one of them")
        #: the values it returns: by default those it makes for outside (other nodes, or the
        #: step's outputs)
        self.outputs: list[Value] = list(outputs)

    def _made_for_outside(self, produced: set[Value]) -> list[Value]:
        graph = self.graph
        inside = {v.node for v in produced}
        step_outputs = {v for v in graph.outputs if v is not None}
        read_outside = {v for m in graph.nodes if m.id not in inside
                        for v in m.operands if v is not None and v in produced}
        # a scan elsewhere reads all its operands, even one its body leaves unused
        read_outside |= {v for scan in graph.scans if scan.nodes and scan.nodes[0] not in inside
                         for v in scan.operands if v is not None and v in produced}
        return [v for _, _, outs in self.units for v in outs
                if v is not None and (v in read_outside or v in step_outputs)]

    def program(self):
        """The region as a ClosedJaxpr: its inputs in, its outputs out. Their types are those
        of the equations that read them (the graph prices a typed key by its storage)."""
        read: dict[Value, Any] = {}
        for eqn, operands, _ in self.units:
            for v, var in zip(operands, eqn.invars):
                if v is not None:
                    read.setdefault(v, var.aval)
        avals = [jax.ShapeDtypeStruct(read[v].shape, read[v].dtype) for v in self.inputs]
        return jax.make_jaxpr(self._run)(*avals)

    def _run(self, *args):
        env: dict[Value, Any] = dict(zip(self.inputs, args))
        for eqn, operands, results in self.units:
            invals = [env[v] if v is not None else a.val
                      for v, a in zip(operands, eqn.invars)]
            outs = eqn.primitive.bind(*invals, **eqn.params)
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
            for v, x in zip(results, outs):
                if v is not None:
                    env[v] = x
        return [env[v] for v in self.outputs]

    def key(self) -> str:
        """A digest of the region's structure, the same for identical layer ranges."""
        local: dict[Value, str] = {v: f"in{i}" for i, v in enumerate(self.inputs)}
        digest = hashlib.sha256()
        for i, v in enumerate(self.inputs):
            digest.update(repr(("in", self.graph.value_shape(v),
                                str(self.graph.value_dtype(v)))).encode())
        for u, (eqn, operands, results) in enumerate(self.units):
            reads = [local[v] if v is not None else repr(a.val)
                     for v, a in zip(operands, eqn.invars)]
            digest.update(repr((eqn.primitive.name, reads,
                                sorted((k, repr(p)) for k, p in eqn.params.items()),
                                [str(a.aval) for a in eqn.outvars])).encode())
            for k, v in enumerate(results):
                if v is not None:
                    local[v] = f"u{u}.{k}"
        digest.update(repr([local[v] for v in self.outputs]).encode())
        return digest.hexdigest()[:32]


def layer_region(graph: Graph, layers: Sequence[int], start: int, stop: int) -> Region:
    """The region of layers ``start`` to ``stop - 1`` (``layers``: ``layer_of``'s answer)."""
    return Region(graph, [n.id for n in graph.nodes
                          if n.kind == "op" and start <= layers[n.id] < stop])
