"""Retry policy for store calls: which failures are transient, backoff with jitter.

Every call to a remote store (listing, stat, revision lookup, ranged read, download)
goes through :func:`with_retries` with a :class:`RetryPolicy`. A failure is retried
only when :func:`is_transient` says a retry may cure it (5xx, 429, timeouts, resets,
a truncated or corrupt body); "not found" or "forbidden" fail at once with a
:class:`~hf_pipeline.errors.SourceError`. When the retries run out the store is called
unreachable (:class:`~hf_pipeline.errors.StoreUnreachableError`: a fault, exit code 1,
not bad input).

Two signal types travel through the retry loop: :class:`TransientError`, raised by
our own checks (a size or checksum mismatch) to ask for another attempt, and
:class:`Cancelled`, raised when the owner of a download is closing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from hf_pipeline.errors import SourceError, StoreUnreachableError

if TYPE_CHECKING:  # pragma: no cover
    from hf_pipeline.config import DataConfig

__all__ = [
    "Cancelled",
    "RetryPolicy",
    "ShortObjectError",
    "TransientError",
    "check_deadline",
    "describe_error",
    "http_status",
    "is_transient",
    "with_retries",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: HTTP statuses a retry may cure: timeouts, rate limits, server-side failures.
_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}


class TransientError(OSError):
    """A failure worth retrying (5xx, 429, timeout, reset, truncated or corrupt body)."""


class ShortObjectError(OSError):
    """The object ends before a range asked of it does, by the store's own word (a
    ``206``'s ``Content-Range`` gives the object's size): no retry cures that, unlike a
    body cut short by the connection. Picklable.

    Attributes:
        path: the object's URL.
        size: its size, as the store said it.
    """

    def __init__(self, path: str, size: int):
        super().__init__(f"{path}: the object has {size} bytes")
        self.path, self.size = path, size

    def __reduce__(self):
        return (type(self), (self.path, self.size))


class Cancelled(Exception):
    """The owner of a download is closing; abandon it quietly (never a user error)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How hard to try for one file.

    Attributes:
        max_retries: retries after the first attempt (0: one attempt only).
        file_timeout: seconds one attempt at one file may take, stalls included.
        backoff_base: first backoff delay in seconds; doubles per retry.
        backoff_max: cap on one delay.
    """

    max_retries: int = 5
    file_timeout: float = 600.0
    backoff_base: float = 0.5
    backoff_max: float = 30.0

    def __post_init__(self):
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.file_timeout <= 0:
            raise ValueError(f"file_timeout must be > 0, got {self.file_timeout}")
        if self.backoff_base < 0:
            raise ValueError(f"backoff_base must be >= 0, got {self.backoff_base}")

    def delay(self, attempt: int) -> float:
        """Backoff before retry ``attempt`` (1-based): exponential with full jitter.

        Full jitter (uniform in [d/2, d]) spreads out many clients hitting a store that
        just came back, instead of retrying in lock-step.
        """
        ceiling = min(self.backoff_max, self.backoff_base * (2 ** (attempt - 1)))
        return ceiling * (0.5 + 0.5 * random.random())

    @classmethod
    def from_config(cls, data_config: DataConfig, **overrides: Any) -> RetryPolicy:
        """The policy a :class:`~hf_pipeline.config.DataConfig` asks for."""
        kw: dict[str, Any] = {
            "max_retries": data_config.max_retries,
            "file_timeout": data_config.file_timeout,
        }
        kw.update(overrides)
        return cls(**kw)


def http_status(exc: BaseException) -> int | None:
    """HTTP status carried by an exception from gcsfs, huggingface_hub or httpx."""
    for attr in ("code", "status", "status_code"):
        value = getattr(exc, attr, None)
        with contextlib.suppress(TypeError, ValueError):
            if value is not None:
                return int(value)
    resp = getattr(exc, "response", None)
    value = getattr(resp, "status_code", None)
    return int(value) if isinstance(value, int) else None


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure a retry may cure.

    Not found / forbidden / bad request are permanent: retrying a 404 five times only
    delays the clear error the user needs.
    """
    if isinstance(exc, TransientError | TimeoutError | ConnectionError):
        return True
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError):
        return False
    status = http_status(exc)
    if status is not None:
        return status in _RETRY_STATUS
    mod = type(exc).__module__ or ""
    name = type(exc).__name__
    # aiohttp (gcsfs), httpx2 (huggingface_hub), requests (gcsfs maps 502 to ProxyError):
    # their transport errors all mean "the connection failed", never "the data is wrong".
    if mod.startswith(("aiohttp", "httpx", "requests", "urllib3")):
        return not name.startswith(("InvalidURL", "UnsupportedProtocol", "InvalidHeader"))
    if name in ("ChecksumError", "ProxyError", "ServerDisconnectedError"):
        return True
    # huggingface_hub's http_get raises a plain OSError on a size mismatch.
    if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
        return True
    return False


def describe_error(exc: BaseException) -> str:
    """``"<type>: <first line of the message>"`` (the type alone without a message)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def check_deadline(deadline: float, what: str, file_timeout: float) -> None:
    """Raise :class:`TimeoutError` (transient) once ``time.monotonic()`` passed ``deadline``.

    Args:
        deadline: ``time.monotonic()`` value the attempt must finish by.
        what: URL or path, for the message.
        file_timeout: the per-file timeout the deadline came from, for the message.
    """
    if time.monotonic() > deadline:
        raise TimeoutError(f"{what}: per-file timeout of {file_timeout:g}s exceeded")


def with_retries(
    what: str,
    fn: Callable[[], _T],
    policy: RetryPolicy,
    *,
    on_retry: Callable[[BaseException], None] | None = None,
    stop: threading.Event | None = None,
    log_retries: bool = True,
) -> _T:
    """Call ``fn`` until it succeeds, retrying transient failures with backoff.

    Thread-safe (keeps no state between calls).

    Args:
        what: URL or path, for the error message.
        fn: the attempt; raises on failure.
        policy: retry count and backoff.
        on_retry: called with each exception that will be retried (stats).
        stop: abandon between attempts when set (raises :class:`Cancelled`).
        log_retries: log each retry (INFO); False where ``on_retry`` says them itself
            (a stream's many reads, said in a bounded number of lines).

    Returns:
        What ``fn`` returned.

    Raises:
        SourceError: permanent failure (not found, forbidden, ...); names ``what``.
        StoreUnreachableError: transient failures until the retries ran out (the
            store is down or unreachable: a fault, not bad input); names ``what`` and
            the last failure.
        Cancelled: ``stop`` was set.
    """
    attempt = 0
    while True:
        if stop is not None and stop.is_set():
            raise Cancelled(what)
        try:
            return fn()
        except Cancelled:
            raise
        except SourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified right below
            if not is_transient(exc):
                raise SourceError(what, f"{describe_error(exc)} (not retried)") from exc
            if attempt >= policy.max_retries:
                raise StoreUnreachableError(
                    what,
                    f"failed after {attempt + 1} attempt(s); last error: {describe_error(exc)}",
                ) from exc
            attempt += 1
            if on_retry is not None:
                on_retry(exc)
            delay = policy.delay(attempt)
            if log_retries:
                logger.info(
                    "retry %d/%d for %s in %.2fs: %s",
                    attempt,
                    policy.max_retries,
                    what,
                    delay,
                    describe_error(exc),
                )
            if stop is not None:
                if stop.wait(delay):
                    raise Cancelled(what) from exc
            else:
                time.sleep(delay)
