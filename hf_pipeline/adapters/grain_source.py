"""A Grain random-access data source over the memory-mapped cache, or a published one.

:class:`GrainSource` serves one training sample per record (``__len__`` /
``__getitem__``, Grain's ``RandomAccessDataSource`` protocol) as NumPy arrays, gathered
by :class:`~hf_pipeline.read.mapped.SampleSource` from the Arrow files of a built cache,
or (:meth:`GrainSource.from_stream`) by a :class:`~hf_pipeline.read.stream.StreamSource`
from a published cache read in place: ranged reads of the blocks holding the records,
each verified against its published checksum, held in a cache of at most
``StreamOptions.cache_bytes`` (least recently used blocks dropped first). Grain
owns the order (``MapDataset.shuffle``, ``IndexSampler``), the sharding, the batching
and the checkpoint; this module only turns a record index into a sample.

Records: ``{"latents": (C, H, W), "embeddings": (D,), "keys": int64 scalar}`` in the
cache dtypes, so Grain's default batching gives the same names and shapes as
:class:`hf_pipeline.read.loader.Loader` batches. Records are numbered as
:class:`hf_pipeline.read.records.SampleRecords` numbers them (``crop="all"``: one record per
crop; a random crop is a hash of ``(seed, row)``, the same every epoch), so a record's
value never depends on which worker, batch or resume reads it: Grain's checkpoints stay
exact.

Worker processes: Grain pickles the source into each worker (spawned processes). A
pickled GrainSource is its cache folder, stage folders, fingerprint and options — a few
hundred bytes, never the arrays — and each process maps the files itself on first read
(the page cache is shared, so N workers do not hold N copies). A streaming one pickles
as its URL, stream options, retry policy and fingerprint: each worker reads the
manifest once and holds its own block cache: ``worker_count`` (the number given to Grain's
``DataLoader``) splits ``cache_bytes`` among them, so the host holds at most
``cache_bytes`` together (without it, N workers: up to N x ``cache_bytes``).

Speed: in grain 0.2.x both ``MapDataset.batch`` and ``DataLoader`` fetch records one by
one (``_getitems``, the batched read that :meth:`GrainSource._getitems` implements, is
behind a disabled experiment in ``BatchMapDataset``), then ``np.stack`` them: per-record
Python. :meth:`GrainSource.get_batch` is the batched path: batch *indices* in Grain, then
one NumPy gather per batch (README "Grain", ``benchmarks/bench_grain.py``).

Thread-safety: reads are safe from several threads (Grain's read threads); the lazy
open is locked. ``close`` must not race with reads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hf_pipeline.cache.layout import STAGES, CacheLayout, open_sample_source, published_stage_dirs
from hf_pipeline.read.mapped import SampleSource
from hf_pipeline.read.records import SampleRecords, record_index
from hf_pipeline.read.sampler import CropMode

if TYPE_CHECKING:  # pragma: no cover
    from hf_pipeline.read.stream import StreamOptions, StreamSource
    from hf_pipeline.stores.retry import RetryPolicy

__all__ = ["GrainSource"]


class GrainSource:
    """Samples of a built cache as a Grain random-access data source (of a published
    cache read in place: :meth:`from_stream`).

    Args:
        cache_dir: a built cache folder (``BuildResult.cache_dir``:
            ``<cache_root>/<name>-<fingerprint>``). Its stage markers must be valid.
        crop: ``"random"`` (one crop per row, a hash of ``(seed, row)``), a fixed crop
            index, or ``"all"`` (each crop of each row is a record), as ``loader.crop``.
        seed: seed of the random crops (not of the order: Grain shuffles).
        fingerprint: the expected cache identity; default the one its markers state.

    Raises:
        CacheFormatError: not a complete cache (the message names the marker or file),
            or its files do not hold the expected columns.
        ValueError: invalid ``crop`` or ``seed``, or a crop index ``>= num_crops``.

    Thread-safety: reads may run on several threads at once; ``close`` may not.
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike,
        *,
        crop: CropMode | int = "random",
        seed: int = 0,
        fingerprint: str | None = None,
    ):
        root = Path(cache_dir)
        stage_dirs, fp = published_stage_dirs(root, fingerprint)
        self._init(root, stage_dirs, None, fp, crop, seed)

    @classmethod
    def from_layout(
        cls,
        layout: CacheLayout,
        fingerprint: str,
        *,
        crop: CropMode | int = "random",
        seed: int = 0,
    ) -> GrainSource:
        """A source over ``layout`` (opened, in each process, by :func:`open_sample_source`,
        which checks the markers and every listed file's size and first/last MiB).

        The stage folders are resolved once here, so every worker maps the same files.
        """
        self = cls.__new__(cls)
        stage_dirs = {stage: layout.stage_dir(stage).name for stage in STAGES}
        self._init(Path(layout.root), stage_dirs, None, str(fingerprint), crop, seed)
        return self

    @classmethod
    def from_build(cls, built, *, crop: CropMode | int = "random", seed: int = 0) -> GrainSource:
        """A source over the cache of a :class:`hf_pipeline.build.prepare.BuildResult`."""
        return cls.from_layout(built.layout, built.fingerprint, crop=crop, seed=seed)

    @classmethod
    def from_stream(
        cls,
        url: str,
        options: StreamOptions | None = None,
        *,
        policy: RetryPolicy | None = None,
        crop: CropMode | int = "random",
        seed: int = 0,
        fingerprint: str | None = None,
        worker_count: int = 0,
    ) -> GrainSource:
        """A source over the published cache at ``url`` (``gs://...`` or
        ``hf://datasets/...``, the folder ``--publish`` wrote), read in place by a
        :class:`~hf_pipeline.read.stream.StreamSource`: no local copy, no shared
        filesystem; the same records as the local cache's source, bit for bit.

        Args:
            url: the published cache folder (``gs://bucket/caches/demo-<fingerprint>``).
            options: the stream's options; ``cache_bytes`` bounds the verified blocks
                each process keeps for later records (least recently used dropped
                first; 0: every read fetches its blocks).
            policy: retries and per-read timeout (default: the data config's defaults).
            crop, seed: as the constructor's.
            fingerprint: the identity expected (None: the one the folder name states).
            worker_count: the ``worker_count`` given to Grain's ``DataLoader``: each
                worker process keeps at most ``cache_bytes // worker_count`` (0: reads in
                this process only, which keeps ``cache_bytes``).

        Raises:
            SourceError, StoreUnreachableError, CacheFormatError: as
                :class:`~hf_pipeline.read.stream.StreamSource` (the manifest is read
                here, so a bad URL or cache fails at construction).
            ValueError: invalid ``crop``, ``seed`` or ``worker_count``.
        """
        from hf_pipeline.read.stream import StreamSource

        workers = _worker_count(worker_count)
        source = StreamSource(url, options, policy=policy, fingerprint=fingerprint)
        return cls._over_stream(source, crop, seed, workers)

    @classmethod
    def from_stream_config(
        cls, loader_config, data_config=None, *, worker_count: int = 0
    ) -> GrainSource:
        """:meth:`from_stream` of ``loader.stream_from`` with the ``loader.stream_*``
        options, ``loader.crop`` and ``loader.seed``, and the ``data`` section's retries
        and per-read timeout (their defaults without ``data_config``), as
        :func:`~hf_pipeline.read.stream.open_stream` reads them; ``worker_count`` as
        :meth:`from_stream`'s.

        Raises:
            ConfigError: ``loader.stream_from`` is empty.
            ValueError: ``worker_count`` is negative.
            SourceError, StoreUnreachableError, CacheFormatError: as :meth:`from_stream`.
        """
        from hf_pipeline.read.stream import open_stream

        workers = _worker_count(worker_count)
        order = loader_config.sampler_options()  # crop as the loader reads it ("1" -> 1)
        # Grain's own worker processes each reopen the stream: never stream workers here.
        source = open_stream(loader_config, data_config, workers=1)
        return cls._over_stream(source, order.crop, order.seed, workers)

    @classmethod
    def _over_stream(cls, source: StreamSource, crop, seed: int, workers: int) -> GrainSource:
        """A source over ``source`` (opened: owned from here); workers reopen its URL
        with its options (their share of the cache limit), retry policy and fingerprint."""
        self = cls.__new__(cls)
        try:
            options = source.options
            if workers > 1:  # what a pickled copy (a Grain worker) reopens with
                options = options.shared_by(workers)
            stream = (source.url, options, source.policy)
            self._init(None, {}, stream, source.fingerprint, crop, seed, opened=source)
        except BaseException:
            source.close()
            raise
        return self

    def _init(
        self, root: Path | None, stage_dirs, stream, fingerprint, crop, seed: int, opened=None
    ) -> None:
        self._root = root
        self._stage_dirs = dict(stage_dirs)
        # (url, StreamOptions, RetryPolicy) or None (local): what a worker reopens, the
        # identity and retries pinned by the first open.
        self._stream = stream
        self._fingerprint = fingerprint
        self._crop, self._seed = crop, seed
        self._lock = threading.Lock()
        self._records: SampleRecords | None = None
        self._open(opened)  # here, so that a bad cache or crop fails at construction

    # ------------------------------------------------------------------ opening

    def _open(self, opened: SampleSource | StreamSource | None = None) -> SampleRecords:
        records = self._records
        if records is not None:
            return records
        with self._lock:  # Grain reads on several threads; map the files once
            if self._records is None:
                source = opened if opened is not None else self._open_source()
                try:
                    self._records = SampleRecords(source, crop=self._crop, seed=self._seed)
                except BaseException:
                    source.close()
                    raise
            return self._records

    def _open_source(self) -> SampleSource | StreamSource:
        if self._stream is None:
            assert self._root is not None  # a local source always has its folder
            return open_sample_source(CacheLayout(self._root, self._stage_dirs), self._fingerprint)
        from hf_pipeline.read.stream import StreamSource

        url, options, policy = self._stream
        return StreamSource(url, options, policy=policy, fingerprint=self._fingerprint)

    def __getstate__(self) -> dict[str, Any]:
        # Paths (or the stream's URL) and options only: each process maps the files, or
        # reads the manifest and fetches its blocks, itself on first read.
        return {
            "root": None if self._root is None else str(self._root),
            "stage_dirs": dict(self._stage_dirs),
            "stream": self._stream,
            "fingerprint": self._fingerprint,
            "crop": self._crop,
            "seed": self._seed,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._root = None if state["root"] is None else Path(state["root"])
        self._stage_dirs = dict(state["stage_dirs"])
        self._stream = state.get("stream")
        self._fingerprint = state["fingerprint"]
        self._crop, self._seed = state["crop"], state["seed"]
        self._lock = threading.Lock()
        self._records = None

    # ------------------------------------------------------------------ properties

    @property
    def cache_dir(self) -> Path | None:
        """The local cache folder (None when streaming: :attr:`stream_from`)."""
        return self._root

    @property
    def stream_from(self) -> str:
        """The published cache folder read in place ("" for a local cache)."""
        return "" if self._stream is None else self._stream[0]

    @property
    def fingerprint(self) -> str:
        """The cache identity."""
        return self._fingerprint

    @property
    def crop(self) -> CropMode | int:
        """``"random"``, ``"all"`` or the fixed crop index."""
        return self._crop

    @property
    def seed(self) -> int:
        """Seed of the random crops."""
        return self._seed

    @property
    def sample_source(self) -> SampleSource | StreamSource:
        """This process's source (opened on demand): the memory-mapped
        :class:`SampleSource`, or the :class:`~hf_pipeline.read.stream.StreamSource`
        when streaming (its ``stats()`` and ``cache_state()`` say what it fetched and
        holds)."""
        return self._open().source

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        """Records: rows, or rows x crops with ``crop="all"``."""
        return len(self._open())

    def get_batch(
        self, indices: Sequence[int] | np.ndarray, epoch: int = 0
    ) -> dict[str, np.ndarray]:
        """Records ``indices`` stacked into one batch by a single NumPy gather.

        Meant for ``MapDataset.range(len(src)).shuffle(...).batch(B).map(src.get_batch)``:
        Grain batches the indices, this assembles the batch without per-record Python.

        Args:
            indices: record indices.
            epoch: whose random crops to draw (``crop="random"``): the records are epoch
                0's, the same every epoch, unless a reader that knows the epoch (one
                record per global batch of :class:`~hf_pipeline.read.sampler.GlobalSampler`)
                passes it; then the batch is the Loader's, latents included.

        Returns:
            ``{"latents": (B, C, H, W), "embeddings": (B, D), "keys": (B,)}``.

        Raises:
            IndexError: an index outside ``[0, len(self))``.
            TypeError: indices or an epoch that are not integers.
            ValueError: ``epoch < 0``.
        """
        return self._open().get_batch(indices, epoch)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Record ``index``: ``{"latents": (C, H, W), "embeddings": (D,), "keys": int64}``.

        Raises:
            IndexError: ``index`` outside ``[0, len(self))``.
            TypeError: ``index`` is not an integer (a float, a string, a slice or a list).
        """
        batch = self.get_batch([record_index(index)])
        return {
            "latents": batch["latents"][0],
            "embeddings": batch["embeddings"][0],
            "keys": batch["keys"][0],
        }

    def _getitems(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Grain's batched read (``SupportsBatchedReadRandomAccessDataSource``): one gather."""
        batch = self.get_batch(indices)
        return [
            {"latents": lat, "embeddings": emb, "keys": key}
            for lat, emb, key in zip(
                batch["latents"], batch["embeddings"], batch["keys"], strict=True
            )
        ]

    def close(self) -> None:
        """Unmap the files of this process, or drop the stream's blocks and threads
        (idempotent); a later read opens them again."""
        with self._lock:
            if self._records is not None:
                self._records.source.close()
            self._records = None

    def __enter__(self) -> GrainSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        # Grain's DataLoader compares repr(source) when it restores a checkpoint: name
        # the identity (fingerprint) and options, not the mount point, so a checkpoint
        # restores on a host that mounts the same cache elsewhere.
        return (
            f"GrainSource(fingerprint={self._fingerprint!r}, crop={self._crop!r}, "
            f"seed={self._seed})"
        )


def _worker_count(worker_count: int) -> int:
    """``worker_count`` checked: a Grain ``DataLoader``'s worker count (0: none)."""
    if isinstance(worker_count, bool) or not isinstance(worker_count, int) or worker_count < 0:
        raise ValueError(f"worker_count must be an integer >= 0, got {worker_count!r}")
    return worker_count
