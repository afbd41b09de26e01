"""The shard fetcher: downloads ahead of the ``datasets.map`` workers, in their order.

The build converts shards inside ``datasets.map(num_proc=K)`` worker processes. This
module gives it two halves of one protocol:

* :class:`ShardFetcher` (parent side, a context manager): a bounded thread pool that
  downloads shard files into a local staging folder in the order the K workers will
  consume them (:func:`consumption_order`), at most ``prefetch_ahead`` files beyond
  the K being converted and at most ``staging_max_gb`` bytes.
* :class:`StagingClient` (picklable, handed to the workers): ``acquire(file)`` waits
  for the staged copy (or fetches it itself when prefetching is off), ``release(file)``
  deletes it once converted, freeing room for the next download.

The two halves talk through small marker files in a per-run control folder inside
the staging folder (``.ctl/<run>/``): a worker asking for a file writes ``want``,
one done with it writes ``released``; the fetcher writes ``failed`` markers and a
heartbeat counter. Files survive process boundaries, forks and pickling, where
queues and locks do not.

Each download goes through :func:`hf_pipeline.stores.staging.stage_file` (verified, atomic,
resumable) with the retries of :mod:`hf_pipeline.stores.retry`; counters are
:class:`~hf_pipeline.stores.fetch_stats.FetchStats`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import re
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from dist.atomic import write_json_atomic
from dist.errors import ForeignCacheFolderError
from dist.markers import read_json
from dist.safepath import own_folder, remove_tree_at
from hf_pipeline.errors import SourceError, StoreUnreachableError
from hf_pipeline.stores.fetch_stats import FetchStats, merge_fetch_stats
from hf_pipeline.stores.retry import Cancelled, RetryPolicy, describe_error
from hf_pipeline.stores.staging import StagingFolder, stage_file, staged_name

if TYPE_CHECKING:  # pragma: no cover
    from hf_pipeline.config import DataConfig, OnMissing
    from hf_pipeline.stores import Source
    from hf_pipeline.stores.remote_file import RemoteFile

__all__ = ["ShardFetcher", "StagingClient", "consumption_order"]

logger = logging.getLogger(__name__)

_MARKER_POLL_S = 0.02  # seconds between control-folder checks (local disk, cheap)
_DEAD_AFTER = 15.0  # seconds without fetcher heartbeat progress -> fetch ourselves
_HEARTBEAT_S = 0.5  # seconds between heartbeat counter updates
_CTL_DIR = ".ctl"  # the control folders' folder, in the staging folder
_CTL_PREFIX = "run-"  # a run's control folder: .ctl/run-<random> (tempfile.mkdtemp)
#: What the sweep takes for a run's control folder (earlier releases: 12 hex digits).
_CTL_NAME = re.compile(r"run-[A-Za-z0-9_]{8}|[0-9a-f]{12}")


class _FileState(enum.Enum):
    """Where one file of the fetcher's list stands (absent: not scheduled yet)."""

    QUEUED = "queued"  # submitted to the download pool, not staged yet
    STAGED = "staged"  # verified in the staging folder, not released yet
    FAILED = "failed"  # given up on; a "failed" marker tells the worker why
    RELEASED = "released"  # converted and deleted by a worker


#: States that hold a slot of the window (downloading or staged, not yet released).
_OUTSTANDING = (_FileState.QUEUED, _FileState.STAGED)


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
    out: list[RemoteFile] = []
    for j in range(max((len(r) for r in ranges), default=0)):
        out.extend(r[j] for r in ranges if j < len(r))
    return out


# --------------------------------------------------------------------------- client


#: Control markers of one file: asked for by a worker; done with by a worker; given
#: up on by the fetcher (with the reason); not in the fetcher's list.
_MarkerKind = Literal["want", "released", "failed", "unknown"]


def _ctl_name(file: RemoteFile, what: _MarkerKind) -> str:
    """The name of ``file``'s control marker ``what``."""
    return f"{staged_name(file)}.{what}"


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
        staging_base: the user's folder it lies in (:class:`StagingFolder`); "": the
            staging folder itself.
        ctl_dir: this run's control folder (markers, stats), or "" without a
            fetcher.
        prefetched: a fetcher thread stages files; False: ``acquire`` downloads
            itself.
        on_missing: what a file that cannot be fetched becomes (``data.on_missing``).
        policy: retry policy for self-fetching.
    """

    source: Source
    staging_dir: str
    staging_base: str = ""
    ctl_dir: str = ""
    prefetched: bool = False
    on_missing: OnMissing = "fail"
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
        # Not durable: the parent reads these counters at the end of this very run (a
        # crash redoes the build), and an fsync per shard is costly while the workers
        # write GBs of Arrow files (on ext4 it waits for their dirty data to be flushed).
        with contextlib.suppress(OSError):
            write_json_atomic(
                Path(self.ctl_dir) / f"stats-{os.getpid()}.json",
                self.stats.as_dict(),
                durable=False,
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
        original path, no copy. Otherwise waits for the fetcher to stage it (asking
        for it first, so a worker that runs ahead of the predicted order is served
        next), or downloads it itself when no fetcher runs or the fetcher stopped
        beating.

        Args:
            file: a shard from ``Source.list_shards()``.
            timeout: most seconds to wait; None waits as long as the fetcher is
                alive (its own per-file timeout and retries bound each file).

        Returns:
            The path, or None when the file failed and ``on_missing == "skip"`` (it is
            recorded in the fetch stats with the reason).

        Raises:
            SourceError: the file could not be fetched and ``on_missing == "fail"``, or
                ``timeout`` passed.
        """
        direct = self.source.direct_path(file)
        if direct is not None:
            self.stats.add(staging_hits=1)
            self._dump_stats()
            return direct
        staging = self._staging()
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
                return stage_file(self.source, file, staging, self.policy, self.stats)
            except SourceError as err:
                self.stats.add(failures={"name": file.name, "url": file.url, "reason": err.reason})
                self._skip_or_raise(file, err)
                return None
        finally:
            self._dump_stats()

    def _wait(self, file: RemoteFile, staging: StagingFolder, ctl: Path, timeout: float | None):
        """Wait for the fetcher; returns a path, None (skipped) or False (fetch it yourself)."""
        want = ctl / _ctl_name(file, "want")
        # Control markers only coordinate live processes, so no fsync (durable=False);
        # sidecars vouch for data after a crash, so they pay for it.
        with contextlib.suppress(OSError):
            write_json_atomic(want, {"pid": os.getpid()}, durable=False)
        try:
            return self._wait_staged(file, staging, ctl, timeout)
        finally:
            # Withdraw a want the fetcher has not read yet: seen in one scan together
            # with our later "released", it would read as "wanted again" and the file
            # would be downloaded a second time and left staged (holding a window slot).
            with contextlib.suppress(OSError):
                want.unlink()

    def _wait_staged(
        self, file: RemoteFile, staging: StagingFolder, ctl: Path, timeout: float | None
    ):
        start = time.monotonic()
        beat, beat_seen = None, time.monotonic()
        while True:
            if staging.is_staged(file):
                return staging.path(file)
            failed = read_json(ctl / _ctl_name(file, "failed"))
            if isinstance(failed, dict):
                # The marker carries the kind, so "store down" keeps exit code 1 here too.
                kind = StoreUnreachableError if failed.get("unreachable") else SourceError
                err = kind(file.url, str(failed.get("reason", "fetch failed")))
                return self._skip_or_raise(file, err)
            if (ctl / _ctl_name(file, "unknown")).exists():
                return False  # not in the fetcher's list: fetch it ourselves
            now = time.monotonic()
            heartbeat = read_json(ctl / "heartbeat")
            if heartbeat != beat:
                beat, beat_seen = heartbeat, now
            elif now - beat_seen > _DEAD_AFTER or not ctl.is_dir():
                # Judged by our own clock: the fetcher's counter stopped moving.
                logger.warning(
                    "prefetcher stopped; fetching %s in worker %d", file.name, os.getpid()
                )
                return False
            if timeout is not None and now - start > timeout:
                raise StoreUnreachableError(file.url, f"not staged within {timeout:g}s")
            time.sleep(_MARKER_POLL_S)

    def release(self, file: RemoteFile) -> None:
        """Delete the staged copy of ``file`` (never an original) and free its slot.

        Idempotent; safe to call for a skipped file.
        """
        # Marker first, then delete: the fetcher treats "not staged + released" as
        # consumed, so it never re-downloads a file in the gap.
        if self.ctl_dir and Path(self.ctl_dir).is_dir():
            with contextlib.suppress(OSError):
                write_json_atomic(
                    Path(self.ctl_dir) / _ctl_name(file, "released"),
                    {"pid": os.getpid()},
                    durable=False,
                )
        if self.source.direct_path(file) is None:
            self._staging().remove(file)

    def _staging(self) -> StagingFolder:
        return StagingFolder(self.staging_dir, base=self.staging_base or None)


# --------------------------------------------------------------------------- fetcher


def _progress_enabled(flag: bool | None) -> bool:
    if flag is not None:
        return flag
    return sys.stderr.isatty()


class ShardFetcher:
    """Downloads shards ahead of the ``datasets.map`` workers into a bounded staging area.

    Usage (parent process)::

        files = source.list_shards()
        with ShardFetcher(source, files, data_config=cfg.data, num_workers=K) as fetcher:
            ds.map(convert, num_proc=K, fn_kwargs={"staging": fetcher.client()})
        report["fetch"] = fetcher.stats()

    Window: at most ``num_workers + prefetch_ahead`` files are downloading or staged
    and not yet released (the K being converted plus ``prefetch_ahead`` ahead), and
    their bytes stay under ``staging_max_gb`` (one file is always allowed, so a shard
    larger than the budget still makes progress). A file a worker asks for jumps the
    queue. With ``prefetch_ahead == 0`` no thread starts and workers fetch for
    themselves.

    Thread-safety: ``client()``/``stats()``/``wait_idle()``/``close()`` may be called
    from any thread; ``close()`` is idempotent and waits (bounded) for the download
    threads.

    Args:
        source: where the files live (:func:`hf_pipeline.stores.open_source`).
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
        self.staging = source.staging
        self._order = consumption_order(self.files, num_workers)
        self._stats = FetchStats()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # Notified at the end of each scheduler pass (wait_idle).
        self._pass_done = threading.Condition(self._lock)
        self._passes = 0  # scheduler passes begun
        self._idle_through = 0  # the last pass that left nothing downloading
        self._progress = _progress_enabled(progress)
        self._bars: list[Any] = []
        self._pool: ThreadPoolExecutor | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        self.ctl_dir: Path | None = None
        self._state: dict[str, _FileState] = {}  # keyed by staged_name(file)
        self._futures: dict[str, Future] = {}
        self._worker_stats_cache: list[dict] = []
        self._staged_total = 0  # files this fetcher has seen staged (start-up rule)

    # -- lifecycle
    def __enter__(self) -> ShardFetcher:
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
        self.staging.make()
        # ".ctl" is made (or found) a real folder, never a link someone put there: the
        # sweep below removes old folders in it, close() this run's.
        ctl = own_folder(self.staging.root, _CTL_DIR)
        self._sweep_stale_ctl()
        # The control folder also carries the workers' stats, so it exists even when
        # no download thread runs. A fresh name, made by mkdir (never one found there),
        # 0700: only this user's processes (the fetcher and its workers) write in it.
        self.ctl_dir = Path(tempfile.mkdtemp(prefix=_CTL_PREFIX, dir=ctl))
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
        with self._pass_done:
            self._pass_done.notify_all()  # wait_idle callers: no pass will come
        if self._thread is not None:
            self._thread.join(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for bar in self._bars:
            bar.close()
        if self.ctl_dir is not None:
            self._worker_stats()  # read the workers' stats before their folder goes
            self._remove_ctl(self.ctl_dir.name)

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
            staging_base=str(self.staging.base),
            ctl_dir=str(self.ctl_dir) if self.ctl_dir is not None else "",
            prefetched=self.prefetching,
            on_missing=self.on_missing,
            policy=self.policy,
        )

    def stats(self) -> dict[str, Any]:
        """Bytes, files, mean MB/s, retries, failures, skipped files, staging hits/misses.

        Merges the fetcher's counters with those the workers reported, and the
        source's own (this process): ``listing_retries`` (listing, stat and revision
        calls), ``metadata_retries`` (downloads through ``Source.fetch_one``) and the
        shards the listing already found missing (``skipped``, first).
        """
        src = self.source.fetch_stats.as_dict()
        parts = [{"skipped": src["skipped"], "listing_retries": src["listing_retries"]}]
        parts.append(self._stats.as_dict())
        parts.extend(self._worker_stats())
        out = merge_fetch_stats(parts)
        out["metadata_retries"] = src["retries"]
        out["prefetch_ahead"] = self.ahead
        return out

    def raise_if_failed(self) -> None:
        """Re-raise an unexpected error of the scheduler thread (never swallowed)."""
        if self._error is not None:
            raise self._error

    def wait_idle(self, timeout: float) -> bool:
        """Wait for a scheduler pass, begun after this call, that left nothing downloading.

        After it, every file the workers asked for or the window allowed so far is
        staged, failed or released, and the fetcher decided to start nothing more for
        now: what tests and benchmarks check instead of sleeping. Thread-safe.

        Args:
            timeout: most seconds to wait.

        Returns:
            True after such a pass (at once when prefetching is off: nothing is ever
            downloaded here); False when ``timeout`` passed or the scheduler stopped
            (closed, failed, not started) first.
        """
        if not self.prefetching:
            return True
        deadline = time.monotonic() + timeout
        with self._pass_done:
            after = self._passes
            while self._idle_through <= after:
                left = deadline - time.monotonic()
                thread = self._thread
                if left <= 0 or self._stop.is_set() or thread is None or not thread.is_alive():
                    return False
                # Bounded: a scheduler that dies between passes notifies nobody.
                self._pass_done.wait(min(left, 1.0))
            return True

    # -- internals
    def _sweep_stale_ctl(self, max_age: float = 86400.0) -> None:
        """Remove control folders that killed runs of this user left in ``.ctl``.

        A day without any change means nobody is using one (heartbeats rewrite it every
        0.5 s). Only real folders named as a run's and owned by this user; a symlink,
        a file or another user's folder stays. Removed relative to ``.ctl`` opened
        without following a link (:meth:`_remove_ctl`).
        """
        now = time.time()
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.staging.root / _CTL_DIR):
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if (
                        stat.S_ISDIR(st.st_mode)
                        and _CTL_NAME.fullmatch(entry.name)
                        and st.st_uid == os.getuid()
                        and now - st.st_mtime > max_age
                    ):
                        self._remove_ctl(entry.name)

    def _remove_ctl(self, name: str) -> None:
        """Remove ``.ctl/<name>`` (a run's control folder) and what it holds, every step
        relative to ``.ctl`` opened with ``O_NOFOLLOW`` below the staging folder: a
        ``.ctl`` or staging folder swapped for a link is never followed (left, logged)."""
        errors: list[str] = []
        ctl = self.staging.root / _CTL_DIR
        try:
            own_folder(self.staging.base, self._rel(ctl), create=False)
            fd = os.open(ctl, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except (OSError, ForeignCacheFolderError) as e:
            logger.warning("control folder %s left: %s", ctl / name, e)
            return
        try:
            remove_tree_at(fd, name, ctl, errors)
        finally:
            os.close(fd)
        if errors:
            logger.warning("control folder %s not all removed: %s", ctl / name, errors[0])

    def _rel(self, path: Path) -> str:
        """``path`` relative to the staging folder's base, ``/``-separated."""
        return os.path.relpath(path, self.staging.base).replace(os.sep, "/")

    def _worker_stats(self) -> list[dict]:
        """The workers' stats files (the last ones read, once the folder is gone)."""
        if self.ctl_dir is not None and self.ctl_dir.is_dir():
            got = [read_json(p) for p in self.ctl_dir.glob("stats-*.json")]
            self._worker_stats_cache = [g for g in got if isinstance(g, dict)]
        return self._worker_stats_cache

    def _in_flight(self) -> int:
        return sum(1 for state in self._state.values() if state is _FileState.QUEUED)

    def _outstanding(self) -> tuple[int, int]:
        """(files, bytes) holding a slot of the window (caller holds ``_lock``)."""
        count = size = 0
        for f in self.files:
            if self._state.get(staged_name(f)) in _OUTSTANDING:
                count += 1
                size += f.size
        return count, size

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
                    self._state[name] = _FileState.RELEASED
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                elif what == "want":
                    wanted.add(name)
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        return wanted

    @property
    def _ctl(self) -> Path:
        """This run's control folder: set by ``start()``, before the threads that use it."""
        assert self.ctl_dir is not None
        return self.ctl_dir

    def _is_released(self, f: RemoteFile) -> bool:
        name = staged_name(f)
        if (self._ctl / _ctl_name(f, "released")).exists():
            return True
        with self._lock:
            return self._state.get(name) is _FileState.RELEASED

    def _run(self) -> None:
        beat, last_beat = 0, 0.0
        by_name = {staged_name(f): f for f in self.files}
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now - last_beat > _HEARTBEAT_S:
                    beat, last_beat = beat + 1, now
                    write_json_atomic(self._ctl / "heartbeat", beat, durable=False)
                with self._lock:
                    self._passes += 1
                    self._schedule(self._poll_markers(), by_name)
                    if self._in_flight() == 0:
                        self._idle_through = self._passes
                    self._pass_done.notify_all()
                # Keeps beating after the last file too: a worker may still want a shard
                # again (a retried batch) and should not wait for a dead-fetcher verdict.
                self._stop.wait(_MARKER_POLL_S * 2)
        except BaseException as exc:  # noqa: BLE001 - kept for raise_if_failed, workers see no heartbeat
            logger.exception("prefetch scheduler failed")
            self._error = exc

    def _schedule(self, wanted: set[str], by_name: dict[str, RemoteFile]) -> None:
        """Submit what the workers want, then what the window allows (caller holds ``_lock``)."""
        # Wanted first: a worker is blocked on it right now.
        for name in sorted(wanted):
            f = by_name.get(name)
            if f is None:
                with contextlib.suppress(OSError):
                    write_json_atomic(self._ctl / f"{name}.unknown", {}, durable=False)
            elif self._state.get(name) in (None, _FileState.RELEASED):
                # "released" and wanted again: a worker redoes a shard
                # (a retried map batch); fetch it again.
                self._submit(f)
        limit = self.num_workers + self.ahead
        for f in self._order:
            if staged_name(f) in self._state:
                continue
            count, size = self._outstanding()
            if count >= limit or (count > 0 and size + f.size > self.max_bytes):
                break
            if self._staged_total < self.num_workers and self._in_flight() >= self.num_workers:
                # Start-up: every worker is waiting for its first shard. On a
                # shared link, N parallel downloads each get 1/N of it, so
                # fetch just those K first and widen once they have landed.
                break
            self._submit(f)

    def _submit(self, f: RemoteFile) -> None:
        self._state[staged_name(f)] = _FileState.QUEUED
        assert self._pool is not None
        self._futures[staged_name(f)] = self._pool.submit(self._download, f)

    def _fail(self, f: RemoteFile, marker: dict[str, Any]) -> None:
        """Mark ``f`` failed here and, for the worker waiting on it, in its marker."""
        with self._lock:
            self._state[staged_name(f)] = _FileState.FAILED
        with contextlib.suppress(OSError):
            write_json_atomic(self._ctl / _ctl_name(f, "failed"), marker)

    def _download(self, f: RemoteFile) -> None:
        bar_bytes = self._bars[1].update if self._bars else None
        try:
            if self.staging.is_staged(f):
                self._stats.add(staging_hits=1)
            path = stage_file(
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
        except Cancelled:
            return
        except SourceError as err:
            self._stats.add(failures={"name": f.name, "url": f.url, "reason": err.reason})
            if self.on_missing == "skip":
                self._stats.add(skipped={"name": f.name, "url": f.url, "reason": err.reason})
            self._fail(
                f, {"reason": err.reason, "unreachable": isinstance(err, StoreUnreachableError)}
            )
            return
        except BaseException as exc:  # noqa: BLE001 - surfaced to the worker as a failure, never swallowed
            logger.exception("unexpected error fetching %s", f.url)
            self._fail(f, {"reason": describe_error(exc)})
            return
        with self._lock:
            self._staged_total += 1
            if self._state.get(staged_name(f)) is _FileState.QUEUED:
                self._state[staged_name(f)] = _FileState.STAGED
        if self._bars:
            self._bars[0].update(1)
