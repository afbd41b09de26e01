"""One rank of a short training run, launched as ``torchrun`` launches ``train.py``.

``train_rank.py OUT.json OVERRIDE...``: joins ``jax.distributed`` exactly as
``scripts/train.py`` does (:func:`hf_pipeline.trainer.loop.jax_distributed`, from the
launcher's variables), finds the cache, takes ``train.steps`` steps of the trainer's own
step function on the trainer's loader (as :func:`hf_pipeline.trainer.loop.train` does), and
writes ``{rank, process_count, params}``: a digest of this rank's copy of the parameters.
Without a joined job each rank would train its own model on its half of every batch.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    out, overrides = sys.argv[1], sys.argv[2:]
    from dist.env import detect
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.cache.layout import open_sample_source
    from hf_pipeline.config import load_config
    from hf_pipeline.trainer.loop import jax_distributed

    cfg = load_config(None, overrides)
    process = detect()
    with jax_distributed(process):
        import jax
        import numpy as np
        from jax.sharding import Mesh

        from hf_pipeline.read.loader import Loader
        from hf_pipeline.trainer.denoiser import init_params, make_optimizer, make_train_step

        result = prepare_cache(cfg, process=process, progress=False)
        with open_sample_source(result.layout, result.fingerprint) as source:
            if jax.process_count() > 1:  # as train() does
                mesh = Mesh(np.array(jax.devices()), ("data",))
                loader = Loader.from_config(source, cfg.loader, mesh=mesh)
            else:
                loader = Loader.from_config(
                    source, cfg.loader, process_index=process.rank,
                    process_count=process.world_size,
                )  # fmt: skip
            t = cfg.train
            optimizer = make_optimizer(t.learning_rate, t.steps)
            params = init_params(jax.random.PRNGKey(t.seed), source.embed_dim, t.hidden)
            opt_state = optimizer.init(params)
            step_fn = make_train_step(optimizer)
            key = jax.random.PRNGKey(t.seed + 1)
            with loader:
                batches = loader.epochs(None)
                for step in range(t.steps):
                    params, opt_state, _ = step_fn(
                        params, opt_state, next(batches), jax.random.fold_in(key, step)
                    )
            digest = hashlib.sha256()
            for leaf in jax.tree_util.tree_leaves(params):
                # This process's own copy (replicated over the job's devices when joined).
                digest.update(np.asarray(leaf.addressable_data(0)).tobytes())
            record = {"rank": process.rank, "process_count": jax.process_count(),
                      "params": digest.hexdigest()}  # fmt: skip
            del params, opt_state, leaf, batches  # no array outlives the jax.distributed block
    import os

    Path(out.format(rank=os.environ.get("RANK", "0"))).write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
