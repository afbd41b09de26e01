"""Peak memory of this process, for tests that bound what an operation may grow.

``resource.getrusage(...).ru_maxrss`` is not it: the kernel keeps it per process across
``exec``, so a fresh interpreter started from a big process (an xdist worker that has
imported JAX and torch: 1.5 GB and more) starts with that process's peak, and a growth
measured against it reads as none (a suite run also read the worker's size as a child
build's peak). ``VmHWM`` in ``/proc/self/status`` belongs to the process's own memory
map (made anew at ``exec``), and writing ``5`` to ``/proc/self/clear_refs`` resets it
to the current resident size (Linux 4.0 and later).
"""

from __future__ import annotations

import inspect


def reset_peak() -> None:
    """Reset this process's peak resident size to its current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_mib() -> float:
    """This process's peak resident size since its exec (or :func:`reset_peak`), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


#: Both functions as source, for the scripts tests run in fresh interpreters.
SOURCE = "\n".join(inspect.getsource(f) for f in (reset_peak, peak_mib))

__all__ = ["SOURCE", "peak_mib", "reset_peak"]
