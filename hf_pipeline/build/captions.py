"""The caption metadata table: read, validate, deduplicate, look up, classify.

The production parquet has ~10M rows and ~4 GB of captions, so everything here is
vectorized: keys live in sorted ``np.int64`` arrays, captions in Arrow string arrays
aligned with them, and a lookup is ``np.searchsorted`` plus ``pyarrow.compute.take``.
No per-row Python object.

:func:`write_sorted_captions` writes the key-sorted table to an Arrow IPC file chunk by
chunk (an external sort: bounded memory, parallel) and each ``datasets`` map worker
memory-maps it (:meth:`CaptionTable.open`), so GBs of captions are neither held,
pickled nor copied per process. :func:`read_captions` builds the same table in memory.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hf_pipeline.build.accounting import sorted_unique
from hf_pipeline.build.caption_bounds import as_large_string, caption_lengths, too_long
from hf_pipeline.build.caption_sort import (
    MAX_CHUNKS,
    Spill,
    default_chunk_rows,
    open_parquet,
    scatter,
    write_ipc_stream,
)
from hf_pipeline.errors import MetadataError

__all__ = [
    "BAD_CAPTION_ENCODING",
    "EMPTY_CAPTION",
    "KEEP",
    "MAX_CAPTION_BYTES",
    "NO_CAPTION",
    "REASONS",
    "CaptionTable",
    "caption_texts",
    "classify",
    "read_captions",
    "reason_names",
    "write_sorted_captions",
]

#: Reason code 0: the row is kept.
KEEP = ""
#: The key has no metadata row, or its caption is null.
NO_CAPTION = "no_caption"
#: The caption is empty or whitespace only.
EMPTY_CAPTION = "empty_caption"
#: The caption's bytes are not UTF-8 although its column is typed string (a writer that
#: did not validate): it cannot be tokenized, so it costs its row, not the build.
BAD_CAPTION_ENCODING = "bad_caption_encoding"
#: The longest caption accepted by default, in bytes (``data.max_caption_bytes``'s default):
#: COYO's captions hold a few hundred bytes, and the encoder tokenizes only a caption's
#: first ``max(65536, 16 x max_length)`` characters anyway.
MAX_CAPTION_BYTES = 1 << 20
#: Reason names indexed by the codes :func:`classify` returns (``REASONS[code]``).
REASONS: tuple[str, ...] = (KEEP, NO_CAPTION, EMPTY_CAPTION, BAD_CAPTION_ENCODING)

log = logging.getLogger(__name__)

_CODE_KEEP, _CODE_NO_CAPTION, _CODE_EMPTY, _CODE_BAD_ENCODING = 0, 1, 2, 3
_IPC_KEY, _IPC_CAPTION = "key", "caption"
_COUNTS_META = b"hf_pipeline.caption_counts"
_FILE_MAGIC = b"ARROW1"


class CaptionTable:
    """Captions indexed by unique sorted int64 keys.

    Build with :func:`read_captions` (in memory), :func:`write_sorted_captions` (streamed
    to a file, bounded memory) or :meth:`open`. The columns may be split into chunks —
    contiguous key ranges, the record batches of the IPC file — and are then never
    concatenated: a lookup finds the chunk by its first key, then the key in it, so a
    memory-mapped table costs each process only the pages its lookups touch.
    Read-only after construction, so safe to share between threads. Pickles as its file
    path when it was saved to or opened from a file (cheap to send to worker processes),
    else by value.

    Attributes:
        num_rows: rows read from the metadata (before dropping duplicates/null keys).
        duplicate_meta_rows: rows dropped because their key appeared earlier in the file.
        null_key_rows: rows dropped because their key was null.
        null_captions: kept keys whose caption is null.
        source: the metadata file it was read from ("" if unknown).
        path: the IPC file backing it, or None.
    """

    def __init__(
        self,
        keys: np.ndarray | pa.Array | pa.ChunkedArray,
        captions: pa.Array | pa.ChunkedArray,
        *,
        num_rows: int | None = None,
        duplicate_meta_rows: int = 0,
        null_key_rows: int = 0,
        source: str = "",
        path: str | os.PathLike | None = None,
    ):
        """Wrap already-deduplicated, sorted columns (no copy).

        Args:
            keys: strictly increasing int64 keys: a NumPy array, or an Arrow int64 array
                (chunked like ``captions`` to stay zero copy).
            captions: string or large_string array of the same length; a chunked array
                keeps its chunks.
            num_rows: rows of the original metadata (default ``len(keys)``).
            duplicate_meta_rows: rows dropped as duplicates.
            null_key_rows: rows dropped for a null key.
            source: the metadata file, for messages.
            path: the IPC file the columns are memory-mapped from, if any.

        Raises:
            ValueError: lengths differ, or keys are not strictly increasing int64.
        """
        key_chunks, cap_chunks = _split_chunks(keys, captions)
        for i, k in enumerate(key_chunks):
            if k.size > 1 and not bool(np.all(k[1:] > k[:-1])):
                raise ValueError("keys must be sorted and unique")
            if i and not k[0] > key_chunks[i - 1][-1]:
                raise ValueError("keys must be sorted and unique")
        self._keys: tuple[np.ndarray, ...] = tuple(key_chunks)
        # 64-bit offsets: the production caption column exceeds 2 GiB of text.
        self._caps: tuple[pa.Array, ...] = tuple(as_large_string(c) for c in cap_chunks)
        self._firsts = np.array([k[0] for k in key_chunks], dtype=np.int64)
        self._len = sum(k.size for k in key_chunks)
        self.num_rows = self._len if num_rows is None else int(num_rows)
        self.duplicate_meta_rows = int(duplicate_meta_rows)
        self.null_key_rows = int(null_key_rows)
        self.null_captions = sum(int(c.null_count) for c in self._caps)
        self.source = str(source)
        self.path = None if path is None else str(path)

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return (
            f"CaptionTable({len(self)} keys, num_rows={self.num_rows}, "
            f"duplicate_meta_rows={self.duplicate_meta_rows}, null_captions={self.null_captions}, "
            f"source={self.source!r})"
        )

    def __reduce__(self):
        if self.path is not None and os.path.exists(self.path):
            return (CaptionTable.open, (self.path,))
        return (
            _rebuild,
            (
                self.keys,
                self.captions,
                self.num_rows,
                self.duplicate_meta_rows,
                self.null_key_rows,
                self.source,
            ),
        )

    @property
    def keys(self) -> np.ndarray:
        """Sorted unique int64 keys, shape (K,).

        A view (of the memory map, for an opened file) when the table is one chunk; a
        concatenated copy otherwise — :meth:`lookup`, :meth:`count_absent` and ``len``
        never need it.
        """
        if len(self._keys) == 1:
            return self._keys[0]
        if not self._keys:
            return np.empty(0, dtype=np.int64)
        return np.concatenate(self._keys)

    @property
    def captions(self) -> pa.Array | pa.ChunkedArray:
        """Captions aligned with :attr:`keys`: one ``pa.LargeStringArray`` (may hold nulls),
        or a ``pa.ChunkedArray`` of the chunks (zero copy) when there are several."""
        if len(self._caps) == 1:
            return self._caps[0]
        if not self._caps:
            return pa.array([], type=pa.large_string())
        return pa.chunked_array(self._caps, type=pa.large_string())

    @property
    def num_chunks(self) -> int:
        """How many chunks (contiguous key ranges) the columns are split into."""
        return len(self._keys)

    @property
    def counts(self) -> dict[str, int]:
        """The counters as a dict (for the build report)."""
        return {
            "meta_rows": self.num_rows,
            "meta_keys": len(self),
            "duplicate_meta_rows": self.duplicate_meta_rows,
            "null_key_rows": self.null_key_rows,
            "null_captions": self.null_captions,
        }

    def lookup(self, keys: np.ndarray | Iterable[int]) -> tuple[pa.Array, np.ndarray]:
        """Captions for ``keys``.

        Args:
            keys: integer keys, any order, duplicates allowed.

        Returns:
            ``(captions, found)``: a ``pa.LargeStringArray`` aligned with ``keys`` (null
            where the key is absent or its caption is null) and a bool array, True where
            the key has a metadata row. 64-bit offsets: a part's lookup may hold more
            than 2 GiB of captions, each up to ``data.max_caption_bytes``.
        """
        query = _as_query(keys)
        found = np.zeros(query.shape, dtype=bool)
        parts, where = [], []
        for chunk, sel, idx, hit in self._search(query):
            found[sel] = hit
            parts.append(pc.take(self._caps[chunk], pa.array(idx, mask=~hit)))
            where.append(sel)
        if not parts:
            taken = pa.nulls(query.size, type=pa.large_string())
        elif len(parts) == 1 and isinstance(where[0], slice):
            taken = parts[0]
        else:
            # Gathered chunk by chunk; one more take puts them back in query order.
            back = np.empty(query.size, dtype=np.int64)
            back[np.concatenate(where)] = np.arange(query.size)
            taken = pc.take(pa.concat_arrays(parts), pa.array(back))
        return taken, found

    def count_absent(self, latent_keys: np.ndarray | Iterable[int]) -> int:
        """Metadata keys that have no latents (the build report's ``no_latents``).

        Searches the (few) latent keys in the table rather than the reverse, so it reads
        only the key pages those searches touch.

        Args:
            latent_keys: every latent key of the dataset (duplicates allowed).

        Returns:
            How many keys of this table do not occur in ``latent_keys``.
        """
        lat = sorted_unique(np.asarray(latent_keys, dtype=np.int64))
        present = sum(int(np.count_nonzero(hit)) for _c, _s, _i, hit in self._search(lat))
        return len(self) - present

    def save(self, path: str | os.PathLike) -> Path:
        """Write the table as an Arrow IPC stream file (a record batch per chunk), atomically.

        Temp file in the same folder, fsync, ``os.replace``, fsync the folder: a reader
        sees either no file or the complete one, even if the writer is killed.
        Several processes saving the same table to the same path is safe (last wins,
        identical content).

        Args:
            path: destination ``.arrow`` file.

        Returns:
            The path written; the table is now backed by it (pickles as the path).
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        schema = _file_schema(
            self.num_rows, self.duplicate_meta_rows, self.null_key_rows, self.source
        )
        write_ipc_stream(
            path,
            schema,
            (
                pa.record_batch([pa.array(keys), caps], schema=schema).serialize()
                for keys, caps in zip(self._keys, self._caps, strict=True)
            ),
        )
        self.path = str(path)
        return path

    @classmethod
    def open(cls, path: str | os.PathLike) -> CaptionTable:
        """Memory-map a table written by :meth:`save` or :func:`write_sorted_captions`.

        No copy, cheap per process: the columns are views of the mapped file, chunk by
        chunk.

        Args:
            path: the ``.arrow`` file.

        Returns:
            A :class:`CaptionTable` backed by the mapped file.

        Raises:
            MetadataError: missing, unreadable or not a caption table file.
        """
        path = os.fspath(path)
        try:
            source = pa.memory_map(path, "r")
            # The stream format (what save() and write_sorted_captions write: its batches
            # can be written in parallel) or the file format (older saves).
            is_file = source.read(len(_FILE_MAGIC)) == _FILE_MAGIC
            source.seek(0)
            reader = pa.ipc.open_file(source) if is_file else pa.ipc.open_stream(source)
            table = reader.read_all()
        except FileNotFoundError:
            raise MetadataError(path, "caption table file does not exist") from None
        except (pa.ArrowInvalid, OSError) as exc:
            raise MetadataError(path, f"not a readable Arrow IPC caption table: {exc}") from None
        if table.column_names != [_IPC_KEY, _IPC_CAPTION]:
            raise MetadataError(
                path, f"expected columns ['key', 'caption'], got {table.column_names}"
            )
        meta = json.loads((table.schema.metadata or {}).get(_COUNTS_META, b"{}"))
        try:
            return cls(
                table.column(_IPC_KEY),
                table.column(_IPC_CAPTION),
                num_rows=meta.get("num_rows"),
                duplicate_meta_rows=meta.get("duplicate_meta_rows", 0),
                null_key_rows=meta.get("null_key_rows", 0),
                source=meta.get("source", ""),
                path=path,
            )
        except (ValueError, pa.ArrowInvalid) as exc:
            raise MetadataError(path, f"not a valid caption table: {exc}") from None

    def _search(self, query: np.ndarray) -> Iterator[tuple[int, Any, np.ndarray, np.ndarray]]:
        """Find int64 ``query`` keys chunk by chunk.

        Yields ``(chunk, sel, idx, hit)`` for each chunk that some query keys fall into:
        ``sel`` selects those query positions (a slice when it is all of them), ``idx`` is
        each one's index in the chunk (clipped into range) and ``hit`` whether it is there.
        """
        if not self._keys or query.size == 0:
            return
        if len(self._keys) == 1:
            yield (0, slice(None), *_search_sorted(self._keys[0], query))
            return
        chunk = np.searchsorted(self._firsts, query, side="right") - 1
        np.maximum(chunk, 0, out=chunk)  # below the first key: searched (and missed) in chunk 0
        order = np.argsort(chunk, kind="stable")
        cuts = np.searchsorted(chunk[order], np.arange(len(self._keys) + 1))
        for c in np.flatnonzero(cuts[1:] > cuts[:-1]):
            sel = order[cuts[c] : cuts[c + 1]]
            yield (int(c), sel, *_search_sorted(self._keys[c], query[sel]))


def _search_sorted(keys: np.ndarray, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index clipped into range, found mask) of ``query`` in non-empty sorted ``keys``."""
    idx = np.searchsorted(keys, query)
    np.minimum(idx, keys.size - 1, out=idx)
    return idx, keys[idx] == query


def _as_query(keys: np.ndarray | Iterable[int]) -> np.ndarray:
    query = np.asarray(keys)
    if query.ndim != 1:
        query = query.reshape(-1)
    if query.dtype != np.int64:
        query = query.astype(np.int64)
    return query


def _split_chunks(
    keys: np.ndarray | pa.Array | pa.ChunkedArray, captions: pa.Array | pa.ChunkedArray
) -> tuple[list[np.ndarray], list[pa.Array]]:
    """Non-empty (int64 key chunk, caption chunk) pairs, chunked like ``captions``."""
    caps = list(captions.chunks) if isinstance(captions, pa.ChunkedArray) else [captions]
    lengths = [len(c) for c in caps]
    if isinstance(keys, pa.ChunkedArray) and [len(c) for c in keys.chunks] == lengths:
        parts = [_key_numpy(c) for c in keys.chunks]  # zero copy, chunk by chunk
    else:
        if isinstance(keys, pa.ChunkedArray):
            keys = keys.combine_chunks() if keys.num_chunks != 1 else keys.chunk(0)
        flat = _key_numpy(keys) if isinstance(keys, pa.Array) else np.asarray(keys)
        if flat.dtype != np.int64 or flat.ndim != 1:
            raise ValueError(f"keys must be a 1-D int64 array, got {flat.dtype} {flat.shape}")
        total = sum(lengths)
        if total != flat.size:
            raise ValueError(f"captions has {total} rows but keys has {flat.size}")
        parts = np.split(flat, np.cumsum(lengths)[:-1]) if len(caps) > 1 else [flat]
    for k in parts:
        if k.dtype != np.int64 or k.ndim != 1:
            raise ValueError(f"keys must be a 1-D int64 array, got {k.dtype} {k.shape}")
    pairs = [(k, c) for k, c in zip(parts, caps, strict=True) if k.size]
    return [k for k, _ in pairs], [c for _, c in pairs]


def _key_numpy(arr: pa.Array) -> np.ndarray:
    """An Arrow key array as NumPy: a zero-copy view when it is int64 without nulls."""
    if arr.null_count:
        raise ValueError(f"keys must not be null, got {arr.null_count} nulls")
    return arr.to_numpy(zero_copy_only=False)


def _file_schema(num_rows: int, duplicate_meta_rows: int, null_key_rows: int, source: str):
    """The caption table file's schema, with the counters as schema metadata."""
    meta = {
        _COUNTS_META: json.dumps(
            {
                "num_rows": int(num_rows),
                "duplicate_meta_rows": int(duplicate_meta_rows),
                "null_key_rows": int(null_key_rows),
                "source": str(source),
            },
            sort_keys=True,
        ).encode()
    }
    return pa.schema(
        [pa.field(_IPC_KEY, pa.int64()), pa.field(_IPC_CAPTION, pa.large_string())], metadata=meta
    )


def _rebuild(keys, captions, num_rows, duplicate_meta_rows, null_key_rows, source) -> CaptionTable:
    return CaptionTable(
        keys,
        captions,
        num_rows=num_rows,
        duplicate_meta_rows=duplicate_meta_rows,
        null_key_rows=null_key_rows,
        source=source,
    )


# ----------------------------------------------------------------------------- metadata


def read_captions(
    path: str | os.PathLike,
    *,
    key_column: str = "key",
    caption_column: str = "caption_llava",
    max_caption_bytes: int = MAX_CAPTION_BYTES,
) -> CaptionTable:
    """Read the key and caption columns of a metadata parquet into a :class:`CaptionTable`.

    Everything in memory (the caption column whole, then sorted by ``take``): about
    2.7 GiB per GB of caption text at peak. For the production table use
    :func:`write_sorted_captions`, which writes the same table in bounded memory.

    Only the two needed columns are read. When ``key_column`` is not a column, the key
    may be the pandas index: pandas writes an unnamed index as ``__index_level_0__`` and
    records index columns in the schema's pandas metadata (``index_columns``); a single
    stored integer index is then used as the key. Rows with a duplicate key keep the
    first occurrence (file order); the others are counted in ``duplicate_meta_rows``.
    Rows with a null key are dropped and counted in ``null_key_rows``. Null captions are
    kept (they classify as ``no_caption``). A caption longer than ``max_caption_bytes``
    (in any row, kept or not) is refused; a column stored as an Arrow dictionary is
    measured before it is decoded, any other is read whole first (in memory, as said).

    Args:
        path: the parquet file.
        key_column: integer key column (or index name).
        caption_column: string caption column.
        max_caption_bytes: the longest caption accepted, in bytes.

    Returns:
        The deduplicated, key-sorted table (one chunk).

    Raises:
        MetadataError: the file is missing or not parquet, a column is missing (the
            message lists the columns that exist), a column has the wrong type, or a
            caption is longer than ``max_caption_bytes``.
    """
    path = os.fspath(path)
    pf, key_field = _open_metadata(path, key_column, caption_column)
    try:
        table = pf.read(columns=[key_field, caption_column], use_pandas_metadata=False)
    except (pa.ArrowInvalid, OSError) as exc:
        raise MetadataError(
            path, f"cannot read columns {key_field!r}, {caption_column!r}: {exc}"
        ) from None

    num_rows = table.num_rows
    key_arr = table.column(key_field)
    captions = table.column(caption_column)
    del table  # drop our reference so the row-group buffers can be freed early
    first_row = 0
    for chunk in captions.chunks:
        try:
            lengths = caption_lengths(chunk)
        except ValueError as exc:
            raise MetadataError(path, f"cannot read column {caption_column!r}: {exc}") from None
        over = np.flatnonzero(lengths > max_caption_bytes)
        if over.size:
            row = first_row + int(over[0])
            size = int(lengths[over[0]])
            raise MetadataError(
                path, too_long(caption_column, row, key_arr[row].as_py(), size, max_caption_bytes)
            )
        first_row += len(chunk)
    # 64-bit offsets: the production caption column holds more than 2 GiB of text.
    captions = pa.chunked_array(
        [as_large_string(c) for c in captions.chunks], type=pa.large_string()
    )
    # take() on a many-chunk ChunkedArray concatenates it first, every call; one linear
    # concatenation here is cheaper overall.
    captions = captions.combine_chunks() if captions.num_chunks != 1 else captions.chunk(0)
    keys, valid_rows, null_keys = _non_null_keys(path, key_field, key_arr)
    del key_arr
    sorted_keys, first = _first_rows(keys)  # first is None: sorted and unique already
    dup = int(len(keys) - len(sorted_keys))
    rows = first if valid_rows is None else valid_rows if first is None else valid_rows[first]
    if rows is not None:
        captions = pc.take(captions, pa.array(rows))
    return CaptionTable(
        sorted_keys,
        captions,
        num_rows=num_rows,
        duplicate_meta_rows=dup,
        null_key_rows=null_keys,
        source=path,
    )


def write_sorted_captions(
    meta_path: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    key_column: str = "key",
    caption_column: str = "caption_llava",
    num_proc: int = 1,
    chunk_rows: int = 0,
    max_caption_bytes: int = MAX_CAPTION_BYTES,
) -> CaptionTable:
    """Write the caption table of a metadata parquet to an Arrow IPC file, in bounded memory.

    The same table as ``read_captions(meta_path, ...).save(out_path)`` — same keys,
    captions and counters, the same rules (first occurrence in file order wins, null keys
    dropped, null captions kept, key column or pandas index) and the same errors — but
    the caption column is never held whole (an external sort,
    :mod:`hf_pipeline.build.caption_sort`):

    1. the key column alone is read and sorted;
    2. *scatter*: the caption column is streamed in batches, row groups in parallel, and
       each kept row goes to the spill file of the output chunk it belongs to (a
       dot-folder next to ``out_path``, removed after);
    3. *gather*: chunk by chunk, in parallel, a spill file is put in key order by one
       ``take`` and becomes one record batch of ``out_path`` (an Arrow IPC stream,
       written in parallel).

    Memory: about 80 bytes per metadata row while the keys are sorted (0.9 GB at 11M
    rows), then 16 bytes per row plus ``num_proc`` + 1 chunks of captions in flight (a
    chunk is ~64 MiB of text unless ``chunk_rows`` says otherwise; one that turns out
    to hold more is gathered in pieces of at most ~128 MiB); no Python object per
    row. Captions are read in batches of ~64 MiB at most by the file's own sizes (a
    dictionary page's longest value included: one row may stand for it), each caption
    measured as it is read (a column stored as an Arrow dictionary: before it is
    decoded), and one longer than ``max_caption_bytes`` is refused naming its row, so a
    small file cannot make it decode gigabytes at once. Disk: room for the captions
    twice (spill and output) while it runs. The file is published atomically (temp
    file, fsync, ``os.replace``); on error nothing is left behind. Several processes
    writing the same table to the same path is safe (last wins, identical content).

    Args:
        meta_path: the metadata parquet file.
        out_path: the ``.arrow`` file to write; its folder is created if needed.
        key_column: integer key column (or pandas index name).
        caption_column: string caption column.
        num_proc: threads reading row groups and gathering chunks (both release the GIL).
        chunk_rows: rows per output chunk; 0 picks ~64 MiB of captions a chunk.
        max_caption_bytes: the longest caption accepted, in bytes.

    Returns:
        The table, memory-mapped from ``out_path`` (nothing of it held in memory).

    Raises:
        MetadataError: as :func:`read_captions`, or a row group holds fewer or more rows
            than the file's metadata says.
        ValueError: ``num_proc``, ``chunk_rows`` or ``max_caption_bytes`` out of range.
    """
    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc}")
    if chunk_rows < 0:
        raise ValueError(f"chunk_rows must be >= 0, got {chunk_rows}")
    if max_caption_bytes < 0:
        raise ValueError(f"max_caption_bytes must be >= 0, got {max_caption_bytes}")
    path = os.fspath(meta_path)
    out = Path(out_path)
    t0 = time.monotonic()
    pf, key_field = _open_metadata(path, key_column, caption_column)
    try:
        key_arr = pf.read(columns=[key_field], use_pandas_metadata=False).column(0)
    except (pa.ArrowInvalid, OSError) as exc:
        raise MetadataError(path, f"cannot read column {key_field!r}: {exc}") from None
    num_rows = len(key_arr)
    keys, valid_rows, null_keys = _non_null_keys(path, key_field, key_arr)
    del key_arr
    sorted_keys, first = _first_rows(keys)
    dup = int(len(keys) - len(sorted_keys))
    del keys
    # dest[r]: the output position of file row r; -1 drops it (null key, later duplicate).
    rows = np.arange(len(sorted_keys)) if first is None else first
    if valid_rows is not None:
        rows = valid_rows[rows]
    dest = np.full(num_rows, -1, dtype=np.int64)
    dest[rows] = np.arange(len(sorted_keys))
    del rows, first, valid_rows

    if not chunk_rows:
        chunk_rows = default_chunk_rows(pf, path, caption_column)
    # Bounds the spill files open at once; only beyond 256 x 64 MiB do chunks grow.
    chunk_rows = max(chunk_rows, -(-len(sorted_keys) // MAX_CHUNKS))
    schema = _file_schema(num_rows, dup, null_keys, path)
    out.parent.mkdir(parents=True, exist_ok=True)
    spill = Spill(
        Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".spill", dir=out.parent)),
        total=len(sorted_keys),
        chunk_rows=chunk_rows,
    )
    t1 = time.monotonic()
    try:
        scatter(
            pf, path, caption_column, dest, spill, num_proc,
            max_caption_bytes=max_caption_bytes, key_at=_key_reader(path, pf, key_field),
        )  # fmt: skip
        del dest
        t2 = time.monotonic()

        def message(lo: int, caps: pa.Array) -> pa.Buffer:
            keys = pa.array(sorted_keys[lo : lo + len(caps)])
            return pa.record_batch([keys, caps], schema=schema).serialize()

        write_ipc_stream(out, schema, spill.gather(num_proc, message), num_proc=num_proc)
    finally:
        spill.close()
    # The pool keeps freed chunks for reuse (its threads' heaps too); the builder goes on
    # to the join and the embedding, which do not need them.
    pa.default_memory_pool().release_unused()
    log.info(
        "captions: %d keys of %d rows sorted in %.1fs, scattered in %.1fs, gathered into "
        "%d chunks in %.1fs",
        len(sorted_keys),
        num_rows,
        t1 - t0,
        t2 - t1,
        spill.num_chunks,
        time.monotonic() - t2,
    )
    return CaptionTable.open(out)


def _key_reader(path: str, pf, key_field: str):
    """``key_at(file row)``: the key of one row, read from its row group's key column
    (for a message: called at most once), or None when it cannot be read."""
    meta = pf.metadata
    starts = np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])

    def key_at(row: int) -> object:
        rg = int(np.searchsorted(starts, row, side="right")) - 1
        reader = open_parquet(path, metadata=meta)  # this thread's own reader
        try:
            keys = reader.read_row_group(rg, columns=[key_field], use_pandas_metadata=False)
            return keys.column(0)[row - int(starts[rg])].as_py()
        except (pa.ArrowInvalid, OSError, IndexError):
            return None
        finally:
            reader.close()

    return key_at


def _open_metadata(path: str, key_column: str, caption_column: str):
    """Open the parquet file and check its key and caption columns.

    Returns:
        ``(ParquetFile, key field name)``: the key column itself or the pandas index.
    """
    if not os.path.exists(path):
        raise MetadataError(path, "metadata parquet file does not exist")
    try:
        pf = open_parquet(path)
        schema = pf.schema_arrow
    except (pa.ArrowInvalid, OSError) as exc:
        raise MetadataError(path, f"not a readable parquet file: {exc}") from None

    key_field = _resolve_key_column(path, schema, key_column)
    if caption_column not in schema.names:
        raise MetadataError(
            path, f"caption column {caption_column!r} not found; columns: {_columns_text(schema)}"
        )
    ktype = schema.field(key_field).type
    if not pa.types.is_integer(ktype):
        raise MetadataError(path, f"key column {key_field!r} must be an integer type, got {ktype}")
    ctype = schema.field(caption_column).type
    if not _is_text(ctype):
        raise MetadataError(
            path, f"caption column {caption_column!r} must be string/large_string, got {ctype}"
        )
    return pf, key_field


def _non_null_keys(
    path: str, key_field: str, key_arr: pa.ChunkedArray
) -> tuple[np.ndarray, np.ndarray | None, int]:
    """``(int64 keys of the non-null rows, their row numbers or None if all, null count)``."""
    if pa.types.is_uint64(key_arr.type):
        too_big = pc.max(key_arr).as_py()
        if too_big is not None and too_big > np.iinfo(np.int64).max:
            raise MetadataError(
                path, f"key column {key_field!r} has values beyond int64 ({too_big})"
            )
    null_keys = key_arr.null_count
    valid_rows = None
    if null_keys:
        valid = pc.is_valid(key_arr)
        valid_rows = np.flatnonzero(valid.to_numpy())
        key_arr = pc.filter(key_arr, valid)
    return _to_int64_numpy(key_arr), valid_rows, int(null_keys)


def _first_rows(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """``(unique keys sorted, index in keys of each one's first occurrence)``.

    The index is None when ``keys`` is already sorted and unique (a key-ordered export).
    """
    if keys.size < 2 or bool(np.all(keys[1:] > keys[:-1])):
        return keys, None
    # An unstable sort (SIMD, several times faster than the stable one on 11M keys), then
    # the smallest row index of each run of equal keys: the earliest row in the file.
    order = np.argsort(keys)
    sorted_keys = keys[order]
    starts = np.ones(sorted_keys.shape, dtype=bool)
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=starts[1:])
    runs = np.flatnonzero(starts)
    first = np.minimum.reduceat(order, runs) if runs.size != order.size else order
    return sorted_keys[runs], first


def classify(captions: pa.Array | pa.ChunkedArray, found: np.ndarray) -> np.ndarray:
    """Why each row would be dropped, as small integer codes (``REASONS[code]``).

    Vectorized (pyarrow ``utf8_trim_whitespace`` + ``utf8_length``): no per-row Python.
    "Whitespace" is Unicode White_Space, the same set as Python's ``str.isspace``
    (``"\u3000"`` counts; zero-width space ``"\u200b"`` does not).

    Args:
        captions: captions from :meth:`CaptionTable.lookup` (nulls allowed).
        found: bool mask from the same lookup.

    Returns:
        uint8 array: 0 keep (``KEEP``), 1 ``NO_CAPTION`` (key absent or caption null),
        2 ``EMPTY_CAPTION`` (empty or whitespace only), 3 ``BAD_CAPTION_ENCODING`` (not
        UTF-8: the metadata is untrusted, and Arrow does not check string columns read
        from parquet).

    Raises:
        ValueError: lengths differ.
    """
    found = np.asarray(found, dtype=bool)
    if len(captions) != found.shape[0]:
        raise ValueError(f"captions has {len(captions)} rows but found has {found.shape[0]}")
    if len(captions) == 0:
        return np.zeros(0, dtype=np.uint8)
    undecodable = _undecodable(captions)
    if undecodable.any():  # the UTF-8 kernels below refuse the whole array otherwise
        captions = pc.if_else(pa.array(undecodable), pa.scalar(None, captions.type), captions)
    lengths = pc.utf8_length(pc.utf8_trim_whitespace(captions))
    # Nulls -> -1 so a single numpy pass separates null / empty / non-empty.
    lengths = pc.fill_null(lengths, -1)
    if isinstance(lengths, pa.ChunkedArray):
        lengths = lengths.combine_chunks()
    lens = lengths.to_numpy(zero_copy_only=False)
    codes = np.full(found.shape, _CODE_KEEP, dtype=np.uint8)
    codes[lens == 0] = _CODE_EMPTY
    codes[(lens < 0) | ~found] = _CODE_NO_CAPTION
    codes[undecodable & found] = _CODE_BAD_ENCODING
    return codes


def caption_texts(captions: pa.Array | pa.ChunkedArray, codes: np.ndarray) -> list[str]:
    """The captions as Python strings, ``""`` where null or not UTF-8.

    Args:
        captions: captions from :meth:`CaptionTable.lookup`.
        codes: their :func:`classify` codes.
    """
    bad = np.asarray(codes) == _CODE_BAD_ENCODING
    if bad.any():  # decoding one of them would raise UnicodeDecodeError
        captions = pc.if_else(pa.array(bad), pa.scalar(None, captions.type), captions)
    return captions.fill_null("").to_pylist()


def _undecodable(captions: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Bool mask: the values that are not valid UTF-8 (nulls are not).

    One validation pass over the whole array (the usual, valid case); only when it fails
    is each value decoded in Python to find which (a bad file is rare, and the join turns
    every caption of the batch into a Python string anyway).
    """
    chunks = captions.chunks if isinstance(captions, pa.ChunkedArray) else [captions]
    masks = []
    for chunk in chunks:
        try:
            chunk.validate(full=True)
            masks.append(np.zeros(len(chunk), dtype=bool))
            continue
        except pa.ArrowInvalid:
            pass
        raw = chunk.view(pa.large_binary() if pa.types.is_large_string(chunk.type) else pa.binary())
        masks.append(np.array([v is not None and not _is_utf8(v) for v in raw.to_pylist()], bool))
    return np.concatenate(masks) if masks else np.zeros(0, dtype=bool)


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def reason_names(codes: np.ndarray) -> np.ndarray:
    """Map :func:`classify` codes to their names (``""``, ``"no_caption"``, ...).

    Args:
        codes: uint8 codes.

    Returns:
        A numpy array of str, same shape.
    """
    return np.asarray(REASONS)[np.asarray(codes, dtype=np.intp)]


def _resolve_key_column(path: str, schema: pa.Schema, key_column: str) -> str:
    """The stored column holding the key: the column itself or the pandas index."""
    if key_column in schema.names:
        return key_column
    stored_index = []
    try:
        pandas_meta = schema.pandas_metadata or {}
    except (ValueError, TypeError):
        pandas_meta = {}  # malformed pandas metadata: treat as absent, not a crash
    for entry in pandas_meta.get("index_columns", []):
        # A RangeIndex is recorded as a dict and not stored; only named fields count.
        if isinstance(entry, str) and entry in schema.names:
            stored_index.append(entry)
    if len(stored_index) == 1:
        return stored_index[0]
    hint = ""
    if len(stored_index) > 1:
        hint = f" (pandas index has several levels: {stored_index}; none is named {key_column!r})"
    elif any(isinstance(e, dict) for e in pandas_meta.get("index_columns", [])):
        hint = " (the pandas index is a RangeIndex, not stored)"
    raise MetadataError(
        path,
        f"key column {key_column!r} not found as a column or pandas index{hint}; "
        f"columns: {_columns_text(schema)}",
    )


def _is_text(dtype: pa.DataType) -> bool:
    """Whether a column type holds captions: (large_)string, string_view, a dictionary of
    those (pandas categoricals), or all-null."""
    if pa.types.is_dictionary(dtype):
        dtype = dtype.value_type
    string_view = getattr(pa.types, "is_string_view", lambda _t: False)
    return (
        pa.types.is_string(dtype)
        or pa.types.is_large_string(dtype)
        or string_view(dtype)
        or pa.types.is_null(dtype)
    )


def _columns_text(schema: pa.Schema) -> str:
    return ", ".join(schema.names) or "(none)"


def _to_int64_numpy(arr: pa.ChunkedArray | pa.Array) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if arr.type != pa.int64():
        arr = arr.cast(pa.int64())
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=np.int64)
