# ruff: noqa: F811 - pytest fixtures imported from tests.servers are parameters here
"""Inputs resolved once per job: 8 real ranks make the Hub requests 1 rank makes."""

from __future__ import annotations

import json
import socket

import pytest

from tests.conftest import REPO, run_ranks
from tests.servers import shard_dir  # noqa: F401
from tests.servers.hub import FakeHub

pytestmark = [pytest.mark.slow, pytest.mark.remote]

HUB_REPO = "org/coyo-like"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(hub, world: int, tmp_path) -> list[dict]:
    overrides = [f"data.shards=hf://datasets/{HUB_REPO}/latents", "build.num_proc=1"]
    runs = run_ranks(
        [REPO / "tests/procs/resolve_rank.py", *overrides], world, timeout=300,
        HF_ENDPOINT=hub.url, HF_HUB_OFFLINE="0", HF_HOME=str(tmp_path / f"home{world}"),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
    )  # fmt: skip
    for code, out, err in runs:
        assert code == 0, (out + err)[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in runs]


def test_eight_ranks_make_the_api_requests_of_one(shard_dir, tmp_path):
    files = {f"latents/{p.name}": p.read_bytes() for p in shard_dir.glob("*.pt")}
    files["coyo11m-meta.parquet"] = (shard_dir / "coyo11m-meta.parquet").read_bytes()
    with FakeHub(page_size=2) as hub:
        hub.add_commit(HUB_REPO, files)
        one = _resolve(hub, 1, tmp_path)
        requests_one = len(hub.log)
        assert requests_one > 0
        eight = _resolve(hub, 8, tmp_path)
        requests_eight = len(hub.log) - requests_one
    assert requests_eight == requests_one, (requests_one, requests_eight)
    assert {r["fingerprint"] for r in eight} == {one[0]["fingerprint"]}
    assert all(r["shards"] == one[0]["shards"] == 4 for r in eight)
