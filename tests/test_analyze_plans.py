"""What XLA emits under hand-written plans, against expectations derived by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spmd

D, H, B = 64, 256, 32  # MLP width, hidden width, batch


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (D, H)) * 0.1, "w2": jax.random.normal(k2, (H, D)) * 0.1}


LOGICAL = {"w1": ("embed", "mlp"), "w2": ("mlp", "embed")}
PARAM_BYTES = (D * H + H * D) * 4


def _step(params, opt_state, batch):
    def loss(p):
        hidden = jax.nn.relu(batch["x"] @ p["w1"])  # (B, H)
        return jnp.mean((hidden @ p["w2"] - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optax.sgd(0.1).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def _report(mesh, method):
    params = _params()
    opt_state = optax.sgd(0.1).init(params)
    batch = {"x": jnp.ones((B, D)), "y": jnp.zeros((B, D))}
    step = spmd.parallelize(_step, mesh=mesh, method=method, logical_axes=LOGICAL)
    compiled = step.lower(params, opt_state, batch).compile()
    return spmd.analyze(compiled), step


@pytest.fixture(scope="module")
def mesh():
    return spmd.load_mesh("cpu-8")


def test_dp_is_one_gradient_all_reduce_and_no_gather(mesh):
    report, _ = _report(mesh, "dp")
    count, nbytes = report.collectives["all-reduce"]
    assert report.collectives["all-gather"] == (0, 0)
    # Gradients of both weights, plus the scalar loss mean.
    assert PARAM_BYTES <= nbytes <= PARAM_BYTES + 64
    assert report.total_collective_bytes == nbytes


def test_fsdp_gathers_parameters_and_reduces_gradients_to_shards(mesh):
    report, step = _report(mesh, "fsdp")
    specs = {leaf.path: spec for leaf, spec in zip(step.plan.leaves, step.plan.input_specs)}
    assert specs["params/w1"] == (("data", "model"), ())
    # Each weight is gathered whole for the forward (and again for the backward pass).
    gathered = report.collectives["all-gather"][1]
    assert PARAM_BYTES <= gathered <= 2 * PARAM_BYTES
    # Gradient reduction: XLA:CPU has no reduce-scatter; it all-reduces then keeps its shard.
    reduced = report.collectives["reduce-scatter"][1] + report.collectives["all-reduce"][1]
    assert reduced >= PARAM_BYTES
    assert report.memory.argument_bytes < PARAM_BYTES  # parameters arrive sharded


def test_tp_all_reduces_activations_never_weights(mesh):
    report, _ = _report(mesh, "tp")
    count, nbytes = report.collectives["all-reduce"]
    assert report.collectives["all-gather"] == (0, 0)
    # Forward: the row-parallel output (B, D); backward: the input gradient (B, D) is not
    # needed (x is data), so activation all-reduces stay far below the weights' size.
    assert count >= 1
    assert nbytes < PARAM_BYTES / 4
    assert B * D * 4 <= nbytes


def test_plain_jax_state_keeps_sharding_and_matches_one_device(mesh):
    params = _params()
    opt_state = optax.sgd(0.1).init(params)
    batch = {"x": jnp.ones((B, D)), "y": jnp.zeros((B, D))}
    step = spmd.parallelize(_step, mesh=mesh, method="fsdp_tp", logical_axes=LOGICAL)
    p, o, loss = step(params, opt_state, batch)
    assert p["w1"].sharding.spec == jax.sharding.PartitionSpec("data", "model")
    ref_p, _, ref_loss = jax.jit(_step)(params, opt_state, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(p["w2"]), np.asarray(ref_p["w2"]), atol=1e-6)


def test_missing_logical_names_are_named(mesh):
    """No names at all: the method cannot apply, and says what to give. Some names (kernels
    annotated, not the rest, as Flax examples write them): the unnamed stay whole."""
    params = _params()
    args = (params, optax.sgd(0.1).init(params), {"x": jnp.ones((B, D)), "y": jnp.ones((B, D))})
    with pytest.raises(spmd.PlanError, match="needs logical axis names but no parameter has any"):
        spmd.plan(_step, *args, mesh=mesh, method="tp", logical_axes={"w1": None, "w2": None})
    p = spmd.plan(_step, *args, mesh=mesh, method="tp",
                  logical_axes={"w1": ("embed", "mlp"), "w2": None})
    specs = {leaf.path: spec for leaf, spec in zip(p.leaves, p.input_specs)}
    assert specs["params/w1"] == ((), ("model",)) and specs["params/w2"] == ((), ())
