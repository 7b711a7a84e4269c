"""Rematerialization chosen by the search (issue 14, items 1-2): the jaxpr rewrite
(``spmd.memory.remat``) keeps the step's numbers and XLA's memory drops; under a budget no
sharding meets, auto recomputes the fewest layers that fit (``spmd.search.memory_fit``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
from spmd.memory.remat import (RECOMPUTE_ALL, REMAT_SCOPE, SAVE_DOTS, RematPlan, block_count,
                               rematerialize)
from spmd.runtime.compile import prepare
from spmd.trace.graph import build_graph

# Activations (B x D per layer) dwarf the weights (D x D), so every good sharding splits the
# activations 8 ways and none is much leaner than another: under a budget, remat decides.
# (At D 256, B 2048 the shardings' peaks spread over 5.2-7.3 MiB, and which layers fitted
# moved with the search's clock.)
D, B, LAYERS = 128, 8192, 8


def _loss(params, x, checkpoint=False):
    block = lambda w, x: jnp.tanh(jnp.sin(x @ w) * 2.0)  # noqa: E731
    if checkpoint:
        block = jax.checkpoint(block)
    for w in params:
        x = block(w, x)
    return jnp.mean(x ** 2)


def _step(params, batch):
    """A plain-JAX step with no jax.checkpoint in it."""
    loss, grads = jax.value_and_grad(_loss)(params, batch["x"])
    return [w - 0.1 * g for w, g in zip(params, grads)], loss


def _args(concrete: bool):
    if not concrete:
        return ([jax.ShapeDtypeStruct((D, D), jnp.float32)] * LAYERS,
                {"x": jax.ShapeDtypeStruct((B, D), jnp.float32)})
    keys = jax.random.split(jax.random.key(0), LAYERS + 1)
    params = [jax.random.normal(k, (D, D)) / np.sqrt(D) for k in keys[:-1]]
    return params, {"x": jax.random.normal(keys[-1], (B, D))}


def _compiled_bytes(fn, *args) -> int:
    memory = jax.jit(fn).lower(*args).compile().memory_analysis()
    return memory.argument_size_in_bytes + memory.temp_size_in_bytes


def _run(closed):
    return lambda *flat: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *flat)


def test_the_rewrite_keeps_the_numbers_and_xla_holds_less():
    params, batch = _args(concrete=True)
    flat = [*params, batch["x"]]
    closed = jax.make_jaxpr(lambda *f: _step(list(f[:-1]), {"x": f[-1]}))(*flat)
    graph = build_graph(closed)
    assert block_count(graph) == LAYERS
    want = jax.jit(_run(closed))(*flat)
    plain = _compiled_bytes(_run(closed), *flat)
    for policy in (SAVE_DOTS, RECOMPUTE_ALL):
        rewritten = rematerialize(closed, RematPlan.first(LAYERS, LAYERS - 1, policy), graph)
        assert any(REMAT_SCOPE in str(e.source_info.name_stack) for e in rewritten.jaxpr.eqns)
        got = jax.jit(_run(rewritten))(*flat)
        for a, b in zip(want, got):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
        # XLA (CPU too: the recomputation depends on a backward value, no barrier to undo)
        # keeps the recomputed layers' inputs only
        assert _compiled_bytes(_run(rewritten), *flat) < 0.85 * plain, policy


def test_a_users_own_checkpoint_is_kept():
    params, batch = _args(concrete=False)
    flat = [*params, batch["x"]]

    def step(*f):
        loss, grads = jax.value_and_grad(_loss)(list(f[:-1]), f[-1], checkpoint=True)
        return [w - 0.1 * g for w, g in zip(f[:-1], grads)], loss

    closed = jax.make_jaxpr(step)(*flat)
    graph = build_graph(closed)
    rewritten = rematerialize(closed, RematPlan.first(block_count(graph), block_count(graph),
                                                      RECOMPUTE_ALL), graph)
    assert not any(REMAT_SCOPE in str(e.source_info.name_stack) for e in rewritten.jaxpr.eqns)


def test_the_plan_round_trips_its_remat():
    remat = RematPlan.first(4, 2, SAVE_DOTS)
    assert RematPlan.from_dict(remat.to_dict()) == remat
    assert remat.summary() == "save_dots on 2 of 4 layers"
    with pytest.raises(ValueError, match="unknown policy 'everything'"):
        RematPlan(1, ("everything",))


def test_under_a_budget_no_sharding_meets_auto_recomputes_the_fewest_layers():
    """cpu-8: the plain step's best plan needs P bytes per device; under 0.9 P, planned
    under 0.81 P (less the memory headroom), no sharding fits and auto recomputes some
    layers, not all (4 of 8 when written: 3 fitted, slower by the sharding found); the
    compiled step fits the budget and its loss and new parameters are a single device's."""
    mesh = spmd.load_mesh("cpu-8")
    params, batch = _args(concrete=False)
    plain = spmd.plan(_step, params, batch, mesh=mesh, options=spmd.SearchOptions(cache=False))
    assert plain.remat is None
    budget = 0.9 * plain.prediction.memory_bytes
    options = spmd.SearchOptions(cache=False, memory_budget=budget)
    step = spmd.parallelize(_step, mesh=mesh, options=options)
    params, batch = _args(concrete=True)
    new_params, loss = step(params, batch)
    plan = step.plan
    assert plan.remat is not None
    chosen = [p for p in plan.remat.policies if p is not None]
    assert 0 < len(chosen) < LAYERS, plan.remat
    assert plan.prediction.memory_bytes <= budget and plan.prediction.recompute_time > 0
    # The fewest layers that fit, up to the search's own variance: some plan recomputing
    # fewer layers was searched and did not fit, and none that fitted is predicted faster
    # (CI once found 5 layers fitting but slower than 6, by the sharding the search found).
    fewer = [q for q in plan.search["remat_probes"] if q["recomputed"] < len(chosen)]
    assert len(chosen) == 1 or any(not q["fits"] for q in fewer), fewer
    assert all(q["step_seconds"] >= plan.prediction.total_time for q in fewer if q["fits"])
    memory = spmd.analyze(prepare(plan).compile()).memory
    assert memory.argument_bytes + memory.temp_bytes <= budget
    want_params, want_loss = jax.jit(_step)(params, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    for a, b in zip(new_params, want_params):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert "rematerialized: " in plan.describe()


def test_a_budget_not_even_full_remat_meets_names_the_least_memory():
    mesh = spmd.load_mesh("cpu-8")
    params, batch = _args(concrete=False)
    with pytest.raises(spmd.InfeasibleError, match="even with every layer's activations "
                       "recomputed.*recompute_all on 8 of 8 layers.*least peak memory"):
        spmd.plan(_step, params, batch, mesh=mesh,
                  options=spmd.SearchOptions(cache=False, memory_budget=100_000))


def test_an_nnx_model_under_a_budget_recomputes_some_of_its_blocks():
    """gpt-tiny grown to 4 blocks on cpu-8, under 0.9 x the plain plan's peak: some blocks
    are recomputed, not all; the compiled step fits and matches a single device. (Under
    0.8 x, since CPU all-reduces are priced a latency per operand, the cheapest fit saves
    only the matmul outputs of all four blocks. Before
    offload was known to save nothing on XLA:CPU, the search sometimes recomputed 2 blocks
    and offloaded the optimizer state, predicted 12% under what then compiled.)"""
    from flax import nnx

    from spmd import zoo

    spec = zoo.get("gpt-tiny").with_config(num_layers=4, d_model=128, head_dim=16, d_ff=512,
                                           vocab_size=1024, seq_len=64)
    mesh = spmd.load_mesh("cpu-8")
    abstract = (*nnx.eval_shape(spec.training_state), spec.batch(16))
    options = spmd.SearchOptions(cache=False, compare=False, time_limit=4.0)
    plain = spmd.plan(spec.train_step, *abstract, mesh=mesh, options=options)
    budget = 0.9 * plain.prediction.memory_bytes
    step = spmd.parallelize(spec.train_step, mesh=mesh,
                            options=dataclasses.replace(options, memory_budget=budget))
    model, opt = spec.training_state()
    want_model, want_opt = spec.training_state()
    batch = spec.batch(16)
    got = step(model, opt, batch)
    chosen = [p for p in step.plan.remat.policies if p is not None]
    assert 0 < len(chosen) < 4, step.plan.remat
    assert step.plan.offload is None  # on XLA:CPU host memory is the devices' own
    memory = spmd.analyze(step.lower(model, opt, batch).compile()).memory
    assert memory.argument_bytes + memory.temp_bytes <= budget
    want = nnx.jit(spec.train_step)(want_model, want_opt, batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # the gradients, as AdamW's first moments after one step (0.1 x the gradient; the new
    # parameters would amplify fp32 noise where a gradient is near Adam's eps)
    def moments(optimizer):
        return [x for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(optimizer))
                if "mu" in jax.tree_util.keystr(path)]

    assert len(moments(opt)) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    for a, b in zip(moments(opt), moments(want_opt)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)


def test_a_retry_lowers_the_rows_below_a_plan_they_did_not_bind():
    """``search_under``: a plan over the budget by what the prediction adds beside the
    program's memory rows first gets the set of its peak's point (here it comes again: what
    it adds there spans the point); then, its rows having sat well below the target, the
    target is lowered past those rows, not by the overshoot alone (which would find the same
    plan again and again)."""
    from types import SimpleNamespace

    from spmd.search.memory_fit import search_under

    gib = 2.0**30

    def plan(rows: float, peak: float, held: float = 0.0):
        return SimpleNamespace(prediction=SimpleNamespace(memory_bytes=peak * gib),
                               stats={"program_peak_bytes": rows * gib, "peak_point": 7,
                                      "peak_point_held": held * gib})

    class Job:  # rows 28 GiB + 6 beside them; a leaner plan exists only under 28. The set
        # of the peak's point holds 34 GiB of the first plan, 33 of the next (what spans it)
        def __init__(self):
            self.targets: list[float] = []
            self.points: list[list[int]] = []

        def search(self, *, memory_budget, points, **_):
            self.targets.append(memory_budget / gib)
            self.points.append(list(points))
            if memory_budget < 28 * gib:
                return plan(27, 31)
            return plan(28, 34, held=33 if points else 34)

    job = Job()
    result, why = search_under(job, 33.5 * gib, spmd.SearchOptions())
    assert why is None and result.prediction.memory_bytes == 31 * gib
    assert job.targets == [33.5, 33.5, pytest.approx(27.5)]
    assert job.points == [[], [7], [7]]
