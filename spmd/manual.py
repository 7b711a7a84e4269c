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


def vocabulary() -> set[str]:
    """Every logical name some hand-written method's rules map."""
    return {name for m in METHODS.values()
            for name in (*m.params, *(m.optimizer or ()), "batch")}


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


def leaf_spec(leaf: Leaf, method: ManualMethod, mesh: DeviceMesh, pin: Spec | None = None
              ) -> Spec:
    """The spec a hand-written method gives one input leaf (the user's pin, where there is
    one: ``spmd.logical.user_pins``); indivisible dims are errors."""
    if pin is not None:
        return pin
    if leaf.kind == "batch":
        rules: Rules = {"batch": method.batch}
    elif leaf.kind == "param":
        rules = method.params
    elif leaf.kind == "optimizer":
        rules = method.optimizer if method.optimizer is not None else method.params
    else:
        return replicated(len(leaf.shape))
    if not rules or not leaf.logical:  # unnamed (a bias, a norm's scale): not split
        return replicated(len(leaf.shape))
    used: set[str] = set()
    spec: list[tuple[str, ...]] = []
    for dim, (size, name) in enumerate(zip(leaf.shape, leaf.logical)):
        axes = _resolve(rules.get(name, ()), mesh, method.name) if name else ()
        axes = tuple(a for a in axes if a not in used)
        split = mesh.axis_size(axes)
        if axes and size % split:
            hint = (" It was taken as the step's batch; if it is not, pass batch_argnums= with "
                    "the position of the batch argument." if leaf.kind == "batch" else "")
            raise PlanError(
                f"{leaf.path}: dimension {dim} ({name}, size {size}) is not divisible by mesh "
                f"axes {axes} of total size {split} (sizes {[mesh.shape[a] for a in axes]}) "
                f"under method {method.name!r}; pick a size divisible by {split} or another "
                f"method.{hint}")
        used.update(axes)
        spec.append(axes)
    return tuple(spec)


def manual_specs(leaves: Sequence[Leaf], method: str, mesh: DeviceMesh,
                 pins: Sequence[Spec | None] | None = None) -> list[Spec]:
    """Specs of every input leaf under a hand-written method, the user's pins kept."""
    chosen = get_method(method)
    pins = pins if pins is not None else [None] * len(leaves)
    params = [l for l in leaves if l.kind == "param" and l.shape]
    if chosen.params and params and not any(l.logical for l in params):
        raise PlanError(f"method {method!r} needs logical axis names but no parameter has "
                        f"any (e.g. {params[0].path}, shape {params[0].shape}); give them with "
                        f"nnx.with_partitioning or logical_axes=")
    return [leaf_spec(leaf, chosen, mesh, pin) for leaf, pin in zip(leaves, pins)]


def _shards_state(leaves: Sequence[Leaf], specs: Sequence[Spec],
                  pins: Sequence[Spec | None]) -> bool:
    """Whether a plan splits some parameter or optimizer state the user left free."""
    return any(any(specs[i]) for i, leaf in enumerate(leaves)
               if pins[i] is None and leaf.kind in ("param", "optimizer"))


#: how a plan's ``alternatives`` begin the entry of a method that does not apply to the step
DOES_NOT_APPLY = "does not apply: "


def applicable_methods(leaves: Sequence[Leaf], mesh: DeviceMesh,
                       pins: Sequence[Spec | None] | None = None) -> dict[str, str | None]:
    """Each method, mapped to None when it applies or to the reason it does not (among them:
    one whose rules split no parameter or optimizer state of this model is no alternative
    to plain data parallelism, and says so)."""
    pins = pins if pins is not None else [None] * len(leaves)
    out: dict[str, str | None] = {}
    names = sorted({n for l in leaves if l.logical and l.kind != "batch" for n in l.logical if n})
    has_experts = "expert" in names
    example = next((l for l in leaves if l.kind == "param" and l.shape),
                   next((l for l in leaves if l.kind != "batch" and l.shape), None))
    unnamed = ("needs logical axis names, and no input has any"
               + (f" (e.g. {example.path}, shape {example.shape})" if example else "")
               + ", so it would be data parallelism; give them with nnx.with_partitioning or "
                 "logical_axes=")
    for name, method in METHODS.items():
        wanted = set(method.params) | set(method.optimizer or ())
        if wanted and not names:  # a plain-JAX step without logical_axes=: one reason for all
            out[name] = unnamed
            continue
        if name == "ep" and not has_experts:
            out[name] = "the model has no 'expert' dimension"
            continue
        try:
            specs = manual_specs(leaves, name, mesh, pins)
        except PlanError as err:
            out[name] = str(err)
            continue
        out[name] = None
        if wanted and not _shards_state(leaves, specs, pins):
            if not wanted & set(names):
                why = f"the model's logical names are {names}"
            elif not method.params and not any(l.kind == "optimizer" for l in leaves):
                why = "the step has no optimizer state"
            else:
                why = "the user's pins fix the arrays they name"
            out[name] = (f"splits no parameter or optimizer state here, so it is data "
                         f"parallelism: its rules name {sorted(wanted)}; {why}")
    return out
