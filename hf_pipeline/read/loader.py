"""Batches from the memory-mapped cache into JAX, assembled ahead on a prefetch thread.

A :class:`Loader` walks the global order of :mod:`hf_pipeline.read.sampler`, gathers this
process's share of each global batch with :meth:`SampleSource.gather` (NumPy over the
memory map) and moves it to the device(s) on a background thread, ``prefetch`` batches
ahead, so that assembly and transfer overlap the training step.

What it draws and how it assembles batches is one :class:`LoaderOptions` (the order's
:class:`~hf_pipeline.read.sampler.SamplerOptions` plus prefetch depth, threads and output
dtype), made from the config's ``loader`` section by ``LoaderConfig.loader_options()``
or from keywords by :func:`loader_options`; where this process sits (process index,
mesh) is given to the :class:`Loader` beside it. :mod:`hf_pipeline.adapters.torch_data` draws
the same order from the same options.

A source that reads a published cache in place (:class:`hf_pipeline.read.stream.StreamSource`,
``loader.stream_from``) is told the positions, rows and crops of the batches to come
(``source.plan``) so that it fetches them ahead (and, with ``loader.stream_workers``,
has worker processes assemble them); its batches are the same.

Exact resume: :meth:`Loader.state_dict` describes the NEXT batch the consumer will get
(not how far the prefetch thread ran ahead). The state names global batches, not
process shares, so a state saved with ``W`` processes restores with ``W'`` processes
and the global batch sequence continues unchanged (elastic resume).

Thread-safety: a Loader is driven by one consumer thread. ``close`` may be called from
any thread. The prefetch thread is internal.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from hf_pipeline.errors import ConfigError
from hf_pipeline.read.sampler import (
    ORDER_VERSION,
    SAMPLER_FIELDS,
    GlobalSampler,
    OptionError,
    ProcessBatch,
    SamplerOptions,
    check_at_least,
    check_order_version,
    sampler_options,
    unexpected_options,
)
from hf_pipeline.workers.pool import usable_cpus

if TYPE_CHECKING:  # annotations only: jax is imported when a loader starts
    from jax.sharding import NamedSharding

_log = logging.getLogger(__name__)

__all__ = [
    "BatchLayout",
    "Loader",
    "LoaderOptions",
    "LoaderStats",
    "loader_options",
]

_STATE_VERSION = 1
# Fields of the state that define the global order: a resume must match them exactly.
_ORDER_FIELDS = (
    "seed",
    "global_batch_size",
    "fingerprint",
    "crop",
    "shuffle",
    "block_size",
    "window_blocks",
    "drop_last",
    "num_rows",
)
# Seconds each blocking queue/future/join call of the prefetcher waits before it looks
# at the stop event again: how late a close() is noticed.
_STOP_CHECK_S = 0.1
#: Threads assembling batches when ``num_threads`` is not given: min(this, usable CPUs).
_DEFAULT_MAX_THREADS = 4


class _End:
    """Sentinel: the producer finished its positions."""


_END = _End()


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    """What a :class:`Loader` draws and how it assembles batches.

    Where the process sits (process index and count, a mesh) is not an option: it is
    given to the :class:`Loader` beside them.

    Attributes:
        order: the global order (seed, batch size, shuffle, crop, ...); the part a
            saved state must match.
        prefetch: batches assembled ahead (queue bound).
        num_threads: threads assembling batches in parallel (gather + transfer release
            the GIL); batches still arrive in order. 1: the prefetch thread alone;
            None: ``min(4, CPUs)``, counted when the loader is made. On a 16-core host 8
            threads reached ~11 GB/s of shuffled fp16 latents into an H200
            (benchmarks/bench_loader.py).
        latents_dtype: output dtype of the latents (``"bfloat16"``, ...); None (or "")
            keeps the cache's storage dtype (a bfloat16 cache's ``ml_dtypes.bfloat16``
            arrays become ``jnp.bfloat16`` on the device, bit for bit).
    """

    order: SamplerOptions
    prefetch: int = 4
    num_threads: int | None = None
    latents_dtype: Any = None

    def __post_init__(self):
        if not isinstance(self.order, SamplerOptions):
            raise TypeError(f"order must be a SamplerOptions, got {type(self.order).__name__}")
        check_at_least(self.prefetch, 1, "prefetch")
        if self.num_threads is not None:
            check_at_least(self.num_threads, 1, "num_threads")
        if isinstance(self.latents_dtype, str) and not self.latents_dtype:
            object.__setattr__(self, "latents_dtype", None)
        elif self.latents_dtype is not None and _float_dtype(self.latents_dtype) is None:
            # checked here, where a config is read, not first at the Loader after a build
            raise OptionError(
                "latents_dtype",
                "must be a floating dtype (bfloat16, float16, float32), "
                f"got {self.latents_dtype!r}",
            )

    @classmethod
    def from_config(cls, loader_config) -> LoaderOptions:
        """The options of a :class:`~hf_pipeline.config.LoaderConfig` (``loader`` section).

        The same as ``loader_config.loader_options()``, which owns the mapping.
        """
        return loader_config.loader_options()


def _float_dtype(value: Any) -> np.dtype | None:
    """The NumPy dtype ``value`` names, when it is a floating one, else None: a name
    (``"bfloat16"``, ``"float32"``, ``"f4"``) or a dtype-like of NumPy, JAX or
    ``ml_dtypes`` (the same dtype ``jnp.dtype`` gives), without importing JAX."""
    import ml_dtypes

    named = isinstance(value, str) and hasattr(ml_dtypes, value)
    try:
        dtype = np.dtype(getattr(ml_dtypes, value) if named else value)
        ml_dtypes.finfo(dtype)  # floating types only
    except (TypeError, ValueError):
        return None
    return dtype


_SAMPLER_FIELDS = frozenset(SAMPLER_FIELDS)
_LOADER_FIELDS = frozenset(field.name for field in dataclasses.fields(LoaderOptions)) - {"order"}


def loader_options(
    options: LoaderOptions | None = None, *, caller: str = "loader_options", **fields
) -> LoaderOptions:
    """``options`` with ``fields`` replaced, or new options made of ``fields`` alone.

    The one place that maps flat keywords to :class:`LoaderOptions`: a field of
    :class:`~hf_pipeline.read.sampler.SamplerOptions` (``global_batch_size``, ``seed``,
    ``crop``, ...) goes to ``order``, the others (``prefetch``, ``num_threads``,
    ``latents_dtype``) stay. ``Loader(source, **fields)`` calls it.

    Raises:
        TypeError: a keyword that is no field of either, or no ``global_batch_size``
            without ``options``.
        ValueError: an invalid value.
    """
    unknown = set(fields) - _SAMPLER_FIELDS - _LOADER_FIELDS
    if unknown:
        raise unexpected_options(caller, unknown, _SAMPLER_FIELDS | _LOADER_FIELDS)
    order_fields = {name: value for name, value in fields.items() if name in _SAMPLER_FIELDS}
    own_fields = {name: value for name, value in fields.items() if name in _LOADER_FIELDS}
    if options is None:
        return LoaderOptions(order=sampler_options(**order_fields), **own_fields)
    if not fields:
        return options
    order = sampler_options(options.order, **order_fields)
    return dataclasses.replace(options, order=order, **own_fields)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchLayout:
    """How a global batch is split over processes and devices.

    Attributes:
        global_batch_size: samples per step over all processes.
        process_count: processes sharing a global batch.
        process_index: this process's index (its share's position in the batch).
        per_process_batch: samples this process gathers per step.
        devices: devices the global batch is sharded over (data axis size with a mesh;
            otherwise one per process).
        local_devices: devices this process feeds.
        per_device_batch: samples per device.
    """

    global_batch_size: int
    process_count: int
    process_index: int
    per_process_batch: int
    devices: int
    local_devices: int
    per_device_batch: int

    def describe(self) -> str:
        """One line for logs: ``global 2048 = 8 devices x 256; process 1/2 gathers 1024``."""
        return (
            f"global batch {self.global_batch_size} = {self.devices} devices x "
            f"{self.per_device_batch}; process {self.process_index}/{self.process_count} "
            f"gathers {self.per_process_batch} for {self.local_devices} local device(s)"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoaderStats:
    """Consumer-side throughput figures since the loader was created or stats reset.

    Attributes:
        batches: batches handed to the consumer.
        samples: samples handed to the consumer (this process).
        wait_s: total time the consumer was blocked waiting for a batch.
        mean_wait_s: ``wait_s / batches``.
        queue_depth: batches ready in the prefetch queue right now.
        elapsed_s: time since the first batch was requested.
        samples_per_s: ``samples / elapsed_s``.
    """

    batches: int
    samples: int
    wait_s: float
    mean_wait_s: float
    queue_depth: int
    elapsed_s: float
    samples_per_s: float


#: Prefetchers not yet closed (weakly): closed at exit, see _close_live_prefetchers.
_LIVE_PREFETCHERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_prefetchers() -> None:
    """Close the prefetchers still open when the interpreter exits, while the modules
    are whole. An iterator a program still holds at exit (``it = iter(loader);
    next(it)``) is finalized after the modules' globals are torn down; its ``close``
    then failed on them (``Exception ignored in: <generator object Loader._iterate>``).
    """
    for prefetcher in list(_LIVE_PREFETCHERS):
        prefetcher.close(timeout=1.0)


class _Prefetcher:
    """Runs ``produce(position)`` for each position ahead of the consumer, in order.

    A named daemon thread walks the positions and puts ``(item, position, error)`` on a
    bounded queue of ``depth``. With ``threads > 1`` it hands positions to a pool of
    that many worker threads (NumPy gathers and device transfers release the GIL, so
    batches are assembled in parallel) and still puts the results in position order.
    Every ``put``/``get``/wait runs in short slices and checks the stop event, so
    neither side can block forever. An error in ``produce`` is sent once and ends the
    thread; the consumer re-raises it (its traceback still holds the producer's frames).
    """

    def __init__(
        self, produce: Callable, positions: Iterator, depth: int, name: str, threads: int = 1
    ):
        self._produce = produce
        self._positions = positions
        self._threads = max(1, int(threads))
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _LIVE_PREFETCHERS.add(self)

    def _put(self, entry) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=_STOP_CHECK_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            if self._threads == 1:
                for position in self._positions:
                    if self._stop.is_set():
                        return
                    if not self._put((self._produce(position), position, None)):
                        return
            elif not self._run_pool():
                return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, never dropped
            self._put((None, None, exc))
            return
        self._put((None, None, _END))

    def _run_pool(self) -> bool:
        """Produce with a worker pool; False if stopped. Raises what ``produce`` raised."""
        from concurrent.futures import ThreadPoolExecutor
        from concurrent.futures import TimeoutError as FutureTimeout

        pending: collections.deque = collections.deque()
        positions = iter(self._positions)
        pool = ThreadPoolExecutor(self._threads, thread_name_prefix=f"{self._thread.name}-worker")
        try:
            exhausted = False
            while True:
                # Keep every worker busy; the queue bounds how far results run ahead.
                while not exhausted and len(pending) < self._threads:
                    position = next(positions, _END)
                    if position is _END:
                        exhausted = True
                    else:
                        pending.append((position, pool.submit(self._produce, position)))
                if not pending:
                    return True
                position, future = pending[0]
                while True:
                    if self._stop.is_set():
                        return False
                    try:
                        item = future.result(timeout=_STOP_CHECK_S)
                        break
                    except FutureTimeout:
                        continue
                pending.popleft()
                if not self._put((item, position, None)):
                    return False
        finally:
            for _, future in pending:
                future.cancel()
            # Running produce() calls are short (one batch); wait for them so no worker
            # thread outlives close().
            pool.shutdown(wait=True, cancel_futures=True)

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def get(self):
        """The next ``(item, position)``; ``None`` at the end or once closed.

        Raises:
            BaseException: whatever ``produce`` raised.
        """
        while True:
            try:
                item, position, error = self._queue.get(timeout=_STOP_CHECK_S)
            except queue.Empty:
                if self._stop.is_set():
                    return None
                if not self._thread.is_alive():
                    try:  # the thread may have put its last entry just before exiting
                        item, position, error = self._queue.get_nowait()
                    except queue.Empty:
                        raise RuntimeError(
                            f"prefetch thread {self._thread.name} exited without a result"
                        ) from None
                else:
                    continue
            if error is _END:
                return None
            if error is not None:
                self._stop.set()
                raise error
            return item, position

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread, drop queued batches, and join (idempotent: a second call
        returns at once, touching no module global, so that an iterator finalized during
        interpreter shutdown, after :func:`_close_live_prefetchers`, closes quietly)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:  # unblock a producer stuck on a full queue
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(_STOP_CHECK_S)
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread.is_alive():  # pragma: no cover - produce() stuck in a long call
            warnings.warn(
                f"prefetch thread {self._thread.name} did not stop within {timeout}s",
                RuntimeWarning,
                stacklevel=2,
            )


def _refuse_a_share_of_all(process_count: int) -> None:
    """Refuse one process's view of a job of several (torchrun, SLURM, ... ranks whose
    JAX was never joined): each rank would read every batch, the same as its peers."""
    if process_count != 1:
        return
    from dist.env import detect

    process = detect()
    if process.world_size > 1:
        raise ConfigError(
            f"{process.world_size} processes ({process.source}) but JAX sees one "
            "(jax.process_count() is 1): every rank would read the same batches. Join one "
            "JAX job first (wrap the loop in `with hf_pipeline.jax_distributed():`), or "
            f"pass process_index={process.rank}, process_count={process.world_size} to "
            "the Loader (process_count=1: this process reads every batch, on purpose)"
        )


class Loader:
    """Iterates batches of a :class:`~hf_pipeline.read.mapped.SampleSource` as JAX arrays.

    Iterating a Loader yields the remaining batches of the current epoch, then stops;
    iterate again for the next epoch, or use :meth:`epochs`. One iteration runs at a
    time: starting another ends the previous one. Breaking out of a ``for`` loop stops
    the prefetch thread (the iterator is closed when dropped); an iterator kept alive
    but no longer read holds its thread until :meth:`close`. Each batch is
    ``{"latents": (B, C, H, W), "embeddings": (B, D), "keys": (B,)}`` (plus ``"mask"``,
    ``(B,)`` bool, with ``drop_last=False``) where ``B`` is this process's share, or,
    with a ``mesh``, global ``jax.Array`` s of ``global_batch_size`` rows sharded over
    ``data_axis``.

    ``Loader(source, options)`` takes a :class:`LoaderOptions`; as a convenience the
    fields of the options may be given as keywords instead, flat (``Loader(source,
    global_batch_size=64, crop=0, prefetch=2)``, see :func:`loader_options`), or beside
    ``options`` to replace some of its fields. :meth:`from_config` makes one from the
    config's ``loader`` section.

    Args:
        source: the :class:`SampleSource` (anything with ``num_rows``, ``num_crops``,
            ``fingerprint`` and ``gather(rows, crops)``).
        options: the :class:`LoaderOptions`.
        process_index, process_count: this process's share; default
            ``jax.process_index()`` / ``jax.process_count()`` (or, with a mesh, the
            position of this process's devices along the data axis). A launch of
            several processes whose JAX sees one (no ``jax.distributed`` joined: use
            ``hf_pipeline.jax_distributed()``) is refused unless ``process_count`` is
            given; ``process_count=1`` says that each process reads every batch.
        mesh: optional ``jax.sharding.Mesh``; batches become global arrays.
        data_axis: mesh axis (or axes) the batch dimension is sharded over.
        start_epoch: epoch to start at (ignored after :meth:`load_state_dict`).
        **option_fields: fields of :class:`LoaderOptions` or of its ``order``
            (:class:`~hf_pipeline.read.sampler.SamplerOptions`): ``global_batch_size``,
            ``seed``, ``crop``, ``shuffle``, ``partition``, ``block_size``,
            ``window_blocks``, ``drop_last``, ``prefetch``, ``num_threads``,
            ``latents_dtype``.

    Raises:
        TypeError: an unknown keyword, or neither ``options`` nor ``global_batch_size``.
        ValueError: invalid options, or a global batch not divisible by the process
            count or the number of devices along ``data_axis``.
        ConfigError: the launcher says this is one of several processes (torchrun's
            ``WORLD_SIZE``, SLURM, ...: ``dist.env.detect``) but JAX sees one and no
            ``process_count`` was given: every rank would read the same batches. Or an
            epoch would have no batch: the source holds no samples, or the
            ``global_batch_size`` is larger than the data with ``drop_last`` (a
            ``ValueError``; scripts print it as one line and exit 2).
    """

    _t_first: float | None  # when the first batch was asked for (reset_stats)

    def __init__(
        self,
        source,
        options: LoaderOptions | None = None,
        *,
        process_index: int | None = None,
        process_count: int | None = None,
        mesh=None,
        data_axis: str | tuple[str, ...] = "data",
        start_epoch: int = 0,
        **option_fields,
    ):
        import jax

        options = loader_options(options, caller="Loader", **option_fields)
        if start_epoch < 0:
            raise ValueError(f"start_epoch must be >= 0, got {start_epoch}")
        self._source = source
        self._options = options
        self._order = options.order
        self._sampler = GlobalSampler(source.num_rows, self._order, num_crops=source.num_crops)
        self._sampler.require_batches()
        self._prefetch = int(options.prefetch)
        if options.num_threads is None:
            self._num_threads = min(_DEFAULT_MAX_THREADS, usable_cpus())
        else:
            self._num_threads = int(options.num_threads)
        self._mesh = mesh
        self._data_axis = data_axis
        # LoaderOptions checked it: a floating dtype, or None
        self._latents_dtype = (
            None if options.latents_dtype is None else _float_dtype(options.latents_dtype)
        )
        if mesh is None:
            self._init_processes(jax, process_index, process_count)
        else:
            self._init_mesh(process_index, process_count)
        if process_count is None:
            _refuse_a_share_of_all(self._layout.process_count)
        advise = getattr(source, "advise", None)
        if advise is not None:
            # Shuffled reads of a cache larger than RAM must not pull 128 KiB of
            # read-ahead per 8 KiB sample; ordered reads want the read-ahead.
            advise("random" if self._order.shuffle == "global" else "sequential")
        self._epoch, self._step = int(start_epoch), 0
        # A source that reads ahead from a store (StreamSource) is told which batches come.
        self._plans = callable(getattr(source, "plan", None))
        self._prefetcher: _Prefetcher | None = None
        self._closed = False
        self._keys_warned = False
        self._cast = None
        self.reset_stats()

    @classmethod
    def from_config(cls, source, loader_config, **overrides) -> Loader:
        """A Loader from a :class:`~hf_pipeline.config.LoaderConfig` plus overrides.

        Args:
            source: the :class:`SampleSource`, or a
                :class:`~hf_pipeline.read.stream.StreamSource` (``open_stream(cfg.loader,
                cfg.data)`` for ``loader.stream_from``).
            loader_config: the ``loader`` section of the config.
            **overrides: any ``Loader`` keyword (``mesh=...``, ``process_index=...``,
                or an option field, which replaces the config's).
        """
        return cls(source, LoaderOptions.from_config(loader_config), **overrides)

    def _init_processes(self, jax, process_index, process_count) -> None:
        """Without a mesh: one device per process, the share from the process index."""
        global_batch = self._order.global_batch_size
        if process_count is None:
            process_count = jax.process_count()
        if process_index is None:
            process_index = jax.process_index()
        process_count, process_index = int(process_count), int(process_index)
        self._local = self._sampler.process_positions(process_index, process_count)
        self._sharding: NamedSharding | None = None
        self._layout = BatchLayout(
            global_batch_size=global_batch,
            process_count=process_count,
            process_index=process_index,
            per_process_batch=global_batch // process_count,
            devices=process_count,
            local_devices=1,
            per_device_batch=global_batch // process_count,
        )

    def _init_mesh(self, process_index, process_count) -> None:
        """With a mesh: the share is the rows of the global batch this process's devices hold."""
        from jax.sharding import NamedSharding, PartitionSpec

        global_batch = self._order.global_batch_size
        axes = self._data_axis if isinstance(self._data_axis, tuple) else (self._data_axis,)
        for axis in axes:
            if axis not in self._mesh.shape:
                raise ValueError(
                    f"data_axis {axis!r} is not an axis of the mesh {dict(self._mesh.shape)}"
                )
        devices = int(np.prod([self._mesh.shape[axis] for axis in axes]))
        if global_batch % devices:
            raise ValueError(
                f"global_batch_size ({global_batch}) must be divisible by the {devices} "
                f"devices along data axis {self._data_axis!r}"
            )
        self._sharding = NamedSharding(self._mesh, PartitionSpec(self._data_axis))
        # Which rows of the global array this process's devices hold decides its share:
        # it must be one contiguous block for make_array_from_process_local_data.
        indices = self._sharding.addressable_devices_indices_map((global_batch,))
        spans = sorted(
            {  # type: ignore[misc]  # jax types an index Optional; a NamedSharding's are tuples
                (rows.start or 0, global_batch if rows.stop is None else rows.stop)
                for rows, *_ in indices.values()
            }
        )
        lo, hi = spans[0][0], spans[-1][1]
        if (
            any(end != start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
            or global_batch % (hi - lo)
            or lo % (hi - lo)
        ):
            raise ValueError(
                f"this process's devices hold rows {spans} of the global batch; the loader "
                "needs one contiguous, evenly sized block per process"
            )
        share = hi - lo
        count, index = global_batch // share, lo // share
        if (process_count is not None and process_count != count) or (
            process_index is not None and process_index != index
        ):
            raise ValueError(
                f"with this mesh this process is {index} of {count} along the data axis, but "
                f"process_index={process_index}, process_count={process_count} were given"
            )
        self._local = self._sampler.process_positions(index, count)
        self._layout = BatchLayout(
            global_batch_size=global_batch,
            process_count=count,
            process_index=index,
            per_process_batch=share,
            devices=devices,
            local_devices=len(spans),
            per_device_batch=global_batch // devices,
        )

    # ------------------------------------------------------------------ properties

    @property
    def steps_per_epoch(self) -> int:
        """Global batches (steps) per epoch."""
        return self._sampler.steps_per_epoch

    @property
    def layout(self) -> BatchLayout:
        """Device arithmetic: devices, global / per-process / per-device batch."""
        return self._layout

    @property
    def sampler(self) -> GlobalSampler:
        """The global order this loader walks."""
        return self._sampler

    @property
    def epoch(self) -> int:
        """Epoch of the next batch the consumer will get."""
        return self._epoch

    @property
    def step(self) -> int:
        """Step (within :attr:`epoch`) of the next batch the consumer will get."""
        return self._step

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The position of the NEXT batch the consumer will get, plus the order's identity.

        Independent of the number of processes; JSON-serialisable.
        """
        order = self._order
        return {
            "version": _STATE_VERSION,
            "order_version": ORDER_VERSION,
            "epoch": self._epoch,
            "step": self._step,
            "seed": order.seed,
            "global_batch_size": order.global_batch_size,
            "fingerprint": str(getattr(self._source, "fingerprint", "")),
            "crop": order.crop,
            "shuffle": order.shuffle,
            "block_size": order.block_size,
            "window_blocks": order.window_blocks,
            "drop_last": order.drop_last,
            "num_rows": self._sampler.num_rows,
            "partition": order.partition,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` (from :meth:`state_dict`) left off.

        Any running iteration is stopped. The process count and partition may differ
        from the run that saved the state.

        Raises:
            ValueError: the state belongs to another cache (fingerprint), global batch
                size, seed, crop or shuffle mode, or sample order version
                (``hf_pipeline.read.sampler.ORDER_VERSION``), or is malformed.
        """
        if not isinstance(state, dict) or "epoch" not in state or "step" not in state:
            raise ValueError(f"not a loader state: {state!r}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')} != {_STATE_VERSION}")
        check_order_version(state, "loader state")
        mine = self.state_dict()
        for key in _ORDER_FIELDS:
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"loader state has {key}={state[key]!r} but this loader has "
                    f"{key}={mine[key]!r}; resuming would not continue the same sequence"
                )
        epoch, step = int(state["epoch"]), int(state["step"])
        if epoch < 0 or not 0 <= step <= max(self.steps_per_epoch, 0):
            raise ValueError(f"loader state position epoch={epoch}, step={step} is out of range")
        self._stop_prefetch()
        self._epoch, self._step = self._normalize(epoch, step)

    def _normalize(self, epoch: int, step: int) -> tuple[int, int]:
        steps = self.steps_per_epoch
        if steps and step >= steps:
            return epoch + 1, 0
        return epoch, step

    # ------------------------------------------------------------------ iteration

    def _positions(self, epoch: int, step: int, num_epochs: int | None):
        steps = self.steps_per_epoch
        end = None if num_epochs is None else epoch + num_epochs
        while end is None or epoch < end:
            while step < steps:
                yield epoch, step
                step += 1
            epoch, step = epoch + 1, 0

    def _produce(self, position: tuple[int, int]) -> dict[str, Any]:
        epoch, step = position
        share: ProcessBatch = self._sampler.batch_at(epoch, step, self._local)
        if self._plans:
            batch = self._source.gather(share.rows, share.crops, position=position)
        else:
            batch = self._source.gather(share.rows, share.crops)
        if not self._order.drop_last:
            batch["mask"] = share.mask
        return self._to_device(batch)

    def _cast_latents(self, latents):
        # Cast on the device: transfers stay in the (smaller) cache dtype, and XLA's
        # vectorized convert beats ml_dtypes' per-element NumPy cast (~4x for fp16->bf16).
        if self._latents_dtype is None or latents.dtype == self._latents_dtype:
            return latents
        if self._cast is None:
            import jax

            dtype = self._latents_dtype
            self._cast = jax.jit(lambda array: array.astype(dtype))
        return self._cast(latents)

    def _keys_for_jax(self, keys: np.ndarray):
        import jax

        if jax.config.jax_enable_x64:  # type: ignore[attr-defined]  # a flag jax sets at runtime
            return keys
        if keys.size == 0 or (keys.min() >= -(2**31) and keys.max() < 2**31):
            return keys.astype(np.int32)
        return None  # does not fit the int32 JAX would silently truncate to

    def _to_device(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        import jax

        host: dict[str, np.ndarray] = {}
        out: dict[str, Any] = {}
        for name, arr in batch.items():
            if name == "keys":
                converted = self._keys_for_jax(arr)
                if converted is None:
                    if not self._keys_warned:
                        # Expected with real (COYO) ids: say it once, quietly.
                        self._keys_warned = True
                        _log.info(
                            "keys exceed int32 and jax_enable_x64 is off: keys stay NumPy "
                            "int64 (process-local)"
                        )
                    out[name] = arr
                    continue
                arr = converted
            host[name] = arr
        if self._sharding is None:
            out.update(jax.device_put(host))  # one call: the transfers are issued together
        else:
            for name, arr in host.items():
                global_shape = (self._order.global_batch_size, *arr.shape[1:])
                out[name] = jax.make_array_from_process_local_data(
                    self._sharding, arr, global_shape
                )
        out["latents"] = self._cast_latents(out["latents"])
        # Finish the transfers here, on the prefetch thread, not in the training step.
        jax.block_until_ready([value for value in out.values() if isinstance(value, jax.Array)])
        return {name: out[name] for name in batch}  # keep the key order

    def _planned(self, epoch: int, step: int, num_epochs: int | None):
        """``(position, rows, crops)`` of this process's batches from ``(epoch, step)``:
        what a streaming source fetches ahead (its workers assemble them:
        :class:`~hf_pipeline.read.stream.workers.StreamWorkers`)."""
        for position in self._positions(epoch, step, num_epochs):
            epoch_at, step_at = position
            share = self._sampler.batch_at(epoch_at, step_at, self._local)
            yield position, share.rows, share.crops

    def _stop_prefetch(self) -> None:
        prefetcher, self._prefetcher = self._prefetcher, None
        if prefetcher is not None:
            prefetcher.close()
        if self._plans:
            self._source.plan(None)

    def _iterate(self, num_epochs: int | None):
        if self._closed:
            raise RuntimeError("the loader is closed")
        self._stop_prefetch()
        if self._plans:
            self._source.plan(self._planned(self._epoch, self._step, num_epochs))
        prefetcher = _Prefetcher(
            self._produce,
            self._positions(self._epoch, self._step, num_epochs),
            self._prefetch,
            name=f"hf_pipeline-prefetch-p{self._layout.process_index}",
            threads=self._num_threads,
        )
        self._prefetcher = prefetcher
        try:
            while True:
                t0 = time.perf_counter()
                if self._t_first is None:
                    self._t_first = t0
                got = prefetcher.get()
                if got is None:
                    return
                item, (epoch, step) = got
                self._wait_s += time.perf_counter() - t0
                self._batches += 1
                self._samples += self._layout.per_process_batch
                # The consumer now holds (epoch, step): the state names the one after.
                self._epoch, self._step = self._normalize(epoch, step + 1)
                yield item
        finally:
            prefetcher.close()
            if self._prefetcher is prefetcher:
                self._prefetcher = None
                if self._plans:
                    self._source.plan(None)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The remaining batches of the current epoch (then the state moves to the next)."""
        return self._iterate(1)

    def epochs(self, num_epochs: int | None = None) -> Iterator[dict[str, Any]]:
        """Batches across ``num_epochs`` epochs from the current position (None: forever).

        The prefetch thread runs across epoch boundaries without a bubble.

        An epoch of no batch (no samples, or a ``global_batch_size`` larger than the data
        with ``drop_last``) was refused when the Loader was made.
        """
        if num_epochs is not None and num_epochs < 0:
            raise ValueError(f"num_epochs must be >= 0 or None, got {num_epochs}")
        return self._iterate(num_epochs)

    # ------------------------------------------------------------------ stats & life

    def reset_stats(self) -> None:
        """Start the :meth:`stats` counters afresh."""
        self._batches = self._samples = 0
        self._wait_s = 0.0
        self._t_first = None

    def stats(self) -> LoaderStats:
        """Consumer-side throughput: mean wait per batch, queue depth, samples/s."""
        elapsed = 0.0 if self._t_first is None else time.perf_counter() - self._t_first
        return LoaderStats(
            batches=self._batches,
            samples=self._samples,
            wait_s=self._wait_s,
            mean_wait_s=self._wait_s / self._batches if self._batches else 0.0,
            queue_depth=self._prefetcher.depth if self._prefetcher is not None else 0,
            elapsed_s=elapsed,
            samples_per_s=self._samples / elapsed if elapsed > 0 else 0.0,
        )

    def close(self) -> None:
        """Stop and join the prefetch thread (idempotent; the source stays open)."""
        self._closed = True
        self._stop_prefetch()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Loader({self._layout}, {self._options}, epoch={self._epoch}, step={self._step})"
