"""Publish files atomically: temp file in the same folder, fsync, ``os.replace``.

A reader of the target path sees the old file or the complete new one, never a part,
even if the writer is killed. The temp file lives next to the target (``os.replace`` is
atomic only within one filesystem) and is named ``.<name>.<pid>.<random>.tmp`` so
concurrent writers, threads included, never share one; the leading dot and ``.tmp``
suffix are what scanners skip and what ``dist.coordinator`` sweeps up after a killed
writer.

Every function here is thread- and process-safe in that sense; with :func:`atomic_write`
the last writer wins, with :func:`create_new` the first one does (no overwrite).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "create_new", "fsync_dir", "write_json_atomic"]


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """fsync a folder so a create or rename in it survives a crash.

    Best effort: does nothing where a folder cannot be opened or fsynced (some
    filesystems and NFS servers refuse it; Windows cannot open folders).
    """
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike[str], mode: str = "wb", *, durable: bool = True
) -> Iterator[IO[Any]]:
    """Yield a file object whose content replaces ``path`` when the block ends cleanly.

    On success the temp file is flushed, fsynced (if ``durable``), ``os.replace``d over
    ``path``, and the folder fsynced (if ``durable``). If the block raises, the temp file
    is removed, ``path`` is left as it was, and the error propagates.

    Args:
        path: the file to publish; its folder must exist.
        mode: ``"wb"`` (bytes) or ``"w"`` (UTF-8 text).
        durable: fsync file and folder, so the new content survives a crash. Without it
            the replace is still atomic for live readers (cheap; for signals between
            processes that a crash makes moot anyway).

    Raises:
        ValueError: ``mode`` is not ``"w"`` or ``"wb"``.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as fh:
            yield fh
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def write_json_atomic(
    path: str | os.PathLike[str], obj: Any, *, durable: bool = True, **json_kw: Any
) -> None:
    """Write ``obj`` as JSON to ``path`` with :func:`atomic_write`.

    Args:
        path: the file to publish.
        obj: anything ``json.dumps`` accepts with ``json_kw``.
        durable: as in :func:`atomic_write`.
        **json_kw: passed to ``json.dumps`` (``sort_keys``, ``indent``, ``default``...).
    """
    # Serialize first: an unserializable object then never creates a temp file.
    data = json.dumps(obj, **json_kw).encode("utf-8")
    with atomic_write(path, "wb", durable=durable) as fh:
        fh.write(data)


def create_new(path: str | os.PathLike[str], data: bytes, *, durable: bool = True) -> bool:
    """Publish ``data`` at ``path`` only if ``path`` does not exist yet (no overwrite).

    The content is written to a temp file in the same folder, fsynced, then hard-linked
    to ``path``: ``link`` fails with EEXIST rather than replace, and it is atomic on local
    filesystems and NFS, so of several concurrent writers exactly one wins and a reader
    sees either nothing or the complete file. Where the filesystem refuses hard links
    (some FUSE and SMB mounts) it falls back to ``O_CREAT|O_EXCL`` and writes in place:
    still one winner, but a reader may briefly see a partial file (readers parse markers
    leniently, a partial one is "absent").

    Args:
        path: the file to create; its folder must exist.
        data: the complete content.
        durable: fsync the file and the folder.

    Returns:
        True if this call created ``path``; False if it already existed (nothing written).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            return _create_exclusive(path, data, durable=durable)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    if durable:
        fsync_dir(path.parent)
    return True


def _create_exclusive(path: Path, data: bytes, *, durable: bool) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        if durable:
            os.fsync(fh.fileno())
    if durable:
        fsync_dir(path.parent)
    return True
