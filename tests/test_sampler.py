"""sampler: the global order is a permutation, world-size independent, and partitions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_pipeline.read.sampler import GlobalSampler, SamplerOptions

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
    with pytest.raises(ValueError, match="drop_last must be True or False, got 'no'"):
        SamplerOptions(global_batch_size=1, drop_last="no")  # a truthy string: not True
    assert SamplerOptions(global_batch_size=1, drop_last=np.bool_(False)).drop_last is False
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


# Golden sample orders, by ORDER_VERSION: (rows, crops) of every global batch of epochs 0
# and 3, seed 7, for a few settings; computed once from the code that defined the version.
# Every saved loader state points into these sequences. If this test fails, the order
# changed: if that is deliberate, bump hf_pipeline.read.sampler.ORDER_VERSION and add the new
# version's arrays here (keep the old ones); otherwise the change is a bug.
GOLDEN_SETTINGS = {
    "global-random": dict(num_rows=20, global_batch_size=6, shuffle="global", crop="random"),
    "global-all": dict(num_rows=9, global_batch_size=4, shuffle="global", crop="all"),
    "block-fixed": dict(
        num_rows=23, global_batch_size=5, shuffle="block", crop=1, block_size=4, window_blocks=2
    ),
    "block-random": dict(
        num_rows=30, global_batch_size=8, shuffle="block", crop="random", block_size=5,
        window_blocks=3,
    ),
    "sequential-all": dict(num_rows=7, global_batch_size=4, shuffle="sequential", crop="all"),
}  # fmt: skip
# fmt: off
GOLDEN = {
    1: {
        ("global-random", 0): (
            [3, 8, 12, 13, 14, 16, 10, 15, 1, 6, 0, 7, 4, 18, 5, 19, 17, 2],
            [2, 0, 1, 0, 0, 2, 2, 0, 1, 2, 1, 1, 2, 2, 0, 1, 2, 1],
        ),
        ("global-random", 3): (
            [8, 5, 2, 12, 19, 13, 10, 18, 3, 4, 0, 15, 11, 7, 14, 17, 16, 1],
            [0, 0, 1, 0, 0, 1, 1, 1, 0, 2, 1, 0, 2, 1, 1, 1, 2, 0],
        ),
        ("global-all", 0): (
            [5, 1, 8, 4, 1, 4, 4, 6, 6, 8, 0, 7, 6, 3, 2, 2, 0, 5, 2, 5, 1, 8, 7, 0],
            [2, 1, 1, 1, 0, 2, 0, 0, 1, 0, 0, 1, 2, 1, 2, 1, 1, 0, 0, 1, 2, 2, 2, 2],
        ),
        ("global-all", 3): (
            [8, 4, 3, 6, 8, 6, 4, 2, 6, 0, 1, 5, 7, 2, 1, 1, 7, 0, 7, 3, 5, 4, 8, 5],
            [1, 1, 1, 1, 2, 2, 0, 1, 0, 2, 2, 2, 2, 2, 1, 0, 0, 0, 1, 2, 0, 2, 0, 1],
        ),
        ("block-fixed", 0): (
            [8, 10, 9, 20, 21, 22, 11, 16, 2, 0, 3, 19, 1, 18, 17, 15, 7, 12, 5, 14],
            [1] * 20,
        ),
        ("block-fixed", 3): (
            [0, 18, 1, 16, 3, 19, 2, 17, 14, 11, 13, 9, 10, 12, 8, 15, 6, 7, 5, 20],
            [1] * 20,
        ),
        ("block-random", 0): (
            [0, 4, 13, 28, 3, 26, 2, 11, 25, 12, 29, 14, 10, 1, 27, 17, 19, 24, 9, 6, 16, 7, 23, 8],
            [1, 2, 0, 1, 2, 1, 1, 2, 2, 1, 2, 0, 2, 1, 0, 2, 1, 1, 2, 2, 2, 1, 2, 0],
        ),
        ("block-random", 3): (
            [3, 0, 22, 17, 1, 18, 15, 4, 23, 24, 20, 19, 16, 2, 21, 10, 26, 13, 29, 5, 8, 9, 14, 12],
            [0, 1, 1, 1, 0, 1, 0, 2, 2, 0, 2, 0, 2, 1, 2, 1, 2, 1, 1, 0, 0, 1, 1, 0],
        ),
        ("sequential-all", 0): (
            [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5, 6, 6],
            [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1],
        ),
        ("sequential-all", 3): (
            [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5, 6, 6],
            [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1],
        ),
        # drop_last=False: the last global batch of "global-random", epoch 0, wraps around.
        "padded-last-batch": ([9, 11, 3, 8, 12, 13], [2, 2, 2, 0, 1, 0], [1, 1, 0, 0, 0, 0]),
        # Step 1 of "global-random", epoch 0, split over 3 processes.
        "shares": {
            "contiguous": [[10, 15], [1, 6], [0, 7]],
            "strided": [[10, 6], [15, 0], [1, 7]],
        },
    }
}
# fmt: on


@pytest.mark.parametrize("name", sorted(GOLDEN_SETTINGS))
@pytest.mark.parametrize("epoch", [0, 3])
def test_golden_order_of_this_order_version(name, epoch):
    from hf_pipeline.read.sampler import ORDER_VERSION

    settings = dict(GOLDEN_SETTINGS[name])
    s = GlobalSampler(settings.pop("num_rows"), seed=7, **settings)
    rows, crops = [], []
    for step in range(s.steps_per_epoch):
        b = s.process_batch(epoch, step)
        rows += b.rows.tolist()
        crops += b.crops.tolist()
    assert (rows, crops) == GOLDEN[ORDER_VERSION][(name, epoch)]


def test_golden_padding_and_process_shares_of_this_order_version():
    from hf_pipeline.read.sampler import ORDER_VERSION

    golden = GOLDEN[ORDER_VERSION]
    settings = dict(GOLDEN_SETTINGS["global-random"], seed=7)
    n = settings.pop("num_rows")
    padded = GlobalSampler(n, drop_last=False, **settings).process_batch(0, 3)
    assert (padded.rows.tolist(), padded.crops.tolist(), padded.mask.astype(int).tolist()) == (
        golden["padded-last-batch"]
    )
    for partition, shares in golden["shares"].items():
        s = GlobalSampler(n, partition=partition, **settings)
        assert [s.process_batch(0, 1, p, 3).rows.tolist() for p in range(3)] == shares
