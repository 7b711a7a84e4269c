"""Mesh files, programmatic meshes and their error messages."""

import dataclasses
from pathlib import Path

import pytest

import spmd
from spmd.cluster.mesh import bundled_meshes, mesh_yaml
from spmd.errors import MeshError


@pytest.mark.parametrize("name", bundled_meshes())
def test_every_shipped_mesh_loads(name):
    mesh = spmd.load_mesh(name, virtual=True)
    assert mesh.size == mesh.hosts * (mesh.size // mesh.hosts)
    assert set(mesh.links) == set(mesh.axis_names)
    assert mesh.device.memory_bytes > 0


def test_bundled_meshes_load_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert spmd.load_mesh("cpu-8.yaml", virtual=True).name == "cpu-8"
    assert {"cpu-8", "cpu-2x4", "a100-2x8", "a100-8x8"} <= set(bundled_meshes())


def test_a_file_of_the_same_name_wins_over_the_bundled_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a100-8.yaml").write_text(GOOD + "name: mine\n")
    assert spmd.load_mesh("a100-8.yaml", virtual=True).name == "mine"
    assert spmd.load_mesh("a100-8", virtual=True).name == "a100-8"  # no such file: bundled


@pytest.mark.parametrize("given", ["cpu-9", "no/such/cpu-8.yaml"])
def test_unknown_mesh_names_what_was_given_and_the_bundled_names(given):
    with pytest.raises(MeshError, match=f"{given}: no such mesh file, nor a bundled mesh "
                                        "name; bundled: a100-2x8, .*cpu-8"):
        spmd.load_mesh(given)


def test_inner_axes_get_the_fast_link():
    mesh = spmd.load_mesh("a100-2x8", virtual=True)
    assert mesh.shape == {"data": 2, "model": 8}
    assert mesh.links["model"].bandwidth == 300e9  # NVLink inside a host
    assert mesh.links["data"].bandwidth == 25e9  # InfiniBand between hosts
    assert mesh.link(("data", "model")).bandwidth == 25e9


def test_cpu_mesh_gives_jax_mesh_with_auto_axes():
    from jax.sharding import AxisType

    mesh = spmd.load_mesh("cpu-8")
    jm = mesh.jax_mesh()
    assert dict(jm.shape) == {"data": 2, "model": 4}
    assert all(t == AxisType.Auto for t in jm.axis_types)


def test_make_mesh_per_axis_links():
    mesh = spmd.make_mesh({"data": 2, "model": 4}, bandwidth={"data": 25e9, "model": 300e9},
                          latency={"data": 5e-6, "model": 1e-6}, device="a100-40gb")
    assert mesh.links["model"].latency == 1e-6
    assert mesh.device.name == "a100-40gb"
    with pytest.raises(MeshError, match="missing \\['model'\\]"):
        spmd.make_mesh({"data": 2, "model": 4}, bandwidth={"data": 1e9})


def _write(tmp_path, text):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    return path


GOOD = """
device: a100-40gb
links: {intra_host: {bandwidth: 3.0e+11, latency: 1.0e-6}}
axes: {data: 2, model: 4}
"""


def test_numbers_written_without_dot_parse(tmp_path):
    mesh = spmd.load_mesh(_write(tmp_path, GOOD.replace("3.0e+11", "300e9")), virtual=True)
    assert mesh.links["data"].bandwidth == 300e9


@pytest.mark.parametrize("text, message", [
    ("axes: [1, 2", "malformed YAML"),
    (GOOD + "colour: blue\n", "unknown key\\(s\\) \\['colour'\\]"),
    (GOOD.replace("device: a100-40gb\n", ""), "missing key 'device'"),
    (GOOD.replace("a100-40gb", "tpu-v9"), "unknown device 'tpu-v9'"),
    (GOOD.replace("model: 4", "model: four"), "axes.model: expected a number"),
    (GOOD + "hosts: 3\n", "hosts x devices_per_host"),
    (GOOD.replace("bandwidth: 3.0e+11, ", ""), "missing keys \\['bandwidth'\\]"),
])
def test_bad_mesh_files_name_file_and_key(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(MeshError, match=message) as err:
        spmd.load_mesh(path, virtual=True)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("name", bundled_meshes())
def test_mesh_yaml_reads_back_equal(tmp_path, name):
    """Every axis written with its own link, so a multi-host mesh needs no links section."""
    mesh = spmd.load_mesh(name, virtual=True)
    text = mesh_yaml(mesh, header=["a note"], notes={mesh.axis_names[0]: ["outer"]})
    assert text.startswith("# a note\n") and "  # outer\n" in text and "links:" not in text
    again = spmd.load_mesh(_write(tmp_path, text), virtual=True)
    assert dataclasses.replace(again, source=None, distributed=None) == dataclasses.replace(
        mesh, source=None, distributed=None)


def test_names_that_yaml_would_misread_are_quoted(tmp_path):
    mesh = spmd.make_mesh({"data": 2}, device={"name": "true", "peak_flops_bf16": 1e12,
                                               "peak_flops_fp32": 1e12, "memory_bytes": 2**30,
                                               "memory_bandwidth": 1e11}, name="a: b")
    again = spmd.load_mesh(_write(tmp_path, mesh_yaml(mesh)), virtual=True)
    assert (again.name, again.device.name) == ("a: b", "true")


def _cpu_mesh(tmp_path, devices):
    return _write(tmp_path, GOOD.replace("a100-40gb", "cpu").replace(
        "axes: {data: 2, model: 4}", f"axes: {{data: 2, model: {devices // 2}}}\nplatform: cpu"))


def test_size_mismatch_names_both_numbers(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")  # no count asked
    path = _cpu_mesh(tmp_path, 4)
    with pytest.raises(MeshError, match=f"mesh 'm' \\(from {path}\\) needs 4 CPU devices but "
                                        "jax already started with 8"):
        spmd.load_mesh(path)


@pytest.mark.parametrize("flags", ["--xla_force_host_platform_device_count=2",
                                   "--xla_force_host_platform_device_count=16 --foo=1"])
def test_a_different_count_in_xla_flags_is_refused_not_overridden(tmp_path, monkeypatch, flags):
    monkeypatch.setenv("XLA_FLAGS", flags)
    want = flags.split()[0].split("=")[1]
    with pytest.raises(MeshError, match=f"mesh 'cpu-8' .* needs 8 CPU devices but XLA_FLAGS sets "
                                        f"--xla_force_host_platform_device_count={want}; set it "
                                        "to 8, or remove it"):
        spmd.load_mesh("cpu-8")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert spmd.load_mesh("cpu-8").size == 8  # the same count is fine


def test_gpu_mesh_on_cpu_box_is_refused_unless_virtual():
    with pytest.raises(MeshError, match="mesh 'a100-8' .* is for 8 GPUs but no GPU is present "
                                        "\\(JAX_PLATFORMS is 'cpu'\\); .*virtual=True.*spmd plan"):
        spmd.load_mesh("a100-8", virtual=False)
    virtual = spmd.load_mesh("a100-8", virtual=True)
    assert virtual.jax_mesh().devices.size == 8  # compile-only checks on simulated devices


def test_gpu_mesh_made_in_code_is_refused_where_a_plan_needs_its_devices():
    mesh = spmd.make_mesh({"data": 8}, device="a100-40gb")  # pricing it needs no GPU
    assert mesh.platform == "gpu" and not mesh.virtual
    with pytest.raises(MeshError, match="needs 8 gpu devices .* sees 0 gpu device\\(s\\); no GPU "
                                        "is present; to plan for it here, load it with virtual"):
        mesh.sharding_mesh()
    assert spmd.make_mesh({"data": 64}, device="a100-40gb", virtual=True).sharding_mesh().size == 64


def test_gpu_check_starts_no_backend(tmp_path):
    """Without JAX_PLATFORMS, the check reads the installed plugins (none on a CPU box), and
    a CPU mesh loaded after it still gets its device count."""
    import importlib.metadata
    import importlib.util
    import os
    import subprocess
    import sys

    if (importlib.util.find_spec("jax_plugins") is not None
            or importlib.metadata.entry_points(group="jax_plugins")):
        pytest.skip("a jax GPU plugin is installed here")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    code = ("import jax, spmd\n"
            "try:\n    spmd.load_mesh('a100-8')\nexcept spmd.MeshError as err:\n    print(err)\n"
            "spmd.load_mesh('cpu-8'); print(len(jax.devices()))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no GPU is present (no jax GPU plugin is installed" in done.stdout
    assert done.stdout.split()[-1] == "8"
