"""Worker processes for ``datasets``' ``num_proc``: started by a clean fork server,
never forked from the caller.

Why not fork. ``Dataset.map``/``Dataset.filter(num_proc=K)`` start a ``multiprocess``
pool (``datasets``' dill-based copy of ``multiprocessing``) with that library's default
start method, ``fork`` on Linux. The process that calls
:func:`hf_pipeline.build.prepare.prepare_cache` is usually a training script that has already
initialised JAX (``jax.distributed.initialize()`` is the first line of most, and our
key-value doorbell needs it) or CUDA, and the build itself runs prefetch and heartbeat
threads. ``fork`` copies only the calling thread, with every lock that the other
threads (XLA's thread pools, gRPC, the CUDA driver, torch's OpenMP pool) held at that
instant; a worker that touches one of them waits forever. JAX warns about exactly this
(``RuntimeWarning: os.fork() was called ... JAX is multithreaded``).

Why not spawn. A spawned worker is a fresh interpreter that imports ``datasets``, torch
and its other libraries itself: measured on a 16-CPU H200 host, 16 workers importing at
once took 13 s before the first shard of a 100k-row join (3.5 s of work), and their
interpreter shut-down 2 s more after the last one.

What. Inside :func:`clean_workers` the pools that ``datasets`` starts use the
``forkserver`` start method, with a fork server of the block's own: a fresh interpreter
(started by fork+exec, so none of the caller's threads, locks or accelerator state exist
there) that imports :data:`PRELOAD` once, single-threaded, then forks each worker on
demand. A worker starts in milliseconds with its libraries already imported, and leaves
with ``os._exit``. The server is started when the block begins (it imports while the
build writes its caption table and loads the encoder) and stopped when the last block
ends, so it sees the environment of the build (``HF_TOKEN`` or ``STORAGE_EMULATOR_HOST``
set by the caller beforehand) and does not outlive it. Nothing is inherited from the
caller: a worker gets its inputs by pickling (the shard list, a
:class:`~hf_pipeline.stores.fetch.StagingClient`, the tokenizer spec) and opens the caption
table by path. Only ``multiprocess``'s default start method and fork-server preload list
change, for the block, and are restored after it (reference-counted, so nested and
concurrent builds in one process agree); the standard library's ``multiprocessing`` is
never touched. A caller that chose ``spawn`` or ``forkserver`` for ``multiprocess``
keeps its choice (and its server). Where ``forkserver`` does not exist (Windows), the
workers are spawned.

Considered and not taken: running the whole build in a clean child process when JAX or
CUDA is up: the stage functions need the parent's lease (heartbeat thread, ownership
checks, the doorbell's client), and a second path taken only "when JAX is up" is one
that most runs never exercise.

The one requirement, as for every spawn-based program (and Python 3.14's default
start method): a worker imports the main script again as ``__mp_main__``, so a script
that calls ``prepare_cache`` must keep its entry point under
``if __name__ == "__main__":``. :func:`check_not_bootstrapping` turns a missing guard
into one clear error instead of a worker that builds (or waits for) the cache itself.

:func:`usable_cpus` is the CPU count that sizes worker pools and thread pools (the
build's ``num_proc``, the loader's ``num_threads``).

:func:`quick_gil_handoff` is for the builder's own threads: while one thread runs Python
(the encoder's loading: imports, ``torch.compile``, the warm-up), every other thread
that comes back from C code (the caption step's Arrow and NumPy calls, the pool start's
socket calls) waits for it to drop the GIL, up to the switch interval (5 ms by default)
each time. Measured on 2 CPUs, a Python-busy thread made the 2M-row caption step take
26.4 s against 2.5 s alone; with a 1 ms interval 9.3 s, with 0.5 ms 6.6 s. The build's
stages run with at most 1 ms.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

__all__ = [
    "PRELOAD",
    "check_not_bootstrapping",
    "clean_workers",
    "unimportable_main",
    "die_with_parent",
    "in_lasting_thread",
    "run_below_builder",
    "quick_gil_handoff",
    "usable_cpus",
]

#: Start methods that never copy the calling process; a caller's choice of one is kept.
_CLEAN = ("spawn", "forkserver")

#: What the fork server imports once for all workers: what a join worker runs
#: (``datasets``' map loop, torch for ``torch.load``, our join) and a tokens worker
#: (``tokenizers`` and :mod:`hf_pipeline.build.tokens`: about 0.5 s of imports that each
#: worker of the build's tokenizing pool paid otherwise);
#: no more, since the first shard waits for it.
PRELOAD = (
    "hf_pipeline.workers.forkserver_init",  # first: the server and its children die with the builder
    "torch",
    "datasets",
    "hf_pipeline.build.convert",
    "hf_pipeline.build.captions",
    "hf_pipeline.build.shards",
    "hf_pipeline.cache.precision",
    "hf_pipeline.stores.fetch",
    "tokenizers",
    "hf_pipeline.build.tokens",
)

#: How much nicer than the builder each worker runs (see :func:`run_below_builder`):
#: at 10 a thread of the builder sharing a CPU with one busy worker gets about 90% of it
#: (the kernel's weights, 1024 against 110), against 50% at the same niceness.
WORKER_NICENESS = 10

_T = TypeVar("_T")

#: Starts the fork servers (and the stream's workers: :func:`in_lasting_thread`): one thread for the life of the process, because a server's
#: PR_SET_PDEATHSIG fires when the *thread* that started it ends.
_starter = ThreadPoolExecutor(1, thread_name_prefix="hf_pipeline-forkserver")


def in_lasting_thread(fn: Callable[..., _T], *args) -> _T:
    """``fn(*args)`` run on a thread that lives as long as this process, and its result
    (or its exception). A child started there that asks for ``PR_SET_PDEATHSIG``
    (:func:`die_with_parent`) dies with this process, not with the caller's thread (a
    Lightning hook's, a test's, a short-lived loader thread's). Thread-safe; calls run
    one at a time."""
    return _starter.submit(fn, *args).result()


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which a job scheduler narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class _WhileAnyBlock:
    """A process-wide setting held while any of its blocks is open: ``apply()`` runs when
    the first opens and returns what undoes it (or None: nothing to undo), which runs when
    the last closes. Nested and concurrent blocks agree; thread-safe."""

    def __init__(self, apply: Callable[[], Callable[[], None] | None]):
        self._apply = apply
        self._lock = threading.Lock()
        self._depth = 0
        self._undo: Callable[[], None] | None = None

    @contextlib.contextmanager
    def block(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._undo = self._apply()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self._undo is not None:
                    undo, self._undo = self._undo, None
                    undo()


def _use_fork_server() -> Callable[[], None] | None:
    """``multiprocess``' pools start from a fork server of our own (spawn where there is
    none); what restores the caller's start method (and preload list, and stops the
    server). A caller's clean start method is kept: nothing to undo."""
    import multiprocess
    from multiprocess import forkserver

    saved = multiprocess.get_start_method(allow_none=True)
    if saved in _CLEAN:
        return None
    if "forkserver" not in multiprocess.get_all_start_methods():  # pragma: no cover
        multiprocess.set_start_method("spawn", force=True)
        return lambda: multiprocess.set_start_method(saved, force=True)
    saved_preload = list(forkserver._forkserver._preload_modules)
    forkserver.set_forkserver_preload(list(PRELOAD))
    multiprocess.set_start_method("forkserver", force=True)
    # Starts importing now, while the build does its other start-up work.
    in_lasting_thread(forkserver.ensure_running)

    def undo() -> None:
        multiprocess.set_start_method(saved, force=True)
        forkserver.set_forkserver_preload(saved_preload)
        _stop_fork_server(forkserver)

    return undo


_FORK_SERVER = _WhileAnyBlock(_use_fork_server)


def _unguarded_report(authkey: bytes) -> Path:
    """Where a worker that found the main script unguarded leaves its message for the
    builder: named after the builder's ``multiprocess`` authkey, which every process it
    starts inherits (set before the worker imports the main script)."""
    digest = hashlib.sha256(bytes(authkey)).hexdigest()[:24]
    return Path(tempfile.gettempdir()) / f"hf_pipeline-unguarded-{digest}.txt"


def _take_unguarded_message() -> str | None:
    """The message a worker of this builder left (see :func:`check_not_bootstrapping`),
    removed; None if there is none."""
    import multiprocess

    path = _unguarded_report(multiprocess.current_process().authkey)
    try:
        message = path.read_text()
    except OSError:
        return None
    with contextlib.suppress(OSError):
        path.unlink()
    return message


@contextlib.contextmanager
def clean_workers() -> Iterator[None]:
    """Within the block, ``datasets``' ``num_proc`` pools start their workers from a
    fork server of the block's own (see the module's docstring).

    Restores ``multiprocess``'s previous default start method (``None`` included) and
    preload list, and stops the server, when the last of any nested or concurrent blocks
    ends. Thread-safe.

    Raises:
        RuntimeError: the block failed because its workers found the main script without
            an ``if __name__ == "__main__":`` guard (their message, once).
    """
    with _FORK_SERVER.block():
        try:
            yield
        except BaseException:
            message = _take_unguarded_message()
            if message is None:
                raise
            raise RuntimeError(message) from None


#: The longest switch interval (seconds) inside :func:`quick_gil_handoff`.
GIL_SWITCH_INTERVAL = 0.001


def _short_switch_interval() -> Callable[[], None] | None:
    saved = sys.getswitchinterval()
    if saved <= GIL_SWITCH_INTERVAL:
        return None  # the caller's is short enough: kept
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    return lambda: sys.setswitchinterval(saved)


_SWITCH_INTERVAL = _WhileAnyBlock(_short_switch_interval)


def quick_gil_handoff() -> contextlib.AbstractContextManager[None]:
    """Within the block, the interpreter's switch interval is at most
    :data:`GIL_SWITCH_INTERVAL` (a smaller one set by the caller is kept); restored when
    the last of any nested or concurrent blocks ends (see the module's docstring).
    Thread-safe.
    """
    return _SWITCH_INTERVAL.block()


def _stop_fork_server(forkserver) -> None:
    """Ask the fork server to stop, without waiting: it exits once every process it forked
    has (the pools wait for theirs), and a thread reaps it. The next block starts a new
    one, with the environment of its time.

    ``multiprocess`` only has a blocking ``_stop`` (for its own tests); this is the same
    steps, minus the wait under its lock, so a worker that is slow to exit can never
    hold up the next build.
    """
    from multiprocess import util

    server = forkserver._forkserver
    with server._lock:
        pid, alive_fd = server._forkserver_pid, server._forkserver_alive_fd
        address = server._forkserver_address
        server._forkserver_pid = server._forkserver_alive_fd = None
        server._forkserver_address = None
    if pid is None:
        return
    os.close(alive_fd)  # the server's "alive" pipe: it stops when every end is closed
    if address and not util.is_abstract_socket_namespace(address):
        with contextlib.suppress(OSError):
            os.unlink(address)
    threading.Thread(
        target=_reap, args=(pid,), name="hf_pipeline-forkserver-reap", daemon=True
    ).start()


def run_below_builder() -> None:
    """Make this process :data:`WORKER_NICENESS` steps nicer (capped at 19; Unix only).

    Run in each process the fork server forks (:mod:`hf_pipeline.workers.forkserver_init`),
    never in the server itself: its imports are what the join's first shard waits for.
    The workers are throughput work, the builder's threads are not: the encoder's
    loading thread, the main thread that drives the join and writes the caption table,
    and the embedding thread that feeds the accelerator are each one thread that the
    build's end waits on, and with ``num_proc`` equal to the CPUs every one of them
    shared a CPU with a busy worker (issue 28: on a 16-CPU host the tokenizer, about
    1 CPU-second, took 7.5-9 s while 16 workers joined, and the model after it 2 s
    once they were done). Nicer workers still get every CPU nothing else wants.
    """
    if hasattr(os, "nice"):
        os.nice(WORKER_NICENESS)  # raising one's own niceness needs no privilege


def die_with_parent(parent: int | None = None) -> None:
    """This process gets SIGKILL when the thread that started it ends (Linux; a no-op
    elsewhere), and exits now if that already happened: its parent is no longer
    ``parent`` (its pid, when the caller knows it: an orphan may be adopted by a
    subreaper, not by init), or, without ``parent``, it is init (pid 1)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    # orphaned before the call: nobody will signal us
    if os.getppid() == 1 if parent is None else os.getppid() != parent:
        os._exit(1)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def unimportable_main() -> str | None:
    """The main program's path if processes that import it first (spawn, forkserver)
    could not: one read from standard input (``python - <<EOF``) is no file. None where
    they can, or import nothing (``python -m``, ``python -c``, a notebook)."""
    import multiprocessing.process

    main = sys.modules["__main__"]
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is not None or path is None:
        return None
    full = os.path.join(multiprocessing.process.ORIGINAL_DIR or "", path)  # type: ignore[attr-defined]  # CPython sets it; typeshed omits it
    return None if os.path.isfile(full) else path


def check_not_bootstrapping(
    caller: str = "prepare_cache", workers: str = "the build's workers are started by a fork server"
) -> None:
    """Stop a new worker that is running the main script while it starts up.

    A worker (forkserver or spawn) imports the parent's main script before it does
    any work; a script without an ``if __name__ == "__main__":`` guard would then call
    ``caller`` (``prepare_cache``, or ``generate_demo`` with its spawned writers: how
    the ``workers`` start is said in the message) again inside every worker.

    A worker of a :func:`clean_workers` block's fork server leaves the message for its
    builder (see :func:`_unguarded_report`) and exits quietly: the builder raises it,
    once, instead of every worker printing a traceback and the builder an ``EOFError``.

    Raises:
        RuntimeError: naming the script and the fix (a worker of some other pool).
        SystemExit: in a worker of a :func:`clean_workers` block's fork server, after
            leaving the message.
    """
    for name in ("multiprocess", "multiprocessing"):
        mp = sys.modules.get(name)
        # The flag both libraries set while a child unpickles its parent's state and
        # re-imports __main__ (what their own "bootstrapping phase" check reads).
        if mp is not None and getattr(mp.current_process(), "_inheriting", False):
            main = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the main script"
            message = (
                f"{caller} was called while a new worker process was importing {main}: "
                f"{workers}, so the script's entry point "
                f'must be under `if __name__ == "__main__":`'
            )
            # A worker of our fork server (its preload ran first) leaves the message for
            # the builder, which raises it once; a worker of any other pool raises it.
            if name == "multiprocess" and "hf_pipeline.workers.forkserver_init" in sys.modules:
                try:
                    with open(_unguarded_report(mp.current_process().authkey), "x") as f:
                        f.write(message)
                except FileExistsError:
                    pass  # another worker's is there
                except OSError:  # no writable temp folder: raised here instead
                    raise RuntimeError(message) from None
                raise SystemExit(1)
            raise RuntimeError(message)
