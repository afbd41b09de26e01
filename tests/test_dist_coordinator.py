"""dist.coordinator: real processes, real SIGKILL/SIGSTOP, real tmpfs and read-only mounts.

Ranks are OS processes running tests/procs/dist_rank.py; every test kills what it
started (fixture finalizer), even when it fails.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import xxhash

from dist import (
    BuildFailedError,
    CacheWaitTimeout,
    ReadOnlyCacheError,
    Stage,
    default_builder,
    ensure_built,
)
from dist.coordinator import LEASE_FILE, LeaseLostError
from dist.env import ProcessInfo
from dist.errors import ForeignCacheFolderError
from dist.layout import IDENTITY_FILE
from dist.lease import LeaseView, holder_exited, process_identity, read_lease
from dist.markers import Marker, read_json
from tests.conftest import run_mount as _mount
from tests.helpers.dist_job import Job
from tests.helpers.ports import free_port
from tests.helpers.victims import Victim

REPO = Path(__file__).resolve().parent.parent
# Short timings so the whole file runs in well under 3 minutes on 2 cores.
FAST = ["--poll", "0.05", "--lease-timeout", "1.0", "--heartbeat", "0.2"]
LEASE_TIMEOUT = 1.0


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path / "job")
    yield j
    j.kill_all()


def _clean_hash(job: Job, tmp_path: Path, fingerprint: str = "fp0", *extra: str) -> str:
    """Content hash of an undisturbed single-process build (the reference)."""
    ref = tmp_path / f"reference-{fingerprint}"
    (r,) = job.wait([job.start(ref, 0, "--fingerprint", fingerprint, *FAST, *extra)])
    assert r["ok"], r
    return r["content_hash"]


def _assert_same_cache(results: list[dict], reference: str) -> None:
    for r in results:
        assert r["ok"], f"rank {r['rank']}: {r.get('error_type')}: {r.get('error')}\n{r['output']}"
        assert r["content_hash"] == reference, f"rank {r['rank']} saw different content"
    first = results[0]["markers"]
    assert all(r["markers"] == first for r in results), "ranks returned different markers"


def _events(result: dict, name: str) -> list:
    return [e for e in result["events"] if e[0] == name]


# ----------------------------------------------------------------------------- in-process


def _write_parts(ctx, n=2, size=1000):
    for i in range(n):
        (ctx.tmp_dir / f"part-{i}.bin").write_bytes(bytes([i + 1]) * size)
    return {"rows": n}


STAGES = [Stage(name="converted", build=_write_parts), Stage(name="filtered", build=_write_parts)]
QUICK = dict(poll_interval=0.05, lease_timeout=1.0, heartbeat_interval=0.2, max_wait=30.0)


def _published(markers) -> list[str]:
    """What a complete cache folder holds: each stage's folder and marker, and the
    identity file its first builder wrote; nothing else."""
    return sorted(
        [m.directory for m in markers.values()] + [f"{s}.json" for s in markers] + [IDENTITY_FILE]
    )


def _recorder():
    events: list[tuple[str, dict]] = []
    return events, lambda name, fields: events.append((name, fields))


def test_builds_then_reuses_without_rebuilding(tmp_path):
    cache = tmp_path / "c-fp"
    events, on_event = _recorder()
    markers = ensure_built(cache, "fp", STAGES, builder=True, on_event=on_event, **QUICK)
    assert [e for e, _ in events].count("stage_built") == 2
    assert markers["converted"].info == {"rows": 2}
    folder = markers["filtered"].directory
    assert folder == f"filtered.{markers['filtered'].lease_id}"  # built under its own name
    assert [f.path for f in markers["filtered"].files] == [
        f"{folder}/part-0.bin",
        f"{folder}/part-1.bin",
    ]
    assert markers["filtered"].inputs == {"converted": markers["converted"].directory}
    # Only published results and markers remain: no lease, heartbeat or tmp leftovers.
    assert sorted(os.listdir(cache)) == _published(markers)
    events2, on_event2 = _recorder()
    again = ensure_built(cache, "fp", STAGES, builder=False, on_event=on_event2, **QUICK)
    assert again == markers
    assert [e for e, _ in events2] == ["complete"]


def test_later_stage_sees_published_earlier_stage(tmp_path):
    seen = {}

    def second(ctx):
        seen["previous"] = dict(ctx.previous)
        seen["files"] = sorted(p.name for p in ctx.previous["converted"].iterdir())
        return {}

    markers = ensure_built(
        tmp_path / "c",
        "fp",
        [Stage(name="converted", build=_write_parts), Stage(name="filtered", build=second)],
        builder=True,
        **QUICK,
    )
    assert seen["previous"] == {"converted": tmp_path / "c" / markers["converted"].directory}
    assert seen["files"] == ["part-0.bin", "part-1.bin"]


def test_resume_skips_valid_stage_and_removes_leftovers(tmp_path):
    cache = tmp_path / "c"
    ensure_built(cache, "fp", STAGES[:1], builder=True, **QUICK)
    # A dead builder's leftovers: its tmp folder, a stage folder without marker.
    (cache / "filtered.tmp-deadbeef").mkdir()
    (cache / "filtered.tmp-deadbeef" / "junk").write_bytes(b"x")
    (cache / "filtered").mkdir()
    (cache / "filtered" / "half").write_bytes(b"y")
    events, on_event = _recorder()
    markers = ensure_built(cache, "fp", STAGES, builder=True, on_event=on_event, **QUICK)
    names = [e for e, _ in events]
    assert ("stage_skipped", {"stage": "converted"}) in events
    assert names.count("stage_built") == 1
    assert not (cache / "filtered.tmp-deadbeef").exists()
    folder = cache / markers["filtered"].directory
    assert sorted(p.name for p in folder.iterdir()) == ["part-0.bin", "part-1.bin"]
    assert sorted(os.listdir(cache)) == _published(markers)


def test_a_build_removes_only_leftovers_the_project_wrote(tmp_path):
    """A build clears a dead builder's bookkeeping from the cache folder by name. It
    removed every name containing ``.trash-`` or ``.tmp-`` and every hidden ``*.tmp``,
    whoever wrote it; now only the names the project gives its trash, legacy stage
    folders and interrupted writes (of its stages, markers and bookkeeping)."""
    cache = tmp_path / "c"
    ensure_built(cache, "fp", STAGES[:1], builder=True, **QUICK)
    ours = {
        "filtered.0123456789abcdef.trash-0a1b2c3d": "dir",  # the coordinator's trash
        ".converted.0123456789abcdef.trash-0a1b2c3d": "dir",  # the inventory's
        "filtered.tmp-deadbeef": "dir",  # a stage folder of hf_pipeline <= 0.1
        ".filtered.json.123.0123456789ab.tmp": "file",  # an interrupted marker write
    }
    theirs = {
        "notes.trash-0a1b2c3d": "file",
        "photos.trash-12345678": "dir",
        "plan.tmp-1": "file",
        ".editor-swap.tmp": "file",
    }
    for name, kind in {**ours, **theirs}.items():
        if kind == "dir":
            (cache / name).mkdir()
            (cache / name / "inside").write_bytes(b"x")
        else:
            (cache / name).write_bytes(b"x")
    ensure_built(cache, "fp", STAGES, builder=True, **QUICK)
    left = set(os.listdir(cache))
    assert not left & set(ours), sorted(left & set(ours))
    assert set(theirs) <= left, sorted(set(theirs) - left)
    assert (cache / "photos.trash-12345678" / "inside").read_bytes() == b"x"


@pytest.mark.parametrize(
    "damage",
    ["fingerprint", "missing_file", "truncated_file", "malformed_json", "schema_version"],
)
def test_untrusted_marker_is_rebuilt_with_reason_logged(tmp_path, caplog, damage):
    cache = tmp_path / "c"
    old = ensure_built(cache, "fp", STAGES, builder=True, **QUICK)
    marker = cache / "converted.json"
    d = json.loads(marker.read_text())
    part = cache / old["converted"].directory / "part-1.bin"
    if damage == "fingerprint":
        d["fingerprint"] = "other"
        marker.write_text(json.dumps(d))
        why = "fingerprint 'other', expected 'fp'"
    elif damage == "missing_file":
        part.unlink()
        why = f"'{old['converted'].directory}/part-1.bin' missing"
    elif damage == "truncated_file":
        part.write_bytes(b"\x02" * 10)
        why = "has 10 bytes, expected 1000"
    elif damage == "malformed_json":
        marker.write_text('{"schema_version": 1, "fing')
        why = "malformed JSON"
    else:
        d["schema_version"] = 99
        marker.write_text(json.dumps(d))
        why = "schema version 99"
    events, on_event = _recorder()
    with caplog.at_level(logging.WARNING, logger="dist"):
        markers = ensure_built(cache, "fp", STAGES, builder=True, on_event=on_event, **QUICK)
    lines = [r.getMessage() for r in caplog.records if r.name.split(".")[0] == "dist"]
    assert any(why in line and "converted.json" in line for line in lines), lines
    # Stage 1 rebuilt, and stage 2 with it (it was derived from stage 1).
    assert [f for e, f in events if e == "stage_built"] == [
        {"stage": "converted", "lease_id": markers["converted"].lease_id, "info": {"rows": 2}},
        {"stage": "filtered", "lease_id": markers["filtered"].lease_id, "info": {"rows": 2}},
    ]
    assert (cache / markers["converted"].directory / "part-1.bin").stat().st_size == 1000
    # The invalid markers were moved aside, not deleted; the new ones are elsewhere.
    assert markers["converted"].directory != old["converted"].directory
    retired = sorted(n for n in os.listdir(cache) if ".json.retired-" in n)
    assert [n.split(".")[0] for n in retired] == ["converted", "filtered"]


def test_build_error_is_reraised_and_leaves_nothing_published(tmp_path):
    def boom(ctx):
        (ctx.tmp_dir / "partial").write_bytes(b"z" * 100)
        raise ValueError("bad rows")

    cache = tmp_path / "c"
    with pytest.raises(ValueError, match="bad rows"):
        ensure_built(
            cache, "fp", [STAGES[0], Stage(name="filtered", build=boom)], builder=True, **QUICK
        )
    names = sorted(os.listdir(cache))
    stage1 = read_json(cache / "converted.json")["directory"]
    assert names[:3] == [IDENTITY_FILE, stage1, "converted.json"]  # stage 1 stays (resume)
    assert not any(n.startswith("filtered") for n in names) and LEASE_FILE not in names
    assert not any(".tmp-" in n for n in names)
    (record,) = [n for n in names if n.startswith("failed-")]
    assert read_json(cache / record)["error_type"] == "ValueError"
    # A fresh run clears the record and succeeds.
    markers = ensure_built(cache, "fp", STAGES, builder=True, **QUICK)
    assert set(markers) == {"converted", "filtered"}
    assert not any(n.startswith("failed-") for n in os.listdir(cache))


def test_waiter_builds_when_preferred_builder_never_comes(tmp_path):
    events, on_event = _recorder()
    t0 = time.monotonic()
    ensure_built(tmp_path / "c", "fp", STAGES, builder=False, on_event=on_event, **QUICK)
    elapsed = time.monotonic() - t0
    assert [e for e, _ in events][0] == "claimed"
    assert QUICK["lease_timeout"] <= elapsed < QUICK["lease_timeout"] + 2


@pytest.mark.parametrize("content", [b"", b'{"lease_id": "dead0001", "host": "h", "pid": 1}'])
def test_dead_lease_without_heartbeat_is_taken_over(tmp_path, content):
    """A claimer killed right after O_EXCL (empty lease) or before its first heartbeat."""
    cache = tmp_path / "c"
    cache.mkdir()
    (cache / LEASE_FILE).write_bytes(content)
    (cache / "converted.tmp-dead0001").mkdir()
    events, on_event = _recorder()
    t0 = time.monotonic()
    markers = ensure_built(cache, "fp", STAGES, builder=True, on_event=on_event, **QUICK)
    assert QUICK["lease_timeout"] <= time.monotonic() - t0 < QUICK["lease_timeout"] + 2
    assert [e for e, _ in events][:3] == ["lease_dead", "takeover", "claimed"]
    assert sorted(os.listdir(cache)) == _published(markers)


def test_a_waiter_whose_cache_folder_was_removed_claims_it_anew(tmp_path):
    """`prebuild_cache.py --clean` removes a dead builder's cache folder while ranks
    wait on it: the waiter that then takes over died on ENOENT creating its lease."""
    import shutil

    cache = tmp_path / "c"
    cache.mkdir()
    (cache / LEASE_FILE).write_bytes(b'{"lease_id": "dead0001", "host": "h", "pid": 1}')
    timer = threading.Timer(QUICK["lease_timeout"] / 2, shutil.rmtree, (cache,))
    timer.start()
    try:
        events, on_event = _recorder()
        markers = ensure_built(cache, "fp", STAGES, builder=False, on_event=on_event, **QUICK)
    finally:
        timer.cancel()
    assert "claimed" in [e for e, _ in events]
    assert sorted(os.listdir(cache)) == _published(markers)


def test_a_link_planted_as_the_lease_s_stage_folder_is_refused_by_name(tmp_path):
    """Someone who can write in the cache folder puts a symlink (or a file) where this
    lease is about to build a stage (``<stage>.<lease id>``, planted when the claim is
    seen): the build fails naming it (before: a bare FileExistsError) and nothing is
    written through it; the next build, once it is gone, succeeds."""
    victim = Victim(tmp_path / "victim")
    cache = tmp_path / "c"
    for plant in ("link", "file"):

        def on_event(name, fields, plant=plant):
            if name == "claimed":
                place = cache / f"{STAGES[0].name}.{fields['lease_id']}"
                if plant == "link":
                    place.symlink_to(victim.path, target_is_directory=True)
                else:
                    place.write_text("x")

        with pytest.raises(ForeignCacheFolderError) as ei:
            ensure_built(cache, "fp", STAGES, builder=True, on_event=on_event, **QUICK)
        msg = str(ei.value)
        what = "a symlink" if plant == "link" else "not a folder"
        assert f"{STAGES[0].name}." in msg and what in msg and "\n" not in msg, msg
        victim.assert_untouched()
        for leftover in cache.glob(f"{STAGES[0].name}.*"):
            leftover.unlink()
    markers = ensure_built(cache, "fp", STAGES, builder=True, **QUICK)
    assert set(markers) == {s.name for s in STAGES}
    victim.assert_untouched()


def test_argument_validation_messages(tmp_path):
    with pytest.raises(ValueError, match="poll_interval must be > 0, got 0"):
        ensure_built(tmp_path, "fp", STAGES, poll_interval=0)
    with pytest.raises(ValueError, match="heartbeat_interval must be <= lease_timeout / 2"):
        ensure_built(tmp_path, "fp", STAGES, lease_timeout=1.0, heartbeat_interval=0.9)
    with pytest.raises(ValueError, match="stage names must be unique"):
        ensure_built(tmp_path, "fp", [STAGES[0], STAGES[0]])
    with pytest.raises(ValueError, match="name must be letters"):
        Stage(name="a/b", build=_write_parts)
    with pytest.raises(ValueError, match="reserved"):
        Stage(name="lease", build=_write_parts)
    with pytest.raises(ValueError, match="scope must be"):
        default_builder(ProcessInfo(), "cluster")


def test_default_builder_scopes():
    p = ProcessInfo(rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1)
    q = ProcessInfo(rank=4, world_size=8, local_rank=0, local_world_size=4, node_rank=1)
    assert not default_builder(p, "shared") and not default_builder(q, "shared")
    assert default_builder(q, "node") and not default_builder(p, "node")
    assert default_builder(p, "process")
    assert default_builder(ProcessInfo(rank=0, world_size=8, local_world_size=4), "shared")


def test_exceptions_pickle_with_their_path():
    for exc in (
        BuildFailedError("m", "/c", lease_id="L", host="h", pid=3, error_type="OSError"),
        CacheWaitTimeout("m", "/c/filtered.json"),
        ReadOnlyCacheError("m", "/c"),
        LeaseLostError("m", "/c", "L"),
    ):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == "m" and back.__dict__ == exc.__dict__
    assert issubclass(CacheWaitTimeout, TimeoutError)
    assert issubclass(ReadOnlyCacheError, PermissionError)
    assert issubclass(BuildFailedError, RuntimeError)


# ----------------------------------------------------------------------------- processes


@pytest.mark.slow
def test_eight_processes_exactly_one_build_per_round(job, tmp_path):
    for round_ in range(3):
        fp = f"round{round_}"
        reference = _clean_hash(job, tmp_path, fp, "--size-mb", "0.5")
        cache = tmp_path / f"shared-{fp}"
        start_at = time.time() + 1.0  # all 8 leave the starting line together
        procs = [
            job.start(
                cache,
                rank,
                "--fingerprint",
                fp,
                "--size-mb",
                "0.5",
                *FAST,
                "--start-at",
                str(start_at),
            )
            for rank in range(8)
        ]
        results = job.wait(procs)
        _assert_same_cache(results, reference)
        assert sorted(line.split()[0] for line in job.builds(cache)) == ["converted", "filtered"]
        builders = [r for r in results if _events(r, "claimed")]
        assert [r["rank"] for r in builders] == [0]


@pytest.mark.slow
def _sigkill_the_builder(job, cache, timing, phase, *, ranks):
    """Start ``ranks`` ranks holding at ``phase``, SIGKILL the builder (rank 0) there:
    the other ranks' results, the one that took over, and when the kill was sent."""
    procs = [job.start(cache, r, *timing, "--hold", f"{phase}:60") for r in range(ranks)]
    victim = job.wait_for_signal(phase)
    assert victim == procs[0].pid  # rank 0 is the builder
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    procs[0].wait(timeout=10)
    results = job.wait(procs[1:])
    takers = [r for r in results if _events(r, "takeover")]
    assert len(takers) == 1, "exactly one waiter takes over"
    return results, takers[0], killed_at


@pytest.mark.parametrize(
    "phase",
    [
        "build-converted",  # inside stage 1's build, files half written
        # after the converted marker, before stage 2 starts
        pytest.param("stage_built", marks=pytest.mark.slow),
        # inside stage 2's build
        pytest.param("build-filtered", marks=pytest.mark.slow),
        "publishing",  # files complete and described, marker about to be published
        # the same for the last stage
        pytest.param("publishing-filtered", marks=pytest.mark.slow),
    ],
)
def test_sigkill_builder_at_each_phase(job, tmp_path, phase):
    reference = _clean_hash(job, tmp_path)
    cache = tmp_path / "shared"
    results, taker, killed_at = _sigkill_the_builder(job, cache, FAST, phase, ranks=4)
    _assert_same_cache(results, reference)
    detected = _events(taker, "takeover")[0][1] - killed_at
    # At once (it exited on this machine), at the latest after lease_timeout without
    # progress (+ a poll and a heartbeat of slack).
    assert detected < LEASE_TIMEOUT + 1.5, f"took {detected:.2f}s to notice"
    expected_builds = {
        "build-converted": ["converted", "converted", "filtered"],
        "stage_built": ["converted", "filtered"],  # stage 1 resumed from its marker
        "build-filtered": ["converted", "filtered", "filtered"],
        "publishing": ["converted", "converted", "filtered"],  # folder without marker: redone
        "publishing-filtered": ["converted", "filtered", "filtered"],
    }[phase]
    assert [line.split()[0] for line in job.builds(cache)] == expected_builds
    # The victim's unpublished folder was collected once the taker published the stage.
    markers = {k: Marker.from_dict(v) for k, v in results[0]["markers"].items()}
    assert sorted(os.listdir(cache)) == _published(markers)


def _exited_process() -> tuple[int, dict]:
    """The pid and process identity of a child that ran and was reaped."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    identity = process_identity(child.pid)
    child.kill()
    child.wait(timeout=10)
    assert identity is not None
    return child.pid, identity


def _lease_naming(cache: Path, pid: int, proc: dict | None) -> None:
    cache.mkdir()
    record = {"lease_id": "gone0001", "host": socket.gethostname(), "pid": pid}
    if proc is not None:
        record["proc"] = proc
    (cache / LEASE_FILE).write_text(json.dumps(record))


def test_lease_of_a_process_that_exited_on_this_machine_is_taken_over_at_once(tmp_path):
    """A builder SIGKILLed (or OOM-killed) on this machine is dead now: no waiting
    lease_timeout for its heartbeat to stall (it used to cost a lease_timeout per unit)."""
    pid, proc = _exited_process()
    _lease_naming(tmp_path / "c", pid, proc)
    events, on_event = _recorder()
    timing = {**QUICK, "lease_timeout": 30.0}
    t0 = time.monotonic()
    markers = ensure_built(tmp_path / "c", "fp", STAGES, builder=True, on_event=on_event, **timing)
    assert time.monotonic() - t0 < 10
    assert [e for e, _ in events][:3] == ["lease_dead", "takeover", "claimed"]
    assert events[1][1]["exited"] is True
    assert sorted(os.listdir(tmp_path / "c")) == _published(markers)


@pytest.mark.parametrize("case", ["running", "pid reused", "other pid namespace", "other boot"])
def test_holder_exited_only_when_provable(tmp_path, case):
    """Only a process of this boot and pid namespace that no longer runs (or whose pid
    now belongs to a process started at another time) is judged exited; a running one,
    or one the reader cannot look up, is judged by its heartbeat."""
    me = process_identity()
    assert me is not None
    pid, proc = os.getpid(), dict(me)
    if case == "pid reused":
        proc["start"] = me["start"] + 1  # our pid, but another process's start time
    elif case == "other pid namespace":
        pid, proc = _exited_process()
        proc["pidns"] = "pid:[1]"
    elif case == "other boot":
        pid, proc = _exited_process()
        proc["boot"] = "00000000-0000-0000-0000-000000000000"
    _lease_naming(tmp_path / "c", pid, proc)
    view = read_lease(tmp_path / "c" / LEASE_FILE)
    assert view is not None
    assert holder_exited(view) is (case == "pid reused")


def test_holder_exited_is_false_for_a_stopped_process_and_true_for_a_zombie():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        proc = process_identity(child.pid)
        view = LeaseView("x", "x", socket.gethostname(), child.pid, tuple(proc.values()))
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert holder_exited(view) is False  # paused: judged by its heartbeat (fencing)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not holder_exited(view):  # a zombie until reaped: exited all the same
            assert time.monotonic() < deadline, "a SIGKILLed child never looked exited"
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait(timeout=10)
    assert holder_exited(view) is True


def test_sigkilled_builder_is_taken_over_at_once_by_a_rank_on_its_machine(job, tmp_path):
    """Ranks on the builder's machine replace a SIGKILLed builder without waiting for a
    long lease_timeout; a SIGSTOPped one is still judged by its heartbeat (above)."""
    reference = _clean_hash(job, tmp_path)
    slow = ["--poll", "0.05", "--lease-timeout", "60", "--heartbeat", "0.2"]
    results, taker, killed_at = _sigkill_the_builder(
        job, tmp_path / "shared", slow, "build-converted", ranks=3
    )
    _assert_same_cache(results, reference)
    _, at, fields = _events(taker, "takeover")[0]
    assert fields["exited"] == "True"
    assert at - killed_at < 10, f"took {at - killed_at:.1f}s with lease_timeout 60"


def test_status_knows_a_builder_on_this_machine_exited_without_watching_it(job, tmp_path):
    """`--status`/`--clean` watch a lease's heartbeat for observe_s to tell a live builder
    from a dead one; a builder on this machine that exited needs no watching."""
    from dist.inventory import list_caches

    root = tmp_path / "root"
    dead = job.start(
        root / "c-dead", 0, "--fingerprint", "dead", *FAST, "--hold", "build-converted:60"
    )
    job.wait_for_signal("build-converted")
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait(timeout=10)
    t0 = time.monotonic()
    (status,) = list_caches(root, observe_s=30)
    assert time.monotonic() - t0 < 10
    assert status.state == "stale" and status.live is False and status.builder_pid == dead.pid


@pytest.mark.slow
def test_paused_builder_loses_lease_and_stands_down(job, tmp_path):
    """SIGSTOP the builder past lease_timeout: a waiter takes over; when the old builder
    resumes it must notice and not publish, and still return the good cache."""
    reference = _clean_hash(job, tmp_path)
    cache = tmp_path / "shared"
    procs = [job.start(cache, rank, *FAST, "--hold", "build-converted:1.0") for rank in range(3)]
    victim = job.wait_for_signal("build-converted")
    os.kill(victim, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 20
        while not any(
            "converted" in line and str(victim) not in line for line in job.builds(cache)
        ):
            assert time.monotonic() < deadline, "nobody took over the paused builder"
            time.sleep(0.05)
    finally:
        os.kill(victim, signal.SIGCONT)
    results = job.wait(procs)
    _assert_same_cache(results, reference)
    old = next(r for r in results if r["pid"] == victim)
    assert _events(old, "lease_lost"), "the paused builder did not notice it lost the lease"
    assert all(r["markers"]["converted"]["pid"] != victim for r in results)


class _PublishedWatch:
    """Polls a cache folder from the test process: the first time a marker is seen, it
    records the marker's bytes and the content of every file it names; every later look
    must find exactly those (a published stage never changes or disappears)."""

    def __init__(self, cache: Path):
        self.cache = cache
        self.seen: dict[str, tuple[bytes, dict[str, bytes]]] = {}
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="published-watch", daemon=True)
        self._thread.start()

    def _look(self) -> None:
        for stage in ("converted", "filtered"):
            try:
                raw = (self.cache / f"{stage}.json").read_bytes()
            except FileNotFoundError:
                if stage in self.seen:
                    self.violations.append(f"{stage}.json disappeared")
                continue
            d = json.loads(raw)
            files = {}
            for f in d["files"]:
                try:
                    files[f["path"]] = xxhash.xxh64((self.cache / f["path"]).read_bytes()).digest()
                except FileNotFoundError:
                    files[f["path"]] = b"missing"
            if stage not in self.seen:
                self.seen[stage] = (raw, files)
            elif self.seen[stage] != (raw, files):
                self.violations.append(f"{stage}: published marker or files changed")

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._look()

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(timeout=10)
        self._look()
        return self.violations


@pytest.mark.slow
@pytest.mark.parametrize(
    "window,layout,wake",
    [
        ("claimed", "same", "complete"),  # right after the O_EXCL claim
        ("build-converted", "same", "complete"),  # inside stage 1's build
        ("build-converted", "other", "complete"),
        ("marker_write-converted", "same", "complete"),  # lease checked, marker not linked
        ("marker_write-converted", "other", "complete"),
        ("marker_write-converted", "other", "takeover"),  # wakes while the taker builds
        ("build-filtered", "other", "complete"),  # inside stage 2's build
        ("marker_write-filtered", "same", "complete"),
        ("marker_write-filtered", "other", "takeover"),
    ],
)
def test_paused_builder_never_changes_a_published_stage(job, tmp_path, window, layout, wake):
    """Issue 8: a builder SIGSTOPped past its lease in any window of either stage, with the
    same or another file layout than its successor (different num_proc), wakes up and can
    neither overwrite, delete nor spoil what is published; it reports it did not build."""
    cache = tmp_path / "shared"
    victim_args = ["--layout", "1"] if layout == "other" else []
    procs = [
        job.start(cache, 0, *FAST, "--build-sleep", "0.6", *victim_args, "--hold", f"{window}:3"),
        *[job.start(cache, r, *FAST, "--build-sleep", "0.6") for r in (1, 2)],
    ]
    victim = job.wait_for_signal(window)
    os.kill(victim, signal.SIGSTOP)
    watch = _PublishedWatch(cache)
    try:
        deadline = time.monotonic() + 30

        def done() -> bool:
            if wake == "complete":
                return len(watch.seen) == 2
            # the victim's lease is gone: it wakes while its successor still builds
            return (read_json(cache / LEASE_FILE) or {}).get("pid") not in (None, victim)

        while not done():
            assert time.monotonic() < deadline, f"no {wake} while the builder was paused"
            time.sleep(0.02)
    finally:
        os.kill(victim, signal.SIGCONT)
    results = job.wait(procs)
    assert watch.stop() == []
    for r in results:
        assert r["ok"], f"rank {r['rank']}: {r.get('error_type')}: {r.get('error')}\n{r['output']}"
    assert len({r["content_hash"] for r in results}) == 1
    assert all(r["markers"] == results[0]["markers"] for r in results)
    # A process says it built exactly when its lease published a stage.
    assert {r["pid"] for r in results if r["built"]} == {
        m["pid"] for m in results[0]["markers"].values()
    }
    if wake == "complete":  # the paused stage is its successor's
        stage = "converted" if window in ("claimed", "build-converted") else window.split("-")[-1]
        assert results[0]["markers"][stage]["pid"] != victim
        old = next(r for r in results if r["pid"] == victim)
        assert old["built"] == (stage == "filtered")  # it did publish stage 1 before
    markers = {k: Marker.from_dict(v) for k, v in results[0]["markers"].items()}
    assert sorted(os.listdir(cache)) == _published(markers)  # unpublished folders collected


@pytest.mark.slow
def test_waiters_get_build_failed_error_promptly(job, tmp_path):
    cache = tmp_path / "shared"
    # Waiters must be waiting when the build fails: a failure record that predates a
    # waiter is history to it (it would wait lease_timeout, then retry the build itself).
    start_at = str(time.time() + 1.0)
    args = ["--fail-stage", "filtered", "--build-sleep", "0.5", "--start-at", start_at]
    timing = ["--poll", "0.5", "--lease-timeout", "30", "--heartbeat", "1"]
    procs = [job.start(cache, rank, *args, *timing) for rank in range(3)]
    results = job.wait(procs, timeout=30)
    assert results[0]["error_type"] == "RuntimeError"
    for r in results[1:]:
        assert r["error_type"] == "BuildFailedError", r
        assert "injected failure in filtered" in r["error"]
        assert r["returned_at"] - results[0]["returned_at"] < 2.0  # a poll, not a timeout


@pytest.mark.slow
def test_wait_timeout_names_marker_and_builder(job, tmp_path):
    cache = tmp_path / "shared"
    builder = job.start(
        cache,
        0,
        "--poll",
        "0.05",
        "--lease-timeout",
        "20",
        "--heartbeat",
        "0.2",
        "--hold",
        "build-converted:60",
    )
    job.wait_for_signal("build-converted")
    t0 = time.monotonic()
    with pytest.raises(CacheWaitTimeout) as info:
        ensure_built(
            cache,
            "fp0",
            STAGES,
            builder=False,
            poll_interval=0.05,
            max_wait=1.0,
            lease_timeout=20,
            heartbeat_interval=0.2,
        )
    assert time.monotonic() - t0 < 3
    msg = str(info.value)
    assert str(cache / "filtered.json") in msg and f"pid {builder.pid}" in msg
    assert socket.gethostname() in msg and "last heartbeat progress" in msg
    assert info.value.path == str(cache / "filtered.json")


# ----------------------------------------------------------------------------- mounts


@pytest.mark.slow
def test_full_disk_fails_cleanly_then_succeeds_after_growing(job, tmp_path, mounts):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounts("-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk))
    cache = disk / "c-fp0"
    args = [*FAST, "--size-mb", "1", "--files", "3", "--lease-timeout", "30", "--heartbeat", "1"]
    # Start together: a failure record older than a waiter is history to it (see
    # test_waiters_get_build_failed_error_promptly).
    start_at = str(time.time() + 1.0)
    procs = [job.start(cache, rank, *args, "--start-at", start_at) for rank in range(3)]
    results = job.wait(procs, timeout=60)
    builder, waiters = results[0], results[1:]
    assert builder["error_type"] == "OSError" and "No space left" in builder["error"], builder
    for r in waiters:
        assert r["error_type"] == "BuildFailedError", r
        assert "No space left" in r["error"]
        assert r["returned_at"] - builder["returned_at"] < 2.0
    names = os.listdir(cache)
    assert not any(n in ("converted", "converted.json") or ".tmp-" in n for n in names), names
    # Free space: grow the tmpfs; the same job runs again and succeeds.
    _mount("-o", "remount,size=32m", str(disk))
    results = job.wait([job.start(cache, rank, *args) for rank in range(3)], timeout=60)
    _assert_same_cache(results, _clean_hash(job, tmp_path, "fp0", "--size-mb", "1"))
    assert not any(n.startswith("failed-") for n in os.listdir(cache))


def test_read_only_mount_of_built_cache_returns_without_writing(tmp_path, mounts):
    cache = tmp_path / "rw" / "c"
    built = ensure_built(cache, "fp", STAGES, builder=True, **QUICK)
    ro = tmp_path / "ro"
    ro.mkdir()
    mounts("--bind", str(tmp_path / "rw"), str(ro))
    _mount("-o", "remount,bind,ro", str(ro))
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*")}
    markers = ensure_built(ro / "c", "fp", STAGES, builder=True, **QUICK)
    assert {k: m.files for k, m in markers.items()} == {k: m.files for k, m in built.items()}
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*")} == before


def test_read_only_mount_of_unbuilt_cache_raises_at_once(tmp_path, mounts):
    (tmp_path / "rw" / "c").mkdir(parents=True)
    ro = tmp_path / "ro"
    ro.mkdir()
    mounts("--bind", str(tmp_path / "rw"), str(ro))
    _mount("-o", "remount,bind,ro", str(ro))
    for target in (ro / "c", ro / "not-yet-created"):
        t0 = time.monotonic()
        with pytest.raises(ReadOnlyCacheError) as info:
            ensure_built(target, "fp", STAGES, builder=False, **QUICK)
        assert time.monotonic() - t0 < 0.5
        assert "scripts/prebuild_cache.py --config" in str(info.value)
        assert info.value.path == str(target)
        assert isinstance(info.value, PermissionError)
    assert os.listdir(tmp_path / "rw" / "c") == []


# ----------------------------------------------------------------------------- gloo


@pytest.mark.slow
def test_gloo_waiters_wake_within_a_second_despite_long_poll(job, tmp_path):
    pytest.importorskip("torch.distributed")
    cache = tmp_path / "shared"
    world = 3
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world)}
    procs = [
        job.start(
            cache,
            rank,
            "--gloo",
            "--poll",
            "30",
            "--lease-timeout",
            "120",
            "--heartbeat",
            "1",
            "--build-sleep",
            "1.5",
            env=env,
        )
        for rank in range(world)
    ]
    results = job.wait(procs, timeout=90)
    for r in results:
        assert r["ok"], r
    published = _events(results[0], "complete")[0][1]
    for r in results[1:]:
        assert r["returned_at"] - published < 1.0, (
            f"rank {r['rank']} woke {r['returned_at'] - published:.2f}s after publication"
        )


# ----------------------------------------------------------------------------- inventory


@pytest.mark.slow
def test_inventory_status_verify_and_clean(job, tmp_path):
    from dist.inventory import clean, list_caches, verify

    root = tmp_path / "root"
    ensure_built(root / "c-complete", "complete", STAGES, builder=True, **QUICK)
    ensure_built(root / "c-partial", "partial", STAGES[:1], builder=True, **QUICK)
    corrupt = ensure_built(root / "c-corrupt", "corrupt", STAGES, builder=True, **QUICK)
    (root / "c-corrupt" / corrupt["filtered"].directory / "part-0.bin").write_bytes(b"short")
    # Not caches: a dot-folder and a folder of unrelated JSON files (e.g. a listing cache).
    (root / ".staging").mkdir()
    (root / "hub_listings").mkdir()
    (root / "hub_listings" / "org--repo-main.json").write_text("{}")
    with pytest.raises(ZeroDivisionError):
        ensure_built(
            root / "c-failed",
            "failed",
            [Stage(name="converted", build=lambda ctx: 1 / 0 or {})],
            builder=True,
            **QUICK,
        )
    # A dead builder: SIGKILLed inside its build, lease and tmp folder left behind.
    dead = job.start(
        root / "c-dead", 0, "--fingerprint", "dead", *FAST, "--hold", "build-converted:60"
    )
    job.wait_for_signal("build-converted")
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait(timeout=10)
    # A live builder, holding in its build with heartbeats every 0.2 s.
    live = job.start(
        root / "c-live", 0, "--fingerprint", "live", *FAST, "--hold", "build-filtered:60"
    )
    job.wait_for_signal("build-filtered")

    states = {s.path.name: s for s in list_caches(root, observe_s=0.8)}
    assert {k: s.state for k, s in states.items()} == {
        "c-complete": "complete",
        "c-corrupt": "corrupt",
        "c-dead": "stale",
        "c-failed": "failed",
        "c-live": "building",
        "c-partial": "partial",
    }
    assert states["c-partial"].stages_done == ("converted",)  # resumes after stage 1
    assert states["c-live"].builder_pid == live.pid and states["c-live"].live is True
    assert states["c-live"].heartbeat_stage == "filtered"
    assert states["c-dead"].live is False and states["c-dead"].builder_pid == dead.pid
    assert any("ZeroDivisionError" in p for p in states["c-failed"].problems)
    assert states["c-complete"].fingerprint == "complete"
    assert states["c-complete"].size_bytes >= 4000

    assert verify(root / "c-complete") == []
    (problem,) = verify(root / "c-corrupt")
    assert problem.startswith("filtered: ") and "part-0.bin" in problem
    complete = read_json(root / "c-complete" / "converted.json")["directory"]
    part = root / "c-complete" / complete / "part-1.bin"
    part.write_bytes(b"\x00" * part.stat().st_size)  # same size, other bytes
    assert verify(root / "c-complete") == [
        f"converted: listed file '{complete}/part-1.bin' checksum mismatch"
    ]

    expected = {root / "c-corrupt", root / "c-dead", root / "c-failed"}
    assert set(clean(root, dry_run=True, observe_s=0.8).removed) == expected
    assert all(p.exists() for p in expected)
    assert set(clean(root, dry_run=False, observe_s=0.8).removed) == expected
    assert sorted(p.name for p in root.iterdir()) == [
        ".staging",
        "c-complete",
        "c-live",
        "c-partial",
        "hub_listings",
    ]
    os.kill(live.pid, signal.SIGKILL)


@pytest.mark.slow
def test_gloo_builder_sigkilled_waiters_fall_back_to_polling_and_take_over(job, tmp_path):
    """Rank 0 hosts the TCPStore: killing it kills the doorbell too; waiters must not
    hang on the store, and one must take over."""
    pytest.importorskip("torch.distributed")
    reference = _clean_hash(job, tmp_path)
    cache = tmp_path / "shared"
    world = 3
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world)}
    procs = [
        job.start(cache, rank, "--gloo", "--no-barrier", *FAST, "--hold", "build-converted:60",
                  env=env)
        for rank in range(world)
    ]  # fmt: skip
    victim = job.wait_for_signal("build-converted", timeout=60)
    assert victim == procs[0].pid
    os.kill(victim, signal.SIGKILL)
    results = job.wait(procs[1:], timeout=60)
    _assert_same_cache(results, reference)
    assert sum(bool(_events(r, "takeover")) for r in results) == 1


def _tree_bytes(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize("built", [False, True], ids=["empty", "complete"])
def test_a_folder_whose_identity_names_another_fingerprint_is_refused(built, tmp_path):
    """A cache folder whose identity file names another fingerprint (copied, renamed or
    planted) is no cache to status/verify/clean; the coordinator built into it (empty)
    or served its markers (complete). Now every process refuses it with one line naming
    the folder and both fingerprints, and nothing in it changes."""
    from dist.errors import ForeignCacheFolderError
    from dist.layout import identity_bytes

    cache = tmp_path / "c-fp"
    if built:
        ensure_built(cache, "fp", STAGES, builder=True, **QUICK)
        (cache / IDENTITY_FILE).unlink()
    else:
        cache.mkdir()
    (cache / IDENTITY_FILE).write_bytes(identity_bytes("other", host="h", pid=1))
    before = _tree_bytes(cache)
    for builder in (True, False):
        with pytest.raises(ForeignCacheFolderError) as info:
            ensure_built(cache, "fp", STAGES, builder=builder, **QUICK)
        message = str(info.value)
        assert str(cache) in message and "'other'" in message and "'fp'" in message, message
        assert "\n" not in message and info.value.path == str(cache)
        assert pickle.loads(pickle.dumps(info.value)).path == str(cache)
    assert _tree_bytes(cache) == before


def test_a_waiter_says_whom_it_waits_for_then_reports_every_interval(
    job, tmp_path, caplog, monkeypatch
):
    """A process waiting for another builder printed nothing for the whole wait (52 s,
    then `[found]`: outside tester). One INFO line when the wait starts, naming the
    builder (host/pid) and what it waits for, then one per WAIT_REPORT_S, not more."""
    import dist.coordinator as coordinator

    monkeypatch.setattr(coordinator, "WAIT_REPORT_S", 0.5)
    cache = tmp_path / "shared"
    builder = job.start(cache, 0, "--poll", "0.05", "--lease-timeout", "20",
                        "--heartbeat", "0.2", "--hold", "build-converted:60")  # fmt: skip
    job.wait_for_signal("build-converted")
    caplog.set_level(logging.INFO, logger="dist.coordinator")
    with pytest.raises(CacheWaitTimeout):
        ensure_built(cache, "fp0", STAGES, builder=False, poll_interval=0.05, max_wait=1.8,
                     lease_timeout=20, heartbeat_interval=0.2)  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if r.name == "dist.coordinator"]
    who = f"{socket.gethostname()}/{builder.pid}"
    started = [m for m in lines if m.startswith("waiting for ")]
    assert started == [f"waiting for {cache} (stages converted, filtered): built by {who}"]
    still = [m for m in lines if m.startswith("still waiting for ")]
    assert 2 <= len(still) <= 4, lines  # ~1.8 s / 0.5 s
    assert all(f"built by {who}" in m and "last heartbeat progress" in m for m in still)


def test_only_each_hosts_first_rank_reports_its_wait(job, tmp_path, caplog, monkeypatch):
    """A rank other than its host's first (local_rank 1) waits as quietly as before at
    INFO: its waiting lines are DEBUG, so a large job logs one line per host, not one
    per rank, every WAIT_REPORT_S."""
    import dist.coordinator as coordinator
    from dist.env import ProcessInfo

    monkeypatch.setattr(coordinator, "WAIT_REPORT_S", 0.5)
    cache = tmp_path / "shared"
    job.start(cache, 0, "--poll", "0.05", "--lease-timeout", "20", "--heartbeat", "0.2",
              "--hold", "build-converted:60")  # fmt: skip
    job.wait_for_signal("build-converted")
    caplog.set_level(logging.DEBUG, logger="dist.coordinator")
    second = ProcessInfo(rank=1, world_size=2, local_rank=1, local_world_size=2, node_rank=0,
                         source="test")  # fmt: skip
    with pytest.raises(CacheWaitTimeout):
        ensure_built(cache, "fp0", STAGES, process=second, poll_interval=0.05, max_wait=1.3,
                     lease_timeout=20, heartbeat_interval=0.2)  # fmt: skip
    waits = [r for r in caplog.records if "waiting for" in r.getMessage()]
    assert waits and {r.levelno for r in waits} == {logging.DEBUG}, waits


@pytest.mark.parametrize("builder", [True, False])
def test_a_symlink_in_the_cache_folders_place_is_refused(tmp_path, builder):
    """The cache root is shared: someone put a symlink where a cache folder belongs,
    aimed at a folder of the user's. The coordinator built into it (lease, identity,
    stage folders, markers) and, once a stage published, removed every stage-named
    folder there that its marker does not name (`converted.<16 hex>`: a private cache's
    published stage). Now every process refuses it in one line naming the link; the
    folder it names is as it was."""
    from dist.errors import ForeignCacheFolderError

    victim = Victim(tmp_path / "victim")
    (victim.path / "converted.0123456789abcdef").mkdir()
    (victim.path / "converted.0123456789abcdef" / "part-0.bin").write_bytes(b"years of work")
    victim = Victim(victim.path)
    root = tmp_path / "root"
    root.mkdir()
    cache = root / "c-fp"
    cache.symlink_to(victim.path)
    with pytest.raises(ForeignCacheFolderError) as info:
        ensure_built(cache, "fp", STAGES, builder=builder, **QUICK)
    message = str(info.value)
    assert message.startswith(f"{cache}: a symlink where hf_pipeline keeps"), message
    assert "\n" not in message and info.value.path == str(cache)
    victim.assert_untouched()
    assert sorted(os.listdir(root)) == ["c-fp"]
    # The root itself may be a link (HF_HOME -> /mnt/nfs/...): its caches build.
    cache.unlink()
    real = tmp_path / "nfs"
    real.mkdir()
    linked_root = tmp_path / "hf_home"
    linked_root.symlink_to(real)
    if builder:
        markers = ensure_built(linked_root / "c-fp", "fp", STAGES, builder=True, **QUICK)
        assert sorted(os.listdir(real / "c-fp")) == _published(markers)
    victim.assert_untouched()
