# ruff: noqa: F811 - pytest fixtures imported from tests.helpers / tests.servers are parameters
"""Publishing a built cache (hf_pipeline.publish.upload, hf_pipeline.publish.find) to the real
fake-gcs-server and to the FakeHub: what lands where, in which order, idempotence,
resume, ``--status URL`` and the script's exit codes."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dist.layout import marker_name
from hf_pipeline.cache.layout import STAGES
from hf_pipeline.errors import CacheFormatError, SourceError
from hf_pipeline.publish.find import find_published, list_published
from hf_pipeline.publish.manifest import (
    MANIFEST_NAME,
    MANIFEST_VERSION,
    Manifest,
    ManifestEntry,
    bytes_digests,
    file_digests,
    same_content,
)
from hf_pipeline.publish.upload import publish_cache
from hf_pipeline.stores import open_store, parse_location
from hf_pipeline.stores.remote_file import RemoteFile
from hf_pipeline.stores.staging import checksum_of
from tests.conftest import PYTHON, REPO, script_env
from tests.helpers.publishing import (  # noqa: F401
    HUB_REPO,
    config,
    gcs_store,
    hub_store,
)
from tests.servers import gcs_fs

pytestmark = pytest.mark.remote


def _listed(result) -> list[str]:
    """Every file the source cache's markers list (cache-relative)."""
    from dist.markers import read_json

    out = []
    for stage in STAGES:
        marker = read_json(Path(result.cache_dir) / marker_name(stage))
        out.extend(f["path"] for f in marker["files"])
    return sorted(out)


# ------------------------------------------------------------------- unit


def test_parse_location():
    gs = parse_location("gs://bucket/some/prefix/")
    assert (gs.kind, gs.path, gs.url) == ("gcs", "bucket/some/prefix", "gs://bucket/some/prefix")
    assert (
        gs.cache_url("demo-ab", "converted.json")
        == "gs://bucket/some/prefix/demo-ab/converted.json"
    )
    hub = parse_location("hf://datasets/org/repo@dev%2Fx/caches")
    assert (hub.kind, hub.repo_id, hub.revision, hub.path) == ("hub", "org/repo", "dev/x", "caches")
    assert parse_location("hf://datasets/org/repo").revision == "main"
    for bad in ("s3://b/p", "gs://", "hf://models/org/repo", "hf://datasets/org", "gs://b/*.x"):
        with pytest.raises(SourceError, match="must look like gs://") as info:
            parse_location(bad)
        # the URL as given (a tester: `gs://` was named `gs:`)
        assert str(info.value).startswith(f"{bad}: "), str(info.value)


def test_publish_schemes_are_the_store_kinds():
    """config checks build.pull_from against PUBLISH_SCHEMES before any store module is
    imported: a kind of store added in hf_pipeline/stores must be listed there too."""
    from hf_pipeline.config import PUBLISH_SCHEMES
    from hf_pipeline.stores.base import publish_schemes

    assert sorted(PUBLISH_SCHEMES) == sorted(publish_schemes())


def test_manifest_golden():
    """Format version 1 as written by this code: it must keep parsing (a published cache
    outlives the hf_pipeline that published it)."""
    golden = {
        "version": 1,
        "name": "demo-0123456789abcdef",
        "fingerprint": "0123456789abcdef",
        "stages": ["converted", "filtered"],
        "rows": 2929,
        "published_at": 1700000000.5,
        "host": "builder-0",
        "bytes": 12,
        "files": {
            "converted.00aa/rows/data.arrow": {
                "size": 10,
                "crc32c": "AAAAAA==",
                "sha256": "ab" * 32,
            },
            "filtered.00bb/report.json": {"size": 2, "crc32c": "BBBBBB=="},
        },
    }
    m = Manifest.from_dict(golden)
    assert MANIFEST_VERSION == 1
    assert m.rows == 2929 and m.total_bytes == 12 and m.stages == ("converted", "filtered")
    assert m.files["filtered.00bb/report.json"] == ManifestEntry(size=2, crc32c="BBBBBB==")
    assert json.loads(m.to_bytes()) == golden
    with pytest.raises(ValueError, match="version 2"):
        Manifest.from_dict({**golden, "version": 2})
    with pytest.raises(KeyError):
        Manifest.from_dict({k: v for k, v in golden.items() if k != "files"})


def test_digests_use_the_stores_encodings(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 40000)  # > one read chunk
    got = file_digests(p, sha256=True)
    assert got.size == p.stat().st_size
    assert got.crc32c == checksum_of(p, "crc32c")  # GCS's base64 big-endian crc32c
    assert got.sha256 == checksum_of(p, "sha256")  # the Hub's LFS oid
    assert bytes_digests(p.read_bytes(), sha256=True) == got
    assert file_digests(p).sha256 == ""
    # "Already there?" through whichever checksum the store publishes, file or bytes.
    for kind in ("crc32c", "sha256", "md5", "gitsha1"):
        remote = RemoteFile(
            name="f.bin", url="x", size=got.size, checksum=f"{kind}:{checksum_of(p, kind)}"
        )
        assert same_content(remote, got, p) and same_content(remote, got, p.read_bytes()), kind
        other = dataclasses.replace(remote, checksum=f"{kind}:AAAA")
        assert not same_content(other, got, p) and not same_content(other, got, p.read_bytes())
    assert not same_content(dataclasses.replace(remote, size=1), got, p)
    assert not same_content(dataclasses.replace(remote, checksum=""), got, p)  # no checksum
    assert not same_content(None, got, p)


# ------------------------------------------------------------------- GCS


def test_publish_gcs_data_first_markers_last_idempotent_resumable(source_cache, gcs_store, caplog):
    server, url = gcs_store
    result = source_cache.result
    cfg = source_cache.cfg
    name = Path(result.cache_dir).name
    listed = _listed(result)
    report = publish_cache(result.cache_dir, result.fingerprint, url, data_config=cfg.data)
    assert report.state == "published"
    assert report.uploaded_files == len(listed) + 1 + len(STAGES) == report.files
    assert report.rows == result.report["rows_out"]

    # Exactly the markers, the manifest and the listed files, at their cache paths.
    fs = gcs_fs(server)
    prefix = f"{url[5:]}/{name}"
    remote = sorted(p[len(prefix) + 1 :] for p in fs.find(prefix))
    assert remote == sorted([*listed, MANIFEST_NAME, *map(marker_name, STAGES)])
    for rel in listed:
        assert fs.cat_file(f"{prefix}/{rel}") == (Path(result.cache_dir) / rel).read_bytes()
    for stage in STAGES:
        assert (
            fs.cat_file(f"{prefix}/{marker_name(stage)}")
            == (Path(result.cache_dir) / marker_name(stage)).read_bytes()
        )

    # Order: every data file before the manifest, the manifest before the markers,
    # converted.json before filtered.json (the last one makes the folder a cache). A GCS
    # generation is the object's creation time in microseconds.
    def created(rel: str) -> int:
        return int(fs.info(f"{prefix}/{rel}")["generation"])

    assert (
        max(created(rel) for rel in listed)
        < created(MANIFEST_NAME)
        < created(marker_name("converted"))
        < created(marker_name("filtered"))
    )

    # Idempotent: a second run uploads nothing.
    again = publish_cache(result.cache_dir, result.fingerprint, url, data_config=cfg.data)
    assert (again.state, again.uploaded_files, again.skipped_files) == (
        "unchanged",
        0,
        report.files,
    )

    # An interrupted upload (a data file and the last marker missing) is not a cache...
    store = open_store(url, data_config=cfg.data)
    fs.rm(f"{prefix}/{listed[0]}")
    fs.rm(f"{prefix}/{marker_name('filtered')}")
    cache, why = find_published(
        store, name, result.fingerprint, STAGES, meta_dir=Path(cfg.cache_root) / "m1"
    )
    assert cache is None and "filtered.json" in why
    [status] = list_published(store, STAGES)
    assert status.state == "incomplete" and "filtered.json" in status.problem
    # ... and resumes: exactly what is missing goes up again.
    resumed = publish_cache(result.cache_dir, result.fingerprint, url, data_config=cfg.data)
    assert resumed.uploaded_files == 2 and resumed.state == "published"
    assert resumed.uploaded_bytes == (Path(result.cache_dir) / listed[0]).stat().st_size + len(
        (Path(result.cache_dir) / marker_name("filtered")).read_bytes()
    )
    [status] = list_published(store, STAGES)
    assert (status.state, status.fingerprint, status.rows) == (
        "complete",
        result.fingerprint,
        result.report["rows_out"],
    )
    assert status.size_bytes == sum((Path(result.cache_dir) / r).stat().st_size for r in listed)
    # A published file changed in the store: publishing the same build again repairs
    # it, and says so (naming the file), rather than looking like a plain resume.
    victim = f"{prefix}/{listed[-1]}"
    body = bytearray(fs.cat_file(victim))
    body[len(body) // 2] ^= 0xFF
    fs.pipe_file(victim, bytes(body))
    with caplog.at_level("WARNING", logger="hf_pipeline"):
        repaired = publish_cache(result.cache_dir, result.fingerprint, url, data_config=cfg.data)
    assert repaired.uploaded_files == 1
    assert fs.cat_file(victim) == (Path(result.cache_dir) / listed[-1]).read_bytes()
    [said] = [r.getMessage() for r in caplog.records if "differ from this cache" in r.getMessage()]
    assert listed[-1] in said and "changed or damaged in the store" in said
    fs.pipe_file(f"{url[5:]}/notes/readme.txt", b"not a cache")  # other folders: not listed
    assert [s.name for s in list_published(store, STAGES)] == [name]


def test_publish_refuses_a_damaged_local_cache(source_cache, gcs_store, tmp_path):
    server, url = gcs_store
    copy = tmp_path / Path(source_cache.result.cache_dir).name
    shutil.copytree(source_cache.result.cache_dir, copy)
    victim = copy / _listed(source_cache.result)[0]
    with open(victim, "r+b") as fh:
        fh.seek(10)
        fh.write(b"\xff\xfe")  # same size, other bytes in the first MiB
    with pytest.raises(CacheFormatError, match="checksum mismatch"):
        publish_cache(copy, source_cache.result.fingerprint, url, data_config=source_cache.cfg.data)
    assert gcs_fs(server).find(url[5:]) == []  # nothing uploaded


@pytest.mark.slow
def test_publish_leaves_another_build_of_the_fingerprint_alone(source_cache, gcs_store, tmp_path):
    """A complete cache of the same fingerprint published by another build stands."""
    from hf_pipeline.build.prepare import prepare_cache

    server, url = gcs_store
    result = source_cache.result
    publish_cache(result.cache_dir, result.fingerprint, url, data_config=source_cache.cfg.data)
    fs = gcs_fs(server)
    before = {p: fs.info(p)["generation"] for p in fs.find(url[5:])}
    # The same inputs built again elsewhere: same fingerprint, other lease ids.
    other = prepare_cache(config(source_cache.data, tmp_path / "other"), progress=False)
    assert other.fingerprint == result.fingerprint and other.stage_dirs != result.stage_dirs
    report = publish_cache(
        other.cache_dir, other.fingerprint, url, data_config=source_cache.cfg.data
    )
    assert report.state == "already_published" and report.uploaded_files == 0
    assert {p: fs.info(p)["generation"] for p in fs.find(url[5:])} == before


# ------------------------------------------------------------------- Hub


def test_publish_hub_one_commit_idempotent(source_cache, hub_store):
    hub, url = hub_store
    result = source_cache.result
    cfg = source_cache.cfg
    name = Path(result.cache_dir).name
    report = publish_cache(result.cache_dir, result.fingerprint, url, data_config=cfg.data)
    assert report.state == "published"
    assert hub.count("/commit/main", method="POST") == 1  # everything in one commit
    files = hub.files(HUB_REPO)
    listed = _listed(result)
    assert sorted(p for p in files if p.startswith(f"caches/{name}/")) == sorted(
        f"caches/{name}/{r}" for r in [*listed, MANIFEST_NAME, *map(marker_name, STAGES)]
    )
    for rel in [*listed, *map(marker_name, STAGES)]:
        assert files[f"caches/{name}/{rel}"] == (Path(result.cache_dir) / rel).read_bytes()
    manifest = Manifest.from_dict(json.loads(files[f"caches/{name}/{MANIFEST_NAME}"]))
    assert all(e.sha256 for e in manifest.files.values())  # the Hub's own checksum kind

    again = publish_cache(result.cache_dir, result.fingerprint, url, data_config=cfg.data)
    assert (again.state, again.uploaded_files) == ("unchanged", 0)
    assert hub.count("/commit/main", method="POST") == 1  # no second commit
    assert hub.count("/_lfs/", method="PUT") == len([r for r in listed if r.endswith(".arrow")])
    [status] = list_published(open_store(url, data_config=cfg.data), STAGES)
    assert (status.name, status.state, status.rows) == (name, "complete", result.report["rows_out"])


# ------------------------------------------------------------------- the script


@pytest.mark.slow
def test_script_publish_status_and_bad_url(source_cache, gcs_store):
    server, url = gcs_store
    result = source_cache.result
    env = script_env(STORAGE_EMULATOR_HOST=server, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    base = [
        PYTHON,
        str(REPO / "scripts/prebuild_cache.py"),
        "-q",
        "--set",
        f"data.shards={source_cache.data}",
        "--cache-dir",
        str(Path(result.cache_dir).parent),
    ]
    from tests.conftest import SMALL_DEMO

    for item in SMALL_DEMO:
        base += ["--set", item]
    bad = subprocess.run(
        [*base, "--publish", "s3://nope/x"], env=env, capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 2 and "s3://nope/x" in bad.stderr and "gs://" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1

    pub = subprocess.run(
        [*base, "--publish", url, "--json", "-"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pub.returncode == 0, pub.stderr[-3000:]
    summary = json.loads(pub.stdout)  # `--json -`: the JSON alone, the human lines on stderr
    assert summary["fingerprint"] == result.fingerprint and not summary["built"]
    assert summary["publish"]["state"] == "published"
    assert f"published   {url}/{Path(result.cache_dir).name}" in pub.stderr

    # The published cache folder itself given as the location: refused, nothing uploaded
    # (it made <folder>/<folder>/ and uploaded everything again).
    folder = f"{url}/{Path(result.cache_dir).name}"
    again = subprocess.run(
        [*base, "--publish", folder], env=env, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 2, again.stderr[-3000:]
    assert again.stderr.strip().splitlines() == [
        f"error: {folder}: is a published cache folder (its manifest.json is there): "
        f"publish to its parent location {url}"
    ], again.stderr[-3000:]
    nested = f"{folder}/{Path(result.cache_dir).name}"[len("gs://") :]
    assert not gcs_fs(server).exists(nested)

    status = subprocess.run(
        [*base, "--status", url], env=env, capture_output=True, text=True, timeout=300
    )
    assert status.returncode == 0, status.stderr[-3000:]
    line = next(x for x in status.stdout.splitlines() if x.startswith(Path(result.cache_dir).name))
    assert (
        result.fingerprint in line and "complete" in line and str(result.report["rows_out"]) in line
    )


@pytest.mark.slow
def test_a_bucket_that_does_not_exist_is_named_before_any_build(source_cache, gcs_store, tmp_path):
    """`--status` said "no published caches" (exit 0), and `--publish` built the whole
    cache, then failed on gcsfs's "FileNotFoundError: b/<bucket>/o"; a pull said the same."""
    from tests.conftest import SMALL_DEMO

    server, _ = gcs_store
    env = script_env(STORAGE_EMULATOR_HOST=server, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    nowhere = "gs://no-such-bucket-here/caches"
    cache = tmp_path / "fresh"
    base = [PYTHON, str(REPO / "scripts/prebuild_cache.py"), "-q", "--cache-dir", str(cache),
            "--set", f"data.shards={source_cache.data}", *[a for o in SMALL_DEMO for a in ("--set", o)]]  # fmt: skip
    for extra, extra_env in (
        (["--status", nowhere], {}),
        (["--publish", nowhere], {}),
        ([], {"HF_PIPELINE_PULL_FROM": nowhere}),
    ):
        p = subprocess.run([*base, *extra], env={**env, **extra_env}, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
        assert p.returncode == 2, (extra, extra_env, p.stderr[-2000:])
        (line,) = p.stderr.strip().splitlines()
        assert line == f"error: {nowhere}: no such bucket gs://no-such-bucket-here", line
        assert not list(cache.glob("demo-*/converted.json"))  # nothing was built


@pytest.mark.slow
def test_a_published_manifest_that_is_not_json_is_said_so(source_cache, gcs_store):
    """Was "malformed manifest (TypeError: manifest must be a JSON object, got NoneType)"."""
    server, url = gcs_store
    result = source_cache.result
    store = open_store(url, data_config=source_cache.cfg.data)
    publish_cache(result.cache_dir, result.fingerprint, url, data_config=source_cache.cfg.data)
    gcs_fs(server).pipe_file(f"{url[5:]}/{Path(result.cache_dir).name}/{MANIFEST_NAME}", b"{nope")
    [status] = list_published(store, STAGES)
    assert status.state == "damaged"
    assert status.problem.endswith(f"{MANIFEST_NAME}: is not valid JSON"), status.problem


def test_a_published_file_changed_in_place_is_found_by_its_listed_checksum(
    source_cache, gcs_store, tmp_path
):
    """One byte flipped in a published data file (same size): `--status` said
    "complete" and a publish from another build "already published; left as it is"
    (exit 0), while every pull was refused. The listing's crc32c finds it."""
    server, url = gcs_store
    result, cfg = source_cache.result, source_cache.cfg
    publish_cache(result.cache_dir, result.fingerprint, url, data_config=cfg.data)
    rel = _listed(result)[0]
    path = f"{url[5:]}/{Path(result.cache_dir).name}/{rel}"
    fs = gcs_fs(server)
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))
    [status] = list_published(open_store(url, data_config=cfg.data), STAGES)
    assert status.state == "damaged" and rel in status.problem and "crc32c" in status.problem
    # Another build of the fingerprint (its markers differ) meets it: refused, not kept.
    other = tmp_path / Path(result.cache_dir).name
    shutil.copytree(result.cache_dir, other)
    marker = other / marker_name(STAGES[-1])
    marker.write_text(marker.read_text().replace('"host"', '"host" ', 1))
    with pytest.raises(CacheFormatError, match="publish again"):
        publish_cache(other, result.fingerprint, url, data_config=cfg.data)


# ------------------------------------------------------------------- hostile JSON


def _script(source_cache, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    from tests.conftest import SMALL_DEMO

    cmd = [PYTHON, str(REPO / "scripts/prebuild_cache.py"), "-q",
           "--set", f"data.shards={source_cache.data}",
           *[a for o in SMALL_DEMO for a in ("--set", o)], *args]  # fmt: skip
    return subprocess.run(cmd, env=script_env(**env), capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_status_lists_every_cache_when_one_holds_deeply_nested_json(
    source_cache, gcs_store, tmp_path
):
    """Issue 23, item 3: a published marker nested 100000 deep made `--status URL` die
    of a RecursionError traceback (exit 1), hiding every other cache there; a pull of it
    did the same. Now: that cache is "damaged" (naming the file), the others are listed,
    and a pull of it is one line, exit 2."""
    server, url = gcs_store
    result = source_cache.result
    publish_cache(result.cache_dir, result.fingerprint, url, data_config=source_cache.cfg.data)
    fs = gcs_fs(server)
    good = Path(result.cache_dir).name
    bad = f"{good.rsplit('-', 1)[0]}-{'0' * 16}"
    deep = b"[" * 100_000 + b"]" * 100_000
    for stage in STAGES:
        fs.pipe_file(f"{url[5:]}/{bad}/{marker_name(stage)}", deep)
    env = {"STORAGE_EMULATOR_HOST": server, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    status = _script(source_cache, "--status", url, env=env)
    assert status.returncode == 0, status.stderr[-3000:]
    lines = status.stdout.splitlines()
    assert any(x.startswith(good) and " complete " in x for x in lines), lines
    i = next(i for i, x in enumerate(lines) if x.startswith(bad))
    assert " damaged " in lines[i], lines
    assert f"{url}/{bad}/converted.json: nested deeper than 64 levels" in lines[i + 1], lines

    # The good cache's manifest nested as deep: its pull is one line, exit 2.
    fs.pipe_file(f"{url[5:]}/{good}/{MANIFEST_NAME}", deep)
    root = tmp_path / "cache"
    pull = _script(source_cache, "--cache-dir", str(root), "--set", f"build.pull_from={url}",
                   env=env)  # fmt: skip
    assert pull.returncode == 2, pull.stderr[-3000:]
    (line,) = pull.stderr.strip().splitlines()
    assert line == f"error: {url}/{good}/{MANIFEST_NAME}: nested deeper than 64 levels", line
    assert not list(root.glob("*/converted.json"))  # nothing pulled or built


def test_an_oversized_published_manifest_is_refused_without_downloading_it(source_cache, gcs_store):
    """Issue 23, item 3: a valid 500 MB manifest took 6.4 GB of memory and was accepted.
    Now a manifest (or marker) over MAX_JSON_BYTES is refused by its listed size, before
    a byte of it is downloaded."""
    from dist.markers import MAX_JSON_BYTES
    from hf_pipeline.stores.fetch_stats import FetchStats

    server, url = gcs_store
    result, cfg = source_cache.result, source_cache.cfg
    publish_cache(result.cache_dir, result.fingerprint, url, data_config=cfg.data)
    name = Path(result.cache_dir).name
    fs = gcs_fs(server)
    obj = f"{url[5:]}/{name}/{MANIFEST_NAME}"
    manifest = fs.cat_file(obj)
    fs.pipe_file(obj, manifest + b" " * (MAX_JSON_BYTES + 1 - len(manifest)))  # still valid
    stats = FetchStats()
    with pytest.raises(CacheFormatError, match=f"{MANIFEST_NAME}: is {MAX_JSON_BYTES + 1} bytes"):
        find_published(
            open_store(url, data_config=cfg.data), name, result.fingerprint, STAGES,
            meta_dir=Path(cfg.cache_root) / "oversized", stats=stats,
        )  # fmt: skip
    assert stats.bytes < 1 << 20  # the markers only


def test_a_manifest_with_an_unsafe_path_or_name_is_malformed():
    from dist.safepath import UnsafePathError

    good = json.loads(
        Manifest(
            name="demo-0123456789abcdef", fingerprint="0123456789abcdef", stages=("converted",),
            rows=1, published_at=0.0, host="h",
            files={"converted.00aa/a.arrow": ManifestEntry(size=1, crc32c="AAAAAA==")},
        ).to_bytes()
    )  # fmt: skip
    assert Manifest.from_dict(good).files
    for path in ("converted.00aa//etc/x", "/etc/x", "../x", "a/./b", "a\nb", "a\\b", "a/"):
        with pytest.raises(UnsafePathError):
            Manifest.from_dict({**good, "files": {path: {"size": 1, "crc32c": "AAAAAA=="}}})
    for name in ("a/b", "..", "demo\nERROR forged-0123456789abcdef", "a\x00b"):
        with pytest.raises(UnsafePathError):
            Manifest.from_dict({**good, "name": name})
