"""Calling a ParallelStep again on the same NNX objects skips the graph walk (spmd.runtime.nodes)
and still behaves as the walk did: state updated in place, donated, re-planned when the graph,
a shape or Variable metadata changes, and the cache let go with the objects."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import spmd


class _Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, out: int = 1) -> None:
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.head = nnx.Linear(8, out, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.hidden(x)))


def _step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
    optimizer.update(model, grads)
    return {"loss": loss}


def _create(seed: int = 0):
    model = _Net(nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _batch():
    x = jax.random.normal(jax.random.key(1), (8, 4))
    return {"x": x, "y": x[:, :1] * 2.0}


@pytest.fixture(scope="module")
def mesh():
    return spmd.make_mesh({"data": 8})


def _values(*nodes):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(nodes))]


def _assert_same_state(got, want):
    for a, b in zip(_values(*got), _values(*want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_repeat_calls_update_state_in_place_like_eager_nnx(mesh):
    step = spmd.parallelize(_step, mesh=mesh, method="dp")
    model, opt = _create()
    ref_model, ref_opt = _create()
    batch = _batch()
    kernel = model.head.kernel
    for _ in range(4):
        old = kernel.get_raw_value()
        loss = step(model, opt, batch)["loss"]
        ref_loss = _step(ref_model, ref_opt, batch)["loss"]
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        assert old.is_deleted()  # donated: the new value took its buffer
    assert model.head.kernel is kernel and step._nodes._entry is not None  # no walk since call 1
    _assert_same_state((model, opt), (ref_model, ref_opt))
    assert int(opt.step[...]) == 4

    # a value the user writes between calls is what the next call reads
    for m in (model, ref_model):
        m.hidden.bias[...] = jnp.full((8,), 0.5)
    step(model, opt, batch), _step(ref_model, ref_opt, batch)
    _assert_same_state((model, opt), (ref_model, ref_opt))


def test_structure_shape_and_metadata_changes_are_seen(mesh):
    step = spmd.parallelize(_step, mesh=mesh, method="dp")
    model, opt = _create()
    ref_model, ref_opt = _create()
    batch = _batch()
    step(model, opt, batch), _step(ref_model, ref_opt, batch)

    # a submodule, then a Variable deeper down, replaced by one of the same shape: the new
    # Variables are the ones updated
    for m in (model, ref_model):
        m.head = nnx.Linear(8, 1, rngs=nnx.Rngs(5))
    step(model, opt, batch), _step(ref_model, ref_opt, batch)
    for m in (model, ref_model):
        m.hidden.bias = nnx.Param(jnp.full((8,), 0.1))
    step(model, opt, batch), _step(ref_model, ref_opt, batch)
    _assert_same_state((model,), (ref_model,))
    assert len(step._prepared) == 1

    # a Variable added: another state structure, planned anew
    model.seen = nnx.BatchStat(jnp.zeros(()))
    step(model, opt, batch)
    assert len(step._prepared) == 2 and "seen" in nnx.state(model)

    # a Variable's new shape, then new metadata (part of the state's structure): planned anew
    model.seen.set_value(jnp.zeros((3,)))
    step(model, opt, batch)
    model.seen.set_metadata("note", "x")
    step(model, opt, batch)
    assert len(step._prepared) == 4


def test_dropped_objects_are_let_go(mesh):
    step = spmd.parallelize(_step, mesh=mesh, method="dp")
    model, opt = _create()
    step(model, opt, _batch())
    assert step._nodes._entry is not None
    del model, opt
    gc.collect()
    assert step._nodes._entry is None


def test_functional_step_runs_as_before(mesh):
    tx = optax.sgd(0.1)

    def pure(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch["x"] @ p) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    params = jnp.ones((4, 2))
    state, ref = (params, tx.init(params)), (params, tx.init(params))
    batch = {"x": _batch()["x"]}
    step = spmd.parallelize(pure, mesh=mesh, method="dp")
    for _ in range(3):
        state, loss = step(*state, batch)
        ref, ref_loss = pure(*ref, batch)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(state[0], ref[0], rtol=1e-5)
