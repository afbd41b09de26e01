"""Small caches written as the build writes them, and sample sources over them.

Shared by the tests of ``mapped``, ``loader`` and ``torch_data``: :func:`build_cache`
writes the Arrow files with ``datasets`` (map/filter with ``num_proc``), and
:func:`open_source` maps them as a :class:`~hf_pipeline.read.mapped.SampleSource` for a
module-scoped fixture.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import datasets
import numpy as np

from hf_pipeline.read.mapped import SampleSource

REPO = Path(__file__).resolve().parents[2]

LATENT_SHAPE = (3, 4, 32, 32)


def build_cache(
    root,
    num_rows: int = 300,
    *,
    dtype: str = "float16",
    embed_dim: int = 8,
    num_proc: int = 2,
    writer_batch_size: int = 40,
    map_batch_size: int = 25,
    drop_every: int | None = 3,
    latent_shape=LATENT_SHAPE,
):
    """Write a cache like the build does (``datasets`` map/filter with ``num_proc``).

    Latent values encode (key, crop, position) so mix-ups show; keys are
    ``1000 + 7 * i`` so they differ from row ids. Rows whose key is a multiple of
    ``drop_every`` are filtered out (``None``: no filter, no indices files).
    ``dtype="bfloat16"`` stores the bits as uint16, as the build does, with the first
    values of each crop set to bfloat16 subnormals and values below float16's range.

    ``datasets`` forks its ``num_proc`` workers; once JAX (multithreaded) is imported
    in this process that may deadlock, so then the build runs in a fresh interpreter.

    Returns:
        ``(rows_files, embedding_files, indices_files or None)``.
    """
    root = str(root)
    kwargs = dict(
        num_rows=num_rows,
        dtype=dtype,
        embed_dim=embed_dim,
        num_proc=num_proc,
        writer_batch_size=writer_batch_size,
        map_batch_size=map_batch_size,
        drop_every=drop_every,
        latent_shape=list(latent_shape),
    )
    if "jax" in sys.modules:
        code = (
            "import json, sys; from tests.helpers.caches import build_cache; "
            "print(json.dumps(build_cache(sys.argv[1], **json.loads(sys.argv[2]))))"
        )
        result = subprocess.run(
            [sys.executable, "-c", code, root, json.dumps(kwargs)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        return tuple(json.loads(result.stdout.strip().splitlines()[-1]))
    latent_shape = tuple(latent_shape)

    def keep(k):
        return drop_every is None or k % drop_every != 0

    from hf_pipeline.cache.precision import arrow_dtype, numpy_dtype, to_arrow

    feats = datasets.Features(
        {
            "key": datasets.Value("int64"),
            "latents": datasets.Array4D(latent_shape, arrow_dtype(dtype)),
            "caption": datasets.Value("string"),
            "drop_reason": datasets.Value("string"),
        }
    )
    base = datasets.Dataset.from_dict({"i": np.arange(num_rows, dtype=np.int64)})
    size = int(np.prod(latent_shape[1:]))

    def rows_fn(batch):
        i = np.asarray(batch["i"], dtype=np.int64)
        key = 1000 + 7 * i
        crop = np.arange(latent_shape[0])[None, :, None]
        pos = np.arange(size)[None, None, :] % 61
        lat = (key[:, None, None] % 997) + crop * 0.25 + pos / 64
        if dtype == "bfloat16":
            # A bfloat16 subnormal, a value float16 would flush to zero, a negative zero.
            lat[:, :, :3] = [9.2e-41 * 3, -3e-8, -0.0]
        lat = lat.reshape(len(i), *latent_shape).astype(numpy_dtype(dtype))
        return {
            "key": key,
            "latents": to_arrow(lat),
            "caption": [f"caption {k}" for k in key],
            "drop_reason": ["" if keep(k) else "filtered" for k in key],
        }

    rows = base.map(
        rows_fn,
        batched=True,
        batch_size=map_batch_size,
        num_proc=num_proc,
        writer_batch_size=writer_batch_size,
        features=feats,
        remove_columns=["i"],
        cache_file_name=os.path.join(root, "converted", "rows", "data.arrow"),
    )

    def emb_fn(batch):
        key = np.asarray(batch["key"], dtype=np.int64)
        return {"embedding": (key[:, None] + np.arange(embed_dim) / 100).astype(np.float32)}

    emb = rows.map(
        emb_fn,
        batched=True,
        batch_size=map_batch_size,
        num_proc=num_proc,
        writer_batch_size=writer_batch_size,
        features=datasets.Features(
            {"embedding": datasets.List(datasets.Value("float32"), length=embed_dim)}
        ),
        remove_columns=rows.column_names,
        cache_file_name=os.path.join(root, "converted", "embeddings", "data.arrow"),
    )
    rows_files = [f["filename"] for f in rows.cache_files]
    emb_files = [f["filename"] for f in emb.cache_files]
    if drop_every is None:
        return rows_files, emb_files, None
    rows.filter(
        lambda b: [r == "" for r in b["drop_reason"]],
        batched=True,
        num_proc=num_proc,
        cache_file_name=os.path.join(root, "filtered", "indices.arrow"),
    )
    indices_files = sorted(glob.glob(os.path.join(root, "filtered", "indices*.arrow")))
    return rows_files, emb_files, indices_files


@contextlib.contextmanager
def open_source(root, num_rows: int, *, fingerprint: str, **cache_kw) -> Iterator[SampleSource]:
    """A :class:`SampleSource` over a fresh :func:`build_cache` of ``num_rows`` rows in ``root``.

    Closed when the block ends (a module fixture yields inside it).
    """
    files = build_cache(root, num_rows, **cache_kw)
    source = SampleSource(*files, fingerprint=fingerprint)
    try:
        yield source
    finally:
        source.close()


def copy_inputs(config, folder):
    """The demo inputs of ``config`` copied into a plain ``folder`` (outside the cache
    root): builds that must see the very same files (and so one fingerprint)."""
    import shutil

    from hf_pipeline.build.prepare import resolve_inputs

    inputs = resolve_inputs(config)
    folder.mkdir()
    for f in [*inputs.shards, inputs.metadata]:
        shutil.copy2(f.url, folder / f.name)
    return folder
