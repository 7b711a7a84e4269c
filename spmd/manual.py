"""Hand-written plans: the sharding an expert writes, as data.

Each method maps logical axis names to mesh axes, separately for parameters, optimizer
state and the batch dimension (MaxText-style rules, not code). ``ALL`` stands for every
mesh axis (pure data parallelism over the whole mesh). Within one tensor, a mesh axis is used
by the first dimension that asks for it; a later dimension asking for it stays unsplit.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from spmd.errors import PlanError
from spmd.cluster.mesh import DeviceMesh
from spmd.sharding import Spec, replicated
from spmd.trace.signature import Leaf

ALL = "*"  # every axis of the mesh, outer to inner
Rules = Mapping[str, tuple[str, ...]]

_TP: Rules = {"heads": ("model",), "mlp": ("model",), "vocab": ("model",),
              "conv_out": ("model",), "expert": ("model",)}
_FSDP: Rules = {"embed": (ALL,), "conv_out": (ALL,)}


@dataclasses.dataclass(frozen=True)
class ManualMethod:
    """One hand-written plan: logical-name rules for each kind of tensor."""

    name: str
    summary: str
    batch: tuple[str, ...]
    params: Rules
    optimizer: Rules | None = None  # None: optimizer state follows its parameter


METHODS: dict[str, ManualMethod] = {m.name: m for m in (
    ManualMethod("dp", "data parallel: batch over every device, state replicated", (ALL,), {}),
    ManualMethod("zero", "ZeRO-2: data parallel with optimizer state (and so gradient "
                 "reduction) sharded over every device", (ALL,), {}, _FSDP),
    ManualMethod("fsdp", "ZeRO-3 / FSDP: parameters and optimizer state sharded over every "
                 "device, gathered per use", (ALL,), _FSDP),
    ManualMethod("tp", "Megatron tensor parallel: column/row splits over 'model', batch "
                 "replicated", (), _TP),
    ManualMethod("dp_tp", "batch over 'data', Megatron tensor parallel over 'model'",
                 ("data",), _TP),
    ManualMethod("fsdp_tp", "batch and embed over 'data' (FSDP), Megatron over 'model'",
                 ("data",), {**_TP, "embed": ("data",)}),
    ManualMethod("ep", "expert parallel: experts and batch over every device, dense layers "
                 "data parallel", (ALL,), {"expert": (ALL,)}),
)}


def get_method(name: str) -> ManualMethod:
    if name not in METHODS:
        raise PlanError(f"unknown method {name!r}; valid methods: auto, {', '.join(METHODS)}")
    return METHODS[name]


def _resolve(axes: Sequence[str], mesh: DeviceMesh, method: str) -> tuple[str, ...]:
    out: list[str] = []
    for axis in axes:
        if axis == ALL:
            out.extend(mesh.axis_names)
        elif axis in mesh.axis_names:
            out.append(axis)
        else:
            raise PlanError(f"method {method!r} needs a mesh axis named {axis!r}; the mesh "
                            f"{mesh.name!r} has axes {list(mesh.axis_names)}")
    return tuple(a for a in out if mesh.shape[a] > 1)


def leaf_spec(leaf: Leaf, method: ManualMethod, mesh: DeviceMesh) -> Spec:
    """The spec a hand-written method gives one input leaf; indivisible dims are errors."""
    if leaf.pinned is not None:
        return leaf.pinned
    if leaf.kind == "batch":
        rules: Rules = {"batch": method.batch}
    elif leaf.kind == "param":
        rules = method.params
    elif leaf.kind == "optimizer":
        rules = method.optimizer if method.optimizer is not None else method.params
    else:
        return replicated(len(leaf.shape))
    if not rules or not leaf.logical:
        if leaf.kind == "param" and method.params and leaf.logical is None and leaf.shape:
            raise PlanError(f"method {method.name!r} needs logical axis names but parameter "
                            f"{leaf.path} (shape {leaf.shape}) has none; give them with "
                            f"nnx.with_partitioning or logical_axes=")
        return replicated(len(leaf.shape))
    used: set[str] = set()
    spec: list[tuple[str, ...]] = []
    for dim, (size, name) in enumerate(zip(leaf.shape, leaf.logical)):
        axes = _resolve(rules.get(name, ()), mesh, method.name) if name else ()
        axes = tuple(a for a in axes if a not in used)
        split = mesh.axis_size(axes)
        if axes and size % split:
            raise PlanError(
                f"{leaf.path}: dimension {dim} ({name}, size {size}) is not divisible by mesh "
                f"axes {axes} of total size {split} (sizes {[mesh.shape[a] for a in axes]}) "
                f"under method {method.name!r}; pick a size divisible by {split} or another method")
        used.update(axes)
        spec.append(axes)
    return tuple(spec)


def manual_specs(leaves: Sequence[Leaf], method: str, mesh: DeviceMesh) -> list[Spec]:
    """Specs of every input leaf under a hand-written method."""
    chosen = get_method(method)
    return [leaf_spec(leaf, chosen, mesh) for leaf in leaves]


def applicable_methods(leaves: Sequence[Leaf], mesh: DeviceMesh) -> dict[str, str | None]:
    """Each method, mapped to None when it applies or to the reason it does not."""
    out: dict[str, str | None] = {}
    has_experts = any(l.logical and "expert" in l.logical for l in leaves)
    for name in METHODS:
        if name == "ep" and not has_experts:
            out[name] = "the model has no 'expert' dimension"
            continue
        try:
            manual_specs(leaves, name, mesh)
            out[name] = None
        except PlanError as err:
            out[name] = str(err)
    return out
