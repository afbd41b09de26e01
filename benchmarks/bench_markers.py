#!/usr/bin/env python
"""What a marker's file checksums cost: ``dist.markers.file_checksum`` (xxh64 over the
size, the first MiB and the last MiB) on ``--files`` files of ``--mb`` MB each, cold
(page cache dropped, needs root; else said so) and warm, against reading the files whole
(the reference: what a whole-file checksum must at least do), same files, same run.

Usage::

    python benchmarks/bench_markers.py [--files 16] [--mb 250] [--dir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._results import write_result  # noqa: E402


def _drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _timed(fn, files) -> float:
    t0 = time.perf_counter()
    for f in files:
        fn(f)
    return time.perf_counter() - t0


def _read_whole(path: Path) -> None:
    with open(path, "rb") as fh:
        while fh.read(16 << 20):
            pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--mb", type=int, default=250)
    ap.add_argument("--dir", default="", help="where the files go (default: a temp folder)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.files < 1 or args.mb < 3:
        ap.error("--files must be >= 1 and --mb >= 3")

    from dist.markers import file_checksum

    work = Path(args.dir or tempfile.mkdtemp(prefix="hfp_markers_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        files = []
        for i in range(args.files):
            path = work / f"data-{i:05d}.arrow"
            with open(path, "wb") as fh:
                for _ in range(args.mb):
                    fh.write(os.urandom(1 << 20))
            files.append(path)
        gb = sum(f.stat().st_size for f in files) / 1e9
        cold = _drop_caches()
        checksum_cold = _timed(file_checksum, files)
        checksum_warm = _timed(file_checksum, files)
        _drop_caches()
        whole_cold = _timed(_read_whole, files)
        out = {
            "files": args.files,
            "gb": round(gb, 2),
            "page_cache_dropped": cold,
            "checksum_ms_per_file_cold": round(checksum_cold / args.files * 1000, 2),
            "checksum_ms_per_file_warm": round(checksum_warm / args.files * 1000, 3),
            "checksum_ms_per_gb_cold": round(checksum_cold / gb * 1000, 1),
            "read_whole_ms_per_gb_cold": round(whole_cold / gb * 1000, 1),
            "checksum_vs_read_whole": round(checksum_cold / whole_cold, 4),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=1))
    if args.json:
        write_result(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
