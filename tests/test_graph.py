"""jaxpr -> op graph: inlining of nested jaxprs, node counts, the apply interpreter's walk."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from spmd.graph import build_graph, eval_jaxpr_with, walk


def _prims(graph):
    return [n.op.primitive for n in graph.nodes if n.kind == "op"]


def test_plain_function_counts():
    cj = jax.make_jaxpr(lambda w, x: jnp.tanh(x @ w))(jnp.ones((4, 2)), jnp.ones((3, 4)))
    g = build_graph(cj)
    assert [n.kind for n in g.nodes] == ["input", "input", "op", "op"]
    assert _prims(g) == ["dot_general", "tanh"]
    assert g.size() == {"nodes": 4, "ops": 2, "edges": 3}
    assert g.nodes[0].consumers == [2] and g.nodes[2].consumers == [3]
    assert g.outputs == [g.outputs[0]] and g.outputs[0].node == 3
    assert g.nodes[2].key == "eqn 0"


def test_inlines_jit_custom_jvp_custom_vjp_and_checkpoint():
    @jax.custom_vjp
    def double(x):
        return 2 * x

    double.defvjp(lambda x: (2 * x, None), lambda _, g: (2 * g,))

    @jax.jit
    def inner(x):
        return jnp.sin(x)

    def loss(w, x):
        h = jax.nn.relu(double(x) @ w)            # custom_vjp, custom_jvp (relu)
        h = jax.checkpoint(lambda h: jnp.tanh(h) * 2)(h)  # remat
        return jnp.sum(inner(jax.nn.gelu(h)))     # jit

    cj = jax.make_jaxpr(jax.grad(loss))(jnp.ones((4, 4)), jnp.ones((2, 4)))
    top = {e.primitive.name for e in cj.jaxpr.eqns}
    assert {"custom_vjp_call", "custom_jvp_call", "jit"} & top  # the test covers nesting
    g = build_graph(cj)
    prims = set(_prims(g))
    for nested in ("jit", "pjit", "custom_jvp_call", "custom_vjp_call", "remat2", "checkpoint"):
        assert nested not in prims
    assert {"dot_general", "tanh", "sin", "max"} <= prims
    # Nested equations get nested paths; the walk and the graph agree on them.
    paths = [n.path for n in g.nodes if n.kind == "op"]
    assert any(len(p) > 1 for p in paths)
    assert paths == [p for p, _ in walk(cj.jaxpr)]


def test_interpreter_matches_jaxpr_and_keeps_remat():
    def loss(w, x):
        h = jax.checkpoint(lambda h: jnp.tanh(h @ w))(x)
        return jnp.sum(jax.nn.gelu(h) ** 2)

    w, x = jnp.ones((4, 4)) * 0.1, jnp.arange(8.0).reshape(2, 4)
    cj = jax.make_jaxpr(jax.value_and_grad(loss))(w, x)
    seen = []

    def hook(path, eqn, outs):
        seen.append(path)
        return outs

    got = eval_jaxpr_with(cj.jaxpr, cj.consts, [w, x], hook)
    want = jax.value_and_grad(loss)(w, x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    assert seen == [p for p, _ in walk(cj.jaxpr)]
    # The differentiated checkpoint keeps its optimization barrier.
    text = jax.jit(lambda w, x: eval_jaxpr_with(cj.jaxpr, cj.consts, [w, x],
                                                lambda p, e, o: o)).lower(w, x).as_text()
    assert "optimization_barrier" in text


def test_adamw_step_and_scan():
    def loss(p, x):
        def body(c, _):
            return jnp.tanh(c @ p["w"]), None
        h, _ = jax.lax.scan(body, x, None, length=3)
        return jnp.mean(h ** 2)

    tx = optax.adamw(1e-3)
    p = {"w": jnp.ones((4, 4))}
    st = tx.init(p)

    def step(p, st, x):
        l, g = jax.value_and_grad(loss)(p, x)
        u, st = tx.update(g, st, p)
        return optax.apply_updates(p, u), st, l

    cj = jax.make_jaxpr(step)(p, st, jnp.ones((2, 4)))
    g = build_graph(cj)
    assert "scan" in _prims(g)  # kept as one node
    assert len(g.inputs) == len(jax.tree.leaves((p, st))) + 1
    assert all(v is not None for v in g.outputs)
    sizes = g.size()
    assert sizes["nodes"] == len(g.nodes) and sizes["edges"] > sizes["ops"]


def test_literal_output_and_constants():
    cj = jax.make_jaxpr(lambda x: (x + jnp.arange(3.0), 1.0))(jnp.ones(3))
    g = build_graph(cj)
    assert g.outputs[1] is None and g.output_literals[1] == pytest.approx(1.0)
