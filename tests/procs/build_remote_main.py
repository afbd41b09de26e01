"""Subprocess entry point for tests/test_build_remote.py: run one build, print its summary.

``python -m tests.procs.build_remote_main [--read-chunk BYTES] OVERRIDE...``. The
environment (``STORAGE_EMULATOR_HOST``, ``HF_HOME``, ...) is whatever the test set. Used
where the build must be a real process the test can SIGKILL mid-download.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--read-chunk", type=int, default=0, help="GCS ranged-read size (bytes)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config

    if args.read_chunk:
        from hf_pipeline.stores import GCSSource

        # Several ranged reads per shard, so a kill leaves a partial .part to resume.
        GCSSource.read_chunk = args.read_chunk
    res = prepare_cache(load_config(None, args.overrides), progress=False)
    json.dump(res.summary(), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
