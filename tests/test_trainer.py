"""The demo trainer: loss falls, and a checkpointed run resumes exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hf_pipeline.cache import open_sample_source


@pytest.fixture()
def source(built_cache):
    src = open_sample_source(built_cache.layout, built_cache.fingerprint)
    yield src
    src.close()


def _cfg(small_config, **train):
    return dataclasses.replace(small_config, train=dataclasses.replace(small_config.train, **train))


def test_loss_falls_and_stats_are_reported(small_config, source):
    from hf_pipeline.trainer import train

    logs = []
    out = train(_cfg(small_config, steps=80, log_every=20), source, on_log=logs.append)
    assert out.steps == 80 and len(logs) == 4
    assert out.last_loss < 0.8 * out.first_loss
    assert 0.0 <= out.data_wait_share < 1.0 and out.samples_per_s > 0
    assert {"step", "loss", "samples_per_s", "data_wait", "epoch"} <= set(logs[0])


def test_checkpoint_resume_continues_the_same_run(small_config, source, tmp_path):
    from hf_pipeline.trainer import train

    straight = train(_cfg(small_config, steps=40, log_every=10), source)
    ckpt = tmp_path / "ckpt"
    cfg = _cfg(small_config, steps=40, log_every=10, checkpoint=str(ckpt))
    first = train(cfg, source, max_steps=20)  # "preempted" after 20 of 40 steps
    assert (ckpt / "state.npz").is_file() and first.steps == 20
    second = train(cfg, source)
    assert second.steps == 20
    # Same batches, same keys, same parameters: the resumed run's losses are the
    # uninterrupted run's second half.
    resumed = [h["loss"] for h in first.history + second.history]
    expected = [h["loss"] for h in straight.history]
    np.testing.assert_allclose(resumed, expected, rtol=1e-4)
    assert second.loader_state == straight.loader_state


def test_trains_on_a_bfloat16_cache(tmp_path):
    """bf16 demo shards are stored as bf16 (default) and the model reads them as float32."""
    import ml_dtypes

    from hf_pipeline.build import prepare_cache
    from hf_pipeline.config import load_config
    from hf_pipeline.trainer import train
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
    from hf_pipeline.trainer import jax_distributed, shutdown_jax_distributed

    process = detect(environ={})
    with jax_distributed(process, environ={"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"}) as joined:
        assert joined is False
    assert not jax.distributed.is_initialized()
    shutdown_jax_distributed()  # nothing joined: returns without waiting
