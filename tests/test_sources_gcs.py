# ruff: noqa: F811 - pytest fixtures imported from tests.servers are parameters here
"""GCS sources against the real fake-gcs-server, with and without injected faults."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_pipeline.config import DataConfig
from hf_pipeline.errors import SourceError
from hf_pipeline.stores import GCSSource, open_source
from hf_pipeline.stores.fetch import ShardFetcher
from hf_pipeline.stores.retry import RetryPolicy
from hf_pipeline.stores.staging import StagingFolder
from hf_pipeline.workers.pool import clean_workers
from tests.servers import gcs_bucket, gcs_server, hf_home, shard_dir  # noqa: F401
from tests.servers.proxy import Fault, FaultProxy

pytestmark = pytest.mark.remote

FAST = RetryPolicy(max_retries=3, file_timeout=5, backoff_base=0.01)
REPO_ROOT = Path(__file__).resolve().parent.parent


def _cfg(tmp_path, location, **kw) -> DataConfig:
    kw.setdefault("staging_dir", str(tmp_path / "staging"))
    kw.setdefault("max_retries", FAST.max_retries)
    kw.setdefault("file_timeout", FAST.file_timeout)
    return DataConfig(shards=location, **kw)


@pytest.fixture
def proxy(gcs_bucket, monkeypatch):
    """A FaultProxy in front of the GCS server; STORAGE_EMULATOR_HOST points at it."""
    server, _, _ = gcs_bucket
    with FaultProxy(server) as p:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", p.url)
        yield p


def _fetch_all(src, cfg, *, num_workers=1, policy=FAST, release=False):
    files = src.list_shards()
    got = {}
    with ShardFetcher(
        src, files, data_config=cfg, num_workers=num_workers, progress=False, policy=policy
    ) as pf:
        client = pf.client()
        for f in files:
            p = client.acquire(f, timeout=60)
            got[f.name] = None if p is None else p.read_bytes()
            if release:
                client.release(f)
    return got, pf.stats()


def test_metadata_next_to_the_shards_and_at_the_root_is_refused_naming_both(gcs_bucket, tmp_path):
    # Two candidates, one per level: nearest-first used to pick one silently; which one
    # was meant is the user's to say (data.metadata), so both are named.
    from tests.servers import gcs_fs

    _, location, local = gcs_bucket
    bucket = location[5:].split("/")[0]
    fs = gcs_fs(os.environ["STORAGE_EMULATOR_HOST"])
    fs.put_file(str(local / "coyo11m-meta.parquet"), f"{bucket}/latents/new-meta.parquet")
    src = open_source(location, data_config=_cfg(tmp_path, location), policy=FAST)
    with pytest.raises(SourceError) as err:
        src.find_metadata()
    msg = str(err.value)
    assert f"gs://{bucket}/latents/new-meta.parquet" in msg, msg
    assert f"gs://{bucket}/coyo11m-meta.parquet" in msg, msg
    assert "data.metadata" in msg, msg
    # Named explicitly: no ambiguity left.
    assert src.find_metadata("new-meta.parquet").url == f"gs://{bucket}/latents/new-meta.parquet"


def test_list_metadata_identity(gcs_bucket, tmp_path):
    _, location, local = gcs_bucket
    cfg = _cfg(tmp_path, location)
    src = open_source(location, data_config=cfg, policy=FAST)
    assert isinstance(src, GCSSource)
    shards = src.list_shards()
    assert [f.name for f in shards] == sorted(p.name for p in local.glob("*.pt"))
    assert all(f.size == (local / f.name).stat().st_size for f in shards)
    assert all(f.checksum.startswith("crc32c:") and f.etag for f in shards)
    # Not next to the shards: discovered at the bucket root.
    meta = src.find_metadata()
    assert (
        meta.name == "coyo11m-meta.parquet"
        and meta.url == f"gs://{location[5:].split('/')[0]}/coyo11m-meta.parquet"
    )
    assert src.find_metadata(meta.url) == meta
    assert src.find_metadata("coyo11m-meta.parquet") == meta
    assert src.fetch_one(meta).read_bytes() == (local / "coyo11m-meta.parquet").read_bytes()
    ident = src.identity()
    assert [(n, s) for n, s, _ in ident] == [(f.name, f.size) for f in shards]
    # The identity is the content (md5), not the generation: a re-upload of the same
    # bytes is the same input (the same cache), other bytes are another.
    assert all(i[2].startswith("md5:") for i in ident)
    from tests.servers import gcs_fs

    fs = gcs_fs(os.environ["STORAGE_EMULATOR_HOST"])
    fs.put_file(str(local / shards[0].name), shards[0].url[5:])
    src2 = open_source(location, data_config=cfg, policy=FAST)
    assert src2.list_shards()[0].version != shards[0].version, "a new generation"
    assert src2.identity() == ident
    changed = tmp_path / shards[0].name
    raw = bytearray((local / shards[0].name).read_bytes())
    raw[-1] ^= 1
    changed.write_bytes(bytes(raw))
    fs.put_file(str(changed), shards[0].url[5:])
    src3 = open_source(location, data_config=cfg, policy=FAST)
    assert src3.identity()[0][2] != ident[0][2] and src3.identity()[1:] == ident[1:]
    with pytest.raises(SourceError, match="no such bucket or prefix|no \\*.pt"):
        open_source(location + "-missing", data_config=cfg, policy=FAST).list_shards()


def test_fetch_is_byte_identical_and_resumes_without_refetch(proxy, gcs_bucket, tmp_path):
    _, location, local = gcs_bucket
    cfg = _cfg(tmp_path, location, prefetch_ahead=2, download_workers=3)
    src = open_source(location, data_config=cfg, policy=FAST)
    got, stats = _fetch_all(src, cfg, num_workers=2)
    for name, data in got.items():
        assert data == (local / name).read_bytes()
    assert (
        stats["files"] == 4
        and stats["failures"] == []
        and stats["bytes"] == sum((local / n).stat().st_size for n in got)
    )
    assert stats["mean_mb_s"] > 0
    before = proxy.count(".pt")
    assert before == 4
    # The proxy counts the body bytes it sent: exactly the files' bytes, once.
    assert proxy.body_bytes(".pt") == stats["bytes"]
    # Second run (e.g. after a crash before conversion): everything is staged and
    # verified by its sidecar, nothing goes over the wire.
    src = open_source(location, data_config=cfg, policy=FAST)
    got2, stats2 = _fetch_all(src, cfg, num_workers=2, release=True)
    assert got2 == got
    assert proxy.count(".pt") == before
    assert proxy.body_bytes(".pt") == stats["bytes"]
    assert stats2["bytes"] == 0 and stats2["staging_hits"] >= 4
    # Released: the staging area is empty again.
    assert not list((tmp_path / "staging").rglob("*.pt"))


@pytest.mark.parametrize(
    "fault",
    [
        Fault(match="000000-000005.pt", action="status", status=503, times=2),
        Fault(match="000006-000011.pt", action="status", status=429, times=1),
        Fault(match="000012-000017.pt", action="reset", times=2),
        Fault(match="000018-000023.pt", action="truncate", times=1),
        Fault(match="000000-000005.pt", action="stall", seconds=3, times=1),
    ],
    ids=["503", "429", "reset", "truncate", "stall"],
)
def test_transient_faults_are_retried(proxy, gcs_bucket, tmp_path, fault):
    _, location, local = gcs_bucket
    cfg = _cfg(tmp_path, location, file_timeout=1.0)
    policy = RetryPolicy(max_retries=3, file_timeout=1.0, backoff_base=0.01)
    proxy.add(fault)
    src = open_source(location, data_config=cfg, policy=policy)
    got, stats = _fetch_all(src, cfg, policy=policy)
    for name, data in got.items():
        assert data == (local / name).read_bytes()
    assert stats["retries"] >= 1 and stats["failures"] == []
    assert proxy.count(fault.match) >= 2


def test_truncated_body_is_never_staged(proxy, gcs_bucket, tmp_path):
    _, location, local = gcs_bucket
    name = "000006-000011.pt"
    cfg = _cfg(tmp_path, location, max_retries=0)
    policy = RetryPolicy(max_retries=0, file_timeout=5, backoff_base=0.01)
    src = open_source(location, data_config=cfg, policy=policy)
    src.read_chunk = 40_000  # several ranged reads per shard
    f = next(x for x in src.list_shards() if x.name == name)
    # The first two ranged reads succeed, the third is cut short.
    proxy.add(Fault(match=name, action="truncate", times=1, skip=2))
    with ShardFetcher(src, [f], data_config=cfg, progress=False, policy=policy) as pf:
        with pytest.raises(SourceError) as ei:
            pf.client().acquire(f, timeout=30)
    assert name in str(ei.value)
    staging = StagingFolder(src.staging_dir)  # a folder per location below staging_dir
    assert src.staging_dir.parent == tmp_path / "staging"
    assert not staging.path(f).exists() and not staging.is_staged(f)
    # The next run resumes from the kept prefix with a ranged read and verifies.
    with ShardFetcher(src, [f], data_config=cfg, progress=False, policy=policy) as pf:
        p = pf.client().acquire(f, timeout=30)
    assert p.read_bytes() == (local / name).read_bytes()
    ranged = [r.range for r in proxy.log if name in r.path and "alt=media" in r.path]
    assert any(r and not r.startswith("bytes=0-") for r in ranged), ranged
    assert pf.stats()["resumed_bytes"] == 80_000


def test_corrupt_body_fails_checksum(proxy, gcs_bucket, tmp_path):
    _, location, _ = gcs_bucket
    cfg = _cfg(tmp_path, location, max_retries=1)
    policy = RetryPolicy(max_retries=1, file_timeout=5, backoff_base=0.01)
    src = open_source(location, data_config=cfg, policy=policy)
    f = src.list_shards()[0]
    # Same size, different bytes on the server than the listing promised.
    bad = type(f)(name=f.name, url=f.url, size=f.size, etag=f.etag, checksum="crc32c:AAAAAA==")
    with pytest.raises(SourceError, match="crc32c mismatch"):
        src.fetch_one(bad)
    assert not StagingFolder(src.staging_dir).path(bad).exists()


def test_fail_vs_skip_after_retries(proxy, gcs_bucket, tmp_path):
    _, location, local = gcs_bucket
    bad = "000012-000017.pt"
    proxy.add(Fault(match=bad, action="status", status=503, times=-1))
    cfg = _cfg(tmp_path, location, max_retries=2)
    policy = RetryPolicy(max_retries=2, file_timeout=5, backoff_base=0.01)
    src = open_source(location, data_config=cfg, policy=policy)
    with pytest.raises(SourceError) as ei:
        _fetch_all(src, cfg, policy=policy)
    assert bad in ei.value.path and "503" in ei.value.reason and "3 attempt(s)" in ei.value.reason
    # Raised in the consumer from the prefetcher's "failed" marker: still "the store
    # is down" (exit 1), not bad input.
    from hf_pipeline.errors import StoreUnreachableError

    assert isinstance(ei.value, StoreUnreachableError)

    cfg = _cfg(tmp_path, location, max_retries=2, on_missing="skip")
    got, stats = _fetch_all(src, cfg, policy=policy)
    assert got[bad] is None
    assert all(got[n] == (local / n).read_bytes() for n in got if n != bad)
    assert [s["name"] for s in stats["skipped"]] == [bad]
    assert "503" in stats["skipped"][0]["reason"]
    assert [s["name"] for s in stats["failures"]] == [bad]


def test_window_and_byte_budget_bound_the_staging_area(proxy, gcs_bucket, tmp_path):
    _, location, _ = gcs_bucket
    cfg = _cfg(tmp_path, location, prefetch_ahead=1, download_workers=4)
    src = open_source(location, data_config=cfg, policy=FAST)
    files = src.list_shards()
    staging = StagingFolder(src.staging_dir)
    with ShardFetcher(
        src, files, data_config=cfg, num_workers=1, progress=False, policy=FAST
    ) as pf:
        client = pf.client()
        assert client.acquire(files[0], timeout=30) is not None
        # The fetcher has decided: what it started has landed, and it starts no more.
        assert pf.wait_idle(timeout=30)
        # One being converted + prefetch_ahead=1: files[2:] must not be fetched yet.
        assert sum(staging.is_staged(f) for f in files) == 2
        assert proxy.count(files[2].name) == 0 and proxy.count(files[3].name) == 0
        client.release(files[0])
        for f in files[1:]:
            assert client.acquire(f, timeout=30) is not None
            client.release(f)
    # Byte budget smaller than two shards: never more than one outstanding.
    proxy.clear()
    size = files[0].size
    cfg = _cfg(tmp_path, location, prefetch_ahead=3, staging_max_gb=1.5 * size / (1 << 30))
    with ShardFetcher(
        src, files, data_config=cfg, num_workers=1, progress=False, policy=FAST
    ) as pf:
        client = pf.client()
        assert client.acquire(files[0], timeout=30) is not None
        assert pf.wait_idle(timeout=30)
        assert proxy.count(files[1].name) == 0
        client.release(files[0])
        assert client.acquire(files[1], timeout=30) is not None


def test_a_worker_ahead_of_the_order_is_served_first(proxy, gcs_bucket, tmp_path):
    _, location, local = gcs_bucket
    cfg = _cfg(tmp_path, location, prefetch_ahead=1, download_workers=1)
    src = open_source(location, data_config=cfg, policy=FAST)
    files = src.list_shards()
    with ShardFetcher(
        src, files, data_config=cfg, num_workers=1, progress=False, policy=FAST
    ) as pf:
        client = pf.client()
        # Window is full with files[0:2], nobody releases: the want marker must still
        # get files[3] fetched instead of waiting forever.
        p = client.acquire(files[3], timeout=20)
        assert p.read_bytes() == (local / files[3].name).read_bytes()


def _convert(batch, files, client):
    import torch

    out = []
    for i in batch["i"]:
        p = client.acquire(files[i], timeout=60)
        shard = torch.load(p, weights_only=True)
        # NumPy, not a torch op: torch ops in forked workers can hang on the
        # parent's OpenMP pool (see hf_pipeline/build/shards.py).
        out.append(int(shard["keys"].numpy().sum()))
        client.release(files[i])
    return {"keysum": out}


@pytest.mark.slow
@pytest.mark.parametrize("ahead", [0, 2])
def test_datasets_map_workers(gcs_bucket, tmp_path, ahead):
    import datasets
    import torch

    _, location, local = gcs_bucket
    cfg = _cfg(tmp_path, location, prefetch_ahead=ahead, download_workers=2)
    src = open_source(location, data_config=cfg, policy=FAST)
    files = src.list_shards()
    # The workers' copy leaves the listing behind (it grows with the shard count).
    assert pickle.loads(pickle.dumps(src))._listings == {} and src._listings
    ds = datasets.Dataset.from_dict({"i": list(range(len(files)))})
    with ShardFetcher(
        src, files, data_config=cfg, num_workers=2, progress=False, policy=FAST
    ) as pf:
        client = pickle.loads(pickle.dumps(pf.client()))
        with clean_workers():  # as the build starts them: the client crosses by pickle
            out = ds.map(
                _convert,
                batched=True,
                batch_size=1,
                num_proc=2,
                fn_kwargs={"files": files, "client": client},
                load_from_cache_file=False,
                cache_file_name=str(tmp_path / "map" / "out.arrow"),
            )
        stats = pf.stats()
    want = [int(torch.load(local / f.name, weights_only=True)["keys"].sum()) for f in files]
    assert out["keysum"] == want
    assert not list((tmp_path / "staging").rglob("*.pt")), "workers released everything"
    assert stats["failures"] == [] and stats["staging_hits"] + stats["staging_misses"] == len(files)
    assert stats["bytes"] == sum(f.size for f in files)


def _part_growing(staging: Path, local: Path, seen: dict[str, int]) -> bool:
    """Whether a part file grew since the last look (``seen``) and is below half its shard."""
    for part in staging.glob(".*.part.*"):
        name = part.name.split(".pt")[0].lstrip(".") + ".pt"
        try:
            size = part.stat().st_size
        except FileNotFoundError:
            continue  # published (or adopted) meanwhile
        before = seen.setdefault(part.name, size)
        seen[part.name] = size
        if before < size < (local / name).stat().st_size // 2:
            return True
    return False


@pytest.mark.slow
def test_sigkill_mid_download_then_resume(proxy, gcs_bucket, tmp_path):
    _, location, local = gcs_bucket
    from hf_pipeline.stores.base import staging_place

    given = tmp_path / "staging"
    staging, _ = staging_place(location, str(given), tmp_path)  # its folder below it
    # ~60 KB/s per request: each 240 KB shard takes ~4 s, so the kill lands mid-file.
    proxy.add(Fault(match=".pt", action="throttle", rate=60_000, times=-1))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    cmd = [sys.executable, "-m", "tests.servers.fetch_main", location, str(given)]
    child = subprocess.Popen(
        [*cmd, "--ahead", "4", "--workers", "2", "--chunk", "20000"],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        seen: dict[str, int] = {}
        while time.monotonic() < deadline:
            done = list(staging.glob(".*.staged.json"))
            # Then kill while the next shard is partway: its part exists and grows.
            if len(done) >= 2 and _part_growing(staging, local, seen):
                break
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close()
        child.stderr.close()
    completed = {
        json.loads(p.read_text())["url"].rsplit("/", 1)[-1] for p in staging.glob(".*.staged.json")
    }
    partial = {p.name.split(".pt")[0] + ".pt" for p in staging.glob(".*.part.*")}
    partial = {n.lstrip(".") for n in partial}
    assert len(completed) >= 2
    assert partial - completed, "the kill should land while some shard is half-downloaded"
    first_run = {n: proxy.count(n) for n in (p.name for p in local.glob("*.pt"))}
    proxy.clear()  # no throttle, fresh request log
    res = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    import hashlib

    for name, info in out["files"].items():
        assert info["sha256"] == hashlib.sha256((local / name).read_bytes()).hexdigest()
    for name in completed:
        assert proxy.count(name) == 0, f"{name} was complete but fetched again"
    for name in partial - completed:
        ranged = [r for r in proxy.log if name in r.path and "alt=media" in r.path]
        assert ranged and all(r.range for r in ranged), f"{name} did not resume with a Range read"
    assert first_run  # sanity: the first run went through the proxy


def test_unlisted_file_reacquire_progress_and_dead_prefetcher(gcs_bucket, tmp_path, monkeypatch):
    import hf_pipeline.stores.fetch as fetch

    _, location, local = gcs_bucket
    cfg = _cfg(tmp_path, location, prefetch_ahead=1, download_workers=2)
    src = open_source(location, data_config=cfg, policy=FAST)
    files = src.list_shards()
    # progress=True: tqdm bars for files and bytes must not get in the way.
    with ShardFetcher(src, files[:2], data_config=cfg, progress=True, policy=FAST) as pf:
        client = pf.client()
        # Not in the prefetcher's list: the worker is told to fetch it itself.
        assert (
            client.acquire(files[3], timeout=20).read_bytes()
            == (local / files[3].name).read_bytes()
        )
        client.release(files[3])
        p = client.acquire(files[0], timeout=20)
        client.release(files[0])
        assert not p.exists()
        # Wanted again after release (a retried batch): fetched again, not a hang.
        assert (
            client.acquire(files[0], timeout=20).read_bytes()
            == (local / files[0].name).read_bytes()
        )
        client.release(files[0])
    monkeypatch.setattr(fetch, "_DEAD_AFTER", 0.3)
    pf = ShardFetcher(src, files[:3], data_config=cfg, progress=False, policy=FAST)
    pf.start()
    try:
        # Simulate a dead prefetcher: its thread stops but the control folder stays.
        pf._stop.set()
        pf._thread.join(5)
        client = pf.client()
        assert (
            client.acquire(files[2], timeout=20).read_bytes()
            == (local / files[2].name).read_bytes()
        )
    finally:
        pf.close()


def test_listing_and_metadata_retries_reach_the_fetch_summary(proxy, gcs_bucket, tmp_path):
    _, location, local = gcs_bucket
    proxy.add(
        Fault(match="prefix=latents/", action="status", status=503, times=1),
        Fault(match="o/coyo11m-meta.parquet?alt=media", action="status", status=503, times=2),
    )
    cfg = _cfg(tmp_path, location)
    src = open_source(location, data_config=cfg, policy=FAST)
    meta = src.find_metadata()
    assert src.fetch_one(meta).read_bytes() == (local / "coyo11m-meta.parquet").read_bytes()
    got, stats = _fetch_all(src, cfg)
    assert all(got[n] == (local / n).read_bytes() for n in got)
    # Before: only shard downloads were counted; a flaky listing left no trace.
    assert stats["listing_retries"] == 1 and stats["metadata_retries"] == 2
    assert stats["retries"] == 0


def test_stray_names_are_refused_and_a_glob_names_them(gcs_bucket, tmp_path):
    from tests.servers import gcs_fs

    server, location, local = gcs_bucket
    gcs_fs(server).put_file(str(local / "000000-000005.pt"), f"{location[5:]}/latest.pt")
    cfg = _cfg(tmp_path, location)
    with pytest.raises(SourceError) as ei:
        open_source(location, data_config=cfg, policy=FAST).list_shards()
    assert "not named by a row range" in ei.value.reason and "latest.pt;" in ei.value.reason
    assert f"{location}/*.pt" in ei.value.reason

    every = open_source(f"{location}/*.pt", data_config=cfg, policy=FAST)
    names = [f.name for f in every.list_shards()]
    assert names == ["latest.pt", *sorted(p.name for p in local.glob("*.pt"))]
    assert every.find_metadata().name == "coyo11m-meta.parquet"
    got, _ = _fetch_all(every, cfg)
    assert got["latest.pt"] == (local / "000000-000005.pt").read_bytes()
    numbered = open_source(f"{location}/0*.pt", data_config=cfg, policy=FAST).list_shards()
    assert [f.name for f in numbered] == names[1:]
    with pytest.raises(SourceError, match="file name part"):
        open_source("gs://b/*/x.pt", data_config=cfg)


def test_a_missing_bucket_is_bad_input_not_an_outage(gcs_bucket, tmp_path):
    from hf_pipeline.errors import StoreUnreachableError

    _, location, _ = gcs_bucket
    cfg = _cfg(tmp_path, location)
    with pytest.raises(SourceError, match="no such bucket or prefix|no \\*.pt") as ei:
        open_source("gs://no-such-bucket-x/p", data_config=cfg, policy=FAST).list_shards()
    assert not isinstance(ei.value, StoreUnreachableError)
