"""The demo trainer: loss falls, and a checkpointed run resumes exactly."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from hf_pipeline.cache.layout import open_sample_source
from tests.conftest import PYTHON, REPO, SMALL_DEMO, script_env


@pytest.fixture()
def source(built_cache):
    src = open_sample_source(built_cache.layout, built_cache.fingerprint)
    yield src
    src.close()


def _cfg(small_config, **train):
    return dataclasses.replace(small_config, train=dataclasses.replace(small_config.train, **train))


@pytest.mark.slow
def test_loss_falls_and_stats_are_reported(small_config, source):
    from hf_pipeline.trainer.loop import train

    logs = []
    out = train(_cfg(small_config, steps=80, log_every=20), source, on_log=logs.append)
    assert out.steps == 80 and len(logs) == 4
    assert out.last_loss < 0.8 * out.first_loss
    assert 0.0 <= out.data_wait_share < 1.0 and out.samples_per_s > 0
    assert {"step", "loss", "samples_per_s", "data_wait", "epoch"} <= set(logs[0])


@pytest.mark.slow
def test_checkpoint_resume_continues_the_same_run(small_config, source, tmp_path):
    from hf_pipeline.trainer.loop import train

    straight = train(_cfg(small_config, steps=40, log_every=10), source)
    ckpt = tmp_path / "ckpt"
    cfg = _cfg(small_config, steps=40, log_every=10, checkpoint=str(ckpt))
    first = train(cfg, source, max_steps=20)  # "preempted" after 20 of 40 steps
    assert (ckpt / "20" / "meta").is_dir() and first.steps == 20
    second = train(cfg, source)
    assert second.steps == 20
    # Same batches, same keys, same parameters: the resumed run's losses are the
    # uninterrupted run's second half.
    resumed = [h["loss"] for h in first.history + second.history]
    expected = [h["loss"] for h in straight.history]
    np.testing.assert_allclose(resumed, expected, rtol=1e-4)
    assert second.loader_state == straight.loader_state


@pytest.mark.slow
def test_trains_on_a_bfloat16_cache(tmp_path):
    """bf16 demo shards are stored as bf16 (default) and the model reads them as float32."""
    import ml_dtypes

    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config
    from hf_pipeline.trainer.loop import train
    from tests.conftest import SMALL_DEMO

    cfg = load_config(
        None,
        [
            *SMALL_DEMO,
            "data.demo.num_shards=2",
            "data.demo.latent_dtype=bfloat16",
            "build.num_proc=1",
            f"build.cache_dir={tmp_path}",
            "train.steps=40",
            "train.log_every=10",
        ],
        environ={},
    )
    built = prepare_cache(cfg, progress=False)
    assert built.report["precision"]["storage_dtype"] == "bfloat16"
    with open_sample_source(built.layout, built.fingerprint) as src:
        assert src.latent_dtype == np.dtype(ml_dtypes.bfloat16)
        out = train(cfg, src)
    losses = [h["loss"] for h in out.history]
    assert out.steps == 40 and all(np.isfinite(losses))
    assert out.last_loss < out.first_loss


def test_jax_distributed_is_a_no_op_for_one_process():
    import jax

    from dist.env import detect
    from hf_pipeline.trainer.loop import jax_distributed, shutdown_jax_distributed

    process = detect(environ={})
    with jax_distributed(process, environ={"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"}) as joined:
        assert joined is False
    assert not jax.distributed.is_initialized()
    shutdown_jax_distributed()  # nothing joined: returns without waiting


def test_jax_distributed_detects_the_process_when_given_none():
    """``hf_pipeline.jax_distributed()`` (public, for users' scripts) reads the rank from
    the launcher's environment, as ``prepare_cache`` does."""
    from dist.env import EnvironmentConflictError
    from hf_pipeline import jax_distributed

    with jax_distributed(environ={}) as joined:
        assert joined is False
    torchrun = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    with pytest.raises(EnvironmentConflictError, match="2 processes"):
        with jax_distributed(environ=torchrun):
            pass


def _steps(ckpt):
    """The complete checkpoints in ``ckpt`` (Orbax's step folders), oldest first."""
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_checkpoints_every_n_steps_keep_the_newest_and_skip_half_written_ones(
    small_config, source, tmp_path
):
    from hf_pipeline.trainer.loop import train

    ckpt = tmp_path / "ckpt"
    cfg = _cfg(
        small_config, steps=40, log_every=5, checkpoint=str(ckpt), checkpoint_every=10,
        keep_checkpoints=2,
    )  # fmt: skip
    first = train(cfg, source, max_steps=25)
    assert _steps(ckpt) == [20, 25]  # 10 removed; 25: the end of this call
    meta = json.loads((ckpt / "25" / "meta" / "metadata").read_text())
    assert meta["step"] == 25 and meta["loader"] == first.loader_state  # through Orbax
    # A save cut short leaves Orbax's temporary folder: never a checkpoint to resume.
    shutil.copytree(ckpt / "25", ckpt / "30.orbax-checkpoint-tmp-1700000000")
    for f in (ckpt / "30.orbax-checkpoint-tmp-1700000000" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"")
    second = train(cfg, source)
    assert second.steps == 15
    straight = train(_cfg(small_config, steps=40, log_every=5), source)
    np.testing.assert_allclose(
        [h["loss"] for h in first.history + second.history],
        [h["loss"] for h in straight.history],
        rtol=1e-6,
    )
    assert _steps(ckpt) == [30, 40]


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_one_line(small_config, source, tmp_path):
    from hf_pipeline.errors import ConfigError
    from hf_pipeline.trainer.loop import train

    ckpt = tmp_path / "ckpt"
    train(_cfg(small_config, steps=10, checkpoint=str(ckpt)), source, max_steps=5)
    with pytest.raises(ConfigError, match=r"does not fit this model") as ei:
        train(_cfg(small_config, steps=10, checkpoint=str(ckpt), hidden=32), source)
    assert ei.value.field == "train.checkpoint" and "\n" not in str(ei.value)


def _wait_for(predicate, timeout, proc):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, "the run ended before the awaited checkpoint"
        assert time.monotonic() < deadline, "timed out waiting for a checkpoint"
        time.sleep(0.02)


def _restore(ckpt, step):
    """(params leaves, meta) of a checkpoint, read back through Orbax."""
    import jax
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(
        ckpt.absolute(), options=ocp.CheckpointManagerOptions(read_only=True),
        item_names=("state", "meta"),
    ) as mngr:  # fmt: skip
        got = mngr.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()),
        )
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(got["state"])], got["meta"]


@pytest.mark.slow
def test_sigkilled_run_resumes_to_the_uninterrupted_result(
    session_cache_root, built_cache, tmp_path
):
    """train.py killed (SIGKILL) after its step-10 checkpoint, then run again: from step
    10 on it sees the uninterrupted run's batches (loader state at every checkpoint) and
    ends with its parameters, bit for bit."""
    steps, every = 60, 10

    def start(ckpt):
        return subprocess.Popen(
            [PYTHON, str(REPO / "scripts" / "train.py"), "--cache-dir", str(session_cache_root),
             *[a for o in SMALL_DEMO for a in ("--set", o)], "--steps", str(steps),
             "--checkpoint", str(ckpt), "--checkpoint-every", str(every),
             "--set", "train.keep_checkpoints=100", "--set", "train.log_every=5", "-q"],
            env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=REPO,
        )  # fmt: skip

    killed, straight = tmp_path / "killed", tmp_path / "straight"
    proc = start(killed)
    try:
        _wait_for(lambda: killed.is_dir() and 10 in _steps(killed), 600, proc)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert steps not in _steps(killed)  # killed mid-run
    resumed_from = max(_steps(killed))
    runs = {}
    for name, ckpt in (("resumed", killed), ("straight", straight)):
        proc = start(ckpt)
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        runs[name] = [ln for ln in out.splitlines() if ln.startswith("step")]
    # Every checkpoint the resumed run wrote equals the uninterrupted run's: the same
    # loader position (so the same batches in between) and the same parameters.
    after = [s for s in _steps(killed) if s > resumed_from]
    assert after and after[-1] == steps and set(after) <= set(_steps(straight))
    for step in after:
        (p_resumed, m_resumed), (p_straight, m_straight) = (
            _restore(killed, step),
            _restore(straight, step),
        )
        assert m_resumed == m_straight
        for a, b in zip(p_resumed, p_straight, strict=True):
            np.testing.assert_array_equal(a, b)
    # The losses it logged are the uninterrupted run's, step for step.
    tail = [ln.split()[:6] for ln in runs["resumed"]]  # step N epoch E loss L
    assert tail == [ln.split()[:6] for ln in runs["straight"]][-len(tail) :]


def test_the_summary_line_says_whether_the_loss_fell_or_rose():
    """A resumed run's loss can rise: its summary said "(-2% lower)" (outside tester)."""
    from hf_pipeline.commands.train import loss_change

    assert loss_change(0.5, 0.4) == "20% lower"
    assert loss_change(0.43, 0.44) == "2% higher"
    assert loss_change(0.44, 0.44) == "unchanged"
    assert loss_change(0.0, 0.1) == "from 0"
    assert loss_change(float("nan"), float("nan")) == "not a number"
