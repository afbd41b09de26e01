"""A ``torch.utils.data`` view of the cache, in the same global order as the JAX loader.

:class:`TorchBatches` is an ``IterableDataset`` of whole batches (this rank's share of
each global batch, exactly what :class:`hf_pipeline.loader.Loader` gives that rank).
Under a ``DataLoader`` with ``num_workers=K`` worker ``k`` assembles the steps
``start_step + k, start_step + k + K, ...``; the DataLoader reads workers round-robin, so
batches arrive in step order, each exactly once. Use ``batch_size=None`` (the dataset
already batches) — :func:`torch_loader` does that.

Workers inherit the memory maps when forked and reopen them by path when spawned
(:class:`SampleSource` pickles as its file lists).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from hf_pipeline.sampler import GlobalSampler, SamplerOptions

__all__ = [
    "LatentDataModule",
    "TorchBatches",
    "torch_loader",
]


def _to_tensor(a: np.ndarray) -> torch.Tensor:
    """A NumPy batch array as a tensor; bfloat16 (``ml_dtypes``) keeps its bits exactly."""
    a = np.ascontiguousarray(a)
    if a.dtype.name == "bfloat16":
        # torch.from_numpy does not know ml_dtypes: share the 16 bits, then view them.
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _default_rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class TorchBatches(tud.IterableDataset):
    """This rank's batches of one epoch as dicts of torch tensors.

    Args:
        source: a :class:`~hf_pipeline.mapped.SampleSource`.
        global_batch_size: samples per step over all ranks.
        seed, crop, shuffle, partition, block_size, window_blocks, drop_last: as for
            :class:`hf_pipeline.loader.Loader` (same order, same shares).
        process_index, process_count: this rank's share; default the
            ``torch.distributed`` rank and world size, else 0 of 1.
        epoch: the epoch to iterate (see :meth:`set_epoch`).
        start_step: first step of the epoch to produce (resume).
        latents_dtype: optional torch dtype (or name) for the latents, e.g. bfloat16.

    Yields:
        ``{"latents": (b, C, H, W), "embeddings": (b, D), "keys": (b,)}`` tensors (and
        ``"mask"`` with ``drop_last=False``), ``b = global_batch_size // process_count``.
        Latents come in the cache's storage dtype (``torch.bfloat16`` for a bfloat16
        cache) unless ``latents_dtype`` says otherwise.

    Raises:
        ValueError: invalid options or a global batch not divisible by the ranks.

    Thread-safety: each DataLoader worker iterates its own copy.
    """

    def __init__(
        self,
        source,
        *,
        global_batch_size: int,
        seed: int = 0,
        crop: str | int = "random",
        shuffle: str = "global",
        partition: str = "contiguous",
        block_size: int = 4096,
        window_blocks: int = 4,
        drop_last: bool = True,
        process_index: int | None = None,
        process_count: int | None = None,
        epoch: int = 0,
        start_step: int = 0,
        latents_dtype: torch.dtype | str | None = None,
    ):
        super().__init__()
        options = SamplerOptions(
            global_batch_size=global_batch_size,
            seed=seed,
            crop=crop,
            shuffle=shuffle,
            partition=partition,
            block_size=block_size,
            window_blocks=window_blocks,
            drop_last=drop_last,
        )
        if process_index is None or process_count is None:
            rank, world = _default_rank()
            process_index = rank if process_index is None else process_index
            process_count = world if process_count is None else process_count
        self.source = source
        self.sampler = GlobalSampler(source.num_rows, options, num_crops=source.num_crops)
        self._local = self.sampler.process_positions(process_index, process_count)
        self.process_index, self.process_count = int(process_index), int(process_count)
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.epoch = int(epoch)
        self.start_step = int(start_step)
        if isinstance(latents_dtype, str):
            latents_dtype = getattr(torch, latents_dtype)
        self.latents_dtype = latents_dtype

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Iterate ``epoch`` from ``start_step`` next time (call before each epoch)."""
        self.epoch, self.start_step = int(epoch), int(start_step)

    def __len__(self) -> int:
        """Batches left in the epoch for this rank (all workers together)."""
        return max(self.sampler.steps_per_epoch - self.start_step, 0)

    def steps(self) -> range:
        """The steps this worker produces (all remaining steps outside a worker)."""
        info = tud.get_worker_info()
        k, n = (0, 1) if info is None else (info.id, info.num_workers)
        return range(self.start_step + k, self.sampler.steps_per_epoch, n)

    def batch(self, step: int) -> dict[str, Any]:
        """This rank's batch ``step`` of the current epoch as torch tensors."""
        pb = self.sampler.batch_at(self.epoch, step, self._local)
        arrays = self.source.gather(pb.rows, pb.crops)
        out = {name: _to_tensor(a) for name, a in arrays.items()}
        if self.latents_dtype is not None:
            out["latents"] = out["latents"].to(self.latents_dtype)
        if not self.sampler.options.drop_last:
            out["mask"] = torch.from_numpy(pb.mask)
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for step in self.steps():
            yield self.batch(step)


def torch_loader(dataset: TorchBatches, *, num_workers: int = 2, pin_memory: bool = False, **kw):
    """A ``DataLoader`` over ``dataset`` that keeps its batches and order.

    Args:
        dataset: the :class:`TorchBatches`.
        num_workers: worker processes (each a disjoint set of steps).
        pin_memory: pin batches in page-locked memory (for CUDA transfers).
        **kw: other ``DataLoader`` arguments (``prefetch_factor``, ``persistent_workers``,
            ``multiprocessing_context``, ...).
    """
    if "batch_size" in kw and kw["batch_size"] is not None:
        raise ValueError("TorchBatches yields whole batches: leave batch_size unset")
    kw["batch_size"] = None
    return tud.DataLoader(dataset, num_workers=num_workers, pin_memory=pin_memory, **kw)


class LatentDataModule:
    """A thin Lightning-style DataModule over the shared cache (no lightning import).

    ``setup()`` finds or builds the cache exactly like every other entry point (one rank
    builds, the others wait); ``train_dataloader()`` serves :class:`TorchBatches` in the
    loader's global order. Lightning's ``Trainer`` accepts it as a DataModule by duck
    typing; without Lightning call the methods yourself. Call :meth:`set_epoch` at the
    start of each epoch (with ``start_step`` to resume inside one).

    Args:
        cfg: the :class:`~hf_pipeline.config.Config` (``loader`` section for the order).
        num_workers, pin_memory: ``DataLoader`` settings.
        **loader_kw: ``DataLoader`` arguments (e.g. ``multiprocessing_context``).
    """

    def __init__(self, cfg, *, num_workers: int = 2, pin_memory: bool = False, **loader_kw):
        self.cfg = cfg
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.loader_kw = loader_kw
        self.source = None
        self.dataset: TorchBatches | None = None

    def prepare_data(self) -> None:
        """Nothing to do: :meth:`setup` coordinates the build across ranks itself."""

    def setup(self, stage: str | None = None) -> None:
        from hf_pipeline.build import prepare_cache
        from hf_pipeline.cache import open_sample_source

        if self.source is not None:
            return
        built = prepare_cache(self.cfg, progress=False)
        self.source = open_sample_source(built.layout, built.fingerprint)
        lc = self.cfg.loader
        self.dataset = TorchBatches(
            self.source, global_batch_size=lc.global_batch_size, seed=lc.seed, crop=lc.crop,
            shuffle=lc.shuffle, partition=lc.partition, block_size=lc.block_size,
            window_blocks=lc.window_blocks, drop_last=lc.drop_last,
            latents_dtype=lc.latents_dtype or None,
        )

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self._require().set_epoch(epoch, start_step)

    def train_dataloader(self):
        return torch_loader(
            self._require(), num_workers=self.num_workers, pin_memory=self.pin_memory,
            **self.loader_kw,
        )

    def teardown(self, stage: str | None = None) -> None:
        if self.source is not None:
            self.source.close()
            self.source = self.dataset = None

    def _require(self) -> TorchBatches:
        if self.dataset is None:
            raise RuntimeError("call setup() first")
        return self.dataset
