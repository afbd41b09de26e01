"""Batches in shared memory: the slots that stream workers assemble batches into.

A slot is one batch's arrays (``latents``, ``embeddings``, ``keys``, each ``rows`` long)
laid out one after the other in an anonymous shared memory file: ``memfd_create`` on
Linux (no name anywhere, nothing in ``/dev/shm``; the kernel frees it when the last
process holding it closes it or dies, SIGKILL included), an unlinked temporary file
elsewhere. The parent creates the slots and hands their descriptors to its workers over
their Unix socket (``SCM_RIGHTS``); both sides map them.

Used by :mod:`hf_pipeline.read.stream.workers` (the parent) and
:mod:`hf_pipeline.read.stream.worker` (a worker). Internal.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import tempfile

import numpy as np

__all__ = ["BatchField", "batch_fields", "layout", "map_slot", "new_slot", "slot_bytes", "views"]

#: Each array of a slot starts at a multiple of this many bytes.
_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class BatchField:
    """One array of a batch: its name, its dtype and the shape of one row."""

    name: str
    dtype: np.dtype
    row_shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize


def batch_fields(source) -> tuple[BatchField, ...]:
    """The arrays ``source.gather`` returns, as it returns them (names, dtypes, row
    shapes), from a gather of no row: nothing is read."""
    empty = np.empty(0, dtype=np.int64)
    got = source.gather(empty, empty)
    return tuple(BatchField(name, arr.dtype, tuple(arr.shape[1:])) for name, arr in got.items())


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def layout(fields: tuple[BatchField, ...], rows: int) -> list[tuple[BatchField, int]]:
    """``(field, byte offset)`` of each array of a batch of ``rows`` rows in a slot."""
    out, offset = [], 0
    for field in fields:
        out.append((field, offset))
        offset += _aligned(rows * field.row_bytes)
    return out


def slot_bytes(fields: tuple[BatchField, ...], rows: int) -> int:
    """Bytes of a slot that holds a batch of ``rows`` rows."""
    return max(1, sum(_aligned(rows * field.row_bytes) for field in fields))


def new_slot(nbytes: int) -> int:
    """A new shared memory file of ``nbytes`` (zeros), as a descriptor the caller closes."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("hf_pipeline-stream-slot", os.MFD_CLOEXEC)
    else:  # pragma: no cover - not Linux: a temporary file, unlinked at once
        fd, path = tempfile.mkstemp(prefix="hf_pipeline-stream-slot-")
        os.unlink(path)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_slot(fd: int, nbytes: int) -> mmap.mmap:
    """The slot behind ``fd`` mapped read-write (the map keeps its own descriptor: the
    caller may close ``fd``)."""
    return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def views(buf: mmap.mmap, fields: tuple[BatchField, ...], rows: int) -> dict[str, np.ndarray]:
    """The arrays of a batch of ``rows`` rows in slot ``buf`` (views: writes go to the
    slot; they keep the map open while they live)."""
    out = {}
    for field, offset in layout(fields, rows):
        count = rows * int(np.prod(field.row_shape, dtype=np.int64))
        arr = np.frombuffer(buf, dtype=field.dtype, count=count, offset=offset)
        out[field.name] = arr.reshape((rows, *field.row_shape))
    return out
