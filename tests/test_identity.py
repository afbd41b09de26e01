"""Content identity of local inputs (hf_pipeline.stores.identity) and its use by the build:
a touched or copied shard with the same bytes finds the same cache; the content index
(``<cache root>/.content-index/``) makes an unchanged start hash nothing, and is read as
hostile input."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import time
from pathlib import Path

import pytest

from dist.checksums import whole_checksum
from hf_pipeline.build.prepare import job_identity, prepare_cache, resolve_inputs
from hf_pipeline.config import load_config
from hf_pipeline.stores.identity import (
    INDEX_DIR,
    INDEX_NAME,
    ContentIndex,
    content_identities,
    stat_key,
)
from hf_pipeline.stores.local import LocalSource
from tests.conftest import ANY_CACHE_SAMPLES_PER_SHARD, SMALL_DEMO
from tests.helpers.damage import flip_middle_bit
from tests.helpers.releases import build_with_release

REPO_ROOT = Path(__file__).resolve().parent.parent
#: The last commit before content identity (fingerprints over mtimes): what "a cache
#: built by an earlier release" is built with.
MTIME_RELEASE = "16502fa8a24f202d3b1e503ddf2fc1d39259f13f"
#: The last commit whose encoder identity named a local model folder by its path and
#: its files' names and sizes (weights rewritten in place kept it).
PATH_MODEL_RELEASE = "e338c67c05a755242d10b5a0eb715a193b4c7431"
_HOUR_NS = 3600 * 10**9


def _data(tmp_path: Path, name: str = "data") -> Path:
    """A small demo dataset of its own, its files' mtimes an hour old (not "racy": an
    index entry of a file hashed within 2 s of its last change is re-checked once)."""
    from hf_pipeline.demo.generate import generate_demo

    demo = generate_demo(
        tmp_path / f"{name}-gen", num_shards=4, samples_per_shard=ANY_CACHE_SAMPLES_PER_SHARD
    )
    out = tmp_path / name
    out.mkdir()
    for p in [*map(Path, demo.shard_paths), Path(demo.metadata_path)]:
        shutil.copy(p, out / p.name)
    _age(out)
    return out


def _age(folder: Path) -> None:
    past = time.time_ns() - _HOUR_NS
    for p in folder.iterdir():
        os.utime(p, ns=(past, past))


def _cfg(root: Path, data: Path, *extra: str):
    return load_config(
        None,
        [
            *SMALL_DEMO,
            f"build.cache_dir={root}",
            f"data.shards={data}",
            f"data.metadata={data / 'coyo11m-meta.parquet'}",
            *extra,
        ],
        environ={},
    )


def _caches(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def _fingerprint(cfg) -> str:
    from dist.env import detect

    return job_identity(cfg, detect(rank=0, world_size=1, local_rank=0, local_world_size=1))[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One cache built from a data folder of its own: ``(config, data, root, result)``."""
    tmp = tmp_path_factory.mktemp("identity")
    data, root = _data(tmp), tmp / "cache"
    cfg = _cfg(root, data)
    res = prepare_cache(cfg, progress=False)
    assert res.built
    h = res.hashing
    assert (h["files"], h["index_hits"], h["hashed_files"]) == (5, 0, 5)
    assert h["hashed_bytes"] == sum(p.stat().st_size for p in data.iterdir())
    assert h["seconds"] > 0 and h["gb_per_s"] > 0
    return cfg, data, root, res


def test_an_unchanged_start_hashes_nothing(built):
    cfg, data, root, first = built
    res = prepare_cache(cfg, progress=False)
    assert not res.built and res.fingerprint == first.fingerprint
    assert res.hashing["index_hits"] == 5
    assert res.hashing["hashed_bytes"] == 0 and res.hashing["hashed_files"] == 0
    assert res.summary()["hashing"]["hashed_bytes"] == 0


def test_touching_every_shard_finds_the_same_cache(built):
    cfg, data, root, first = built
    before = _caches(root)
    shards = sorted(data.glob("*.pt"))
    for p in shards:
        os.utime(p)  # touch: new mtime, same bytes
    res = prepare_cache(cfg, progress=False)
    assert not res.built and res.fingerprint == first.fingerprint
    assert res.cache_dir == first.cache_dir and _caches(root) == before
    # The touched files missed the index and were hashed again; the metadata hit.
    assert res.hashing["hashed_files"] == len(shards) and res.hashing["index_hits"] == 1
    assert res.hashing["hashed_bytes"] == sum(p.stat().st_size for p in shards)
    _age(data)


def test_a_copy_without_mtimes_elsewhere_finds_the_same_cache(built, tmp_path):
    cfg, data, root, first = built
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    for p in data.iterdir():
        shutil.copy(p, copy / p.name)  # shutil.copy keeps no mtime
    assert all((copy / p.name).stat().st_mtime_ns != p.stat().st_mtime_ns for p in data.iterdir())
    res = prepare_cache(_cfg(root, copy), progress=False)
    assert not res.built and res.fingerprint == first.fingerprint
    assert res.cache_dir == first.cache_dir
    assert res.hashing["hashed_files"] == 5  # a new path: hashed once


def test_one_changed_byte_is_a_new_fingerprint(built, tmp_path):
    cfg, data, root, first = built
    copy = tmp_path / "changed"
    shutil.copytree(data, copy)
    shard = sorted(copy.glob("*.pt"))[1]
    original = shard.read_bytes()
    raw = bytearray(original)
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    assert _fingerprint(_cfg(root, copy)) != first.fingerprint
    shard.write_bytes(original)  # the same bytes again (a new mtime): the same cache
    assert _fingerprint(_cfg(root, copy)) == first.fingerprint
    # ... and a changed byte of the metadata is a new fingerprint too.
    meta = copy / "coyo11m-meta.parquet"
    m = bytearray(meta.read_bytes())
    m[100] ^= 0x01
    meta.write_bytes(bytes(m))
    assert _fingerprint(_cfg(root, copy)) != first.fingerprint


# slow: a build by the old release in a fresh interpreter, then three builds here (about a
# third of this module's CPU time); the content index and fingerprints keep fast tests.
@pytest.mark.slow
def test_a_cache_of_the_mtime_release_is_used_not_rebuilt(tmp_path):
    """A cache built by the release before content identity (its fingerprint over
    mtimes) is found and used by an upgrade while the mtimes are unchanged; a touch
    then builds once under the content fingerprint."""
    data, root = _data(tmp_path), tmp_path / "cache"
    args = [*SMALL_DEMO, f"build.cache_dir={root}", f"data.shards={data}",
            f"data.metadata={data / 'coyo11m-meta.parquet'}"]  # fmt: skip
    old_fp, old_dir = build_with_release(MTIME_RELEASE, args, tmp_path)
    cfg = _cfg(root, data)
    res = prepare_cache(cfg, progress=False)
    assert not res.built and res.fingerprint == old_fp and str(res.cache_dir) == old_dir
    assert _caches(root) == [Path(old_dir).name]
    # A touch changes the old identity: built once under the content fingerprint, which
    # a later touch then keeps.
    for p in data.glob("*.pt"):
        os.utime(p)
    again = prepare_cache(cfg, progress=False)
    assert again.built and again.fingerprint != old_fp
    _age(data)
    assert prepare_cache(cfg, progress=False).fingerprint == again.fingerprint


@pytest.mark.slow
def test_a_cache_of_the_path_model_release_is_used_until_the_model_changes(tmp_path):
    """A cache an earlier release built with a local model folder (identified by its
    path, names and sizes) is used by an upgrade, whose identity is the folder's
    bytes; once a file of the folder changed after that build (weights rewritten in
    place, same size, mtime put back), it is not: the embeddings are built again."""
    from hf_pipeline.encoder.model import resolve_encoder_path

    data, root, model = _data(tmp_path), tmp_path / "cache", tmp_path / "model"
    shutil.copytree(resolve_encoder_path("minilm"), model)
    extra = [f"encoder.model={model}"]
    args = [*SMALL_DEMO, f"build.cache_dir={root}", f"data.shards={data}",
            f"data.metadata={data / 'coyo11m-meta.parquet'}", *extra]  # fmt: skip
    old_fp, old_dir = build_with_release(PATH_MODEL_RELEASE, args, tmp_path)
    cfg = _cfg(root, data, *extra)
    res = prepare_cache(cfg, progress=False)
    assert not res.built and res.fingerprint == old_fp and str(res.cache_dir) == old_dir
    weights = model / "model.safetensors"
    flip_middle_bit(weights, 0x01, keep_mtime=True)
    again = prepare_cache(cfg, progress=False)
    assert again.built and again.fingerprint != old_fp


# -- the index


def _files(data: Path):
    return LocalSource(str(data), data_config=_cfg(data.parent, data).data).list_shards()


def test_the_index_remembers_by_stat_and_rehashes_racy_files(tmp_path):
    data = _data(tmp_path)
    files = _files(data)
    idx = tmp_path / INDEX_DIR
    out, stats = content_identities(files, index=ContentIndex(idx))
    assert stats.hashed_files == 4 and stats.index_hits == 0
    assert [f.etag for f in out] == [f"xxh3_128:{whole_checksum(f.url)[1]}" for f in files]
    out2, stats2 = content_identities(files, index=ContentIndex(idx))
    assert out2 == out and (stats2.hashed_files, stats2.index_hits) == (0, 4)
    # Written just now: hashed again at the next start (its mtime may not have moved).
    (data / files[0].name).write_bytes((data / files[0].name).read_bytes())
    _, s3 = content_identities(files, index=ContentIndex(idx))
    assert s3.hashed_files == 1
    _, s4 = content_identities(files, index=ContentIndex(idx))
    assert s4.hashed_files == 1, "racy: hashed within 2 s of its last change"


def test_an_in_place_rewrite_with_its_mtime_put_back_is_hashed_again(tmp_path):
    # Same size, same inode, mtime restored (`touch -r`): only the ctime moved, which
    # the index did not compare, so the old digest (the old cache) was served.
    data = _data(tmp_path)
    files = _files(data)
    idx = tmp_path / INDEX_DIR
    out, _ = content_identities(files, index=ContentIndex(idx))
    victim = Path(files[0].url)
    st = flip_middle_bit(victim, 1, keep_mtime=True)
    after = victim.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        st.st_size,
        st.st_mtime_ns,
        st.st_ino,
    )
    assert after.st_ctime_ns != st.st_ctime_ns
    out2, stats = content_identities(files, index=ContentIndex(idx))
    assert (stats.hashed_files, stats.index_hits) == (1, 3)
    assert out2[0].etag == f"xxh3_128:{whole_checksum(victim)[1]}" != out[0].etag
    assert out2[1:] == out[1:]


def test_the_same_files_under_another_path_are_not_hashed_again(tmp_path):
    # bench_evolve.py's append read 500 unchanged shards again: its input folders are
    # hard links to one set of files, and the index is keyed by path. The same inode
    # with exactly the same stat (size, mtime, ctime) under another path is the same
    # bytes: a folder renamed, or reached by another path, or hard links made before
    # the hashing. A link made after it moves every path's ctime: hashed again, as
    # after `cp -al` or `rsync --link-dest` of a folder already hashed.
    data = _data(tmp_path)
    early = tmp_path / "early"
    early.mkdir()
    for p in data.iterdir():
        os.link(p, early / p.name)
    idx = tmp_path / INDEX_DIR
    out, stats = content_identities(_files(data), index=ContentIndex(idx))
    assert (stats.hashed_files, stats.index_hits) == (4, 0)
    linked, stats = content_identities(_files(early), index=ContentIndex(idx))
    assert (stats.hashed_files, stats.index_hits) == (0, 4)
    assert [f.etag for f in linked] == [f.etag for f in out]
    # Remembered under the new path too: found by path from now on.
    doc = json.loads((idx / INDEX_NAME).read_text())
    assert {str(early / f.name) for f in linked} <= set(doc["entries"])
    moved = tmp_path / "moved"
    data.rename(moved)
    again, stats = content_identities(_files(moved), index=ContentIndex(idx))
    assert (stats.hashed_files, stats.index_hits) == (0, 4)
    assert [f.etag for f in again] == [f.etag for f in out]
    late = tmp_path / "late"
    late.mkdir()
    for p in moved.iterdir():
        os.link(p, late / p.name)
    _, stats = content_identities(_files(late), index=ContentIndex(idx))
    assert (stats.hashed_files, stats.index_hits) == (4, 0)
    # Changed in place: its stat moved, so no entry under any path serves it.
    victim = Path(_files(moved)[0].url)
    with open(victim, "r+b") as f:
        f.write(b"\x00")
    _, stats = content_identities(_files(moved), index=ContentIndex(idx))
    assert stats.hashed_files == 1


def test_an_index_of_the_release_before_ctime_is_read_and_rehashed(tmp_path, caplog):
    # Its rows have no ctime: each is a miss (hashed once, then remembered with its
    # ctime), not a malformed entry and not a crash.
    data = _data(tmp_path)
    files = _files(data)
    idx = tmp_path / INDEX_DIR
    out, _ = content_identities(files, index=ContentIndex(idx))
    doc = json.loads((idx / INDEX_NAME).read_text())
    doc["entries"] = {k: row[:6] for k, row in doc["entries"].items()}
    (idx / INDEX_NAME).write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="hf_pipeline"):
        out2, stats = content_identities(files, index=ContentIndex(idx))
    assert not [r.getMessage() for r in caplog.records if "content index" in r.getMessage()]
    assert (stats.hashed_files, stats.index_hits) == (4, 0) and out2 == out
    assert content_identities(files, index=ContentIndex(idx))[1].index_hits == 4


@pytest.mark.parametrize(
    "content, why",
    [
        (b"\x00garbage{{{", "malformed JSON"),
        (b"[1, 2, 3]", "not a JSON object"),
        (
            json.dumps({"version": 99, "algorithm": "xxh3_128", "entries": {}}).encode(),
            "version 99",
        ),
        (json.dumps({"version": 1, "algorithm": "xxh3_128", "entries": []}).encode(), "'entries'"),
        (b"[" * 100_000, "nested deeper"),
        (None, "larger than"),  # a sparse file past the 64 MiB bound
    ],
)
def test_a_hostile_index_is_ignored_with_one_line(tmp_path, caplog, content, why):
    data = _data(tmp_path)
    idx = tmp_path / INDEX_DIR
    idx.mkdir()
    path = idx / INDEX_NAME
    if content is None:
        with open(path, "wb") as f:
            f.truncate(65 << 20)
    else:
        path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="hf_pipeline"):
        out, stats = content_identities(_files(data), index=ContentIndex(idx))
    lines = [r.getMessage() for r in caplog.records if "content index" in r.getMessage()]
    assert len(lines) == 1 and why in lines[0] and str(path) in lines[0], lines
    assert why in stats.index_problem and stats.hashed_files == 4
    # Rewritten whole by this run: the next start trusts it.
    assert content_identities(_files(data), index=ContentIndex(idx))[1].index_hits == 4


def test_an_index_entry_is_never_trusted_for_another_stat(tmp_path, caplog):
    data = _data(tmp_path)
    files = _files(data)
    idx = tmp_path / INDEX_DIR
    idx.mkdir()
    forged = "0" * 32
    entries = {}
    for i, f in enumerate(files):
        real, size, mtime, ino, dev, _ = stat_key(f.url)
        row = [size, mtime, ino, dev, forged, mtime + _HOUR_NS]
        row[i % 3] += 1  # size, mtime or inode off by one
        entries[real] = row
    entries["/wrong/types"] = [True, "1", None, 2, forged, 3]
    entries["relative/path"] = [1, 1, 1, 1, forged, 3]
    doc = {"version": 1, "algorithm": "xxh3_128", "entries": entries}
    (idx / INDEX_NAME).write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="hf_pipeline"):
        out, stats = content_identities(files, index=ContentIndex(idx))
    assert stats.hashed_files == 4 and stats.index_hits == 0
    assert all(forged not in f.etag for f in out)
    assert [f.etag for f in out] == [f"xxh3_128:{whole_checksum(f.url)[1]}" for f in files]
    assert any("2 malformed entries ignored" in r.getMessage() for r in caplog.records)


def test_a_symlinked_index_is_not_followed(tmp_path):
    data = _data(tmp_path)
    idx = tmp_path / INDEX_DIR
    idx.mkdir()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("{}")
    (idx / INDEX_NAME).symlink_to(elsewhere)
    idx_obj = ContentIndex(idx)
    assert idx_obj.problem == "not a regular file"
    content_identities(_files(data), index=idx_obj)
    assert elsewhere.read_text() == "{}"  # replaced the link, never wrote through it
    assert not (idx / INDEX_NAME).is_symlink()


def _save_many(idx: str, tag: int, n: int) -> None:
    for i in range(n):
        index = ContentIndex(idx)
        index.record((f"/w{tag}/f{i}", i, i, i, i, i), f"{tag:032x}", 10 * _HOUR_NS)
        index.save()


def test_two_writers_at_once_never_corrupt_the_index(tmp_path):
    idx = str(tmp_path / INDEX_DIR)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_save_many, args=(idx, t, 40)) for t in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    index = ContentIndex(idx)
    assert index.problem == ""
    # Each writer merges what is on disk before it replaces it: at least every entry
    # of the writer that finished last, and nothing half-written.
    doc = json.loads((Path(idx) / INDEX_NAME).read_text())
    tags = {row[4] for row in doc["entries"].values()}
    assert tags <= {f"{1:032x}", f"{2:032x}"}
    assert len(doc["entries"]) >= 40


def test_resolve_inputs_identifies_the_metadata_too(tmp_path):
    data = _data(tmp_path)
    inputs = resolve_inputs(_cfg(tmp_path / "cache", data))
    assert inputs.metadata.etag.startswith("xxh3_128:")
    assert all(f.etag.startswith("xxh3_128:") for f in inputs.shards)
    assert inputs.hashing is not None and inputs.hashing.files == 5
    assert (tmp_path / "cache" / INDEX_DIR / INDEX_NAME).is_file()


@pytest.mark.slow
def test_local_inputs_are_hashed_once_per_job(tmp_path):
    """Three real ranks (gloo, env://): rank 0 hashes the inputs; rank 1 (same cache
    root) finds them in the index; rank 2 (a cache root of its own, as a node-local one)
    takes rank 0's digests for files of the very same stat. One fingerprint."""
    from tests.conftest import REPO, run_ranks
    from tests.helpers.ports import free_port_pair

    data = _data(tmp_path)
    shared, own = tmp_path / "shared-root", tmp_path / "node-root"
    runs = run_ranks(
        [REPO / "tests/procs/resolve_rank.py", f"data.shards={data}", "build.num_proc=1",
         f"data.metadata={data / 'coyo11m-meta.parquet'}"],
        3, timeout=300, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port_pair()),
        rank_env=lambda r: {"HF_PIPELINE_CACHE": str(own if r == 2 else shared)},
    )  # fmt: skip
    for code, out, err in runs:
        assert code == 0, (out + err)[-3000:]
    got = {r["rank"]: r for r in (json.loads(out.strip().splitlines()[-1]) for _, out, _ in runs)}
    assert len({r["fingerprint"] for r in got.values()}) == 1
    size = sum(p.stat().st_size for p in data.iterdir())
    assert got[0]["hashing"]["hashed_bytes"] == size and got[0]["hashing"]["hashed_files"] == 5
    for rank in (1, 2):
        h = got[rank]["hashing"]
        assert (h["hashed_bytes"], h["hashed_files"], h["index_hits"]) == (0, 0, 5), (rank, h)


def test_a_symlinked_index_folder_is_refused_and_nothing_is_written_there(tmp_path):
    """`.content-index` linked to a folder of the user's (a shared root): the index was
    written there (and replaced a file of that name). Now refused naming the link."""
    from dist.errors import ForeignCacheFolderError
    from tests.helpers.victims import Victim

    data = _data(tmp_path)
    victim = Victim(tmp_path / "victim")
    root = tmp_path / "root"
    root.mkdir()
    (root / INDEX_DIR).symlink_to(victim.path)
    with pytest.raises(ForeignCacheFolderError) as e:
        content_identities(_files(data), index=ContentIndex(root / INDEX_DIR))
    assert e.value.path == str(root / INDEX_DIR)
    victim.assert_untouched()
