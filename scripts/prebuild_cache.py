#!/usr/bin/env python
"""Build (or find) the shared cache for a config, before a training job starts.

  python scripts/prebuild_cache.py                       # the demo
  python scripts/prebuild_cache.py --config configs/coyo11m.yaml --json build.json
  python scripts/prebuild_cache.py --status | --verify | --clean [--dry-run] [--json PATH]
  python scripts/prebuild_cache.py --publish gs://bucket/caches     # build if needed, upload
  python scripts/prebuild_cache.py --status gs://bucket/caches      # what is published there

Run it on one host with write access to the cache; training ranks then only read.
Exit codes: 0 ok, 1 coordination failure / store unreachable / problems found by --verify
/ something --clean could not remove, 2 bad input. docs/operations.md says what
--status, --verify and --clean show and touch.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run by path from a checkout (the project card's command): the repository, not only an
# installed copy, provides hf_pipeline. The code is hf_pipeline.commands.prebuild, which
# `hf-pipeline` runs too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_pipeline import cli  # noqa: E402
from hf_pipeline.commands import exit_now, prebuild  # noqa: E402

if __name__ == "__main__":
    # Out at once once the output is written (hf_pipeline.commands.exit_now).
    exit_now(cli.run(prebuild.main, prebuild.parser()))
