"""Host offload chosen by the search (issue 14, item 3): the optimizer state kept in pinned
host memory between steps (``spmd.memory.offload``) when no sharding or remat fits the
budget. On CPU the memory kinds exist but host memory is the devices' own, so the checks are
that it runs, computes a single device's numbers, and that the compiled program holds the
offloaded arrays in host memory (layout ``S(5)``); the saving shows on a GPU."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx

import spmd
from spmd import zoo
from spmd.memory.offload import OffloadPlan
from spmd.plan import Plan
from spmd.planner import score_manual
from spmd.runtime.compile import prepare

BATCH = 8


@pytest.fixture(scope="module")
def mlp():
    """mlp-small at a small batch: its activations are tiny beside its weights and Adam's
    moments, so recomputing them saves little and the state is what memory holds."""
    spec = zoo.get("mlp-small")
    mesh = spmd.load_mesh("cpu-8")
    abstract = (*nnx.eval_shape(spec.training_state), spec.batch(BATCH))
    fsdp = spmd.plan(spec.train_step, *abstract, mesh=mesh, method="fsdp")
    lean = score_manual(fsdp.bound_signature(), mesh, "fsdp", spmd.SearchOptions())
    return spec, mesh, abstract, lean.prediction.memory_bytes


def test_under_a_budget_only_offload_meets_the_state_goes_to_host_memory(mlp):
    spec, mesh, abstract, fsdp_bytes = mlp
    # planned under 0.8 x fsdp's (the budget less the headroom): below every sharding's,
    # with or without remat
    budget = 0.8 * fsdp_bytes / (1 - spmd.SearchOptions.memory_headroom)
    options = spmd.SearchOptions(cache=False, time_limit=2.0, memory_budget=budget)
    step = spmd.parallelize(spec.train_step, mesh=mesh, options=options)
    model, opt = spec.training_state()
    want_model, want_opt = spec.training_state()
    for seed in range(2):  # the second step reads the state from host memory
        batch = spec.batch(BATCH, seed)
        got = step(model, opt, batch)
        want = nnx.jit(spec.train_step)(want_model, want_opt, batch)
        np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-6)
    plan = step.plan
    assert plan.offload is not None and plan.offload.active and plan.remat is None
    assert {plan.leaves[i].kind for i in plan.offload.inputs} == {"optimizer"}
    assert plan.prediction.memory_bytes <= budget and plan.prediction.transfer_time > 0
    assert any(q["offload"] != "none" and q["fits"] for q in plan.search["remat_probes"])
    for a, b in zip(jax.tree.leaves(nnx.state(opt)), jax.tree.leaves(nnx.state(want_opt))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    held = {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(opt)) if x.ndim}
    assert held == {"pinned_host"}
    # XLA holds them in host memory, in and out: S(5) in the entry layout
    text = step.compile(model, opt, spec.batch(BATCH)).as_text()
    entry = re.search(r"entry_computation_layout=\{(.*)\}", text).group(1)
    assert entry.count("S(5)") == 2 * len(plan.offload.inputs)
    assert "offloaded: optimizer state (16 arrays) in pinned host memory" in plan.describe()


def test_a_budget_not_even_remat_and_offload_meet_names_both(mlp):
    spec, mesh, abstract, fsdp_bytes = mlp
    options = spmd.SearchOptions(cache=False, compare=False, time_limit=1.0,
                                 memory_budget=0.3 * fsdp_bytes)
    with pytest.raises(spmd.InfeasibleError, match="even with every layer's activations "
                       "recomputed.* and the optimizer state \\(16 arrays\\) in pinned host "
                       "memory: the least peak memory"):
        spmd.plan(spec.train_step, *abstract, mesh=mesh, options=options)


def test_no_host_link_no_offload(mlp):
    """A device whose host link is not known (host_bandwidth 0) offloads nothing."""
    spec, mesh, abstract, fsdp_bytes = mlp
    unlinked = dataclasses.replace(mesh, device=dataclasses.replace(mesh.device,
                                                                    host_bandwidth=0.0))
    options = spmd.SearchOptions(cache=False, compare=False, time_limit=1.0,
                                 memory_budget=0.8 * fsdp_bytes)
    with pytest.raises(spmd.InfeasibleError) as err:
        spmd.plan(spec.train_step, *abstract, mesh=unlinked, options=options)
    assert "pinned host memory" not in str(err.value)


def test_the_plan_saves_and_loads_its_offload(mlp, tmp_path):
    spec, mesh, abstract, _ = mlp
    plan = spmd.plan(spec.train_step, *abstract, mesh=mesh, method="fsdp")
    moved = dataclasses.replace(plan, offload=OffloadPlan((9, 10)))
    moved.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json", mesh)
    assert loaded.offload == OffloadPlan((9, 10))
    bound = dataclasses.replace(loaded, signature=plan.bound_signature())
    kinds = [s.memory_kind for s in bound.input_shardings_flat()]
    assert kinds[9] == kinds[10] == "pinned_host" and kinds[8] in (None, "device")
    out = [s.memory_kind for s in bound.output_shardings_flat() if s is not None]
    assert out.count("pinned_host") == 2
    assert prepare(bound).lower() is not None
