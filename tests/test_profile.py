"""`spmd profile`: measured figures, fitted to the cost model's formulas, as a mesh file."""

import dataclasses
import math

import jax
import numpy as np
import pytest

import spmd
from spmd.cli import main
from spmd.cluster.hardware import OP_RATE_KINDS
from spmd.cluster.mesh import make_mesh
from spmd.errors import MeshError, ProfileError
from spmd.kernel_timer import above_noise
from spmd.profile import LINK_KINDS, fit_link, profile_mesh

KIB = 1024


@pytest.fixture(scope="module")
def measured():
    """A 1x2 block of the test session's 8 CPU devices at three sizes (4 KiB, 1 and 4 MiB):
    the small one may be lost in the noise of a busy 2-core host (the suite's other tests,
    or CI), and is then dropped; the two large ones still grow with size (4 and 64 KiB
    alone did not, in full runs)."""
    mesh = spmd.load_mesh("cpu-8").submesh({"data": 1, "model": 2})
    return profile_mesh(mesh, sizes=(4 * KIB, 1024 * KIB, 4096 * KIB), quick=True, repeats=3)


def _positive_finite(value):
    return math.isfinite(value) and value > 0


def test_the_written_file_loads_as_the_measured_mesh(measured, tmp_path):
    path = tmp_path / "profiled.yaml"
    path.write_text(measured.yaml())
    loaded = spmd.load_mesh(path, virtual=True)  # 2 devices: not this session's 8
    assert dataclasses.replace(loaded, source=None, virtual=False) == measured.mesh()
    device = loaded.device
    assert device.name == "cpu-profiled"
    assert all(_positive_finite(v) for v in (device.peak_flops_bf16, device.peak_flops_fp32,
                                             device.memory_bandwidth, device.memory_bytes))
    assert device.memory_bytes == spmd.load_mesh("cpu-8").device.memory_bytes  # CPU: no stats
    assert device.kernel_overhead >= 0 and "measured by spmd profile" in device.source
    # quick sides 8 and 32 run batched (64 / side)^3 at once, each still one matmul's FLOPs
    assert [w for w, _ in device.matmul_curve] == [2.0 * side**3 for side in (8, 32, 128)]
    assert all(0 < f <= 1 for _, f in device.matmul_curve)
    assert dict(device.matmul_curve)[2.0 * 128**3] == 1.0  # the largest sets the rate
    assert 0 < device.transpose_fraction <= 1 and 0 < device.conv_fraction <= 1
    assert [kind for kind, _ in device.op_rates] == list(OP_RATE_KINDS)
    assert all(_positive_finite(rate) for _, rate in device.op_rates)
    assert (device.matmul_fraction, device.bandwidth_fraction) == (1.0, 1.0)  # all measured
    link = loaded.links["model"]
    assert _positive_finite(link.bandwidth) and link.latency >= 0
    assert loaded.links["data"] == measured.source.links["data"]  # size 1: not measured


def test_every_collective_is_fitted_with_sane_residuals(measured):
    fits = measured.collectives["model"]
    assert list(fits) == ["all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                          "collective-permute"]
    for fit in [*fits.values(), measured.links["model"]]:
        assert _positive_finite(fit.bandwidth) and fit.latency >= 0
        assert 0 <= fit.residual < 1  # few points: far from exact on a shared host, not wild
        assert all(_positive_finite(t) for _, t in fit.points)
    assert len(measured.links["model"].points) == sum(len(fits[k].points) for k in LINK_KINDS)
    assert all(len(fit.points) >= 2 for fit in fits.values())  # a lost size is dropped
    assert "data" not in measured.collectives


def test_the_file_says_how_and_where_it_was_measured(measured):
    text = measured.yaml()
    for expected in (f"jax {jax.__version__}", "platform cpu", "device kind cpu",
                     "simulated devices share this host's", "not a GPU",
                     "kernel overhead:", "transpose: a 128x128 fp32 matrix",
                     "(bundled cpu-8), ",
                     "convolution: 3x3, NHWC 4x8x8x64", "side below 64 run batched", "# model: 2 devices; link = joint fit of all-reduce "
                     "and all-gather", "#   reduce-scatter", "nothing crosses it"):
        assert expected in text, expected
    assert "axis model (2 devices)" in measured.summary()


def test_fit_recovers_latency_and_bandwidth_across_sizes():
    charged = np.array([4e3, 3.2e4, 2.6e5, 2e6, 1.6e7])
    seconds = 20e-6 + charged / 5e9
    latency, bandwidth, residual = fit_link(charged, seconds)
    assert latency == pytest.approx(20e-6) and bandwidth == pytest.approx(5e9)
    assert residual == pytest.approx(0, abs=1e-9)
    noisy = seconds * (1 + 0.05 * np.array([1, -1, 1, -1, 1]))
    latency, bandwidth, residual = fit_link(charged, noisy)
    assert latency == pytest.approx(20e-6, rel=0.1) and bandwidth == pytest.approx(5e9, rel=0.1)
    assert 0.01 < residual < 0.1


def test_fit_holds_latency_at_zero_and_refuses_flat_times():
    latency, bandwidth, _ = fit_link([1e3, 1e6], [1e-7, 1.1e-3])  # would fit alpha < 0
    assert latency == 0 and bandwidth > 0
    with pytest.raises(ProfileError, match="do not grow with bytes"):
        fit_link([1e3, 1e6], [2e-3, 1e-3])


def test_a_timing_lost_in_noise_runs_longer_until_it_is_not():
    """What ``Timer.loop`` and ``Timer.unrolled`` (the kernel overhead, matmuls) do with a
    difference not above 0: one of six profiles of one CPU device read an overhead of 0."""
    asked = []

    def timed(longer):
        asked.append(longer)
        return {1: 0.0, 4: -1e-7, 16: 3e-7}[longer]

    assert above_noise(timed) == 3e-7 and asked == [1, 4, 16]
    asked.clear()
    assert above_noise(lambda longer: asked.append(longer) or 2e-7) == 2e-7 and asked == [1]
    asked.clear()
    assert above_noise(lambda longer: asked.append(longer) or 0.0) == 0.0
    assert asked == [1, 4, 16]


def test_a_virtual_mesh_is_refused():
    with pytest.raises(MeshError, match="is virtual .* profile measures the devices present"):
        profile_mesh(make_mesh({"data": 8}, device="a100-40gb", virtual=True))


def _run(capsys, *argv):
    with pytest.raises(SystemExit) as done:
        main(list(argv))
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


def test_the_command_writes_the_file_and_prints_a_summary(capsys, tmp_path):
    path = tmp_path / "measured.yaml"
    code, out, err = _run(capsys, "profile", "--mesh", "cpu-8", "--quick", "--output", str(path))
    assert code == 0, err
    assert "device cpu-profiled: matmul bf16" in out and "axis model (4 devices)" in out
    assert f"wrote {path}: mesh cpu-8-profiled: 8 x cpu-profiled" in out
    assert spmd.load_mesh(path).shape == {"data": 2, "model": 4}


@pytest.mark.parametrize("mesh, message", [
    ("cpu-9", "cpu-9: no such mesh file, nor a bundled mesh name"),
    ("a100-8x8", "mesh 'a100-8x8' is virtual"),
])
def test_the_command_refuses_a_mesh_in_one_line(capsys, mesh, message):
    code, out, err = _run(capsys, "profile", "--mesh", mesh)
    assert code == 2 and "Traceback" not in out + err
    assert len(err.strip().splitlines()) == 1 and message in err, err
