# ruff: noqa: F811 - pytest fixtures imported from tests.test_stream are parameters here
"""How long a streamed epoch's reads are (hf_pipeline.read.stream): a block-shuffled
epoch whose windows straddle the planner's refills is read in about one read per run of
a window's rows, not in one short read per checksum block of the straddling windows."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hf_pipeline.read.loader import Loader
from hf_pipeline.read.stream import StreamOptions, StreamSource
from tests.test_stream import (  # noqa: F401
    _FAST,
    gcs_cache,
    gcs_store,
)

pytestmark = pytest.mark.remote


def _windows(loader: Loader, block_size: int) -> list[np.ndarray]:
    """The epoch's rows, one array per block-shuffle window, from the sample order: a
    window ends where every block whose rows it began has all its rows (``window_blocks``
    blocks of ``block_size`` rows are shuffled together; a finer split is possible and
    only makes more groups)."""
    rows = np.concatenate([r for _, r in loader._planned(0, 0, 1)])
    last: dict[int, int] = {}
    for p, r in enumerate(rows.tolist()):
        last[r // block_size] = p
    out, start, end = [], 0, -1
    for p, r in enumerate(rows.tolist()):
        end = max(end, last[r // block_size])
        if p == end:
            out.append(rows[start : p + 1])
            start = p + 1
    return out


def _epoch_stats(url: str, shuffle: str):
    """``(stats, fewest)`` of one streamed epoch, a training step of 40 ms per batch
    (the planner refills as the consumer goes); fewest: the reads of fetching each
    block-shuffle window's rows at once (block shuffle only)."""
    block_size = 32
    kw = {
        "global_batch_size": 16,
        "seed": 3,
        "num_threads": 2,
        "crop": 0,
        "shuffle": shuffle,
        "block_size": block_size,
        "window_blocks": 4,
        "process_index": 0,
        "process_count": 1,
    }
    options = StreamOptions(cache_bytes=256 << 20, ahead=8, coalesce_bytes=100_000)
    with StreamSource(url, options, policy=_FAST) as stream:
        loader = Loader(stream, **kw)
        fewest = None
        if shuffle == "block":
            fewest = sum(
                len(stream._runs(stream.block_ids(w).tolist(), count=False))
                for w in _windows(loader, block_size)
            )
        stream.reset_stats()
        for _ in loader:
            time.sleep(0.04)
        return stream.stats(), fewest


def test_windows_that_straddle_refills_are_read_in_long_runs(gcs_cache):
    """Block shuffle, windows of 4 batches (4 blocks of 16 rows), refills of 8 batches
    (``ahead`` 16): 2 windows a refill, but the epoch's last block is short (the rows
    are not a multiple of 16) and every window after it is shifted off the batches, so
    each refill ends inside a window. The refill that ends there started the reads of a
    scattered share of that window's rows: one short read per checksum block, the gaps
    between them (rows of the window's next batches) more than 1/8 of the read; and
    the next refill read the rest as one short read per hole. On the H200 host (96k
    rows, batch and block 1024) 3,098 reads of 0.81 MB an epoch, 2,685 of them cut at
    such a gap (``read_cuts["gap_share"]``). Now a gap made of blocks the next
    batches need is read with the run (those blocks are kept for them): at most 1.5x
    the reads of fetching each window at once, and bytes fetched within 1.1x of the
    rows' bytes. Before: {before}; after: {after}."""
    _, url = gcs_cache
    stats, fewest = _epoch_stats(url, "block")
    print(
        stats.requests,
        fewest,
        stats.read_cuts,
        stats.bytes_fetched / stats.bytes_needed,
        stats.flushes,
        stats.flush_blocks,
        stats.completed_batches,
        stats.planned_blocks,
    )
    assert stats.demand_blocks == 0, stats
    assert stats.requests <= 1.5 * fewest + 2, (stats, fewest)
    assert stats.bytes_fetched <= 1.1 * stats.bytes_needed, stats


def test_a_global_shuffle_fetches_no_more_than_before(gcs_cache):
    """The same epoch globally shuffled: the bytes fetched per byte needed are not
    worse than before this change (gaps of blocks the next batches need are read, and
    kept for them; others are not): before {before}, after {after}."""
    _, url = gcs_cache
    stats, _ = _epoch_stats(url, "global")
    print(stats.requests, stats.read_cuts, stats.bytes_fetched / stats.bytes_needed)
    assert stats.bytes_fetched <= 1.2 * stats.bytes_needed, stats
