"""The builder's lease: the ``lease`` file that names the one builder, and its heartbeat.

Files in a cache folder (see :mod:`dist.layout`)::

    lease                      JSON {lease_id, host, pid, proc}; created O_EXCL, never
                               rewritten
    heartbeat-<lease id>.json  the holder's heartbeat: a counter that moves while it lives

The heartbeat lives in its own per-lease file rather than in ``lease``: if heartbeats
rewrote ``lease`` with ``os.replace``, a builder that was merely paused (GC, SIGSTOP, an
NFS hang) would, on waking, resurrect its lease over the one of the process that took
over. A per-lease heartbeat file can only ever describe its own lease. Liveness is judged
by the *reader's* clock seeing the counter move (never by comparing mtimes).

Removing a lease is a ``rename`` of ``lease`` to a unique name (one winner among
concurrent removers), then a check of what was moved (:func:`move_lease`).

*A holder that provably exited.* ``proc`` names the holder's process beyond its pid: the
kernel's boot id, its pid namespace and its start time (Linux). A reader that shares the
boot id and the pid namespace can look the holder up in ``/proc``: when no such process
runs (gone, a zombie, or the pid reused by a process that started at another time) the
lease is dead now, without waiting ``lease_timeout`` for its heartbeat to stall
(:func:`holder_exited`). Everyone else (another host, another container, another OS, a
lease written by an earlier release) judges by the heartbeat alone, as before. A
stopped holder (SIGSTOP) still runs, so it is judged by its heartbeat: fencing, not this
check, protects what it may still write.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path

import xxhash

from dist.atomic import fsync_dir, write_json_atomic
from dist.errors import LeaseLostError
from dist.markers import MAX_JSON_BYTES, parse_json, read_json, read_regular_bytes
from dist.safepath import own_folder

__all__ = [
    "LEASE_FILE",
    "Lease",
    "LeaseProbe",
    "LeaseView",
    "heartbeat_counter",
    "heartbeat_path",
    "holder_exited",
    "move_lease",
    "process_identity",
    "read_lease",
    "try_claim",
]

logger = logging.getLogger(__name__)

LEASE_FILE = "lease"


@dataclasses.dataclass(frozen=True)
class LeaseView:
    """What ``lease`` said when read.

    Attributes:
        key: the lease id, or a digest of unparsable content (a claimer died mid-write).
        lease_id, host, pid: the holder, when the file parsed.
        proc: the holder's process identity (:func:`process_identity`), when the lease
            carried a well-formed one.
    """

    key: str
    lease_id: str | None
    host: str | None
    pid: int | None
    proc: tuple[str, str, int] | None = None


def _parse_lease(raw: bytes) -> LeaseView:
    try:
        d = parse_json(raw, path=LEASE_FILE)  # bounded depth: a lease file others wrote
        lease_id = str(d["lease_id"])
    except (ValueError, KeyError, TypeError):
        return LeaseView("raw-" + xxhash.xxh64(raw).hexdigest(), None, None, None)
    pid = d.get("pid")
    pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
    return LeaseView(lease_id, lease_id, d.get("host"), pid, _parse_proc(d.get("proc")))


def _parse_proc(value: object) -> tuple[str, str, int] | None:
    """A lease's ``proc`` field, checked: anything else (absent, foreign) is None."""
    if not isinstance(value, dict):
        return None
    boot, ns, start = value.get("boot"), value.get("pidns"), value.get("start")
    if not (isinstance(boot, str) and isinstance(ns, str) and 0 < len(boot) <= 64):
        return None
    if len(ns) > 64 or not isinstance(start, int) or isinstance(start, bool) or start < 0:
        return None
    return boot, ns, start


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) of ``pid`` from ``/proc``; None if
    no such process (or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096)
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "pid (comm) state ppid ... starttime": comm may hold spaces and parentheses.
    fields = raw[raw.rfind(b")") + 2 :].split()
    return fields[0].decode("ascii", "replace"), int(fields[19])


def process_identity(pid: int | None = None) -> dict[str, object] | None:
    """This machine's boot id, this process's pid namespace and ``pid``'s start time
    (default: this process); None where ``/proc`` does not tell (not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read(64).strip()
        ns = os.readlink("/proc/self/ns/pid")
        stat = _proc_stat(os.getpid() if pid is None else pid)
    except (OSError, ValueError, IndexError):
        return None
    if not boot or stat is None:
        return None
    return {"boot": boot, "pidns": ns, "start": stat[1]}


def holder_exited(view: LeaseView) -> bool:
    """True only when ``view``'s holder provably no longer runs: it shares this host's
    name, this machine's boot and this process's pid namespace, and ``/proc`` has no process of its pid and
    start time that is not a zombie. False when that cannot be told (see the module
    docstring): the caller then judges by the heartbeat."""
    if view.proc is None or view.pid is None or view.pid <= 0:
        return False
    if view.host != socket.gethostname():
        return False  # another host's name (or a UTS namespace of its own): its heartbeat
    here = process_identity()
    if here is None or (here["boot"], here["pidns"]) != view.proc[:2]:
        return False
    try:
        stat = _proc_stat(view.pid)
    except (OSError, ValueError, IndexError):
        return False  # unreadable: unknown, not dead
    if stat is None:
        return True
    state, start = stat
    return start != view.proc[2] or state in ("Z", "X", "x")


def read_lease(path: Path) -> LeaseView | None:
    """The lease file at ``path``; None if there is none. OSError (ESTALE...) propagates."""
    try:
        # Bounded, and a fifo or device is no lease (read as garbage, never waited on).
        return _parse_lease(read_regular_bytes(path, MAX_JSON_BYTES) or b"")
    except FileNotFoundError:
        return None


def heartbeat_path(cache_dir: Path, lease_id: str) -> Path:
    return cache_dir / f"heartbeat-{lease_id}.json"


def heartbeat_counter(cache_dir: Path, lease_id: str) -> int | None:
    """The last heartbeat counter of ``lease_id`` (None when absent or unreadable)."""
    hb = read_json(heartbeat_path(cache_dir, lease_id))
    counter = hb.get("counter") if isinstance(hb, dict) else None
    return counter if isinstance(counter, int) else None


def try_claim(cache_dir: Path, lease_id: str, host: str, pid: int) -> bool:
    """Create ``lease`` naming ``lease_id`` with O_EXCL; False if one exists."""
    path = cache_dir / LEASE_FILE
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except FileNotFoundError:
        # The folder went away while we waited (`prebuild_cache.py --clean` of a dead
        # builder's cache): make it again and claim it, rather than die on ENOENT. A real
        # folder only: a link put in its place meanwhile is refused, never claimed through.
        own_folder(cache_dir.parent, cache_dir.name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
    try:
        record: dict[str, object] = {"lease_id": lease_id, "host": host, "pid": pid}
        proc = process_identity(pid) if pid == os.getpid() else None
        if proc is not None:
            record["proc"] = proc
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(cache_dir)
    return True


def move_lease(cache_dir: Path, expected_key: str, purpose: str) -> bool:
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
        view = read_lease(moved)
    except OSError:
        view = None
    if view is None:
        return False  # vanished under us (someone cleaning up); nothing to restore
    if view.key == expected_key:
        _unlink(moved)
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


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _owner_now(lease_file: Path, lease_id: str, *, tries: int = 4) -> bool:
    """Re-read ``lease``; a brief absence (a taker's ABA rename in flight) is retried."""
    for attempt in range(tries):
        try:
            view = read_lease(lease_file)
        except OSError:  # ESTALE/EIO: unknown, like absent; retry
            view = None
        if view is not None:
            return view.key == lease_id
        time.sleep(0.02 * (attempt + 1))
    return False


@dataclasses.dataclass(frozen=True)
class LeaseProbe:
    """A picklable ownership check for the processes a stage build starts (map workers).

    ``check()`` re-reads ``lease`` and raises :class:`LeaseLostError` when another lease
    holds it, so a worker of a builder that lost its lease stops at its next item
    instead of finishing work nobody will publish. Process- and thread-safe (reads only).
    """

    cache_dir: Path
    lease_id: str

    def check(self) -> None:
        if not _owner_now(self.cache_dir / LEASE_FILE, self.lease_id):
            raise LeaseLostError(
                f"{self.cache_dir}: lease {self.lease_id} was taken over by another process",
                str(self.cache_dir),
                self.lease_id,
            )


class Lease:
    """This process's ownership of ``cache_dir`` and its heartbeat thread.

    ``start()`` beats once and starts a daemon thread that beats every ``interval``
    seconds and notices a takeover; ``check()`` raises :class:`LeaseLostError` once the
    lease is gone. ``stop()`` joins the thread (bounded); ``release()`` also removes the
    lease. Thread-safe.
    """

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

    @property
    def probe(self) -> LeaseProbe:
        return LeaseProbe(self.cache_dir, self.lease_id)

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
            if self._lost.is_set():
                return  # a lost lease's heartbeat must not look alive to anybody
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
                    heartbeat_path(self.cache_dir, self.lease_id),
                    record,
                    durable=False,
                    sort_keys=True,
                    indent=1,
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
                view = read_lease(self.cache_dir / LEASE_FILE)
            except OSError as e:  # ESTALE/EIO on a flaky NFS mount: count as absent
                logger.debug("heartbeat: cannot read lease: %s", e)
                view = None
            absent = absent + 1 if view is None else 0  # may be a taker's ABA rename
            if (view is not None and view.key != self.lease_id) or absent >= 3:
                logger.warning("lease %s was taken over; standing down", self.lease_id)
                self._lost.set()
                return
            self._beat()

    def owned(self) -> bool:
        """Re-read ``lease`` now (a brief absence is tolerated: see :func:`move_lease`)."""
        if self._lost.is_set():
            return False
        return _owner_now(self.cache_dir / LEASE_FILE, self.lease_id)

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
            move_lease(self.cache_dir, self.lease_id, "released")
        _unlink(heartbeat_path(self.cache_dir, self.lease_id))
