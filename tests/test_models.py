"""Tests for the model zoo (`models/`, installed as `spmd.zoo`): registry, logical names, batches, training, MoE gating.

Big sizes are only ever built abstractly (`nnx.eval_shape`); anything that runs uses the
tiny sizes, so the file stays well under a minute on two CPU cores.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmd import zoo
from spmd.zoo import moe

TINY = [n for n in zoo.names() if n.endswith("-tiny")]
# the tiny models, and the scanned GPT whose names and optimizer state are checked too
CHECKED = [*TINY, "gpt-tiny-scan"]
LOGICAL_NAMES = {
    "embed", "mlp", "heads", "kv", "vocab", "pos", "expert", "conv_in", "conv_out", "classes",
    "layers",
}  # fmt: skip
# Nominal sizes of the GPT-3 family (Brown et al. 2020, Table 2.1).
GPT_NOMINAL = {
    "gpt-125m": 125e6,
    "gpt-350m": 350e6,
    "gpt-760m": 760e6,
    "gpt-1.3b": 1.3e9,
    "gpt-2.6b": 2.7e9,
    "gpt-6.7b": 6.7e9,
    "gpt-13b": 13e9,
}


@functools.lru_cache(maxsize=None)
def _abstract(name: str) -> nnx.Module:
    """The abstract model of a registered name or variant, built once per test session."""
    return zoo.get(name).abstract_model()


def _flat(state: nnx.State) -> dict[tuple, nnx.Variable]:
    return dict(nnx.to_flat_state(state))


def _specs(state: nnx.State) -> dict[tuple, tuple]:
    """Path -> tuple of logical names, read the supported way (nnx.get_partition_spec)."""
    return {p: tuple(v.get_value()) for p, v in nnx.to_flat_state(nnx.get_partition_spec(state))}


def _model_and_optimizer(spec: zoo.ModelSpec) -> tuple[nnx.Module, nnx.Optimizer]:
    model = spec.create()
    return model, spec.optimizer(model)


@pytest.fixture(scope="module")
def trained():
    """Loss per step for 5 jitted AdamW steps on each tiny model's default batch."""
    out = {}
    for name in TINY:
        spec = zoo.get(name)
        model = spec.create()
        opt = spec.optimizer(model)
        batch = spec.batch(spec.default_batch_size)
        step = nnx.jit(spec.train_step)
        out[name] = (model, [float(step(model, opt, batch)["loss"]) for _ in range(5)])
    return out


# --- registry -------------------------------------------------------------------------


def test_names_cover_every_family():
    names = zoo.names()
    assert len(names) == len(set(names))
    for expected in ["gpt-tiny", "gpt-125m", "gpt-13b", "mlp-tiny", "moe-tiny", "wresnet-tiny"]:
        assert expected in names
    assert {zoo.get(n).family for n in names} == {"gpt", "mlp", "moe", "wresnet"}


def test_unknown_name_lists_valid_names():
    with pytest.raises(zoo.UnknownModelError, match="gpt-tiny") as info:
        zoo.get("gpt-7")
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("name", zoo.names())
def test_spec_fields(name):
    spec = zoo.get(name)
    assert spec.name == name and name.startswith(spec.family + "-")
    assert spec.default_batch_size > 0 and spec.default_batch_size % 8 == 0
    if spec.unit == "tokens":
        assert spec.items_per_batch(8) == 8 * spec.config.seq_len
    else:
        assert spec.unit == "samples" and spec.items_per_batch(8) == 8


@pytest.mark.parametrize("name", zoo.names())
def test_every_model_builds_abstractly(name):
    abstract = _abstract(name)
    leaves = jax.tree.leaves(nnx.state(abstract))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    params = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    assert all(x.dtype == jnp.float32 for x in params)
    if name in GPT_NOMINAL or name.endswith("-tiny"):  # param_count builds it again
        assert zoo.get(name).param_count() == sum(math.prod(x.shape) for x in params)


@pytest.mark.parametrize("name", sorted(GPT_NOMINAL))
def test_gpt_param_counts_match_nominal(name):
    params = jax.tree.leaves(nnx.state(_abstract(name), nnx.Param))
    count = sum(math.prod(x.shape) for x in params)
    assert abs(count - GPT_NOMINAL[name]) / GPT_NOMINAL[name] < 0.10, count


def test_with_config_overrides_and_validates():
    spec = zoo.get("gpt-tiny")
    deeper = spec.with_config(num_layers=4, dtype=jnp.bfloat16)
    assert deeper.config.num_layers == 4 and deeper.config.dtype == "bfloat16"
    assert spec.config.num_layers == 2  # the registered spec is untouched
    per_layer = deeper.param_count() - spec.param_count()
    assert per_layer > 0 and per_layer % 2 == 0
    with pytest.raises(ValueError, match="num_layers"):
        spec.with_config(num_layer=4)
    with pytest.raises(ValueError):
        spec.with_config(num_layers=0)
    with pytest.raises(ValueError, match="scan_layers"):
        spec.with_config(scan_layers="yes")
    with pytest.raises(ValueError):
        zoo.get("wresnet-tiny").with_config(depth=11)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_gpt_remat_checkpoints_each_block_and_changes_no_number(scan):
    """`remat` wraps every block in jax.checkpoint with the named policy, as a user writes
    it: the step's jaxpr holds the checkpoint, and loss and gradients are the plain ones."""
    from spmd.zoo import gpt

    def loss_grads(remat):
        spec = zoo.get("gpt-tiny").with_config(remat=remat, scan_layers=scan)
        graphdef, state = nnx.split(spec.training_state()[0])
        batch = spec.batch(4, 0)
        f = lambda st: gpt.loss(nnx.merge(graphdef, st), batch)  # noqa: E731
        jaxpr = jax.make_jaxpr(jax.grad(f))(state)
        held = any(e.primitive.name in ("checkpoint", "remat", "remat2")
                   for e in _all_eqns(jaxpr.jaxpr))
        return jax.value_and_grad(f)(state), held

    (loss, grads), held = loss_grads("none")
    assert not held
    for remat in ("save_dots", "recompute_all"):
        (loss_r, grads_r), held = loss_grads(remat)
        assert held, remat
        np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads_r), jax.tree.leaves(grads)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="remat must be one of"):
        zoo.get("gpt-tiny").with_config(remat="dots")


def _all_eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs inside its equations."""
    for e in jaxpr.eqns:
        yield e
        for sub in jax.core.jaxprs_in_params(e.params):
            yield from _all_eqns(sub)


# --- logical names --------------------------------------------------------------------


@pytest.mark.parametrize("name", CHECKED)
def test_every_variable_has_logical_names(name):
    state = nnx.state(_abstract(name))
    specs = _specs(state)
    for path, var in _flat(state).items():
        names = specs[path]
        assert len(names) == len(var.shape), (path, names, var.shape)
        assert any(n is not None for n in names), path
        assert set(names) - {None} <= LOGICAL_NAMES, (path, names)
        assert isinstance(var, (nnx.Param, nnx.BatchStat)), (path, type(var))


@pytest.mark.parametrize("name", CHECKED)
def test_optimizer_state_carries_param_names(name):
    spec = zoo.get(name)
    model, opt = nnx.eval_shape(lambda: _model_and_optimizer(spec))
    param_specs = _specs(nnx.state(model, nnx.Param))
    opt_specs = _specs(nnx.state(opt))
    matched = 0
    for path, names in opt_specs.items():
        for i in range(len(path)):
            if path[i:] in param_specs:  # e.g. ("opt_state", 0, "mu", *param_path)
                assert names == param_specs[path[i:]], path
                matched += 1
                break
    assert matched == 2 * len(param_specs)  # Adam's mu and nu per param


def test_gpt_parameter_kinds_are_named_as_documented():
    specs = _specs(nnx.state(_abstract("gpt-tiny")))
    assert specs[("embed", "wte")] == ("vocab", "embed")
    assert specs[("embed", "wpe")] == ("pos", "embed")
    assert specs[("blocks", 1, "attn", "wq")] == ("embed", "heads", "kv")
    assert specs[("blocks", 1, "attn", "bq")] == ("heads", "kv")
    assert specs[("blocks", 0, "attn", "wo")] == ("heads", "kv", "embed")
    assert specs[("blocks", 0, "mlp", "wi")] == ("embed", "mlp")
    assert specs[("blocks", 0, "mlp", "wo")] == ("mlp", "embed")
    assert specs[("ln_f", "scale")] == ("embed",)


def test_moe_expert_weights_have_expert_dim():
    specs = _specs(nnx.state(_abstract("moe-tiny")))
    assert specs[("blocks", 1, "moe", "router")] == ("embed", "expert")
    assert specs[("blocks", 1, "moe", "wi")] == ("expert", "embed", "mlp")
    assert specs[("blocks", 1, "moe", "wo")] == ("expert", "mlp", "embed")
    assert ("blocks", 0, "mlp", "wi") in specs  # block 0 is dense


# --- creation and batches -------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_batch_is_deterministic(name):
    spec = zoo.get(name)
    n = spec.default_batch_size  # the shape the training fixture compiles too
    a, b, c = spec.batch(n, seed=0), spec.batch(n, seed=0), spec.batch(n, seed=1)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape[0] == n
        np.testing.assert_array_equal(a[k], b[k])
    assert any(not np.array_equal(a[k], c[k]) for k in a)


def test_create_is_pure_and_jittable():
    """spmd initializes with jax.jit(lambda: nnx.split(create())[1]); it must match eager."""
    spec = zoo.get("mlp-tiny")
    eager = nnx.state(spec.create(seed=3))
    jitted = jax.jit(lambda: nnx.split(spec.create(seed=3))[1])()
    for x, y in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)  # fusion may move the last ulp
    other = nnx.state(spec.create(seed=4))
    assert not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(eager), jax.tree.leaves(other)))


def test_models_store_no_rngs():
    for name in CHECKED:
        state = nnx.state(_abstract(name))
        assert all(isinstance(v, (nnx.Param, nnx.BatchStat)) for v in _flat(state).values()), name


# --- training -------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY)
def test_train_steps_are_finite(trained, name):
    _, losses = trained[name]
    assert all(np.isfinite(losses)), losses


@pytest.mark.parametrize("name", ["gpt-tiny", "mlp-tiny", "moe-tiny", "wresnet-tiny"])
def test_a_few_steps_reduce_the_loss(trained, name):
    _, losses = trained[name]
    assert losses[-1] < losses[0], losses


def test_wresnet_train_step_updates_batch_stats(trained):
    model, _ = trained["wresnet-tiny"]
    mean = model.blocks[0].bn1.mean[...]
    assert not np.allclose(mean, 0.0)


def test_bfloat16_compute_gives_fp32_loss():
    spec = zoo.get("gpt-tiny").with_config(dtype="bfloat16")
    model = spec.create()
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    loss = nnx.jit(spec.loss)(model, spec.batch(8))
    assert loss.dtype == jnp.float32 and np.isfinite(float(loss))


# --- MoE gating -----------------------------------------------------------------------


def test_top2_dispatch_respects_capacity():
    capacity = 3  # tight, so some tokens overflow and some keep both experts
    logits = jax.random.normal(jax.random.key(0), (4, 32, 8)) * 3.0  # (group, seq, expert)
    dispatch, combine, aux = jax.jit(moe.top2_gating, static_argnums=1)(logits, capacity)
    dispatch, combine = np.asarray(dispatch), np.asarray(combine)
    assert dispatch.shape == combine.shape == (4, 32, 8, capacity)
    assert set(np.unique(dispatch)) <= {0.0, 1.0}
    assert dispatch.sum(axis=(1, 3)).max() <= capacity  # tokens per (group, expert)
    assert dispatch.sum(axis=1).max() <= 1  # each slot holds at most one token
    assert dispatch.sum(axis=(2, 3)).max() <= 2  # each token goes to at most two experts
    assert np.all(combine[dispatch == 0] == 0)
    weights = combine.sum(axis=(2, 3))  # (group, seq)
    assert weights.max() <= 1 + 1e-5
    kept_both = dispatch.sum(axis=(2, 3)) == 2
    np.testing.assert_allclose(weights[kept_both], 1.0, rtol=1e-5)
    assert (dispatch.sum(axis=(2, 3)) < 2).any() and kept_both.any()  # both cases exercised
    assert np.isfinite(float(aux)) and float(aux) > 0


def test_moe_capacity_formula():
    config = zoo.get("moe-tiny").config
    assert config.capacity == math.ceil(config.capacity_factor * config.seq_len * 2 / config.num_experts)
    assert moe.expert_capacity(32, 8, 2.0) == 16
