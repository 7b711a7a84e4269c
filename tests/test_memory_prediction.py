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


@pytest.mark.parametrize("model,method", [
    ("gpt-tiny", "auto"),
    ("gpt-tiny", "dp"),
    pytest.param("mlp-small", "auto", marks=pytest.mark.xfail(
        strict=True, reason="over-predicted by 15.2% (11.6 MiB against XLA's 10.1 MiB; "
                            "issue 14 item 4 is open): XLA's temporaries are below the "
                            "liveness")),
])
def test_predicted_memory_is_xlas_within_15_percent(model, method):
    """On cpu-8, a plan whose compiled program is the one predicted (auto, compiled with its
    constraints; dp, whose propagation XLA runs as scored): the peak the cost model predicts
    (liveness of the values, with resharded copies and partial sums) against XLA's
    arguments + temporaries per device. Measured (bench/memory.py): gpt-tiny auto 1.06, dp
    1.07; without the resharded copies and partial sums, 0.91 and 0.96. The dp gradients'
    combined all-reduce holds its inputs beside its results (XLA:CPU's temporaries: twice
    the gradients)."""
    spec = zoo.get(model)
    mesh = spmd.load_mesh("cpu-8")
    args = (*nnx.eval_shape(spec.training_state), spec.batch(spec.default_batch_size))
    step = spmd.parallelize(spec.train_step, mesh=mesh, method=method,
                            options=spmd.SearchOptions(cache=False, compare=method != "auto"))
    memory = spmd.analyze(step.lower(*args).compile()).memory
    xla = memory.argument_bytes + memory.temp_bytes
    assert 0.85 <= step.plan.prediction.memory_bytes / xla <= 1.15
