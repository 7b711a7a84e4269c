"""The cost graph, its encodings and the prediction, on small steps where every number can
be worked out: followers, ties, pins, reshards paid once per target, one pricing path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spmd.cluster.mesh import make_mesh
from spmd.search.costgraph import CostGraph, InputInfo
from spmd.search.encode import Encoder
from spmd.search.predict import predict
from spmd.solver import evaluate, reduce, solve
from spmd.trace.graph import Value, build_graph

MESH = make_mesh({"data": 2, "model": 4}, bandwidth=10e9, latency=1e-5, virtual=True)


def _mlp_step(p, x):
    def loss(p):
        h = jax.nn.gelu(x @ p["w1"])
        return jnp.mean((h @ p["w2"]) ** 2)

    g = jax.grad(loss)(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


def _mlp(d=64, h=256, b=32):
    args = ({"w1": jnp.ones((d, h)), "w2": jnp.ones((h, d))}, jnp.ones((b, d)))
    cj = jax.make_jaxpr(_mlp_step)(*args)
    infos = [InputInfo("w1", (d, h), jnp.float32, "param"), InputInfo("w2", (h, d), jnp.float32, "param"),
             InputInfo("x", (b, d), jnp.float32, "batch")]
    return build_graph(cj), infos


def test_followers_share_their_producers_choice_and_inputs_never_absorb_them():
    graph, infos = _mlp()
    cg = CostGraph(graph, infos, MESH, output_aliases={0: 0, 1: 1})
    merged = [n.id for n in graph.nodes if cg.root[n.id] != n.id]
    assert cg.stats["followers_merged"] == len(merged) > 0
    for n in merged:
        root = graph.nodes[cg.root[n]]
        assert root.kind == "op"  # never an input or a constant
        assert len(cg.fmap[n]) == len(cg.strats[root.id])
    # aliased outputs (the new parameters) keep their own choice
    for v in graph.outputs:
        assert cg.root[v.node] == v.node


def test_pins_only_change_the_inputs_part_of_a_request():
    graph, infos = _mlp()
    cg = CostGraph(graph, infos, MESH, output_aliases={0: 0, 1: 1},
                   required={(64, 256): [((), ("model",))]})
    encoder = Encoder(cg)
    free = encoder.encode([None, None, None])
    pinned = encoder.encode([((), ("model",)), (("model",), ()), (("data",), ())])
    a, b = free.request(None, 5.0), pinned.request(None, 5.0)
    assert encoder.shared is not None  # built once, by the first request
    assert a.node_names == b.node_names
    inputs = {free.index[i] for i in graph.inputs}
    for i in range(len(a.node_names)):
        if i in inputs:
            assert len(b.strategy_names[i]) == 1 < len(a.strategy_names[i])
        else:
            assert a.strategy_names[i] == b.strategy_names[i]
            assert a.node_costs[i] == b.node_costs[i]
    with pytest.raises(Exception, match="does not fit mesh"):
        encoder.encode([((("model",),) * 2), None, None])


def test_a_value_read_twice_in_one_new_spec_is_resharded_once():
    """x (batch, 64) split over data is read by two matmuls that both want it replicated:
    XLA gathers it once. The request holds it as one fan-out, paid once, and the prediction
    counts one all-gather."""
    def step(w1, w2, x):
        return jnp.sum(x @ w1) + jnp.sum(x @ w2)

    args = jnp.ones((64, 64)), jnp.ones((64, 64)), jnp.ones((32, 64))
    graph = build_graph(jax.make_jaxpr(step)(*args))
    infos = [InputInfo(f"in{i}", a.shape, a.dtype, "param") for i, a in enumerate(args)]
    cg = CostGraph(graph, infos, MESH)
    x = Value(graph.inputs[2], 0)
    assert len({cg.root[r.node] for r in cg.reads[x]}) == 2
    enc = Encoder(cg).encode([((), ()), ((), ()), (("data",), ())])
    req = enc.request(None, 5.0)
    assert len(req.fanouts) == 1
    # every node at its replicated strategy (the dots' first, replicated, candidate)
    choice = [next(k for k, s in enumerate(enc.strats[r])
                   if all(not any(spec) for spec in s.in_specs + s.out_specs)) if
              graph.nodes[r].kind == "op" else 0 for r in enc.roots]
    node_choice = enc.node_choice(choice)
    pred = predict(enc, node_choice)
    assert pred.collectives["all-gather"] == (1, 32 * 64 * 4)
    once = cg.reshard_time(x, (("data",), ()), ((), ()))
    assert pred.comm_time == pytest.approx(once)
    assert evaluate(req, choice) == pytest.approx(pred.objective)


def test_a_value_gathered_whole_for_two_readers_is_gathered_once():
    """w (64, 64), its columns split over both axes, is read by a matmul that wants it
    replicated and by one that wants its rows split over model. XLA gathers it whole for
    the first and rematerializes it for the second (gathers it whole and slices): the same
    all-gather of the same operand, which its CSE merges, so the compiled step gathers w
    once. The prediction counts it once (the fan-out targets' paths share that step)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from spmd.analysis.hlo import collective_ops

    def step(w, x):
        return jnp.sum(x @ w) + jnp.sum(jnp.tanh(x) @ w)

    args = jnp.ones((64, 64)), jnp.ones((32, 64))
    graph = build_graph(jax.make_jaxpr(step)(*args))
    infos = [InputInfo(f"in{i}", a.shape, a.dtype, "param") for i, a in enumerate(args)]
    enc = Encoder(CostGraph(graph, infos, MESH)).encode([((), ("data", "model")), ((), ())])
    dots = [n.id for n in graph.nodes if n.kind == "op" and n.op.primitive == "dot_general"]
    wants = {dots[0]: (((), ()), ((), ())), dots[1]: (((), ("model",)), (("model",), ()))}

    def pick(r: int) -> int:
        for k, s in enumerate(enc.strats[r]):
            if r in wants and tuple(s.in_specs) == wants[r]:
                return k
            if r not in wants and all(not any(spec) for spec in s.in_specs + s.out_specs):
                return k
        return 0  # an input: its pinned spec, the only one

    pred = predict(enc, enc.node_choice([pick(r) for r in enc.roots]))
    assert pred.collectives["all-gather"] == (1, 64 * 64 * 4)

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    spec = lambda *dims: NamedSharding(mesh, P(*dims))  # noqa: E731

    def constrained(w, x):
        whole = jax.lax.with_sharding_constraint(w, spec())
        rows = jax.lax.with_sharding_constraint(w, spec("model", None))
        t = jax.lax.with_sharding_constraint(jnp.tanh(x), spec(None, "model"))
        return jnp.sum(x @ whole) + jnp.sum(t @ rows)

    text = jax.jit(constrained, in_shardings=(spec(None, ("data", "model")), spec())
                   ).lower(*args).compile().as_text()
    gathers = [op.bytes for op in collective_ops(text) if op.kind == "all-gather"]
    assert gathers == [64 * 64 * 4]


def test_the_prediction_is_the_objective_the_solver_minimized():
    graph, infos = _mlp()
    cg = CostGraph(graph, infos, MESH, output_aliases={0: 0, 1: 1})
    enc = Encoder(cg).encode([None] * 3)
    req = enc.request(None, 5.0)
    res = solve(req)
    pred = predict(enc, enc.node_choice(res.choice))
    assert res.objective == pytest.approx(pred.objective, rel=1e-12)
    assert pred.objective >= pred.total_time  # plus the tie-break on inputs' bytes
    assert pred.objective - pred.total_time < 1e-3 * pred.total_time


def test_repeated_layers_share_a_choice_and_their_inputs_only_under_equal_pins():
    """gpt-tiny's four blocks tie; a block's parameters tie to the next block's only when
    both are pinned alike (here the blocks' parameters alternate between replicated and
    split, so no two differently pinned ones share a choice)."""
    from conftest import traced_zoo_step

    from spmd.options import SearchOptions
    from spmd.planner import step_inputs

    sig, graph = traced_zoo_step("gpt-tiny", num_layers=4)
    infos = step_inputs(sig, MESH, SearchOptions())
    cg = CostGraph(graph, infos, MESH, output_aliases=sig.output_aliases)
    assert cg.stats["tied"] > 0 and cg.input_ties
    encoder = Encoder(cg)
    assert encoder.encode([None] * len(infos)).input_ties > 0

    def pin(leaf):
        block = next((int(p) for p in leaf.path.split("/") if p.isdigit()), None)
        if block is None or leaf.kind == "batch":
            return None
        return tuple(("model",) if d == len(leaf.shape) - 1 and block % 2 and
                     leaf.shape[d] % 4 == 0 else () for d in range(len(leaf.shape)))

    pins = [pin(leaf) for leaf in sig.leaves]
    mixed = encoder.encode(pins)
    rep = lambda i: mixed.same_as[i] if mixed.same_as[i] >= 0 else i  # noqa: E731
    compared = 0
    for a, b in cg.input_ties:
        pa, pb = pins[graph.nodes[a].input_index], pins[graph.nodes[b].input_index]
        if pa != pb:
            compared += 1
            assert rep(mixed.index[a]) != rep(mixed.index[b])
    assert compared > 0


def test_reduce_folds_a_fanout_into_an_edge_when_one_group_reads_it():
    graph, infos = _mlp()
    cg = CostGraph(graph, infos, MESH, output_aliases={0: 0, 1: 1})
    req = Encoder(cg).encode([None] * 3).request(None, 5.0)
    prob = reduce(req)
    for gp, costs, consumers in prob.fanouts:
        assert len({g for g, _ in consumers if g != gp}) >= 2
        assert np.isfinite(costs).all() and (costs >= 0).all()


def test_values_made_from_constants_alone_are_never_in_memory():
    """A causal mask broadcast to the scores' shape and the select of zeros its gradient
    reads depend on no input: XLA makes them inside each reader's kernel, in its sharding,
    so they are in no liveness the search or the prediction counts."""
    from spmd.search.fusion import constant_made

    b = 64

    def step(w, x):
        def loss(w):
            scores = (x @ w) @ x.T  # (b, b)
            mask = jnp.tril(jnp.ones((b, b), bool))
            return jnp.sum(jax.nn.softmax(jnp.where(mask, scores, -1e9)))
        return w - 0.1 * jax.grad(loss)(w)

    g = build_graph(jax.make_jaxpr(step)(jnp.ones((32, 32)), jnp.ones((b, 32))))
    made = constant_made(g)
    masks = [n.id for n in g.nodes if n.kind == "op" and n.op.out_shapes == ((b, b),)
             and n.op.primitive in ("broadcast_in_dim", "select_n") and n.id in made]
    assert masks  # the mask itself, at least
    assert not any(g.nodes[n].op.primitive == "dot_general" for n in made)
    cg = CostGraph(g, [InputInfo("w", (32, 32), jnp.float32, "param"),
                       InputInfo("x", (b, 32), jnp.float32, "batch")], MESH)
    fused = {v.node for (v, _, _), f in zip(cg.liveness.intervals, cg.liveness.fused) if f}
    assert set(masks) <= fused and cg.constant_made == made
