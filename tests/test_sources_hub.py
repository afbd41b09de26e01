# ruff: noqa: F811 - pytest fixtures imported from tests.servers are parameters here
"""Hub sources against a local server speaking the Hub HTTP API (tests/servers/hub.py).

huggingface_hub freezes ``HF_ENDPOINT``/``HF_HUB_OFFLINE`` at import time, so the
online -> offline test runs in fresh subprocesses. The in-process tests rely on
``hf_pipeline.stores`` passing the endpoint explicitly and checking
``HF_HUB_OFFLINE`` itself at call time.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_pipeline.config import DataConfig
from hf_pipeline.errors import SourceError
from hf_pipeline.stores import HubSource, open_source
from hf_pipeline.stores.fetch import ShardFetcher
from hf_pipeline.stores.retry import RetryPolicy
from tests.servers import hf_home, shard_dir  # noqa: F401
from tests.servers.hub import FakeHub
from tests.servers.proxy import Fault, FaultProxy

pytestmark = pytest.mark.remote

FAST = RetryPolicy(max_retries=3, file_timeout=5, backoff_base=0.01)
REPO_ROOT = Path(__file__).resolve().parent.parent
REPO = "KBlueLeaf/coyo11m-256px-ccrop-latent"
LOCATION = f"hf://datasets/{REPO}/latents-3crop"


def _repo_files(local: Path) -> dict[str, bytes]:
    files = {f"latents-3crop/{p.name}": p.read_bytes() for p in local.glob("*.pt")}
    files["coyo11m-meta.parquet"] = (local / "coyo11m-meta.parquet").read_bytes()
    files["README.md"] = b"# test repo\n"
    return files


@pytest.fixture
def hub(shard_dir):
    """A FakeHub serving the shards under latents-3crop/ and the parquet at the root."""
    with FakeHub(page_size=2) as server:
        server.add_commit(REPO, _repo_files(shard_dir))
        yield server


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(args, env) -> dict:
    res = subprocess.run(
        [sys.executable, "-m", "tests.servers.fetch_main", *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout)


@pytest.mark.slow
def test_list_and_fetch_online_then_offline(hub, shard_dir, tmp_path):
    env = dict(
        os.environ, PYTHONPATH=str(REPO_ROOT), HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "home")
    )
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_HUB_CACHE", None)
    staging = str(tmp_path / "staging")
    online = _run([LOCATION, staging, "--metadata"], env)
    commit = hub._repos[REPO]["refs"]["main"]
    want = {p.name: (p.stat().st_size, _sha(p)) for p in shard_dir.glob("*.pt")}
    assert online["identity"][0] == [f"{REPO}@main", 0, commit]
    assert [(n, s, e) for n, s, e in online["identity"][1:]] == [
        (n, want[n][0], want[n][1]) for n in sorted(want)
    ]
    assert {n: v["sha256"] for n, v in online["files"].items()} == {
        n: w[1] for n, w in want.items()
    }
    assert online["metadata"]["sha256"] == _sha(shard_dir / "coyo11m-meta.parquet")
    # The metadata went through huggingface_hub's own cache (snapshot of the commit).
    assert f"snapshots/{commit}" in online["metadata"]["path"]
    # Branch resolved once; listing paginated (page size 2 -> several tree calls).
    assert hub.count("/revision/main") == 1
    assert hub.count(f"/tree/{commit}/latents-3crop") >= 2
    assert hub.count("/resolve/") == 4 + 1  # 4 shards + the parquet, each once

    hub.stop()  # the network is gone
    offline = _run([LOCATION, staging, "--metadata"], dict(env, HF_HUB_OFFLINE="1"))
    assert offline["identity"] == online["identity"]
    assert offline["files"] == online["files"]
    assert offline["metadata"] == online["metadata"]
    assert offline["stats"]["bytes"] == 0


def _cfg(tmp_path, **kw) -> DataConfig:
    kw.setdefault("staging_dir", str(tmp_path / "staging"))
    kw.setdefault("max_retries", 3)
    kw.setdefault("file_timeout", 5)
    return DataConfig(shards=LOCATION, **kw)


@pytest.fixture
def hub_env(hub, monkeypatch, hf_home):
    """Online against ``hub`` in this process.

    tests/conftest.py sets ``HF_HUB_OFFLINE=1`` before huggingface_hub may be imported,
    and huggingface_hub freezes it into ``constants.HF_HUB_OFFLINE`` (which its HTTP
    hook consults on every request), so both are switched off here and restored after.
    """
    import huggingface_hub.constants

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return hub


def test_revision_pins_a_commit_and_identity_follows_it(hub_env, shard_dir, tmp_path):
    hub = hub_env
    first = hub._repos[REPO]["refs"]["main"]
    src = open_source(LOCATION, data_config=_cfg(tmp_path), policy=FAST)
    assert isinstance(src, HubSource) and src.commit == first
    ident = src.identity()
    # A new commit on main (README edit): the branch now resolves elsewhere.
    files = _repo_files(shard_dir)
    files["README.md"] = b"# edited\n"
    second = hub.add_commit(REPO, files)
    moved = open_source(LOCATION, data_config=_cfg(tmp_path), policy=FAST)
    assert moved.commit == second and moved.identity()[0][2] == second
    assert moved.identity()[1:] == ident[1:], "same shard content, same per-file identity"
    pinned = open_source(
        f"hf://datasets/{REPO}@{first}/latents-3crop", data_config=_cfg(tmp_path), policy=FAST
    )
    assert pinned.commit == first and hub.count(f"/revision/{first}") == 0
    with pytest.raises(SourceError, match="cannot resolve revision 'nope'"):
        _ = open_source(
            f"hf://datasets/{REPO}@nope/x", data_config=_cfg(tmp_path), policy=FAST
        ).commit
    with pytest.raises(SourceError, match="no such folder"):
        open_source(
            f"hf://datasets/{REPO}/missing", data_config=_cfg(tmp_path), policy=FAST
        ).list_shards()
    meta = src.find_metadata()
    assert meta.name == "coyo11m-meta.parquet" and meta.checksum.startswith("sha256:")
    assert src.find_metadata(f"hf://datasets/{REPO}/coyo11m-meta.parquet") == meta


def test_faults_on_the_hub_are_retried_and_verified(hub_env, shard_dir, tmp_path, monkeypatch):
    hub = hub_env
    with FaultProxy(hub.url) as proxy:
        monkeypatch.setenv("HF_ENDPOINT", proxy.url)
        proxy.add(
            Fault(match="/revision/main", action="status", status=502, times=1),
            Fault(match="000000-000005.pt", action="status", status=503, times=2),
            Fault(match="000006-000011.pt", action="truncate", times=1),
            Fault(match="000012-000017.pt", action="reset", times=1),
            Fault(
                match="coyo11m-meta.parquet", action="status", status=503, times=1, method="HEAD"
            ),
            Fault(match="coyo11m-meta.parquet", action="truncate", times=1),
        )
        cfg = _cfg(tmp_path, download_workers=2)
        src = open_source(LOCATION, data_config=cfg, policy=FAST)
        files = src.list_shards()
        with ShardFetcher(
            src, files, data_config=cfg, num_workers=2, progress=False, policy=FAST
        ) as pf:
            client = pf.client()
            for f in files:
                assert _sha(client.acquire(f, timeout=30)) == _sha(shard_dir / f.name)
        stats = pf.stats()
        assert stats["retries"] >= 4 and stats["failures"] == []
        assert stats["listing_retries"] == 1  # the 502 on /revision/main
        meta = src.find_metadata()
        assert _sha(src.fetch_one(meta)) == _sha(shard_dir / "coyo11m-meta.parquet")
        # Both injected faults hit the metadata download (huggingface_hub's own
        # retry/resume or ours absorbed them).
        assert {r.fault for r in proxy.log if "coyo11m-meta.parquet" in r.path} >= {
            "status",
            "truncate",
        }
        # The truncated download resumed with a Range request instead of starting over.
        assert any(
            r.range and "000006-000011.pt" in r.path and not r.range.startswith("bytes=0-")
            for r in proxy.log
        )


def test_skip_and_fail_on_the_hub(hub_env, shard_dir, tmp_path, monkeypatch):
    hub = hub_env
    bad = "000018-000023.pt"
    with FaultProxy(hub.url) as proxy:
        monkeypatch.setenv("HF_ENDPOINT", proxy.url)
        proxy.add(Fault(match=bad, action="status", status=500, times=-1))
        policy = RetryPolicy(max_retries=1, file_timeout=5, backoff_base=0.01)
        for mode in ("fail", "skip"):
            cfg = _cfg(tmp_path, on_missing=mode, max_retries=1)
            src = open_source(LOCATION, data_config=cfg, policy=policy)
            files = src.list_shards()
            with ShardFetcher(src, files, data_config=cfg, progress=False, policy=policy) as pf:
                client = pf.client()
                if mode == "fail":
                    with pytest.raises(SourceError) as ei:
                        for f in files:
                            client.acquire(f, timeout=30)
                    assert bad in ei.value.path and "500" in ei.value.reason
                else:
                    got = {f.name: client.acquire(f, timeout=30) for f in files}
                    assert got[bad] is None and all(
                        v is not None for k, v in got.items() if k != bad
                    )
            if mode == "skip":
                assert [s["name"] for s in pf.stats()["skipped"]] == [bad]


def test_files_already_in_the_hub_cache_are_used_in_place(
    hub_env, shard_dir, tmp_path, monkeypatch
):
    from huggingface_hub import hf_hub_download

    hub = hub_env
    src = open_source(LOCATION, data_config=_cfg(tmp_path), policy=FAST)
    files = src.list_shards()
    cached = hf_hub_download(
        REPO,
        f"latents-3crop/{files[1].name}",
        repo_type="dataset",
        revision=src.commit,
        endpoint=hub.url,
        cache_dir=str(Path(os.environ["HF_HOME"]) / "hub"),
    )
    before = hub.count("/resolve/")
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    offline = open_source(LOCATION, data_config=_cfg(tmp_path / "fresh"), policy=FAST)
    assert offline.list_shards() == files  # from the saved listing
    with ShardFetcher(
        offline, files, data_config=offline.data_config, progress=False, policy=FAST
    ) as pf:
        client = pf.client()
        assert client.acquire(files[1], timeout=10) == Path(cached)
        client.release(files[1])
        assert Path(cached).exists(), "never delete from huggingface_hub's cache"
        with pytest.raises(SourceError, match="HF_HUB_OFFLINE"):
            client.acquire(files[0], timeout=10)
    assert hub.count("/resolve/") == before


def test_stray_names_are_refused_and_a_glob_names_them(hub_env, shard_dir, tmp_path):
    hub = hub_env
    files = _repo_files(shard_dir)
    files["latents-3crop/latest.pt"] = files["latents-3crop/000000-000005.pt"]
    hub.add_commit(REPO, files)
    with pytest.raises(SourceError) as ei:
        open_source(LOCATION, data_config=_cfg(tmp_path), policy=FAST).list_shards()
    assert "not named by a row range" in ei.value.reason and "latest.pt;" in ei.value.reason
    every = open_source(f"{LOCATION}/*.pt", data_config=_cfg(tmp_path), policy=FAST)
    names = [f.name for f in every.list_shards()]
    assert names == ["latest.pt", *sorted(p.name for p in shard_dir.glob("*.pt"))]
    assert every.find_metadata().name == "coyo11m-meta.parquet"
    numbered = open_source(f"{LOCATION}/0*.pt", data_config=_cfg(tmp_path), policy=FAST)
    assert [f.name for f in numbered.list_shards()] == names[1:]


def _closed_port_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed on return: refused


def test_a_hub_that_is_down_is_unreachable_not_bad_input(hub_env, tmp_path, monkeypatch):
    from hf_pipeline.errors import StoreUnreachableError

    nope = open_source(f"hf://datasets/{REPO}@nope/x", data_config=_cfg(tmp_path), policy=FAST)
    with pytest.raises(SourceError) as ei:
        _ = nope.commit
    assert not isinstance(ei.value, StoreUnreachableError)  # the Hub answered: no such revision
    # A Hub that is down (stopping the server would not do: pooled keep-alive
    # connections outlive it).
    monkeypatch.setenv("HF_ENDPOINT", _closed_port_url())
    src = open_source(LOCATION, data_config=_cfg(tmp_path), policy=FAST)
    with pytest.raises(StoreUnreachableError, match="cannot resolve revision 'main'"):
        _ = src.commit
    assert src.fetch_stats.as_dict()["listing_retries"] == FAST.max_retries


def test_a_symlinked_listing_folder_is_refused_and_nothing_is_written_there(hf_home, tmp_path):
    """`.hub_listings` under a shared root linked to a folder of the user's: the listing
    cache was written there. Now refused naming the link."""
    from dist.errors import ForeignCacheFolderError
    from hf_pipeline.cache.layout import HUB_LISTINGS_DIR
    from tests.helpers.victims import Victim

    victim = Victim(tmp_path / "victim")
    commit = "0123456789abcdef0123456789abcdef01234567"  # pinned: no network to resolve it
    src = open_source(f"hf://datasets/org/name@{commit}/latents", data_config=DataConfig())
    place = src._listing_cache().parent
    assert place.name == HUB_LISTINGS_DIR
    place.parent.mkdir(parents=True)
    place.symlink_to(victim.path)
    with pytest.raises(ForeignCacheFolderError) as e:
        src._save_listing("latents", [])
    assert e.value.path == str(place)
    victim.assert_untouched()
