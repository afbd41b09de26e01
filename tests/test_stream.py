# ruff: noqa: F811 - pytest fixtures imported from tests.helpers are parameters here
"""Streaming a published cache in place (hf_pipeline.read.stream): the same batches as
the local memory-mapped loader, bit for bit, from the real fake-gcs-server and the
local Hub server; a tampered byte range refused; 503/reset/truncation/stall survived
through a fault proxy; a hopeless store one clear error; the local cache bounded; exact
and elastic resume; the torch adapter."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_pipeline.adapters.torch_data import TorchBatches
from hf_pipeline.cache.layout import open_sample_source
from hf_pipeline.errors import CacheFormatError, StoreUnreachableError
from hf_pipeline.publish.upload import publish_cache
from hf_pipeline.read.loader import Loader
from hf_pipeline.read.stream import StreamOptions, StreamSource, open_stream
from hf_pipeline.stores.retry import RetryPolicy
from tests.helpers.publishing import (  # noqa: F401
    config,
    gcs_store,
    hub_store,
)
from tests.servers import gcs_fs
from tests.servers.proxy import Fault, FaultProxy

pytestmark = pytest.mark.remote

# Quick retries for the tests that inject faults; a generous per-read deadline for the
# healthy store, whose tests assert no retry at all: under a load average of 9-15 a read
# from fake-gcs-server passed 5 s and was retried (29 retries, a full-suite failure).
_FAST = RetryPolicy(max_retries=4, file_timeout=30.0, backoff_base=0.01, backoff_max=0.05)


def _publish(source_cache, url: str) -> str:
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    return f"{url}/{Path(src.cache_dir).name}"


@pytest.fixture
def gcs_cache(source_cache, gcs_store):
    """``(server url, published cache folder URL)`` on a fresh fake-gcs-server bucket."""
    server, url = gcs_store
    return server, _publish(source_cache, url)


@pytest.fixture
def local_source(source_cache):
    src = source_cache.result
    with open_sample_source(src.layout, src.fingerprint) as source:
        yield source


def _epoch(loader, limit: int | None = None) -> list[dict[str, np.ndarray]]:
    out = []
    for batch in loader:
        out.append({k: np.asarray(v) for k, v in batch.items()})
        if limit is not None and len(out) == limit:
            break
    return out


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, (i, k)
            assert x[k].tobytes() == y[k].tobytes(), f"batch {i} {k} differs"


_ORDERS = [
    {"shuffle": "global", "crop": "random"},
    {"shuffle": "block", "block_size": 16, "window_blocks": 2, "crop": "random"},
    {"shuffle": "sequential", "crop": "all"},
    {"shuffle": "global", "crop": 1, "partition": "strided", "drop_last": False},
]


@pytest.mark.parametrize("order", _ORDERS, ids=lambda o: "-".join(map(str, o.values())))
def test_streamed_batches_equal_local_gcs(order, gcs_cache, local_source):
    """1 and 2 processes, every shuffle mode: bit for bit the local loader's batches;
    a small cache (planned ahead, blocks evicted) and ``num_threads=2`` gathers."""
    _, url = gcs_cache
    kw = {"global_batch_size": 24, "seed": 5, "num_threads": 2, **order}
    with StreamSource(url, StreamOptions(cache_bytes=3_000_000, ahead=3), policy=_FAST) as stream:
        assert stream.num_rows == local_source.num_rows
        for count in (1, 2):
            for index in range(count):
                share = {"process_index": index, "process_count": count}
                want = _epoch(Loader(local_source, **share, **kw))
                _same(want, _epoch(Loader(stream, **share, **kw)))
        stats = stream.stats()
        assert stats.planned_blocks > 0 and stats.max_held_bytes <= 3_000_000
        assert stats.retries == stats.refetched == 0


@pytest.mark.slow
def test_streamed_batches_equal_local_hub(source_cache, hub_store, local_source):
    _, url = hub_store
    url = _publish(source_cache, url)
    kw = {"global_batch_size": 24, "seed": 2, "shuffle": "block", "block_size": 8}
    with StreamSource(url, StreamOptions(cache_bytes=1 << 20), policy=_FAST) as stream:
        for index in range(2):
            share = {"process_index": index, "process_count": 2}
            _same(
                _epoch(Loader(local_source, **share, **kw)), _epoch(Loader(stream, **share, **kw))
            )


def _live_buffer_bytes(source: StreamSource) -> int:
    """Bytes of the distinct buffers the source's held blocks keep alive."""
    with source._lock:
        buffers = {id(buf): buf for buf, _ in source._blocks.values()}
    return sum(buf.nbytes for buf in buffers.values())


def test_pure_streaming_and_the_cache_limit(gcs_cache, local_source):
    """cache_bytes=0 streams on demand and holds nothing; a small limit is never
    passed, counted from the blocks the cache holds after every batch."""
    _, url = gcs_cache
    kw = {"global_batch_size": 16, "seed": 1, "shuffle": "global"}
    want = _epoch(Loader(local_source, process_index=0, process_count=1, **kw))
    for limit in (0, 1_500_000):
        with StreamSource(url, StreamOptions(cache_bytes=limit, ahead=4), policy=_FAST) as s:
            got = []
            for batch in Loader(s, process_index=0, process_count=1, num_threads=1, **kw):
                got.append({k: np.asarray(v) for k, v in batch.items()})
                state = s.cache_state()
                assert state["bytes"] + state["reserved_bytes"] <= limit, state
                # The memory the held blocks keep alive, not only their count: blocks
                # share their read's buffer, and a block dropped from a shared buffer
                # kept all of it alive (1.81 MB behind a 1.5 MB limit).
                assert _live_buffer_bytes(s) <= limit, (_live_buffer_bytes(s), state)
                # The planner remembers at most its lookahead's steps (it once kept
                # every consumed step of an on-demand stream: growth without bound).
                planner = s._planner
                if planner is not None:
                    assert len(planner._released) + len(planner._planned) <= 4 + 1
            _same(want, got)
            stats = s.stats()
            assert stats.max_held_bytes <= limit
            if limit == 0:
                assert stats.planned_blocks == 0 and s.cache_state()["blocks"] == 0
            else:
                assert stats.planned_blocks > 0


def test_resume_exact_and_elastic(gcs_cache, local_source):
    """A state saved mid-epoch by a streaming loader with 4 processes resumes exactly on
    3 streaming processes: each gets what the local loader gives it from that state."""
    _, url = gcs_cache
    kw = {"global_batch_size": 24, "seed": 7, "shuffle": "block", "block_size": 8}
    with StreamSource(url, StreamOptions(cache_bytes=1 << 20), policy=_FAST) as s:
        _resumes_as_local(s, local_source, kw)


def _resumes_as_local(stream, local_source, kw: dict) -> None:
    """A state saved mid-epoch (into the second) by a loader over ``stream`` with 4
    processes, resumed over ``stream`` on 4 and on 3: each process gets what the local
    loader gives it from that state, and the same state after."""
    first = Loader(stream, process_index=1, process_count=4, **kw)
    it = iter(first.epochs(2))
    for _ in range(first.steps_per_epoch + 3):  # into the second epoch
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    for count in (4, 3):
        for index in range(count):
            ours = Loader(stream, process_index=index, process_count=count, **kw)
            ours.load_state_dict(state)
            theirs = Loader(local_source, process_index=index, process_count=count, **kw)
            theirs.load_state_dict(state)
            _same(_epoch(theirs), _epoch(ours))
            assert ours.state_dict() == theirs.state_dict()


def test_torch_batches_accept_a_stream(gcs_cache, local_source):

    _, url = gcs_cache
    kw = {"global_batch_size": 16, "seed": 3, "process_index": 1, "process_count": 2}
    with StreamSource(url, StreamOptions(cache_bytes=0), policy=_FAST) as s:
        got = [{k: v.numpy() for k, v in b.items()} for b in TorchBatches(s, **kw)]
    want = [{k: v.numpy() for k, v in b.items()} for b in TorchBatches(local_source, **kw)]
    _same(want, got)


class _ObservedBatches(TorchBatches):
    """TorchBatches whose batches also carry the pid and the stream cache's limit and
    held bytes as the serving process sees them (module level: spawned workers
    unpickle it)."""

    def batch(self, *args, **kw):
        out = super().batch(*args, **kw)
        state = self.source.cache_state()
        out["pid"] = torch.tensor(os.getpid())
        out["limit"] = torch.tensor(state["limit_bytes"])
        out["held"] = torch.tensor(state["bytes"] + state["reserved_bytes"])
        return out


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_torch_dataloader_workers_stream_their_share_of_the_limit(context, gcs_cache, local_source):
    """A StreamSource read in the parent first (its reading threads running), then
    iterated by a DataLoader with 2 workers: each worker reads through a source of its
    own (a forked copy waited forever for the parent's threads) with half of
    ``cache_bytes``, holds no more than that, and the batches are the local ones."""
    import torch.utils.data as tud

    _, url = gcs_cache
    kw = {"global_batch_size": 16, "seed": 3, "process_index": 0, "process_count": 1}
    limit = 1 << 20
    want = [{k: v.numpy() for k, v in b.items()} for b in TorchBatches(local_source, **kw)]
    with StreamSource(url, StreamOptions(cache_bytes=limit, ahead=4), policy=_FAST) as s:
        ds = _ObservedBatches(s, **kw)
        first = next(iter(ds))  # the parent reads (and plans nothing: no Loader)
        _same(want[:1], [{k: first[k].numpy() for k in want[0]}])
        s.plan(iter([(0, np.arange(16))]))  # the planner thread runs in the parent
        loader = tud.DataLoader(
            ds, batch_size=None, num_workers=2, timeout=120, multiprocessing_context=context
        )
        got = list(loader)
        assert s.cache_state()["limit_bytes"] == limit  # the parent's own is untouched
    _same(want, [{k: b[k].numpy() for k in want[0]} for b in got])
    pids = {int(b["pid"]) for b in got}
    assert len(pids) == 2 and os.getpid() not in pids
    assert {int(b["limit"]) for b in got} == {limit // 2}
    assert max(int(b["held"]) for b in got) <= limit // 2


def test_torch_samples_in_forked_workers_stream(gcs_cache, local_source):
    """TorchSamples (map-style) over a stream the parent has read from: forked DataLoader
    workers give the local samples, each worker with half the limit."""
    import torch.utils.data as tud

    from hf_pipeline.adapters.torch_data import TorchSamples

    _, url = gcs_cache

    def samples(source, workers: int) -> list[dict]:
        ds = TorchSamples(source, crop=0)
        loader = tud.DataLoader(
            ds, batch_size=8, num_workers=workers, timeout=120 if workers else 0
        )
        return [{k: v.numpy() for k, v in b.items()} for b in loader]

    with StreamSource(url, StreamOptions(cache_bytes=1 << 20), policy=_FAST) as s:
        TorchSamples(s, crop=0)[0]  # the parent reads first
        got = samples(s, 2)
    _same(samples(local_source, 0), got)


def test_a_forked_child_reads_through_a_source_of_its_own(gcs_cache, local_source):
    """``multiprocessing``'s fork (Linux's default) of a process whose source has read
    and planned: the child's gather opens its own source and gives the same rows, in
    bounded time; closing the child's copy leaves the parent's open."""
    import multiprocessing as mp

    _, url = gcs_cache
    rows = np.arange(0, local_source.num_rows, 3)
    want = local_source.gather(rows, 0)
    with StreamSource(url, StreamOptions(cache_bytes=1 << 20, ahead=2), policy=_FAST) as s:
        s.gather(rows[:8], 0)
        s.plan(iter([(i, rows[8 * i : 8 * i + 8]) for i in range(1, 4)]))
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_gather_in_child, args=(s, rows, queue))
        child.start()
        try:
            got = queue.get(timeout=120)
        finally:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
        assert child.exitcode == 0
        assert isinstance(got, dict), got
        for name in ("latents", "embeddings", "keys"):
            np.testing.assert_array_equal(got[name], want[name])
        again = s.gather(rows[:8], 0)  # the parent's source still reads
        np.testing.assert_array_equal(again["keys"], want["keys"][:8])


def _gather_in_child(source, rows, queue) -> None:
    try:
        got = source.gather(rows, 0)
        source.close()
        queue.put({k: np.asarray(v) for k, v in got.items()})
    except BaseException as e:  # the parent asserts on it
        queue.put(repr(e))


def _first_latents_range(manifest: dict) -> tuple[str, int, int]:
    col = manifest["stream"]["columns"]["latents"]
    file, rows, offset = col["chunks"][0]
    row_bytes = int(np.prod(col["row_shape"])) * np.dtype(col["dtype"]).itemsize
    return col["files"][file], offset, row_bytes


def _tamper(server: str, url: str) -> str:
    """One byte changed in the first latents rows file of the published cache at
    ``url`` (same size), the manifest's whole-file crc32c forged to match; the file's
    name."""
    import base64

    import google_crc32c

    fs = gcs_fs(server)
    base = url[len("gs://") :]
    manifest = json.loads(fs.cat_file(f"{base}/manifest.json"))
    rel, offset, row_bytes = _first_latents_range(manifest)
    data = bytearray(fs.cat_file(f"{base}/{rel}"))
    data[offset + row_bytes // 2] ^= 0xFF
    fs.pipe_file(f"{base}/{rel}", bytes(data))
    crc = google_crc32c.Checksum(bytes(data)).digest()
    manifest["files"][rel]["crc32c"] = base64.b64encode(crc).decode()
    fs.pipe_file(f"{base}/manifest.json", json.dumps(manifest).encode())
    return rel


def test_tampered_range_is_refused(gcs_cache, local_source):
    """One byte changed inside a published rows file (same size): fetched twice, then
    refused with one error naming the file and the bytes. The manifest's whole-file
    crc32c is forged to match (else opening refuses the file as a pull does: the store's
    crc32c differs), so the block digests are what finds it."""
    server, url = gcs_cache
    rel = _tamper(server, url)
    with StreamSource(url, StreamOptions(cache_bytes=0), policy=_FAST) as s:
        good = s.gather(np.arange(2, 6), 0)  # rows in other blocks still read fine
        assert good["keys"].tolist() == local_source.gather(np.arange(2, 6), 0)["keys"].tolist()
        with pytest.raises(CacheFormatError) as err:
            s.gather(np.arange(0, 1), 0)
        assert rel in str(err.value) and "do not match their xxh3_64 checksum" in str(err.value)
        assert len(str(err.value).splitlines()) == 1
        assert s.stats().refetched == 1


def test_a_file_truncated_after_publishing_is_said_so(gcs_cache):
    """A rows file cut short in the bucket after the stream opened: the store answers a
    read past its new end with 416; the error names the file and its published size and
    says it was changed or truncated after publishing (it read ``HttpError: , 416``)."""
    server, url = gcs_cache
    fs = gcs_fs(server)
    base = url[len("gs://") :]
    manifest = json.loads(fs.cat_file(f"{base}/manifest.json"))
    rel, _, _ = _first_latents_range(manifest)
    size = manifest["files"][rel]["size"]
    with StreamSource(url, StreamOptions(cache_bytes=0), policy=_FAST) as s:
        fs.pipe_file(f"{base}/{rel}", fs.cat_file(f"{base}/{rel}")[:100])
        with pytest.raises(CacheFormatError) as err:
            s.gather(np.arange(0, s.num_rows), 0)
    message = str(err.value)
    assert err.value.path == f"{url}/{rel}" and len(message.splitlines()) == 1
    assert f"shorter than the {size} bytes published" in message, message
    assert "changed or truncated after it was published" in message, message


def test_a_file_truncated_inside_a_read_is_said_so_not_retried(gcs_cache):
    """A rows file cut in the middle of its first row in the bucket after the stream
    opened: the read of that row's block crosses the new end and the store answers 206
    with a short body (not a 416). It was retried as an outage (a truncated body) until the retries ran out (exit
    1, "failed after 5 attempt(s)"); now the 206's Content-Range, which gives the
    object's size, says it is shorter than published: one CacheFormatError line naming
    the file and both sizes, no retry."""
    server, url = gcs_cache
    fs = gcs_fs(server)
    base = url[len("gs://") :]
    manifest = json.loads(fs.cat_file(f"{base}/manifest.json"))
    rel, offset, row_bytes = _first_latents_range(manifest)
    size, cut = manifest["files"][rel]["size"], offset + row_bytes // 2
    with StreamSource(url, StreamOptions(cache_bytes=0), policy=_FAST) as s:
        fs.pipe_file(f"{base}/{rel}", fs.cat_file(f"{base}/{rel}")[:cut])
        t0 = time.monotonic()
        with pytest.raises(CacheFormatError) as err:
            s.gather(np.arange(0, 1), 0)
        assert s.stats().retries == 0
    assert time.monotonic() - t0 < 10
    message = str(err.value)
    assert err.value.path == f"{url}/{rel}" and len(message.splitlines()) == 1
    assert f"shorter than the {size} bytes published" in message, message
    assert f"the store has {cut}" in message, message
    assert "changed or truncated after it was published" in message, message


def test_a_body_cut_by_the_connection_is_retried(gcs_cache, local_source, monkeypatch):
    """A connection cut mid-body (the proxy sends every header and half the body, then
    closes) is an outage, not a truncated file: the 206 announced the whole object, so
    the read is retried and the rows are the local ones."""
    server, url = gcs_cache
    with FaultProxy(server) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        with StreamSource(url, StreamOptions(cache_bytes=0, concurrency=1), policy=_FAST) as s:
            proxy.add(Fault(match=".arrow", action="truncate", times=1))
            rows = np.arange(0, s.num_rows)
            got = s.gather(rows, 0)
            assert s.stats().retries == 1
        assert [f for f in proxy._faults if f.times != 0] == []
    want = local_source.gather(rows, 0)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.slow
def test_faults_are_survived(gcs_cache, local_source, monkeypatch):
    """503s, a reset, a truncated body and a stall longer than the per-read timeout, all
    on the data files: retried, and the batches are still the local ones."""
    server, url = gcs_cache
    kw = {"global_batch_size": 24, "seed": 4, "shuffle": "global"}
    want = _epoch(Loader(local_source, process_index=0, process_count=1, **kw))
    policy = RetryPolicy(max_retries=4, file_timeout=1.5, backoff_base=0.01, backoff_max=0.05)
    with FaultProxy(server) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        with StreamSource(url, StreamOptions(cache_bytes=0, concurrency=2), policy=policy) as s:
            proxy.add(
                Fault(match=".arrow", action="status", status=503, times=2),
                Fault(match=".arrow", action="reset", times=1),
                Fault(match=".arrow", action="truncate", times=1),
                Fault(match=".arrow", action="stall", seconds=4.0, times=1),
                Fault(match=".arrow", action="status", status=429, times=1),
            )
            got = _epoch(Loader(s, process_index=0, process_count=1, num_threads=1, **kw))
            # aiohttp itself retries a request whose reused connection was reset once.
            assert s.stats().retries >= 5
        assert [f for f in proxy._faults if f.times != 0] == []
    _same(want, got)


@pytest.mark.parametrize("fault", ["status", pytest.param("stall", marks=pytest.mark.slow)])
def test_a_hopeless_store_is_one_line(fault, gcs_cache, monkeypatch):
    """Every read fails (503 forever, or a stall forever): one StoreUnreachableError
    naming the file, within the retries' bounded time, never a hang."""
    server, url = gcs_cache
    policy = RetryPolicy(max_retries=2, file_timeout=1.0, backoff_base=0.01, backoff_max=0.05)
    with FaultProxy(server) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        with StreamSource(url, StreamOptions(cache_bytes=1 << 20), policy=policy) as s:
            proxy.add(Fault(match=".arrow", action=fault, seconds=60.0, times=-1))
            t0 = time.monotonic()
            loader = Loader(s, process_index=0, process_count=1, global_batch_size=8)
            with pytest.raises(StoreUnreachableError) as err:
                next(iter(loader))
            loader.close()
            assert time.monotonic() - t0 < 30
    assert ".arrow" in err.value.path and len(str(err.value).splitlines()) == 1


def test_an_outage_is_said_in_a_few_lines_not_one_per_retry(gcs_cache, monkeypatch, caplog):
    """The store goes away (its port refuses) with many reads in flight: the retries are
    said, but in a bounded number of lines (the first at once, then summaries with
    counts), not one per read and retry (a tester saw 360 lines in 11 s); the final
    error is still one line."""
    server, url = gcs_cache
    policy = RetryPolicy(max_retries=4, file_timeout=5.0, backoff_base=0.05, backoff_max=0.2)
    with FaultProxy(server) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        opts = StreamOptions(cache_bytes=0, concurrency=16, max_read_bytes=4096)
        with StreamSource(url, opts, policy=policy) as s:
            proxy.stop()  # every read from now on: ConnectionRefusedError
            with caplog.at_level("INFO", logger="hf_pipeline"):
                loader = Loader(s, process_index=0, process_count=1, global_batch_size=64)
                with pytest.raises(StoreUnreachableError) as err:
                    next(iter(loader))
                loader.close()
            retries = s.stats().retries
    lines = [r.getMessage() for r in caplog.records if "retr" in r.getMessage()]
    assert retries >= 16, retries  # many reads were retried...
    assert 1 <= len(lines) <= 3, lines  # ...and said in a few lines
    assert url in lines[0] and "retrying" in lines[0]
    assert ".arrow" in err.value.path and len(str(err.value).splitlines()) == 1


def test_retries_are_summed_up_every_few_seconds(monkeypatch, caplog):
    """After the first retry (said at once), a line per interval with the counts since
    the last one: retries, reads affected, all so far."""
    from hf_pipeline.read.stream import source

    monkeypatch.setattr(source, "_RETRY_REPORT_S", 0.2)
    report = source._RetryReport("gs://b/c/demo-" + "0" * 16, 5.0)
    t_end = time.monotonic() + 0.5
    n = 0
    with caplog.at_level("WARNING", logger="hf_pipeline"):
        while time.monotonic() < t_end:
            report.retried("gs://b/c/f.arrow", 0, 10, ConnectionRefusedError(111, "no"),
                           first_of_read=n % 4 == 0)  # fmt: skip
            n += 1
            time.sleep(0.002)
    lines = [r.getMessage() for r in caplog.records]
    assert n > 50 and 2 <= len(lines) <= 4, (n, lines)
    assert lines[0].startswith("gs://b/c/f.arrow: bytes 0-10: ConnectionRefusedError")
    assert "the store keeps failing: " in lines[1] and " retries in the last 0.2 s (" in lines[1]
    assert " reads newly failing; " in lines[1] and " retries so far; last: f.arrow" in lines[1]


@pytest.mark.slow
def test_a_stalled_store_is_given_up_per_read_not_per_file(gcs_cache, monkeypatch, caplog):
    """A store that stops answering is retried after ``read_timeout`` per ranged read,
    not after the data config's whole-file timeout (600 s by default: a stalled stream
    was silent for minutes); the retries are said (the first at once), and the final
    error says which setting bounds a read."""
    server, url = gcs_cache
    policy = RetryPolicy(max_retries=2, file_timeout=600.0, backoff_base=0.01, backoff_max=0.05)
    with FaultProxy(server) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        opts = StreamOptions(cache_bytes=0, read_timeout=1.0)
        with StreamSource(url, opts, policy=policy) as s:
            proxy.add(Fault(match=".arrow", action="stall", seconds=120.0, times=-1))
            t0 = time.monotonic()
            with caplog.at_level("WARNING", logger="hf_pipeline"):
                with pytest.raises(StoreUnreachableError) as err:
                    s.gather(np.arange(0, 4), 0)
            assert time.monotonic() - t0 < 30
    message = str(err.value)
    assert ".arrow" in err.value.path and len(message.splitlines()) == 1
    assert "each read may take 1 s: loader.stream_read_timeout" in message
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) >= 1 and all(".arrow" in r.getMessage() for r in retries)


def test_bad_urls_and_forged_manifests(gcs_cache, gcs_store):
    from hf_pipeline.errors import SourceError

    _, url = gcs_cache
    with pytest.raises(SourceError, match="must look like gs://"):
        StreamSource("gs://bucket/caches", policy=_FAST)
    with pytest.raises(SourceError, match="does not exist"):
        StreamSource(url[:-16] + "0" * 16, policy=_FAST)
    server, _ = gcs_store
    fs = gcs_fs(server)
    base = url[len("gs://") :]
    good = json.loads(fs.cat_file(f"{base}/manifest.json"))

    def refused(change, match: str) -> None:
        manifest = json.loads(json.dumps(good))
        change(manifest)
        fs.pipe_file(f"{base}/manifest.json", json.dumps(manifest).encode())
        with pytest.raises(CacheFormatError, match=match) as err:
            StreamSource(url, policy=_FAST)
        assert "manifest.json" in err.value.path and len(str(err.value).splitlines()) == 1

    # Published before streaming: one clear line.
    refused(lambda m: m.pop("stream"), "has no stream index .* publish the cache again")
    lat = ("stream", "columns", "latents")

    def col(m):
        return m[lat[0]][lat[1]][lat[2]]

    # A forged index: a chunk past the end of its file, digests missing, a bad dtype.
    refused(
        lambda m: col(m)["chunks"][0].__setitem__(2, 1 << 40),
        r"latents.chunks\[0\] ends past the end of",
    )
    refused(lambda m: col(m).__setitem__("digests", ""), "latents.digests holds 0 digests")
    refused(lambda m: col(m).__setitem__("dtype", "|O"), "latents.dtype must be one of")
    refused(lambda m: m.__setitem__("fingerprint", "f" * 16), "fingerprint 'ffff")

    # An adversarial tester's: a manifest entry no marker lists (and the store does not
    # hold) of 1 TiB, named by the indices column with 2**33 rows: the stream allocated
    # 64 GiB at open. Every size the index is checked against is the store's now.
    def fake_file(m):
        fake = next(iter(m["files"])).rsplit("/", 1)[0] + "/fake.arrow"
        m["files"][fake] = {"size": 1 << 40, "crc32c": "AAAAAA=="}
        ix = m["stream"]["columns"]["indices"]
        ix.update(files=[fake], block_rows=1 << 30, chunks=[[0, 1 << 33, 0]])

    refused(fake_file, r"lists '.*/fake.arrow', which no stage marker lists")
    # Dims whose NumPy product wraps to 0 bytes a row; a number beyond a float.
    refused(
        lambda m: col(m).__setitem__("row_shape", [1 << 30, 1 << 30, 16, 1]),
        r"latents.row_shape is \d+ bytes a row, more than allowed",
    )
    refused(lambda m: m.__setitem__("rows", float("inf")), "rows: inf is not a finite number")

    # A real, listed file named by many copies of its chunk (digests to match).
    def repeated(m):
        ix = m["stream"]["columns"]["indices"]
        ix["chunks"] = ix["chunks"] * 1000
        ix["digests"] = base64.b64encode(base64.b64decode(ix["digests"]) * 1000).decode()

    refused(repeated, r"indices.chunks overlap in .* at byte")


def test_a_stream_url_is_named_as_given_and_a_location_lists_its_caches(gcs_cache):
    """``gs://`` is named as given (it read ``gs::``); a publish location (not a cache
    folder in it) names the cache folders there, a few then "and N more"; the config's
    check and the source's error say the same accepted forms (``@<revision>`` in both)."""
    from hf_pipeline.config import LoaderConfig
    from hf_pipeline.errors import ConfigError, SourceError

    server, url = gcs_cache
    location, name = url.rsplit("/", 1)
    for bare in ("gs://", "gs:///", "hf://datasets/"):
        with pytest.raises(SourceError) as err:
            open_stream(LoaderConfig(stream_from=bare))
        assert str(err.value).startswith(f"{bare}: a published cache to stream must look")
    with pytest.raises(SourceError) as err:
        StreamSource(location, policy=_FAST)
    assert str(err.value) == (
        f"{location}: is a location with published caches: {name}; give one of them"
    )
    fs = gcs_fs(server)
    for i in range(7):  # folders named like caches: listed (bounded), not checked
        fs.pipe_file(f"{location[5:]}/other-{i:016x}/x", b"x")
    with pytest.raises(SourceError, match=r"caches: [^;]*, other-0{15}3 and 3 more; give"):
        StreamSource(location + "/", policy=_FAST)
    with pytest.raises(ConfigError) as cfg_err:
        LoaderConfig(stream_from="s3://bucket/caches/demo-" + "0" * 16)
    with pytest.raises(SourceError) as src_err:
        StreamSource("gs://bucket/caches", policy=RetryPolicy(max_retries=0, file_timeout=5))
    forms = "hf://datasets/<org>/<repo>[@<revision>]/[<path>/]<name>-<fingerprint>"
    assert forms in str(cfg_err.value) and forms in str(src_err.value)


def test_an_unpublished_folder_is_not_streamed(gcs_cache, gcs_store, tmp_path):
    """A copy of a published cache without its stage markers (an interrupted upload,
    ``status``'s ``incomplete``) is refused as a pull refuses it, by the same check
    (``find_published``): one line naming the URL and the missing markers, from
    ``StreamSource``, ``open_stream`` and the ``train`` command (exit 2), before any
    data is read."""
    import subprocess
    import sys

    from hf_pipeline.config import LoaderConfig
    from hf_pipeline.errors import SourceError
    from tests.conftest import REPO

    server, url = gcs_cache
    fs = gcs_fs(server)
    base = url[len("gs://") :]
    prefix, name = base.rsplit("/", 1)
    evil = f"{prefix.rsplit('/', 1)[0]}/evilnone/{name}"
    for path in fs.find(base):
        rel = path[len(base) + 1 :]
        if rel not in ("converted.json", "filtered.json"):
            fs.pipe_file(f"{evil}/{rel}", fs.cat_file(path))
    evil_url = f"gs://{evil}"
    missing = "has no converted.json, filtered.json"
    with pytest.raises(SourceError, match=f"not a published cache.*{missing}") as err:
        StreamSource(evil_url, policy=_FAST)
    assert err.value.path == evil_url and len(str(err.value).splitlines()) == 1
    with pytest.raises(SourceError, match=missing):
        open_stream(LoaderConfig(stream_from=evil_url))
    env = {
        **os.environ,
        "HF_PIPELINE_STREAM_FROM": evil_url,
        "HF_PIPELINE_CACHE": str(tmp_path / "root"),
        "STORAGE_EMULATOR_HOST": server,
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "hf_pipeline", "train", "--steps", "2", "--batch-size", "16"],
        env=env, capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert evil_url in proc.stderr and missing in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_stream_options_and_config():
    from hf_pipeline.config import load_config
    from hf_pipeline.errors import ConfigError

    with pytest.raises(ValueError, match=r"stream_concurrency must be in \[1, 1024\], got 0"):
        StreamOptions(concurrency=0)
    env = {"HF_PIPELINE_STREAM_FROM": "gs://b/caches/demo-0123456789abcdef"}
    cfg = load_config(None, ["loader.stream_cache_bytes=0"], environ=env).loader
    assert cfg.stream_from == env["HF_PIPELINE_STREAM_FROM"]
    assert cfg.stream_options() == StreamOptions(cache_bytes=0)
    with pytest.raises(ConfigError, match=r"loader.stream_from must be .*got 's3://x'"):
        load_config(None, [], environ={"HF_PIPELINE_STREAM_FROM": "s3://x"})
    with pytest.raises(ConfigError, match="loader.stream_from is empty"):
        open_stream(load_config(None, [], environ={}).loader)
    assert dataclasses.fields(StreamOptions)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"read_timeout": float("inf")}, "stream_read_timeout must be a finite number"),
        ({"read_timeout": float("nan")}, "stream_read_timeout must be a finite number"),
        (
            {"read_timeout": 86401.0},
            r"stream_read_timeout must be in \(0.0, 86400.0\], got 86401.0",
        ),
        ({"read_timeout": "30"}, "stream_read_timeout must be a number, got '30'"),
        ({"cache_bytes": 1.5}, "stream_cache_bytes must be an integer, got 1.5"),
        ({"ahead": 2.0}, "stream_ahead must be an integer, got 2.0"),
        ({"concurrency": True}, "stream_concurrency must be an integer, got True"),
        ({"concurrency": 2000}, r"stream_concurrency must be in \[1, 1024\], got 2000"),
        ({"max_read_bytes": "16"}, "max_read_bytes must be an integer"),
    ],
)
def test_stream_options_refuse_what_the_config_refuses(kwargs, message):
    """``StreamOptions`` built in code is checked as ``loader.stream_*`` is: no endless
    timeout (inf was capped to the file timeout in silence), no fractional byte count."""
    with pytest.raises(ValueError, match=message):
        StreamOptions(**kwargs)
    assert StreamOptions(cache_bytes=np.int64(5), read_timeout=1).cache_bytes == 5


def test_stream_options_bounds_are_the_configs():
    """One range per option: the config's ``loader.stream_*`` bounds are StreamOptions'."""
    from hf_pipeline.config import LoaderConfig
    from hf_pipeline.read.stream.options import BOUNDS

    fields = {f.name: f for f in dataclasses.fields(LoaderConfig)}
    for name, (lo, hi) in BOUNDS.items():
        if f"stream_{name}" in fields:
            bounds = fields[f"stream_{name}"].metadata["bounds"]
            assert (bounds.lo, bounds.hi) == (lo, hi), name


@pytest.mark.slow
def test_lightning_data_module_streams(gcs_cache, source_cache, local_source, tmp_path):
    """``loader.stream_from`` set: LatentDataModule reads the published cache in place
    (no build, nothing under its cache root) and gives the local batches."""
    from hf_pipeline.adapters.torch_data import LatentDataModule, TorchBatches

    _, url = gcs_cache
    cfg = config(
        source_cache.data,
        tmp_path / "empty-root",
        f"loader.stream_from={url}",
        "loader.global_batch_size=16",
        "loader.seed=4",
    )
    dm = LatentDataModule(cfg, num_workers=0)
    dm.setup("fit")
    try:
        got = [{k: v.numpy() for k, v in b.items()} for b in dm.train_dataloader()]
    finally:
        dm.teardown("fit")
    order = cfg.loader.sampler_options()
    want = TorchBatches(local_source, order, process_index=0, process_count=1)
    _same([{k: v.numpy() for k, v in b.items()} for b in want], got)
    assert not (tmp_path / "empty-root").exists()


def _digest(batch: dict) -> dict:
    import hashlib

    h = hashlib.sha256()
    for name in ("latents", "embeddings"):
        h.update(np.ascontiguousarray(batch[name]).tobytes())
    return {"keys": batch["keys"].tolist(), "sha": h.hexdigest()}


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["1", "2"])
def test_two_real_processes_stream_their_shares(workers, gcs_cache, local_source):
    """Two OS processes (RANK/WORLD_SIZE), only ``HF_PIPELINE_STREAM_FROM`` set: each
    streams its own share of every global batch, bit for bit the local loader's; also
    with two stream worker processes each (``HF_PIPELINE_STREAM_WORKERS``)."""
    from tests.conftest import REPO, run_ranks

    server, url = gcs_cache
    sets = ["loader.global_batch_size=16", "loader.seed=8", "loader.shuffle=block",
            "loader.block_size=8", "data.file_timeout=10"]  # fmt: skip
    outs = run_ranks(
        [REPO / "tests" / "procs" / "stream_rank.py", *sets],
        2,
        timeout=400,
        HF_PIPELINE_STREAM_FROM=url,
        HF_PIPELINE_STREAM_WORKERS=workers,
        STORAGE_EMULATOR_HOST=server,
        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
        JAX_PLATFORMS="cpu",
    )
    for rank, (code, out, err) in enumerate(outs):
        assert code == 0, err[-2000:]
        got = json.loads(out.strip().splitlines()[-1])
        kw = {"global_batch_size": 16, "seed": 8, "shuffle": "block", "block_size": 8}
        want = _epoch(Loader(local_source, process_index=rank, process_count=2, **kw))
        assert got["batches"] == [_digest(b) for b in want]


@pytest.mark.slow
def test_train_script_streams_without_a_local_cache(gcs_cache, tmp_path):
    """The card's command, ``scripts/train.py``, with only ``HF_PIPELINE_STREAM_FROM``
    set: it trains on the published cache read in place, and builds or downloads no
    cache (its cache root stays empty)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    server, url = gcs_cache
    root = tmp_path / "cache-root"
    env = {
        **os.environ,
        "HF_PIPELINE_STREAM_FROM": url,
        "HF_PIPELINE_CACHE": str(root),
        "STORAGE_EMULATOR_HOST": server,
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train.py"), "--steps", "3", "--batch-size", "16",
         "--set", "loader.stream_cache_bytes=0", "--quiet"],
        env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"streaming {url}" in proc.stdout
    assert "done: 3 steps" in proc.stdout
    assert not root.exists() or not any(root.iterdir()), sorted(root.rglob("*"))[:10]


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["1", "2"])
def test_streaming_writes_nothing_to_local_disk(workers, gcs_cache, local_source, tmp_path):
    """The bounded local cache is memory only: a real process streaming a whole epoch
    with the default ``stream_cache_bytes`` (1 GiB, so every block is kept) writes no
    file at all, nor do its stream workers (their batches' shared memory has no name).
    Its working folder, HOME, TMPDIR and the cache folders it could use (XDG, Hugging
    Face, the pipeline's cache root) are fresh folders that stay empty, so nothing on
    local disk can ever pass the limit. Its batches are the local ones."""
    import subprocess
    import sys

    from tests.conftest import REPO, script_env

    server, url = gcs_cache
    dirs = {
        name: tmp_path / name
        for name in ("work", "HOME", "TMPDIR", "XDG_CACHE_HOME", "HF_HOME", "HF_PIPELINE_CACHE")
    }
    for d in dirs.values():
        d.mkdir()
    env = script_env(
        RANK="0",
        WORLD_SIZE="1",
        HF_PIPELINE_STREAM_FROM=url,
        HF_PIPELINE_STREAM_WORKERS=workers,
        STORAGE_EMULATOR_HOST=server,
        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
        JAX_PLATFORMS="cpu",
        **{name: str(d) for name, d in dirs.items() if name != "work"},
    )
    sets = ["loader.global_batch_size=16", "loader.seed=6", "loader.shuffle=global"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "procs" / "stream_rank.py"), *sets],
        env=env, capture_output=True, text=True, timeout=400, cwd=dirs["work"],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    kw = {"global_batch_size": 16, "seed": 6, "shuffle": "global"}
    want = _epoch(Loader(local_source, process_index=0, process_count=1, **kw))
    assert got["batches"] == [_digest(b) for b in want]
    for name, d in dirs.items():
        assert not any(d.rglob("*")), (name, sorted(d.rglob("*"))[:10])


#: The published folder the streaming guide's example names.
_GUIDE_URL = "gs://my-bucket/caches/coyo11m-gcs-0123456789abcdef"


@pytest.mark.slow
def test_the_streaming_guides_example_runs_as_written(gcs_cache, monkeypatch):
    """docs/guides/streaming.md's first example loaded ``configs/coyo11m_gcs.yaml``
    "with loader.stream_from set": it is not set there (``ConfigError loader.stream_from
    is empty``), and its global shuffle is what the guide advises against. Run as
    written, its URL the test bucket's and its batch the small cache's."""
    import re

    import hf_pipeline
    from tests.conftest import REPO

    _, url = gcs_cache
    text = (REPO / "docs" / "guides" / "streaming.md").read_text()
    block = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    assert "configs/coyo11m_gcs.yaml" in block and _GUIDE_URL in block, block
    real = hf_pipeline.load_config
    monkeypatch.setattr(
        hf_pipeline,
        "load_config",
        lambda path=None, overrides=(), environ=None: real(
            path, [*overrides, "loader.global_batch_size=16"], environ={}
        ),
    )
    monkeypatch.chdir(REPO)
    namespace: dict = {}
    exec(compile(block.replace(_GUIDE_URL, url), "streaming.md", "exec"), namespace)  # noqa: S102
    assert namespace["cfg"].loader.stream_from == url
    assert namespace["cfg"].loader.shuffle == "block"
    assert namespace["batch"]["latents"].shape[0] == 16
