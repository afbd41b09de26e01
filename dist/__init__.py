"""Distributed coordination: who am I, marker files, "exactly one builds" protocol.

Knows nothing of datasets or JAX models. One mechanism per module:

- ``env``: who am I (rank, world size, local rank, node) from the launcher's variables;
- ``atomic``: publish a file atomically (replace, or create-if-absent);
- ``markers``: marker files (a published stage and its files), strict read, validation;
- ``lease``: the builder's lease file and heartbeat;
- ``layout``: what lives in a cache folder and which folders of a root are caches;
- ``kvstore``: find the job's key-value store (torch.distributed, jax.distributed) and
  share small values through it;
- ``doorbell``: wake waiters through that store;
- ``errors``: the protocol's exceptions;
- ``coordinator``: the "exactly one builds, everyone gets the result" protocol;
- ``inventory``: status, verify and clean for operators.
"""

from dist.atomic import atomic_write, fsync_dir, write_json_atomic
from dist.coordinator import Stage, StageContext, default_builder, ensure_built
from dist.doorbell import Doorbell, StoreDoorbell
from dist.env import EnvironmentConflictError, ProcessInfo, detect
from dist.errors import (
    BuildFailedError,
    CacheWaitTimeout,
    ForeignCacheFolderError,
    LeaseLostError,
    ReadOnlyCacheError,
)
from dist.markers import FileEntry, Marker, publish_marker, read_marker, write_marker

__all__ = [
    "BuildFailedError",
    "CacheWaitTimeout",
    "Doorbell",
    "EnvironmentConflictError",
    "FileEntry",
    "ForeignCacheFolderError",
    "LeaseLostError",
    "Marker",
    "ProcessInfo",
    "ReadOnlyCacheError",
    "Stage",
    "StageContext",
    "StoreDoorbell",
    "atomic_write",
    "default_builder",
    "detect",
    "ensure_built",
    "fsync_dir",
    "publish_marker",
    "read_marker",
    "write_json_atomic",
    "write_marker",
]
