"""External sort of the caption column: parquet rows in file order -> IPC stream in key order.

Used by :func:`hf_pipeline.build.captions.write_sorted_captions`, which reads and sorts the key
column and says where each file row goes (``dest``). Here the caption column follows,
in bounded memory:

1. *scatter* (:func:`scatter`): row groups are read in parallel threads, in batches;
   each batch's kept rows are put in output order by one ``take`` and appended to the
   spill files of the output chunks they belong to (:class:`Spill`), by the reading
   thread or, with fewer row groups than threads, by the spare threads;
2. *gather* (:meth:`Spill.gather`): chunk by chunk, in parallel, a chunk's spill file is
   memory-mapped, put in key order by one ``take`` and serialized as a record batch;
3. :func:`write_ipc_stream` writes those record batches (in parallel, each at its
   offset) into one Arrow IPC stream file, published atomically.

Every step works on NumPy arrays and Arrow buffers (no Python object per row) and
releases the GIL for its heavy part (parquet decoding, ``take``, file I/O), so threads
scale on the ``num_proc`` cores.

The metadata is foreign input, so what it makes this module decode is bounded: a read
batch holds ~``_SLICE_BYTES`` of captions at most, by the file's own sizes (the
uncompressed size per row, and a dictionary page's longest value, which one row of a
dictionary-encoded page may stand for: :func:`caption_reader`); a column stored as an
Arrow dictionary is measured by its dictionary's value lengths at the indices a batch
uses before any of it is decoded
(:func:`hf_pipeline.build.caption_bounds.caption_lengths`). So 400 rows sharing one
10 MB value cost about 10 MB, not 4 GB. A caption longer than ``max_caption_bytes`` is
refused naming its row (:func:`scatter`); the rest is decoded and moved in slices of
at most ~``_SLICE_BYTES`` (a caption alone may exceed it), and a gathered chunk is cut
into pieces of at most ~``_PIECE_BYTES`` however many bytes its rows turned out to
hold. No string array with 32-bit offsets ever holds more than one slice or piece, so
none can overflow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dist.atomic import fsync_dir
from hf_pipeline.build.caption_bounds import (
    as_large_string,
    byte_slices,
    caption_lengths,
    text_offsets,
    too_long,
)
from hf_pipeline.errors import MetadataError

__all__ = [
    "MAX_CHUNKS",
    "Spill",
    "caption_reader",
    "default_chunk_rows",
    "open_parquet",
    "scatter",
    "write_ipc_stream",
]

_T = TypeVar("_T")

#: Target caption bytes of one output chunk: what one gather task holds (about 3x).
_CHUNK_BYTES = 64 * 2**20
#: At most this many chunks (spill files open at once); beyond, chunks grow instead.
MAX_CHUNKS = 256
#: Rows per parquet read batch (~13 MB of COYO captions), and the read buffer: without
#: one, the parquet reader loads a whole column chunk (a row group's captions) at once.
_BATCH_ROWS = 32768
_READ_BUFFER = 4 * 2**20
#: Caption bytes decoded, taken and spilled at once (a caption alone may exceed it), and
#: what a read batch of a plain-encoded column holds at most by the file's own sizes.
_SLICE_BYTES = 64 * 2**20
#: Caption bytes of one gathered record batch at most (a caption alone may exceed it):
#: a chunk whose rows hold more than the estimate said is gathered in pieces.
_PIECE_BYTES = 2 * _CHUNK_BYTES
#: Bytes per write call. Measured on the 2-core VM of README's Performance section: 4.5 GB
#: written in 64 MiB calls cost 5-7 s of CPU, in 256 KiB calls 1.2-2 s.
_IO_BYTES = 256 * 1024
#: End of an IPC stream: continuation marker, then a zero metadata length.
_STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def open_parquet(path: str, *, metadata=None, read_dictionary=None):
    """A ``pq.ParquetFile`` set up for streaming: not memory-mapped (read pages count in
    the page cache, not in this process's RSS), buffered reads and no pre-buffering (else
    the reader loads a whole column chunk — a row group's captions — at once)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(
        path,
        metadata=metadata,
        memory_map=False,
        buffer_size=_READ_BUFFER,
        pre_buffer=False,
        read_dictionary=read_dictionary,
    )


def caption_reader(path: str, meta, caption_column: str, rg: int) -> tuple[Any, int]:
    """A reader of row group ``rg``'s captions, and its batch size in rows: a batch
    decodes ~``_SLICE_BYTES`` of captions at most, by the file's own sizes.

    Plain-encoded values take in the file (uncompressed) the bytes they decode to, so
    the column chunk's uncompressed size per row sizes the batches (COYO's ~400-byte
    captions: the full ``_BATCH_ROWS``). A dictionary-encoded page stores per row an
    index into the column chunk's dictionary page, so one row may decode to that
    page's longest value (400 rows of one 10 MB value: 4 GB from a 3 KB file): when
    the chunk has a dictionary page, its longest value is measured first, by reading
    one row as a dictionary (the page is decoded once, nothing expanded), and bounds
    the batch too. Not read as a dictionary throughout: Arrow's dictionary reader
    hashes the values of the pages that fell back to plain encoding (every page after
    the first ~1 MiB of distinct captions, as pyarrow writes COYO's) into a dictionary
    that grows over the whole column chunk (1.6 against 0.5 s and 535 against 155 MB
    for 1M rows). A column stored as an Arrow dictionary (a pandas categorical) reads as
    one batch by batch, each measured before it is decoded (:func:`caption_lengths`).

    Args:
        path: the parquet file.
        meta: its ``FileMetaData``.
        caption_column: the caption column's name.
        rg: the row group.

    Returns:
        ``(ParquetFile, rows per batch)``; the caller closes the file.

    Raises:
        pa.ArrowInvalid, OSError: the dictionary page cannot be read.
    """
    group = meta.row_group(rg)
    chunk = next(
        (
            group.column(j)
            for j in range(group.num_columns)
            if group.column(j).path_in_schema == caption_column
        ),
        None,
    )
    rows = _BATCH_ROWS
    if chunk is None or not group.num_rows:
        return open_parquet(path, metadata=meta), rows
    size = chunk.total_uncompressed_size
    if size > 0:
        rows = min(rows, max(1, _SLICE_BYTES * group.num_rows // size))
    stored = meta.schema.to_arrow_schema().field(caption_column).type
    if (
        chunk.has_dictionary_page
        and chunk.physical_type == "BYTE_ARRAY"
        and not pa.types.is_dictionary(stored)
    ):
        probe = open_parquet(path, metadata=meta, read_dictionary=[caption_column])
        try:
            batches = probe.iter_batches(
                batch_size=1, row_groups=[rg], columns=[caption_column], use_threads=False
            )
            first = next(batches, None)
        finally:
            probe.close()
        if first is not None and pa.types.is_dictionary(first.column(0).type):
            values = first.column(0).dictionary
            longest = int(np.diff(text_offsets(values)).max()) if len(values) else 0
            rows = min(rows, max(1, _SLICE_BYTES // max(longest, 1)))
    return open_parquet(path, metadata=meta), int(rows)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How a spilled chunk is gathered: its rows' offsets in the ``.data`` file (arrival
    order), ``order`` (output position -> arrival index), the output's validity (None:
    no nulls) and its pieces (output row ranges)."""

    chunk: int
    offsets: np.ndarray
    order: np.ndarray
    valid: np.ndarray | None
    pieces: list[tuple[int, int]]


class Spill:
    """Spill files of the external sort: per output chunk, the caption bytes of its rows
    (``.data``) and per row its position in the chunk and byte length (``.rows``, int32
    pairs; a null caption has length ``-1 - bytes``), both appended in arrival order.

    Raw bytes rather than Arrow IPC: the gather maps a chunk's ``.data`` as one buffer
    and builds the string array over it with no copy. ``write`` is thread-safe (a lock
    per chunk); ``gather`` runs after all writes.
    """

    def __init__(self, folder: Path, *, total: int, chunk_rows: int):
        self.folder = folder
        self.total = total
        self.chunk_rows = chunk_rows
        self.num_chunks = -(-total // chunk_rows)
        self._fds: list[tuple[int, ...] | None] = [None] * self.num_chunks
        self._locks = [threading.Lock() for _ in range(self.num_chunks)]

    def _paths(self, chunk: int) -> tuple[Path, Path]:
        stem = self.folder / f"chunk-{chunk:06d}"
        return stem.with_suffix(".data"), stem.with_suffix(".rows")

    def write(self, dest: np.ndarray, captions: pa.Array, valid: np.ndarray | None) -> None:
        """Append the rows whose output positions are ``dest`` (sorted, unique).

        Args:
            dest: output positions, sorted and unique.
            captions: their captions, large_string (a validity bitmap is not read).
            valid: which captions are not null (None: all).
        """
        n = len(captions)
        offsets = np.frombuffer(
            captions.buffers()[1], dtype=np.int64, count=n + 1, offset=captions.offset * 8
        )
        values = captions.buffers()[2]
        data = memoryview(values) if values is not None else memoryview(b"")
        rows = np.empty((n, 2), dtype=np.int32)
        np.subtract(offsets[1:], offsets[:-1], out=rows[:, 1], casting="unsafe")
        if valid is not None:
            np.subtract(-1, rows[:, 1], out=rows[:, 1], where=~valid)
        size = self.chunk_rows
        lo_chunk, hi_chunk = int(dest[0]) // size, int(dest[-1]) // size
        cuts = np.searchsorted(dest, np.arange(lo_chunk, hi_chunk + 2) * size)
        for i, chunk in enumerate(range(lo_chunk, hi_chunk + 1)):
            a, b = int(cuts[i]), int(cuts[i + 1])
            if a == b:
                continue
            np.subtract(dest[a:b], chunk * size, out=rows[a:b, 0], casting="unsafe")
            with self._locks[chunk]:
                fds = self._fds[chunk]
                if fds is None:
                    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
                    fds = self._fds[chunk] = tuple(
                        os.open(p, flags, 0o600) for p in self._paths(chunk)
                    )
                _write_all(fds[0], data[int(offsets[a]) : int(offsets[b])])
                _write_all(fds[1], rows[a:b].data.cast("B"))

    def _close_files(self) -> None:
        for i, fds in enumerate(self._fds):
            if fds is not None:
                for fd in fds:
                    os.close(fd)
                self._fds[i] = None

    def _plan(self, chunk: int) -> _Plan:
        """A chunk's rows in key order, from its ``.rows`` file (8 bytes a row)."""
        n = min(self.chunk_rows, self.total - chunk * self.chunk_rows)
        _, rows_path = self._paths(chunk)
        rows = np.fromfile(rows_path, dtype=np.int32).reshape(-1, 2)
        if rows.shape[0] != n:  # internal invariant: every kept row was spilled once
            raise AssertionError(f"chunk {chunk}: {rows.shape[0]} rows spilled, {n} expected")
        lengths = rows[:, 1].astype(np.int64)
        valid = lengths >= 0
        null_count = int(n - np.count_nonzero(valid))
        np.copyto(lengths, -1 - lengths, where=~valid)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        order = np.empty(n, dtype=np.int64)
        order[rows[:, 0]] = np.arange(n)
        del rows
        return _Plan(
            chunk=chunk,
            offsets=offsets,
            order=order,
            valid=valid[order] if null_count else None,
            pieces=byte_slices(lengths[order], _PIECE_BYTES),
        )

    def _piece(self, plan: _Plan, lo: int, hi: int) -> pa.Array:
        """Output rows ``lo:hi`` of a planned chunk, in key order."""
        n = len(plan.order)
        data_path, _ = self._paths(plan.chunk)
        order = pa.array(plan.order[lo:hi])
        if plan.offsets[-1] == 0:  # only empty or null captions: nothing to map or move
            out = pa.LargeStringArray.from_buffers(
                hi - lo, pa.py_buffer(np.zeros(hi - lo + 1, dtype=np.int64)), pa.py_buffer(b"")
            )
        else:
            # Mapped, not read: no copy; the pages leave this process's RSS with the map.
            with pa.memory_map(str(data_path), "r") as src:
                arr = pa.LargeStringArray.from_buffers(
                    n, pa.py_buffer(plan.offsets), src.read_buffer()
                )
                out = pc.take(arr, order)
                del arr
        if plan.valid is not None:
            valid = plan.valid[lo:hi]
            null_count = int(valid.size - np.count_nonzero(valid))
            if null_count:
                validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
                _, out_offsets, out_values = out.buffers()
                out = pa.LargeStringArray.from_buffers(
                    hi - lo, out_offsets, out_values or pa.py_buffer(b""), validity, null_count
                )
        return out

    def gather(self, num_proc: int, finish: Callable[[int, pa.Array], _T]) -> Iterator[_T]:
        """Yield ``finish(first output position, captions in key order)`` piece by piece,
        in order: a chunk is one piece unless its captions hold more than
        ``_PIECE_BYTES`` (the chunk size is an estimate). ``finish`` runs in the
        gathering thread. At most ``num_proc`` + 1 pieces are in flight."""
        self._close_files()

        def one(plan: _Plan, lo: int, hi: int) -> _T:
            return finish(plan.chunk * self.chunk_rows + lo, self._piece(plan, lo, hi))

        def done(fut, last_of: int | None) -> _T:
            result = fut.result()
            if last_of is not None:  # the chunk's pieces are all done: its spill can go
                for path in self._paths(last_of):
                    path.unlink()
            return result

        with ThreadPoolExecutor(num_proc, thread_name_prefix="caption-gather") as pool:
            pending: deque = deque()
            try:
                for chunk in range(self.num_chunks):
                    plan = self._plan(chunk)
                    for i, (lo, hi) in enumerate(plan.pieces):
                        last = chunk if i == len(plan.pieces) - 1 else None
                        pending.append((pool.submit(one, plan, lo, hi), last))
                        if len(pending) > num_proc:
                            yield done(*pending.popleft())
                while pending:
                    yield done(*pending.popleft())
            finally:
                for fut, _ in pending:
                    fut.cancel()

    def close(self) -> None:
        """Close any open spill file and remove the spill folder (idempotent)."""
        self._close_files()
        shutil.rmtree(self.folder, ignore_errors=True)


def _take_text(arr: pa.Array, indices: np.ndarray) -> tuple[pa.Array, np.ndarray | None]:
    """``take`` on a text array, as ``(large_string values, valid mask or None when no
    nulls)``; the values' validity bitmap, if any, is not to be read.

    Arrow's ``take`` on strings is several times slower when the array has a validity
    bitmap and the indices are random, so the values are taken without it (a null
    slot's bytes ride along, unused) and the mask is taken with NumPy. A dictionary
    array's indices are taken, then decoded (:func:`as_large_string`): only the rows
    taken are decoded.
    """
    valid = None
    if arr.null_count:
        valid = arr.is_valid().to_numpy(zero_copy_only=False)[indices]
    if pa.types.is_dictionary(arr.type):
        return as_large_string(pc.take(arr, pa.array(indices))), valid
    arr = as_large_string(arr)
    if valid is not None:
        arr = pa.LargeStringArray.from_buffers(
            len(arr), arr.buffers()[1], arr.buffers()[2], None, 0, arr.offset
        )
    return pc.take(arr, pa.array(indices)), valid


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data[:_IO_BYTES]) :]


def scatter(
    pf,
    path: str,
    caption_column: str,
    dest: np.ndarray,
    spill: Spill,
    num_proc: int,
    *,
    max_caption_bytes: int,
    key_at: Callable[[int], object] | None = None,
) -> None:
    """Stream the caption column into ``spill`` with ``num_proc`` threads.

    A thread per row group decodes it (up to ``num_proc``). With fewer row groups than
    threads (a file written as one row group is common: pyarrow's default was 64Mi rows
    before 15.0), the other threads place the decoded batches (``take``, spill writes)
    while the readers decode on: otherwise one thread would do all of it. At most
    2 batches a placing thread are in flight (bounded memory).

    Each batch is measured (:func:`caption_lengths`) as soon as it is read, before any
    of it is decoded (a dictionary column) or moved: a caption longer than
    ``max_caption_bytes`` stops the whole scatter.

    Args:
        pf: the metadata's ``ParquetFile`` (its metadata is used).
        path: the metadata file, for the readers and messages.
        caption_column: the caption column.
        dest: per file row, its output position (-1: dropped).
        spill: where the kept rows go.
        num_proc: threads.
        max_caption_bytes: the longest caption accepted, in bytes.
        key_at: the key of a file row, for the refusal's message (None: not named).

    Raises:
        MetadataError: the column cannot be read, a row group does not hold the rows
            the file's metadata says, or a caption is longer than ``max_caption_bytes``.
    """

    meta = pf.metadata
    starts = np.zeros(meta.num_row_groups + 1, dtype=np.int64)
    np.cumsum([meta.row_group(i).num_rows for i in range(meta.num_row_groups)], out=starts[1:])
    stop = threading.Event()
    readers = max(1, min(meta.num_row_groups, num_proc))
    placers = num_proc - readers
    in_flight = threading.BoundedSemaphore(max(1, 2 * placers))
    place_pool = (
        ThreadPoolExecutor(placers, thread_name_prefix="caption-place") if placers else None
    )

    def measure(column: pa.Array, first_row: int, rg: int) -> np.ndarray:
        try:
            lengths = caption_lengths(column)
        except ValueError as exc:
            raise MetadataError(
                path, f"cannot read column {caption_column!r} (row group {rg}): {exc}"
            ) from None
        over = np.flatnonzero(lengths > max_caption_bytes)
        if over.size:
            row = first_row + int(over[0])
            key = key_at(row) if key_at is not None else None
            raise MetadataError(
                path,
                too_long(caption_column, row, key, int(lengths[over[0]]), max_caption_bytes),
            )
        return lengths

    def place(column: pa.Array, d: np.ndarray, lengths: np.ndarray) -> None:
        keep = np.flatnonzero(d >= 0)
        if not keep.size:
            return
        d = d[keep]
        order = np.argsort(d)
        rows, d = keep[order], d[order]
        if not pa.types.is_dictionary(column.type):
            column = as_large_string(column)  # once a batch: a cast copies the offsets
        # Taken (a dictionary: decoded) and spilled a slice at a time: a batch of a
        # dictionary column may stand for far more text than the file holds.
        for lo, hi in byte_slices(lengths[rows], _SLICE_BYTES):
            spill.write(d[lo:hi], *_take_text(column, rows[lo:hi]))

    def place_released(column: pa.Array, d: np.ndarray, lengths: np.ndarray) -> None:
        try:
            if not stop.is_set():
                place(column, d, lengths)
        finally:
            in_flight.release()

    def one_row_group(rg: int) -> None:
        # A reader per thread: a ParquetFile is not documented as thread-safe. Not memory
        # mapped, so the file's pages never count in this process's RSS.
        try:
            reader, batch_rows = caption_reader(path, meta, caption_column, rg)
        except (pa.ArrowInvalid, OSError) as exc:
            raise MetadataError(
                path, f"cannot read column {caption_column!r} (row group {rg}): {exc}"
            ) from None
        row = int(starts[rg])
        placed: deque = deque()
        try:
            batches = reader.iter_batches(
                batch_size=batch_rows, row_groups=[rg], columns=[caption_column], use_threads=False
            )
            while True:
                if stop.is_set():
                    return  # another task failed: its error is the one raised
                try:
                    batch = next(batches, None)
                except (pa.ArrowInvalid, OSError) as exc:
                    # Only reading is the metadata file's fault; a failed spill write
                    # (a full disk) propagates as the OSError it is.
                    raise MetadataError(
                        path, f"cannot read column {caption_column!r} (row group {rg}): {exc}"
                    ) from None
                if batch is None or row + batch.num_rows > starts[rg + 1]:
                    break
                column = batch.column(0)
                lengths = measure(column, row, rg)
                d = dest[row : row + batch.num_rows]
                row += batch.num_rows
                if place_pool is None:
                    place(column, d, lengths)
                    continue
                in_flight.acquire()
                # The batch stays referenced here until placed, so that its buffers are
                # freed by this thread, which allocated them: freed by another thread
                # they went back to the allocator lazily (peak RSS 4.9 GB against 0.8 GB
                # for one 11M-row group).
                placed.append((place_pool.submit(place_released, column, d, lengths), batch))
                while placed and placed[0][0].done():
                    placed.popleft()[0].result()  # a failed placement stops this reader
            while placed:
                placed.popleft()[0].result()
        finally:
            reader.close()
        if row != starts[rg + 1]:
            raise MetadataError(
                path,
                f"row group {rg} of column {caption_column!r} does not hold the "
                f"{int(starts[rg + 1] - starts[rg])} rows its metadata says",
            )

    try:
        with ThreadPoolExecutor(readers, thread_name_prefix="caption-scatter") as pool:
            futures = [pool.submit(one_row_group, rg) for rg in range(meta.num_row_groups)]
            try:
                for fut in futures:
                    fut.result()
            except BaseException:
                stop.set()
                for fut in futures:
                    fut.cancel()
                raise
    finally:
        if place_pool is not None:
            place_pool.shutdown(wait=True)


def default_chunk_rows(pf, path: str, caption_column: str) -> int:
    """Rows per output chunk for ~``_CHUNK_BYTES`` of captions, from the file's own sizes.

    The parquet metadata's uncompressed size is the plain-encoded size, but a dictionary
    encoded column counts each distinct caption once; the lengths of a sample of the
    first rows (read as :func:`caption_reader` says, measured by
    :func:`caption_lengths`) cover that case. The gather cuts a chunk that holds more than the
    estimate said into pieces, so a wrong estimate costs speed, not memory.
    """
    meta = pf.metadata
    if meta.num_rows == 0:
        return 1
    estimate = 0.0
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        for j in range(rg.num_columns):
            if rg.column(j).path_in_schema == caption_column:
                estimate += rg.column(j).total_uncompressed_size
    estimate /= meta.num_rows
    first = next(i for i in range(meta.num_row_groups) if meta.row_group(i).num_rows)
    try:
        reader, batch_rows = caption_reader(path, meta, caption_column, first)
    except (pa.ArrowInvalid, OSError) as exc:
        raise MetadataError(path, f"cannot read column {caption_column!r}: {exc}") from None
    try:
        batches = reader.iter_batches(
            batch_size=min(4096, batch_rows), row_groups=[first], columns=[caption_column]
        )
        sample = next(batches, None)
        lengths = caption_lengths(sample.column(0)) if sample is not None else None
    except (pa.ArrowInvalid, OSError, ValueError) as exc:
        raise MetadataError(path, f"cannot read column {caption_column!r}: {exc}") from None
    finally:
        reader.close()
    if lengths is not None and lengths.size:
        estimate = max(estimate, float(lengths.sum()) / lengths.size)
    return max(1024, int(_CHUNK_BYTES // max(estimate, 1.0)))


def write_ipc_stream(
    path: Path, schema: pa.Schema, messages: Iterable[pa.Buffer], *, num_proc: int = 1
) -> None:
    """Write an Arrow IPC stream file of serialized record batches, and publish it
    atomically as ``dist.atomic.atomic_write`` does (same temp name, fsync,
    ``os.replace``, fsync the folder).

    Each message's place in the file is known as soon as the ones before it are
    serialized, so ``num_proc`` threads write them (``pwrite``) at once: one writer
    thread is what bounded the whole step at GBs of captions.

    Args:
        path: the file to publish.
        schema: the stream's schema.
        messages: ``RecordBatch.serialize()`` buffers, in file order.
        num_proc: threads writing.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            head = schema.serialize()
            _pwrite_all(fd, head, 0)
            offset = head.size
            with ThreadPoolExecutor(num_proc, thread_name_prefix="caption-write") as pool:
                pending: deque = deque()
                for message in messages:
                    pending.append(pool.submit(_pwrite_all, fd, message, offset))
                    offset += message.size
                    if len(pending) > num_proc:
                        pending.popleft().result()
                while pending:
                    pending.popleft().result()
            _pwrite_all(fd, _STREAM_END, offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def _pwrite_all(fd: int, data: pa.Buffer | bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view[:_IO_BYTES], offset)
        view, offset = view[done:], offset + done
