"""Paths that others wrote: checked before any filesystem call sees them.

A marker, a manifest or a store listing names files by a POSIX path relative to a
cache folder. Those names come from outside (a published cache, a store anyone with
write access can change), so a name like ``converted.x//home/me/.venv/.../zz.pth`` must
never reach ``Path(base) / name``: joining an absolute path drops ``base``.

:func:`check_relpath` accepts only the plain form (non-empty ``/``-separated parts, none
``.`` or ``..``, printable, no backslash, bounded); :func:`join_under` joins a checked
path to a folder and checks that no component already on disk between the folder and
the result is a symlink. Every reader of foreign paths goes through them
(:class:`dist.markers.FileEntry`, :class:`hf_pipeline.publish.manifest.Manifest`, the stores'
listings, the pull).

A symlink created *after* :func:`join_under` looked is not caught: only someone who can
already write into the cache folder can do that.

:func:`own_folder` is the same rule for the folders hf_pipeline keeps under a root it was
given (``.staging/<key>``, ``.parts``, a cache folder...): whoever else can write in a
shared root may have put a symlink (or a file) at that name beforehand, and what the
project writes or removes there would land in the link's target. The root itself is
the user's and may be a link (``HF_HOME -> /mnt/nfs/...``); nothing below it may.
"""

from __future__ import annotations

import contextlib
import os
import stat
import unicodedata
from pathlib import Path
from typing import Any

from dist.errors import ForeignCacheFolderError

__all__ = [
    "MAX_PATH_BYTES",
    "MAX_PATH_DEPTH",
    "MAX_PART_BYTES",
    "UnsafePathError",
    "check_name",
    "check_relpath",
    "join_under",
    "own_folder",
    "remove_tree_at",
    "shown",
]

#: Longest accepted path, UTF-8 bytes: Linux's PATH_MAX less room for the cache root.
MAX_PATH_BYTES = 1024
#: Longest accepted part (file or folder name), UTF-8 bytes: NAME_MAX of ext4/xfs.
MAX_PART_BYTES = 255
#: Most parts in one path. A cache is 4-5 levels deep (``converted.<id>/parts/part-0/
#: rows/x.arrow``); 16 leaves room for later layouts.
MAX_PATH_DEPTH = 16

_SHOWN = 120  # characters of a refused path an error message shows


class UnsafePathError(ValueError):
    """A foreign path that could leave its folder, or is not a plain relative path.

    ``str()`` is one line: the path (escaped, cut at 120 characters) and why.

    Attributes:
        path: the refused path, as given; empty when built from the message alone (as
            torch's ``DataLoader`` re-raises a worker's exception).
        reason: why it was refused.
    """

    def __init__(self, path: str, reason: str | None = None):
        if reason is None:  # the message alone (torch's DataLoader re-raise): path empty
            super().__init__(str(path))
            self.path, self.reason = "", str(path)
            return
        super().__init__(f"unsafe path {shown(path)}: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (
            type(self),
            (self.reason,) if self.args[0] == self.reason else (self.path, self.reason),
        )


def shown(text: object) -> str:
    """``text`` for one line of an error message: ``ascii()`` (control characters,
    newlines, NUL escaped), cut at 120 characters."""
    s = ascii(text)
    if len(s) <= _SHOWN:
        return s
    quote = s[0] if s[0] in "'\"" else ""  # ascii() quotes a string with ' or with "
    return f"{s[:_SHOWN]}...{quote} ({len(str(text))} characters)"


def _part_problem(part: str) -> str | None:
    if part == "":
        return "empty part (a leading, doubled or trailing '/')"
    if part in (".", ".."):
        return f"{part!r} part"
    if len(part.encode("utf-8")) > MAX_PART_BYTES:
        return f"a part longer than {MAX_PART_BYTES} bytes"
    return None


def _text_problem(path: object) -> str | None:
    if not isinstance(path, str):
        return f"must be a string, got {type(path).__name__}"
    if path == "":
        return "empty"
    try:
        size = len(path.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in JSON): no file has it
        return "not valid UTF-8"
    if size > MAX_PATH_BYTES:
        return f"longer than {MAX_PATH_BYTES} bytes ({size})"
    if "\\" in path:
        return "backslash (not a POSIX path)"
    # Cc: NUL, newline, CR, tab, DEL, C1 controls. A newline in a name forges log lines.
    if any(unicodedata.category(c) == "Cc" for c in path):
        return "control character (NUL, newline, ...)"
    return None


def check_relpath(path: str) -> str:
    """Check a foreign relative POSIX path; return it unchanged.

    Accepted: ``a``, ``a/b.arrow``: 1 to :data:`MAX_PATH_DEPTH` parts separated by single
    ``/``, none empty, ``.`` or ``..``; at most :data:`MAX_PATH_BYTES` bytes of UTF-8,
    each part at most :data:`MAX_PART_BYTES`; no control character (NUL, newline, CR,
    ...), no backslash. So the path names a file at or below the folder it is joined to
    (symlinks aside: :func:`join_under`).

    Raises:
        UnsafePathError: anything else (absolute, ``a//b``, ``a/``, ``./a``, ``a/../b``...).
    """
    problem = _text_problem(path)
    if problem is None and path.startswith("/"):
        problem = "absolute"
    if problem is None:
        parts = path.split("/")
        if len(parts) > MAX_PATH_DEPTH:
            problem = f"more than {MAX_PATH_DEPTH} parts ({len(parts)})"
        else:
            problem = next(filter(None, map(_part_problem, parts)), None)
    if problem is not None:
        raise UnsafePathError(path, problem)
    return path


def check_name(name: str) -> str:
    """Check a foreign file or folder *name* (one part: no ``/``); return it unchanged.

    Raises:
        UnsafePathError: as :func:`check_relpath`, or it holds a ``/``.
    """
    check_relpath(name)
    if "/" in name:
        raise UnsafePathError(name, "a '/' in a name of one folder level")
    return name


def join_under(
    base: str | os.PathLike[str], path: str, *, checked_dirs: set[Path] | None = None
) -> Path:
    """``base / path`` for a foreign ``path``, proven to stay under ``base``.

    ``path`` is checked with :func:`check_relpath`; then every component between
    ``base`` and the result that already exists is ``lstat``-ed: none may be a symlink
    (a link placed in a cache could point anywhere). Components that do not exist yet
    are fine (the caller creates them under a checked parent).

    Args:
        base: the folder ``path`` is relative to.
        path: the foreign path.
        checked_dirs: folders already found not to be symlinks, skipped, and added to
            (one set across the files of one marker: one ``lstat`` per folder, not per
            file and level, on NFS).

    Raises:
        UnsafePathError: ``path`` is unsafe, or a component on the way is a symlink.
    """
    check_relpath(path)
    base = Path(base)
    out = base.joinpath(*path.split("/"))
    # Belt and braces: a checked path cannot climb, but say so if it ever did.
    if os.path.commonpath([os.path.abspath(base), os.path.abspath(out)]) != os.path.abspath(base):
        raise UnsafePathError(path, f"leaves {base}")
    here = base
    parts = path.split("/")
    for i, part in enumerate(parts):
        here = here / part
        if checked_dirs is not None and here in checked_dirs:
            continue
        try:
            mode = os.lstat(here).st_mode
        except (FileNotFoundError, NotADirectoryError):
            break  # nothing below a missing component exists either
        if stat.S_ISLNK(mode):
            raise UnsafePathError(path, f"{here} is a symlink")
        if checked_dirs is not None and i < len(parts) - 1:
            checked_dirs.add(here)
    return out


def own_folder(base: str | os.PathLike[str], rel: str, *, create: bool = True) -> Path:
    """``base / rel``, a folder hf_pipeline keeps, proven a real folder at every level.

    ``base`` is the user's (a cache root, a configured staging folder) and may be a
    symlink; it is made if missing. Each part of ``rel`` is made if missing (with
    ``create``) and then ``lstat``-ed: a symlink, a file or anything else that is not a
    folder in its place is refused, never followed or replaced (someone who can write
    in a shared root may have put it there, aiming what the project writes or removes
    at a folder of theirs or of the user's). Not proof against a folder swapped for a
    link *after* this look: callers that remove something check again right before.

    Args:
        base: the folder ``rel`` is relative to.
        rel: the project's own ``/``-separated folder names (checked as
            :func:`check_relpath`); ``""``: ``base`` itself, unchecked.
        create: make what is missing; without it a missing part ends the look (the
            path is returned; nothing below it exists).

    Raises:
        ForeignCacheFolderError: a part below ``base`` is a symlink or not a folder;
            names it.
        OSError: a folder could not be made (read-only, full, permissions).
    """
    here = Path(base)
    if create:
        here.mkdir(parents=True, exist_ok=True)
    for part in check_relpath(rel).split("/") if rel else ():
        here = here / part
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(here)
        try:
            mode = os.lstat(here).st_mode
        except FileNotFoundError:
            if create:  # removed between our mkdir and lstat: someone is playing games
                raise
            return Path(base).joinpath(*rel.split("/"))
        if not stat.S_ISDIR(mode):
            what = "a symlink" if stat.S_ISLNK(mode) else "not a folder"
            raise ForeignCacheFolderError(
                f"{here}: {what} where hf_pipeline keeps a folder of its own; it writes and "
                "removes there, so it never follows a link or uses another's file: remove "
                "it (hf_pipeline makes the folder)",
                str(here),
            )
    return here


#: Deepest folder :func:`remove_tree_at` descends (a cache is 4-5 levels deep; beyond,
#: someone built the tree to exhaust the stack or the descriptors: left, reported).
_MAX_REMOVE_DEPTH = 64


def remove_tree_at(
    dir_fd: int, name: str, where: Path, errors: list[str], *, _depth: int = 0
) -> None:
    """Remove entry ``name`` of the folder open as ``dir_fd``, with all it holds.

    Every step is relative to an open folder (``dir_fd``, then each subfolder opened with
    ``O_NOFOLLOW`` and checked to be the folder ``lstat`` saw): a folder swapped for a
    symlink while it runs is never followed, so nothing outside the folder the caller
    opened can be removed. A symlink is unlinked itself.

    Args:
        dir_fd: the open folder holding ``name``.
        name: one entry of it.
        where: ``dir_fd``'s path, for messages only.
        errors: what could not be removed is appended here, one line each (``path:
            why``); a missing entry is not an error.
    """
    path = where / name
    try:
        st = os.lstat(name, dir_fd=dir_fd)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dir_fd)
            return
        if _depth >= _MAX_REMOVE_DEPTH:
            errors.append(f"{path}: more than {_MAX_REMOVE_DEPTH} folders deep, left")
            return
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as e:
        errors.append(f"{path}: {e}")
        return
    try:
        if not os.path.samestat(st, os.fstat(fd)):
            errors.append(f"{path}: changed while it was being removed, left")
            return
        for inner in os.listdir(fd):
            remove_tree_at(fd, inner, path, errors, _depth=_depth + 1)
    except OSError as e:
        errors.append(f"{path}: {e}")
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as e:
        errors.append(f"{path}: {e}")
