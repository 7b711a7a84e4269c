"""The stage search's dynamic program (``spmd.stages.dp``) on layer costs worked out by hand:
Alpa's objective over layer ranges, memory under the schedule's microbatches in flight, and
stages that recompute their forward pass only where they must."""

import pytest

from spmd.stages.dp import best_partition
from spmd.stages.price import StageCost, combine
from spmd.stages.schedule import schedule
from spmd.trace.graph import Value

MB = 2**20


def _layer(k: int, residuals: float = 100 * MB, sent: float = 10 * MB) -> StageCost:
    """Layer ``k``: 1 ms forward, 2 ms backward, 50 MiB of state, ``residuals`` per
    microbatch, and the activation it receives from layer ``k - 1`` (``sent`` bytes)."""
    received = ((Value(k, 0), k - 1, sent),) if k else ()
    return StageCost(forward=1e-3, backward=2e-3, update=0.1e-3, params=10 * MB,
                     state=30 * MB, sums=10 * MB, residuals=residuals, work=20 * MB,
                     update_work=5 * MB, sent_forward=sent, sent_backward=sent, comm=0.0,
                     forward_comm=0.0, first_layer=k, received=received)


def test_a_recomputing_range_keeps_only_what_it_received_and_runs_its_forward_again():
    layers = [_layer(k) for k in range(4)]
    kept = combine(layers[1:3], None, first=False, last=False)
    redone = combine(layers[1:3], None, first=False, last=False, recompute=True)
    assert not kept.recompute and redone.recompute
    assert kept.residuals == 200 * MB and redone.residuals == 10 * MB  # layer 0's activation
    assert redone.backward == pytest.approx(kept.backward + kept.forward)
    # one microbatch's forward values all live again in the backward task
    assert redone.work == pytest.approx(kept.work + 200 * MB - 10 * MB)
    assert redone.memory(4) < kept.memory(4)
    assert redone.memory(1) == pytest.approx(kept.memory(1))  # one in flight: no saving


def test_only_the_stages_over_the_budget_recompute():
    """1F1B on 2 stages of 2 layers holds 2 microbatches on stage 0 and 1 on stage 1: under a
    budget between stage 0's memory with and without recompute, stage 0 alone recomputes."""
    layers = [_layer(k) for k in range(4)]
    sched = schedule("1f1b", 2, 4)
    plain = [combine(layers[:2], None, True, False), combine(layers[2:], None, False, True)]
    first = [c.memory(sched.in_flight(s)) for s, c in enumerate(plain)]
    assert first[0] > first[1]
    budget = (first[0] + first[1]) / 2
    found = best_partition(layers, sched, None, budget)
    assert found is not None and found.starts == (0, 2)
    assert found.recompute == (True, False)
    assert all(c.memory(sched.in_flight(s)) <= budget for s, c in enumerate(found.costs))
    # with room for both, neither recomputes (it costs time)
    assert best_partition(layers, sched, None, 2 * first[0]).recompute == (False, False)
    # and below what recomputing every stage holds, no cut fits
    assert best_partition(layers, sched, None, 100 * MB) is None
