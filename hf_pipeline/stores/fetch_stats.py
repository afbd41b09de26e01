"""Download counters of one fetching party, and their sum for the build report.

Each party that downloads (the parent's :class:`~hf_pipeline.stores.fetch.ShardFetcher`, each
``datasets.map`` worker's :class:`~hf_pipeline.stores.fetch.StagingClient`, a
:class:`~hf_pipeline.stores.Source` for listings and the metadata parquet) counts in
its own :class:`FetchStats`; :func:`merge_fetch_stats` adds their snapshots into the
report's ``fetch`` section.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["FetchStats", "merge_fetch_stats"]

#: Counters that are lists of ``{"name", "url", "reason"}`` records (appended to).
_LISTS = ("failures", "skipped")


class FetchStats:
    """Counters of one fetching party (fetcher, worker or source). Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes = 0
        self.files = 0
        self.retries = 0
        self.listing_retries = 0  # listing, stat and revision calls (not downloads)
        self.failures: list[dict[str, str]] = []
        self.skipped: list[dict[str, str]] = []
        self.staging_hits = 0
        self.staging_misses = 0
        self.resumed_bytes = 0
        self.download_seconds = 0.0
        self._first: float | None = None
        self._last: float | None = None

    def add(self, **inc: Any) -> None:
        """Add to counters (``bytes=``, ``files=``, ...); lists are appended to."""
        with self._lock:
            for key, value in inc.items():
                if key in _LISTS:
                    getattr(self, key).append(value)
                else:
                    setattr(self, key, getattr(self, key) + value)

    def span(self, start: float, end: float) -> None:
        """Record one download's wall interval (for aggregate throughput)."""
        with self._lock:
            self._first = start if self._first is None else min(self._first, start)
            self._last = end if self._last is None else max(self._last, end)
            self.download_seconds += end - start

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly snapshot."""
        with self._lock:
            wall = (
                (self._last - self._first)
                if self._first is not None and self._last is not None
                else 0.0
            )
            return {
                "bytes": self.bytes,
                "files": self.files,
                "retries": self.retries,
                "listing_retries": self.listing_retries,
                "failures": list(self.failures),
                "skipped": list(self.skipped),
                "staging_hits": self.staging_hits,
                "staging_misses": self.staging_misses,
                "resumed_bytes": self.resumed_bytes,
                "download_seconds": round(self.download_seconds, 4),
                "wall_seconds": round(wall, 4),
            }


def merge_fetch_stats(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Sum snapshots of :meth:`FetchStats.as_dict` (some may hold only a few keys).

    Lists are concatenated (``skipped`` keeps each file name once, first wins),
    ``wall_seconds`` is the longest (the parties ran at the same time), the rest add up;
    ``mean_mb_s`` is derived from the sums.
    """
    out: dict[str, Any] = {
        "bytes": 0,
        "files": 0,
        "retries": 0,
        "listing_retries": 0,
        "failures": [],
        "skipped": [],
        "staging_hits": 0,
        "staging_misses": 0,
        "resumed_bytes": 0,
        "download_seconds": 0.0,
        "wall_seconds": 0.0,
    }
    for part in parts:
        for key, value in part.items():
            if key not in out:
                continue
            if isinstance(out[key], list):
                out[key].extend(value)
            elif key == "wall_seconds":
                out[key] = max(out[key], value)
            else:
                out[key] += value
    seen: set[str] = set()
    unique = []
    for s in out["skipped"]:
        if s["name"] not in seen:
            seen.add(s["name"])
            unique.append(s)
    out["skipped"] = unique
    out["mean_mb_s"] = (
        round(out["bytes"] / 1e6 / out["wall_seconds"], 3) if out["wall_seconds"] > 0 else 0.0
    )
    return out
