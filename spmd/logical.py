"""A user's logical axis rules, in the forms Flax users already write, and the pins they give.

Flax and MaxText name each array dimension logically (``("embed", "mlp")``) and map names to
mesh axes with *rules*: ``nnx.logical_axis_rules``-style pairs ``[("batch", "data"),
("mlp", "model")]``, MaxText-style lists ``[["mlp", ["fsdp", "tensor"]], ...]`` or a mapping
``{"mlp": "model"}``; a rule's axes may be one name, several, or None (not split). They are
normalized to one ordered form and applied as Flax applies them: rules in order, each giving
its mesh axes to the first dimension of that name still unassigned, if none of those axes is
already used by the array. Names no rule covers are not split.

A user's pins come from two places: an explicit ``PartitionSpec`` of mesh axes in
``logical_axes=``, and logical names covered by the rules. Both bind the search and every
hand-written plan alike.
"""

from __future__ import annotations

from typing import Sequence

from jax.sharding import PartitionSpec

from spmd.cluster.mesh import DeviceMesh
from spmd.errors import PlanError, warn
from spmd.manual import vocabulary
from spmd.options import Rules
from spmd.sharding import Spec, format_spec, from_partition_spec
from spmd.trace.signature import Leaf

def apply_rules(path: str, shape: Sequence[int], logical: Sequence[str | None], rules: Rules,
                mesh: DeviceMesh) -> Spec:
    """The spec the rules give one array with these logical names (Flax's order of rules);
    axes of size 1 split nothing and are left out."""
    assigned: list[tuple[str, ...] | None] = [None] * len(shape)
    used: set[str] = set()
    for name, axes in rules:
        if name not in logical:
            continue
        dim = list(logical).index(name)
        if assigned[dim] is not None or used.intersection(axes):
            continue
        for axis in axes:
            if axis not in mesh.shape:
                raise PlanError(f"rule {name!r} -> {axes} names mesh axis {axis!r}, used by "
                                f"{path} (dimension {dim}); mesh {mesh.name!r} has axes "
                                f"{list(mesh.axis_names)}")
        assigned[dim] = axes
        used.update(axes)
    spec = tuple(tuple(a for a in (axes or ()) if mesh.shape[a] > 1) for axes in assigned)
    check_fits(path, shape, spec, mesh, logical)
    return spec


def check_fits(path: str, shape: Sequence[int], spec: Spec, mesh: DeviceMesh,
               logical: Sequence[str | None] | None = None) -> None:
    """A PlanError naming the array, dimension, size and axes when ``spec`` cannot split it."""
    seen: dict[str, int] = {}
    for dim, axes in enumerate(spec):
        for axis in axes:
            if axis not in mesh.shape:
                raise PlanError(f"{path}: dimension {dim} is split over {axis!r}, which is not "
                                f"an axis of mesh {mesh.name!r} (axes {list(mesh.axis_names)})")
            if axis in seen:
                raise PlanError(f"{path}: mesh axis {axis!r} splits dimensions {seen[axis]} and "
                                f"{dim}; an axis can split one dimension of an array")
            seen[axis] = dim
        split = mesh.axis_size(axes)
        if shape[dim] % split:
            name = f" ({logical[dim]})" if logical and logical[dim] else ""
            raise PlanError(
                f"{path}: dimension {dim}{name} of size {shape[dim]} cannot be split over mesh "
                f"axes {axes} of total size {split} (spec {format_spec(spec)}, shape "
                f"{tuple(shape)}); valid: a size divisible by {split}, or other axes for it")


def _mesh_axes_only(pspec: PartitionSpec, mesh: DeviceMesh) -> bool:
    names = [a for e in pspec if e is not None for a in ((e,) if isinstance(e, str) else e)]
    return all(a in mesh.shape for a in names)


def user_pin(leaf: Leaf, rules: Rules, mesh: DeviceMesh) -> Spec | None:
    """The spec the user fixed for one input, or None (free).

    A ``PartitionSpec`` given in ``logical_axes`` pins as it is when it names mesh axes only
    (or nothing the rules cover); one of logical names (as ``nnx.get_partition_spec`` and
    ``nn.get_partition_spec`` return them) is read as names.
    """
    covered = bool(leaf.logical) and any(name in leaf.logical for name, _ in rules)
    if leaf.partition_spec is not None and not covered and (
            _mesh_axes_only(leaf.partition_spec, mesh)):
        spec = from_partition_spec(leaf.partition_spec, len(leaf.shape))
        check_fits(leaf.path, leaf.shape, spec, mesh)
        return spec
    if covered:
        return apply_rules(leaf.path, leaf.shape, leaf.logical, rules, mesh)
    return None


def user_pins(leaves: Sequence[Leaf], rules: Rules, mesh: DeviceMesh) -> list[Spec | None]:
    """Every input's pin; rules that cover none of the model's names are a warning."""
    if rules:
        names = sorted({n for leaf in leaves if leaf.logical for n in leaf.logical
                        if isinstance(n, str)})
        if not any(rule in names for rule, _ in rules):
            warn(f"the logical axis rules map {sorted({r for r, _ in rules})}, none of the "
                 f"model's logical names {names}; nothing is pinned by them")
    _warn_unknown_spec_names(leaves, rules, mesh)
    return [user_pin(leaf, rules, mesh) for leaf in leaves]


def _warn_unknown_spec_names(leaves: Sequence[Leaf], rules: Rules, mesh: DeviceMesh) -> None:
    """PartitionSpecs in ``logical_axes`` of which no name is known (a mesh axis, a rule's or
    a hand-written method's) split nothing at all: likely mesh axes mistyped, or rules
    forgotten. One name unknown among known ones is a logical name left unsplit, as Flax
    leaves it."""
    given = {n for leaf in leaves if leaf.partition_spec is not None
             for n in leaf.logical or () if n}
    known = set(mesh.axis_names) | {r for r, _ in rules} | vocabulary()
    if given and not given & known:
        warn(f"logical_axes name {sorted(given)}: none is an axis of mesh {mesh.name!r} (axes "
             f"{list(mesh.axis_names)}) or a name any rule maps, so they split nothing; give "
             f"mesh axes, or SearchOptions(rules=...) for them")
