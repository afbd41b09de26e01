"""Free TCP ports for tests that start servers or launchers (torchrun, gloo, a Hub).

A port found free can be taken by another program before the test binds it; these
narrow the window, they do not close it.
"""

from __future__ import annotations

import socket

__all__ = ["free_port", "free_port_pair"]


def free_port() -> int:
    """A port no one listens on at this moment, on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair(tries: int = 50) -> int:
    """A port ``p`` such that ``p`` and ``p + 1`` are both free on every interface at
    this moment: torchrun's ``--master-port`` (its store on ``p``, jax.distributed's
    coordinator on ``p + 1``, ``dist.env``)."""
    for _ in range(tries):
        p = free_port()
        if p >= 65535:
            continue
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("0.0.0.0", p))
                b.bind(("0.0.0.0", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError(f"no two consecutive free ports found in {tries} tries")
