"""Tests for spmd.analyze: HLO parsing on hand-written text and on real XLA CPU output.

Expectations for the compiled cases are derived by hand for 8 CPU devices on a
(data=2, model=4) mesh; every byte count is per device.

XLA CPU facts these tests pin down (jax 0.10.2):
* A GSPMD sum whose output is constrained to be sharded compiles to all-reduce + a
  dynamic-slice, not reduce-scatter; `jax.lax.psum_scatter` under shard_map does emit one.
* CPU emits synchronous collectives only (no `-start`/`-done`); those forms are covered by
  the hand-written HLO tests.
* Replica groups print in the mesh-axes form `mesh['axis_0'=2,...] {'axis_0'}`.
"""

import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.analysis.report import (
    COLLECTIVE_KINDS,
    MemoryReport,
    Report,
    analyze,
    analyze_hlo_text,
    groups_to_mesh_axes,
    parse_replica_groups,
    shape_bytes,
)

F32 = 4


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _put(mesh, array, *spec):
    return jax.device_put(array, NamedSharding(mesh, P(*spec)))


def _compile(fn, *args, **jit_kwargs):
    return jax.jit(fn, **jit_kwargs).lower(*args).compile()


def _axes(op, mesh):
    return groups_to_mesh_axes(op.replica_groups, dict(mesh.shape))


# ----------------------------------------------------------------- compiled, XLA CPU


def test_data_parallel_gradient_is_one_all_reduce_of_the_weight(mesh):
    w = _put(mesh, jnp.ones((16, 8)))  # replicated weight: 512 bytes
    x = _put(mesh, jnp.ones((32, 16)), "data")
    report = analyze(_compile(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w))), w, x))
    count, nbytes = report.collectives["all-reduce"]
    assert count >= 1 and nbytes == 16 * 8 * F32
    assert report.collectives["all-gather"] == (0, 0)
    assert all(_axes(op, mesh) == ("data",) for op in report.ops)
    assert report.total_collective_bytes == nbytes


def test_sharded_to_replicated_is_one_all_gather_of_the_full_array(mesh):
    a = _put(mesh, jnp.ones((16, 8)), "model")
    report = analyze(_compile(lambda a: a * 2, a, out_shardings=NamedSharding(mesh, P())))
    assert report.collectives["all-gather"] == (1, 16 * 8 * F32)
    assert _axes(report.ops[0], mesh) == ("model",)
    assert sum(count for count, _ in report.collectives.values()) == 1


def test_two_axis_gather_goes_one_axis_at_a_time(mesh):
    # XLA gathers over model (result 8x8) and then over data (the full 16x8).
    a = _put(mesh, jnp.ones((16, 8)), "data", "model")
    report = analyze(_compile(lambda a: a * 2, a, out_shardings=NamedSharding(mesh, P())))
    gathers = [op for op in report.ops if op.kind == "all-gather"]
    assert report.collectives["all-gather"][0] == 2
    assert {_axes(op, mesh) for op in gathers} == {("data",), ("model",)}
    assert max(op.bytes for op in gathers) == 16 * 8 * F32


def test_sharded_sum_to_sharded_output(mesh):
    # Each device holds b[:, 4 cols] and sums it to a partial f32[8] (32 bytes); the result is
    # sharded over model. XLA CPU emits all-reduce(f32[8]) + dynamic-slice, not
    # reduce-scatter; if a later XLA emits reduce-scatter, B is still the f32[8] operand.
    b = _put(mesh, jnp.ones((8, 16)), None, "model")
    out = NamedSharding(mesh, P("model"))
    report = analyze(_compile(lambda b: jnp.sum(b, axis=1), b, out_shardings=out))
    (op,) = report.ops
    assert op.kind in ("all-reduce", "reduce-scatter")
    assert op.bytes == 8 * F32
    assert _axes(op, mesh) == ("model",)


def test_psum_scatter_is_a_reduce_scatter_of_the_operand(mesh):
    x = _put(mesh, jnp.ones((8, 16)))
    fn = jax.shard_map(
        lambda x: jax.lax.psum_scatter(x, "model", scatter_dimension=0, tiled=True),
        mesh=mesh,
        in_specs=P(),
        out_specs=P("model"),
    )
    report = analyze(_compile(fn, x))
    assert report.collectives["reduce-scatter"] == (1, 8 * 16 * F32)  # operand, not result
    (op,) = [op for op in report.ops if op.kind == "reduce-scatter"]
    assert _axes(op, mesh) == ("model",)


def test_moving_a_split_between_dims_is_an_all_to_all(mesh):
    c = _put(mesh, jnp.ones((8, 16)), "model", None)  # each device holds f32[2,16]
    to_cols = NamedSharding(mesh, P(None, "model"))
    fn = lambda c: jax.lax.with_sharding_constraint(c * 2, to_cols) + 1  # noqa: E731
    report = analyze(_compile(fn, c, out_shardings=to_cols))
    assert report.collectives["all-to-all"] == (1, 2 * 16 * F32)
    assert _axes(report.ops[0], mesh) == ("model",)


def test_roll_on_a_sharded_dim_is_a_collective_permute(mesh):
    c = _put(mesh, jnp.ones((8, 16)), "model", None)
    rows = NamedSharding(mesh, P("model", None))
    report = analyze(_compile(lambda c: jnp.roll(c, 1, axis=0), c, out_shardings=rows))
    # Only the boundary row f32[1,16] crosses devices.
    assert report.collectives["collective-permute"] == (1, 16 * F32)
    (op,) = report.ops
    assert op.replica_groups is None and len(op.source_target_pairs) == 8


def test_ppermute_moves_the_whole_shard(mesh):
    x = _put(mesh, jnp.ones((8, 16)), "model")
    pairs = [(i, (i + 1) % 4) for i in range(4)]
    fn = jax.shard_map(
        lambda x: jax.lax.ppermute(x, "model", pairs),
        mesh=mesh,
        in_specs=P("model"),
        out_specs=P("model"),
    )
    report = analyze(_compile(fn, x))
    assert report.collectives["collective-permute"] == (1, 2 * 16 * F32)
    assert sorted(report.ops[0].source_target_pairs) == sorted(
        pairs + [(a + 4, b + 4) for a, b in pairs]
    )


def test_collective_in_scan_counts_per_iteration_and_is_marked(mesh):
    w = _put(mesh, jnp.ones((16, 16)))
    x = _put(mesh, jnp.ones((8, 16)), "data")

    def loss(w, x):
        h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=3)
        return h.sum()

    report = analyze(_compile(jax.grad(loss), w, x))
    looped = [op for op in report.ops if op.in_while]
    assert len(looped) == 1 and looped[0].kind == "all-reduce"
    assert looped[0].bytes == 16 * 16 * F32 and looped[0].runs == 3  # the scan's length
    static, per_run = report.static_collectives["all-reduce"], report.collectives["all-reduce"]
    assert per_run == (static[0] + 2, static[1] + 2 * 16 * 16 * F32)
    assert "while loops" in report.describe()


def test_memory_and_flops(mesh):
    a = jnp.ones((8, 16))
    b = jnp.ones((16, 4))
    report = analyze(_compile(lambda a, b: a @ b, a, b))
    mem = report.memory
    assert mem is not None
    assert all(getattr(mem, f) >= 0 for f in MemoryReport.__dataclass_fields__)
    assert mem.argument_bytes == (8 * 16 + 16 * 4) * F32
    assert mem.output_bytes == 8 * 4 * F32
    assert mem.peak_bytes >= mem.argument_bytes
    assert report.flops is not None and report.flops >= 2 * 8 * 16 * 4
    assert report.collectives == {kind: (0, 0) for kind in COLLECTIVE_KINDS}


def test_donated_argument_is_not_counted_twice_in_peak(mesh):
    w = _put(mesh, jnp.ones((16, 16)))
    mem = analyze(_compile(lambda w: w + 1, w, donate_argnums=0)).memory
    assert mem.alias_bytes == 16 * 16 * F32
    live = mem.argument_bytes + mem.output_bytes + mem.temp_bytes
    assert mem.peak_bytes == live - mem.alias_bytes


def test_peak_holds_the_temporaries(mesh):
    """XLA:CPU's own peak of a step that updates a donated weight leaves the temporaries
    out (here the 256x512 product whose tanh and sum the update reads); the report's holds
    them."""
    w, x = jnp.ones((512, 512)), jnp.ones((256, 512))
    mem = analyze(_compile(lambda w, x: (w - jnp.tanh(x @ w).sum(), (x @ w).sum()), w, x,
                           donate_argnums=0)).memory
    assert mem.temp_bytes >= 256 * 512 * F32
    assert mem.peak_bytes >= mem.argument_bytes + mem.temp_bytes


def test_report_serialises_and_describes(mesh):
    x = _put(mesh, jnp.ones((32, 16)), "data")
    w = _put(mesh, jnp.ones((16, 8)))
    report = analyze(_compile(jax.grad(lambda w, x: jnp.sum(x @ w)), w, x))
    data = json.loads(json.dumps(report.to_dict()))
    assert set(COLLECTIVE_KINDS) <= set(data["collectives"])
    assert data["ops"][0]["kind"] == "all-reduce"
    text = report.describe()
    assert "all-reduce" in text and "peak_bytes" in text and "flops" in text
    assert max(len(line) for line in text.splitlines()) <= 100


# ----------------------------------------------------------------- hand-written HLO

ASYNC_GPU_HLO = """
HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[64]{0})->f32[8]{0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%wrapped_reduce_scatter_computation (param_0: bf16[64]) -> bf16[8] {
  %param_0 = bf16[64]{0} parameter(0)
  ROOT %reduce-scatter.2 = bf16[8]{0} reduce-scatter(%param_0), channel_id=4, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}

ENTRY %main (p: f32[64]) -> f32[8] {
  %p = f32[64]{0} parameter(0)
  %all-reduce-start = f32[64]{0} all-reduce-start(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %all-reduce-done = f32[64]{0} all-reduce-done(%all-reduce-start)
  %all-gather-start = (f32[8]{0}, f32[64]{0}) all-gather-start(%p.slice), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}
  %all-gather-done = f32[64]{0} all-gather-done(%all-gather-start)
  %collective-permute-start = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%all-reduce-done), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %collective-permute-done = f32[64]{0} collective-permute-done(%collective-permute-start)
  %bf = bf16[64]{0} convert(%collective-permute-done)
  %async-start = ((bf16[64]{0}), bf16[8]{0}, s32[]) async-start(%bf), calls=%wrapped_reduce_scatter_computation
  %async-done = bf16[8]{0} async-done(%async-start)
  %rs-start = ((f32[64]{0}), f32[8]{0}) reduce-scatter-start(%all-gather-done), channel_id=5, replica_groups={}, dimensions={0}, to_apply=%add
  %rs-update = ((f32[64]{0}), f32[8]{0}) reduce-scatter-update(%rs-start)
  ROOT %rs-done = f32[8]{0} reduce-scatter-done(%rs-update)
}
"""


def test_comm_time_prices_each_collective_over_its_mesh_axes():
    """The HLO's collectives priced by the cost model: groups {0..3},{4..7} are the `model`
    axis of a 2x4 mesh, {0..7} (or `{}`) both axes; the collective-permute has pairs, not
    groups, and is reported unpriced."""
    from spmd.cost.partitioner import Collective
    from spmd.cost.time import CostModel
    from spmd.cluster.mesh import make_mesh

    mesh = make_mesh({"data": 2, "model": 4}, bandwidth=10e9, latency=1e-5, virtual=True)
    cost = CostModel(mesh)
    report = analyze_hlo_text(ASYNC_GPU_HLO)
    seconds, unpriced = report.comm_time(mesh)
    everything = ("data", "model")
    want = (cost.time(Collective("all-reduce", ("model",), 64 * F32))
            + cost.time(Collective("all-gather", everything, 64 * F32))
            + cost.time(Collective("reduce-scatter", everything, 64 * 2))
            + cost.time(Collective("reduce-scatter", everything, 64 * F32)))
    assert unpriced == 1
    assert seconds == pytest.approx(want)


def test_comm_time_charges_a_combined_cpu_all_reduce_a_latency_per_operand():
    """XLA:CPU runs a combined all-reduce one rendezvous per operand, XLA:GPU as one call:
    the same three-operand op pays three latencies on a CPU mesh and one on a GPU mesh."""
    from spmd.cluster.mesh import make_mesh

    hlo = """
ENTRY %main (a: f32[64], b: f32[64], c: f32[32]) -> f32[64] {
  %a = f32[64]{0} parameter(0)
  %b = f32[64]{0} parameter(1)
  %c = f32[32]{0} parameter(2)
  ROOT %ar = (f32[64]{0}, f32[64]{0}, f32[32]{0}) all-reduce(%a, %b, %c), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}
"""
    report = analyze_hlo_text(hlo)
    assert report.collectives["all-reduce"] == (1, 160 * F32)
    times = {}
    for platform in ("cpu", "gpu"):
        mesh = make_mesh({"data": 8}, bandwidth=1e15, latency=1e-5, platform=platform,
                         virtual=True)
        times[platform], unpriced = report.comm_time(mesh)
        assert unpriced == 0
    assert times["gpu"] == pytest.approx(1e-5, rel=1e-3)
    assert times["cpu"] == pytest.approx(3e-5, rel=1e-3)


def test_async_pairs_count_the_start_once_with_the_right_bytes():
    report = analyze_hlo_text(ASYNC_GPU_HLO)
    assert report.collectives["all-reduce"] == (1, 64 * F32)
    assert report.collectives["all-gather"] == (1, 64 * F32)  # result of (f32[8], f32[64])
    assert report.collectives["collective-permute"] == (1, 64 * F32)  # not the u32 context
    # One reduce-scatter in the async-start's wrapped body (bf16 operand) and one sugar form.
    assert report.collectives["reduce-scatter"] == (2, 64 * 2 + 64 * F32)
    assert sorted(op.opcode for op in report.ops) == sorted(
        ["all-reduce-start", "all-gather-start", "collective-permute-start",
         "reduce-scatter", "reduce-scatter-start"]
    )  # fmt: skip
    wrapped = next(op for op in report.ops if op.opcode == "reduce-scatter")
    assert wrapped.computation == "wrapped_reduce_scatter_computation"
    assert wrapped.replica_groups == [list(range(8))]
    assert next(op for op in report.ops if op.opcode == "reduce-scatter-start").replica_groups == []
    assert report.memory is None and report.flops is None
    assert "not reported" in report.describe()


def test_async_start_sugar_without_a_known_operand_reads_the_tuple():
    hlo = """
ENTRY %e () -> f32[4] {
  %rs = ((f32[16]{0}), f32[4]{0}) reduce-scatter-start(%unknown), dimensions={0}
  %cp = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(%unknown), source_target_pairs={{0,1}}
  %a2a = ((f32[8]{0}, f32[8]{0}), (f32[8]{0}, f32[8]{0})) all-to-all-start(%u1, %u2)
}"""
    c = analyze_hlo_text(hlo).collectives
    assert c["reduce-scatter"] == (1, 64)
    assert c["collective-permute"] == (1, 64)
    assert c["all-to-all"] == (1, 64)


def test_opcode_not_name_decides():
    hlo = """
HloModule m
%fused (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %all-gather.9 = f32[4]{0} negate(%param_0)
}
ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %all-reduce.3 = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused
  %reduce-scatter = f32[4]{0} add(%all-reduce.3, %p), metadata={op_name="all-reduce(x)"}
  %all-to-all-done.1 = f32[4]{0} copy(%reduce-scatter)
  ROOT %x = f32[4]{0} reduce(%all-to-all-done.1, %p), dimensions={}, to_apply=%all-reduce
}"""
    report = analyze_hlo_text(hlo)
    assert report.ops == []
    assert report.collectives == {kind: (0, 0) for kind in COLLECTIVE_KINDS}


def test_tuple_combined_collectives_sum_their_elements_and_dtypes():
    hlo = """
ENTRY %main (a: bf16[4,8], b: s8[16], c: pred[3]) -> f32[] {
  %a = bf16[4,8]{1,0:T(8,128)(2,1)} parameter(0)
  %b = s8[16]{0} parameter(1)
  %c = c64[2]{0} parameter(2)
  %ar = (bf16[4,8]{1,0:T(8,128)(2,1)}, s8[16]{0}, c64[2]{0}) all-reduce(%a, %b, %c), replica_groups={{0,1}}, to_apply=%add
  %ag = (f32[8]{0}, /*index=1*/f16[8]{0}) all-gather(f32[2]{0} %x, f16[2]{0} %y), replica_groups={{0,1,2,3}}, dimensions={0}
  %rs = f32[2,4]{1,0} reduce-scatter(f32[8,4]{1,0} %z), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  %rs2 = f32[2]{0} reduce-scatter(%missing), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  %cp = pred[3]{0} collective-permute(pred[3]{0} %c2), source_target_pairs={{0,1},{1,0}}
}"""
    c = analyze_hlo_text(hlo).collectives
    assert c["all-reduce"] == (1, 4 * 8 * 2 + 16 + 2 * 8)
    assert c["all-gather"] == (1, 8 * 4 + 8 * 2)  # results
    assert c["reduce-scatter"] == (2, 8 * 4 * 4 + 2 * 4 * 4)  # operands; %missing: result x 4
    assert c["collective-permute"] == (1, 3)


def test_wrapped_multiline_instruction_and_while_body():
    hlo = """
HloModule m
body {
  p = (f32[8], s32[]) parameter(0)
  v = f32[8] get-tuple-element(p), index=0
  ar = f32[8] all-reduce(v),
      replica_groups={{0,1}}, to_apply=add
  i = s32[] get-tuple-element(p), index=1
  ROOT t = (f32[8], s32[]) tuple(ar, i)
}
cond {
  p = (f32[8], s32[]) parameter(0)
  ROOT lt = pred[] constant(true)
}
ENTRY main {
  x = f32[8] parameter(0)
  ag = f32[16] all-gather(x), replica_groups={{0,1}}, dimensions={0}
  init = (f32[8], s32[]) tuple(x, zero)
  ROOT w = (f32[8], s32[]) while(init), condition=cond, body=body
}"""
    report = analyze_hlo_text(hlo)
    by_kind = {op.kind: op for op in report.ops}
    assert by_kind["all-reduce"].in_while and by_kind["all-reduce"].computation == "body"
    assert by_kind["all-reduce"].bytes == 32 and by_kind["all-reduce"].replica_groups == [[0, 1]]
    assert not by_kind["all-gather"].in_while and by_kind["all-gather"].bytes == 64


@pytest.mark.parametrize(
    "attrs, groups",
    [
        ("replica_groups={{0,1},{2,3}}, dimensions={0}", [[0, 1], [2, 3]]),
        ("replica_groups={}", []),
        ("channel_id=2", None),
        ("replica_groups=[2,4]<=[8], x=1", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=[2,4]<=[4,2]T(1,0)", [[0, 2, 4, 6], [1, 3, 5, 7]]),
        # Real XLA CPU output (jax 0.10.2) for the data and the model axis of a 2x4 mesh.
        ("replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}, use_global_device_ids=true",
         [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
         [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=mesh['a'=2,'b'=4] {'b','a'}", [[0, 4, 1, 5, 2, 6, 3, 7]]),
        ("replica_groups=mesh['x'=2,'y'=2], device_ids=(3,2,1,0) {'y'}", [[3, 2], [1, 0]]),
        # Sub-axes: x:(1)2 is the major half of x=8, x:(2)4 the minor four.
        ("replica_groups=mesh['x'=8] {'x':(1)2}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=mesh['x'=8] {'x':(2)4}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ],
)  # fmt: skip
def test_parse_replica_groups(attrs, groups):
    assert parse_replica_groups(attrs) == groups


def test_shape_bytes():
    assert shape_bytes("f32[8,16]{1,0}") == 512
    assert shape_bytes("bf16[2,3]") == 12
    assert shape_bytes("pred[5]") == 5
    assert shape_bytes("f8e4m3fn[10]") == 10
    assert shape_bytes("c128[2]") == 32
    assert shape_bytes("s4[3]") == 2
    assert shape_bytes("(f32[], token[], u64[2])") == 4 + 16
    assert shape_bytes("f32[<=8,2]") == 64
    with pytest.raises(ValueError):
        shape_bytes("q7[2]")


def test_groups_to_mesh_axes():
    shape = {"data": 2, "model": 4}
    assert groups_to_mesh_axes([[0, 4], [1, 5], [2, 6], [3, 7]], shape) == ("data",)
    assert groups_to_mesh_axes([[0, 1, 2, 3], [4, 5, 6, 7]], shape) == ("model",)
    assert groups_to_mesh_axes([list(range(8))], shape) == ("data", "model")
    assert groups_to_mesh_axes([], shape) == ("data", "model")
    assert groups_to_mesh_axes([[i] for i in range(8)], shape) == ()
    assert groups_to_mesh_axes([[0, 1], [2, 3], [4, 5], [6, 7]], shape) is None  # half of model
    reversed_ids = list(range(7, -1, -1))
    assert groups_to_mesh_axes([[7, 3], [6, 2], [5, 1], [4, 0]], shape, reversed_ids) == ("data",)


def test_report_totals_and_empty_report():
    report = Report(ops=[])
    assert report.total_collective_bytes == 0
    assert list(report.collectives) == list(COLLECTIVE_KINDS)
    assert json.loads(json.dumps(report.to_dict()))["memory"] is None


def test_multiline_start_with_inline_operand_shapes():
    # The layout XLA's own tests use: operands with shapes, arguments wrapped over lines.
    hlo = """
  ENTRY AllGatherStartAndDone {
    %input = f32[8,256,256] parameter(0)
    %ag-start = (f32[8,256,256], f32[16,256,256]) all-gather-start(
      f32[8,256,256] %input), replica_groups={{0,1}}, dimensions={0},
      metadata={op_type="AllGather" op_name="ag0"}
    ROOT %ag-done = f32[16,256,256] all-gather-done(
      (f32[8,256,256], f32[16,256,256]) %ag-start),
      metadata={op_type="AllGather" op_name="ag0"}
  }"""
    report = analyze_hlo_text(hlo)
    assert report.collectives["all-gather"] == (1, 16 * 256 * 256 * F32)
    assert report.ops[0].replica_groups == [[0, 1]]


def test_unreadable_collective_fails_loudly():
    with pytest.raises(ValueError, match="cannot parse"):
        analyze_hlo_text("ENTRY e {\n  %ar = f32[4 all-reduce(%x), to_apply=%add\n}")
