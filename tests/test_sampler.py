"""sampler: the global order is a permutation, world-size independent, and partitions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_pipeline.sampler import GlobalSampler, SamplerOptions

SETTINGS = settings(max_examples=40, deadline=None)
shuffles = st.sampled_from(["global", "block", "sequential"])
crops = st.sampled_from(["random", "all", 0, 2])


def _epoch_samples(s: GlobalSampler, epoch: int, p: int, w: int) -> list[np.ndarray]:
    out = []
    for b in s.process_stream(epoch, p, w):
        samples = b.rows * s.num_crops + b.crops if s.options.crop == "all" else b.rows
        out.append(samples[b.mask])
    return out


@SETTINGS
@given(
    n=st.integers(0, 300),
    w=st.integers(1, 8),
    per=st.integers(1, 9),
    seed=st.integers(0, 2**31),
    shuffle=shuffles,
    crop=crops,
    partition=st.sampled_from(["contiguous", "strided"]),
    block=st.integers(1, 40),
)
def test_epoch_covers_each_sample_once_and_ranks_partition(
    n, w, per, seed, shuffle, crop, partition, block
):
    g = w * per
    s = GlobalSampler(
        n,
        global_batch_size=g,
        seed=seed,
        shuffle=shuffle,
        crop=crop,
        partition=partition,
        block_size=block,
        window_blocks=3,
    )
    order = s.epoch_order(1)
    assert np.array_equal(np.sort(order), np.arange(s.num_samples))
    assert s.steps_per_epoch == s.num_samples // g
    per_rank = [_epoch_samples(s, 1, p, w) for p in range(w)]
    seen = np.concatenate([np.concatenate(r) for r in per_rank if r] or [np.zeros(0, int)])
    # Every kept sample exactly once; the dropped tail is the last num_samples % g.
    assert len(seen) == len(set(seen.tolist())) == s.steps_per_epoch * g
    assert set(seen.tolist()) == set(order[: s.steps_per_epoch * g].tolist())
    for step in range(s.steps_per_epoch):
        glob, mask = s.global_batch(1, step)
        assert mask.all()
        union = np.concatenate([per_rank[p][step] for p in range(w)])
        assert sorted(union.tolist()) == sorted(glob.tolist())
        for p in range(w):
            assert len(per_rank[p][step]) == per


@SETTINGS
@given(
    n=st.integers(1, 200),
    g=st.integers(1, 40),
    seed=st.integers(0, 1000),
    shuffle=shuffles,
    crop=crops,
)
def test_same_seed_epoch_same_order_and_epochs_differ(n, g, seed, shuffle, crop):
    kw = dict(global_batch_size=g, seed=seed, shuffle=shuffle, crop=crop, block_size=7)
    a, b = GlobalSampler(n, **kw), GlobalSampler(n, **kw)
    np.testing.assert_array_equal(a.epoch_order(3), b.epoch_order(3))
    if a.steps_per_epoch:
        ba, bb = a.process_batch(3, 0), b.process_batch(3, 0)
        np.testing.assert_array_equal(ba.rows, bb.rows)
        np.testing.assert_array_equal(ba.crops, bb.crops)
    if shuffle != "sequential" and a.num_samples >= 30:
        assert not np.array_equal(a.epoch_order(0), a.epoch_order(1))
    if shuffle == "sequential":
        np.testing.assert_array_equal(a.epoch_order(5), np.arange(a.num_samples))


@SETTINGS
@given(n=st.integers(1, 200), seed=st.integers(0, 1000), w1=st.integers(1, 8), w2=st.integers(1, 8))
def test_random_crop_independent_of_world_size(n, seed, w1, w2):
    g = w1 * w2 * 2
    s = GlobalSampler(n, global_batch_size=g, seed=seed, crop="random")
    for w in (w1, w2):
        for b in s.process_stream(0, w - 1, w):
            np.testing.assert_array_equal(b.crops, s.random_crops(b.rows, 0))
    crops = s.random_crops(np.arange(n), 0)
    assert crops.min() >= 0 and crops.max() <= 2
    if n >= 100:
        assert len(set(crops.tolist())) == 3
        assert not np.array_equal(crops, s.random_crops(np.arange(n), 1))


@SETTINGS
@given(
    n=st.integers(1, 120),
    w=st.integers(1, 8),
    per=st.integers(1, 6),
    seed=st.integers(0, 1000),
    drop_last=st.booleans(),
    shuffle=st.sampled_from(["global", "sequential"]),
)
def test_strided_matches_distributed_sampler(n, w, per, seed, drop_last, shuffle):
    """Strided = torch DistributedSampler (+ DataLoader batching) over the same order."""
    import torch.utils.data as tud

    g = w * per
    s = GlobalSampler(
        n,
        global_batch_size=g,
        seed=seed,
        shuffle=shuffle,
        partition="strided",
        crop=0,
        drop_last=drop_last,
    )
    order = s.epoch_order(2)
    for p in range(w):
        ds = tud.DistributedSampler(
            range(n), num_replicas=w, rank=p, shuffle=False, drop_last=drop_last
        )
        expect = order[np.asarray(list(ds), dtype=np.int64)]
        ours = [b.rows for b in s.process_stream(2, p, w)]
        flat = np.concatenate(ours) if ours else np.zeros(0, np.int64)
        if drop_last:
            # DataLoader(batch_size=per, drop_last=True) over the DistributedSampler.
            loader_batches = list(tud.DataLoader(expect.tolist(), batch_size=per, drop_last=True))
            assert len(loader_batches) == len(ours) == s.steps_per_epoch
            for lb, ob in zip(loader_batches, ours, strict=True):
                np.testing.assert_array_equal(np.asarray(lb), ob)
        else:
            # Same wrap-around padding; ours pads further to a whole global batch.
            assert len(flat) >= len(expect)
            np.testing.assert_array_equal(flat[: len(expect)], expect)


@SETTINGS
@given(n=st.integers(1, 150), w=st.integers(1, 6), per=st.integers(1, 5))
def test_strided_equals_distributed_sampler_batches_not_index_sets(n, w, per):
    """What README promises, exactly: per-process batches equal DistributedSampler +
    DataLoader(drop_last=True); the index sets differ iff N mod G >= W; with
    DistributedSampler's default drop_last=False the DataLoader yields one more batch
    iff N mod G > G - W."""
    import torch.utils.data as tud

    g = w * per
    s = GlobalSampler(n, global_batch_size=g, seed=3, partition="strided", crop=0)
    order = s.epoch_order(0)
    for p in range(w):
        ours = [b.rows for b in s.process_stream(0, p, w)]
        our_set = sorted(np.concatenate(ours).tolist()) if ours else []
        for ds_drop_last in (True, False):
            ds = tud.DistributedSampler(
                range(n), num_replicas=w, rank=p, shuffle=False, drop_last=ds_drop_last
            )
            indices = order[np.asarray(list(ds), dtype=np.int64)]
            batches = list(tud.DataLoader(indices.tolist(), batch_size=per, drop_last=True))
            for theirs, mine in zip(batches, ours, strict=False):
                np.testing.assert_array_equal(np.asarray(theirs), mine)
            extra = len(batches) - len(ours)
            assert extra == (0 if ds_drop_last else int(n % g > g - w))
            if ds_drop_last:
                assert (sorted(indices.tolist()) == our_set) == (n % g < w)


def test_distributed_sampler_shuffle_via_torch_permutation():
    """Feeding torch's own permutation shows the index sets are DistributedSampler's."""
    import torch
    import torch.utils.data as tud

    n, w, seed, epoch = 103, 4, 7, 3
    ds_sets = []
    for p in range(w):
        d = tud.DistributedSampler(
            range(n), num_replicas=w, rank=p, shuffle=True, seed=seed, drop_last=True
        )
        d.set_epoch(epoch)
        ds_sets.append(list(d))
    gen = torch.Generator()
    gen.manual_seed(seed + epoch)
    perm = np.asarray(torch.randperm(n, generator=gen).tolist())
    s = GlobalSampler(n, global_batch_size=w, shuffle="sequential", partition="strided", crop=0)
    for p in range(w):
        ours = np.concatenate([b.rows for b in s.process_stream(0, p, w)])
        np.testing.assert_array_equal(perm[ours], ds_sets[p][: len(ours)])


@SETTINGS
@given(n=st.integers(1, 100), g=st.integers(1, 30), seed=st.integers(0, 100))
def test_pad_mode_masks_padding(n, g, seed):
    s = GlobalSampler(n, global_batch_size=g, seed=seed, drop_last=False, crop=1)
    assert s.steps_per_epoch == -(-n // g)
    real = []
    for step in range(s.steps_per_epoch):
        b = s.process_batch(0, step)
        assert len(b.rows) == g
        assert b.rows.min() >= 0 and b.rows.max() < n
        real.append(b.rows[b.mask])
        assert b.mask.all() == (step < n // g)
    assert sorted(np.concatenate(real).tolist()) == list(range(n))


def test_block_shuffle_is_local():
    n, bs, wb = 10_000, 100, 4
    s = GlobalSampler(n, global_batch_size=50, shuffle="block", block_size=bs, window_blocks=wb)
    order = s.epoch_order(0)
    windows = order[: (n // (bs * wb)) * bs * wb].reshape(-1, bs * wb)
    for win in windows:
        assert len(set((win // bs).tolist())) == wb  # a window holds whole blocks only
    assert not np.array_equal(order[:bs], np.sort(order[:bs]))  # shuffled inside


def test_validation_messages():
    with pytest.raises(ValueError, match="global_batch_size must be >= 1, got 0"):
        SamplerOptions(global_batch_size=0)
    with pytest.raises(ValueError, match="shuffle must be"):
        SamplerOptions(global_batch_size=1, shuffle="nope")
    with pytest.raises(ValueError, match="crop must be"):
        SamplerOptions(global_batch_size=1, crop="x")
    assert SamplerOptions(global_batch_size=1, crop="2").crop == 2
    with pytest.raises(
        ValueError, match=r"crop must be 'random', 'all' or a crop index 0-2, got 3"
    ):
        GlobalSampler(10, global_batch_size=1, crop=3)
    with pytest.raises(ValueError, match="crop must be 'random', 'all' or an index >= 0, got True"):
        SamplerOptions(global_batch_size=1, crop=True)  # an int to Python, not an index
    s = GlobalSampler(10, global_batch_size=6)
    with pytest.raises(ValueError, match="divisible by the number of processes"):
        s.process_positions(0, 4)
    with pytest.raises(IndexError):
        s.process_batch(0, 1)
