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
already write into the cache folder can do that, and the cache root is trusted.
"""

from __future__ import annotations

import os
import stat
import unicodedata
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_PATH_BYTES",
    "MAX_PATH_DEPTH",
    "MAX_PART_BYTES",
    "UnsafePathError",
    "check_name",
    "check_relpath",
    "join_under",
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
    return s if len(s) <= _SHOWN else f"{s[:_SHOWN]}...' ({len(str(text))} characters)"


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
