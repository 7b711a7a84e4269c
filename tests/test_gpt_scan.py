"""GPT with `scan_layers=True`: the stacked blocks compute what the unrolled ones do, their
params carry the `layers` logical name, and hand-written plans leave that dim unsplit.

Numerics are compared on the same weights (the unrolled model's, stacked into the scan
model), since the two layouts initialize from different keys. Tiny sizes only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmd import zoo
import spmd
from spmd.trace.graph import build_graph

TINY = zoo.get("gpt-tiny")


def _pair(num_layers: int) -> tuple[zoo.ModelSpec, zoo.ModelSpec]:
    """(unrolled, scanned) gpt-tiny with `num_layers` blocks."""
    unrolled = TINY.with_config(num_layers=num_layers)
    return unrolled, unrolled.with_config(scan_layers=True)


def _stack_blocks(tree: dict) -> dict:
    """A pure state dict of an unrolled GPT ({"blocks": {0: ..., 1: ...}, ...}) in the
    scanned layout: each block leaf stacked along a new leading layer dim."""
    blocks = tree["blocks"]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(blocks[i] for i in range(len(blocks))))
    return {**tree, "blocks": stacked}


def _scanned_copy(unrolled: nnx.Module, scan_spec: zoo.ModelSpec) -> nnx.Module:
    """A scan model holding `unrolled`'s params; its variables keep their own metadata."""
    model = scan_spec.create()
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, _stack_blocks(nnx.state(unrolled).to_pure_dict()))
    nnx.update(model, state)
    return model


def _logical_names(model: nnx.Module) -> dict[tuple, tuple]:
    """Path -> logical names, read as `spmd.trace.signature` reads them."""
    flat = nnx.to_flat_state(nnx.get_partition_spec(nnx.state(model)))
    return {path: tuple(v.get_value()) for path, v in flat}


@pytest.mark.parametrize("num_layers", [2, 3])
def test_scan_matches_unrolled(num_layers):
    unrolled_spec, scan_spec = _pair(num_layers)
    unrolled = unrolled_spec.create()
    scanned = _scanned_copy(unrolled, scan_spec)
    batch = TINY.batch(TINY.default_batch_size)
    value_and_grad = nnx.jit(nnx.value_and_grad(TINY.loss))
    want_loss, want_grads = value_and_grad(unrolled, batch)
    loss, grads = value_and_grad(scanned, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    want = _stack_blocks(want_grads.to_pure_dict())
    got = grads.to_pure_dict()
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_stacked_params_are_named_layers_first():
    unrolled_spec, scan_spec = _pair(3)
    abstract = scan_spec.abstract_model()
    names = _logical_names(abstract)
    assert names[("blocks", "attn", "wq")] == ("layers", "embed", "heads", "kv")
    assert names[("blocks", "attn", "bq")] == ("layers", "heads", "kv")
    assert names[("blocks", "mlp", "wo")] == ("layers", "mlp", "embed")
    assert names[("blocks", "ln1", "scale")] == ("layers", "embed")
    assert names[("embed", "wte")] == ("vocab", "embed")  # outside the stack: unchanged
    assert abstract.blocks.attn.wq.shape == (3, 64, 8, 8)
    assert scan_spec.param_count() == unrolled_spec.param_count()


def test_layers_initialize_independently():
    """Each layer draws its own key: a broadcast key would make every layer the same."""
    wq = np.asarray(TINY.with_config(scan_layers=True).create().blocks.attn.wq[...])
    assert not np.allclose(wq[0], wq[1])


@pytest.fixture(scope="module")
def mesh() -> spmd.DeviceMesh:
    return spmd.load_mesh("cpu-8")


def _create(spec: zoo.ModelSpec) -> tuple[nnx.Module, nnx.Optimizer]:
    model = spec.create()
    return model, spec.optimizer(model)


@pytest.fixture(scope="module")
def one_device_losses() -> list[float]:
    """Two AdamW steps of the scanned gpt-tiny on one device."""
    spec = _pair(2)[1]
    model, opt = _create(spec)
    step = nnx.jit(spec.train_step)
    batch = spec.batch(spec.default_batch_size)
    return [float(step(model, opt, batch)["loss"]) for _ in range(2)]


@pytest.mark.parametrize("method", ["dp", "fsdp_tp"])
def test_manual_plans_match_one_device(mesh, one_device_losses, method):
    spec = _pair(2)[1]
    batch = spec.batch(spec.default_batch_size)
    step = spmd.parallelize(spec.train_step, mesh=mesh, method=method)
    plan = step.plan_for(*nnx.eval_shape(lambda: _create(spec)), batch)
    specs = {leaf.path: s for leaf, s in zip(plan.leaves, plan.input_specs)}
    stacked = [leaf for leaf in plan.leaves if leaf.logical and leaf.logical[0] == "layers"]
    assert {leaf.kind for leaf in stacked} == {"param", "optimizer"}
    assert all(specs[leaf.path][0] == () for leaf in stacked)  # no rule for "layers"
    if method == "fsdp_tp":  # the dims after it split as in the unrolled model
        assert specs["model/blocks/attn/wq"] == ((), ("data",), ("model",), ())
    model, opt = spmd.materialize(lambda: _create(spec), plan)
    losses = [float(step(model, opt, batch)["loss"]) for _ in range(2)]
    np.testing.assert_allclose(losses, one_device_losses, rtol=1e-5)
    scans = [e.params["length"] for e in plan.signature.jaxpr.eqns if e.primitive.name == "scan"]
    assert scans == [2, 2]  # forward and (reversed) backward; the AdamW update is outside


# The 5 s limit is for test speed; the search may reach it on a busy host (a warning).
@pytest.mark.filterwarnings("ignore:the sharding search reached its time limit")
def test_auto_plans_the_scan_body_once_and_matches_one_device(mesh, one_device_losses):
    """The search plans one body for all layers (far fewer graph ops than the unrolled
    model's) and the plan trains as one device does. The stacked layer dim may be split:
    since the optimizer update is priced by its memory traffic, auto shards some stacked
    weights and moments of this tiny model along it over `data` (each iteration then
    gathers its layer's slice, a few KiB), and the loss check is what guards the scan."""
    spec = _pair(2)[1]
    batch = spec.batch(spec.default_batch_size)
    options = spmd.SearchOptions(compare=False, time_limit=5.0, cache=False)
    step = spmd.parallelize(spec.train_step, mesh=mesh, method="auto", options=options)
    plan = step.plan_for(*nnx.eval_shape(lambda: _create(spec)), batch)
    # the unrolled model's op graph, as its search would build it (graph_ops is its size)
    unrolled = spmd.plan(_pair(2)[0].train_step, *nnx.eval_shape(lambda: _create(_pair(2)[0])),
                         batch, mesh=mesh, method="dp")
    assert plan.search["graph_ops"] < 0.7 * build_graph(unrolled.signature.jaxpr).size()["ops"]
    assert not plan.search["fallbacks"]
    assert any(leaf.logical and leaf.logical[0] == "layers" for leaf in plan.leaves)
    model, opt = spmd.materialize(lambda: _create(spec), plan)
    losses = [float(step(model, opt, batch)["loss"]) for _ in range(2)]
    np.testing.assert_allclose(losses, one_device_losses, rtol=1e-5)
