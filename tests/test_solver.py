"""The intra-op integer program on hand-written cost matrices."""

import itertools
import math
import time

import numpy as np
import pytest

from spmd.errors import InfeasibleError, PlanError
from spmd.options import SolverOptions
from spmd.solver import SolverRequest, evaluate, memory_peak, reduce, rescale, solve, validate
from spmd.solver.cpsat import OutOfTime, build
from spmd.solver.eliminate import eliminate
from spmd.solver.fit_seed import fitting_seed
from spmd.solver.local_search import local_search
from spmd.solver.min_sum import min_sum_seed

INF = float("inf")


def request(node_costs, edges=(), edge_costs=(), same_as=None, node_memory=None, liveness=(),
            memory_budget=None, warm_start=None, time_limit=10.0):
    n = len(node_costs)
    return SolverRequest(
        node_names=[f"n{i}" for i in range(n)],
        strategy_names=[[f"s{j}" for j in range(len(c))] for c in node_costs],
        node_costs=[list(c) for c in node_costs], edges=list(edges),
        edge_costs=[[list(r) for r in m] for m in edge_costs],
        same_as=list(same_as) if same_as is not None else [-1] * n,
        node_memory=node_memory or [[0.0] * len(c) for c in node_costs],
        liveness=[list(s) for s in liveness], memory_budget=memory_budget,
        warm_start=warm_start, time_limit=time_limit)


def brute_force(req):
    """Best admissible assignment by enumeration (tiny requests only)."""
    best = (INF, None)
    for choice in itertools.product(*[range(len(c)) for c in req.node_costs]):
        if any(s != -1 and choice[v] != choice[s] for v, s in enumerate(req.same_as)):
            continue
        if req.memory_budget is not None and memory_peak(req, choice) > req.memory_budget:
            continue
        best = min(best, (evaluate(req, choice), list(choice)))
    return best


SWAP = [[0.0, 3.0], [3.0, 0.0]]  # resharding between two specs costs 3


def test_chain_prefers_consistent_specs():
    # a prefers s0 slightly, b and c prefer s1 by more: all choose s1, no resharding
    req = request([[1.0, 1.5], [2.0, 0.5], [2.0, 0.5]], [(0, 1), (1, 2)], [SWAP, SWAP])
    res = solve(req)
    assert res.choice == [1, 1, 1]
    assert res.status == "optimal" and not res.timed_out
    assert res.objective == pytest.approx(2.5) == evaluate(req, res.choice)
    assert res.bound == pytest.approx(res.objective)  # a chain: the bound is exact
    assert res.num_variables > 0


def test_diamond_matches_brute_force():
    rng = np.random.default_rng(1)
    costs = [rng.uniform(0, 1, 3).tolist() for _ in range(4)]
    edges = [(0, 1), (0, 2), (1, 3), (2, 3)]
    mats = [rng.uniform(0, 2, (3, 3)).tolist() for _ in edges]
    req = request(costs, edges, mats)
    res = solve(req)
    value, choice = brute_force(req)
    assert res.objective == pytest.approx(value, rel=1e-5)
    assert evaluate(req, res.choice) == res.objective


def test_random_small_graphs_match_brute_force():
    rng = np.random.default_rng(7)
    for trial in range(5):
        n = 5
        ks = rng.integers(1, 4, n)
        costs = [rng.uniform(0, 1, k).tolist() for k in ks]
        edges = [(i, j) for i in range(n) for j in range(i + 1, n) if rng.uniform() < 0.5]
        mats = [rng.uniform(0, 1, (ks[u], ks[v])).tolist() for u, v in edges]
        req = request(costs, edges, mats)
        res = solve(req)
        assert res.objective == pytest.approx(brute_force(req)[0], rel=1e-5), trial


def test_large_matrices_use_row_constraints_and_stay_exact():
    # 6 x 6 matrices with distinct rows exceed MARGINAL_LIMIT: the enforced-row formulation
    rng = np.random.default_rng(3)
    costs = [rng.uniform(0, 1, 6).tolist() for _ in range(3)]
    edges = [(0, 1), (1, 2), (0, 2)]
    mats = [rng.uniform(0, 1, (6, 6)).tolist() for _ in edges]
    req = request(costs, edges, mats)
    assert solve(req).objective == pytest.approx(brute_force(req)[0], rel=1e-5)


def test_same_as_shares_one_choice():
    # Two repeated layers; alone, layer 2 would prefer s0, but it must follow layer 1.
    req = request([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [2.0, 0.0]],
                  [(0, 1), (1, 2), (2, 3)], [SWAP, SWAP, SWAP], same_as=[-1, -1, 0, 1])
    res = solve(req)
    assert res.choice[2] == res.choice[0] and res.choice[3] == res.choice[1]
    value, choice = brute_force(req)
    assert res.objective == pytest.approx(value)
    # chains of same_as resolve to the first representative
    req.same_as = [-1, -1, 0, 2]
    res = solve(req)
    assert res.choice[0] == res.choice[2] == res.choice[3]


def test_single_strategy_endpoints_and_zero_edges_fold():
    req = request([[1.0], [0.0, 0.0], [0.5, 0.0]], [(0, 1), (1, 2)],
                  [[[2.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]])
    res = solve(req)
    assert res.choice == [0, 1, 1] and res.objective == pytest.approx(1.0)


def test_forbidden_pairs_and_strategies():
    # the cheap pair (s0, s0) is forbidden; s1 of node 1 is forbidden
    req = request([[0.0, 1.0], [0.0, INF, 0.5]], [(0, 1)],
                  [[[INF, 1.0, 0.2], [0.0, 5.0, 5.0]]])
    res = solve(req)
    assert res.choice == [0, 2]
    assert res.objective == pytest.approx(0.7)
    assert math.isfinite(res.objective)
    # nothing allowed: infeasible, and the message says why
    req = request([[0.0], [0.0]], [(0, 1)], [[[INF]]])
    with pytest.raises(InfeasibleError, match="forbidden"):
        solve(req)


def test_memory_budget_forces_smaller_strategy():
    # s0 fast but big (replicated), s1 slower and small (sharded)
    mem = [[8e9, 1e9], [8e9, 1e9]]
    req = request([[0.0, 1.0], [0.0, 1.0]], [(0, 1)], [SWAP], node_memory=mem,
                  liveness=[[0, 1]], memory_budget=10e9)
    res = solve(req)
    assert memory_peak(req, res.choice) <= 10e9
    assert res.objective == pytest.approx(brute_force(req)[0])
    req.memory_budget = 3e9
    res = solve(req)
    assert res.choice == [1, 1] and res.objective == pytest.approx(2.0)
    req.memory_budget = None
    assert solve(req).choice == [0, 0]


def test_memory_priced_as_time_makes_a_fitting_start_from_the_cheapest():
    """Four nodes live together, each fast and big (10 bytes) or slower and small; the
    budget holds two big ones. From the fast plan (40 bytes), pricing the set's memory makes
    a fitting plan that keeps the node whose small strategy costs most; the solver's optimum
    switches the two cheapest."""
    slower = [1.0, 2.0, 4.0, 100.0]
    req = request([[10.0, 10.0 + c] for c in slower], node_memory=[[10.0, 0.0]] * 4,
                  liveness=[[0, 1, 2, 3]], memory_budget=25.0)
    seeding = reduce(req).pairwise(split=False)
    fast = [0, 0, 0, 0]
    assert memory_peak(req, fast) > 25.0
    fit = fitting_seed(req, seeding, fast, lambda c: evaluate(req, c), time.perf_counter() + 5)
    assert fit is not None and memory_peak(req, fit) <= 25.0
    assert fit[3] == 0  # the expensive one stays big
    best = solve(req)
    assert best.choice == [1, 1, 0, 0] and best.objective == pytest.approx(brute_force(req)[0])
    # nothing to price without a budget
    req.memory_budget = None
    assert fitting_seed(req, seeding, fast, lambda c: evaluate(req, c),
                        time.perf_counter() + 5) is None


def test_per_set_rows_charge_a_node_what_is_live_at_that_point():
    """Node 1 stands for two values: 6e9 live at the first point, 1e9 at the second. At its
    own peak (node_memory) it overflows the second set too; per set it fits unsharded."""
    mem = [[4e9, 1e9], [6e9], [4e9, 1e9]]
    req = request([[0.0, 1.0], [0.0], [0.0, 1.0]], node_memory=mem,
                  liveness=[[0, 1], [1, 2]], memory_budget=8e9)
    assert solve(req).choice == [1, 0, 1]  # own peaks: 6e9 + 4e9 > 8e9 in both sets
    req.liveness_memory = [[[4e9, 1e9], [6e9]], [[1e9], [4e9, 1e9]]]
    res = solve(req)
    assert res.choice == [1, 0, 0] and memory_peak(req, res.choice) == 7e9
    assert res.objective == pytest.approx(brute_force(req)[0])
    assert SolverRequest.from_json(req.to_json()) == req
    req.liveness_memory[1].pop()
    with pytest.raises(PlanError, match="liveness set 1 needs one row per member"):
        validate(req)


def test_only_liveness_sets_that_can_exceed_the_budget_become_constraints():

    # set {0, 1} fits 10e9 even at its largest (8e9 + 1e9): no terms; set {1, 2} can
    # exceed it (1e9 + 16e9) and must push node 2 to its small strategy.
    mem = [[8e9, 8e9], [1e9, 1e9], [16e9, 2e9]]
    req = request([[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]], [(0, 1), (1, 2)], [SWAP, SWAP],
                  node_memory=mem, liveness=[[0, 1], [1, 2]], memory_budget=10e9)
    prob = reduce(req)
    scaled = rescale(prob.unary, prob.pairs, [])
    built = build(req, prob, scaled, with_memory=True, objective=True)
    unbounded = build(req, prob, scaled, with_memory=False, objective=True)
    assert built.num_constraints == unbounded.num_constraints + 1
    res = solve(req)
    assert res.choice[2] == 1 and memory_peak(req, res.choice) <= 10e9
    assert res.objective == pytest.approx(brute_force(req)[0])


def test_a_copy_counts_where_readers_on_both_sides_of_its_point_want_it():
    """Node 0 makes a value in spec a (s0) or b (s1); readers 1 (before the point) and 2
    (after it) read it in a (s0) or b (s1). The copy in b of a value made in a (6e9) is live
    at the point only when both readers want b; the fastest plan (0 in a, readers in b) holds
    it, so under a budget the solver pays a reshard-free slower plan instead."""
    copy = (0, [[0.0, 6e9], [5e9, 0.0]], [(1, [0, 1])], [(2, [0, 1])])
    req = request([[0.0, 4.0], [1.0, 0.0], [1.0, 0.0]], node_memory=[[1e9, 1e9], [0.0, 0.0],
                                                                      [0.0, 0.0]],
                  liveness=[[0]])
    req.liveness_memory = [[[1e9, 1e9]]]
    req.liveness_copies = [[copy]]
    validate(req)
    assert solve(req).choice == [0, 1, 1]
    assert memory_peak(req, [0, 1, 1]) == 7e9 and memory_peak(req, [0, 1, 0]) == 1e9
    assert memory_peak(req, [1, 0, 0]) == 6e9  # made in b, both want a: a's copy, 5e9
    req.memory_budget = 3e9
    res = solve(req)
    assert memory_peak(req, res.choice) <= 3e9
    assert res.choice in ([0, 1, 0], [0, 0, 1]) and res.objective == pytest.approx(1.0)
    assert res.objective == pytest.approx(brute_force(req)[0])
    assert SolverRequest.from_json(req.to_json()) == req
    req.liveness_copies = [[(0, [[0.0, 6e9]], [(1, [0, 1])], [(2, [0, 1])])]]
    with pytest.raises(PlanError, match="liveness set 0's copy 0: needs one row of bytes "
                                        "per strategy of node 0"):
        validate(req)
    req.liveness_copies = [[(0, copy[1], [(1, [0, 2])], [(2, [0, 1])])]]
    with pytest.raises(PlanError, match="reader 1 names a target outside"):
        validate(req)


def test_infeasible_memory_states_the_minimum():
    mem = [[8e9, 1e9], [8e9, 3e9], [4e9, 2e9]]
    req = request([[0.0, 1.0]] * 3, [(0, 1), (1, 2)], [SWAP, SWAP], node_memory=mem,
                  liveness=[[0, 1], [1, 2]], memory_budget=2e9)
    with pytest.raises(InfeasibleError) as err:
        solve(req)
    msg = str(err.value)
    # least peak: max(1e9 + 3e9, 3e9 + 2e9) = 5e9 bytes
    assert "5000000000 bytes" in msg and "remat" in msg and "devices" in msg


def test_a_warm_started_search_out_of_time_returns_its_best_seed_timed_out():
    """50 ms for a 300-node request with cycles: no seed is proven optimal (gap 0), there is
    no time to write the CP-SAT model, so the best seed, no worse than the warm start, comes
    back marked timed out, its objective its exact cost."""
    req = _random_request(n=300, edges=450, seed=5, time_limit=0.05)
    hand = [0] * 300
    req.warm_start = hand
    start = time.perf_counter()
    res = solve(req, SolverOptions(gap=0.0))
    assert time.perf_counter() - start < 1.0
    assert res.timed_out and res.status == "feasible" and not res.stalled
    assert res.objective <= evaluate(req, hand)
    assert res.objective == pytest.approx(evaluate(req, res.choice))
    assert res.bound < res.objective


def test_a_model_not_written_in_time_leaves_the_best_seed_timed_out():
    """Writing the CP-SAT model counts against the limit: past its deadline the best seed
    is returned, marked timed out, instead of solving beyond the limit."""

    req = _random_request(n=300, edges=450, seed=5, time_limit=0.5)
    prob = reduce(req)
    scaled = rescale(prob.unary, prob.pairs, [c for c, _ in prob.charges])
    with pytest.raises(OutOfTime):
        build(req, prob, scaled, with_memory=True, objective=True,
              deadline=time.perf_counter() - 1)
    # no seed may end the search early (gap 0); the model is due at the start (share 1)
    res = solve(req, SolverOptions(gap=0.0, solve_share=1.0))
    assert res.timed_out and not res.stalled and res.num_constraints == 0
    assert res.objective == pytest.approx(evaluate(req, res.choice))
    assert res.bound <= res.objective < evaluate(req, [0] * 300)


def test_json_round_trip():
    req = request([[0.0, INF], [1.0, 2.0]], [(0, 1)], [[[0.0, INF], [1.0, 2.0]]],
                  node_memory=[[1.0, 2.0], [3.0, 4.0]], liveness=[[0, 1]],
                  memory_budget=10.0, warm_start=[0, 0], time_limit=3.0)
    back = SolverRequest.from_json(req.to_json())
    assert back == req
    assert solve(back).choice == solve(req).choice


@pytest.mark.parametrize("mutate,match", [
    (lambda r: r.node_costs.pop(), "node_costs has 1 entries for 2 nodes"),
    (lambda r: r.node_costs[1].append(0.0), "node 1 \\('n1'\\) has 2 strategies but 3 node_costs"),
    (lambda r: r.edges.__setitem__(0, (0, 5)), "edge 0 \\(0, 5\\)"),
    (lambda r: r.edge_costs.__setitem__(0, [[0.0]]), "edge 0 node 0 .* needs a 2 x 2"),
    (lambda r: r.same_as.__setitem__(1, 1), "same_as 1 is not another node"),
    (lambda r: r.liveness.append([0, 9]), "liveness set 0 names unknown nodes \\[9\\]"),
    (lambda r: setattr(r, "warm_start", [0, 3]), "warm_start: node 1 \\('n1'\\) has no strategy 3"),
    (lambda r: setattr(r, "memory_budget", -1.0), "memory_budget must be positive"),
    (lambda r: r.node_memory[0].__setitem__(0, -1.0), "node 0 .* negative"),
])
def test_validate_names_the_fault(mutate, match):
    req = request([[0.0, 1.0], [0.0, 1.0]], [(0, 1)], [SWAP])
    validate(req)
    mutate(req)
    with pytest.raises(PlanError, match=match):
        validate(req)


def test_validate_detects_same_as_cycles_and_mismatch():
    req = request([[0.0, 1.0]] * 3, same_as=[1, 2, 0])
    with pytest.raises(PlanError, match="cycle"):
        validate(req)
    req = request([[0.0, 1.0], [0.0, 1.0, 2.0]], same_as=[-1, 0])
    with pytest.raises(PlanError, match="its same_as"):
        validate(req)


def test_rescale_keeps_tiny_costs_and_forbids_inf():
    s = rescale([[0.0, 1e-12, 1.0, INF]])
    assert s.unary[0].tolist() == [0, 1, 1_000_000, -1]
    assert s.offset == 0.0 and s.scale == pytest.approx(1e6)
    s = rescale([[2.0, 2.0]], {(0, 1): [[5.0, 7.0], [INF, 5.0]]})
    assert s.offset == pytest.approx(7.0)
    assert s.pairs[(0, 1)].tolist() == [[0, 1_000_000], [-1, 0]]


def test_evaluate_and_memory_peak():
    req = request([[1.0, 2.0], [3.0, 4.0]], [(0, 1)], [SWAP], node_memory=[[1.0, 2.0], [4.0, 8.0]],
                  liveness=[[0], [0, 1]])
    assert evaluate(req, [0, 1]) == pytest.approx(1.0 + 4.0 + 3.0)
    assert memory_peak(req, [1, 1]) == 10.0
    with pytest.raises(PlanError, match="2 entries|has no strategy"):
        evaluate(req, [0, 2])


# -- scale ---------------------------------------------------------------------------------


def _random_request(n, edges, seed, time_limit, labels=8, keep=0.8):
    """A planner-like graph: strategies are specs (labels), resharding depends only on the
    (producer spec, consumer spec) pair; equal specs and slicing from replicated (label 0)
    are free; consumers mostly want what they produce; chain plus short skip edges."""
    rng = np.random.default_rng(seed)
    ks = rng.integers(4, 31, n)
    out = [rng.integers(0, labels, k) for k in ks]
    inn = [np.where(rng.uniform(size=k) < keep, o, rng.integers(0, labels, k))
           for o, k in zip(out, ks)]
    C = rng.choice([0.5, 1.0], (labels, labels))
    C[0, :] = 0
    np.fill_diagonal(C, 0)
    costs = [(rng.uniform(1e-4, 1e-3) * (1 + rng.uniform(0, 0.5, k))).tolist() for k in ks]
    E = [(i - 1, i) for i in range(1, n)]
    while len(E) < edges:
        v = int(rng.integers(2, n))
        E.append((max(0, v - int(rng.integers(2, 7))), v))
    mats = [(rng.uniform(1e-4, 1e-3) * C[out[u]][:, inn[v]]).tolist() for u, v in E]
    mem = [rng.uniform(1e6, 1e8, k).tolist() for k in ks]
    return SolverRequest([f"n{i}" for i in range(n)], [[f"s{j}" for j in range(k)] for k in ks],
                         costs, E, mats, [-1] * n, mem, [], None, None, time_limit)


def test_large_request_solves_in_seconds():
    req = _random_request(n=2000, edges=3000, seed=0, time_limit=10.0)
    start = time.perf_counter()
    res = solve(req)
    elapsed = time.perf_counter() - start
    print(f"\n2000 nodes / 3000 edges: {elapsed:.1f} s, status {res.status}, "
          f"objective {res.objective:.5f}, bound {res.bound:.5f}, {res.num_variables} variables")
    assert elapsed < 1.2 * req.time_limit  # the limit holds, model writing included
    assert res.objective == pytest.approx(evaluate(req, res.choice))
    # better than the trivial plan "everyone takes strategy 0"
    assert res.objective < evaluate(req, [0] * 2000)


def test_local_search_moves_tied_chains_and_repairs_a_warm_start():
    """Three nodes that must agree (``inf`` off the diagonal): switching one or two of them is
    forbidden, so greedy and pairwise moves stay at cost 3; the spanning-tree dynamic program
    moves the chain at once to the optimum 2. A forbidden warm start is repaired the same way."""

    tie = [[0.0, INF], [INF, 0.0]]
    req = request([[0.0, 1.0], [0.0, 1.0], [3.0, 0.0]], edges=[(0, 1), (1, 2)],
                  edge_costs=[tie, tie])
    prob = reduce(req)
    deadline = time.perf_counter() + 5.0
    assert local_search(prob, deadline) == [1, 1, 1]
    assert local_search(prob, deadline, start=[0, 1, 0]) == [1, 1, 1]
    req.warm_start = [0, 1, 0]  # forbidden pairs: only its repaired version is a seed
    res = solve(req)
    assert res.choice == [1, 1, 1] and res.objective == pytest.approx(2.0)


def test_min_sum_seed_sees_a_choice_that_pays_off_far_downstream():
    """A ladder (each node joined to the next two) whose first node is a tie and whose last
    node prefers the other strategy: greedy takes strategy 0 everywhere and no local move
    escapes (a chain moved alone still mismatches the skip edges: 2 x 1 per rung, while the
    last node's preference is 1.5), the trap of the token embedding's tie on gpt-1.3b.
    Messages carry the last node's preference back to the tie: all 1, cost 0."""

    n = 12
    mismatch = [[0.0, 1.0], [1.0, 0.0]]
    edges = [(i, i + k) for k in (1, 2) for i in range(n - k)]
    req = request([[0.0, 0.0]] * (n - 1) + [[1.5, 0.0]], edges=edges,
                  edge_costs=[mismatch] * len(edges))
    prob = reduce(req)
    deadline = time.perf_counter() + 5.0
    assert evaluate(req, local_search(prob, deadline)) == pytest.approx(1.5)
    seed = min_sum_seed(prob, deadline)
    assert seed.choice == [1] * n and evaluate(req, seed.choice) == 0.0
    assert solve(req).objective == 0.0


def test_diffusion_bounds_every_plan_and_proves_trees_optimal():
    """The bound is below the brute-force optimum on graphs with cycles and forbidden pairs,
    and meets it on a tree (where the LP relaxation is exact), which then needs no CP-SAT."""

    rng = np.random.default_rng(3)
    for trial in range(6):
        n = 6
        edges = [(i, i + 1) for i in range(n - 1)] + ([(0, 3), (2, 5)] if trial % 2 else [])
        mats = [rng.uniform(0, 2, (3, 3)) for _ in edges]
        mats[0][0, 1] = INF
        req = request([rng.uniform(0, 1, 3).tolist() for _ in range(n)], edges,
                      [m.tolist() for m in mats])
        best, _ = brute_force(req)
        dual = min_sum_seed(reduce(req), time.perf_counter() + 5.0)
        assert dual.bound <= best + 1e-12
        if trial % 2 == 0:  # a chain
            assert dual.bound == pytest.approx(best) and evaluate(req, dual.choice) == best
            res = solve(req)
            assert res.status == "optimal" and res.bound_from == "diffusion"
            assert res.num_constraints == 0 and res.objective == pytest.approx(best)


def test_elimination_leaves_the_core_and_completes_its_plans_exactly():
    """A complete graph of 4 groups (degree 3: the core) with a chain hanging off group 0
    (4 - 5, group 5 a leaf), a single-strategy group 6 joined to three core groups, and an
    isolated group 7: groups 4 to 7 leave, and every plan of the core completes to the best
    plan of the whole problem that agrees with it on the core. Diffusion over that core
    bounds the whole problem's optimum."""
    rng = np.random.default_rng(11)
    core_edges = list(itertools.combinations(range(4), 2))
    edges = core_edges + [(0, 4), (4, 5), (1, 6), (2, 6), (3, 6)]
    sizes = [3, 3, 2, 3, 3, 2, 1, 3]
    req = request([rng.uniform(0, 1, k).tolist() for k in sizes], edges,
                  [rng.uniform(0, 2, (sizes[a], sizes[b])).tolist() for a, b in edges])
    prob = reduce(req)
    own = [u.astype(float) for u in prob.unary]
    pairs = {key: m.astype(float) for key, m in prob.pairs.items()}
    exact = eliminate(own, pairs)
    assert exact.core == [0, 1, 2, 3] and set(pairs) == set(core_edges)
    every = list(itertools.product(*[range(k) for k in sizes]))
    for core_plan in itertools.product(*[range(sizes[g]) for g in range(4)]):
        completed = exact.complete(list(core_plan) + [-1] * 4)
        best = min(evaluate(req, c) for c in every if c[:4] == core_plan)
        assert evaluate(req, completed) == pytest.approx(best)
        reduced = (exact.offset + sum(own[g][k] for g, k in enumerate(core_plan))
                   + sum(m[core_plan[a], core_plan[b]] for (a, b), m in pairs.items()))
        assert reduced == pytest.approx(best)  # the core's costs are the completions'
    optimum, _ = brute_force(req)
    dual = min_sum_seed(prob, time.perf_counter() + 5.0)
    assert dual.bound <= optimum + 1e-12


def test_a_charge_is_paid_once_however_many_strategies_incur_it():
    """Two nodes may each emit a collective (strategy 0) whose latency, 1.0, XLA pays once
    for both, or avoid it for 0.6 each: emitting in both costs 1.0 in all, not 2.0, so it
    wins over 1.2; emitting in one costs 1.6. The seeds see the charge spread evenly."""
    req = request([[0.0, 0.6], [0.0, 0.6]])
    req.charges = [(1.0, [(0, 0), (1, 0)])]
    assert evaluate(req, [0, 0]) == pytest.approx(1.0)
    assert evaluate(req, [0, 1]) == pytest.approx(1.6)
    assert evaluate(req, [1, 1]) == pytest.approx(1.2)
    res = solve(req)
    assert res.choice == [0, 0] and res.objective == pytest.approx(1.0)
    assert SolverRequest.from_json(req.to_json()).charges == [(1.0, [(0, 0), (1, 0)])]
    req.charges = [(1.0, [(0, 5)])]
    with pytest.raises(PlanError, match="charge 0 names strategy 5 of node 0"):
        validate(req)


# -- fan-outs: a value resharded once per target ----------------------------------------------


def test_diffusion_warm_started_from_another_problems_messages_still_bounds_every_plan():
    """Messages of one problem moved onto another of the same graph (other costs) keep every
    plan's total there: the bound stays below its optimum, and a converged start is kept."""
    rng = np.random.default_rng(5)
    edges = [(i, i + 1) for i in range(5)] + [(0, 3), (2, 5)]

    def random_req():
        return request([rng.uniform(0, 1, 3).tolist() for _ in range(6)], edges,
                       [rng.uniform(0, 2, (3, 3)).tolist() for _ in edges])

    for _ in range(4):
        first, second = random_req(), random_req()
        dual = min_sum_seed(reduce(first), time.perf_counter() + 5.0)
        warm = min_sum_seed(reduce(second), time.perf_counter() + 5.0, messages=dual.messages)
        best, _ = brute_force(second)
        assert warm.bound <= best + 1e-12
        again = min_sum_seed(reduce(first), time.perf_counter() + 5.0, messages=dual.messages)
        assert again.bound >= dual.bound - 1e-12  # it starts where the first one ended


def _fanout_request():
    """A producer (2 specs: target 0 free from spec 0, target 1 free from spec 1) read by
    three consumers that each pick a target (strategy k wants target k). Resharding to a
    target the producer does not hold costs 3.0, once, however many consumers want it;
    consumers 1 and 2 prefer target 1 by 1.0 each, consumer 0 prefers target 0 by 2.5."""
    req = request([[0.0, 0.0], [0.0, 2.5], [1.0, 0.0], [1.0, 0.0]])
    req.fanouts = [(0, [[0.0, 3.0], [3.0, 0.0]], [(1, [0, 1]), (2, [0, 1]), (3, [0, 1])])]
    return req


def test_a_fanout_pays_each_distinct_target_once():
    req = _fanout_request()
    assert evaluate(req, [0, 0, 0, 0]) == pytest.approx(2.0)  # all at target 0: no reshard
    assert evaluate(req, [0, 0, 1, 1]) == pytest.approx(3.0)  # target 1 once, for two
    assert evaluate(req, [1, 0, 1, 1]) == pytest.approx(3.0)  # target 0 once, for one
    assert evaluate(req, [1, 1, 1, 1]) == pytest.approx(2.5)
    best, choice = brute_force(req)
    res = solve(req, SolverOptions(gap=0.0))
    assert res.objective == pytest.approx(best) and evaluate(req, res.choice) == pytest.approx(best)
    assert res.bound <= best + 1e-12
    back = SolverRequest.from_json(req.to_json())
    assert back.fanouts == [(0, [[0.0, 3.0], [3.0, 0.0]], [(1, [0, 1]), (2, [0, 1]), (3, [0, 1])])]
    assert evaluate(back, choice) == pytest.approx(best)


def test_fanouts_fold_and_their_split_form_bounds_every_plan():
    req = _fanout_request()
    prob = reduce(req)
    assert len(prob.fanouts) == 1  # three consumer groups: a true fan-out
    lower, upper = prob.pairwise(split=True), prob.pairwise(split=False)
    for choice in itertools.product(range(2), repeat=4):
        exact = evaluate(req, choice)
        assert lower.total(list(choice)) <= exact + 1e-12 <= upper.total(list(choice)) + 1e-12
    # read by one other group only, it folds into an edge, exactly
    one = request([[0.0, 0.0], [0.0, 1.0]])
    one.fanouts = [(0, [[0.0, 3.0], [3.0, 0.0]], [(1, [0, 1]), (1, [1, 0])])]
    folded = reduce(one)
    assert not folded.fanouts and (0, 1) in folded.pairs
    for choice in itertools.product(range(2), repeat=2):
        assert folded.total(list(choice)) == pytest.approx(evaluate(one, choice))


@pytest.mark.parametrize("mutate,match", [
    (lambda r: r.fanouts.append((9, [[0.0]], [(1, [0])])), "fan-out 1: producer 9"),
    (lambda r: r.fanouts.append((0, [[0.0]], [(1, [0, 0])])), "one row per strategy"),
    (lambda r: r.fanouts.append((0, [[0.0], [-1.0]], [(1, [0, 0])])), "finite and non-negative"),
    (lambda r: r.fanouts.append((0, [[0.0], [0.0]], [(1, [0])])), "one target per strategy"),
    (lambda r: r.fanouts.append((0, [[0.0], [0.0]], [(1, [0, 4])])), "outside the 1 columns"),
])
def test_validate_names_a_bad_fanout(mutate, match):
    req = _fanout_request()
    validate(req)
    mutate(req)
    with pytest.raises(PlanError, match=match):
        validate(req)
