"""Grain over our cache vs our own Loader: same cache, same batch shape, same machine.

Builds (or reuses, ``--cache-dir``) a real cache of the demo data with ``prepare_cache``
(latents ``(3, 4, 32, 32)``, the configured encoder's embeddings: MiniLM on the CPU
here, a few minutes the first time), warms the page cache,
then times shuffled batches of ``--batch`` samples, consumer side, best of ``--repeats``:

- ``loader``: :class:`hf_pipeline.read.loader.Loader` (prefetch threads, gather + device_put
  to the default JAX device, CPU here);
- ``gather``: :meth:`SampleSource.gather` on the calling thread (NumPy only): our floor;
- ``grain MapDataset per-record``: ``MapDataset.source(GrainSource).shuffle().batch()``
  read through ``to_iter_dataset()`` (Grain's read threads);
- ``grain DataLoader per-record w=K``: ``grain.DataLoader`` + ``IndexSampler`` +
  ``Batch``, ``worker_count`` K (0: in process; K > 0: spawned worker processes);
- ``grain MapDataset batched``: ``MapDataset.range(n).shuffle().batch()`` of indices,
  ``.map(GrainSource.get_batch)``: one gather per batch (Grain still shuffles and
  batches the indices one by one);
- ``grain MapDataset of global batches``: ``MapDataset.range(steps).map(f)`` where
  ``f(g)`` gathers global batch ``g`` of :class:`~hf_pipeline.read.sampler.GlobalSampler`'s
  order (this process's share) with ``GrainSource.get_batch``: Grain handles iteration,
  prefetch and checkpoints, no per-sample Python anywhere.

Each result has ``x_loader`` = its samples/s over the Loader's.

Usage::

    python benchmarks/bench_grain.py --rows 20000 --batch 256 --steps 200 \
        --json benchmarks/results/grain_2cpu.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (REPO, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)
from benchmarks._results import write_result  # noqa: E402


def _time_iter(make_iter, steps: int, repeats: int, block=None) -> float:
    """Seconds per batch: best of ``repeats`` runs of ``steps`` batches from a fresh
    iterator each (its start-up — threads, worker processes — excluded by 2 warm batches)."""
    best = float("inf")
    for _ in range(repeats):
        it = make_iter()
        for _ in range(2):
            next(it)
        t = time.perf_counter()
        for _ in range(steps):
            batch = next(it)
        if block is not None:
            block(batch)
        best = min(best, (time.perf_counter() - t) / steps)
        close = getattr(it, "close", None)
        if close is not None:
            close()
        del it
    return best


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=200, help="batches per measurement")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workers", default="0,2", help="grain DataLoader worker_count values")
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--cache-dir", default="", help="reuse/keep the demo data and cache here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more config override of the build (repeatable)")  # fmt: skip
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    load_at_start = os.getloadavg()[0]

    from absl import flags

    # grain 0.2.18 + JAX reads an absl flag when it starts worker processes and raises
    # outside absl.app unless flags count as parsed (google/grain#1355).
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()

    import bench_loader
    import grain
    import jax

    from hf_pipeline.adapters.grain_source import GrainSource
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config
    from hf_pipeline.demo.generate import generate_demo
    from hf_pipeline.read.loader import Loader
    from hf_pipeline.read.sampler import GlobalSampler

    # A real cache (markers, fingerprint): the Grain DataLoader's worker processes reopen
    # it from its root, as a user's would.
    work = Path(args.cache_dir or os.path.join(tempfile.gettempdir(), f"bench_grain_{args.rows}"))
    data = work / "data"
    if not (data / "DONE").exists():
        shards = max(1, args.rows // 1000)
        generate_demo(data, num_shards=shards, samples_per_shard=args.rows // shards)
        (data / "DONE").touch()
    cfg = load_config(
        None,
        [f"data.shards={data}", f"build.cache_dir={work / 'cache'}",
         f"build.num_proc={args.num_proc}", "encoder.device=cpu", *args.set],
    )  # fmt: skip
    built = prepare_cache(cfg, progress=False)
    bench_loader.warm(sorted(str(f) for f in Path(built.cache_dir).rglob("*.arrow")))
    src = GrainSource.from_build(built, crop="random", seed=0)
    n, B, steps = len(src), args.batch, args.steps
    sample_bytes = src.sample_source.sample_bytes
    results: dict[str, dict] = {}

    def record(name: str, sec: float, note: str) -> None:
        results[name] = {
            "ms_per_batch": sec * 1e3,
            "samples_per_s": B / sec,
            "GB_per_s": B * sample_bytes / sec / 1e9,
            "note": note,
        }
        print(f"{name:40s} {sec * 1e3:9.2f} ms/batch {B / sec:12.0f} samples/s", flush=True)

    def loader_iter():
        ld = Loader(src.sample_source, global_batch_size=B, process_index=0, process_count=1)
        it = ld.epochs(None)

        def gen():
            try:
                yield from it
            finally:
                ld.close()

        return gen()

    record(
        "loader",
        _time_iter(loader_iter, steps, args.repeats, jax.block_until_ready),
        f"hf_pipeline Loader, num_threads=min(4, cpus), jax arrays on {jax.devices()[0].platform}",
    )
    rng = np.random.default_rng(0)
    order = rng.permutation(n)

    def gather_iter():
        for s in itertools.count():
            idx = order[(s * B) % (n - B) : (s * B) % (n - B) + B]
            yield src.get_batch(idx)

    record("gather", _time_iter(gather_iter, steps, args.repeats), "one NumPy gather, no thread")

    per_record = grain.MapDataset.source(src).shuffle(seed=0).repeat().batch(B, drop_remainder=True)
    record(
        "grain MapDataset per-record",
        _time_iter(lambda: iter(per_record.to_iter_dataset()), steps, args.repeats),
        "source[i] per record + np.stack, Grain read threads",
    )
    batched = (
        grain.MapDataset.range(n)
        .shuffle(seed=0)
        .repeat()
        .batch(B, drop_remainder=True)
        .map(src.get_batch)
    )
    record(
        "grain MapDataset batched",
        _time_iter(lambda: iter(batched.to_iter_dataset()), steps, args.repeats),
        "indices batched by Grain, GrainSource.get_batch: one gather per batch",
    )
    # Grain over our global order: one record per global batch (GlobalSampler, as the
    # Loader draws them), this process's share gathered at once. No per-sample Python.
    gs = GlobalSampler(n, global_batch_size=B, seed=0)
    share = gs.process_positions(jax.process_index(), jax.process_count())
    spe = gs.steps_per_epoch

    def global_batch(g):
        ids, _ = gs.global_batch(g // spe, g % spe)
        return src.get_batch(ids[share])

    by_batch = grain.MapDataset.range(spe * 1000).map(global_batch)
    record(
        "grain MapDataset of global batches",
        _time_iter(lambda: iter(by_batch.to_iter_dataset()), steps, args.repeats),
        "record g = global batch g of hf_pipeline.read.sampler's order, one gather",
    )

    # The Loader hands out jax.Arrays, transferred on its prefetch threads: the same
    # here on Grain's read threads (int64 keys stay NumPy, as the Loader keeps them).
    def to_device(batch):
        out = dict(batch)
        for name in ("latents", "embeddings"):
            out[name] = jax.block_until_ready(jax.device_put(batch[name]))
        return out

    on_device = by_batch.map(to_device)
    record(
        "grain MapDataset of global batches + device_put",
        _time_iter(lambda: iter(on_device.to_iter_dataset()), steps, args.repeats),
        "as above, then jax.device_put in Grain's read threads (what the Loader delivers)",
    )
    for wc in (int(w) for w in args.workers.split(",") if w):
        sampler = grain.samplers.IndexSampler(
            num_records=n,
            shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
            shuffle=True,
            num_epochs=None,
            seed=0,
        )
        dl = grain.DataLoader(
            data_source=src,
            sampler=sampler,
            operations=[grain.transforms.Batch(B, drop_remainder=True)],
            worker_count=wc,
        )
        record(
            f"grain DataLoader per-record w={wc}",
            _time_iter(lambda dl=dl: iter(dl), steps, args.repeats),
            "in process" if wc == 0 else f"{wc} spawned worker processes",
        )

    base = results["loader"]["samples_per_s"]
    for r in results.values():
        r["x_loader"] = r["samples_per_s"] / base
    # Where the per-record path spends its time: one record through GrainSource.
    t = time.perf_counter()
    for i in range(2000):
        src[int(order[i % n])]
    per_record_us = (time.perf_counter() - t) / 2000 * 1e6
    out = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg_1m_at_start": load_at_start,
        "load_avg_1m_at_end": os.getloadavg()[0],
        "grain": grain.__version__,
        "rows": args.rows,
        "records": n,
        "batch": B,
        "steps": steps,
        "repeats": args.repeats,
        "sample_bytes": sample_bytes,
        "grain_source_getitem_us": per_record_us,
        "results": results,
    }
    print(f"GrainSource[i]: {per_record_us:.1f} us per record")
    if args.json:
        write_result(args.json, out)
    return out


if __name__ == "__main__":
    main()
