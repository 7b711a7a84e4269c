"""Cost model: collective formulas by hand, and resharding predictions against compiled HLO."""

import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.cost.partitioner import Collective
from spmd.cost.time import CostModel
from spmd.cluster.mesh import make_mesh
from spmd.sharding import from_partition_spec

GB = 1e9


@pytest.fixture
def cm():
    mesh = make_mesh({"data": 2, "model": 4}, bandwidth={"data": 25 * GB, "model": 100 * GB},
                     latency={"data": 10e-6, "model": 2e-6}, device="a100-40gb", virtual=True)
    return CostModel(mesh)


# -- formulas by hand -------------------------------------------------------------------


def test_collective_formulas(cm):
    B = 1e9
    assert cm.all_reduce(B, ("model",)) == pytest.approx(2 * 3 / 4 * B / (100 * GB) + 2e-6)
    assert cm.all_gather(B, ("model",)) == pytest.approx(3 / 4 * B / (100 * GB) + 2e-6)
    assert cm.reduce_scatter(B, "data") == pytest.approx(1 / 2 * B / (25 * GB) + 10e-6)
    assert cm.all_to_all(B, ("data",)) == pytest.approx(1 / 2 * B / (25 * GB) + 10e-6)
    # Two axes: n = 8, slowest link (data), largest latency.
    assert cm.all_reduce(B, ("data", "model")) == pytest.approx(2 * 7 / 8 * B / (25 * GB) + 10e-6)
    assert cm.time(Collective("all-gather", ("model",), B)) == cm.all_gather(B, ("model",))
    with pytest.raises(ValueError, match="unknown collective"):
        cm.time(Collective("broadcast", ("model",), B))


def test_xla_cpu_collectives_pay_each_axis_latency():
    """On XLA:CPU a collective over two axes pays both latencies (a rendezvous of more
    threads); a collective-permute one hop; a GPU mesh the slowest link's (above)."""
    mesh = make_mesh({"data": 2, "model": 4, "pipe": 1}, bandwidth=1e12,
                     latency={"data": 10e-6, "model": 2e-6, "pipe": 50e-6})
    cm = CostModel(mesh)
    assert mesh.platform == "cpu"
    both = ("data", "model", "pipe")  # pipe has one device: no latency of its own
    assert cm.split(Collective("all-gather", both, 1e6))[1] == pytest.approx(12e-6)
    assert cm.split(Collective("all-reduce", ("model",), 1e6))[1] == pytest.approx(2e-6)
    assert cm.all_reduce(1e6, both) == pytest.approx(2 * 7 / 8 * 1e6 / 1e12 + 12e-6)
    assert cm.collective_permute(1e6, both) == pytest.approx(1e6 / 1e12 + 10e-6)


def test_size_one_axes_cost_nothing():
    cm = CostModel(make_mesh({"pipe": 1, "data": 8}))
    assert cm.all_reduce(1e9, ("pipe",)) == 0.0
    assert cm.all_gather(1e9, ()) == 0.0
    assert cm.all_reduce(1e9, ("pipe", "data")) == cm.all_reduce(1e9, ("data",))
    t, colls = cm.reshard((16, 16), "float32", (("pipe",), ()), ((), ()))
    assert (t, colls) == (0.0, ())
    assert cm.partitioner.partial_sum((16, 16), "float32", ((), ()), ("pipe",)) == ()


def test_compute_and_memory_time_at_the_achievable_fraction_of_the_datasheet(cm):
    # a100-40gb: 312 TFLOP/s bf16, 156 TF32, 1555 GB/s; 65% and 71% achievable (H200-measured)
    assert cm.compute(312e12 * 0.65, jnp.bfloat16) == pytest.approx(1.0)
    assert cm.compute(156e12 * 0.65, "float32") == pytest.approx(1.0)  # TF32 tensor cores
    assert cm.memory_time(1555e9 * 0.71) == pytest.approx(1.0)
    assert "datasheet" in cm.mesh.device.source and cm.mesh.device.kernel_overhead > 0


def test_reshard_by_hand(cm):
    R = ((), ())
    # gather over data: B = bytes after = the full 16x32 f32 array
    t, cs = cm.reshard((16, 32), "float32", (("data",), ()), R)
    assert cs == (Collective("all-gather", ("data",), 2048.0),)
    assert t == pytest.approx(0.5 * 2048 / (25 * GB) + 10e-6)
    # slicing is free
    assert cm.reshard((16, 32), "float32", R, (("data",), ("model",))) == (0.0, ())
    # a dim split over two axes gathers in one collective over both
    _, cs = cm.reshard((16, 32), jnp.bfloat16, (("data", "model"), ()), R)
    assert cs == (Collective("all-gather", ("data", "model"), 1024.0),)
    # moving a split between dims: one all-to-all of the per-device piece
    t, cs = cm.reshard((16, 32), "float32", (("model",), ()), ((), ("model",)))
    assert cs == (Collective("all-to-all", ("model",), 512.0),)
    assert t == pytest.approx(0.75 * 512 / (100 * GB) + 2e-6)
    # two dims gather separately, last dim first
    _, cs = cm.reshard((16, 32), "float32", (("data",), ("model",)), R)
    assert [c.axes for c in cs] == [("model",), ("data",)]
    assert [c.bytes for c in cs] == [1024.0, 2048.0]
    # axis order within a dim matters: a reorder is a collective-permute of the piece
    _, cs = cm.reshard((16, 32), "float32", (("data", "model"), ()), (("model", "data"), ()))
    assert [(c.kind, c.bytes) for c in cs] == [("collective-permute", 256.0)]
    with pytest.raises(ValueError, match="rank"):
        cm.reshard((16, 32), "float32", (("data",),), R)


def test_partial_sum_by_hand(cm):
    cs = cm.partitioner.partial_sum((64, 32), "float32", (("data",), ()), ("model",))
    assert cs == (Collective("all-reduce", ("model",), 32 * 32 * 4.0),)
    assert cm.time(cs[0]) == pytest.approx(2 * 0.75 * 4096 / (100 * GB) + 2e-6)
    # summed axis that also splits the output: reduce-scatter, B = bytes before scattering
    # on a GPU cluster, present or virtual (priced as XLA:GPU runs it, though a virtual one
    # is compile-checked on CPU: spmd.analysis.reconcile reads that back)
    gpu = CostModel(make_mesh({"data": 2, "model": 4}, device="a100-40gb", platform="gpu"))
    for mesh in (gpu, cm):
        assert mesh.partitioner.platform == "gpu"
        cs = mesh.partitioner.partial_sum((64, 32), "float32", ((), ("model",)), ("model",))
        assert cs == (Collective("reduce-scatter", ("model",), 64 * 32 * 4.0),)
    # ... except on XLA:CPU, which all-reduces the whole result and slices
    cpu = CostModel(make_mesh({"data": 2, "model": 4}))
    cs = cpu.partitioner.partial_sum((64, 32), "float32", ((), ("model",)), ("model",))
    assert cs == (Collective("all-reduce", ("model",), 64 * 32 * 4.0),)


# -- agreement with XLA's SPMD partitioner ------------------------------------------------

_OP = re.compile(r"=\s*(\(.*?\)|\w+\[[^\]]*\](?:\{[^}]*\})?)\s+"
                 r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_ITEM = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "f64": 8}


def _hlo_collectives(text):
    """(kind, result bytes) of each collective opcode in optimized HLO text."""
    out = []
    for line in text.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        nbytes = sum(_ITEM[t] * math.prod(int(d) for d in dims.split(",") if d)
                     for t, dims in _ARRAY.findall(m.group(1)))
        out.append((m.group(2), float(nbytes)))
    return sorted(out)


def _jax_mesh(axes):
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def _compiled_reshard(axes, shape, src, dst, dtype):
    mesh = _jax_mesh(axes)
    x = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, src))
    f = jax.jit(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, dst)),
                out_shardings=NamedSharding(mesh, dst))
    return f.lower(x).compile().as_text()


M2 = {"data": 2, "model": 4}
M3 = {"a": 2, "b": 2, "c": 2}
RESHARDS = [
    # plain gathers, slices, two-axis gather, gathers on two dims
    (M2, (16, 32), P("data"), P()),
    (M2, (16, 32), P(), P("data", "model")),
    (M2, (16, 32), P(("data", "model")), P()),
    (M2, (16, 32), P(("data", "model")), P("data")),
    (M2, (16, 32), P("data", "model"), P()),
    (M2, (16, 32), P("model", "data"), P()),
    (M2, (16, 32), P("data"), P(("data", "model"))),
    (M3, (16, 32, 8), P("a", "b", "c"), P()),
    # all-to-all: a split moving to another dim
    (M2, (16, 32), P("data"), P(None, "data")),
    (M2, (16, 32), P("model"), P(None, "model")),
    (M2, (16, 32), P("data", "model"), P(("data", "model"))),
    (M2, (16, 32), P(("data", "model")), P("data", "model")),
    (M2, (16, 32), P(("data", "model")), P(None, ("data", "model"))),
    (M2, (16, 32, 8), P("data", "model"), P(None, "model", "data")),
    (M2, (16, 32), P("data", "model"), P(None, ("model", "data"))),
    (M2, (16, 32), P("data", "model"), P("model", None)),  # all-gather + all-to-all
    # XLA differs from the textbook: permutes instead of gather + slice / all-to-all
    (M2, (16, 32), P(("data", "model")), P(("model", "data"))),  # reorder: one permute
    (M2, (16, 32), P(("data", "model")), P("model")),  # permute + all-gather
    (M2, (16, 32), P("data"), P("model")),  # slice + permute
    (M2, (16, 32), P("model"), P("data")),  # permute + all-gather
    (M2, (16, 32), P("model"), P(("data", "model"))),  # slice + permute
    (M2, (16, 32), P("data"), P("model", "data")),  # slice + permute, not all-to-all
    (M3, (16, 32), P("a"), P("b")),
    (M3, (16, 32), P("a", "b"), P("b", "a")),
    (M3, (16, 32), P(("a", "b")), P("c")),
    (M2, (16, 32), P("data", "model"), P("model", "data")),  # all-to-all + permute
    (M2, (16, 32), P("data"), P(None, ("data", "model"))),  # all-to-all + permute
    (M2, (16, 32), P("data", "model"), P(None, "data")),  # permute + 2 all-gathers
    # XLA's "involuntary full rematerialization": gather all, then slice
    (M2, (16, 32), P("data"), P(None, "model")),
    (M2, (16, 32), P(("data", "model")), P(None, "model")),
    (M3, (16, 32, 8), P("a", "b", "c"), P(None, None, ("a", "b", "c"))),
    # ... also when one dim would lose an axis and send another to a second dim
    (M2, (16, 32), P(None, ("model", "data")), P("model", None)),
    (M2, (16, 32), P(("model", "data"), None), P(None, "model")),
    (M3, (16, 32), P(None, ("a", "b", "c")), P(("a", "b"), None)),
]


@pytest.mark.parametrize("axes,shape,src,dst", RESHARDS,
                         ids=[f"{s}->{d}@{'x'.join(map(str, a.values()))}" for a, _, s, d in RESHARDS])
@pytest.mark.parametrize("dtype", [jnp.float32])
def test_reshard_matches_xla(axes, shape, src, dst, dtype):
    text = _compiled_reshard(axes, shape, src, dst, dtype)
    cm = CostModel(make_mesh(axes))
    _, cs = cm.reshard(shape, dtype, from_partition_spec(src, len(shape)),
                       from_partition_spec(dst, len(shape)))
    assert sorted((c.kind, c.bytes) for c in cs) == _hlo_collectives(text)


def test_reshard_bf16_on_cpu_runs_in_f32():
    """XLA:CPU upcasts bf16 collectives to f32 (convert, gather, convert back), so on a CPU
    mesh the HLO moves twice the bytes the model predicts for bf16 (a GPU moves bf16). Should
    a jaxlib stop upcasting, this test says so: the cost model's CPU bytes need updating."""
    text = _compiled_reshard(M2, (16, 32), P("data", "model"), P(), jnp.bfloat16)
    _, cs = CostModel(make_mesh(M2)).reshard((16, 32), jnp.bfloat16, (("data",), ("model",)), ((), ()))
    assert sorted((c.kind, c.bytes) for c in cs) == [("all-gather", 512.0), ("all-gather", 1024.0)]
    assert _hlo_collectives(text) == [("all-gather", 1024.0), ("all-gather", 2048.0)]


SPREADS = [  # mesh, the summed axes (splitting the contraction and the result's first
    # dim), whether XLA spreads the result over the free axes
    ({"data": 4, "model": 2}, "model", True),  # data's 4 devices hold model's 2
    ({"data": 2, "model": 4}, "data", True),  # model's 4 hold data's 2
    ({"data": 2, "model": 4}, "model", False),  # data's 2 cannot hold model's 4
    (M3, ("a", "b"), False),  # c's 2 cannot hold 4
    (M3, "a", True),  # b and c hold a's 2
]


@pytest.mark.parametrize("axes,summed,spreads", SPREADS, ids=[
    f"{s}@{'x'.join(map(str, a.values()))}" for a, s, _ in SPREADS])
def test_dot_spreads_a_scattered_partial_sum_over_free_axes(axes, summed, spreads):
    """A weight gradient (x^T y over a batch split on ``summed``) wanted split on ``summed``
    too: where the other axes hold a multiple of its devices, XLA's dot handler computes
    each device's piece on them, all-reduces it and permutes it into place; elsewhere it
    all-reduces the whole result and slices (XLA:GPU's reduce-scatter)."""
    mesh = _jax_mesh(axes)
    split = NamedSharding(mesh, P(summed, None))
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=split)
    y = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=split)
    text = jax.jit(lambda x, y: x.T @ y, out_shardings=split).lower(x, y).compile().as_text()
    partitioner = CostModel(make_mesh(axes)).partitioner
    out = from_partition_spec(P(summed, None), 2)
    sum_axes = out[0]
    cs = partitioner.partial_sum((32, 16), jnp.float32, out, sum_axes, spread=True)
    assert sorted((c.kind, c.bytes) for c in cs) == _hlo_collectives(text)
    assert bool(partitioner.spread_axes(out, sum_axes)) == spreads
    assert ("collective-permute" in {c.kind for c in cs}) == spreads


def test_partial_sum_matches_xla():
    """x (8, 64) split on its contracting dim over model, w (64, 16) likewise: a partial sum."""
    mesh = _jax_mesh(M2)
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
    w = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(mesh, P("model", None)))
    cm = CostModel(make_mesh(M2))
    out = NamedSharding(mesh, P("data", None))
    text = jax.jit(jnp.dot, out_shardings=out).lower(x, w).compile().as_text()
    cs = cm.partitioner.partial_sum((8, 16), jnp.float32, (("data",), ()), ("model",))
    assert sorted((c.kind, c.bytes) for c in cs) == _hlo_collectives(text) == [("all-reduce", 256.0)]
    # Consumer wants the result split on the summed axis: XLA:CPU all-reduces, then slices
    # (a GPU compiler's reduce-scatter creator turns that into a reduce-scatter).
    out = NamedSharding(mesh, P("data", "model"))
    text = jax.jit(jnp.dot, out_shardings=out).lower(x, w).compile().as_text()
    cs = cm.partitioner.partial_sum((8, 16), jnp.float32, (("data",), ("model",)), ("model",))
    assert sorted((c.kind, c.bytes) for c in cs) == _hlo_collectives(text) == [("all-reduce", 256.0)]
