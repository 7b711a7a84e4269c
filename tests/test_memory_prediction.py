"""The predicted peak memory against XLA's (``memory_analysis()``: arguments + temporaries),
and the buffers a plan adds beside the graph's values (``spmd.memory.liveness.Buffer``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import spmd
from spmd import zoo
from spmd.memory.liveness import Buffer, Liveness
from spmd.trace.graph import build_graph


def test_a_buffer_beside_the_values_adds_its_bytes_only_while_it_lives():
    g = build_graph(jax.make_jaxpr(lambda w, x: jnp.tanh(x @ w).sum())(jnp.ones((4, 4)),
                                                                        jnp.ones((8, 4))))
    live = Liveness(g, donated=set())
    base = live.totals(live.full_bytes)
    with_copy = live.totals(live.full_bytes, [Buffer(2, 3, 1000.0)])
    assert list(with_copy - base) == [0, 0, 1000, 1000, 0, 0]
    assert live.peak(live.full_bytes, [Buffer(2, 3, 1000.0)]) == base.max() + 1000


@pytest.mark.parametrize("model", [
    "gpt-tiny",
    pytest.param("mlp-small", marks=pytest.mark.xfail(
        strict=True, reason="over-predicted by 15.2% (12.15 MB against XLA's 10.55 MB; issue "
                            "14 item 4 is open): XLA's temporaries are below the liveness")),
])
def test_auto_plans_predicted_memory_is_xlas_within_15_percent(model):
    """On cpu-8, the auto plan compiled as planned: the peak the cost model predicts
    (liveness of the values, with resharded copies and partial sums) against XLA's
    arguments + temporaries per device. (Measured: gpt-tiny 0.97; without the resharded
    copies it was 0.91.)"""
    spec = zoo.get(model)
    mesh = spmd.load_mesh("cpu-8")
    args = (*nnx.eval_shape(spec.training_state), spec.batch(spec.default_batch_size))
    step = spmd.parallelize(spec.train_step, mesh=mesh, method="auto",
                            options=spmd.SearchOptions(cache=False, compare=False))
    memory = spmd.analyze(step.lower(*args).compile()).memory
    xla = memory.argument_bytes + memory.temp_bytes
    assert 0.85 <= step.plan.prediction.memory_bytes / xla <= 1.15
