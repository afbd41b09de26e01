"""torch_data: DataLoader workers split this rank's batches without duplicates."""

from __future__ import annotations

import pickle
import sys
import warnings

import numpy as np
import pytest
import torch

from hf_pipeline.mapped import SampleSource
from hf_pipeline.torch_data import TorchBatches, torch_loader
from tests.test_mapped import build_cache


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    files = build_cache(tmp_path_factory.mktemp("torch_cache"), 200, embed_dim=8)
    src = SampleSource(*files, fingerprint="fp")
    yield src
    src.close()


def _ctx():
    """Fork workers (inheriting the maps) unless JAX's threads live in this process.

    Forking a process that runs JAX threads may deadlock the child; forkserver starts
    workers from a clean process (they reopen the maps from the pickled source).
    """
    return "forkserver" if "jax" in sys.modules else None


def _expected(ds: TorchBatches, step: int):
    pb = ds.sampler.batch_at(ds.epoch, step, ds._local)
    return ds.source.gather(pb.rows, pb.crops)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_workers_disjoint_in_order(source, num_workers):
    ds = TorchBatches(
        source, global_batch_size=16, seed=3, process_index=1, process_count=2, epoch=1
    )
    assert len(ds) == source.num_rows // 16
    dl = torch_loader(
        ds,
        num_workers=num_workers,
        pin_memory=True,
        timeout=60 if num_workers else 0,
        multiprocessing_context=_ctx() if num_workers else None,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "pin_memory set but no accelerator" on CPU
        batches = list(dl)
    assert len(batches) == len(ds)
    all_keys = []
    for step, b in enumerate(batches):
        exp = _expected(ds, step)
        assert b["latents"].dtype == torch.float16 and b["latents"].shape == (8, 4, 32, 32)
        np.testing.assert_array_equal(b["latents"].numpy(), exp["latents"])
        np.testing.assert_array_equal(b["embeddings"].numpy(), exp["embeddings"])
        np.testing.assert_array_equal(b["keys"].numpy(), exp["keys"])
        all_keys += b["keys"].tolist()
    assert len(all_keys) == len(set(all_keys))  # crop="random": one sample per row


def test_ranks_union_is_global_batch_and_resume(source):
    kw = dict(global_batch_size=12, seed=5, crop="all", partition="strided")
    ranks = [TorchBatches(source, process_index=p, process_count=3, **kw) for p in range(3)]
    per_rank = [
        list(torch_loader(r, num_workers=2, timeout=60, multiprocessing_context=_ctx()))
        for r in ranks
    ]
    for step in range(len(ranks[0])):
        glob, _ = ranks[0].sampler.global_batch(0, step)
        got = torch.cat([per_rank[p][step]["keys"] for p in range(3)]).tolist()
        assert sorted(got) == sorted(source.keys[glob // 3].tolist())
    ranks[0].set_epoch(0, start_step=4)
    resumed = list(
        torch_loader(ranks[0], num_workers=2, timeout=60, multiprocessing_context=_ctx())
    )
    assert [b["keys"].tolist() for b in resumed] == [b["keys"].tolist() for b in per_rank[0][4:]]


def test_pad_mask_bf16_and_spawned_workers(source):
    ds = TorchBatches(
        source,
        global_batch_size=48,
        crop=0,
        drop_last=False,
        latents_dtype="bfloat16",
        process_index=0,
        process_count=1,
    )
    clone = pickle.loads(pickle.dumps(source))
    try:
        assert clone.num_rows == source.num_rows and clone.fingerprint == "fp"
    finally:
        clone.close()
    dl = torch_loader(ds, num_workers=2, multiprocessing_context="spawn", timeout=120)
    batches = list(dl)
    assert [int(b["mask"].sum()) for b in batches] == [48, 48, source.num_rows - 96]
    assert batches[0]["latents"].dtype == torch.bfloat16
    keys = torch.cat([b["keys"][b["mask"]] for b in batches]).tolist()
    assert sorted(keys) == sorted(source.keys.tolist())
    with pytest.raises(ValueError, match="batch_size"):
        torch_loader(ds, batch_size=4)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bfloat16_cache_gives_bfloat16_tensors(tmp_path, num_workers):
    """torch.from_numpy refuses ml_dtypes: the bits are shared as int16 and viewed."""
    files = build_cache(tmp_path, 60, dtype="bfloat16", num_proc=1, embed_dim=8)
    with SampleSource(*files, fingerprint="bf", latent_dtype="bfloat16") as src:
        ds = TorchBatches(src, global_batch_size=8, seed=1, process_index=0, process_count=1)
        ctx = _ctx() if num_workers else None
        dl = torch_loader(
            ds,
            num_workers=num_workers,
            multiprocessing_context=ctx,
            timeout=60 if num_workers else 0,
        )
        batches = list(dl)
        assert len(batches) == len(ds) == 5
        for step, b in enumerate(batches):
            exp = _expected(ds, step)["latents"]
            assert b["latents"].dtype == torch.bfloat16
            bits = b["latents"].view(torch.int16).numpy().view(np.uint16)
            np.testing.assert_array_equal(bits, exp.view(np.uint16))
            assert (bits[:, 0, 0, 0] == 3).all()  # the planted subnormal, unchanged
        wide = TorchBatches(
            src,
            global_batch_size=8,
            seed=1,
            latents_dtype="float32",
            process_index=0,
            process_count=1,
        )
        np.testing.assert_array_equal(
            wide.batch(0)["latents"].numpy(), _expected(ds, 0)["latents"].astype(np.float32)
        )


def test_datamodule_over_the_built_cache(small_config, built_cache):
    """The Lightning-style DataModule: setup finds the cache, batches follow the loader order."""
    import numpy as np

    from hf_pipeline.torch_data import LatentDataModule, TorchBatches

    dm = LatentDataModule(small_config, num_workers=0)
    with pytest.raises(RuntimeError, match="setup"):
        dm.train_dataloader()
    dm.setup("fit")
    dm.set_epoch(1, start_step=2)
    got = [b["keys"].numpy() for b in dm.train_dataloader()]
    ref = TorchBatches(dm.source, global_batch_size=16, seed=0, process_index=0, process_count=1,
                       epoch=1, start_step=2)
    assert len(got) == len(ref) > 0
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(a, b["keys"].numpy())
    dm.teardown()
    assert dm.source is None
