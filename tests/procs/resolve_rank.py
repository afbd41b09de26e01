"""One rank that joins a gloo job (env://) and resolves the build's inputs.

Prints JSON: the fingerprint this rank computes, how many shards it sees and what this
rank hashed (``Inputs.hashing``). Used by tests/test_build_inputs.py to count Hub
requests for 1 and for 8 ranks, and by tests/test_identity.py (local inputs hashed once
per job).
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import torch.distributed as torch_dist

    from dist.env import detect
    from hf_pipeline.build.prepare import resolve_job_inputs
    from hf_pipeline.cache.layout import compute_fingerprint
    from hf_pipeline.config import load_config

    torch_dist.init_process_group("gloo")
    cfg = load_config(None, sys.argv[1:])
    process = detect()
    inputs, encoder = resolve_job_inputs(cfg, process)
    fingerprint = compute_fingerprint(
        cfg, [f.identity() for f in inputs.shards], inputs.metadata.identity(), encoder
    )
    hashing = inputs.hashing.as_dict() if inputs.hashing is not None else None
    print(
        json.dumps(
            {
                "rank": process.rank,
                "fingerprint": fingerprint,
                "shards": len(inputs.shards),
                "hashing": hashing,
            }
        )
    )
    torch_dist.barrier()  # rank 0 hosts the store: it leaves last
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()
