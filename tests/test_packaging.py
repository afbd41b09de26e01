"""Packaging: `dist/` is a package here, and building archives must never write into it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from tests.conftest import REPO


def _snapshot(folder):
    return sorted(
        (p.relative_to(folder).as_posix(), p.stat().st_size)
        for p in folder.rglob("*")
        if p.is_file()
    )


def test_bdist_wheel_and_sdist_leave_dist_package_alone(tmp_path):
    repo = tmp_path / "repo"
    junk = shutil.ignore_patterns(
        ".git", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"
    )

    def ignore(folder, names):  # the top-level build/ only: hf_pipeline/build/ is a package
        return set(junk(folder, names)) | ({"build"} if folder == str(REPO) else set())

    shutil.copytree(REPO, repo, ignore=ignore)
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
    assert not any(n.startswith("tests/") for n in names)


def test_configs_available_without_a_checkout(tmp_path, monkeypatch):
    """Installed from a wheel there is no configs/ folder: the demo defaults still load."""
    from hf_pipeline import config

    monkeypatch.setattr(config, "CONFIG_DIR", tmp_path / "missing")
    cfg = config.load_config(None, environ={})
    assert cfg.name == "demo" and cfg.data.shards == "demo" and cfg.encoder.model == "minilm"
