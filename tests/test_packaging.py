"""spmd installs like any package: the zoo as ``spmd.zoo`` (no top-level ``models`` beside the
user's own), the mesh files inside it, every subpackage in the wheel."""

import importlib.metadata
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_pyproject_lists_every_package():
    """packages.find cannot see a mapped package, so pyproject lists them: a new subpackage
    missing from the list would be missing from the wheel."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in ROOT.glob("spmd/**/__init__.py")}
    assert set(setuptools["packages"]) == on_disk | {"spmd.zoo"}
    assert setuptools["package-dir"] == {"spmd.zoo": "models"}
    assert setuptools["package-data"]["spmd"] == ["meshes/*.yaml"]


def test_installed_layout_from_another_directory(tmp_path):
    """Run where the checkout is not on sys.path (an empty cwd, no PYTHONPATH): the installed
    spmd has its zoo and bundled meshes, and ``import models`` finds nothing. Meaningful for
    an editable install too, whose import hook maps exactly the packages pyproject declares."""
    try:
        importlib.metadata.distribution("spmd")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("spmd is not installed in this interpreter (pip install -e .)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import importlib.util, spmd.zoo; from spmd.cluster.mesh import bundled_meshes; "
            "print(importlib.util.find_spec('models'), spmd.zoo.get('mlp-tiny').name, "
            "sorted(bundled_meshes())[:2])")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "mlp-tiny", "['a100-2x8',", "'a100-8']"], (
        f"{done.stdout!r}: a top-level `models` means a stale install; pip install -e . again")


def test_zoo_comes_from_the_same_checkout_as_spmd():
    """An editable install maps spmd.zoo to the models/ folder of the checkout it was made
    from: spmd imported from another checkout (a worktree on sys.path, the venv installed
    from the main one) would run that one's zoo silently."""
    import spmd
    import spmd.zoo

    here, zoo = pathlib.Path(spmd.__file__).parent, pathlib.Path(spmd.zoo.__file__).parent
    assert zoo in (here / "zoo", here.parent / "models"), (
        f"spmd from {here} but spmd.zoo from {zoo}: pip install -e . in {here.parent}")
