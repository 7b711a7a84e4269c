"""Checkpoints across plans and meshes: a state saved under one plan on one mesh resumes under
another plan on another mesh with the losses of an uninterrupted run (fp32), its arrays read
straight into the new plan's shardings; a checkpoint of another model is refused, naming the
tensor, and left as it was."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmd import zoo
import spmd
from spmd.cli import main

SPEC = zoo.get("mlp-tiny")  # compiles in a second; gpt-tiny where attention's shards matter
GPT = zoo.get("gpt-tiny")
BATCHES = [SPEC.batch(8, seed) for seed in range(6)]  # one batch per step, the same in every run


def create():
    return SPEC.training_state(0)


def _mesh(data: int, model: int) -> spmd.DeviceMesh:
    return spmd.make_mesh({"data": data, "model": model})


def _step_and_plan(method: str, mesh: spmd.DeviceMesh, spec: zoo.ModelSpec = SPEC):
    step = spmd.parallelize(spec.train_step, mesh=mesh, method=method)
    return step, step.plan_for(*nnx.eval_shape(spec.training_state), spec.batch(8))


def _train(step, model, optimizer, batches) -> list[float]:
    return [float(step(model, optimizer, b)["loss"]) for b in batches]


@pytest.fixture(scope="module")
def straight_losses() -> list[float]:
    """Six steps under dp on 1x8, never interrupted."""
    step, plan = _step_and_plan("dp", _mesh(1, 8))
    return _train(step, *spmd.materialize(create, plan), BATCHES)


@pytest.mark.parametrize("first, second", [
    (("fsdp", (2, 4)), ("dp_tp", (1, 8))),
    (("dp_tp", (1, 8)), ("fsdp", (4, 2))),
], ids=["fsdp-2x4-to-dp_tp-1x8", "dp_tp-1x8-to-fsdp-4x2"])
def test_resuming_under_another_plan_and_mesh_continues_the_curve(tmp_path, straight_losses,
                                                                  first, second):
    step, plan = _step_and_plan(first[0], _mesh(*first[1]))
    model, optimizer = spmd.materialize(create, plan)
    losses = _train(step, model, optimizer, BATCHES[:3])
    spmd.save_checkpoint(tmp_path / "ck", model, optimizer)
    del model, optimizer

    step, plan = _step_and_plan(second[0], _mesh(*second[1]))
    model, optimizer = spmd.restore_checkpoint(tmp_path / "ck", create, plan)
    assert int(optimizer.step[...]) == 3  # AdamW's count came back with the moments
    losses += _train(step, model, optimizer, BATCHES[3:])
    np.testing.assert_allclose(losses, straight_losses, rtol=1e-4)


def test_restored_arrays_are_equal_and_sharded_as_the_target_plan(tmp_path):
    _, source = _step_and_plan("fsdp", _mesh(2, 4), GPT)
    saved = spmd.materialize(GPT.training_state, source)
    spmd.save_checkpoint(tmp_path / "ck", *saved)
    spmd.save_checkpoint(tmp_path / "ck", *saved)  # over the first: replaced, one kept
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["1"]

    _, target = _step_and_plan("dp_tp", _mesh(1, 8), GPT)
    restored = spmd.restore_checkpoint(tmp_path / "ck", GPT.training_state, target)
    want = jax.tree.leaves(nnx.state(saved))
    got = jax.tree.leaves(nnx.state(restored))
    shardings = target.input_shardings_flat()[: len(got)]
    assert len(got) == len(want) == target.bound_signature().num_state_leaves
    for g, w, s in zip(got, want, shardings):
        assert np.array_equal(np.asarray(g), np.asarray(w))
        assert g.sharding.spec == s.spec and g.sharding.mesh.shape == s.mesh.shape
    wi = restored[0].blocks[0].mlp.wi[...]  # Megatron's column split of the FFN's input
    assert wi.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert dict(wi.sharding.mesh.shape) == {"data": 1, "model": 8}
    assert wi.addressable_shards[0].data.shape == (wi.shape[0], wi.shape[1] // 8)


def _listing(directory):
    return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in directory.rglob("*"))


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(tmp_path):
    _, plan = _step_and_plan("dp", _mesh(2, 4))
    spmd.save_checkpoint(tmp_path / "ck", *spmd.materialize(create, plan))
    before = _listing(tmp_path / "ck")
    other = zoo.get("mlp-small")
    _, other_plan = _step_and_plan("dp_tp", _mesh(1, 8), other)
    with pytest.raises(spmd.CheckpointError,
                       match=r"tensor 0/layers/0/bias is \(256,\) float32 in the checkpoint, "
                             r"\(2048,\) float32 from create_fn \(23 more tensors differ\)"):
        spmd.restore_checkpoint(tmp_path / "ck", other.training_state, other_plan)
    with pytest.raises(spmd.PlanError, match="pass the plan of this step"):
        spmd.restore_checkpoint(tmp_path / "ck", create, other_plan)  # the plan of another model
    assert _listing(tmp_path / "ck") == before


def test_no_checkpoint_is_told_and_refused(tmp_path):
    assert not spmd.is_checkpoint(tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()  # asking creates nothing
    _, plan = _step_and_plan("dp", _mesh(2, 4))
    with pytest.raises(spmd.CheckpointError, match="no checkpoint here"):
        spmd.restore_checkpoint(tmp_path / "nothing", create, plan)


def keyed_step(params, keys, batch):
    """A functional step: plain pytrees in, with typed PRNG keys (one per example)."""
    noise = jax.vmap(lambda k: jax.random.normal(k, batch["x"].shape[1:]))(keys)
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch["x"] + noise) @ p["w"]))(params)
    new_keys = jax.vmap(lambda k: jax.random.split(k)[0])(keys)
    return {"w": params["w"] - 0.1 * grads["w"]}, new_keys, {"loss": loss}


def test_plain_pytrees_and_typed_keys_round_trip(tmp_path):
    params = {"w": jnp.linspace(-1.0, 1.0, 64 * 32).reshape(64, 32)}
    keys = jax.random.split(jax.random.key(3), 8)
    batch = {"x": jnp.ones((8, 64))}
    names = {"w": ("embed", "mlp")}
    source = spmd.plan(keyed_step, params, keys, batch, mesh=_mesh(2, 4), method="fsdp",
                       logical_axes=names)
    params, keys = jax.device_put((params, keys), source.in_shardings[:2])
    assert params["w"].sharding.spec == jax.sharding.PartitionSpec(("data", "model"))
    spmd.save_checkpoint(tmp_path / "ck", params, keys)

    target = spmd.plan(keyed_step, params, keys, batch, mesh=_mesh(4, 2), method="tp",
                       logical_axes=names)
    got_params, got_keys = spmd.restore_checkpoint(tmp_path / "ck", lambda: (params, keys),
                                                   target)
    assert np.array_equal(got_params["w"], params["w"])
    assert got_params["w"].sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert dict(got_params["w"].sharding.mesh.shape) == {"data": 4, "model": 2}
    assert got_keys.dtype == keys.dtype
    assert np.array_equal(jax.random.key_data(got_keys), jax.random.key_data(keys))


def _cli_losses(capsys, tmp_path, name, *argv) -> tuple[list[float], str]:
    out_json = tmp_path / f"{name}.json"
    with pytest.raises(SystemExit) as done:
        main(["run", "--model", "mlp-tiny", "--steps", "2", "--output-json", str(out_json),
              *argv])
    out = capsys.readouterr()
    assert done.value.code == 0, out.err
    import json
    return json.loads(out_json.read_text())["losses"], out.out


def test_cli_resumes_from_its_checkpoint_and_saves_over_it(capsys, tmp_path):
    """`spmd run` reuses one batch every step: 4 straight steps vs 2 saved (fsdp) + 2
    resumed (dp_tp) on the same batch, the resumed run's losses the straight run's last two."""
    straight, _ = _cli_losses(capsys, tmp_path, "a", "--steps", "4", "--method", "dp")
    ck = str(tmp_path / "ck")
    first, out = _cli_losses(capsys, tmp_path, "b", "--method", "fsdp", "--checkpoint", ck)
    assert "resumed" not in out and f"saved {ck}" in out
    second, out = _cli_losses(capsys, tmp_path, "c", "--method", "dp_tp", "--checkpoint", ck)
    assert f"resumed from {ck} (optimizer step 2)" in out and f"saved {ck}" in out
    np.testing.assert_allclose(first, straight[:2], rtol=1e-4)
    np.testing.assert_allclose(second, straight[2:], rtol=1e-4)
    assert second[0] != first[0]
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["1"]
