"""Imported first by the build's fork server (:data:`hf_pipeline.workers.pool.PRELOAD`): ties
the server, and every process it forks, to the builder.

A SIGKILLed builder cannot stop its pools; without this, the processes its fork server
forked (the ``num_proc`` workers and the manager ``datasets`` starts beside them) would
linger, holding shards, staging slots and memory. On Linux, the server gets
``PR_SET_PDEATHSIG`` (SIGKILL) towards the builder's thread that started it (a thread
that lives as long as the builder: see :func:`hf_pipeline.workers.pool.clean_workers`), and
each process it forks gets it towards the server. Elsewhere this does nothing.

Importing this module anywhere else would tie that process to its parent: it is meant
for the fork server only.
"""

from __future__ import annotations

import os

from hf_pipeline.workers.pool import die_with_parent

die_with_parent()  # the server: with the builder
os.register_at_fork(after_in_child=die_with_parent)  # its children: with the server
