"""A published cache streamed by several worker processes (``loader.stream_workers``).

Why. A :class:`~hf_pipeline.read.stream.StreamSource` does its ranged reads (the HTTP
client) and its gathers and planning in one process, under one GIL: a globally shuffled
sample costs ~0.08 ms of reads and ~0.07 ms of gathers there, so one process stops near
5k samples/s on the 16-CPU H200 host whatever the concurrency (benchmarks/NOTES.md,
"CPU per ranged read"). :class:`StreamWorkers` runs that work in ``workers`` processes.

What it is. The same interface as a :class:`StreamSource` where the
:class:`~hf_pipeline.read.loader.Loader` uses one (``num_rows``, ``fingerprint``,
``plan``, ``gather``, ``stats``, ...): it opens the published cache in this process first
(the same checks, the same errors; with a cache of 0 bytes: it reads only what a gather
outside the plan asks for), then starts the workers
(:mod:`hf_pipeline.read.stream.worker`: fork and exec, never a fork of this process, so
JAX, CUDA and this process's threads are no concern), each with its own StreamSource
over the same URL and ``cache_bytes // workers`` of the cache: the limit holds for the
host.

Who reads what. Each worker owns stripes of the cache's rows (stripe ``k`` of
:data:`STRIPE_BYTES` of latents goes to worker ``k % workers``). Every planned batch is
split by owner, and each worker plans, fetches and assembles its rows of every batch,
``ahead`` batches ahead, into the batch's slot of shared memory
(:mod:`hf_pipeline.read.stream.slots`) at their places. So a block shuffle's window is
still read in long runs (a worker reads its stripes of it), a global shuffle's reads are
split over the workers, a worker holds only its own stripes' blocks, and the batches are
one process's, bit for bit. (Whole steps per worker, step ``i`` to worker ``i % N``,
would have every worker read most blocks of each block-shuffle window for ``1/N`` of
its rows.)

Order and memory. Batch ``i`` of a plan is assembled in slot ``i % slots``; a worker
starts on it only once batch ``i - slots`` was copied out. A gather of batch ``i`` waits
until every worker has done its part, copies the arrays out (one copy; no array handed
out ever shares memory with a slot, which is reused at once) and releases the slot. The
memory: the workers' caches (``cache_bytes`` together), ``slots`` batches of shared
memory (``loader.prefetch + 1`` from :func:`~hf_pipeline.read.stream.open_stream`),
and each worker's part of the batch it assembles.

Failures. A worker's error (a range that fails its checksum twice, a hopeless store)
is raised by the gather of its batch and of every later one: the same exception, the
same one line, as in one process. A worker that exits (killed, out of memory) or sends
nothing for :data:`SILENT_S` seconds (it says it is alive every second) is a
:class:`~hf_pipeline.workers.persistent.WorkerExitedError` naming it, from every gather
from then on: never a hang. Workers die with this process (SIGKILL included:
``PR_SET_PDEATHSIG``, and their socket's end), ignore Ctrl-C (this process closes
them), and leave nothing behind: the slots have no name (``memfd``: nothing in
``/dev/shm``), and :meth:`StreamWorkers.close`, the garbage collector or the
interpreter's exit stop the processes.

Thread-safety: as a StreamSource: ``gather`` from several threads at once, one ``plan``
at a time, ``close`` from any thread (idempotent).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.reduction import sendfds
from pathlib import Path
from typing import Any

import numpy as np

from hf_pipeline.read.stream.options import StreamOptions
from hf_pipeline.read.stream.slots import batch_fields, map_slot, new_slot, slot_bytes, views
from hf_pipeline.read.stream.source import StreamSource, StreamStats
from hf_pipeline.stores.retry import RetryPolicy
from hf_pipeline.workers.persistent import WorkerExitedError

__all__ = ["MAX_WORKERS", "SILENT_S", "STRIPE_BYTES", "StreamWorkers"]

#: The most worker processes.
MAX_WORKERS = 256
#: Rows are dealt to the workers in stripes of about this many bytes of latents. A read
#: never crosses a stripe's end, so each plan's flush cuts about one read per stripe
#: (4 MiB on the 2-CPU VM's bench: 3.0k -> 4.4k reads of a global epoch, 303 -> 566 of
#: a block one); a block-shuffle window's rows spread over the workers only as far as
#: it spans stripes (a window of 4 x 1,024 rows of 28 KB is ~14 of 8 MiB).
STRIPE_BYTES = 8 << 20
#: A worker that sends nothing for this long (it says it is alive every second) is
#: taken for dead (stopped, or hung).
SILENT_S = 60.0
#: Seconds the workers have to start and open the published cache.
_START_S = 180.0
#: Seconds close() waits for the workers to exit before it kills them.
_CLOSE_S = 10.0
#: Seconds a stats() or cache_state() question waits for the workers' answers.
_ASK_S = 60.0
_STOP_CHECK_S = 0.1
#: The plan is sent to the workers ``3 x ahead + slots`` and this many batches past the
#: last one copied out: a worker's planner looks up to ``3 x ahead`` batches past the
#: one it assembles (``ahead``, up to ``ahead`` more completing a refill's window, and
#: the next ``ahead`` it peeks at), which is up to ``slots`` past that. A worker whose
#: planner waits for a batch not sent (it must never wait on the plan while the gather
#: it serves waits on it) asks for it, and gets ``ahead`` batches past it: asked one
#: at a time, the round trips held the first batch of the 2-CPU VM's bench 5-14 s.
_FEED_SLACK = 4


def _feed_ahead(ahead: int, slots: int) -> int:
    """Batches the plan is sent past the last one copied out, unasked."""
    return 3 * ahead + slots + _FEED_SLACK


_WORKER_MAIN = "from hf_pipeline.read.stream.worker import main; main()"


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit code yet"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"code {code}"


class _Plan:
    """One plan in this process (guarded by the crew's condition)."""

    def __init__(self, gen: int, slots: int):
        self.gen = gen
        self.slots = slots
        self.index_of: dict[Any, int] = {}
        self.items: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # rows, crops
        self.done: collections.Counter[int] = collections.Counter()
        self.released = 0  # batches 0 .. released - 1 copied out
        self.copied: set[int] = set()  # copied out, past ``released``
        self.copying = 0
        self.fed = 0
        self.wanted = -1  # the furthest batch a worker asked for
        self.count: int | None = None  # batches in the plan, once the feeder ended
        self.failed: tuple[int, BaseException] | None = None
        self.stopped = False
        self.feeder: threading.Thread | None = None

    def fail(self, index: int, exc: BaseException) -> None:
        if self.failed is None or index < self.failed[0]:
            self.failed = (index, exc)


class _Crew:
    """The worker processes, their sockets and the thread that reads them; no reference
    to the :class:`StreamWorkers` (its finalizer closes this)."""

    def __init__(self, url: str, count: int):
        self.url = url
        self.count = count
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.pids: list[int] = []
        self._send_locks: list[threading.Lock] = []
        self.cv = threading.Condition()
        self.last_seen: list[float] = []
        self.dead: BaseException | None = None
        self.closed = False
        self.plan: _Plan | None = None
        self.replies: dict[int, list] = {}
        self.acks: dict[int, int] = collections.Counter()  # plan gen -> workers stopped
        self.slots: list = []  # maps of the slots
        self.slot_bytes = 0
        self._receiver: threading.Thread | None = None

    # ------------------------------------------------------------------ start

    def spawn(self, opening: tuple) -> None:
        """Start the workers and have each open the cache (``opening``: the ``open``
        message); :meth:`ready` waits for them."""
        from hf_pipeline.workers.pool import in_lasting_thread

        root = str(Path(__file__).resolve().parents[3])  # this hf_pipeline's, first
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH", "")) if p
        )}  # fmt: skip
        for _ in range(self.count):
            ours, theirs = socket.socketpair()
            try:
                cmd = [sys.executable, "-c", _WORKER_MAIN, str(theirs.fileno()), str(os.getpid())]
                # From a thread that lives as long as this process: the worker's
                # PR_SET_PDEATHSIG fires when the thread that started it ends.
                proc = in_lasting_thread(
                    functools.partial(
                        subprocess.Popen,
                        cmd,
                        pass_fds=(theirs.fileno(),),
                        env=env,
                        stdin=subprocess.DEVNULL,
                    )
                )
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            self.procs.append(proc)
            self.pids.append(proc.pid)
            self.conns.append(Connection(ours.detach()))
            self._send_locks.append(threading.Lock())
        for k in range(self.count):
            self.send(k, opening)

    def ready(self) -> None:
        """Wait until every worker opened the cache, then read them on a thread.

        Raises:
            Exception: what a worker's open raised (SourceError, ...).
            WorkerExitedError: a worker exited before it was ready.
            TimeoutError: not ready within :data:`_START_S`.
        """
        deadline = time.monotonic() + _START_S
        for k, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(
                    f"stream worker {k} (pid {self.pids[k]}) of {self.url} was not ready "
                    f"after {_START_S:.0f} s"
                )
            try:
                answer = conn.recv()
            except (EOFError, OSError):
                raise self._exited(k, "while it opened the cache") from None
            if answer[0] == "failed":
                raise answer[1]
        now = time.monotonic()
        self.last_seen = [now] * self.count
        self._receiver = threading.Thread(
            target=self._receive, name="hf_pipeline-stream-workers", daemon=True
        )
        self._receiver.start()

    # ------------------------------------------------------------------ messages

    def send(self, k: int, message) -> None:
        with self._send_locks[k]:
            self.conns[k].send(message)

    def broadcast(self, message) -> None:
        for k in range(self.count):
            self.send(k, message)

    def send_slots(self, nbytes: int, fds: list[int]) -> None:
        """Every worker maps the slots ``fds`` (``nbytes`` each) from its next batch."""
        for k in range(self.count):
            with self._send_locks[k]:
                self.conns[k].send(("slots", nbytes, len(fds)))
                with socket.socket(fileno=os.dup(self.conns[k].fileno())) as sock:
                    sendfds(sock, fds)

    def _receive(self) -> None:
        from multiprocessing.connection import wait

        live = dict(enumerate(self.conns))
        while live and not self.closed:
            try:
                ready = wait(list(live.values()), timeout=0.5)
            except OSError:  # closed under us: close() runs
                return
            now = time.monotonic()
            for k, conn in list(live.items()):
                if conn not in ready:
                    # Nothing pending (a paused process would find its heartbeats
                    # waiting here): silent for real.
                    if now - self.last_seen[k] > SILENT_S:
                        self._lost(k, silent=True)
                        del live[k]
                    continue
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    del live[k]
                    self._lost(k)
                    continue
                self._on_message(k, message, now)

    def _on_message(self, k: int, message, now: float) -> None:
        kind = message[0]
        with self.cv:
            self.last_seen[k] = now
            plan = self.plan
            if kind == "done":
                _, gen, index = message
                if plan is not None and plan.gen == gen:
                    plan.done[index] += 1
                    if plan.done[index] == self.count:
                        self.cv.notify_all()
            elif kind == "error":
                _, gen, index, exc = message
                if plan is not None and plan.gen == gen:
                    plan.fail(index, exc)
                    self.cv.notify_all()
            elif kind == "reply":
                _, request, value = message
                if request in self.replies:
                    self.replies[request].append(value)
                    self.cv.notify_all()
            elif kind == "want":
                _, gen, index = message
                if plan is not None and plan.gen == gen and index > plan.wanted:
                    plan.wanted = index
                    self.cv.notify_all()
            elif kind == "stopped":
                self.acks[message[1]] += 1
                self.cv.notify_all()

    def _exited(self, k: int, doing: str) -> WorkerExitedError:
        proc = self.procs[k]
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(2.0)  # its exit code, if it is only now exiting
        return WorkerExitedError(
            f"stream worker {k} of {self.count} (pid {proc.pid}) of {self.url} exited "
            f"with {_exit_text(proc.returncode)} {doing}",
            proc.pid,
            proc.returncode,
        )

    def _lost(self, k: int, silent: bool = False) -> None:
        if self.closed:
            return
        if silent:
            error: BaseException = WorkerExitedError(
                f"stream worker {k} of {self.count} (pid {self.pids[k]}) of {self.url} "
                f"sent nothing for {SILENT_S:.0f} s (stopped, or hung): given up",
                self.pids[k],
                None,
            )
        else:
            error = self._exited(k, "while streaming")
        with self.cv:
            if self.dead is None:
                self.dead = error
            self.cv.notify_all()

    def check(self) -> None:
        """Raise what stops every call (caller holds ``cv``)."""
        if self.dead is not None:
            raise self.dead
        if self.closed:
            raise RuntimeError(f"the stream of {self.url} is closed")

    def wait(self, until, what: str, timeout: float | None = None) -> None:
        """Wait (caller holds ``cv``) until ``until()`` is true, in short slices that
        look at a worker's death and at close.

        Raises:
            WorkerExitedError, RuntimeError: as :meth:`check`.
            TimeoutError: ``timeout`` seconds passed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not until():
            self.check()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the workers streaming {self.url}: no {what} in {timeout} s")
            self.cv.wait(_STOP_CHECK_S)

    # ------------------------------------------------------------------ stop

    def close(self) -> None:
        """Stop the workers (asked, then killed after :data:`_CLOSE_S`), close the
        sockets and unmap the slots. Idempotent; any thread."""
        with self.cv:
            if self.closed:
                return
            self.closed = True
            if self.plan is not None:
                self.plan.stopped = True
            self.cv.notify_all()
        for k in range(len(self.conns)):
            with contextlib.suppress(OSError, ValueError):
                self.send(k, ("close",))
        # Not ready yet (this process's own open failed): a worker may be retrying a
        # hopeless store for minutes before it reads "close".
        grace = _CLOSE_S if self._receiver is not None else 0.0
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(2.0)
        for conn in self.conns:
            conn.close()
        if self._receiver is not None and self._receiver is not threading.current_thread():
            self._receiver.join(2.0)
        self.unmap()

    def unmap(self) -> None:
        slots, self.slots, self.slot_bytes = self.slots, [], 0
        for buf in slots:
            with contextlib.suppress(BufferError):  # still viewed: closed when dropped
                buf.close()


def _combined(parts: list[StreamStats]) -> StreamStats:
    """The stats of several sources as one: counts and bytes summed (the most held, in
    flight or reads running: each source's most, summed, a bound for them together),
    times the longest."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(StreamStats):
        values = [getattr(part, field.name) for part in parts]
        known = [v for v in values if v is not None]
        if field.name in ("first_batch_s", "read_s", "starved_s", "held_back_s"):
            out[field.name] = max(known) if known else None
        elif isinstance(values[0], dict):
            total: collections.Counter[str] = collections.Counter()
            for v in values:
                total.update(v)
            out[field.name] = dict(sorted(total.items()))
        else:
            out[field.name] = sum(known) if known else None
    if out["read_s"] is None:
        out["read_s"] = 0.0
    return StreamStats(**out)


def _feed(crew: _Crew, plan: _Plan, meta: StreamSource, fields, stripe: int, ahead: int, batches):
    """The feeder thread: the plan's batches, split by owner, sent to the workers up to
    :func:`_feed_ahead` batches past the last one copied out, and ``ahead`` past the
    furthest one a worker asked for; the slots made for the first."""
    unasked = _feed_ahead(ahead, plan.slots)
    index = 0
    try:
        for item in batches:
            position, rows = item[0], np.asarray(item[1], dtype=np.int64).reshape(-1)
            if len(item) < 3:
                raise TypeError(
                    "a plan for stream workers needs (position, rows, crops) per batch: "
                    "the workers assemble the batches"
                )
            crops = np.broadcast_to(np.asarray(item[2], dtype=np.int64), rows.shape)
            with crew.cv:
                crew.wait(
                    lambda at=index: (
                        plan.stopped
                        or at < plan.released + unasked
                        or (plan.wanted >= 0 and at <= plan.wanted + ahead)
                    ),
                    "room",
                )
                if plan.stopped:
                    return
            if index == 0:
                _make_slots(crew, fields, rows.size, plan.slots)
            elif slot_bytes(fields, rows.size) > crew.slot_bytes:
                raise ValueError(
                    f"batch {index} of the plan has {rows.size} rows, more than its first "
                    "(the slots are sized for it)"
                )
            owner = (meta.physical(rows) // stripe) % crew.count
            with crew.cv:
                plan.index_of[position] = index
                plan.items[index] = (rows, crops)
            for k in range(crew.count):
                mine = np.flatnonzero(owner == k)
                entry = ("entry", plan.gen, index, position, rows[mine], crops[mine], mine)
                crew.send(k, (*entry, rows.size))
            with crew.cv:
                plan.fed = index = index + 1
                crew.cv.notify_all()
        crew.broadcast(("end", plan.gen, index))
        with crew.cv:
            plan.count = index
            crew.cv.notify_all()
    except BaseException as exc:  # noqa: BLE001 - raised by the gather of this batch
        with crew.cv:
            plan.fail(index, exc)
            crew.cv.notify_all()


def _make_slots(crew: _Crew, fields, rows: int, count: int) -> None:
    """``count`` slots of batches of ``rows`` rows, unless those there hold them."""
    need = slot_bytes(fields, rows)
    if need <= crew.slot_bytes and len(crew.slots) == count:
        return
    fds = [new_slot(need) for _ in range(count)]
    try:
        maps = [map_slot(fd, need) for fd in fds]
        crew.send_slots(need, fds)
    finally:
        for fd in fds:
            os.close(fd)
    crew.unmap()  # no copy runs: a plan starts after the last one's copies ended
    crew.slots, crew.slot_bytes = maps, need


def _shut(crew: _Crew, meta: StreamSource) -> None:
    crew.close()
    meta.close()


class StreamWorkers:
    """A published cache read and assembled by ``workers`` processes (see the module
    docstring); what a :class:`~hf_pipeline.read.loader.Loader` streams through when
    ``loader.stream_workers`` is more than 1 (:func:`~hf_pipeline.read.stream.open_stream`).

    Args:
        url, options, policy, fingerprint: as :class:`StreamSource`; ``options``'
            ``cache_bytes`` is the host's: each worker gets ``cache_bytes // workers``,
            and ``ahead`` and ``concurrency`` each worker (per process, as ever).
        workers: worker processes, 1 to :data:`MAX_WORKERS`.
        slots: batches of shared memory the workers assemble into (>= 1): how far they
            run ahead of the gathers.

    Raises:
        ValueError: ``workers`` or ``slots`` out of range.
        SourceError, StoreUnreachableError, CacheFormatError: as :class:`StreamSource`
            (this process opens the cache first, then each worker).
        WorkerExitedError: a worker exited before it was ready.
        TimeoutError: the workers were not ready within 3 minutes.
    """

    def __init__(
        self,
        url: str,
        options: StreamOptions | None = None,
        *,
        workers: int,
        slots: int = 5,
        policy: RetryPolicy | None = None,
        fingerprint: str | None = None,
    ):
        if isinstance(workers, bool) or not isinstance(workers, int):
            raise TypeError(f"workers must be an int, got {type(workers).__name__}")
        if not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"workers must be in [1, {MAX_WORKERS}], got {workers}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        self.options = options or StreamOptions()
        self.workers = workers
        self.slots = slots
        self.worker_options = self.options.shared_by(workers)
        self._crew = crew = _Crew(url, workers)
        try:
            # The workers start (a fresh interpreter each, then their own open of the
            # cache) while this process opens it: the first batch waits for the slower
            # of the two, not for both in turn.
            crew.spawn(("open", url, self.worker_options, policy, fingerprint))
            # This process's own: the checks and errors of opening (raised before any
            # worker's), the metadata, and any gather outside the plan (read on demand,
            # nothing kept).
            meta = StreamSource(
                url,
                dataclasses.replace(self.options, cache_bytes=0),
                policy=policy,
                fingerprint=fingerprint,
            )
        except BaseException:
            crew.close()
            raise
        self._meta = meta
        self.url, self.policy, self.fingerprint = meta.url, meta.policy, meta.fingerprint
        crew.url = self.url
        self.manifest = meta.manifest
        self.num_rows, self.num_physical_rows = meta.num_rows, meta.num_physical_rows
        self._finalizer = weakref.finalize(self, _shut, crew, meta)
        try:
            self._fields = batch_fields(meta)
            latents = next(f for f in self._fields if f.name == "latents")
            self._stripe = max(1, STRIPE_BYTES // (latents.row_bytes * meta.num_crops))
            crew.ready()
        except BaseException:
            self.close()
            raise
        self._gens = itertools.count(1)
        self._requests = itertools.count(1)
        self._plan: _Plan | None = None

    # ------------------------------------------------------------------ metadata

    @property
    def pids(self) -> list[int]:
        """The workers' process ids."""
        return list(self._crew.pids)

    @property
    def num_crops(self) -> int:
        return self._meta.num_crops

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return self._meta.latent_shape

    @property
    def embed_dim(self) -> int:
        return self._meta.embed_dim

    @property
    def latent_dtype(self) -> np.dtype:
        return self._meta.latent_dtype

    @property
    def embedding_dtype(self) -> np.dtype:
        return self._meta.embedding_dtype

    @property
    def sample_bytes(self) -> int:
        return self._meta.sample_bytes

    @property
    def keys(self) -> np.ndarray:
        """Keys of all kept rows, in logical row order (fetched by this process)."""
        return self._meta.keys

    def physical(self, rows: np.ndarray) -> np.ndarray:
        """As :meth:`StreamSource.physical`."""
        return self._meta.physical(rows)

    # ------------------------------------------------------------------ plan & gather

    def plan(self, batches: Iterator[tuple[Any, ...]] | None) -> None:
        """Have the workers fetch and assemble ``batches``: ``(position, logical rows,
        crops)`` of this process's upcoming batches in order (the Loader's plan).
        ``None`` stops the plan (the workers keep their blocks while their limits allow).

        Raises:
            WorkerExitedError: a worker is gone.
            TimeoutError: a worker did not confirm the previous plan stopped.
        """
        crew = self._crew
        old, self._plan = self._plan, None
        if old is not None:
            self._stop(old)
        if batches is None or crew.closed:
            return
        with crew.cv:
            crew.check()
        plan = _Plan(next(self._gens), self.slots)
        crew.broadcast(("plan", plan.gen, plan.slots))
        plan.feeder = threading.Thread(
            target=_feed,
            args=(crew, plan, self._meta, self._fields, self._stripe, self.options.ahead, batches),
            name="hf_pipeline-stream-workers-feed",
            daemon=True,
        )
        with crew.cv:
            crew.plan = plan
        self._plan = plan
        plan.feeder.start()

    def _stop(self, old: _Plan) -> None:
        """Stop plan ``old`` and wait until no gather copies out of a slot and no
        worker can write into one for it (the next plan's batches go there). Never
        raises: a worker gone or a source closed has nothing to wait for, and workers
        that do not confirm within a minute are taken for dead (every later call says
        so)."""
        crew = self._crew
        with crew.cv:
            old.stopped = True
            if crew.plan is old:
                crew.plan = None
            crew.cv.notify_all()
        if old.feeder is not None and old.feeder is not threading.current_thread():
            old.feeder.join(timeout=10.0)
        try:
            crew.broadcast(("stop", old.gen))
            with crew.cv:
                crew.wait(
                    lambda: old.copying == 0 and crew.acks[old.gen] == crew.count,
                    "confirmation that the plan stopped",
                    timeout=60.0,
                )
        except TimeoutError as exc:
            with crew.cv:
                if crew.dead is None:
                    crew.dead = exc
        except Exception:  # noqa: BLE001, S110 - gone or closed: said by every later call
            pass
        finally:
            with crew.cv:
                crew.acks.pop(old.gen, None)

    def _index(self, plan: _Plan | None, position: Any) -> int | None:
        """The plan's index of ``position``, once the feeder got there; None when it is
        not in the plan (caller holds the crew's condition)."""
        crew = self._crew
        while True:
            crew.check()
            if plan is None or plan is not crew.plan:
                return None
            index = plan.index_of.get(position)
            if index is not None:
                return index
            if plan.failed is not None:
                raise plan.failed[1]
            # The feeder stops this far ahead of the copies: a position not fed by then
            # is not planned soon (a gather outside the plan, read here).
            ahead = _feed_ahead(self.options.ahead, plan.slots)
            if plan.count is not None or plan.fed >= plan.released + ahead:
                return None
            crew.cv.wait(_STOP_CHECK_S)

    def gather(
        self,
        rows: np.ndarray,
        crops: np.ndarray | int,
        *,
        out: dict[str, np.ndarray] | None = None,
        position: Any = None,
    ) -> dict[str, np.ndarray]:
        """The batch at ``position`` of the plan, from the workers; as
        :meth:`StreamSource.gather` (``rows`` and ``crops`` must be the plan's). A
        gather without a position, or of one not planned, is read by this process.

        Raises:
            IndexError, CacheFormatError, StoreUnreachableError, SourceError: as
                :meth:`StreamSource.gather` (a worker's, unchanged).
            WorkerExitedError: a worker is gone.
        """
        crew = self._crew
        plan = self._plan
        with crew.cv:
            index = None if position is None else self._index(plan, position)
            if index is None:
                crew.check()
        if index is None:
            return self._meta.gather(rows, crops, out=out)
        assert plan is not None
        with crew.cv:

            def ready() -> bool:
                if plan.failed is not None and plan.failed[0] <= index:
                    raise plan.failed[1]
                if plan.stopped:
                    raise RuntimeError(f"the plan of {self.url} was stopped")
                return plan.done[index] == crew.count

            crew.wait(ready, "batch")
            plan.copying += 1
            planned_rows, planned_crops = plan.items[index]
        try:
            rows = np.asarray(rows, dtype=np.int64).reshape(-1)
            if not (
                np.array_equal(rows, planned_rows)
                and np.array_equal(np.broadcast_to(crops, rows.shape), planned_crops)
            ):
                raise ValueError(
                    f"gather of position {position!r} asks for other rows or crops than "
                    "the plan has for it"
                )
            arrays = views(crew.slots[index % plan.slots], self._fields, rows.size)
            result = {}
            for name, arr in arrays.items():
                if out and name in out:
                    np.copyto(out[name], arr)
                    result[name] = out[name]
                else:
                    result[name] = arr.copy()
            del arrays
        finally:
            self._release(plan, index, position)
        return result

    def _release(self, plan: _Plan, index: int, position: Any) -> None:
        crew = self._crew
        with crew.cv:
            plan.copying -= 1
            plan.copied.add(index)
            plan.items.pop(index, None)
            plan.index_of.pop(position, None)
            plan.done.pop(index, None)
            before = plan.released
            while plan.released in plan.copied:
                plan.copied.discard(plan.released)
                plan.released += 1
            released = plan.released
            crew.cv.notify_all()
        if released > before and not plan.stopped:
            with contextlib.suppress(OSError):  # a dead worker: the next wait says so
                crew.broadcast(("released", plan.gen, released))

    # ------------------------------------------------------------------ stats & life

    def _ask(self, what: str) -> list:
        crew = self._crew
        request = next(self._requests)
        with crew.cv:
            crew.check()
            crew.replies[request] = []
        try:
            crew.broadcast(("ask", request, what))
            with crew.cv:
                crew.wait(lambda: len(crew.replies[request]) == crew.count, what, _ASK_S)
                return crew.replies[request]
        finally:
            with crew.cv:
                crew.replies.pop(request, None)

    def stats(self) -> StreamStats:
        """The workers' counters and this process's together (see :func:`_combined`:
        counts and bytes summed, times the longest worker's)."""
        return _combined([self._meta.stats(), *self._ask("stats")])

    def cache_state(self) -> dict[str, int]:
        """What the workers' caches hold right now, summed (``limit_bytes``: their
        limits together, at most ``cache_bytes``)."""
        total: collections.Counter[str] = collections.Counter(self._meta.cache_state())
        for state in self._ask("cache_state"):
            total.update(state)
        return dict(total)

    def reset_stats(self) -> None:
        self._meta.reset_stats()
        self._ask("reset_stats")

    def __reduce__(self):
        raise TypeError(
            "a StreamWorkers holds processes and cannot be pickled: open a StreamSource "
            "in each process (open_stream(loader_config, data_config, workers=1))"
        )

    def close(self) -> None:
        """Stop the plan and the workers, release the shared memory (idempotent)."""
        plan, self._plan = getattr(self, "_plan", None), None
        if plan is not None:
            with self._crew.cv:
                plan.stopped = True
                self._crew.cv.notify_all()
        self._finalizer()
        if plan is not None and plan.feeder not in (None, threading.current_thread()):
            plan.feeder.join(timeout=10.0)

    def __enter__(self) -> StreamWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"StreamWorkers({self.url!r}, rows={self.num_rows}, workers={self.workers}, "
            f"{self.options})"
        )
