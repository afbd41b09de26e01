"""An exception as torch's DataLoader hands a worker's exception back to the main
process (its own ``ExceptionWrapper``: rebuilt from one message string), without
starting workers."""

from __future__ import annotations


def worker_reraised(error: BaseException) -> BaseException:
    """What ``except`` sees in the main process when a DataLoader worker raised ``error``
    (torch's ``ExceptionWrapper.reraise``; a RuntimeError where the rebuild failed)."""
    from torch._utils import ExceptionWrapper

    try:
        raise error
    except type(error):
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    try:
        wrapped.reraise()
    except BaseException as got:  # noqa: BLE001 - returned for the caller's assertions
        return got
    raise AssertionError("ExceptionWrapper.reraise did not raise")
