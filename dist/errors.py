"""The errors of the ``dist`` protocol; each subclasses the nearest built-in and pickles.

They cross process boundaries (a stage build running in a worker pool, a test's rank
process), so every one carries its path as an attribute and survives ``pickle``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BuildFailedError",
    "CacheWaitTimeout",
    "ForeignCacheFolderError",
    "LeaseLostError",
    "ReadOnlyCacheError",
]


class BuildFailedError(RuntimeError):
    """The builder's stage build raised; raised in the processes that waited for it.

    Attributes:
        path: the cache folder.
        lease_id, host, pid: the failed builder.
        error_type: the builder's exception type name (``"OSError"``).
        reason: the builder's exception message.
        input_error: the builder's error was the input's (its type has a true
            ``input_error``): scripts exit with the input's code (2), as the builder.
    """

    def __init__(
        self,
        message: str,
        path: str = "",
        *,
        lease_id: str | None = None,
        host: str | None = None,
        pid: int | None = None,
        error_type: str | None = None,
        reason: str | None = None,
        input_error: bool = False,
    ):
        super().__init__(message)
        self.input_error = bool(input_error)
        self.path = str(path)
        self.lease_id = lease_id
        self.host = host
        self.pid = pid
        self.error_type = error_type
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = {
            "lease_id": self.lease_id,
            "host": self.host,
            "pid": self.pid,
            "error_type": self.error_type,
            "reason": self.reason,
            "input_error": self.input_error,
        }
        return (_rebuild_build_failed, (self.args[0], self.path, kwargs))


def _rebuild_build_failed(message: str, path: str, kwargs: dict[str, Any]) -> BuildFailedError:
    return BuildFailedError(message, path, **kwargs)


class _MessagePathError(Exception):
    """Mixin: ``(message, path)``; ``str()`` is the message; pickles with both.

    Put it before the built-in base (``class X(_MessagePathError, TimeoutError)``).
    Built from the message alone (how torch's ``DataLoader`` re-raises a worker's
    exception: ``type(e)(text)``), ``path`` is empty and the type survives.
    """

    def __init__(self, message: str, path: str = ""):
        super().__init__(message)
        self.path = str(path)

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.path))


class CacheWaitTimeout(_MessagePathError, TimeoutError):
    """Waited ``max_wait`` seconds and the cache did not become complete.

    Attributes:
        path: the marker that never became valid.
    """


class ReadOnlyCacheError(_MessagePathError, PermissionError):
    """The cache is incomplete and this process cannot write to its folder.

    Attributes:
        path: the cache folder.
    """


class ForeignCacheFolderError(_MessagePathError, ValueError):
    """The cache folder holds an identity file of another fingerprint (copied, renamed,
    or planted): not this cache's folder, so nothing is built into it or read from it.
    Also: a symlink or a file where hf_pipeline keeps a folder of its own (a cache
    folder, ``.staging``, ``.parts``...: :func:`dist.safepath.own_folder`), which it
    never writes or removes through.

    Attributes:
        path: the folder (or the link in its place).
    """


class LeaseLostError(RuntimeError):
    """This process was the builder but another process took its lease over.

    Handled inside :func:`dist.coordinator.ensure_built` (the process goes back to
    waiting); stage builds raise it from :meth:`StageContext.check_ownership` (or a
    :class:`dist.lease.LeaseProbe` in their worker processes) to stop early.

    Attributes:
        path: the cache folder.
        lease_id: the lost lease.
    """

    def __init__(self, message: str, path: str = "", lease_id: str = ""):
        super().__init__(message)
        self.path = str(path)
        self.lease_id = lease_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.path, self.lease_id))
