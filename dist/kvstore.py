"""The job's key-value store (torch.distributed's TCPStore or JAX's coordination
service), for sharing small values between the ranks of one job.

:func:`job_store` finds the store of an initialised ``torch.distributed`` or
``jax.distributed`` job (None otherwise). Values are bytes; :meth:`JobStore.get` waits
for a key with a deadline, so a rank whose publisher died is never stuck forever.

:func:`job_client` is how both this module and :mod:`dist.doorbell` find the job's
store; :func:`private_torch_store` gives each a client of its own with its own timeout.

:func:`launch_store` also finds a store where no process group is initialised yet but
a launcher started the ranks: torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``
at ``MASTER_ADDR:MASTER_PORT``; keys under the run id and restart count, so a restarted
attempt never reads the last one's values). :class:`FileJobStore` is a job's store in
a folder every rank shares (the cache root), for launchers that give a job id
(:func:`launch_job_id`) but no store.
"""

from __future__ import annotations

import base64
import datetime
import errno
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dist.markers import MAX_JSON_BYTES, read_regular_bytes
from dist.safepath import own_folder

__all__ = [
    "JOBS_DIR",
    "FileJobStore",
    "JobStore",
    "job_client",
    "job_store",
    "launch_job_id",
    "launch_store",
    "private_torch_store",
]

logger = logging.getLogger(__name__)


class JobStore:
    """``set(key, bytes)`` / ``get(key, timeout)`` on a torch Store or a JAX client."""

    def __init__(self, store: Any, prefix: str = ""):
        self._store = store
        self._jax = not hasattr(store, "add")
        self._prefix = prefix

    def set(self, key: str, value: bytes) -> None:
        key = self._prefix + key
        if self._jax:
            self._store.key_value_set(key, base64.b64encode(value).decode("ascii"))
        else:
            self._store.set(key, value)

    def get(self, key: str, timeout: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to be set.

        Raises:
            TimeoutError: not set in time.
        """
        key = self._prefix + key
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
    from dist.env import imported_module

    torch_dist = imported_module("torch.distributed")  # never one a thread is importing
    try:
        if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
            from torch.distributed import distributed_c10d

            return torch_client(distributed_c10d._get_default_store())
    except Exception as e:
        logger.warning("no torch.distributed %s: %s", what, e)
    if "jax" in sys.modules:
        try:
            from jax._src import distributed as jax_dist

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
    if isinstance(base, td.TCPStore):  # type: ignore[attr-defined]  # torch re-exports it without __all__
        return td.TCPStore(  # type: ignore[attr-defined]  # torch re-exports it without __all__
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


def launch_store(environ: Mapping[str, str] | None = None) -> JobStore | None:
    """The job's store: that of an initialised torch/jax job (:func:`job_store`), else
    torchrun's agent store, else None.

    torchrun's agent hosts a TCPStore at ``MASTER_ADDR:MASTER_PORT`` for its whole run
    and says so with ``TORCHELASTIC_USE_AGENT_STORE=True``; its workers may connect as
    clients (``init_process_group`` does the same later). Without that variable nobody
    is known to host a store at ``MASTER_PORT`` (the program's own
    ``init_process_group`` will bind it), so none is made up.

    Raises:
        TimeoutError: the agent store did not answer within 30 s.
    """
    store = job_store()
    if store is not None:
        return store
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        return None
    import torch.distributed as td

    try:
        client = td.TCPStore(  # type: ignore[attr-defined]  # torch re-exports it without __all__
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30)
        )
    except Exception as e:  # torch raises its own DistStoreError / RuntimeError types
        raise TimeoutError(f"torchrun's store at {host}:{port} did not answer: {e}") from e
    client.set_timeout(datetime.timedelta(hours=1))  # get() bounds each wait itself
    run = f"{env.get('TORCHELASTIC_RUN_ID', 'none')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return JobStore(client, prefix=f"hf_pipeline/{run}/")


def launch_job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """An id unique to this launch of the job, from the launcher's variables; None when
    the launcher gives none (plain ``RANK``/``WORLD_SIZE``).

    ``HF_PIPELINE_JOB_ID`` (set it to something new for every launch), else SLURM's job
    and step ids with its restart count (``SLURM_JOB_ID``, ``SLURM_STEP_ID``,
    ``SLURM_RESTART_COUNT``), else torchrun's run id with its restart count (a fresh
    uuid for every ``torchrun`` unless ``--rdzv-id`` names one). ``MASTER_ADDR:PORT``
    alone is not an id: the next job on the same host reuses it.
    """
    env = os.environ if environ is None else environ
    if env.get("HF_PIPELINE_JOB_ID"):
        return "user-" + env["HF_PIPELINE_JOB_ID"]
    if env.get("SLURM_JOB_ID"):
        return "slurm-" + "-".join(
            env.get(k, "0") for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT")
        )
    run = env.get("TORCHELASTIC_RUN_ID", "")
    if run and run != "none":
        return f"torchrun-{run}-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return None


#: The folder of a shared root holding one :class:`FileJobStore` folder per launch
#: (``<root>/.jobs/<launch id>/``): ``--status`` and ``--clean`` look there.
JOBS_DIR = ".jobs"

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class FileJobStore:
    """A job's key-value store as files in a folder every rank can read and write.

    ``set`` publishes once (:func:`dist.atomic.create_new`: a key already set raises
    :class:`FileExistsError`, so a job id reused by a later launch is noticed rather
    than its stale values read); ``get`` polls for the file with a deadline. For small values (agreement posts),
    not for anything a rank would unpickle: anyone who can write the folder can write
    a value. Process-safe.
    """

    def __init__(self, folder: Path, poll_interval: float = 0.05, *, base: Path | None = None):
        self.folder = Path(folder)
        #: The user's folder ``folder`` lies in (the cache root of ``<root>/.jobs/<id>``),
        #: which may be a symlink; the folders below it are made as real folders.
        self.base = self.folder.parent if base is None else Path(base)
        self._poll = poll_interval

    def _path(self, key: str) -> Path:
        return self.folder / _UNSAFE.sub("_", key.replace("/", "~"))

    def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` at ``key``.

        Raises:
            FileExistsError: ``key`` was set before (by this launch or an earlier one).
        """
        from dist.atomic import create_new

        # Real folders below the root (a link someone put there is refused).
        own_folder(self.base, os.path.relpath(self.folder, self.base).replace(os.sep, "/"))
        path = self._path(key)
        if not create_new(path, value, durable=False):
            raise FileExistsError(errno.EEXIST, "job store key already set", str(path))

    def get(self, key: str, timeout: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to appear.

        Raises:
            TimeoutError: not set in time.
        """
        path, deadline = self._path(key), time.monotonic() + timeout
        while True:
            try:
                # Bounded; a fifo or device in the job folder reads as garbage, never waits.
                return read_regular_bytes(path, MAX_JSON_BYTES) or b""
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{path}: not written within {timeout:g}s") from None
            time.sleep(self._poll)
