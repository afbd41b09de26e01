#!/usr/bin/env python
"""What content identity of local inputs costs (``hf_pipeline.stores.identity``).

On ``--files`` shard files of ``--mb`` MB each (random bytes: hashing does not parse
them), measured in one run:

- the first start (empty content index): ``content_identities`` GB/s cold (each file's
  pages evicted with ``posix_fadvise(DONTNEED)``, or the whole page cache with
  ``--drop-caches all``, root only) and warm; the reference is reading the same files
  whole, cold, same run;
- threads against processes: ``dist.checksums.hash_files`` (threads, what the build
  uses) against a ``ProcessPoolExecutor`` of ``whole_checksum`` with as many workers,
  warm and cold;
- a start whose index knows every file (the usual start): seconds for ``--hit-files``
  small files, index read, one ``stat`` per file, no byte read;
- a start after ``touch`` of every shard: hashed again (the first-start rate).

Usage::

    python benchmarks/bench_identity.py [--files 16] [--mb 128] [--hit-files 5000] \\
        [--workers N] [--drop-caches fadvise|all] [--dir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._results import write_result  # noqa: E402


def _drop_caches(files, how: str) -> str:
    """Evict the files' pages: ``fadvise`` evicts just ours (the machine is shared),
    ``all`` empties the whole page cache (root)."""
    os.sync()
    if how == "all":
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return "drop_caches_3"
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed"


def _read_whole(path: Path) -> None:
    with open(path, "rb") as fh:
        while fh.read(16 << 20):
            pass


def _one_hash(path: str) -> str:
    from dist.checksums import whole_checksum

    return whole_checksum(path)[1]


def _identify(files, index_dir: Path | None, workers: int):
    from hf_pipeline.stores.identity import ContentIndex, content_identities

    t0 = time.perf_counter()
    out, stats = content_identities(files, index=ContentIndex(index_dir), workers=workers)
    return time.perf_counter() - t0, stats


def _remote_files(paths):
    from hf_pipeline.stores.remote_file import RemoteFile

    return [RemoteFile(name=p.name, url=str(p), size=p.stat().st_size) for p in paths]


def main() -> int:
    from dist.checksums import default_workers

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--mb", type=int, default=128)
    ap.add_argument("--hit-files", type=int, default=5000, help="files of the index-hit start")
    ap.add_argument("--workers", type=int, default=default_workers())
    ap.add_argument("--drop-caches", choices=["fadvise", "all"], default="fadvise")
    ap.add_argument("--dir", default="", help="where the files go (default: a temp folder)")
    ap.add_argument("--json", default="")
    ap.add_argument(
        "--chunks-kb",
        default="",
        help="also hash the files warm with --workers threads at each of these read sizes "
        "(KiB, comma-separated), taking turns, 3 rounds: threads_gb_per_s_by_chunk_kb",
    )
    args = ap.parse_args()
    try:
        chunks_kb = [int(c) for c in args.chunks_kb.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--chunks-kb takes comma-separated integers, got {args.chunks_kb!r}")
    if any(c < 1 for c in chunks_kb):
        ap.error("--chunks-kb: each size must be >= 1")
    if args.files < 1 or args.mb < 1 or args.hit_files < 1 or args.workers < 1:
        ap.error("--files, --mb, --hit-files and --workers must be >= 1")

    from dist.checksums import hash_files

    work = Path(args.dir or tempfile.mkdtemp(prefix="hfp_identity_"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    try:
        shards = work / "shards"
        shards.mkdir()
        paths = []
        for i in range(args.files):
            p = shards / f"{i * 1000:06d}-{i * 1000 + 999:06d}.pt"
            with open(p, "wb") as fh:
                for _ in range(args.mb):
                    fh.write(os.urandom(1 << 20))
            paths.append(p)
        past = time.time_ns() - 3600 * 10**9  # not "racy": see RACY_NS
        for p in paths:
            os.utime(p, ns=(past, past))
        files = _remote_files(paths)
        gb = sum(f.size for f in files) / 1e9

        cold_by = _drop_caches(paths, args.drop_caches)
        t0 = time.perf_counter()
        for p in paths:
            _read_whole(p)
        read_cold = time.perf_counter() - t0

        _drop_caches(paths, args.drop_caches)
        cold_s, cold = _identify(files, work / "index-a", args.workers)
        warm_s, _ = _identify(files, work / "index-b", args.workers)
        hit_s, hit = _identify(files, work / "index-a", args.workers)
        assert cold.hashed_files == args.files and hit.hashed_bytes == 0, (cold, hit)

        # threads vs processes, same worker count, warm then cold
        def threads():
            list(hash_files(paths, workers=args.workers))

        pool = ProcessPoolExecutor(args.workers)
        list(pool.map(_one_hash, [str(paths[0])]))  # start the workers before timing

        def processes():
            list(pool.map(_one_hash, [str(p) for p in paths]))

        compare = {}
        for name, fn in (("threads", threads), ("processes", processes)):
            t0 = time.perf_counter()
            fn()
            compare[f"{name}_gb_per_s_warm"] = round(gb / (time.perf_counter() - t0), 2)
            _drop_caches(paths, args.drop_caches)
            t0 = time.perf_counter()
            fn()
            compare[f"{name}_gb_per_s_cold"] = round(gb / (time.perf_counter() - t0), 2)
        pool.shutdown()
        t0 = time.perf_counter()
        list(hash_files(paths, workers=1))
        compare["one_thread_gb_per_s_warm"] = round(gb / (time.perf_counter() - t0), 2)

        by_chunk: dict[str, list[float]] = {str(c): [] for c in chunks_kb}
        for _ in range(3 if chunks_kb else 0):
            for c in chunks_kb:
                t0 = time.perf_counter()
                list(hash_files(paths, workers=args.workers, chunk_bytes=c << 10))
                by_chunk[str(c)].append(round(gb / (time.perf_counter() - t0), 2))
        if chunks_kb:
            compare["threads_gb_per_s_by_chunk_kb"] = by_chunk

        # touch every shard: every file misses the index and is hashed again (warm)
        for p in paths:
            os.utime(p, ns=(past + 10**9, past + 10**9))
        touch_s, touched = _identify(files, work / "index-a", args.workers)

        # the usual start: many small shards, all in the index
        many = work / "many"
        many.mkdir()
        small = []
        for i in range(args.hit_files):
            p = many / f"{i * 10:07d}-{i * 10 + 9:07d}.pt"
            p.write_bytes(os.urandom(64))
            os.utime(p, ns=(past, past))
            small.append(p)
        small_files = _remote_files(small)
        _identify(small_files, work / "index-many", args.workers)
        many_s, many_stats = _identify(small_files, work / "index-many", args.workers)
        assert many_stats.index_hits == args.hit_files
        index_bytes = (work / "index-many" / "index.json").stat().st_size

        out = {
            "files": args.files,
            "gb": round(gb, 3),
            "workers": args.workers,
            "cpus": os.cpu_count(),
            "load_avg_1min_before": round(load_before, 2),
            "load_avg_1min_after": round(os.getloadavg()[0], 2),
            "cold_by": cold_by,
            "first_start_gb_per_s_cold": round(gb / cold_s, 2),
            "first_start_gb_per_s_warm": round(gb / warm_s, 2),
            "read_whole_gb_per_s_cold": round(gb / read_cold, 2),
            "index_hit_start_s": round(hit_s, 4),
            "touched_start_s": round(touch_s, 3),
            "touched_hashed_files": touched.hashed_files,
            **compare,
            "hit_files": args.hit_files,
            "hit_start_s_for_hit_files": round(many_s, 4),
            "hit_start_ms_per_file": round(many_s / args.hit_files * 1000, 4),
            "index_bytes_for_hit_files": index_bytes,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=1))
    if args.json:
        write_result(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
