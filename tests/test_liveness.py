"""Which values are alive together: live ranges, donation, peaks per owner."""

import jax
import jax.numpy as jnp
import numpy as np

from spmd.memory.liveness import Liveness
from spmd.trace.graph import build_graph


def _graph():
    # w (4x4), x (8x4) -> y = x @ w (8x4) -> t = tanh(y) -> s = sum(t); w - s (update)
    return build_graph(jax.make_jaxpr(
        lambda w, x: w - jnp.tanh(x @ w).sum())(jnp.ones((4, 4)), jnp.ones((8, 4))))


def test_intervals_follow_producers_and_last_uses():
    g = _graph()
    live = Liveness(g, donated=set())
    spans = {(v.node, v.index): (a, b) for v, a, b in live.intervals}
    end = len(g.nodes)
    assert spans[(0, 0)] == (0, end) and spans[(1, 0)] == (0, end)  # inputs: throughout
    dot = next(n.id for n in g.nodes if n.kind == "op" and n.op.primitive == "dot_general")
    assert spans[(dot, 0)] == (dot, dot + 1)  # read by tanh only
    assert spans[(end - 1, 0)] == (end - 1, end)  # the step's output lives to the end


def test_a_donated_input_dies_at_its_last_use():
    g = _graph()
    kept = {(v.node, v.index): (a, b) for v, a, b in Liveness(g, donated=set()).intervals}
    donated = {(v.node, v.index): (a, b) for v, a, b in Liveness(g, donated={0}).intervals}
    last = max(c for c in g.nodes[0].consumers)
    assert donated[(0, 0)] == (0, last) and kept[(0, 0)][1] == len(g.nodes)
    assert donated[(1, 0)] == kept[(1, 0)]


def test_peak_and_busiest_points_and_own_peaks():
    g = _graph()
    live = Liveness(g, donated=set())
    totals = live.totals(live.full_bytes)
    assert live.peak(live.full_bytes) == totals.max()
    points = live.busiest_points(2)
    assert points == sorted(points) and totals[points].min() >= np.sort(totals)[-2]
    halved = live.peak(live.full_bytes / 2)
    assert halved == live.peak(live.full_bytes) / 2
    owner = list(range(len(live.intervals)))
    peaks = live.own_peaks(owner)
    assert all(len(v) == 1 for v in peaks.values())  # a single value peaks alone
    together = live.own_peaks([0] * len(live.intervals))
    t = totals.argmax()
    assert set(together[0].tolist()) == set(live.live_at(int(t)).tolist())


def test_a_cheap_value_is_remade_in_its_fusible_readers():
    """``b = x + 1`` is kept only as long as a matmul reads it; read later by fusible ops
    only, it is not held in between (XLA's fusion computes it again there from ``x``, which
    is kept anyway). ``e = exp(x)`` is not cheap: it is held to its last reader."""
    from spmd.search.fusion import REMAKING

    def step(x, w):
        b = x + 1.0
        e = jnp.exp(x)
        m = b @ w  # a reader that cannot fuse b
        h = jnp.tanh(m) @ w
        return (h * b).sum() + (h * e).sum()  # b and e read again, by fusible ops

    g = build_graph(jax.make_jaxpr(step)(jnp.ones((8, 8)), jnp.ones((8, 8))))

    def spans(live: Liveness) -> dict[str, tuple[int, int]]:
        """Each primitive's first value's live range."""
        out: dict[str, tuple[int, int]] = {}
        for v, a, b in live.intervals:
            if g.nodes[v.node].kind == "op":
                out.setdefault(g.nodes[v.node].op.primitive, (a, b))
        return out

    first = spans(Liveness(g, donated=set()))
    remade = spans(Liveness(g, donated=set(), remaking=REMAKING))
    dots = [n.id for n in g.nodes if n.kind == "op" and n.op.primitive == "dot_general"]
    add = remade["add"]
    assert add[1] == dots[0] and first["add"][1] > dots[1]  # to the matmul, not beyond
    assert remade["exp"] == first["exp"] and first["exp"][1] > dots[1]


def test_a_chain_of_cheap_ops_from_one_value_is_remade_from_it():
    """GELU's backward reads ``3 * x**2``, made from the matmul's result ``x`` by two cheap
    ops: it is not held from the forward pass to there; ``x`` is, for as long as the
    readers that make it again need it (XLA's fusion: moe-tiny's experts on cpu-8)."""
    from spmd.search.fusion import REMAKING

    def step(a, w):
        x = a @ w
        slope = 3.0 * x ** 2  # read again by the backward's fusible ops only
        h = jnp.tanh(x) @ w
        return (h * slope).sum()

    g = build_graph(jax.make_jaxpr(step)(jnp.ones((64, 64)), jnp.ones((64, 64))))
    written = {v.node: (a, b) for v, a, b in Liveness(g, donated=set()).intervals}
    remade = {v.node: (a, b) for v, a, b in
              Liveness(g, donated=set(), remaking=REMAKING).intervals}
    x, dot2 = [n.id for n in g.nodes if n.kind == "op" and n.op.primitive == "dot_general"]
    slope = next(n.id for n in g.nodes if n.kind == "op" and n.op.primitive == "mul"
                 and n.operands[0] is None)
    last = written[slope][1]  # the product with h, where the backward reads it
    assert written[slope][0] == slope and last > dot2  # held across the matmul as written
    assert remade[slope][0] > remade[slope][1]  # never in memory: made where it is read
    # x held for it instead, to its reader (whose result may take x's place there)
    assert written[x][1] < dot2 <= remade[x][1] == last - 1


def test_a_product_of_broadcasts_is_remade_from_the_small_arrays_it_broadcasts():
    """A mask made by multiplying two broadcast vectors (moe-tiny's dispatch masks) holds
    more elements than it reads: XLA makes it again wherever it is read, so the two vectors
    are held, not the mask."""
    from spmd.search.fusion import REMAKING

    def step(x, w):
        rows, cols = x.sum(1), x.sum(0)  # small: what the mask is made of
        mask = rows[:, None] * cols[None, :]
        h = jnp.tanh(mask @ w) @ w
        return (h * mask).sum()  # the mask read again after both matmuls, by a fusible op

    g = build_graph(jax.make_jaxpr(step)(jnp.ones((64, 64)), jnp.ones((64, 64))))
    written = Liveness(g, donated=set())
    remade = Liveness(g, donated=set(), remaking=REMAKING)
    span = {v.node: (a, b) for v, a, b in remade.intervals}
    dot = next(n for n in g.nodes if n.kind == "op" and n.op.primitive == "dot_general")
    mask = dot.operands[0].node
    sums = [n.id for n in g.nodes if n.kind == "op" and n.op.primitive == "reduce_sum"][:2]
    last = {v.node: b for v, _, b in written.intervals}[mask]
    assert span[mask] == (mask, dot.id)  # in memory for the first matmul only
    assert all(span[s][1] == last - 1 for s in sums)  # the vectors, held for the last read
    assert remade.peak(remade.full_bytes) < written.peak(written.full_bytes)


def test_a_cheap_value_a_matmul_reads_last_does_not_hold_its_source_too():
    """``3 * x**2`` read last by a matmul stays in memory to it: ``x`` is not held for it
    as well (holding both put the peak above the step as written)."""
    from spmd.search.fusion import REMAKING

    def step(a, w):
        x = a @ w
        slope = 3.0 * x ** 2
        k = jnp.exp(jnp.tanh(x) @ w) @ w
        return (k @ slope).sum()  # slope's last reader: a matmul

    g = build_graph(jax.make_jaxpr(step)(jnp.ones((64, 64)), jnp.ones((64, 64))))
    written = Liveness(g, donated=set())
    remade = Liveness(g, donated=set(), remaking=REMAKING)
    assert remade.peak(remade.full_bytes) <= written.peak(written.full_bytes)


def test_a_chain_made_from_a_copy_between_memories_holds_the_copys_buffer():
    """On XLA:CPU a copy between memories is its operand's buffer (``forwarded``): a chain
    of cheap ops made from the copy holds that operand for its readers, as it would the
    copy (a sine stands for the copy here)."""
    from spmd.search.fusion import REMAKING
    from spmd.trace.graph import Value

    def step(a, w):
        x = a @ w
        c = jnp.sin(x)
        slope = 3.0 * c ** 2
        return ((jnp.tanh(c) @ w) * slope).sum()

    g = build_graph(jax.make_jaxpr(step)(jnp.ones((64, 64)), jnp.ones((64, 64))))
    sine = next(n.id for n in g.nodes if n.kind == "op" and n.op.primitive == "sin")
    copied = Liveness(g, donated=set(), remaking=REMAKING)
    forwarded = Liveness(g, donated=set(), remaking=REMAKING,
                         forwarded=frozenset({Value(sine, 0)}))
    x = g.nodes[sine].operands[0]
    held_copy = {v.node: b for v, _, b in copied.intervals}[sine]
    assert {v: b for v, _, b in forwarded.intervals}[x] == held_copy
    assert forwarded.peak(forwarded.full_bytes) == copied.peak(copied.full_bytes)


def test_on_xla_cpu_a_copy_between_memories_is_its_operands_buffer():
    """XLA:CPU's host memory is the devices': an offloaded step holds what the step as
    written holds there (its copies forwarded), and less on a GPU (its host values out)."""
    from spmd.memory.offload import OffloadPlan, host_values, memory_copies, offload

    def step(w, m, g):  # m: state updated in place (output 1 aliases input 1), read last
        u = jnp.tanh(jnp.exp(g) * w).sum(0)  # the peak: g's rows, before m is read
        m = 0.9 * m + u
        return w - m, m

    written = jax.make_jaxpr(step)(jnp.ones(1024), jnp.ones(1024), jnp.ones((8, 1024)))
    graph = build_graph(offload(written, OffloadPlan((1,)), {1: 1}))
    plain = Liveness(build_graph(written), donated={1})
    on_cpu = Liveness(graph, donated={1}, forwarded=memory_copies(graph))
    on_gpu = Liveness(graph, donated={1}, host=host_values(graph))
    assert len(memory_copies(graph)) == 2
    assert on_cpu.peak(on_cpu.full_bytes) == plain.peak(plain.full_bytes)
    assert on_gpu.peak(on_gpu.full_bytes) < plain.peak(plain.full_bytes)
