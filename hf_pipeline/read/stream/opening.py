"""The stream a config asks for (:func:`open_stream`): a
:class:`~hf_pipeline.read.stream.StreamSource` in this process, or with
``loader.stream_workers`` above 1 a :class:`~hf_pipeline.read.stream.StreamWorkers`.

Apart from both so that neither imports the other's module for it.
"""

from __future__ import annotations

from typing import Literal, overload

from hf_pipeline.errors import ConfigError
from hf_pipeline.read.stream.source import StreamSource
from hf_pipeline.read.stream.workers import StreamWorkers
from hf_pipeline.stores.retry import RetryPolicy

__all__ = ["open_stream"]


@overload
def open_stream(
    loader_config, data_config=None, *, workers: Literal[1]
) -> StreamSource: ...  # pragma: no cover


@overload
def open_stream(
    loader_config, data_config=None, *, workers: int | None = None
) -> StreamSource | StreamWorkers: ...  # pragma: no cover


def open_stream(
    loader_config, data_config=None, *, workers: int | None = None
) -> StreamSource | StreamWorkers:
    """The stream of the config: ``loader.stream_from`` with the ``loader.stream_*``
    options, and the ``data`` section's retries and per-read timeout (its defaults
    without ``data_config``). A :class:`StreamSource` (reads and gathers in this
    process), or with ``loader.stream_workers`` above 1 a :class:`StreamWorkers` (in
    that many worker
    processes, ``loader.prefetch + 1`` batches of shared memory), for the JAX
    :class:`~hf_pipeline.read.loader.Loader`.

    Args:
        workers: the worker processes instead of ``loader.stream_workers`` (1: a
            StreamSource; the torch and Grain adapters ask for it: their own worker
            processes each open one).

    Raises:
        ConfigError: ``loader.stream_from`` is empty.
        SourceError, StoreUnreachableError, CacheFormatError: as :class:`StreamSource`.
        WorkerExitedError, TimeoutError: as :class:`StreamWorkers`.
    """
    if not loader_config.stream_from:
        raise ConfigError(
            "loader.stream_from is empty: set it to a published cache folder "
            "(gs://<bucket>/<prefix>/<name>-<fingerprint>), or open the local cache",
            field="loader.stream_from",
        )
    policy = None if data_config is None else RetryPolicy.from_config(data_config)
    if workers is None:
        workers = loader_config.stream_workers
    if workers > 1:
        return StreamWorkers(
            loader_config.stream_from,
            loader_config.stream_options(),
            workers=workers,
            slots=loader_config.prefetch + 1,
            policy=policy,
        )
    return StreamSource(loader_config.stream_from, loader_config.stream_options(), policy=policy)
