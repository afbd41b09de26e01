"""dist.atomic: content lands whole, or the old file stays and no temp file is left."""

import errno
import json
import os
import subprocess
import sys

import pytest

import dist
from dist.atomic import atomic_write, create_new, fsync_dir, write_json_atomic
from tests.conftest import REPO


def _others(folder, name):
    return [n for n in os.listdir(folder) if n != name]


@pytest.mark.parametrize("durable", [True, False])
def test_atomic_write_bytes_lands(tmp_path, durable):
    path = tmp_path / "f.bin"
    with atomic_write(path, durable=durable) as fh:
        fh.write(b"abc")
        fh.write(b"def")
        assert not path.exists()  # nothing visible until the block ends
    assert path.read_bytes() == b"abcdef"
    assert _others(tmp_path, "f.bin") == []


def test_atomic_write_text_replaces(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("old")
    with atomic_write(path, "w") as fh:
        fh.write("néw")
    assert path.read_text(encoding="utf-8") == "néw"
    assert _others(tmp_path, "f.txt") == []


def test_atomic_write_error_keeps_old_file_and_cleans_up(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old content")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_write(path) as fh:
            fh.write(b"half a new fi")
            raise RuntimeError("boom")
    assert path.read_bytes() == b"old content"
    assert _others(tmp_path, "f.bin") == []


def test_atomic_write_error_without_old_file(tmp_path):
    path = tmp_path / "f.bin"
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(path, durable=False) as fh:
            fh.write(b"x")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_atomic_write_rejects_other_modes(tmp_path):
    with pytest.raises(ValueError, match="mode must be"):
        with atomic_write(tmp_path / "f", "ab"):
            pass
    assert os.listdir(tmp_path) == []


def test_atomic_write_nested_same_path_distinct_temps(tmp_path):
    """Two writers of one path never share a temp file; the last to finish wins."""
    path = tmp_path / "f"
    with atomic_write(path) as a:
        with atomic_write(path) as b:
            b.write(b"b")
        a.write(b"a")
    assert path.read_bytes() == b"a"
    assert _others(tmp_path, "f") == []


@pytest.mark.parametrize("durable", [True, False])
def test_write_json_atomic(tmp_path, durable):
    path = tmp_path / "m.json"
    path.write_text("{}")
    write_json_atomic(path, {"b": 1, "a": [1, 2]}, durable=durable, sort_keys=True, indent=1)
    assert path.read_text() == json.dumps({"a": [1, 2], "b": 1}, sort_keys=True, indent=1)
    assert _others(tmp_path, "m.json") == []


def test_write_json_atomic_unserializable_keeps_old(tmp_path):
    path = tmp_path / "m.json"
    path.write_text('{"v": 0}')
    with pytest.raises(TypeError):
        write_json_atomic(path, {"v": object()})
    assert json.loads(path.read_text()) == {"v": 0}
    assert _others(tmp_path, "m.json") == []
    write_json_atomic(path, {"v": object()}, default=lambda o: "obj")
    assert json.loads(path.read_text()) == {"v": "obj"}


def test_fsync_dir_syncs_the_folder_and_is_best_effort(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    fsync_dir(tmp_path)
    assert synced == [str(tmp_path)]
    fsync_dir(tmp_path / "missing")  # no error: best effort
    (tmp_path / "file").write_text("x")
    fsync_dir(tmp_path / "file")  # not a folder: no error either
    assert synced == [str(tmp_path)]


def test_create_new_never_overwrites_and_one_of_many_wins(tmp_path):
    path = tmp_path / "marker.json"
    assert create_new(path, b"first") is True
    assert create_new(path, b"second") is False
    assert path.read_bytes() == b"first"
    assert _others(tmp_path, "marker.json") == []  # no temp file left either way

    # 8 real processes race for one path: exactly one wins and its bytes are whole.
    race = tmp_path / "race.json"
    code = (
        "import sys; from dist.atomic import create_new; "
        "print(create_new(sys.argv[1], sys.argv[2].encode() * 100000))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(race), str(i)], cwd=REPO,
                         stdout=subprocess.PIPE, text=True)
        for i in range(8)
    ]  # fmt: skip
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert outs.count("True") == 1 and outs.count("False") == 7
    winner = str(outs.index("True"))
    assert race.read_bytes() == winner.encode() * 100000


def test_create_new_without_hard_links_falls_back_to_exclusive_create(tmp_path, monkeypatch):
    """Some FUSE and SMB mounts refuse link(2) with EPERM: still one winner."""

    def refuse(src, dst, *a, **kw):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", refuse)
    path = tmp_path / "m.json"
    assert create_new(path, b"a") is True
    assert create_new(path, b"b") is False
    assert path.read_bytes() == b"a"
    assert _others(tmp_path, "m.json") == []


def test_exported_from_package():
    assert {"atomic_write", "fsync_dir", "write_json_atomic"} <= set(dist.__all__)
    assert {"publish_marker", "ensure_built", "LeaseLostError"} <= set(dist.__all__)
    assert dist.__all__ == sorted(dist.__all__)
