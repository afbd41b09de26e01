"""The latent data format, in one place: the shape of a sample and the float dtypes.

Imported by the config (which validates ``build.latent_dtype``,
``encoder.output_dtype`` and crop indices), the shard reader and the precision helpers;
it imports nothing of the package.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "EMBEDDING_DTYPES",
    "LATENT_DTYPES",
    "LATENT_SHAPE",
    "STORAGE_DTYPES",
    "EmbeddingDtype",
    "LatentDtype",
    "StorageDtype",
]

#: Shape of one sample's latents: 3 crops x 4 channels x 32 x 32.
LATENT_SHAPE: tuple[int, int, int, int] = (3, 4, 32, 32)

#: Float dtypes of latents (in shards and in the cache) and of encoder compute.
StorageDtype = Literal["float32", "float16", "bfloat16"]
STORAGE_DTYPES: tuple[str, ...] = get_args(StorageDtype)
#: ``build.latent_dtype``: ``"source"`` keeps each shard's own dtype bit for bit (the
#: default); a named dtype converts to it, lossy or not (the build report says).
LatentDtype = Literal["source", StorageDtype]
LATENT_DTYPES: tuple[str, ...] = get_args(LatentDtype)
#: Float dtypes of the caption embeddings in the cache (``encoder.output_dtype``).
EmbeddingDtype = Literal["float32", "float16"]
EMBEDDING_DTYPES: tuple[str, ...] = get_args(EmbeddingDtype)
