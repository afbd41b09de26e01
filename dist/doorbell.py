"""Wake waiters through the job's key-value store instead of making them poll.

A :class:`Doorbell` is a faster sleep, never a barrier: the builder rings it after
publishing (or failing) and waiters check it between their filesystem polls. A barrier
that the builder never reaches (SIGKILL) would hang every rank until the process group's
timeout; a store wait with a short timeout cannot. :func:`auto_doorbell` finds the
store of an initialised ``torch.distributed`` (TCPStore) or ``jax.distributed`` (the
coordination service) job through :func:`dist.kvstore.job_client`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import xxhash

from dist.kvstore import job_client, private_torch_store

__all__ = ["Doorbell", "StoreDoorbell", "auto_doorbell"]


class Doorbell(Protocol):
    """A job-wide wake-up signal: ``token()`` before checking, then ``rung(token)``.

    ``rung`` must be cheap and non-blocking (it is called every few hundred ms while
    waiting); it is True once ``ring()`` was called after ``token()`` was taken.
    Any exception drops the doorbell for the rest of the call (plain polling).
    """

    def token(self) -> Any: ...

    def rung(self, token: Any) -> bool: ...

    def ring(self) -> None: ...


class StoreDoorbell:
    """Doorbell on a key-value store: a ``torch.distributed`` Store or a JAX client.

    Generations: ``token()`` reads counter n; ``ring()`` increments it to m and sets key
    ``ring/m``; ``rung(n)`` checks whether ``ring/n+1`` exists. A ring between the token
    and the check is therefore never missed. Only non-blocking store calls are used:
    blocking waits with a timeout make c10d log a warning on every timeout, and hold the
    store client (shared with the process group) for their whole duration.
    """

    def __init__(self, store: Any, key: str):
        self._store = store
        self._key = key
        self._jax = not hasattr(store, "add")

    def token(self) -> int:
        if self._jax:
            return int(self._store.key_value_increment(f"{self._key}/gen", 0))
        return int(self._store.add(f"{self._key}/gen", 0))

    def rung(self, token: int) -> bool:
        key = f"{self._key}/ring/{token + 1}"
        if self._jax:
            try:
                self._store.key_value_try_get(key)
            except Exception as e:  # NOT_FOUND is an exception in this API
                if "not found" in str(e).lower() or "not_found" in str(e).lower():
                    return False
                raise
            return True
        return bool(self._store.check([key]))

    def ring(self) -> None:
        if self._jax:
            g = int(self._store.key_value_increment(f"{self._key}/gen", 1))
            self._store.key_value_set(f"{self._key}/ring/{g}", "1")
        else:
            g = int(self._store.add(f"{self._key}/gen", 1))
            self._store.set(f"{self._key}/ring/{g}", "1")


def auto_doorbell(cache_dir: Path, fingerprint: str) -> Doorbell | None:
    key = "dist.ensure_built/" + xxhash.xxh64(f"{cache_dir}\0{fingerprint}".encode()).hexdigest()
    client = job_client(private_torch_store, "doorbell, polling only")
    return None if client is None else StoreDoorbell(client, key)
