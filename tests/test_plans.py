"""Every zoo model under every applicable hand-written plan computes what one device does."""

import jax
import numpy as np
import pytest
from flax import nnx
from conftest import assert_grads_close

from spmd import zoo
import spmd
from spmd.manual import METHODS, applicable_methods

TINY = ["gpt-tiny", "mlp-tiny", "moe-tiny", "wresnet-tiny"]


@pytest.fixture(scope="module")
def mesh():
    return spmd.load_mesh("cpu-8")


def _value_and_grad(spec):
    def grads(model, batch):
        return nnx.value_and_grad(spec.loss)(model, batch)
    return grads


_REFERENCE: dict = {}


def _reference(spec):
    """Loss and gradients on one device, computed once per model."""
    if spec.name not in _REFERENCE:
        model = spec.create(0)
        batch = spec.batch(spec.default_batch_size, 0)
        device = jax.devices()[0]
        with jax.default_device(device):
            loss, grads = jax.jit(lambda m, b: nnx.value_and_grad(spec.loss)(m, b))(model, batch)
        _REFERENCE[spec.name] = (float(loss), jax.tree.map(np.asarray, grads))
    return _REFERENCE[spec.name]


_APPLICABLE: dict = {}


def _why_not(spec, mesh):
    """applicable_methods for the model's step, traced once per model for all its methods."""
    if spec.name not in _APPLICABLE:
        abstract = nnx.eval_shape(lambda: spec.create(0))
        batch = spec.batch(spec.default_batch_size, 0)
        leaves = spmd.plan(_value_and_grad(spec), abstract, batch, mesh=mesh, method="dp").leaves
        _APPLICABLE[spec.name] = applicable_methods(leaves, mesh)
    return _APPLICABLE[spec.name]


# A short search: these tests check numerics, not plan quality (see bench/).
FAST_SEARCH = spmd.SearchOptions(compare=False, time_limit=5.0)


@pytest.mark.parametrize("method", ["auto", *METHODS])
@pytest.mark.parametrize("name", TINY)
def test_loss_and_gradients_match_one_device(mesh, name, method):
    spec = zoo.get(name)
    batch = spec.batch(spec.default_batch_size, 0)
    grads_fn = _value_and_grad(spec)
    abstract = nnx.eval_shape(lambda: spec.create(0))
    if method != "auto":
        why_not = _why_not(spec, mesh)[method]
        if why_not:
            pytest.skip(f"{method} does not apply to {name}: {why_not}")
    step = spmd.parallelize(grads_fn, mesh=mesh, method=method, options=FAST_SEARCH)
    plan = step.plan_for(abstract, batch)
    if method == "auto":  # each model built straight into a plan's shardings once
        model = spmd.materialize(lambda: spec.create(0), plan)
        assert all(a.sharding.is_equivalent_to(s, a.ndim) for a, s in zip(
            jax.tree.leaves(nnx.state(model)), plan.input_shardings_flat()))
    else:  # built on one device, placed by the step (materialize is a compile of its own)
        model = spec.create(0)
    loss, grads = step(model, batch)
    ref_loss, ref_grads = _reference(spec)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=2e-5)
    assert_grads_close(grads, ref_grads, atol=2e-5, what=f"{name} {method}")


@pytest.mark.parametrize("method", ["fsdp_tp", "zero"])
def test_state_keeps_its_sharding_across_steps(mesh, method):
    spec = zoo.get("gpt-tiny")
    batch = spec.batch(spec.default_batch_size, 0)

    abstract_model, abstract_opt = nnx.eval_shape(spec.training_state)
    plan = spmd.plan(spec.train_step, abstract_model, abstract_opt, batch, mesh=mesh,
                     method=method)
    net, opt = spmd.materialize(spec.training_state, plan)
    step = spmd.parallelize(spec.train_step, mesh=mesh, method=method)
    want = {leaf.path: sharding for leaf, sharding
            in zip(plan.leaves, plan.input_shardings_flat()) if leaf.kind != "batch"}
    losses = []
    for _ in range(3):
        losses.append(float(step(net, opt, batch)["loss"]))
        leaves = step.plan.signature.flatten_args((net, opt, batch))
        for leaf, array in zip(plan.leaves, leaves):
            if leaf.kind != "batch":
                assert array.sharding.is_equivalent_to(want[leaf.path], array.ndim), leaf.path
    assert losses[2] < losses[0]
    # The same three steps on one device give the same losses.
    ref_net, ref_opt = spec.training_state()
    ref_step = nnx.jit(spec.train_step)
    ref = [float(ref_step(ref_net, ref_opt, batch)["loss"]) for _ in range(3)]
    np.testing.assert_allclose(losses, ref, rtol=1e-4)
