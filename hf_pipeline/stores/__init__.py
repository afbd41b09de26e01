"""The storage backends: where raw files live (a local folder/glob, ``hf://datasets/...``
or ``gs://...``) and where caches are published (``gs://...``, ``hf://datasets/...``).

One interface, :class:`Source`, from :func:`open_source`::

    src = open_source("gs://bucket/prefix", data_config=cfg.data)
    shards = src.list_shards()          # [RemoteFile], natural-sorted by numeric range
    meta = src.find_metadata(cfg.data.metadata)
    fingerprint_inputs = src.identity()  # [(name, size, etag)]
    meta_path = src.fetch_one(meta)      # local verified copy

and, for publishing, one interface, :class:`Store`, from :func:`open_store`::

    store = open_store("gs://bucket/caches", data_config=cfg.data)
    store.list_files(cache_name)         # {rel: RemoteFile}
    store.upload(cache_name, data, tail, workers=8)

One module per kind of store, with both its read and its write side, on one base:

* :mod:`~hf_pipeline.stores.base`: the :class:`Source` and :class:`Store` interfaces
  (the hooks a kind implements are listed there), listing rules, :func:`natural_key`,
  and the scheme lookups (:func:`make_source`, :func:`store_class`).
* :mod:`~hf_pipeline.stores.local`: :class:`LocalSource` (read in place; no write side).
* :mod:`~hf_pipeline.stores.gcs`: :class:`GCSSource`, :class:`GCSStore` (gcsfs).
* :mod:`~hf_pipeline.stores.hub`: :class:`HubSource`, :class:`HubStore`
  (huggingface_hub) and :func:`resolve_hub_commit`.
* :mod:`~hf_pipeline.stores.factory`: :func:`open_source` (with the local mirror) and
  :func:`open_store`.

Shard bytes are fetched through :mod:`hf_pipeline.stores.fetch` (``ShardFetcher`` in the
parent, ``StagingClient`` in ``datasets.map`` workers), which stages them with
:mod:`hf_pipeline.stores.staging` through each source's ``read_range``. The real stores are
reached only through their own client libraries: gcsfs for GCS, huggingface_hub
(``HfApi``, ``hf_hub_download`` and its HTTP session) for the Hub.

Environment (read at call time, through :mod:`hf_pipeline.config`):
``STORAGE_EMULATOR_HOST`` (GCS emulator), ``HF_ENDPOINT``, ``HF_HUB_OFFLINE``,
``HF_HUB_CACHE``/``HF_HOME``.
"""

# Every kind is imported here (one line each: the dispatch), so that make_source and
# store_class know them all whichever module of the package is imported first.
from hf_pipeline.stores.base import (
    PublishLocation,
    Source,
    Store,
    Upload,
    make_source,
    natural_key,
    parse_location,
    store_class,
)
from hf_pipeline.stores.factory import open_source, open_store
from hf_pipeline.stores.gcs import GCSSource, GCSStore
from hf_pipeline.stores.hub import HubSource, HubStore, resolve_hub_commit
from hf_pipeline.stores.local import LocalSource
from hf_pipeline.stores.remote_file import RemoteFile

__all__ = [
    "GCSSource",
    "GCSStore",
    "HubSource",
    "HubStore",
    "LocalSource",
    "PublishLocation",
    "RemoteFile",
    "Source",
    "Store",
    "Upload",
    "make_source",
    "natural_key",
    "open_source",
    "open_store",
    "parse_location",
    "resolve_hub_commit",
    "store_class",
]
