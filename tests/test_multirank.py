"""4 real processes with RANK/WORLD_SIZE on one shared HF_HOME: one builds, all agree."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import REPO, SMALL_DEMO, run_ranks
from tests.helpers.caches import copy_inputs
from tests.helpers.dist_job import two_rank_nodes
from tests.helpers.ports import free_port_pair
from tests.servers import shard_dir  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow


def test_four_ranks_one_build_identical_data_disjoint_slices(tmp_path):
    hf_home = tmp_path / "hf_home"
    world = 4
    overrides = [*SMALL_DEMO, "loader.global_batch_size=32", "coord.poll_interval=0.2"]
    runs = run_ranks(
        [REPO / "tests/procs/rank_loader.py", tmp_path / "r{rank}.json", *overrides],
        world,
        timeout=420,
        HF_HOME=str(hf_home),
    )
    for code, out, err in runs:
        assert code == 0, (out + err)[-3000:]
    results = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(world)]

    assert sum(r["built"] for r in results) == 1, "exactly one rank builds"
    assert results[0]["built"], "rank 0 is the builder"
    assert len({r["fingerprint"] for r in results}) == 1
    assert len({r["content"] for r in results}) == 1, "all ranks read identical data"
    caches = list((hf_home / "datasets" / "hf_pipeline").glob("demo-*"))
    assert len(caches) == 1

    # Each global batch: rank slices are disjoint, equal-sized, and together are the
    # batch the same loader yields for a single process (world-size independent order).
    from hf_pipeline.cache.layout import CacheLayout, open_sample_source
    from hf_pipeline.config import load_config
    from hf_pipeline.read.loader import Loader

    steps = {len(r["batches"]) for r in results}
    assert len(steps) == 1 and steps.pop() > 0
    cfg = load_config(None, overrides, environ={})
    src = open_sample_source(CacheLayout(caches[0]), results[0]["fingerprint"])
    with Loader.from_config(src, cfg.loader, process_index=0, process_count=1) as single:
        reference = [np.asarray(b["keys"]).tolist() for b in single]
    assert len(reference) == len(results[0]["batches"])
    for step, whole in enumerate(reference):
        parts = [r["batches"][step] for r in results]
        assert all(len(p) == 32 // world for p in parts)
        flat = [k for p in parts for k in p]
        assert flat == whole
        assert len(set(flat)) == len(flat)
    src.close()


def test_node_scope_one_build_per_node(tmp_path):
    """coord.scope=node: 2 nodes x 2 ranks, each node a local cache; local rank 0 builds."""

    overrides = [*SMALL_DEMO, "coord.scope=node", "loader.global_batch_size=32"]
    runs = run_ranks(
        [REPO / "tests/procs/rank_loader.py", tmp_path / "r{rank}.json", *overrides],
        4,
        timeout=420,
        rank_env=two_rank_nodes(tmp_path),
    )
    for code, out, err in runs:
        assert code == 0, (out + err)[-3000:]
    results = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(4)]
    assert [r["built"] for r in results] == [True, False, True, False]
    assert len({r["content"] for r in results}) == 1, "both nodes built the same data"
    for node in (0, 1):
        caches = [p for p in (tmp_path / f"node{node}").iterdir() if not p.name.startswith(".")]
        assert len(caches) == 1 and (caches[0] / "filtered.json").is_file()


def _everything(res):
    from hf_pipeline.cache.layout import open_dataset

    ds = open_dataset(res.layout).with_format("numpy")
    return ds[:]


def _assert_same_cache(one, res):
    """``res`` is the cache ``one`` is: the same kept keys in the same order, byte-identical
    latents and captions, embeddings equal up to float noise, the same accounting."""
    a, b = _everything(one), _everything(res)
    assert a["key"].tolist() == b["key"].tolist()
    assert a["caption"].tolist() == b["caption"].tolist()
    np.testing.assert_array_equal(a["latents"], b["latents"])
    np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-5)
    assert res.report["dropped"] == one.report["dropped"]
    assert res.report["rows_out"] == one.report["rows_out"]


def _one_builder_and_ranks(small_config, tmp_path, world: int, *extra: str):
    """The small demo built by one builder, then by ``world`` real rank processes with
    build.parallel=ranks (and ``extra``), each of which must exit 0 with the one
    builder's fingerprint (``parallel`` is a speed knob) and have built.

    Returns:
        The one builder's BuildResult and the ranks' cache, as prepare_cache then finds it.
    """
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config

    data = copy_inputs(small_config, tmp_path / "data")
    base = [*SMALL_DEMO, f"data.shards={data}", "coord.poll_interval=0.1"]
    one = prepare_cache(
        load_config(None, [*base, f"build.cache_dir={tmp_path / 'one'}"], environ={}),
        progress=False,
    )
    par = [*base, f"build.cache_dir={tmp_path / 'par'}", "build.parallel=ranks", *extra]
    # A launch id (as torchrun's run id): the ranks agree on the job's start, so the
    # report counts a part a rank finished before rank 0 started as built, not reused.
    runs = run_ranks(
        [REPO / "tests/procs/rank_loader.py", tmp_path / "r{rank}.json", *par], world,
        timeout=600, HF_PIPELINE_JOB_ID=f"par-{tmp_path.name}",
    )  # fmt: skip
    for code, out, err in runs:
        assert code == 0, (out + err)[-3000:]
    results = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(world)]
    assert {r["fingerprint"] for r in results} == {one.fingerprint}
    assert all(r["built"] for r in results), "every rank built its part"
    assert len({r["content"] for r in results}) == 1
    res = prepare_cache(load_config(None, par, environ={}), progress=False)
    assert res.built is False and res.fingerprint == one.fingerprint
    return one, res


def test_four_ranks_build_in_parts_equal_to_one_builder(small_config, tmp_path):
    """build.parallel=ranks: 4 real processes each build a part; rank 0 assembles. The
    cache equals a single builder's: same fingerprint, same kept keys in the same order,
    byte-identical latents and captions, embeddings equal up to float noise."""
    one, res = _one_builder_and_ranks(small_config, tmp_path, 4, "build.part_shards=1")
    parts = res.report["parts"]  # the report says who built which shards
    assert [p["shards"] for p in parts] == [1, 1, 1, 1]
    assert len({p["builder"]["pid"] for p in parts}) == 4
    _assert_same_cache(one, res)


def test_two_ranks_build_their_parts_overlapped(small_config, tmp_path):
    """build.parallel=ranks, 2 ranks, 4 parts: each rank builds its 2 parts (index modulo
    the ranks), the embedding of its first overlapping the join of its second, as one
    builder does; the stage hard-linked all four, and the cache equals a single
    builder's."""
    one, res = _one_builder_and_ranks(small_config, tmp_path, 2, "build.part_shards=1")
    parts = res.report["parts"]
    assert [p["shards"] for p in parts] == [1, 1, 1, 1]
    pids = [p["builder"]["pid"] for p in parts]
    assert pids[0] == pids[2] != pids[1] == pids[3], "a rank built parts k and k+2"
    for first, second in (parts[0::2], parts[1::2]):
        # The first part's embedding (its token ids first, on the same thread) started
        # before the second part's join ended.
        started = (first["wall"]["tokens"] or first["wall"]["embed"])[0]
        assert first["wall"]["join"][1] <= started <= first["wall"]["embed"][0]
        # The second join did not wait for the first part's token ids and embedding
        # (they may start after a short join ends: the tokenizer still loading).
        assert second["wall"]["join"][0] < first["wall"]["embed"][1]
        assert first["wall"]["join"][1] <= second["wall"]["join"][0] + 1e-3
    assert res.report["reuse"]["joins_built"] == 4
    conv = res.layout.stage_dir("converted")
    assert len(list((conv / "parts").glob("part-*/rows/*.arrow"))) == 4
    _assert_same_cache(one, res)


def test_sigkilled_part_builder_only_its_part_is_redone(small_config, tmp_path):
    """build.parallel=ranks, 4 ranks: rank 2 is SIGKILLed while it builds its part; a live
    rank takes that part over (only it is redone) and the cache equals a clean build."""
    import os
    import signal
    import subprocess
    import time

    from dist.markers import read_json
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config
    from tests.conftest import PYTHON, script_env

    data = copy_inputs(small_config, tmp_path / "data")
    base = [*SMALL_DEMO, f"data.shards={data}", "coord.poll_interval=0.1"]
    par = [*base, f"build.cache_dir={tmp_path / 'par'}", "build.parallel=ranks",
           "build.part_shards=1", "coord.lease_timeout=4",
           "coord.heartbeat_interval=0.5"]  # fmt: skip
    procs = [
        subprocess.Popen(
            [PYTHON, str(REPO / "tests/procs/rank_loader.py"), str(tmp_path / "r{rank}.json"), *par],
            env=script_env(RANK=str(r), WORLD_SIZE="4", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="4"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(4)
    ]  # fmt: skip
    try:
        victim = procs[2]
        deadline = time.monotonic() + 240
        part2 = None
        while part2 is None:  # rank 2 holds part 2's lease and has started joining it
            assert time.monotonic() < deadline, "rank 2 never started its part"
            for lease in (tmp_path / "par" / ".parts").glob("join-*/lease"):
                info = read_json(lease)
                if isinstance(info, dict) and info.get("pid") == victim.pid:
                    if any(lease.parent.glob("join.*/")):
                        part2 = lease.parent
            time.sleep(0.05)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
        outs = [p.communicate(timeout=400)[0] for p in procs if p is not victim]
        for p, out in zip([p for p in procs if p is not victim], outs, strict=True):
            assert p.returncode == 0, out[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    res = prepare_cache(load_config(None, par, environ={}), progress=False)
    parts = res.report["parts"]
    pids = [p["builder"]["pid"] for p in parts]
    assert pids[2] != victim.pid and pids[2] in {p.pid for p in procs}
    assert pids[0] == procs[0].pid and pids[1] == procs[1].pid and pids[3] == procs[3].pid
    # Exactly one published copy of the part: only part 2 was built twice.
    assert part2.name == f"join-{parts[2]['id']}"
    assert len(list(part2.glob("join.*/"))) == 1
    one = prepare_cache(
        load_config(None, [*base, f"build.cache_dir={tmp_path / 'one'}"], environ={}),
        progress=False,
    )
    _assert_same_cache(one, res)


def test_one_builder_in_parts_overlaps_and_equals_one_part(small_config, tmp_path):
    """One builder with build.part_shards: the embedding of part k (a thread) overlaps the
    join of part k+1; the cache is the one-part cache (same fingerprint, same content),
    and the report lists the parts in shard order."""
    import threading

    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config

    data = copy_inputs(small_config, tmp_path / "data")
    base = [*SMALL_DEMO, f"data.shards={data}"]
    one = prepare_cache(
        load_config(None, [*base, f"build.cache_dir={tmp_path / 'one'}"], environ={}),
        progress=False,
    )
    cfg = load_config(
        None, [*base, f"build.cache_dir={tmp_path / 'parts'}", "build.part_shards=1"], environ={}
    )
    res = prepare_cache(cfg, progress=False)
    assert res.built and res.fingerprint == one.fingerprint
    parts = res.report["parts"]
    assert [p["shards"] for p in parts] == [1, 1, 1, 1]
    # The second join did not wait for the first part's token ids and embedding (later
    # parts queue behind the embedding before them when, as on this CPU, it is slower).
    assert parts[1]["wall"]["join"][0] < parts[0]["wall"]["embed"][1]
    for k in range(4):
        assert parts[k]["wall"]["join"][1] <= parts[k]["wall"]["embed"][0]
        if k < 3:
            assert parts[k]["wall"]["join"][1] <= parts[k + 1]["wall"]["join"][0] + 1e-3
    assert not [t for t in threading.enumerate() if t.name.startswith("hf_pipeline-embed")]
    _assert_same_cache(one, res)


# ------------------------------------------------ issue 24 item 12: ranks must agree


def _start_each(argvs_envs, timeout: float = 300) -> list[tuple[int, str, str]]:
    from tests.conftest import run_each

    return run_each(argvs_envs, timeout=timeout)


def _rank_env(rank: int, world: int, **extra: str) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), **extra}  # fmt: skip


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_rank_with_another_world_size_stops_every_rank(small_config, tmp_path):
    """A rank started with WORLD_SIZE=2 among 4 (parallel: ranks, one shared cache root,
    a launcher that names the job): every rank exits 2 with the same line naming rank 1
    and world_size, and nothing is built (it used to retire the others' part markers)."""
    data = copy_inputs(small_config, tmp_path / "data")
    cache = tmp_path / "cache"
    argv = [REPO / "scripts/prebuild_cache.py", "-q", "--cache-dir", cache,
            *[a for o in [*SMALL_DEMO, f"data.shards={data}", "build.parallel=ranks"]
              for a in ("--set", o)]]  # fmt: skip
    job = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
    runs = _start_each([(argv, _rank_env(r, 2 if r == 1 else 4, **job)) for r in range(4)])
    lines = set()
    for code, _out, err in runs:
        assert code == 2, err[-3000:]
        lines.add(_one_error_line(err))
    (line,) = lines  # the same line on every rank
    assert "rank 1 has world_size=2 but rank 0 has 4" in line, line
    assert not list(cache.glob("*/parts")) and not list(cache.glob("*/converted*"))


def test_rank_with_another_config_stops_every_rank(small_config, tmp_path):
    """A rank started with encoder.max_length=32 used to build a second complete cache
    alone: now both ranks exit 2 naming the field, before building anything."""
    data = copy_inputs(small_config, tmp_path / "data")
    cache = tmp_path / "cache"
    argv = [REPO / "scripts/prebuild_cache.py", "-q", "--cache-dir", cache,
            *[a for o in [*SMALL_DEMO, f"data.shards={data}", "build.parallel=ranks"]
              for a in ("--set", o)]]  # fmt: skip
    job = {"HF_PIPELINE_JOB_ID": "config-mismatch"}
    runs = _start_each([
        (argv, _rank_env(0, 2, **job)),
        ([*argv, "--set", "encoder.max_length=32"], _rank_env(1, 2, **job)),
    ])  # fmt: skip
    lines = {_one_error_line(err) for code, _out, err in runs if code == 2}
    assert [code for code, _, _ in runs] == [2, 2], runs
    (line,) = lines
    assert "rank 1 has encoder.max_length=32 but rank 0 has" in line, line
    assert not list(cache.glob("demo-*"))


def test_two_jobs_on_one_cache_root_do_not_meet(tmp_path):
    """Two launches on one cache root, with different configs, agree each within its
    own job (their ids differ); a later launch with an id already used is refused."""
    root = str(tmp_path / "root")
    script = REPO / "tests/procs/agree_rank.py"

    def job(job_id: str, max_length: int) -> list:
        sets = [f"build.cache_dir={root}", f"encoder.max_length={max_length}",
                "coord.poll_interval=0.05", "coord.max_wait=120"]  # fmt: skip
        return [([script, *sets], _rank_env(r, 2, SLURM_JOB_ID=job_id)) for r in range(2)]

    runs = _start_each([*job("100", 32), *job("101", 64)], timeout=200)
    for code, out, err in runs:
        assert code == 0, err[-3000:]
        assert json.loads(out) == {"store": "FileJobStore"}
    # The same id again (a launcher reusing it): refused, not the first launch's posts read.
    runs = _start_each(job("100", 32), timeout=200)
    assert [code for code, _, _ in runs] == [2, 2], runs
    assert all("already posted" in _one_error_line(err) for _, _, err in runs)


# ------------------------------ issue 24 item 14: a torchrun launch is one JAX job


def _rdzv() -> list[str]:
    """torchrun's store on a free port whose next port is free too: jax.distributed's
    coordinator listens there (``MASTER_PORT + 1``); torchrun's own pick leaves it to
    chance, and a port in use there failed a run of the full suite."""
    return ["--master_addr", "127.0.0.1", "--master_port", str(free_port_pair())]


def test_torchrun_ranks_train_one_model(small_config, built_cache, tmp_path):
    """README's launch line without JAX_COORDINATOR_ADDRESS: real torchrun, 2 ranks.
    They join one jax.distributed job (coordinator from MASTER_ADDR/MASTER_PORT), so
    after the steps both hold the same parameters (they used to train a model each)."""
    overrides = [*SMALL_DEMO, f"build.cache_dir={small_config.cache_root}",
                 "train.steps=6", "loader.global_batch_size=16"]  # fmt: skip
    runs = _start_each(
        [(["-m", "torch.distributed.run", "--nproc_per_node", "2", *_rdzv(),
            REPO / "tests/procs/train_rank.py", tmp_path / "out-{rank}.json", *overrides],
          {"OMP_NUM_THREADS": "1"})],
        timeout=400,
    )  # fmt: skip
    code, out, err = runs[0]
    assert code == 0, (out + err)[-4000:]
    records = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in range(2)]
    assert [r["process_count"] for r in records] == [2, 2], records
    assert records[0]["params"] == records[1]["params"], records


def test_ranks_without_a_coordinator_are_refused(small_config, tmp_path):
    """RANK/WORLD_SIZE but nothing naming a coordinator (no MASTER_ADDR/MASTER_PORT,
    no JAX_COORDINATOR_ADDRESS): train.py refuses with one line naming what to set,
    exit 2, rather than train one model per rank."""
    argv = [REPO / "scripts/train.py", "-q", "--cache-dir", tmp_path / "cache",
            *[a for o in SMALL_DEMO for a in ("--set", o)]]  # fmt: skip
    runs = _start_each([(argv, _rank_env(r, 2)) for r in range(2)], timeout=200)
    for code, _out, err in runs:
        assert code == 2, err[-3000:]
        line = _one_error_line(err)
        assert "JAX_COORDINATOR_ADDRESS" in line and "MASTER_ADDR" in line, line
    assert not (tmp_path / "cache").exists()


@pytest.mark.remote
def test_torchrun_ranks_make_the_hub_requests_of_one(shard_dir, tmp_path):  # noqa: F811
    """8 ranks launched by real torchrun, no process group of their own, from hf://:
    torchrun's store is the job store, so they make the Hub API requests of one rank
    (each rank used to resolve the inputs itself: 5 requests per rank)."""
    from tests.servers.hub import FakeHub

    files = {f"latents/{p.name}": p.read_bytes() for p in shard_dir.glob("*.pt")}
    files["coyo11m-meta.parquet"] = (shard_dir / "coyo11m-meta.parquet").read_bytes()
    overrides = ["data.shards=hf://datasets/org/coyo-like/latents", "build.num_proc=1"]
    script = REPO / "tests/procs/resolve_launched.py"
    with FakeHub(page_size=2) as hub:
        hub.add_commit("org/coyo-like", files)
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "OMP_NUM_THREADS": "1"}
        (single,) = _start_each(
            [
                (
                    [script, tmp_path / "one.json", *overrides],
                    {**env, "HF_HOME": str(tmp_path / "h1")},
                )
            ]
        )
        assert single[0] == 0, single[2][-3000:]
        requests_one = len(hub.log)
        assert requests_one > 0
        (launch,) = _start_each(
            [(["-m", "torch.distributed.run", "--nproc_per_node", "8", *_rdzv(), script,
               tmp_path / "r{rank}.json", *overrides], {**env, "HF_HOME": str(tmp_path / "h8")})],
            timeout=400,
        )  # fmt: skip
        assert launch[0] == 0, (launch[1] + launch[2])[-4000:]
        requests_eight = len(hub.log) - requests_one
    one = json.loads((tmp_path / "one.json").read_text())
    eight = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(8)]
    assert requests_eight == requests_one, (requests_one, requests_eight)
    assert {r["fingerprint"] for r in eight} == {one["fingerprint"]}
    assert all(r["shards"] == one["shards"] == 4 for r in eight)


def test_torchrun_ranks_resume_a_checkpoint(small_config, built_cache, tmp_path):
    """2 torchrun ranks train 6 steps saving every 3; a second launch resumes from step 3
    of a copy (as after a SIGKILL once step 3 was saved) and finishes: both ranks end
    with the same parameters as the uninterrupted run and log the same losses. The
    restored state used to sit on each rank's own device, so the first resumed step
    failed with "Received incompatible devices for jitted computation"."""
    import shutil

    def launch(ckpt, tag):
        overrides = [*SMALL_DEMO, f"build.cache_dir={small_config.cache_root}",
                     "train.steps=6", "loader.global_batch_size=16", "train.log_every=1",
                     f"train.checkpoint={ckpt}", "train.checkpoint_every=3",
                     "train.keep_checkpoints=5"]  # fmt: skip
        (run,) = _start_each(
            [(["-m", "torch.distributed.run", "--nproc_per_node", "2", *_rdzv(),
               REPO / "tests/procs/train_loop_rank.py", tmp_path / f"{tag}-{{rank}}.json",
               *overrides], {"OMP_NUM_THREADS": "1"})],
            timeout=400,
        )  # fmt: skip
        assert run[0] == 0, (run[1] + run[2])[-4000:]
        return [json.loads((tmp_path / f"{tag}-{r}.json").read_text()) for r in range(2)]

    whole = launch(tmp_path / "a", "whole")
    assert [r["steps"] for r in whole] == [6, 6] and whole[0]["params"] == whole[1]["params"]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b/6")  # the run was killed after step 3 was saved
    resumed = launch(tmp_path / "b", "resumed")
    assert [r["process_count"] for r in resumed] == [2, 2], resumed
    assert [r["steps"] for r in resumed] == [3, 3], resumed
    assert {r["params"] for r in resumed} == {whole[0]["params"]}, (whole, resumed)
    assert resumed[0]["losses"] == resumed[1]["losses"] == whole[0]["losses"][3:], resumed
