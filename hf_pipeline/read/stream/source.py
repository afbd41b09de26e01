"""Training samples read in place from a published cache, by verified ranged reads.

:class:`StreamSource` is a :class:`~hf_pipeline.read.mapped.SampleSource` whose files stay
in the store (``gs://...`` or ``hf://datasets/...``, as ``--publish`` writes them). It
first checks the folder is published as a pull does
(:func:`~hf_pipeline.publish.find.find_published`: one listing, the stage markers and
``manifest.json``), then uses the manifest's stream index
(:mod:`hf_pipeline.read.stream.index`): no per-file footer. A gather fetches the checksum blocks that hold its
rows; each block is checked against its published digest before a byte of it is used.

Ahead of the consumer: the :class:`~hf_pipeline.read.loader.Loader` hands :meth:`plan`
the positions and rows of this process's upcoming batches (the sample order is a pure
function of seed and epoch); a planner thread fetches the blocks of the next
``ahead`` batches while they fit in ``cache_bytes``, in reads of neighbouring blocks
merged (``coalesce_bytes``; a gap of blocks the next batches need is read with them and
kept: :meth:`StreamSource._runs`), ``concurrency`` reads at a time. A gather takes its blocks
from there; one that reaches a batch not planned yet (the thread late, or more gathering
threads than ``ahead``) plans it and the refill after it itself, in merged reads
(:meth:`_Planner.catch_up`), and fetches on its own only what no plan holds (so
``cache_bytes=0`` streams everything on demand). Once the batch that planned a block is
assembled, the block stays only while the limit allows: kept blocks are dropped, least
recently used first, for the planner's next reservations and for blocks fetched on
demand (so random access without a plan, Grain's records, keeps the blocks it used last).

Trust: a range shorter than asked is retried; a block whose digest differs is fetched
once more, then refused (:class:`~hf_pipeline.errors.CacheFormatError` naming the file
and the bytes). Every read goes through :func:`~hf_pipeline.stores.retry.with_retries`
with the data config's retries and per-read timeout; a store that never answers ends in
one :class:`~hf_pipeline.errors.StoreUnreachableError`, never a hang (every wait has a
deadline).

Bounded memory: the blocks held between batches (prefetched, or kept after use) plus
those the planner has reserved never exceed ``cache_bytes`` (:meth:`cache_state`). The
batch being assembled is the only other memory: its own blocks, dropped after it. The
held bytes are the memory held: the blocks of one read share its buffer (so a batch is
copied out of a read in one go) only while every byte of it is a held block's; a block
dropped from a shared buffer takes its kept siblings with it and copies out those a
plan still needs, and a read whose blocks are not all admitted has the admitted ones
copied out (before, a dropped block's bytes stayed alive behind its siblings: 1.81 MB
of buffers behind a 1.5 MB limit in tests/test_stream.py).

Thread-safety: ``gather`` may be called from several threads at once (the Loader's
``num_threads``); one ``plan`` at a time; ``close`` is idempotent.

Processes: a source pickled into another process (a spawned DataLoader or Grain worker)
opens its own there (one manifest read, an empty cache of its own). A source copied by
``fork`` (torch's DataLoader workers on Linux, ``multiprocessing``'s default there) does
the same at its first use in the child: the parent's reading threads, locks and store
client are not the child's (the child's reads waited forever for threads that do not
exist in it). :meth:`for_worker_processes` is such a source's share of the limit among
``n`` processes (the torch adapter's DataLoader workers).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import itertools
import logging
import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Literal

import numpy as np

from dist.checksums import BLOCK_ALGORITHM, block_digest
from dist.safepath import shown
from hf_pipeline.errors import CacheFormatError, SourceError, StoreUnreachableError
from hf_pipeline.read.stream.index import StreamIndex
from hf_pipeline.read.stream.options import StreamOptions
from hf_pipeline.stores.retry import (
    Cancelled,
    RetryPolicy,
    ShortObjectError,
    TransientError,
    describe_error,
    http_status,
    with_retries,
)

__all__ = ["StreamOptions", "StreamSource", "StreamStats"]

logger = logging.getLogger(__name__)

_MANIFEST = "manifest.json"
_CACHE_NAME = re.compile(r"-([0-9a-f]{16})\Z")
#: Seconds between two lines summing up a stream's retries (the first is said at once).
_RETRY_REPORT_S = 5.0
#: Cache folders an error names when a location is given instead of one of them.
_LISTED_CACHES = 5
_STOP_CHECK_S = 0.1
#: Gaps between blocks are read (one request, not two) only while together they are at
#: most 1/_GAP_SHARE of the blocks' bytes in the read: bytes fetched stay within ~1.1x those
#: needed however the rows fall (``coalesce_bytes`` caps each gap besides).
_GAP_SHARE = 8
#: How long a gather whose batch is not planned yet waits for the planner's walker (it
#: holds it while it pulls and reserves one batch) before fetching the batch itself.
_WALK_WAIT_S = 10.0
#: Bytes in flight (reads started, not landed) are bounded by what the store delivered in
#: this many seconds (:meth:`StreamSource.inflight_limit`): when bandwidth is the bound
#: (a link every read shares), a read started now lands within about this long, so batch
#: k's reads do not share the store's bandwidth with those of batch k + 30 and the first
#: batch (and each next one) lands first; when latency is the bound (each read takes its
#: latency and its transfer whatever runs beside it, under this long), the store
#: delivers more as more reads run, and the bound grows until ``concurrency`` reads run.
_INFLIGHT_S = 1.0
#: The bound until the plan's first batch has landed and the store's rate is known, and
#: its least: this many planned batches' bytes (the largest batch's blocks seen so far),
#: at least ``max_read_bytes`` (one read always fits). Held until the first batch lands:
#: reads started once the rate is known share the link with the first batch's (through
#: one link, at a second of its rate, the first batch waited on 25 of an epoch's 44 reads,
#: against 12). The whole bound until 2026-12 (it held the H200 host's block shuffle to
#: 32.7 reads in flight of 64).
_INFLIGHT_BATCHES = 4
#: The store's rate is the bytes landed per second while reads were queued (held back
#: by the bound or by ``concurrency``: the store had all it could take), over about the
#: last this many seconds of such time (an exponential average): a pause in the plan
#: neither lowers it nor ages it.
_RATE_WINDOW_S = 2.0
#: Queued seconds measured before the rate is used (a read or two landing at once is not
#: a rate).
_RATE_MIN_S = 0.05
#: The priority of a read a gather waits for (no plan holds its blocks): before any
#: planned read, which are ordered by the index of the first batch that needs them.
_DEMAND = -1
#: A gather copies the rows of a read that holds at most this many of them one slice
#: each, and those of a read that holds more by one strided index (:meth:`_assemble`).
_FEW_ROWS = 4
#: Batches a gather may be ahead of those released, beyond ``ahead``: how far a gather
#: looks for its batch in the plan (more gathering threads than this never occur).
_MAX_GATHER_LEAD = 256


#: A verified block: ``(its read's buffer, the block's byte offset in it)`` (its size is
#: ``_block_bytes``). A read's blocks share its buffer: a batch is copied out of them in
#: one fancy-index per read (:meth:`StreamSource._assemble`).
_Held = tuple[np.ndarray, int]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamStats:
    """What a :class:`StreamSource` fetched and holds.

    Attributes:
        requests: ranged reads that returned (retries included in ``retries``).
        bytes_fetched: bytes those reads brought (gaps and refetches included).
        bytes_needed: bytes of the distinct rows gathered (whole rows of every column).
        retries: reads retried (5xx, reset, timeout, short body).
        refetched: ranges fetched again after a checksum mismatch.
        planned_blocks: blocks fetched ahead by the planner.
        demand_blocks: blocks a gather had to fetch itself.
        planned_reads: reads the planner started (neighbouring blocks of its refills
            merged: few and long when it stays ahead).
        demand_reads: reads a gather started for blocks no plan held (each batch's own
            scattered blocks; the manifest's indices at start; every read with
            ``cache_bytes=0`` or without a plan, Grain's records).
        held_bytes: bytes of blocks held now.
        max_held_bytes: the most held plus reserved at any moment.
        limit_bytes: ``cache_bytes``.
        max_inflight_bytes: the most bytes of reads started and not landed at any moment
            (bounded by :meth:`StreamSource.inflight_limit`).
        max_inflight_reads: the most reads running at any moment (at most
            ``concurrency``).
        first_batch_s: seconds from the plan's start until the reads of its first batch
            had all landed (None: no plan, or not landed yet).
        first_batch_reads: reads this source had sent to the store (planned and on
            demand; queued ones not counted) when the first batch's reads had all landed:
            how far the epoch's reads ran ahead of the first batch (None as for
            ``first_batch_s``).
        read_s: seconds the reads took together, from the first started to the last
            landed (the wall time the store was busy for this source).
        mean_inflight_reads: reads running on average over ``read_s`` (at most
            ``concurrency``): below it, the store was not kept busy.
        starved_s: seconds of ``read_s`` with fewer than ``concurrency`` reads running
            and none queued (nothing planned to read: the reads waited on the plan).
        held_back_s: seconds with fewer than ``concurrency`` reads running while reads
            were queued (held back by the bytes in flight bound,
            :meth:`StreamSource.inflight_limit`).
        flushes: why the planner's pending reads were started, by reason (how many
            times): ``due`` (the lookahead ran low), ``full`` (no room for the next
            batch), ``ended`` (the plan ended), ``catch_up`` (a gather reached a
            batch not planned or not started), ``gather`` (a gather needed a pending
            block). ``flush_blocks``: the blocks they started, by the same reasons.
        read_cuts: why neighbouring blocks of a file went into separate reads, by
            reason: ``file`` (another file), ``gap`` (more than ``coalesce_bytes``
            apart, or overlapping), ``gap_share`` (the read's gaps would exceed 1/8 of
            its blocks), ``max_read`` (``max_read_bytes``).
        completed_batches: batches planned beyond a refill because they fill the holes
            of its reads (a block-shuffle window finished: ``_Planner._complete``).
        gap_blocks: blocks read in a gap between planned blocks because the batches
            pulled next need them (kept for those: :meth:`StreamSource._runs`).
    """

    requests: int
    bytes_fetched: int
    bytes_needed: int
    retries: int
    refetched: int
    planned_blocks: int
    demand_blocks: int
    planned_reads: int
    demand_reads: int
    held_bytes: int
    max_held_bytes: int
    limit_bytes: int
    max_inflight_bytes: int = 0
    max_inflight_reads: int = 0
    first_batch_s: float | None = None
    first_batch_reads: int | None = None
    read_s: float = 0.0
    mean_inflight_reads: float = 0.0
    starved_s: float = 0.0
    held_back_s: float = 0.0
    flushes: dict[str, int] = dataclasses.field(default_factory=dict)
    flush_blocks: dict[str, int] = dataclasses.field(default_factory=dict)
    read_cuts: dict[str, int] = dataclasses.field(default_factory=dict)
    completed_batches: int = 0
    gap_blocks: int = 0


@dataclasses.dataclass(frozen=True)
class _Column:
    """One column's rows in the global block numbering."""

    name: str
    row_bytes: int
    row_shape: tuple[int, ...]
    dtype: np.dtype
    block_rows: int
    starts: np.ndarray  # first row of each chunk (+ total)
    block0: np.ndarray  # first global block id of each chunk


def _split_url(url: str, policy: RetryPolicy | None = None) -> tuple[str, str]:
    """``(store location, cache name)`` of a published cache's URL.

    A URL of another shape is refused naming it as given; one that is a publish location
    holding cache folders (``gs://bkt/caches``, where ``--publish`` wrote) lists a few.
    """
    from hf_pipeline.config import PUBLISH_SCHEMES, PUBLISHED_CACHE_FORMS

    given = url
    url = url.strip().rstrip("/")
    name = url.rsplit("/", 1)[-1]
    if not url.startswith(PUBLISH_SCHEMES) or not _CACHE_NAME.search(name):
        found = _cache_folders_at(url, policy) if url.startswith(PUBLISH_SCHEMES) else ""
        if found:
            raise SourceError(
                given, f"is a location with published caches: {found}; give one of them"
            )
        raise SourceError(
            given,
            f"a published cache to stream must look like {' or '.join(PUBLISHED_CACHE_FORMS)}"
            " (the folder --publish wrote)",
        )
    return url, name


def _cache_folders_at(url: str, policy: RetryPolicy | None) -> str:
    """The cache folders at publish location ``url``, a few named ("" when it is no
    location, holds none, or the store fails: the caller's error stands alone)."""
    from hf_pipeline.config import DataConfig
    from hf_pipeline.publish.find import cache_folder_names
    from hf_pipeline.stores.factory import open_store

    try:
        store = open_store(url, data_config=DataConfig(), policy=policy)
        names = cache_folder_names(store)
    except SourceError:  # no location (a bare gs://), not found, refused, unreachable
        return ""
    shown_names = ", ".join(
        n if n.isascii() and n.isprintable() else shown(n) for n in names[:_LISTED_CACHES]
    )
    more = len(names) - _LISTED_CACHES
    return f"{shown_names} and {more} more" if more > 0 else shown_names


class _RetryReport:
    """A source's retries said in a bounded number of lines (thread-safe): the first at
    once (a failing store is never silent until the last attempt), then at most one
    line per :data:`_RETRY_REPORT_S` with the counts since the last line (one line per
    retry flooded the log: 360 lines in 11 s of an outage with 64 reads in flight)."""

    def __init__(self, url: str, read_timeout: float):
        self.url, self.read_timeout = url, read_timeout
        self._lock = threading.Lock()
        self._said: float | None = None  # time.monotonic() of the last line
        self._total = self._retries = self._reads = 0  # all; since the last line (2)

    def retried(
        self, url: str, start: int, end: int, exc: BaseException, *, first_of_read: bool
    ) -> None:
        """Count one retry of ``url``'s bytes ``[start, end)``; say it when it is due."""
        with self._lock:
            self._total += 1
            self._retries += 1
            self._reads += first_of_read
            now = time.monotonic()
            if self._said is not None and now - self._said < _RETRY_REPORT_S:
                return
            since, self._said = None if self._said is None else now - self._said, now
            retries, reads, total = self._retries, self._reads, self._total
            self._retries = self._reads = 0
        if since is None:
            logger.warning(
                "%s: bytes %d-%d: %s (a read may take %.0f s); retrying (further retries "
                "of %s summed up every %.0f s)",
                url, start, end, describe_error(exc), self.read_timeout, self.url,
                _RETRY_REPORT_S,
            )  # fmt: skip
        else:
            logger.warning(
                "%s: the store keeps failing: %d retries in the last %.1f s (%d reads "
                "newly failing; %d retries so far; last: %s at bytes %d-%d: %s); retrying",
                self.url, retries, since, reads, total,
                url.rsplit("/", 1)[-1], start, end, describe_error(exc),
            )  # fmt: skip


class StreamSource:
    """The samples of a published cache, read in place (see the module docstring).

    Args:
        url: the published cache folder (``gs://bucket/caches/demo-<fingerprint>``).
        options: :class:`StreamOptions`.
        policy: retries and per-read timeout (default: the data config's defaults).
        fingerprint: the identity expected (None: the one the folder name states).

    Raises:
        SourceError: a malformed URL, the store refused (not found, forbidden), or the
            folder is not a published cache (no folder, or a stage marker missing: an
            upload unfinished or interrupted), checked as a pull checks it before any
            data is read; names the URL and the missing markers.
        StoreUnreachableError: the store did not answer after every retry.
        CacheFormatError: the folder is damaged as a pull finds it (markers, manifest
            and the store's listing disagree; the manifest missing, malformed or of
            another fingerprint), the manifest has no stream index (published by an
            older version), or the filter's indices do not check out; names the file.
    """

    def __init__(
        self,
        url: str,
        options: StreamOptions | None = None,
        *,
        policy: RetryPolicy | None = None,
        fingerprint: str | None = None,
    ):
        from hf_pipeline.config import DataConfig
        from hf_pipeline.stores import make_source

        self.options = options or StreamOptions()
        policy = policy or RetryPolicy.from_config(DataConfig())
        self.url, name = _split_url(url, policy)
        # One ranged read is small (at most max_read_bytes): it gets read_timeout, not
        # a whole file's download time (a stalled store was silent for minutes).
        self.policy = dataclasses.replace(
            policy, file_timeout=min(policy.file_timeout, self.options.read_timeout)
        )
        self._store = make_source(self.url, data_config=DataConfig(), policy=self.policy)
        # Reentrant: a read that is already done runs its callback (_landed) at once, in
        # the thread that submits it, which holds the lock.
        self._lock = threading.RLock()
        self._room = threading.Condition(self._lock)  # notified when bytes are freed
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(
            self.options.concurrency, thread_name_prefix="hf_pipeline-stream"
        )
        self._closed = False
        self._counts: collections.Counter[str] = collections.Counter()
        self._retry_report = _RetryReport(self.url, self.policy.file_timeout)
        # Held blocks: block id -> (its read's buffer, byte offset of the block there).
        self._blocks: dict[int, _Held] = {}
        # Read buffers that several held blocks share, by id(): their held blocks. Every
        # byte of such a buffer is a held block's (held bytes = the memory they keep
        # alive); a block dropped from one takes its kept siblings with it, or copies
        # the pinned ones out, so no dropped byte stays alive behind a held block.
        self._sharing: dict[int, set[int]] = {}
        # Held blocks no plan needs now, least recently used first; their bytes.
        self._kept: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._kept_bytes = 0
        self._pins: dict[int, int] = {}
        self._reserved: set[int] = set()
        self._inflight: dict[int, Future] = {}
        self._held = self._reserved_bytes = self._max_held = 0
        # Reads not started yet, best first: (priority, sequence, run, bytes, future).
        self._queue: list[tuple[int, int, list[int], int, Future]] = []
        self._sequence = itertools.count()
        self._running = self._inflight_bytes = self._max_inflight = self._max_running = 0
        # Read-seconds (reads running x seconds), and the seconds below ``concurrency``
        # with nothing queued / with reads queued: since ``_tick_t`` (:meth:`_tick`).
        self._tick_t: float | None = None
        self._running_area = self._starved_s = self._held_back_s = 0.0
        # The store's rate while reads were queued (:meth:`inflight_limit`): bytes landed
        # and seconds, both decayed over ``_RATE_WINDOW_S`` of such seconds.
        self._rate_bytes = self._rate_s = 0.0
        self._batch_bytes = 0  # the largest planned batch's blocks
        # Timeline: when the reads started/ended, and when the plan's first batch landed.
        self._first_read: float | None = None
        self._last_read: float | None = None
        self._plan_t0: float | None = None
        self._first_batch: set[int] | None = None  # blocks of it not landed yet
        self._first_batch_s: float | None = None
        self._first_batch_reads: int | None = None
        self._planner: _Planner | None = None
        self._pid = os.getpid()  # the process whose threads and client these are
        try:
            self._open(name, fingerprint)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ processes

    def _own(self) -> None:
        """In a process forked from the one that opened this source: reopen here first
        (:func:`_reopen`, as a spawned worker does), dropping the parent's state
        untouched (its threads do not exist here; its blocks are the parent's memory)."""
        if self._pid == os.getpid():
            return
        with _FORKED:
            if self._pid == os.getpid():  # another thread of this child reopened it
                return
            if self._closed:  # stays closed: nothing to reopen
                self._drop_forked()
                return
            fresh = _reopen(self.url, self.options, self.policy, self.fingerprint)
            self.__dict__.update(fresh.__dict__)

    def _drop_forked(self) -> None:
        """Forget the parent's state in a forked copy without touching it (its threads
        do not exist here, its locks may have been copied held); closed."""
        self._closed = True
        self._planner = None
        self._lock = threading.RLock()
        self._room = threading.Condition(self._lock)
        self._blocks, self._sharing, self._queue, self._inflight = {}, {}, [], {}
        self._kept = collections.OrderedDict()
        self._held = self._kept_bytes = self._reserved_bytes = 0
        self._pid = os.getpid()

    def for_worker_processes(self, workers: int) -> StreamSource:
        """This process's source as one of ``workers`` processes that share the cache
        limit, e.g. a DataLoader worker's: each gets ``cache_bytes // workers`` (the
        host holds at most ``cache_bytes`` together). This source, its limit set in
        place, while it has read nothing in this process (a forked copy reopens first:
        :meth:`_own`); else a new one.

        Raises:
            ValueError: ``workers`` is below 1.
        """
        if int(workers) < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        options = self.options.shared_by(int(workers))
        self._own()
        with self._lock:
            if self._planner is None and not (
                self._blocks or self._inflight or self._queue or self._closed
            ):
                self.options = options
                return self
        return _reopen(self.url, options, self.policy, self.fingerprint)

    # ------------------------------------------------------------------ opening

    def _published(self, name: str, want: str):
        """The folder's manifest, once it is a published cache of fingerprint ``want``
        as a pull finds one (:func:`~hf_pipeline.publish.find.find_published`: every
        stage marker there, consistent with the manifest, its fingerprint and the store's
        listing); no data file is read.

        Raises:
            SourceError: not published (no folder, or a marker missing: an upload
                unfinished or interrupted), naming the URL and what is missing.
            CacheFormatError: published but damaged (as a pull refuses it).
        """
        from hf_pipeline.cache.layout import STAGES
        from hf_pipeline.config import DataConfig
        from hf_pipeline.publish.find import find_published
        from hf_pipeline.stores.factory import open_store

        store = open_store(self.url[: -len(name) - 1], data_config=DataConfig(), policy=self.policy)
        with tempfile.TemporaryDirectory(prefix="hf_pipeline-stream-") as meta:
            published, why = find_published(store, name, want, STAGES, meta_dir=meta)
        if published is None:
            why = why.removeprefix(f"{self.url} ")
            if why.startswith("nothing at "):
                why = "it does not exist (nothing is published there)"
            raise SourceError(self.url, f"not a published cache, so not streamed: {why}")
        return published.manifest

    def _open(self, name: str, fingerprint: str | None) -> None:
        stated = _CACHE_NAME.search(name).group(1)  # type: ignore[union-attr]  # checked
        want = fingerprint or stated
        manifest = self._published(name, want)  # its fingerprint is ``want``
        where = f"{self.url}/{_MANIFEST}"
        if stated != want:
            raise CacheFormatError(
                where, f"fingerprint {manifest.fingerprint!r}, expected {want!r}"
            )
        if manifest.stream is None:
            raise CacheFormatError(
                where,
                "has no stream index (published by an older hf_pipeline): publish the cache "
                "again with prebuild_cache.py --publish, or pull it (build.pull_from)",
            )
        sizes = {rel: entry.size for rel, entry in manifest.files.items()}
        try:
            index = StreamIndex.from_dict(manifest.stream, sizes)
        except ValueError as e:
            raise CacheFormatError(where, str(e)) from None
        self.fingerprint = manifest.fingerprint
        self.manifest = manifest
        self._index = index
        self._build_tables(index)
        idx_col = self._columns["indices"]
        all_idx = self._read_column(idx_col, np.arange(int(idx_col.starts[-1])))
        self._init_rows(all_idx.astype(np.int64), index.columns["indices"].files[0])

    def _build_tables(self, index: StreamIndex) -> None:
        from hf_pipeline.cache.precision import numpy_dtype

        files: list[str] = []
        file_of: dict[str, int] = {}
        b_file, b_start, b_bytes, b_digest = [], [], [], []
        self._columns: dict[str, _Column] = {}
        next_block = 0
        for name, col in index.columns.items():
            for f in col.files:
                file_of.setdefault(f, len(files))
                if file_of[f] == len(files):
                    files.append(f)
            rows = np.array([r for _, r, _ in col.chunks], dtype=np.int64)
            starts = np.zeros(len(rows) + 1, dtype=np.int64)
            starts[1:] = np.cumsum(rows)
            per = col.blocks_per_chunk()
            block0 = next_block + np.concatenate([[0], np.cumsum(per)[:-1]]).astype(np.int64)
            for (file, n, offset), first in zip(col.chunks, block0, strict=True):
                k = np.arange(-(-n // col.block_rows), dtype=np.int64)
                b_file.append(np.full(k.size, file_of[col.files[file]], dtype=np.int64))
                b_start.append(offset + k * col.block_rows * col.row_bytes)
                b_bytes.append(np.minimum(col.block_rows, n - k * col.block_rows) * col.row_bytes)
                assert first == next_block  # chunks are numbered in order
                next_block += k.size
            b_digest.append(col.digests)
            dtype = np.dtype(col.dtype)
            if name == "latents" and index.latent_dtype is not None:
                view = np.dtype(numpy_dtype(index.latent_dtype))
                if view.itemsize != dtype.itemsize:
                    raise CacheFormatError(
                        f"{self.url}/{_MANIFEST}",
                        f"latents stored as {dtype} cannot be {index.latent_dtype}",
                    )
                dtype = view
            self._columns[name] = _Column(
                name=name,
                row_bytes=col.row_bytes,
                row_shape=col.row_shape,
                dtype=dtype,
                block_rows=col.block_rows,
                starts=starts,
                block0=block0 if block0.size else np.zeros(0, np.int64),
            )
        cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)  # noqa: E731
        self._files = files
        self._block_file = cat(b_file)
        self._block_start = cat(b_start)
        self._block_bytes = cat(b_bytes)
        self._block_digest = np.concatenate(b_digest)

    def _init_rows(self, idx: np.ndarray, where: str) -> None:
        lat = self._columns["latents"]
        physical = int(lat.starts[-1])
        url = f"{self.url}/{where}"
        if idx.size and (idx[0] < 0 or idx[-1] >= physical):
            raise CacheFormatError(url, f"indices outside [0, {physical}) rows")
        if idx.size > 1 and not np.all(np.diff(idx) > 0):
            raise CacheFormatError(url, "indices are not strictly ascending")
        self._indices = idx
        self.num_rows = int(idx.size)
        self.num_physical_rows = physical

    # ------------------------------------------------------------------ properties

    @property
    def num_crops(self) -> int:
        return self._columns["latents"].row_shape[0]

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return self._columns["latents"].row_shape[1:]

    @property
    def embed_dim(self) -> int:
        return self._columns["embedding"].row_shape[0]

    @property
    def latent_dtype(self) -> np.dtype:
        return self._columns["latents"].dtype

    @property
    def embedding_dtype(self) -> np.dtype:
        return self._columns["embedding"].dtype

    @property
    def sample_bytes(self) -> int:
        lat, emb = self._columns["latents"], self._columns["embedding"]
        return lat.row_bytes // self.num_crops + emb.row_bytes + 8

    @property
    def keys(self) -> np.ndarray:
        """Keys of all kept rows, in logical row order (int64; fetched on each call)."""
        return self._read_column(self._columns["key"], self._indices)

    def physical(self, rows: np.ndarray) -> np.ndarray:
        """Physical row ids of logical ``rows``.

        Raises:
            IndexError: a row id is outside ``[0, num_rows)``.
        """
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= self.num_rows):
            raise IndexError(
                f"row ids must be in [0, {self.num_rows}), got [{rows.min()}, {rows.max()}]"
            )
        return self._indices[rows]

    # ------------------------------------------------------------------ gathering

    def _locate(self, col: _Column, phys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(global block id, byte offset inside the block)`` of each physical row."""
        chunk = np.searchsorted(col.starts, phys, side="right") - 1
        r = phys - col.starts[chunk]
        k = r // col.block_rows
        return col.block0[chunk] + k, (r - k * col.block_rows) * col.row_bytes

    def block_ids(self, rows: np.ndarray) -> np.ndarray:
        """The global block ids holding logical ``rows`` in every column (sorted, unique)."""
        phys = self.physical(rows)
        ids = [self._locate(self._columns[n], phys)[0] for n in ("latents", "embedding", "key")]
        return np.unique(np.concatenate(ids))

    def gather(
        self,
        rows: np.ndarray,
        crops: np.ndarray | int,
        *,
        out: dict[str, np.ndarray] | None = None,
        position: Any = None,
    ) -> dict[str, np.ndarray]:
        """Gather samples by logical row id, as :meth:`SampleSource.gather` does.

        Args:
            rows, crops, out: as :meth:`~hf_pipeline.read.mapped.SampleSource.gather`.
            position: the plan position this batch is (from :meth:`plan`): its blocks
                are released once it is assembled.

        Raises:
            IndexError: a row or crop index is out of range.
            CacheFormatError: a block failed its checksum twice (names the file).
            StoreUnreachableError, SourceError: the store failed after every retry.
        """
        self._own()
        phys = self.physical(rows)
        planner = self._planner
        try:
            if position is not None and planner is not None:
                # Ahead of the planner: plan this batch and the refill after it now,
                # in merged reads, rather than fetch its scattered blocks alone.
                planner.catch_up(position)
            located = {
                n: self._locate(self._columns[n], phys) for n in ("latents", "embedding", "key")
            }
            ids = np.unique(np.concatenate([b for b, _ in located.values()]))
            blocks = self._obtain(ids)
            lat = self._columns["latents"]
            crops_arr = np.asarray(crops, dtype=np.int64)
            if crops_arr.size and (crops_arr.min() < 0 or crops_arr.max() >= lat.row_shape[0]):
                raise IndexError(f"sub index must be in [0, {lat.row_shape[0]}), got {crops}")
            result = {
                "latents": self._assemble(lat, blocks, *located["latents"], crops_arr),
                "embeddings": self._assemble(
                    self._columns["embedding"], blocks, *located["embedding"], None
                ),
                "keys": self._assemble(self._columns["key"], blocks, *located["key"], None),
            }
            with self._lock:
                uniq = np.unique(phys).size
                self._counts["bytes_needed"] += uniq * sum(
                    self._columns[n].row_bytes for n in ("latents", "embedding", "key")
                )
        finally:
            if position is not None and self._planner is not None:
                self._planner.release(position)
        if out:
            for name, arr in result.items():
                if name in out:
                    np.copyto(out[name], arr)
                    result[name] = out[name]
        return result

    def _assemble(self, col, blocks, ids, within, sub) -> np.ndarray:
        """The rows (or one crop of each) out of their blocks: one fancy-index copy per
        read buffer the blocks lie in (:meth:`_read_blocks`), of the rows' bytes only.
        The blocks were once joined into one array first: a copy of every byte of every
        block the batch touched, under the GIL (a globally shuffled batch needs one row
        of each 64 KiB block: several times its own bytes)."""
        shape = col.row_shape
        item = col.row_bytes
        if sub is not None:
            item = col.row_bytes // shape[0]
            within = within + sub * item
            shape = shape[1:]
        uniq, inverse = np.unique(ids, return_inverse=True)
        held = [blocks[b] for b in uniq.tolist()]
        # The read buffers (one per read), and each block's buffer and offset there.
        _, first, group = np.unique(
            np.array([id(buf) for buf, _ in held], dtype=np.int64),
            return_index=True,
            return_inverse=True,
        )
        buffers = [held[k][0] for k in first.tolist()]
        start = np.array([offset for _, offset in held], dtype=np.int64)
        offsets = start[inverse] + within

        def rows_of(buf: np.ndarray) -> np.ndarray:
            # A row may start at any byte of a read (a read may hold blocks of several
            # columns): rows of ``item`` bytes at a stride of one byte, read-only.
            return np.lib.stride_tricks.as_strided(
                buf, shape=(buf.size - item + 1, item), strides=(1, 1), writeable=False
            )

        if len(buffers) == 1:
            got = rows_of(buffers[0])[offsets]
        else:
            got = np.empty((ids.size, item), dtype=np.uint8)
            of_row = group[inverse]
            # A row whose read holds few of the batch's rows (a global shuffle: about
            # one) is a slice of its own: a strided view and an index per read cost
            # ~10 us a read, most of a globally shuffled gather (4.4 -> 2.6 ms of CPU
            # a 256-row batch on the 2-CPU VM).
            few = np.bincount(of_row, minlength=len(buffers))[of_row] <= _FEW_ROWS
            for r, k, off in zip(
                np.flatnonzero(few).tolist(),
                of_row[few].tolist(),
                offsets[few].tolist(),
                strict=True,
            ):
                got[r] = buffers[k][off : off + item]
            many = np.flatnonzero(~few)
            if many.size:
                order = many[np.argsort(of_row[many], kind="stable")]
                bounds = np.searchsorted(of_row[order], np.arange(len(buffers) + 1))
                for k, buf in enumerate(buffers):
                    rows = order[bounds[k] : bounds[k + 1]]
                    if rows.size:
                        got[rows] = rows_of(buf)[offsets[rows]]
        return got.view(col.dtype).reshape((ids.size, *shape))

    def _read_column(self, col: _Column, phys: np.ndarray) -> np.ndarray:
        ids, within = self._locate(col, phys)
        blocks = self._obtain(np.unique(ids))
        return self._assemble(col, blocks, ids, within, None)

    # ------------------------------------------------------------------ blocks

    def _obtain(self, ids: np.ndarray) -> dict[int, _Held]:
        """The verified bytes of blocks ``ids``: held ones, in flight ones, the rest
        fetched now (kept afterwards while the limit allows)."""
        got: dict[int, _Held] = {}
        waits: dict[Future, list[int]] = {}
        missing = []
        with self._lock:
            self._check_open()
            for b in ids.tolist():
                arr = self._blocks.get(b)
                if arr is not None:
                    got[b] = arr
                    if b in self._kept:
                        self._kept.move_to_end(b)
                elif b in self._inflight:
                    waits.setdefault(self._inflight[b], []).append(b)
                else:
                    missing.append(b)
            missing = self._flush_planned(missing, waits)
            self._counts["demand_blocks"] += len(missing)
            reads = self._submit(missing)
            self._counts["demand_reads"] += len(reads)
            for future, blocks in reads:
                waits[future] = blocks
        for future in waits:
            got.update(self._result(future))
        return got

    def _flush_planned(self, missing: list[int], waits: dict[Future, list[int]]) -> list[int]:
        """``missing`` less the blocks the planner has reserved but not started: those
        start now, with all its other pending reads (merged with them, not cut into
        this batch's share), and go into ``waits`` (caller holds the lock)."""
        planner = self._planner
        if planner is None or not any(b in self._reserved for b in missing):
            return missing
        planner.flush("gather")
        rest = []
        for b in missing:
            if b in self._inflight:
                waits.setdefault(self._inflight[b], []).append(b)
            else:
                rest.append(b)
        return rest

    def _result(self, future: Future) -> dict[int, _Held]:
        """A read's blocks, waiting at most as long as its retries can take."""
        p = self.policy
        limit = (p.max_retries + 1) * (p.file_timeout + p.backoff_max) * 2 + 10
        deadline = time.monotonic() + limit
        while True:
            try:
                return future.result(timeout=_STOP_CHECK_S)
            except FutureTimeout:
                self._check_open()
                if time.monotonic() > deadline:  # pragma: no cover - reads are bounded
                    raise TimeoutError(
                        f"{self.url}: a read did not end within {limit:.0f}s"
                    ) from None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the stream source of {self.url} is closed")

    def _submit(
        self,
        ids: list[int],
        first_use: dict[int, int] | None = None,
        soon: set[int] | frozenset[int] = frozenset(),
    ) -> list[tuple[Future, list[int]]]:
        """Queue reads of ``ids`` (caller holds the lock), neighbours merged (a gap of
        ``soon`` blocks read with them: :meth:`_runs`); each read ranks by the first
        batch that needs one of its blocks (``first_use``: block -> plan index; None: a
        gather waits for them, before any planned read)."""
        reads = []
        for run in self._runs(ids, soon=soon, room=self._spare_room() if soon else 0):
            if first_use is None:
                priority = _DEMAND
            else:
                priority = min((first_use[b] for b in run if b in first_use), default=0)
            reads.append(self._start_read(run, priority))
        return reads

    def _spare_room(self) -> int:
        """Bytes that blocks no plan holds may take now: the limit less the blocks held
        for a plan and those reserved (kept blocks make way, least recently used first;
        caller holds the lock)."""
        return max(
            0, self.options.cache_bytes - (self._held - self._kept_bytes) - self._reserved_bytes
        )

    def _fills(self, last: int, b: int, soon, room: int) -> list[int] | None:
        """The blocks between ``last`` and ``b`` when they are exactly the bytes of the
        gap, every one of them in ``soon``, and together at most ``room`` bytes; else
        None (caller holds the lock)."""
        if not soon or b - last < 2:
            return None
        between = range(last + 1, b)
        if not all(x in soon for x in between):
            return None
        lo, hi = last, b
        starts = self._block_start[lo + 1 : hi + 1]
        ends = self._block_start[lo:hi] + self._block_bytes[lo:hi]
        if not (
            np.array_equal(starts, ends)
            and np.all(self._block_file[lo : hi + 1] == self._block_file[lo])
            and int(self._block_bytes[lo + 1 : hi].sum()) <= room
        ):
            return None
        return list(between)

    def _runs(
        self,
        ids: list[int],
        *,
        count: bool = True,
        soon: set[int] | frozenset[int] = frozenset(),
        room: int = 0,
    ) -> list[list[int]]:
        """``ids`` in file order, cut into reads: neighbours of a file at most
        ``coalesce_bytes`` apart merge while the read stays within ``max_read_bytes``,
        and while its gaps together are at most 1/:data:`_GAP_SHARE` of its blocks
        (a gap is bytes fetched for nothing: filtered-out rows, the latents' list
        offsets and the input_ids between record batches' buffers; this keeps them to a
        small share of a long run's bytes).

        A gap made wholly of blocks in ``soon`` (those of the batches the planner pulled
        next, not held, reserved or in flight) is no waste: it is read as blocks of the
        run, verified, and kept for those batches (at most ``room`` bytes of them in
        all, what the limit leaves). That is what a block-shuffle window that a refill
        ends inside looks like: the refill holds a scattered share of the window's
        rows, its gaps are the rows of the window's next batches. Cut at every such gap
        (the 1/8 rule cuts a run of a few blocks at a one-block gap) the window took one
        read per block, and the next refill one per hole between them (on the H200
        host, 96k rows, batch and block 1024: 3,098 reads of 0.81 MB an epoch, 2,685
        cut there: every refill ends inside a window, as the epoch's short last block
        shifts the windows after it off the batches). A gap of blocks no batch pulled
        next needs (a globally shuffled batch's rows, filtered-out rows, other columns)
        counts as before."""
        out: list[list[int]] = []
        if not ids:
            return out
        # In file order, and every block's numbers as Python ints, by NumPy: the loop
        # below is the planner's, on the refill's thousands of blocks (a global
        # shuffle's), once more per batch :meth:`_Planner._complete` weighs; a sort
        # keyed by NumPy scalars and their arithmetic per block took ~2 us a block
        # (seconds before the H200 host's first global-shuffle batch).
        arr = np.fromiter(ids, dtype=np.int64, count=len(ids))
        arr = arr[np.lexsort((self._block_start[arr], self._block_file[arr]))]
        order = arr.tolist()
        files = self._block_file[arr].tolist()
        starts = self._block_start[arr].tolist()
        sizes = self._block_bytes[arr].tolist()
        coalesce, max_read = self.options.coalesce_bytes, self.options.max_read_bytes
        run = [order[0]]
        first, end = starts[0], starts[0] + sizes[0]  # the run's first byte, its end
        used, gaps = sizes[0], 0
        for i in range(1, len(order)):
            b, start, size = order[i], starts[i], sizes[i]
            gap = start - end
            fits = start + size - first <= max_read
            fill = None
            if files[i] != files[i - 1]:
                cut = "file"
            elif soon and gap > 0 and fits and (fill := self._fills(run[-1], b, soon, room)):
                cut = None
            elif not 0 <= gap <= coalesce:
                cut = "gap"
            elif (gaps + gap) * _GAP_SHARE > used + size:
                cut = "gap_share"
            elif not fits:
                cut = "max_read"
            else:
                cut = None
            if cut is None:
                if fill:
                    n = int(self._block_bytes[fill].sum())
                    run.extend(fill)
                    # Not in ``used``: the waste allowed a read stays 1/8 of the planned
                    # blocks (fills are kept only while the room allows).
                    room -= n
                    gap = 0
                    if count:
                        self._counts["gap_blocks"] += len(fill)
                run.append(b)
                used += size
                gaps += gap
            else:
                if count:
                    self._counts[f"cut_{cut}"] += 1
                out.append(run)
                run = [b]
                first, used, gaps = start, size, 0
            end = start + size
        out.append(run)
        return out

    def _start_read(self, run: list[int], priority: int) -> tuple[Future, list[int]]:
        """Queue one read (caller holds the lock); it starts in order of ``priority``
        (then of queueing) once the bytes in flight allow (:meth:`_dispatch`)."""
        future: Future = Future()
        for b in run:
            self._inflight[b] = future
        self._tick()
        future.add_done_callback(functools.partial(self._landed, run))
        nbytes = int(self._block_start[run[-1]] + self._block_bytes[run[-1]]) - int(
            self._block_start[run[0]]
        )
        heapq.heappush(self._queue, (priority, next(self._sequence), run, nbytes, future))
        self._dispatch()
        return future, run

    def inflight_limit(self) -> int:
        """Most bytes of reads in flight at once (thread-safe): what the store delivered
        in :data:`_INFLIGHT_S` seconds while reads were queued, within ``cache_bytes``;
        at least :data:`_INFLIGHT_BATCHES` times the largest planned batch's blocks and
        ``max_read_bytes`` (all of it until the plan's first batch has landed and the
        rate is known).

        Reads started all at once share the store's bandwidth: when it is the bound, the
        first batch's landed with the last one's, seconds late; so the bytes in flight
        are what the store delivers in a short time, and a read started now lands about
        that soon. When latency is the bound, a read takes as long whatever runs beside
        it: more reads in flight deliver more, the rate rises with them, and the bound
        with it, until ``concurrency`` reads run (4 batches' bytes held the H200 host's
        block shuffle, 50 ms a request, to 32.7 reads of 64). The planned reads in flight
        are reserved bytes, already within ``cache_bytes``."""
        with self._lock:
            least = max(_INFLIGHT_BATCHES * self._batch_bytes, self.options.max_read_bytes)
            if self._first_batch_s is None or self._rate_s < _RATE_MIN_S:
                return least
            rate = self._rate_bytes / self._rate_s
            return max(least, min(int(rate * _INFLIGHT_S), self.options.cache_bytes))

    def _dispatch(self) -> None:
        """Start queued reads, best first, while fewer than ``concurrency`` run and their
        bytes fit :meth:`inflight_limit` (one always may: caller holds the lock). Reads
        started all at once share the store's bandwidth: the first batch's landed
        with the last one's, seconds late."""
        self._tick()
        limit = self.inflight_limit()
        while self._queue and not self._closed and self._running < self.options.concurrency:
            _, _, run, nbytes, future = self._queue[0]
            if self._running and self._inflight_bytes + nbytes > limit:
                return
            heapq.heappop(self._queue)
            if not future.set_running_or_notify_cancel():
                continue
            self._running += 1
            self._max_running = max(self._max_running, self._running)
            self._counts["dispatched_reads"] += 1
            self._inflight_bytes += nbytes
            self._max_inflight = max(self._max_inflight, self._inflight_bytes)
            if self._first_read is None:
                self._first_read = time.monotonic()
            try:
                self._pool.submit(self._run_read, run, nbytes, future)
            except RuntimeError as exc:  # the pool shut down: the source is closing
                self._running -= 1
                self._inflight_bytes -= nbytes
                future.set_exception(exc)

    def _tick(self) -> None:
        """Account the time since the last tick at the reads running and queued then
        (caller holds the lock; called before either changes): the store's rate
        (:meth:`inflight_limit`), mean reads in flight, :attr:`StreamStats.starved_s`
        and :attr:`StreamStats.held_back_s`."""
        now = time.monotonic()
        if self._tick_t is not None and self._queue:
            # Reads queued since the last tick: the store had all it could take.
            decay = math.exp(-(now - self._tick_t) / _RATE_WINDOW_S)
            self._rate_bytes *= decay
            self._rate_s = self._rate_s * decay + (now - self._tick_t)
        if self._tick_t is not None and self._first_read is not None:
            dt = now - self._tick_t
            self._running_area += self._running * dt
            if self._running < self.options.concurrency:
                if self._queue:
                    self._held_back_s += dt
                else:
                    self._starved_s += dt
        self._tick_t = now

    def _run_read(self, run: list[int], nbytes: int, future: Future) -> None:
        """One queued read, in a pool thread: its result (or error) goes to ``future``."""
        error: BaseException | None = None
        try:
            blocks = self._read_blocks(run)
        except BaseException as exc:  # noqa: BLE001 - the waiter raises it
            error, blocks = exc, None
        with self._lock:
            self._tick()
            if self._queue and error is None:
                self._rate_bytes += nbytes  # landed while reads waited for room
            self._running -= 1
            self._inflight_bytes -= nbytes
            self._last_read = time.monotonic()
            self._dispatch()  # the next one starts before this one's waiters wake
        if error is None:
            future.set_result(blocks)
        else:
            future.set_exception(error)

    def _read_blocks(self, run: list[int]) -> dict[int, _Held]:
        """Fetch one run of neighbouring blocks and verify each; once more on a mismatch."""
        rel = self._files[int(self._block_file[run[0]])]
        start = int(self._block_start[run[0]])
        end = int(self._block_start[run[-1]] + self._block_bytes[run[-1]])
        # Per-block numbers as Python ints, once per read: a long read is hundreds of
        # blocks (the sum of the run's sizes once recomputed per block took seconds of
        # GIL per epoch on the H200 host: quadratic in the blocks of a read).
        offsets = (self._block_start[run] - start).tolist()
        sizes = self._block_bytes[run].tolist()
        digests = self._block_digest[run].tolist()
        # A block is ``(buffer, offset)``: the read's one buffer (so a batch is copied
        # out of a read's blocks in one go, :meth:`_assemble`), the read's own bytes
        # when it has no gaps, else the blocks joined without the gaps (the gaps' bytes
        # must not stay alive behind a block: they are not counted as held).
        gaps = len(run) > 1 and end - start != sum(sizes)
        for attempt in (1, 2):
            data = np.frombuffer(self._read(rel, start, end), dtype=np.uint8)
            bad = None
            for b, s, n, digest in zip(run, offsets, sizes, digests, strict=True):
                if block_digest(data[s : s + n]) != digest:
                    bad = b
                    break
            if bad is None:
                if gaps:
                    data = np.concatenate(
                        [data[s : s + n] for s, n in zip(offsets, sizes, strict=True)]
                    )
                    offsets = np.concatenate([[0], np.cumsum(sizes[:-1])]).tolist()
                return dict(zip(run, ((data, s) for s in offsets), strict=True))
            if attempt == 1:
                with self._lock:
                    self._counts["refetched"] += 1
                logger.warning(
                    "%s/%s: bytes %d-%d fail their %s checksum; fetching them again",
                    self.url, rel, self._block_start[bad],
                    self._block_start[bad] + self._block_bytes[bad], BLOCK_ALGORITHM,
                )  # fmt: skip
        a, b = int(self._block_start[bad]), int(self._block_start[bad] + self._block_bytes[bad])
        raise CacheFormatError(
            f"{self.url}/{rel}",
            f"bytes {a}-{b} do not match their {BLOCK_ALGORITHM} checksum in {_MANIFEST} "
            "(fetched twice): the published file was changed or the store serves other bytes",
        )

    def _read(self, rel: str, start: int, end: int, *, exact: bool = True) -> bytes:
        """Bytes ``[start, end)`` of ``rel`` with retries; a short body is retried,
        unless the store says the object ends before ``end`` (one CacheFormatError)."""
        url = f"{self.url}/{rel}"

        def attempt() -> bytes:
            data = self._store.read_span(
                rel, start, end, time.monotonic() + self.policy.file_timeout
            )
            if exact and len(data) != end - start:
                raise TransientError(f"{url}: got {len(data)} of {end - start} bytes at {start}")
            return data

        first = True

        def retried(exc: BaseException) -> None:
            nonlocal first
            with self._lock:
                self._counts["retries"] += 1
            self._retry_report.retried(url, start, end, exc, first_of_read=first)
            first = False

        try:
            data = with_retries(
                url, attempt, self.policy, on_retry=retried, stop=self._stop, log_retries=False
            )
        except Cancelled:
            raise RuntimeError(f"the stream source of {self.url} is closed") from None
        except StoreUnreachableError as err:
            raise StoreUnreachableError(
                url,
                f"{err.reason} (each read may take {self.policy.file_timeout:.0f} s: "
                "loader.stream_read_timeout; retries: data.max_retries)",
            ) from err
        except SourceError as err:
            if isinstance(err.__cause__, FileNotFoundError):
                raise SourceError(url, "does not exist in the store") from err.__cause__
            cause = err.__cause__
            if cause is not None and (
                isinstance(cause, ShortObjectError) or http_status(cause) == 416
            ):
                # The object ends before bytes the manifest has: a range past its end
                # (416 Range Not Satisfiable) or across it (206, a short body whose
                # Content-Range gives the size). A short body the connection cut is
                # retried above (TransientError), never said so.
                has = (
                    f"{cause.size} bytes, not bytes {start}-{end}"
                    if isinstance(cause, ShortObjectError)
                    else f"no bytes {start}-{end}"
                )
                raise CacheFormatError(
                    url,
                    f"shorter than the {self.manifest.files[rel].size} bytes published "
                    f"(the store has {has}): the file was changed or truncated after it "
                    "was published; publish the cache again",
                ) from cause
            raise
        with self._lock:
            self._counts["requests"] += 1
            self._counts["bytes_fetched"] += len(data)
        return data

    def _landed(self, run: list[int], future: Future) -> None:
        """A read ended: keep its blocks that are reserved, and others while they fit."""
        with self._lock:
            for b in run:
                if self._inflight.get(b) is future:
                    del self._inflight[b]
            try:
                blocks = None if future.cancelled() or future.exception() else future.result()
            except BaseException:  # noqa: BLE001 - the waiter gets the read's error itself
                blocks = None
            if blocks is not None and self._first_batch:
                self._first_batch.difference_update(run)
                if not self._first_batch:
                    self._first_batch_landed()
            for b in run:
                reserved = b in self._reserved
                if reserved:
                    self._reserved.discard(b)
                    self._reserved_bytes -= int(self._block_bytes[b])
                if blocks is None or b in self._blocks:
                    continue
                n = int(self._block_bytes[b])
                # Reserved bytes were counted when the planner reserved them; anything
                # else is kept while it fits, in place of kept blocks used longer ago
                # (random access, Grain's records: the recent blocks are the likely ones).
                if reserved or self._drop_kept(n, run):
                    self._blocks[b] = blocks[b]
                    self._held += n
                    if not self._pins.get(b, 0):
                        self._keep(b)
            if blocks is not None:
                self._share_or_copy(run, blocks)
            self._max_held = max(self._max_held, self._held + self._reserved_bytes)
            self._room.notify_all()

    # ------------------------------------------------------------------ plan

    def plan(self, batches: Iterator[tuple[Any, ...]] | None) -> None:
        """Fetch ahead for ``batches``: ``(position, logical rows)`` (or ``(position,
        rows, crops)``, as the Loader gives them: the crops are not needed here) of this
        process's upcoming batches in order (what a gather with ``position=`` will
        consume). ``None`` stops planning (blocks already held stay while the limit
        allows)."""
        self._own()
        old, self._planner = self._planner, None
        if old is not None:
            old.stop()
        with self._lock:
            for b in self._pins:
                if b in self._blocks:
                    self._keep(b)  # no plan needs it now: kept while the limit allows
            self._pins.clear()
        if batches is not None and not self._closed:
            with self._lock:
                self._plan_t0, self._first_batch, self._first_batch_s = time.monotonic(), None, None
                self._first_batch_reads = None
            self._planner = _Planner(self, batches)

    def _planned_batch(self, index: int, ids: np.ndarray) -> None:
        """The planner pinned batch ``index`` of its plan, blocks ``ids`` (caller holds
        the lock): the in-flight bound follows the largest batch, and the first batch's
        blocks not held yet are watched until they land (:attr:`StreamStats.first_batch_s`)."""
        self._batch_bytes = max(self._batch_bytes, int(self._block_bytes[ids].sum()))
        if index == 0 and self._first_batch is None:
            self._first_batch = {b for b in ids.tolist() if b not in self._blocks}
            if not self._first_batch:
                self._first_batch_landed()

    def _first_batch_landed(self) -> None:
        """The plan's first batch is held (caller holds the lock)."""
        if self._plan_t0 is None:  # no plan: no first batch to time
            return
        self._first_batch_s = time.monotonic() - self._plan_t0
        self._first_batch_reads = self._counts["dispatched_reads"]

    def _start_planned(
        self, blocks: dict[int, int], soon: set[int] | frozenset[int] = frozenset()
    ) -> None:
        """Queue the reads of blocks reserved by the planner (caller holds the lock),
        ``blocks``: block -> index of the first planned batch that needs it; ``soon``:
        blocks a gap may be filled with (:meth:`_runs`)."""
        todo = [b for b in blocks if b not in self._inflight and b in self._reserved]
        self._counts["planned_blocks"] += len(todo)
        self._counts["planned_reads"] += len(self._submit(todo, blocks, soon))

    def _unpin(self, b: int) -> None:
        """One plan fewer needs ``b`` (caller holds the lock)."""
        left = self._pins.get(b, 0) - 1
        if left > 0:
            self._pins[b] = left
            return
        self._pins.pop(b, None)
        if b in self._blocks:
            self._keep(b)  # kept while the limit allows (dropped for newer blocks)

    def _keep(self, b: int) -> None:
        """Held block ``b`` is kept for reuse, as the most recently used (caller holds
        the lock)."""
        if b not in self._kept:
            self._kept_bytes += int(self._block_bytes[b])
        self._kept[b] = None
        self._kept.move_to_end(b)

    def _unkeep(self, b: int) -> None:
        """``b`` is no longer kept: pinned by a plan, or dropped (caller holds the lock)."""
        if b in self._kept:
            del self._kept[b]
            self._kept_bytes -= int(self._block_bytes[b])

    def _share_or_copy(self, run: list[int], blocks: dict[int, _Held]) -> None:
        """The blocks of a landed read that were admitted share its buffer only if they
        are all of its bytes; otherwise (a block not admitted for want of room, or held
        already from an earlier read) each admitted one is copied out, so the rest of
        the buffer is freed (caller holds the lock)."""
        admitted = [b for b in run if self._blocks.get(b) is blocks[b]]
        if not admitted:
            return
        buf = blocks[admitted[0]][0]
        if int(self._block_bytes[admitted].sum()) == buf.nbytes:
            if len(admitted) > 1:
                self._sharing[id(buf)] = set(admitted)
            return
        for b in admitted:
            self._copy_out(b)

    def _copy_out(self, b: int) -> None:
        """Held block ``b`` gets a buffer of its own (caller holds the lock)."""
        buf, off = self._blocks[b]
        self._blocks[b] = (buf[off : off + int(self._block_bytes[b])].copy(), 0)

    def _drop(self, b: int, spare) -> None:
        """Drop kept block ``b`` (already out of the LRU order) and, when it shares its
        read's buffer, its kept siblings too (none of ``spare``); siblings a plan still
        needs are copied out (caller holds the lock)."""
        n = int(self._block_bytes[b])
        self._kept_bytes -= n
        self._held -= n
        buf, _ = self._blocks.pop(b)
        siblings = self._sharing.pop(id(buf), set())
        siblings.discard(b)
        for s in siblings:
            if s in self._kept and s not in spare:
                self._unkeep(s)
                self._held -= int(self._block_bytes[s])
                del self._blocks[s]
            else:
                self._copy_out(s)

    def _drop_kept(self, need: int, spare) -> bool:
        """Make room for ``need`` more bytes under the limit by dropping kept blocks,
        least recently used first, none of ``spare`` (caller holds the lock). False,
        and nothing dropped, when even that would not make room."""
        limit = self.options.cache_bytes
        if self._held + self._reserved_bytes + need <= limit:
            return True
        spare = {b for b in spare if b in self._kept}
        evictable = self._kept_bytes - sum(int(self._block_bytes[b]) for b in spare)
        if self._held - evictable + self._reserved_bytes + need > limit:
            return False
        skipped = []
        while self._held + self._reserved_bytes + need > limit:
            b, _ = self._kept.popitem(last=False)
            if b in spare:
                skipped.append(b)
                continue
            self._drop(b, spare)
        for b in reversed(skipped):  # back where they were: least recently used first
            self._kept[b] = None
            self._kept.move_to_end(b, last=False)
        return True

    def _reserve(self, ids: np.ndarray) -> list[int] | Literal[False] | None:
        """Pin ``ids`` for a planned batch and reserve room for the missing ones (caller
        holds the lock). Returns the blocks to read (the caller starts them, together
        with those of the next planned batches: neighbours across batches merge into
        one read); False: no room now; None: can never fit."""
        want = ids.tolist()
        new = [b for b in want if b not in self._blocks and b not in self._reserved]
        need = int(self._block_bytes[new].sum()) if new else 0
        if need > self.options.cache_bytes:
            return None
        if not self._drop_kept(need, want):
            return False
        for b in want:
            self._pins[b] = self._pins.get(b, 0) + 1
            self._unkeep(b)
        for b in new:
            self._reserved.add(b)
        self._reserved_bytes += need
        self._max_held = max(self._max_held, self._held + self._reserved_bytes)
        return [b for b in new if b not in self._inflight]

    # ------------------------------------------------------------------ stats & life

    def stats(self) -> StreamStats:
        """Counters since the source was opened (thread-safe)."""
        self._own()
        with self._lock:
            c = self._counts
            read_s = (
                self._last_read - self._first_read
                if self._first_read is not None and self._last_read is not None
                else 0.0
            )
            reasons = sorted(k[len("flush_") :] for k in c if k.startswith("flush_"))
            cuts = sorted(k[len("cut_") :] for k in c if k.startswith("cut_"))
            return StreamStats(
                requests=c["requests"],
                bytes_fetched=c["bytes_fetched"],
                bytes_needed=c["bytes_needed"],
                retries=c["retries"],
                refetched=c["refetched"],
                planned_blocks=c["planned_blocks"],
                demand_blocks=c["demand_blocks"],
                planned_reads=c["planned_reads"],
                demand_reads=c["demand_reads"],
                held_bytes=self._held,
                max_held_bytes=self._max_held,
                limit_bytes=self.options.cache_bytes,
                max_inflight_bytes=self._max_inflight,
                max_inflight_reads=self._max_running,
                first_batch_s=self._first_batch_s,
                first_batch_reads=self._first_batch_reads,
                read_s=read_s,
                mean_inflight_reads=self._running_area / read_s if read_s > 0 else 0.0,
                starved_s=self._starved_s,
                held_back_s=self._held_back_s,
                flushes={r: c[f"flush_{r}"] for r in reasons},
                flush_blocks={r: c[f"flushblocks_{r}"] for r in reasons},
                read_cuts={r: c[f"cut_{r}"] for r in cuts},
                completed_batches=c["completed_batches"],
                gap_blocks=c["gap_blocks"],
            )

    def cache_state(self) -> dict[str, int]:
        """What the cache holds right now, counted from the blocks themselves:
        ``{"blocks", "bytes", "reserved_bytes", "limit_bytes"}`` (thread-safe)."""
        self._own()
        with self._lock:
            return {
                "blocks": len(self._blocks),
                "bytes": int(self._block_bytes[list(self._blocks)].sum()) if self._blocks else 0,
                "reserved_bytes": self._reserved_bytes,
                "limit_bytes": self.options.cache_bytes,
            }

    def reset_stats(self) -> None:
        self._own()
        with self._lock:
            self._counts.clear()
            self._max_held = self._held + self._reserved_bytes
            self._max_inflight = self._inflight_bytes
            self._max_running = self._running
            self._first_read = self._last_read = None
            self._tick_t = time.monotonic()
            self._running_area = self._starved_s = self._held_back_s = 0.0

    def __reduce__(self):
        # A DataLoader worker opens its own: one manifest read, its own cache.
        return (_reopen, (self.url, self.options, self.policy, self.fingerprint))

    def close(self) -> None:
        """Stop planning and reading, drop the held blocks (idempotent)."""
        if self._closed:
            return
        if self._pid != os.getpid():  # a forked copy: the threads are the parent's
            self._drop_forked()
            return
        self._closed = True
        self._stop.set()
        planner, self._planner = self._planner, None
        if planner is not None:
            planner.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            queued, self._queue = self._queue, []
            for *_, future in queued:
                future.cancel()  # a waiter sees the source closed
            self._blocks.clear()
            self._sharing.clear()
            self._kept.clear()
            self._held = self._kept_bytes = 0

    def __enter__(self) -> StreamSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        rows = getattr(self, "num_rows", "?")
        return f"StreamSource({self.url!r}, rows={rows}, {self.options})"


def _reopen(url, options, policy, fingerprint):
    return StreamSource(url, options, policy=policy, fingerprint=fingerprint)


#: Serialises the reopening of forked sources (:meth:`StreamSource._own`) in a child;
#: made anew in every child (a fork may copy it held).
_FORKED = threading.Lock()


def _new_forked_lock() -> None:
    global _FORKED
    _FORKED = threading.Lock()


os.register_at_fork(after_in_child=_new_forked_lock)


#: The blocks planned for a batch that is read on demand (none).
_NO_BLOCKS = np.empty(0, dtype=np.int64)


class _Planner:
    """Walks the planned batches ``ahead`` of the gathers: a named daemon thread, and
    any gather that finds its batch not planned yet (:meth:`catch_up`).

    One walker at a time (``_walk``): the batches come from one iterator. The thread
    holds it only while it pulls and reserves one batch, never while it waits, and
    gives way while a gather waits for it; a gather that holds it plans up to its own
    batch and the refill after it, and starts those reads at once, merged. So a gather
    never fetches by itself a block that a plan will fetch in a merged read: when the
    thread falls behind (starved of the GIL by the gathering threads, or more gathers
    than batches planned ahead), the gathers plan in its place, in refills, and do not
    scatter a block-shuffle window into one small read per block.
    """

    def __init__(self, source: StreamSource, batches: Iterator[tuple[Any, np.ndarray]]):
        self._source = source
        self._batches = iter(batches)
        self._stop = threading.Event()
        self._walk = threading.Lock()
        # Guarded by _walk: the batches pulled but not planned yet ``(position, block
        # ids)``, in order (the next one, held back for room or the lookahead's limit,
        # and those pulled to see which blocks the next refill needs: :meth:`_look`),
        # the index of the next batch to plan, and whether the batches ended.
        self._peek: collections.deque[tuple[Any, np.ndarray]] = collections.deque()
        # Their blocks (a read may fill a gap with them: :meth:`flush`), guarded by the
        # source's lock.
        self._soon: frozenset[int] = frozenset()
        self._index = 0
        self._ended = False
        # Guarded by the source's lock:
        self._planned: dict[Any, np.ndarray] = {}
        self._released: set[Any] = set()
        self._consumed = 0
        self._waiters = 0  # gathers waiting to walk: the thread gives way
        # Reserved, not read yet: started together, so that neighbouring blocks of
        # several batches merge into one read.
        self._pending: dict[int, int] = {}  # block -> index of the first batch needing it
        self._pending_from: int | None = None  # index of the oldest batch in _pending
        self.idle = False  # waiting for room or for the consumer, or ended
        self._thread = threading.Thread(
            target=self._run, name="hf_pipeline-stream-plan", daemon=True
        )
        self._thread.start()

    def release(self, position: Any) -> None:
        """The batch at ``position`` is assembled: unpin its blocks."""
        src = self._source
        with src._lock:
            self._consumed += 1
            ids = self._planned.pop(position, None)
            if ids is None:
                self._released.add(position)  # the planner is behind: it skips this one
            else:
                for b in ids.tolist():
                    src._unpin(b)
            src._room.notify_all()

    def flush(self, reason: str) -> None:
        """Start the reads of every reserved block not started yet (caller holds the
        source's lock): a gather needs one of them now, or the lookahead ran low.
        ``reason`` is counted (:attr:`StreamStats.flushes`). A gap between two of them
        made of blocks the batches pulled next need (:meth:`_look`) is read with them,
        while those fit in the room (see :meth:`StreamSource._runs`)."""
        pending, self._pending, self._pending_from = self._pending, {}, None
        src = self._source
        if pending:
            src._counts[f"flush_{reason}"] += 1
            src._counts[f"flushblocks_{reason}"] += len(pending)
        soon = {
            b
            for b in self._soon
            if b not in src._blocks and b not in src._reserved and b not in src._inflight
        }
        src._start_planned(pending, soon)
        src._room.notify_all()

    def _pull(self) -> bool:
        """Make sure the next batch is pulled (caller holds ``_walk``, not the source's
        lock: the sampler's work runs outside it). False: the batches ended, or the
        planner stopped."""
        return bool(self._peek) or self._pull_one()

    def _pull_one(self) -> bool:
        """Pull one more batch onto ``_peek`` (as :meth:`_pull`). False: the batches
        ended, or the planner stopped."""
        if self._stop.is_set() or self._ended:
            return False
        item = next(self._batches, None)
        if item is None:
            self._ended = True
            return False
        self._peek.append((item[0], self._source.block_ids(item[1])))
        return True

    def _look(self) -> None:
        """Pull the batches after those planned, up to ``ahead`` of them (what the next
        refills will plan), and note their blocks (caller holds ``_walk``, not the
        source's lock), so that the reads started now may read them where they fill a
        gap: the rest of a block-shuffle window that this refill ends inside. Sampler
        work the planner does anyway, a lookahead's batches early."""
        src = self._source
        while len(self._peek) < src.options.ahead and self._pull_one():
            pass
        soon = (
            frozenset(np.concatenate([ids for _, ids in self._peek]).tolist())
            if self._peek
            else frozenset()
        )
        with src._lock:
            self._soon = soon

    def _interleaved(self, ids: np.ndarray) -> bool:
        """Whether most of the blocks that batch ``ids`` would add fill holes of the
        pending reads: in the reads the pending blocks and these make together, they
        lie between two pending blocks of the same read (caller holds the source's
        lock). A block-shuffle window's next batch: its rows are the holes between the
        rows of the window's batches planned so far. Not a globally shuffled batch
        (its blocks fall anywhere), nor a sequential one (after the last pending block)."""
        src = self._source
        new = {
            b
            for b in ids.tolist()
            if b not in src._blocks
            and b not in src._reserved
            and b not in src._inflight
            and b not in self._pending
        }
        if not new or not self._pending:
            return False
        # By bytes: a window's few leftover blocks at its edges (and the embeddings'
        # longer blocks) do not outweigh the rows between. A quarter: a globally
        # shuffled batch's blocks fall between pending ones of one read about as often
        # as both neighbours are pending (~0.1 at a refill of 1/6 of the rows).
        runs = src._runs([*self._pending, *new], count=False)
        # By NumPy over the runs laid end to end (a Python pass per block, once per
        # batch weighed, was most of a global-shuffle refill's planning): a new block
        # is inside when a pending block of its run lies before it and one after.
        flat = np.fromiter(itertools.chain.from_iterable(runs), dtype=np.int64)
        lengths = np.fromiter(map(len, runs), dtype=np.int64, count=len(runs))
        heads = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        is_new = np.isin(flat, np.fromiter(new, dtype=np.int64, count=len(new)))
        at = np.arange(flat.size)
        first = np.minimum.reduceat(np.where(is_new, flat.size, at), heads)
        last = np.maximum.reduceat(np.where(is_new, -1, at), heads)
        of_run = np.repeat(np.arange(len(runs)), lengths)
        inside_mask = is_new & (at > first[of_run]) & (at < last[of_run])
        inside = int(src._block_bytes[flat[inside_mask]].sum())
        return 4 * inside >= int(src._block_bytes[flat[is_new]].sum())

    def _complete(self) -> None:
        """Before the pending reads start, plan the next batches as well while each is
        mostly the holes of those reads (:meth:`_interleaved`), within the room and at
        most ``ahead`` batches more (caller holds ``_walk``, not the source's lock).

        A refill that ends inside a block-shuffle window started the reads of the
        window's first batches; its later batches need the rows between those, which
        the next refill then fetched as one short read per hole (the reads already
        started lie between them): on the bench, 16k rows, ``ahead`` 6 (refills of 3
        batches, windows of 4), 1,809 reads of 0.24 MB an epoch, against 57 of 7.3 MB
        once completed. Completed, a refill ends where a window ends. A globally
        shuffled epoch small against the lookahead is planned further too (its
        batches fill each other's holes once a refill holds a large share of its
        rows); at scale its blocks fall outside the pending reads and nothing is
        added. So a plan may run up to ``2 x ahead`` batches ahead, never beyond the
        room (``cache_bytes``)."""
        src = self._source
        for _ in range(src.options.ahead):
            if not self._pull():
                return
            with src._lock:
                if not self._interleaved(self._peek[0][1]):
                    return
            what, _ = self._plan_one(limit=self._index + 1)
            if what != "planned":
                return
            with src._lock:
                src._counts["completed_batches"] += 1

    def _due(self) -> bool:
        """Whether the pending reads must start now (the planner is about to wait): the
        oldest pending batch is within half the lookahead of the consumer. Until then
        reservations accumulate (a refill of about ``ahead / 2`` batches per start): a
        block-shuffle window's batches each need a scattered part of the same rows, and
        only their union is a few long runs; sequential batches merge across batches."""
        low = max(1, self._source.options.ahead // 2)
        return self._pending_from is not None and self._pending_from <= self._consumed + low

    def _plan_one(self, limit: int | None) -> tuple[str, Any]:
        """Plan the next batch (caller holds ``_walk``): pin its blocks and reserve room
        for the missing ones, unless its index is ``limit`` or more (None: the
        consumer's count plus ``ahead``). Returns ``(what, position)``: "planned" (or
        skipped: its gather already ran), "later" (at the limit), "full" (no room now),
        "ended" or "stopped"."""
        src = self._source
        if not self._pull():
            return ("ended", None) if self._ended else ("stopped", None)
        position, ids = self._peek[0]
        with src._lock:
            # Checked with the reservation in one hold of the lock: once plan() has
            # stopped this planner and cleared the pins, nothing more is pinned.
            if self._stop.is_set():
                return "stopped", None
            if position in self._released:
                self._released.discard(position)
            else:
                if limit is None:
                    limit = self._consumed + src.options.ahead
                if self._index >= limit:
                    return "later", position
                got = src._reserve(ids)
                if got is False:
                    return "full", position  # what is reserved is all there will be now
                if got is None:  # larger than the whole cache: on demand
                    # Nothing pinned; recorded so that its release finds it (else every
                    # consumed step stayed in _released).
                    self._planned[position] = _NO_BLOCKS
                else:
                    self._planned[position] = ids
                    src._planned_batch(self._index, ids)
                    if self._pending_from is None:
                        self._pending_from = self._index
                    for b in got:
                        self._pending.setdefault(b, self._index)
            self._peek.popleft()
            self._index += 1
            return "planned", position

    def catch_up(self, position: Any) -> None:
        """Called by the gather of ``position`` before it fetches: if the batch is not
        planned yet (the gathers are ahead of the thread), plan every batch up to it
        and the refill after it (``ahead / 2`` batches more, within the room), and start
        their reads together, merged; if it is planned but its reads have not started,
        start every pending read. Whatever still misses (no room) the gather fetches."""
        src = self._source
        with src._lock:
            ids = self._planned.get(position)
            if ids is not None and not any(
                b in src._reserved and b not in src._inflight for b in ids.tolist()
            ):
                return  # planned, its reads started (or done)
            if ids is None and self._ended and not self._peek:
                return  # not in the plan (the plan ended): fetched on demand
            self._waiters += 1
        # The walker holds _walk only while it pulls and reserves one batch.
        deadline = time.monotonic() + _WALK_WAIT_S
        try:
            while not self._walk.acquire(timeout=_STOP_CHECK_S):
                if self._stop.is_set() or time.monotonic() > deadline:
                    return
        finally:
            with src._lock:
                self._waiters -= 1
        try:
            # Bounded: the batch being gathered is at most the gathering threads ahead
            # of those released; a position that is not in the plan ends the search.
            for _ in range(2 * src.options.ahead + _MAX_GATHER_LEAD):
                with src._lock:
                    if position in self._planned or position in self._released:
                        break
                what, at = self._plan_one(limit=self._index + 1)
                if what != "planned":
                    break
                if at == position:
                    break
            with src._lock:
                found = position in self._planned
                limit = max(
                    self._consumed + src.options.ahead,
                    self._index + max(1, src.options.ahead // 2),
                )
            # The refill after it: the other batches of its block-shuffle window need
            # the same row runs, and only fetched together are they a few long reads.
            while found:
                what, _ = self._plan_one(limit=limit)
                if what != "planned":
                    break
            if found:
                self._complete()
            self._look()
            with src._lock:
                self.flush("catch_up")
        finally:
            self._walk.release()
            with src._lock:
                src._room.notify_all()  # the thread may walk again

    def _run(self) -> None:
        src = self._source
        try:
            while True:
                with src._lock:
                    # A gather waits to walk: it plans what it needs itself, at once.
                    while self._waiters and not self._stop.is_set():
                        src._room.wait(_STOP_CHECK_S)
                if self._stop.is_set():
                    return
                if not self._walk.acquire(timeout=_STOP_CHECK_S):
                    continue
                try:
                    what, _ = self._plan_one(limit=None)
                finally:
                    self._walk.release()
                if what == "planned":
                    continue
                if what in ("later", "full"):
                    # Completed even while a gather waits to walk (it waits for these
                    # few batches' planning, not for reads): its flush would not be.
                    with src._lock:
                        due = what == "full" or self._due()
                    if due and self._walk.acquire(timeout=_STOP_CHECK_S):
                        try:
                            if what == "later":
                                self._complete()
                            self._look()
                        finally:
                            self._walk.release()
                with src._lock:
                    if what in ("ended", "stopped"):
                        if what == "ended":
                            self.flush("ended")
                        return
                    if what == "full" or self._due():
                        self.flush("full" if what == "full" else "due")
                    self.idle = True
                    src._room.notify_all()
                    src._room.wait(_STOP_CHECK_S)
                    self.idle = False
        except BaseException as exc:  # noqa: BLE001 - gathers fetch on demand and raise it
            logger.warning("stream planner stopped: %s", exc)
        finally:
            with src._lock:  # stopped: what was reserved and never read frees its room
                self.idle = True
                pending, self._pending = self._pending, {}
                for b in pending:
                    if b in src._reserved and b not in src._inflight:
                        src._reserved.discard(b)
                        src._reserved_bytes -= int(src._block_bytes[b])
                src._room.notify_all()

    def stop(self) -> None:
        self._stop.set()
        with self._source._room:
            self._source._room.notify_all()
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():  # pragma: no cover - every wait above is bounded
            logger.warning("stream planner did not stop within 10 s")
