"""hf_pipeline: raw latent shards + captions -> shared memory-mapped datasets cache -> JAX.

The public API is what this module exports (``__all__``): import it from here,
``from hf_pipeline import prepare_cache, open_sample_source, Loader``. The modules behind
it may move between releases; these names do not.

Names load on first use (PEP 562), so ``import hf_pipeline`` stays cheap: importing it
does not import torch, JAX or ``datasets`` until a name that needs them is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hf_pipeline.config import Config, load_config
from hf_pipeline.errors import (
    CacheFormatError,
    ConfigError,
    CorruptShardError,
    MetadataError,
    SourceError,
    StoreUnreachableError,
    UserError,
)
from hf_pipeline.workers.persistent import WorkerExitedError

#: Public name -> the module that defines it (loaded on first use).
_LAZY: dict[str, str] = {
    # build: find, pull or build the cache (every rank calls it; one builds)
    "BuildResult": "hf_pipeline.build.prepare",
    "prepare_cache": "hf_pipeline.build.prepare",
    # the cache on disk, opened read-only
    "CacheLayout": "hf_pipeline.cache.layout",
    "open_dataset": "hf_pipeline.cache.layout",
    "dataset_view_dir": "hf_pipeline.cache.layout",
    "open_sample_source": "hf_pipeline.cache.layout",
    "SampleSource": "hf_pipeline.read.mapped",
    # batches: the global order and the JAX loader
    "GlobalSampler": "hf_pipeline.read.sampler",
    "SamplerOptions": "hf_pipeline.read.sampler",
    "Loader": "hf_pipeline.read.loader",
    "LoaderOptions": "hf_pipeline.read.loader",
    # other clients
    "TorchBatches": "hf_pipeline.adapters.torch_data",
    "TorchSamples": "hf_pipeline.adapters.torch_data",
    "torch_loader": "hf_pipeline.adapters.torch_data",
    "LatentDataModule": "hf_pipeline.adapters.torch_data",
    "GrainSource": "hf_pipeline.adapters.grain_source",
    # read a published cache in place
    "StreamOptions": "hf_pipeline.read.stream",
    "StreamSource": "hf_pipeline.read.stream",
    "StreamWorkers": "hf_pipeline.read.stream",
    "open_stream": "hf_pipeline.read.stream",
    # publish once, pull anywhere
    "publish_cache": "hf_pipeline.publish.upload",
    "PublishReport": "hf_pipeline.publish.upload",
    # the demo data and the demo trainer
    "generate_demo": "hf_pipeline.demo.generate",
    "DemoData": "hf_pipeline.demo.generate",
    "train": "hf_pipeline.trainer.loop",
    "shutdown_jax_distributed": "hf_pipeline.trainer.loop",
    "jax_distributed": "hf_pipeline.trainer.loop",
    # coordination errors every rank may see
    "BuildFailedError": "dist.errors",
    "CacheWaitTimeout": "dist.errors",
    "ForeignCacheFolderError": "dist.errors",
    "ReadOnlyCacheError": "dist.errors",
}

__all__ = [
    "BuildFailedError",
    "BuildResult",
    "CacheFormatError",
    "CacheLayout",
    "CacheWaitTimeout",
    "Config",
    "ConfigError",
    "CorruptShardError",
    "DemoData",
    "ForeignCacheFolderError",
    "GlobalSampler",
    "GrainSource",
    "LatentDataModule",
    "Loader",
    "LoaderOptions",
    "MetadataError",
    "PublishReport",
    "ReadOnlyCacheError",
    "SampleSource",
    "SamplerOptions",
    "SourceError",
    "StoreUnreachableError",
    "StreamOptions",
    "StreamSource",
    "StreamWorkers",
    "TorchBatches",
    "TorchSamples",
    "UserError",
    "WorkerExitedError",
    "dataset_view_dir",
    "generate_demo",
    "jax_distributed",
    "load_config",
    "open_dataset",
    "open_sample_source",
    "open_stream",
    "prepare_cache",
    "publish_cache",
    "shutdown_jax_distributed",
    "torch_loader",
    "train",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # what the names are, for type checkers and IDEs
    from dist.errors import (
        BuildFailedError,
        CacheWaitTimeout,
        ForeignCacheFolderError,
        ReadOnlyCacheError,
    )
    from hf_pipeline.adapters.grain_source import GrainSource
    from hf_pipeline.adapters.torch_data import (
        LatentDataModule,
        TorchBatches,
        TorchSamples,
        torch_loader,
    )
    from hf_pipeline.build.prepare import BuildResult, prepare_cache
    from hf_pipeline.cache.layout import (
        CacheLayout,
        dataset_view_dir,
        open_dataset,
        open_sample_source,
    )
    from hf_pipeline.demo.generate import DemoData, generate_demo
    from hf_pipeline.publish.upload import PublishReport, publish_cache
    from hf_pipeline.read.loader import Loader, LoaderOptions
    from hf_pipeline.read.mapped import SampleSource
    from hf_pipeline.read.sampler import GlobalSampler, SamplerOptions
    from hf_pipeline.read.stream import StreamOptions, StreamSource, StreamWorkers, open_stream
    from hf_pipeline.trainer.loop import jax_distributed, shutdown_jax_distributed, train
