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
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dist.atomic import fsync_dir
from hf_pipeline.errors import MetadataError

__all__ = [
    "MAX_CHUNKS",
    "Spill",
    "as_large_string",
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
#: Bytes per write call. Measured on the 2-core VM of README's Performance section: 4.5 GB
#: written in 64 MiB calls cost 5-7 s of CPU, in 256 KiB calls 1.2-2 s.
_IO_BYTES = 256 * 1024
#: End of an IPC stream: continuation marker, then a zero metadata length.
_STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def open_parquet(path: str, *, metadata=None):
    """A ``pq.ParquetFile`` set up for streaming: not memory-mapped (read pages count in
    the page cache, not in this process's RSS), buffered reads and no pre-buffering (else
    the reader loads a whole column chunk — a row group's captions — at once)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(
        path, metadata=metadata, memory_map=False, buffer_size=_READ_BUFFER, pre_buffer=False
    )


def as_large_string(arr: pa.Array) -> pa.Array:
    """``arr`` as ``large_string`` (64-bit offsets: the production caption column holds
    more than 2 GiB of text); a cast copies only the offsets."""
    return arr if pa.types.is_large_string(arr.type) else arr.cast(pa.large_string())


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
            captions: their captions, large_string without a validity bitmap.
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

    def _gather_one(self, chunk: int) -> pa.Array:
        n = min(self.chunk_rows, self.total - chunk * self.chunk_rows)
        data_path, rows_path = self._paths(chunk)
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
        del rows, lengths
        if offsets[-1] == 0:  # only empty or null captions: nothing to map or move
            out = pa.LargeStringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(b""))
        else:
            # Mapped, not read: no copy; the pages leave this process's RSS with the map.
            with pa.memory_map(str(data_path), "r") as src:
                arr = pa.LargeStringArray.from_buffers(n, pa.py_buffer(offsets), src.read_buffer())
                out = pc.take(arr, pa.array(order))
                del arr
        if null_count:
            validity = pa.py_buffer(np.packbits(valid[order], bitorder="little"))
            _, out_offsets, out_values = out.buffers()
            out = pa.LargeStringArray.from_buffers(
                n, out_offsets, out_values or pa.py_buffer(b""), validity, null_count
            )
        data_path.unlink()
        rows_path.unlink()
        return out

    def gather(self, num_proc: int, finish: Callable[[int, pa.Array], _T]) -> Iterator[_T]:
        """Yield ``finish(first output position, captions in key order)`` chunk by chunk,
        in order; ``finish`` runs in the gathering thread. At most ``num_proc`` + 1
        chunks are in flight."""
        self._close_files()

        def one(chunk: int) -> _T:
            return finish(chunk * self.chunk_rows, self._gather_one(chunk))

        with ThreadPoolExecutor(num_proc, thread_name_prefix="caption-gather") as pool:
            pending: deque = deque()
            try:
                for chunk in range(self.num_chunks):
                    pending.append(pool.submit(one, chunk))
                    if len(pending) > num_proc:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            finally:
                for fut in pending:
                    fut.cancel()

    def close(self) -> None:
        """Close any open spill file and remove the spill folder (idempotent)."""
        self._close_files()
        shutil.rmtree(self.folder, ignore_errors=True)


def _take_text(arr: pa.Array, indices: np.ndarray) -> tuple[pa.Array, np.ndarray | None]:
    """``take`` on a text array, as ``(large_string values without validity, valid mask
    or None when no nulls)``.

    Arrow's ``take`` on strings is several times slower when the array has a validity
    bitmap and the indices are random, so the values are taken without it (a null
    slot's bytes ride along, unused) and the mask is taken with NumPy.
    """
    arr = as_large_string(arr)
    if not arr.null_count:
        return pc.take(arr, pa.array(indices)), None
    valid = arr.is_valid().to_numpy(zero_copy_only=False)[indices]
    bare = pa.LargeStringArray.from_buffers(
        len(arr), arr.buffers()[1], arr.buffers()[2], None, 0, arr.offset
    )
    return pc.take(bare, pa.array(indices)), valid


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data[:_IO_BYTES]) :]


def scatter(
    pf, path: str, caption_column: str, dest: np.ndarray, spill: Spill, num_proc: int
) -> None:
    """Stream the caption column into ``spill`` with ``num_proc`` threads.

    A thread per row group decodes it (up to ``num_proc``). With fewer row groups than
    threads (a file written as one row group is common: pyarrow's default was 64Mi rows
    before 15.0), the other threads place the decoded batches (``take``, spill writes)
    while the readers decode on: otherwise one thread would do all of it. At most
    2 batches a placing thread are in flight (bounded memory).
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

    def place(column: pa.Array, d: np.ndarray) -> None:
        keep = np.flatnonzero(d >= 0)
        if keep.size:
            d = d[keep]
            order = np.argsort(d)
            spill.write(d[order], *_take_text(column, keep[order]))

    def place_released(column: pa.Array, d: np.ndarray) -> None:
        try:
            if not stop.is_set():
                place(column, d)
        finally:
            in_flight.release()

    def one_row_group(rg: int) -> None:
        # A reader per thread: a ParquetFile is not documented as thread-safe. Not memory
        # mapped, so the file's pages never count in this process's RSS.
        reader = open_parquet(path, metadata=meta)
        row = int(starts[rg])
        placed: deque = deque()
        try:
            batches = reader.iter_batches(
                batch_size=_BATCH_ROWS, row_groups=[rg], columns=[caption_column], use_threads=False
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
                d = dest[row : row + batch.num_rows]
                row += batch.num_rows
                if place_pool is None:
                    place(batch.column(0), d)
                    continue
                in_flight.acquire()
                # The batch stays referenced here until placed, so that its buffers are
                # freed by this thread, which allocated them: freed by another thread
                # they went back to the allocator lazily (peak RSS 4.9 GB against 0.8 GB
                # for one 11M-row group).
                placed.append((place_pool.submit(place_released, batch.column(0), d), batch))
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
    encoded column counts each distinct caption once; a decoded sample of the first rows
    covers that case.
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
    try:
        sample = next(pf.iter_batches(batch_size=4096, columns=[caption_column]), None)
    except (pa.ArrowInvalid, OSError) as exc:
        raise MetadataError(path, f"cannot read column {caption_column!r}: {exc}") from None
    if sample is not None and sample.num_rows:
        text = pc.sum(pc.binary_length(as_large_string(sample.column(0)))).as_py() or 0
        estimate = max(estimate, text / sample.num_rows)
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
