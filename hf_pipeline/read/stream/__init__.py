"""Reading a published cache in place: the stream index publish writes, and the source
that reads rows by verified ranged reads (docs/guides/streaming.md)."""

from hf_pipeline.read.stream.index import (
    DEFAULT_BLOCK_BYTES,
    StreamIndex,
    build_stream_index,
)
from hf_pipeline.read.stream.options import StreamOptions
from hf_pipeline.read.stream.source import StreamSource, StreamStats, open_stream

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "StreamIndex",
    "StreamOptions",
    "StreamSource",
    "StreamStats",
    "build_stream_index",
    "open_stream",
]
