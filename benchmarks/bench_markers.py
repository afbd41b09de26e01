#!/usr/bin/env python
"""What a marker's file checksums cost: ``dist.markers.file_checksum`` (xxh64 over the
size, the first MiB and the last MiB) and ``dist.checksums.whole_checksum`` (xxh3_128 of
every byte: ``--verify``, and ``describe_files`` at publication), on ``--files`` files
of ``--mb`` MB each, cold (each file's pages evicted
through ``posix_fadvise(DONTNEED)``) and warm, against reading the
files whole, same files, same run; and ``dist.checksums.hash_files`` with 1 and
``--workers`` threads, warm.

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


def _drop_caches(files) -> str:
    """Evict just these files' pages (clean after the sync): cold reads of our files
    without emptying the page cache of everybody else on the machine."""
    os.sync()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed"


def _timed(fn, files, cpu: list | None = None) -> float:
    """Wall seconds of ``fn`` over ``files``; appends this process's CPU seconds to
    ``cpu`` (what the work costs whatever else the machine runs)."""
    c0, t0 = time.process_time(), time.perf_counter()
    for f in files:
        fn(f)
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    return time.perf_counter() - t0


def _read_whole(path: Path) -> None:
    with open(path, "rb") as fh:
        while fh.read(16 << 20):
            pass


def _in_memory_cpu_s_per_gb() -> dict[str, float]:
    """CPU seconds per GB of each candidate whole-file hash over 256 MiB in memory (why
    markers use xxh3_128: the cheapest; the manifest's crc32c is the stores' own)."""
    import google_crc32c
    import xxhash

    buf = os.urandom(1 << 20) * 256
    out = {}
    for name, fn in (
        ("xxh3_128", lambda: xxhash.xxh3_128(buf).digest()),
        ("xxh64", lambda: xxhash.xxh64(buf).digest()),
        ("crc32c", lambda: google_crc32c.Checksum(buf).digest()),
    ):
        c0 = time.process_time()
        fn()
        out[name] = round((time.process_time() - c0) / (len(buf) / 1e9), 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--mb", type=int, default=250)
    ap.add_argument("--dir", default="", help="where the files go (default: a temp folder)")
    ap.add_argument("--workers", type=int, default=2, help="threads for hash_files")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.files < 1 or args.mb < 3:
        ap.error("--files must be >= 1 and --mb >= 3")

    from dist.checksums import hash_files, whole_checksum
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
        cold = _drop_caches(files)
        checksum_cold = _timed(file_checksum, files)
        checksum_warm = _timed(file_checksum, files)
        _drop_caches(files)
        whole_cold = _timed(_read_whole, files)
        _drop_caches(files)
        cpu: list[float] = []
        xxh3_cold = _timed(whole_checksum, files, cpu)
        xxh3_warm = _timed(whole_checksum, files, cpu)
        parallel = {}
        for n in sorted({1, args.workers}):
            t0 = time.perf_counter()
            list(hash_files(files, workers=n))
            parallel[f"hash_files_gb_per_s_warm_{n}_threads"] = round(
                gb / (time.perf_counter() - t0), 2
            )
        out = {
            "files": args.files,
            "gb": round(gb, 2),
            "cpus": os.cpu_count(),
            "load_avg_1min": round(os.getloadavg()[0], 2),
            "cold_by": cold,
            "xxh3_128_gb_per_s_cold": round(gb / xxh3_cold, 2),
            "xxh3_128_gb_per_s_warm": round(gb / xxh3_warm, 2),
            "xxh3_128_cpu_s_per_gb_cold": round(cpu[0] / gb, 3),
            "xxh3_128_cpu_s_per_gb_warm": round(cpu[1] / gb, 3),
            "read_whole_gb_per_s_cold": round(gb / whole_cold, 2),
            **parallel,
            "in_memory_cpu_s_per_gb": _in_memory_cpu_s_per_gb(),
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
