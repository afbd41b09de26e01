"""Exactly one process builds a cache, every process gets it, crashes included.

:func:`ensure_built` runs a list of :class:`Stage` s (``"converted"``, then
``"filtered"``) into ``cache_dir`` so that exactly one process builds, the others wait,
and a builder that dies (SIGKILL, lost node, full disk) is noticed and replaced.
It works on local disks and on NFS/Lustre: it relies only on ``O_CREAT|O_EXCL``,
``rename`` and ``link`` being atomic on one filesystem, never on ``flock``, and never
compares another host's clock (or file mtimes) with the local clock.

Layout of ``cache_dir`` (one cache = one fingerprint; the caller picks the folder,
e.g. ``root/<name>-<fingerprint>``)::

    <stage>/                  published stage output (only ever created by one rename)
    <stage>.json              marker: the stage is complete (dist.markers)
    <stage>.tmp-<lease id>/   private build folder of one lease; never published if dead
    lease                     the claim: JSON {lease_id, host, pid}, created O_EXCL, never
                              rewritten in place
    heartbeat-<lease id>.json the builder's heartbeat: counter, stage, phase (os.replace)
    failed-<lease id>.json    failure record of a lease whose build raised
    lease.dead-*, lease.takeover-*, lease.released-*, <stage>.trash-*: bookkeeping

Protocol
--------
*Ownership.* The builder is, by definition, the process whose lease id is in the file
``lease``. It is claimed with ``O_CREAT|O_EXCL`` (one winner). The heartbeat lives in a
separate per-lease file rather than in ``lease`` itself: if heartbeats rewrote ``lease``
with ``os.replace``, a builder that was merely paused (GC, SIGSTOP, NFS hang) would, on
waking, resurrect its lease over the one of the process that took over. A per-lease
heartbeat file can only ever describe its own lease.

*Election.* The preferred builder (``builder=True``; by default rank 0) claims at once.
Other processes only wait; they claim a fresh cache only when no lease (and no complete
cache) has appeared for ``lease_timeout`` seconds of their own monotonic clock (the
preferred builder never came), and they take over a lease that made no heartbeat progress.

*Liveness.* A waiter reads ``(lease id, heartbeat counter)``; when that pair has not
changed for ``lease_timeout`` seconds on the waiter's own ``time.monotonic()`` the lease
is dead. No clock of another host is ever involved.

*Takeover, and why it is race-free.* To take over dead lease X a waiter

1. creates ``lease.takeover-X-<g>`` with O_EXCL (g grows by one every further
   ``lease_timeout`` the lease stays stuck, so a taker that itself died does not block
   the next one). This only limits contention to ~one process per generation; safety
   does not depend on it;
2. ``os.rename("lease", "lease.dead-X-<random>")``. Of several concurrent renames of the
   same source exactly one succeeds; the others get ENOENT. The winner reads the file it
   moved: if it is X, X is gone. If it is not X (X was released and a new lease Y was
   claimed between our read and our rename: the ABA case) we moved Y by mistake and put
   it back with ``os.link(moved, "lease")``, which like O_EXCL fails rather than
   overwrite a lease that appeared meanwhile; if it fails, Y's owner sees a foreign or
   missing lease and stands down (below). Either way ``lease`` never names two owners;
3. claims a new lease with O_EXCL, which may lose to another claimer: fine.

*A slow builder.* A builder paused longer than ``lease_timeout`` loses its lease while
it still runs. Its heartbeat thread re-reads ``lease`` every beat and flags the loss;
the builder also re-reads ``lease`` right before each irreversible step (removing a
stale stage folder, renaming its tmp folder into place, writing a marker, writing a
failure record) and stands down (removes its tmp folder and waits like everybody else)
when it is no longer the owner. The window between that check and the step cannot be
closed without a lock the filesystem does not offer, so the steps are built to be safe
even if a stale owner slips through it: a stage folder only ever appears by renaming a
*complete* build of the *same* fingerprint into place, ``rename`` onto an existing
non-empty folder fails (so two owners can never mix files), and a marker lists the
sizes and checksums of the files it vouches for, which every reader re-checks.

*Publication order.* Build in ``<stage>.tmp-<id>/`` -> fsync files -> rename to
``<stage>/`` -> fsync the folder -> write ``<stage>.json`` atomically. Readers trust only
markers, so a crash at any point leaves either a complete stage or one the next builder
discards: a ``<stage>/`` without a valid marker is removed and rebuilt, a dead lease's
``*.tmp-*`` is removed, never published. A valid marker of stage k is kept (resume);
an invalid one invalidates stages k, k+1, ... (they were derived from it).

*Failure.* If a build raises, the builder removes its tmp folder (frees the space a full
disk needs for the record), writes ``failed-<lease id>.json``, releases the lease, rings
the doorbell and re-raises. A waiter raises :class:`BuildFailedError` for any failure
record that appears while it waits (records that were already there when it started are
history, not news). The next builder to claim deletes old records, so a fresh run after
the disk was freed simply builds.

*Waking up.* Waiters poll every ``poll_interval``. When a ``torch.distributed`` or
``jax.distributed`` job is initialised (``wakeup="auto"``) a daemon thread also waits on
the job's key-value store (the TCPStore / the JAX coordination service) and the builder
rings it after publishing or failing, so waiters wake at once (milliseconds) instead of
up to a poll interval later. This deliberately is not a collective barrier: a barrier
that the builder never reaches (SIGKILL) blocks everyone until the process group's
timeout (30 min for gloo), and a barrier that only some ranks enter (one got
ReadOnlyCacheError) deadlocks the rest. A store wait with a timeout is just a faster
sleep; the poll loop still does every liveness check and honours ``max_wait``, and
because the store calls run in a separate thread even a store that hangs (its host
partitioned away) cannot hold the loop. If the store host dies the doorbell is dropped
and polling continues.

*Read-only.* If every marker is valid, :func:`ensure_built` returns without writing a
byte (a read-only mount works). If the cache is incomplete and the folder is not
writable it raises :class:`ReadOnlyCacheError` at once.

Known limits: NFS caches negative directory lookups for up to ``acdirmax`` seconds, so a
waiter on another NFS client may see a marker up to that long after publication (the
doorbell avoids this within one job).
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import json
import logging
import os
import re
import secrets
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import xxhash

from dist.atomic import fsync_dir
from dist.env import ProcessInfo, detect
from dist.markers import (
    Marker,
    check_marker,
    describe_files,
    read_json,
    write_json_atomic,
    write_marker,
)
from dist.timing import timing_problem

__all__ = [
    "BuildFailedError",
    "CacheWaitTimeout",
    "Doorbell",
    "LeaseLostError",
    "ReadOnlyCacheError",
    "Stage",
    "StageContext",
    "StoreDoorbell",
    "default_builder",
    "ensure_built",
]

logger = logging.getLogger("dist")

LEASE_FILE = "lease"
_STAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_]*(-[A-Za-z0-9_]+)*$")
_RESERVED = frozenset({"lease", "heartbeat", "failed"})


# ----------------------------------------------------------------------------- errors


class BuildFailedError(RuntimeError):
    """The builder's stage build raised; raised in the processes that waited for it.

    Attributes:
        path: the cache folder.
        lease_id, host, pid: the failed builder.
        error_type: the builder's exception type name (``"OSError"``).
        reason: the builder's exception message.
    """

    def __init__(
        self,
        message: str,
        path: str,
        *,
        lease_id: str | None = None,
        host: str | None = None,
        pid: int | None = None,
        error_type: str | None = None,
        reason: str | None = None,
    ):
        super().__init__(message)
        self.path = str(path)
        self.lease_id = lease_id
        self.host = host
        self.pid = pid
        self.error_type = error_type
        self.reason = reason

    def __reduce__(self):
        kwargs = {
            "lease_id": self.lease_id,
            "host": self.host,
            "pid": self.pid,
            "error_type": self.error_type,
            "reason": self.reason,
        }
        return (_rebuild_build_failed, (self.args[0], self.path, kwargs))


def _rebuild_build_failed(message, path, kwargs):
    return BuildFailedError(message, path, **kwargs)


class _MessagePathError(Exception):
    """Mixin: ``(message, path)``; ``str()`` is the message; pickles with both.

    Put it before the built-in base (``class X(_MessagePathError, TimeoutError)``).
    """

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = str(path)

    def __str__(self):
        return self.args[0]

    def __reduce__(self):
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


class LeaseLostError(RuntimeError):
    """This process was the builder but another process took its lease over.

    Handled inside :func:`ensure_built` (the process goes back to waiting); exported for
    stage builds that want to check :meth:`StageContext.check_ownership` in long loops.

    Attributes:
        path: the cache folder.
        lease_id: the lost lease.
    """

    def __init__(self, message: str, path: str, lease_id: str):
        super().__init__(message)
        self.path = str(path)
        self.lease_id = lease_id

    def __reduce__(self):
        return (type(self), (self.args[0], self.path, self.lease_id))


# ----------------------------------------------------------------------------- options


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageContext:
    """What a stage build gets. Not shared between threads.

    Attributes:
        stage: this stage's name.
        tmp_dir: the builder's private, empty folder; write the stage's files here.
        cache_dir: the cache folder.
        fingerprint: the cache identity.
        previous: published folders of the earlier stages, by name.
        markers: markers of the earlier stages, by name.
        lease_id: this builder's lease.
    """

    stage: str
    tmp_dir: Path
    cache_dir: Path
    fingerprint: str
    previous: Mapping[str, Path]
    markers: Mapping[str, Marker]
    lease_id: str
    _check: Callable[[], None] = dataclasses.field(repr=False, compare=False)

    def check_ownership(self) -> None:
        """Raise :class:`LeaseLostError` if another process took this build over."""
        self._check()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """One step of a cache build.

    Attributes:
        name: folder and marker name (letters, digits, ``_`` and ``-``).
        build: writes the stage's files into ``ctx.tmp_dir`` and returns JSON-able info
            (row counts...) stored in the marker's ``info``.
    """

    name: str
    build: Callable[[StageContext], Mapping[str, Any] | None]

    def __post_init__(self):
        if not isinstance(self.name, str) or not _STAGE_NAME.match(self.name):
            raise ValueError(
                f"name must be letters, digits, '_' or '-' (not leading), got {self.name!r}"
            )
        if self.name in _RESERVED or ".tmp" in self.name:
            raise ValueError(f"name {self.name!r} is reserved")
        if not callable(self.build):
            raise TypeError(f"build must be callable, got {self.build!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Timing:
    poll_interval: float
    max_wait: float
    lease_timeout: float
    heartbeat_interval: float

    def __post_init__(self):
        problem = timing_problem(**dataclasses.asdict(self))  # config checks the same rules
        if problem is not None:
            raise ValueError(problem[1])


def default_builder(process: ProcessInfo, scope: str = "shared") -> bool:
    """Whether ``process`` is the preferred builder for a cache of ``scope``.

    Args:
        process: this process.
        scope: ``"shared"``: one cache for the whole job (NFS, ``HF_HOME``): global
            rank 0 builds. ``"node"``: one cache per node on local disk (the caller
            passes a node-local ``cache_dir``): local rank 0 of each node builds.
            ``"process"``: every process has its own cache: everyone builds.

    Returns:
        True if this process should claim at once.

    Raises:
        ValueError: unknown scope.
    """
    if scope == "shared":
        return process.rank == 0
    if scope == "node":
        return process.local_rank == 0
    if scope == "process":
        return True
    raise ValueError(f"scope must be 'shared', 'node' or 'process', got {scope!r}")


# ----------------------------------------------------------------------------- doorbell


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


def _private_torch_store(store: Any) -> Any:
    """Our own client of the job's TCPStore, with a short timeout.

    The process group's client has the group's timeout (30 min for gloo): if rank 0's
    host were partitioned away, a store call on it could block a waiter that long. Our
    client gives up after 5 s, and we then drop the doorbell and poll the filesystem.
    """
    import torch.distributed as td

    base = store
    while hasattr(base, "underlying_store"):  # PrefixStore
        base = base.underlying_store
    if isinstance(base, td.TCPStore):
        return td.TCPStore(
            base.host, base.port, is_master=False, timeout=datetime.timedelta(seconds=5)
        )
    return store  # FileStore/HashStore: local, cannot hang on the network


def _auto_doorbell(cache_dir: Path, fingerprint: str) -> Doorbell | None:
    key = "dist.ensure_built/" + xxhash.xxh64(f"{cache_dir}\0{fingerprint}".encode()).hexdigest()
    torch_dist = sys.modules.get("torch.distributed")
    try:
        if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
            from torch.distributed import distributed_c10d

            store = _private_torch_store(distributed_c10d._get_default_store())
            return StoreDoorbell(store, key)
    except Exception as e:
        logger.warning("no torch.distributed doorbell, polling only: %s", e)
    if "jax" in sys.modules:
        try:
            from jax._src import distributed as jax_dist  # type: ignore[import-not-found]

            client = getattr(jax_dist.global_state, "client", None)
            if client is not None:
                return StoreDoorbell(client, key)
        except Exception as e:
            logger.warning("no jax.distributed doorbell, polling only: %s", e)
    return None


# ----------------------------------------------------------------------------- lease files


@dataclasses.dataclass(frozen=True)
class _LeaseView:
    key: str  # the lease id, or a digest of unparsable content (a claimer died mid-write)
    lease_id: str | None
    host: str | None
    pid: int | None


def _parse_lease(raw: bytes) -> _LeaseView:
    try:
        d = json.loads(raw)
        return _LeaseView(str(d["lease_id"]), str(d["lease_id"]), d.get("host"), d.get("pid"))
    except (ValueError, KeyError, TypeError):
        return _LeaseView("raw-" + xxhash.xxh64(raw).hexdigest(), None, None, None)


def _read_lease(path: Path) -> _LeaseView | None:
    try:
        with open(path, "rb") as f:
            return _parse_lease(f.read())
    except FileNotFoundError:
        return None


def _try_claim(cache_dir: Path, lease_id: str, host: str, pid: int) -> bool:
    path = cache_dir / LEASE_FILE
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps({"lease_id": lease_id, "host": host, "pid": pid}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(cache_dir)
    return True


def _move_lease(cache_dir: Path, expected_key: str, purpose: str) -> bool:
    """Atomically remove the lease if it is ``expected_key``; restore anything else.

    Returns True if the lease ``expected_key`` was removed by this call.
    """
    lease = cache_dir / LEASE_FILE
    moved = cache_dir / f"{LEASE_FILE}.{purpose}-{expected_key}-{secrets.token_hex(4)}"
    try:
        os.rename(lease, moved)
    except FileNotFoundError:
        return False
    try:
        view = _read_lease(moved)
    except OSError:
        view = None
    if view is None:
        return False  # vanished under us (someone cleaning up); nothing to restore
    if view.key == expected_key:
        try:
            os.unlink(moved)
        except OSError:
            pass
        return True
    # ABA: we moved a newer lease; put it back unless yet another one appeared.
    try:
        os.link(moved, lease)
    except FileExistsError:
        logger.warning("lease %s displaced during a takeover; its owner will stand down", view.key)
    except FileNotFoundError:
        return False
    _unlink(moved)
    return False


def _heartbeat_path(cache_dir: Path, lease_id: str) -> Path:
    return cache_dir / f"heartbeat-{lease_id}.json"


def _failure_records(cache_dir: Path) -> set[str]:
    try:
        return {n for n in os.listdir(cache_dir) if n.startswith("failed-") and n.endswith(".json")}
    except FileNotFoundError:
        return set()


class _Lease:
    """This process's ownership of ``cache_dir`` and its heartbeat thread."""

    def __init__(self, cache_dir: Path, lease_id: str, host: str, interval: float):
        self.cache_dir = cache_dir
        self.lease_id = lease_id
        self.host = host
        self.pid = os.getpid()
        self._interval = interval
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._lock = threading.Lock()
        self._stage = ""
        self._phase = "claimed"
        self._counter = 0
        self._thread: threading.Thread | None = None
        self._hb_error_logged = False

    def start(self) -> None:
        self._beat()
        self._thread = threading.Thread(
            target=self._run, name=f"dist-heartbeat-{self.lease_id[:12]}", daemon=True
        )
        self._thread.start()

    def set_phase(self, stage: str, phase: str) -> None:
        with self._lock:
            self._stage, self._phase = stage, phase
        self._beat()

    def _beat(self) -> None:
        with self._lock:
            self._counter += 1
            record = {
                "lease_id": self.lease_id,
                "host": self.host,
                "pid": self.pid,
                "counter": self._counter,
                "stage": self._stage,
                "phase": self._phase,
                "wall_time": time.time(),  # informational; no reader compares clocks
            }
            try:
                write_json_atomic(
                    _heartbeat_path(self.cache_dir, self.lease_id), record, fsync=False
                )
            except OSError as e:
                # A full disk can refuse even this; waiters will then judge us dead.
                if not self._hb_error_logged:
                    logger.warning("heartbeat write failed (%s); waiters may take over", e)
                    self._hb_error_logged = True

    def _run(self) -> None:
        absent = 0
        while not self._stop.wait(self._interval):
            try:
                view = _read_lease(self.cache_dir / LEASE_FILE)
            except OSError as e:  # ESTALE/EIO on a flaky NFS mount: count as absent
                logger.debug("heartbeat: cannot read lease: %s", e)
                view = None
            if view is None:
                absent += 1  # may be a taker's ABA rename in flight: allow a few beats
            else:
                absent = 0
            if (view is not None and view.key != self.lease_id) or absent >= 3:
                logger.warning("lease %s was taken over; standing down", self.lease_id)
                self._lost.set()
                return
            self._beat()

    def owned(self) -> bool:
        """Re-read ``lease`` now (a brief absence is tolerated: see _move_lease)."""
        if self._lost.is_set():
            return False
        for attempt in range(4):
            try:
                view = _read_lease(self.cache_dir / LEASE_FILE)
            except OSError:  # ESTALE/EIO: unknown, like absent; retry
                view = None
            if view is not None:
                return view.key == self.lease_id
            time.sleep(0.02 * (attempt + 1))
        return False

    def check(self) -> None:
        if not self.owned():
            self._lost.set()
            raise LeaseLostError(
                f"{self.cache_dir}: lease {self.lease_id} was taken over by another process",
                str(self.cache_dir),
                self.lease_id,
            )

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self._interval))
            self._thread = None

    def release(self) -> None:
        self.stop()
        if not self._lost.is_set():
            _move_lease(self.cache_dir, self.lease_id, "released")
        _unlink(_heartbeat_path(self.cache_dir, self.lease_id))


# ----------------------------------------------------------------------------- helpers


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _discard_dir(path: Path) -> None:
    """Remove a folder so that no reader ever sees it half-deleted: rename, then delete."""
    if not path.exists():
        return
    trash = path.with_name(f"{path.name}.trash-{secrets.token_hex(4)}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def _writable(path: Path) -> bool:
    p = path
    while not p.exists():
        if p.parent == p:
            return False
        p = p.parent
    return os.access(p, os.W_OK)


def _readonly_error(cache_dir: Path, detail: str = "") -> ReadOnlyCacheError:
    return ReadOnlyCacheError(
        f"{cache_dir}: the cache is not built and this folder is not writable{detail}; "
        "run `python scripts/prebuild_cache.py --config ...` on a host with write access "
        "to build it first",
        str(cache_dir),
    )


# ----------------------------------------------------------------------------- protocol


class _Coordinator:
    def __init__(
        self,
        cache_dir: Path,
        fingerprint: str,
        stages: Sequence[Stage],
        builder: bool,
        timing: _Timing,
        wakeup: Doorbell | None,
        on_event: Callable[[str, dict], None] | None,
        world_size: int = 1,
    ):
        self.cache_dir = cache_dir
        self.fingerprint = fingerprint
        self.stages = list(stages)
        self.builder = builder
        self.t = timing
        self.doorbell = wakeup
        # Doorbell checks cost world_size / wake_step requests per second on the store's
        # server (rank 0): ~160/s for 8 ranks, capped near 4000/s for large jobs.
        self.wake_step = min(timing.poll_interval, max(0.05, world_size / 4000))
        self._on_event = on_event
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self._last_reason: str | None = None

    # -- events and logging

    def emit(self, event: str, **fields: Any) -> None:
        logger.debug("%s: %s %s", self.cache_dir, event, fields)
        if self._on_event is not None:
            self._on_event(event, fields)

    def marker_path(self, stage: Stage) -> Path:
        return self.cache_dir / f"{stage.name}.json"

    def _check_marker(self, stage: Stage) -> tuple[Marker | None, str | None]:
        """``stage``'s marker checked against this cache: ``(marker, None)`` or ``(None, why)``."""
        return check_marker(
            self.marker_path(stage),
            fingerprint=self.fingerprint,
            base_dir=self.cache_dir,
            stage=stage.name,
        )

    def complete_markers(self, *, log: bool) -> dict[str, Marker] | None:
        """All markers if every one is valid, else None. Reads only, writes nothing."""
        # Cheap pre-check first: 1000 waiters polling should cost 1 stat each, not a
        # stat per listed file.
        if not all(self.marker_path(s).exists() for s in self.stages):
            return None
        markers = {}
        for stage in self.stages:
            marker, why = self._check_marker(stage)
            if marker is None:
                reason = f"ignoring marker {self.marker_path(stage)}: {why}"
                if log and reason != self._last_reason:
                    logger.warning("%s", reason)
                self._last_reason = reason
                return None
            markers[stage.name] = marker
        return markers

    def ring(self) -> None:
        if self.doorbell is not None:
            try:
                self.doorbell.ring()
            except Exception as e:
                logger.warning("doorbell ring failed (%s: %s)", type(e).__name__, e)

    def _bell(self, method: str, *args: Any) -> Any:
        """Call the doorbell; on any error drop it (the store's host died): poll only."""
        if self.doorbell is None:
            return None
        try:
            return getattr(self.doorbell, method)(*args)
        except Exception as e:
            logger.warning("doorbell failed (%s: %s); polling only", type(e).__name__, e)
            self.doorbell = None
            return None

    def _pause(self, seconds: float, token: Any) -> None:
        """Sleep ``seconds``, or less if the doorbell rings."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.doorbell is None or token is None:
                time.sleep(left)
                return
            time.sleep(min(left, self.wake_step))
            if self._bell("rung", token):
                return

    # -- main loop

    def run(self) -> dict[str, Marker]:
        markers = self.complete_markers(log=True)
        if markers is not None:
            self.emit("complete", built=False)
            return markers
        if not _writable(self.cache_dir):
            raise _readonly_error(self.cache_dir)
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise _readonly_error(self.cache_dir, f" ({e.strerror})") from e
            raise
        return self._loop()

    def _loop(self) -> dict[str, Marker]:
        start = time.monotonic()
        failures_at_start = _failure_records(self.cache_dir)
        absent_since = start
        last_key: tuple | None = None
        last_view: _LeaseView | None = None
        last_change = start
        reported_dead: tuple | None = None
        while True:
            token = self._bell("token")  # before the check: a later ring is never missed
            markers = self.complete_markers(log=True)
            if markers is not None:
                self.emit("complete", built=False)
                return markers
            self._raise_new_failure(failures_at_start)
            now = time.monotonic()
            try:
                view = _read_lease(self.cache_dir / LEASE_FILE)
            except OSError as e:
                # ESTALE/EIO from a flaky NFS mount: not a reason to fail; carry on with
                # the lease we saw last (if the mount stays broken, its heartbeat stops
                # moving for us and we judge it dead, as we would for a lost builder).
                logger.debug("%s: cannot read the lease: %s", self.cache_dir, e)
                view = last_view
            if view is None:
                if last_key is not None:
                    absent_since, last_key = now, None
                grace = 0.0 if self.builder else self.t.lease_timeout
                if now - absent_since >= grace:
                    result = self._claim_and_build(takeover_of=None)
                    if result is not None:
                        return result
                    absent_since = time.monotonic()
            else:
                hb = read_json(_heartbeat_path(self.cache_dir, view.key))
                counter = hb.get("counter") if isinstance(hb, dict) else None
                key = (view.key, counter)
                if key != last_key:
                    last_key, last_view, last_change = key, view, now
                elif now - last_change >= self.t.lease_timeout:
                    stuck = now - last_change
                    if reported_dead != key:
                        reported_dead = key
                        self.emit(
                            "lease_dead",
                            lease_id=view.key,
                            stuck_s=stuck,
                            host=view.host,
                            pid=view.pid,
                        )
                    result = self._takeover(view, key, stuck)
                    if result is not None:
                        return result
            elapsed = time.monotonic() - start
            if elapsed >= self.t.max_wait:
                self._raise_timeout(last_view, time.monotonic() - last_change, elapsed)
            self._pause(min(self.t.poll_interval, self.t.max_wait - elapsed), token)

    def _raise_new_failure(self, seen: set[str]) -> None:
        for name in sorted(_failure_records(self.cache_dir) - seen):
            record = read_json(self.cache_dir / name)
            if not isinstance(record, dict):
                continue  # being written or garbage: look again next poll
            raise BuildFailedError(
                f"{self.cache_dir}: the builder (host {record.get('host')}, pid "
                f"{record.get('pid')}, stage {record.get('stage')!r}) failed: "
                f"{record.get('error_type')}: {record.get('message')}",
                str(self.cache_dir),
                lease_id=record.get("lease_id"),
                host=record.get("host"),
                pid=record.get("pid"),
                error_type=record.get("error_type"),
                reason=record.get("message"),
            )

    def _raise_timeout(self, view: _LeaseView | None, progress_age: float, elapsed: float):
        path = self.marker_path(self.stages[-1])
        who = (
            f"builder host {view.host}, pid {view.pid}, lease {view.key}, last heartbeat "
            f"progress {progress_age:.1f}s ago (this process's clock)"
            if view is not None
            else "no builder lease seen"
        )
        raise CacheWaitTimeout(
            f"gave up after {elapsed:.1f}s (max_wait) waiting for {path}: {who}", str(path)
        )

    def _takeover(self, view: _LeaseView, key: tuple, stuck: float) -> dict[str, Marker] | None:
        generation = int(max(0.0, stuck - self.t.lease_timeout) // self.t.lease_timeout)
        ticket = self.cache_dir / f"{LEASE_FILE}.takeover-{view.key}-{generation}"
        try:
            os.close(os.open(ticket, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return None  # someone else is taking over this generation
        # The builder may have woken up since we judged it: look once more.
        hb = read_json(_heartbeat_path(self.cache_dir, view.key))
        counter = hb.get("counter") if isinstance(hb, dict) else None
        if (view.key, counter) != key or not _move_lease(self.cache_dir, view.key, "dead"):
            # Not dead after all, or already replaced: free the ticket so that a real
            # death of this same lease later is not delayed by a generation.
            _unlink(ticket)
            return None
        self.emit("takeover", lease_id=view.key, stuck_s=stuck)
        logger.warning(
            "%s: builder lease %s (host %s, pid %s) made no progress for %.1fs; taking over",
            self.cache_dir,
            view.key,
            view.host,
            view.pid,
            stuck,
        )
        return self._claim_and_build(takeover_of=view.key)

    def _claim_and_build(self, takeover_of: str | None) -> dict[str, Marker] | None:
        lease_id = secrets.token_hex(8)
        try:
            claimed = _try_claim(self.cache_dir, lease_id, self.host, self.pid)
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise _readonly_error(self.cache_dir, f" ({e.strerror})") from e
            raise
        if not claimed:
            return None
        self.emit("claimed", lease_id=lease_id, takeover_of=takeover_of)
        lease = _Lease(self.cache_dir, lease_id, self.host, self.t.heartbeat_interval)
        lease.start()
        try:
            markers = self._build_all(lease)
        except LeaseLostError:
            self.emit("lease_lost", lease_id=lease_id)
            lease.stop()
            _unlink(_heartbeat_path(self.cache_dir, lease_id))
            return None  # back to waiting for whoever took over
        except BaseException:
            lease.release()
            self.ring()
            raise
        lease.release()
        self.ring()
        self.emit("complete", built=True, lease_id=lease_id)
        return markers

    def _clean_leftovers(self, lease: _Lease) -> None:
        """Remove what dead leases left behind. We own the lease, so nothing else is live
        (a stale owner still writing into its tmp folder will fail and stand down)."""
        mine = f".tmp-{lease.lease_id}"
        for name in os.listdir(self.cache_dir):
            path = self.cache_dir / name
            if (".tmp-" in name and not name.endswith(mine)) or ".trash-" in name:
                shutil.rmtree(path, ignore_errors=True)
            elif name.startswith(f"{LEASE_FILE}.takeover-") or (
                name.startswith("failed-") and name.endswith(".json")
            ):
                # Not lease.dead-*/lease.released-*: their movers delete them at once and
                # may be mid-way (see _move_lease); a crashed mover's one is inventory's.
                _unlink(path)
            elif name.startswith("heartbeat-") and name != f"heartbeat-{lease.lease_id}.json":
                _unlink(path)
            elif name.startswith(".") and name.endswith(".tmp") and lease.lease_id not in name:
                _unlink(path)  # a marker write interrupted before its os.replace

    def _build_all(self, lease: _Lease) -> dict[str, Marker]:
        lease.check()
        self._clean_leftovers(lease)
        markers: dict[str, Marker] = {}
        first_invalid = len(self.stages)
        for i, stage in enumerate(self.stages):
            marker, why = self._check_marker(stage)
            if marker is None:
                reason = f"ignoring marker {self.marker_path(stage)}: {why}"
                if why != "missing" and reason != self._last_reason:
                    logger.warning(
                        "ignoring marker %s: %s; rebuilding", self.marker_path(stage), why
                    )
                first_invalid = i
                break
            markers[stage.name] = marker
            self.emit("stage_skipped", stage=stage.name)
        later = self.stages[first_invalid:]
        # Markers first: they are what readers trust; then the folders they vouched for.
        for stage in reversed(later):
            lease.check()
            _unlink(self.marker_path(stage))
        for stage in later:
            lease.check()
            _discard_dir(self.cache_dir / stage.name)
        for stage in later:
            markers[stage.name] = self._build_stage(stage, lease, markers)
        lease.check()
        return markers

    def _build_stage(self, stage: Stage, lease: _Lease, markers: dict[str, Marker]) -> Marker:
        tmp = self.cache_dir / f"{stage.name}.tmp-{lease.lease_id}"
        final = self.cache_dir / stage.name
        published = False
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            lease.set_phase(stage.name, "building")
            self.emit("building", stage=stage.name, lease_id=lease.lease_id)
            started = time.time()
            ctx = StageContext(
                stage=stage.name,
                tmp_dir=tmp,
                cache_dir=self.cache_dir,
                fingerprint=self.fingerprint,
                previous={name: self.cache_dir / name for name in markers},
                markers=dict(markers),
                lease_id=lease.lease_id,
                _check=lease.check,
            )
            info = dict(stage.build(ctx) or {})
            try:
                json.dumps(info)
            except (TypeError, ValueError) as e:
                raise TypeError(f"stage {stage.name!r} build returned non-JSON info: {e}") from e
            _fsync_tree(tmp)
            files = describe_files(tmp, relative_to=tmp)
            lease.set_phase(stage.name, "publishing")
            self.emit("publishing", stage=stage.name, lease_id=lease.lease_id)
            lease.check()
            try:
                os.rename(tmp, final)
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                # A stale owner slipped a complete folder in; if we still own the lease
                # it has no valid marker (we removed it): replace it with ours.
                lease.check()
                _discard_dir(final)
                os.rename(tmp, final)
            published = True
            fsync_dir(self.cache_dir)
            self.emit("renamed", stage=stage.name, lease_id=lease.lease_id)
            marker = Marker(
                fingerprint=self.fingerprint,
                stage=stage.name,
                directory=stage.name,
                host=self.host,
                pid=self.pid,
                lease_id=lease.lease_id,
                started_at=started,
                finished_at=time.time(),
                info=info,
                files=tuple(dataclasses.replace(f, path=f"{stage.name}/{f.path}") for f in files),
            )
            lease.check()
            write_marker(self.marker_path(stage), marker)
            lease.set_phase(stage.name, "published")
            self.emit("stage_built", stage=stage.name, lease_id=lease.lease_id, info=info)
            return marker
        except LeaseLostError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space a full disk needs
            owned = lease.owned()
            if isinstance(e, Exception) and not owned:
                # Probably failed *because* the new owner removed our tmp folder.
                raise LeaseLostError(
                    f"{self.cache_dir}: lease {lease.lease_id} lost during the build "
                    f"({type(e).__name__}: {e})",
                    str(self.cache_dir),
                    lease.lease_id,
                ) from e
            if published and owned:
                _discard_dir(final)
            if isinstance(e, Exception):
                self._write_failure(lease, stage, e)
            raise

    def _write_failure(self, lease: _Lease, stage: Stage, error: Exception) -> None:
        record = {
            "lease_id": lease.lease_id,
            "host": self.host,
            "pid": self.pid,
            "stage": stage.name,
            "error_type": type(error).__name__,
            "message": str(error),
            "wall_time": time.time(),
        }
        try:
            write_json_atomic(self.cache_dir / f"failed-{lease.lease_id}.json", record)
        except OSError as e:
            logger.error(
                "%s: could not write failure record (%s); waiters will time out "
                "on the lease instead",
                self.cache_dir,
                e,
            )
        self.emit("failed", stage=stage.name, error=f"{type(error).__name__}: {error}")


def ensure_built(
    cache_dir: str | os.PathLike,
    fingerprint: str,
    stages: Sequence[Stage],
    *,
    process: ProcessInfo | None = None,
    builder: bool | None = None,
    poll_interval: float = 5.0,
    max_wait: float = 3600.0,
    lease_timeout: float = 60.0,
    heartbeat_interval: float = 2.0,
    wakeup: Doorbell | Literal["auto"] | None = "auto",
    on_event: Callable[[str, dict], None] | None = None,
) -> dict[str, Marker]:
    """Make sure every stage of the cache in ``cache_dir`` is built; build it if we must.

    Every process of the job calls this with the same arguments. Exactly one builds
    (see the module docstring for the protocol); all return the same markers.
    Process-safe across hosts sharing ``cache_dir``; call it from one thread per process.

    Args:
        cache_dir: the folder of this one cache (one fingerprint).
        fingerprint: the cache identity; a marker of another fingerprint is ignored.
        stages: the stages in order; stage k+1 sees the published folders of 0..k.
        process: this process (default: :func:`dist.env.detect`).
        builder: whether this process is the preferred builder (default:
            ``default_builder(process, "shared")``, i.e. global rank 0).
        poll_interval: seconds between checks while waiting.
        max_wait: seconds to wait in total before :class:`CacheWaitTimeout`.
        lease_timeout: seconds without heartbeat progress (on this process's clock)
            after which a builder is judged dead, and without any lease after which a
            waiter claims a cache nobody started.
        heartbeat_interval: seconds between the builder's heartbeats
            (<= lease_timeout / 2).
        wakeup: ``"auto"``: wake waiters through the torch.distributed / jax.distributed
            key-value store when one is initialised; None: poll only; or a
            :class:`Doorbell`.
        on_event: called as ``on_event(name, fields)`` for ``claimed``, ``takeover``,
            ``lease_dead``, ``building``, ``publishing``, ``renamed``, ``stage_built``,
            ``stage_skipped``, ``failed``, ``lease_lost``, ``complete`` (tests, metrics).

    Returns:
        The stage markers by stage name.

    Raises:
        BuildFailedError: the builder we waited for failed.
        CacheWaitTimeout: not complete after ``max_wait`` seconds.
        ReadOnlyCacheError: incomplete and ``cache_dir`` is not writable.
        Exception: whatever this process's own stage build raised.
    """
    timing = _Timing(
        poll_interval=poll_interval,
        max_wait=max_wait,
        lease_timeout=lease_timeout,
        heartbeat_interval=heartbeat_interval,
    )
    stages = list(stages)
    if not stages:
        raise ValueError("stages must not be empty, got []")
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"stage names must be unique, got {names}")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"fingerprint must be a non-empty string, got {fingerprint!r}")
    cache_dir = Path(os.path.abspath(cache_dir))
    if process is None and builder is None:
        process = detect()
    if builder is None:
        builder = default_builder(process, "shared")
    world_size = process.world_size if process is not None else 1
    if wakeup == "auto":
        wakeup = _auto_doorbell(cache_dir, fingerprint)
    coordinator = _Coordinator(
        cache_dir, fingerprint, stages, bool(builder), timing, wakeup, on_event, world_size
    )
    return coordinator.run()
