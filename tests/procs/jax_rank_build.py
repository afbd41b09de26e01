"""One rank of a JAX job that builds caches the way a training script does: JAX first.

Usage: ``jax_rank_build.py OUT ROUNDS [overrides...]`` with RANK/WORLD_SIZE and
JAX_COORDINATOR_ADDRESS set. Joins ``jax.distributed`` through
:func:`hf_pipeline.trainer.loop.jax_distributed`, starts JAX's CPU backend (which arms JAX's
own at-fork warning) and runs one small cross-process computation, then calls
``prepare_cache`` ROUNDS times, each for a new demo seed (a new fingerprint: rank 0
builds, the other ranks wait). Every ``os.fork()`` of this process is counted and every
warning recorded. Writes JSON to OUT (``{rank}`` replaced): the rounds, the fork count,
the warnings that mention a fork, and whether JAX's backend client was released when
the ``jax_distributed`` block ended.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
import weakref

_FORKS: list[int] = []


def main() -> None:
    out_path, rounds, *overrides = sys.argv[1:]
    os.register_at_fork(before=lambda: _FORKS.append(os.getpid()))
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.extend.backend import get_backend

    from dist.env import detect
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config
    from hf_pipeline.trainer.loop import jax_distributed

    process = detect()
    records = []
    with jax_distributed(process) as joined:
        assert joined and jax.process_count() == process.world_size
        # Arrays, a compiled function and a collective: the backend is fully up.
        total = multihost_utils.process_allgather(np.array([process.rank + 1]))
        assert int(np.sum(total)) == sum(range(1, process.world_size + 1))
        client = weakref.ref(get_backend())
        del total
        rounds_out = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(int(rounds)):
                cfg = load_config(None, [*overrides, f"data.demo.seed={100 + i}"])
                res = prepare_cache(cfg, process=process, progress=False)
                rounds_out.append(
                    {
                        "fingerprint": res.fingerprint,
                        "built": res.built,
                        "rows_out": res.report["rows_out"],
                    }
                )
        records = [str(w.message) for w in caught if "fork" in str(w.message)]
    with open(out_path.format(rank=process.rank), "w") as fh:
        json.dump(
            {
                "rank": process.rank,
                "rounds": rounds_out,
                "forks": len(_FORKS),
                "fork_warnings": records,
                "client_released": client() is None,
                "jax_joined_after": jax.distributed.is_initialized(),
            },
            fh,
        )


if __name__ == "__main__":
    main()
