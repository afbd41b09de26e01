"""The caption step at COYO scale: peak RSS and wall time, in-memory vs streaming.

Generates (once, cached under ``--data-dir``) a synthetic metadata parquet of
``--rows`` rows shaped like COYO-11M's: an int64 ``key`` column, shuffled, with ~1%
duplicate keys and ~0.2% null keys, and a ``caption_llava`` column of ~400 characters of
random words per row (~0.5% null, ~0.3% empty or whitespace only), written by a
streaming ``ParquetWriter`` in row groups of ``--row-group-rows`` (pyarrow's and pandas'
default is 1Mi rows), so generating it is bounded in memory too.

Then runs, each in a fresh child process (so peak RSS is that step's alone) and with
the metadata file in the page cache (``--cold``: evicted from it) before each:

1. ``streaming``: ``write_sorted_captions(path, out, num_proc=...)`` from this tree.
2. ``reference``: the in-memory path, ``read_captions(path).save(out)`` — the whole
   caption column read, combined and sorted by ``take`` in memory. The code is imported
   from ``--reference-root`` (default: the main checkout ``/work/main``, else this
   tree), so the reference is the code as it was before the streaming writer.

Both are followed (inside the same child, timed separately) by ``count_absent`` against
``--latent-keys`` keys, as the build does, and checked equal to each other (keys,
captions, counts), chunk by chunk in a third process. Peak RSS is the child's
``ru_maxrss`` (``getrusage``; it counts file pages the process maps, so memory-mapped
reads are not hidden) plus the same for any processes it waited for.

Usage::

    python benchmarks/bench_captions.py [--rows 11000000] [--data-dir /tmp/hf_pipeline_bench]
        [--num-proc 2] [--skip-reference] [--reference-max-rows N] [--cold] [--keep-output] [--json benchmarks/results/captions_2cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAIN = Path("/work/main")
_MiB = 2**20
# For the result writer only: the timed children import the tree under test (--repo).
sys.path.insert(0, str(REPO))

from benchmarks._results import write_result  # noqa: E402

# --------------------------------------------------------------------------- data


class _Words:
    """A 64 MB pool of random words; a batch of captions is a run of consecutive pieces of
    it (zero copy: the pool slice is the data buffer, word boundaries are the offsets)."""

    def __init__(self, rng, pool_bytes: int = 64 * _MiB):
        import numpy as np

        width, vocab = 10, 2048
        lens = rng.integers(2, width + 1, size=vocab)  # ~6 letters and a space a word
        mat = rng.integers(ord("a"), ord("z") + 1, size=(vocab, width + 1), dtype=np.uint8)
        mat[np.arange(width + 1)[None, :] > lens[:, None]] = 0
        mat[np.arange(vocab), lens] = ord(" ")
        ids = rng.integers(0, vocab, size=pool_bytes // 7)
        lens, mat = lens[ids], mat[ids]
        n = len(ids)
        flat = mat.reshape(-1)
        self.data = flat[flat != 0]
        self.starts = np.zeros(n + 1, np.int64)  # byte offset where word i starts
        np.cumsum(lens + 1, out=self.starts[1:])
        self.rng = rng

    def captions(self, rows: int):
        """``rows`` captions of 31-84 words (~400 characters), as a ``pa.StringArray``."""
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        rng = self.rng
        words = rng.integers(31, 85, size=rows)
        need = int(words.sum())
        first = int(rng.integers(0, len(self.starts) - 1 - need))
        bounds = self.starts[first + np.concatenate([[0], np.cumsum(words)])]
        lo, hi = int(bounds[0]), int(bounds[-1])
        caps = pa.LargeStringArray.from_buffers(
            rows, pa.py_buffer(bounds - lo), pa.py_buffer(self.data[lo:hi])
        )
        caps = pc.utf8_rtrim(caps, characters=" ")  # each piece ends with its word's space
        # ~0.5% null, ~0.3% empty or whitespace-only captions.
        u = rng.random(rows)
        blank = (u >= 0.005) & (u < 0.008)
        if blank.any():
            fill = np.where(rng.random(int(blank.sum())) < 0.5, "", "   ")
            caps = pc.replace_with_mask(caps, pa.array(blank), pa.array(fill, pa.large_string()))
        caps = pc.if_else(pa.array(u < 0.005), pa.scalar(None, caps.type), caps)
        return caps.cast(pa.string())


def generate(path: Path, rows: int, row_group_rows: int, seed: int = 0) -> Path:
    """Write the synthetic metadata parquet (atomically: temp file then rename)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    words = _Words(rng)
    # Unique sparse keys in shuffled order, then ~1% of rows reuse another row's key and
    # ~0.2% have none (88 MB of int64 at 11M rows: the only whole-file array here).
    keys = rng.permutation(rows).astype(np.int64) * 7 + 3
    dup = rng.random(rows) < 0.01
    keys[dup] = keys[rng.integers(0, rows, size=int(dup.sum()))]
    null_key = rng.random(rows) < 0.002
    schema = pa.schema([("key", pa.int64()), ("caption_llava", pa.string())])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    step = 100_000
    t0 = time.perf_counter()
    with pq.ParquetWriter(tmp, schema) as writer:
        pending = None
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            kcol = pa.array(keys[lo:hi], mask=null_key[lo:hi])
            batch = pa.Table.from_batches(
                [pa.record_batch([kcol, words.captions(hi - lo)], schema=schema)]
            )
            pending = batch if pending is None else pa.concat_tables([pending, batch])
            # One write_table per row group (write_batch would make a row group of each).
            while pending.num_rows >= row_group_rows or (hi == rows and pending.num_rows):
                writer.write_table(pending.slice(0, row_group_rows), row_group_size=row_group_rows)
                pending = pending.slice(row_group_rows)
    os.replace(tmp, path)
    print(
        f"generated {path} ({rows} rows, {path.stat().st_size / 1e9:.2f} GB) in "
        f"{time.perf_counter() - t0:.0f}s",
        file=sys.stderr,
        flush=True,
    )
    return path


def latent_keys(rows: int, count: int, seed: int = 1):
    """``count`` latent keys, about half with a metadata row (the generator's keys are
    ``7 i + 3``) and half without (``7 i + 4``): what the build passes to count_absent."""
    import numpy as np

    rng = np.random.default_rng(seed)
    i = rng.integers(0, rows, size=count).astype(np.int64)
    return i * 7 + np.where(rng.random(count) < 0.5, 3, 4)


# --------------------------------------------------------------------------- child


def _peak_rss_mb() -> tuple[float, float]:
    """(this process, its largest waited-for child) peak RSS in MiB (Linux: KiB units)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return own, kids


def _child(spec: dict) -> int:
    """Run one caption step in this fresh process and print its figures as JSON."""
    import logging

    from hf_pipeline.build import captions

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the phase times
    out = Path(spec["out"])
    load = os.getloadavg()[0]
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    if spec["impl"] == "reference":
        table = captions.read_captions(spec["meta"])
        table.save(out)
    else:
        table = captions.write_sorted_captions(spec["meta"], out, num_proc=spec["num_proc"])
    step = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    rss_step = _peak_rss_mb()[0]
    t1 = time.perf_counter()
    absent = table.count_absent(latent_keys(spec["rows"], spec["latent_keys"]))
    absent_s = time.perf_counter() - t1
    # What the builder keeps through join and embed: the table object it holds.
    import psutil

    held = psutil.Process().memory_full_info()
    own, kids = _peak_rss_mb()
    res = {
        "impl": spec["impl"],
        "seconds": step,
        "cpu_seconds": cpu,
        "peak_rss_mb": max(own, kids),
        "peak_rss_step_mb": rss_step,
        "count_absent_s": absent_s,
        "no_latents": absent,
        "rss_after_mb": held.rss / _MiB,
        "uss_after_mb": held.uss / _MiB,
        "counts": table.counts,
        "num_chunks": getattr(table, "num_chunks", 1),
        "out_bytes": out.stat().st_size,
        "loadavg_1m_at_start": load,
    }
    print("BENCH_RESULT " + json.dumps(res), flush=True)
    return 0


def _verify(spec: dict) -> int:
    """Compare two caption table files chunk by chunk; print whether they are equal."""
    from hf_pipeline.build.captions import CaptionTable

    a, b = CaptionTable.open(spec["a"]), CaptionTable.open(spec["b"])
    same = a.counts == b.counts and len(a) == len(b)
    step = 1 << 18
    ka, kb = a.keys, b.keys  # 8 bytes a key: small next to the captions
    same = same and bool((ka == kb).all())
    import pyarrow as pa

    ca, cb = (
        c if isinstance(c, pa.ChunkedArray) else pa.chunked_array([c])
        for c in (a.captions, b.captions)
    )
    for lo in range(0, len(a) if same else 0, step):
        n = min(step, len(a) - lo)
        if not ca.slice(lo, n).equals(cb.slice(lo, n)):
            same = False
            break
    print("BENCH_RESULT " + json.dumps({"equal": same, "keys": len(a)}), flush=True)
    return 0


# --------------------------------------------------------------------------- parent


def _run(spec: dict, root: Path, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root))
    p = subprocess.run(
        [sys.executable, __file__, "--_child", json.dumps(spec)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    line = next((x for x in p.stdout.splitlines() if x.startswith("BENCH_RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"{spec} failed (rc {p.returncode}):\n{p.stderr[-4000:]}")
    res = json.loads(line[len("BENCH_RESULT ") :])
    res["log"] = [x for x in p.stderr.splitlines() if x.startswith("captions:")]
    for x in res["log"]:
        print(f"    {x}", file=sys.stderr)
    return res


def _prepare_cache(path: Path, cold: bool) -> None:
    """Put the metadata file in the page cache (read it once) or, with ``cold``, out of it
    (``POSIX_FADV_DONTNEED`` on that file only), so every run starts alike."""
    with open(path, "rb") as fh:
        if cold:
            os.fsync(fh.fileno())
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            return
        while fh.read(64 * _MiB):
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="11000000", help="metadata rows; a comma list runs each")
    ap.add_argument("--row-group-rows", type=int, default=1 << 20)
    ap.add_argument("--data-dir", default="/tmp/hf_pipeline_bench")
    ap.add_argument("--num-proc", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--latent-keys", type=int, default=20_000)
    ap.add_argument(
        "--reference-root",
        default=str(MAIN if (MAIN / "hf_pipeline").is_dir() else REPO),
        help="checkout whose read_captions + save is the reference (default: /work/main)",
    )
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument(
        "--reference-max-rows",
        type=int,
        default=0,
        help="run the reference only up to this many rows (it holds ~16 GB at 11M rows)",
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="evict the metadata file from the page cache before each run (default: warm)",
    )
    ap.add_argument("--keep-output", action="store_true")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--json", default="")
    ap.add_argument("--_child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_verify", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        return _child(json.loads(args._child))
    if args._verify:
        return _verify(json.loads(args._verify))

    data = Path(args.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    sizes, metas = {}, {}
    for rows in (int(r) for r in args.rows.split(",")):
        meta = metas[rows] = data / f"meta-{rows}-rg{args.row_group_rows}.parquet"
        if not meta.exists():
            generate(meta, rows, args.row_group_rows)
        print(f"{rows} metadata rows ({meta.stat().st_size / 1e9:.2f} GB):", file=sys.stderr)
        sizes[str(rows)] = _measure(args, data, meta, rows)
    doc = {
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "machine": {
            "cpus": os.cpu_count(),
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        },
        "metadata": {str(r): {"path": str(m), "bytes": m.stat().st_size} for r, m in metas.items()},
        "sizes": sizes,
    }
    if args.json:
        write_result(args.json, doc)
    return 0 if all(v["summary"].get("equal_tables", True) for v in sizes.values()) else 1


def _measure(args, data: Path, meta: Path, rows: int) -> dict:
    """Reference then streaming on one metadata file, each in a fresh process; compare."""
    base = {"meta": str(meta), "rows": rows, "latent_keys": args.latent_keys}
    results = {}
    # Streaming first: the reference's peak (the whole table, ~16 GB at 11M rows) evicts
    # the page cache, which would slow whatever runs after it.
    runs = [("streaming", REPO)]
    if not args.skip_reference and rows <= (args.reference_max_rows or rows):
        runs.append(("reference", Path(args.reference_root)))
    for impl, root in runs:
        _prepare_cache(meta, args.cold)
        out = data / f"out-{impl}-{rows}.arrow"
        spec = dict(base, impl=impl, out=str(out), num_proc=args.num_proc)
        r = _run(spec, root, args.timeout)
        r["code_root"] = str(root)
        results[impl] = r
        print(
            f"  {impl:<10} {r['seconds']:6.1f}s (cpu {r['cpu_seconds']:.1f}s)  peak RSS "
            f"{r['peak_rss_mb']:7.0f} MiB  after {r['rss_after_mb']:.0f} MiB (uss "
            f"{r['uss_after_mb']:.0f})  count_absent {r['count_absent_s'] * 1e3:.0f} ms  "
            f"load {r['loadavg_1m_at_start']:.1f}",
            file=sys.stderr,
            flush=True,
        )
    summary = {}
    if "reference" in results:
        ref, new = results["reference"], results["streaming"]
        check = _run_verify(
            data / f"out-reference-{rows}.arrow", data / f"out-streaming-{rows}.arrow", args.timeout
        )
        summary = {
            "equal_tables": check["equal"] and ref["no_latents"] == new["no_latents"],
            "seconds_ratio": new["seconds"] / ref["seconds"],
            "peak_rss_ratio": new["peak_rss_mb"] / ref["peak_rss_mb"],
        }
        print(
            f"  streaming / reference: time {summary['seconds_ratio']:.2f}x, peak RSS "
            f"{summary['peak_rss_ratio']:.2f}x, same table: {summary['equal_tables']}",
            file=sys.stderr,
        )
    if not args.keep_output:
        for impl in results:
            (data / f"out-{impl}-{rows}.arrow").unlink(missing_ok=True)
    return {"results": results, "summary": summary}


def _run_verify(a: Path, b: Path, timeout: float) -> dict:
    p = subprocess.run(
        [sys.executable, __file__, "--_verify", json.dumps({"a": str(a), "b": str(b)})],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    line = next((x for x in p.stdout.splitlines() if x.startswith("BENCH_RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"verify failed (rc {p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(line[len("BENCH_RESULT ") :])


if __name__ == "__main__":
    sys.exit(main())
