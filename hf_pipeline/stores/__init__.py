"""Where raw files live: a local folder/glob, ``hf://datasets/...`` or ``gs://...``.

One interface, :class:`Source`, from :func:`open_source`::

    src = open_source("gs://bucket/prefix", data_config=cfg.data)
    shards = src.list_shards()          # [RemoteFile], natural-sorted by numeric range
    meta = src.find_metadata(cfg.data.metadata)
    fingerprint_inputs = src.identity()  # [(name, size, etag)]
    meta_path = src.fetch_one(meta)      # local verified copy

One module per kind of store, on one base:

* :mod:`~hf_pipeline.stores.base`: the :class:`Source` interface (the hooks a kind
  implements are listed there), listing rules, :func:`natural_key`.
* :mod:`~hf_pipeline.stores.local`: :class:`LocalSource` (read in place).
* :mod:`~hf_pipeline.stores.gcs`: :class:`GCSSource` (gcsfs).
* :mod:`~hf_pipeline.stores.hub`: :class:`HubSource` (huggingface_hub) and
  :func:`resolve_hub_commit`.
* :mod:`~hf_pipeline.stores.factory`: :func:`open_source` (with the local mirror).

Shard bytes are fetched through :mod:`hf_pipeline.stores.fetch` (``ShardFetcher`` in the
parent, ``StagingClient`` in ``datasets.map`` workers), which stages them with
:mod:`hf_pipeline.stores.staging` through each source's ``read_range``. The real stores are
reached only through their own client libraries: gcsfs for GCS, huggingface_hub
(``HfApi``, ``hf_hub_download`` and its HTTP session) for the Hub.

Environment (read at call time, through :mod:`hf_pipeline.config`):
``STORAGE_EMULATOR_HOST`` (GCS emulator), ``HF_ENDPOINT``, ``HF_HUB_OFFLINE``,
``HF_HUB_CACHE``/``HF_HOME``.
"""

# Every kind is imported here, so that make_source knows them all whichever module
# of the package is imported first.
from hf_pipeline.stores.base import Source, make_source, natural_key
from hf_pipeline.stores.factory import open_source
from hf_pipeline.stores.gcs import GCSSource
from hf_pipeline.stores.hub import HubSource, resolve_hub_commit
from hf_pipeline.stores.local import LocalSource
from hf_pipeline.stores.remote_file import RemoteFile

__all__ = [
    "GCSSource",
    "HubSource",
    "LocalSource",
    "RemoteFile",
    "Source",
    "make_source",
    "natural_key",
    "open_source",
    "resolve_hub_commit",
]
