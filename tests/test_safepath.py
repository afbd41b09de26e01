"""dist.safepath: every form of a foreign path, accepted or refused, and the join."""

from __future__ import annotations

import os
import pickle

import pytest

from dist.errors import ForeignCacheFolderError
from dist.safepath import (
    MAX_PART_BYTES,
    MAX_PATH_BYTES,
    MAX_PATH_DEPTH,
    UnsafePathError,
    check_name,
    check_relpath,
    join_under,
    own_folder,
    remove_tree_at,
    shown,
)
from tests.helpers.victims import Victim

GOOD = [
    "a",
    "converted.00aa/rows/data-00000.arrow",
    "parts/part-00000/embeddings/e.arrow",
    ".hidden",  # a dot-file is a name, not "."
    "a..b",  # ".." inside a name is not a ".." part
    "...",
    "résumé/日本.arrow",
    "/".join(["d"] * MAX_PATH_DEPTH),
    "x" * MAX_PART_BYTES,
]

BAD = {
    "empty": ("", "empty"),
    "absolute": ("/etc/passwd", "absolute"),
    "doubled slash": ("converted.x//tmp/victim/zz.pth", "empty part"),
    "leading doubled slash": ("//tmp/x", "absolute"),
    "trailing slash": ("a/", "empty part"),
    "only a slash": ("/", "absolute"),
    "dot part": ("./a", "'.' part"),
    "dot in the middle": ("a/./b", "'.' part"),
    "dotdot": ("..", "'..' part"),
    "dotdot in the middle": ("a/../../b", "'..' part"),
    "NUL": ("a\x00b", "control character"),
    "newline": ("a\nINFO fake log line", "control character"),
    "carriage return": ("a\rb", "control character"),
    "tab": ("a\tb", "control character"),
    "DEL": ("a\x7fb", "control character"),
    "C1 control": ("a\x85b", "control character"),
    "backslash": ("a\\..\\b", "backslash"),
    "lone surrogate": ("a\ud800b", "not valid UTF-8"),
    "too long": ("a/" * (MAX_PATH_BYTES // 2) + "b", f"longer than {MAX_PATH_BYTES} bytes"),
    "too deep": ("/".join(["d"] * (MAX_PATH_DEPTH + 1)), f"more than {MAX_PATH_DEPTH} parts"),
    "part too long": ("x" * (MAX_PART_BYTES + 1), f"longer than {MAX_PART_BYTES} bytes"),
    "part too long in UTF-8": ("é" * 128, f"longer than {MAX_PART_BYTES} bytes"),
    "not a string": (5, "must be a string, got int"),
}


@pytest.mark.parametrize("path", GOOD)
def test_plain_relative_paths_are_accepted_unchanged(path):
    assert check_relpath(path) is path


@pytest.mark.parametrize("form", list(BAD))
def test_every_unsafe_form_is_refused_in_one_line(form):
    path, why = BAD[form]
    with pytest.raises(UnsafePathError, match=why) as info:
        check_relpath(path)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message and "\x00" not in message
    assert len(message) < 250  # an overlong path is cut, not printed whole
    assert info.value.path == path
    again = pickle.loads(pickle.dumps(info.value))  # crosses process boundaries
    assert (str(again), again.path, again.reason) == (message, path, info.value.reason)


def test_a_name_is_one_part():
    assert check_name("demo-0123456789abcdef") == "demo-0123456789abcdef"
    with pytest.raises(UnsafePathError, match="'/' in a name"):
        check_name("a/b")
    with pytest.raises(UnsafePathError, match="control character"):
        check_name("demo\nERROR: forged-0123456789abcdef")


def test_join_under_stays_under_the_base(tmp_path):
    assert join_under(tmp_path, "a/b/c.arrow") == tmp_path / "a" / "b" / "c.arrow"
    for path, why in BAD.values():
        if isinstance(path, str):
            with pytest.raises(UnsafePathError, match=why):
                join_under(tmp_path, path)


def test_join_under_refuses_a_symlink_on_the_way(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    base = tmp_path / "cache"
    (base / "stage").mkdir(parents=True)
    os.symlink(outside, base / "stage" / "rows")
    with pytest.raises(UnsafePathError, match="rows is a symlink"):
        join_under(base, "stage/rows/x.arrow")
    os.symlink(outside / "x", base / "stage" / "last")  # the file itself, dangling
    with pytest.raises(UnsafePathError, match="last is a symlink"):
        join_under(base, "stage/last")
    # Missing components and a regular file on the way are left to the caller's own call.
    assert join_under(base, "stage/new/x") == base / "stage" / "new" / "x"
    (base / "f").write_text("")
    assert join_under(base, "f/x") == base / "f" / "x"


@pytest.mark.parametrize("path", ["converted/a\x00b", "converted/a\nWARNING forged", "/etc/x"])
def test_a_marker_listing_an_unsafe_path_reads_as_absent_in_one_line(path, tmp_path, caplog):
    """Issue 23, item 6: NUL in a listed path was a ValueError traceback out of
    read_marker (os.stat: embedded null byte); a newline was accepted."""
    import json
    import logging

    from dist.markers import read_marker

    (tmp_path / "converted").mkdir()
    marker = {
        "schema_version": 1, "fingerprint": "f", "stage": "converted",
        "directory": "converted", "host": "h", "pid": 1, "lease_id": "l",
        "started_at": 0.0, "finished_at": 0.0,
        "files": [{"path": path, "size": 0, "checksum": "x"}],
    }  # fmt: skip
    (tmp_path / "converted.json").write_text(json.dumps(marker))
    with caplog.at_level(logging.WARNING, logger="dist"):
        assert read_marker(tmp_path / "converted.json", fingerprint="f", base_dir=tmp_path) is None
    [line] = [r.getMessage() for r in caplog.records]
    assert "unsafe path" in line and "\n" not in line and "\x00" not in line, line


def test_join_under_checks_each_folder_once_with_a_shared_set(tmp_path):
    (tmp_path / "s" / "rows").mkdir(parents=True)
    seen: set = set()
    join_under(tmp_path, "s/rows/a.arrow", checked_dirs=seen)
    assert seen == {tmp_path / "s", tmp_path / "s" / "rows"}
    # A folder replaced by a symlink after it was checked is the caller's set's business;
    # a fresh set finds it.
    (tmp_path / "s" / "rows").rmdir()
    os.symlink(tmp_path, tmp_path / "s" / "rows")
    assert join_under(tmp_path, "s/rows/b.arrow", checked_dirs=seen)
    with pytest.raises(UnsafePathError, match="is a symlink"):
        join_under(tmp_path, "s/rows/b.arrow", checked_dirs=set())


# --------------------------------------------------------------------------- own_folder


def test_own_folder_makes_real_folders_below_a_linked_root(tmp_path):
    """The root is the user's and may be a link (HF_HOME -> /mnt/nfs/...)."""
    real = tmp_path / "nfs"
    real.mkdir()
    root = tmp_path / "hf_home"
    root.symlink_to(real)
    assert own_folder(root, ".staging/abc") == root / ".staging" / "abc"
    assert (real / ".staging" / "abc").is_dir() and not (real / ".staging").is_symlink()
    assert own_folder(root, ".staging/abc") == root / ".staging" / "abc"  # found: fine
    assert own_folder(root, "") == root
    # Without create: what is missing ends the look, nothing is made.
    assert own_folder(root, ".parts/x", create=False) == root / ".parts" / "x"
    assert not (real / ".parts").exists()


@pytest.mark.parametrize("level", [".staging", ".staging/abc", ".staging/abc/.ctl"])
@pytest.mark.parametrize("create", [True, False])
def test_own_folder_refuses_a_symlink_below_the_root_and_writes_nothing_there(
    tmp_path, level, create
):
    victim = Victim(tmp_path / "victim")
    root = tmp_path / "root"
    (root / level).parent.mkdir(parents=True, exist_ok=True)
    (root / level).symlink_to(victim.path)
    with pytest.raises(ForeignCacheFolderError, match="a symlink where hf_pipeline keeps") as e:
        own_folder(root, ".staging/abc/.ctl/run", create=create)
    assert e.value.path == str(root / level)
    assert str(e.value).startswith(f"{root / level}: ") and "\n" not in str(e.value)
    victim.assert_untouched()
    # A dangling link is no folder either (mkdir would have said "exists").
    (root / level).unlink()
    (root / level).symlink_to(tmp_path / "nowhere")
    with pytest.raises(ForeignCacheFolderError):
        own_folder(root, ".staging/abc/.ctl/run", create=create)
    assert not (tmp_path / "nowhere").exists()


def test_own_folder_refuses_a_file_in_a_folders_place(tmp_path):
    (tmp_path / ".parts").write_text("a file")
    with pytest.raises(ForeignCacheFolderError, match="not a folder where hf_pipeline keeps"):
        own_folder(tmp_path, ".parts/unit")
    assert (tmp_path / ".parts").read_text() == "a file"
    with pytest.raises(UnsafePathError):
        own_folder(tmp_path, "../elsewhere")


def test_remove_tree_at_unlinks_links_and_never_follows_a_folder_swapped_for_one(
    tmp_path, monkeypatch
):
    victim = Victim(tmp_path / "victim")
    top = tmp_path / "trash"
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "b" / "f").write_text("ours")
    (top / "link").symlink_to(victim.path)  # a link inside: unlinked, not followed
    (top / "swapped").mkdir()
    (top / "swapped" / "g").write_text("ours")
    real_open = os.open

    def open_after_swap(path, flags, mode=0o777, *, dir_fd=None):
        # Between remove_tree_at's lstat of "swapped" and its open: a link in its place.
        if path == "swapped" and not os.path.islink(top / "swapped"):
            os.rename(top / "swapped", tmp_path / "moved-away")
            os.symlink(victim.path, top / "swapped")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", open_after_swap)
    fd = real_open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    errors: list[str] = []
    try:
        remove_tree_at(fd, "trash", tmp_path, errors)
    finally:
        os.close(fd)
    monkeypatch.undo()
    victim.assert_untouched()
    assert any(e.startswith(f"{top / 'swapped'}: ") for e in errors), errors
    assert sorted(os.listdir(top)) == ["swapped"] and (top / "swapped").is_symlink()


def test_a_long_text_is_shown_cut_with_its_own_closing_quote():
    """A message written by another host (a failure record's) is shown on one line, cut
    at 120 characters: the cut keeps the quote ascii() opened it with (a text holding a
    ' is quoted with "; it was closed with ' before), and says the full length."""
    cut = shown("it's " + "x" * 300)
    assert cut.startswith("\"it's xx") and cut.endswith('..." (305 characters)'), cut
    cut = shown("plain " + "y\n" * 200)
    assert cut.startswith("'plain y\\n") and cut.endswith("...' (406 characters)"), cut
    assert "\n" not in cut
    assert shown(10**200).endswith("... (201 characters)")  # not a string: no quotes
    assert shown("short") == "'short'"
