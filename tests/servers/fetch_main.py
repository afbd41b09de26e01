"""Subprocess entry point for tests: fetch every shard of a location, print JSON.

``python -m tests.servers.fetch_main LOCATION STAGING [--ahead N] [--workers N]
[--metadata] [--release]``. Environment (``STORAGE_EMULATOR_HOST``, ``HF_ENDPOINT``,
``HF_HUB_OFFLINE``, ``HF_HOME``) is whatever the test set. Used for SIGKILL/resume
tests and to run huggingface_hub with a fresh import-time environment.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

from hf_pipeline.config import DataConfig
from hf_pipeline.stores import open_source
from hf_pipeline.stores.fetch import ShardFetcher
from hf_pipeline.stores.retry import RetryPolicy


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("location")
    ap.add_argument("staging")
    ap.add_argument("--ahead", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--metadata", action="store_true")
    ap.add_argument("--release", action="store_true")
    ap.add_argument("--chunk", type=int, default=0, help="GCS ranged-read size")
    args = ap.parse_args(argv)
    cfg = DataConfig(
        shards=args.location,
        staging_dir=args.staging,
        prefetch_ahead=args.ahead,
        download_workers=args.workers,
        max_retries=3,
        file_timeout=30,
    )
    policy = RetryPolicy(max_retries=3, file_timeout=30, backoff_base=0.05)
    src = open_source(args.location, data_config=cfg, policy=policy)
    if args.chunk:
        src.read_chunk = args.chunk
    files = src.list_shards()
    out: dict = {"identity": src.identity(), "files": {}}
    with ShardFetcher(
        src, files, data_config=cfg, num_workers=1, progress=False, policy=policy
    ) as pf:
        client = pf.client()
        for f in files:
            p = client.acquire(f, timeout=120)
            out["files"][f.name] = {
                "path": str(p),
                "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            }
            if args.release:
                client.release(f)
    out["stats"] = pf.stats()
    if args.metadata:
        meta = src.find_metadata()
        p = src.fetch_one(meta)
        out["metadata"] = {
            "name": meta.name,
            "path": str(p),
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
        }
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
