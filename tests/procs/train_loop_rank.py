"""One rank of a checkpointed run of the trainer itself, launched as ``torchrun`` would.

``train_loop_rank.py OUT.json OVERRIDE...``: joins ``jax.distributed`` as
``scripts/train.py`` does, runs :func:`hf_pipeline.trainer.loop.train` (which resumes
from ``train.checkpoint`` when it holds a step), and writes ``{rank, process_count,
steps, losses, params}``: the logged ``[step, loss]`` pairs and a digest of this rank's
copy of the parameters after the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    out, overrides = sys.argv[1], sys.argv[2:]
    from dist.env import detect
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.cache.layout import open_sample_source
    from hf_pipeline.config import load_config
    from hf_pipeline.trainer.loop import jax_distributed, train

    cfg = load_config(None, overrides)
    process = detect()
    with jax_distributed(process):
        import jax
        import numpy as np

        result = prepare_cache(cfg, process=process, progress=False)
        with open_sample_source(result.layout, result.fingerprint) as source:
            got = train(
                cfg, source, process_index=process.rank, process_count=process.world_size,
                keep_params=True,
            )  # fmt: skip
        digest = hashlib.sha256()
        for leaf in jax.tree_util.tree_leaves(got.params):
            # This process's own copy (replicated over the job's devices when joined).
            digest.update(np.asarray(leaf.addressable_data(0)).tobytes())
        record = {"rank": process.rank, "process_count": jax.process_count(),
                  "steps": got.steps, "params": digest.hexdigest(),
                  "losses": [[r["step"], r["loss"]] for r in got.history]}  # fmt: skip
        del got, leaf  # no array outlives the jax.distributed block
    Path(out.format(rank=os.environ.get("RANK", "0"))).write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
