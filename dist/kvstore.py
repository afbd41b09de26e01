"""The job's key-value store (torch.distributed's TCPStore or JAX's coordination
service), for sharing small values between the ranks of one job.

:func:`job_store` finds the store of an initialised ``torch.distributed`` or
``jax.distributed`` job (None otherwise). Values are bytes; :meth:`JobStore.get` waits
for a key with a deadline, so a rank whose publisher died is never stuck forever.
"""

from __future__ import annotations

import base64
import datetime
import logging
import sys
from typing import Any

from dist.doorbell import private_torch_store

__all__ = ["JobStore", "job_store"]

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


def job_store() -> JobStore | None:
    """The store of an initialised torch.distributed / jax.distributed job, or None."""
    torch_dist = sys.modules.get("torch.distributed")
    try:
        if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
            from torch.distributed import distributed_c10d

            store = distributed_c10d._get_default_store()
            while hasattr(store, "underlying_store"):  # PrefixStore
                store = store.underlying_store
            return JobStore(_with_long_timeout(store))
    except Exception as e:
        logger.warning("no torch.distributed store: %s", e)
    if "jax" in sys.modules:
        try:
            from jax._src import distributed as jax_dist  # type: ignore[import-not-found]

            client = getattr(jax_dist.global_state, "client", None)
            if client is not None:
                return JobStore(client)
        except Exception as e:
            logger.warning("no jax.distributed store: %s", e)
    return None


def _with_long_timeout(store: Any) -> Any:
    # Our own client: its timeout bounds a get() whose publisher is slow (a listing of
    # 10k shards on a busy Hub), unlike the doorbell's short-timeout client.
    client = private_torch_store(store)
    if hasattr(client, "set_timeout"):
        client.set_timeout(datetime.timedelta(hours=1))
    return client
