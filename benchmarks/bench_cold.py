#!/usr/bin/env python
"""Cold-cache loader throughput: ``shuffle: block`` / ``sequential`` against ``global``.

A cache bigger than RAM is read from disk, not from the page cache. This benchmark makes
every measured pass cold without needing a machine with little RAM: before each pass it
evicts the cache files from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)`` on
each file, with no process mapping them), then times the loader's first ``--steps``
batches from a fresh memory map. Ratios are against fully random (``global``) order
measured in the same run; a warm pass of ``global`` is the ceiling.

  python benchmarks/bench_cold.py --rows 50000 --steps 20 --json cold.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks._results import write_result  # noqa: E402


def evict(files) -> None:
    """Drop the files' clean pages from the page cache (nobody may have them mapped)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(files) -> float:
    """Share of the files' pages in the page cache (``mincore`` over a fresh mmap)."""
    import ctypes
    import mmap

    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    total = resident = 0
    for f in files:
        size = os.path.getsize(f)
        if not size:
            continue
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) as mm:
            view = np.frombuffer(mm, dtype=np.uint8)
            n = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = np.zeros(n, dtype=np.uint8)
            rc = libc.mincore(
                ctypes.c_void_p(view.ctypes.data),
                ctypes.c_size_t(size),
                vec.ctypes.data_as(ctypes.c_void_p),
            )
            del view
            if rc != 0:
                return float("nan")
            resident += int((vec & 1).sum())
            total += n
    return resident / total if total else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=50000)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20, help="batches timed per pass")
    p.add_argument("--block-size", type=int, default=4096)
    p.add_argument("--cache-dir", default="")
    p.add_argument("--json", default="")
    args = p.parse_args()

    import jax
    from bench_loader import build, build_pyarrow

    from hf_pipeline.read.loader import Loader
    from hf_pipeline.read.mapped import SampleSource

    try:
        import datasets  # noqa: F401

        make = build
    except ImportError:
        make = build_pyarrow
    root = args.cache_dir or os.path.join(tempfile.gettempdir(), f"bench_cold_{args.rows}")
    files = make(root, args.rows, 384, "float16", 2, 1000)
    all_files = [f for group in files for f in group]
    size_gb = sum(os.path.getsize(f) for f in all_files) / 1e9

    def one_pass(shuffle: str, cold: bool) -> dict:
        if cold:
            evict(all_files)
        before = resident_fraction(all_files)
        src = SampleSource(*files, fingerprint="bench")
        t0 = time.perf_counter()
        with Loader(
            src,
            global_batch_size=args.batch,
            seed=0,
            process_index=0,
            process_count=1,
            shuffle=shuffle,
            block_size=args.block_size,
        ) as ld:
            it = ld.epochs()
            for _ in range(args.steps):
                b = next(it)
            jax.block_until_ready(b["latents"])
        dt = time.perf_counter() - t0
        src.close()
        samples = args.steps * args.batch
        return {
            "shuffle": shuffle,
            "cold": cold,
            "resident_before": before,
            "samples_per_s": samples / dt,
            "gb_per_s": samples * src.sample_bytes / dt / 1e9,
        }

    for f in all_files:  # warm the whole cache once: the warm pass is the ceiling
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    results = [one_pass("global", cold=False)]
    for shuffle in ("global", "block", "sequential"):
        results.append(one_pass(shuffle, cold=True))
    ref = next(r for r in results if r["cold"] and r["shuffle"] == "global")["samples_per_s"]
    print(f"cache {size_gb:.2f} GB, batch {args.batch}, {args.steps} batches per pass")
    print(
        f"{'order':12} {'page cache':>11} {'resident':>9} {'samples/s':>10} {'GB/s':>6} {'x global cold':>14}"
    )
    for r in results:
        print(
            f"{r['shuffle']:12} {'cold' if r['cold'] else 'warm':>11} {100 * r['resident_before']:8.0f}% "
            f"{r['samples_per_s']:10.0f} {r['gb_per_s']:6.2f} {r['samples_per_s'] / ref:14.2f}"
        )
    if args.json:
        write_result(args.json, {"cache_gb": size_gb, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
