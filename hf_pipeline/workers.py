"""Worker processes for ``datasets``' ``num_proc``: spawned, never forked from the caller.

Why. ``Dataset.map``/``Dataset.filter(num_proc=K)`` start a ``multiprocess`` pool
(``datasets``' dill-based copy of ``multiprocessing``) with that library's default
start method, ``fork`` on Linux. The process that calls
:func:`hf_pipeline.build.prepare_cache` is usually a training script that has already
initialised JAX (``jax.distributed.initialize()`` is the first line of most, and our
key-value doorbell needs it) or CUDA, and the build itself runs prefetch and heartbeat
threads. ``fork`` copies only the calling thread, with every lock that the other
threads (XLA's thread pools, gRPC, the CUDA driver, torch's OpenMP pool) held at that
instant; a worker that touches one of them waits forever. JAX warns about exactly this
(``RuntimeWarning: os.fork() was called ... JAX is multithreaded``).

What. Inside :func:`spawned_workers` the pools that ``datasets`` starts use the
``spawn`` start method: each worker is a new interpreter (fork+exec in C, no Python
at-fork hooks run), so none of the caller's threads, locks or accelerator state exist
there, and a torch op in a worker is as safe as in any fresh process. Nothing is
inherited: a worker gets its inputs by pickling (the shard list, a
:class:`~hf_pipeline.fetch.StagingClient`, the encoder config) and opens the caption
table by path. Only ``multiprocess``'s default start method changes, for the block,
and is restored after it (reference-counted, so nested and concurrent builds in one
process agree); the standard library's ``multiprocessing`` is never touched. A caller
that chose ``spawn`` or ``forkserver`` for ``multiprocess`` keeps its choice.

Cost. A spawned worker imports ``datasets``, torch and the tokenizer itself instead of
inheriting them, about 3 CPU-seconds per worker per stage. Measured on the 2-CPU
development machine: a ``num_proc=2`` pool of a trivial function starts in 1.5 s
against 0.13 s forked (idle machine); the demo's join stage (4 shards x 100 rows,
``num_proc=2``) costs its child processes 7 CPU-s against 0.25 forked (two workers
and the manager process ``datasets`` starts beside them). A fixed cost per stage,
noise against a real build. Considered and not taken:

* ``forkserver`` with the libraries preloaded (2.3 s for the first pool, then 0.16 s
  per pool): workers then see the environment of the moment the server started, not
  of the build (``HF_TOKEN`` or ``STORAGE_EMULATOR_HOST`` set later are missing), and
  the server outlives the build.
* running the whole build in a clean child process when JAX or CUDA is up: the
  stage functions need the parent's lease (heartbeat thread, ownership checks, the
  doorbell's client), and a second path taken only "when JAX is up" is one that most
  runs never exercise.

The one requirement, as for every spawn-based program (and Python 3.14's default
start method): a spawned worker imports the main script again as ``__mp_main__``,
so a script that calls ``prepare_cache`` must keep its entry point under
``if __name__ == "__main__":``. :func:`check_not_bootstrapping` turns a missing guard
into one clear error instead of a worker that builds (or waits for) the cache itself.

:func:`usable_cpus` is the CPU count that sizes worker pools and thread pools (the
build's ``num_proc``, the loader's ``num_threads``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

__all__ = ["check_not_bootstrapping", "spawned_workers", "usable_cpus"]

#: Start methods that never copy the calling process; a caller's choice of one is kept.
_CLEAN = ("spawn", "forkserver")

_lock = threading.Lock()
_depth = 0
_saved: str | None = None


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which a job scheduler narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def spawned_workers() -> Iterator[None]:
    """Within the block, ``datasets``' ``num_proc`` pools start their workers by spawn.

    Restores ``multiprocess``'s previous default start method (``None`` included) when
    the last of any nested or concurrent blocks ends. Thread-safe.
    """
    global _depth, _saved
    import multiprocess

    with _lock:
        if _depth == 0:
            _saved = multiprocess.get_start_method(allow_none=True)
            if _saved not in _CLEAN:
                multiprocess.set_start_method("spawn", force=True)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved not in _CLEAN:
                multiprocess.set_start_method(_saved, force=True)


def check_not_bootstrapping() -> None:
    """Raise if a spawned worker is running the main script while it starts up.

    A spawned (or forkserver) child imports the parent's main script before it does
    any work; a script without an ``if __name__ == "__main__":`` guard would then call
    ``prepare_cache`` again inside every worker, as the same rank.

    Raises:
        RuntimeError: naming the script and the fix.
    """
    for name in ("multiprocess", "multiprocessing"):
        mp = sys.modules.get(name)
        # The flag both libraries set while a child unpickles its parent's state and
        # re-imports __main__ (what their own "bootstrapping phase" check reads).
        if mp is not None and getattr(mp.current_process(), "_inheriting", False):
            main = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the main script"
            raise RuntimeError(
                f"prepare_cache was called while a new worker process was importing "
                f"{main}: the build's workers are spawned, so the script's entry point "
                f'must be under `if __name__ == "__main__":`'
            )
