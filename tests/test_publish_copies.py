# ruff: noqa: F811 - pytest fixtures imported from tests.helpers / tests.servers are parameters
"""Publishing a cache beside another publication that holds some of its files (a re-embed:
the same latents and captions, new embeddings): those files are made in the store, not
uploaded (hf_pipeline.publish.copies), on the real fake-gcs-server (through a proxy that
counts what the client sends) and on the FakeHub (whose LFS batch answer is what dedups);
every copy is verified, a forged or damaged source is never copied, and each publication
pulls bit-identical by itself."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
from pathlib import Path

import pytest

from dist.layout import marker_name
from dist.markers import read_json
from hf_pipeline.build.prepare import prepare_cache
from hf_pipeline.cache.layout import STAGES
from hf_pipeline.publish.manifest import MANIFEST_NAME, file_digests
from hf_pipeline.publish.upload import publish_cache
from hf_pipeline.stores import open_store
from hf_pipeline.stores.base import Upload
from tests.conftest import PYTHON, REPO, SMALL_DEMO, copy_shared_root, script_env
from tests.helpers.publishing import (  # noqa: F401
    HUB_REPO,
    config,
    gcs_store,
    hub_store,
    tree,
)
from tests.servers import gcs_fs
from tests.servers.proxy import FaultProxy

pytestmark = pytest.mark.remote

#: The re-embed: another encoder.max_length, so another fingerprint, the same latents.
REEMBED = "encoder.max_length=32"


@pytest.fixture(scope="module")
def reembedded(source_cache, tmp_path_factory):
    """The source cache's inputs embedded again with :data:`REEMBED`, in a copy of its
    root (its stored units reused: only the embeddings are computed)."""
    root = tmp_path_factory.mktemp("reembed")
    copy_shared_root(Path(source_cache.result.cache_dir).parent, root)
    return prepare_cache(config(source_cache.data, root, REEMBED), progress=False)


def _files(result) -> dict[str, tuple[int, str]]:
    """``{path: (size, whole_checksum)}`` of every file a cache's markers list."""
    out = {}
    for stage in STAGES:
        for f in read_json(Path(result.cache_dir) / marker_name(stage))["files"]:
            out[f["path"]] = (f["size"], f["whole_checksum"])
    return out


def _shared(a, b) -> dict[str, int]:
    """``{path in b: size}`` of b's files that a lists with the same size and checksum."""
    have = set(_files(a).values())
    return {p: size for p, (size, whole) in _files(b).items() if (size, whole) in have}


def _tail_bytes(result) -> int:
    """Bytes of a cache's markers (the manifest's are added from the store)."""
    return sum(len((Path(result.cache_dir) / marker_name(s)).read_bytes()) for s in STAGES)


def _pull(source_cache, root: Path, url: str, *extra: str):
    return prepare_cache(
        config(source_cache.data, root, f"build.pull_from={url}", *extra), progress=False
    )


# ------------------------------------------------------------------- GCS


def test_a_reembedded_cache_copies_in_the_store_what_a_publication_holds(
    source_cache, reembedded, gcs_store, monkeypatch, tmp_path
):
    """The outside tester's case: the second publish uploaded every file again ("uploaded
    18 of 18 files ... (0 already there)") and the bucket held the latents twice. Now the
    files the first publication holds are made by a server-side copy (no byte through
    the host), the rest uploaded; both publications pull bit-identical, the second one
    with the first removed."""
    server, url = gcs_store
    a, b = source_cache.result, reembedded
    data_cfg = source_cache.cfg.data
    assert a.fingerprint != b.fingerprint
    shared = _shared(a, b)
    assert len(shared) >= 4 and not any("/embeddings/" in p for p in shared), shared
    first = publish_cache(a.cache_dir, a.fingerprint, url, data_config=data_cfg)
    assert (first.copied_files, first.copied_bytes) == (0, 0)

    with FaultProxy(server) as proxy:  # every request of the second publish goes through it
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        report = publish_cache(b.cache_dir, b.fingerprint, url, data_config=data_cfg)
        sent = proxy.request_bytes()
        rewrites = proxy.count("/rewriteTo/", "POST", media_only=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server)
    assert report.state == "published"
    assert (report.copied_files, report.copied_bytes) == (len(shared), sum(shared.values()))
    assert report.skipped_files == 0
    assert report.uploaded_files + report.copied_files == report.files
    fs = gcs_fs(server)
    prefix = f"{url[5:]}/{Path(b.cache_dir).name}"
    manifest_bytes = fs.info(f"{prefix}/{MANIFEST_NAME}")["size"]
    new = {p: s for p, (s, _) in _files(b).items() if p not in shared}
    expected = sum(new.values()) + manifest_bytes + _tail_bytes(b)
    assert report.uploaded_bytes == expected
    # What the client sent: the new files and the requests' own bytes, none of the shared
    # ones (they are 90% of the cache).
    assert expected <= sent < expected + (64 << 10), (sent, expected, sum(shared.values()))
    assert rewrites == len(shared)
    for rel in _files(b):
        assert fs.cat_file(f"{prefix}/{rel}") == (Path(b.cache_dir) / rel).read_bytes(), rel

    # Both pull bit-identical; the second one stands alone (the first removed).
    got_a = _pull(source_cache, tmp_path / "pull-a", url)
    assert got_a.pulled and tree(got_a) == tree(a)
    fs.rm(f"{url[5:]}/{Path(a.cache_dir).name}", recursive=True)
    got_b = _pull(source_cache, tmp_path / "pull-b", url, REEMBED)
    assert got_b.pulled and got_b.fingerprint == b.fingerprint and tree(got_b) == tree(b)


def _forge_same_crc32c(data: bytes) -> bytes:
    """Other bytes of the same size and the same crc32c (CRC is linear: flip a set of the
    bits of 8 bytes in the middle whose effects on the CRC cancel out)."""
    import google_crc32c

    base = google_crc32c.value(data)
    at = len(data) // 2
    basis: dict[int, tuple[int, int]] = {}  # leading bit -> (crc effect, bits flipped)
    for bit in range(64):
        flipped = bytearray(data)
        flipped[at + bit // 8] ^= 1 << (bit % 8)
        effect, combo = google_crc32c.value(bytes(flipped)) ^ base, 1 << bit
        while effect:
            top = effect.bit_length() - 1
            if top not in basis:
                basis[top] = (effect, combo)
                break
            effect, combo = effect ^ basis[top][0], combo ^ basis[top][1]
        if not effect:  # these flips change no CRC bit
            out = bytearray(data)
            for b in range(64):
                if combo >> b & 1:
                    out[at + b // 8] ^= 1 << (b % 8)
            assert bytes(out) != data and google_crc32c.value(bytes(out)) == base
            return bytes(out)
    raise AssertionError("64 bits always hold a combination with no CRC effect")


def test_a_forged_or_damaged_copy_source_is_never_copied(
    source_cache, reembedded, gcs_store, tmp_path, caplog
):
    """A publication whose object was replaced by other bytes of the same size and crc32c
    (the listing and its manifest cannot tell) is not copied from: the md5 the store
    lists is not the local file's, so that file is uploaded, with a warning naming it.
    A publication whose manifest claims another checksum than the store's is damaged and
    no source at all. Either way the new publication holds the local bytes."""
    server, url = gcs_store
    a, b = source_cache.result, reembedded
    data_cfg = source_cache.cfg.data
    fs = gcs_fs(server)
    shared = _shared(a, b)
    victim = max(shared, key=lambda p: shared[p])  # a latents file
    mine = Path(b.cache_dir) / victim
    # b's path of a's file: the stage folders' lease ids differ, the rest is the same.
    theirs = next(p for p in _files(a) if p.split("/", 1)[1] == victim.split("/", 1)[1])

    # 1. Forged bytes, same size and crc32c, in the first publication.
    publish_cache(a.cache_dir, a.fingerprint, url, data_config=data_cfg)
    obj = f"{url[5:]}/{Path(a.cache_dir).name}/{theirs}"
    real = fs.cat_file(obj)
    fs.pipe_file(obj, _forge_same_crc32c(real))
    assert fs.info(obj)["crc32c"] == file_digests(mine).crc32c
    with caplog.at_level(logging.WARNING, logger="hf_pipeline"):
        report = publish_cache(b.cache_dir, b.fingerprint, url, data_config=data_cfg)
    assert report.copied_files == len(shared) - 1
    assert report.uploaded_bytes >= shared[victim]
    prefix = f"{url[5:]}/{Path(b.cache_dir).name}"
    assert fs.cat_file(f"{prefix}/{victim}") == mine.read_bytes()
    [said] = [r.getMessage() for r in caplog.records if "not copied" in r.getMessage()]
    assert victim in said and "md5" in said, said

    # 2. A manifest that claims another crc32c for a file: that publication is damaged,
    # nothing is copied from it (said), everything is uploaded.
    url2 = url + "-2"
    publish_cache(a.cache_dir, a.fingerprint, url2, data_config=data_cfg)
    manifest = f"{url2[5:]}/{Path(a.cache_dir).name}/{MANIFEST_NAME}"
    m = json.loads(fs.cat_file(manifest))
    assert m["files"][theirs]["crc32c"] != "AAAAAA=="
    m["files"][theirs]["crc32c"] = "AAAAAA=="
    fs.pipe_file(manifest, json.dumps(m).encode())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_pipeline"):
        report = publish_cache(b.cache_dir, b.fingerprint, url2, data_config=data_cfg)
    assert report.copied_files == 0 and report.uploaded_files == report.files
    said = [r.getMessage() for r in caplog.records if "not a source of copies" in r.getMessage()]
    assert len(said) == 1 and theirs in said[0] and "crc32c" in said[0], said
    got = _pull(source_cache, tmp_path / "pull", url2, REEMBED)
    assert got.pulled and tree(got) == tree(b)


def test_a_copy_that_does_not_verify_is_uploaded_instead(source_cache, gcs_store, caplog):
    """The store's copy is checked as an upload is (size, crc32c, and the md5 of the
    local file): a source replaced since it was listed (its generation gone) and a
    listing that lies (another object's bytes behind the listed md5) both end in an
    upload of the local bytes, with a warning; never in a wrong object."""
    server, url = gcs_store
    a = source_cache.result
    publish_cache(a.cache_dir, a.fingerprint, url, data_config=source_cache.cfg.data)
    store = open_store(url, data_config=source_cache.cfg.data)
    fs = gcs_fs(server)
    name = Path(a.cache_dir).name
    listing = store.list_files(name)
    rel = max((p for p in _files(a)), key=lambda p: _files(a)[p][0])
    local = Path(a.cache_dir) / rel
    listed = listing[rel]
    assert listed.etag.startswith("md5:") and listed.version
    other = bytearray(local.read_bytes())
    other[len(other) // 2] ^= 0xFF
    fs.pipe_file(f"{url[5:]}/{name}/{rel}", bytes(other))  # a new generation, other bytes
    now = store.source.describe(fs.info(f"{url[5:]}/{name}/{rel}", refresh=True))
    entry = file_digests(local)
    for case, source in (
        ("replaced since listed", listed),  # its listed generation is gone
        ("a lying listing", dataclasses.replace(listed, version=now.version)),
    ):
        caplog.clear()
        dest = f"dest-{case.replace(' ', '-')}"
        with caplog.at_level(logging.WARNING, logger="hf_pipeline"):
            copied = store.upload(
                dest, [Upload(rel=rel, local=local, entry=entry, copy_from=source)], [], workers=1
            )
        assert copied == set(), case
        assert fs.cat_file(f"{url[5:]}/{dest}/{rel}") == local.read_bytes(), case
        [said] = [r.getMessage() for r in caplog.records if "not copied" in r.getMessage()]
        assert rel in said and "uploaded instead" in said, (case, said)


# ------------------------------------------------------------------- Hub


def test_the_hub_keeps_one_copy_of_a_file_a_publication_holds(
    source_cache, reembedded, hub_store, tmp_path
):
    """On the Hub an LFS file is stored by its sha256 once per repository: the LFS batch
    endpoint answers "already there" for the shared files and huggingface_hub sends no
    byte of them (only the new files' PUTs); the report counts them as copied in the
    store. The second publication pulls bit-identical."""
    hub, url = hub_store
    a, b = source_cache.result, reembedded
    data_cfg = source_cache.cfg.data
    shared = _shared(a, b)
    publish_cache(a.cache_dir, a.fingerprint, url, data_config=data_cfg)
    puts = hub.count("/_lfs/", method="PUT")
    report = publish_cache(b.cache_dir, b.fingerprint, url, data_config=data_cfg)
    new_lfs = [p for p in _files(b) if p.endswith(".arrow") and p not in shared]
    assert hub.count("/_lfs/", method="PUT") - puts == len(new_lfs)
    assert (report.copied_files, report.copied_bytes) == (len(shared), sum(shared.values()))
    assert report.uploaded_files + report.copied_files == report.files
    files = hub.files(HUB_REPO)
    for rel in _files(b):
        assert (
            files[f"caches/{Path(b.cache_dir).name}/{rel}"]
            == (Path(b.cache_dir) / rel).read_bytes()
        )
    got = _pull(source_cache, tmp_path / "pull", url, REEMBED)
    assert got.pulled and tree(got) == tree(b)


# ------------------------------------------------------------------- the script


@pytest.mark.slow
def test_the_publish_line_and_json_count_the_copies(source_cache, reembedded, gcs_store):
    server, url = gcs_store
    a, b = source_cache.result, reembedded
    publish_cache(a.cache_dir, a.fingerprint, url, data_config=source_cache.cfg.data)
    env = script_env(STORAGE_EMULATOR_HOST=server, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    cmd = [PYTHON, str(REPO / "scripts/prebuild_cache.py"), "-q",
           "--cache-dir", str(Path(b.cache_dir).parent),
           *[x for o in (*SMALL_DEMO, f"data.shards={source_cache.data}", REEMBED)
             for x in ("--set", o)],
           "--publish", url, "--json", "-"]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    n = len(_shared(a, b))
    got = json.loads(p.stdout)["publish"]
    assert (got["copied_files"], got["copied_bytes"]) == (n, sum(_shared(a, b).values()))
    [line] = [x for x in p.stderr.splitlines() if x.startswith("uploaded ")]
    assert f"{n} copied in the store" in line and "0 already there" in line, line
