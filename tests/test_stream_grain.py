# ruff: noqa: F811 - pytest fixtures imported from tests.helpers are parameters here
"""Grain over a published cache read in place (GrainSource.from_stream): the local
GrainSource's records bit for bit through the real grain package (MapDataset and
DataLoader with spawned worker processes) from the real fake-gcs-server; the per-process
block cache bounded and reused least-recently-used first."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hf_pipeline.adapters.grain_source import GrainSource
from hf_pipeline.errors import ConfigError, SourceError
from hf_pipeline.publish.upload import publish_cache
from hf_pipeline.read.stream import StreamOptions
from hf_pipeline.stores.retry import RetryPolicy
from tests.helpers.publishing import (  # noqa: F401
    config,
    gcs_store,
)

pytestmark = pytest.mark.remote

_FAST = RetryPolicy(max_retries=4, file_timeout=10.0, backoff_base=0.01, backoff_max=0.05)


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


@pytest.fixture
def published(source_cache, gcs_store) -> str:
    """The small demo cache published to a fresh fake-gcs-server bucket: its folder URL."""
    _, url = gcs_store
    src = source_cache.result
    publish_cache(src.cache_dir, src.fingerprint, url, data_config=source_cache.cfg.data)
    return f"{url}/{Path(src.cache_dir).name}"


def _copy(batches) -> list[dict[str, np.ndarray]]:
    # Worker outputs live in shared memory that Grain recycles: keep copies.
    return [{k: np.array(v) for k, v in b.items()} for b in batches]


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert sorted(x) == sorted(y)
        for k in x:
            x_k, y_k = np.asarray(x[k]), np.asarray(y[k])
            assert x_k.dtype == y_k.dtype and x_k.shape == y_k.shape, (i, k)
            assert x_k.tobytes() == y_k.tobytes(), f"record/batch {i} {k} differs"


@pytest.mark.parametrize(
    "crop",
    [
        pytest.param("random", marks=pytest.mark.slow),
        1,
        pytest.param("all", marks=pytest.mark.slow),
    ],
)
def test_streamed_records_equal_local(crop, published, source_cache):
    """Every record, batched reads and Grain's MapDataset shuffle + batch: bit for bit
    the local GrainSource's, with a cache smaller than the data (never passed)."""
    limit = 1_000_000
    local = GrainSource(source_cache.result.cache_dir, crop=crop, seed=3)
    stream = GrainSource.from_stream(
        published, StreamOptions(cache_bytes=limit), policy=_FAST, crop=crop, seed=3
    )
    with local, stream:
        assert len(stream) == len(local) > 0
        assert stream.fingerprint == local.fingerprint and repr(stream) == repr(local)
        assert stream.cache_dir is None and stream.stream_from == published
        _same([stream[i] for i in range(len(local))], [local[i] for i in range(len(local))])
        order = np.random.default_rng(0).permutation(len(local))[:64]
        _same([stream.get_batch(order)], [local.get_batch(order)])
        ds = {
            name: grain.MapDataset.source(src).shuffle(seed=5).batch(8, drop_remainder=True)
            for name, src in (("local", local), ("stream", stream))
        }
        _same([ds["stream"][i] for i in range(len(ds["stream"]))], list(ds["local"]))
        state = stream.sample_source.cache_state()
        assert 0 < state["bytes"] <= limit and stream.sample_source.stats().max_held_bytes <= limit


class _Observed(GrainSource):
    """A streamed source whose records also carry the reading process's cache limit and
    the most it has held (module level: Grain's spawned workers unpickle it)."""

    def __getitem__(self, index):
        record = super().__getitem__(index)
        source = self.sample_source
        held = source.stats().max_held_bytes
        return {**record, "limit": np.int64(source.options.cache_bytes), "held": np.int64(held)}


def _limits(batches: list[dict]) -> tuple[set[int], int]:
    """The cache limits the records were read under and the most any reader held,
    taken out of ``batches``."""
    limits = {int(v) for b in batches for v in b.pop("limit")}
    return limits, max(int(b.pop("held").max()) for b in batches)


@pytest.mark.slow
def test_dataloader_workers_stream_their_records(published, source_cache):
    """Grain's DataLoader with 2 spawned worker processes (each unpickles the source and
    streams on its own: the pickle is the URL and options, not the data), shuffled and
    batched, then resumed from a checkpoint: the local source's batches. With
    ``worker_count=2`` each worker reads under half the cache limit and holds no more."""
    limit = 2_000_000
    stream = _Observed.from_stream(
        published, StreamOptions(cache_bytes=limit), policy=_FAST, worker_count=2
    )
    local = GrainSource(source_cache.result.cache_dir)
    assert len(pickle.dumps(stream)) < 2_000
    assert stream.sample_source.options.cache_bytes == limit  # this process: all of it

    def loader(src):
        sampler = grain.samplers.IndexSampler(
            num_records=len(src),
            shard_options=grain.sharding.ShardOptions(0, 1, drop_remainder=True),
            shuffle=True,
            num_epochs=1,
            seed=11,
        )
        return grain.DataLoader(
            data_source=src,
            sampler=sampler,
            operations=[grain.transforms.Batch(8, drop_remainder=True)],
            worker_count=2,
        )

    with local, stream:
        want = _copy(loader(local))
        got = _copy(loader(stream))
        limits, held = _limits(got)
        assert limits == {limit // 2} and 0 < held <= limit // 2
        _same(got, want)
        it = iter(loader(stream))
        head = _copy(next(it) for _ in range(5))
        state = it.get_state()
        del it
        resumed = iter(loader(stream))
        resumed.set_state(state)
        rest = head + _copy(resumed)
        assert _limits(rest)[0] == {limit // 2}
        _same(rest, want)


def test_per_record_reads_reuse_the_cache(published, source_cache):
    """Records read one at a time in row order: each block is fetched once while the
    cache holds a few blocks (least recently used dropped), not once per record; the
    limit is never passed, counted from the blocks held after every read."""
    limit = 400_000  # a few latent blocks plus the embeddings' and keys' blocks
    stream = GrainSource.from_stream(published, StreamOptions(cache_bytes=limit), policy=_FAST)
    local = GrainSource(source_cache.result.cache_dir)
    with local, stream:
        n = len(local)
        source = stream.sample_source
        source.reset_stats()
        for i in range(n):
            _same([stream[i]], [local[i]])
            state = source.cache_state()
            assert state["bytes"] + state["reserved_bytes"] <= limit, (i, state)
        stats = source.stats()
        # One request per distinct block at most (neighbours of one read may merge).
        assert stats.requests <= source.block_ids(np.arange(n)).size < n, stats
        assert stats.max_held_bytes <= limit


def test_from_stream_config_and_bad_urls(published, source_cache, tmp_path):
    cfg = config(
        source_cache.data,
        tmp_path / "empty-root",
        f"loader.stream_from={published}",
        "loader.stream_cache_bytes=0",
        "loader.crop=2",
        "loader.seed=6",
    )
    with (
        GrainSource.from_stream_config(cfg.loader, cfg.data) as stream,
        GrainSource(source_cache.result.cache_dir, crop=2, seed=6) as local,
    ):
        assert stream.crop == 2 and stream.seed == 6
        _same([stream.get_batch(range(0, 40, 3))], [local.get_batch(range(0, 40, 3))])
        assert stream.sample_source.cache_state()["bytes"] == 0  # 0: nothing kept
    assert not (tmp_path / "empty-root").exists()
    empty = config(source_cache.data, tmp_path / "r")
    with pytest.raises(ConfigError, match="loader.stream_from is empty"):
        GrainSource.from_stream_config(empty.loader)
    with pytest.raises(SourceError, match="does not exist"):
        GrainSource.from_stream(published[:-16] + "0" * 16, policy=_FAST)
    with pytest.raises(ValueError, match="crop"):
        GrainSource.from_stream(published, policy=_FAST, crop="middle")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="worker_count must be an integer >= 0"):
            GrainSource.from_stream(published, policy=_FAST, worker_count=bad)


def test_a_pickled_source_reads_under_its_workers_share(published, source_cache):
    """What Grain sends each worker (a pickle) reads the same records under
    ``cache_bytes // worker_count``; the source it was made from keeps the whole limit."""
    stream = GrainSource.from_stream(
        published, StreamOptions(cache_bytes=900_000), policy=_FAST, worker_count=3
    )
    with stream, GrainSource(source_cache.result.cache_dir) as local:
        with pickle.loads(pickle.dumps(stream)) as worker:
            _same([worker[i] for i in range(8)], [local[i] for i in range(8)])
            assert worker.sample_source.options.cache_bytes == 300_000
            assert 0 < worker.sample_source.stats().max_held_bytes <= 300_000
        assert stream.sample_source.options.cache_bytes == 900_000


def test_the_grain_guides_streaming_example_runs(published):
    """docs/guides/grain.md's streaming example (a ``py`` block: test_readme has no
    store), run against the published cache."""
    import re

    from tests.conftest import REPO

    text = (REPO / "docs" / "guides" / "grain.md").read_text()
    (block,) = re.findall(r"```py\n(.*?)```", text, flags=re.S)
    code = block.replace("gs://my-bucket/caches/demo-830ecc81071f30be", published)
    namespace = {"grain": grain}
    exec(compile(code, "docs/guides/grain.md", "exec"), namespace)  # noqa: S102
    with namespace["stream_src"]:
        assert namespace["stream_batch"]["latents"].shape[0] == 16
        assert namespace["one"]["latents"].ndim == 3
