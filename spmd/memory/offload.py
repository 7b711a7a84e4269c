"""Host offload: optimizer state kept in pinned host memory between steps, copied to the
device for the update and back after it, so that device memory holds it only while the
update reads it.

A train step reads its optimizer state (Adam's moments) only in its update, at the end of
the step; between steps the state only waits. ``offload`` rewrites the step's jaxpr: each
offloaded input is copied to device memory (``device_put`` to ``Space.Device``) before its
first reader, and each output that is its new value (aliased to it) is copied to host memory
(``Space.Host``). The plan's input and output shardings give those arrays the memory kind
``pinned_host`` (``Plan.input_shardings_flat``), so the state stays there between steps,
and the step's other arrays are untouched.

What is in host memory is read off the program (``host_values``): an input read only by
copies to the device, and what a copy to the host returns. The liveness leaves those out of
device memory (``spmd.memory.liveness``), and the cost graph prices every copy between the
two at the device's ``host_bandwidth`` (``DeviceSpec``), so a user's own ``device_put`` to
host is priced the same way.

Where the prediction and XLA may differ: XLA places the copies (on GPU its host offloader
makes them asynchronous copies, which its scheduler may start earlier than their reader);
the prediction takes each device copy as alive from its first reader to its last, and the
copies as not overlapped with compute. XLA:CPU has the memory kinds (a ``pinned_host``
argument is laid out ``S(5)``) but its host memory is the devices' own: there an offloaded
plan runs and computes the same numbers, and saves nothing (``memory_analysis`` counts those
arguments with the others). So a mesh of the CPU platform counts host values as device
memory (``separate_host_memory``): the search does not offload for it, and a virtual GPU
plan priced as XLA:CPU compiles it (its compile check) holds its offloaded state.

>>> import jax, jax.numpy as jnp
>>> def step(w, m, g):  # m: state updated in place (output 1 aliases input 1)
...     m = 0.9 * m + g
...     return w - m, m
>>> cj = jax.make_jaxpr(step)(jnp.ones(4), jnp.ones(4), jnp.ones(4))
>>> out = offload(cj, OffloadPlan((1,)), {1: 1})
>>> [e.primitive.name for e in out.jaxpr.eqns]  # the new m goes to the host once made
['device_put', 'mul', 'add', 'device_put', 'sub']
>>> from spmd.trace.graph import build_graph
>>> sorted(v.node for v in host_values(build_graph(out)))  # input 1, and the new m
[1, 6]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax

from spmd.trace.graph import Graph, Op, Path, Value, build_graph
from spmd.trace.interpret import eval_jaxpr_with
from spmd.trace.signature import Leaf

__all__ = ["HOST_MEMORY_KIND", "OFFLOAD_SCOPE", "OffloadPlan", "destination", "host_values",
           "memory_copies", "offload", "offloadable", "separate_host_memory"]

#: the memory kind offloaded arrays live in between steps (pinned: the device copies it by DMA)
HOST_MEMORY_KIND = "pinned_host"
#: the name-stack scope of the copies ``offload`` inserts
OFFLOAD_SCOPE = "offloaded"


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """Which of the step's flat inputs live in pinned host memory between steps (their new
    values, the outputs aliased to them, too)."""

    inputs: tuple[int, ...]

    @property
    def active(self) -> bool:
        return bool(self.inputs)

    def summary(self, leaves: Sequence[Leaf]) -> str:
        """e.g. ``optimizer state (24 arrays) in pinned host memory``."""
        kinds = sorted({leaves[i].kind for i in self.inputs})
        what = " and ".join("optimizer state" if k == "optimizer" else k for k in kinds)
        return f"{what} ({len(self.inputs)} arrays) in pinned host memory"

    def to_dict(self) -> dict:
        return {"inputs": list(self.inputs)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "OffloadPlan":
        return cls(tuple(int(i) for i in d["inputs"]))


def offloadable(leaves: Sequence[Leaf], output_aliases: Mapping[int, int]) -> OffloadPlan:
    """The inputs a plan may keep in host memory: optimizer state the step updates in place
    (an output aliases it), scalars (a step count, read early and tiny) left on the device."""
    updated = set(output_aliases.values())
    return OffloadPlan(tuple(i for i, leaf in enumerate(leaves)
                             if leaf.kind == "optimizer" and leaf.shape and i in updated))


def destination(op: Op) -> str | None:
    """Where a ``device_put`` copies its operand: ``"host"`` or ``"device"`` memory, or None
    (not a copy between memories: another op, or a put that keeps the memory)."""
    if op.primitive != "device_put":
        return None
    dest = (op.params.get("devices") or (None,))[0]
    kind = getattr(dest, "memory_kind", None)  # a Sharding
    if kind is None:  # a jax.memory.Space
        kind = getattr(dest, "name", None)
    kind = str(kind).lower() if kind is not None else ""
    return "host" if "host" in kind else "device" if kind == "device" else None


def separate_host_memory(platform: str) -> bool:
    """Whether offloading to pinned host memory frees device memory on ``platform``: on a
    GPU it does; XLA:CPU has the memory kinds, but its host memory is the devices' own, so an
    offloaded array takes the same memory there (a plan that fit a budget by offloading
    compiled over it on cpu-8: the state it offloaded was counted out of the prediction
    and in ``memory_analysis``'s arguments)."""
    return platform != "cpu"


def memory_copies(graph: Graph) -> frozenset[Value]:
    """The values of ``graph`` made by a copy between host and device memory: on a platform
    without a host memory of its own (``separate_host_memory``), its operand's own buffer
    (XLA:CPU made none of them: an offloaded mlp-small's temporaries were 0.6 MB, not the
    4.2 MB of state the copies would hold)."""
    return frozenset(Value(n.id, 0) for n in graph.nodes
                     if n.kind == "op" and destination(n.op) is not None)


def host_values(graph: Graph) -> frozenset[Value]:
    """The values of ``graph`` in host memory: what a copy to the host returns, and an input
    whose every reader copies it to the device."""
    nodes = graph.nodes
    out = {Value(n.id, 0) for n in nodes if n.kind == "op" and destination(n.op) == "host"}
    for i in graph.inputs:
        readers = nodes[i].consumers
        if readers and all(nodes[c].kind == "op" and destination(nodes[c].op) == "device"
                           for c in readers):
            out.add(Value(i, 0))
    return frozenset(out)


def offload(closed_jaxpr, plan: OffloadPlan, output_aliases: Mapping[int, int],
            graph: Graph | None = None):
    """The step's jaxpr with ``plan``'s inputs copied to the device before their first reader
    and the outputs aliased to them copied to the host as soon as they are made (module
    docstring): a new value's device copy then dies at its last device reader, not at the
    step's end. ``graph``: ``build_graph(closed_jaxpr)`` when the caller has it."""
    graph = graph if graph is not None else build_graph(closed_jaxpr)
    moved = set(plan.inputs)
    jaxpr = closed_jaxpr.jaxpr
    back = {o for o, i in output_aliases.items() if i in moved}
    made_at: dict[tuple[Path, int], int] = {}  # (equation path, result) -> output index
    for o in sorted(back):
        v = graph.outputs[o]
        node = graph.nodes[v.node] if v is not None else None
        if node is not None and node.kind == "op" and node.scan < 0 and node.eqn is not None:
            made_at.setdefault((node.path, v.index), o)

    def run(*args):
        held = {id(args[i]): i for i in moved}  # the tracers of the offloaded inputs
        copies: dict[int, Any] = {}
        written: dict[int, Any] = {}  # output index -> its copy in host memory

        def to_device(path, eqn, operands: list[Any]) -> list[Any]:
            out = []
            for x in operands:
                i = held.get(id(x))
                if i is not None and i not in copies:
                    with jax.named_scope(OFFLOAD_SCOPE):
                        copies[i] = jax.device_put(x, jax.memory.Space.Device)
                out.append(x if i is None else copies[i])
            return out

        def to_host(path, eqn, outs: list[Any]) -> list[Any]:
            for k, x in enumerate(outs):
                o = made_at.get((path, k))
                if o is not None and eqn is not None:
                    with jax.named_scope(OFFLOAD_SCOPE):
                        written[o] = jax.device_put(x, jax.memory.Space.Host)
            return outs

        outs = eval_jaxpr_with(jaxpr, closed_jaxpr.consts, args, to_host, to_device)
        with jax.named_scope(OFFLOAD_SCOPE):  # outputs made by no equation outside a scan
            return [written[o] if o in written else
                    jax.device_put(y, jax.memory.Space.Host) if o in back else y
                    for o, y in enumerate(outs)]

    avals = [v.aval for v in jaxpr.invars]
    return jax.make_jaxpr(run)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
