"""dist.markers: atomic write, strict read, every way a marker can be untrustworthy."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading

import pytest
import xxhash

from dist.atomic import write_json_atomic
from dist.checksums import hash_files, whole_checksum
from dist.markers import (
    SCHEMA_VERSION,
    FileEntry,
    Marker,
    derived_from_problem,
    describe_files,
    file_checksum,
    publish_marker,
    read_marker,
    write_marker,
)


@pytest.fixture
def stage(tmp_path):
    """A cache folder with one stage of three files (one > 2 MiB) and its marker."""
    cache = tmp_path / "cache"
    folder = cache / "converted"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.bin").write_bytes(os.urandom(3 << 20))
    (folder / "b.bin").write_bytes(b"")
    (folder / "sub" / "c.bin").write_bytes(b"hello")
    marker = Marker(
        fingerprint="fp",
        stage="converted",
        directory="converted",
        host="h",
        pid=1,
        lease_id="L",
        started_at=1.0,
        finished_at=2.0,
        info={"rows": 7},
        files=describe_files(folder, relative_to=cache),
    )
    write_marker(cache / "converted.json", marker)
    return cache, marker


def _read(cache, **kw):
    kw.setdefault("fingerprint", "fp")
    return read_marker(cache / "converted.json", base_dir=cache, **kw)


def test_roundtrip(stage):
    cache, marker = stage
    assert [f.path for f in marker.files] == [
        "converted/a.bin",
        "converted/b.bin",
        "converted/sub/c.bin",
    ]
    assert _read(cache) == marker
    assert _read(cache, verify=True, stage="converted") == marker
    assert marker.total_bytes == (3 << 20) + 5
    d = json.loads((cache / "converted.json").read_text())
    assert d["schema_version"] == SCHEMA_VERSION and d["info"] == {"rows": 7}


def _expect_absent(caplog, cache, why, **kw):
    with caplog.at_level(logging.DEBUG, logger="dist"):
        assert _read(cache, **kw) is None
    lines = [r.getMessage() for r in caplog.records if r.name.split(".")[0] == "dist"]
    assert len(lines) == 1 and why in lines[0] and "converted.json" in lines[0], lines


def test_missing(caplog, tmp_path):
    _expect_absent(caplog, tmp_path, "missing")


def test_fingerprint_mismatch(caplog, stage):
    _expect_absent(caplog, stage[0], "fingerprint 'fp', expected 'other'", fingerprint="other")


def test_stage_mismatch(caplog, stage):
    _expect_absent(caplog, stage[0], "stage 'converted', expected 'filtered'", stage="filtered")


def test_listed_file_missing(caplog, stage):
    (stage[0] / "converted" / "sub" / "c.bin").unlink()
    _expect_absent(caplog, stage[0], "'converted/sub/c.bin' missing")


def test_listed_file_truncated(caplog, stage):
    with open(stage[0] / "converted" / "a.bin", "r+b") as f:
        f.truncate(100)
    _expect_absent(caplog, stage[0], f"'converted/a.bin' has 100 bytes, expected {3 << 20}")


def test_stage_folder_missing(caplog, stage):
    (stage[0] / "converted").rename(stage[0] / "elsewhere")
    _expect_absent(caplog, stage[0], "stage folder 'converted' missing")


def test_checksum_only_with_verify(caplog, stage):
    cache, marker = stage
    path = cache / "converted" / "a.bin"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, torn tail
    path.write_bytes(bytes(data))
    assert _read(cache) == marker
    _expect_absent(caplog, cache, "'converted/a.bin' checksum mismatch", verify=True)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"schema_version": 1, "fing', "malformed JSON"),
        ("", "malformed JSON"),
        ("[1, 2]", "malformed marker"),
        ('{"schema_version": 1}', "malformed marker (KeyError"),
        ('{"schema_version": 3}', "schema version 3, expected 1 or 2"),
        ('{"schema_version": true}', "schema version True, expected 1 or 2"),
        ("\xff\xfe garbage", "malformed JSON"),
    ],
)
def test_malformed_never_crashes(caplog, stage, text, why):
    (stage[0] / "converted.json").write_text(text, errors="surrogateescape")
    _expect_absent(caplog, stage[0], why)


def test_malformed_file_entries(caplog, stage):
    d = json.loads((stage[0] / "converted.json").read_text())
    d["files"][0]["path"] = "../../etc/passwd"
    (stage[0] / "converted.json").write_text(json.dumps(d))
    _expect_absent(caplog, stage[0], "relative inside the cache")


def test_checksum_covers_size_head_and_tail(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"a" * (5 << 20))
    base = file_checksum(p)
    with open(p, "r+b") as f:
        f.seek(2 << 20)
        f.write(b"b")  # the middle is deliberately not covered (cheap checksum)
    assert file_checksum(p) == base
    with open(p, "r+b") as f:
        f.seek((5 << 20) - 1)
        f.write(b"b")
    assert file_checksum(p) != base


def test_atomic_write_readers_never_see_partial(tmp_path):
    """A reader hammering the file while a writer replaces it sees only whole versions."""
    path = tmp_path / "m.json"
    write_json_atomic(path, {"v": 0, "pad": "x" * 100_000})
    stop = threading.Event()
    bad = []

    def reader():
        while not stop.is_set():
            try:
                json.loads(path.read_bytes())
            except ValueError as e:
                bad.append(e)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    for i in range(200):
        write_json_atomic(path, {"v": i, "pad": "x" * 100_000}, durable=False)
    stop.set()
    t.join(timeout=10)
    assert bad == []
    assert [n for n in os.listdir(tmp_path) if n != "m.json"] == []  # no temp leftovers


def test_describe_rejects_symlinks(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "link").symlink_to("/etc/hostname")
    with pytest.raises(ValueError, match="symlinks are not allowed"):
        describe_files(tmp_path / "s", relative_to=tmp_path)


def test_dataclass_validation():
    with pytest.raises(ValueError, match="size must be >= 0, got -1"):
        FileEntry(path="a", size=-1, checksum="0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        FileEntry(path="a", size=1, checksum="0").size = 2  # type: ignore[misc]


def test_publish_marker_first_publication_stands(stage):
    cache, marker = stage
    path = cache / "other.json"
    assert publish_marker(path, marker) is True
    later = dataclasses.replace(marker, lease_id="M", info={"rows": 8})
    assert publish_marker(path, later) is False  # never overwrites
    assert Marker.from_dict(json.loads(path.read_text())) == marker


def test_later_stage_valid_only_over_the_folders_it_was_derived_from(stage):
    _, converted = stage
    filtered = dataclasses.replace(
        converted, stage="filtered", directory="filtered.aaaa", inputs={"converted": "converted"}
    )
    assert derived_from_problem(filtered, {"converted": converted}) is None
    moved = dataclasses.replace(converted, directory="converted.bbbb")
    why = derived_from_problem(filtered, {"converted": moved})
    assert "derived from {'converted': 'converted'}" in why and "converted.bbbb" in why
    # hf_pipeline 0.1 markers recorded no inputs: valid over the fixed folder names only.
    legacy = dataclasses.replace(filtered, inputs={})
    assert derived_from_problem(legacy, {"converted": converted}) is None
    assert derived_from_problem(legacy, {"converted": moved}) is not None
    # inputs survive the JSON round trip
    assert Marker.from_dict(json.loads(json.dumps(filtered.to_dict()))) == filtered


# Golden markers (STYLE rule 14): the bytes a marker of each schema version holds for
# the files of _golden_files(). SCHEMA_VERSION 2 writes GOLDEN_V2; GOLDEN_V1 is what
# hf_pipeline wrote before whole-file checksums, and must stay readable.
GOLDEN_V2 = """{
 "directory": "converted",
 "files": [
  {
   "checksum": "8ac4a74750c15852",
   "path": "converted/a.bin",
   "size": 3145728,
   "whole_checksum": "ac18721f75b1d31e067d004927c0c8bc"
  },
  {
   "checksum": "633457081244afec",
   "path": "converted/b.bin",
   "size": 0,
   "whole_checksum": "99aa06d3014798d86001c324468d497f"
  },
  {
   "checksum": "23895d4c1deb123a",
   "path": "converted/sub/c.bin",
   "size": 5,
   "whole_checksum": "b5e9c1ad071b3e7fc779cfaa5e523818"
  }
 ],
 "fingerprint": "0123456789abcdef",
 "finished_at": 2.5,
 "host": "h",
 "info": {
  "rows": 7
 },
 "inputs": {},
 "lease_id": "0123456789abcdef",
 "pid": 1,
 "schema_version": 2,
 "stage": "converted",
 "started_at": 1.5
}"""

GOLDEN_V1 = """{
 "directory": "converted",
 "files": [
  {
   "checksum": "8ac4a74750c15852",
   "path": "converted/a.bin",
   "size": 3145728
  },
  {
   "checksum": "633457081244afec",
   "path": "converted/b.bin",
   "size": 0
  },
  {
   "checksum": "23895d4c1deb123a",
   "path": "converted/sub/c.bin",
   "size": 5
  }
 ],
 "fingerprint": "0123456789abcdef",
 "finished_at": 2.5,
 "host": "h",
 "info": {
  "rows": 7
 },
 "inputs": {},
 "lease_id": "0123456789abcdef",
 "pid": 1,
 "schema_version": 1,
 "stage": "converted",
 "started_at": 1.5
}"""


def _golden_files(tmp_path):
    cache = tmp_path / "cache"
    folder = cache / "converted"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.bin").write_bytes(bytes(range(256)) * 12288)  # 3 MiB: a middle
    (folder / "b.bin").write_bytes(b"")
    (folder / "sub" / "c.bin").write_bytes(b"hello")
    return cache


def _golden_marker(cache):
    return Marker(
        fingerprint="0123456789abcdef",
        stage="converted",
        directory="converted",
        host="h",
        pid=1,
        lease_id="0123456789abcdef",
        started_at=1.5,
        finished_at=2.5,
        info={"rows": 7},
        files=describe_files(cache / "converted", relative_to=cache),
    )


def test_golden_marker_of_this_schema_version(tmp_path):
    assert SCHEMA_VERSION == 2  # a new version gets its own golden text
    cache = _golden_files(tmp_path)
    marker = _golden_marker(cache)
    write_marker(cache / "converted.json", marker)
    assert (cache / "converted.json").read_text() == GOLDEN_V2
    got = read_marker(
        cache / "converted.json", fingerprint="0123456789abcdef", base_dir=cache, verify=True
    )
    assert got == marker


def test_golden_schema_1_marker_still_reads(tmp_path):
    cache = _golden_files(tmp_path)
    (cache / "converted.json").write_text(GOLDEN_V1)
    got = read_marker(
        cache / "converted.json", fingerprint="0123456789abcdef", base_dir=cache, verify=True
    )
    assert got is not None and got.schema_version == 1
    assert [f.whole_checksum for f in got.files] == ["", "", ""]
    new = _golden_marker(cache)
    assert [(f.path, f.size, f.checksum) for f in got.files] == [
        (f.path, f.size, f.checksum) for f in new.files
    ]
    write_marker(cache / "again.json", got)  # written back as schema 1 wrote it
    assert (cache / "again.json").read_text() == GOLDEN_V1


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (None, "KeyError"),
        ("AC18721F75B1D31E067D004927C0C8BC", "32 lowercase hex digits"),
        ("ac18721f", "32 lowercase hex digits"),
        (17, "32 lowercase hex digits"),
    ],
)
def test_schema_2_entries_need_a_whole_checksum(caplog, tmp_path, value, why):
    cache = _golden_files(tmp_path)
    d = json.loads(GOLDEN_V2)
    if value is None:
        del d["files"][0]["whole_checksum"]
    else:
        d["files"][0]["whole_checksum"] = value
    (cache / "converted.json").write_text(json.dumps(d))
    with caplog.at_level(logging.DEBUG, logger="dist"):
        assert (
            read_marker(cache / "converted.json", fingerprint="0123456789abcdef", base_dir=cache)
            is None
        )
    assert any(why in r.getMessage() for r in caplog.records), caplog.text


def test_whole_checksum_covers_every_byte(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"a" * (5 << 20))
    size, base = whole_checksum(p)
    assert size == 5 << 20 and len(base) == 32
    with open(p, "r+b") as f:
        f.seek(2 << 20)
        f.write(b"b")  # the middle, which file_checksum does not read
    assert whole_checksum(p)[1] != base


@pytest.mark.parametrize(
    "chunk_bytes, length",
    [(1, 3), (4096, 5 << 20), (1 << 20, 5 << 20), (3 << 20, 5 << 20), (64 << 20, 5 << 20)],
)
def test_the_read_size_does_not_change_a_digest(tmp_path, chunk_bytes, length):
    # the read size is a speed knob (tuned on a host's page cache): a digest recorded with
    # one size must match one computed with any other, a file of any length included
    p = tmp_path / "f"
    p.write_bytes((bytes(range(256)) * (length // 256 + 1))[: length + 7])  # no multiple
    expected = (length + 7, xxhash.xxh3_128(p.read_bytes()).hexdigest())
    assert whole_checksum(p, chunk_bytes=chunk_bytes) == expected
    ((_, got_size, got),) = hash_files([p], workers=1, chunk_bytes=chunk_bytes)
    assert (got_size, got) == expected


def test_a_read_size_below_one_byte_is_refused(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"x")
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1, got 0"):
        whole_checksum(p, chunk_bytes=0)


def test_hash_files_in_parallel_reports_an_unreadable_file_in_its_place(tmp_path):
    paths = []
    for i in range(5):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(bytes([i]) * ((i + 1) << 20))
    paths.insert(2, tmp_path / "missing")
    seen = []
    got = list(hash_files(paths, workers=3, on_bytes=seen.append))
    assert [p for p, _, _ in got] == paths
    assert isinstance(got[2][2], FileNotFoundError)
    ok = [g for g in got if not isinstance(g[2], OSError)]
    assert [(s, d) for _, s, d in ok] == [whole_checksum(p) for p, _, _ in ok]
    assert sum(seen) == sum(s for _, s, _ in ok)
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        list(hash_files(paths, workers=0))


def test_hash_files_stops_its_threads_when_the_consumer_leaves(tmp_path):
    paths = []
    for i in range(6):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(bytes([i]) * (32 << 20))
    seen = []
    hashed = hash_files(paths, workers=2, on_bytes=seen.append)
    next(hashed)
    hashed.close()  # joins the threads: a running hash stops at its next chunk
    assert not [t for t in threading.enumerate() if t.name.startswith("dist-hash")]
    assert sum(seen) < sum(p.stat().st_size for p in paths)  # the rest was never read
