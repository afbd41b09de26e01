"""The few exceptions hf_pipeline raises for bad input.

Each subclasses the nearest built-in and :class:`UserError`, carries the offending
path or field as an attribute, pickles (they cross ``datasets`` worker process
boundaries), and is built from one message string too: torch's ``DataLoader``
re-raises a worker's exception as ``type(e)(message)``, so ``except`` clauses naming
these types work there. Scripts print a :class:`UserError` as one line and exit with 2,
except :class:`StoreUnreachableError`: a store that did not answer is a fault of the
environment, not of the input, so scripts exit with code 1 for it.
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = [
    "CacheFormatError",
    "ConfigError",
    "CorruptShardError",
    "MetadataError",
    "SourceError",
    "StoreUnreachableError",
    "UserError",
    "shown",
]


_REPR = reprlib.Repr()
_REPR.maxlevel = 2
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlong = 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4


def shown(value: Any) -> str:
    """A bounded repr of a value for error messages: at most ~120 characters.

    Every config and option message prints values through this, so a hostile value (a
    YAML that expands to a gigabyte, a 10**6-character string, a 5000-digit integer)
    costs a short line, never the whole value. The repr walks at most a few items of a container.
    """
    try:
        text = _REPR.repr(value)
    except ValueError:  # str() of an int over sys.get_int_max_str_digits() digits
        size = value.bit_length() if isinstance(value, int) else "?"
        text = f"<{type(value).__name__} of {size} bits>"
    return text if len(text) <= 120 else text[:117] + "..."


class UserError(Exception):
    """Mixin: an error caused by input or configuration, shown without a traceback.

    ``input_error``: the builder's failure record says so, and the ranks that waited for
    it exit with 2 as the builder does (``dist.errors.BuildFailedError.input_error``).
    """

    input_error = True


class ConfigError(UserError, ValueError):
    """A configuration value is missing or invalid.

    Attributes:
        field: dotted config field name (``"loader.global_batch_size"``), or None.
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    def __reduce__(self):
        return (type(self), (self.args[0], self.field))


class _PathError(UserError):
    """Mixin: an error about one file or URL, ``"<path>: <message>"``, picklable.

    Subclasses also inherit the nearest built-in (``ValueError``, ``OSError``) after it.

    Built from one string (``type(e)(text)``: how torch's ``DataLoader`` re-raises a
    worker's exception), the string is the whole message and ``path`` is empty: the
    type survives, so ``except StoreUnreachableError`` still catches it.

    Attributes:
        path: the offending file or URL, as a string ("" when built from one string).
        reason: the message without the path.
    """

    def __init__(self, path: str, message: str | None = None):
        if message is None:
            super().__init__(str(path))
            self.path, self.reason = "", str(path)
        else:
            super().__init__(f"{path}: {message}")
            self.path, self.reason = str(path), message

    def __reduce__(self):
        return (type(self), (self.path, self.reason) if self.path else (self.reason,))


class CorruptShardError(_PathError, ValueError):
    """A latent shard is unreadable or does not have the expected keys/shape/dtype.

    Attributes:
        path: the shard file.
    """


class MetadataError(_PathError, ValueError):
    """The caption metadata table is unreadable or lacks a required column.

    Attributes:
        path: the metadata file.
    """


class CacheFormatError(_PathError, ValueError):
    """A cache file is missing, unreadable, or lacks the expected column or layout.

    Attributes:
        path: the offending file (or the first file of a group).
        reason: what is wrong with it.
    """


class SourceError(_PathError, OSError):
    """A source location cannot be listed or a file cannot be fetched.

    Attributes:
        path: the URL or path that failed.
    """


class StoreUnreachableError(SourceError):
    """A store did not answer: connection failures, timeouts or 5xx after every retry.

    Still a :class:`SourceError`, so ``data.on_missing: skip`` and ``data.local_mirror``
    treat it like any failed file; but it says nothing about the user's input (the
    same command may work in a minute), so scripts exit with code 1, not 2. A store
    that answers "not found" or "forbidden" raises a plain :class:`SourceError`.

    Attributes:
        path: the URL or path that failed.
    """

    input_error = False
