"""The roofline: which ops run as one kernel (``spmd.search.fusion``), what they read and
write, and how that memory traffic and the per-kernel overhead change predictions and plans,
on small steps worked out by hand and on plain-JAX steps at realistic widths (abstract
shapes on virtual A100 meshes)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spmd
import spmd.cluster.hardware
import spmd.cluster.mesh
from spmd.cluster.mesh import make_mesh
from spmd.search.costgraph import CostGraph, InputInfo
from spmd.search.fusion import folded_transposes, fuse
from spmd.trace.graph import Value, build_graph

S = jax.ShapeDtypeStruct
A100_4 = make_mesh({"data": 4}, bandwidth=300e9, latency=5e-6, device="a100-40gb",
                   platform="gpu", virtual=True)
NO_CACHE = spmd.SearchOptions(cache=False)


def _graph(fn, *args):
    return build_graph(jax.make_jaxpr(fn)(*args))


def _ops(graph, primitive):
    return [n for n in graph.nodes if n.kind == "op" and n.op.primitive == primitive]


def test_an_elementwise_chain_after_a_matmul_is_one_kernel_reading_the_matmul_output():
    w, x, b = jnp.ones((8, 4)), jnp.ones((2, 8)), jnp.ones((4,))
    g = _graph(lambda w, x, b: jnp.tanh(x @ w + b) * 2.0, w, x, b)
    fusion = fuse(g)
    dot, = _ops(g, "dot_general")
    chain = [n for n in g.nodes if n.kind == "op" and n.op.primitive != "dot_general"]
    assert len({fusion.kernel[n.id] for n in chain}) == 1  # broadcast, add, tanh, mul
    assert fusion.kernel[dot.id] != fusion.kernel[chain[0].id]
    assert fusion.launches == 2
    assert fusion.reads[dot.id] == (True, True) and fusion.writes[dot.id] == (True,)
    add, = _ops(g, "add")
    assert fusion.reads[add.id] == (True, False)  # the matmul's output; the broadcast b inside
    tanh, = _ops(g, "tanh")
    assert fusion.writes[tanh.id] == (False,)  # consumed inside the kernel
    mul, = _ops(g, "mul")
    assert fusion.writes[mul.id] == (True,)  # the step's output


def test_a_reduction_ends_its_fusion_its_consumers_read_the_input_again():
    x = jnp.ones((16, 32))
    g = _graph(lambda x: x - jnp.max(x, axis=1, keepdims=True), x)
    fusion = fuse(g)
    red, = _ops(g, "reduce_max")
    sub, = _ops(g, "sub")
    assert fusion.kernel[red.id] != fusion.kernel[sub.id]
    assert fusion.reads[red.id] == (True,) and fusion.writes[red.id] == (True,)
    assert fusion.reads[sub.id][0]  # x, read by both kernels


def _adam_like(p, m, v, x):
    g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p) ** 2))(p)
    m = 0.9 * m + 0.1 * g
    v = 0.99 * v + 0.01 * g * g
    return p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), m, v


def _cost_graph(fn, shapes, mesh):
    args = [jnp.zeros(s, jnp.float32) for s in shapes]
    infos = [InputInfo(f"a{i}", s, jnp.float32, "param") for i, s in enumerate(shapes)]
    return CostGraph(_graph(fn, *args), infos, mesh, output_aliases={0: 0, 1: 1, 2: 2}), args


def test_traffic_of_a_step_is_what_xla_says_it_accesses_within_a_factor_of_two():
    """XLA's own count (``cost_analysis()['bytes accessed']`` of the compiled step, summed
    over its fusions) against the cost graph's, on one device where every spec is
    replicated: the fusion model is an approximation, but not one off by more than 2x."""
    shapes = [(512, 512)] * 3 + [(256, 512)]
    mesh = make_mesh({"data": 1}, device="cpu")
    cg, args = _cost_graph(_adam_like, shapes, mesh)
    ours = sum(cg._traffic(n, cg.strats[n.id][0]) * n.repeat for n in cg.graph.nodes
               if n.kind == "op")
    analysis = jax.jit(_adam_like).lower(*args).compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    assert 0.5 <= ours / analysis["bytes accessed"] <= 2.0


def test_the_update_reads_and_writes_every_state_once_and_a_split_divides_it():
    shapes = [(512, 512)] * 3 + [(256, 512)]
    mesh = make_mesh({"data": 4}, device="a100-40gb", platform="gpu", virtual=True)
    cg, _ = _cost_graph(_adam_like, shapes, mesh)
    # The update's last op writes the new parameter: 1 MiB replicated, a quarter split.
    new_p = cg.graph.nodes[cg.graph.outputs[0].node]
    by_spec = {s.out_specs[0]: cg._traffic(new_p, s) for s in cg.strats[new_p.id]}
    whole, split = by_spec[((), ())], by_spec[(("data",), ())]
    assert whole >= 512 * 512 * 4 and split == pytest.approx(whole / 4)


def test_a_prediction_shows_flops_memory_and_kernel_launches_apart():
    plan = spmd.plan(_adam_like, *[S(s, jnp.float32) for s in [(512, 512)] * 3 + [(256, 512)]],
                     mesh=A100_4, options=NO_CACHE)
    p = plan.prediction
    assert p.memory_time > 0 and p.compute_time > 0
    launches = p.launch_time / A100_4.device.kernel_overhead
    assert launches == pytest.approx(round(launches)) and 5 <= launches <= 60
    assert p.total_time == pytest.approx(p.compute_time + p.memory_time + p.launch_time
                                         + p.comm_time)
    from spmd.explain import _prediction_table
    headers = [column.header for column in _prediction_table(plan).columns]
    assert {"compute ms", "memory-bound ms", "launch ms", "comm ms"} <= set(headers)


def test_a_small_matmul_runs_at_its_profiled_fraction_and_the_curve_reads_back(tmp_path):
    device = spmd.cluster.hardware.device_spec(
        {"peak_flops_bf16": 1e12, "peak_flops_fp32": 5e11, "memory_bytes": 2**30,
         "memory_bandwidth": 1e11, "matmul_curve": [[1e3, 0.1], [1e6, 0.5], [1e9, 1.0]],
         "transpose_fraction": 0.25, "conv_fraction": 0.5})
    assert device.flops("float32") == 5e11  # no size: the large matmul's rate
    assert device.flops("float32", conv=True) == 2.5e11
    assert device.transpose_bandwidth == 2.5e10
    assert device.flops("float32", 1e3) == pytest.approx(5e10)
    assert device.flops("float32", 1e12) == pytest.approx(5e11)  # held at the ends
    assert device.flops("bfloat16", np.sqrt(1e3 * 1e6)) == pytest.approx(1e12 * 0.3)  # log-linear
    mesh = make_mesh({"data": 2}, device=device, virtual=True)
    path = tmp_path / "curve.yaml"
    path.write_text(spmd.cluster.mesh.mesh_yaml(mesh))
    assert spmd.load_mesh(path).device == device
    with pytest.raises(spmd.errors.MeshError, match=r"a.yaml: device.transpose_fraction: "
                                                    r"expected a fraction above 0"):
        spmd.cluster.hardware.device_spec(
            {"peak_flops_bf16": 1, "peak_flops_fp32": 1, "memory_bytes": 1,
             "memory_bandwidth": 1, "transpose_fraction": 0}, "a.yaml: device")
    with pytest.raises(spmd.errors.MeshError, match="matmul_curve: FLOPs must be positive"):
        spmd.cluster.hardware.device_spec(
            {"peak_flops_bf16": 1, "peak_flops_fp32": 1, "memory_bytes": 1,
             "memory_bandwidth": 1, "matmul_curve": [[1e6, 0.5], [1e3, 0.1]]}, "a.yaml: device")


def test_a_batched_matmul_is_priced_at_the_rate_of_one_of_its_matmuls():
    """Attention's dots run one small matmul per (batch, head): on a device whose small
    matmuls are slow, 64 of (32 x 8) @ (8 x 32) cost more than one matmul of as many FLOPs."""
    device = spmd.cluster.hardware.device_spec(
        {"peak_flops_bf16": 1e11, "peak_flops_fp32": 1e11, "memory_bytes": 2**30,
         "memory_bandwidth": 1e12, "matmul_curve": [[1e4, 0.1], [1e8, 1.0]]})
    mesh = make_mesh({"data": 1}, device=device)
    q = jnp.ones((64, 32, 8))
    batched = CostGraph(_graph(lambda a, b: jnp.einsum("bqd,bkd->bqk", a, b), q, q),
                        [InputInfo(f"a{i}", q.shape, jnp.float32, "batch") for i in (0, 1)], mesh)
    flat = jnp.ones((256, 128))
    single = CostGraph(_graph(lambda a, b: a @ b.T, flat, flat),
                       [InputInfo(f"a{i}", flat.shape, jnp.float32, "batch") for i in (0, 1)],
                       mesh)
    dot_b, = _ops(batched.graph, "dot_general")
    dot_s, = _ops(single.graph, "dot_general")
    assert batched.strats[dot_b.id][0].flops == pytest.approx(2 * 64 * 32 * 32 * 8)
    per_flop = [cg.compute[n.id][0] / cg.strats[n.id][0].flops
                for cg, n in ((batched, dot_b), (single, dot_s))]
    assert per_flop[0] > 3 * per_flop[1]


def test_a_rated_op_takes_at_least_its_elements_at_its_kinds_rate(tmp_path):
    """On a device whose profile rates exponentials at 1 G elements/s (XLA:CPU's tanh runs
    near that), a tanh over 256 x 1024 elements costs its elements at that rate, though it
    moves its bytes 25x faster; the reduction after it, its input's elements at the reduce
    rate. A GPU (nothing rated) prices both by their bytes. The rates read back from a mesh
    file; a kind the cost model does not know is refused, naming the valid ones."""
    rated = {"exponential": 1e9, "reduce": 2e9}
    fields = {"peak_flops_bf16": 1e11, "peak_flops_fp32": 1e11, "memory_bytes": 2**30,
              "memory_bandwidth": 1e11}
    x = jnp.ones((256, 1024))
    costs = {}
    for name, device in (("rated", {**fields, "op_rates": rated}), ("bytes", fields)):
        mesh = make_mesh({"data": 1}, device=spmd.cluster.hardware.device_spec(device))
        cg = CostGraph(_graph(lambda x: jnp.sum(jnp.tanh(x), axis=1), x),
                       [InputInfo("x", x.shape, jnp.float32, "batch")], mesh)
        costs[name] = {p: cg.compute[_ops(cg.graph, p)[0].id][0] for p in ("tanh", "reduce_sum")}
    assert costs["rated"]["tanh"] == pytest.approx(x.size / 1e9)
    assert costs["rated"]["reduce_sum"] == pytest.approx(x.size / 2e9)
    # by bytes: tanh reads x (its output stays in the kernel), 1 M elements of FLOPs at 1e11
    assert costs["bytes"]["tanh"] == pytest.approx(max(x.size * 4 / 1e11, x.size / 1e11))
    assert costs["rated"]["tanh"] > 20 * costs["bytes"]["tanh"]
    mesh = make_mesh({"data": 2}, device=spmd.cluster.hardware.device_spec(
        {**fields, "op_rates": rated}), virtual=True)
    path = tmp_path / "rated.yaml"
    path.write_text(spmd.cluster.mesh.mesh_yaml(mesh))
    assert spmd.load_mesh(path).device.op_rate("exponential") == 1e9
    with pytest.raises(spmd.errors.MeshError, match=r"a.yaml: device.op_rates: unknown kinds "
                                                    r"\['tanh'\]; valid kinds: elementwise, "):
        spmd.cluster.hardware.device_spec({**fields, "op_rates": {"tanh": 1e9}},
                                          "a.yaml: device")
    with pytest.raises(spmd.errors.MeshError, match="reduce: expected elements per second"):
        spmd.cluster.hardware.device_spec({**fields, "op_rates": {"reduce": -1}}, "device")


def test_a_fused_kernel_takes_the_longer_of_its_flops_and_its_traffic_not_each_ops():
    """An AdamW-like update is one kernel: its division and root are compute (rated slow, as
    XLA:CPU runs them), its reads of p, m, v, g and writes of p, m, v are memory. The kernel
    streams while it computes, so its ops together cost the longer of the two sums, each op
    its share of it, not the sum of each op's longer term (which priced wresnet-tiny's
    update on cpu-8 at 1.6x what it took)."""
    device = spmd.cluster.hardware.device_spec(
        {"peak_flops_bf16": 1e11, "peak_flops_fp32": 1e11, "memory_bytes": 2**30,
         "memory_bandwidth": 1e10, "op_rates": {"divide": 1e9, "root": 1e9}})
    mesh = make_mesh({"data": 1}, device=device)

    def update(p, m, v, g):
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        return p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), m, v

    shape = (512, 512)
    cg, _ = _cost_graph(update, [shape] * 4, mesh)
    ops = [n for n in cg.graph.nodes if n.kind == "op"]
    assert len({cg.fusion.kernel[n.id] for n in ops}) == 1
    prices = [cg._price(n, cg.strats[n.id], False) for n in ops]
    flops = sum(p.flop_time[0] for p in prices)
    traffic = sum(p.traffic[0] for p in prices)
    each_longer = sum(max(p.flop_time[0], p.traffic[0]) for p in prices)
    array = np.prod(shape) * 4
    assert traffic == pytest.approx(7 * array / 1e10)  # g read once, by three operands
    assert flops == pytest.approx(2 * array / 4 / 1e9, rel=0.1)  # the division and root
    assert traffic > flops and each_longer > 1.3 * traffic
    assert sum(cg.compute[n.id][0] - cg.launch[n.id] for n in ops) == pytest.approx(traffic)
    memory_bound = sum(cg.memory_bound[n.id][0] for n in ops)
    assert memory_bound == pytest.approx(traffic - flops)


def _slow_transposes(platform: str):
    """One device whose transposes run at a tenth of its copies (XLA:CPU's, roughly)."""
    device = spmd.cluster.hardware.device_spec(
        {"peak_flops_bf16": 1e11, "peak_flops_fp32": 1e11, "memory_bytes": 2**30,
         "memory_bandwidth": 1e10, "transpose_fraction": 0.1, "kernel_overhead": 1e-6})
    return make_mesh({"data": 1}, device=device, platform=platform, virtual=platform == "gpu")


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_a_weight_gradient_dot_pays_for_transposing_its_operand_on_cpu_only(platform):
    """x^T @ dy over (batch, token) contracts x's first two dimensions: XLA:CPU copies x
    transposed first (a kernel moving its bytes at the transpose bandwidth; a copy fusion
    in its compiled HLO); cuBLAS takes it as it is. A 2-D x^T @ dy is one Eigen ``dot``
    reading x transposed on XLA:CPU too: no copy, none priced."""
    x, dy = jnp.ones((8, 32, 128)), jnp.ones((8, 32, 64))
    mesh = _slow_transposes(platform)
    gradient = lambda x, dy: jnp.einsum("btx,bty->xy", x, dy)  # noqa: E731
    cg = CostGraph(_graph(gradient, x, dy),
                   [InputInfo(f"a{i}", a.shape, jnp.float32, "batch") for i, a in
                    enumerate((x, dy))], mesh)
    dot, = _ops(cg.graph, "dot_general")
    strategy = cg.strats[dot.id][0]
    roofline = max(strategy.flops / 1e11, cg._traffic(dot, strategy) / 1e10)
    relayout = 2 * x.size * 4 / 1e9 if platform == "cpu" else 0.0
    kernels = 2 if platform == "cpu" else 1
    assert cg.launch[dot.id] == pytest.approx(kernels * 1e-6)
    assert cg.compute[dot.id][0] == pytest.approx(roofline + relayout + kernels * 1e-6)
    assert cg.memory_bound[dot.id][0] == pytest.approx(cg.compute[dot.id][0] - cg.launch[dot.id]
                                                       - strategy.flops / 1e11)
    if platform == "cpu":
        x2, dy2 = x.reshape(256, 128), dy.reshape(256, 64)
        matrix = CostGraph(_graph(_contract_rows, x2, dy2),
                           [InputInfo(f"a{i}", a.shape, jnp.float32, "batch") for i, a in
                            enumerate((x2, dy2))], mesh)
        assert matrix.launch[_ops(matrix.graph, "dot_general")[0].id] == pytest.approx(1e-6)
        copies = lambda f, *a: re.findall(  # noqa: E731
            r"= \S+ (?:copy|transpose)\(|%\w*(?:copy|transpose)\w*(?:\.\d+)? = \S+ fusion",
            (lambda t: t[t.index("ENTRY"):])(jax.jit(f).lower(*a).compile().as_text()))
        assert copies(gradient, x, dy)
        assert not copies(_contract_rows, x2, dy2)


#: (einsum, lhs shape, rhs shape): matmuls of a transformer's steps, each operand of them
#: in the order XLA:CPU's matmul takes or not
_DOT_FORMS = [
    ("bse,ef->bsf", (8, 32, 64), (64, 128)),  # a projection
    ("bsf,ef->bse", (8, 32, 128), (64, 128)),  # its input gradient (w transposed)
    ("bse,bsf->ef", (8, 32, 64), (8, 32, 128)),  # its weight gradient
    ("bse,hke->bshk", (8, 32, 64), (4, 16, 64)),  # attention's output projection, backward
    ("bshk,hke->bse", (8, 32, 4, 16), (4, 16, 64)),
    ("bse,ehk->bshk", (8, 32, 64), (64, 4, 16)),
    ("bse,bshk->ehk", (8, 32, 64), (8, 32, 4, 16)),
    ("bhqd,bhkd->bhqk", (8, 4, 32, 16), (8, 4, 32, 16)),
    ("bqhd,bkhd->bhqk", (8, 32, 4, 16), (8, 32, 4, 16)),  # batch dimensions not leading
    ("te,tf->ef", (256, 64), (256, 128)),  # 2-D x^T @ dy: Eigen reads x transposed
    ("te,fe->tf", (256, 64), (128, 64)),  # 2-D x @ w.T
]


@pytest.mark.parametrize("form,lhs,rhs", _DOT_FORMS, ids=[f for f, _, _ in _DOT_FORMS])
def test_the_operands_xla_cpu_transposes_before_a_matmul_are_those_the_rule_names(form, lhs, rhs):
    """``spmd.search.layout``'s rule against XLA:CPU's compiled HLO: as many copy or
    transpose kernels before the matmul as operands the rule says it reorders."""
    from spmd.search.layout import transposed_operands

    graph = _graph(lambda a, b: jnp.einsum(form, a, b), jnp.ones(lhs), jnp.ones(rhs))
    dot, = _ops(graph, "dot_general")
    named = transposed_operands(lhs, rhs, dot.op.params["dimension_numbers"], "cpu")
    text = jax.jit(lambda a, b: jnp.einsum(form, a, b)).lower(
        jnp.ones(lhs), jnp.ones(rhs)).compile().as_text()
    entry = text[text.index("ENTRY"):]
    before = entry[:entry.index(re.search(r"= \S+ (?:dot|fusion)\([^\n]*kind=kCustom|= \S+ dot\(",
                                          entry).group(0))]
    copies = re.findall(r"%\w*(?:copy|transpose)\w*(?:\.\d+)? = \S+ fusion", before)
    assert len(copies) == len(named), (form, named, entry)


def test_a_transpose_moves_its_bytes_at_the_transpose_bandwidth():
    x = jnp.ones((256, 128))
    cg = CostGraph(_graph(lambda x: x.T, x), [InputInfo("x", x.shape, jnp.float32, "batch")],
                   _slow_transposes("cpu"))
    transpose, = _ops(cg.graph, "transpose")
    assert cg.compute[transpose.id][0] == pytest.approx(2 * x.size * 4 / 1e9 + 1e-6)


def _contract_rows(a, b):
    """a^T @ b as jax's transpose rule writes a weight gradient: contract both first dims."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())))


def test_a_transposed_matmul_result_is_the_matmul_with_its_operands_swapped():
    """JAX writes a weight gradient as transpose(dot_general(dy, x)); XLA swaps the operands
    and the matmul writes the transposed result itself (the compiled step has no transpose
    or copy). So it costs what the swapped matmul costs, in one kernel, and the matmul's own
    result is never in memory. A transpose of a result read twice, or of a batched result
    that is no swap, stays a kernel of its own."""
    x, dy = jnp.ones((256, 128)), jnp.ones((256, 64))
    infos = [InputInfo(f"a{i}", a.shape, jnp.float32, "batch") for i, a in enumerate((x, dy))]
    mesh = _slow_transposes("gpu")
    folded = lambda x, dy: jnp.tanh(_contract_rows(dy, x).T)  # noqa: E731
    swapped = lambda x, dy: jnp.tanh(_contract_rows(x, dy))  # noqa: E731
    cg, plain = (CostGraph(_graph(f, x, dy), infos, mesh) for f in (folded, swapped))
    transpose, = _ops(cg.graph, "transpose")
    dot, = _ops(cg.graph, "dot_general")
    assert transpose.id in cg.fusion.folded
    assert cg.fusion.kernel[transpose.id] == cg.fusion.kernel[dot.id]
    assert cg.fusion.launches == plain.fusion.launches == 2  # the matmul, then tanh's
    total = lambda g: sum(g.compute[n.id][0] for n in g.graph.nodes if n.kind == "op")  # noqa: E731
    assert total(cg) == pytest.approx(total(plain))
    assert cg.liveness.fused[cg.liveness.position[Value(dot.id, 0)]]
    compiled = jax.jit(folded).lower(x, dy).compile().as_text()
    assert not re.search(r"= \S+ (transpose|copy)\(", compiled[compiled.index("ENTRY"):])

    read_twice = _graph(lambda x, dy: (lambda y: jnp.tanh(y.T) + y.sum())(_contract_rows(dy, x)),
                        x, dy)
    a, b = jnp.ones((8, 64, 32)), jnp.ones((8, 32, 48))
    not_a_swap = _graph(lambda a, b: jnp.transpose(a @ b, (1, 0, 2)), a, b)
    batched_swap = _graph(lambda a, b: jnp.transpose(a @ b, (0, 2, 1)), a, b)
    assert not folded_transposes(read_twice) and not folded_transposes(not_a_swap)
    assert folded_transposes(batched_swap) == {_ops(batched_swap, "transpose")[0].id}


def _residual_sums(x, gs, w):
    """A residual stream summed over four layers by cheap ops, each layer's sum contracted
    over its leading (batch, token) dimensions with ``w``, as a weight gradient is: XLA:CPU
    transposes that operand before its matmul."""
    h, grads = x, []
    for g in gs:
        h = h + 0.5 * g
        grads.append(jax.lax.dot_general(h, w, (((0, 1), (0, 1)), ((), ()))))
    return grads


def test_a_transposed_operand_made_by_cheap_ops_is_remade_from_their_inputs_on_cpu():
    """XLA:CPU fuses a matmul operand's transpose with the cheap ops making it, duplicated
    for each reader: the k-th layer's transpose reads x and the k layer inputs (the compiled
    step has a fusion of k + 1 operands before each matmul, and no fusion computing the
    stream alone), all at the transpose bandwidth. The cost graph prices each relayout so.
    Not on a GPU mesh: cuBLAS reads the operand as it is."""
    x, w = jnp.ones((8, 32, 128)), jnp.ones((8, 32, 64))
    gs = tuple(jnp.full(x.shape, float(k)) for k in range(4))
    graph = _graph(_residual_sums, x, gs, w)
    infos = [InputInfo(f"a{i}", a.shape, jnp.float32, "batch") for i, a in
             enumerate((x, *gs, w))]
    cg = CostGraph(graph, infos, _slow_transposes("cpu"))
    dots = _ops(graph, "dot_general")
    assert [cg.transposed_reads[d.operands[0]] for d in dots] == [2.0, 3.0, 4.0, 5.0]
    bytes_x = x.size * 4
    for reads, d in zip((2, 3, 4, 5), dots):  # written once, its cone's inputs read
        relayout = (1 + reads) * bytes_x / 1e9 + 1e-6  # at 0.1 x 10 GB/s, and one launch
        flops = 2 * x.size * 64 / 1e11
        assert cg.compute[d.id][0] == pytest.approx(relayout + flops + 1e-6)
    compiled = jax.jit(_residual_sums).lower(x, gs, w).compile().as_text()
    entry = compiled[compiled.index("ENTRY"):]
    fused = [line for line in entry.splitlines() if " fusion(" in line and "kLoop" in line]
    assert sorted(line.split("fusion(")[1].split(")")[0].count("%") for line in fused) == [
        2, 3, 4, 5]
    assert not CostGraph(graph, infos, _slow_transposes("gpu")).transposed_reads


# -- realistic widths: abstract shapes on a virtual 4 x A100 mesh --------------------------
D, LAYERS, TOKENS = 4096, 4, 16384


def _wide_params():
    return {f"w{i}_{l}": S((D, D), jnp.float32) for l in range(LAYERS) for i in (1, 2)}


def _forward(params, x):
    h = x
    for l in range(LAYERS):
        h = h + jax.nn.gelu(h @ params[f"w1_{l}"]) @ params[f"w2_{l}"]
    return jnp.mean(h ** 2)


def _wide_adamw_step(params, m, v, x):
    g = jax.grad(_forward)(params, x)
    m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
    v = jax.tree.map(lambda a, b: 0.999 * a + 0.001 * b * b, v, g)
    new = jax.tree.map(lambda p, a, b: p - 1e-3 * (a / (jnp.sqrt(b) + 1e-8) + 0.01 * p),
                       params, m, v)
    return new, m, v


def _split(spec) -> bool:
    return any(axes for axes in spec)


def test_wide_adamw_step_shards_parameters_and_optimizer_state():
    """134M fp32 parameters with AdamW on 4 A100s, 16k tokens: replicated, every device reads
    and writes 3.8 GB of parameters and moments per step (~3.4 ms at 71% of 1555 GB/s);
    split, a quarter of that, for the same gradient traffic (reduce-scatter + all-gather
    equal one all-reduce). The search shards every weight's moments and most weights: the
    solver, stopped at its stall window on a busy host, may leave a few weights replicated
    with their moments split (ZeRO-style, 0.5% slower by the model)."""
    params = _wide_params()
    plan = spmd.plan(_wide_adamw_step, params, params, params, S((TOKENS, D), jnp.float32),
                     mesh=A100_4, options=NO_CACHE)
    specs = {leaf.path: spec for leaf, spec in zip(plan.leaves, plan.input_specs)}
    state = [path for path in specs if path.split("/")[0] in ("params", "m", "v")]
    assert len(state) == 3 * 2 * LAYERS
    replicated = [path for path in state if not _split(specs[path])]
    assert all(path.startswith("params/") for path in replicated) and len(replicated) <= LAYERS
    assert _split(specs["x"])
    dp = plan.alternatives["dp"]
    assert plan.prediction.total_time < dp.total_time  # 38.7 ms against 42.6 (2026-12-01)
    assert plan.prediction.memory_time < 0.7 * dp.memory_time  # 4.5 ms against 7.1


def test_wide_eval_step_keeps_its_weights_replicated():
    """The reverse: a forward-only step (no update) at the same widths. Splitting a weight
    would only add collectives; the search splits the batch and replicates the weights."""
    plan = spmd.plan(_forward, _wide_params(), S((TOKENS, D), jnp.float32), mesh=A100_4,
                     options=NO_CACHE)
    specs = {leaf.path: spec for leaf, spec in zip(plan.leaves, plan.input_specs)}
    assert _split(specs["x"])
    assert not any(_split(spec) for path, spec in specs.items() if path != "x"), specs
    assert plan.prediction.comm_time < 1e-4
