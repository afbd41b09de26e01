"""LatentDataModule under the real Lightning Trainer (CPU): every epoch its own order,
and a checkpoint resumes at exactly the next batch."""

from __future__ import annotations

import pickle
import sys

import pytest
import torch

from hf_pipeline.adapters.torch_data import TorchBatches, torch_loader

# Lightning is imported by the fixtures below, not at module level: importing it takes
# seconds (5.6 s after torch on the development VM), and every pytest-xdist worker
# collects every module, so a module-level import is paid by each worker, even when
# these tests are deselected (`-m "not slow"`) or run on another worker.
# hf_pipeline's LatentDataModule is made on first use for the same reason.


@pytest.fixture(scope="module")
def L():  # noqa: N802 - the name Lightning's docs give the package
    """The ``lightning`` package (the test is skipped without it)."""
    return pytest.importorskip("lightning")


@pytest.fixture(scope="module")
def LatentDataModule(L):  # noqa: N802 - the class it returns
    from hf_pipeline.adapters.torch_data import LatentDataModule

    return LatentDataModule


@pytest.fixture(scope="module")
def KeyRecorder(L):  # noqa: N802 - the class it returns
    """A tiny regression from caption embedding to mean latent; records every batch."""

    class KeyRecorder(L.LightningModule):
        def __init__(self, embed_dim: int):
            super().__init__()
            self.lin = torch.nn.Linear(embed_dim, 1)
            self.seen: list[tuple[int, int, list[int]]] = []

        def training_step(self, batch, batch_idx):
            self.seen.append((self.current_epoch, batch_idx, batch["keys"].tolist()))
            target = batch["latents"].float().mean(dim=(1, 2, 3))
            return torch.nn.functional.mse_loss(self.lin(batch["embeddings"]).squeeze(-1), target)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return KeyRecorder


def _ctx() -> str | None:
    # Forking a process that runs JAX threads may deadlock the child (tests/test_torch_data).
    return "forkserver" if "jax" in sys.modules else None


def _trainer(L, root, max_steps: int, callbacks=()):
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        default_root_dir=str(root),
    )


def _datamodule(LatentDataModule, cfg, num_workers: int):
    kw = {"multiprocessing_context": _ctx(), "timeout": 120} if num_workers else {}
    return LatentDataModule(cfg, num_workers=num_workers, **kw)


def _epoch_keys(source, cfg, epoch: int) -> list[list[int]]:
    ref = TorchBatches(
        source,
        global_batch_size=cfg.loader.global_batch_size,
        seed=cfg.loader.seed,
        process_index=0,
        process_count=1,
        epoch=epoch,
    )
    return [b["keys"].tolist() for b in ref]


def test_is_a_real_lightning_datamodule(L, LatentDataModule, small_config):
    dm = LatentDataModule(small_config, num_workers=0)
    assert isinstance(dm, L.LightningDataModule)
    assert callable(dm.on_exception)  # the AttributeError of issue 11
    assert LatentDataModule.__module__ == "hf_pipeline.adapters.torch_data"
    assert LatentDataModule.__qualname__ == "LatentDataModule"
    assert dm.state_dict() == {}  # nothing to save before setup
    # Picklable by name (spawned strategies send the DataModule to new processes).
    clone = pickle.loads(pickle.dumps(dm))
    assert type(clone) is LatentDataModule and clone.cfg == small_config


@pytest.mark.parametrize(
    "num_workers", [0, pytest.param(2, marks=pytest.mark.slow)], ids=["inline", "workers"]
)
def test_fit_orders_each_epoch_and_resumes_at_the_next_batch(
    L, LatentDataModule, KeyRecorder, small_config, built_cache, tmp_path, num_workers
):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from hf_pipeline.cache.layout import open_sample_source

    with open_sample_source(built_cache.layout, built_cache.fingerprint) as source:
        spe = source.num_rows // small_config.loader.global_batch_size
        epochs = [_epoch_keys(source, small_config, e) for e in range(3)]
        dim = source.embed_dim
    assert spe >= 8 and epochs[0] != epochs[1]
    every = spe // 2  # checkpoints mid-epoch and at every epoch boundary
    total = 2 * spe + every + 1
    ckpt_dir = tmp_path / "ckpt"
    model = KeyRecorder(dim)
    saver = ModelCheckpoint(
        dirpath=ckpt_dir, every_n_train_steps=every, save_top_k=-1, filename="{step}"
    )
    dm = _datamodule(LatentDataModule, small_config, num_workers)
    _trainer(L, tmp_path, total, [saver]).fit(model, datamodule=dm)
    full = model.seen
    assert len(full) == total
    # Lightning reached set_epoch: each epoch is that epoch's order, batch for batch.
    for e in range(3):
        got = [keys for epoch, _, keys in full if epoch == e]
        assert got == epochs[e][: len(got)], f"epoch {e}"
    assert [i for e, i, _ in full if e == 1] == list(range(spe))

    for step in (every, spe, spe + every):  # mid-epoch 0, epoch boundary, mid-epoch 1
        ckpt = ckpt_dir / f"step={step}.ckpt"
        saved = torch.load(ckpt, map_location="cpu", weights_only=True)
        state = saved["LatentDataModule"]
        assert (state["epoch"], state["step"]) == divmod(step, spe)
        assert state["fingerprint"] == built_cache.fingerprint
        resumed = KeyRecorder(dim)
        _trainer(L, tmp_path / f"resume{step}", total).fit(
            resumed,
            datamodule=_datamodule(LatentDataModule, small_config, num_workers),
            ckpt_path=ckpt,
        )
        assert resumed.seen == full[step:], f"resumed from step {step}"


def test_plain_dataloader_under_trainer_gets_each_epoch(
    L, KeyRecorder, built_cache, small_config, tmp_path
):
    """torch_loader's DataLoader too: Lightning's set_epoch reaches TorchBatches."""
    from hf_pipeline.cache.layout import open_sample_source

    with open_sample_source(built_cache.layout, built_cache.fingerprint) as source:
        ds = TorchBatches(source, global_batch_size=16, seed=0, process_index=0, process_count=1)
        spe = len(ds)
        model = KeyRecorder(source.embed_dim)
        _trainer(L, tmp_path, 2 * spe).fit(model, train_dataloaders=torch_loader(ds, num_workers=0))
        for e in range(2):
            assert [k for epoch, _, k in model.seen if epoch == e] == _epoch_keys(
                source, small_config, e
            )


@pytest.mark.slow
@pytest.mark.parametrize("when", ["pre", "fit"], ids=["setup_before_fit", "setup_in_fit"])
def test_ddp_ranks_split_every_global_batch(L, small_config, built_cache, tmp_path, when):
    """Real Lightning DDP, 2 CPU ranks (gloo). With README's `dm.setup("fit")` before
    `Trainer.fit` both ranks got the whole global batch (the share was frozen as rank 0
    of 1 then); now every sample of every global batch is seen exactly once across the
    ranks, with or without the pre-setup, and no rank warns about its variables."""
    import json
    import subprocess

    from hf_pipeline.cache.layout import open_sample_source
    from tests.conftest import PYTHON, REPO, SMALL_DEMO, script_env

    with open_sample_source(built_cache.layout, built_cache.fingerprint) as source:
        want = _epoch_keys(source, small_config, 0)
        dim = source.embed_dim
    overrides = [*SMALL_DEMO, f"build.cache_dir={small_config.cache_root}"]
    script = REPO / "tests" / "procs" / "lightning_ddp.py"
    run = subprocess.run(
        [PYTHON, str(script), str(tmp_path), when, str(dim), *overrides],
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["world"] for s in seen] == [2, 2]
    assert len(seen[0]["seen"]) == len(seen[1]["seen"]) == len(want) > 10
    for step, batch in enumerate(want):
        a, b = seen[0]["seen"][step], seen[1]["seen"][step]
        assert len(a) == len(b) == len(batch) // 2, f"step {step}"
        assert not set(a) & set(b), f"step {step}: both ranks got {sorted(set(a) & set(b))}"
        assert sorted(a + b) == sorted(batch), f"step {step}"
    assert "is set but" not in run.stderr, run.stderr[-3000:]
    assert "rank 0 of 1" not in run.stderr
