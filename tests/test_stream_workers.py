# ruff: noqa: F811 - pytest fixtures imported from tests.test_stream are parameters here
"""Streaming with the reads and gathers in worker processes
(hf_pipeline.read.stream.workers, ``loader.stream_workers``), against the real
fake-gcs-server with real processes: one process's batches bit for bit (every shuffle
mode, 1 and 2 ranks, across epochs, exact and elastic resume); a worker's error is the
one-process error; a worker killed is named, never a hang; the workers leave with their
parent (SIGKILL, Ctrl-C), with close() and with the garbage collector, leaving no
process and no shared memory; the cache limit holds for the host."""

from __future__ import annotations

import gc
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hf_pipeline.errors import CacheFormatError, ConfigError, StoreUnreachableError
from hf_pipeline.read.loader import Loader
from hf_pipeline.read.stream import StreamOptions, StreamSource, StreamWorkers, open_stream
from hf_pipeline.stores.retry import RetryPolicy
from hf_pipeline.workers.persistent import WorkerExitedError
from tests.helpers.publishing import config, gcs_store  # noqa: F401
from tests.servers.proxy import Fault, FaultProxy
from tests.test_stream import (  # noqa: F401
    _FAST,
    _ORDERS,
    _epoch,
    _resumes_as_local,
    _same,
    _tamper,
    gcs_cache,
    local_source,
)

pytestmark = pytest.mark.remote


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _all_gone(pids: list[int], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_gone(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return all(_gone(pid) for pid in pids)


def _my_workers() -> list[int]:
    """Stream worker processes of this process still running."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and b"read.stream.worker" in cmdline:
            if fields[0] not in ("Z", "X"):
                out.append(int(entry))
    return out


def _open_files(pid: int | str = "self") -> list[str]:
    """What process ``pid`` has open or mapped: its descriptors' targets and its maps."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return out + Path(f"/proc/{pid}/maps").read_text().splitlines()


def _slot_fds() -> list[str]:
    """This process's descriptors and maps of stream slots."""
    return [line for line in _open_files() if "hf_pipeline-stream-slot" in line]


def _named_shm(pid: int | str = "self") -> list[str]:
    """Named shared memory process ``pid`` holds that would outlive it (a /dev/shm
    file not unlinked): none of ours ever is (the slots are memfds, freed by the kernel
    with their last holder, SIGKILL included). /dev/shm itself is not compared: the
    rest of the suite, beside, fills it."""
    return [line for line in _open_files(pid) if "/dev/shm/" in line and "(deleted)" not in line]


def test_workers_give_one_process_batches(gcs_cache, local_source):
    """Three workers, a small cache (planned ahead, blocks evicted), every shuffle mode,
    1 and 2 processes, two epochs (across the boundary): bit for bit the local loader's
    batches; the workers' caches together stay within the host's limit."""
    _, url = gcs_cache
    limit = 3_000_000
    options = StreamOptions(cache_bytes=limit, ahead=3)
    with StreamWorkers(url, options, workers=3, slots=3, policy=_FAST) as stream:
        assert stream.num_rows == local_source.num_rows
        assert stream.worker_options.cache_bytes == limit // 3
        for order in _ORDERS:
            kw = {"global_batch_size": 24, "seed": 5, "num_threads": 2, **order}
            for count in (1, 2):
                for index in range(count):
                    share = {"process_index": index, "process_count": count}
                    want = _epoch(Loader(local_source, **share, **kw).epochs(2))
                    _same(want, _epoch(Loader(stream, **share, **kw).epochs(2)))
            state = stream.cache_state()
            assert state["bytes"] + state["reserved_bytes"] <= state["limit_bytes"] <= limit
        stats = stream.stats()
        assert stats.planned_blocks > 0 and stats.max_held_bytes <= limit
        assert stats.limit_bytes <= limit
        assert stats.retries == stats.refetched == 0


@pytest.mark.slow  # the loop keeps the workers' equality, error and killed-worker tests
def test_workers_resume_exactly_and_elastically(gcs_cache, local_source):
    """A state saved mid-epoch (into the second) by a loader over workers with 4
    processes resumes exactly on 4 and on 3 processes, global and block shuffle."""
    _, url = gcs_cache
    with StreamWorkers(url, StreamOptions(cache_bytes=1 << 20), workers=2, policy=_FAST) as s:
        for shuffle in ("global", "block"):
            kw = {"global_batch_size": 24, "seed": 7, "shuffle": shuffle, "block_size": 8}
            _resumes_as_local(s, local_source, kw)


def _error_of(source, **kw) -> BaseException:
    loader = Loader(source, process_index=0, process_count=1, **kw)
    try:
        with pytest.raises(Exception) as err:
            _epoch(loader)
    finally:
        loader.close()
    return err.value


def test_a_workers_error_is_the_one_process_error(gcs_cache):
    """A tampered range, refused by a worker: the consumer gets the error one process
    gives, same type, same one line naming the file."""
    server, url = gcs_cache
    rel = _tamper(server, url)
    kw = {"global_batch_size": 16, "seed": 3, "shuffle": "sequential"}
    with StreamSource(url, StreamOptions(cache_bytes=0), policy=_FAST) as s:
        want = _error_of(s, **kw)
    with StreamWorkers(url, StreamOptions(cache_bytes=0), workers=2, policy=_FAST) as s:
        got = _error_of(s, **kw)
        assert isinstance(want, CacheFormatError) and type(got) is type(want)
        assert str(got) == str(want) and rel in str(got) and len(str(got).splitlines()) == 1


@pytest.mark.slow  # the loop keeps the workers' equality, error and killed-worker tests
def test_a_hopeless_store_through_workers_is_one_line(gcs_cache, monkeypatch):
    """Every read of the workers fails (503 forever): one StoreUnreachableError naming
    the file, the one process's line, within the retries' bounded time."""
    server, url = gcs_cache
    policy = RetryPolicy(max_retries=2, file_timeout=1.0, backoff_base=0.01, backoff_max=0.05)
    with FaultProxy(server) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)  # the workers' too
        with StreamWorkers(url, StreamOptions(cache_bytes=1 << 20), workers=2, policy=policy) as s:
            proxy.add(Fault(match=".arrow", action="status", status=503, times=-1))
            t0 = time.monotonic()
            err = _error_of(s, global_batch_size=8)
            assert time.monotonic() - t0 < 30
    assert isinstance(err, StoreUnreachableError), repr(err)
    assert ".arrow" in err.path and len(str(err).splitlines()) == 1


def test_a_killed_worker_is_named_never_a_hang(gcs_cache):
    """A worker SIGKILLed mid-epoch: the consumer gets an error naming it and its
    signal within seconds (never a hang, whatever batches were in flight); the other
    workers and the shared memory go with close()."""
    _, url = gcs_cache
    stream = StreamWorkers(url, StreamOptions(cache_bytes=1 << 20), workers=2, policy=_FAST)
    pids = stream.pids
    loader = Loader(stream, process_index=0, process_count=1, global_batch_size=16)
    it = iter(loader.epochs(None))
    next(it)
    assert not any(_named_shm(pid) for pid in pids)
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerExitedError) as err:
        for _ in range(10_000):
            next(it)
    assert time.monotonic() - t0 < 20
    message = str(err.value)
    assert f"pid {pids[1]}" in message and "SIGKILL" in message, message
    assert err.value.pid == pids[1] and len(message.splitlines()) == 1
    with pytest.raises(WorkerExitedError):  # the stream is broken from then on
        next(iter(loader))
    loader.close()
    stream.close()
    assert _all_gone(pids) and not _slot_fds() and not _named_shm()


@pytest.mark.slow  # the loop keeps the workers' equality, error and killed-worker tests
def test_close_and_the_garbage_collector_leave_nothing(gcs_cache):
    """close() mid-epoch, and a stream merely dropped: the workers exit and no shared
    memory stays (no slot descriptor or map here; none ever in /dev/shm)."""
    _, url = gcs_cache
    for how in ("close", "gc"):
        stream = StreamWorkers(url, StreamOptions(cache_bytes=1 << 20), workers=2, policy=_FAST)
        pids = stream.pids
        loader = Loader(stream, process_index=0, process_count=1, global_batch_size=16)
        it = iter(loader)
        next(it)
        # The slots are mapped here, anonymous (memfd: no name, nothing in /dev/shm).
        slots = _slot_fds()
        assert slots and all(s.startswith("/memfd:") or "/memfd:" in s for s in slots), slots
        if how == "close":
            stream.close()
            stream.close()  # idempotent
            it.close()
        else:
            del it, loader, stream
            gc.collect()
        assert _all_gone(pids), how
        assert not _slot_fds() and not _named_shm(), how


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_the_parent_killed_or_interrupted_takes_its_workers(sig, gcs_cache):
    """A training process streaming with two workers, SIGKILLed (no clean-up of its
    own) or interrupted (Ctrl-C): its workers exit within seconds. Neither it nor they
    hold named shared memory (/dev/shm) that could stay behind."""
    from tests.conftest import REPO, script_env

    server, url = gcs_cache
    env = script_env(
        HF_PIPELINE_STREAM_FROM=url,
        HF_PIPELINE_STREAM_WORKERS="2",
        STORAGE_EMULATOR_HOST=server,
        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
        JAX_PLATFORMS="cpu",
    )
    # Started as a terminal starts it, SIGINT at its default: a suite run in the
    # background of a script (`cmd &`) passes SIGINT ignored to its children, and the
    # process then rightly ignored the Ctrl-C (the full suite's only failure, twice).
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "procs" / "stream_workers_parent.py"),
         "loader.global_batch_size=16", "loader.stream_cache_bytes=1000000"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line, proc.stderr.read()[-3000:]  # type: ignore[union-attr]
        pids = json.loads(line)["pids"]
        assert len(pids) == 2 and not any(_gone(pid) for pid in pids)
        assert not any(_named_shm(pid) for pid in [proc.pid, *pids])
        proc.send_signal(sig)
        proc.wait(timeout=60)
        assert _all_gone(pids), [p for p in pids if not _gone(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()  # type: ignore[union-attr]
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in err and err.count("Traceback") == 1, err[-3000:]


@pytest.mark.slow  # the loop keeps the workers' equality, error and killed-worker tests
def test_the_config_asks_for_workers(gcs_cache, source_cache, monkeypatch):
    """``loader.stream_workers`` (and HF_PIPELINE_STREAM_WORKERS): open_stream gives
    stream workers, each with its share of ``stream_cache_bytes``, ``loader.prefetch +
    1`` slots of shared memory; 1 (the default) is a StreamSource in this process, as
    is ``workers=1`` for the torch and Grain adapters; a stream of workers does not
    pickle; the bounds are the class's."""
    from hf_pipeline.config import load_config
    from hf_pipeline.read.stream.workers import MAX_WORKERS

    _, url = gcs_cache
    base = [f"loader.stream_from={url}", "loader.stream_cache_bytes=1000000"]
    cfg = load_config(None, base, environ={})
    assert cfg.loader.stream_workers == 1
    with open_stream(cfg.loader, cfg.data) as s:
        assert type(s) is StreamSource
    cfg = load_config(None, base, environ={"HF_PIPELINE_STREAM_WORKERS": "2"})
    assert cfg.loader.stream_workers == 2
    with open_stream(cfg.loader, cfg.data, workers=1) as s:
        assert type(s) is StreamSource
    cfg = load_config(None, [*base, "loader.stream_workers=3", "loader.prefetch=2"], environ={})
    with open_stream(cfg.loader, cfg.data) as s:
        assert type(s) is StreamWorkers and len(s.pids) == 3
        assert s.worker_options.cache_bytes == 1_000_000 // 3
        batch = next(iter(Loader.from_config(s, cfg.loader, process_index=0, process_count=1)))
        assert batch["latents"].shape[0] == 64
        assert len([fd for fd in _slot_fds() if fd.startswith("/memfd:")]) == 3
        assert s.cache_state()["limit_bytes"] == 3 * (1_000_000 // 3)
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(s)
    # A folder that is not a published cache: this process's own error (the workers,
    # started beside its open, are stopped at once).
    from hf_pipeline.errors import SourceError

    missing = url.rsplit("-", 1)[0] + "-0123456789abcdef"
    with pytest.raises(SourceError, match="not a published cache"):
        StreamWorkers(missing, workers=2, policy=_FAST)
    assert _all_gone(_my_workers(), timeout=5.0)
    for value in (0, MAX_WORKERS + 1):
        with pytest.raises(ConfigError, match="loader.stream_workers"):
            load_config(None, [f"loader.stream_workers={value}"], environ={})
    with pytest.raises(ValueError, match="workers must be in"):
        StreamWorkers(url, workers=0)


def test_a_batch_a_worker_has_no_row_of_is_still_whole(gcs_cache, local_source):
    """More workers than rows in some batches' stripes (a batch of 2 rows, 4 workers):
    the workers with no row of a batch still let it through, and it is the local one."""
    _, url = gcs_cache
    kw = {"global_batch_size": 2, "seed": 1, "shuffle": "sequential"}
    with StreamWorkers(url, StreamOptions(cache_bytes=0), workers=4, policy=_FAST) as s:
        got = _epoch(Loader(s, process_index=0, process_count=1, **kw), limit=40)
    want = _epoch(Loader(local_source, process_index=0, process_count=1, **kw), limit=40)
    _same(want, got)
    assert np.concatenate([b["keys"] for b in got]).size == 80


@pytest.mark.timeout(120)
def test_a_workers_planner_may_look_further_than_the_plan_was_sent(
    gcs_cache, local_source, monkeypatch
):
    """A worker's planner may look further ahead than the parent sends the plan unasked
    (a refill after the batch being gathered, its completion, the next lookahead: up to
    ``3 x ahead``): it asks for the batches it waits on. Here the parent sends only
    ``slots`` batches ahead unasked (its slack lowered), so every refill asks; the
    batches are the local ones. Without asking, the bench's workers waited forever on a
    plan 73 batches ahead, with the first gather's refill needing the 74th."""
    import hf_pipeline.read.stream.workers as workers_module

    _, url = gcs_cache
    ahead = 8
    monkeypatch.setattr(workers_module, "_FEED_SLACK", -2 * ahead)
    kw = {"global_batch_size": 16, "seed": 4, "shuffle": "block", "block_size": 32}
    options = StreamOptions(ahead=ahead, cache_bytes=8 << 20)
    with StreamWorkers(url, options, workers=2, slots=2, policy=_FAST) as s:
        loader = Loader(s, process_index=0, process_count=1, **kw)
        got = _epoch(loader.epochs(None), limit=60)
        loader.close()
    want = _epoch(Loader(local_source, process_index=0, process_count=1, **kw).epochs(3))
    _same(want[:60], got)
