"""One rank of the streaming test: the Loader of ``loader.stream_from`` (from the
environment, ``HF_PIPELINE_STREAM_FROM``), one epoch of this rank's share, no local
cache. Prints one JSON line: each batch's keys and a sha256 of its latents' and
embeddings' bytes.

Rank and world size come from RANK/WORLD_SIZE like under torchrun; more config as
``--set`` overrides after the script name.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np


def main() -> None:
    from dist.env import detect
    from hf_pipeline.config import load_config
    from hf_pipeline.read.loader import Loader
    from hf_pipeline.read.stream import open_stream

    cfg = load_config(None, sys.argv[1:])
    process = detect()
    batches = []
    with (
        open_stream(cfg.loader, cfg.data) as source,
        Loader.from_config(
            source, cfg.loader, process_index=process.rank, process_count=process.world_size
        ) as loader,
    ):
        for batch in loader:
            h = hashlib.sha256()
            for name in ("latents", "embeddings"):
                h.update(np.ascontiguousarray(np.asarray(batch[name])).tobytes())
            batches.append({"keys": np.asarray(batch["keys"]).tolist(), "sha": h.hexdigest()})
    print(json.dumps({"rank": process.rank, "batches": batches}))


if __name__ == "__main__":
    main()
