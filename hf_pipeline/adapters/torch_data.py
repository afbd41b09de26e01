"""A ``torch.utils.data`` view of the cache, in the same global order as the JAX loader.

:class:`TorchBatches` is an ``IterableDataset`` of whole batches (this rank's share of
each global batch, exactly what :class:`hf_pipeline.read.loader.Loader` gives that rank).
Under a ``DataLoader`` with ``num_workers=K`` worker ``k`` assembles the steps
``start_step + k, start_step + k + K, ...``; the DataLoader reads workers round-robin, so
batches arrive in step order, each exactly once. Use ``batch_size=None`` (the dataset
already batches) — :func:`torch_loader` does that; a ``DataLoader`` with a ``batch_size``
is refused at its first batch (it would stack several batches into one), and a
persistent worker at its second epoch (it would repeat the first).

The rank's share of each global batch is read when an iteration starts (an initialised
``torch.distributed`` group, else the launcher's variables), never frozen when the
dataset is made: a DataModule set up before ``Trainer.fit`` still splits every global
batch over the DDP ranks.

:class:`TorchSamples` is the map-style view (``len``, ``ds[i]`` -> one sample) over the
same memory map, for ``DataLoader(ds, batch_size=B)`` with any sampler
(``DistributedSampler``).

The order is the Loader's: a :class:`~hf_pipeline.read.sampler.SamplerOptions` (a
:class:`~hf_pipeline.read.loader.LoaderOptions`' ``order``, or its fields as keywords), so
rank ``p`` gets the same samples from either.

Workers inherit the memory maps when forked and reopen them by path when spawned
(:class:`SampleSource` pickles as its file lists).

Epochs: each iteration reads ``(epoch, start_step)`` when it starts (a DataLoader copies
the dataset into its workers then). The DataLoader of :func:`torch_loader` exposes
``sampler.set_epoch`` — where Lightning's fit loop (and ``DistributedSampler`` habits)
set the epoch — and forwards it to the dataset.

:class:`LatentDataModule` is a ``lightning.LightningDataModule`` when Lightning is
installed (imported on first use of the name, not with this module), else a plain class
with the same methods. Its ``state_dict`` is the position of the next batch the training
step gets, so ``Trainer.fit(..., ckpt_path=...)`` resumes at exactly that batch.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from hf_pipeline.read.loader import LoaderOptions
from hf_pipeline.read.records import SampleRecords, record_index
from hf_pipeline.read.sampler import (
    ORDER_VERSION,
    CropMode,
    GlobalSampler,
    SamplerOptions,
    check_order_version,
    sampler_options,
)

__all__ = [
    "STATE_VERSION",
    "LatentDataModule",  # noqa: F822 - made on first use by the module __getattr__
    "TorchBatch",
    "TorchBatches",
    "TorchSamples",
    "torch_loader",
]


def _to_tensor(array: np.ndarray) -> torch.Tensor:
    """A NumPy batch array as a tensor; bfloat16 (``ml_dtypes``) keeps its bits exactly."""
    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":
        # torch.from_numpy does not know ml_dtypes: share the 16 bits, then view them.
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _latents_dtype(latents_dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A floating torch dtype (or None) from a dtype or its name.

    Raises:
        ValueError: not a floating dtype.
    """
    if isinstance(latents_dtype, str):
        latents_dtype = getattr(torch, latents_dtype, None) or latents_dtype
    if latents_dtype is not None and not (
        isinstance(latents_dtype, torch.dtype) and latents_dtype.is_floating_point
    ):
        raise ValueError(
            "latents_dtype must be a floating torch dtype (or its name: bfloat16, "
            f"float16, float32), got {latents_dtype!r}"
        )
    return latents_dtype


def _process_group() -> tuple[int, int] | None:
    """``(rank, world size)`` of an initialised ``torch.distributed`` group, else None."""
    import torch.distributed as torch_dist  # not the package ``dist``

    if torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist.get_rank(), torch_dist.get_world_size()
    return None


def _job_share() -> tuple[int, int]:
    """This process's ``(rank, world size)`` now: the process group's when one is
    initialised (Lightning's DDP, ``init_process_group``), else the launcher's variables
    (:func:`dist.env.detect`: torchrun, SLURM, ...), else 0 of 1."""
    found = _process_group()
    if found is not None:
        return found
    from dist.env import detect

    process = detect()
    return process.rank, process.world_size


def _raising(error: Exception) -> Iterator[Any]:
    raise error
    yield  # a generator: raises at its first next()


class TorchBatch(dict):
    """One batch of :class:`TorchBatches`: a ``dict`` of tensors, already batched.

    Its own type only so that torch's ``default_collate`` (a ``DataLoader`` with a
    ``batch_size``, which would stack several batches into one) refuses it in one line.
    """


def _refuse_collate(batch, *, collate_fn_map=None):
    raise TypeError(
        "TorchBatches yields whole batches: use DataLoader(dataset, batch_size=None) or "
        "hf_pipeline.torch_loader(dataset); for per-sample batching with "
        "batch_size=B use TorchSamples"
    )


# torch's documented extension point of default_collate: a function per element type.
tud._utils.collate.default_collate_fn_map[TorchBatch] = _refuse_collate


class TorchBatches(tud.IterableDataset):
    """This rank's batches of one epoch as dicts of torch tensors.

    Args:
        source: a :class:`~hf_pipeline.read.mapped.SampleSource`.
        order: the :class:`~hf_pipeline.read.sampler.SamplerOptions` of the global order,
            as a :class:`hf_pipeline.read.loader.Loader`'s ``options.order`` (same order,
            same shares).
        process_index, process_count: this rank's share. Default: the job's, read each
            time an iteration starts (never frozen at construction): an initialised
            ``torch.distributed`` group's rank and world size (Lightning's DDP), else
            the launcher's variables (``dist.env.detect``), else 0 of 1. DataLoader
            workers get the share of the process that starts them.
        epoch: the epoch to iterate (see :meth:`set_epoch`).
        start_step: first step of the epoch to produce (resume).
        latents_dtype: optional torch dtype (or name) for the latents, e.g. bfloat16.
        **order_fields: fields of the order as keywords, instead of ``order`` or
            replacing some of its fields (``global_batch_size``, ``seed``, ``crop``,
            ``shuffle``, ``partition``, ``block_size``, ``window_blocks``,
            ``drop_last``): ``TorchBatches(source, global_batch_size=64, seed=0)``.

    Yields:
        ``{"latents": (b, C, H, W), "embeddings": (b, D), "keys": (b,)}`` tensors (and
        ``"mask"`` with ``drop_last=False``), ``b = global_batch_size // process_count``.
        Latents come in the cache's storage dtype (``torch.bfloat16`` for a bfloat16
        cache) unless ``latents_dtype`` says otherwise.

    Raises:
        TypeError: an unknown keyword, or neither ``order`` nor ``global_batch_size``.
        ValueError: invalid options or a global batch not divisible by the ranks (with
            the job's share: when an iteration starts).
        ConfigError: an epoch would have no batch (no samples, or a ``global_batch_size``
            larger than the data with ``drop_last``), as the ``Loader`` refuses it.
        TypeError: (from the DataLoader) a ``batch_size`` other than None: each item is
            already a batch.
        RuntimeError: a DataLoader worker iterates its copy twice (``persistent_workers=True``
            would repeat the first epoch forever).

    Thread-safety: each DataLoader worker iterates its own copy.
    """

    def __init__(
        self,
        source,
        order: SamplerOptions | None = None,
        *,
        process_index: int | None = None,
        process_count: int | None = None,
        epoch: int = 0,
        start_step: int = 0,
        latents_dtype: torch.dtype | str | None = None,
        **order_fields,
    ):
        super().__init__()
        options = sampler_options(order, caller="TorchBatches", **order_fields)
        self.source = source
        self.sampler = GlobalSampler(source.num_rows, options, num_crops=source.num_crops)
        self.sampler.require_batches()
        self._given = (
            None if process_index is None else int(process_index),
            None if process_count is None else int(process_count),
        )
        self._shared: tuple[int, int] | None = None  # the parent's share, in a spawned worker
        self._iterated_in_worker = False
        if process_index is not None and process_count is not None:
            self.sampler.process_positions(
                int(process_index), int(process_count)
            )  # a bad share fails here
        self.set_epoch(epoch, start_step)
        self.latents_dtype = _latents_dtype(latents_dtype)

    def share(self) -> tuple[int, int]:
        """``(process_index, process_count)`` an iteration starting now takes.

        Raises:
            ValueError: the global batch is not divisible by the process count.
        """
        index, count = self._given
        if index is None or count is None:
            in_worker = tud.get_worker_info() is not None
            rank, world = self._shared if in_worker and self._shared else _job_share()
            index = rank if index is None else index
            count = world if count is None else count
        self.sampler.process_positions(index, count)  # checks the split
        return index, count

    @property
    def process_index(self) -> int:
        """This process's index among :attr:`process_count` (see :meth:`share`)."""
        return self.share()[0]

    @property
    def process_count(self) -> int:
        """The number of processes sharing each global batch (see :meth:`share`)."""
        return self.share()[1]

    @property
    def _local(self) -> np.ndarray:
        return self.sampler.process_positions(*self.share())

    def __getstate__(self) -> dict[str, Any]:
        # A spawned (or forkserver) DataLoader worker has no process group: it gets the
        # share of the process that pickles it, which starts the workers.
        state = dict(self.__dict__)
        if None in self._given:
            state["_shared"] = self.share()
        return state

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Iterate ``epoch`` from ``start_step`` next time (call before each epoch).

        Raises:
            ValueError: a negative epoch or a step outside ``[0, steps_per_epoch]``.
        """
        steps = self.sampler.steps_per_epoch
        if int(epoch) < 0 or not 0 <= int(start_step) <= steps:
            raise ValueError(
                f"position must be epoch >= 0 and step in [0, {steps}], "
                f"got epoch={epoch}, step={start_step}"
            )
        self.epoch, self.start_step = int(epoch), int(start_step)

    def __len__(self) -> int:
        """Batches left in the epoch for this rank (all workers together)."""
        return max(self.sampler.steps_per_epoch - self.start_step, 0)

    def steps(self) -> range:
        """The steps this worker produces (all remaining steps outside a worker)."""
        info = tud.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return range(self.start_step + worker, self.sampler.steps_per_epoch, workers)

    def batch(
        self, step: int, epoch: int | None = None, local: np.ndarray | None = None
    ) -> TorchBatch:
        """This rank's batch ``step`` of ``epoch`` (default the current one) as tensors.

        ``local``: the positions of the global batch to take (default this rank's share).
        """
        epoch = self.epoch if epoch is None else epoch
        local = self._local if local is None else local
        share = self.sampler.batch_at(epoch, step, local)
        arrays = self.source.gather(share.rows, share.crops)
        out = TorchBatch((name, _to_tensor(array)) for name, array in arrays.items())
        if self.latents_dtype is not None:
            out["latents"] = out["latents"].to(self.latents_dtype)
        if not self.sampler.options.drop_last:
            out["mask"] = torch.from_numpy(share.mask)
        return out

    def __iter__(self) -> Iterator[TorchBatch]:
        info = tud.get_worker_info()
        if info is not None:
            # A worker's copy is made when the DataLoader's iteration starts; a second
            # iteration of the same copy is a persistent worker, which set_epoch never
            # reaches: it would repeat the first epoch's batches forever.
            if self._iterated_in_worker:
                # Raised at the first next(), not here: torch forwards errors of a fetch to
                # the DataLoader, while one from iter() kills the worker without a word.
                return _raising(
                    RuntimeError(
                        "TorchBatches was iterated twice by one DataLoader worker "
                        "(persistent_workers=True): set_epoch never reaches persistent "
                        "workers and every epoch would repeat the first; use "
                        "persistent_workers=False"
                    )
                )
            self._iterated_in_worker = True
            # A streamed source: this worker's share of the host's cache limit (the
            # workers hold stream_cache_bytes together, as the JAX loader's do), opened
            # in this process (a forked copy's reading threads are the parent's).
            share = getattr(self.source, "for_worker_processes", None)
            if share is not None:
                self.source = share(info.num_workers)
        # Epoch, steps and share are read now, not at the first next(): a set_epoch that
        # comes between iter() and the first batch (Lightning calls it after its iter()
        # when it resumes) must not move an iteration that has begun.
        epoch, steps, local = self.epoch, self.steps(), self._local
        return (self.batch(step, epoch, local) for step in steps)


class TorchSamples(tud.Dataset):
    """The cache's samples as a map-style dataset: ``len(ds)``, ``ds[i]`` -> one sample.

    For the usual torch recipe — ``DataLoader(ds, batch_size=B, shuffle=True)``, or a
    ``DistributedSampler`` per rank — over the same memory map as :class:`TorchBatches`.
    Records are numbered as :class:`hf_pipeline.read.records.SampleRecords` numbers them
    (``crop="all"``: one record per crop; a random crop is a hash of ``(seed, row)``,
    the same every epoch). The order, the sharding and the epochs are the sampler's:
    not the loader's global order (use :class:`TorchBatches` for that).

    A ``DataLoader`` fetches a batch's samples with one gather (``__getitems__``), then
    stacks them (``default_collate``). Workers get the source by pickling (its file
    lists) or by fork.

    Args:
        source: a :class:`~hf_pipeline.read.mapped.SampleSource` (not closed by this object).
        crop: ``"random"``, a fixed crop index, or ``"all"``, as ``loader.crop``.
        seed: seed of the random crops.
        latents_dtype: optional torch dtype (or name) for the latents, e.g. float32.

    Returns (``ds[i]``):
        ``{"latents": (C, H, W), "embeddings": (D,), "keys": int64 scalar}`` tensors;
        latents in the cache's storage dtype (``torch.bfloat16`` for a bfloat16 cache)
        unless ``latents_dtype`` says otherwise.

    Raises:
        ValueError: invalid ``crop``, ``seed`` or ``latents_dtype``.
        IndexError, TypeError: (``ds[i]``) an index outside ``[0, len(ds))`` or not an int.

    Thread-safety: reads are safe from several threads.
    """

    def __init__(
        self,
        source,
        *,
        crop: CropMode | int = "random",
        seed: int = 0,
        latents_dtype: torch.dtype | str | None = None,
    ):
        super().__init__()
        self.records = SampleRecords(source, crop=crop, seed=seed)
        self.latents_dtype = _latents_dtype(latents_dtype)
        self._worker_shared = False  # a DataLoader worker took its share of the source

    def __len__(self) -> int:
        return len(self.records)

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """Samples ``indices`` from one gather (what a DataLoader's fetcher calls)."""
        info = tud.get_worker_info()
        if info is not None and not self._worker_shared:
            # A streamed source: this worker's share of the cache limit, as TorchBatches.
            self._worker_shared = True
            share = getattr(self.records.source, "for_worker_processes", None)
            if share is not None:
                self.records.source = share(info.num_workers)
        batch = self.records.get_batch(indices)
        latents = _to_tensor(batch["latents"])
        if self.latents_dtype is not None:
            latents = latents.to(self.latents_dtype)
        embeddings, keys = _to_tensor(batch["embeddings"]), _to_tensor(batch["keys"])
        return [
            {"latents": latents[j], "embeddings": embeddings[j], "keys": keys[j]}
            for j in range(len(indices))
        ]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([record_index(index)])[0]


class _EpochSampler(tud.Sampler):
    """What a DataLoader over :class:`TorchBatches` has as ``sampler``.

    Iterates like torch's placeholder sampler of an ``IterableDataset`` (``None``
    forever: the dataset picks its own samples) and forwards ``set_epoch`` — which
    Lightning's fit loop calls on ``dataloader.sampler`` before every epoch
    (``lightning.fabric.utilities.data._set_sampler_epoch``) — to ``on_epoch``.
    """

    def __init__(self, on_epoch: Callable[[int], None]):
        super().__init__()
        self._on_epoch = on_epoch

    def __iter__(self) -> Iterator[None]:
        return itertools.repeat(None)

    def set_epoch(self, epoch: int) -> None:
        self._on_epoch(int(epoch))


class _BatchLoader(tud.DataLoader):
    """A ``DataLoader`` over :class:`TorchBatches` whose ``sampler.set_epoch`` reaches it.

    torch refuses a custom sampler for an iterable dataset and installs its own
    placeholder in ``__init__``; this class's ``sampler`` property keeps an
    :class:`_EpochSampler` in its place (same iteration, plus ``set_epoch``).

    Args:
        dataset: the :class:`TorchBatches`.
        on_epoch: called with the epoch by ``sampler.set_epoch``; default
            ``dataset.set_epoch``.
        **kw: ``DataLoader`` arguments (``batch_size`` stays ``None``).
    """

    dataset: TorchBatches  # what __init__ is given (DataLoader types it Dataset)

    def __init__(
        self, dataset: TorchBatches, *, on_epoch: Callable[[int], None] | None = None, **kw
    ):
        self._on_epoch = on_epoch or dataset.set_epoch
        super().__init__(dataset, batch_size=None, **kw)

    @property
    def sampler(self) -> _EpochSampler:
        return self._epoch_sampler

    @sampler.setter
    def sampler(self, placeholder: tud.Sampler[Any] | Iterable[Any]) -> None:
        # DataLoader.__init__ assigns torch's placeholder (it yields None forever, as
        # ours does); assigning it later is refused by DataLoader.__setattr__.
        self._epoch_sampler = _EpochSampler(self._on_epoch)


class _ModuleLoader(_BatchLoader):
    """The DataLoader of :meth:`LatentDataModule.train_dataloader`.

    Reports the consumer's position — the ``(epoch, step)`` of the next batch it will
    hand out — to the DataModule whenever an iteration starts and whenever it hands a
    batch out (so batches prefetched by workers never count). ``len()`` is the whole
    epoch: Lightning numbers a resumed epoch's batches from where it stopped. Its
    ``state_dict`` is the DataModule's: Lightning treats only loaders with one as
    resumable (else it warns on a mid-epoch resume), and restores both with the same
    position.
    """

    def __init__(self, module: _LatentDataModule, **kw):
        self._module = module
        super().__init__(module._require(), on_epoch=module._start_epoch, **kw)

    def __len__(self) -> int:
        return self.dataset.sampler.steps_per_epoch

    def __iter__(self):
        epoch, step = self.dataset.epoch, self.dataset.start_step  # what the workers get
        batches = super().__iter__()
        self._module._handed_out(epoch, step)
        return self._track(batches, epoch, step)

    def _track(self, batches, epoch: int, step: int):
        for batch in batches:
            step += 1
            self._module._handed_out(epoch, step)  # before the consumer's step on it
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self._module.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._module.load_state_dict(state)


def _check_loader_kw(kw: dict) -> None:
    if kw.get("batch_size") is not None:
        raise ValueError("TorchBatches yields whole batches: leave batch_size unset")
    if kw.get("persistent_workers"):
        raise ValueError(
            "persistent_workers must be False: persistent workers keep the dataset copy of "
            "the first epoch, so set_epoch (a new order per epoch, a resume position) "
            "would never reach them"
        )


def torch_loader(dataset: TorchBatches, *, num_workers: int = 2, pin_memory: bool = False, **kw):
    """A ``DataLoader`` over ``dataset`` that keeps its batches and order.

    ``loader.sampler.set_epoch(e)`` calls ``dataset.set_epoch(e)`` (Lightning calls it
    before every epoch).

    Args:
        dataset: the :class:`TorchBatches`.
        num_workers: worker processes (each a disjoint set of steps).
        pin_memory: pin batches in page-locked memory (for CUDA transfers).
        **kw: other ``DataLoader`` arguments (``prefetch_factor``,
            ``multiprocessing_context``, ...).

    Raises:
        ValueError: ``batch_size`` given, or ``persistent_workers=True`` (workers that
            outlive an epoch never see the next epoch's ``set_epoch``).
    """
    _check_loader_kw(kw)
    kw.pop("batch_size", None)
    return _BatchLoader(dataset, num_workers=num_workers, pin_memory=pin_memory, **kw)


#: Version of :meth:`LatentDataModule.state_dict` (same fields as ``Loader.state_dict``).
STATE_VERSION = 1
# Fields of the state that may differ on resume: how a global batch is split over ranks.
_SPLIT_FIELDS = ("partition",)


class _LatentDataModule:
    """The methods of :class:`LatentDataModule`, with or without Lightning as a base."""

    def __init__(self, cfg, *, num_workers: int = 2, pin_memory: bool = False, **loader_kw):
        super().__init__()  # LightningDataModule.__init__ when it is a base
        _check_loader_kw(loader_kw)
        self.cfg = cfg
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.loader_kw = loader_kw
        self.source: Any = None
        self.dataset: TorchBatches | None = None
        self._position = (0, 0)  # (epoch, step) of the next batch the consumer gets
        self._identity: dict[str, Any] | None = None  # the order's identity, once set up
        self._steps_per_epoch = 0  # of the cache once set up (kept after teardown)
        self._pending_state: dict[str, Any] | None = None

    def prepare_data(self) -> None:
        """Nothing to do: :meth:`setup` coordinates the build across ranks itself."""

    def setup(self, stage: str | None = None) -> None:
        """Find or build the cache (one rank builds, the others wait) and map it.

        May be called before ``Trainer.fit`` (to size a model from ``dm.source``): the
        rank's share of each global batch is read when an iteration starts, never here,
        so a later DDP fit still splits every global batch over its ranks.
        """
        from hf_pipeline.build.prepare import prepare_cache
        from hf_pipeline.cache.layout import open_sample_source

        if self.source is not None:
            return
        if self.cfg.loader.stream_from:  # read the published cache in place: no build
            from hf_pipeline.read.stream import open_stream

            # The DataLoader's workers are this adapter's processes (each reopens the
            # stream): loader.stream_workers is the JAX loader's.
            self.source = open_stream(self.cfg.loader, self.cfg.data, workers=1)
            fingerprint = self.source.fingerprint
        else:
            built = prepare_cache(self.cfg, process=self._process(), progress=False)
            self.source = open_sample_source(built.layout, built.fingerprint)
            fingerprint = built.fingerprint
        # The Loader's options: the same order and output dtype as Loader.from_config.
        options = LoaderOptions.from_config(self.cfg.loader)
        try:
            self.dataset = TorchBatches(
                self.source, options.order, latents_dtype=options.latents_dtype
            )
        except BaseException:  # e.g. an epoch of no batch: leave nothing mapped
            self.source.close()
            self.source = None
            raise
        self._identity = {
            "order_version": ORDER_VERSION,
            **dataclasses.asdict(self.dataset.sampler.options),
            "fingerprint": str(fingerprint),
            "num_rows": self.dataset.sampler.num_rows,
        }
        self._steps_per_epoch = self.dataset.sampler.steps_per_epoch
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        self.dataset.set_epoch(*self._position)

    def _process(self):
        """Who this process is for the build: the trainer's (or process group's) rank,
        else the launcher's variables (``dist.env.detect``).

        Lightning's DDP launcher starts each rank with ``WORLD_SIZE``, ``LOCAL_RANK``
        and ``NODE_RANK`` but no ``RANK`` (the global rank comes with its process
        group). Before ``Trainer.fit`` such a process is on its own: it finds or builds
        the cache as rank 0 of 1 (the build's lease lets exactly one process build)
        instead of reading half a launcher's variables.
        """
        import os

        from dist.env import ProcessInfo, detect

        trainer = getattr(self, "trainer", None)  # LightningDataModule's, once attached
        group = _process_group()
        if trainer is not None and (group is not None or trainer.world_size == 1):
            return ProcessInfo(
                rank=trainer.global_rank,
                world_size=trainer.world_size,
                local_rank=trainer.local_rank,
                local_world_size=max(1, min(trainer.num_devices, trainer.world_size)),
                node_rank=trainer.node_rank,
                source="lightning",
            )
        if (
            group is None
            and "RANK" not in os.environ
            and {"WORLD_SIZE", "LOCAL_RANK", "NODE_RANK"} <= os.environ.keys()
        ):
            return ProcessInfo(source="lightning, before Trainer.fit")
        return detect()

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Serve ``epoch`` from ``start_step`` next (the position :meth:`state_dict` reports).

        Raises:
            RuntimeError: before :meth:`setup`.
            ValueError: a negative epoch or a step outside the epoch.
        """
        self._require().set_epoch(epoch, start_step)  # checks the position
        self._position = (int(epoch), int(start_step))

    def train_dataloader(self) -> tud.DataLoader:
        """This rank's batches from the current position, in the loader's global order.

        A ``DataLoader`` (``len`` = steps per epoch) whose ``sampler.set_epoch(e)`` —
        called by Lightning before every epoch — starts epoch ``e`` unless the position
        (a resume) is already in it, and which reports every batch it hands out to
        :meth:`state_dict`. One iteration at a time.
        """
        return _ModuleLoader(
            self,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            **self.loader_kw,
        )

    def _start_epoch(self, epoch: int) -> None:
        # Lightning calls this before every epoch, and on resume after it has already
        # started iterating from the restored position: keep a position inside `epoch`.
        if self._next_position()[0] != epoch:
            self._position = (epoch, 0)
        self._require().set_epoch(*self._next_position())

    def _handed_out(self, epoch: int, step: int) -> None:
        self._position = (epoch, step)

    def _next_position(self) -> tuple[int, int]:
        epoch, step = self._position
        steps = self._steps_per_epoch
        return (epoch + 1, 0) if steps and step >= steps else (epoch, step)

    def state_dict(self) -> dict[str, Any]:
        """The position of the NEXT batch the training step gets, and the order's identity.

        Lightning stores it in its checkpoints. Batches already prefetched by workers do
        not count: only those handed out by the DataLoader. Same fields as
        :meth:`hf_pipeline.read.loader.Loader.state_dict`. Empty before the first ``setup``.
        """
        if self._identity is None:
            return {}
        epoch, step = self._next_position()
        return {"version": STATE_VERSION, "epoch": epoch, "step": step, **self._identity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the batch ``state`` (from :meth:`state_dict`) names.

        Before :meth:`setup` (or after :meth:`teardown`) the state is kept and checked
        by the next ``setup``.

        Raises:
            ValueError: not a state of this format or version, or one of another cache
                (fingerprint), seed, batch size, crop, shuffle or sample order version
                (``hf_pipeline.read.sampler.ORDER_VERSION``; the process count and
                ``partition`` may differ: the global batches are the same).
        """
        if not isinstance(state, dict) or "epoch" not in state or "step" not in state:
            raise ValueError(f"not a LatentDataModule state: {state!r}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"LatentDataModule state version {state.get('version')!r} != {STATE_VERSION}"
            )
        check_order_version(state, "LatentDataModule state")
        if self.dataset is None:
            self._pending_state = dict(state)
            return
        assert self._identity is not None  # set up with self.dataset
        for key, mine in self._identity.items():
            if key not in _SPLIT_FIELDS and key in state and state[key] != mine:
                raise ValueError(
                    f"LatentDataModule state has {key}={state[key]!r} but this DataModule has "
                    f"{key}={mine!r}; resuming would not continue the same sequence"
                )
        self.set_epoch(int(state["epoch"]), int(state["step"]))

    def teardown(self, stage: str | None = None) -> None:
        """Unmap the cache; the position stays (``state_dict`` still reports it)."""
        if self.source is not None:
            self.source.close()
            self.source = self.dataset = None

    def _require(self) -> TorchBatches:
        if self.dataset is None:
            raise RuntimeError("call setup() first")
        return self.dataset


_DOC = """A DataModule over the shared cache: a real Lightning one when Lightning is installed.

    ``setup()`` finds or builds the cache exactly like every other entry point (one rank
    builds, the others wait); ``train_dataloader()`` serves :class:`TorchBatches` in the
    loader's global order. With ``lightning`` (else ``pytorch_lightning``) installed
    this class subclasses its ``LightningDataModule``: ``Trainer.fit(model,
    datamodule=dm)`` sets each epoch through the DataLoader's ``sampler.set_epoch`` and
    saves the position in its checkpoints (``state_dict``), so ``ckpt_path=`` resumes at
    exactly the next batch. Without Lightning call the methods yourself
    (:meth:`set_epoch` at the start of each epoch).

    Args:
        cfg: the :class:`~hf_pipeline.config.Config` (``loader`` section for the order).
        num_workers, pin_memory: ``DataLoader`` settings.
        **loader_kw: ``DataLoader`` arguments (e.g. ``multiprocessing_context``).

    Raises:
        ValueError: ``persistent_workers=True`` or a ``batch_size`` in ``loader_kw``.
    """


def _lightning_datamodule_base():
    """``LightningDataModule`` of ``lightning`` (else ``pytorch_lightning``), or None."""
    import importlib

    for name in ("lightning", "pytorch_lightning"):
        try:
            return importlib.import_module(name).LightningDataModule
        except ImportError:
            continue
    return None


def _make_datamodule_class() -> type:
    base = _lightning_datamodule_base()
    bases = (_LatentDataModule,) if base is None else (_LatentDataModule, base)
    # Module and qualified name as if defined here: pickle finds it, and Lightning files
    # its state in checkpoints under the class's __qualname__.
    return type(
        "LatentDataModule",
        bases,
        {"__module__": __name__, "__qualname__": "LatentDataModule", "__doc__": _DOC},
    )


def __getattr__(name: str):
    # LatentDataModule is made on first use: importing Lightning takes seconds, and this
    # module must stay usable (and quick to import) without it.
    if name == "LatentDataModule":
        cls = _make_datamodule_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
