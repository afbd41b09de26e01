"""The caption metadata table: read, validate, deduplicate, look up, classify.

The production parquet has ~10M rows, so everything here is vectorized: keys live in
one sorted ``np.int64`` array, captions in one Arrow string array aligned with it, and a
lookup is ``np.searchsorted`` plus ``pyarrow.compute.take``. No per-row Python dict.

A :class:`CaptionTable` can be saved as an Arrow IPC file and memory-mapped back by
each ``datasets`` map worker (:meth:`CaptionTable.open`), so GBs of captions are neither
pickled nor copied per process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dist.atomic import atomic_write
from hf_pipeline.errors import MetadataError

__all__ = [
    "EMPTY_CAPTION",
    "KEEP",
    "NO_CAPTION",
    "REASONS",
    "CaptionTable",
    "classify",
    "read_captions",
    "reason_names",
]

#: Reason code 0: the row is kept.
KEEP = ""
#: The key has no metadata row, or its caption is null.
NO_CAPTION = "no_caption"
#: The caption is empty or whitespace only.
EMPTY_CAPTION = "empty_caption"
#: Reason names indexed by the codes :func:`classify` returns (``REASONS[code]``).
REASONS: tuple[str, ...] = (KEEP, NO_CAPTION, EMPTY_CAPTION)

_CODE_KEEP, _CODE_NO_CAPTION, _CODE_EMPTY = 0, 1, 2
_IPC_KEY, _IPC_CAPTION = "key", "caption"
_COUNTS_META = b"hf_pipeline.caption_counts"


class CaptionTable:
    """Captions indexed by unique sorted int64 keys.

    Build with :func:`read_captions` or :meth:`open`. Read-only after construction, so
    safe to share between threads. Pickles as its file path when it was saved to or
    opened from a file (cheap to send to worker processes), else by value.

    Attributes:
        keys: sorted unique int64 keys, shape (K,).
        captions: ``pa.LargeStringArray`` of length K aligned with ``keys`` (may hold nulls).
        num_rows: rows read from the metadata (before dropping duplicates/null keys).
        duplicate_meta_rows: rows dropped because their key appeared earlier in the file.
        null_key_rows: rows dropped because their key was null.
        null_captions: kept keys whose caption is null.
        source: the metadata file it was read from ("" if unknown).
        path: the IPC file backing it, or None.
    """

    def __init__(
        self,
        keys: np.ndarray,
        captions: pa.Array,
        *,
        num_rows: int | None = None,
        duplicate_meta_rows: int = 0,
        null_key_rows: int = 0,
        source: str = "",
        path: str | os.PathLike | None = None,
    ):
        """Wrap already-deduplicated, sorted columns (no copy).

        Args:
            keys: strictly increasing int64 keys.
            captions: string or large_string array of the same length.
            num_rows: rows of the original metadata (default ``len(keys)``).
            duplicate_meta_rows: rows dropped as duplicates.
            null_key_rows: rows dropped for a null key.
            source: the metadata file, for messages.
            path: the IPC file the columns are memory-mapped from, if any.

        Raises:
            ValueError: lengths differ, or keys are not strictly increasing int64.
        """
        keys = np.asarray(keys)
        if isinstance(captions, pa.ChunkedArray):
            captions = captions.combine_chunks() if captions.num_chunks != 1 else captions.chunk(0)
        if keys.dtype != np.int64 or keys.ndim != 1:
            raise ValueError(f"keys must be a 1-D int64 array, got {keys.dtype} {keys.shape}")
        if len(captions) != len(keys):
            raise ValueError(f"captions has {len(captions)} rows but keys has {len(keys)}")
        if len(keys) > 1 and not bool(np.all(keys[1:] > keys[:-1])):
            raise ValueError("keys must be sorted and unique")
        if not pa.types.is_large_string(captions.type):
            # 64-bit offsets: the production caption column exceeds 2 GiB of text.
            captions = captions.cast(pa.large_string())
        self.keys = keys
        self.captions = captions
        self.num_rows = len(keys) if num_rows is None else int(num_rows)
        self.duplicate_meta_rows = int(duplicate_meta_rows)
        self.null_key_rows = int(null_key_rows)
        self.null_captions = int(captions.null_count)
        self.source = str(source)
        self.path = None if path is None else str(path)

    def __len__(self) -> int:
        return len(self.keys)

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
            ``(captions, found)``: a ``pa.StringArray`` aligned with ``keys`` (null where
            the key is absent or its caption is null) and a bool array, True where the key
            has a metadata row.
        """
        query = np.asarray(keys)
        if query.ndim != 1:
            query = query.reshape(-1)
        if query.dtype != np.int64:
            query = query.astype(np.int64)
        found, idx = self._positions(query)
        taken = pc.take(self.captions, pa.array(idx, mask=~found))
        # Lookups are per batch (far below 2 GiB), so the plain string type is safe and
        # what `datasets` expects for a text column.
        return taken.cast(pa.string()), found

    def count_absent(self, latent_keys: np.ndarray | Iterable[int]) -> int:
        """Metadata keys that have no latents (the build report's ``no_latents``).

        Args:
            latent_keys: every latent key of the dataset (duplicates allowed).

        Returns:
            How many keys of this table do not occur in ``latent_keys``.
        """
        lat = np.unique(np.asarray(latent_keys, dtype=np.int64).reshape(-1))
        if lat.size == 0:
            return len(self)
        idx = np.searchsorted(lat, self.keys)
        present = lat[np.minimum(idx, lat.size - 1)] == self.keys
        return int(len(self) - np.count_nonzero(present))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the table as an Arrow IPC file, atomically.

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
        meta = {
            _COUNTS_META: json.dumps(
                {
                    "num_rows": self.num_rows,
                    "duplicate_meta_rows": self.duplicate_meta_rows,
                    "null_key_rows": self.null_key_rows,
                    "source": self.source,
                },
                sort_keys=True,
            ).encode()
        }
        table = pa.table(
            {_IPC_KEY: pa.array(self.keys, type=pa.int64()), _IPC_CAPTION: self.captions},
        ).replace_schema_metadata(meta)
        with atomic_write(path) as fh:
            with pa.ipc.new_file(fh, table.schema) as writer:
                # One record batch: open() then gets each column as one zero-copy array.
                writer.write_table(table, max_chunksize=max(1, len(self)))
        self.path = str(path)
        return path

    @classmethod
    def open(cls, path: str | os.PathLike) -> CaptionTable:
        """Memory-map a table written by :meth:`save` (no copy; cheap per process).

        Args:
            path: the ``.arrow`` file.

        Returns:
            A :class:`CaptionTable` whose columns are views of the mapped file.

        Raises:
            MetadataError: missing, unreadable or not a caption table file.
        """
        path = os.fspath(path)
        try:
            source = pa.memory_map(path, "r")
            table = pa.ipc.open_file(source).read_all()
        except FileNotFoundError:
            raise MetadataError(path, "caption table file does not exist") from None
        except (pa.ArrowInvalid, OSError) as exc:
            raise MetadataError(path, f"not a readable Arrow IPC caption table: {exc}") from None
        if table.column_names != [_IPC_KEY, _IPC_CAPTION]:
            raise MetadataError(
                path, f"expected columns ['key', 'caption'], got {table.column_names}"
            )
        meta = json.loads((table.schema.metadata or {}).get(_COUNTS_META, b"{}"))
        keys_col = table.column(_IPC_KEY)
        cap_col = table.column(_IPC_CAPTION)
        if table.num_rows == 0:
            keys = np.empty(0, dtype=np.int64)
            caps = pa.array([], type=pa.large_string())
        else:
            keys = keys_col.chunk(0) if keys_col.num_chunks == 1 else keys_col.combine_chunks()
            keys = keys.to_numpy(zero_copy_only=keys.null_count == 0)
            caps = cap_col
        return cls(
            keys,
            caps,
            num_rows=meta.get("num_rows"),
            duplicate_meta_rows=meta.get("duplicate_meta_rows", 0),
            null_key_rows=meta.get("null_key_rows", 0),
            source=meta.get("source", ""),
            path=path,
        )

    def _positions(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found mask, index into self.keys clipped to range) for int64 ``query``."""
        if len(self) == 0:
            return np.zeros(query.shape, dtype=bool), np.zeros(query.shape, dtype=np.int64)
        idx = np.searchsorted(self.keys, query)
        np.minimum(idx, len(self) - 1, out=idx)
        found = self.keys[idx] == query
        return found, idx


def _rebuild(keys, captions, num_rows, duplicate_meta_rows, null_key_rows, source) -> CaptionTable:
    return CaptionTable(
        keys,
        captions,
        num_rows=num_rows,
        duplicate_meta_rows=duplicate_meta_rows,
        null_key_rows=null_key_rows,
        source=source,
    )


def read_captions(
    path: str | os.PathLike,
    *,
    key_column: str = "key",
    caption_column: str = "caption_llava",
) -> CaptionTable:
    """Read the key and caption columns of a metadata parquet into a :class:`CaptionTable`.

    Only the two needed columns are read. When ``key_column`` is not a column, the key
    may be the pandas index: pandas writes an unnamed index as ``__index_level_0__`` and
    records index columns in the schema's pandas metadata (``index_columns``); a single
    stored integer index is then used as the key. Rows with a duplicate key keep the
    first occurrence (file order); the others are counted in ``duplicate_meta_rows``.
    Rows with a null key are dropped and counted in ``null_key_rows``. Null captions are
    kept (they classify as ``no_caption``).

    Args:
        path: the parquet file.
        key_column: integer key column (or index name).
        caption_column: string caption column.

    Returns:
        The deduplicated, key-sorted table.

    Raises:
        MetadataError: the file is missing or not parquet, a column is missing (the
            message lists the columns that exist), or a column has the wrong type.
    """
    import pyarrow.parquet as pq

    path = os.fspath(path)
    if not os.path.exists(path):
        raise MetadataError(path, "metadata parquet file does not exist")
    try:
        pf = pq.ParquetFile(path, memory_map=True)
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
    if not pa.types.is_large_string(captions.type):
        # 64-bit offsets: the production caption column holds more than 2 GiB of text.
        captions = captions.cast(pa.large_string())
    # take() on a many-chunk ChunkedArray resolves the chunk per index (~10x slower
    # than on one array); one linear concatenation first is cheaper overall.
    captions = captions.combine_chunks() if captions.num_chunks != 1 else captions.chunk(0)
    if pa.types.is_uint64(key_arr.type):
        too_big = pc.max(key_arr).as_py()
        if too_big is not None and too_big > np.iinfo(np.int64).max:
            raise MetadataError(
                path, f"key column {key_field!r} has values beyond int64 ({too_big})"
            )
    null_keys = key_arr.null_count
    if null_keys:
        keep = pc.is_valid(key_arr)
        key_arr = pc.filter(key_arr, keep)
        captions = pc.filter(captions, keep)
    keys = _to_int64_numpy(key_arr)

    if bool(np.all(keys[1:] > keys[:-1])):
        # Already sorted and unique (a key-ordered export): skip the GB-sized take.
        return CaptionTable(keys, captions, num_rows=num_rows, null_key_rows=null_keys, source=path)
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    first = np.ones(sorted_keys.shape, dtype=bool)
    # Stable sort keeps file order among equal keys, so the first of a run is the
    # earliest row in the file.
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=first[1:])
    unique_rows = order[first]
    dup = int(len(keys) - unique_rows.size)
    caps_sorted = pc.take(captions, pa.array(unique_rows, type=pa.int64()))
    return CaptionTable(
        sorted_keys[first],
        caps_sorted,
        num_rows=num_rows,
        duplicate_meta_rows=dup,
        null_key_rows=null_keys,
        source=path,
    )


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
        2 ``EMPTY_CAPTION`` (empty or whitespace only).

    Raises:
        ValueError: lengths differ.
    """
    found = np.asarray(found, dtype=bool)
    if len(captions) != found.shape[0]:
        raise ValueError(f"captions has {len(captions)} rows but found has {found.shape[0]}")
    if len(captions) == 0:
        return np.zeros(0, dtype=np.uint8)
    lengths = pc.utf8_length(pc.utf8_trim_whitespace(captions))
    # Nulls -> -1 so a single numpy pass separates null / empty / non-empty.
    lengths = pc.fill_null(lengths, -1)
    if isinstance(lengths, pa.ChunkedArray):
        lengths = lengths.combine_chunks()
    lens = lengths.to_numpy(zero_copy_only=False)
    codes = np.full(found.shape, _CODE_KEEP, dtype=np.uint8)
    codes[lens == 0] = _CODE_EMPTY
    codes[(lens < 0) | ~found] = _CODE_NO_CAPTION
    return codes


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
