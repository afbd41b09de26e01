"""Opening a location: a shard location's source (or the local mirror), a publish
location's store.

Which kind serves a URL is decided by its scheme, which each kind declares on its class
(``class GCSSource(Source, scheme="gs://")``, ``class GCSStore(Store, scheme="gs://")``)
and :func:`~hf_pipeline.stores.base.make_source` /
:func:`~hf_pipeline.stores.base.store_class` look up; :mod:`hf_pipeline.stores` imports
every kind's module, so each is known whichever module is imported first.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from hf_pipeline.errors import StoreUnreachableError
from hf_pipeline.stores.base import (
    PublishLocation,
    Source,
    Store,
    make_source,
    parse_location,
    store_class,
)
from hf_pipeline.stores.local import LocalSource
from hf_pipeline.stores.retry import RetryPolicy

if TYPE_CHECKING:  # pragma: no cover
    from hf_pipeline.config import DataConfig

__all__ = ["open_source", "open_store"]

logger = logging.getLogger(__name__)


def open_source(
    location: str,
    *,
    data_config: DataConfig,
    policy: RetryPolicy | None = None,
    staging_dir: str | os.PathLike | None = None,
    staging_base: str | os.PathLike | None = None,
) -> Source:
    """Open a shard location: local folder/glob, ``hf://datasets/...`` or ``gs://...``.

    A remote source is listed right away. If that fails with a transient error
    (unreachable, timeouts, 5xx after retries) and ``data_config.local_mirror`` is set,
    the mirror folder is used instead and a warning line says so.

    Args:
        location: where the shards are.
        data_config: retries, timeouts, staging and mirror settings.
        policy: override the retry policy (tests use short backoffs).
        staging_dir: override the staging folder (default ``data.staging_dir``, else
            ``<cache root>/.staging/<hash of location>``).
        staging_base: the user's folder ``staging_dir`` lies in (the cache root for
            ``<root>/.staging/<key>``; default ``staging_dir`` itself): the folders
            below it are hf_pipeline's and are never followed as symlinks.

    Returns:
        A :class:`~hf_pipeline.stores.Source`.

    Raises:
        SourceError: bad location.
        StoreUnreachableError: unreachable (after retries) without a mirror.
    """
    src = make_source(
        location,
        data_config=data_config,
        policy=policy,
        staging_dir=staging_dir,
        staging_base=staging_base,
    )
    if src.is_local or not data_config.local_mirror:
        return src
    try:
        src.list_shards()
    except StoreUnreachableError as err:
        mirror = data_config.local_mirror
        logger.warning(
            "%s is unreachable (%s); using the local mirror %s", location, err.reason, mirror
        )
        local = LocalSource(
            mirror,
            data_config=data_config,
            policy=policy,
            staging_dir=staging_dir,
            staging_base=staging_base,
        )
        local.fetch_stats = src.fetch_stats  # the retries that led here are reported too
        return local
    return src


def open_store(
    url: str | PublishLocation, *, data_config: DataConfig, policy: RetryPolicy | None = None
) -> Store:
    """The :class:`~hf_pipeline.stores.base.Store` of a publish location; no I/O yet.

    Raises:
        SourceError: a malformed URL, or a scheme no kind of store serves.
    """
    location = url if isinstance(url, PublishLocation) else parse_location(url)
    cls = store_class(location.url)
    policy = policy or RetryPolicy.from_config(data_config)
    # The source only reads (by range); it never stages into its own folder here.
    source = make_source(
        cls.source_location(location),
        data_config=data_config,
        policy=policy,
        staging_dir=Path(tempfile.gettempdir()),
    )
    return cls(location, source, policy)
