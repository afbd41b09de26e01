"""Whole-file checksums of cache files: xxh3_128, one file or many in parallel.

A marker (:mod:`dist.markers`, schema 2) records each file's :func:`whole_checksum`
besides its cheap edge checksum; ``prebuild_cache.py --verify`` recomputes them with
:func:`hash_files`. xxhash releases the GIL while it hashes a buffer, and so does the
read, so threads hash files in parallel (measured: a Python thread kept ~95% of its
speed while another hashed). Costs: docs/integrity.md.

Thread-safe: no shared state.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import xxhash

__all__ = [
    "ALGORITHM",
    "BLOCK_ALGORITHM",
    "block_digest",
    "default_workers",
    "hash_files",
    "hashed_problem",
    "whole_checksum",
]

#: What :func:`whole_checksum` computes (docs and messages say it; markers pin it by
#: their schema version).
ALGORITHM = "xxh3_128"
#: A path type :func:`hash_files` hands back unchanged.
_P = TypeVar("_P", bound="str | os.PathLike[str]")
#: What :func:`block_digest` computes: the per-block checksums a published cache's
#: stream index carries (8 bytes a block keeps the index small; a block is a few rows).
BLOCK_ALGORITHM = "xxh3_64"
#: The read size: a buffer that stays in a core's L2, so that each byte crosses memory
#: once (read from the page cache) rather than three times (copied into an 8 MiB buffer,
#: written back, read by the hash). On a 16-CPU H200 host's tmpfs, 16 threads: 1 MiB
#: 43.6-50.3 GB/s, 2 MiB 48.5-49.4, 8 MiB 39.9-41.2, 256 KiB 19.2-20.5 (per-call cost);
#: 8 threads 36.5-39.8 / 35.2-38.4 / 32.9-33.8 / 22.9-31.3 (benchmarks/NOTES.md).
_CHUNK = 1 << 20


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of the regular file at ``path`` (symlinks followed),
    opened without blocking: a fifo in a file's place (others can write the folder)
    made every reader wait forever (an adversarial tester).

    Raises:
        OSError: missing or unreadable; EINVAL when it is not a regular file (closed).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
    return fd


def whole_checksum(
    path: str | os.PathLike[str],
    on_bytes: Callable[[int], object] | None = None,
    *,
    chunk_bytes: int = _CHUNK,
    expected_size: int | None = None,
) -> tuple[int, str]:
    """Size and xxh3_128 (hex) of every byte of ``path``, read once front to back.

    Args:
        path: the file.
        on_bytes: called with the byte count of each chunk read (a progress bar).
        chunk_bytes: the read size (the digest does not depend on it).
        expected_size: a file larger than this is not read: ``(its size, "")`` (a sparse
            1 TB file in a 2 KB file's place kept verify reading; an adversarial tester).

    A path that is not a regular file (a fifo, whose open would wait forever; a
    device) raises ``OSError`` (EINVAL) without being read.

    Returns:
        ``(bytes read, hex digest)``; the byte count is what was read, so a file that
        shrank or grew under us is told apart from a recorded size by the caller.

    Raises:
        OSError: the file cannot be opened or read.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    h = xxhash.xxh3_128()
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    size = 0
    fd = open_regular(path)
    with open(fd, "rb", buffering=0) as fh:
        st_size = os.fstat(fd).st_size
        if expected_size is not None and st_size > expected_size:
            return st_size, ""
        while n := fh.readinto(view):
            h.update(view[:n])
            size += n
            if on_bytes is not None:
                on_bytes(n)
    return size, h.hexdigest()


def block_digest(data: bytes | memoryview | Any) -> int:
    """xxh3_64 of one block of bytes (``bytes``, ``memoryview`` or a contiguous NumPy
    array), as an unsigned 64-bit int. Releases the GIL while hashing."""
    return xxhash.xxh3_64_intdigest(data)


def default_workers() -> int:
    """Hashing threads: one per core, at least 2 (a read waiting on the disk or NFS
    overlaps another's hashing), at most 16 (on a 16-CPU host's page cache 16 threads
    hashed 1.3x what 8 did: 48-50 against 37-40 GB/s; beyond, reads queue on one disk)."""
    return max(2, min(16, os.cpu_count() or 1))


def hash_files(
    paths: Iterable[_P],
    *,
    workers: int | None = None,
    on_bytes: Callable[[int], object] | None = None,
    chunk_bytes: int = _CHUNK,
    expected_sizes: Iterable[int | None] | None = None,
) -> Iterator[tuple[_P, int, str | OSError]]:
    """:func:`whole_checksum` of each path, ``workers`` files at a time.

    Yields ``(path, bytes read, hex digest)`` in the order of ``paths``; an unreadable
    file yields its ``OSError`` in the digest's place (the others are still hashed).
    ``on_bytes`` is called from the worker threads; ``chunk_bytes`` is each read's size.
    Closing the generator early (an
    error or Ctrl-C in the consumer) stops the threads within one chunk.
    """
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    paths = list(paths)
    if not paths:
        return
    sizes = [None] * len(paths) if expected_sizes is None else list(expected_sizes)
    if len(sizes) != len(paths):
        raise ValueError(f"{len(sizes)} expected sizes for {len(paths)} paths")
    stop = threading.Event()

    def chunk(n: int) -> None:
        if stop.is_set():  # the consumer left (an error, Ctrl-C): abandon this file
            raise _Stopped
        if on_bytes is not None:
            on_bytes(n)

    def one(path: _P, expected: int | None) -> tuple[int, str | OSError]:
        try:
            return whole_checksum(path, chunk, chunk_bytes=chunk_bytes, expected_size=expected)
        except OSError as e:
            return 0, e

    pool = ThreadPoolExecutor(min(workers, len(paths)), thread_name_prefix="dist-hash")
    try:
        futures = [pool.submit(one, p, n) for p, n in zip(paths, sizes, strict=True)]
        for path, future in zip(paths, futures, strict=True):
            size, digest = future.result()
            yield path, size, digest
    finally:
        stop.set()  # a running hash stops at its next chunk, queued ones never start
        pool.shutdown(wait=True, cancel_futures=True)


class _Stopped(Exception):
    """Raised inside a hashing thread when the consumer has gone."""


def hashed_problem(
    size: int, digest: str | OSError, *, expected_size: int, expected: str
) -> str | None:
    """What is wrong with a file :func:`hash_files` read as ``(size, digest)`` against
    the size and whole-file checksum a marker recorded for it, in the words every report
    uses (``"unreadable (...)"``, ``"has N bytes, expected M"``, ``"whole-file checksum
    mismatch (xxh3_128)"``); None when it matches."""
    if isinstance(digest, OSError):
        return f"unreadable ({digest.strerror or digest})"
    if size != expected_size:
        return f"has {size} bytes, expected {expected_size}"
    if digest != expected:
        return f"whole-file checksum mismatch ({ALGORITHM})"
    return None
