"""One rank, launched by torchrun, that finds its job's identity as ``prepare_cache``
does (:func:`hf_pipeline.build.prepare.job_identity`) and initialises no process group itself.

``resolve_launched.py OUT OVERRIDE...`` writes ``{rank, fingerprint, shards}`` to OUT
(``{rank}`` in it is this rank). Used to count the Hub requests of N launched ranks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    from dist.env import detect
    from hf_pipeline.build.prepare import job_identity
    from hf_pipeline.config import load_config

    cfg = load_config(None, sys.argv[2:])
    process = detect()
    inputs, fingerprint = job_identity(cfg, process)
    record = {"rank": process.rank, "fingerprint": fingerprint, "shards": len(inputs.shards)}
    Path(sys.argv[1].format(rank=os.environ.get("RANK", "0"))).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
