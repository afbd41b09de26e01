"""Reading a published cache in place: the stream index publish writes, the source
that reads rows by verified ranged reads, and the same in worker processes
(docs/guides/streaming.md)."""

from hf_pipeline.read.stream.index import (
    DEFAULT_BLOCK_BYTES,
    StreamIndex,
    build_stream_index,
)
from hf_pipeline.read.stream.opening import open_stream
from hf_pipeline.read.stream.options import StreamOptions
from hf_pipeline.read.stream.source import StreamSource, StreamStats
from hf_pipeline.read.stream.workers import StreamWorkers

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "StreamIndex",
    "StreamOptions",
    "StreamSource",
    "StreamStats",
    "StreamWorkers",
    "build_stream_index",
    "open_stream",
]
