"""The global sample order per (seed, epoch), and each process's share of it.

The order depends only on ``(seed, epoch, num_rows, options)``, never on the number of
processes: global batch ``g`` of an epoch is the fixed slice ``[g*G, (g+1)*G)`` of the
epoch's order, and process ``p`` of ``W`` takes its part of every global batch
(``partition="contiguous"``: ``[p*G/W, (p+1)*G/W)``; ``partition="strided"``: every
``W``-th sample from ``p``, i.e. the batches of ``DataLoader(batch_size=G/W,
drop_last=True)`` over :class:`torch.utils.data.DistributedSampler` on the same order;
not its index sets, which also hold the tail that ``DataLoader`` drops: see README).
A run saved on ``W`` processes and resumed on ``W'`` therefore sees the same global
batches.

Samples: with ``crop="all"`` each row gives ``num_crops`` samples (sample id
``row * num_crops + crop``); otherwise one sample per row whose crop is either fixed or
drawn per ``(seed, epoch, row)`` by a counter-based hash (independent of the world size
and of the batch a row lands in).

Orders (``shuffle``):

- ``"global"``: a full permutation from ``np.random.default_rng([seed, epoch])``.
- ``"sequential"``: no shuffling; contiguous reads.
- ``"block"``: blocks of ``block_size`` consecutive samples in random order, then a
  shuffle inside each window of ``window_blocks`` consecutive (shuffled) blocks. Each
  window reads ``window_blocks * block_size`` nearby rows, so a cache larger than RAM
  streams from disk with locality while batches still mix several regions.

The choices (:data:`Shuffle`, :data:`Partition`, :data:`CropMode`) are defined here,
once; ``hf_pipeline.config`` checks ``loader.*`` against them, and
:func:`sampler_options` is the one rule for taking options or their fields as keywords.

Everything is vectorized NumPy; one epoch's order (int64, one entry per sample) is the
largest allocation.

Thread-safety: :class:`GlobalSampler` methods may be called from several threads (the
per-epoch order cache is locked).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import reprlib
import threading
from collections.abc import Iterable
from typing import Any, Literal, get_args, overload

import numpy as np

from hf_pipeline.errors import ConfigError

__all__ = [
    "CROPS",
    "ORDER_VERSION",
    "PARTITIONS",
    "SAMPLER_FIELDS",
    "SHUFFLES",
    "CropMode",
    "GlobalSampler",
    "OptionError",
    "Partition",
    "ProcessBatch",
    "SamplerOptions",
    "Shuffle",
    "check_at_least",
    "crop_problem",
    "sampler_options",
    "unexpected_options",
]

#: Version of the sample order: which samples, crops and process shares every global
#: batch of every (seed, epoch, num_rows, options) holds. A saved loader state names
#: global batches, so any change to ``_compute_order``, ``random_crops``,
#: ``samples_to_rows`` or ``process_positions`` that moves a sample silently changes every
#: resumed run: such a change must bump this (tests/test_sampler.py pins each version's
#: order with golden arrays, and the loader refuses a state saved under another version).
ORDER_VERSION = 1


def check_order_version(state: dict, what: str) -> None:
    """Refuse a saved position (``what``: whose state) drawn under another order version.

    States written before the field existed were written under order version 1.

    Raises:
        ValueError: the state names another ``order_version`` than this code draws.
    """
    saved = state.get("order_version", 1)
    if saved != ORDER_VERSION:
        raise ValueError(
            f"{what} was saved under sample order version {saved!r} but this code draws "
            f"order version {ORDER_VERSION}; resuming would not continue the same sequence "
            "(use the hf_pipeline release that saved it)"
        )


#: How an epoch's samples are ordered (``loader.shuffle``; see the module docstring).
Shuffle = Literal["block", "global", "sequential"]
SHUFFLES: tuple[str, ...] = get_args(Shuffle)
#: How a global batch is split over processes (``loader.partition``).
Partition = Literal["contiguous", "strided"]
PARTITIONS: tuple[str, ...] = get_args(Partition)
#: The named crop choices (``loader.crop``); a crop index is the other kind of choice.
CropMode = Literal["all", "random"]
CROPS: tuple[str, ...] = get_args(CropMode)


@overload
def _splitmix64(x: np.ndarray) -> np.ndarray: ...
@overload
def _splitmix64(x: np.uint64) -> np.uint64: ...
def _splitmix64(x: Any) -> Any:
    """Vectorized SplitMix64 finalizer (uint64 -> well-mixed uint64), of an array or a scalar."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _normalize_crop(crop) -> str | int:
    if isinstance(crop, (int, np.integer)) and not isinstance(crop, bool):
        return int(crop)
    if isinstance(crop, str) and crop.isdigit():
        return int(crop)
    return crop


def crop_problem(crop, num_crops: int | None = None) -> str | None:
    """Why ``crop`` is not a valid crop choice, or None: the one rule for crop values.

    Valid: ``"random"``, ``"all"``, or a crop index (int or digit string) below
    ``num_crops`` (any index >= 0 while ``num_crops`` is unknown). ``hf_pipeline.config``
    checks ``loader.crop`` with this and the shards' crop count.

    Returns:
        ``"must be 'random', 'all' or a crop index 0-2, got '7'"`` (without the field's
        name, which the caller puts in front), or None.
    """
    normalized = _normalize_crop(crop)
    if isinstance(normalized, int) and not isinstance(normalized, bool):  # True is an int
        if normalized >= 0 and (num_crops is None or normalized < num_crops):
            return None
    elif normalized in CROPS:
        return None
    index = "an index >= 0" if num_crops is None else f"a crop index 0-{num_crops - 1}"
    return f"must be 'random', 'all' or {index}, got {crop!r}"


class OptionError(ConfigError):
    """An option of :class:`SamplerOptions` or ``LoaderOptions`` has an invalid value.

    A :class:`~hf_pipeline.errors.ConfigError` (so a ``ValueError``): what the API's
    readers (``Loader``, ``TorchBatches``, ``GrainSource``) raise for a bad option, the
    same type ``load_config`` raises for the config field.

    Attributes:
        field: the option's name (``hf_pipeline.config`` names it ``loader.<field>``);
            "" when built from one string (torch's ``DataLoader`` re-raise).
    """

    def __init__(self, field: str, message: str | None = None):
        if message is None:
            super().__init__(field, "")
            self.field, self.message = "", field
        else:
            super().__init__(f"{field} {message}", field)
            self.message = message

    def __reduce__(self):
        return type(self), (self.field, self.message) if self.field else (self.message,)


def check_at_least(value: int, least: int, field: str) -> None:
    """Raise :class:`OptionError` "``field`` must be >= ``least``, got ``value``"."""
    if value < least:
        raise OptionError(field, f"must be >= {least}, got {value!r}")


def check_number(
    value: object,
    field: str,
    lo: float,
    hi: float,
    *,
    integer: bool,
    lo_open: bool = False,
    note: str = "",
) -> None:
    """Raise :class:`OptionError` unless ``value`` is a number (an integer if ``integer``)
    in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``; ``note`` follows the range in the
    message): the rule of the config's bounded fields (which call it), so options built
    in code refuse what ``loader.*`` refuses (inf, NaN, 1.5 bytes). Values are shown
    bounded (:func:`hf_pipeline.errors.shown`)."""
    from hf_pipeline.errors import shown

    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise OptionError(
            field, f"must be {'an integer' if integer else 'a number'}, got {shown(value)}"
        )
    # numpy's ints and floats compared as Python's (an int stays exact however large).
    number = int(value) if isinstance(value, numbers.Integral) else float(value)
    if isinstance(number, float) and not math.isfinite(number):  # an int is finite
        raise OptionError(field, f"must be a finite number, got {shown(value)}")
    if not ((lo < number) if lo_open else (lo <= number)) or number > hi:
        span = f"{'(' if lo_open else '['}{lo}, {hi}]{note}"
        raise OptionError(field, f"must be in {span}, got {shown(value)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerOptions:
    """How the global order is drawn and split.

    Attributes:
        global_batch_size: samples per global batch (all processes together).
        seed: non-negative seed of the order and of random crops.
        shuffle: ``"global"``, ``"block"`` or ``"sequential"``.
        partition: ``"contiguous"`` or ``"strided"`` (DistributedSampler's batches).
        crop: ``"random"``, ``"all"`` or a fixed crop index (an int, or a digit string
            that becomes one).
        block_size: samples per block for ``shuffle="block"``.
        window_blocks: blocks shuffled together for ``shuffle="block"``.
        drop_last: drop the last partial global batch (default). ``False`` pads it by
            wrapping around to the start of the epoch's order and masks the padding.
    """

    global_batch_size: int
    seed: int = 0
    shuffle: Shuffle = "global"
    partition: Partition = "contiguous"
    crop: CropMode | int = "random"
    block_size: int = 4096
    window_blocks: int = 4
    drop_last: bool = True

    def __post_init__(self):
        if not isinstance(self.drop_last, bool | np.bool_):
            raise OptionError("drop_last", f"must be True or False, got {self.drop_last!r}")
        object.__setattr__(self, "drop_last", bool(self.drop_last))
        check_at_least(self.global_batch_size, 1, "global_batch_size")
        check_at_least(self.seed, 0, "seed")
        for field, value, allowed in (
            ("shuffle", self.shuffle, SHUFFLES),
            ("partition", self.partition, PARTITIONS),
        ):
            if value not in allowed:
                raise OptionError(field, f"must be one of {allowed}, got {reprlib.repr(value)}")
        problem = crop_problem(self.crop)
        if problem is not None:
            raise OptionError("crop", problem)
        object.__setattr__(self, "crop", _normalize_crop(self.crop))
        check_at_least(self.block_size, 1, "block_size")
        check_at_least(self.window_blocks, 1, "window_blocks")


#: The fields of :class:`SamplerOptions` (``hf_pipeline.config.LoaderConfig`` has each).
SAMPLER_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplerOptions))
_SAMPLER_FIELD_SET = frozenset(SAMPLER_FIELDS)


def unexpected_options(caller: str, unknown: Iterable[str], known: Iterable[str]) -> TypeError:
    """The ``TypeError`` for keywords that are no option of ``caller``: names it, the
    first unknown keyword, the option it is closest to (a misspelling) and the valid ones."""
    name, valid = sorted(unknown)[0], sorted(known)
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return TypeError(
        f"{caller}() got an unexpected keyword argument {name!r}{hint}; "
        f"its options: {', '.join(valid)}"
    )


def sampler_options(
    options: SamplerOptions | None = None, *, caller: str = "SamplerOptions", **fields
) -> SamplerOptions:
    """``options`` with ``fields`` replaced, or new options made of ``fields`` alone.

    The one rule by which :class:`GlobalSampler`, :class:`hf_pipeline.read.loader.Loader` and
    :class:`hf_pipeline.adapters.torch_data.TorchBatches` take either options or their fields as
    keywords.

    Args:
        caller: what the keywords were given to, named by the ``TypeError`` of one
            that is no option.

    Raises:
        TypeError: a field that :class:`SamplerOptions` does not have, or no
            ``global_batch_size`` without ``options``.
        ValueError: an invalid value.
    """
    if not fields.keys() <= _SAMPLER_FIELD_SET:
        raise unexpected_options(caller, fields.keys() - _SAMPLER_FIELD_SET, SAMPLER_FIELDS)
    if options is None:
        return SamplerOptions(**fields)
    return dataclasses.replace(options, **fields) if fields else options


@dataclasses.dataclass(frozen=True)
class ProcessBatch:
    """One process's share of one global batch.

    Attributes:
        epoch: the epoch.
        step: the global batch index within the epoch.
        rows: ``(b,)`` int64 logical row ids.
        crops: ``(b,)`` int64 crop indices.
        mask: ``(b,)`` bool, False for padding (only with ``drop_last=False``).
        positions: ``(b,)`` int64 positions of these samples in the global batch.
    """

    epoch: int
    step: int
    rows: np.ndarray
    crops: np.ndarray
    mask: np.ndarray
    positions: np.ndarray


class GlobalSampler:
    """The global sample order of a dataset of ``num_rows`` rows.

    Args:
        num_rows: rows in the (filtered) dataset.
        options: a :class:`SamplerOptions`; or pass its fields as keywords.
        num_crops: crops per row.

    Raises:
        ValueError: invalid options, a fixed crop ``>= num_crops``, or ``num_rows < 0``.
    """

    def __init__(
        self, num_rows: int, options: SamplerOptions | None = None, *, num_crops: int = 3, **kw
    ):
        options = sampler_options(options, caller="GlobalSampler", **kw)
        if num_rows < 0:
            raise ValueError(f"num_rows must be >= 0, got {num_rows}")
        if num_crops < 1:
            raise ValueError(f"num_crops must be >= 1, got {num_crops}")
        problem = crop_problem(options.crop, num_crops)
        if problem is not None:
            raise ValueError(f"crop {problem} (the data has {num_crops} crops per row)")
        self.options = options
        self.num_rows = int(num_rows)
        self.num_crops = int(num_crops)
        self.num_samples = self.num_rows * (self.num_crops if options.crop == "all" else 1)
        self._lock = threading.Lock()
        self._cache: dict[int, np.ndarray] = {}

    def __getstate__(self):
        # Picklable for spawned/forkserver workers: the lock and cached orders stay behind.
        state = self.__dict__.copy()
        del state["_lock"], state["_cache"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._cache = {}

    @property
    def global_batch_size(self) -> int:
        """Samples per global batch."""
        return self.options.global_batch_size

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch (partial last batch dropped unless ``drop_last=False``)."""
        batch = self.options.global_batch_size
        if self.options.drop_last:
            return self.num_samples // batch
        return -(-self.num_samples // batch)

    def require_batches(self) -> None:
        """Raise unless an epoch has at least one batch to train on.

        Every reader (the JAX ``Loader``, ``TorchBatches``, so the DataModule) calls it
        when it is made: an epoch of no batch would otherwise end at once, silently.

        Raises:
            ConfigError: the data holds no samples, or (``drop_last``) the global batch is
                larger than an epoch. A ``ValueError`` and a ``UserError``: scripts print
                it as one line and exit 2.
        """
        from hf_pipeline.errors import ConfigError

        if self.num_samples == 0:
            raise ConfigError(
                "the cache holds no samples: its build kept none of its rows (its report's "
                "'dropped' counts say why); there is nothing to train on"
            )
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"loader.global_batch_size ({self.global_batch_size}) is larger than an "
                f"epoch of {self.num_samples} samples ({self.num_rows} rows in the "
                "cache): with drop_last there is no full batch to train on; use a batch of "
                f"at most {self.num_samples} or set loader.drop_last: false",
                field="loader.global_batch_size",
            )

    # ------------------------------------------------------------------ order

    def _compute_order(self, epoch: int) -> np.ndarray:
        num_samples, options = self.num_samples, self.options
        if options.shuffle == "sequential" or num_samples == 0:
            return np.arange(num_samples, dtype=np.int64)
        rng = np.random.default_rng([options.seed, epoch])
        if options.shuffle == "global":
            return rng.permutation(num_samples).astype(np.int64, copy=False)
        # Block shuffle: permute blocks, lay their samples out in that order (a matrix,
        # one laid-out block per row, -1 past the end of the data), then shuffle inside
        # windows of `window_blocks` laid-out blocks: O(n), no sort.
        block_size, window_blocks = options.block_size, options.window_blocks
        num_blocks = -(-num_samples // block_size)
        num_windows = -(-num_blocks // window_blocks)
        block_order = np.full(num_windows * window_blocks, -1, dtype=np.int64)
        block_order[:num_blocks] = rng.permutation(num_blocks)
        layout = block_order[:, None] * block_size + np.arange(block_size, dtype=np.int64)[None, :]
        layout[(block_order[:, None] < 0) | (layout >= num_samples)] = -1
        layout = layout.reshape(num_windows, window_blocks * block_size)
        rng.permuted(layout, axis=1, out=layout)
        return layout[layout >= 0]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample ids of ``epoch`` in order (read-only int64 array, cached).

        Raises:
            ValueError: ``epoch < 0``.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        with self._lock:
            order = self._cache.get(epoch)
        if order is None:
            order = self._compute_order(epoch)
            order.flags.writeable = False
            with self._lock:
                # Keep two epochs: the prefetcher runs ahead across the boundary.
                self._cache[epoch] = order
                for old in sorted(self._cache)[:-2]:
                    del self._cache[old]
        return order

    def samples_to_rows(self, samples: np.ndarray, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Split sample ids into ``(rows, crops)`` for ``epoch``."""
        samples = np.asarray(samples, dtype=np.int64)
        crop = self.options.crop
        if crop == "all":
            return samples // self.num_crops, samples % self.num_crops
        if crop == "random":
            return samples, self.random_crops(samples, epoch)
        return samples, np.full(samples.shape, crop, dtype=np.int64)

    def random_crops(self, rows: np.ndarray, epoch: int) -> np.ndarray:
        """The random crop of each row in ``epoch``: a hash of (seed, epoch, row)."""
        rows = np.asarray(rows, dtype=np.int64).astype(np.uint64)
        with np.errstate(over="ignore"):
            salt = _splitmix64(_splitmix64(np.uint64(self.options.seed)) ^ np.uint64(epoch))
            hashed = _splitmix64(rows ^ salt)
        return (hashed % np.uint64(self.num_crops)).astype(np.int64)

    def _check_step(self, epoch: int, step: int) -> None:
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step must be in [0, {self.steps_per_epoch}), got {step}")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")

    def global_positions(self, step: int) -> np.ndarray:
        """Positions in the epoch order of global batch ``step`` (may run past the end)."""
        batch = self.options.global_batch_size
        return np.arange(step * batch, (step + 1) * batch, dtype=np.int64)

    def global_batch(self, epoch: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample ids of global batch ``step`` of ``epoch`` and the mask of real ones.

        With ``drop_last=False`` the last batch wraps to the start of the epoch's order
        (as DistributedSampler pads) and the mask marks the wrapped samples False.

        Raises:
            IndexError: ``step`` outside ``[0, steps_per_epoch)``.
        """
        self._check_step(epoch, step)
        pos = self.global_positions(step)
        order = self.epoch_order(epoch)
        mask = pos < self.num_samples
        return order[pos % self.num_samples], mask

    def process_positions(self, process_index: int, process_count: int) -> np.ndarray:
        """Which positions of a global batch process ``process_index`` takes.

        Raises:
            ValueError: ``global_batch_size % process_count != 0`` or a bad index.
        """
        batch = self.options.global_batch_size
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"process_index must be in [0, {process_count}), got {process_index}")
        if batch % process_count:
            raise ValueError(
                f"global_batch_size ({batch}) must be divisible by the number of processes "
                f"({process_count})"
            )
        share = batch // process_count
        if self.options.partition == "strided":
            return np.arange(process_index, batch, process_count, dtype=np.int64)
        return np.arange(process_index * share, (process_index + 1) * share, dtype=np.int64)

    def process_batch(
        self, epoch: int, step: int, process_index: int = 0, process_count: int = 1
    ) -> ProcessBatch:
        """Process ``process_index``'s share of global batch ``step`` of ``epoch``.

        Raises:
            IndexError: ``step`` outside ``[0, steps_per_epoch)``.
            ValueError: ``global_batch_size`` not divisible by ``process_count``.
        """
        return self.batch_at(epoch, step, self.process_positions(process_index, process_count))

    def batch_at(self, epoch: int, step: int, local: np.ndarray) -> ProcessBatch:
        """The samples at positions ``local`` of global batch ``step`` of ``epoch``.

        Raises:
            IndexError: ``step`` outside ``[0, steps_per_epoch)``.
        """
        self._check_step(epoch, step)
        local = np.asarray(local, dtype=np.int64)
        pos = step * self.options.global_batch_size + local
        order = self.epoch_order(epoch)
        samples = order[pos % self.num_samples]
        rows, crops = self.samples_to_rows(samples, epoch)
        return ProcessBatch(epoch, step, rows, crops, pos < self.num_samples, local)

    def process_stream(self, epoch: int, process_index: int = 0, process_count: int = 1):
        """Iterate ``process_batch`` over all steps of ``epoch``."""
        for step in range(self.steps_per_epoch):
            yield self.process_batch(epoch, step, process_index, process_count)

    def __repr__(self) -> str:
        return f"GlobalSampler(num_rows={self.num_rows}, {self.options})"
