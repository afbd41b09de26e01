"""The build is safe where users call it: after JAX (or CUDA) is up, its workers come
from a clean fork server, never from a fork of the caller.

``hf_pipeline.workers.pool`` makes ``datasets``' ``num_proc`` pools start their workers from a
fork server of the build's own; these tests check that with real processes: a 2-rank
``jax.distributed`` job builds fresh caches several times without one ``os.fork()``,
the start method is restored, the server has the libraries imported before any worker
starts, sees the environment of its build and is gone after it, and a script without a
main guard fails at once with a message instead of hanging.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import datasets
import multiprocess
import pytest

from hf_pipeline.workers.pool import PRELOAD, clean_workers
from tests.conftest import PYTHON, REPO, SMALL_DEMO, run_ranks, script_env
from tests.helpers.ports import free_port

_FORKS: list[int] = []
os.register_at_fork(before=lambda: _FORKS.append(os.getpid()))


def _plus_one(batch):
    return {"y": [x + 1 for x in batch["x"]]}


@pytest.fixture
def start_method():
    """Restore ``multiprocess``'s default start method after the test."""
    before = multiprocess.get_start_method(allow_none=True)
    yield
    multiprocess.set_start_method(before, force=True)


@pytest.mark.parametrize("chosen", [None, "fork", "spawn", "forkserver"])
def test_start_method_is_forkserver_inside_and_restored_after(start_method, chosen):
    multiprocess.set_start_method(chosen, force=True)
    with clean_workers():
        # A caller's fork (explicit, or fixed by an earlier get_start_method()) is
        # replaced; a clean method the caller chose is kept.
        expected = chosen if chosen in ("spawn", "forkserver") else "forkserver"
        assert multiprocess.get_start_method(allow_none=True) == expected
        with clean_workers():
            assert multiprocess.get_start_method(allow_none=True) == expected
        assert multiprocess.get_start_method(allow_none=True) == expected  # inner exit
    assert multiprocess.get_start_method(allow_none=True) == chosen


def test_overlapping_blocks_in_threads_restore_once(start_method):
    multiprocess.set_start_method("fork", force=True)
    entered, leave = threading.Barrier(3, timeout=30), threading.Event()
    seen = []

    def build():
        with clean_workers():
            entered.wait()
            assert leave.wait(timeout=30)
            seen.append(multiprocess.get_start_method(allow_none=True))

    threads = [threading.Thread(target=build, name=f"build-{i}") for i in range(2)]
    for t in threads:
        t.start()
    entered.wait()  # both threads are inside their blocks
    leave.set()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    assert seen == ["forkserver", "forkserver"]
    assert multiprocess.get_start_method(allow_none=True) == "fork"


@pytest.mark.slow
def test_datasets_map_with_num_proc_never_forks_the_caller(start_method, tmp_path):
    ds = datasets.Dataset.from_dict({"x": list(range(10))})
    forks = len(_FORKS)
    with clean_workers():
        out = ds.map(
            _plus_one,
            batched=True,
            batch_size=2,
            num_proc=2,
            cache_file_name=str(tmp_path / "out.arrow"),
        )
    assert out["y"] == list(range(1, 11))
    assert len(_FORKS) == forks, "no os.fork() in this process (a fork server forks)"


def _worker_facts(batch):
    import sys

    import psutil

    return {
        "pid": [os.getpid()] * len(batch["x"]),
        "parent": [psutil.Process().ppid()] * len(batch["x"]),
        # Imported by the fork server before this worker existed (not by this function).
        "preloaded": [all(m in sys.modules for m in PRELOAD)] * len(batch["x"]),
        "marker": [os.environ.get("HFP_TEST_MARKER", "")] * len(batch["x"]),
    }


def _facts(tmp_path, name):
    ds = datasets.Dataset.from_dict({"x": list(range(4))})
    return ds.map(
        _worker_facts, batched=True, batch_size=1, num_proc=2,
        cache_file_name=str(tmp_path / f"{name}.arrow"),
    )  # fmt: skip


@pytest.mark.slow
def test_workers_come_preloaded_from_a_server_of_the_block(start_method, tmp_path, monkeypatch):
    """The workers are children of the block's fork server, with PRELOAD imported before
    they start; each block's server sees the environment of its time and is gone when
    the block ends (it never outlives the build)."""
    import psutil

    multiprocess.set_start_method("fork", force=True)
    me = psutil.Process()
    servers = []
    for marker in ("first", "second"):  # the caller changes its environment in between
        monkeypatch.setenv("HFP_TEST_MARKER", marker)
        with clean_workers():
            out = _facts(tmp_path, marker)
            server = {p.pid for p in me.children()} & set(out["parent"])
            assert len(server) == 1, "every worker was forked by one child of ours"
            servers.append(psutil.Process(server.pop()))
        assert set(out["pid"]).isdisjoint({me.pid}) and len(set(out["pid"])) == 2
        assert all(out["preloaded"])
        assert set(out["marker"]) == {marker}
        servers[-1].wait(timeout=30)  # raises if the server outlives its block
    assert servers[0].pid != servers[1].pid


_UNGUARDED = """
import sys
from hf_pipeline.build.prepare import prepare_cache
from hf_pipeline.config import load_config

prepare_cache(load_config(None, sys.argv[1:]), progress=False)  # no __main__ guard
print("built")
"""


@pytest.mark.slow
def test_script_without_main_guard_fails_with_one_clear_message(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED)
    args = [*SMALL_DEMO, "data.demo.samples_per_shard=10", f"build.cache_dir={tmp_path / 'c'}"]
    # Where the workers leave the message for the builder: short, as the fork server's
    # socket lives under it (AF_UNIX paths end at 107 bytes; an xdist worker's tmp_path
    # under pytest-181/popen-gw0/ was too long).
    tmp = Path(tempfile.mkdtemp(prefix="hfp-"))
    r = subprocess.run(
        [PYTHON, str(script), *args],
        env=script_env(TMPDIR=str(tmp)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0 and "built" not in r.stdout
    # One message, raised by the builder itself (its last line), not a traceback from
    # every worker and an EOFError from the builder's pool.
    message = f"importing {script}: the build's workers are started by a fork server, so the script's entry point must be under `if __name__ == \"__main__\":`"
    assert r.stderr.count(message) == 1, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith("RuntimeError: prepare_cache was called")
    assert "EOFError" not in r.stderr
    assert not list(tmp.glob("hf_pipeline-*")), "the builder removed the message it raised"
    shutil.rmtree(tmp, ignore_errors=True)
    assert not list((tmp_path / "c").glob("demo-*/filtered.json")), "nothing published"


_UNGUARDED_RANKS = """
import sys
import hf_pipeline

# README's loop without a __main__ guard (a tester's copy): every new worker of the
# build imports this script, and used to join jax.distributed again as rank 0
with hf_pipeline.jax_distributed():
    hf_pipeline.prepare_cache(hf_pipeline.load_config(None, sys.argv[1:]), progress=False)
print("built")
"""


@pytest.mark.slow
def test_two_ranks_of_a_script_without_main_guard_get_one_clear_message(tmp_path):
    """Two ranks run an unguarded script that joins jax.distributed, then builds. The
    builder's workers imported the script and joined jax.distributed as a second "rank
    0": JAX's coordinator aborted both ranks (exit 134, "unexpectedly tried to connect
    with a different incarnation") with no word of the cause. Now the worker stops
    before joining, and the ranks fail with the message that names the fix."""
    script = tmp_path / "unguarded_ranks.py"
    script.write_text(_UNGUARDED_RANKS)
    args = [*SMALL_DEMO, "data.demo.samples_per_shard=10", f"build.cache_dir={tmp_path / 'c'}",
            "build.num_proc=2", "coord.lease_timeout=5", "coord.heartbeat_interval=1"]  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="hfp-"))  # short: the fork server's socket
    runs = run_ranks(
        [script, *args], 2, timeout=300, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}",
        JAX_PLATFORMS="cpu", TMPDIR=str(tmp),
    )  # fmt: skip
    shutil.rmtree(tmp, ignore_errors=True)
    fix = 'must be under `if __name__ == "__main__":`'
    builder = [err for code, out, err in runs if fix in err]
    assert builder, [err[-2000:] for _, _, err in runs]
    for code, out, err in runs:
        assert code not in (0, -6, 134) and "built" not in out, (code, err[-3000:])
        assert "incarnation" not in err, err[-3000:]
    assert not list((tmp_path / "c").glob("demo-*/filtered.json")), "nothing published"


@pytest.mark.slow
def test_jax_distributed_first_then_five_builds_never_fork(tmp_path):
    """2 real ranks: jax.distributed + CPU backend up, then 5 fresh builds each."""
    rounds = 5
    overrides = [
        *SMALL_DEMO,
        "data.demo.samples_per_shard=20",
        "coord.max_wait=400",
        f"build.cache_dir={tmp_path / 'cache'}",
    ]
    runs = run_ranks(
        [REPO / "tests/procs/jax_rank_build.py", tmp_path / "r{rank}.json", rounds, *overrides],
        2,
        timeout=600,
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}",
        JAX_PLATFORMS="cpu",
    )
    for code, out, err in runs:
        assert code == 0, (out + err)[-3000:]
        assert "os.fork() was called" not in err
        # No trace from JAX's coordination service at the end of a good run.
        assert "WatchTasks" not in err and "CANCELLED" not in err
    results = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["forks"] == 0, "the JAX process never forked"
        assert r["fork_warnings"] == []
        assert r["client_released"] and not r["jax_joined_after"]
        assert len(r["rounds"]) == rounds
    fingerprints = [x["fingerprint"] for x in results[0]["rounds"]]
    assert len(set(fingerprints)) == rounds, "every round was a new cache"
    assert [x["fingerprint"] for x in results[1]["rounds"]] == fingerprints
    assert all(x["built"] for x in results[0]["rounds"]), "rank 0 built every round"
    assert not any(x["built"] for x in results[1]["rounds"])
    assert [x["rows_out"] for x in results[1]["rounds"]] == [
        x["rows_out"] for x in results[0]["rounds"]
    ]


def test_quick_gil_handoff_nests_keeps_a_smaller_interval_and_restores():
    """The build's stages run with a switch interval of at most 1 ms (a thread coming back
    from C code waits less for a Python-busy one); nested and concurrent blocks restore
    the caller's interval once, when the last ends; a caller's smaller one is kept."""
    import sys

    from hf_pipeline.workers.pool import GIL_SWITCH_INTERVAL, quick_gil_handoff

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        entered, release = threading.Barrier(2), threading.Event()

        def other():
            with quick_gil_handoff():
                entered.wait()
                release.wait()

        t = threading.Thread(target=other)
        t.start()
        with quick_gil_handoff():
            entered.wait()
            assert sys.getswitchinterval() == GIL_SWITCH_INTERVAL
            with quick_gil_handoff():
                assert sys.getswitchinterval() == GIL_SWITCH_INTERVAL
        # The other block is still open: not restored yet.
        assert sys.getswitchinterval() == GIL_SWITCH_INTERVAL
        release.set()
        t.join()
        assert sys.getswitchinterval() == 0.005
        sys.setswitchinterval(0.0002)
        smaller = sys.getswitchinterval()  # as the interpreter rounds it
        with quick_gil_handoff():
            assert sys.getswitchinterval() == smaller
        assert sys.getswitchinterval() == smaller
    finally:
        sys.setswitchinterval(before)


@pytest.mark.slow
def test_a_build_read_from_standard_input_explains_why_its_workers_cannot_start(tmp_path):
    """``python - <<EOF`` with num_proc > 1: the join's workers would import '<stdin>'
    (no file) and die; the build says so once, exits non-zero, publishes nothing."""
    code = _UNGUARDED.replace(
        "sys.argv[1:]", repr([*SMALL_DEMO, f"build.cache_dir={tmp_path / 'c'}"])
    )
    r = subprocess.run(
        [PYTHON, "-"], input=code, env=script_env(), cwd=tmp_path,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode != 0 and "built" not in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("hf_pipeline.errors.ConfigError: build.num_proc is 2: "), r.stderr[
        -3000:
    ]
    assert "'<stdin>' is not a file" in last and "DATASET_NUM_PROC=1" in last
    assert "EOFError" not in r.stderr and "FileNotFoundError" not in r.stderr
    assert not list((tmp_path / "c").glob("demo-*/converted.json")), "nothing published"


def _niceness(batch):
    return {"nice": [os.getpriority(os.PRIO_PROCESS, 0)] * len(batch["x"])}


@pytest.mark.slow
def test_workers_run_below_the_builder(start_method, tmp_path):
    """The join's workers yield the CPU to the builder's own threads (issue 28): each
    runs ``WORKER_NICENESS`` steps nicer than the builder, whose niceness is left as it
    was; the fork server itself (which imports what the first shard waits for) is not
    lowered. On the code before, the workers ran at the builder's priority, and on a
    16-CPU host the encoder's loading thread, beside 16 busy workers, took 7.5-9 s for
    a tokenizer that loads in about 1 CPU-second."""
    import psutil

    from hf_pipeline.workers.pool import WORKER_NICENESS

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    expected = min(19, mine + WORKER_NICENESS)
    me = psutil.Process()
    with clean_workers():
        ds = datasets.Dataset.from_dict({"x": list(range(4))})
        out = ds.map(
            _niceness, batched=True, batch_size=1, num_proc=2,
            cache_file_name=str(tmp_path / "nice.arrow"),
        )  # fmt: skip
        # Our children: the fork server (its workers and manager are its children).
        server_nice = {os.getpriority(os.PRIO_PROCESS, p.pid) for p in me.children()}
    assert set(out["nice"]) == {expected}, (out["nice"], mine)
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine
    assert server_nice == {mine}, server_nice
