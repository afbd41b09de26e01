"""dist.doorbell: waking waiters through a real TCPStore and a real JAX coordination service."""

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO


def test_store_doorbell_generations_on_a_real_tcpstore():
    td = pytest.importorskip("torch.distributed")
    from dist.doorbell import StoreDoorbell
    from dist.kvstore import private_torch_store

    server = td.TCPStore("127.0.0.1", 0, 1, True)
    bell = StoreDoorbell(private_torch_store(td.PrefixStore("default_pg", server)), "k")
    other = StoreDoorbell(private_torch_store(server), "k")  # another rank's client
    token = bell.token()
    assert not bell.rung(token)
    other.ring()
    assert bell.rung(token)  # a ring after the token is seen...
    fresh = bell.token()
    assert fresh == token + 1 and not bell.rung(fresh)  # ...and only once per token
    t0 = time.monotonic()
    for _ in range(200):
        bell.rung(fresh)
    assert (time.monotonic() - t0) / 200 < 0.01  # non-blocking


@pytest.mark.slow
def test_store_doorbell_on_jax_coordination_service():
    code = """
import socket, jax
from pathlib import Path
from dist.doorbell import auto_doorbell
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0)
bell = auto_doorbell(Path("/c"), "fp")
t = bell.token()
before = bell.rung(t)
bell.ring()
print(type(bell).__name__, before, bell.rung(t), bell.token() == t + 1)
jax.distributed.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["StoreDoorbell", "False", "True", "True"]
