# ruff: noqa: F811 - pytest fixtures imported from tests.servers are parameters here
"""Ranged reads of GCS objects on each thread's own connection (hf_pipeline.stores.gcs_ranged)
against the real fake-gcs-server: exact bytes from many threads, no wait on gcsfs' event
loop, a server that ignores the range refused without reading the object, a connection
the server closed between reads reopened without a failure, error statuses mapped as
gcsfs maps them."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from hf_pipeline.config import DataConfig
from hf_pipeline.stores import GCSSource
from hf_pipeline.stores.retry import RetryPolicy, ShortObjectError, TransientError, is_transient
from tests.servers import gcs_bucket, gcs_fs, gcs_server, hf_home, shard_dir  # noqa: F401
from tests.servers.proxy import Fault, FaultProxy

pytestmark = pytest.mark.remote

_POLICY = RetryPolicy(max_retries=0, file_timeout=30.0)
_SIZE = 3 << 20


@pytest.fixture
def blob(gcs_bucket):
    """``(bucket, object name, its bytes)``: a 3 MiB object in a fresh bucket."""
    server, location, _ = gcs_bucket
    bucket = location[len("gs://") :].split("/", 1)[0]
    data = os.urandom(_SIZE)
    gcs_fs(server).pipe_file(f"{bucket}/obj.bin", data)
    return bucket, "obj.bin", data


def _source(bucket: str) -> GCSSource:
    return GCSSource(f"gs://{bucket}", data_config=DataConfig(), policy=_POLICY)


@pytest.fixture
def proxied(blob, gcs_bucket, monkeypatch):
    """``(fault proxy, a source reading through it, object name, its bytes)``."""
    bucket, name, data = blob
    with FaultProxy(gcs_bucket[0]) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        yield proxy, _source(bucket), name, data


def _deadline() -> float:
    import time

    return time.monotonic() + 60


def test_ranges_from_many_threads_are_exact(blob):
    bucket, name, data = blob
    src = _source(bucket)
    spans = [(i * 100_003 % (_SIZE - 70_000), i * 100_003 % (_SIZE - 70_000) + 1 + i * 997)
             for i in range(64)]  # fmt: skip
    spans += [(0, _SIZE), (_SIZE - 1, _SIZE), (5, 5)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda se: src.read_span(name, *se, _deadline()), spans * 2))
    assert got == [data[s:e] for s, e in spans * 2]


def test_a_ranged_read_does_not_wait_on_the_gcsfs_event_loop(blob):
    """The reads' Python runs on the reading thread: with fsspec's one event loop thread
    busy (here: blocked outright), a range still arrives."""
    bucket, name, data = blob
    src = _source(bucket)
    loop = src.filesystem().loop
    release = threading.Event()

    async def busy() -> None:
        release.wait(60)  # blocks the loop's thread, as a long callback would

    blocked = asyncio.run_coroutine_threadsafe(busy(), loop)
    try:
        with ThreadPoolExecutor(1) as pool:
            read = pool.submit(src.read_span, name, 10, 70_010, _deadline())
            assert read.result(timeout=20) == data[10:70_010]
    finally:
        release.set()
        blocked.result(timeout=60)


def test_a_server_that_ignores_the_range_is_refused_not_read_whole(proxied, blob):
    """A 200 with the whole object (the Range header dropped on the way) is a transient
    failure naming the object, and the client stops reading after the range's bytes."""
    proxy, src, name, _ = proxied
    proxy.add(Fault(match=name, action="ignore_range", times=-1))
    with pytest.raises(TransientError) as err:
        src.read_span(name, 1000, 2000, _deadline())
    assert f"{blob[0]}/{name}" in str(err.value) and "Range header ignored" in str(err.value)
    assert is_transient(err.value)


def test_a_connection_the_server_closed_between_reads_is_reopened(proxied):
    """Every answer is followed by the server closing the kept-alive connection, unsaid:
    each next read on that thread reopens it, and no read fails."""
    proxy, src, name, data = proxied
    proxy.add(Fault(match=name, action="close", times=-1))
    for i in range(6):
        got = src.read_span(name, i * 1000, i * 1000 + 500, _deadline())
        assert got == data[i * 1000 : i * 1000 + 500]
    assert proxy.count(name) == 6


def test_error_statuses_are_mapped_as_gcsfs_maps_them(proxied):
    """404 is FileNotFoundError (permanent); 503 and 429 carry their status (retried);
    after a failure the next read on the thread succeeds."""
    proxy, src, name, data = proxied
    with pytest.raises(FileNotFoundError):
        src.read_span("missing.bin", 0, 10, _deadline())
    for status in (503, 429):
        proxy.add(Fault(match=name, action="status", status=status, times=1))
        with pytest.raises(Exception) as err:
            src.read_span(name, 0, 10, _deadline())
        assert is_transient(err.value), repr(err.value)
    assert src.read_span(name, 0, 10, _deadline()) == data[:10]


def test_a_range_across_the_object_end_is_short_object_a_cut_body_is_short(proxied):
    """A range that crosses the object's end: the 206's Content-Range gives its size,
    and the read raises ShortObjectError (permanent, picklable, naming the object and
    the size); a body the connection cut (every header, half the body) comes back short,
    as it is, for the caller to retry; the next read on the thread is exact."""
    import pickle

    proxy, src, name, data = proxied
    with pytest.raises(ShortObjectError) as err:
        src.read_span(name, _SIZE - 100, _SIZE + 100, _deadline())
    assert err.value.size == _SIZE and err.value.path.endswith(f"/{name}")
    assert not is_transient(err.value)
    again = pickle.loads(pickle.dumps(err.value))
    assert (again.path, again.size, str(again)) == (err.value.path, _SIZE, str(err.value))
    proxy.add(Fault(match=name, action="truncate", times=1))
    got = src.read_span(name, 1000, 1000 + (1 << 20), _deadline())
    assert 0 < len(got) < 1 << 20 and got == data[1000 : 1000 + len(got)]
    assert src.read_span(name, 1000, 2000, _deadline()) == data[1000:2000]
