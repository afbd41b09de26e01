"""A build's start-up timeline in this process: when each thing the join's first shard
and the first embedding need became ready, in seconds after :func:`prepare_cache` was
entered.

The build report carries it (``startup``) so that where a fresh process spends its first
seconds is read from the build itself, not guessed from outside: ``identity`` (inputs
listed, fingerprint known), ``workers_starting`` (the fork server of the join's workers
asked to start, :mod:`hf_pipeline.workers.pool`), ``imports`` (the libraries the
build's threads import, imported on the main thread first), ``join_map`` (the first
join of this process starts), ``first_shard`` (its first worker started its first
shard), ``tokenizer`` and ``encoder`` (transformers' tokenizer and the model, loaded on
their own thread). Beside the times, ``notes`` (:meth:`StartupTimeline.note`): facts
about the start-up (none recorded by the build today).

Thread-safe: the loading thread and the main thread both mark.

:func:`prepare_cache`: :func:`hf_pipeline.build.prepare.prepare_cache`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["StartupTimeline"]


class StartupTimeline:
    """Wall-clock stamps of named start-up events; the first stamp of a name wins.

    Args:
        origin: the wall-clock time the timeline counts from (default: now).
    """

    def __init__(self, origin: float | None = None):
        self.origin = time.time() if origin is None else origin
        self._events: dict[str, float] = {}
        self._notes: dict[str, Any] = {}
        self._lock = threading.Lock()

    def mark(self, name: str, at: float | None = None) -> None:
        """Record ``name`` now (or at wall-clock ``at``), unless it is recorded already."""
        stamp = time.time() if at is None else at
        with self._lock:
            self._events.setdefault(name, stamp)

    def note(self, name: str, value: Any) -> None:
        """Record a JSON-able fact about the start-up (the last value wins)."""
        with self._lock:
            self._notes[name] = value

    def at(self, name: str) -> float | None:
        """The wall-clock time of ``name``, or None if it was not marked."""
        with self._lock:
            return self._events.get(name)

    def as_dict(self) -> dict[str, Any]:
        """``{"entered": origin, "seconds": {event: seconds after origin}, "notes":
        {...}}`` (events in time order): the build report's ``startup`` block."""
        with self._lock:
            events = sorted(self._events.items(), key=lambda kv: kv[1])
            notes = dict(self._notes)
        return {
            "entered": round(self.origin, 3),
            "seconds": {name: round(t - self.origin, 3) for name, t in events},
            "notes": notes,
        }
