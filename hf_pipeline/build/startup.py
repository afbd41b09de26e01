"""A build's start-up timeline in this process: when each thing the join's first shard
and the first embedding need became ready, in seconds after :func:`prepare_cache` was
entered.

The build report carries it (``startup``) so that where a fresh process spends its first
seconds is read from the build itself, not guessed from outside: ``identity`` (inputs
listed, fingerprint known), ``workers_starting`` (the fork server of the join's workers
asked to start, :mod:`hf_pipeline.workers.pool`), ``imports`` (what the join needs
and the build's threads share: torch, ``torch.distributed``, ``datasets``, imported on
the main thread before any thread starts), ``join_map`` (the first join of this process
starts), ``first_shard`` (its first worker started its first shard), then on the
encoder's loading thread: ``transformers`` (transformers imported, beside the caption
table; the join starts after it), ``encoder_loading`` (the tokenizer and the model
began loading: once the join started, or when an embedding asked for the encoder
first), ``tokenizer`` and ``encoder`` (the model ready); ``tokenizer`` is marked when
the tokenizer was found without transformers instead (in the model folder,
:mod:`hf_pipeline.encoder.bert_tokenizer`, or in the cache root's tokenizer store,
:mod:`hf_pipeline.build.tokenizer_store`: then on whichever thread asked first), and
``tokens_pool`` when the token ids' worker pool started. Beside the times, ``notes``
(:meth:`StartupTimeline.note`): facts about the start-up: ``tokenizer`` (``"native"``,
``"store"`` or ``"transformers"``: where it came from) and, after a store miss,
``tokenizer_saved``.

Thread-safe: the loading thread and the main thread both mark; :meth:`StartupTimeline.when`
lets one thread act on another's mark.

:func:`prepare_cache`: :func:`hf_pipeline.build.prepare.prepare_cache`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
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
        self._waiting: dict[str, list[Callable[[], None]]] = {}
        self._lock = threading.Lock()

    def mark(self, name: str, at: float | None = None) -> None:
        """Record ``name`` now (or at wall-clock ``at``), unless it is recorded already;
        the first mark of a name runs what :meth:`when` registered for it (here, after
        the stamp)."""
        stamp = time.time() if at is None else at
        with self._lock:
            first = name not in self._events
            self._events.setdefault(name, stamp)
            callbacks = self._waiting.pop(name, []) if first else []
        for callback in callbacks:
            callback()

    def when(self, name: str, callback: Callable[[], None]) -> None:
        """Run ``callback`` once ``name`` is marked: on the marking thread, after the
        stamp and before :meth:`mark` returns (a callback that waits holds that thread
        back: the build's first join waits there for transformers' import, see
        :class:`hf_pipeline.build.prepare._EncoderLoading`); at once, here, if ``name``
        is marked already."""
        with self._lock:
            if name not in self._events:
                self._waiting.setdefault(name, []).append(callback)
                return
        callback()

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
