"""How a streaming source reads ahead and what it may hold (:class:`StreamOptions`).

Apart from :mod:`hf_pipeline.read.stream.source` so that the config (which builds them
from ``loader.stream_*``) does not import the stores.
"""

from __future__ import annotations

import dataclasses

from hf_pipeline.read.sampler import OptionError, check_at_least

__all__ = ["StreamOptions"]


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
        check_at_least(self.ahead, 1, "stream_ahead")
        check_at_least(self.cache_bytes, 0, "stream_cache_bytes")
        check_at_least(self.concurrency, 1, "stream_concurrency")
        check_at_least(self.coalesce_bytes, 0, "coalesce_bytes")
        check_at_least(self.max_read_bytes, 1, "max_read_bytes")
        if not self.read_timeout > 0:  # NaN too
            raise OptionError("stream_read_timeout", f"must be > 0, got {self.read_timeout!r}")
