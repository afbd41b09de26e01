"""Shared fixtures: an isolated HF_HOME per test session, a small demo config, and one
demo cache built once per session (through the real build: datasets, MiniLM)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Nothing may reach the network: the Hub client must use only local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

#: Overrides that make the demo small enough for tests (4 shards x 100 samples).
SMALL_DEMO = [
    "data.demo.num_shards=4",
    "data.demo.samples_per_shard=100",
    "build.num_proc=2",
    "build.batch_size=64",
    "build.writer_batch_size=50",
    "coord.poll_interval=0.2",
    "coord.lease_timeout=20",
    "coord.heartbeat_interval=0.5",
    "loader.global_batch_size=16",
]


@pytest.fixture(scope="session")
def session_cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_home") / "cache"


@pytest.fixture(scope="session")
def small_config(session_cache_root):
    from hf_pipeline.config import load_config

    return load_config(None, [*SMALL_DEMO, f"build.cache_dir={session_cache_root}"], environ={})


@pytest.fixture(scope="session")
def built_cache(small_config):
    """The small demo, built once for the whole session."""
    from hf_pipeline.build import prepare_cache

    return prepare_cache(small_config, progress=False)


def script_env(**extra: str) -> dict[str, str]:
    """Environment for running scripts/ in a subprocess (repo importable, offline)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_", "DATASET_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


PYTHON = sys.executable


def run_ranks(
    argv, world: int, *, timeout: float = 300, rank_env=None, **env: str
) -> list[tuple[int, str, str]]:
    """Start ``world`` real processes of ``argv`` with torchrun's RANK/WORLD_SIZE variables.

    ``rank_env(rank)`` may return more variables for one rank (e.g. its node).
    Returns ``(returncode, stdout, stderr)`` per rank; every process is killed (never
    left behind) if the wait times out or the test fails.
    """
    procs = [
        subprocess.Popen(
            [PYTHON, *map(str, argv)],
            env=script_env(**{"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                              "LOCAL_WORLD_SIZE": str(world), **env,
                              **(rank_env(r) if rank_env else {})}),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


# ------------------------------------------------------------ real mounts (root only)
# Full disks are small tmpfs mounts and read-only caches are read-only bind mounts.


def run_mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _can_mount(tmp_path: Path) -> str | None:
    if os.geteuid() != 0:
        return "needs root to mount tmpfs / bind mounts"
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        run_mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe))
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        return f"mount not permitted here: {getattr(e, 'stderr', e)}"
    _umount(probe)
    return None


@pytest.fixture
def mounts(tmp_path):
    reason = _can_mount(tmp_path)
    if reason:
        pytest.skip(reason)
    mounted: list[Path] = []

    def mount(*args: str) -> None:
        run_mount(*args)
        mounted.append(Path(args[-1]))

    yield mount
    for path in reversed(mounted):
        _umount(path)


