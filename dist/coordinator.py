"""Exactly one process builds a cache, every process gets it, crashes included.

:func:`ensure_built` runs a list of :class:`Stage` s (``"converted"``, then
``"filtered"``) into ``cache_dir`` so that exactly one process builds, the others wait,
and a builder that dies (SIGKILL, lost node, full disk) is noticed and replaced.
It works on local disks and on NFS/Lustre: it relies only on ``O_CREAT|O_EXCL``,
``rename`` and ``link`` being atomic on one filesystem, never on ``flock``, and never
compares another host's clock (or file mtimes) with the local clock.

Layout of ``cache_dir`` (one cache = one fingerprint; the caller picks the folder,
e.g. ``root/<name>-<fingerprint>``)::

    <stage>.<lease id>/       the folder one lease builds the stage in; published (then
                              never changed) when the marker names it
    <stage>.json              marker: the stage is complete (dist.markers); created once
    lease                     the claim: JSON {lease_id, host, pid}, created O_EXCL, never
                              rewritten in place (dist.lease)
    heartbeat-<lease id>.json the builder's heartbeat: counter, stage, phase (os.replace)
    failed-<lease id>.json    failure record of a lease whose build raised
    .hf_pipeline-cache.json   identity (kind, schema, fingerprint): the mark by which
                              ``prebuild_cache.py --clean`` knows the folder is a cache
    lease.dead-*, lease.takeover-*, lease.released-*, *.trash-*: bookkeeping

(:mod:`dist.layout` has the naming rules, :mod:`dist.lease` the lease and heartbeat.)

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
is dead. No clock of another host is ever involved. A waiter on the holder's own machine
(same boot, same pid namespace) does not wait: when the holder's process has exited
(SIGKILL, the OOM killer) the lease is dead at once (:func:`dist.lease.holder_exited`);
a merely stopped holder still counts as running and is judged by its heartbeat.

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

*Fencing: a slow builder can never touch a published stage.* A builder paused longer
than ``lease_timeout`` (GC, SIGSTOP, an NFS hang) loses its lease while it still runs,
and may wake up anywhere, even between its last ownership check and its next step; no
filesystem offers the lock that would close that window. So the steps are built so that
a stale lease holder cannot win or spoil anything:

- every lease builds only under its own name, ``<stage>.<lease id>/``: two builders never
  share a folder, and nothing is ever renamed into a shared name;
- a marker is published create-if-absent (temp file + ``link``, which fails rather than
  overwrite): of all the builders of a stage the first publication stands; a later one
  finds the marker taken and stands down (a valid marker already there is used as is);
- a published stage's files are never deleted or rewritten by a builder. A marker found
  *invalid* (files missing or truncated, derived from another earlier stage) is moved
  aside to ``<stage>.json.retired-<id>`` (re-checked after the move: if what was moved
  turns out valid, it is linked back), and its folder is left to ``--clean``;
- a lease's unpublished folders are deleted by itself when it fails or loses, and by
  others only once the stage's marker is in place and names another folder (from then
  on no marker can ever name them);
- a builder that lost its lease stops at the next ownership check (stage builds call
  :meth:`StageContext.check_ownership`, or ``ctx.probe.check()`` in worker processes,
  per batch) and reports that it did not build (its lease is not in the markers).

A later stage's marker records the folders of the earlier stages it was derived from
(``inputs``); it is valid only over exactly those.

*Publication order.* Build in ``<stage>.<id>/`` -> fsync the files -> describe them
(sizes, checksums) -> publish ``<stage>.json`` (create-if-absent). Readers trust only
markers, so a crash at any point leaves either a complete stage or an unpublished folder
that the next builder collects once it has published. A valid marker of stage k is kept
(resume).

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

Known limits: a SIGKILLed builder's unpublished folder stays until the stage is
published by its successor, so a takeover may briefly need twice the stage's disk space.
NFS caches negative directory lookups for up to ``acdirmax`` seconds, so a
waiter on another NFS client may see a marker up to that long after publication (the
doorbell avoids this within one job).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

from dist.atomic import create_new, fsync_dir, write_json_atomic
from dist.doorbell import Doorbell, StoreDoorbell, auto_doorbell
from dist.env import ProcessInfo, detect
from dist.errors import (
    BuildFailedError,
    CacheWaitTimeout,
    ForeignCacheFolderError,
    LeaseLostError,
    ReadOnlyCacheError,
)
from dist.layout import (
    IDENTITY_FILE,
    identity_bytes,
    identity_fingerprint,
    is_project_entry,
    marker_name,
    parse_stage_dir,
    parse_trash_name,
    retired_marker_name,
    stage_dir_name,
)
from dist.lease import (
    LEASE_FILE,
    Lease,
    LeaseProbe,
    LeaseView,
    heartbeat_counter,
    heartbeat_path,
    holder_exited,
    move_lease,
    read_lease,
    try_claim,
)
from dist.markers import (
    FileEntry,
    Marker,
    check_marker,
    derived_from_problem,
    describe_files,
    parse_marker,
    publish_marker,
    read_json,
)
from dist.safepath import own_folder, shown
from dist.timing import timing_problem

__all__ = [
    "LEASE_FILE",
    "BuildFailedError",
    "CacheWaitTimeout",
    "Doorbell",
    "LeaseLostError",
    "ReadOnlyCacheError",
    "Stage",
    "StageContext",
    "StoreDoorbell",
    "complete_markers",
    "default_builder",
    "ensure_built",
    "readonly_error",
    "retire_damaged",
    "retire_marker",
]

logger = logging.getLogger(__name__)

_STAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_]*(-[A-Za-z0-9_]+)*$")
_RESERVED = frozenset({"lease", "heartbeat", "failed"})
#: Publication attempts of one stage before giving up (each lost one means a marker was
#: taken by another lease and then found invalid: only a broken filesystem loops).
_MAX_PUBLISH_ATTEMPTS = 5

#: Seconds between a waiter's "still waiting" lines (the first says whom it waits for):
#: a wait for another builder printed nothing for its whole length. INFO in each host's
#: first process (``local_rank`` 0), DEBUG in the others: a 64-host job of 8 ranks each
#: logs 64 lines per interval, not 512.
WAIT_REPORT_S = 30.0

Scope = Literal["shared", "node", "process"]
SCOPES: tuple[str, ...] = ("shared", "node", "process")


# ----------------------------------------------------------------------------- options


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageContext:
    """What a stage build gets. Not shared between threads.

    Attributes:
        stage: this stage's name.
        tmp_dir: this lease's own, empty folder for the stage; write the stage's files
            here (it is published as it is: the marker names it).
        cache_dir: the cache folder.
        fingerprint: the cache identity.
        previous: published folders of the earlier stages, by name.
        markers: markers of the earlier stages, by name.
        lease_id: this builder's lease.
        probe: a picklable ownership check for worker processes (``probe.check()``
            raises :class:`LeaseLostError` once another process took the build over).
        recorded: files the build hard-linked from published units, by path relative
            to ``cache_dir``, with the entries those units' markers list: the stage's
            marker takes them as they are (``describe_files``' ``recorded``).
    """

    stage: str
    tmp_dir: Path
    cache_dir: Path
    fingerprint: str
    previous: Mapping[str, Path]
    markers: Mapping[str, Marker]
    lease_id: str
    probe: LeaseProbe
    _check: Callable[[], None] = dataclasses.field(repr=False, compare=False)
    _phase: Callable[[str], None] = dataclasses.field(
        default=lambda phase: None, repr=False, compare=False
    )
    recorded: dict[str, FileEntry] = dataclasses.field(default_factory=dict)

    def check_ownership(self) -> None:
        """Raise :class:`LeaseLostError` if another process took this build over."""
        self._check()

    def set_phase(self, phase: str) -> None:
        """Say in this lease's heartbeat what the build is doing (``--status`` shows it:
        ``building``, then e.g. ``embedding``). Thread-safe."""
        self._phase(phase)


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

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
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
    raise ValueError(f"scope must be one of {', '.join(map(repr, SCOPES))}, got {scope!r}")


# ----------------------------------------------------------------------------- helpers


def _failure_records(cache_dir: Path) -> set[str]:
    try:
        return {n for n in os.listdir(cache_dir) if n.startswith("failed-") and n.endswith(".json")}
    except FileNotFoundError:
        return set()


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _delete(path: Path) -> None:
    """Delete a folder, or a symlink or file in its place: ``rmtree`` refuses a symlink
    (it never follows one), which with ``ignore_errors`` would leave the link for good."""
    if os.path.islink(path) or not os.path.isdir(path):
        _unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _discard_dir(path: Path) -> None:
    """Remove a folder so that no reader ever sees it half-deleted: rename, then delete."""
    if not os.path.lexists(path):
        return
    trash = path.with_name(f"{path.name}.trash-{secrets.token_hex(4)}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    _delete(trash)


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


def readonly_error(cache_dir: Path, detail: str = "") -> ReadOnlyCacheError:
    """The one message for a cache that is not built under a folder this process cannot
    write (``detail``: what failed, in parentheses, after "not writable")."""
    return ReadOnlyCacheError(
        f"{cache_dir}: the cache is not built and this folder is not writable{detail}; "
        "run `python scripts/prebuild_cache.py --config ...` on a host with write access "
        "to build it first",
        str(cache_dir),
    )


# ----------------------------------------------------------------------------- protocol


def _who(view: LeaseView) -> str:
    """The holder of a lease as ``host/pid`` (``?`` for a field the file lacks)."""
    # The host comes from a file on a shared root: escaped, it cannot forge a log line.
    host = "?" if not view.host else view.host if view.host.isprintable() else shown(view.host)
    return f"{host}/{view.pid if view.pid is not None else '?'}"


class _Coordinator:
    def __init__(
        self,
        cache_dir: Path,
        fingerprint: str,
        stages: Sequence[Stage],
        builder: bool,
        timing: _Timing,
        wakeup: Doorbell | None,
        on_event: Callable[[str, dict[str, Any]], None] | None,
        world_size: int = 1,
        reports: bool = True,
    ):
        self.cache_dir = cache_dir
        # Whether this waiter's "waiting for" lines are INFO (else DEBUG): one process
        # per host says it, not every rank of a large job every WAIT_REPORT_S.
        self.report_level = logging.INFO if reports else logging.DEBUG
        self.fingerprint = fingerprint
        self.stages = list(stages)
        self.builder = builder
        self.timing = timing
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
        return self.cache_dir / marker_name(stage.name)

    def _check_marker(
        self, stage: Stage, earlier: Mapping[str, Marker], path: Path | None = None
    ) -> tuple[Marker | None, str | None]:
        """``stage``'s marker (at ``path``, default its place) checked against this cache
        and the ``earlier`` stages: ``(marker, None)`` or ``(None, why)``."""
        marker, why = check_marker(
            path or self.marker_path(stage),
            fingerprint=self.fingerprint,
            base_dir=self.cache_dir,
            stage=stage.name,
        )
        if marker is not None:
            why = derived_from_problem(marker, earlier)
            if why is not None:
                marker = None
        return marker, why

    def complete_markers(self, *, log: bool) -> dict[str, Marker] | None:
        """All markers if every one is valid, else None. Reads only, writes nothing."""
        # Cheap pre-check first: 1000 waiters polling should cost 1 stat each, not a
        # stat per listed file.
        if not all(self.marker_path(s).exists() for s in self.stages):
            return None
        markers: dict[str, Marker] = {}
        for stage in self.stages:
            marker, why = self._check_marker(stage, markers)
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
        self._check_identity()
        markers = self.complete_markers(log=True)
        if markers is not None:
            self.emit("complete", built=False)
            return markers
        if not _writable(self.cache_dir):
            raise readonly_error(self.cache_dir)
        try:
            own_folder(self.cache_dir.parent, self.cache_dir.name)  # never a link (above)
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise readonly_error(self.cache_dir, f" ({e.strerror})") from e
            raise
        return self._loop()

    def _loop(self) -> dict[str, Marker]:
        start = time.monotonic()
        failures_at_start = _failure_records(self.cache_dir)
        absent_since = start
        last_key: tuple[str, int | None] | None = None
        last_view: LeaseView | None = None
        last_change = start
        reported_dead: tuple[str, int | None] | None = None
        announced: str | None = None  # the lease whose builder the log named
        reported = start
        while True:
            token = self._bell("token")  # before the check: a later ring is never missed
            markers = self.complete_markers(log=True)
            if markers is not None:
                self.emit("complete", built=False)
                return markers
            self._raise_new_failure(failures_at_start)
            now = time.monotonic()
            try:
                view = read_lease(self.cache_dir / LEASE_FILE)
            except OSError as e:
                # ESTALE/EIO from a flaky NFS mount: not a reason to fail; carry on with
                # the lease we saw last (if the mount stays broken, its heartbeat stops
                # moving for us and we judge it dead, as we would for a lost builder).
                logger.debug("%s: cannot read the lease: %s", self.cache_dir, e)
                view = last_view
            if view is None:
                if last_key is not None:
                    absent_since, last_key = now, None
                grace = 0.0 if self.builder else self.timing.lease_timeout
                if now - absent_since >= grace:
                    result = self._claim_and_build(takeover_of=None)
                    if result is not None:
                        return result
                    absent_since = time.monotonic()
            else:
                key = (view.key, heartbeat_counter(self.cache_dir, view.key))
                if key != last_key:
                    last_key, last_view, last_change = key, view, now
                if view.key != announced:
                    announced, reported = view.key, now
                    logger.log(
                        self.report_level,
                        "waiting for %s: built by %s",
                        self._waited_for(),
                        _who(view),
                    )
                elif now - reported >= WAIT_REPORT_S:
                    reported = now
                    logger.log(
                        self.report_level,
                        "still waiting for %s after %.0f s: built by %s, its last heartbeat "
                        "progress %.1f s ago",
                        self.cache_dir,
                        now - start,
                        _who(view),
                        now - last_change,
                    )
                # A holder on this machine that provably exited (SIGKILL, OOM kill) is
                # dead now; any other is dead once its heartbeat stalled lease_timeout.
                exited = holder_exited(view)
                if exited or now - last_change >= self.timing.lease_timeout:
                    stuck = now - last_change
                    if reported_dead != key:
                        reported_dead = key
                        self.emit(
                            "lease_dead",
                            lease_id=view.key,
                            stuck_s=stuck,
                            host=view.host,
                            pid=view.pid,
                            exited=exited,
                        )
                    result = self._takeover(view, key, stuck, exited=exited)
                    if result is not None:
                        return result
            elapsed = time.monotonic() - start
            if elapsed >= self.timing.max_wait:
                self._raise_timeout(last_view, time.monotonic() - last_change, elapsed)
            self._pause(min(self.timing.poll_interval, self.timing.max_wait - elapsed), token)

    def _waited_for(self) -> str:
        """The cache folder and its stages, for the waiter's first line."""
        return f"{self.cache_dir} (stages {', '.join(st.name for st in self.stages)})"

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
                input_error=bool(record.get("input_error", False)),
            )

    def _raise_timeout(
        self, view: LeaseView | None, progress_age: float, elapsed: float
    ) -> NoReturn:
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

    def _takeover(
        self, view: LeaseView, key: tuple[str, int | None], stuck: float, *, exited: bool = False
    ) -> dict[str, Marker] | None:
        lease_timeout = self.timing.lease_timeout
        generation = int(max(0.0, stuck - lease_timeout) // lease_timeout)
        ticket = self.cache_dir / f"{LEASE_FILE}.takeover-{view.key}-{generation}"
        try:
            os.close(os.open(ticket, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return None  # someone else is taking over this generation
        # The builder may have woken up since we judged it: look once more (an exited
        # one cannot: a heartbeat file still settling from its last beat does not matter).
        now_key = (view.key, heartbeat_counter(self.cache_dir, view.key))
        if (now_key != key and not exited) or not move_lease(self.cache_dir, view.key, "dead"):
            # Not dead after all, or already replaced: free the ticket so that a real
            # death of this same lease later is not delayed by a generation.
            _unlink(ticket)
            return None
        self.emit("takeover", lease_id=view.key, stuck_s=stuck, exited=exited)
        logger.warning(
            "%s: builder lease %s (host %s, pid %s) %s; taking over",
            self.cache_dir,
            view.key,
            view.host,
            view.pid,
            "belongs to a process that exited" if exited else f"made no progress for {stuck:.1f}s",
        )
        return self._claim_and_build(takeover_of=view.key)

    def _claim_and_build(self, takeover_of: str | None) -> dict[str, Marker] | None:
        lease_id = secrets.token_hex(8)
        try:
            claimed = try_claim(self.cache_dir, lease_id, self.host, self.pid)
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise readonly_error(self.cache_dir, f" ({e.strerror})") from e
            raise
        if not claimed:
            return None
        self.emit("claimed", lease_id=lease_id, takeover_of=takeover_of)
        lease = Lease(self.cache_dir, lease_id, self.host, self.timing.heartbeat_interval)
        lease.start()
        try:
            markers = self._build_all(lease)
        except LeaseLostError:
            self.emit("lease_lost", lease_id=lease_id)
            lease.stop()
            # The stage builds have returned (their writers joined): what they wrote
            # after the successor collected our folders goes now.
            self._discard_unpublished(lease)
            _unlink(heartbeat_path(self.cache_dir, lease_id))
            # Back to waiting for whoever took over, no longer as the preferred builder:
            # when its lease goes, its markers may reach this host's lookup cache late
            # (NFS), and an immediate claim would rebuild what was just published.
            self.builder = False
            return None
        except BaseException:
            lease.release()
            self.ring()
            raise
        lease.release()
        self.ring()
        built = any(m.lease_id == lease_id for m in markers.values())
        self.emit("complete", built=built, lease_id=lease_id)
        return markers

    def _discard_unpublished(self, lease: Lease) -> None:
        """Remove this lost lease's stage folders that no marker names.

        A builder that resumes after its successor deleted its folders may still write
        into them (a writer that passed its last check before the pause re-creates
        them), so the lease-lost path removes them itself. A folder a marker (or a
        retired marker) names was published by this lease and stays: the marker is read
        before the retired ones, so a marker being retired meanwhile is seen in either.
        """
        for stage in self.stages:
            name = stage_dir_name(stage.name, lease.lease_id)
            if not (self.cache_dir / name).exists():
                continue
            named = {(read_json(self.marker_path(stage)) or {}).get("directory")}
            prefix = f"{marker_name(stage.name)}.retired-"
            for other in os.listdir(self.cache_dir):
                if other.startswith(prefix):
                    named.add((read_json(self.cache_dir / other) or {}).get("directory"))
            if name not in named:
                _discard_dir(self.cache_dir / name)

    def _clean_leftovers(self, lease: Lease) -> None:
        """Remove bookkeeping that dead leases left behind. Never a stage folder another
        lease could still publish (see :meth:`_collect_stage_garbage`)."""
        stages = [s.name for s in self.stages]
        for name in os.listdir(self.cache_dir):
            path = self.cache_dir / name
            legacy = parse_stage_dir(name) if ".tmp-" in name else None
            if parse_trash_name(name) is not None:
                # Only trash of what the project writes (a user's "x.trash-..." stays).
                if is_project_entry(name, stages):
                    _delete(path)
            elif legacy is not None and legacy.stage in stages:
                # A <stage>.tmp-<id>/ folder of hf_pipeline <= 0.1: never published by
                # this protocol (nothing is renamed into place any more).
                _delete(path)
            elif name.startswith(f"{LEASE_FILE}.takeover-") or (
                name.startswith("failed-") and name.endswith(".json")
            ):
                # Not lease.dead-*/lease.released-*: their movers delete them at once and
                # may be mid-way (see move_lease); a crashed mover's one is inventory's.
                _unlink(path)
            elif (
                name.startswith("heartbeat-")
                and name != heartbeat_path(self.cache_dir, lease.lease_id).name
            ):
                _unlink(path)
            elif (
                name.endswith(".tmp")
                and lease.lease_id not in name
                and is_project_entry(name, stages)
            ):
                _unlink(path)  # a marker write interrupted before its link/replace

    def _check_identity(self) -> None:
        """Refuse a folder whose identity file names another cache (copied, renamed or
        planted): the inventory does not count it as a cache, so building into it or
        serving its markers would give a cache that ``--status`` and ``--clean`` do not
        know, or another cache's files under this fingerprint. A symlink or a file of
        another format there is not ours either (create_new never writes a link).

        Nor is a symlink (or a file) in the cache folder's own place: someone who can
        write in a shared root may have aimed it at a folder of theirs or of the user's,
        which the build would fill and whose stage-named folders the builder removes
        (a real folder only, as :func:`dist.safepath.own_folder` checks)."""
        own_folder(self.cache_dir.parent, self.cache_dir.name, create=False)
        found = identity_fingerprint(self.cache_dir)
        if found is None or found == self.fingerprint:
            return
        # Written by whoever could write the folder: escaped and bounded (one line).
        what = f"names fingerprint {shown(found)}" if found else "is not hf_pipeline's"
        raise ForeignCacheFolderError(
            f"{self.cache_dir}: its {IDENTITY_FILE} {what}, not this cache's "
            f"{shown(self.fingerprint)}: not this cache's folder (copied, renamed, or written by "
            "something else); nothing was built or read there. Move it away, or build "
            "under another cache root",
            str(self.cache_dir),
        )

    def _write_identity(self) -> None:
        """Mark the folder as a cache before anything is built in it: the inventory
        (``--clean``) removes only folders carrying this mark (see dist.layout)."""
        path = self.cache_dir / IDENTITY_FILE
        if path.exists():
            return
        try:
            create_new(path, identity_bytes(self.fingerprint, host=self.host, pid=self.pid))
        except OSError as e:
            # A full disk: the build fails next, with its failure record; without the
            # mark --clean at worst leaves the folder, never removes it wrongly.
            logger.warning("%s: could not write %s (%s)", self.cache_dir, IDENTITY_FILE, e)

    def _build_all(self, lease: Lease) -> dict[str, Marker]:
        lease.check()
        self._check_identity()  # planted while we waited for the lease
        self._write_identity()
        self._clean_leftovers(lease)
        markers: dict[str, Marker] = {}
        for stage in self.stages:
            markers[stage.name] = self._stage(stage, lease, markers)
        return markers

    def _stage(self, stage: Stage, lease: Lease, markers: dict[str, Marker]) -> Marker:
        """The published marker of ``stage``: the valid one there, or ours once built."""
        built: Marker | None = None
        for _ in range(_MAX_PUBLISH_ATTEMPTS):
            marker, why = self._check_marker(stage, markers)
            if marker is None and why is not None and why != "missing" and "missing" in why:
                # Files another host just published may reach our attribute cache late
                # (NFS acregmax): look again before judging the stage broken.
                time.sleep(min(self.timing.lease_timeout, 5.0))
                marker, why = self._check_marker(stage, markers)
            if marker is None and why != "missing":
                lease.check()
                logger.warning("ignoring marker %s: %s; rebuilding", self.marker_path(stage), why)
                self._retire_marker(stage, markers, lease)
                continue
            if marker is not None:
                if built is None:
                    self.emit("stage_skipped", stage=stage.name)
                else:  # another lease published first: theirs stands
                    self.emit("publish_lost", stage=stage.name, lease_id=lease.lease_id)
                self._collect_stage_garbage(stage, marker, lease)
                return marker
            if built is None:
                built = self._build_stage(stage, lease, markers)
                if built.lease_id != lease.lease_id:
                    return built  # published by another lease while ours failed
            lease.check()
            # The window no check closes: a pause here wakes to a marker already taken
            # (publish_marker then writes nothing) or publishes a complete, valid stage.
            self.emit("marker_write", stage=stage.name, lease_id=lease.lease_id)
            try:
                published = publish_marker(self.marker_path(stage), built)
            except OSError as e:
                # Our temp file collected by a successor that claimed while we were paused?
                lease.check()
                raise OSError(e.errno, f"publishing {self.marker_path(stage)}: {e}") from e
            if published:
                lease.set_phase(stage.name, "published")
                self.emit("stage_built", stage=stage.name, lease_id=lease.lease_id, info=built.info)
                self._collect_stage_garbage(stage, built, lease)
                return built
            self._await_visible(self.marker_path(stage))
        raise RuntimeError(
            f"{self.marker_path(stage)}: could not publish after {_MAX_PUBLISH_ATTEMPTS} "
            "attempts (markers keep appearing and being found invalid)"
        )

    def _await_visible(self, path: Path) -> None:
        """``link`` said the marker exists; this host's negative lookup cache (NFS
        ``acdirmax``) may hide it for a while: wait for it, boundedly."""
        deadline = time.monotonic() + self.timing.lease_timeout
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(self.timing.poll_interval)

    def _retire_marker(self, stage: Stage, earlier: Mapping[str, Marker], lease: Lease) -> None:
        """Move an invalid marker aside; put it back if what we moved is valid after all
        (a stale builder published between our judgement and the move)."""
        path = self.marker_path(stage)
        retired = self.cache_dir / retired_marker_name(stage.name, secrets.token_hex(8))
        try:
            os.rename(path, retired)
        except FileNotFoundError:
            return  # somebody else moved it
        marker, _ = self._check_marker(stage, earlier, path=retired)
        if marker is not None:
            try:
                os.link(retired, path)
            except FileExistsError:
                pass  # yet another publication: judged on the next round
            _unlink(retired)
            return
        fsync_dir(self.cache_dir)
        self.emit("marker_retired", stage=stage.name, lease_id=lease.lease_id)

    def _collect_stage_garbage(self, stage: Stage, published: Marker, lease: Lease) -> None:
        """Delete ``stage`` folders that no marker names and none ever can any more.

        Safe once ``stage``'s marker is in place: publication is create-if-absent, so a
        folder it does not name stays unpublished for good. Folders named by retired
        markers are left for ``--clean`` (their readers may still hold them).
        """
        if not lease.owned():
            return
        retired_dirs = set()
        for name in os.listdir(self.cache_dir):
            if name.startswith(f"{marker_name(stage.name)}.retired-"):
                d = read_json(self.cache_dir / name)
                if isinstance(d, dict) and isinstance(d.get("directory"), str):
                    retired_dirs.add(d["directory"])
        for name in os.listdir(self.cache_dir):
            parsed = parse_stage_dir(name)
            ours = parsed is not None and parsed.stage == stage.name
            legacy = name == stage.name  # hf_pipeline <= 0.1 folder, not (or no longer) named
            if (ours or legacy) and name != published.directory and name not in retired_dirs:
                _discard_dir(self.cache_dir / name)

    def _build_stage(self, stage: Stage, lease: Lease, markers: dict[str, Marker]) -> Marker:
        """Build ``stage`` into this lease's own folder; the marker, not yet published."""
        name = stage_dir_name(stage.name, lease.lease_id)
        # Something in its place already (this lease's id is new: someone put it there)
        # is refused by name, never built into, followed or removed through.
        folder = own_folder(self.cache_dir, name, create=False)
        folder.mkdir()
        try:
            lease.set_phase(stage.name, "building")
            self.emit("building", stage=stage.name, lease_id=lease.lease_id)
            started = time.time()
            ctx = StageContext(
                stage=stage.name,
                tmp_dir=folder,
                cache_dir=self.cache_dir,
                fingerprint=self.fingerprint,
                previous={name: self.cache_dir / m.directory for name, m in markers.items()},
                markers=dict(markers),
                lease_id=lease.lease_id,
                probe=lease.probe,
                _check=lease.check,
                _phase=lambda phase: lease.set_phase(stage.name, phase),
            )
            info = dict(stage.build(ctx) or {})
            # Lost while building? Then what the build wrote is not ours to describe:
            # the except below removes it (a successor may have collected it already
            # and the build re-created some of it).
            lease.check()
            try:
                json.dumps(info)
            except (TypeError, ValueError) as e:
                raise TypeError(f"stage {stage.name!r} build returned non-JSON info: {e}") from e
            _fsync_tree(folder)
            fsync_dir(self.cache_dir)
            files = describe_files(folder, relative_to=self.cache_dir, recorded=ctx.recorded)
            lease.set_phase(stage.name, "publishing")
            self.emit("publishing", stage=stage.name, lease_id=lease.lease_id)
            return Marker(
                fingerprint=self.fingerprint,
                stage=stage.name,
                directory=folder.name,
                host=self.host,
                pid=self.pid,
                lease_id=lease.lease_id,
                started_at=started,
                finished_at=time.time(),
                info=info,
                files=files,
                inputs={name: m.directory for name, m in markers.items()},
            )
        except LeaseLostError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        except BaseException as e:
            shutil.rmtree(folder, ignore_errors=True)  # frees the space a full disk needs
            if not isinstance(e, Exception):
                raise
            if not lease.owned():
                # Probably failed *because* we were taken over (our folder collected).
                raise LeaseLostError(
                    f"{self.cache_dir}: lease {lease.lease_id} lost during the build "
                    f"({type(e).__name__}: {e})",
                    str(self.cache_dir),
                    lease.lease_id,
                ) from e
            marker, _ = self._check_marker(stage, markers)
            if marker is not None:
                # A stale lease published this stage meanwhile (and collected our folder):
                # the cache is fine, our failure is moot.
                self.emit("publish_lost", stage=stage.name, lease_id=lease.lease_id)
                return marker
            self._write_failure(lease, stage, e)
            raise

    def _write_failure(self, lease: Lease, stage: Stage, error: Exception) -> None:
        record = {
            "lease_id": lease.lease_id,
            "host": self.host,
            "pid": self.pid,
            "stage": stage.name,
            "error_type": type(error).__name__,
            "message": str(error),
            # The input's fault (an error type that says so): the waiters exit as the
            # builder does, with the input's code, not the fault's.
            "input_error": bool(getattr(error, "input_error", False)),
            "wall_time": time.time(),
        }
        try:
            write_json_atomic(
                self.cache_dir / f"failed-{lease.lease_id}.json", record, sort_keys=True, indent=1
            )
        except OSError as e:
            logger.error(
                "%s: could not write failure record (%s); waiters will time out "
                "on the lease instead",
                self.cache_dir,
                e,
            )
        self.emit("failed", stage=stage.name, error=f"{type(error).__name__}: {error}")


def complete_markers(
    cache_dir: str | os.PathLike[str], fingerprint: str, stages: Sequence[str]
) -> dict[str, Marker] | None:
    """The markers of ``stages`` if every one is valid (the cache is complete), else None.

    Reads only; what :func:`ensure_built` checks first. Process-safe.
    """
    markers: dict[str, Marker] = {}
    for name in stages:
        marker, why = check_marker(
            Path(cache_dir) / marker_name(name), fingerprint=fingerprint,
            base_dir=Path(cache_dir), stage=name,
        )  # fmt: skip
        if marker is None or derived_from_problem(marker, markers) is not None:
            return None
        markers[name] = marker
    return markers


def retire_damaged(cache_dir: str | os.PathLike[str], fingerprint: str, stage: str) -> str | None:
    """Move ``stage``'s marker aside when its files fail their checksums, so that the
    next :func:`ensure_built` builds the stage again; return why (None: it is valid).

    What :func:`ensure_built` does with a marker whose files are missing or cut short,
    for damage only a read finds (``verify=True``: :func:`dist.markers.file_problems`,
    each file's edges; :func:`retire_marker` for damage a whole read found).
    """
    folder = Path(cache_dir)
    path = folder / marker_name(stage)
    _, why = check_marker(path, fingerprint=fingerprint, base_dir=folder, stage=stage, verify=True)
    if why is None:
        return None
    marker, _ = parse_marker(path, fingerprint=fingerprint, stage=stage)
    if marker is not None:
        retire_marker(folder, stage, marker.directory, why)
    return why


def retire_marker(cache_dir: str | os.PathLike[str], stage: str, directory: str, why: str) -> bool:
    """Move ``stage``'s marker aside to ``<stage>.json.retired-<id>`` if it publishes
    ``directory`` (found damaged: ``why``); True if this call moved it.

    Re-checked after the move: a marker that names another folder (another builder
    published a new one between the judgement and the move) is linked back. The folder
    is left as it is (files other caches hard-link stay theirs) for ``--clean``.
    Process-safe: of several callers one moves it, the others find it gone.
    """
    folder = Path(cache_dir)
    path = folder / marker_name(stage)
    retired = folder / retired_marker_name(stage, secrets.token_hex(8))
    try:
        os.rename(path, retired)
    except FileNotFoundError:
        return False  # somebody else moved it
    moved = read_json(retired)
    if not isinstance(moved, dict) or moved.get("directory") != directory:
        with contextlib.suppress(FileExistsError):
            os.link(retired, path)
        _unlink(retired)
        return False
    fsync_dir(folder)
    logger.warning("retired marker %s (%s/ is damaged: %s)", path, directory, why)
    return True


def ensure_built(
    cache_dir: str | os.PathLike[str],
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
    on_event: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, Marker]:
    """Make sure every stage of the cache in ``cache_dir`` is built; build it if we must.

    Every process of the job calls this with the same arguments. Exactly one builds
    (see the module docstring for the protocol); all return the same markers.
    Process-safe across hosts sharing ``cache_dir``; call it from one thread per process.

    Args:
        cache_dir: the folder of this one cache (one fingerprint).
        fingerprint: the cache identity; a marker of another fingerprint is ignored.
        stages: the stages in order; stage k+1 sees the published folders of 0..k.
        process: this process (default: :func:`dist.env.detect`); a waiting process
            other than its host's first (``local_rank`` > 0) logs its waits at DEBUG.
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
            ``lease_dead``, ``building``, ``publishing``, ``marker_write``, ``stage_built``,
            ``stage_skipped``, ``publish_lost``, ``marker_retired``, ``failed``,
            ``lease_lost``, ``complete`` (tests, metrics). ``complete`` carries
            ``built``: True only in the process whose lease published a stage.

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
    if builder is None:
        if process is None:
            process = detect()
        builder = default_builder(process, "shared")
    world_size = process.world_size if process is not None else 1
    if wakeup == "auto":
        wakeup = auto_doorbell(cache_dir, fingerprint)
    coordinator = _Coordinator(
        cache_dir, fingerprint, stages, bool(builder), timing, wakeup, on_event, world_size,
        reports=process is None or process.local_rank == 0,
    )  # fmt: skip
    return coordinator.run()
