"""Shared fixtures: an isolated HF_HOME per test session, a small demo config, and one
demo cache built once per session (through the real build: datasets, MiniLM); under
pytest-xdist once per run, each worker reading its own copy (see below)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Nothing may reach the network: the Hub client must use only local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")
# torch's OpenMP threads (libgomp) spin on a CPU while they wait for work. Two xdist
# workers, each with a thread per CPU, and the processes the tests start share the
# 2-core VM: spinning threads burn what the others need (the encoder tests took 2-3x the
# CPU). Passive threads sleep instead: the same kernels, the same thread count (tests of
# fork after torch's thread pool still have one), the same results. Set before any torch
# import (libgomp reads it once), here and in every process the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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

#: Samples per shard of the demo for a test that builds a cache of its own but needs no
#: particular size (another latent dtype, its own data folder): 4 x 25 rows cost about a
#: third less CPU to build than SMALL_DEMO's 4 x 100 (14 vs 21 CPU-s, most of the rest is
#: the build's fixed start: encoder load, fork server).
ANY_CACHE_SAMPLES_PER_SHARD = 25


@pytest.fixture(scope="session")
def session_cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_home") / "cache"


@pytest.fixture(scope="session")
def small_config(session_cache_root):
    from hf_pipeline.config import load_config

    return load_config(None, [*SMALL_DEMO, f"build.cache_dir={session_cache_root}"], environ={})


#: The xdist worker this process is ("gw0", ...), or None in a run without workers.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")

#: How long a worker waits for another worker's build of a shared session cache (a
#: build takes 15-40 s on 2 loaded cores).
SHARED_BUILD_TIMEOUT_S = 900


def once_per_run(tmp_path_factory, name: str, make: Callable[[Path], object]) -> Path:
    """A folder that ``make(folder)`` filled once for the whole test run.

    Without xdist that is this session's own ``mktemp(name)``. Under xdist the first
    worker to ask fills ``<run's base temp>/shared/<name>`` while it holds a file lock;
    the others wait for it and reuse the folder: READ-ONLY (inputs, or a cache to copy).
    A worker that failed half-way leaves no ``.done`` file: the next one starts over.
    """
    if XDIST_WORKER is None:
        folder = tmp_path_factory.mktemp(name)
        make(folder)
        return folder
    from filelock import FileLock

    # getbasetemp() is <run's base temp>/popen-gwN: its parent is this run's alone.
    base = tmp_path_factory.getbasetemp().parent / "shared"
    base.mkdir(exist_ok=True)
    folder, done = base / name, base / f"{name}.done"
    with FileLock(base / f"{name}.lock", timeout=SHARED_BUILD_TIMEOUT_S):
        if not done.exists():
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


def copy_shared_root(shared: Path, root: Path) -> None:
    """Copy a cache root built by :func:`once_per_run` into this worker's ``root``.

    ``cp -a``: mtimes, symlinks and the hard links between the root's files are kept as
    the build made them; every file is this worker's own (no link to the shared one), so
    a test that cleans, tampers with or builds into its root never touches another
    worker's."""
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", f"{shared}/.", str(root)], check=True)


def _is_empty(folder: Path) -> bool:
    return not folder.exists() or not any(folder.iterdir())


def build_once_per_run(
    tmp_path_factory, name: str, config_for: Callable[[Path], object], root: Path
):
    """``prepare_cache(config_for(root))``, the cache built once for the whole run.

    Without xdist (or when ``root`` already holds something) it builds in ``root``. Under
    xdist the first worker builds in the run's shared folder (:func:`once_per_run`), and
    every worker copies that root into its own ``root`` and opens its copy there (found
    there, not built again). The result is the build's, relocated: what the build did
    (``built``, ``pulled``, ``seconds``, ``hashing``; the copy's report.json is the
    build's) with this worker's ``cache_dir``, as if this worker had built it there.
    """
    from hf_pipeline.build.prepare import prepare_cache

    if XDIST_WORKER is None or not _is_empty(root):
        return prepare_cache(config_for(root), progress=False)

    def make(folder: Path) -> None:
        res = prepare_cache(config_for(folder / "root"), progress=False)
        done = {"built": res.built, "seconds": res.seconds, "pulled": res.pulled}
        (folder / "result.json").write_text(json.dumps({**done, "hashing": dict(res.hashing)}))

    shared = once_per_run(tmp_path_factory, name, make)
    copy_shared_root(shared / "root", root)
    found = prepare_cache(config_for(root), progress=False)
    # Paths in the build's result (its content index) name the shared root: name the copy.
    text = (shared / "result.json").read_text()
    text = text.replace(json.dumps(str(shared / "root"))[1:-1], json.dumps(str(root))[1:-1])
    return dataclasses.replace(found, **json.loads(text))


@pytest.fixture(scope="session")
def built_cache(small_config, tmp_path_factory):
    """The small demo, built once for the whole session (under xdist once for the whole
    run: each worker gets it copied into its own ``session_cache_root``)."""
    from hf_pipeline.config import load_config

    # A module that builds into the session's root before this fixture runs leaves the
    # root non-empty: then this worker builds its own here (test_open_dataset asks for
    # built_cache first).
    return build_once_per_run(
        tmp_path_factory,
        "built-cache",
        lambda root: load_config(None, [*SMALL_DEMO, f"build.cache_dir={root}"], environ={}),
        small_config.cache_root,
    )


# A session-scoped fixture is built once only where it is defined: conftest. Imported into
# a test module it becomes that module's own fixture, built again in each such module.
#
# Under pytest-xdist (the developer loop: `-n 2 --dist loadfile`) "session" means one
# worker: each worker process has its own session fixtures, in its own base temp folder
# (tmp_path_factory gives each worker popen-gwN/), so two workers never build into, read,
# verify or clean one cache folder. The two caches every worker needs (built_cache and
# source_cache) are still built only once per run: the first worker builds into a folder
# shared by the run (once_per_run), under a file lock, and every worker copies that
# finished root into its own folder and opens its copy there (a copy elsewhere is found,
# not rebuilt). The shared folders are read-only after their build: only copied from
# (built roots) or read (the demo's data files).
# `--dist loadfile` keeps each module on one worker, so a module-scoped build is made once.


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """The small demo's files in a folder of their own, generated once (under xdist once
    per run, shared by the workers: read-only). Every "host" of a publish/pull/stream test
    reads these same files, so every host computes the same fingerprint (a copy elsewhere
    is another cache)."""
    from hf_pipeline.demo.generate import generate_demo

    def make(folder: Path) -> None:
        generate_demo(folder / "data", num_shards=4, samples_per_shard=100)

    return once_per_run(tmp_path_factory, "publish-demo", make) / "data"


@pytest.fixture(scope="session")
def source_cache(demo_data, tmp_path_factory):
    """The cache built once from :func:`demo_data`: the one the publish, pull and stream
    tests publish (tests.helpers.publishing.SourceCache); under xdist once per run, each
    worker with its own copy of the root (:func:`build_once_per_run`)."""
    from tests.helpers.publishing import SourceCache, config

    root = tmp_path_factory.mktemp("publish-source")
    result = build_once_per_run(
        tmp_path_factory, "publish-source", lambda r: config(demo_data, r), root
    )
    return SourceCache(data=demo_data, result=result)


def script_env(**extra: str) -> dict[str, str]:
    """Environment for running scripts/ in a subprocess (repo importable, offline)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_", "DATASET_"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


PYTHON = sys.executable


def run_each(argvs_envs, *, timeout: float = 300) -> list[tuple[int, str, str]]:
    """Start one real process per ``(argv, env)`` at once (``env`` on top of
    :func:`script_env`); ``(returncode, stdout, stderr)`` of each. Every process is killed
    (never left behind) if the wait times out or the test fails."""
    procs = [
        subprocess.Popen(
            [PYTHON, *map(str, argv)],
            env=script_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv, env in argvs_envs
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


def run_ranks(
    argv, world: int, *, timeout: float = 300, rank_env=None, **env: str
) -> list[tuple[int, str, str]]:
    """Start ``world`` real processes of ``argv`` with torchrun's RANK/WORLD_SIZE variables.

    ``rank_env(rank)`` may return more variables for one rank (e.g. its node).
    Returns ``(returncode, stdout, stderr)`` per rank (:func:`run_each`).
    """
    return run_each(
        [
            (
                argv,
                {
                    "RANK": str(r),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(r),
                    "LOCAL_WORLD_SIZE": str(world),
                    **env,
                    **(rank_env(r) if rank_env else {}),
                },
            )
            for r in range(world)
        ],
        timeout=timeout,
    )


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


# ------------------------------------------------- two hosts' views of one share (FUSE)
# An NFS client caches attributes, lookups and negative lookups (acregmax/acdirmax), so a
# file written on host A can stay invisible, or keep its old content, on host B for
# seconds. Two bindfs views of one folder with kernel caches of N seconds behave like
# that: each view is one host (its processes share one cache), and a change made
# through one view reaches the other only once the other's cache entry expires.

#: bindfs options of one "host": lookups, negative lookups and attributes cached for N s,
#: and file data kept until an attribute refresh shows a new mtime or size (auto_cache),
#: as an NFS client validates its data cache against attributes cached up to acregmax.
#: Without auto_cache bindfs re-reads data on every open but cuts it to the cached size:
#: JSON files come out torn rather than late.
BINDFS_OPTIONS = "attr_timeout={n},entry_timeout={n},negative_timeout={n},auto_cache"


@dataclasses.dataclass(frozen=True)
class HostViews:
    """One shared folder seen through two caching hosts."""

    shared: Path  # the real folder (the NFS server's export)
    a: Path  # host A's mount of it
    b: Path  # host B's mount of it
    cache_s: float  # how long either host may see stale names, attributes and data

    def view(self, host: int) -> Path:
        return (self.a, self.b)[host % 2]


def _bindfs_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to mount FUSE"
    if shutil.which("bindfs") is None:
        return "bindfs is not installed (apt-get install -y bindfs; .ci/run does)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return None


def _mount_bindfs(source: Path, target: Path, cache_s: float) -> subprocess.Popen:
    """Start bindfs in the foreground (so the test owns its pid) and wait for the mount."""
    opts = BINDFS_OPTIONS.format(n=cache_s)
    proc = subprocess.Popen(
        ["bindfs", "-f", "-o", opts, str(source), str(target)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not os.path.ismount(target):
        if proc.poll() is not None:
            raise RuntimeError(f"bindfs {source} {target} exited: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"bindfs {source} {target} did not mount in 10 s")
        time.sleep(0.01)
    return proc


def _unmount_bindfs(target: Path, proc: subprocess.Popen) -> None:
    # Lazy: a rank process the test has not reaped yet may still hold a file open.
    subprocess.run(["umount", "-l", str(target)], capture_output=True)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stderr:
        proc.stderr.close()


@pytest.fixture
def host_views(tmp_path):
    """``host_views(cache_s)``: a fresh shared folder and two caching views of it.

    Every mount is undone when the test ends, pass or fail (request this fixture before
    any fixture that starts processes on the views, so those are killed first).
    """
    reason = _bindfs_unavailable()
    if reason:
        pytest.skip(reason)
    mounted: list[tuple[Path, subprocess.Popen]] = []

    def make(cache_s: float = 3.0, name: str = "share") -> HostViews:
        shared, a, b = (tmp_path / f"{name}-{part}" for part in ("export", "host-a", "host-b"))
        for p in (shared, a, b):
            p.mkdir()
        for target in (a, b):
            mounted.append((target, _mount_bindfs(shared, target, cache_s)))
        return HostViews(shared=shared, a=a, b=b, cache_s=cache_s)

    try:
        yield make
    finally:
        for target, proc in reversed(mounted):
            _unmount_bindfs(target, proc)
