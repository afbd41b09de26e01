"""Distributed coordination: who am I, marker files, "exactly one builds" protocol.

Knows nothing of datasets or JAX models; see ``dist.coordinator`` for the protocol.
"""

from dist.atomic import atomic_write, fsync_dir, write_json_atomic
from dist.coordinator import (
    BuildFailedError,
    CacheWaitTimeout,
    Doorbell,
    LeaseLostError,
    ReadOnlyCacheError,
    Stage,
    StageContext,
    StoreDoorbell,
    default_builder,
    ensure_built,
)
from dist.env import EnvironmentConflictError, ProcessInfo, detect
from dist.markers import FileEntry, Marker, read_marker, write_marker

__all__ = [
    "BuildFailedError",
    "CacheWaitTimeout",
    "Doorbell",
    "EnvironmentConflictError",
    "FileEntry",
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
    "read_marker",
    "write_json_atomic",
    "write_marker",
]
