"""Fetch machinery for remote sources: retries, verified atomic staging, prefetch.

The build converts shards inside ``datasets.map(num_proc=K)`` worker processes. This
module gives it two halves:

* :class:`Prefetcher` (parent side, a context manager): a bounded thread pool that
  downloads shard files into a local staging folder in the order the K workers will
  consume them, at most ``prefetch_ahead`` files beyond the K being converted and at
  most ``staging_max_gb`` bytes.
* :class:`StagingClient` (picklable, handed to the workers): ``acquire(file)`` waits
  for the staged copy (or fetches it itself when prefetching is off), ``release(file)``
  deletes it once converted, freeing room for the next download.

The two halves talk through small marker files in a per-run control folder inside
the staging folder (``.ctl/<run>/``): a worker asking for a file writes ``want``,
one done with it writes ``released``; the prefetcher writes ``failed`` markers and a
heartbeat counter. Files survive process boundaries, forks and pickling, where
queues and locks do not.

Every download goes through :func:`_stage_file`: bytes land in a private
``.part`` file, are checked against the size and checksum the store published,
fsynced, and only then renamed into place next to a sidecar JSON recording what was
verified. A truncated or corrupted body is never visible under the final name, and a
file whose sidecar matches is not fetched again after a kill (resume).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dist.atomic import write_json_atomic
from hf_pipeline.errors import SourceError, StoreUnreachableError

if TYPE_CHECKING:  # pragma: no cover
    from hf_pipeline.config import DataConfig
    from hf_pipeline.sources import RemoteFile, Source

__all__ = ["FetchStats", "Prefetcher", "RetryPolicy", "StagingClient", "consumption_order"]

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20  # bytes per ranged read: small enough to notice a deadline or stop
_POLL = 0.02  # seconds between marker-folder checks (local disk, cheap)
_DEAD_AFTER = 15.0  # seconds without prefetcher heartbeat progress -> fetch ourselves
_SIDECAR_VERSION = 1


# --------------------------------------------------------------------------- retries


class _TransientError(OSError):
    """A failure worth retrying (5xx, 429, timeout, reset, truncated or corrupt body)."""


class _Cancelled(Exception):
    """The owning prefetcher is closing; abandon the download quietly."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How hard to try for one file.

    Attributes:
        max_retries: retries after the first attempt (0: one attempt only).
        file_timeout: seconds one attempt at one file may take, stalls included.
        backoff_base: first backoff delay in seconds; doubles per retry.
        backoff_max: cap on one delay.
    """

    max_retries: int = 5
    file_timeout: float = 600.0
    backoff_base: float = 0.5
    backoff_max: float = 30.0

    def __post_init__(self):
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.file_timeout <= 0:
            raise ValueError(f"file_timeout must be > 0, got {self.file_timeout}")
        if self.backoff_base < 0:
            raise ValueError(f"backoff_base must be >= 0, got {self.backoff_base}")

    def delay(self, attempt: int) -> float:
        """Backoff before retry ``attempt`` (1-based): exponential with full jitter.

        Full jitter (uniform in [d/2, d]) spreads out many clients hitting a store that
        just came back, instead of retrying in lock-step.
        """
        d = min(self.backoff_max, self.backoff_base * (2 ** (attempt - 1)))
        return d * (0.5 + 0.5 * random.random())

    @classmethod
    def from_config(cls, data_config: DataConfig, **overrides: Any) -> RetryPolicy:
        """The policy a :class:`~hf_pipeline.config.DataConfig` asks for."""
        kw = {"max_retries": data_config.max_retries, "file_timeout": data_config.file_timeout}
        kw.update(overrides)
        return cls(**kw)


_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}


def _status_of(exc: BaseException) -> int | None:
    """HTTP status carried by an exception from gcsfs, huggingface_hub or httpx."""
    for attr in ("code", "status", "status_code"):
        v = getattr(exc, attr, None)
        with contextlib.suppress(TypeError, ValueError):
            if v is not None:
                return int(v)
    resp = getattr(exc, "response", None)
    v = getattr(resp, "status_code", None)
    return int(v) if isinstance(v, int) else None


def _is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure a retry may cure.

    Not found / forbidden / bad request are permanent: retrying a 404 five times only
    delays the clear error the user needs.
    """
    if isinstance(exc, _TransientError | TimeoutError | ConnectionError):
        return True
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError):
        return False
    status = _status_of(exc)
    if status is not None:
        return status in _RETRY_STATUS
    mod = type(exc).__module__ or ""
    name = type(exc).__name__
    # aiohttp (gcsfs), httpx2 (huggingface_hub), requests (gcsfs maps 502 to ProxyError):
    # their transport errors all mean "the connection failed", never "the data is wrong".
    if mod.startswith(("aiohttp", "httpx", "requests", "urllib3")):
        return not name.startswith(("InvalidURL", "UnsupportedProtocol", "InvalidHeader"))
    if name in ("ChecksumError", "ProxyError", "ServerDisconnectedError"):
        return True
    # huggingface_hub's http_get raises a plain OSError on a size mismatch.
    if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
        return True
    return False


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _with_retries(
    what: str,
    fn: Callable[[], Any],
    policy: RetryPolicy,
    *,
    on_retry: Callable[[BaseException], None] | None = None,
    stop: threading.Event | None = None,
) -> Any:
    """Call ``fn`` until it succeeds, retrying transient failures with backoff.

    Args:
        what: URL or path, for the error message.
        fn: the attempt; raises on failure.
        policy: retry count and backoff.
        on_retry: called with each exception that will be retried (stats).
        stop: abandon between attempts when set (raises :class:`_Cancelled`).

    Returns:
        What ``fn`` returned.

    Raises:
        SourceError: permanent failure (not found, forbidden, ...); names ``what``.
        StoreUnreachableError: transient failures until the retries ran out (the
            store is down or unreachable: a fault, not bad input); names ``what`` and
            the last failure.
    """
    attempt = 0
    while True:
        if stop is not None and stop.is_set():
            raise _Cancelled(what)
        try:
            return fn()
        except _Cancelled:
            raise
        except SourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified right below
            if not _is_transient(exc):
                raise SourceError(what, f"{_describe(exc)} (not retried)") from exc
            if attempt >= policy.max_retries:
                raise StoreUnreachableError(
                    what, f"failed after {attempt + 1} attempt(s); last error: {_describe(exc)}"
                ) from exc
            attempt += 1
            if on_retry is not None:
                on_retry(exc)
            delay = policy.delay(attempt)
            logger.info(
                "retry %d/%d for %s in %.2fs: %s",
                attempt,
                policy.max_retries,
                what,
                delay,
                _describe(exc),
            )
            if stop is not None:
                if stop.wait(delay):
                    raise _Cancelled(what) from exc
            else:
                time.sleep(delay)


# --------------------------------------------------------------------------- stats


class FetchStats:
    """Counters of one fetching party (prefetcher or worker). Thread-safe."""

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
            for k, v in inc.items():
                if k in ("failures", "skipped"):
                    getattr(self, k).append(v)
                else:
                    setattr(self, k, getattr(self, k) + v)

    def span(self, start: float, end: float) -> None:
        """Record one download's wall interval (for aggregate throughput)."""
        with self._lock:
            self._first = start if self._first is None else min(self._first, start)
            self._last = end if self._last is None else max(self._last, end)
            self.download_seconds += end - start

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly snapshot."""
        with self._lock:
            wall = (self._last - self._first) if self._first is not None else 0.0
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


def _merge_stats(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
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
    for p in parts:
        for k, v in p.items():
            if k not in out:
                continue
            if isinstance(out[k], list):
                out[k].extend(v)
            elif k == "wall_seconds":
                out[k] = max(out[k], v)
            else:
                out[k] += v
    seen: set[str] = set()
    out["skipped"] = [s for s in out["skipped"] if not (s["name"] in seen or seen.add(s["name"]))]
    out["mean_mb_s"] = (
        round(out["bytes"] / 1e6 / out["wall_seconds"], 3) if out["wall_seconds"] > 0 else 0.0
    )
    return out


# --------------------------------------------------------------------------- staging


def _safe_name(file: RemoteFile) -> str:
    # Shard names are flat ("000000-000009.pt"); keep them readable but never let a
    # remote name escape the staging folder.
    return re.sub(r"[^A-Za-z0-9._-]", "_", file.name) or "file"


def _ident(file: RemoteFile) -> dict[str, Any]:
    return {"url": file.url, "size": file.size, "etag": file.etag, "checksum": file.checksum}


def _read_json(path: Path) -> Any:
    """Parse a marker leniently: unreadable or malformed means absent (None)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _checksum_of(path: Path, kind: str) -> str:
    """Checksum of a whole file in the encoding the store publishes."""
    if kind == "crc32c":
        import google_crc32c

        c = google_crc32c.Checksum()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(_CHUNK), b""):
                c.update(block)
        return base64.b64encode(c.digest()).decode()
    if kind == "md5":
        h = hashlib.md5(usedforsecurity=False)
    elif kind == "sha256":
        h = hashlib.sha256()
    elif kind == "gitsha1":
        h = hashlib.sha1(usedforsecurity=False)
        h.update(b"blob %d\0" % path.stat().st_size)
    else:
        raise ValueError(f"unknown checksum kind {kind!r}")
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            h.update(block)
    if kind == "md5":
        return base64.b64encode(h.digest()).decode()
    return h.hexdigest()


# Parts being written by threads of this process (see _Staging.claim_part).
_ACTIVE_PARTS: set[str] = set()
_ACTIVE_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    # datasets.map forks its workers while our download threads run; a thread holding
    # _ACTIVE_LOCK at that instant would leave the child's copy locked forever. The
    # child writes no parent part, so it starts with an empty registry.
    global _ACTIVE_LOCK
    _ACTIVE_LOCK = threading.Lock()
    _ACTIVE_PARTS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Staging:
    """Layout of a staging folder. Process- and thread-safe (atomic renames only)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def path(self, file: RemoteFile) -> Path:
        return self.root / _safe_name(file)

    def sidecar(self, file: RemoteFile) -> Path:
        return self.root / f".{_safe_name(file)}.staged.json"

    def _part_prefix(self, file: RemoteFile) -> str:
        tag = hashlib.sha1(json.dumps(_ident(file), sort_keys=True).encode()).hexdigest()[:12]
        return f".{_safe_name(file)}.{tag}.part."

    def is_staged(self, file: RemoteFile) -> bool:
        """The final file exists and its sidecar records this exact remote version.

        The checksum was verified when the sidecar was written; we trust it here
        rather than re-hashing a multi-GB file on every resume.
        """
        meta = _read_json(self.sidecar(file))
        if not isinstance(meta, dict) or meta.get("version") != _SIDECAR_VERSION:
            return False
        if {k: meta.get(k) for k in ("url", "size", "etag", "checksum")} != _ident(file):
            return False
        try:
            return self.path(file).stat().st_size == file.size
        except OSError:
            return False

    def claim_part(self, file: RemoteFile) -> tuple[Path, int]:
        """A private ``.part`` file for this thread, adopting a dead owner's partial.

        Parts are named by owner pid/thread so two downloaders never write one file; a
        part left by a killed process (pid gone) is adopted with ``os.rename``, which
        only one adopter can win, and the download resumes from its size.

        Returns:
            (part path, bytes already present).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        prefix = self._part_prefix(file)
        mine = self.root / f"{prefix}{os.getpid()}.{threading.get_ident()}"
        with _ACTIVE_LOCK:
            if mine.exists():
                _ACTIVE_PARTS.add(str(mine))
                return mine, mine.stat().st_size
            for cand in sorted(self.root.glob(_glob_escape(prefix) + "*")):
                try:
                    pid = int(cand.name[len(prefix) :].split(".")[0])
                except ValueError:
                    continue
                # Ours but not being written (an earlier attempt/thread gave up), or
                # a dead process's: adoptable. A live process's: leave it alone.
                if pid == os.getpid():
                    if str(cand) in _ACTIVE_PARTS:
                        continue
                elif _pid_alive(pid):
                    continue
                try:
                    os.rename(cand, mine)
                except OSError:
                    continue  # another adopter won
                _ACTIVE_PARTS.add(str(mine))
                return mine, mine.stat().st_size
            _ACTIVE_PARTS.add(str(mine))
            return mine, 0

    @staticmethod
    def done_with_part(part: Path) -> None:
        """Mark a part as no longer being written by this process."""
        with _ACTIVE_LOCK:
            _ACTIVE_PARTS.discard(str(part))

    def publish(self, file: RemoteFile, part: Path) -> Path:
        """Rename a verified part into place, then write its sidecar (both atomic)."""
        final = self.path(file)
        os.replace(part, final)
        # Durable: fsyncs the sidecar, then self.root, which holds the rename above too.
        write_json_atomic(
            self.sidecar(file),
            {"version": _SIDECAR_VERSION, **_ident(file), "staged_at": time.time()},
        )
        return final

    def remove(self, file: RemoteFile) -> None:
        # Sidecar first: a crash in between leaves a data file without a sidecar,
        # which is "not staged" and gets overwritten, never trusted.
        for p in (self.sidecar(file), self.path(file)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


def _glob_escape(text: str) -> str:
    """Escape glob metacharacters (``[``, ``*``, ``?``) in a literal prefix."""
    return re.sub(r"([\[\]*?])", r"[\1]", text)


def _stage_file(
    source: Source,
    file: RemoteFile,
    staging: _Staging,
    policy: RetryPolicy,
    stats: FetchStats,
    *,
    stop: threading.Event | None = None,
    on_bytes: Callable[[int], None] | None = None,
    unwanted: Callable[[], bool] | None = None,
) -> Path | None:
    """Download ``file`` into ``staging`` verified and atomically, with retries.

    Thread-safe; several processes may stage the same file at once (each writes its own
    part; the last identical rename wins).

    Args:
        unwanted: checked when the file is not staged; True means "already consumed
            and released, do not fetch again" (returns None).

    Returns:
        The staged path, or None when ``unwanted()`` said so.

    Raises:
        SourceError: permanent failure or retries exhausted.
        _Cancelled: ``stop`` was set.
    """
    if staging.is_staged(file):
        return staging.path(file)
    # Checked after is_staged: a worker writes "released" before deleting, so a file
    # that vanished between the two checks is seen as released, never fetched again.
    if unwanted is not None and unwanted():
        return None
    kind, expected = file.checksum.partition(":")[::2] if file.checksum else ("", "")
    t0 = time.monotonic()

    def attempt() -> Path:
        part, have = staging.claim_part(file)
        try:
            return _fill(part, have)
        finally:
            _Staging.done_with_part(part)

    def _fill(part: Path, have: int) -> Path:
        if have > file.size:
            part.unlink()
            have = 0
        if have:
            stats.add(resumed_bytes=have)
        deadline = time.monotonic() + policy.file_timeout
        got = 0
        try:
            with open(part, "ab") as fh:
                for block in source._read_range(file, have, deadline, stop):
                    fh.write(block)
                    got += len(block)
                    if on_bytes is not None:
                        on_bytes(len(block))
                    if stop is not None and stop.is_set():
                        raise _Cancelled(file.url)
                fh.flush()
                os.fsync(fh.fileno())
        finally:
            stats.add(bytes=got)
        size = part.stat().st_size
        if size != file.size:
            if size > file.size:
                part.unlink()
            # A short body is kept: the next attempt resumes from it and the checksum
            # over the whole file still guards what was kept.
            raise _TransientError(f"size mismatch: got {size} bytes, expected {file.size}")
        if kind:
            actual = _checksum_of(part, kind)
            if actual != expected:
                part.unlink()
                raise _TransientError(f"{kind} mismatch: got {actual}, expected {expected}")
        return staging.publish(file, part)

    try:
        path = _with_retries(
            file.url, attempt, policy, on_retry=lambda e: stats.add(retries=1), stop=stop
        )
    finally:
        stats.span(t0, time.monotonic())
    stats.add(files=1)
    return path


# --------------------------------------------------------------------------- order


def consumption_order(files: Sequence[RemoteFile], num_workers: int) -> list[RemoteFile]:
    """The order K ``datasets.map`` workers are predicted to ask for ``files``.

    ``datasets`` splits the input into ``num_workers`` contiguous ranges and each
    worker walks its range in order, so step j of every worker comes before step j+1.

    Args:
        files: shards in list order.
        num_workers: K (``num_proc``); 1 means plain list order.

    Returns:
        ``files`` reordered by (step, worker).
    """
    k = max(1, min(num_workers, len(files)))
    n = len(files)
    # Same split as datasets' contiguous sharding: the first n % k ranges get one extra.
    ranges, start = [], 0
    for i in range(k):
        size = n // k + (1 if i < n % k else 0)
        ranges.append(files[start : start + size])
        start += size
    out = []
    for j in range(max((len(r) for r in ranges), default=0)):
        out.extend(r[j] for r in ranges if j < len(r))
    return out


# --------------------------------------------------------------------------- client


def _ctl_name(file: RemoteFile, what: str) -> str:
    return f"{_safe_name(file)}.{what}"


@dataclasses.dataclass(kw_only=True)
class StagingClient:
    """Worker-side handle on the staging folder; picklable (cross ``datasets.map``).

    Use in a worker::

        path = client.acquire(file, timeout=600)
        if path is None:           # skipped under on_missing="skip"; keys lost
            ...
        try:
            convert(path)
        finally:
            client.release(file)

    Process-safe (all coordination is by atomic files); one client may be used by one
    thread at a time per process.

    Attributes:
        source: the source (its network handles are rebuilt after unpickling).
        staging_dir: staging folder.
        ctl_dir: this run's control folder (markers, stats), or "" without a
            prefetcher.
        prefetched: a prefetcher thread stages files; False: ``acquire`` downloads
            itself.
        on_missing: "fail" or "skip".
        policy: retry policy for self-fetching.
    """

    source: Source
    staging_dir: str
    ctl_dir: str = ""
    prefetched: bool = False
    on_missing: str = "fail"
    policy: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)
    _stats: FetchStats | None = dataclasses.field(default=None, repr=False)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_stats"] = None  # per process; holds a lock
        return state

    @property
    def stats(self) -> FetchStats:
        if self._stats is None:
            self._stats = FetchStats()
        return self._stats

    def _dump_stats(self) -> None:
        if not self.ctl_dir or not Path(self.ctl_dir).is_dir():
            return
        with contextlib.suppress(OSError):
            write_json_atomic(
                Path(self.ctl_dir) / f"stats-{os.getpid()}.json", self.stats.as_dict()
            )

    def _skip_or_raise(self, file: RemoteFile, err: SourceError) -> None:
        if self.on_missing == "skip":
            logger.warning("skipping %s: %s", file.url, err.reason)
            self.stats.add(skipped={"name": file.name, "url": file.url, "reason": err.reason})
            return None
        raise err

    def acquire(self, file: RemoteFile, timeout: float | None = None) -> Path | None:
        """A local, verified path for ``file``.

        Local sources (and Hub files already in huggingface_hub's cache) return the
        original path, no copy. Otherwise waits for the prefetcher to stage it (asking
        for it first, so a worker that runs ahead of the predicted order is served
        next), or downloads it itself when no prefetcher runs or the prefetcher stopped
        beating.

        Args:
            file: a shard from ``Source.list_shards()``.
            timeout: most seconds to wait; None waits as long as the prefetcher is
                alive (its own per-file timeout and retries bound each file).

        Returns:
            The path, or None when the file failed and ``on_missing == "skip"`` (it is
            recorded in the fetch stats with the reason).

        Raises:
            SourceError: the file could not be fetched and ``on_missing == "fail"``, or
                ``timeout`` passed.
        """
        direct = self.source._direct_path(file)
        if direct is not None:
            self.stats.add(staging_hits=1)
            self._dump_stats()
            return direct
        staging = _Staging(self.staging_dir)
        try:
            if staging.is_staged(file):
                self.stats.add(staging_hits=1)
                return staging.path(file)
            self.stats.add(staging_misses=1)
            ctl = Path(self.ctl_dir) if self.ctl_dir else None
            if self.prefetched and ctl is not None and ctl.is_dir():
                path = self._wait(file, staging, ctl, timeout)
                if path is not False:
                    return path
            try:
                return _stage_file(self.source, file, staging, self.policy, self.stats)
            except SourceError as err:
                self.stats.add(failures={"name": file.name, "url": file.url, "reason": err.reason})
                return self._skip_or_raise(file, err)
        finally:
            self._dump_stats()

    def _wait(self, file: RemoteFile, staging: _Staging, ctl: Path, timeout: float | None):
        """Wait for the prefetcher; returns a path, None (skipped) or False (fetch it yourself)."""
        want = ctl / _ctl_name(file, "want")
        # Control markers only coordinate live processes, so no fsync (durable=False);
        # sidecars vouch for data after a crash, so they pay for it.
        with contextlib.suppress(OSError):
            write_json_atomic(want, {"pid": os.getpid()}, durable=False)
        try:
            return self._wait_staged(file, staging, ctl, timeout)
        finally:
            # Withdraw a want the prefetcher has not read yet: seen in one scan together
            # with our later "released", it would read as "wanted again" and the file
            # would be downloaded a second time and left staged (holding a window slot).
            with contextlib.suppress(OSError):
                want.unlink()

    def _wait_staged(self, file: RemoteFile, staging: _Staging, ctl: Path, timeout: float | None):
        start = time.monotonic()
        beat, beat_seen = None, time.monotonic()
        while True:
            if staging.is_staged(file):
                return staging.path(file)
            failed = _read_json(ctl / _ctl_name(file, "failed"))
            if isinstance(failed, dict):
                # The marker carries the kind, so "store down" keeps exit code 1 here too.
                kind = StoreUnreachableError if failed.get("unreachable") else SourceError
                err = kind(file.url, str(failed.get("reason", "fetch failed")))
                return self._skip_or_raise(file, err)
            if (ctl / _ctl_name(file, "unknown")).exists():
                return False  # not in the prefetcher's list: fetch it ourselves
            now = time.monotonic()
            hb = _read_json(ctl / "heartbeat")
            if hb != beat:
                beat, beat_seen = hb, now
            elif now - beat_seen > _DEAD_AFTER or not ctl.is_dir():
                # Judged by our own clock: the prefetcher's counter stopped moving.
                logger.warning(
                    "prefetcher stopped; fetching %s in worker %d", file.name, os.getpid()
                )
                return False
            if timeout is not None and now - start > timeout:
                raise StoreUnreachableError(file.url, f"not staged within {timeout:g}s")
            time.sleep(_POLL)

    def release(self, file: RemoteFile) -> None:
        """Delete the staged copy of ``file`` (never an original) and free its slot.

        Idempotent; safe to call for a skipped file.
        """
        # Marker first, then delete: the prefetcher treats "not staged + released" as
        # consumed, so it never re-downloads a file in the gap.
        if self.ctl_dir and Path(self.ctl_dir).is_dir():
            with contextlib.suppress(OSError):
                write_json_atomic(
                    Path(self.ctl_dir) / _ctl_name(file, "released"),
                    {"pid": os.getpid()},
                    durable=False,
                )
        if self.source._direct_path(file) is None:
            _Staging(self.staging_dir).remove(file)


# --------------------------------------------------------------------------- prefetcher


def _progress_enabled(flag: bool | None) -> bool:
    if flag is not None:
        return flag
    return sys.stderr.isatty()


class Prefetcher:
    """Downloads shards ahead of the ``datasets.map`` workers into a bounded staging area.

    Usage (parent process)::

        files = source.list_shards()
        with Prefetcher(source, files, data_config=cfg.data, num_workers=K) as pf:
            ds.map(convert, num_proc=K, fn_kwargs={"staging": pf.client()})
        report["fetch"] = pf.stats()

    Window: at most ``num_workers + prefetch_ahead`` files are downloading or staged
    and not yet released (the K being converted plus ``prefetch_ahead`` ahead), and
    their bytes stay under ``staging_max_gb`` (one file is always allowed, so a shard
    larger than the budget still makes progress). A file a worker asks for jumps the
    queue. With ``prefetch_ahead == 0`` no thread starts and workers fetch for
    themselves.

    Thread-safety: ``client()``/``stats()``/``close()`` may be called from any thread;
    ``close()`` is idempotent and waits (bounded) for the download threads.

    Args:
        source: where the files live (:func:`hf_pipeline.sources.open_source`).
        files: the shards, in list order.
        data_config: supplies prefetch_ahead, download_workers, staging_max_gb,
            on_missing, max_retries, file_timeout.
        num_workers: K, the ``num_proc`` of the consuming map.
        progress: tqdm bars; None: only when stderr is a TTY.
        policy: override the retry policy (tests use short backoffs).
    """

    def __init__(
        self,
        source: Source,
        files: Sequence[RemoteFile],
        *,
        data_config: DataConfig,
        num_workers: int = 1,
        progress: bool | None = None,
        policy: RetryPolicy | None = None,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.source = source
        self.files = list(files)
        self.num_workers = num_workers
        self.ahead = data_config.prefetch_ahead
        self.max_bytes = int(data_config.staging_max_gb * (1 << 30))
        self.download_workers = data_config.download_workers
        self.on_missing = data_config.on_missing
        self.policy = policy or source.policy
        self.staging = _Staging(source.staging_dir)
        self._order = consumption_order(self.files, num_workers)
        self._stats = FetchStats()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._progress = _progress_enabled(progress)
        self._bars: list[Any] = []
        self._pool: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        self.ctl_dir: Path | None = None
        # name -> "queued" | "staged" | "failed" | "released"
        self._state: dict[str, str] = {}  # keyed by _safe_name(file)
        self._futures: dict[str, Future] = {}
        self._worker_stats_cache: list[dict] = []
        self._staged_total = 0  # files this prefetcher has seen staged (start-up rule)

    # -- lifecycle
    def __enter__(self) -> Prefetcher:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
        if exc_type is None:
            self.raise_if_failed()

    def start(self) -> None:
        """Create the control folder and start the scheduler and download threads."""
        if self._thread is not None or self._closed:
            return
        self.staging.root.mkdir(parents=True, exist_ok=True)
        self._sweep_stale_ctl()
        # The control folder also carries the workers' stats, so it exists even when
        # no download thread runs.
        self.ctl_dir = self.staging.root / ".ctl" / uuid.uuid4().hex[:12]
        self.ctl_dir.mkdir(parents=True)
        if not self.prefetching:
            return  # workers acquire for themselves (local: the original path)
        write_json_atomic(self.ctl_dir / "heartbeat", 0, durable=False)
        if self._progress:
            from tqdm.auto import tqdm

            self._bars = [
                tqdm(total=len(self.files), desc="shards", unit="file", position=0),
                tqdm(
                    total=sum(f.size for f in self.files),
                    desc="bytes",
                    unit="B",
                    unit_scale=True,
                    position=1,
                ),
            ]
        self._pool = ThreadPoolExecutor(
            self.download_workers, thread_name_prefix="hf_pipeline-fetch"
        )
        self._thread = threading.Thread(target=self._run, name="hf_pipeline-prefetch", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop scheduling, abandon downloads in flight, remove the control folder.

        Staged files that were not released stay (a rerun finds them verified).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for bar in self._bars:
            bar.close()
        if self.ctl_dir is not None:
            self._collect_worker_stats()
            shutil.rmtree(self.ctl_dir, ignore_errors=True)

    # -- public
    @property
    def prefetching(self) -> bool:
        """Whether download threads run (remote source and ``prefetch_ahead > 0``)."""
        return self.ahead > 0 and not self.source.is_local

    def client(self) -> StagingClient:
        """A picklable :class:`StagingClient` for the workers of this run."""
        return StagingClient(
            source=self.source,
            staging_dir=str(self.staging.root),
            ctl_dir=str(self.ctl_dir) if self.ctl_dir is not None else "",
            prefetched=self.prefetching,
            on_missing=self.on_missing,
            policy=self.policy,
        )

    def stats(self) -> dict[str, Any]:
        """Bytes, files, mean MB/s, retries, failures, skipped files, staging hits/misses.

        Merges the prefetcher's counters with those the workers reported, and the
        source's own (this process): ``listing_retries`` (listing, stat and revision
        calls), ``metadata_retries`` (downloads through ``Source.fetch_one``) and the
        shards the listing already found missing (``skipped``, first).
        """
        src = self.source.fetch_stats.as_dict()
        parts = [{"skipped": src["skipped"], "listing_retries": src["listing_retries"]}]
        parts.append(self._stats.as_dict())
        parts.extend(self._worker_stats())
        out = _merge_stats(parts)
        out["metadata_retries"] = src["retries"]
        out["prefetch_ahead"] = self.ahead
        return out

    def raise_if_failed(self) -> None:
        """Re-raise an unexpected error of the scheduler thread (never swallowed)."""
        if self._error is not None:
            raise self._error

    # -- internals
    def _sweep_stale_ctl(self, max_age: float = 86400.0) -> None:
        # A killed run leaves its control folder behind; a day without any change
        # means nobody is using it (heartbeats rewrite it every 0.5 s).
        now = time.time()
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.staging.root / ".ctl"):
                with contextlib.suppress(OSError):
                    if entry.is_dir() and now - entry.stat().st_mtime > max_age:
                        shutil.rmtree(entry.path, ignore_errors=True)

    def _worker_stats(self) -> list[dict]:
        if self.ctl_dir is not None and self.ctl_dir.is_dir():
            got = [_read_json(p) for p in self.ctl_dir.glob("stats-*.json")]
            self._worker_stats_cache = [g for g in got if isinstance(g, dict)]
        return self._worker_stats_cache

    def _collect_worker_stats(self) -> None:
        self._worker_stats()

    def _in_flight(self) -> int:
        return sum(1 for name, st in self._state.items() if st == "queued")

    def _outstanding(self) -> tuple[int, int]:
        n = b = 0
        for f in self.files:
            if self._state.get(_safe_name(f)) in ("queued", "staged"):
                n += 1
                b += f.size
        return n, b

    def _poll_markers(self) -> set[str]:
        """Read and consume ``released``/``want`` markers (caller holds ``_lock``).

        Consumed markers are deleted so the scan stays small over a long build; the
        state they carried lives on in ``_state``.
        """
        wanted = set()
        assert self.ctl_dir is not None
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.ctl_dir):
                name, _, what = entry.name.rpartition(".")
                if what == "released":
                    # State first, then unlink: _is_released checks marker then state.
                    self._state[name] = "released"
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                elif what == "want":
                    wanted.add(name)
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        return wanted

    def _is_released(self, f: RemoteFile) -> bool:
        name = _safe_name(f)
        if (self.ctl_dir / _ctl_name(f, "released")).exists():
            return True
        with self._lock:
            return self._state.get(name) == "released"

    def _run(self) -> None:
        beat, last_beat = 0, 0.0
        by_name = {_safe_name(f): f for f in self.files}
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now - last_beat > 0.5:
                    beat, last_beat = beat + 1, now
                    write_json_atomic(self.ctl_dir / "heartbeat", beat, durable=False)
                with self._lock:
                    wanted = self._poll_markers()
                    # Wanted first: a worker is blocked on it right now.
                    for name in sorted(wanted):
                        f = by_name.get(name)
                        if f is None:
                            with contextlib.suppress(OSError):
                                write_json_atomic(
                                    self.ctl_dir / f"{name}.unknown", {}, durable=False
                                )
                        elif self._state.get(name) in (None, "released"):
                            # "released" and wanted again: a worker redoes a shard
                            # (a retried map batch); fetch it again.
                            self._submit(f)
                    limit = self.num_workers + self.ahead
                    for f in self._order:
                        if _safe_name(f) in self._state:
                            continue
                        n, b = self._outstanding()
                        if n >= limit or (n > 0 and b + f.size > self.max_bytes):
                            break
                        if (
                            self._staged_total < self.num_workers
                            and self._in_flight() >= self.num_workers
                        ):
                            # Start-up: every worker is waiting for its first shard. On a
                            # shared link, N parallel downloads each get 1/N of it, so
                            # fetch just those K first and widen once they have landed.
                            break
                        self._submit(f)
                # Keeps beating after the last file too: a worker may still want a shard
                # again (a retried batch) and should not wait for a dead-prefetcher verdict.
                self._stop.wait(_POLL * 2)
        except BaseException as exc:  # noqa: BLE001 - kept for raise_if_failed, workers see no heartbeat
            logger.exception("prefetch scheduler failed")
            self._error = exc

    def _submit(self, f: RemoteFile) -> None:
        self._state[_safe_name(f)] = "queued"
        assert self._pool is not None
        self._futures[_safe_name(f)] = self._pool.submit(self._download, f)

    def _download(self, f: RemoteFile) -> None:
        bar_bytes = self._bars[1].update if self._bars else None
        try:
            if self.staging.is_staged(f):
                self._stats.add(staging_hits=1)
            path = _stage_file(
                self.source,
                f,
                self.staging,
                self.policy,
                self._stats,
                stop=self._stop,
                on_bytes=bar_bytes,
                unwanted=lambda: self._is_released(f),
            )
            if path is None:
                return  # consumed and released meanwhile: nothing to do
        except _Cancelled:
            return
        except SourceError as err:
            self._stats.add(failures={"name": f.name, "url": f.url, "reason": err.reason})
            if self.on_missing == "skip":
                self._stats.add(skipped={"name": f.name, "url": f.url, "reason": err.reason})
            with self._lock:
                self._state[_safe_name(f)] = "failed"
            with contextlib.suppress(OSError):
                write_json_atomic(
                    self.ctl_dir / _ctl_name(f, "failed"),
                    {"reason": err.reason, "unreachable": isinstance(err, StoreUnreachableError)},
                )
            return
        except BaseException as exc:  # noqa: BLE001 - surfaced to the worker as a failure, never swallowed
            logger.exception("unexpected error fetching %s", f.url)
            with self._lock:
                self._state[_safe_name(f)] = "failed"
            with contextlib.suppress(OSError):
                write_json_atomic(self.ctl_dir / _ctl_name(f, "failed"), {"reason": _describe(exc)})
            return
        with self._lock:
            self._staged_total += 1
            if self._state.get(_safe_name(f)) == "queued":
                self._state[_safe_name(f)] = "staged"
        if self._bars:
            self._bars[0].update(1)
