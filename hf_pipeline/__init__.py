"""hf_pipeline: raw latent shards + captions -> shared memory-mapped datasets cache -> JAX."""

from hf_pipeline.config import Config, load_config
from hf_pipeline.errors import (
    ConfigError,
    CorruptShardError,
    MetadataError,
    SourceError,
    UserError,
)

__all__ = [
    "Config",
    "ConfigError",
    "CorruptShardError",
    "MetadataError",
    "SourceError",
    "UserError",
    "load_config",
]
__version__ = "0.1.0"
