"""method="auto" through the public API: cache, warnings and errors a user sees."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd

LOGICAL = {"w1": ("embed", "mlp"), "w2": ("mlp", "embed")}


def _step(params, batch):
    def loss(p):
        return jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"] - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


def _args(d=64, h=256, b=32):
    params = {"w1": jnp.ones((d, h)) * 0.01, "w2": jnp.ones((h, d)) * 0.01}
    return params, {"x": jnp.ones((b, d)), "y": jnp.zeros((b, d))}


def test_second_plan_is_loaded_from_the_cache(tmp_path):
    mesh = spmd.make_mesh({"data": 2, "model": 4}, virtual=True)
    options = spmd.SearchOptions(cache_dir=str(tmp_path), compare=False)
    first = spmd.plan(_step, *_args(), mesh=mesh, method="auto", options=options)
    assert "cache" not in first.search
    start = time.perf_counter()
    second = spmd.plan(_step, *_args(), mesh=mesh, method="auto", options=options)
    assert second.search["cache"].startswith("loaded")
    assert second.input_specs == first.input_specs
    assert second.constraints == first.constraints
    assert time.perf_counter() - start < first.search["search_seconds"] + 5
    assert set(second.search["timings"]) == {"trace", "cache"}  # this call's own phases
    assert len(list(tmp_path.glob("*.json"))) == 1
    # a plan found under other options (here a shorter search) is not reused
    other = spmd.plan(_step, *_args(), mesh=mesh, method="auto",
                      options=dataclasses.replace(options, time_limit=3.0))
    assert "cache" not in other.search and len(list(tmp_path.glob("*.json"))) == 2


def test_unmeetable_budget_states_the_least_memory():
    mesh = spmd.make_mesh({"data": 2, "model": 4}, virtual=True)
    options = spmd.SearchOptions(memory_budget=1024, cache=False, compare=False)
    with pytest.raises(spmd.InfeasibleError, match="least peak memory") as err:
        spmd.plan(_step, *_args(), mesh=mesh, method="auto", options=options)
    # remat was tried before giving up: the message says so
    assert "every layer's activations recomputed" in str(err.value)
    assert "use more devices" in str(err.value)


def test_solver_timeout_warns_and_still_plans():
    mesh = spmd.make_mesh({"data": 2, "model": 4}, virtual=True)
    from spmd import zoo
    from flax import nnx

    spec = zoo.get("gpt-tiny")
    grads = lambda m, b: nnx.value_and_grad(spec.loss)(m, b)  # noqa: E731
    options = spmd.SearchOptions(time_limit=0.05, cache=False, compare=False)
    with pytest.warns(UserWarning, match="reached its time limit") as caught:
        plan = spmd.plan(grads, nnx.eval_shape(lambda: spec.create(0)), spec.batch(8, 0),
                         mesh=mesh, method="auto", options=options)
    assert plan.search["status"] == "feasible"
    assert {w.filename for w in caught} == {__file__}  # the user's line, not spmd's


@pytest.mark.parametrize("axes, warning", [
    ({"data": 8, "model": 1}, "axis model has size 1"),
    ({"data": 1}, "has one device"),
])
def test_trivial_axes_warn_and_the_step_runs(axes, warning):
    mesh = spmd.make_mesh(axes, virtual=True)
    options = spmd.SearchOptions(cache=False, compare=False)
    params, batch = _args()
    with pytest.warns(UserWarning, match=warning) as caught:
        step = spmd.parallelize(_step, mesh=mesh, method="auto", options=options)
        new_params, loss = step(params, batch)
    assert {w.filename for w in caught} == {__file__}  # planned on the first call
    with pytest.warns(UserWarning, match=warning) as caught:
        spmd.plan(_step, params, batch, mesh=mesh, method="auto", options=options)
    assert {w.filename for w in caught} == {__file__}  # the user's line, not spmd's
    ref_params, ref_loss = jax.jit(_step)(params, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(new_params["w1"]), np.asarray(ref_params["w1"]), rtol=1e-5,
                               atol=1e-6)


def test_user_pins_are_kept():
    mesh = spmd.make_mesh({"data": 2, "model": 4}, virtual=True)
    options = spmd.SearchOptions(cache=False, compare=False, rules={"mlp": ("data",)})
    plan = spmd.plan(_step, *_args(), mesh=mesh, method="auto", logical_axes=LOGICAL,
                     options=options)
    specs = {leaf.path: spec for leaf, spec in zip(plan.leaves, plan.input_specs)}
    assert specs["params/w1"] == ((), ("data",))
    assert specs["params/w2"] == (("data",), ())
    explicit = {"w1": jax.sharding.PartitionSpec(None, "model"), "w2": None}
    plan = spmd.plan(_step, *_args(), mesh=mesh, method="auto", logical_axes=explicit,
                     options=spmd.SearchOptions(cache=False, compare=False))
    specs = {leaf.path: spec for leaf, spec in zip(plan.leaves, plan.input_specs)}
    assert specs["params/w1"] == ((), ("model",))


def test_auto_plan_explains_itself():
    mesh = spmd.make_mesh({"data": 2, "model": 4}, virtual=True)
    params, batch = _args()
    step = spmd.parallelize(_step, mesh=mesh, method="auto",
                            options=spmd.SearchOptions(cache=False))
    compiled = step.lower(params, batch).compile()
    plan = step.plan
    plan.attach_measured(spmd.analyze(compiled))
    text = plan.describe()
    for needle in ("predicted cost per step", "auto (this plan)", "dp", "predicted vs compiled",
                   "params/w1", "communication priced by the cost model", "of the lower bound",
                   "batch/x"):
        assert needle in text
    assert "graph_nodes=" not in text  # the raw counters stay in the JSON
    assert plan.search["bound"] <= plan.search["objective"]
    # The compiled program's collectives, priced by the same model, cost what was predicted
    # (here one gradient all-reduce: nothing for XLA to combine).
    assert plan.measured["unpriced_collectives"] == 0
    assert plan.measured["comm_time"] == pytest.approx(plan.prediction.comm_time, rel=0.01)
    assert set(plan.alternatives) >= {"dp", "fsdp", "tp"}


def test_auto_never_returns_a_plan_predicted_slower_than_a_hand_written_one(monkeypatch):
    """When the search (tied layers, pruned small tensors) ends slower than the best scored
    hand-written plan, that plan (its inputs, intermediates chosen by the ILP) is returned.
    The search is replaced by one whose plan is predicted 10x slower."""
    import dataclasses

    from spmd.search.intra_op import IntraOp

    real = IntraOp.search

    def slower(self, **kwargs):
        res = real(self, **kwargs)
        return dataclasses.replace(res, prediction=res.prediction.scaled(10.0))

    monkeypatch.setattr(IntraOp, "search", slower)
    mesh = spmd.make_mesh({"data": 2, "model": 4}, virtual=True)
    options = spmd.SearchOptions(cache=False, compare=True, time_limit=2.0)
    plan = spmd.plan(_step, *_args(), mesh=mesh, method="auto", options=options,
                     logical_axes=LOGICAL)
    kept = plan.search["kept_hand_written"]
    assert kept == plan.search["warm_start_from"] and kept in plan.alternatives
    assert plan.prediction == plan.alternatives[kept]
    assert plan.input_specs == spmd.plan(_step, *_args(), mesh=mesh, method=kept,
                                         logical_axes=LOGICAL).input_specs


def test_hand_written_plans_with_the_same_pins_are_scored_once(monkeypatch):
    """Where the data axis has size 1, tp and dp_tp pin every input alike: one scoring."""
    from spmd.search.intra_op import IntraOp

    pinned = []
    real = IntraOp.score

    def counted(self, pins, **kwargs):
        pinned.append(tuple(pins))
        return real(self, pins, **kwargs)

    monkeypatch.setattr(IntraOp, "score", counted)
    mesh = spmd.make_mesh({"data": 1, "model": 8}, virtual=True)
    options = spmd.SearchOptions(cache=False, time_limit=2.0)
    with pytest.warns(UserWarning, match="size 1"):
        plan = spmd.plan(_step, *_args(), mesh=mesh, method="auto", options=options,
                         logical_axes=LOGICAL)
    assert len(pinned) == len(set(pinned)) < len(plan.alternatives)
    assert plan.alternatives["dp_tp"] is plan.alternatives["tp"]


def test_planning_hides_the_old_heap_from_the_collector_and_restores_it():
    import gc

    seen = []

    def step(params, batch):
        seen.append(gc.get_freeze_count())
        return _step(params, batch)

    mesh = spmd.make_mesh({"data": 2}, virtual=True)
    assert gc.get_freeze_count() == 0
    spmd.plan(step, *_args(), mesh=mesh, method="dp")
    assert seen[-1] > 0 and gc.get_freeze_count() == 0
    gc.freeze()  # a caller's own frozen heap stays frozen
    try:
        frozen = gc.get_freeze_count()
        spmd.plan(step, *_args(), mesh=mesh, method="dp")
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()


def test_describe_shows_the_batch_past_many_parameters():
    """Inputs are grouped (batch, parameters, optimizer state, other state); with 80
    parameters and the default 60 rows the batch's spec is still shown."""
    params = {f"w{i:02d}": jnp.ones((8, 8)) for i in range(80)}

    def step(params, batch):
        return jax.tree.map(lambda w: w - 0.1 * (batch["x"] @ w).mean(), params)

    mesh = spmd.make_mesh({"data": 8}, virtual=True)
    plan = spmd.plan(step, params, {"x": jnp.ones((16, 8))}, mesh=mesh, method="dp")
    text = plan.describe()
    assert "batch/x" in text and "P(data, -)" in text
    assert "more other state" in text and "params/w00" in text  # no names: not "param"


def test_describe_gives_one_line_for_the_methods_a_plain_step_cannot_use():
    """A plain-JAX step has no logical names: every method but dp would be data
    parallelism, for one reason, said once under the table rather than in a row each."""
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)

    mesh = spmd.make_mesh({"data": 2, "model": 4}, virtual=True)
    plan = spmd.plan(step, jax.ShapeDtypeStruct((64, 64), jnp.float32),
                     jax.ShapeDtypeStruct((32, 64), jnp.float32), mesh=mesh)
    text = " ".join(plan.describe().split())
    assert ("zero, fsdp, tp, dp_tp, fsdp_tp, ep: does not apply: needs logical axis names, "
            "and no input has any (e.g. w, shape (64, 64)), so it would be data parallelism; "
            "give them with nnx.with_partitioning or logical_axes=") in text
    assert text.count("does not apply") == 1
    from spmd.search.predict import Prediction

    assert isinstance(plan.alternatives["dp"], Prediction)
