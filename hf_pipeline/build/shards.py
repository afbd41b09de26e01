"""Find, order, load and validate latent shards (``000000-000009.pt`` files).

A shard is untrusted input: it is only ever opened with
``torch.load(..., weights_only=True)``, so a crafted pickle cannot run code; every
structural problem becomes one :class:`~hf_pipeline.errors.CorruptShardError` line that
says what was expected and what was found.

Expected content (the KBlueLeaf/coyo11m-256px-ccrop-latent release)::

    {"keys": int64 tensor (N,), "latents": tensor (N, 3, 4, 32, 32)}

with latents in float16, bfloat16 or float32 (3 crops of a 4-channel 32x32 latent).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import pickletools
import re
import reprlib
import warnings
import zipfile

import numpy as np

# STORAGE_DTYPES: the dtypes read_shard can return (what the cache stores); defined once
# in config, re-exported here where it always was.
from hf_pipeline.cache.latents import LATENT_DTYPES, LATENT_SHAPE, STORAGE_DTYPES
from hf_pipeline.cache.precision import PrecisionLoss
from hf_pipeline.errors import CorruptShardError, SourceError

__all__ = [
    "LATENT_SHAPE",
    "STORAGE_DTYPES",
    "LoadedShard",
    "load_shard",
    "nonfinite_rows",
    "read_shard",
    "shard_header",
    "shard_latent_dtype",
]


_DIGITS = re.compile(r"(\d+)")
_GLOB_CHARS = set("*?[")


@dataclasses.dataclass(frozen=True)
class LoadedShard:
    """One validated shard, its latents in the requested storage dtype.

    Attributes:
        keys: int64 array (N,).
        latents: array (N, 3, 4, 32, 32) in the storage dtype (bfloat16 as
            ``ml_dtypes.bfloat16``), C-contiguous.
        source_dtype: the shard's own latent dtype (``"float16"``, ``"bfloat16"``,
            ``"float32"``); ``""`` for a shard without rows (saved as any 0-row
            tensors: its latents are then an empty array of the requested dtype,
            float32 for ``"source"``).
        loss: what the conversion to the storage dtype changed
            (:class:`hf_pipeline.cache.precision.PrecisionLoss`; all zeros when exact; rows
            in ``nonfinite`` are not counted).
        nonfinite: bool (N,): rows holding a NaN or inf. They are returned as they are
            (one bad row is a row-level defect the build drops under a counted reason,
            not a reason to refuse the shard).
    """

    keys: np.ndarray
    latents: np.ndarray
    source_dtype: str
    loss: PrecisionLoss
    nonfinite: np.ndarray


def read_shard(path: str | os.PathLike, *, dtype: str = "source") -> LoadedShard:
    """Load one latent shard safely, validate it, and convert it to a storage dtype.

    Only ``torch.load`` touches torch; all arithmetic is NumPy, so this is safe in forked
    worker processes. Thread- and process-safe.

    Args:
        path: the ``.pt`` file.
        dtype: ``"source"`` keeps the shard's own dtype bit for bit (bfloat16 included);
            ``"float16"``, ``"bfloat16"`` or ``"float32"`` converts (round to nearest),
            counting what changed.

    Returns:
        :class:`LoadedShard`. N may be 0: a shard whose keys and latents both have 0
        rows is empty, whatever their shapes and dtypes.

    Raises:
        CorruptShardError: unreadable file, refused pickle, wrong structure, shape,
            dtype, a tensor whose storage does not hold each of its elements once (zero
            or overlapping strides: checked before the data is touched), or finite
            values that overflow ``dtype`` (one line saying expected vs found).
        SourceError: the file does not exist or cannot be opened.
        ValueError: ``dtype`` is not one of ``LATENT_DTYPES``.
    """
    import torch

    from hf_pipeline.cache.precision import dtype_name, numpy_dtype, to_storage

    if dtype not in LATENT_DTYPES:
        raise ValueError(f"dtype must be one of {LATENT_DTYPES}, got {dtype!r}")
    path = os.fspath(path)
    keys, latents = _validated(path, _torch_load(path))
    if keys is None:  # no rows: an empty array of the dtype asked for
        empty = np.zeros((0, *LATENT_SHAPE), numpy_dtype("float32" if dtype == "source" else dtype))
        return LoadedShard(np.zeros(0, np.int64), empty, "", PrecisionLoss(), np.zeros(0, bool))
    n = keys.shape[0]
    # From here on NumPy only: this runs inside forked ``datasets`` workers, and a torch
    # op there can deadlock on the OpenMP pool the parent initialised before the fork.
    keys_np = _keys_to_int64(path, keys)
    # No .contiguous()/.to() either: on a strided (saved-view) tensor they are parallel
    # copy kernels. .numpy() and a same-width .view(dtype) are metadata only.
    raw = latents.detach()
    if raw.dtype == torch.bfloat16:
        # NumPy has no native bfloat16: take the 16 bits and view them as ml_dtypes'.
        bits = raw.view(torch.int16).numpy().view(np.uint16)
        # Non-finite bfloat16 <=> all exponent bits set; integer ops, no float copy.
        finite_values = (bits & np.uint16(0x7F80)) != np.uint16(0x7F80)
        lat = bits.view(_bfloat16())
    else:
        lat = raw.numpy()
        finite_values = np.isfinite(lat)
    finite = finite_values.reshape(n, -1).all(axis=1) if n else np.ones(0, dtype=bool)
    del finite_values
    source = dtype_name(lat.dtype)
    if dtype == "source":
        values = int(lat[finite].size) if not finite.all() else int(lat.size)
        return LoadedShard(
            keys_np, np.ascontiguousarray(lat), source, PrecisionLoss(values=values), ~finite
        )
    try:
        if finite.all():
            stored, loss = to_storage(lat, dtype)
        else:  # convert (and count) the finite rows; NaN/inf stay NaN/inf in any format
            good, loss = to_storage(lat[finite], dtype)
            stored = np.empty(lat.shape, dtype=good.dtype)
            stored[finite] = good
            with np.errstate(invalid="ignore", over="ignore"):
                stored[~finite] = lat[~finite].astype(good.dtype)
    except OverflowError as exc:
        raise CorruptShardError(path, str(exc)) from None
    return LoadedShard(keys_np, stored, source, loss, ~finite)


def load_shard(path: str | os.PathLike, *, dtype: str = "float16") -> tuple[np.ndarray, np.ndarray]:
    """Load one latent shard safely and validate it (:func:`read_shard` without the report).

    Args:
        path: the ``.pt`` file.
        dtype: storage dtype of the returned latents (``"float16"``, ``"bfloat16"``,
            ``"float32"``) or ``"source"`` for the shard's own dtype.

    Returns:
        ``(keys, latents)``: int64 array of shape (N,) and an array of shape
        (N, 3, 4, 32, 32) in ``dtype``. N may be 0.

    Rows holding NaN or inf are returned as they are: one bad row is a row-level
    defect (the build drops it under a counted reason, see :func:`nonfinite_rows`),
    not a reason to refuse the shard.

    Raises:
        As :func:`read_shard`.
    """
    shard = read_shard(path, dtype=dtype)
    return shard.keys, shard.latents


def nonfinite_rows(latents: np.ndarray) -> np.ndarray:
    """Which rows hold at least one NaN or inf value (bool array of shape (N,)).

    Args:
        latents: an array of shape (N, ...), as :func:`load_shard` returns (float16,
            float32, or ``ml_dtypes.bfloat16``).
    """
    n = latents.shape[0]
    if n == 0:
        return np.zeros(0, dtype=bool)
    if latents.dtype == _bfloat16():  # non-finite <=> all exponent bits set
        bits = latents.view(np.uint16).reshape(n, -1)
        return ((bits & np.uint16(0x7F80)) == np.uint16(0x7F80)).any(axis=1)
    return ~np.isfinite(latents.reshape(n, -1)).all(axis=1)


def shard_header(path: str | os.PathLike) -> tuple[int, str | None]:
    """``(rows, latent dtype)`` of a shard, from its header (the tensor data is not read).

    Validates the structure like :func:`read_shard` (not the values). The dtype is the
    saved latents' (``"float16"``, ``"bfloat16"``, ``"float32"``), or None for a shard
    without rows saved in another dtype (``torch.zeros(0, dtype=torch.float64)``).

    Raises:
        CorruptShardError, SourceError: as :func:`read_shard`.
    """
    path = os.fspath(path)
    # mmap: only the pickle is parsed; storages stay unread pages of the zip. Legacy
    # (non-zip) files cannot be mapped and are read whole.
    keys, latents = _validated(path, _torch_load(path, mmap=zipfile.is_zipfile(path)))
    dtype = str(latents.dtype).removeprefix("torch.")
    return (0 if keys is None else keys.shape[0]), (dtype if dtype in STORAGE_DTYPES else None)


def shard_latent_dtype(path: str | os.PathLike) -> str | None:
    """The latent dtype of a shard with rows, from its header (see :func:`shard_header`).

    None for a shard without rows: what dtype its empty tensors were saved in says
    nothing about latents it does not hold.

    Raises:
        CorruptShardError, SourceError: as :func:`read_shard`.
    """
    rows, dtype = shard_header(path)
    return dtype if rows else None


def _bfloat16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _validated(path: str, obj):
    """``(keys, latents)`` tensors of a loaded shard, or CorruptShardError.

    ``keys`` is None for a shard without rows (any 0-row tensors).
    """
    import torch

    if not isinstance(obj, dict):
        raise CorruptShardError(
            path, f"expected a dict with 'keys' and 'latents', got {type(obj).__name__}"
        )
    missing = [k for k in ("keys", "latents") if k not in obj]
    if missing:
        # Bounded: the keys are the shard's (a 50 MB key was a 52 MB error line).
        fields = [reprlib.repr(k) for k in itertools.islice(obj, 10)]
        have = ", ".join(fields + (["..."] if len(obj) > 10 else [])) or "none"
        raise CorruptShardError(
            path, f"missing field {' and '.join(map(repr, missing))} (fields present: {have})"
        )
    keys, latents = obj["keys"], obj["latents"]
    # Extra fields are tolerated: a future release adding e.g. "sizes" should not break us.
    for name, value in (("keys", keys), ("latents", latents)):
        if not isinstance(value, torch.Tensor):
            raise CorruptShardError(
                path, f"{name!r} must be a torch tensor, got {type(value).__name__}"
            )
        if value.layout != torch.strided:
            raise CorruptShardError(
                path, f"{name!r} must be a dense tensor, got layout {value.layout}"
            )

    # Before anything reads the data: a tensor is only a view (shape, strides, offset)
    # over its storage, so a few bytes can declare GBs (issue 23 item 4).
    _check_storage(path, "keys", keys)
    _check_storage(path, "latents", latents)
    if _is_empty(keys) and _is_empty(latents):
        # No rows: nothing to convert, whatever shape or dtype the empty tensors were
        # saved with (``torch.zeros(0)`` is 1-D float32; README: empty shards are fine).
        return None, latents
    if keys.dim() != 1:
        raise CorruptShardError(path, f"keys must be 1-D (N,), got shape {tuple(keys.shape)}")
    if keys.dtype.is_floating_point or keys.dtype.is_complex or keys.dtype == torch.bool:
        raise CorruptShardError(path, f"keys must be an integer tensor, got {keys.dtype}")
    n = keys.shape[0]
    if latents.dim() != 1 + len(LATENT_SHAPE) or tuple(latents.shape[1:]) != LATENT_SHAPE:
        raise CorruptShardError(
            path, f"latents must have shape (N, 3, 4, 32, 32), got {tuple(latents.shape)}"
        )
    if latents.shape[0] != n:
        raise CorruptShardError(
            path, f"latents has {latents.shape[0]} rows but keys has {n} (must match)"
        )
    if latents.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise CorruptShardError(
            path, f"latents must be float16, bfloat16 or float32, got {latents.dtype}"
        )
    return keys, latents


def _is_empty(t) -> bool:
    """A tensor of 0 rows: at least one dimension, the first of size 0."""
    return t.dim() >= 1 and t.shape[0] == 0


def _check_storage(path: str, name: str, t) -> None:
    """Refuse a tensor whose elements are not each stored once in its storage.

    Reads only the tensor's metadata (shape, strides, offset, storage size), never its
    data: a zero stride or an ``expand`` repeats stored elements, overlapping strides
    reuse them, and either way a copy (``np.ascontiguousarray``, ``isfinite``) would
    allocate for the declared shape, not the file (1.9 KB declaring 2.6 GB). A saved view
    (a slice or transpose of a larger tensor) is fine: its storage holds more than its
    elements, each once. Dimensions of size 1 may carry any stride (never stepped).
    """
    itemsize = t.element_size()
    storage = t.untyped_storage().nbytes() // itemsize  # elements the storage holds
    offset = t.storage_offset()
    shape, strides = tuple(t.shape), t.stride()
    if offset < 0 or offset > storage:
        raise CorruptShardError(
            path, f"{name}: storage offset {offset} outside its storage of {storage} elements"
        )
    if t.numel() == 0:
        return
    reach = 0  # the farthest element, relative to the offset, of the dims checked so far
    for dim in sorted((i for i, size in enumerate(shape) if size > 1), key=lambda i: strides[i]):
        size, stride = shape[dim], strides[dim]
        if stride <= 0:
            raise CorruptShardError(
                path,
                f"{name}: stride {stride} in dim {dim} of shape {shape} (repeated elements: "
                "a shard must store each element once)",
            )
        # Strides sorted ascending: each must step past everything the smaller ones reach,
        # else two indices meet at one element (a sufficient test; what slicing, transposing
        # and torch.save produce always passes it).
        if stride <= reach:
            raise CorruptShardError(
                path, f"{name}: elements overlap in storage (shape {shape}, strides {strides})"
            )
        reach += stride * (size - 1)
    if offset + reach + 1 > storage:
        raise CorruptShardError(
            path,
            f"{name}: shape {shape} needs {(offset + reach + 1) * itemsize} bytes of storage, "
            f"the file holds {storage * itemsize}",
        )


# A raw pickle (not torch.save's zip) of another protocol made torch warn ("Detected pickle
# protocol 4 in the checkpoint ...") before the one-line refusal below: noise to the user.
warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)


def _torch_load(path: str, mmap: bool = False):
    """``torch.load(weights_only=True)`` with each failure mapped to a one-line error."""
    import torch

    if not os.path.exists(path):
        raise SourceError(path, "shard file does not exist")
    _refuse_deep_pickle(path)
    try:
        return torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
    except pickle.UnpicklingError as exc:
        # weights_only's restricted unpickler refuses globals it does not allow-list;
        # that is the "malicious or non-tensor pickle" case, never to be retried unsafely.
        _refuse_if_not_torch(path)
        if "weights only" in str(exc).lower() or "weights_only" in str(exc).lower():
            # Keep only torch's reason ("unsupported GLOBAL posix.system ..."), not its
            # advice to retry with weights_only=False, which is exactly what must not happen.
            detail = _refusal_reason(str(exc))
            raise CorruptShardError(
                path,
                "not a plain tensor file (refused by torch.load(weights_only=True))"
                + (f": {detail}" if detail else ""),
            ) from None
        raise CorruptShardError(
            path, f"unreadable pickle: {_first_useful_line(str(exc))}"
        ) from None
    except (FileNotFoundError, PermissionError, IsADirectoryError) as exc:
        raise SourceError(path, f"cannot open shard: {exc.strerror or exc}") from None
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: any parser failure is "corrupt"
        # The unpickler and zip reader raise anything on garbage (RuntimeError, EOFError,
        # IndexError, UnicodeDecodeError, ...); all mean the same thing here.
        _refuse_if_not_torch(path)
        size = _size_or_none(path)
        raise CorruptShardError(
            path,
            f"not a readable torch file ({size} bytes; truncated or corrupt?): "
            f"{type(exc).__name__}: {_first_useful_line(str(exc)) or 'unexpected end of file'}",
        ) from None


def _keys_to_int64(path: str, keys) -> np.ndarray:
    """Convert an integer key tensor to int64 numpy, refusing values that do not fit."""
    import torch

    # NumPy only (fork safety, see load_shard); the copy also frees a saved view's
    # larger storage instead of pinning it.
    arr = keys.detach().numpy()
    if keys.dtype == torch.int64 or keys.dtype.is_signed or keys.dtype == torch.uint8:
        return np.array(arr, dtype=np.int64, order="C", copy=True)
    # Unsigned wider types (uint16/32/64) may not fit int64.
    if arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise CorruptShardError(path, f"keys ({keys.dtype}) exceed the int64 range")
    return arr.astype(np.int64)


def _refusal_reason(text: str) -> str:
    """The line of a weights_only refusal that names the offending global, if any."""
    for line in text.splitlines():
        low = line.lower()
        if "global" in low or "unsupported" in low:
            return line.strip()[:200]
    return ""


def _first_useful_line(text: str) -> str:
    """The first non-empty line of an exception message, trimmed for a one-line error:
    its first sentence (torch's zip reader goes on with advice), else cut at a word
    boundary within 200 characters."""
    for line in text.splitlines():
        line = line.strip()
        if line:
            end = line.find(". ")
            if 0 < end < 200:
                return line[: end + 1]
            if len(line) <= 200:
                return line
            return line[:200].rsplit(" ", 1)[0] + " ..."
    return ""


#: Nesting a shard's pickle may have (a real one: 2-3 levels): deeper is refused before
#: torch.load, whose unpickler and CPython's hashing recurse on the C stack (a tuple
#: nested 300,000 deep as a dict key, 547 KB, killed the build with SIGSEGV).
MAX_PICKLE_DEPTH = 200
#: The pickle of a zip shard (``data.pkl``; the tensors are separate records) is read
#: whole for the check; a real one is a few hundred bytes.
MAX_PICKLE_BYTES = 64 << 20


def _refuse_deep_pickle(path: str) -> None:
    """Refuse a shard whose pickle nests containers deeper than
    :data:`MAX_PICKLE_DEPTH` (or whose ``data.pkl`` is larger than
    :data:`MAX_PICKLE_BYTES`), found by walking its opcodes without building anything.
    A file that is no zip or whose pickle does not parse is left to ``torch.load``'s
    own error."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                names = [n for n in archive.namelist() if n.endswith("/data.pkl")]
                if len(names) != 1:
                    return
                info = archive.getinfo(names[0])
                if info.file_size > MAX_PICKLE_BYTES:
                    raise CorruptShardError(
                        path, f"its pickle is {info.file_size} bytes, more than {MAX_PICKLE_BYTES}"
                    )
                with archive.open(info) as data:
                    _check_pickle_depth(path, data, pickles=1)
        else:
            with open(path, "rb") as f:
                if f.read(1) != b"\x80":
                    return
                f.seek(0)
                # The legacy format: pickles (magic, protocol, sys info, the object), then
                # the storages, which are not walked (read from the file, not loaded).
                _check_pickle_depth(path, f, pickles=4)
    except CorruptShardError:
        raise
    except Exception:  # noqa: BLE001 - not parseable here: torch.load says why
        return


def _check_pickle_depth(path: str, stream, *, pickles: int) -> None:
    """Refuse ``path`` when one of the next ``pickles`` pickles of ``stream`` nests deeper
    than :data:`MAX_PICKLE_DEPTH`."""
    for _ in range(pickles):
        if _pickle_depth(pickletools.genops(stream)) > MAX_PICKLE_DEPTH:
            raise CorruptShardError(
                path,
                f"its pickle nests deeper than {MAX_PICKLE_DEPTH} levels: refused before "
                "loading (a crafted shard: loading it would overflow the stack)",
            )


def _pickle_depth(ops) -> int:
    """The deepest container nesting the pickle ``ops`` (``pickletools.genops``) build,
    from the opcodes alone; stops early past :data:`MAX_PICKLE_DEPTH`."""
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[object, int] = {}
    deepest = 0

    def take_mark() -> list[int]:
        start = marks.pop()
        items = stack[start:]
        del stack[start:]
        return items

    for op, arg, _ in ops:
        name = op.name
        if name == "STOP":
            break
        if name == "MARK":
            marks.append(len(stack))
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1] if stack else 0
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1] if stack else 0
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(arg, 0))
        elif name == "POP":
            if stack:
                stack.pop()
        elif name == "POP_MARK":
            take_mark()
        elif name == "DUP":
            stack.append(stack[-1] if stack else 0)
        elif name in ("APPEND", "SETITEM", "BUILD"):
            n = 2 if name == "SETITEM" else 1
            items = [stack.pop() for _ in range(min(n, len(stack)))]
            if stack:
                stack[-1] = max(stack[-1], max(items, default=-1) + 1)
        elif name in ("APPENDS", "SETITEMS", "ADDITEMS"):
            items = take_mark()
            if stack:
                stack[-1] = max(stack[-1], max(items, default=-1) + 1)
        else:  # builds a value from what it takes: one level above the deepest taken
            taken: list[int] = []
            before = list(op.stack_before)
            if pickletools.markobject in before:
                taken += take_mark()
                before = before[: before.index(pickletools.markobject)]
            for _ in range(min(len(before), len(stack))):
                taken.append(stack.pop())
            level = max(taken, default=-1) + 1
            stack.extend([level] * len(op.stack_after))
        if stack and stack[-1] > deepest:
            deepest = stack[-1]
            if deepest > MAX_PICKLE_DEPTH:
                break
    return deepest


def _refuse_if_not_torch(path: str) -> None:
    """Refuse a file that ``torch.save`` cannot have written: neither a zip archive nor
    a pickle of protocol 2 or later (the legacy format), by its first bytes. Such bytes
    reach the legacy unpickler, which refused them as an "Unsupported operand" (a safety
    refusal, which is not what happened) or with an IndexError. Empty or unreadable
    files are left to the caller's message."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return
    if head and not (head.startswith(b"PK") or head[:1] == b"\x80"):
        raise CorruptShardError(
            path,
            f"not a torch file ({_size_or_none(path)} bytes, neither torch.save's zip "
            "archive nor a pickle)",
        )


def _size_or_none(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None
