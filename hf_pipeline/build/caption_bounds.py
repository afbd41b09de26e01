"""Caption arrays measured without decoding them, and cut to what Arrow's 32-bit string
offsets hold.

The metadata is foreign: a dictionary-encoded column may stand for far more text than
its file holds (400 rows sharing one 10 MB value: 4 GB from 2.2 KB). So a caption
column is measured first (:func:`caption_lengths`: a dictionary's value lengths at the
indices used, nothing decoded), refused past the limit (:func:`too_long`), and decoded
and moved in slices of bounded bytes (:func:`byte_slices`, :func:`as_large_string`,
which decodes into 64-bit offsets directly). Used by
:mod:`hf_pipeline.build.caption_sort`, :mod:`hf_pipeline.build.captions` and the
``text`` unit's writer (:func:`hf_pipeline.build.parts.text_part`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["as_large_string", "byte_slices", "caption_lengths", "text_offsets", "too_long"]


def caption_lengths(arr: pa.Array) -> np.ndarray:
    """Each caption's byte length (0 where null), as int64, without decoding anything:
    a dictionary array's lengths are its dictionary's at the indices it uses.

    Args:
        arr: a caption array (string, large_string, string_view, a dictionary of
            those, or all-null).

    Raises:
        ValueError: a dictionary index outside its dictionary.
    """
    n = len(arr)
    if pa.types.is_null(arr.type) or n == 0:
        return np.zeros(n, dtype=np.int64)
    if pa.types.is_dictionary(arr.type):
        idx = arr.indices.to_numpy(zero_copy_only=False)
        valid = None
        if arr.indices.null_count:  # a null slot's index is undefined: read as 0
            valid = arr.indices.is_valid().to_numpy(zero_copy_only=False)
            idx = np.where(valid, idx, 0)
        idx = idx.astype(np.int64, copy=False)
        values = arr.dictionary
        if len(values) == 0 or (idx.size and (idx.min() < 0 or idx.max() >= len(values))):
            if valid is None or valid.any():
                raise ValueError(f"a dictionary index outside its {len(values)} values")
            return np.zeros(n, dtype=np.int64)
        offsets = text_offsets(values)
        out = offsets[idx + 1] - offsets[idx]
        if valid is not None:
            out[~valid] = 0
        return out
    offsets = text_offsets(arr)
    out = offsets[1:] - offsets[:-1]
    if arr.null_count:
        out[~arr.is_valid().to_numpy(zero_copy_only=False)] = 0
    return out


def text_offsets(arr: pa.Array) -> np.ndarray:
    """A text array's value offsets (``len + 1``, int64); a string_view array is cast
    first (plain, already decoded data)."""
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        arr = arr.cast(pa.large_string())
    wide = pa.types.is_large_string(arr.type)
    return np.frombuffer(
        arr.buffers()[1],
        dtype=np.int64 if wide else np.int32,
        count=len(arr) + 1,
        offset=arr.offset * (8 if wide else 4),
    ).astype(np.int64)


def as_large_string(arr: pa.Array) -> pa.Array:
    """``arr`` as ``large_string`` (64-bit offsets: the production caption column holds
    more than 2 GiB of text); a cast copies only the offsets. A dictionary array is
    decoded into 64-bit offsets directly (a cast decodes it into 32-bit ones first,
    which overflow at 2 GiB): the caller bounds its size (:func:`caption_lengths`)."""
    if pa.types.is_dictionary(arr.type):
        values = arr.dictionary
        if int(caption_lengths(arr).sum()) >= 2**31 - 1 or not pa.types.is_string(values.type):
            values = as_large_string(values)
        arr = pc.take(values, arr.indices)
    return arr if pa.types.is_large_string(arr.type) else arr.cast(pa.large_string())


def byte_slices(sizes: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Cut rows of ``sizes`` bytes into consecutive ``(start, stop)`` slices of at most
    ``limit`` bytes each; a row larger than ``limit`` is a slice of its own. Empty input:
    one empty slice."""
    if int(sizes.sum()) <= limit:
        return [(0, len(sizes))]
    ends = np.cumsum(sizes)
    out, lo = [], 0
    while lo < len(sizes):
        base = int(ends[lo - 1]) if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, base + limit, side="right")))
        out.append((lo, hi))
        lo = hi
    return out


def too_long(caption_column: str, row: int, key: object, size: int, limit: int) -> str:
    """The refusal of a caption over the limit: column, file row (and key), size, limit
    and the setting that raises it."""
    at = f"row {row}" if key is None else f"row {row} (key {key})"
    return (
        f"caption column {caption_column!r}, {at}: a caption of {size} bytes, over the "
        f"limit of {limit} bytes (data.max_caption_bytes)"
    )
