"""A step made pure and flat: leaves named and classified, outputs aliased, round trips."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from spmd import zoo
from spmd.errors import PlanError
from spmd.trace.signature import StepSignature


def _pure_step(params, opt_state, batch):
    tx = optax.adam(1e-3)
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch["x"] @ p["w"]) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _pure_args():
    params = {"w": jnp.ones((8, 4))}
    return params, optax.adam(1e-3).init(params), {"x": jnp.ones((16, 8))}


def test_pure_step_leaves_kinds_and_aliases():
    args = _pure_args()
    sig = StepSignature(_pure_step, args, logical_axes={"w": ("embed", "mlp")})
    kinds = {leaf.path: leaf.kind for leaf in sig.leaves}
    assert kinds["params/w"] == "param" and kinds["batch/x"] == "batch"
    opt = [leaf for leaf in sig.leaves if leaf.kind == "optimizer"]
    assert opt and all(leaf.logical == ("embed", "mlp") for leaf in opt if leaf.shape == (8, 4))
    # outputs 0.. are the new params and state, aliasing their inputs one to one
    n_state = len(jax.tree.leaves(args[0])) + len(jax.tree.leaves(args[1]))
    assert sig.output_aliases == {i: i for i in range(n_state)}
    # the flat function computes what the step computes
    flat = jax.tree.leaves(args)
    out = sig.flat_fn(*flat)
    want = jax.tree.leaves(_pure_step(*args))
    for a, b in zip(out, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b))


def test_nnx_step_reads_logical_names_and_writes_state_back():
    spec = zoo.get("mlp-tiny")
    model = spec.create(0)
    opt = spec.optimizer(model)
    batch = spec.batch(spec.default_batch_size, 0)
    sig = StepSignature(spec.train_step, (model, opt, batch))
    params = [leaf for leaf in sig.leaves if leaf.kind == "param"]
    assert params and all(leaf.logical and len(leaf.logical) == len(leaf.shape) for leaf in params)
    assert all(leaf.path.startswith(("model/", "optimizer/")) for leaf in sig.leaves
               if leaf.kind != "batch")
    assert sig.num_state_leaves == len(sig.output_aliases)
    before = np.asarray(jax.tree.leaves(nnx.state(model, nnx.Param))[0])
    out = sig.flat_fn(*sig.flatten_args((model, opt, batch)))
    metrics = sig.unflatten_outputs((model, opt, batch), out)
    after = np.asarray(jax.tree.leaves(nnx.state(model, nnx.Param))[0])
    assert "loss" in metrics and not np.allclose(before, after)


def test_batch_argnums_and_mismatched_logical_axes_are_named():
    args = _pure_args()
    sig = StepSignature(_pure_step, args, batch_argnums=(2,))
    assert {leaf.kind for leaf in sig.leaves if leaf.path.startswith("batch")} == {"batch"}
    short = StepSignature(_pure_step, args, logical_axes={"w": ("embed",)})
    assert {l.path: l.logical for l in short.leaves}["params/w"] == ("embed", None)
    with pytest.raises(PlanError, match="names 3 dimensions but the array has shape"):
        StepSignature(_pure_step, args, logical_axes={"w": ("embed", "mlp", "x")})
    with pytest.raises(PlanError, match="does not match the structure of any argument"):
        StepSignature(_pure_step, args, logical_axes={"v": ("embed", "mlp")})
    with pytest.raises(PlanError, match="structure differs"):
        sig.flatten_args(({"w": jnp.ones((8, 4)), "b": jnp.ones(4)}, args[1], args[2]))


def _state_step(state, batch, rng):
    """A functional TrainState-style step: (state, batch, key) -> (state, loss)."""
    params, opt_state = state["params"], state["opt_state"]
    tx = optax.adam(1e-3)
    noise = jax.random.normal(rng, batch["x"].shape)
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean(((batch["x"] + noise) @ p["w"]) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state,
            "step": state["step"] + 1}, loss


def _state_args():
    params = {"w": jnp.ones((8, 4))}
    state = {"params": params, "opt_state": optax.adam(1e-3).init(params), "step": jnp.int32(0)}
    return state, {"x": jnp.ones((2, 8))}, jax.random.PRNGKey(0)


@pytest.mark.parametrize("names", [
    {"w": ("embed", "mlp")},  # the params only
    {"w": jax.sharding.PartitionSpec("embed", "mlp")},  # as nn.get_partition_spec gives them
    {"w": ("embed",)},  # short: the rest not split
])
def test_functional_state_finds_params_optimizer_and_batch(names):
    """The params are a subtree of the state argument; Adam's moments follow their parameter;
    the batch is found by what it is (a trailing legacy key of leading size 2 is not it, even
    though the batch's leading size is 2 too)."""
    sig = StepSignature(_state_step, _state_args(), logical_axes=names)
    kinds = {l.path: l.kind for l in sig.leaves}
    assert kinds["state/params/w"] == "param"
    assert kinds["state/step"] == "state" and kinds["rng"] == "state"
    assert kinds["batch/x"] == "batch"
    moments = [l for l in sig.leaves if l.kind == "optimizer"]
    assert len(moments) == 2 and all(l.logical[0] == "embed" for l in moments)
    assert sig.batch_argnums == {1}


def test_no_batch_found_is_a_warning_naming_batch_argnums():
    with pytest.warns(UserWarning, match="batch_argnums="):
        sig = StepSignature(lambda p, step: p["a"].sum() * p["b"] * step,
                            ({"a": jnp.ones((4, 4)), "b": jnp.ones(3)}, jnp.float32(2)))
    assert sig.batch_argnums == set()
