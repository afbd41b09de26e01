"""Worker processes started once and reused: the build's tokenizing pool.

Why. ``Dataset.map(num_proc=N)`` starts a new pool for every call, and every worker of
it loads what it needs (a tokenizer) again: a build tokenizing 20 parts started 20 pools
and loaded the tokenizer 20 x N times, and paid ``datasets``' map (fingerprinting, a
file per worker) each time. A :class:`PersistentPool` starts its ``num_proc`` workers
once (from the build's clean fork server, :func:`hf_pipeline.workers.pool.clean_workers`:
never a fork of the caller), each runs ``setup(arg)`` once (loads the tokenizer), and
every later :meth:`PersistentPool.run` hands them tasks, ``2`` in flight per worker so
that none waits for the builder between two (its thread shares the CPUs with a join).

Crash-safety. The workers are children of the fork server, so they die with the builder
(:mod:`hf_pipeline.workers.forkserver_init`: SIGKILL of the builder kills the server,
which kills them); a worker also leaves when its pipe to the builder closes. A
:meth:`~PersistentPool.run` that fails (a task's error, a lost lease raised by its
``check``, a worker that died, the deadline) kills the workers, since tasks of the
failed call are still in flight; the next call starts new ones (as it does when a worker
died between two calls). :meth:`~PersistentPool.close`
stops them and waits for them (bounded), so none outlives the build.

Thread-safety: one :meth:`~PersistentPool.run` at a time (a lock); the build calls it
from its tokens thread only.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PersistentPool", "WorkerExitedError"]

#: Tasks in flight per worker: the next is queued in its pipe while it works on one.
IN_FLIGHT = 2

#: How often a waiting :meth:`PersistentPool.run` calls ``check`` (seconds).
CHECK_INTERVAL = 1.0


class WorkerExitedError(RuntimeError):
    """A worker of a :class:`PersistentPool` exited while it had work (killed, out of
    memory, or a crash in native code). Carries its ``pid`` and ``exitcode``."""

    def __init__(self, message: str, pid: int | None = None, exitcode: int | None = None):
        super().__init__(message)
        self.pid = pid
        self.exitcode = exitcode

    def __reduce__(self):
        return (type(self), (str(self), self.pid, self.exitcode))


def _serve(conn, setup: Callable[[Any], Any], arg: Any, work: Callable[[Any, Any], Any]) -> None:
    """A worker's loop: ``state = setup(arg)`` once, then ``work(state, task)`` per task
    received, answering ``(index, ok, result or error)``; leaves on ``None`` or when the
    builder's end of the pipe closes. Ctrl-C is the builder's: a terminal sends SIGINT to
    the whole process group, and each worker printed a KeyboardInterrupt traceback; the
    builder stops the pool (or dies, and the pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    state = setup(arg)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the builder is gone
            return
        if message is None:
            return
        index, task = message
        try:
            answer = (index, True, work(state, task))
        except Exception as e:  # sent to the builder, which raises it
            answer = (index, False, e)
        try:
            conn.send(answer)
        except (BrokenPipeError, OSError):
            return
        except Exception as e:  # an error that does not pickle: its text
            conn.send((index, False, RuntimeError(f"{type(e).__name__}: {e}")))


class PersistentPool:
    """``num_proc`` worker processes started once (see the module's docstring).

    Args:
        setup: run once in each worker with ``arg``; returns the worker's state.
        work: ``work(state, task)`` in a worker; returns a picklable result.
        num_proc: the workers (>= 1).
        name: the workers' process name prefix.
    """

    def __init__(
        self,
        *,
        setup: Callable[[Any], Any],
        arg: Any,
        work: Callable[[Any, Any], Any],
        num_proc: int,
        name: str = "hf_pipeline-worker",
    ):
        if num_proc < 1:
            raise ValueError(f"num_proc must be >= 1, got {num_proc}")
        self.num_proc = num_proc
        self._setup, self._arg, self._work, self._name = setup, arg, work, name
        self._lock = threading.Lock()
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._stack: contextlib.ExitStack | None = None
        self.starts = 0  # how many times the workers were started (tests, timelines)

    @property
    def pids(self) -> list[int]:
        """The running workers' process ids (empty before the first run and after close)."""
        return [p.pid for p in self._procs]

    def _start(self) -> None:
        import multiprocess

        from hf_pipeline.workers.pool import clean_workers

        with contextlib.ExitStack() as stack:
            # The block's fork server forks the workers; the block ends with close().
            stack.enter_context(clean_workers())
            ctx = multiprocess.get_context()
            try:
                for k in range(self.num_proc):
                    ours, theirs = ctx.Pipe()
                    proc = ctx.Process(
                        target=_serve, args=(theirs, self._setup, self._arg, self._work),
                        name=f"{self._name}-{k}", daemon=True,
                    )  # fmt: skip
                    proc.start()
                    theirs.close()
                    self._procs.append(proc)
                    self._conns.append(ours)
            except BaseException:
                self._stop(graceful=False)  # the ones started; the block ends after
                raise
            self._stack = stack.pop_all()
        self.starts += 1

    def run(
        self, tasks: Sequence[Any], *, timeout: float, check: Callable[[], None] | None = None
    ) -> list[Any]:
        """The results of ``work`` on ``tasks``, in order, from the workers (started on
        the first call, or again after a failed one).

        Args:
            timeout: seconds the whole call may take.
            check: called before each task is handed out and at least every
                :data:`CHECK_INTERVAL` seconds while waiting (a lease probe); what it
                raises stops the call.

        Raises:
            TimeoutError: the call took longer than ``timeout``.
            WorkerExitedError: a worker exited while the call had work.
            Exception: what a task raised in its worker (its type), or ``check`` raised.
        """
        from multiprocess.connection import wait

        with self._lock:
            if any(p.exitcode is not None for p in self._procs):
                # One died between two calls (killed, out of memory): nothing of it was
                # in flight, so the call starts over with new workers instead of failing.
                self._stop(graceful=False)
            if not self._procs:
                self._start()
            deadline = time.monotonic() + timeout
            results: list[Any] = [None] * len(tasks)
            pending = list(enumerate(tasks))[::-1]  # popped from the end: in order
            busy = [0] * len(self._conns)
            left = len(tasks)
            try:
                while left:
                    # The idlest worker first: each gets one before any gets a second.
                    for level in range(IN_FLIGHT):
                        for k, conn in enumerate(self._conns):
                            if pending and busy[k] <= level:
                                if check is not None:
                                    check()
                                try:
                                    conn.send(pending.pop())
                                except OSError as e:  # its end closed: it exited
                                    raise self._exited(self._procs[k]) from e
                                busy[k] += 1
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(
                            f"{self._name}: {left} of {len(tasks)} tasks unfinished after "
                            f"{timeout:g} s"
                        )
                    ready = wait(
                        self._conns + [p.sentinel for p in self._procs],
                        timeout=min(remaining, CHECK_INTERVAL),
                    )
                    for k, conn in enumerate(self._conns):
                        if conn in ready:
                            try:
                                index, ok, value = conn.recv()
                            except (EOFError, OSError) as e:  # its end closed: it exited
                                raise self._exited(self._procs[k]) from e
                            if not ok:
                                raise value
                            results[index] = value
                            busy[k] -= 1
                            left -= 1
                    for proc in self._procs:
                        if proc.sentinel in ready and proc.exitcode is not None:
                            raise self._exited(proc)
                    if check is not None:
                        check()
            except BaseException:
                self._stop(graceful=False)  # tasks of this call are still in flight
                raise
            return results

    def _exited(self, proc) -> WorkerExitedError:
        proc.join(1.0)  # its exit code, if it is only now exiting
        return WorkerExitedError(
            f"{self._name}: worker {proc.pid} exited with code {proc.exitcode} while it had work",
            proc.pid,
            proc.exitcode,
        )

    def _stop(self, *, graceful: bool, timeout: float = 10.0) -> None:
        procs, conns, stack = self._procs, self._conns, self._stack
        self._procs, self._conns, self._stack = [], [], None
        for conn in conns:
            with contextlib.suppress(OSError):
                if graceful:
                    conn.send(None)
                conn.close()  # the worker leaves at EOF too
        deadline = time.monotonic() + timeout
        for proc in procs:
            if not graceful:
                proc.kill()
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:  # stuck in native code: not waited for longer
                proc.kill()
                proc.join(1.0)
        if stack is not None:
            stack.close()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers and wait for them (``timeout`` seconds, then SIGKILL).
        Idempotent; the pool may be used again (new workers)."""
        with self._lock:
            self._stop(graceful=True, timeout=timeout)

    def __enter__(self) -> PersistentPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
