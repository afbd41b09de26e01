"""MosaicML Streaming against our streamed loader: the same rows from the same emulated bucket.

Same data, same run. ``bench_stream.py``'s setup (the real fake-gcs-server on loopback,
the demo cache built and published to ``gs://bench/caches``), then the cache's rows
(every kept row: its key, its latents with all crops, its caption embedding; the rows
our stream's "needed" bytes count) are written in that order as MosaicML Streaming MDS
shards (``streaming.MDSWriter``, no compression, ``size_limit`` the mean size of our
published rows files) and uploaded to ``gs://bench/mds``. For each per-request latency
(a ``tests/servers/proxy.py`` fault proxy in a process of its own, in front of the
server for both libraries, 0 ms too, holding each request for a ``.arrow`` or ``.mds``
file that long) and each shuffle, one epoch of:

* ``local``: our :class:`~hf_pipeline.read.loader.Loader` over the local cache (the
  reference: no store);
* ``ours``: the same Loader over a :class:`~hf_pipeline.read.stream.StreamSource` of the
  published folder (``--ahead``, ``--cache-mb``, ``--concurrency``, ``--threads``);
* ``mosaic``: ``streaming.StreamingDataset(remote="gs://bench/mds", local=<fresh tmp>,
  shuffle=True, batch_size=B, ...)`` under a ``torch.utils.data.DataLoader(batch_size=B,
  num_workers=--workers)`` as its docs show (the platform's default worker start: fork
  on Linux).

For each: samples/s over the epoch (from the iterator's creation to its end), time to
first batch (for the streams: from opening the source / making the dataset and loader),
bytes the proxy sent for that library's files (the same count for both), requests, and
the local cache's peak: Mosaic's ``local`` folder (polled), ours held in memory
(``max_held_bytes``; ours writes nothing to disk).

Shuffles, mapped (both seeded; neither order is the other's):

* ``global``: ours ``shuffle="global"`` (a permutation of all rows); Mosaic
  ``shuffle_algo="naive"`` (``rng.permutation`` of all samples).
* ``block``: ours ``shuffle="block"`` (blocks of ``--block-size`` rows in a shuffled
  order, rows shuffled within windows of ``window_blocks`` (4) blocks); Mosaic
  ``shuffle_algo="py1br"`` (shards in a shuffled order, samples shuffled within blocks
  of 0.75-1.25 x ``shuffle_block_size`` samples) with ``shuffle_block_size`` = our
  window (4 x ``--block-size``). Mosaic's default, ``py1e``, spreads each shard's
  samples over ``shuffle_block_size`` (default 262,144: more rows than these datasets,
  so about a global shuffle of shards here).

Mosaic runs with ``num_canonical_nodes=1`` (one host) and its defaults otherwise:
``predownload`` 8 x batch per worker, no ``cache_limit`` (``--mosaic-cache-mb`` sets
one), whole shards downloaded by its GCS downloader (``google-cloud-storage``'s
``Blob.download_to_filename``).

How Mosaic reaches the emulator: its ``GCSDownloader`` makes a
``google.cloud.storage.Client(credentials=google.auth.default()[0])`` (or, with
``GCS_KEY``/``GCS_SECRET``, a boto3 S3 client pinned to ``https://storage.googleapis.com``,
which no emulator can stand in for). ``google-cloud-storage`` sends its requests to
``STORAGE_EMULATOR_HOST``; ``google.auth.default()`` needs credentials, so the bench
writes an ``authorized_user`` file holding an access token valid until 2099 (nothing to
refresh, so no token endpoint is asked) and points ``GOOGLE_APPLICATION_CREDENTIALS`` at
it. fake-gcs-server ignores the token.

Where ``torchvision`` is missing, ``streaming``'s package ``__init__`` (which imports its
vision datasets) cannot run: the bench then loads ``streaming.base`` alone and says so
in the result (``import_note``). The GPU host has torchvision.

Needs ``mosaicml-streaming`` importable (not a project dependency): ``pip install
--target DIR --no-deps`` its wheel and brotli, zstd, python-snappy, cramjam, catalogue
(what its modules import), then ``PYTHONPATH=DIR:.``.

Usage::

    python benchmarks/bench_stream_compare.py [--shards 8] [--samples 500] [--batch 256]
        [--latency-ms 0 50] [--shuffle global block] [--workers 2] [--ahead 16]
        [--cache-mb 512] [--concurrency 32] [--threads 4] [--block-size 256]
        [--mosaic-cache-mb 0] [--set KEY=VALUE] [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import math
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import bench_stream  # noqa: E402  (sets the environment defaults)
from benchmarks._results import write_result  # noqa: E402
from benchmarks.bench_stream import PROXY_START_S, ProxyProcess  # noqa: E402
from hf_pipeline.read.stream.options import StreamOptions  # noqa: E402

#: Seconds between polls of Mosaic's local folder for its peak size.
POLL_S = 0.02
#: The data files each latency holds: ours (Arrow) and Mosaic's (MDS shards).
DATA_SUFFIXES = (".arrow", ".mds")
VERSIONS = ("mosaicml-streaming", "google-cloud-storage", "google-auth", "gcsfs", "torch",
            "numpy")  # fmt: skip


def _skip_streaming_init() -> str:
    """Where torchvision is missing, register ``streaming`` as a bare package so that
    ``streaming.base`` imports without the package ``__init__`` (its vision datasets
    import torchvision). Runs at import, so a spawned DataLoader worker does it too.

    Returns:
        A note for the result, "" when nothing was done.
    """
    if "streaming" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return ""
    spec = importlib.util.find_spec("streaming")
    if spec is None or not spec.submodule_search_locations:
        return ""
    pkg = types.ModuleType("streaming")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__file__ = spec.origin
    sys.modules["streaming"] = pkg
    return "torchvision missing: streaming.base loaded without the streaming package __init__"


IMPORT_NOTE = _skip_streaming_init()


def _tree_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # renamed or evicted between listing and stat
                pass
    return total


class PeakSize:
    """The largest size of a folder's files seen by a thread polling every ``POLL_S``."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-size", daemon=True)

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, _tree_bytes(self.folder))
            if self._stop.wait(POLL_S):
                break

    def __enter__(self) -> PeakSize:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(PROXY_START_S)
        self.peak = max(self.peak, _tree_bytes(self.folder))


def write_mds(source, out: Path, *, size_limit: int, chunk: int = 1024) -> dict[str, int]:
    """Write every kept row of ``source`` (a SampleSource), in order, as MDS shards.

    Returns:
        ``{"rows", "shards", "bytes"}`` of what was written.
    """
    import numpy as np
    from streaming.base import MDSWriter

    crops = source.num_crops
    lat_dtype = np.dtype(source.latent_dtype)
    # MDS knows NumPy's own dtypes only: bfloat16 travels as its uint16 bits (same bytes).
    stored = lat_dtype if lat_dtype.name != "bfloat16" else np.dtype(np.uint16)
    shape = ",".join(str(d) for d in (crops, *source.latent_shape))
    columns = {
        "keys": "int64",
        "latents": f"ndarray:{stored.name}:{shape}",
        "embeddings": f"ndarray:{np.dtype(source.embedding_dtype).name}:{source.embed_dim}",
    }
    with MDSWriter(out=str(out), columns=columns, compression=None, size_limit=size_limit) as w:
        for lo in range(0, source.num_rows, chunk):
            rows = np.arange(lo, min(lo + chunk, source.num_rows))
            parts = [source.gather(rows, c) for c in range(crops)]
            latents = np.stack([p["latents"] for p in parts], axis=1).view(stored)
            for i in range(len(rows)):
                w.write(
                    {
                        "keys": int(parts[0]["keys"][i]),
                        "latents": latents[i],
                        "embeddings": parts[0]["embeddings"][i],
                    }
                )
    shards = sorted(out.glob("*.mds"))
    return {
        "rows": source.num_rows,
        "shards": len(shards),
        "bytes": sum(p.stat().st_size for p in shards),
    }


def _emulator_credentials(folder: Path) -> Path:
    """An ``authorized_user`` credentials file whose access token never needs refreshing
    (``google.auth.default()`` then asks no token endpoint; the emulator ignores it)."""
    from dist.atomic import write_json_atomic

    path = folder / "emulator-adc.json"
    token = {
        "type": "authorized_user",
        "client_id": "emulator",
        "client_secret": "emulator",
        "refresh_token": "emulator",
        "token": "emulator",
        "expiry": "2099-01-01T00:00:00Z",
    }
    write_json_atomic(path, token)
    return path


def _mosaic_epoch(remote: str, local: Path, args, shuffle: str) -> dict:
    """One epoch of Mosaic's StreamingDataset under a torch DataLoader."""
    import torch.utils.data as tud
    from streaming.base import StreamingDataset

    algo = {"global": "naive", "block": "py1br"}[shuffle]
    t0 = time.perf_counter()
    with PeakSize(local) as peak:
        dataset = StreamingDataset(
            remote=remote,
            local=str(local),
            shuffle=True,
            shuffle_algo=algo,
            shuffle_seed=0,
            shuffle_block_size=args.block_size * 4 if shuffle == "block" else None,
            num_canonical_nodes=1,
            batch_size=args.batch,
            cache_limit=int(args.mosaic_cache_mb * (1 << 20)) or None,
        )
        loader = tud.DataLoader(dataset, batch_size=args.batch, num_workers=args.workers)
        open_s = time.perf_counter() - t0
        first_s, epoch_s, n = bench_stream._epoch(loader)
        del loader
    return {
        "algo": algo,
        "samples": n,
        "samples_per_s": n / epoch_s,
        "first_batch_s": open_s + first_s,
        "peak_local_mb": peak.peak / 2**20,
    }


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in VERSIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--samples", type=int, default=500, help="per shard")
    ap.add_argument("--batch", type=int, default=256, help="global batch (one process)")
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 50.0])
    ap.add_argument("--shuffle", nargs="+", choices=("global", "block"),
                    default=["global", "block"])  # fmt: skip
    ap.add_argument("--workers", type=int, default=2, help="Mosaic: DataLoader num_workers")
    ap.add_argument("--mosaic-cache-mb", type=float, default=0,
                    help="Mosaic: cache_limit (0: none, its default)")  # fmt: skip
    ap.add_argument("--ahead", type=int, default=16)
    ap.add_argument("--cache-mb", type=float, default=512)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=256, help="shuffle: block")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="one more config override (repeatable), e.g. encoder.model=DIR")  # fmt: skip
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    bench_stream._SETS.extend(args.set)

    try:
        import streaming  # noqa: F401
        import streaming.base  # noqa: F401
    except ImportError as e:
        sys.exit(f"bench_stream_compare: mosaicml-streaming is not importable ({e}); see --help")

    from hf_pipeline.cache.layout import open_sample_source
    from hf_pipeline.read.loader import Loader
    from hf_pipeline.read.stream import StreamSource
    from hf_pipeline.stores.retry import RetryPolicy
    from tests.servers import gcs_fs

    tmp = Path(tempfile.mkdtemp(prefix="bench-stream-compare-"))
    server = bench_stream.start_bucket("bench")
    try:
        _, _, built, cache_url, publish_s = bench_stream.publish_demo(
            tmp, "gs://bench/caches", shards=args.shards, samples=args.samples
        )
        # The proxy sees object paths as ".../b/<bucket>/o/<name>" (unquoted).
        ours_match = "/o/" + cache_url[len("gs://bench/") :] + "/"
        mosaic_match = "/o/mds/"
        rows_files = sorted(Path(built.cache_dir).rglob("rows/*.arrow"))
        size_limit = math.ceil(sum(p.stat().st_size for p in rows_files) / len(rows_files))
        local = open_sample_source(built.layout, built.fingerprint)
        t0 = time.perf_counter()
        mds = write_mds(local, tmp / "mds", size_limit=size_limit)
        gcs_fs(server.url).put(str(tmp / "mds"), "bench/mds", recursive=True)
        mds["write_and_upload_s"] = time.perf_counter() - t0
        os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = str(_emulator_credentials(tmp))
        os.environ.setdefault("GOOGLE_CLOUD_PROJECT", "bench")
        policy = RetryPolicy(max_retries=5, file_timeout=60.0)
        options = StreamOptions(
            ahead=args.ahead,
            cache_bytes=int(args.cache_mb * (1 << 20)),
            concurrency=args.concurrency,
        )
        # JAX's backend starts at the first transfer: not the first timed run's cost.
        next(iter(Loader(local, process_index=0, process_count=1, global_batch_size=args.batch)))
        runs = []
        for latency in args.latency_ms:
            proxy = ProxyProcess(server.url, latency / 1e3, DATA_SUFFIXES)
            os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
            try:
                for shuffle in args.shuffle:
                    kw = {
                        "global_batch_size": args.batch,
                        "shuffle": shuffle,
                        "block_size": args.block_size,
                        "num_threads": args.threads,
                        "process_index": 0,
                        "process_count": 1,
                    }
                    _, local_s, n_local = bench_stream._epoch(Loader(local, **kw))
                    req0, bytes0 = proxy.traffic(ours_match)
                    t0 = time.perf_counter()
                    with StreamSource(cache_url, options, policy=policy) as stream:
                        open_s = time.perf_counter() - t0
                        first_s, stream_s, n = bench_stream._epoch(Loader(stream, **kw))
                        stats = stream.stats()
                    req1, bytes1 = proxy.traffic(ours_match)
                    ours = {
                        "samples": n,
                        "samples_per_s": n / stream_s,
                        "first_batch_s": open_s + first_s,
                        "bytes_fetched_proxy": bytes1 - bytes0,
                        "requests_proxy": req1 - req0,
                        "bytes_fetched_stats": stats.bytes_fetched,
                        "bytes_needed": stats.bytes_needed,
                        "peak_local_mb": 0.0,
                        "max_held_mb": stats.max_held_bytes / 2**20,
                    }
                    req0, bytes0 = proxy.traffic(mosaic_match)
                    mosaic = _mosaic_epoch(
                        "gs://bench/mds", tmp / f"mosaic-{latency:g}-{shuffle}", args, shuffle
                    )
                    req1, bytes1 = proxy.traffic(mosaic_match)
                    mosaic.update(bytes_fetched_proxy=bytes1 - bytes0, requests_proxy=req1 - req0)
                    shutil.rmtree(tmp / f"mosaic-{latency:g}-{shuffle}", ignore_errors=True)
                    run = {
                        "latency_ms": latency,
                        "shuffle": shuffle,
                        "local_samples_per_s": n_local / local_s,
                        "ours": ours,
                        "mosaic": mosaic,
                    }
                    runs.append(run)
                    for name, r in (("ours", ours), ("mosaic", mosaic)):
                        print(
                            f"latency {latency:4.0f} ms  {shuffle:6s}  {name:6s} "
                            f"{r['samples_per_s']:9.0f} samples/s  first batch "
                            f"{r['first_batch_s']:6.2f} s  fetched "
                            f"{r['bytes_fetched_proxy'] / 1e6:8.1f} MB in "
                            f"{r['requests_proxy']:5d} requests  peak local "
                            f"{r['peak_local_mb']:7.1f} MiB  (local loader "
                            f"{run['local_samples_per_s']:.0f} samples/s)",
                            flush=True,
                        )
            finally:
                os.environ["STORAGE_EMULATOR_HOST"] = server.url
                proxy.stop()
        local.close()
        out = {
            "rows": built.report["rows_out"],
            "cache_mb": sum(
                p.stat().st_size for p in Path(built.cache_dir).rglob("*") if p.is_file()
            )
            / 1e6,
            "rows_files": len(rows_files),
            "publish_s": publish_s,
            "mds": {**mds, "size_limit": size_limit, "compression": None},
            "options": {
                "batch": args.batch,
                "block_size": args.block_size,
                "window_blocks": 4,
                "ours": {
                    "ahead": args.ahead,
                    "cache_mb": args.cache_mb,
                    "concurrency": args.concurrency,
                    "threads": args.threads,
                },
                "mosaic": {
                    "num_workers": args.workers,
                    "worker_start": mp.get_start_method(allow_none=False),
                    "num_canonical_nodes": 1,
                    "shuffle_algo": {"global": "naive", "block": "py1br"},
                    "shuffle_block_size": {"block": args.block_size * 4},
                    "cache_limit_mb": args.mosaic_cache_mb or None,
                    "predownload": 8 * args.batch,
                },
            },
            "versions": _versions(),
            "import_note": IMPORT_NOTE,
            "cpus": len(os.sched_getaffinity(0)),
            "runs": runs,
        }
        if args.json:
            write_result(args.json, out)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
