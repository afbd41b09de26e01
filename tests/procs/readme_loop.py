"""README's training loop, as a user runs it under torchrun (RANK/WORLD_SIZE set).

``python readme_loop.py OUT [distributed]``: the loop over the built cache at
``$DEMO_CACHE`` (the session's), with ``distributed`` inside ``hf_pipeline.jax_distributed()``
as README shows it. Writes ``{"process": [index, count], "keys": [...]}`` to ``OUT``
(``{rank}`` replaced), or exits with the error line (code 2) as the scripts do.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys

import numpy as np


def main() -> int:
    out, *mode = sys.argv[1:]
    from hf_pipeline import Loader, UserError, jax_distributed, open_sample_source
    from hf_pipeline.cache.layout import CacheLayout

    joined = jax_distributed() if mode == ["distributed"] else contextlib.nullcontext()
    try:
        with joined:
            source = open_sample_source(CacheLayout(os.environ["DEMO_CACHE"]))
            with Loader(source, global_batch_size=16, seed=3) as loader:
                keys = [
                    np.asarray(batch["keys"]).tolist()
                    for batch in itertools.islice(loader.epochs(None), 4)
                ]
                layout = loader.layout
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with open(out.format(rank=os.environ["RANK"]), "w") as fh:
        json.dump({"process": [layout.process_index, layout.process_count], "keys": keys}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
