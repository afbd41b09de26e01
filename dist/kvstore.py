"""The job's key-value store (torch.distributed's TCPStore or JAX's coordination
service), for sharing small values between the ranks of one job.

:func:`job_store` finds the store of an initialised ``torch.distributed`` or
``jax.distributed`` job (None otherwise). Values are bytes; :meth:`JobStore.get` waits
for a key with a deadline, so a rank whose publisher died is never stuck forever.

:func:`job_client` is how both this module and :mod:`dist.doorbell` find the job's
store; :func:`private_torch_store` gives each a client of its own with its own timeout.
"""

from __future__ import annotations

import base64
import datetime
import logging
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["JobStore", "job_client", "job_store", "private_torch_store"]

logger = logging.getLogger("dist")


class JobStore:
    """``set(key, bytes)`` / ``get(key, timeout)`` on a torch Store or a JAX client."""

    def __init__(self, store: Any):
        self._store = store
        self._jax = not hasattr(store, "add")

    def set(self, key: str, value: bytes) -> None:
        if self._jax:
            self._store.key_value_set(key, base64.b64encode(value).decode("ascii"))
        else:
            self._store.set(key, value)

    def get(self, key: str, timeout: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to be set.

        Raises:
            TimeoutError: not set in time.
        """
        try:
            if self._jax:
                raw = self._store.blocking_key_value_get(key, int(timeout * 1000))
                return base64.b64decode(raw)
            self._store.wait([key], datetime.timedelta(seconds=timeout))
            return bytes(self._store.get(key))
        except Exception as e:  # both raise their own types on a timeout
            if "timeout" in str(e).lower() or "deadline" in str(e).lower():
                raise TimeoutError(f"job store: {key!r} was not set within {timeout}s") from e
            raise


def job_client(torch_client: Callable[[Any], Any], what: str) -> Any | None:
    """The client of an initialised job's key-value store, or None.

    ``torch.distributed`` first: its default store, made into the client the caller
    wants by ``torch_client``; else ``jax.distributed``: its coordination service
    client. Neither library is imported here (a job that uses one has imported it).

    Args:
        torch_client: ``torch_client(default_store)`` is the client to use.
        what: what the caller makes of the store, for the warning when there is none
            to be had (``"no torch.distributed <what>: <error>"``).
    """
    torch_dist = sys.modules.get("torch.distributed")
    try:
        if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
            from torch.distributed import distributed_c10d

            return torch_client(distributed_c10d._get_default_store())
    except Exception as e:
        logger.warning("no torch.distributed %s: %s", what, e)
    if "jax" in sys.modules:
        try:
            from jax._src import distributed as jax_dist  # type: ignore[import-not-found]

            client = getattr(jax_dist.global_state, "client", None)
            if client is not None:
                return client
        except Exception as e:
            logger.warning("no jax.distributed %s: %s", what, e)
    return None


def job_store() -> JobStore | None:
    """The store of an initialised torch.distributed / jax.distributed job, or None."""
    client = job_client(_long_timeout_client, "store")
    return None if client is None else JobStore(client)


def _base_store(store: Any) -> Any:
    while hasattr(store, "underlying_store"):  # PrefixStore
        store = store.underlying_store
    return store


def private_torch_store(store: Any) -> Any:
    """Our own client of the job's TCPStore, with a short timeout.

    The process group's client has the group's timeout (30 min for gloo): if rank 0's
    host were partitioned away, a store call on it could block a waiter that long. Our
    client gives up after 5 s, and we then drop the doorbell and poll the filesystem.
    """
    import torch.distributed as td

    base = _base_store(store)
    if isinstance(base, td.TCPStore):
        return td.TCPStore(
            base.host, base.port, is_master=False, timeout=datetime.timedelta(seconds=5)
        )
    return store  # FileStore/HashStore: local, cannot hang on the network


def _long_timeout_client(store: Any) -> Any:
    # Our own client: its timeout bounds a get() whose publisher is slow (a listing of
    # 10k shards on a busy Hub), unlike the doorbell's short-timeout client.
    client = private_torch_store(_base_store(store))
    if hasattr(client, "set_timeout"):
        client.set_timeout(datetime.timedelta(hours=1))
    return client
