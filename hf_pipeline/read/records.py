"""Record index -> training sample: the map-style view of a cache.

:class:`SampleRecords` numbers the samples of a :class:`~hf_pipeline.read.mapped.SampleSource`
(record ``i`` is a *sample id* of :mod:`hf_pipeline.read.sampler`): with ``crop="random"`` or
a fixed crop index it is logical row ``i``; with ``crop="all"`` it is crop
``i % num_crops`` of row ``i // num_crops``. A random crop is a hash of ``(seed, row)``
(the sampler's epoch-0 crop), so a record's value never depends on which worker, batch
or resume reads it; ``get_batch(indices, epoch)`` draws epoch ``epoch``'s crops, for a
reader that knows the epoch (one record per global batch: the Loader's batches). Grain's source (:class:`hf_pipeline.adapters.grain_source.GrainSource`) and
torch's map-style dataset (:class:`hf_pipeline.adapters.torch_data.TorchSamples`) both serve it:
the framework owns the order, the sharding and the batching.

Thread-safety: immutable; reads are safe from several threads (the source's gathers are).
"""

from __future__ import annotations

import operator
import typing
from collections.abc import Sequence

import numpy as np

from hf_pipeline.read.mapped import SampleSource
from hf_pipeline.read.sampler import CropMode, GlobalSampler, SamplerOptions

if typing.TYPE_CHECKING:  # the stream imports the stores: only for the annotation
    from hf_pipeline.read.stream import StreamSource

__all__ = ["SampleRecords", "record_index"]

# Random crops are drawn as the sampler draws them for this epoch; a map-style source
# sees no epoch, so every epoch reuses it.
_CROP_EPOCH = 0


def record_index(index) -> int:
    """``index`` as an int (numpy ints too).

    Raises:
        TypeError: a float, a string, a slice or a list.
    """
    try:
        return operator.index(index)
    except TypeError:
        raise TypeError(
            f"record index must be an integer, got {type(index).__name__} {index!r:.80}"
        ) from None


class SampleRecords:
    """The samples of ``source`` numbered ``0 .. len - 1``.

    Args:
        source: the memory-mapped :class:`SampleSource` (not closed by this object).
        crop: ``"random"``, a fixed crop index, or ``"all"``, as ``loader.crop``.
        seed: seed of the random crops.

    Raises:
        ValueError: invalid ``crop`` or ``seed``, or a crop index ``>= num_crops``.
    """

    def __init__(
        self, source: SampleSource | StreamSource, *, crop: CropMode | int = "random", seed: int = 0
    ):
        # SamplerOptions checks crop and seed with the loader's messages; the global
        # batch size plays no part in the record -> (row, crop) mapping.
        options = SamplerOptions(global_batch_size=1, seed=seed, crop=crop)
        self.source = source
        self.sampler = GlobalSampler(source.num_rows, options, num_crops=source.num_crops)

    def __len__(self) -> int:
        """Records: rows, or rows x crops with ``crop="all"``."""
        return self.sampler.num_samples

    def rows_and_crops(self, indices, epoch: int = _CROP_EPOCH) -> tuple[np.ndarray, np.ndarray]:
        """The logical rows and crops of records ``indices``, random crops drawn as the
        sampler draws them in ``epoch``.

        Raises:
            IndexError: an index outside ``[0, len(self))``.
            TypeError: indices or an epoch that are not integers.
            ValueError: ``epoch < 0``.
        """
        epoch = operator.index(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        ids = np.asarray(indices)
        if ids.size and ids.dtype.kind not in "iu":
            raise TypeError(f"record indices must be integers, got {ids.dtype} ({indices!r:.80})")
        ids = ids.astype(np.int64, copy=False).reshape(-1)
        n = self.sampler.num_samples
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            bad = ids[(ids < 0) | (ids >= n)][0]
            raise IndexError(f"record index must be in [0, {n}), got {bad}")
        return self.sampler.samples_to_rows(ids, epoch)

    def get_batch(
        self, indices: Sequence[int] | np.ndarray, epoch: int = _CROP_EPOCH
    ) -> dict[str, np.ndarray]:
        """Records ``indices`` stacked by one NumPy gather (random crops of ``epoch``).

        Returns:
            ``{"latents": (B, C, H, W), "embeddings": (B, D), "keys": (B,)}``.

        Raises:
            IndexError: an index outside ``[0, len(self))``.
            TypeError: indices or an epoch that are not integers.
            ValueError: ``epoch < 0``.
        """
        rows, crops = self.rows_and_crops(indices, epoch)
        return self.source.gather(rows, crops)
