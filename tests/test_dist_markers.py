"""dist.markers: atomic write, strict read, every way a marker can be untrustworthy."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading

import pytest

from dist.atomic import write_json_atomic
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
    lines = [r.getMessage() for r in caplog.records if r.name == "dist"]
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
        ('{"schema_version": 2}', "schema version 2, expected 1"),
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
