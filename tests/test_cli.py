"""The command line: user errors are one message with exit status 2, never a traceback."""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from spmd.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(capsys, *argv):
    with pytest.raises(SystemExit) as done:
        main(list(argv))
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


@pytest.mark.parametrize("argv, message", [
    (["run", "--model", "gpt-huge"], "unknown model 'gpt-huge'"),
    (["run", "--method", "magic", "--steps", "1"], "unknown method 'magic'; valid methods"),
    (["run", "--mesh", "does/not/exist.yaml"], "does/not/exist.yaml: no such mesh file"),
    (["plan", "--mesh", "cpu-9"], "cpu-9: no such mesh file, nor a bundled mesh name; "
                                  "bundled: a100-2x8,"),
    (["run", "--method", "tp", "--batch-size", "12", "--model", "mlp-tiny", "--steps", "1"],
     None),
    (["plan", "--model", "gpt-125m", "--mesh", "a100-2x8", "--method", "tp"],
     "attn/bk: dimension 0 \\(heads, size 12\\) is not divisible by mesh axes \\(.model.,\\)"),
    (["launch", "-n", "2"], "give the command to launch"),
    (["run", "--mesh", "a100-8"], "mesh 'a100-8' .* is for 8 GPUs but no GPU is present"),
])
def test_user_errors_print_one_line(capsys, argv, message):
    code, out, err = _run(capsys, *argv)
    if message is None:  # tp with a batch not divisible by 'data' is fine: batch replicated
        assert code == 0, err
        return
    assert code == 2
    assert "Traceback" not in err + out
    assert re.search(message, err), err


@pytest.mark.parametrize("argv, message", [
    (["run", "--bogus"], "error: No such option: --bogus \\(see `spmd run --help`\\)"),
    (["bogus"], "error: No such command 'bogus' \\(see `spmd --help`\\)"),
    (["plan", "--steps", "3"], "No such option: --steps"),
    (["run", "--steps", "abc"], "Invalid value for '--steps'"),
    (["run", "--steps", "0"], "Invalid value for '--steps'"),
])
def test_usage_errors_print_one_line(capsys, argv, message):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and "Traceback" not in out + err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_usage_error_from_the_console_script_has_no_traceback(tmp_path):
    """The real entry point, in a process of its own, run from an empty directory."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout, installed or not
    done = subprocess.run([sys.executable, "-m", "spmd.cli", "run", "--bogus"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "error: No such option: --bogus (see `spmd run --help`)"


def test_no_arguments_show_the_help(capsys):
    code, out, _ = _run(capsys)
    assert code == 0 and "Usage: spmd" in out and "plan" in out


def test_bad_batch_split_names_tensor_dimension_and_axes(capsys):
    code, _, err = _run(capsys, "run", "--model", "mlp-tiny", "--batch-size", "12",
                        "--method", "dp", "--steps", "1")
    assert code == 2
    assert "batch/x: dimension 0 (batch, size 12) is not divisible by mesh axes" in err


def test_malformed_mesh_file(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("device: cpu\naxes: {data: 8\n")
    code, _, err = _run(capsys, "run", "--mesh", str(path))
    assert code == 2 and f"{path}: malformed YAML" in err


def test_run_reports_losses_speed_and_collectives(capsys, tmp_path):
    out_json = tmp_path / "run.json"
    code, out, err = _run(capsys, "run", "--model", "mlp-tiny", "--steps", "3",
                          "--method", "dp_tp", "--output-json", str(out_json))
    assert code == 0, err
    assert "samples/s" in out and "all-reduce" in out
    # a hand-written plan is scored under run's options, so it has a prediction to compare
    assert re.search(r"step time: measured [\d.]+ ms, predicted [\d.e+-]+ ms "
                     r"\(M/P = [\d.e+]+\)", out), out
    result = json.loads(out_json.read_text())
    assert len(result["losses"]) == 3 and result["losses"][2] < result["losses"][0]
    assert result["fresh_host_bytes_per_step"] >= 0  # counted (Linux), in bytes


def test_models_and_meshes_list(capsys):
    code, out, _ = _run(capsys, "models")
    assert code == 0 and "gpt-13b" in out and "wresnet-tiny" in out
    code, out, _ = _run(capsys, "meshes")
    assert code == 0 and "a100-2x8: virtual mesh a100-2x8: 16 x a100-40gb" in out


def test_meshes_lists_a_folder_of_ones_own(capsys, tmp_path):
    (tmp_path / "mine.yaml").write_text("device: cpu\nplatform: cpu\naxes: {data: 4}\n"
                                        "links: {intra_host: {bandwidth: 1e9, latency: 0}}\n")
    code, out, _ = _run(capsys, "meshes", "--directory", str(tmp_path))
    assert code == 0 and "cpu-8: " in out and f"{tmp_path / 'mine.yaml'}: virtual mesh mine" in out
    code, _, err = _run(capsys, "meshes", "--directory", str(tmp_path / "empty"))
    assert code == 2 and "no mesh files (*.yaml) there" in err


def test_plan_for_a_cluster_that_is_not_here(capsys, tmp_path):
    """64 virtual A100s planned on this CPU box, saved as JSON and loaded back."""
    import spmd
    from spmd.plan import Plan

    saved = tmp_path / "plan.json"
    code, out, err = _run(capsys, "plan", "--model", "gpt-125m", "--mesh", "a100-8x8",
                          "--method", "fsdp", "--batch-size", "64", "--save", str(saved))
    assert code == 0, err
    assert "virtual mesh a100-8x8: 64 x a100-40gb" in out
    plan = Plan.load(saved, spmd.load_mesh("a100-8x8", virtual=True))
    specs = {leaf.path: spec for leaf, spec in zip(plan.leaves, plan.input_specs)}
    assert specs["model/blocks/0/mlp/wi"] == (("data", "model"), ())


def test_plan_compile_checks_a_gpu_plan_on_cpu_devices(capsys, tmp_path):
    """`spmd plan --compile`: the plan for 8 virtual A100s compiled on the 8 CPU devices the
    test session has, its collectives and memory shown beside the prediction (the CPU's
    all-reduce + slice read as the GPU's reduce-scatter), and saved with the plan."""
    saved = tmp_path / "plan.json"
    code, out, err = _run(capsys, "plan", "--model", "gpt-tiny", "--mesh", "a100-8",
                          "--time-limit", "2", "--compile", "--save", str(saved))
    assert code == 0, err
    assert "HLO MiB" in out and "XLA:GPU" in out and "peak memory" in out
    found = re.search(r"compiled on 8 simulated CPU devices \(XLA:CPU, shapes only\) in \d+ s: "
                      r"([\d.]+) (KiB|MiB) per device \(arguments \+ temporaries\); predicted "
                      r"[\d.]+ (KiB|MiB) \(compiled / predicted = ([\d.]+)\)", out)
    assert found, out
    assert 0.85 <= float(found.group(4)) <= 1.15  # the memory benchmark's target
    assert "the plan priced as XLA:CPU runs it" in out
    assert "device memory 37.25 GiB: the compiled step fits" in out
    measured = json.loads(saved.read_text())["measured"]
    assert measured["memory"]["temp_bytes"] > 0 and measured["platform"] == "gpu"


def test_plan_compile_checks_a_one_program_pipeline_and_says_why_not_an_mpmd_one(capsys):
    """The SPMD runtime's pipeline is one program: compiled and read against its predicted
    peak; the MPMD runtime's programs are compiled when it runs, and the check says so."""
    code, out, err = _run(capsys, "plan", "--model", "gpt-tiny-scan", "--mesh", "cpu-pp",
                          "--method", "pp_tp", "--compile")
    assert code == 0, err
    found = re.search(r"compiled on 8 simulated CPU devices .* per device \(arguments \+ "
                      r"temporaries\); predicted .* \(compiled / predicted = ([\d.]+)\)", out)
    assert found and 0.85 <= float(found.group(1)) <= 1.15, out
    code, out, err = _run(capsys, "plan", "--model", "gpt-tiny", "--mesh", "cpu-pp",
                          "--method", "pp_dp", "--compile")
    assert code == 0, err
    assert "--compile: not compiled: this pipeline runs a program per stage and phase" in out


def test_compile_check_names_what_does_not_fit_and_xla_cpus_order():
    from spmd.analysis.verify import CompileCheck, describe_check
    from spmd.search.predict import Prediction

    gib = 2**30
    as_cpu = Prediction(compute_time=1.0, comm_time=0.2, memory_bytes=31 * gib,
                        collectives={}, objective=1.2)
    check = CompileCheck(devices=8, seconds=130.0, compiled_bytes=42 * gib,
                         predicted_bytes=31 * gib, as_cpu=as_cpu,
                         device_bytes=40e9, gpu_mesh=True)
    text = describe_check(check)
    assert not check.fits
    assert "compiled / predicted = 1.35" in text and "compiled / that = 1.35" in text
    assert "device memory 37.25 GiB: the compiled step needs 4.75 GiB more" in text
    assert "breadth-first" in text and "whose memory only their own compile checks" in text
    near = dataclasses.replace(check, compiled_bytes=32 * gib)
    assert near.fits and "breadth-first" not in describe_check(near)
    unpriced = dataclasses.replace(check, predicted_bytes=None, as_cpu=None)
    assert "temporaries); no prediction" in describe_check(unpriced)


def test_compare_judges_auto_against_every_compiled_hand_written_plan(capsys, tmp_path):
    """`spmd compare` plans, compiles auto and each hand-written plan (the 8 CPU devices the
    test session has), and prints what each predicted and compiled to, and the criteria."""
    out_json = tmp_path / "compare.json"
    code, out, err = _run(capsys, "compare", "--model", "mlp-tiny", "--time-limit", "2",
                          "--output-json", str(out_json))
    assert code == 0, err
    for needle in ("auto", "dp_tp", "fsdp", "HLO MiB", "criteria: A PASS", "C PASS"):
        assert needle in out
    record = json.loads(out_json.read_text())
    from spmd.analysis.verify import judge

    verdict = judge(record)
    assert verdict["A"] and verdict["C"]
    assert record["manual"]["ep"]["applicable"] is False
    assert record["manual"]["dp"]["total_collective_bytes"] > 0


OWN_STEP = '''
import jax
import jax.numpy as jnp
import optax
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(16, 32, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


def train_step(model, optimizer, batch):
    def loss_fn(model):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return {"loss": loss}


def create():
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)


def batch():
    x = jax.random.normal(jax.random.key(1), (16, 16))
    return {"x": x, "y": jnp.sin(x[:, :1])}


def make():
    return train_step, (*create(), batch())


def make_abstract():
    return train_step, (*nnx.eval_shape(create), jax.eval_shape(batch))


def sgd_step(params, batch):
    def loss_fn(params):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), {"loss": loss}


def make_functional():
    return sgd_step, ({"w": jnp.zeros((16, 1))}, batch())


def make_stateless():
    return (lambda params, batch: {"loss": sgd_step(params, batch)[1]["loss"]},
            ({"w": jnp.zeros((16, 1))}, batch()))


def make_nothing():
    return 3


not_a_function = 3
'''


@pytest.fixture
def own_step(tmp_path, monkeypatch):
    """A module of the user's own in the current directory (``mine.py``), which `--step`
    makes importable; sys.path and sys.modules are restored afterwards."""
    (tmp_path / "mine.py").write_text(OWN_STEP)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])  # as a script
    yield tmp_path
    sys.modules.pop("mine", None)


@pytest.mark.parametrize("ref", ["mine:make", "mine:make_functional"])
def test_run_trains_ones_own_step(capsys, own_step, ref):
    """An NNX step updates its model in place; a functional one gets its new state back."""
    out_json = own_step / "run.json"
    code, out, err = _run(capsys, "run", "--step", ref, "--steps", "4", "--time-limit", "2",
                          "--output-json", str(out_json))
    assert code == 0, err
    assert f"step {ref}; method auto" in out and "step time: measured" in out
    losses = json.loads(out_json.read_text())["losses"]
    assert len(losses) == 4 and losses[3] < losses[0]


def test_plan_ones_own_step_from_abstract_arguments(capsys, own_step):
    code, out, err = _run(capsys, "plan", "--step", "mine:make_abstract", "--method", "dp")
    assert code == 0, err
    assert out.startswith("step mine:make_abstract\n") and "dp" in out


@pytest.mark.parametrize("argv, message", [
    (["run", "--step", "mine:make", "--model", "mlp-tiny"], "--model and --step are mutually "
                                                            "exclusive"),
    (["plan", "--step", "mine:make", "--batch-size", "8"], "--batch-size sizes a zoo model's"),
    (["run", "--step", "mine"], "--step 'mine': expected module:function"),
    (["run", "--step", "nowhere.mod:make"], "--step nowhere.mod:make: cannot import module "
                                            "'nowhere.mod' \\(No module named 'nowhere'\\)"),
    (["plan", "--step", "mine:missing"], "module 'mine' \\(.*mine.py\\) has no attribute "
                                         "'missing'; expected a function returning"),
    (["plan", "--step", "mine:not_a_function"], "has a non-callable 'not_a_function'"),
    (["plan", "--step", "mine:make_nothing"], "make_nothing\\(\\) returned int; expected "
                                              "\\(step_fn, args\\)"),
    (["run", "--step", "mine:make_abstract"], "returned abstract arguments"),
    (["run", "--step", "mine:make_stateless", "--steps", "2", "--method", "dp"],
     "the step takes no NNX model or optimizer, so `spmd run` needs it to return "
     "\\(new_state, metrics\\)"),
])
def test_own_step_errors_name_the_culprit(capsys, own_step, argv, message):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and "Traceback" not in out + err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err
