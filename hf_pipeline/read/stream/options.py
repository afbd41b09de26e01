"""How a streaming source reads ahead and what it may hold (:class:`StreamOptions`).

Apart from :mod:`hf_pipeline.read.stream.source` so that the config (which builds them
from ``loader.stream_*``) does not import the stores.
"""

from __future__ import annotations

import dataclasses

from hf_pipeline.read.sampler import check_at_least

__all__ = ["StreamOptions"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamOptions:
    """How a :class:`StreamSource` reads ahead and what it may hold.

    Attributes:
        ahead: batches (steps) of this process planned and fetched ahead of the one
            being assembled.
        cache_bytes: most bytes of blocks held between batches (prefetched or kept for
            reuse); 0 streams every batch on demand.
        concurrency: ranged reads in flight at once.
        coalesce_bytes: neighbouring blocks of a file at most this many bytes apart
            are fetched in one read (the gap is read and dropped).
        max_read_bytes: the largest single read (a long sequential run is cut there).
    """

    ahead: int = 8
    cache_bytes: int = 1 << 30
    concurrency: int = 16
    coalesce_bytes: int = 64 << 10
    max_read_bytes: int = 16 << 20

    def __post_init__(self):
        check_at_least(self.ahead, 1, "stream_ahead")
        check_at_least(self.cache_bytes, 0, "stream_cache_bytes")
        check_at_least(self.concurrency, 1, "stream_concurrency")
        check_at_least(self.coalesce_bytes, 0, "coalesce_bytes")
        check_at_least(self.max_read_bytes, 1, "max_read_bytes")
