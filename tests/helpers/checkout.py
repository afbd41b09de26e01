"""A copy of this checkout to build or install from, without touching the real one."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import REPO

_JUNK = (".git", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis")


def copy_checkout(dest: Path, *, benchmarks: bool = True) -> Path:
    """Copy the checkout to ``dest`` without version control, build leftovers and
    caches (and ``benchmarks/`` unless asked for). Only the top-level ``build/`` is
    left out (setup.py's output): ``hf_pipeline/build/`` is a package. Returns ``dest``."""
    junk = shutil.ignore_patterns(*_JUNK, *(() if benchmarks else ("benchmarks",)))

    def ignore(folder, names):
        return set(junk(folder, names)) | ({"build"} if folder == str(REPO) else set())

    shutil.copytree(REPO, dest, ignore=ignore)
    return dest
