# ruff: noqa: F811 - pytest fixtures imported from tests.servers are parameters here
"""Local sources, ordering, retry classification and the staging primitives."""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import pickle
import threading
import time
from pathlib import Path

import pytest

from dist.errors import ForeignCacheFolderError
from hf_pipeline.config import DataConfig
from hf_pipeline.errors import SourceError
from hf_pipeline.stores import (
    GCSSource,
    HubSource,
    LocalSource,
    RemoteFile,
    natural_key,
    open_source,
)
from hf_pipeline.stores.fetch import ShardFetcher, StagingClient, consumption_order
from hf_pipeline.stores.fetch_stats import FetchStats
from hf_pipeline.stores.retry import RetryPolicy, TransientError, is_transient, with_retries
from hf_pipeline.stores.staging import StagingFolder, stage_file
from tests.helpers.victims import OLD_S, Victim
from tests.servers import hf_home, make_shards, shard_dir  # noqa: F401

FAST = RetryPolicy(max_retries=3, file_timeout=5, backoff_base=0.001)


def _rf(i: int, size: int = 10) -> RemoteFile:
    return RemoteFile(name=f"{i:06d}.pt", url=f"gs://b/{i:06d}.pt", size=size, etag=str(i))


def test_natural_key_orders_numeric_ranges():
    names = ["100-109.pt", "0-9.pt", "10-19.pt", "000020-000029.pt", "9-9.pt"]
    assert sorted(names, key=natural_key) == [
        "0-9.pt",
        "9-9.pt",
        "10-19.pt",
        "000020-000029.pt",
        "100-109.pt",
    ]


def test_consumption_order_matches_contiguous_split():
    files = [_rf(i) for i in range(10)]
    order = [int(f.name[:6]) for f in consumption_order(files, 3)]
    # datasets splits 10 into [0..3], [4..6], [7..9]; step j of every worker first.
    assert order == [0, 4, 7, 1, 5, 8, 2, 6, 9, 3]
    assert consumption_order(files, 1) == files
    assert sorted(consumption_order(files, 32), key=lambda f: f.name) == files


def test_retry_policy_validates_and_backs_off():
    with pytest.raises(ValueError, match="max_retries must be >= 0, got -1"):
        RetryPolicy(max_retries=-1)
    p = RetryPolicy(backoff_base=1.0, backoff_max=4.0)
    for attempt, hi in [(1, 1.0), (2, 2.0), (3, 4.0), (10, 4.0)]:
        d = p.delay(attempt)
        assert hi / 2 <= d <= hi


class _Status(Exception):
    def __init__(self, code):
        super().__init__(f"HTTP {code}")
        self.code = code


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (_Status(503), True),
        (_Status(429), True),
        (_Status(500), True),
        (_Status(404), False),
        (_Status(403), False),
        (TimeoutError("t"), True),
        (ConnectionResetError("r"), True),
        (FileNotFoundError("x"), False),
        (TransientError("size mismatch"), True),
        (ValueError("bad"), False),
    ],
)
def test_transient_classification(exc, transient):
    assert is_transient(exc) is transient


def test_with_retries_retries_then_succeeds_and_names_the_file():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise _Status(503)
        return "ok"

    retried = []
    assert with_retries("gs://b/x.pt", flaky, FAST, on_retry=retried.append) == "ok"
    assert len(calls) == 3 and len(retried) == 2

    with pytest.raises(SourceError) as ei:
        with_retries("gs://b/y.pt", lambda: (_ for _ in ()).throw(_Status(503)), FAST)
    assert ei.value.path == "gs://b/y.pt"
    assert "4 attempt(s)" in ei.value.reason and "503" in ei.value.reason

    calls.clear()

    def missing():
        calls.append(1)
        raise FileNotFoundError("gone")

    with pytest.raises(SourceError, match="not retried"):
        with_retries("gs://b/z.pt", missing, FAST)
    assert len(calls) == 1


def test_local_source_lists_sorted_and_finds_metadata(shard_dir, hf_home):
    # An unpadded name that a plain string sort would misplace.
    (shard_dir / "100-105.pt").write_bytes((shard_dir / "000000-000005.pt").read_bytes())
    cfg = DataConfig(shards=str(shard_dir))
    src = open_source(str(shard_dir), data_config=cfg)
    assert isinstance(src, LocalSource) and src.is_local
    names = [f.name for f in src.list_shards()]
    assert names == [
        "000000-000005.pt",
        "000006-000011.pt",
        "000012-000017.pt",
        "000018-000023.pt",
        "100-105.pt",
    ]
    meta = src.find_metadata()
    assert meta.name == "coyo11m-meta.parquet"
    assert src.find_metadata("coyo11m-meta.parquet") == meta
    assert src.find_metadata(str(shard_dir / "coyo11m-meta.parquet")) == meta
    assert src.fetch_one(meta) == shard_dir / "coyo11m-meta.parquet"
    ident = src.identity()
    assert [i[0] for i in ident] == names
    assert all(i[1] == (shard_dir / i[0]).stat().st_size for i in ident)


def test_local_metadata_is_looked_for_next_to_the_shards_only(tmp_path, hf_home):
    # A local folder has no dataset root: its parent may hold anything (an old backup
    # of the parquet, another dataset's). Discovery used to take a *meta*.parquet from
    # the parent silently; now only next to the shards, else one line saying so.
    make_shards(tmp_path / "data" / "latents", n_shards=3, meta=False)
    make_shards(tmp_path / "other", n_shards=1)
    (tmp_path / "data" / "old-backup-meta.parquet").write_bytes(
        (tmp_path / "other" / "coyo11m-meta.parquet").read_bytes()
    )
    cfg = DataConfig(shards="x")
    src = open_source(str(tmp_path / "data" / "latents" / "0000*-*.pt"), data_config=cfg)
    assert len(src.list_shards()) == 3
    with pytest.raises(SourceError, match=r"no \*meta\*.parquet found next to the shards"):
        src.find_metadata()
    with pytest.raises(SourceError, match="not found next to"):
        src.find_metadata("old-backup-meta.parquet")
    # Next to the shards (the glob's folder): found, whatever the parent holds.
    (tmp_path / "data" / "latents" / "coyo11m-meta.parquet").write_bytes(
        (tmp_path / "other" / "coyo11m-meta.parquet").read_bytes()
    )
    src = open_source(str(tmp_path / "data" / "latents" / "0000*-*.pt"), data_config=cfg)
    assert src.find_metadata().url == str(
        (tmp_path / "data" / "latents" / "coyo11m-meta.parquet").resolve()
    )


def test_local_errors(tmp_path, hf_home):
    cfg = DataConfig(shards="x")
    with pytest.raises(SourceError, match="does not exist"):
        open_source(str(tmp_path / "nope"), data_config=cfg).list_shards()
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no \\*.pt shards"):
        open_source(str(tmp_path / "empty"), data_config=cfg).list_shards()
    # data.metadata naming a folder: said so (was "file does not exist").
    with pytest.raises(SourceError, match="is a directory, not a file") as e:
        open_source(str(tmp_path / "empty"), data_config=cfg).stat(str(tmp_path / "empty"))
    assert e.value.path == str(tmp_path / "empty")
    with pytest.raises(SourceError, match="unsupported scheme"):
        open_source("s3://bucket/x", data_config=cfg)
    make_shards(tmp_path / "two", n_shards=1)
    (tmp_path / "two" / "other-meta.parquet").write_bytes(b"x")
    with pytest.raises(SourceError, match="several metadata candidates"):
        open_source(str(tmp_path / "two"), data_config=cfg).find_metadata()
    make_shards(tmp_path / "none" / "x", n_shards=1, meta=False)
    with pytest.raises(SourceError, match="no \\*meta\\*.parquet"):
        open_source(str(tmp_path / "none" / "x"), data_config=cfg).find_metadata()


def test_location_parsing(hf_home):
    cfg = DataConfig(shards="x")
    hub = open_source(
        "hf://datasets/KBlueLeaf/coyo11m-256px-ccrop-latent/latents-3crop", data_config=cfg
    )
    assert isinstance(hub, HubSource)
    assert (hub.repo_id, hub.revision, hub.path_in_repo) == (
        "KBlueLeaf/coyo11m-256px-ccrop-latent",
        "main",
        "latents-3crop",
    )
    pr = open_source("hf://datasets/org/name@refs%2Fpr%2F3/a/b", data_config=cfg)
    assert (pr.repo_id, pr.revision, pr.path_in_repo) == ("org/name", "refs/pr/3", "a/b")
    with pytest.raises(SourceError, match="hf://datasets/"):
        open_source("hf://models/org/name", data_config=cfg)
    gcs = open_source("gs://bucket/prefix/", data_config=cfg)
    assert isinstance(gcs, GCSSource) and gcs._path == "bucket/prefix"
    with pytest.raises(SourceError, match="gs://<bucket>"):
        open_source("gs://", data_config=cfg)


def test_local_prefetcher_hands_out_originals(shard_dir, hf_home):
    cfg = DataConfig(shards=str(shard_dir))
    src = open_source(str(shard_dir), data_config=cfg)
    files = src.list_shards()
    with ShardFetcher(src, files, data_config=cfg, num_workers=2, progress=False) as pf:
        client = pickle.loads(pickle.dumps(pf.client()))
        for f in files:
            p = client.acquire(f)
            assert p == shard_dir / f.name
            client.release(f)
            assert p.exists(), "release must never delete an original"
    assert pf.stats()["failures"] == []


def test_wait_idle_answers_for_the_scheduler_it_has(shard_dir, hf_home, tmp_path):
    # Local: no scheduler, nothing is ever downloaded here: idle at once.
    cfg = DataConfig(shards=str(shard_dir))
    src = open_source(str(shard_dir), data_config=cfg)
    with ShardFetcher(src, src.list_shards(), data_config=cfg, progress=False) as pf:
        assert pf.wait_idle(timeout=5)
    # Remote, nothing to fetch: the first pass is idle; closed: no pass will come.
    cfg = DataConfig(shards="gs://b/p", staging_dir=str(tmp_path / "staging"))
    remote = open_source("gs://b/p", data_config=cfg)
    pf = ShardFetcher(remote, [], data_config=cfg, progress=False)
    assert not pf.wait_idle(timeout=0.1), "not started: no scheduler to wait for"
    pf.start()
    try:
        assert pf.wait_idle(timeout=10)
    finally:
        pf.close()
    started = time.monotonic()
    assert not pf.wait_idle(timeout=10)
    assert time.monotonic() - started < 5, "a closed fetcher must not make callers wait"


def test_staging_sidecar_guards_identity(tmp_path):
    st = StagingFolder(tmp_path)
    f = RemoteFile(name="a.pt", url="gs://b/a.pt", size=3, etag="1", checksum="md5:x")
    part, have = st.claim_part(f)
    assert have == 0
    part.write_bytes(b"abc")
    st.publish(f, part)
    assert st.is_staged(f)
    # Same name, new generation on the server: not the staged copy any more.
    assert not st.is_staged(
        RemoteFile(name="a.pt", url="gs://b/a.pt", size=3, etag="2", checksum="md5:x")
    )
    st.path(f).write_bytes(b"ab")  # damaged after staging
    assert not st.is_staged(f)
    st.remove(f)
    assert not st.path(f).exists() and not st.sidecar(f).exists()
    st.remove(f)  # idempotent


def test_staging_adopts_a_dead_owners_part(tmp_path):
    import subprocess
    import sys

    st = StagingFolder(tmp_path)
    f = RemoteFile(name="a.pt", url="gs://b/a.pt", size=10, etag="1")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)
    orphan = tmp_path / f"{st._part_prefix(f)}{pid}.1"
    orphan.write_bytes(b"12345")
    part, have = st.claim_part(f)
    assert have == 5 and part.read_bytes() == b"12345" and not orphan.exists()


def test_client_pickles_without_network_handles(hf_home, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    cfg = DataConfig(shards="gs://b/p")
    src = open_source("gs://b/p", data_config=cfg)
    src._fs()  # create a handle; must not travel
    c = StagingClient(source=src, staging_dir=str(src.staging_dir), policy=FAST)
    c2 = pickle.loads(pickle.dumps(c))
    assert c2.source._fs_obj is None and c2.source.location == "gs://b/p"


def test_a_source_pickles_without_its_listing(tmp_path):
    """The join's workers get the source inside every task (StagingClient): its pickle
    does not grow with the shard count (612 KB at 5,500 shards before), and a worker's
    copy still reads its files and lists again when asked."""

    def listed(n: int):
        folder = tmp_path / f"n{n}"
        folder.mkdir()
        for i in range(n):
            (folder / f"{i * 10:06d}-{i * 10 + 9:06d}.pt").write_bytes(b"x")
        src = open_source(str(folder), data_config=DataConfig(shards=str(folder)))
        files = src.list_shards()
        client = StagingClient(source=src, staging_dir=str(tmp_path / "staging"))
        return files, pickle.dumps(client)

    few, small = listed(4)
    many, big = listed(400)
    assert len(few) == 4 and len(many) == 400
    assert len(big) - len(small) < 16  # the folder name's length
    worker = pickle.loads(big).source
    assert worker.direct_path(many[123]) == Path(many[123].url)
    assert worker.list_shards() == many


def test_unreachable_without_mirror_is_a_clear_error(hf_home, monkeypatch, caplog):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: connection refused
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    cfg = DataConfig(shards="gs://b/p", max_retries=1)
    with pytest.raises(SourceError) as ei:
        open_source("gs://b/p", data_config=cfg, policy=FAST).list_shards()
    assert "gs://b/p" in str(ei.value) and "attempt" in ei.value.reason


def test_unreachable_with_mirror_falls_back_and_says_so(shard_dir, hf_home, monkeypatch, caplog):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    cfg = DataConfig(shards="gs://b/p", local_mirror=str(shard_dir))
    with caplog.at_level(logging.WARNING, logger="hf_pipeline.stores"):
        src = open_source("gs://b/p", data_config=cfg, policy=FAST)
    assert isinstance(src, LocalSource) and len(src.list_shards()) == 4
    assert any("unreachable" in r.message and str(shard_dir) in r.message for r in caplog.records)
    # The retries that led to the mirror still reach the report.
    assert src.fetch_stats.as_dict()["listing_retries"] == FAST.max_retries


def test_dangling_symlink_and_loop_are_missing_shards(shard_dir, hf_home):
    # Before: isfile() was False for both, so they vanished with exit 0 even under
    # on_missing: fail, and the report said nothing.
    (shard_dir / "000024-000029.pt").symlink_to(shard_dir / "gone" / "000024-000029.pt")
    loop = shard_dir / "000030-000035.pt"
    loop.symlink_to(loop)
    # A symlink to a real shard is an ordinary shard.
    (shard_dir / "000036-000041.pt").symlink_to(shard_dir / "000000-000005.pt")
    cfg = DataConfig(shards=str(shard_dir))
    with pytest.raises(SourceError) as ei:
        open_source(str(shard_dir), data_config=cfg).list_shards()
    err = ei.value
    assert err.path == str(shard_dir / "000024-000029.pt")
    assert "dangling symlink" in err.reason and "gone" in err.reason
    assert "1 more: 000030-000035.pt" in err.reason and "data.on_missing: skip" in err.reason
    assert pickle.loads(pickle.dumps(err)).reason == err.reason

    cfg = DataConfig(shards=str(shard_dir), on_missing="skip")
    src = open_source(str(shard_dir), data_config=cfg)
    files = src.list_shards()
    assert [f.name for f in files][-1] == "000036-000041.pt" and len(files) == 5
    with ShardFetcher(src, files, data_config=cfg, progress=False) as pf:
        for f in files:
            pf.client().acquire(f)
    skipped = pf.stats()["skipped"]
    assert [s["name"] for s in skipped] == ["000024-000029.pt", "000030-000035.pt"]
    assert "dangling symlink" in skipped[0]["reason"] and "loop" in skipped[1]["reason"]
    assert skipped[1]["url"] == str(loop)


def test_stray_pt_names_are_refused_unless_a_glob_names_them(shard_dir, hf_home):
    # Before: accepted and sorted before the numbered shards, so a "latest.pt" copy
    # decided which duplicate key won.
    one = (shard_dir / "000000-000005.pt").read_bytes()
    for name in ("latest.pt", "shard_final.pt", ".000042-000047.pt"):
        (shard_dir / name).write_bytes(one)
    cfg = DataConfig(shards=str(shard_dir))
    with pytest.raises(SourceError) as ei:
        open_source(str(shard_dir), data_config=cfg).list_shards()
    assert ei.value.path == str(shard_dir)
    # A hidden one too (issue 24 item 7: it was left out without a word; GCS and Hub
    # listings already refused it): a glob is how to leave hidden files out.
    assert "3 *.pt file(s) not named by a row range" in ei.value.reason
    assert "latest.pt, shard_final.pt, .000042-000047.pt;" in ei.value.reason
    assert f"{shard_dir}/*.pt" in ei.value.reason

    every = [f.name for f in open_source(str(shard_dir / "*.pt"), data_config=cfg).list_shards()]
    assert every == [
        "latest.pt",
        "shard_final.pt",
        "000000-000005.pt",
        "000006-000011.pt",
        "000012-000017.pt",
        "000018-000023.pt",
    ]
    numbered = open_source(str(shard_dir / "0*.pt"), data_config=cfg).list_shards()
    assert [f.name for f in numbered] == every[2:]


def test_shard_named_folders_and_special_files_are_missing_shards(shard_dir, hf_home):
    """Issue 24 item 7: a folder named like a shard (and a symlink to one, a fifo) was
    skipped without a word (exit 0, ``skipped_files: []``) even under on_missing: fail."""
    import os

    (shard_dir / "000060-000079.pt").mkdir()
    (shard_dir / "000080-000089.pt").symlink_to(shard_dir / "000060-000079.pt")
    os.mkfifo(shard_dir / "000090-000099.pt")  # torch.load would wait on it forever
    cfg = DataConfig(shards=str(shard_dir))
    with pytest.raises(SourceError) as ei:
        open_source(str(shard_dir), data_config=cfg).list_shards()
    assert ei.value.path == str(shard_dir / "000060-000079.pt")
    assert ei.value.reason.startswith("missing shard: a directory, not a shard file (and 2 more")

    cfg = DataConfig(shards=str(shard_dir), on_missing="skip")
    for location in (shard_dir, shard_dir / "0*.pt"):  # a glob that matches them: the same
        src = open_source(str(location), data_config=cfg)
        files = src.list_shards()
        assert len(files) == 4
        with ShardFetcher(src, files, data_config=cfg, progress=False) as pf:
            pass
        assert [(s["name"], s["reason"]) for s in pf.stats()["skipped"]] == [
            ("000060-000079.pt", "a directory, not a shard file"),
            ("000080-000089.pt", "a symlink to a directory, not a shard file"),
            ("000090-000099.pt", "not a regular file (a fifo)"),
        ]


def test_unreachable_store_is_a_fault_not_bad_input(hf_home, monkeypatch):
    import socket

    from hf_pipeline.errors import StoreUnreachableError, UserError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: connection refused
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    src = open_source("gs://b/p", data_config=DataConfig(shards="gs://b/p"), policy=FAST)
    with pytest.raises(StoreUnreachableError) as ei:
        src.list_shards()
    assert isinstance(ei.value, SourceError) and isinstance(ei.value, UserError)
    assert "4 attempt(s)" in ei.value.reason
    again = pickle.loads(pickle.dumps(ei.value))
    assert type(again) is StoreUnreachableError and again.reason == ei.value.reason
    # Every listing retry is counted, for the report's fetch section.
    assert src.fetch_stats.as_dict()["listing_retries"] == FAST.max_retries
    # A permanent answer is not retried and stays bad input.
    with pytest.raises(SourceError) as ei:
        with_retries("x", lambda: (_ for _ in ()).throw(FileNotFoundError("x")), FAST)
    assert type(ei.value) is SourceError and "not retried" in ei.value.reason


# --------------------------------------------------------------------------- shared roots


@pytest.mark.parametrize("level", [".staging", ".staging/<key>", ".staging/<key>/.ctl"])
def test_the_fetcher_refuses_a_symlinked_staging_or_control_folder(hf_home, tmp_path, level):
    """The cache root is shared: someone linked `.staging`, the source's folder in it or
    its `.ctl` to a folder of the user's. The fetcher made its control folder there, its
    sweep removed every day-old folder in that `.ctl` (`rmtree`, errors ignored), and the
    downloads and releases went there too. Now: refused in one line naming the link, and
    nothing is written into, or removed from, the folder it names."""
    victim = Victim(tmp_path / "victim")
    cfg = DataConfig(shards="gs://b/p")
    src = open_source("gs://b/p", data_config=cfg)  # default: <root>/.staging/<key>
    assert src.staging_dir.parent.name == ".staging"
    place = src.staging_base / level.replace("<key>", src.staging_dir.name)
    place.parent.mkdir(parents=True, exist_ok=True)
    place.symlink_to(victim.path)
    fetcher = ShardFetcher(src, [], data_config=cfg, progress=False)
    with pytest.raises(ForeignCacheFolderError) as e:
        fetcher.start()
    fetcher.close()
    assert e.value.path == str(place), e.value
    assert str(e.value).startswith(f"{place}: a symlink where hf_pipeline keeps")
    victim.assert_untouched()
    # The cache root itself may be a link (HF_HOME -> /mnt/nfs/...): that is fine.
    place.unlink()
    real = tmp_path / "nfs"
    os.rename(src.staging_base, real)
    src.staging_base.symlink_to(real)
    with ShardFetcher(src, [], data_config=cfg, progress=False) as fetcher:
        assert fetcher.ctl_dir is not None and fetcher.ctl_dir.is_dir()
    victim.assert_untouched()


def test_sources_opened_with_one_staging_dir_stage_in_folders_of_their_own(hf_home, tmp_path):
    """A source opened directly (the API, without a staging folder of the build's) with
    ``data.staging_dir`` stages in a folder per location below it, as a build does and as
    ``<root>/.staging/<key>`` does: two buckets whose shards have the same names no longer
    share one flat folder (they took each other's files). The same location, the same
    folder; a folder given explicitly (as the build gives its own) is kept as given."""
    staging = tmp_path / "staging"
    cfg = DataConfig(shards="gs://a/p", staging_dir=str(staging))
    a, b = (open_source(loc, data_config=cfg) for loc in ("gs://a/p", "gs://b/p"))
    assert a.staging_dir != b.staging_dir
    assert {a.staging_dir.parent, b.staging_dir.parent} == {staging}
    assert a.staging_base == b.staging_base == staging
    assert open_source("gs://a/p", data_config=cfg).staging_dir == a.staging_dir
    given = open_source("gs://a/p", data_config=cfg, staging_dir=tmp_path / "mine")
    assert given.staging_dir == tmp_path / "mine"


def test_the_control_sweep_removes_only_old_run_folders_of_this_user(hf_home, tmp_path):
    """What the sweep removes it can tell it made: real folders named as a run's, of this
    user, a day old; a folder of another name or a link named as a run's stays."""
    staging = tmp_path / "staging"
    cfg = DataConfig(shards="gs://b/p", staging_dir=str(staging))
    src = open_source("gs://b/p", data_config=cfg)
    assert src.staging_dir.parent == staging and src.staging_base == staging  # its own folder
    ctl = src.staging_dir / ".ctl"
    victim = Victim(tmp_path / "victim")
    for name in ("run-abcd1234", "0123456789ab", "photos"):
        (ctl / name).mkdir(parents=True)
        (ctl / name / "heartbeat").write_text("1")
    (ctl / "run-zzzzzzzz").symlink_to(victim.path)
    past = time.time() - OLD_S
    for name in ("run-abcd1234", "0123456789ab", "photos", "run-zzzzzzzz"):
        os.utime(ctl / name, (past, past), follow_symlinks=False)
    (ctl / "run-fresh123").mkdir()  # a live run's
    with ShardFetcher(src, [], data_config=cfg, progress=False) as fetcher:
        mine = fetcher.ctl_dir
        assert (
            mine is not None and mine.parent == ctl and oct(mine.stat().st_mode & 0o777) == "0o700"
        )
    assert sorted(os.listdir(ctl)) == ["photos", "run-fresh123", "run-zzzzzzzz"]
    assert (ctl / "photos" / "heartbeat").read_text() == "1"
    victim.assert_untouched()


class _Bytes:
    """A range reader serving one file's bytes."""

    def __init__(self, data: bytes):
        self.data = data

    def read_range(self, file, offset, deadline, stop):
        yield self.data[offset:]


def _md5(data: bytes) -> str:
    return "md5:" + base64.b64encode(hashlib.md5(data).digest()).decode()


def _dead_pid() -> int:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(out.stdout)


def _victim_and_staging(tmp_path):
    """A victim folder (a canary file), a made staging folder and one 10-byte remote file."""
    victim = Victim(tmp_path / "victim")
    staging = StagingFolder(tmp_path / "staging")
    staging.make()
    data = b"0123456789"
    f = RemoteFile(name="a.pt", url="gs://b/a.pt", size=len(data), etag="1", checksum=_md5(data))
    return victim, staging, data, f


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_a_link_planted_at_a_parts_name_is_never_written_through(tmp_path, how):
    """A part's name is predictable (`.<name>.<tag>.part.<pid>.<thread>`): a link there
    to a file of the user's had the download appended to that file (`open(part, "ab")`
    followed it). Now: the download fails naming the part, the file is as it was."""
    victim, staging, data, f = _victim_and_staging(tmp_path)
    mine = staging.root / f"{staging._part_prefix(f)}{os.getpid()}.{threading.get_ident()}"
    if how == "symlink":
        mine.symlink_to(victim.path / "canary.txt")
    else:
        os.link(victim.path / "canary.txt", mine)
        victim = Victim(victim.path)  # the link count moved; nothing else may
    with pytest.raises(SourceError, match="not a part of this download") as e:
        stage_file(_Bytes(data), f, staging, FAST, FetchStats())
    assert str(mine) in str(e.value)
    victim.assert_untouched()
    assert not staging.is_staged(f)


def test_a_dead_owners_part_that_is_a_link_is_never_adopted(tmp_path):
    """A dead process's part is adopted (renamed to ours, then appended to): one that is
    a symlink is left where it is, and the download starts afresh."""
    victim, staging, data, f = _victim_and_staging(tmp_path)
    planted = staging.root / f"{staging._part_prefix(f)}{_dead_pid()}.1"
    planted.symlink_to(victim.path / "canary.txt")
    path = stage_file(_Bytes(data), f, staging, FAST, FetchStats())
    assert path.read_bytes() == data and staging.is_staged(f)
    assert planted.is_symlink()
    victim.assert_untouched()
    # A staged copy is a regular file only: a link in its place is not "staged".
    staging.path(f).unlink()
    staging.path(f).symlink_to(victim.path / "canary.txt")
    assert not staging.is_staged(f)
    victim.assert_untouched()
