"""Start ``tests/procs/build_remote_main.py`` (a build from gs://) behind a proxy."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import PYTHON, REPO, script_env


def start_remote_build(proxy_url: str, chunk: int, overrides, hf_home: Path) -> subprocess.Popen:
    """The build in its own process session (its workers die with it when the
    test SIGKILLs the group), reading in ``chunk``-byte blocks through ``proxy_url``."""
    env = script_env(
        STORAGE_EMULATOR_HOST=proxy_url,
        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
        HF_HOME=str(hf_home),
    )
    return subprocess.Popen(
        [PYTHON, "-m", "tests.procs.build_remote_main", f"--read-chunk={chunk}", *overrides],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
