"""Imported first by the build's fork server (:data:`hf_pipeline.workers.pool.PRELOAD`): ties
the server, and every process it forks, to the builder.

A SIGKILLed builder cannot stop its pools; without this, the processes its fork server
forked (the ``num_proc`` workers and the manager ``datasets`` starts beside them) would
linger, holding shards, staging slots and memory. On Linux, the server gets
``PR_SET_PDEATHSIG`` (SIGKILL) towards the builder's thread that started it (a thread
that lives as long as the builder: see :func:`hf_pipeline.workers.pool.clean_workers`), and
each process it forks gets it towards the server. Elsewhere this does nothing.

When the builder stops it, the server leaves at once (``os._exit`` from its last exit
handler): its interpreter's shut-down tore down the torch and ``datasets`` it preloaded
for a second or more after the build's end, while it still held the builder's standard
output open (a caller reading that output to its end waited for it; issue 28).

Each process it forks also runs :data:`~hf_pipeline.workers.pool.WORKER_NICENESS`
steps nicer than the builder (:func:`hf_pipeline.workers.pool.run_below_builder`): the
builder's own threads (the encoder's loading, the join's driver, the embedding) come
first on a CPU they share with a worker.

Ctrl-C is the builder's: a terminal sends SIGINT to the whole process group, and each
worker raised KeyboardInterrupt and printed its traceback before the builder's
``interrupted`` line (seen in CI, join workers). The server ignores SIGINT from its first
import, so the handler its children are given back after the fork is "ignore" too (the
server restores to each child the handler it had before its own loop); the builder ends
its pools, as on any other error.

Importing this module anywhere else would tie that process to its parent: it is meant
for the fork server only.
"""

from __future__ import annotations

import atexit
import os
import signal

from hf_pipeline.workers.pool import die_with_parent, run_below_builder

signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server and its children: Ctrl-C is the builder's
die_with_parent()  # the server: with the builder
os.register_at_fork(after_in_child=die_with_parent)  # its children: with the server
# Its children, not the server (whose imports the first shard waits for), yield the
# CPU to the builder's own threads.
os.register_at_fork(after_in_child=run_below_builder)
# Registered before the preloaded libraries import (and register theirs): run after
# their exit handlers. Nothing of the server's is left to write; its workers leave with
# os._exit themselves.
atexit.register(os._exit, 0)
