"""A range of a step's layers, planned on a submesh: the region the pipeline's stage search
will ask for once per (layer range, submesh)."""

import jax
import pytest
from conftest import traced_zoo_step

import spmd
from spmd.analysis.report import analyze
from spmd.options import SearchOptions
from spmd.planner import step_inputs
from spmd.runtime.compile import jit_region
from spmd.search.regions import RegionCache, region_inputs, search_region
from spmd.trace.layers import forward_ops, layer_of
from spmd.trace.regions import Region, layer_region


@pytest.fixture(scope="module")
def gpt4():
    """gpt-tiny with four blocks, its traced step and op graph."""
    return traced_zoo_step("gpt-tiny", num_layers=4)


def test_layers_cut_the_forward_between_blocks_and_cover_every_op(gpt4):
    sig, graph = gpt4
    layers = layer_of(graph, 4)
    ops = [n.id for n in graph.nodes if n.kind == "op"]
    assert {layers[i] for i in ops} == {0, 1, 2, 3}
    assert all(layers[n.id] == -1 for n in graph.nodes if n.kind != "op")
    fwd = forward_ops(graph)
    assert [layers[i] for i in fwd] == sorted(layers[i] for i in fwd)  # contiguous
    # Blocks are alike: the two middle layers are the same program, the first and last
    # (the embedding, the logits and the loss) are not.
    keys = [layer_region(graph, layers, k, k + 1).key() for k in range(4)]
    assert keys[1] == keys[2] and len({keys[0], keys[1], keys[3]}) == 3
    # Together the regions are the step: every op in exactly one.
    regions = [layer_region(graph, layers, k, k + 1) for k in range(4)]
    units = sum(len(r.units) for r in regions)
    assert units == len(ops)


def test_more_layers_than_the_graph_has_quiet_gaps_still_cuts_every_layer():
    """Activations that only grow dip at few gaps (4 of 11 here); asked for one layer per
    op, the cut uses every gap, in order, rather than leaving layers empty."""
    import jax.numpy as jnp

    from spmd.trace.graph import build_graph

    def grow(x):
        for _ in range(6):
            x = jnp.concatenate([x, x * 2.0])
        return x

    graph = build_graph(jax.make_jaxpr(grow)(jnp.ones((4,))))
    fwd = forward_ops(graph)
    assert [layer_of(graph, len(fwd))[i] for i in fwd] == list(range(len(fwd)))
    with pytest.raises(ValueError, match="cannot cut"):
        layer_of(graph, len(fwd) + 1)


def test_a_layer_range_on_a_submesh_compiles_as_predicted_and_repeats_from_the_cache(gpt4):
    sig, graph = gpt4
    mesh = spmd.load_mesh("cpu-8")  # data=2 x model=4, 8 CPU devices
    sub = mesh.submesh({"data": 1})
    assert sub.shape == {"data": 1, "model": 4} and sub.device_ids == (0, 1, 2, 3)
    assert sub.links == mesh.links
    layers = layer_of(graph, 4)
    options = SearchOptions(time_limit=5.0)
    inputs = step_inputs(sig, mesh, options)
    cache = RegionCache()
    plan = search_region(layer_region(graph, layers, 1, 2), sub, step_inputs=inputs,
                         output_aliases=sig.output_aliases, options=options, cache=cache)
    again = search_region(layer_region(graph, layers, 2, 3), sub, step_inputs=inputs,
                          output_aliases=sig.output_aliases, options=options, cache=cache)
    assert not plan.cached and again.cached and again.key == plan.key
    assert (cache.hits, cache.misses) == (1, 1)
    # The plan from the cache names the second block's leaves, not the first's.
    paths = [i.path for i in region_inputs(layer_region(graph, layers, 2, 3), inputs)]
    assert [i.path for i in again.inputs] == paths != [i.path for i in plan.inputs]
    # The block's parameters and optimizer state come back in their own specs.
    assert plan.output_aliases and all(
        plan.result.output_specs[o] == plan.result.input_specs[i]
        for o, i in plan.output_aliases.items())
    kinds = {i.kind for i in plan.inputs}
    assert {"param", "optimizer", "activation"} <= kinds
    # Compiled on the submesh's 4 devices, it emits the collectives predicted for it.
    avals = [jax.ShapeDtypeStruct(i.shape, i.dtype) for i in plan.inputs]
    report = analyze(jit_region(plan, sub).lower(*avals).compile())
    predicted = plan.prediction.collectives
    assert plan.prediction.collective_bytes > 0
    for kind, (count, nbytes) in report.collectives.items():
        assert predicted.get(kind, (0, 0.0))[1] == pytest.approx(nbytes, rel=1e-6), kind
    for op in report.ops:  # on the submesh's devices only
        assert op.replica_groups is None or max(max(g) for g in op.replica_groups) < 4


def test_a_region_reading_a_typed_key_keeps_it_a_key():
    """A dropout key made in one layer and read in the next crosses the region's boundary
    as the key it is (the graph prices it as 8 bytes of key data)."""
    import jax.numpy as jnp

    from spmd.trace.graph import build_graph

    def step(x):
        key = jax.random.fold_in(jax.random.key(0), 1)
        return jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0.0).sum()

    graph = build_graph(jax.make_jaxpr(step)(jnp.ones((4, 8))))
    ops = [n.id for n in graph.nodes if n.kind == "op"]
    region = Region(graph, ops[2:])  # after the key is made
    keys = [v for v in region.inputs if graph.value_bytes(v) == 8 and not graph.value_shape(v)]
    assert keys, "the key crosses the boundary"
    program = region.program()
    assert any(jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended) for a in program.in_avals)


def test_a_region_cannot_cut_a_scan():
    _, graph = traced_zoo_step("gpt-tiny", scan_layers=True)
    scan = graph.scans[-1]
    with pytest.raises(spmd.PlanError, match="cannot cut a scan"):
        Region(graph, scan.nodes[:1])
    assert len(Region(graph, scan.nodes).units) == 1
