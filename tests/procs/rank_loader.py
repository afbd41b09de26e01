"""One rank of the multi-rank test: build-or-wait, then read one epoch of its slices.

Rank and world size come from RANK/WORLD_SIZE like under torchrun. Writes a JSON
result to the path given first (``{rank}`` in it is replaced by this rank): whether this process built (or
pulled) the cache, the fingerprint, a content hash of the cache as
this rank reads it, and the keys of its share of every global batch.
``RANK_LOADER_START_DELAY`` (seconds) makes this rank start that much later (a rank
whose host is slow: the others must not count its parts wrong).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np


def main() -> None:
    out_path, *overrides = sys.argv[1:]
    time.sleep(float(os.environ.get("RANK_LOADER_START_DELAY", "0")))
    from dist.env import detect
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config

    cfg = load_config(None, overrides)
    process = detect()
    res = prepare_cache(cfg, process=process, progress=False)

    from hf_pipeline.cache.layout import open_sample_source
    from hf_pipeline.read.loader import Loader

    src = open_sample_source(res.layout, res.fingerprint)
    everything = src.gather(np.arange(src.num_rows), 0)
    h = hashlib.sha256()
    for name in ("keys", "latents", "embeddings"):
        h.update(np.ascontiguousarray(everything[name]).tobytes())
    batches = []
    with Loader.from_config(
        src, cfg.loader, process_index=process.rank, process_count=process.world_size
    ) as loader:
        for batch in loader:
            batches.append(np.asarray(batch["keys"]).tolist())
    with open(out_path.format(rank=process.rank), "w") as fh:
        json.dump(
            {
                "rank": process.rank,
                "built": res.built,
                "pulled": res.pulled,
                "fingerprint": res.fingerprint,
                "content": h.hexdigest(),
                "batches": batches,
            },
            fh,
        )


if __name__ == "__main__":
    main()
