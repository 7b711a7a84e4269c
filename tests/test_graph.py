"""jaxpr -> op graph: inlining of nested jaxprs, scans planned once, node counts, and the
apply interpreter visiting the same equations under the same paths."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from spmd.trace.graph import build_graph
from spmd.trace.interpret import eval_jaxpr_with


def _prims(graph):
    return [n.op.primitive for n in graph.nodes if n.kind == "op"]


def _interpreted_paths(cj, *args):
    """Paths the interpreter's output hook sees, each once, in first-seen order."""
    seen = []

    def hook(path, eqn, outs):
        seen.append(path)
        return outs

    jax.make_jaxpr(lambda *a: eval_jaxpr_with(cj.jaxpr, cj.consts, a, hook))(*jax.tree.leaves(args))
    return list(dict.fromkeys(seen))


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

    args = jnp.ones((4, 4)), jnp.ones((2, 4))
    cj = jax.make_jaxpr(jax.grad(loss))(*args)
    top = {e.primitive.name for e in cj.jaxpr.eqns}
    assert {"custom_vjp_call", "custom_jvp_call", "jit"} & top  # the test covers nesting
    g = build_graph(cj)
    prims = set(_prims(g))
    for nested in ("jit", "pjit", "custom_jvp_call", "custom_vjp_call", "remat2", "checkpoint"):
        assert nested not in prims
    assert {"dot_general", "tanh", "sin", "max"} <= prims
    # Nested equations get nested paths; the interpreter and the graph agree on them.
    paths = [n.path for n in g.nodes if n.kind == "op"]
    assert any(len(p) > 1 for p in paths)
    assert paths == _interpreted_paths(cj, *args)


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
    assert seen == [n.path for n in build_graph(cj).nodes if n.kind == "op"]
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

    args = p, st, jnp.ones((2, 4))
    cj = jax.make_jaxpr(step)(*args)
    g = build_graph(cj)
    # The forward and the backward scan are planned once for their bodies: no loop node,
    # body ops repeated 3 times, one carry pair per loop-carried value.
    prims = _prims(g)
    assert "scan" not in prims and prims.count("scan_carry") == len(g.loops) >= 2
    body = [n for n in g.nodes if n.kind == "op" and n.op.primitive == "dot_general"]
    assert body and all(n.repeat == 3 and len(n.path) == 2 for n in body)
    for a, b in g.loops:
        assert g.nodes[a].op.out_shapes == g.nodes[b].op.out_shapes
        assert (g.nodes[a].path[-2], g.nodes[b].path[-2]) == ("carry", "carry_out")
    stacked = [n for n in g.nodes if n.op.primitive == "scan_stack"]
    assert stacked and all(n.op.out_shapes[0][0] == 3 for n in stacked)
    op_paths = [n.path for n in g.nodes if n.kind == "op"]
    assert sorted(map(str, op_paths)) == sorted(map(str, _interpreted_paths(cj, *args)))
    assert len(g.inputs) == len(jax.tree.leaves((p, st))) + 1
    assert all(v is not None for v in g.outputs)
    sizes = g.size()
    assert sizes["nodes"] == len(g.nodes) and sizes["edges"] > sizes["ops"]


def test_literal_output_and_constants():
    cj = jax.make_jaxpr(lambda x: (x + jnp.arange(3.0), 1.0))(jnp.ones(3))
    g = build_graph(cj)
    assert g.outputs[1] is None and g.output_literals[1] == pytest.approx(1.0)


def test_nested_scans_multiply_repeats_and_interpret_exactly():
    def f(w, x):
        def outer(c, _):
            def inner(d, wi):
                return jnp.tanh(d @ wi), d.sum()
            d, sums = jax.lax.scan(inner, c, w)  # 3 iterations, stacked weights as xs
            return d * 0.5, sums
        y, sums = jax.lax.scan(outer, x, None, length=2)
        return y, sums

    w, x = jnp.ones((3, 4, 4)) * 0.1, jnp.arange(8.0).reshape(2, 4)
    cj = jax.make_jaxpr(f)(w, x)
    g = build_graph(cj)
    dots = [n for n in g.nodes if n.kind == "op" and n.op.primitive == "dot_general"]
    assert [n.repeat for n in dots] == [6] and len(dots[0].path) == 3
    stacks = {n.op.out_shapes[0]: n.repeat for n in g.nodes if n.op.primitive == "scan_stack"}
    assert stacks == {(3,): 6, (2, 3): 2}  # inner ys stacked per outer iteration, then outer
    got = eval_jaxpr_with(cj.jaxpr, cj.consts, [w, x], lambda p, e, o: o)
    for a, b in zip(got, f(w, x)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_ops_inlined_from_a_call_are_named_within_the_step():
    """jnp.where and jnp.tril are jitted functions: their equations record names relative
    to the call, so the graph prefixes the call's own (under jax.grad: ``jvp()``), and the
    interpreter binds them under the same names."""
    def loss(x):
        mask = jnp.tril(jnp.ones((4, 4), bool))
        return jnp.sum(jnp.where(mask, x @ x, -1e9))

    cj = jax.make_jaxpr(jax.grad(loss))(jnp.ones((4, 4)))
    g = build_graph(cj)
    selects = [n for n in g.nodes if n.kind == "op" and n.op.primitive == "select_n"]
    assert selects and all(n.name.startswith("jvp(") or "transpose(" in n.name
                           for n in selects), [n.name for n in selects]
    again = jax.make_jaxpr(lambda x: eval_jaxpr_with(cj.jaxpr, cj.consts, [x],
                                                     lambda p, e, o: o))(jnp.ones((4, 4)))
    retraced = [n.name for n in build_graph(again).nodes
                if n.kind == "op" and n.op.primitive == "select_n"]
    assert retraced == [n.name for n in selects]
