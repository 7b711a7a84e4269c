"""The user's logical rules and pins: Flax's forms, Flax's order, kept by every method and by
the comparison, and clear errors when they cannot apply."""

import pytest
from jax.sharding import PartitionSpec as P

import spmd
from spmd.logical import user_pins
from spmd.options import normalize_rules
from spmd.trace.signature import StepSignature
from tests.test_search import LOGICAL, _args, _step  # a two-layer MLP step


@pytest.fixture(scope="module")
def mesh():
    return spmd.make_mesh({"fsdp": 2, "tensor": 4}, virtual=True)


def _pins(mesh, rules, logical=LOGICAL):
    sig = StepSignature(_step, _args(), logical_axes=logical)
    return {l.path: p for l, p in zip(sig.leaves, user_pins(sig.leaves, normalize_rules(rules),
                                                            mesh))}


@pytest.mark.parametrize("rules", [
    {"mlp": "tensor", "embed": "fsdp"},  # a mapping
    [("mlp", "tensor"), ("embed", "fsdp")],  # nnx.logical_axis_rules-style pairs
    [["mlp", ["tensor"]], ["embed", ["fsdp"]], ["unused", ["nowhere"]]],  # MaxText-style lists
])
def test_rule_forms_pin_alike(mesh, rules):
    pins = _pins(mesh, rules)
    assert pins["params/w1"] == (("fsdp",), ("tensor",))
    assert pins["params/w2"] == (("tensor",), ("fsdp",))
    assert pins["batch/x"] is None  # "batch" is no rule here: searched


def test_rules_apply_in_flax_order(mesh):
    """Each rule gives its axes to the first dimension of its name still free, if none of them
    is taken: the second rule for "mlp" is used once "tensor" is taken by "embed"."""
    pins = _pins(mesh, [("embed", "tensor"), ("mlp", "tensor"), ("mlp", "fsdp")])
    assert pins["params/w1"] == (("tensor",), ("fsdp",))


def test_partition_specs_of_logical_names_or_mesh_axes(mesh):
    """nn.get_partition_spec's PartitionSpecs name logical axes: read as names; a
    PartitionSpec of the mesh's own axes is a pin, as it always was."""
    logical = {"w1": P("embed", "mlp"), "w2": P(None, "tensor")}
    pins = _pins(mesh, {"mlp": "tensor"}, logical)
    assert pins["params/w1"] == ((), ("tensor",))
    assert pins["params/w2"] == ((), ("tensor",))


def test_unknown_mesh_axis_and_indivisible_pins_are_named(mesh):
    with pytest.raises(spmd.PlanError, match=r"rule 'mlp' -> \('model',\) names mesh axis "
                       r"'model', used by params/w1 \(dimension 1\); mesh .* has axes "
                       r"\['fsdp', 'tensor'\]"):
        _pins(mesh, {"mlp": "model"})
    with pytest.raises(spmd.PlanError, match=r"params/w1: dimension 1 \(mlp\) of size 6 cannot "
                       r"be split over mesh axes \('tensor',\) of total size 4"):
        sig = StepSignature(_step, _args(h=6), logical_axes=LOGICAL)
        user_pins(sig.leaves, normalize_rules({"mlp": "tensor"}), mesh)
    with pytest.warns(UserWarning, match=r"logical_axes name \['dta'\]: none is an axis of "
                      r"mesh 'mesh' \(axes \['fsdp', 'tensor'\]\)"):  # a mistyped axis
        assert _pins(mesh, None, {"w1": P("dta"), "w2": None})["params/w1"] is None
    with pytest.raises(spmd.PlanError, match=r"params/w1: mesh axis 'fsdp' splits dimensions "
                       r"0 and 1"):
        _pins(mesh, None, {"w1": P("fsdp", "fsdp"), "w2": None})


def test_rules_that_map_nothing_warn_with_both_vocabularies(mesh):
    with pytest.warns(UserWarning, match=r"rules map \['hidden'\], none of the model's logical "
                      r"names \['batch', 'embed', 'mlp'\]"):
        pins = _pins(mesh, {"hidden": "tensor"})
    assert all(p is None for p in pins.values())


def test_pins_survive_the_comparison_and_every_method(mesh):
    """compare=True scores every hand-written plan with the user's pins (it returned tp with
    them dropped, every parameter replicated), and a hand-written method keeps them too."""
    mesh = spmd.make_mesh({"data": 2, "model": 4}, virtual=True)
    options = spmd.SearchOptions(cache=False, rules={"mlp": "data"})
    auto = spmd.plan(_step, *_args(), mesh=mesh, logical_axes=LOGICAL, options=options)
    tp = spmd.plan(_step, *_args(), mesh=mesh, method="tp", logical_axes=LOGICAL,
                   options=options)
    for plan in (auto, tp):
        specs = {l.path: s for l, s in zip(plan.leaves, plan.input_specs)}
        assert specs["params/w1"] == ((), ("data",)), plan.method
        assert specs["params/w2"] == (("data",), ()), plan.method


def test_memory_budget_is_checked_for_hand_written_plans():
    mesh = spmd.make_mesh({"data": 2, "model": 4}, virtual=True)
    options = spmd.SearchOptions(cache=False, compare=False, memory_budget=4096)
    with pytest.raises(spmd.InfeasibleError, match=r"method 'dp' needs .* per device "
                       r"\(predicted\), over memory_budget=4096"):
        spmd.plan(_step, *_args(), mesh=mesh, method="dp", logical_axes=LOGICAL,
                  options=options)
