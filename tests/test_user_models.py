"""A user's own Flax models (tests/flax_examples.py), their real train steps unchanged, under
auto and hand-written plans on 8 simulated devices: the single-device losses, parameters and
gradients (fp32), dropout included (same keys, partitionable threefry)."""

import jax
import numpy as np
import pytest
from flax import nnx

import spmd
from tests import flax_examples as ex

FAST = spmd.SearchOptions(cache=False, compare=False, time_limit=2.0)
STEPS = 3


@pytest.fixture(scope="module")
def mesh():
    return spmd.make_mesh({"data": 2, "model": 4})


@pytest.fixture(scope="module")
def user_mesh():
    """The user's own axis names, which their rules map to."""
    return spmd.make_mesh({"fsdp": 2, "tensor": 4})


def _close(got, want, what, atol=1e-5):
    """Leaf by leaf. Parameters after AdamW steps get atol 1e-5: a gradient that is zero
    analytically (an attention key's bias) is rounding noise, which Adam's normalization
    turns into updates of ~1e-6 either way; gradients themselves are held tighter."""
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):  # the dropout stream's key
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=atol,
                                   err_msg=f"{what} {jax.tree_util.keystr(path)}")


_REFERENCE: dict = {}


def _nnx_reference(create, step_fn, batch):
    """Losses and final model state of the same step on one device (jit places it on device
    0), computed once per model for all its cases."""
    if create not in _REFERENCE:
        with nnx.use_eager_sharding(False):
            nodes = create()
        step = nnx.jit(step_fn)
        losses = [float(step(*nodes, batch)["loss"]) for _ in range(STEPS)]
        _REFERENCE[create] = losses, nnx.state(nodes[0])
    return _REFERENCE[create]


def _nnx_matches_one_device(create, step_fn, batch, mesh, method, options):
    """STEPS steps under ``method``: the single-device losses and final model state; the
    plan, for what it split."""
    want_losses, want_state = _nnx_reference(create, step_fn, batch)
    step = spmd.parallelize(step_fn, mesh=mesh, method=method, options=options)
    plan = step.plan_for(*spmd.eval_shape(create), batch)
    nodes = spmd.materialize(create, plan)
    losses = [float(step(*nodes, batch)["loss"]) for _ in range(STEPS)]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _close(nnx.state(nodes[0]), want_state, "state")
    assert len(set(losses)) == STEPS  # dropout masks and updates move on each step
    return plan


# One method per kind of split these models meet (ep: no experts here): the search; the
# optimizer state alone split (zero); parameters split with the batch replicated (tp); and
# parameters over both axes beside a batch split (fsdp_tp). The others recombine those: dp
# splits the batch alone (the CNN's dp case below, dropout and AdamW included; the LM's, on
# the user's mesh, keeps the user's pins); fsdp splits the same names over every device at
# once, dp_tp is tp's splits beside a batch split (fsdp_tp has both); test_plans.py runs
# each of them on every zoo model, test_checkpoint.py trains under fsdp and dp_tp.
METHODS = ["auto", "zero", "tp", "fsdp_tp"]
LINEN_METHODS = ["auto", "zero", "fsdp_tp"]  # the batch replicated under tp: the NNX LM's case


@pytest.mark.parametrize("method", METHODS)
def test_nnx_lm_with_dropout_matches_one_device(mesh, method):
    plan = _nnx_matches_one_device(ex.nnx_lm_state, ex.nnx_lm_step, ex.lm_batch(), mesh, method,
                                   FAST)
    split = {leaf.kind for leaf, spec in zip(plan.leaves, plan.input_specs) if any(spec)}
    # auto splits something; whether the batch too is its call (on this CPU mesh it keeps
    # the batch whole, sparing XLA:CPU's all-reduce a latency per gradient): zero and
    # fsdp_tp split the batch under dropout
    assert split if method == "auto" else ("batch" in split or method == "tp")
    if method not in ("auto", "dp"):  # the method's rules reach the model's own names
        assert "optimizer" in split and ("param" in split) == (method != "zero")


@pytest.mark.parametrize("method", ["auto", "dp"])
def test_nnx_lm_under_its_own_rules_and_mesh_axes(user_mesh, method):
    """The user's rules (MaxText-style lists naming "fsdp" and "tensor") pin what they name,
    under auto with the hand-written plans compared (compare=True) and under dp alike."""
    options = spmd.SearchOptions(cache=False, time_limit=2.0, rules=ex.NNX_RULES)
    plan = _nnx_matches_one_device(ex.nnx_lm_state, ex.nnx_lm_step, ex.lm_batch(), user_mesh,
                                   method, options)
    specs = {leaf.path: spec for leaf, spec in zip(plan.leaves, plan.input_specs)}
    assert specs["model/blocks/0/up/kernel"] == (("fsdp",), ("tensor",))
    assert specs["model/embed/embedding"] == (("tensor",), ("fsdp",))
    assert specs["batch/tokens"] == (("fsdp",), ())
    if method == "auto":  # with every named array pinned, only the batch's split differs:
        # the methods that would split parameters say why they are no alternative
        assert isinstance(plan.alternatives["dp"], spmd.Prediction)
        for name in ("fsdp", "tp", "dp_tp"):
            assert plan.alternatives[name].startswith("does not apply"), name


def test_nnx_lm_gradients_match_one_device(mesh):
    batch = ex.lm_batch()

    def grads_step(model, batch):
        return nnx.value_and_grad(ex.nnx_lm_loss)(model, batch)

    with nnx.use_eager_sharding(False):
        model = ex.NnxLM()
    want_loss, want_grads = nnx.jit(grads_step)(model, batch)
    step = spmd.parallelize(grads_step, mesh=mesh, method="auto", options=FAST)
    plan = step.plan_for(spmd.eval_shape(ex.NnxLM), batch)
    loss, grads = step(spmd.materialize(ex.NnxLM, plan), batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    _close(grads, want_grads, "gradient", atol=1e-7)


@pytest.fixture(scope="module")
def linen_state():
    """The Linen LM's TrainState and logical names, initialized once (arrays are immutable
    and a functional step's arguments are not donated, so every case can share them)."""
    return ex.linen_lm_state()


@pytest.mark.parametrize("method", LINEN_METHODS)
def test_linen_train_state_step_matches_one_device(mesh, linen_state, method):
    """A functional step ``(TrainState, batch, key) -> (TrainState, metrics)``; logical_axes
    are the PartitionSpecs of logical names ``nn.get_partition_spec`` gives, for the params
    alone (Adam's moments follow their parameter); the batch is found beside a trailing key."""
    state, names = linen_state
    batch, key = ex.lm_batch(), jax.random.key(5)
    if "linen" not in _REFERENCE:
        want, want_losses = state, []
        ref = jax.jit(ex.linen_lm_step)
        for _ in range(STEPS):
            want, metrics = ref(want, batch, key)
            want_losses.append(float(metrics["loss"]))
        _REFERENCE["linen"] = want, want_losses
    want, want_losses = _REFERENCE["linen"]
    step = spmd.parallelize(ex.linen_lm_step, mesh=mesh, method=method, logical_axes=names,
                            options=FAST)
    plan = step.plan_for(state, batch, key)
    kinds = {leaf.path: leaf.kind for leaf in plan.leaves}
    assert kinds["batch/tokens"] == "batch" and kinds["dropout_key"] == "state"
    assert kinds["state/params/Dense_0/kernel"] == "param"
    assert "optimizer" in kinds.values()
    got, losses = state, []
    for _ in range(STEPS):
        got, metrics = step(got, batch, key)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _close(got.params, want.params, "parameter")
    assert int(got.step) == STEPS


def test_linen_gradients_match_one_device(mesh, linen_state):
    state, names = linen_state
    batch, key = ex.lm_batch(), jax.random.key(5)
    want_loss, want_grads = jax.jit(ex.linen_lm_grads)(state.params, batch, key)
    step = spmd.parallelize(ex.linen_lm_grads, mesh=mesh, method="fsdp_tp", logical_axes=names)
    loss, grads = step(state.params, batch, key)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    _close(grads, want_grads, "gradient", atol=1e-7)


@pytest.mark.parametrize("method", ["auto", "dp"])
def test_nnx_cnn_with_batchnorm_and_dropout_matches_one_device(mesh, method):
    """BatchNorm's statistics (state the step updates) and dropout under a batch split."""
    plan = _nnx_matches_one_device(ex.cnn_state, ex.cnn_step, ex.cnn_batch(), mesh, method, FAST)
    stats = [leaf for leaf in plan.leaves if "mean" in leaf.path]
    assert stats and all(leaf.kind == "state" for leaf in stats)
    # no logical names: the methods that need them say so rather than pose as alternatives
    why = spmd.manual.applicable_methods(plan.leaves, mesh)
    assert "needs logical axis names" in why["fsdp"] and why["dp"] is None
