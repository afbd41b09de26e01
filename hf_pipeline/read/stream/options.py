"""How a streaming source reads ahead and what it may hold (:class:`StreamOptions`).

Apart from :mod:`hf_pipeline.read.stream.source` so that the config (which builds them
from ``loader.stream_*``) does not import the stores.
"""

from __future__ import annotations

import dataclasses

from hf_pipeline.read.sampler import check_number

__all__ = ["BOUNDS", "StreamOptions"]

#: Each option's range: ``(lo, hi)``, ``read_timeout``'s open at ``lo``. The config's
#: ``loader.stream_*`` fields have the same (test_stream checks: the config cannot
#: import this package, whose ``__init__`` imports the stores, which import the config).
BOUNDS: dict[str, tuple[float, float]] = {
    "ahead": (1, 1 << 20),
    "cache_bytes": (0, 1 << 50),
    "concurrency": (1, 1024),
    "coalesce_bytes": (0, 1 << 40),
    "max_read_bytes": (1, 1 << 40),
    "read_timeout": (0.0, 86400.0),
}

#: The names errors give the options: the config's field names where there is one.
_NAMES = {
    "ahead": "stream_ahead",
    "cache_bytes": "stream_cache_bytes",
    "concurrency": "stream_concurrency",
    "read_timeout": "stream_read_timeout",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamOptions:
    """How a :class:`StreamSource` reads ahead and what it may hold.

    Attributes:
        ahead: batches (steps) of this process planned and fetched ahead of the one
            being assembled. Reads start in refills of ``ahead / 2`` batches, merged:
            a block shuffle's window is few reads when a refill covers it (32: a
            default window, 4 x 4096 rows, is 16 batches of 1024). A refill that ends
            inside a window goes on to the window's end (its holes are the next
            batches' rows), up to ``ahead`` batches more, within ``cache_bytes``.
        cache_bytes: most bytes of blocks held between batches (prefetched or kept for
            reuse); 0 streams every batch on demand.
        concurrency: ranged reads in flight at once (64: 50 ms x 64 = ~1,300 reads/s,
            about what one process's HTTP client does on a core: see
            docs/guides/streaming.md).
        coalesce_bytes: neighbouring blocks of a file at most this many bytes apart
            are fetched in one read (the gap is read and dropped), while the gap is
            at most 1/8 of the blocks in the read (fetched stays within ~1.1x needed).
            A gap made of blocks the next ``ahead`` batches need is read whatever its
            size (within ``max_read_bytes`` and the room): they are kept for them.
        max_read_bytes: the largest single read (a long sequential run is cut there).
        read_timeout: seconds one read may take, stalls included, before it is retried
            (the retry policy's per-file timeout caps it): a store that stops answering
            is given up after ``(retries + 1) x read_timeout`` plus backoff, with a
            warning per retry, not after a whole file's download time.
    """

    ahead: int = 32
    cache_bytes: int = 1 << 30
    concurrency: int = 64
    coalesce_bytes: int = 1 << 20
    max_read_bytes: int = 16 << 20
    read_timeout: float = 30.0

    def __post_init__(self):
        for name, (lo, hi) in BOUNDS.items():
            integer = name != "read_timeout"
            check_number(
                getattr(self, name),
                _NAMES.get(name, name),
                lo,
                hi,
                integer=integer,
                lo_open=not integer,
            )

    def shared_by(self, processes: int) -> StreamOptions:
        """These options for one of ``processes`` processes that hold the cache limit
        together: ``cache_bytes // processes`` each (stream workers, DataLoader and Grain
        workers)."""
        return dataclasses.replace(self, cache_bytes=self.cache_bytes // processes)
