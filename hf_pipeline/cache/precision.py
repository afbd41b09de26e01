"""Latent storage precision: which dtype the cache stores, and what a lossy choice costs.

By default (``build.latent_dtype: source``) the cache keeps every shard's latents bit for
bit in the shards' own dtype. Arrow, and so ``datasets``, has no bfloat16: a bfloat16
cache stores each value's 16 bits as ``uint16`` and readers view them as
``ml_dtypes.bfloat16`` (the NumPy bfloat16 that JAX uses) without a copy. Readers never
guess that from ``uint16``: the build records the storage dtype (build report
``precision.storage_dtype``, converted marker ``latent_dtype``).

An explicit dtype that cannot hold every source value (float16 from bfloat16 or float32,
bfloat16 from float16 or float32) rounds; :func:`to_storage` counts what that cost.

Pure NumPy (it runs inside forked ``datasets`` workers, where a torch op may deadlock).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hf_pipeline.cache.latents import STORAGE_DTYPES

__all__ = [
    "PrecisionLoss",
    "arrow_dtype",
    "dtype_name",
    "from_arrow",
    "is_exact",
    "numpy_dtype",
    "to_arrow",
    "to_storage",
]

# Explicit mantissa bits of each storage format: one ulp at |x| in [2**e, 2**(e+1)) is
# 2**(e - bits) for a format with an unbounded exponent range.
_MANTISSA_BITS = {"float16": 10, "bfloat16": 7, "float32": 23}
# Arrow has no bfloat16: its 16 bits travel as uint16.
_ARROW = {"float16": "float16", "bfloat16": "uint16", "float32": "float32"}
# Values per chunk when counting a lossy cast (bounds the float64 temporaries).
_CHUNK = 1 << 20


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a storage dtype name (bfloat16: ``ml_dtypes.bfloat16``).

    Raises:
        ValueError: ``name`` is not one of ``STORAGE_DTYPES``.
    """
    if name not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype must be one of {STORAGE_DTYPES}, got {name!r}")
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def dtype_name(dtype) -> str:
    """The storage dtype name of a NumPy dtype (``float16``, ``bfloat16``, ``float32``).

    Raises:
        ValueError: not one of the storage dtypes.
    """
    name = np.dtype(dtype).name
    if name not in STORAGE_DTYPES:
        raise ValueError(f"latents must be one of {STORAGE_DTYPES}, got {name}")
    return name


def arrow_dtype(name: str) -> str:
    """The ``datasets`` value type that stores ``name`` (bfloat16 -> ``"uint16"`` bits)."""
    numpy_dtype(name)  # validates
    return _ARROW[name]


def to_arrow(values: np.ndarray) -> np.ndarray:
    """``values`` as ``datasets`` can write them: bfloat16 as its uint16 bits (a view)."""
    if dtype_name(values.dtype) == "bfloat16":
        return values.view(np.uint16)
    return values


def from_arrow(values: np.ndarray, storage_dtype: str) -> np.ndarray:
    """View latents read from the cache's Arrow files in their storage dtype (no copy).

    Args:
        values: what Arrow/``datasets`` returns (``uint16`` for a bfloat16 cache;
            ``datasets``' numpy format widens those to int64, which is narrowed back
            here, a copy).
        storage_dtype: the cache's recorded storage dtype (report
            ``precision.storage_dtype``).

    Raises:
        ValueError: ``values`` are not what a cache of that storage dtype holds.
    """
    want = numpy_dtype(storage_dtype)
    arrow = np.dtype(_ARROW[storage_dtype])
    values = np.asarray(values)
    if values.dtype == want:
        return values
    if arrow.kind == "u" and values.dtype.kind in "iu" and values.dtype != arrow:
        if values.size and (values.min() < 0 or values.max() > np.iinfo(arrow).max):
            raise ValueError(f"a {storage_dtype} cache stores {arrow} bits, got {values.dtype}")
        values = values.astype(arrow)
    if values.dtype != arrow:
        raise ValueError(f"a {storage_dtype} cache stores {arrow}, got {values.dtype}")
    return values.view(want)


def is_exact(source: str, storage: str) -> bool:
    """True when ``storage`` holds every finite ``source`` value exactly."""
    return source == storage or storage == "float32"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionLoss:
    """What converting latents to the storage dtype changed.

    Attributes:
        values: values converted.
        changed: values whose stored value differs from the source value.
        flushed_to_zero: nonzero source values stored as zero.
        beyond_1ulp: values that moved by more than one ulp of the storage format at
            the source value's magnitude, i.e. lost more than rounding to the format's
            mantissa: the format's subnormals and flushes (which are counted here too).
    """

    values: int = 0
    changed: int = 0
    flushed_to_zero: int = 0
    beyond_1ulp: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v < 0:
                raise ValueError(f"{f.name} must be >= 0, got {v}")

    def __add__(self, other: PrecisionLoss) -> PrecisionLoss:
        return PrecisionLoss(
            **{
                f.name: getattr(self, f.name) + getattr(other, f.name)
                for f in dataclasses.fields(self)
            }
        )

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def to_storage(values: np.ndarray, storage: str) -> tuple[np.ndarray, PrecisionLoss]:
    """Convert finite latents to ``storage`` (round to nearest even), counting the loss.

    Args:
        values: finite float16, bfloat16 (``ml_dtypes``) or float32 latents.
        storage: the storage dtype name.

    Returns:
        ``(stored, loss)``: a C-contiguous array in ``storage`` (``values`` itself when
        the dtypes already match and it is contiguous) and the :class:`PrecisionLoss`
        (all zeros for an exact conversion).

    Raises:
        OverflowError: a value exceeds the storage format's range (float16: 65504).
    """
    source = dtype_name(values.dtype)
    target = numpy_dtype(storage)
    n = int(values.size)
    if source == storage:
        return np.ascontiguousarray(values), PrecisionLoss(values=n)
    # Widening to float32 is exact; any other cast goes through float32 (exact) once, so
    # there is exactly one rounding.
    wide = values.astype(np.float32)
    if storage == "float32":
        return wide, PrecisionLoss(values=n)
    with np.errstate(over="ignore"):
        stored = wide.astype(target)
    if n and not np.isfinite(stored).all():
        big = float(np.abs(wide[~np.isfinite(stored)]).max())
        raise OverflowError(
            f"{source} latents overflow {storage} storage (|x| up to {big:g} > "
            f"{float(np.finfo(target).max):g}); use build.latent_dtype: source or float32"
        )
    return stored, _count_loss(wide.reshape(-1), stored.reshape(-1), storage)


def _count_loss(src: np.ndarray, stored: np.ndarray, storage: str) -> PrecisionLoss:
    bits = _MANTISSA_BITS[storage]
    changed = flushed = beyond = 0
    for lo in range(0, src.size, _CHUNK):
        # float64 holds every float32 exactly, and their differences and ulps too.
        x = src[lo : lo + _CHUNK].astype(np.float64)
        y = stored[lo : lo + _CHUNK].astype(np.float64)
        nonzero = x != 0
        _, exp = np.frexp(x)  # |x| = m * 2**exp with m in [0.5, 1)
        ulp = np.ldexp(1.0, exp - 1 - bits)
        changed += int(np.count_nonzero(x != y))
        flushed += int(np.count_nonzero(nonzero & (y == 0)))
        beyond += int(np.count_nonzero(nonzero & (np.abs(y - x) > ulp)))
    return PrecisionLoss(
        values=int(src.size), changed=changed, flushed_to_zero=flushed, beyond_1ulp=beyond
    )
