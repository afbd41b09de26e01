"""Verified staging of one remote file: private part, checks, atomic publish, resume.

:func:`stage_file` downloads a :class:`~hf_pipeline.stores.remote_file.RemoteFile` into a
:class:`StagingFolder`: the bytes land in a ``.part`` file private to one thread, are
checked against the size and checksum the store published, fsynced, and only then
renamed into place next to a sidecar JSON recording what was verified. So:

* a truncated or corrupted body is never visible under the final name;
* a file whose sidecar matches is not fetched again after a kill (resume);
* a part left by a killed process is adopted and the download goes on from its size
  with a ranged read (resume by range); the checksum over the whole file still guards
  the bytes that were kept.

Anything that yields a file's bytes from an offset (:class:`RangeReader`; every remote
:class:`~hf_pipeline.stores.Source`) can be staged. Process- and thread-safe: all
coordination is by atomic renames.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol, overload

from dist.atomic import write_json_atomic
from dist.markers import read_json
from dist.safepath import own_folder
from hf_pipeline.stores.fetch_stats import FetchStats
from hf_pipeline.stores.remote_file import ChecksumKind, RemoteFile
from hf_pipeline.stores.retry import Cancelled, RetryPolicy, TransientError, with_retries

__all__ = [
    "READ_CHUNK",
    "RangeReader",
    "StagingFolder",
    "checksum_of",
    "stage_file",
    "staged_name",
]

READ_CHUNK = 8 << 20  # bytes per ranged read: small enough to notice a deadline or stop
_SIDECAR_VERSION = 1


class RangeReader(Protocol):
    """What :func:`stage_file` downloads through (a remote ``Source``)."""

    def read_range(
        self, file: RemoteFile, offset: int, deadline: float, stop: threading.Event | None
    ) -> Iterator[bytes]:
        """Yield the bytes of ``file`` from ``offset`` on; raise on failure or deadline."""
        ...  # pragma: no cover - protocol


def staged_name(file: RemoteFile) -> str:
    """The file name ``file`` is staged under: its name, safe for one folder level."""
    # Shard names are flat ("000000-000009.pt"); keep them readable but never let a
    # remote name escape the staging folder.
    return re.sub(r"[^A-Za-z0-9._-]", "_", file.name) or "file"


def _ident(file: RemoteFile) -> dict[str, Any]:
    return {"url": file.url, "size": file.size, "etag": file.etag, "checksum": file.checksum}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _glob_escape(text: str) -> str:
    """Escape glob metacharacters (``[``, ``*``, ``?``) in a literal prefix."""
    return re.sub(r"([\[\]*?])", r"[\1]", text)


def checksum_of(path: Path, kind: ChecksumKind | str) -> str:
    """Checksum of a whole file in the encoding the store publishes.

    Args:
        path: the file.
        kind: which checksum, in the encoding its store publishes (a ``ChecksumKind``;
            any str is accepted, as kinds come from store metadata).

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind == "crc32c":
        import google_crc32c

        crc = google_crc32c.Checksum()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(READ_CHUNK), b""):
                crc.update(block)
        return base64.b64encode(crc.digest()).decode()
    if kind == "md5":
        digest = hashlib.md5(usedforsecurity=False)
    elif kind == "sha256":
        digest = hashlib.sha256()
    elif kind == "gitsha1":
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(b"blob %d\0" % path.stat().st_size)
    else:
        raise ValueError(f"unknown checksum kind {kind!r}")
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(READ_CHUNK), b""):
            digest.update(block)
    if kind == "md5":
        return base64.b64encode(digest.digest()).decode()
    return digest.hexdigest()


# Parts being written by threads of this process (see StagingFolder.claim_part).
_ACTIVE_PARTS: set[str] = set()
_ACTIVE_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    # datasets.map forks its workers while our download threads run; a thread holding
    # _ACTIVE_LOCK at that instant would leave the child's copy locked forever. The
    # child writes no parent part, so it starts with an empty registry.
    global _ACTIVE_LOCK
    _ACTIVE_LOCK = threading.Lock()
    _ACTIVE_PARTS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class StagingFolder:
    """Layout of a staging folder. Process- and thread-safe (atomic renames only).

    ``<name>`` is a verified file, ``.<name>.staged.json`` its sidecar (what was
    verified), ``.<name>.<version tag>.part.<pid>.<thread>`` a download in progress.

    The folder may lie in a shared root others write to, and a part's name is
    predictable: the folders below ``base`` are made with
    :func:`dist.safepath.own_folder` (a symlink there is refused, never written
    through), a part is opened with ``O_NOFOLLOW`` and must be a regular file of one
    link (a symlink or hard link planted at its name would have had the download
    appended to its target), and a staged file counts only as a regular file.

    Args:
        root: the folder.
        base: the user's folder ``root`` lies in, which may be a symlink (the cache root
            of ``<root>/.staging/<key>``); default ``root`` itself.
    """

    def __init__(self, root: str | os.PathLike, *, base: str | os.PathLike | None = None):
        self.root = Path(root)
        self.base = self.root if base is None else Path(base)

    def make(self, *, create: bool = True) -> Path:
        """Make the folder where missing (with ``create``); its parts below :attr:`base`
        must be real folders.

        Raises:
            dist.errors.ForeignCacheFolderError: one is a symlink or not a folder.
        """
        rel = os.path.relpath(self.root, self.base)
        rel = "" if rel == "." else rel.replace(os.sep, "/")
        return own_folder(self.base, rel, create=create)

    def path(self, file: RemoteFile) -> Path:
        """Where the verified copy of ``file`` lives (whether or not it is there)."""
        return self.root / staged_name(file)

    def sidecar(self, file: RemoteFile) -> Path:
        """The JSON that vouches for :meth:`path` (the remote version it holds)."""
        return self.root / f".{staged_name(file)}.staged.json"

    def _part_prefix(self, file: RemoteFile) -> str:
        tag = hashlib.sha1(json.dumps(_ident(file), sort_keys=True).encode()).hexdigest()[:12]
        return f".{staged_name(file)}.{tag}.part."

    def is_staged(self, file: RemoteFile) -> bool:
        """The final file exists and its sidecar records this exact remote version.

        The checksum was verified when the sidecar was written; we trust it here
        rather than re-hashing a multi-GB file on every resume.
        """
        meta = read_json(self.sidecar(file))
        if not isinstance(meta, dict) or meta.get("version") != _SIDECAR_VERSION:
            return False
        if {k: meta.get(k) for k in ("url", "size", "etag", "checksum")} != _ident(file):
            return False
        try:
            st = os.lstat(self.path(file))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == file.size

    def claim_part(self, file: RemoteFile) -> tuple[Path, int]:
        """A private ``.part`` file for this thread, adopting a dead owner's partial.

        Parts are named by owner pid/thread so two downloaders never write one file; a
        part left by a killed process (pid gone) is adopted with ``os.rename``, which
        only one adopter can win, and the download resumes from its size. Release the
        claim with :meth:`done_with_part`.

        Returns:
            (part path, bytes already present).
        """
        self.make()
        prefix = self._part_prefix(file)
        mine = self.root / f"{prefix}{os.getpid()}.{threading.get_ident()}"
        with _ACTIVE_LOCK:
            if os.path.lexists(mine):
                st = os.lstat(mine)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    raise _not_a_part(mine)
                _ACTIVE_PARTS.add(str(mine))
                return mine, st.st_size
            for cand in sorted(self.root.glob(_glob_escape(prefix) + "*")):
                try:
                    pid = int(cand.name[len(prefix) :].split(".")[0])
                    st = os.lstat(cand)
                except (ValueError, OSError):
                    continue
                if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                    continue  # not a part of ours: a link someone put there stays unused
                # Ours but not being written (an earlier attempt/thread gave up), or
                # a dead process's: adoptable. A live process's: leave it alone.
                if pid == os.getpid():
                    if str(cand) in _ACTIVE_PARTS:
                        continue
                elif _pid_alive(pid):
                    continue
                try:
                    os.rename(cand, mine)
                except OSError:
                    continue  # another adopter won
                _ACTIVE_PARTS.add(str(mine))
                return mine, os.lstat(mine).st_size
            _ACTIVE_PARTS.add(str(mine))
            return mine, 0

    @staticmethod
    def done_with_part(part: Path) -> None:
        """Mark a part as no longer being written by this process."""
        with _ACTIVE_LOCK:
            _ACTIVE_PARTS.discard(str(part))

    def publish(self, file: RemoteFile, part: Path) -> Path:
        """Rename a verified part into place, then write its sidecar (both atomic)."""
        final = self.path(file)
        os.replace(part, final)
        # Durable: fsyncs the sidecar, then self.root, which holds the rename above too.
        write_json_atomic(
            self.sidecar(file),
            {"version": _SIDECAR_VERSION, **_ident(file), "staged_at": time.time()},
        )
        return final

    def remove(self, file: RemoteFile) -> None:
        """Delete the staged copy of ``file`` (idempotent)."""
        self.make(create=False)  # never unlinks through a folder swapped for a link
        # Sidecar first: a crash in between leaves a data file without a sidecar,
        # which is "not staged" and gets overwritten, never trusted.
        for p in (self.sidecar(file), self.path(file)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


@dataclasses.dataclass(frozen=True)
class _Download:
    """One file's download into one staging folder; :meth:`attempt` is one try."""

    reader: RangeReader
    file: RemoteFile
    staging: StagingFolder
    policy: RetryPolicy
    stats: FetchStats
    stop: threading.Event | None
    on_bytes: Callable[[int], object] | None

    def attempt(self) -> Path:
        """Resume or start a part, fill it, verify it and publish it.

        Raises:
            TransientError: the body was short, long or did not match the checksum.
        """
        part, have = self.staging.claim_part(self.file)
        try:
            self._fill(part, have)
            self._verify(part)
            return self.staging.publish(self.file, part)
        finally:
            StagingFolder.done_with_part(part)

    def _fill(self, part: Path, have: int) -> None:
        """Append the bytes from ``have`` on to ``part`` and fsync it."""
        file = self.file
        if have > file.size:
            part.unlink()
            have = 0
        if have:
            self.stats.add(resumed_bytes=have)
        deadline = time.monotonic() + self.policy.file_timeout
        got = 0
        try:
            with _open_part(part) as fh:
                for block in self.reader.read_range(file, have, deadline, self.stop):
                    fh.write(block)
                    got += len(block)
                    if self.on_bytes is not None:
                        self.on_bytes(len(block))
                    if self.stop is not None and self.stop.is_set():
                        raise Cancelled(file.url)
                fh.flush()
                os.fsync(fh.fileno())
        finally:
            self.stats.add(bytes=got)

    def _verify(self, part: Path) -> None:
        """Check size and checksum; drop a part that can never become right."""
        file = self.file
        size = part.stat().st_size
        if size != file.size:
            if size > file.size:
                part.unlink()
            # A short body is kept: the next attempt resumes from it and the checksum
            # over the whole file still guards what was kept.
            raise TransientError(f"size mismatch: got {size} bytes, expected {file.size}")
        kind, _, expected = file.checksum.partition(":")
        if kind:
            actual = checksum_of(part, kind)
            if actual != expected:
                part.unlink()
                raise TransientError(f"{kind} mismatch: got {actual}, expected {expected}")


def _open_part(part: Path) -> BinaryIO:
    """``part`` opened for appending, only as a regular file of one link: never through
    a symlink (``O_NOFOLLOW``), nor into a hard link to another file, that someone who
    can write in the staging folder put at its predictable name.

    Raises:
        OSError: it is not (``ELOOP`` for a symlink, ``ENXIO`` for a fifo); not
            retried, the download fails naming it.
    """
    # O_NONBLOCK: a fifo put there fails the open (ENXIO) instead of blocking it.
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
    fd = os.open(part, flags, 0o644)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise _not_a_part(part)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "ab")


def _not_a_part(part: Path) -> OSError:
    """The error for something else at a part's name (not retried: the download fails
    naming it, and it is left as it is)."""
    return FileExistsError(
        errno.EEXIST,
        "not a part of this download (a symlink, or a file with other links, at its name)",
        str(part),
    )


@overload
def stage_file(
    reader: RangeReader,
    file: RemoteFile,
    staging: StagingFolder,
    policy: RetryPolicy,
    stats: FetchStats,
    *,
    stop: threading.Event | None = None,
    on_bytes: Callable[[int], object] | None = None,
    unwanted: None = None,
) -> Path: ...  # without ``unwanted`` the file is always staged (or it raises)


@overload
def stage_file(
    reader: RangeReader,
    file: RemoteFile,
    staging: StagingFolder,
    policy: RetryPolicy,
    stats: FetchStats,
    *,
    stop: threading.Event | None = None,
    on_bytes: Callable[[int], object] | None = None,
    unwanted: Callable[[], bool] | None,
) -> Path | None: ...


def stage_file(
    reader: RangeReader,
    file: RemoteFile,
    staging: StagingFolder,
    policy: RetryPolicy,
    stats: FetchStats,
    *,
    stop: threading.Event | None = None,
    on_bytes: Callable[[int], object] | None = None,
    unwanted: Callable[[], bool] | None = None,
) -> Path | None:
    """Download ``file`` into ``staging`` verified and atomically, with retries.

    Thread-safe; several processes may stage the same file at once (each writes its own
    part; the last identical rename wins).

    Args:
        reader: reads the file's bytes from an offset (its source).
        file: what to fetch, with the size and checksum to verify.
        staging: where the verified copy goes.
        policy: retries and the per-attempt timeout.
        stats: counts bytes, resumed bytes, retries, files and download time.
        stop: abandon the download when set (raises :class:`Cancelled`).
        on_bytes: called with the size of each block received (progress bars).
        unwanted: checked when the file is not staged; True means "already consumed
            and released, do not fetch again" (returns None).

    Returns:
        The staged path, or None when ``unwanted()`` said so.

    Raises:
        SourceError: permanent failure or retries exhausted.
        Cancelled: ``stop`` was set.
    """
    if staging.is_staged(file):
        return staging.path(file)
    # Outside the retries: a symlink where the folder belongs is refused as what it is.
    staging.make()
    # Checked after is_staged: a worker writes "released" before deleting, so a file
    # that vanished between the two checks is seen as released, never fetched again.
    if unwanted is not None and unwanted():
        return None
    download = _Download(reader, file, staging, policy, stats, stop, on_bytes)
    started = time.monotonic()
    try:
        path = with_retries(
            file.url, download.attempt, policy, on_retry=lambda e: stats.add(retries=1), stop=stop
        )
    finally:
        stats.span(started, time.monotonic())
    stats.add(files=1)
    return path
