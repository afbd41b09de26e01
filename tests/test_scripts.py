"""scripts/: --help, JSON summary, exit codes and one-line errors, a short training run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, SMALL_DEMO, run_ranks, script_env
from tests.helpers.ports import free_port


def _run(script, *args, env=None, timeout=600):
    return subprocess.run(
        [PYTHON, str(REPO / "scripts" / script), *args],
        env=env or script_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def _sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


@pytest.mark.parametrize("script", ["train.py", "prebuild_cache.py"])
def test_help(script):
    p = _run(script, "--help")
    assert p.returncode == 0
    for word in ("--config", "--set", "DATASET_NUM_PROC", "DATASET_WRITER_BATCH_SIZE", "HF_HOME"):
        assert word in p.stdout


def test_prebuild_json_then_found(tmp_path, session_cache_root, built_cache):
    out = tmp_path / "build.json"
    p = _run(
        "prebuild_cache.py",
        "--cache-dir",
        str(session_cache_root),
        *_sets(SMALL_DEMO),
        "--json",
        str(out),
        "-q",
    )
    assert p.returncode == 0, p.stderr
    s = json.loads(out.read_text())
    assert set(s) >= {"fingerprint", "cache_dir", "rows_in", "rows_out", "dropped", "seconds"}
    assert s["fingerprint"] == built_cache.fingerprint and s["built"] is False
    assert "found" in p.stdout and str(s["rows_out"]) in p.stdout
    # The demo repeats one metadata row: counted, outside the latent-row accounting.
    assert s["duplicate_meta_rows"] == built_cache.report["duplicate_meta_rows"] >= 1
    line = f"metadata    {s['duplicate_meta_rows']} rows repeating an earlier key ignored"
    assert line in p.stdout
    # Which parquet the captions came from: in the JSON, one line, and the report.
    assert s["metadata"].endswith("-meta.parquet") and Path(s["metadata"]).is_file(), s
    assert f"meta file   {s['metadata']}\n" in p.stdout
    # The report names the file its build read: under xdist the session cache was built
    # once from another worker's copy of the demo data (conftest), so the same file name.
    assert Path(built_cache.report["metadata"]).name == Path(s["metadata"]).name


def test_prebuild_json_path_that_cannot_be_written_fails_before_the_build(tmp_path):
    """Found only after the whole build before (exit 1, the OS's words)."""
    cache = tmp_path / "c"
    for path, why in (
        (tmp_path / "nodir" / "x.json", "does not exist"),
        (tmp_path, "is a directory"),
    ):
        p = _run("prebuild_cache.py", "--cache-dir", str(cache), *_sets(SMALL_DEMO),
                 "--json", str(path), "-q")  # fmt: skip
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip() == f"error: --json {path}: " + (
            f"its folder {path.parent} does not exist" if why == "does not exist" else why
        )
        assert not list(cache.glob("demo-*"))  # nothing was built


@pytest.mark.slow
def test_a_raw_pickle_shard_is_one_error_line_and_runs_nothing(tmp_path):
    """A raw pickle (not torch.save's zip) in the shard folder: refused, exit 2, and
    the error is the only line (torch warned "Detected pickle protocol 4" first)."""
    import pickle

    from tests.helpers.pickles import RunsCode
    from tests.servers import make_shards

    data = make_shards(tmp_path / "data", n_shards=2, per_shard=6)
    marker = tmp_path / "pwned"
    with open(data / "000000-000005.pt", "wb") as fh:
        pickle.dump(RunsCode(str(marker)), fh, protocol=4)
    p = _run("prebuild_cache.py", "--cache-dir", str(tmp_path / "c"), *_sets(SMALL_DEMO),
             "--set", f"data.shards={data}", "-q")  # fmt: skip
    assert p.returncode == 2, p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith(f"error: {data / '000000-000005.pt'}: not a plain tensor file"), line
    assert not marker.exists()


@pytest.mark.slow
def test_prebuild_status_verify_clean(session_cache_root, built_cache):
    p = _run("prebuild_cache.py", "--cache-dir", str(session_cache_root), "--status")
    assert p.returncode == 0, p.stderr
    assert built_cache.cache_dir.name in p.stdout and "complete" in p.stdout
    p = _run("prebuild_cache.py", "--cache-dir", str(session_cache_root), "--verify")
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"{built_cache.cache_dir.name}: ok" in p.stdout
    p = _run("prebuild_cache.py", "--cache-dir", str(session_cache_root), "--clean", "--dry-run")
    assert p.returncode == 0 and built_cache.cache_dir.name not in p.stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (
            ["--set", "build.num_proc=-2"],
            "build.num_proc must be in [0, 4096] (0: min(8, CPUs)), got -2",
        ),
        (["--set", "loader.crop=9"], "loader.crop"),
        (["--config", "configs/nope.yaml"], "does not exist"),
        (["--set", "data.shards=/nonexistent/folder"], "/nonexistent/folder"),
        # Offline by choice and never listed online: fixable input, not an outage.
        (["--config", "configs/coyo11m.yaml"], "hf://datasets/KBlueLeaf"),
    ],
)
def test_user_errors_are_one_line_exit_2(tmp_path, args, fragment):
    env = script_env(HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    p = _run("prebuild_cache.py", "-q", *args, env=env, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and fragment in errors[0], p.stderr
    assert not list(tmp_path.rglob("*.json")), "nothing may be published"


def _closed_port_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed on return: refused


@pytest.mark.parametrize(
    "env, fragment",
    [
        pytest.param(
            {"RANK": "3", "WORLD_SIZE": "3"},
            "RANK=3 and WORLD_SIZE=3 (torchrun) do not make a process",
            marks=pytest.mark.slow,
        ),
        ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc' is not an integer"),
        pytest.param(
            {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
            "contradictory rank",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_launcher_environment_that_makes_no_process_is_one_line_exit_2(tmp_path, env, fragment):
    """Was a traceback with exit 1 (README: bad usage or config is one line, exit 2)."""
    for script in ("prebuild_cache.py", "train.py"):
        p = _run(script, "-q", "--cache-dir", str(tmp_path), *_sets(SMALL_DEMO),
                 env=script_env(HF_HOME=str(tmp_path), **env))  # fmt: skip
        assert p.returncode == 2, p.stderr
        (line,) = p.stderr.strip().splitlines()
        assert line.startswith("error: ") and fragment in line, line


@pytest.mark.parametrize(
    "args, env, fragment",
    [
        # No network here: storage.googleapis.com does not resolve.
        (
            [
                "--config",
                "configs/coyo11m_gcs.yaml",
                "--set",
                "data.max_retries=0",
                "--set",
                "data.file_timeout=3",
            ],
            {},
            "gs://my-coyo-bucket",
        ),
        # The Hub is down while the encoder's revision is resolved.
        (
            [*_sets(SMALL_DEMO), "--set", "encoder.model=test-org/tiny-encoder"],
            {"HF_ENDPOINT": "closed", "HF_HUB_OFFLINE": "0"},
            "test-org/tiny-encoder@main",
        ),
    ],
)
@pytest.mark.slow
def test_unreachable_store_is_one_line_exit_1(tmp_path, args, env, fragment):
    # Before: exit 2, which README reserves for bad input; the store failed, not the user.
    env = {k: _closed_port_url() if v == "closed" else v for k, v in env.items()}
    env = script_env(HF_HOME=str(tmp_path), **{"HF_HUB_OFFLINE": "1", **env})
    p = _run("prebuild_cache.py", "-q", *args, env=env, timeout=300)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and fragment in errors[0] and "attempt(s)" in errors[0], p.stderr
    assert not list(tmp_path.rglob("converted.json"))


@pytest.mark.slow
def test_bad_row_under_on_bad_rows_fail_is_one_line_exit_2(tmp_path):
    from tests.servers import shards_with_nonfinite_rows

    data, _ = shards_with_nonfinite_rows(tmp_path / "data")
    cache = tmp_path / "cache"
    p = _run(
        "prebuild_cache.py",
        "-q",
        *_sets(SMALL_DEMO),
        "--set",
        f"data.shards={data}",
        "--set",
        "data.on_bad_rows=fail",
        "--cache-dir",
        str(cache),
        env=script_env(HF_HOME=str(tmp_path / "home")),
    )
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, p.stderr
    assert "000006-000011.pt" in errors[0] and "first keys: 8)" in errors[0]
    assert not list(cache.rglob("converted.json")) and not list(cache.rglob("filtered"))


@pytest.mark.slow
def test_every_rank_exits_2_when_the_builder_fails_on_the_input(tmp_path):
    """The waiting ranks got the builder's error but exit 1 (a fault's code) where the
    builder exited 2 (the input's): a job's exit code depended on which rank it read."""
    from tests.servers import shards_with_nonfinite_rows

    data, _ = shards_with_nonfinite_rows(tmp_path / "data")
    args = ["-q", *_sets(SMALL_DEMO), "--set", f"data.shards={data}",
            "--set", "data.on_bad_rows=fail", "--cache-dir", str(tmp_path / "cache")]  # fmt: skip
    results = run_ranks([REPO / "scripts/prebuild_cache.py", *args], 3)
    for code, _out, err in results:
        assert code == 2, err[-2000:]
        (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
        assert "000006-000011.pt" in line and "first keys: 8" in line, line


def test_env_overrides_reach_the_build(tmp_path):
    env = script_env(HF_HOME=str(tmp_path), DATASET_BATCH_SIZE="0")
    p = _run("prebuild_cache.py", "-q", env=env)
    assert p.returncode == 2 and "DATASET_BATCH_SIZE" in p.stderr


@pytest.mark.slow
def test_train_short_run_loss_falls(session_cache_root, built_cache):
    p = _run(
        "train.py",
        "--cache-dir",
        str(session_cache_root),
        *_sets(SMALL_DEMO),
        "--steps",
        "60",
        "--set",
        "train.log_every=20",
        "-q",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("step")]
    assert len(lines) == 3 and "samples/s" in lines[0] and "data wait" in lines[0]
    losses = [float(ln.split("loss")[1].split()[0]) for ln in lines]
    assert losses[-1] < losses[0] * 0.8, losses
    assert "done: 60 steps" in p.stdout


@pytest.mark.slow
def test_train_batch_larger_than_data_is_one_line_exit_2(session_cache_root, built_cache):
    rows = built_cache.report["rows_out"]
    big = rows + 1
    p = _run(
        "train.py",
        "--cache-dir",
        str(session_cache_root),
        *_sets(SMALL_DEMO),
        "--batch-size",
        str(big),
        "--steps",
        "5",
        "-q",
    )
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, p.stderr
    assert f"loader.global_batch_size ({big})" in errors[0]
    assert f"{rows} rows" in errors[0]


@pytest.mark.slow
def test_train_two_processes_jax_distributed(session_cache_root, built_cache):
    """torchrun-style env + JAX_COORDINATOR_ADDRESS: one global batch sharded over 2 hosts."""
    port = free_port()
    args = [
        "--cache-dir",
        str(session_cache_root),
        *_sets(SMALL_DEMO),
        "--steps",
        "20",
        "--set",
        "train.log_every=10",
        "-q",
    ]
    # The debug flag makes jax.extend.backend.clear_backends() raise if a JAX array
    # (and so its backend client) survives train.py's run: on a GPU such a client
    # logs "WatchTasksAsync failed ... CANCELLED" when jax.distributed shuts down.
    results = run_ranks(
        [REPO / "scripts/train.py", *args],
        2,
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_DEBUG_LEAKED_CLIENTS_ON_CLEAR_BACKENDS="1",
    )
    for code, _out, err in results:
        assert code == 0, err[-3000:]
        # JAX is joined before the build and left in order (hf_pipeline.trainer.loop): no
        # fork warning, no coordination-service trace at the end of a good run.
        assert "os.fork() was called" not in err
        assert "WatchTasks" not in err and "CANCELLED" not in err
    outs = [(out, err) for _code, out, err in results]
    assert "done: 20 steps" in outs[0][0] and "cache found" in outs[0][0]
    assert "done:" not in outs[1][0]  # only rank 0 prints


@pytest.mark.slow
def test_train_rerun_of_a_finished_run_and_a_run_shorter_than_a_log_window(
    session_cache_root, built_cache, tmp_path
):
    """A run shorter than train.log_every reports its first and last step's loss (it
    used to report one log entry twice: "loss X -> X (0% lower)"); rerunning the finished
    checkpointed run says there is nothing to train, exit 0 (it used to print
    "done: 0 steps, loss nan -> nan (nan% lower)")."""
    args = ["train.py", "--cache-dir", str(session_cache_root), *_sets(SMALL_DEMO),
            "--steps", "4", "--checkpoint", str(tmp_path / "ckpt"), "-q"]  # fmt: skip
    p = _run(*args)
    assert p.returncode == 0, p.stderr[-3000:]
    (done,) = [ln for ln in p.stdout.splitlines() if ln.startswith("done: 4 steps")]
    first, last = done.split("loss ")[1].split(" (")[0].split(" -> ")
    assert float(first) != float(last), done
    again = _run(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already at step 4 of 4: nothing to train" in again.stdout, again.stdout
    assert "nan" not in again.stdout and "done:" not in again.stdout, again.stdout


@pytest.mark.slow
def test_train_resumed_with_other_steps_is_one_line_exit_2(
    session_cache_root, built_cache, tmp_path
):
    """A finished 10-step run re-run with ``--steps 15`` trained 5 more steps in silence,
    under a learning-rate schedule that spans ``train.steps``: the cosine of a 15-step
    run from step 10, not what either run would do. Now: one line naming both values,
    exit 2, nothing trained; the same value resumes (here: nothing left to do)."""
    ckpt = tmp_path / "ckpt"
    common = ["--cache-dir", str(session_cache_root), *_sets(SMALL_DEMO), "-q"]
    first = _run("train.py", *common, "--steps", "10", "--checkpoint", str(ckpt))
    assert first.returncode == 0, first.stderr[-3000:]
    again = _run("train.py", *common, "--steps", "15", "--checkpoint", str(ckpt))
    assert again.returncode == 2, (again.stdout + again.stderr)[-3000:]
    assert "Traceback" not in again.stderr
    errors = [line for line in again.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, again.stderr
    assert "train.steps" in errors[0] and "10" in errors[0] and "15" in errors[0], errors
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["10"]
    same = _run("train.py", *common, "--steps", "10", "--checkpoint", str(ckpt))
    assert same.returncode == 0, same.stderr[-3000:]
