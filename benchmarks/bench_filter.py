#!/usr/bin/env python
"""The ``filtered`` stage's filter: :func:`hf_pipeline.build.parts.write_kept_indices` (NumPy
over each record batch of the final drop reasons) against the reference, what the stage
did before: ``datasets.Dataset.filter`` with a batched Python predicate, writing the
same indices file. Same reasons file, same run; the two files must be equal.

The reasons file is written as the assembly writes it (``reasons.arrow``: one string
column, record batches of 2^20 rows), ``--rows`` rows of which ``--dropped`` (a share)
carry a reason. Reported: seconds of each, the ratio, and each one's peak RSS growth
(each runs in a fresh process).

Usage::

    python benchmarks/bench_filter.py [--rows 5000000] [--dropped 0.03] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._results import write_result  # noqa: E402

_BATCH = 10_000  # build.writer_batch_size's default


def _ours(reasons: str, out: str) -> int:
    from hf_pipeline.build.parts import write_kept_indices

    return write_kept_indices([Path(reasons)], Path(out), fingerprint="bench", batch_rows=_BATCH)


def _datasets(reasons: str, out: str) -> int:
    from datasets import Dataset

    kept = Dataset.from_file(reasons).filter(
        lambda rs: [r == "" for r in rs], input_columns=["drop_reason"], batched=True,
        batch_size=1000, writer_batch_size=_BATCH, cache_file_name=out, keep_in_memory=False,
    )  # fmt: skip
    return len(kept)


def _measure(name: str, reasons: str, out: str, q) -> None:
    import numpy  # noqa: F401  (the imports are not the filter's time)
    import pyarrow  # noqa: F401

    if name == "datasets":
        import datasets  # noqa: F401
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    kept = (_ours if name == "ours" else _datasets)(reasons, out)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    q.put(
        {
            "seconds": round(seconds, 3),
            "kept": kept,
            "peak_rss_growth_mb": round((peak - before) / 1024, 1),
        }
    )


def _run(name: str, reasons: Path, out: Path) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_measure, args=(name, str(reasons), str(out), q))
    p.start()
    res = q.get()
    p.join()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=5_000_000)
    ap.add_argument("--dropped", type=float, default=0.03, help="share of rows with a reason")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.rows < 1 or not 0 <= args.dropped <= 1:
        ap.error("--rows must be >= 1 and --dropped in [0, 1]")

    import numpy as np
    import pyarrow as pa

    from hf_pipeline.build.parts import _write_reasons

    with tempfile.TemporaryDirectory(prefix="bench_filter-") as tmp:
        work = Path(tmp)
        rng = np.random.default_rng(0)
        codes = (rng.random(args.rows) < args.dropped).astype(np.int32)
        reasons = pa.DictionaryArray.from_arrays(
            pa.array(codes), pa.array(["", "no_caption"], pa.string())
        ).cast(pa.string())
        _write_reasons(work / "reasons.arrow", reasons)
        res = {
            name: _run(name, work / "reasons.arrow", work / f"{name}.arrow")
            for name in ("datasets", "ours")
        }
        tables = [
            pa.ipc.open_stream(pa.memory_map(str(work / f"{n}.arrow"))).read_all() for n in res
        ]
        same = tables[0].column("indices").equals(tables[1].column("indices"))
    out = {
        "rows": args.rows,
        "dropped": args.dropped,
        "datasets_filter": res["datasets"],
        "write_kept_indices": res["ours"],
        "speedup": round(res["datasets"]["seconds"] / max(res["ours"]["seconds"], 1e-9), 1),
        "same_indices": same,
        "what": " ".join(sys.argv),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        write_result(args.json, out)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
