"""The stream index of a published cache: where every row's bytes sit, and their checksums.

``--publish`` writes it into ``manifest.json`` (key ``"stream"``) so that a streaming
reader (:class:`~hf_pipeline.read.stream.source.StreamSource`) needs one manifest read
at start, no listing and no Arrow footer or schema read per file. For each column it
reads (``latents``, ``key``, ``embedding`` and the filter's ``indices``):

* the files, in row order (paths relative to the cache folder, as the manifest has them);
* the row shape and stored dtype;
* every non-empty record batch (``chunk``): ``[file, rows, byte offset]``. The values of
  a fixed-shape column in one record batch are one run of bytes (see
  :mod:`hf_pipeline.read.mapped`), so row ``r`` of a chunk lies at ``offset + r * row_bytes``;
* checksum blocks: each chunk is cut into blocks of ``block_rows`` rows (the last one
  shorter); ``digests`` is base64 of one little-endian :data:`dist.checksums.BLOCK_ALGORITHM`
  value (8 bytes) per block, chunk by chunk. A reader fetches whole blocks and checks
  each one before using a byte of it.

A published index is foreign input: :meth:`StreamIndex.from_dict` checks every field
(types, bounds, offsets inside the file sizes the manifest states, row counts that
agree between columns) and raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dist.checksums import BLOCK_ALGORITHM, block_digest

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "STREAM_INDEX_VERSION",
    "STREAM_COLUMNS",
    "ColumnIndex",
    "StreamIndex",
    "build_stream_index",
]

#: Bump when the index's format changes (readers refuse other versions).
STREAM_INDEX_VERSION = 1
#: Target bytes of one checksum block (rounded down to whole rows, at least one row).
#: The unit of every ranged read: a globally shuffled read fetches a block per row it
#: needs, so small blocks waste little; 8 bytes of digest per block keep the manifest
#: at ~1/8000 of the data.
DEFAULT_BLOCK_BYTES = 64 << 10
#: The columns a streaming reader reads, by kind of file.
STREAM_COLUMNS = {"latents": "rows", "key": "rows", "embedding": "embeddings", "indices": "indices"}
_DTYPES = ("<f2", "<f4", "<f8", "<u2", "<i8", "<u8", "<i4", "<u4")
_MAX_ROW_BYTES = 1 << 30
_MAX_ROWS = 1 << 48


@dataclasses.dataclass(frozen=True, kw_only=True)
class ColumnIndex:
    """Where one column's rows sit (see the module docstring).

    Attributes:
        files: paths relative to the cache folder, in row order.
        row_shape: shape of one row.
        dtype: stored NumPy dtype string (``"<f2"``).
        block_rows: rows per checksum block.
        chunks: ``(file index, rows, byte offset)`` per non-empty record batch.
        digests: one digest per block, chunk by chunk (``uint64``).
    """

    files: tuple[str, ...]
    row_shape: tuple[int, ...]
    dtype: str
    block_rows: int
    chunks: tuple[tuple[int, int, int], ...]
    digests: np.ndarray

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def num_rows(self) -> int:
        return sum(rows for _, rows, _ in self.chunks)

    def blocks_per_chunk(self) -> np.ndarray:
        rows = np.array([r for _, r, _ in self.chunks], dtype=np.int64)
        return -(-rows // self.block_rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": list(self.files),
            "row_shape": list(self.row_shape),
            "dtype": self.dtype,
            "block_rows": self.block_rows,
            "chunks": [list(c) for c in self.chunks],
            "digests": base64.b64encode(self.digests.astype("<u8").tobytes()).decode(),
        }

    @classmethod
    def from_dict(cls, name: str, d: Any, sizes: Mapping[str, int]) -> ColumnIndex:
        """Parse and check one column; ``sizes``: file sizes the manifest states.

        Raises:
            ValueError: naming ``stream.columns.<name>.<field>`` and what was expected.
        """
        where = f"stream.columns.{name}"
        if not isinstance(d, Mapping):
            raise ValueError(f"{where} must be a JSON object")
        files = d.get("files")
        if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
            raise ValueError(f"{where}.files must be a non-empty list of paths")
        for f in files:
            if f not in sizes:
                raise ValueError(f"{where}.files names {f!r}, which the manifest does not list")
        shape = d.get("row_shape")
        if not isinstance(shape, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= _MAX_ROW_BYTES
            for n in shape
        ):
            raise ValueError(
                f"{where}.row_shape must be a list of positive ints, got {shape!r:.80}"
            )
        dtype = d.get("dtype")
        if dtype not in _DTYPES:
            raise ValueError(f"{where}.dtype must be one of {_DTYPES}, got {dtype!r:.40}")
        # Python ints: a NumPy product of foreign dims wraps (2**30 x 2**30 x 16 was 0 bytes).
        row_bytes = math.prod(shape) * np.dtype(dtype).itemsize
        if row_bytes > _MAX_ROW_BYTES:
            raise ValueError(f"{where}.row_shape is {row_bytes} bytes a row, more than allowed")
        block_rows = d.get("block_rows")
        if (
            not isinstance(block_rows, int)
            or isinstance(block_rows, bool)
            or not (1 <= block_rows <= _MAX_ROWS)
        ):
            raise ValueError(f"{where}.block_rows must be an int >= 1, got {block_rows!r:.40}")
        chunks = d.get("chunks")
        if not isinstance(chunks, list):
            raise ValueError(f"{where}.chunks must be a list")
        out = []
        for i, c in enumerate(chunks):
            if not (
                isinstance(c, list)
                and len(c) == 3
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in c)
            ):
                raise ValueError(f"{where}.chunks[{i}] must be [file, rows, offset] ints >= 0")
            file, rows, offset = c
            if file >= len(files) or rows < 1 or rows > _MAX_ROWS:
                raise ValueError(
                    f"{where}.chunks[{i}] names file {file} or {rows} rows: out of range"
                )
            if offset + rows * row_bytes > sizes[files[file]]:
                raise ValueError(
                    f"{where}.chunks[{i}] ends past the end of {files[file]} "
                    f"({sizes[files[file]]} bytes)"
                )
            out.append((file, rows, offset))
        # No two chunks share bytes: the rows declared are then bounded by the files'
        # bytes (one real 2 KB file named by a million copies of its chunk declared 390
        # million rows, 3.7 GB at open: an adversarial tester).
        end_of: dict[int, int] = {}
        for file, rows, offset in sorted(out, key=lambda c: (c[0], c[2])):
            if offset < end_of.get(file, 0):
                raise ValueError(f"{where}.chunks overlap in {files[file]} at byte {offset}")
            end_of[file] = offset + rows * row_bytes
        raw = d.get("digests")
        try:
            if not isinstance(raw, str):
                raise TypeError(raw)
            digests = np.frombuffer(base64.b64decode(raw, validate=True), dtype="<u8")
        except (TypeError, ValueError):
            raise ValueError(f"{where}.digests must be base64 of 8-byte digests") from None
        col = cls(
            files=tuple(files),
            row_shape=tuple(shape),
            dtype=dtype,
            block_rows=block_rows,
            chunks=tuple(out),
            digests=digests,
        )
        want = int(col.blocks_per_chunk().sum()) if out else 0
        if digests.size != want:
            raise ValueError(f"{where}.digests holds {digests.size} digests, expected {want}")
        return col


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamIndex:
    """The ``"stream"`` section of a published manifest (see the module docstring).

    Attributes:
        columns: ``latents``, ``key``, ``embedding``, ``indices``.
        latent_dtype: the latents' storage dtype the build report records
            (``"bfloat16"`` for uint16 bits), or None for an older cache.
        algorithm: the block checksum (:data:`dist.checksums.BLOCK_ALGORITHM`).
        version: :data:`STREAM_INDEX_VERSION`.
    """

    columns: Mapping[str, ColumnIndex]
    latent_dtype: str | None
    algorithm: str = BLOCK_ALGORITHM
    version: int = STREAM_INDEX_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "algorithm": self.algorithm,
            "latent_dtype": self.latent_dtype,
            "columns": {name: col.to_dict() for name, col in sorted(self.columns.items())},
        }

    @classmethod
    def from_dict(cls, d: Any, sizes: Mapping[str, int]) -> StreamIndex:
        """Parse and check a published index against the manifest's file ``sizes``.

        Raises:
            ValueError: naming the field and what was expected.
        """
        if not isinstance(d, Mapping):
            raise ValueError("stream must be a JSON object (publish the cache again)")
        if d.get("version") != STREAM_INDEX_VERSION:
            raise ValueError(
                f"stream.version is {d.get('version')!r:.20}, expected {STREAM_INDEX_VERSION}"
            )
        if d.get("algorithm") != BLOCK_ALGORITHM:
            raise ValueError(
                f"stream.algorithm is {d.get('algorithm')!r:.40}, expected {BLOCK_ALGORITHM!r}"
            )
        latent_dtype = d.get("latent_dtype")
        if latent_dtype not in (None, "float16", "float32", "bfloat16"):
            raise ValueError(f"stream.latent_dtype is not a latent dtype: {latent_dtype!r:.40}")
        raw = d.get("columns")
        if not isinstance(raw, Mapping) or set(raw) != set(STREAM_COLUMNS):
            raise ValueError(f"stream.columns must hold exactly {sorted(STREAM_COLUMNS)}")
        cols = {name: ColumnIndex.from_dict(name, raw[name], sizes) for name in STREAM_COLUMNS}
        lat, key, emb, idx = (cols[n] for n in ("latents", "key", "embedding", "indices"))
        if len(lat.row_shape) != 4:
            raise ValueError("stream.columns.latents.row_shape must be (crops, C, H, W)")
        if key.row_shape or idx.row_shape:
            raise ValueError("stream.columns.key and .indices must be scalar per row")
        if len(emb.row_shape) != 1:
            raise ValueError("stream.columns.embedding.row_shape must be (D,)")
        if not lat.num_rows:
            raise ValueError("stream.columns.latents holds no rows")
        if not lat.num_rows == key.num_rows == emb.num_rows:
            raise ValueError(
                f"stream.columns hold {lat.num_rows} latents, {key.num_rows} keys and "
                f"{emb.num_rows} embeddings: they must agree"
            )
        if key.dtype not in ("<i8", "<u8") or idx.dtype not in ("<i8", "<u8"):
            raise ValueError("stream.columns.key and .indices must be 64-bit integers")
        return cls(columns=cols, latent_dtype=latent_dtype)


def build_stream_index(
    root: str | os.PathLike,
    files: Mapping[str, Sequence[str]],
    *,
    latent_dtype: str | None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> StreamIndex:
    """The stream index of a local cache: where its rows sit, and the blocks' digests.

    Args:
        root: the cache folder.
        files: ``"rows"``, ``"embeddings"``, ``"indices"`` -> the files (paths relative
            to ``root``) in row order, as the markers list them.
        latent_dtype: the build report's ``precision.storage_dtype`` (or None).
        block_bytes: target bytes per checksum block (whole rows, at least one).

    Raises:
        CacheFormatError: a file is unreadable or a column has no fixed-shape layout.
        ValueError: ``block_bytes < 1``.
    """
    from hf_pipeline.read.mapped import MappedColumn

    if block_bytes < 1:
        raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
    columns = {}
    for name, kind in STREAM_COLUMNS.items():
        rels = list(files[kind])
        paths = [os.path.join(root, r) for r in rels]
        with MappedColumn.open(paths, name) as col:
            table = col.chunk_table()
            row_bytes = col.row_bytes
            block_rows = max(1, block_bytes // max(row_bytes, 1))
            digests: list[int] = []
            handles: dict[Any, Any] = {}
            try:
                for file, rows, offset in table:
                    fh = handles.get(file)
                    if fh is None:
                        fh = handles[file] = open(paths[file], "rb")  # noqa: SIM115 - closed below
                    for start in range(0, rows, block_rows):
                        n = min(block_rows, rows - start)
                        fh.seek(offset + start * row_bytes)
                        digests.append(block_digest(fh.read(n * row_bytes)))
            finally:
                for fh in handles.values():
                    fh.close()
            columns[name] = ColumnIndex(
                files=tuple(rels),
                row_shape=tuple(col.row_shape),
                dtype=col.stored_dtype.str,
                block_rows=block_rows,
                chunks=tuple(table),
                digests=np.array(digests, dtype=np.uint64),
            )
    return StreamIndex(columns=columns, latent_dtype=latent_dtype)
