"""Every latent row accounted for: drop reasons, duplicates, bad rows, the build report.

A latent row is either kept or counted under exactly one reason, in this order:
``nonfinite_latents`` (a NaN or inf in its latents), the caption's reason
(``no_caption``, ``empty_caption``, ``bad_caption_encoding``: its bytes are not UTF-8),
then ``duplicate_key`` (its key appeared in an
earlier row with finite latents, in shard order). ``no_latents`` counts metadata rows
that no latent row uses; with ``on_missing: skip``, ``missing_shard_files`` counts the
shards left out. :func:`build_report` checks ``rows_out + sum(reasons) == rows_in``.

Everything here is NumPy/Arrow over whole columns: no Python object per row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dist.safepath import shown

__all__ = [
    "DUPLICATE",
    "FIRST_KEYS",
    "KEEP",
    "NONFINITE",
    "REASONS",
    "ReasonCodes",
    "bad_rows_summary",
    "build_report",
    "keep_mask",
    "report_problem",
    "later_duplicates",
    "sorted_unique",
]

#: Why a latent row was not kept (plus ``no_latents`` for metadata rows). Each row
#: gets one: ``nonfinite_latents`` first, then the caption's reason, then duplicates.
REASONS: tuple[str, ...] = (
    "nonfinite_latents",
    "no_caption",
    "empty_caption",
    "bad_caption_encoding",
    "duplicate_key",
)
NONFINITE, DUPLICATE = REASONS[0], REASONS[-1]
#: The drop reason of a kept row.
KEEP = ""
#: How many offending keys the report (and a ``data.on_bad_rows: fail`` error) names.
FIRST_KEYS = 10


class ReasonCodes:
    """A ``drop_reason`` column as small integer codes (no Python string per row).

    Attributes:
        codes: int16 array, one code per row.
        names: the reason of each code (``names[codes[i]]`` is row i's reason).
    """

    def __init__(self, column: pa.Array | pa.ChunkedArray):
        encoded = pc.dictionary_encode(column)
        if isinstance(encoded, pa.ChunkedArray):
            encoded = (
                encoded.combine_chunks()
                if encoded.num_chunks
                else pa.array([], pa.dictionary(pa.int32(), pa.string()))
            )
        self.names: list[str] = [str(x) for x in encoded.dictionary.to_pylist()]
        self.codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int16)

    def code(self, name: str) -> int:
        """The code of ``name``, added to :attr:`names` if no row has it yet."""
        if name not in self.names:
            self.names.append(name)
        return self.names.index(name)

    def mask(self, name: str) -> np.ndarray:
        """Rows whose reason is ``name``."""
        return self.codes == self.code(name)

    def counts(self) -> dict[str, int]:
        """``{reason: rows}`` for every reason some row has (``""`` for kept rows)."""
        found: Sequence[int] | np.ndarray = (
            np.bincount(self.codes, minlength=len(self.names)) if len(self.codes) else []
        )
        return {name: int(n) for name, n in zip(self.names, found, strict=False) if n}


def keep_mask(reasons: pa.Array) -> np.ndarray:
    """True where a ``drop_reason`` array says the row is kept (:data:`KEEP`; a null
    reason is not kept), as a NumPy bool array: no Python string per row."""
    return pc.equal(reasons, KEEP).fill_null(False).to_numpy(zero_copy_only=False)


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """The distinct values of an integer array, ascending (``np.unique(values)``, by a sort).

    numpy 2's ``np.unique`` hashes: 0.59 s for 1M distinct int64 keys on a 2-CPU VM, where
    a sort and a comparison of neighbours take 6 ms. The assembly of 1M rows called it
    twice (1.7-2.0 s of ``seconds_assemble`` on an H100 host).
    """
    ordered = np.sort(np.asarray(values).reshape(-1))
    if ordered.size == 0:
        return ordered
    first = np.empty(ordered.size, dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return ordered[first]


def later_duplicates(keys: np.ndarray, eligible: np.ndarray | None = None) -> np.ndarray:
    """True for every row whose key appeared in an earlier eligible row.

    Args:
        keys: int64 keys in shard order.
        eligible: rows that can win (default all); an ineligible row (NaN latents) is
            never a duplicate and never shadows a later copy of its key.
    """
    dup = np.zeros(len(keys), dtype=bool)
    rows = np.arange(len(keys)) if eligible is None else np.flatnonzero(eligible)
    _, first = np.unique(keys[rows], return_index=True)
    seen_later = np.ones(len(rows), dtype=bool)
    seen_later[first] = False
    dup[rows] = seen_later
    return dup


def bad_rows_summary(keys: np.ndarray, nonfinite: np.ndarray) -> dict[str, Any]:
    """The report's ``bad_rows`` block: how many rows had NaN/inf latents, first keys."""
    return {
        NONFINITE: {
            "count": int(nonfinite.sum()),
            "first_keys": [int(x) for x in keys[nonfinite][:FIRST_KEYS]],
        }
    }


def build_report(
    *,
    fingerprint: str,
    cache_dir: str,
    rows_out: int,
    converted: Mapping[str, Any],
    builder: Mapping[str, Any],
    config: Mapping[str, Any],
) -> dict[str, Any]:
    """The build report (``filtered/report.json``) from the converted stage's info.

    Raises:
        AssertionError: the rows do not add up (an internal invariant, not input).
    """
    dropped = {r: int(converted["reasons"].get(r, 0)) for r in REASONS}
    dropped["no_latents"] = int(converted["no_latents"])
    skipped = converted.get("fetch", {}).get("skipped", [])
    if skipped:
        dropped["missing_shard_files"] = len(skipped)
    report = {
        "fingerprint": fingerprint,
        "cache_dir": cache_dir,
        "rows_in": int(converted["rows_in"]),
        "rows_out": int(rows_out),
        "dropped": dropped,
        "embed_dim": converted["embed_dim"],
        "duplicate_meta_rows": converted["duplicate_meta_rows"],
        # Metadata rows with a null key (dropped); absent from a cache published before.
        "null_key_meta_rows": converted.get("null_key_meta_rows", 0),
        "bad_rows": converted.get("bad_rows", {}),
        # Who built which shards (one part unless build.part_shards / parallel: ranks).
        "parts": converted.get("parts", []),
        # What came from the part store and what was built (absent before it).
        "reuse": converted.get("reuse"),
        "skipped_files": skipped,
        # The caption parquet the build read; absent before it was reported.
        "metadata": converted.get("metadata"),
        "fetch": converted.get("fetch", {}),
        # The key-sorted caption table (the builder's, or rank 0's with parallel: ranks);
        # None in a cache published by a release before it.
        "seconds_captions": converted.get("seconds_captions"),
        # Putting the parts together (duplicates across parts, the final drop reasons;
        # with parallel: ranks also the hard links): rank 0's, in the converted stage.
        "seconds_assemble": converted.get("seconds_assemble"),
        "seconds_convert": converted["seconds_convert"],
        "seconds_embed": converted["seconds_embed"],
        # The parts' tokens units built (by the workers); absent before them.
        "seconds_tokenize": converted.get("seconds_tokenize"),
        # The builder's start-up timeline (hf_pipeline.build.startup); absent when the
        # converted stage only assembled, or was published by a release before it.
        "startup": converted.get("startup"),
        # Absent when the converted stage was published by a release before it.
        "precision": converted.get("precision"),
        "builder": dict(builder),
        "config": dict(config),
    }
    accounted = rows_out + sum(dropped[r] for r in REASONS)
    if accounted != report["rows_in"]:
        raise AssertionError(f"row accounting broken: {accounted} != {report['rows_in']}")
    return report


#: Keys of the report's ``dropped`` block besides :data:`REASONS`.
OTHER_DROPS: tuple[str, ...] = ("no_latents", "missing_shard_files")
#: Bound of every count in a report (a larger one is forged, or overflows what prints it).
MAX_COUNT = 1 << 48
_MAX_TEXT = 4096  # fingerprint, cache_dir, a first key


def _count_problem(field: str, value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{field} must be an integer, got {type(value).__name__}"
    if not 0 <= value <= MAX_COUNT:
        return f"{field} must be in [0, {MAX_COUNT}], got {shown(value)}"
    return None


def _text_problem(field: str, value: object) -> str | None:
    if not isinstance(value, str) or len(value) > _MAX_TEXT or not value.isprintable():
        return f"{field} must be a string of printable characters, got {shown(value)}"
    return None


def report_problem(report: object) -> str | None:
    """Why ``report`` is not a build report this release can print and trust (the known
    keys' types and bounds, reason names from the known set, and
    ``rows_out + sum(dropped reasons) == rows_in``), or None.

    A report may come from a store (a pulled cache): hostile until checked. Unknown
    keys are left alone (a later release may add some); nothing prints them.
    """
    if not isinstance(report, Mapping):
        return f"must be a JSON object, got {type(report).__name__}"
    problems: list[str | None] = []
    for key in ("rows_in", "rows_out", "duplicate_meta_rows"):
        problems.append(_count_problem(key, report.get(key)))
    for key in ("null_key_meta_rows",):  # absent from caches published before it
        if key in report:
            problems.append(_count_problem(key, report[key]))
    if report.get("embed_dim") is not None:
        problems.append(_count_problem("embed_dim", report["embed_dim"]))
    for key in ("fingerprint", "cache_dir"):
        problems.append(_text_problem(key, report.get(key)))
    for key in ("seconds_captions", "seconds_assemble", "seconds_convert", "seconds_embed"):
        v = report.get(key)
        if v is not None and (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or not (math.isfinite(v) and v >= 0)
        ):
            problems.append(f"{key} must be a finite number >= 0 or null, got {shown(v)}")
    for key, kind in (("parts", list), ("skipped_files", list), ("builder", Mapping),
                      ("config", Mapping), ("fetch", Mapping), ("bad_rows", Mapping),
                      ("precision", Mapping)):  # fmt: skip
        if report.get(key) is not None and not isinstance(report[key], kind):
            problems.append(f"{key} must be a JSON {kind.__name__.lower()}")
    problems.append(_dropped_problem(report.get("dropped")))
    problems.append(_bad_rows_problem(report.get("bad_rows")))
    fetch = report.get("fetch")
    if isinstance(fetch, Mapping):
        for key in ("files", "bytes", "retries"):
            if key in fetch:
                problems.append(_count_problem(f"fetch.{key}", fetch[key]))
        v = fetch.get("mean_mb_s", 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            problems.append(f"fetch.mean_mb_s must be a finite number, got {shown(v)}")
    precision = report.get("precision")
    if isinstance(precision, Mapping) and "storage_dtype" in precision:
        problems.append(_text_problem("precision.storage_dtype", precision["storage_dtype"]))
    found = next((p for p in problems if p), None)
    if found:
        return found
    dropped = report["dropped"]
    accounted = report["rows_out"] + sum(dropped.get(r, 0) for r in REASONS)
    if accounted != report["rows_in"]:
        return (
            f"rows do not add up: rows_out {report['rows_out']} + dropped {accounted - report['rows_out']} "
            f"!= rows_in {report['rows_in']}"
        )
    return None


def _dropped_problem(dropped: object) -> str | None:
    if not isinstance(dropped, Mapping):
        return "dropped must be a JSON object"
    for reason, n in dropped.items():
        if reason not in REASONS and reason not in OTHER_DROPS:
            return f"dropped has an unknown reason {shown(reason)}"
        if why := _count_problem(f"dropped.{reason}", n):
            return why
    return None


def _bad_rows_problem(bad_rows: object) -> str | None:
    if not isinstance(bad_rows, Mapping):
        return None  # absent or not an object: said above
    for reason, bad in bad_rows.items():
        if reason not in REASONS:
            return f"bad_rows has an unknown reason {shown(reason)}"
        if not isinstance(bad, Mapping):
            return f"bad_rows.{reason} must be a JSON object"
        if why := _count_problem(f"bad_rows.{reason}.count", bad.get("count", 0)):
            return why
        keys = bad.get("first_keys", [])
        if not isinstance(keys, list) or len(keys) > FIRST_KEYS:
            return f"bad_rows.{reason}.first_keys must be a list of at most {FIRST_KEYS} keys"
        for k in keys:
            ok = isinstance(k, int) and not isinstance(k, bool) and abs(k) <= 1 << 64
            if not ok and _text_problem("", k):
                return f"bad_rows.{reason}.first_keys holds {shown(k)}"
    return None
