# ruff: noqa: F811 - pytest fixtures imported from tests.servers are parameters here
"""Whole builds from remote stores (issue 5): gs:// on the real fake-gcs-server and
hf:// on the fake Hub, compared row for row with a build of the same files from disk.

What is compared is content (keys, latents, embeddings, captions, report counts),
never the fingerprint: a remote file's identity carries the store's etag/generation,
a local file's its mtime, so the same bytes get different cache identities by design.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_pipeline.build.prepare import REASONS, prepare_cache
from hf_pipeline.cache.layout import CacheLayout, open_dataset
from hf_pipeline.config import load_config
from hf_pipeline.errors import SourceError
from tests.conftest import SMALL_DEMO
from tests.helpers.remote_build import start_remote_build
from tests.servers import gcs_fs, gcs_server, hf_home  # noqa: F401
from tests.servers.hub import FakeHub
from tests.servers.proxy import Fault, FaultProxy

pytestmark = pytest.mark.remote

PREFIX = "coyo/latents-3crop"
META = "coyo/coyo11m-meta.parquet"
HUB_REPO = "test-org/coyo-mini"
#: Short retries: a permanently failing shard gives up in about a second.
FAST = ["data.max_retries=1", "data.file_timeout=10"]


def _cfg(root: Path, shards: str, *extra: str, metadata: str = ""):
    over = [*SMALL_DEMO, *FAST, f"data.shards={shards}", f"build.cache_dir={root}"]
    if metadata:
        over.append(f"data.metadata={metadata}")
    return load_config(None, [*over, *extra], environ={})


def _content(res) -> dict:
    """Every kept row of a built cache, as NumPy arrays (small demos only)."""
    ds = open_dataset(res.layout).with_format("numpy")
    cols = ds[:]
    return {
        "key": np.asarray(cols["key"]),
        "latents": np.asarray(cols["latents"]),
        "embedding": np.asarray(cols["embedding"]),
        "caption": [str(c) for c in cols["caption"]],
    }


def _digest(c: dict) -> str:
    h = hashlib.sha256()
    for name in ("key", "latents", "embedding"):
        h.update(np.ascontiguousarray(c[name]).tobytes())
    h.update("\0".join(c["caption"]).encode())
    return h.hexdigest()


def _counts(report: dict) -> dict:
    return {k: report[k] for k in ("rows_in", "rows_out", "dropped", "embed_dim")}


def _assert_same_content(got, want) -> None:
    a, b = _content(got), _content(want)
    assert a["key"].tolist() == b["key"].tolist()  # same rows, same order
    assert a["caption"] == b["caption"]
    np.testing.assert_array_equal(a["latents"], b["latents"])
    np.testing.assert_array_equal(a["embedding"], b["embedding"])
    assert _digest(a) == _digest(b)
    assert _counts(got.report) == _counts(want.report)


def _nothing_published(root: Path) -> None:
    caches = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    for cache in caches:
        # failed-*.json (the coordinator's failure record) may exist; no stage marker may.
        assert not list(cache.glob("converted*.json")) and not list(cache.glob("filtered*.json"))
        assert not (cache / "converted").exists() and not (cache / "filtered").exists()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from hf_pipeline.demo.generate import generate_demo

    return generate_demo(
        tmp_path_factory.mktemp("demo") / "data", num_shards=4, samples_per_shard=100
    )


@pytest.fixture(scope="module")
def local_build(demo, tmp_path_factory):
    """The reference: the same files built from local disk."""
    root = tmp_path_factory.mktemp("local-cache")
    return prepare_cache(
        _cfg(root, str(demo.out_dir), metadata=str(demo.metadata_path)), progress=False
    )


@pytest.fixture(scope="module")
def bucket(gcs_server, demo) -> str:
    """A fresh bucket holding the demo: shards under coyo/latents-3crop/, parquet in coyo/."""
    name = f"b-{uuid.uuid4().hex[:10]}"
    fs = gcs_fs(gcs_server)
    fs.mkdir(name)
    for p in demo.shard_paths:
        fs.put_file(str(p), f"{name}/{PREFIX}/{p.name}")
    fs.put_file(str(demo.metadata_path), f"{name}/{META}")
    return name


@pytest.fixture
def gcs_env(gcs_server, monkeypatch, hf_home):
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    return gcs_server


@pytest.mark.slow
@pytest.mark.parametrize("ahead", [4, 0], ids=["prefetch4", "prefetch0"])
def test_gcs_build_equals_local_build(gcs_env, bucket, demo, local_build, tmp_path, ahead):
    root = tmp_path / "cache"
    cfg = _cfg(
        root,
        f"gs://{bucket}/{PREFIX}",
        f"data.prefetch_ahead={ahead}",
        metadata=f"gs://{bucket}/{META}",
    )
    res = prepare_cache(cfg, progress=False)
    assert res.built and res.fingerprint != local_build.fingerprint  # etags, not mtimes
    _assert_same_content(res, local_build)
    fetch = res.report["fetch"]
    assert fetch["failures"] == [] and fetch["skipped"] == [] and res.report["skipped_files"] == []
    assert fetch["bytes"] == sum(p.stat().st_size for p in demo.shard_paths)
    assert fetch["prefetch_ahead"] == ahead
    # Every shard was released after conversion: nothing left in staging.
    assert not list((root / ".staging" / res.fingerprint).glob("*.pt"))
    # Same identity again: found, not rebuilt, nothing downloaded.
    again = prepare_cache(cfg, progress=False)
    assert again.built is False and again.fingerprint == res.fingerprint


# --------------------------------------------------------------------------- Hub


@pytest.fixture
def hub(demo, monkeypatch, hf_home):
    """The fake Hub serving the demo; huggingface_hub switched online in this process.

    tests/conftest.py sets HF_HUB_OFFLINE=1 before huggingface_hub is imported and
    huggingface_hub freezes it into ``constants.HF_HUB_OFFLINE``, so both are patched.
    """
    import huggingface_hub.constants

    files = {f"latents-3crop/{p.name}": p.read_bytes() for p in demo.shard_paths}
    files["coyo11m-meta.parquet"] = demo.metadata_path.read_bytes()
    files["README.md"] = b"# mini coyo\n"
    with FakeHub(page_size=3) as server:
        server.add_commit(HUB_REPO, files)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        yield server


def _go_offline(monkeypatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.mark.slow
def test_hub_build_online_then_offline(hub, demo, local_build, tmp_path, monkeypatch, hf_home):
    from huggingface_hub import snapshot_download

    location = f"hf://datasets/{HUB_REPO}/latents-3crop"
    root = tmp_path / "cache"
    res = prepare_cache(_cfg(root, location), progress=False)  # metadata discovered at the root
    assert res.built
    _assert_same_content(res, local_build)
    assert hub.count("/revision/main") == 1
    # 4 shards + the parquet, each downloaded once.
    assert hub.count("/resolve/") == len(demo.shard_paths) + 1, [
        p for m, p in hub.log if "/resolve/" in p
    ]

    # Someone ran `hf download` ahead of time into another Hub cache (for the last step).
    snapshot = tmp_path / "hub-snapshot"
    commit = hub._repos[HUB_REPO]["refs"]["main"]
    snapshot_download(
        HUB_REPO, repo_type="dataset", revision=commit, endpoint=hub.url, cache_dir=str(snapshot)
    )
    hub.stop()  # the network is gone from here on
    _go_offline(monkeypatch)

    # Same cache root: found from the saved listing and the markers, not rebuilt.
    again = prepare_cache(_cfg(root, location), progress=False)
    assert again.built is False and again.fingerprint == res.fingerprint

    # Fresh cache root, default Hub cache: the parquet is there (hf_hub_download), but
    # the shards were streamed through staging and deleted after conversion, so an
    # offline rebuild fails clearly and publishes nothing.
    with pytest.raises(SourceError, match="HF_HUB_OFFLINE") as ei:
        prepare_cache(_cfg(tmp_path / "fresh", location), progress=False)
    assert ei.value.path.endswith(".pt")
    _nothing_published(tmp_path / "fresh")

    # Fresh cache root, Hub cache holding the snapshot: rebuilt fully offline, in place.
    monkeypatch.setenv("HF_HUB_CACHE", str(snapshot))
    fresh = prepare_cache(_cfg(tmp_path / "fresh2", location), progress=False)
    assert fresh.built and fresh.fingerprint == res.fingerprint
    _assert_same_content(fresh, local_build)
    assert fresh.report["fetch"]["bytes"] == 0
    assert all(p.stat().st_size for p in snapshot.rglob("*.pt")), "Hub cache left intact"


# --------------------------------------------------------------------------- faults


@pytest.fixture
def proxy(gcs_env, monkeypatch):
    """A FaultProxy in front of fake-gcs-server; STORAGE_EMULATOR_HOST points at it."""
    with FaultProxy(gcs_env) as p:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", p.url)
        yield p


@pytest.mark.slow
def test_kill_mid_download_then_rerun_fetches_nothing_twice(
    proxy, bucket, demo, local_build, tmp_path, monkeypatch, hf_home
):
    from hf_pipeline.stores import GCSSource

    chunk = 256 << 10
    names = [p.name for p in demo.shard_paths]
    slow = names[0]  # first shard of worker 0: worker 0 waits, its next shard stays staged
    root = tmp_path / "cache"
    over = [
        *SMALL_DEMO,
        f"data.shards=gs://{bucket}/{PREFIX}",
        f"data.metadata=gs://{bucket}/{META}",
        f"build.cache_dir={root}",
        "data.max_retries=2",
        "data.file_timeout=60",
        "coord.lease_timeout=2",
        "coord.heartbeat_interval=0.5",
    ]
    proxy.add(Fault(match=slow, action="throttle", rate=chunk, times=-1))
    proc = start_remote_build(proxy.url, chunk, over, hf_home)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the build never staged anything"
            parts = list(root.glob(f".staging/*/.{slow}.*.part.*"))
            # Worker 0's second shard: staged, and not consumed while worker 0 waits.
            staged = list(root.glob(f".staging/*/.{names[1]}.staged.json"))
            with contextlib.suppress(OSError):
                if parts and parts[0].stat().st_size >= 2 * chunk and staged:
                    break
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)  # reaped: its pid is dead, so its .part is adoptable
    staging = parts[0].parent
    staged_at_kill = {p.name[1 : -len(".staged.json")] for p in staging.glob(".*.pt.staged.json")}
    partial = sum(p.stat().st_size for p in staging.glob(f".{slow}.*.part.*"))
    assert (
        names[1] in staged_at_kill
        and slow not in staged_at_kill
        and 0 < partial < demo.shard_paths[0].stat().st_size
    )
    before = {n: len(proxy.media_ranges(n)) for n in names}
    with proxy._lock:
        proxy._faults.clear()  # the network is fine again; keep the request log

    monkeypatch.setattr(GCSSource, "read_chunk", chunk)
    res = prepare_cache(load_config(None, over, environ={}), progress=False)
    assert res.built
    _assert_same_content(res, local_build)
    after = {n: proxy.media_ranges(n) for n in names}
    # A shard staged and verified before the kill is never fetched again.
    for n in staged_at_kill:
        assert len(after[n]) == before[n], f"{n} was staged before the kill and fetched again"
    # The partial shard resumes where the .part ended: no byte of it is fetched twice.
    rerun = sorted(after[slow][before[slow] :])
    assert rerun and rerun[0][0] == partial, (partial, rerun)
    size = demo.shard_paths[0].stat().st_size
    assert sum(e - s + 1 for s, e in rerun) == size - partial
    assert res.report["fetch"]["resumed_bytes"] == partial
    # Shards converted and released before the kill are fetched again: the convert stage
    # restarts from scratch (its output died with the builder's tmp folder).
    for n in set(names) - staged_at_kill - {slow}:
        assert len(after[n]) - before[n] <= 1


@pytest.mark.slow
def test_missing_shard_fail_vs_skip(proxy, bucket, demo, local_build, tmp_path):
    # A shard with no key shared with another shard, so "local minus its rows" is exact.
    keys = [torch.load(p, weights_only=True)["keys"].numpy() for p in demo.shard_paths]
    alone = [
        i
        for i, k in enumerate(keys)
        if not np.isin(k, np.concatenate([x for j, x in enumerate(keys) if j != i])).any()
    ]
    victim = demo.shard_paths[alone[-1]]
    proxy.add(Fault(match=victim.name, action="status", status=503, times=-1))
    shards, meta = f"gs://{bucket}/{PREFIX}", f"gs://{bucket}/{META}"

    root = tmp_path / "fail"
    with pytest.raises(SourceError) as ei:
        prepare_cache(_cfg(root, shards, metadata=meta), progress=False)
    assert victim.name in ei.value.path and "503" in ei.value.reason
    _nothing_published(root)

    res = prepare_cache(
        _cfg(tmp_path / "skip", shards, "data.on_missing=skip", metadata=meta), progress=False
    )
    r = res.report
    assert [s["name"] for s in r["skipped_files"]] == [victim.name]
    assert "503" in r["skipped_files"][0]["reason"]
    assert r["dropped"]["missing_shard_files"] == 1
    lost = keys[alone[-1]]
    assert r["rows_in"] == local_build.report["rows_in"] - len(lost)
    assert r["rows_out"] + sum(r["dropped"][k] for k in REASONS) == r["rows_in"]

    got, want = _content(res), _content(local_build)
    keep = ~np.isin(want["key"], lost)
    assert got["key"].tolist() == want["key"][keep].tolist()
    assert got["caption"] == [c for c, k in zip(want["caption"], keep, strict=True) if k]
    np.testing.assert_array_equal(got["latents"], want["latents"][keep])
    # Other rows in an encoder batch change the padding, so allow float noise here.
    np.testing.assert_allclose(got["embedding"], want["embedding"][keep], atol=1e-5)


def test_a_want_answered_before_the_scan_is_not_a_second_request(gcs_env, tmp_path, monkeypatch):
    """Regression: a worker's "want" still unread when it released the file was taken
    for "wanted again" in the same scan: the shard was downloaded twice and left staged.
    """
    from hf_pipeline.config import DataConfig
    from hf_pipeline.stores import fetch, open_source
    from tests.servers import make_shards, upload_folder

    bucket = f"b-{uuid.uuid4().hex[:10]}"
    upload_folder(gcs_env, make_shards(tmp_path / "src", 6, 6), f"{bucket}/lat")
    with FaultProxy(gcs_env) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        scan = fetch.ShardFetcher._poll_markers

        def late_scan(self):  # a scheduler thread starved of CPU
            time.sleep(0.3)
            return scan(self)

        monkeypatch.setattr(fetch.ShardFetcher, "_poll_markers", late_scan)
        location = f"gs://{bucket}/lat"
        cfg = DataConfig(
            shards=location,
            staging_dir=str(tmp_path / "staging"),
            prefetch_ahead=4,
            download_workers=1,
        )
        src = open_source(location, data_config=cfg)
        files = src.list_shards()
        with fetch.ShardFetcher(src, files, data_config=cfg, progress=False) as pf:
            client = pf.client()
            for f in files:
                assert client.acquire(f, timeout=60) is not None
                client.release(f)
            # A wrong re-download would be started by a scan after the last release
            # and be in flight: wait for a scan that leaves nothing downloading.
            assert pf.wait_idle(timeout=30)
        assert {f.name: proxy.count(f.name) for f in files} == {f.name: 1 for f in files}
    assert not list((tmp_path / "staging").rglob("*.pt"))  # per-build folders below it


def test_a_gcs_reupload_of_the_same_bytes_is_the_same_cache(gcs_env, bucket, demo, tmp_path):
    """The identity of an object is its content (md5), not its generation: the same
    bytes uploaded again find the same cache; other bytes do not."""
    from dist.env import detect
    from hf_pipeline.build.prepare import job_identity

    one = detect(rank=0, world_size=1, local_rank=0, local_world_size=1)
    cfg = _cfg(tmp_path, f"gs://{bucket}/{PREFIX}", metadata=f"gs://{bucket}/{META}")
    inputs, fingerprint = job_identity(cfg, one)
    fs = gcs_fs(gcs_env)
    for p in demo.shard_paths:
        fs.put_file(str(p), f"{bucket}/{PREFIX}/{p.name}")
    fs.put_file(str(demo.metadata_path), f"{bucket}/{META}")
    again, fp_again = job_identity(cfg, one)
    assert fp_again == fingerprint
    assert all(a.version != b.version for a, b in zip(again.shards, inputs.shards, strict=True))
    # One changed byte in another bucket's copy: another fingerprint.
    other = f"{bucket}-x"
    fs.mkdir(other)
    for p in demo.shard_paths:
        fs.put_file(str(p), f"{other}/{PREFIX}/{p.name}")
    raw = bytearray(Path(demo.metadata_path).read_bytes())
    raw[100] ^= 1
    changed = tmp_path / "meta.parquet"
    changed.write_bytes(bytes(raw))
    fs.put_file(str(changed), f"{other}/{META}")
    cfg_other = _cfg(tmp_path, f"gs://{other}/{PREFIX}", metadata=f"gs://{other}/{META}")
    assert job_identity(cfg_other, one)[1] != fingerprint


def test_a_hub_commit_that_leaves_the_shards_alone_is_the_same_cache(hub, demo, tmp_path):
    """A Hub file's identity is its content (LFS sha256 or git blob id), not the commit:
    a new commit that only edits the README keeps the fingerprint."""
    from dist.env import detect
    from hf_pipeline.build.prepare import job_identity

    one = detect(rank=0, world_size=1, local_rank=0, local_world_size=1)
    location = f"hf://datasets/{HUB_REPO}/latents-3crop"
    cfg = _cfg(tmp_path, location, metadata=f"hf://datasets/{HUB_REPO}/coyo11m-meta.parquet")
    inputs, fingerprint = job_identity(cfg, one)
    files = {f"latents-3crop/{p.name}": p.read_bytes() for p in demo.shard_paths}
    files["coyo11m-meta.parquet"] = demo.metadata_path.read_bytes()
    files["README.md"] = b"# edited\n"
    second = hub.add_commit(HUB_REPO, files)
    moved, fp_moved = job_identity(cfg, one)
    assert second in moved.shards[0].url and second not in inputs.shards[0].url
    assert fp_moved == fingerprint


@pytest.mark.slow
def test_two_sources_of_the_same_file_names_share_one_staging_dir(gcs_env, tmp_path):
    """An outside tester: two builds of two buckets whose shards have the same names,
    both with one ``data.staging_dir``, staged into the same flat folder: one waited
    forever for a file the other had replaced (1 run in 3), or failed `cannot open
    shard`, exit 2. Each build now stages into a folder of its own below it (as under
    the cache root's ``.staging``). Real processes at once; each cache holds its own
    bucket's keys."""
    from hf_pipeline.demo.generate import generate_demo
    from tests.conftest import run_each

    fs = gcs_fs(gcs_env)
    name = f"b-{uuid.uuid4().hex[:10]}"
    fs.mkdir(name)
    keys = {}
    for seed, prefix in ((0, "one"), (1, "two")):
        demo = generate_demo(
            tmp_path / f"demo{seed}", num_shards=3, samples_per_shard=60, seed=seed
        )
        for p in demo.shard_paths:
            fs.put_file(str(p), f"{name}/{prefix}/lat/{p.name}")
        fs.put_file(str(demo.metadata_path), f"{name}/{prefix}/coyo11m-meta.parquet")
        keys[prefix] = {
            int(k) for p in demo.shard_paths for k in torch.load(p, weights_only=True)["keys"]
        }
    assert not keys["one"] & keys["two"]
    staging = tmp_path / "shared-staging"
    env = {"STORAGE_EMULATOR_HOST": gcs_env, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    runs = []
    for prefix in ("one", "two"):
        sets = [*SMALL_DEMO, *FAST, f"data.shards=gs://{name}/{prefix}/lat",
                f"data.metadata=gs://{name}/{prefix}/coyo11m-meta.parquet",
                f"data.staging_dir={staging}", "data.prefetch_ahead=1"]  # fmt: skip
        argv = ["-m", "hf_pipeline", "build", "-q", "--cache-dir", tmp_path / prefix,
                *(x for s in sets for x in ("--set", s))]  # fmt: skip
        runs.append((argv, env))
    results = run_each(runs, timeout=300)
    for (code, _, err), prefix in zip(results, ("one", "two"), strict=True):
        assert code == 0, (prefix, err[-3000:])
        (cache,) = [p for p in (tmp_path / prefix).iterdir() if not p.name.startswith(".")]
        got = {int(k) for k in open_dataset(CacheLayout(cache))["key"]}
        assert got and got <= keys[prefix], prefix
    # Each source stages in a folder of its own below the shared one: nothing flat there
    # (the old code left both metadata files' downloads in one place).
    entries = list(staging.iterdir())
    assert entries and all(p.is_dir() and not p.name.startswith(".") for p in entries), entries
