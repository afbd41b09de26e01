"""torch_data: DataLoader workers split this rank's batches without duplicates."""

from __future__ import annotations

import dataclasses
import pickle
import sys
import warnings

import numpy as np
import pytest
import torch

from hf_pipeline.adapters.torch_data import TorchBatches, torch_loader
from hf_pipeline.errors import CacheFormatError, ConfigError, SourceError, StoreUnreachableError
from hf_pipeline.read.mapped import SampleSource
from hf_pipeline.read.sampler import ORDER_VERSION, OptionError, SamplerOptions
from tests.helpers.caches import build_cache, open_source
from tests.helpers.reraise import worker_reraised


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    with open_source(tmp_path_factory.mktemp("torch_cache"), 200, fingerprint="fp") as src:
        yield src


def _ctx():
    """Fork workers (inheriting the maps) unless JAX's threads live in this process.

    Forking a process that runs JAX threads may deadlock the child; forkserver starts
    workers from a clean process (they reopen the maps from the pickled source).
    """
    return "forkserver" if "jax" in sys.modules else None


def _expected(ds: TorchBatches, step: int, epoch: int | None = None):
    pb = ds.sampler.batch_at(ds.epoch if epoch is None else epoch, step, ds._local)
    return ds.source.gather(pb.rows, pb.crops)


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
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


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_positions_and_dtypes_out_of_range_are_refused(source):
    """A negative epoch, a step outside the epoch or a latents dtype that is not a float
    is one ValueError where it is given (len() once said 10 of a 9-step epoch)."""
    ds = TorchBatches(source, global_batch_size=16, process_index=0, process_count=1)
    steps = ds.sampler.steps_per_epoch
    for epoch, step in ((-1, 0), (0, -1), (0, steps + 1)):
        with pytest.raises(ValueError, match=rf"step in \[0, {steps}\]"):
            ds.set_epoch(epoch, step)
    with pytest.raises(ValueError, match="epoch >= 0"):
        TorchBatches(source, global_batch_size=16, process_index=0, process_count=1, epoch=-1)
    ds.set_epoch(1, steps)  # the end of an epoch is a position
    assert len(ds) == 0
    for dtype in ("int8", "nope", torch.int16):
        with pytest.raises(ValueError, match="latents_dtype must be a floating torch dtype"):
            TorchBatches(
                source, global_batch_size=16, process_index=0, process_count=1,
                latents_dtype=dtype,
            )  # fmt: skip


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
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


@pytest.mark.slow
def test_datamodule_over_the_built_cache(small_config, built_cache):
    """The Lightning-style DataModule: setup finds the cache, batches follow the loader order."""
    import numpy as np

    from hf_pipeline.adapters.torch_data import LatentDataModule, TorchBatches

    dm = LatentDataModule(small_config, num_workers=0)
    with pytest.raises(RuntimeError, match="setup"):
        dm.train_dataloader()
    dm.setup("fit")
    dm.set_epoch(1, start_step=2)
    got = [b["keys"].numpy() for b in dm.train_dataloader()]
    ref = TorchBatches(
        dm.source,
        global_batch_size=16,
        seed=0,
        process_index=0,
        process_count=1,
        epoch=1,
        start_step=2,
    )
    assert len(got) == len(ref) > 0
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(a, b["keys"].numpy())
    dm.teardown()
    assert dm.source is None


def test_a_global_batch_larger_than_the_data_is_refused(small_config, built_cache):
    """TorchBatches and the DataModule's setup refuse a global batch with no full batch
    in an epoch (the Loader's ConfigError), not 0 batches and Lightning's "No training
    batches"; setup leaves no source open."""
    from hf_pipeline.adapters.torch_data import LatentDataModule
    from hf_pipeline.cache.layout import open_sample_source
    from hf_pipeline.errors import ConfigError

    with open_sample_source(built_cache.layout, built_cache.fingerprint) as src:
        big = src.num_rows + 1
        with pytest.raises(ConfigError, match=rf"global_batch_size \({big}\) is larger"):
            TorchBatches(src, global_batch_size=big, process_index=0, process_count=1)
        padded = TorchBatches(src, global_batch_size=big, process_index=0, process_count=1,
                              drop_last=False)  # fmt: skip
        assert len(list(padded)) == 1
    cfg = dataclasses.replace(
        small_config, loader=dataclasses.replace(small_config.loader, global_batch_size=big)
    )
    dm = LatentDataModule(cfg, num_workers=0)
    with pytest.raises(ConfigError, match=rf"global_batch_size \({big}\) is larger"):
        dm.setup("fit")
    assert dm.source is None


def test_iteration_keeps_the_epoch_it_started_with(source):
    """set_epoch between iter() and the first batch (Lightning's order on resume) does not
    move an iteration that has begun; the next iteration follows it."""
    ds = TorchBatches(source, global_batch_size=16, seed=1, process_index=0, process_count=1)
    it = iter(ds)
    ds.set_epoch(5, start_step=3)
    got = [b["keys"].tolist() for b in it]
    assert got == [_expected(ds, s, epoch=0)["keys"].tolist() for s in range(len(got))]
    assert len(got) == source.num_rows // 16
    assert [b["keys"].tolist() for b in ds][0] == _expected(ds, 3, epoch=5)["keys"].tolist()


def test_loader_sampler_set_epoch_reaches_the_dataset(source):
    ds = TorchBatches(source, global_batch_size=16, seed=1, process_index=0, process_count=1)
    dl = torch_loader(ds, num_workers=0)
    dl.sampler.set_epoch(3)  # what Lightning's fit loop calls before each epoch
    assert (ds.epoch, ds.start_step) == (3, 0)
    first = next(iter(dl))
    np.testing.assert_array_equal(first["keys"].numpy(), _expected(ds, 0, epoch=3)["keys"])
    with pytest.raises(ValueError, match="persistent_workers"):
        torch_loader(ds, num_workers=2, persistent_workers=True)


def test_order_as_options_or_keywords_gives_the_same_batches(source):
    order = SamplerOptions(global_batch_size=16, seed=2, shuffle="block", block_size=8, crop=1)
    where = dict(process_index=1, process_count=2)
    by_options = TorchBatches(source, order, **where)
    by_keywords = TorchBatches(
        source, global_batch_size=16, seed=2, shuffle="block", block_size=8, crop=1, **where
    )
    replaced = TorchBatches(source, dataclasses.replace(order, seed=9), seed=2, **where)
    assert by_options.sampler.options == by_keywords.sampler.options == order
    assert replaced.sampler.options == order
    keys = [[b["keys"].tolist() for b in ds] for ds in (by_options, by_keywords, replaced)]
    assert keys[0] == keys[1] == keys[2] and len(keys[0]) == len(by_options)
    with pytest.raises(TypeError, match="bogus"):
        TorchBatches(source, global_batch_size=16, bogus=1, **where)


def _datamodule(cfg, **kw):
    from hf_pipeline.adapters.torch_data import LatentDataModule

    return LatentDataModule(cfg, **kw)


@pytest.mark.slow
def test_datamodule_state_is_the_consumer_position(small_config, built_cache):
    """state_dict names the next batch handed out, not how far the workers ran ahead."""
    dm = _datamodule(small_config, num_workers=2, multiprocessing_context=_ctx(), timeout=120)
    dm.setup("fit")
    dm.set_epoch(1)
    dl = dm.train_dataloader()
    spe = dm.dataset.sampler.steps_per_epoch
    assert len(dl) == spe  # the whole epoch: Lightning numbers a resumed epoch on
    it = iter(dl)
    head = [next(it)["keys"].tolist() for _ in range(3)]
    state = dm.state_dict()
    assert (state["epoch"], state["step"]) == (1, 3)
    assert dl.state_dict() == state
    assert state["fingerprint"] == built_cache.fingerprint and state["version"] == 1
    rest = [b["keys"].tolist() for b in it]
    assert dm.state_dict()["epoch"] == 2 and dm.state_dict()["step"] == 0  # epoch done
    # A fresh DataModule given the state before setup continues exactly there.
    dm2 = _datamodule(small_config, num_workers=0)
    dm2.load_state_dict(state)
    dm2.setup("fit")
    assert [b["keys"].tolist() for b in dm2.train_dataloader()] == rest
    full = TorchBatches(
        dm.source, global_batch_size=16, seed=0, process_index=0, process_count=1, epoch=1
    )
    assert head + rest == [b["keys"].tolist() for b in full]
    dm.teardown()
    assert dm.source is None and dm.state_dict()["epoch"] == 2  # the position outlives it
    dm2.teardown()


def test_datamodule_state_format_golden(small_config, built_cache):
    """Version 1 of the state, written out: checkpoints of today keep loading."""
    dm = _datamodule(small_config, num_workers=0)
    golden = {
        "version": 1,
        "epoch": 2,
        "step": 5,
        "global_batch_size": 16,
        "seed": 0,
        "shuffle": "global",
        "partition": "contiguous",
        "crop": "random",
        "block_size": 4096,
        "window_blocks": 4,
        "drop_last": True,
        "fingerprint": built_cache.fingerprint,
    }
    dm.load_state_dict(golden)  # before setup: kept, checked by setup
    dm.setup()
    golden["num_rows"] = dm.dataset.sampler.num_rows
    # A state written before it named its sample order version was version 1's.
    assert dm.state_dict() == {**golden, "order_version": 1}
    want = TorchBatches(
        dm.source, global_batch_size=16, process_index=0, process_count=1, epoch=2, start_step=5
    )
    got = next(iter(dm.train_dataloader()))
    np.testing.assert_array_equal(got["keys"].numpy(), next(iter(want))["keys"].numpy())
    dm.teardown()


def test_datamodule_refuses_a_state_of_another_order(small_config, built_cache):
    dm = _datamodule(small_config, num_workers=0)
    dm.setup()
    state = dm.state_dict()
    for key, value in (("seed", 7), ("fingerprint", "0" * 16), ("global_batch_size", 8)):
        with pytest.raises(ValueError, match=f"{key}="):
            dm.load_state_dict({**state, key: value})
    with pytest.raises(ValueError, match="version"):
        dm.load_state_dict({**state, "version": 2})
    # Another sample order (a release that moved samples) is refused, as by the Loader.
    assert state["order_version"] == ORDER_VERSION
    with pytest.raises(ValueError, match=f"order version {ORDER_VERSION + 1} but this code"):
        dm.load_state_dict({**state, "order_version": ORDER_VERSION + 1, "step": 2})
    assert dm.state_dict()["step"] == state["step"]  # the position did not move
    with pytest.raises(ValueError, match="step in"):
        dm.load_state_dict({**state, "step": 10_000})
    dm.load_state_dict({**state, "partition": "strided", "step": 4})  # another split: fine
    assert dm.state_dict()["step"] == 4
    dm.teardown()


def test_datamodule_state_interchanges_with_the_jax_loader(small_config, built_cache):
    """Same fields, same global order: a Loader state resumes a DataModule and back."""
    from hf_pipeline.read.loader import Loader

    dm = _datamodule(small_config, num_workers=0)
    dm.setup()
    with Loader.from_config(dm.source, small_config.loader, process_index=0, process_count=1) as ld:
        it = iter(ld)
        for _ in range(4):
            next(it)
        state = ld.state_dict()
        want = np.asarray(next(it)["keys"]).tolist()
        it.close()
        dm.load_state_dict(state)
        assert next(iter(dm.train_dataloader()))["keys"].tolist() == want
        ld.load_state_dict(dm.state_dict())  # 5 batches handed out by now
        assert ld.step == 5
    dm.teardown()


def test_plain_datamodule_without_lightning(small_config, built_cache, monkeypatch):
    from hf_pipeline.adapters import torch_data

    monkeypatch.setitem(sys.modules, "lightning", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)
    plain = torch_data._make_datamodule_class()
    assert plain.__mro__[1:] == (torch_data._LatentDataModule, object)
    dm = plain(small_config, num_workers=0)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert batch["latents"].shape == (16, 4, 32, 32) and dm.state_dict()["step"] == 1
    dm.teardown()


@pytest.mark.slow
def test_importing_torch_data_does_not_import_lightning():
    import subprocess

    from tests.conftest import PYTHON, script_env

    code = (
        "import sys, hf_pipeline.adapters.torch_data as t; assert 'lightning' not in sys.modules; "
        "t.LatentDataModule; print('lightning' in sys.modules)"
    )
    out = subprocess.run(
        [PYTHON, "-c", code], env=script_env(), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"


# ------------------------------------------------ plain torch use (issue 24 item 2)


def _plain_loader(ds, num_workers: int, **kw):
    extra = {"multiprocessing_context": _ctx(), "timeout": 60} if num_workers else {}
    return torch.utils.data.DataLoader(ds, num_workers=num_workers, **extra, **kw)


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_batch_size_is_refused_in_one_line(source, num_workers):
    """`DataLoader(TorchBatches, batch_size=8)` stacked 8 batches into latents of shape
    (8, b, C, H, W) without a word; `batch_size=None` gives the batches as they are."""
    ds = TorchBatches(source, global_batch_size=16, process_index=0, process_count=1)
    with pytest.raises(
        TypeError, match=r"TorchBatches yields whole batches: use DataLoader\("
    ) as e:
        next(iter(_plain_loader(ds, num_workers, batch_size=8)))
    # The public name (an outside tester: it named hf_pipeline.adapters.torch_data's).
    assert "hf_pipeline.torch_loader(dataset)" in str(e.value), e.value
    # (From a worker the message carries the worker's traceback, file paths included.)
    assert "hf_pipeline.adapters" not in str(e.value), e.value
    got = list(_plain_loader(ds, num_workers, batch_size=None))
    assert len(got) == len(ds) and got[0]["latents"].shape == (16, 4, 32, 32)
    np.testing.assert_array_equal(got[1]["keys"].numpy(), _expected(ds, 1)["keys"])


@pytest.mark.slow
def test_persistent_workers_are_refused_not_repeated(source):
    """Persistent workers keep their dataset copy: set_epoch never reached them and every
    epoch repeated epoch 0. The second epoch is now an error, not a repeat."""
    ds = TorchBatches(source, global_batch_size=16, seed=1, process_index=0, process_count=1)
    dl = _plain_loader(ds, 2, batch_size=None, persistent_workers=True)
    first = [b["keys"].tolist() for b in dl]
    assert first == [_expected(ds, s, 0)["keys"].tolist() for s in range(len(ds))]
    ds.set_epoch(1)
    with pytest.raises(RuntimeError, match="persistent_workers=True"):
        list(dl)


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_the_share_is_read_when_iteration_starts(source, monkeypatch, context):
    """A TorchBatches made before the job's rank is known (a DataModule set up before
    `Trainer.fit`) takes the share the job has when the iteration starts, and its
    workers (forked or spawned) take that of the process that starts them."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ds = TorchBatches(source, global_batch_size=16, seed=2)  # made as rank 0 of 1
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    whole = TorchBatches(source, global_batch_size=16, seed=2, process_index=0, process_count=1)
    if context == "fork" and "jax" in sys.modules:
        context = "forkserver"  # see _ctx
    dl = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, multiprocessing_context=context, timeout=120
    )
    for step, batch in enumerate(dl):
        assert batch["keys"].tolist() == whole.batch(step)["keys"][8:].tolist()
    assert step == len(ds) - 1
    assert ds.share() == (1, 2)


@pytest.mark.slow
def test_map_style_samples_with_a_distributed_sampler(tmp_path):
    """TorchSamples: `len`, `ds[i]` one sample, and the usual recipe — a DistributedSampler
    per rank, DataLoader(batch_size=B, num_workers=2) — covers every record exactly once
    across the ranks, each batch the samples its sampler named."""
    from torch.utils.data import DistributedSampler

    from hf_pipeline.adapters.torch_data import TorchSamples

    with open_source(tmp_path, 200, fingerprint="m", drop_every=None) as src:
        ds = TorchSamples(src, crop="all", seed=4)
        assert len(ds) == 3 * src.num_rows == 600
        one = ds[np.int64(5)]
        assert one["latents"].shape == (4, 32, 32) and one["embeddings"].shape == (8,)
        want = src.gather([5 // 3], 5 % 3)
        np.testing.assert_array_equal(one["latents"].numpy(), want["latents"][0])
        assert int(one["keys"]) == int(want["keys"][0])
        for bad, error in ((600, IndexError), (-1, IndexError), (1.0, TypeError)):
            with pytest.raises(error, match="record index"):
                ds[bad]
        seen = []
        for rank in range(2):
            sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=9)
            sampler.set_epoch(3)
            indices = list(sampler)
            batches = list(_plain_loader(ds, 2, batch_size=32, sampler=sampler))
            assert [len(b["keys"]) for b in batches] == [32] * 9 + [12]
            got = {k: torch.cat([b[k] for b in batches]).numpy() for k in batches[0]}
            exp = ds.records.get_batch(indices)
            for name in ("latents", "embeddings", "keys"):
                np.testing.assert_array_equal(got[name], exp[name])
            seen.append(indices)
        assert not set(seen[0]) & set(seen[1])
        assert sorted(seen[0] + seen[1]) == list(range(600))
        bf = TorchSamples(src, crop=0, latents_dtype="float32")
        assert bf[0]["latents"].dtype == torch.float32 and len(bf) == 200


class _FailingReads(torch.utils.data.Dataset):
    """Every read raises ``error`` (a store gone away, a corrupt file) inside the worker."""

    def __init__(self, error: Exception):
        self.error = error

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        raise self.error


_OUR_ERRORS = [
    StoreUnreachableError("gs://bkt/caches/a.bin", "connection refused after 3 tries"),
    SourceError("gs://bkt/caches/a.bin", "not found"),
    CacheFormatError("/c/part-0.bin", "truncated"),
    ConfigError("loader.seed must be an integer", field="loader.seed"),
    OptionError("prefetch", "must be >= 1, got 0"),
]


@pytest.mark.parametrize("error", _OUR_ERRORS, ids=lambda e: type(e).__name__)
def test_our_errors_survive_torchs_worker_reraise(error):
    """What a DataLoader does with a worker's exception (torch's own ``ExceptionWrapper``,
    which rebuilds it from one message string), without starting workers: the loop's
    quick check of the test below."""
    got = worker_reraised(error)
    assert isinstance(got, type(error)), repr(got)
    assert str(error) in str(got)


# slow: DataLoader worker processes (about 5 s each on 2 CPUs); the reraise above is quick.
@pytest.mark.slow
@pytest.mark.parametrize("error", _OUR_ERRORS, ids=lambda e: type(e).__name__)
def test_our_errors_keep_their_type_through_dataloader_workers(error):
    """torch re-raises a worker's exception as ``type(e)(message)``: when that call
    fails it raises RuntimeError instead, and the user's ``except StoreUnreachableError``
    misses it."""
    dl = torch.utils.data.DataLoader(
        _FailingReads(error), num_workers=2, multiprocessing_context=_ctx(), timeout=60
    )
    with pytest.raises(type(error)) as got:
        next(iter(dl))
    assert type(got.value) is type(error)
    assert str(error) in str(got.value)
    again = pickle.loads(pickle.dumps(got.value))
    assert type(again) is type(error) and str(again) == str(got.value)


def test_a_misspelled_option_names_the_class_and_the_valid_options(source):
    """`TorchBatches(src, global_batch_sise=16)` said `SamplerOptions.__init__() got an
    unexpected keyword argument`: it names TorchBatches, the close option, the valid ones."""
    with pytest.raises(TypeError) as e:
        TorchBatches(source, global_batch_sise=16)
    msg = str(e.value)
    assert msg.startswith("TorchBatches() got an unexpected keyword argument 'global_batch_sise'")
    assert "did you mean 'global_batch_size'?" in msg and "seed" in msg and "drop_last" in msg
