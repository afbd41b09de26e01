"""Packaging: `dist/` is a package here, and building archives must never write into it."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from tests.helpers.checkout import copy_checkout


def _snapshot(folder):
    return sorted(
        (p.relative_to(folder).as_posix(), p.stat().st_size)
        for p in folder.rglob("*")
        if p.is_file()
    )


def test_bdist_wheel_and_sdist_leave_dist_package_alone(tmp_path):
    repo = copy_checkout(tmp_path / "repo")
    before = _snapshot(repo / "dist")
    for cmd in (["bdist_wheel"], ["sdist"]):
        p = subprocess.run(
            [sys.executable, "setup.py", "-q", *cmd],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr[-2000:]
    assert _snapshot(repo / "dist") == before, "an archive was written into the dist/ package"
    wheels = list((repo / "build" / "wheels").glob("hf_pipeline-*.whl"))
    assert len(wheels) == 1 and list((repo / "build" / "wheels").glob("hf_pipeline-*.tar.gz"))
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "dist/coordinator.py" in names and "hf_pipeline/build/prepare.py" in names
    assert "hf_pipeline/_configs/demo.yaml" in names and not any(
        n.startswith("configs/") for n in names
    )
    assert not any(n.startswith("tests/") for n in names)


def test_configs_available_without_a_checkout(tmp_path, monkeypatch):
    """Installed from a wheel there is no configs/ folder: the demo defaults still load."""
    from hf_pipeline import config

    monkeypatch.setattr(config, "CONFIG_DIR", tmp_path / "missing")
    cfg = config.load_config(None, environ={})
    assert cfg.name == "demo" and cfg.data.shards == "demo" and cfg.encoder.model == "minilm"


@pytest.mark.slow  # a wheel built and installed into a fresh venv (3-8 s)
def test_a_wheel_installed_in_a_fresh_venv_carries_the_configs(tmp_path):
    """`pip install .` (not -e) installs `configs/*.yaml` with the package: a bare name
    and the default load from any folder, and the command runs a bundled config."""
    repo = copy_checkout(tmp_path / "repo", benchmarks=False)
    pip = [sys.executable, "-m", "pip"]
    p = subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(tmp_path / "wheels"), str(repo)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    (wheel,) = (tmp_path / "wheels").glob("hf_pipeline-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    p = subprocess.run(
        [*pip, "--python", str(py), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    # The heavy dependencies from this venv, after the wheel's own site-packages (a .pth
    # appends): its hf_pipeline wins, and this venv's editable finder is not installed.
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "zz_borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "empty").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = (
        "import hf_pipeline; from hf_pipeline import load_config;"
        "print(hf_pipeline.__file__); c = load_config('demo', environ={});"
        "d = load_config(None, environ={}); print(c.name, d.name, d == c)"
    )
    p = subprocess.run([str(py), "-c", code], cwd=elsewhere, env=env, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    where, names = p.stdout.splitlines()
    assert where.startswith(str(site)), where
    assert names == "demo demo True"
    exe = venv / "bin" / "hf-pipeline"
    p = subprocess.run(
        [str(exe), "status", "--config", "coyo11m", "--cache-dir", str(elsewhere / "empty")],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (p.returncode, p.stdout) == (0, f"no caches under {elsewhere / 'empty'}\n"), p.stderr
