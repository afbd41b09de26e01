"""The whole build under real faults: a full disk (tmpfs) and read-only bind mounts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_pipeline.build.prepare import prepare_cache
from hf_pipeline.cache.layout import open_dataset, open_sample_source
from hf_pipeline.config import load_config
from tests.conftest import PYTHON, REPO, SMALL_DEMO, run_mount, run_ranks, script_env
from tests.helpers.caches import copy_inputs

pytestmark = pytest.mark.slow


def _snapshot(root):
    return sorted(
        (str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
    )


def _published(root):
    return sorted(
        p.name for p in root.rglob("*.json") if p.name in ("converted.json", "filtered.json")
    )


def test_full_disk_fails_cleanly_for_every_rank_then_succeeds(
    small_config, built_cache, tmp_path, mounts
):
    data = copy_inputs(small_config, tmp_path / "data")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounts("-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk))  # the rows need ~10 MB
    args = [
        "-q",
        "--cache-dir",
        str(disk),
        "--set",
        f"data.shards={data}",
        *[a for o in SMALL_DEMO for a in ("--set", o)],
        "--set",
        "coord.lease_timeout=60",
    ]
    results = run_ranks([REPO / "scripts/prebuild_cache.py", *args], 2)
    named = 0
    for code, _out, err in results:
        # Both ranks fail fast with the builder's error (the waiter does not time out).
        assert code == 1, err
        assert "Traceback" not in err
        lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        assert len(lines) == 1 and "No space left on device" in lines[0], err
        named += str(disk) in lines[0]
    assert named >= 1, results  # the builder's line names the cache it was writing
    assert _published(disk) == []
    assert not list(disk.rglob("converted*")) and not list(disk.rglob("filtered*"))

    # Space again: the same command succeeds and the cache holds the demo's rows.
    run_mount("-o", "remount,size=64m", str(disk))
    p = subprocess.run(
        [PYTHON, str(REPO / "scripts/prebuild_cache.py"), *args],
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    cfg = load_config(
        None, [*SMALL_DEMO, f"build.cache_dir={disk}", f"data.shards={data}"], environ={}
    )
    res = prepare_cache(cfg, progress=False)
    assert res.built is False
    assert open_dataset(res.layout)["key"] == open_dataset(built_cache.layout)["key"]


def test_read_only_mount_of_built_cache_loads_without_writing(
    small_config, built_cache, tmp_path, mounts
):
    ro = tmp_path / "ro"
    ro.mkdir()
    mounts("--bind", str(small_config.cache_root), str(ro))
    run_mount("-o", "remount,bind,ro", str(ro))
    before = _snapshot(ro)
    cfg = load_config(None, [*SMALL_DEMO, f"build.cache_dir={ro}"], environ={})
    res = prepare_cache(cfg, progress=False)
    assert res.built is False and res.fingerprint == built_cache.fingerprint
    src = open_sample_source(res.layout, res.fingerprint)
    batch = src.gather(np.arange(4), 0)
    assert batch["latents"].shape == (4, 4, 32, 32)
    src.close()
    assert _snapshot(ro) == before


@pytest.mark.parametrize("shards", ["copied", "demo"])
def test_read_only_unbuilt_cache_fails_at_once_with_advice(small_config, tmp_path, mounts, shards):
    # "demo": the demo's data is generated under the root first; that failed with the
    # raw `[Errno 30] Read-only file system` (an outside tester)
    data = copy_inputs(small_config, tmp_path / "data") if shards == "copied" else "demo"
    ro = tmp_path / "ro"
    (tmp_path / "empty").mkdir()
    ro.mkdir()
    mounts("--bind", str(tmp_path / "empty"), str(ro))
    run_mount("-o", "remount,bind,ro", str(ro))
    p = subprocess.run(
        [
            PYTHON,
            str(REPO / "scripts/train.py"),
            "-q",
            "--cache-dir",
            str(ro),
            *[a for o in SMALL_DEMO for a in ("--set", o)],
            "--set",
            f"data.shards={data}",
        ],
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "prebuild_cache.py" in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_sigkilled_builder_takes_its_join_workers_with_it(small_config, tmp_path):
    """Issue 8: the num_proc pool workers of a SIGKILLed builder die with it (they used to
    linger for 75 s and more, holding shards and memory)."""
    import os
    import signal
    import time

    import psutil

    data = copy_inputs(small_config, tmp_path / "data")
    args = [
        "-q",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--set",
        f"data.shards={data}",
        *[a for o in SMALL_DEMO for a in ("--set", o)],
        "--set",
        "data.demo.num_shards=4",
    ]
    proc = subprocess.Popen([PYTHON, str(REPO / "scripts/prebuild_cache.py"), *args],
                            env=script_env(DATASET_NUM_PROC="2"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        builder = psutil.Process(proc.pid)
        deadline = time.monotonic() + 120
        forked: list[psutil.Process] = []
        # The join's pool is up once the fork server has forked the two workers and
        # the manager that datasets starts beside them (grandchildren of the builder).
        while len(forked) < 3:
            assert proc.poll() is None, "the build ended before its pool was seen"
            assert time.monotonic() < deadline, "no num_proc workers appeared"
            descendants = builder.children(recursive=True)
            forked = [c for c in descendants if c.ppid() != proc.pid]
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        # All of them: the workers, the manager, the fork server, the resource tracker.
        gone, alive = psutil.wait_procs(descendants, timeout=10)
        assert alive == [], f"outlived their builder: {[p.cmdline()[-1][:80] for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_for_phase(cache, phase: str, timeout: float, procs) -> tuple[Path, int]:
    """The heartbeat file of whichever process of ``procs`` first says ``phase`` (what
    ``--status`` shows), and its index in ``procs``; waiting with a deadline, failing
    early when a process ended. Whichever: the ranks race for the lease (under load the
    first to start wins, not always rank 0)."""
    import time

    pids = [p.pid for p in procs]
    deadline = time.monotonic() + timeout
    while True:
        for hb in cache.glob("*/heartbeat-*.json"):
            try:
                d = json.loads(hb.read_text())
            except (OSError, ValueError):  # replaced under us
                continue
            if d.get("pid") in pids and d.get("phase") == phase:
                return hb, pids.index(d["pid"])
        for p in procs:
            assert p.poll() is None, f"process {p.pid} ended (rc {p.returncode}) before {phase}"
        assert time.monotonic() < deadline, f"no process reached {phase!r} in {timeout}s"
        time.sleep(0.01)


def test_builder_paused_in_the_embedding_leaves_no_folder_behind(small_config, tmp_path):
    """Issue 24 item 11: a builder SIGSTOPped while its encoder runs, whose successor
    publishes and deletes the old lease's folder meanwhile, must not re-create that
    folder when it resumes (the embeddings file, ``reasons.arrow``): once it exits, the
    cache holds exactly the published stages."""
    import os
    import signal

    data = copy_inputs(small_config, tmp_path / "data")
    cache = tmp_path / "cache"
    overrides = [
        *SMALL_DEMO,
        f"data.shards={data}",
        "coord.lease_timeout=5",
        "coord.heartbeat_interval=0.3",
        "coord.poll_interval=0.1",
    ]
    args = [sys.executable, str(REPO / "scripts/prebuild_cache.py"), "-q", "--cache-dir",
            str(cache), *[a for o in overrides for a in ("--set", o)]]  # fmt: skip
    procs = [
        subprocess.Popen(args, env=script_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                         LOCAL_WORLD_SIZE="2"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]  # fmt: skip
    try:
        # The heartbeat says "embedding" once the first batch waits for the encoder.
        hb, builder = _wait_for_phase(cache, "embedding", timeout=300, procs=procs)
        victim, successor = procs[builder], procs[1 - builder]
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            root = hb.parent
            old = root / ("converted." + hb.name[len("heartbeat-") : -len(".json")])
            assert old.is_dir()
            _, err = successor.communicate(timeout=400)
            assert successor.returncode == 0, err
            assert (root / "filtered.json").exists() and not old.exists()
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        _, err = victim.communicate(timeout=120)
        assert victim.returncode == 0, err
        assert "standing down" in err or "taken over" in err, err
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
    markers = [json.loads((root / f"{s}.json").read_text()) for s in ("converted", "filtered")]
    assert all(m["lease_id"] not in old.name for m in markers)
    published = sorted(
        [f"{s}.json" for s in ("converted", "filtered")] + [m["directory"] for m in markers]
    )
    assert not old.exists(), sorted(str(p.relative_to(old)) for p in old.rglob("*"))
    from dist.layout import IDENTITY_FILE  # the cache's own mark (--clean knows it by it)

    assert sorted(set(os.listdir(root)) - {IDENTITY_FILE}) == published


def test_ranks_of_a_named_job_load_a_read_only_cache(small_config, built_cache, tmp_path, mounts):
    """The ranks' agreement writes under the cache root (<root>/.jobs/<job id>/); on a
    read-only mount of a built cache they still load it, writing nothing."""
    ro = tmp_path / "ro"
    ro.mkdir()
    mounts("--bind", str(small_config.cache_root), str(ro))
    run_mount("-o", "remount,bind,ro", str(ro))
    before = _snapshot(ro)
    args = ["-q", "--cache-dir", str(ro), *[a for o in SMALL_DEMO for a in ("--set", o)]]
    runs = run_ranks([REPO / "scripts/prebuild_cache.py", *args], 2, SLURM_JOB_ID="77")
    for code, out, err in runs:
        assert code == 0, err[-3000:]
        assert "[found]" in out or "found" in out, out
    assert _snapshot(ro) == before


def _start_build(root, sigint):
    """A demo build of 4 x 300 rows in its own process group (a terminal's job), started
    with SIGINT's disposition ``sigint`` (a terminal: the default; ``nohup``: ignored)."""
    import signal

    argv = [PYTHON, str(REPO / "scripts/prebuild_cache.py"), "--cache-dir", str(root),
            *[a for o in SMALL_DEMO for a in ("--set", o)], "--set", "build.num_proc=2",
            "--set", "data.demo.samples_per_shard=300"]  # fmt: skip
    p = subprocess.Popen(
        argv, env=script_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
    )  # fmt: skip
    return p, argv


@pytest.mark.parametrize("stage", ["join", "embed"])
def test_ctrl_c_during_the_build_exits_130_quietly_and_a_rerun_builds(tmp_path, stage):
    """Ctrl-C in a terminal signals the whole process group: the builder and its worker
    processes. docs/troubleshooting.md: nothing is published, the process exits with 130.
    During the embedding the token ids' workers printed a KeyboardInterrupt traceback each
    before the builder's `interrupted` line (outside tester); during the join's
    ``Dataset.map`` datasets turned it into multiprocess's TimeoutError (a traceback, exit
    1), or lost it and finished the build (exit 0); the join's workers, forked by the fork
    server, printed a KeyboardInterrupt traceback each (CI). A rerun of the same command
    builds.

    The build is started as a terminal starts it: SIGINT at its default. A suite run in the
    background of a script (``cmd &``) passes SIGINT ignored to every child; the embed case
    then saw the build finish (exit 0), as a ``nohup`` build should (the next test)."""
    import os
    import signal
    import time

    root = tmp_path / "c"
    p, argv = _start_build(root, signal.SIG_DFL)
    seen = ""
    try:
        assert p.stderr is not None
        for line in p.stderr:  # the build's log: Ctrl-C once the stage began
            seen += line
            if f"building stage {stage} " in line:
                time.sleep(0.2)
                os.killpg(p.pid, signal.SIGINT)
                break
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    err = seen + err
    assert f"building stage {stage} " in err, err[-3000:]
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert not _published(root), "nothing published"
    rerun = subprocess.run(argv, env=script_env(), cwd=REPO, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _published(root) == ["converted.json", "filtered.json"], _published(root)


def test_a_build_started_with_sigint_ignored_keeps_ignoring_it(tmp_path):
    """``nohup``, or ``cmd &`` in a script, starts the build with SIGINT ignored: a Ctrl-C
    meant for the shell's foreground job must not stop it. It did during the join (whose
    ``Dataset.map`` installed a SIGINT handler of its own over the ignore) and did not
    during the embedding. Now neither: the build finishes and publishes."""
    import contextlib
    import os
    import signal
    import threading
    import time

    root = tmp_path / "c"
    p, _ = _start_build(root, signal.SIG_IGN)
    seen, signalled = "", []

    def ctrl_c_until_done():  # every 0.1 s from the join on: inside the map's window too
        while p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGINT)
                signalled.append(time.monotonic())
            time.sleep(0.1)

    presser = threading.Thread(target=ctrl_c_until_done, daemon=True)
    try:
        assert p.stderr is not None
        for line in p.stderr:
            seen += line
            if "building stage join " in line and not presser.is_alive():
                presser.start()
        p.wait(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    presser.join(5)
    assert "building stage embed " in seen and len(signalled) >= 5, seen[-3000:]
    assert p.returncode == 0, seen[-3000:]
    assert "Traceback" not in seen and "interrupted" not in seen, seen[-3000:]
    assert _published(root) == ["converted.json", "filtered.json"], _published(root)
