#!/usr/bin/env python
"""Train a small caption-conditioned latent denoiser (JAX) from the shared cache.

  python scripts/train.py                                   # the bundled demo, 1-2 min on 2 CPUs
  DATASET_NUM_PROC=16 python scripts/train.py --config configs/coyo11m.yaml
  torchrun --nproc_per_node 4 scripts/train.py              # 4 ranks share one cache

Every rank calls the same build: one builds (rank 0), the others wait for the
'converted' and 'filtered' markers, then all memory-map the cache. Logs loss,
samples/s and the share of step time spent waiting for data.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run by path from a checkout (the project card's command): the repository, not only an
# installed copy, provides hf_pipeline. The code is hf_pipeline.commands.train, which
# `hf-pipeline` runs too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_pipeline import cli  # noqa: E402
from hf_pipeline.commands import train  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli.run(train.main, train.parser()))
