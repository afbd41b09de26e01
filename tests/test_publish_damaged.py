# ruff: noqa: F811 - pytest fixtures imported from tests.helpers / tests.servers are parameters
"""Publishing a locally damaged cache (hf_pipeline.publish.upload) is refused.

A byte flipped deep inside a file larger than 2 MiB passes the markers' edge checksum
(first and last MiB). Publish computed the manifest's crc32c and the stream index's
block digests from those bytes, so the damage was published as the truth: ``status``
said complete, a stream yielded the damaged latents silently and a pull blamed the
store. Publish now compares the xxh3_128 of the bytes it reads with the marker's
``whole_checksum`` and refuses, before anything makes the destination a cache.
Against the real fake-gcs-server and the local Hub server (publish has no
local-folder destination: ``publish_schemes`` is gs:// and hf://datasets/ only).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from dist.layout import marker_name
from dist.markers import Marker, read_json, write_marker
from hf_pipeline.cache.layout import STAGES
from hf_pipeline.errors import CacheFormatError, SourceError
from hf_pipeline.publish.find import find_published, list_published
from hf_pipeline.publish.upload import publish_cache
from hf_pipeline.stores import open_store
from tests.conftest import PYTHON, REPO, SMALL_DEMO, script_env
from tests.helpers.publishing import HUB_REPO, gcs_store, hub_store  # noqa: F401
from tests.servers import gcs_fs

pytestmark = pytest.mark.remote

_EDGE = 1 << 20  # the markers' edge checksum covers the first and last MiB


def _damaged_copy(source_cache, where: Path) -> tuple[Path, str]:
    """A copy of the source cache (same folder name) with one byte flipped in the middle
    of its largest listed file, beyond its first and last MiB; (copy, that file's path)."""
    copy = where / Path(source_cache.result.cache_dir).name
    shutil.copytree(source_cache.result.cache_dir, copy)
    listed = [f for stage in STAGES for f in read_json(copy / marker_name(stage))["files"]]
    victim = max(listed, key=lambda f: f["size"])
    assert victim["size"] > 2 * _EDGE + 2, victim  # else the edge check would see it
    offset = victim["size"] // 2
    assert _EDGE <= offset < victim["size"] - _EDGE
    with open(copy / victim["path"], "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return copy, victim["path"]


def _published(store, name, fingerprint, meta: Path):
    cache, _ = find_published(store, name, fingerprint, STAGES, meta_dir=meta)
    return cache


def test_a_damaged_local_cache_is_not_published_to_gcs(source_cache, gcs_store, tmp_path):
    server, url = gcs_store
    result, cfg = source_cache.result, source_cache.cfg
    name = Path(result.cache_dir).name
    copy, rel = _damaged_copy(source_cache, tmp_path)

    with pytest.raises(CacheFormatError) as err:
        publish_cache(copy, result.fingerprint, url, data_config=cfg.data)
    # One line naming the local file, the marker that disagrees, and what to run.
    msg = str(err.value)
    assert "\n" not in msg
    assert err.value.path == str(copy / rel)
    assert "xxh3_128" in msg and marker_name(rel.split(".", 1)[0]) in msg
    assert "hf-pipeline verify" in msg and "nothing was uploaded" in msg
    # Nothing at the destination: no file, no cache, so no stream and no pull of it.
    fs = gcs_fs(server)
    assert fs.find(url[5:]) == []
    store = open_store(url, data_config=cfg.data)
    assert list_published(store, STAGES) == []
    assert _published(store, name, result.fingerprint, tmp_path / "m1") is None
    from hf_pipeline.read.stream.source import StreamSource

    with pytest.raises(
        SourceError, match="not a published cache, so not streamed: it does not exist"
    ):
        StreamSource(f"{url}/{name}")

    # A partial upload there (the good cache's data and manifest, no marker: what a
    # killed publish leaves) stays as it is, not complete, and is never completed by the
    # damaged copy.
    publish_cache(result.cache_dir, result.fingerprint, url, data_config=cfg.data)
    prefix = f"{url[5:]}/{name}"
    for stage in STAGES:
        fs.rm(f"{prefix}/{marker_name(stage)}")
    before = {p: fs.info(p)["generation"] for p in fs.find(prefix)}
    with pytest.raises(CacheFormatError, match="hf-pipeline verify"):
        publish_cache(copy, result.fingerprint, url, data_config=cfg.data)
    assert {p: fs.info(p)["generation"] for p in fs.find(prefix)} == before
    [status] = list_published(store, STAGES)
    assert status.state == "incomplete"

    # The good cache (a repaired copy) publishes over it: complete, the good bytes.
    report = publish_cache(result.cache_dir, result.fingerprint, url, data_config=cfg.data)
    assert report.state == "published" and report.uploaded_files == len(STAGES)
    [status] = list_published(store, STAGES)
    assert status.state == "complete"
    assert fs.cat_file(f"{prefix}/{rel}") == (Path(result.cache_dir) / rel).read_bytes()
    # Published and complete now, the damaged copy is still refused (nothing changes).
    before = {p: fs.info(p)["generation"] for p in fs.find(prefix)}
    with pytest.raises(CacheFormatError, match="hf-pipeline verify"):
        publish_cache(copy, result.fingerprint, url, data_config=cfg.data)
    assert {p: fs.info(p)["generation"] for p in fs.find(prefix)} == before


def test_a_damaged_local_cache_is_not_committed_to_the_hub(source_cache, hub_store, tmp_path):
    hub, url = hub_store
    result, cfg = source_cache.result, source_cache.cfg
    copy, rel = _damaged_copy(source_cache, tmp_path)
    with pytest.raises(CacheFormatError, match="hf-pipeline verify") as err:
        publish_cache(copy, result.fingerprint, url, data_config=cfg.data)
    assert err.value.path == str(copy / rel)
    assert hub.count("/commit/main", method="POST") == 0
    assert not [p for p in hub.files(HUB_REPO) if p.startswith("caches/")]
    report = publish_cache(result.cache_dir, result.fingerprint, url, data_config=cfg.data)
    assert report.state == "published"


def test_schema_1_markers_are_published_as_read_and_said_so(
    source_cache, gcs_store, tmp_path, caplog
):
    """Markers without whole-file checksums: nothing to compare with; one log line."""
    _, url = gcs_store
    result, cfg = source_cache.result, source_cache.cfg
    copy = tmp_path / Path(result.cache_dir).name
    shutil.copytree(result.cache_dir, copy)
    for stage in STAGES:
        path = copy / marker_name(stage)
        d = read_json(path)
        d["schema_version"] = 1
        write_marker(path, Marker.from_dict(d))
    with caplog.at_level(logging.INFO, logger="hf_pipeline"):
        report = publish_cache(copy, result.fingerprint, url, data_config=cfg.data)
    assert report.state == "published"
    [said] = [r.getMessage() for r in caplog.records if "no whole-file checksum" in r.getMessage()]
    assert "schema 1" in said and "converted" in said and "hf-pipeline verify" not in said


@pytest.mark.slow
def test_the_script_refuses_a_damaged_cache_with_exit_2(source_cache, gcs_store, tmp_path):
    """`hf-pipeline publish URL --cache-dir COPY` said `[published]`, exit 0."""
    server, url = gcs_store
    copy, rel = _damaged_copy(source_cache, tmp_path)
    p = subprocess.run(
        [PYTHON, "-m", "hf_pipeline", "publish", url, "-q", "--cache-dir", str(tmp_path),
         "--set", f"data.shards={source_cache.data}", *[a for o in SMALL_DEMO for a in ("--set", o)]],
        env=script_env(STORAGE_EMULATOR_HOST=server, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false"),
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-3000:])
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith(f"error: {copy / rel}: ") and "hf-pipeline verify" in line, line
    assert "[published]" not in p.stdout
    assert gcs_fs(server).find(url[5:]) == []
    assert json.loads((copy / marker_name(STAGES[-1])).read_text())["stage"] == STAGES[-1]


@pytest.mark.slow  # builds, verify, clean, publish (~45 s)
def test_the_refusals_advice_followed_as_written_lets_the_publish_succeed(gcs_store, tmp_path):
    """The refusal names what to run: each command it quotes, run exactly as written
    (no flag added; the default cache root is elsewhere, as for a user whose cache is
    not there), then the same publish again: published, with only the damaged part
    built anew. The advice said `hf-pipeline verify` and `hf-pipeline clean` without the
    cache root (they looked at the default root and found nothing) and "build it again",
    which a build of that config did not do (it found the cache: complete by its
    markers)."""
    import re
    import shlex

    server, url = gcs_store
    root = tmp_path / "root"
    env = {k: v for k, v in script_env(
        STORAGE_EMULATOR_HOST=server, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
        HF_HOME=str(tmp_path / "home"),
    ).items() if k != "HF_PIPELINE_CACHE"}  # fmt: skip
    sets = [a for o in [*SMALL_DEMO, "build.part_shards=2"] for a in ("--set", o)]

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [PYTHON, "-m", "hf_pipeline", *argv], env=env, capture_output=True, text=True,
            timeout=600, cwd=tmp_path,
        )  # fmt: skip

    b = run("build", "-q", "--cache-dir", str(root), *sets)
    assert b.returncode == 0, b.stdout + b.stderr
    (cache,) = [p for p in root.iterdir() if not p.name.startswith(".")]
    listed = [f for stage in STAGES for f in read_json(cache / marker_name(stage))["files"]]
    victim = max(listed, key=lambda f: f["size"])
    assert victim["size"] > 2 * _EDGE + 2, victim  # else the edge check would see it
    with open(cache / victim["path"], "r+b") as fh:
        fh.seek(victim["size"] // 2)
        byte = fh.read(1)
        fh.seek(victim["size"] // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))

    publish = ("publish", url, "-q", "--cache-dir", str(root), *sets)
    refused = run(*publish)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    commands = re.findall(r"`([^`]+)`", line)
    assert commands and all(c.startswith("hf-pipeline ") for c in commands), line
    for command in commands:
        done = run(*shlex.split(command)[1:])
        assert done.returncode in (0, 1), (command, done.stdout + done.stderr)
        assert "no such folder" not in done.stderr, (command, done.stderr)
    assert not cache.exists(), f"{line}: the cache is still there"

    again = run(*publish, "--json", str(tmp_path / "publish.json"))
    assert again.returncode == 0, again.stdout + again.stderr
    summary = json.loads((tmp_path / "publish.json").read_text())
    assert summary["publish"]["state"] == "published", summary["publish"]
    reuse = summary["reuse"]
    assert (reuse["parts"], reuse["joins_built"], reuse["joins_reused"]) == (2, 1, 1), reuse
    from hf_pipeline.config import DataConfig

    [status] = list_published(open_store(url, data_config=DataConfig()), STAGES)
    assert (status.name, status.state) == (cache.name, "complete"), status
    ok = run("verify", "--cache-dir", str(root))
    assert ok.returncode == 0 and f"{cache.name}: ok" in ok.stdout, ok.stdout + ok.stderr
