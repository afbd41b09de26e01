"""Opening a shard location: the right kind of source, or the local mirror."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from hf_pipeline.errors import StoreUnreachableError
from hf_pipeline.stores.base import Source, make_source
from hf_pipeline.stores.local import LocalSource

if TYPE_CHECKING:  # pragma: no cover
    from hf_pipeline.config import DataConfig
    from hf_pipeline.stores.retry import RetryPolicy

__all__ = ["open_source"]

logger = logging.getLogger(__name__)


def open_source(
    location: str,
    *,
    data_config: DataConfig,
    policy: RetryPolicy | None = None,
    staging_dir: str | os.PathLike | None = None,
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
            ``<cache root>/staging/<hash of location>``).

    Returns:
        A :class:`~hf_pipeline.stores.Source`.

    Raises:
        SourceError: bad location.
        StoreUnreachableError: unreachable (after retries) without a mirror.
    """
    src = make_source(location, data_config=data_config, policy=policy, staging_dir=staging_dir)
    if src.is_local or not data_config.local_mirror:
        return src
    try:
        src.list_shards()
    except StoreUnreachableError as err:
        mirror = data_config.local_mirror
        logger.warning(
            "%s is unreachable (%s); using the local mirror %s", location, err.reason, mirror
        )
        local = LocalSource(mirror, data_config=data_config, policy=policy, staging_dir=staging_dir)
        local.fetch_stats = src.fetch_stats  # the retries that led here are reported too
        return local
    return src
