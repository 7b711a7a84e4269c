"""Random numbers in the step (dropout): typed and legacy keys made inside the step, passed as
arguments, or held as NNX state, planned and run under hand-written plans and auto, give what
the same step gives on one device with the same keys (fp32)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import spmd
from spmd.dtypes import storage_dtype

OPTIONS = spmd.SearchOptions(cache=False, time_limit=2.0)
PARAMS = {"w1": jnp.linspace(-0.1, 0.1, 64 * 256).reshape(64, 256),
          "w2": jnp.linspace(0.1, -0.1, 256 * 64).reshape(256, 64)}
BATCH = {"x": jnp.arange(32 * 64, dtype=jnp.float32).reshape(32, 64) / 2048}


@pytest.fixture(scope="module")
def mesh():
    return spmd.make_mesh({"data": 2, "model": 4})


def _dropout_loss(p, key, x):
    h = jnp.tanh(x @ p["w1"])
    keep = jax.random.bernoulli(key, 0.8, h.shape)
    return jnp.mean((jnp.where(keep, h / 0.8, 0.0) @ p["w2"]) ** 2)


def keyed_step(params, key, batch):
    """A functional step: the key comes in, a fresh one goes out."""
    loss, grads = jax.value_and_grad(_dropout_loss)(params, key, batch["x"])
    new = jax.tree.map(lambda a, b: a - 0.1 * b, params, grads)
    return new, jax.random.split(key)[0], {"loss": loss}


def seeded_step(params, batch):
    """The key is made inside the step (typed, folded)."""
    key = jax.random.fold_in(jax.random.key(7), 1)
    loss, grads = jax.value_and_grad(_dropout_loss)(params, key, batch["x"])
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, grads), {"loss": loss}


def test_a_typed_key_is_priced_as_its_data():
    assert storage_dtype(jax.random.key(0).dtype).itemsize == 8  # two uint32 (threefry)
    assert storage_dtype(np.dtype("float32")) == np.dtype("float32")


@pytest.mark.parametrize("method", ["dp", "fsdp", "auto"])
@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "legacy"])
def test_a_key_argument_gives_the_single_device_step(mesh, method, make_key):
    step = spmd.parallelize(keyed_step, mesh=mesh, method=method, options=OPTIONS)
    got = step(PARAMS, make_key(3), BATCH)
    want = keyed_step(PARAMS, make_key(3), BATCH)
    np.testing.assert_allclose(got[2]["loss"], want[2]["loss"], rtol=1e-5)
    for name in PARAMS:
        np.testing.assert_allclose(got[0][name], want[0][name], rtol=1e-5, atol=1e-7)
    assert np.array_equal(jax.random.key_data(got[1]) if make_key is jax.random.key else got[1],
                          jax.random.key_data(want[1]) if make_key is jax.random.key else want[1])
    if method == "auto":  # random bits and key operations have rules: none is a fallback
        assert not any(f.startswith("random") for f in step.plan.search["fallbacks"])


@pytest.mark.parametrize("method", ["dp", "auto"])
def test_a_key_made_inside_the_step_gives_the_single_device_step(mesh, method):
    step = spmd.parallelize(seeded_step, mesh=mesh, method=method, options=OPTIONS)
    got, want = step(PARAMS, BATCH), seeded_step(PARAMS, BATCH)
    np.testing.assert_allclose(got[1]["loss"], want[1]["loss"], rtol=1e-5)
    for name in PARAMS:
        np.testing.assert_allclose(got[0][name], want[0][name], rtol=1e-5, atol=1e-7)


class DropoutMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(64, 256, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(256, 64, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.l1(x))))


def _create():
    model = DropoutMLP(nnx.Rngs(params=0, dropout=1))
    return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)


def nnx_step(model, optimizer, batch):
    def loss(m):
        return jnp.mean((m(batch["x"]) - 1.0) ** 2)
    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return {"loss": value}


@pytest.mark.parametrize("method", ["dp", "auto"])
def test_nnx_dropout_state_advances_as_on_one_device(mesh, method):
    """nnx.Rngs keeps a key and a counter in the model's state: three steps draw three
    different masks, the same ones as on one device."""
    ref_model, ref_opt = _create()
    ref_step = nnx.jit(nnx_step)
    want = [float(ref_step(ref_model, ref_opt, BATCH)["loss"]) for _ in range(3)]
    model, optimizer = _create()
    step = spmd.parallelize(nnx_step, mesh=mesh, method=method, options=OPTIONS)
    got = [float(step(model, optimizer, BATCH)["loss"]) for _ in range(3)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert len(set(got)) == 3


def test_dropout_bits_are_made_split_at_realistic_size():
    """An 8192 x 32768 dropout mask (1 GiB) under a batch split: with partitionable threefry
    each of 8 devices makes its eighth of the bits; with sequential bits it could only be
    made whole on every device, 896 MiB more per device (the layer's activations, which the
    mask multiplies, are then kept whole too). The weights are small beside the activations,
    so that the peak is where the mask is made."""
    mesh = spmd.make_mesh({"data": 8}, virtual=True, device="a100-80gb")
    params = {"w1": jax.ShapeDtypeStruct((1024, 32768), jnp.float32),
              "w2": jax.ShapeDtypeStruct((32768, 1024), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((8192, 1024), jnp.float32)}
    options = spmd.SearchOptions(cache=False)

    def memory():
        plan = spmd.plan(seeded_step, params, batch, mesh=mesh, method="dp", options=options)
        return plan.prediction.memory_bytes

    split = memory()
    previous = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", False)
    try:
        whole = memory()
    finally:
        jax.config.update("jax_threefry_partitionable", previous)
    mask = 8192 * 32768 * 4
    assert whole - split >= 0.8 * mask, (whole / 2**20, split / 2**20)
