"""grain_source: Grain reads the built cache — same values as SampleSource, small pickles,
real worker processes, exact checkpoint/resume."""

from __future__ import annotations

import itertools
import pickle
import shutil
from typing import Any

import numpy as np
import pytest

from hf_pipeline.adapters.grain_source import GrainSource
from hf_pipeline.cache.layout import STAGES
from hf_pipeline.read.mapped import CacheFormatError
from hf_pipeline.read.sampler import GlobalSampler

#: The grain package, imported by :func:`_grain` when this module's tests run, not at
#: collection: every xdist worker collects every module, and importing grain imports
#: JAX (2 CPU-s; after it tests.helpers.caches.build_cache must fork in a fresh process).
grain: Any = None


@pytest.fixture(scope="module", autouse=True)
def _grain():
    global grain
    grain = pytest.importorskip("grain")


@pytest.fixture(scope="module", autouse=True)
def _absl_flags_parsed():
    # grain 0.2.18 with JAX reads an absl flag when it starts worker processes and
    # raises UnparsedFlagAccessError outside absl.app (google/grain#1355).
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


@pytest.fixture(scope="module")
def src(built_cache):
    with GrainSource(built_cache.cache_dir) as s:
        yield s


def _records(src, indices):
    return [src[int(i)] for i in indices]


def _assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert sorted(x) == sorted(y)
        for name in x:
            np.testing.assert_array_equal(np.asarray(x[name]), np.asarray(y[name]))


@pytest.mark.parametrize("crop", ["random", 1, "all"])
def test_records_equal_sample_source_gather(built_cache, crop):
    with GrainSource(built_cache.cache_dir, crop=crop, seed=3) as s:
        ss = s.sample_source
        rows_n, crops_n = ss.num_rows, ss.num_crops
        assert len(s) == rows_n * (crops_n if crop == "all" else 1)
        idx = np.random.default_rng(0).choice(len(s), size=40, replace=False)
        if crop == "all":
            rows, crops = idx // crops_n, idx % crops_n
        elif crop == "random":
            rows = idx
            crops = GlobalSampler(rows_n, global_batch_size=1, seed=3).random_crops(rows, 0)
            assert len(set(crops.tolist())) > 1  # really random, not crop 0 everywhere
        else:
            rows, crops = idx, np.full(idx.shape, crop)
        want = ss.gather(rows, crops)
        got = _records(s, idx)
        for j, rec in enumerate(got):
            assert (
                rec["latents"].shape == ss.latent_shape and rec["latents"].dtype == ss.latent_dtype
            )
            np.testing.assert_array_equal(rec["latents"], want["latents"][j])
            np.testing.assert_array_equal(rec["embeddings"], want["embeddings"][j])
            assert rec["keys"] == want["keys"][j] and rec["keys"].dtype == np.int64
        _assert_batches_equal([s.get_batch(idx)], [want])
        _assert_batches_equal(s._getitems(idx.tolist()), got)  # Grain's batched read
    if crop == "random":  # the crops are a function of the seed
        with GrainSource(built_cache.cache_dir, crop=crop, seed=4) as other:
            b = other.get_batch(idx)
        assert not np.array_equal(b["latents"], want["latents"])
        np.testing.assert_array_equal(b["keys"], want["keys"])


def test_constructors_agree_and_repr_names_identity(built_cache, src):
    via_build = GrainSource.from_build(built_cache)
    via_layout = GrainSource.from_layout(built_cache.layout, built_cache.fingerprint)
    try:
        assert src.fingerprint == via_build.fingerprint == built_cache.fingerprint
        assert repr(src) == repr(via_build) == repr(via_layout)
        assert built_cache.fingerprint in repr(src) and str(built_cache.cache_dir) not in repr(src)
        _assert_batches_equal([src.get_batch(range(20))], [via_layout.get_batch(range(20))])
    finally:
        via_build.close()
        via_layout.close()


def test_pickle_carries_paths_not_arrays(src):
    import cloudpickle  # what Grain uses to send the source to its worker processes

    cache_bytes = sum(f.stat().st_size for f in src.cache_dir.rglob("*.arrow"))
    for dumps in (pickle.dumps, cloudpickle.dumps):
        blob = dumps(src)
        assert len(blob) < 2000 < cache_bytes // 1000, (len(blob), cache_bytes)
        clone = pickle.loads(blob)
        assert clone._records is None  # nothing mapped until this process reads
        try:
            assert len(clone) == len(src) and repr(clone) == repr(src)
            _assert_batches_equal(
                _records(clone, [0, 5, len(src) - 1]), _records(src, [0, 5, len(src) - 1])
            )
        finally:
            clone.close()


def test_bad_caches_and_options_are_refused(built_cache, tmp_path, src):
    with pytest.raises(CacheFormatError, match="does not exist"):
        GrainSource(tmp_path / "nope")
    copy = tmp_path / "cache"
    shutil.copytree(built_cache.cache_dir, copy)
    with pytest.raises(CacheFormatError, match="fingerprint") as e:
        GrainSource(copy, fingerprint="0" * 16)
    assert e.value.path.endswith(f"{STAGES[0]}.json")
    (copy / f"{STAGES[-1]}.json").unlink()
    with pytest.raises(CacheFormatError, match="missing") as e:
        GrainSource(copy)
    assert e.value.path.endswith(f"{STAGES[-1]}.json")
    with pytest.raises(ValueError, match="a crop index 0-2, got 3"):
        GrainSource(built_cache.cache_dir, crop=3)
    with pytest.raises(ValueError, match="crop must be"):
        GrainSource(built_cache.cache_dir, crop="middle")
    with pytest.raises(ValueError, match="seed must be >= 0"):
        GrainSource(built_cache.cache_dir, seed=-1)
    with pytest.raises(IndexError, match=rf"\[0, {len(src)}\), got {len(src)}"):
        src[len(src)]


@pytest.mark.parametrize("index", [3.7, "2", [1, 2], np.array([1, 2]), slice(0, 3), None])
def test_a_record_index_that_is_not_an_integer_is_refused(src, index):
    """A float, a string, a list or a slice is not a record index: a TypeError, not the
    record of its first or truncated value (3.7 read record 3, [1, 2] record 1 alone)."""
    with pytest.raises(TypeError, match="must be an integer"):
        src[index]
    with pytest.raises(TypeError, match="must be integers"):
        src.get_batch([1.5, 2.0])
    # NumPy integers are integers.
    _assert_batches_equal([src[np.int64(2)]], [src[2]])
    assert src.get_batch(np.array([1, 2], np.uint32))["keys"].tolist() == [
        src[1]["keys"],
        src[2]["keys"],
    ]


def test_map_dataset_shuffle_batch_and_batched_indices(src):
    ds = grain.MapDataset.source(src).shuffle(seed=5).batch(8, drop_remainder=True)
    assert len(ds) == len(src) // 8
    first = ds[0]
    ss = src.sample_source
    assert (
        first["latents"].shape == (8, *ss.latent_shape)
        and first["latents"].dtype == ss.latent_dtype
    )
    assert (
        first["embeddings"].shape == (8, ss.embed_dim) and first["embeddings"].dtype == np.float32
    )
    assert first["keys"].shape == (8,) and first["keys"].dtype == np.int64
    per_record = [ds[i] for i in range(len(ds))]
    keys = np.concatenate([b["keys"] for b in per_record])
    assert len(set(keys.tolist())) == len(keys) and set(keys.tolist()) <= set(ss.keys.tolist())
    # The batched path (indices batched by Grain, one gather per batch) gives the same batches.
    fast = (
        grain.MapDataset.range(len(src))
        .shuffle(seed=5)
        .batch(8, drop_remainder=True)
        .map(src.get_batch)
    )
    _assert_batches_equal([fast[i] for i in range(len(fast))], per_record)


def _loader(src, worker_count, *, batch=True, shard=(0, 1)):
    sampler = grain.samplers.IndexSampler(
        num_records=len(src),
        shard_options=grain.sharding.ShardOptions(shard[0], shard[1], drop_remainder=True),
        shuffle=True,
        num_epochs=1,
        seed=11,
    )
    ops = [grain.transforms.Batch(8, drop_remainder=True)] if batch else []
    return grain.DataLoader(
        data_source=src, sampler=sampler, operations=ops, worker_count=worker_count
    )


def _copy(batches):
    # Worker outputs live in shared memory that Grain recycles: keep copies.
    return [{k: np.array(v) for k, v in b.items()} for b in batches]


@pytest.mark.slow
def test_dataloader_worker_processes_match_in_process(src):
    inline = _copy(_loader(src, 0, batch=False))
    assert len(inline) == len(src)
    workers = _copy(_loader(src, 2, batch=False))  # spawned processes, each maps the cache
    _assert_batches_equal(workers, inline)
    # With Batch, Grain batches inside each worker: the same samples, grouped per worker.
    batched = _copy(_loader(src, 2))
    n = len(src)  # records go round-robin to the workers; each drops its own remainder
    assert len(batched) == (n - n // 2) // 8 + (n // 2) // 8
    seen = np.concatenate([b["keys"] for b in batched]).tolist()
    assert len(set(seen)) == len(seen) and set(seen) <= {int(r["keys"]) for r in inline}
    # Sharded by process (ShardOptions as ShardByJaxProcess builds them): disjoint halves.
    halves = [
        np.concatenate([b["keys"] for b in _copy(_loader(src, 0, shard=(p, 2)))]) for p in (0, 1)
    ]
    assert not set(halves[0].tolist()) & set(halves[1].tolist())
    assert len(halves[0]) + len(halves[1]) == 2 * ((len(src) // 2) // 8 * 8)


@pytest.mark.slow
@pytest.mark.parametrize("worker_count", [0, 2])
def test_dataloader_checkpoint_resume_is_exact(src, worker_count):
    full = _copy(_loader(src, worker_count))
    k = 5
    it = iter(_loader(src, worker_count))
    head = _copy(next(it) for _ in range(k))
    state = it.get_state()
    del it
    resumed_it = iter(_loader(src, worker_count))
    resumed_it.set_state(state)
    rest = _copy(resumed_it)
    _assert_batches_equal(head + rest, full)
    assert len(rest) == len(full) - k > 0


def test_map_dataset_iterator_checkpoint_resume(src):
    ds = grain.MapDataset.source(src).shuffle(seed=2).repeat(2).batch(16, drop_remainder=True)
    full = _copy(ds.to_iter_dataset())
    it = iter(ds.to_iter_dataset())
    head = _copy(next(it) for _ in range(7))
    state = it.get_state()
    it2 = iter(ds.to_iter_dataset())
    it2.set_state(state)
    _assert_batches_equal(head + _copy(it2), full)


def test_global_batches_recipe_gives_the_loaders_batches(built_cache):
    """README's fast path: one Grain record per global batch of our own order, equal to
    the Loader's batches in every epoch, latents included: ``get_batch(ids, epoch=e)``
    draws the random crops of epoch ``e`` as the Loader does (they were epoch 0's in
    every epoch: the keys and embeddings agreed, the latents not from epoch 1 on)."""
    from hf_pipeline.read.loader import Loader

    with GrainSource(built_cache.cache_dir, seed=4) as grain_src:
        order = GlobalSampler(len(grain_src), global_batch_size=16, seed=4)
        share = order.process_positions(1, 2)  # process 1 of 2
        spe = order.steps_per_epoch

        def global_batch(g):
            ids, _ = order.global_batch(g // spe, g % spe)
            return grain_src.get_batch(ids[share], epoch=g // spe)

        by_step = grain.MapDataset.range(3 * spe).map(global_batch)
        with Loader(
            grain_src.sample_source, global_batch_size=16, seed=4, process_index=1,
            process_count=2,
        ) as ld:  # fmt: skip
            want = [
                {k: np.asarray(v) for k, v in b.items() if k in ("keys", "latents", "embeddings")}
                for b in itertools.islice(ld.epochs(3), 3 * spe)
            ]
        got = list(by_step.to_iter_dataset())
    assert len(got) == len(want) == 3 * spe
    _assert_batches_equal(got, want)
