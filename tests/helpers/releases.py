"""Caches built by an earlier release's own code, for the tests that an upgrade finds
and reads them (``test_identity``, ``test_part_store``).

:func:`build_with_release` extracts ``hf_pipeline`` and ``dist`` of one commit with
``git archive`` and runs that code's ``prepare_cache`` in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

_CODE = (
    "import json, sys\n"
    "from hf_pipeline.config import load_config\n"
    "from hf_pipeline.build.prepare import prepare_cache\n"
    "res = prepare_cache(load_config(None, json.loads(sys.argv[1]), environ={}), progress=False)\n"
    "import hf_pipeline\n"
    "print(json.dumps([res.fingerprint, str(res.cache_dir), res.built, hf_pipeline.__file__]))\n"
)


def build_with_release(commit: str, overrides: Sequence[str], work: Path) -> tuple[str, str]:
    """Build with the code of ``commit`` (extracted under ``work/old-release``) and the
    config ``overrides``; skips the test where git or the commit is missing (a shallow
    clone).

    Returns:
        ``(fingerprint, cache_dir)`` of the cache that release built (asserted built,
        by the extracted code, not this checkout's).
    """
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    old = work / "old-release"
    old.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "hf_pipeline", "dist"], capture_output=True
    )
    if archive.returncode != 0:
        pytest.skip(f"commit {commit} not in this clone")
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    env: dict[str, Any] = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        and not k.startswith(("SLURM_", "DATASET_"))
    }
    env["PYTHONPATH"] = str(old)
    out = subprocess.run(
        [sys.executable, "-c", _CODE, json.dumps(list(overrides))], env=env,
        capture_output=True, text=True, timeout=600,
        cwd=old,  # "-c" puts the working folder first on sys.path
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    fingerprint, cache_dir, built, imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert built and imported.startswith(str(old))
    return fingerprint, cache_dir
