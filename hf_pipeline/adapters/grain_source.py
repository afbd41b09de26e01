"""A Grain random-access data source over the memory-mapped cache.

:class:`GrainSource` serves one training sample per record (``__len__`` /
``__getitem__``, Grain's ``RandomAccessDataSource`` protocol) as NumPy arrays, gathered
by :class:`~hf_pipeline.read.mapped.SampleSource` from the Arrow files of a built cache. Grain
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
(the page cache is shared, so N workers do not hold N copies).

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
from typing import Any

import numpy as np

from hf_pipeline.cache.layout import STAGES, CacheLayout, open_sample_source, published_stage_dirs
from hf_pipeline.read.mapped import SampleSource
from hf_pipeline.read.records import SampleRecords, record_index
from hf_pipeline.read.sampler import CropMode

__all__ = ["GrainSource"]


class GrainSource:
    """Samples of a built cache as a Grain random-access data source.

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
        self._init(root, stage_dirs, fp, crop, seed)

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
        self._init(Path(layout.root), stage_dirs, str(fingerprint), crop, seed)
        return self

    @classmethod
    def from_build(cls, built, *, crop: CropMode | int = "random", seed: int = 0) -> GrainSource:
        """A source over the cache of a :class:`hf_pipeline.build.prepare.BuildResult`."""
        return cls.from_layout(built.layout, built.fingerprint, crop=crop, seed=seed)

    def _init(self, root: Path, stage_dirs, fingerprint: str, crop, seed: int) -> None:
        self._root = root
        self._stage_dirs = dict(stage_dirs)
        self._fingerprint = fingerprint
        self._crop, self._seed = crop, seed
        self._lock = threading.Lock()
        self._records: SampleRecords | None = None
        self._open()  # here, so that a bad cache or crop fails at construction

    # ------------------------------------------------------------------ opening

    def _open(self) -> SampleRecords:
        records = self._records
        if records is not None:
            return records
        with self._lock:  # Grain reads on several threads; map the files once
            if self._records is None:
                layout = CacheLayout(self._root, self._stage_dirs)
                source = open_sample_source(layout, self._fingerprint)
                try:
                    self._records = SampleRecords(source, crop=self._crop, seed=self._seed)
                except BaseException:
                    source.close()
                    raise
            return self._records

    def __getstate__(self) -> dict[str, Any]:
        # Paths and options only: each process maps the files itself on first read.
        return {
            "root": str(self._root),
            "stage_dirs": dict(self._stage_dirs),
            "fingerprint": self._fingerprint,
            "crop": self._crop,
            "seed": self._seed,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._root = Path(state["root"])
        self._stage_dirs = dict(state["stage_dirs"])
        self._fingerprint = state["fingerprint"]
        self._crop, self._seed = state["crop"], state["seed"]
        self._lock = threading.Lock()
        self._records = None

    # ------------------------------------------------------------------ properties

    @property
    def cache_dir(self) -> Path:
        """The cache folder."""
        return self._root

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
    def sample_source(self) -> SampleSource:
        """The memory-mapped :class:`SampleSource` of this process (opened on demand)."""
        return self._open().source

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        """Records: rows, or rows x crops with ``crop="all"``."""
        return len(self._open())

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """Records ``indices`` stacked into one batch by a single NumPy gather.

        Meant for ``MapDataset.range(len(src)).shuffle(...).batch(B).map(src.get_batch)``:
        Grain batches the indices, this assembles the batch without per-record Python.

        Returns:
            ``{"latents": (B, C, H, W), "embeddings": (B, D), "keys": (B,)}``.

        Raises:
            IndexError: an index outside ``[0, len(self))``.
            TypeError: indices that are not integers.
        """
        return self._open().get_batch(indices)

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
        """Unmap the files of this process (idempotent); a later read maps them again."""
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
