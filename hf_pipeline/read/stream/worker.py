"""One stream worker process: its own :class:`~hf_pipeline.read.stream.StreamSource` over
the published cache, and its part of every planned batch assembled into the batch's
shared memory slot.

Started by :class:`~hf_pipeline.read.stream.workers.StreamWorkers` as ``python -c "from
hf_pipeline.read.stream.worker import main; main()" FD PARENT_PID``: a fresh interpreter
(fork and exec: none of the parent's threads, locks, JAX or CUDA state), which never
imports the parent's main script (a training script needs no ``__main__`` guard). ``FD``
is its end of a Unix socket pair: pickled messages both ways
(:class:`multiprocessing.connection.Connection`), and the slots' descriptors
(``SCM_RIGHTS``).

Life: it dies with its parent (``PR_SET_PDEATHSIG`` towards the parent's lasting
thread, :func:`hf_pipeline.workers.pool.in_lasting_thread`, and its socket's end of
file where that does not exist); Ctrl-C is the parent's (SIGINT ignored here: the
parent closes its workers); every wait is in short slices that look at the plan's
stop flag. It says it is alive at least every :data:`HEARTBEAT_S` seconds.

The messages (parent -> worker):

* ``("open", url, options, policy, fingerprint)``: first; answered ``("ready", pid)``
  or ``("failed", error)``;
* ``("slots", nbytes, count)``, then the ``count`` descriptors: the slots from now on;
* ``("plan", gen, slots)``: a new plan (the previous one stops); ``("entry", gen,
  index, position, rows, crops, dest, batch_rows)``: this worker's rows of the plan's
  batch ``index`` (``dest``: where they go in the batch); ``("end", gen, count)``: the
  plan has ``count`` batches; ``("released", gen, count)``: the parent copied batches
  ``0 .. count - 1`` out (their slots are free); ``("stop", gen)``, answered
  ``("stopped", gen)`` once nothing of that plan can land in a slot;
* ``("ask", request, what)``: ``stats``, ``cache_state`` or ``reset_stats``, answered
  ``("reply", request, value)``;
* ``("close",)``: it exits, once its reads in flight landed (a few seconds at most;
  nothing else of its own to save: its cache is memory, its sockets and slots the
  kernel's to close).

(worker -> parent): ``("done", gen, index)``, ``("error", gen, index, error)`` (the
plan stops there), ``("want", gen, index)`` (its planner waits for that entry: sent
whatever the parent's own bound), ``("alive",)``.

Internal.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds
from typing import Any

import numpy as np

__all__ = ["HEARTBEAT_S", "main", "picklable"]

#: A worker sends something (``("alive",)`` when it has nothing else to say) at least
#: this often.
HEARTBEAT_S = 1.0
#: How often a waiting thread of the worker looks at its stop flag again.
_STOP_CHECK_S = 0.1
#: Seconds a closing worker lets its reads in flight finish before it exits.
_CLOSE_READS_S = 5.0


def picklable(exc: BaseException) -> BaseException:
    """``exc`` itself when it pickles (the project's errors do: their type and one-line
    message reach the parent unchanged), else a ``RuntimeError`` of its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to pickle: its text instead
        return RuntimeError(f"{type(exc).__name__}: {exc}")


@dataclasses.dataclass
class _Entry:
    position: Any
    rows: np.ndarray
    crops: np.ndarray
    dest: np.ndarray
    batch_rows: int


class _Plan:
    """One plan's state in the worker (guarded by the worker's condition)."""

    def __init__(self, gen: int, slots: int):
        self.gen = gen
        self.slots = slots
        self.entries: dict[int, _Entry] = {}
        self.count: int | None = None  # batches in the plan, once known
        self.released = 0
        self.stopped = False
        self.planner_at = 0  # the next entry the source's planner takes
        self.assembler_at = 0  # the next entry assembled
        self.thread: threading.Thread | None = None

    def trim(self) -> None:
        """Drop the entries both the planner and the assembler have passed."""
        for index in range(min(self.planner_at, self.assembler_at) - 1, -1, -1):
            if self.entries.pop(index, None) is None:
                break


class _Worker:
    def __init__(self, conn: Connection):
        self._conn = conn
        self._send_lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._cv = threading.Condition()
        self._plan: _Plan | None = None
        self._slots: list = []  # mmaps of the current slots
        self._source: Any = None
        self._fields: tuple = ()

    def send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)
            self._last_sent = time.monotonic()

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        from hf_pipeline.read.stream.slots import batch_fields
        from hf_pipeline.read.stream.source import StreamSource

        _, url, options, policy, fingerprint = self._conn.recv()
        try:
            self._source = StreamSource(url, options, policy=policy, fingerprint=fingerprint)
            self._fields = batch_fields(self._source)
        except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it
            self.send(("failed", picklable(exc)))
            return
        self.send(("ready", os.getpid()))
        try:
            while True:
                if not self._conn.poll(HEARTBEAT_S):
                    self.send(("alive",))
                    continue
                message = self._conn.recv()
                if message[0] == "close":
                    self._close()
                self._handle(message)
                if time.monotonic() - self._last_sent > HEARTBEAT_S:
                    self.send(("alive",))
        finally:
            self._stop_plan()
            self._source.close()

    def _close(self) -> None:
        """Exit: the plan stopped, the reads in flight let finish (a store, or a proxy,
        sees no connection broken mid-answer) for at most :data:`_CLOSE_READS_S`, no
        interpreter shut-down (nothing of the worker's own is left to save)."""
        self._stop_plan(wait=False)
        closing = threading.Thread(target=self._source.close, daemon=True)
        closing.start()
        closing.join(_CLOSE_READS_S)
        os._exit(0)

    def _handle(self, message) -> None:
        kind = message[0]
        if kind == "entry":
            _, gen, index, position, rows, crops, dest, batch_rows = message
            with self._cv:
                plan = self._plan
                if plan is not None and plan.gen == gen:
                    plan.entries[index] = _Entry(position, rows, crops, dest, batch_rows)
                    self._cv.notify_all()
        elif kind == "released":
            _, gen, count = message
            with self._cv:
                if self._plan is not None and self._plan.gen == gen:
                    self._plan.released = max(self._plan.released, count)
                    self._cv.notify_all()
        elif kind == "end":
            _, gen, count = message
            with self._cv:
                if self._plan is not None and self._plan.gen == gen:
                    self._plan.count = count
                    self._cv.notify_all()
        elif kind == "plan":
            _, gen, slots = message
            previous = self._stop_plan(wait=False)
            plan = _Plan(gen, slots)
            plan.thread = threading.Thread(
                target=self._run_plan,
                args=(plan, previous),
                name=f"hf_pipeline-stream-worker-plan-{gen}",
                daemon=True,
            )
            with self._cv:
                self._plan = plan
            plan.thread.start()
        elif kind == "stop":
            # Once this is answered no batch of that plan is written into a slot (see
            # _run_plan): the parent's next plan may use them.
            with self._cv:
                current = self._plan is not None and self._plan.gen == message[1]
            if current:
                self._stop_plan(wait=False)
            self.send(("stopped", message[1]))
        elif kind == "slots":
            _, nbytes, count = message
            self._map_slots(nbytes, count)
        elif kind == "ask":
            _, request, what = message
            if what == "reset_stats":
                self._source.reset_stats()
                value = None
            else:
                value = getattr(self._source, what)()
            self.send(("reply", request, value))
        else:  # pragma: no cover - a parent of another version
            raise ValueError(f"unknown message {kind!r}")

    def _map_slots(self, nbytes: int, count: int) -> None:
        import socket

        from hf_pipeline.read.stream.slots import map_slot

        with socket.socket(fileno=os.dup(self._conn.fileno())) as sock:
            fds = recvfds(sock, count)
        try:
            slots = [map_slot(fd, nbytes) for fd in fds]
        finally:
            for fd in fds:
                os.close(fd)
        # The previous plan's thread has ended (a plan's slots come before it): its
        # maps close when nothing views them.
        self._slots = slots

    def _stop_plan(self, wait: bool = True) -> threading.Thread | None:
        """Stop the current plan (its thread sees the flag between two batches); its
        thread, joined when ``wait``."""
        with self._cv:
            plan, self._plan = self._plan, None
            if plan is None:
                return None
            plan.stopped = True
            self._cv.notify_all()
        if wait and plan.thread is not None:
            plan.thread.join(timeout=30.0)
        return plan.thread

    # ------------------------------------------------------------------ a plan

    def _planned(self, plan: _Plan):
        """``(position, rows)`` of the plan's entries in order, as they arrive: what
        this worker's source plans ahead. An entry not here yet is asked for (the parent
        sends the plan only so far ahead of the batches copied out unless asked: how far
        this source's planner looks is its own business)."""
        index = 0
        while True:
            with self._cv:
                missing = index not in plan.entries
            if missing:
                self.send(("want", plan.gen, index))
            with self._cv:
                while index not in plan.entries and not plan.stopped:
                    if plan.count is not None and index >= plan.count:
                        return
                    self._cv.wait(_STOP_CHECK_S)
                if plan.stopped:
                    return
                entry = plan.entries[index]
                plan.planner_at = index + 1
                plan.trim()
            yield entry.position, entry.rows
            index += 1

    def _next(self, plan: _Plan, index: int) -> _Entry | None:
        """Entry ``index`` once its slot is free (None: the plan ended or stopped)."""
        with self._cv:
            while not plan.stopped:
                if plan.count is not None and index >= plan.count:
                    return None
                if index in plan.entries and index < plan.released + plan.slots:
                    return plan.entries[index]
                self._cv.wait(_STOP_CHECK_S)
        return None

    def _run_plan(self, plan: _Plan, previous: threading.Thread | None) -> None:
        from hf_pipeline.read.stream.slots import views

        # One plan at a time writes into the slots: the previous one's last batch first.
        while previous is not None and previous.is_alive():
            if plan.stopped:
                return
            previous.join(_STOP_CHECK_S)
        source = self._source
        source.plan(self._planned(plan))
        index = 0
        try:
            while True:
                entry = self._next(plan, index)
                if entry is None:
                    return
                try:
                    got = source.gather(entry.rows, entry.crops, position=entry.position)
                    # Written under the lock that ``stop`` takes: once the parent has
                    # this plan's stop answered, nothing of it lands in a slot that the
                    # next plan (another worker's rows) may be using.
                    with self._cv:
                        if plan.stopped:
                            return
                        if entry.dest.size:
                            slot = self._slots[index % plan.slots]
                            out = views(slot, self._fields, entry.batch_rows)
                            for name, arr in got.items():
                                out[name][entry.dest] = arr
                            del out
                except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it
                    self.send(("error", plan.gen, index, picklable(exc)))
                    return
                with self._cv:
                    plan.assembler_at = index + 1
                    plan.trim()
                self.send(("done", plan.gen, index))
                index += 1
        except (OSError, EOFError):  # the parent is gone
            os._exit(0)
        finally:
            source.plan(None)  # its pins kept while the limit allows; the planner stops


def main(argv: list[str] | None = None) -> None:
    """A worker's entry point: ``argv`` is ``[socket descriptor, parent pid]``."""
    from hf_pipeline.workers.pool import die_with_parent

    fd, parent = (int(arg) for arg in (sys.argv[1:] if argv is None else argv))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it closes us
    die_with_parent(parent)
    worker = _Worker(Connection(fd))
    try:
        worker.run()
    except (EOFError, OSError):  # the parent is gone
        pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no interpreter shut-down: its threads may still wait on the source
