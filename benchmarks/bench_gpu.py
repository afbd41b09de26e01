#!/usr/bin/env python
"""Accelerator figures: caption-embedding throughput and loader host-to-device rates.

Runs on a GPU machine (falls back to the CPU, for a smoke run). Three parts:

1. **embed** — :class:`hf_pipeline.encoder.model.TextEncoder` rows/s on COYO-length captions, with
   the encoder's defaults (``benchmarks/bench_embed.py`` compares the encoder's variants)
   for all-MiniLM-L6-v2 (``--minilm`` folder; the packaged one by default) and for a
   model shaped like ``google/gemma-3-270m`` (640-d, 18 layers; random weights, built
   from its config: the speed is the architecture's, no download needed).
2. **h2d** — batches/s the :class:`hf_pipeline.read.loader.Loader` delivers *on the device*
   (gather from the memory-mapped Arrow cache layout + transfer on its prefetch
   threads) against a plain ``jax.device_put`` of the same, pre-assembled host arrays
   in the same run.
3. **overlap** — a training step of a fixed cost (``--step-ms``, a jitted matmul chain)
   fed by the loader: the share of step time spent waiting for data.

Prints a table; ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks._results import write_result  # noqa: E402

_WORDS = (
    "a photo of red blue green small large circle square triangle stripes cat dog "
    "tree house car street city night day sky cloud water river mountain person man "
    "woman child standing sitting next to in front behind the with and on under over "
    "bright dark soft detailed watercolor painting illustration background foreground"
).split()


def _captions(n: int, words: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(words // 2, words + words // 2, size=n)
    idx = rng.integers(0, len(_WORDS), size=int(lens.sum()))
    out, pos = [], 0
    for k in lens:
        out.append(" ".join(_WORDS[i] for i in idx[pos : pos + k]))
        pos += k
    return out


def _gemma_like(folder: Path, tokenizer_from: str) -> str:
    """Save a randomly initialised gemma-3-270m-shaped text model with a borrowed tokenizer."""
    from benchmarks.random_models import save_random_model

    save_random_model("gemma", folder, tokenizer_from)
    return str(folder)


def bench_embed(args) -> list[dict]:
    import torch

    from hf_pipeline.config import EncoderConfig
    from hf_pipeline.encoder.model import TextEncoder, resolve_encoder_path

    minilm = args.minilm or resolve_encoder_path("minilm")
    gpu = torch.cuda.is_available()
    rows = []
    caps = _captions(args.embed_rows, args.caption_words)
    with tempfile.TemporaryDirectory() as tmp:
        models = [("all-MiniLM-L6-v2", minilm, 128), ("gemma-3-270m-shaped", None, 256)]
        for name, path, max_len in models:
            if path is None:
                path = _gemma_like(Path(tmp) / "gemma", minilm)
            for dtype in ["float16", "bfloat16"] if gpu else ["float32"]:
                enc = TextEncoder(
                    EncoderConfig(
                        model=path,
                        dtype=dtype,
                        device="cuda" if gpu else "cpu",
                        max_length=max_len,
                        micro_batch_size=args.micro_batch,
                    )
                )
                # The build tokenizes in the num_proc join workers and runs only the
                # model here: time the two halves separately.
                import pyarrow as pa

                t0 = time.perf_counter()
                ids = pa.array(enc.tokenizer(caps), type=pa.list_(pa.int32()))
                tok_s = time.perf_counter() - t0
                # Warm-up on the same ids: kernels, allocator, and with the encoder's
                # defaults on CUDA torch.compile's graphs (one compile per process, apart).
                enc.encode_ids(ids)
                if gpu:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                enc.encode_ids(ids)
                if gpu:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                mean_tokens = float(np.mean([len(x) for x in ids.to_pylist()]))
                rows.append(
                    {
                        "model": name,
                        "dtype": dtype,
                        "max_length": max_len,
                        "dim": enc.dim,
                        "rows": len(caps),
                        "mean_tokens": mean_tokens,
                        "rows_per_s": len(caps) / dt,
                        "tokenize_rows_per_s_one_process": len(caps) / tok_s,
                    }
                )
                del enc
                if gpu:
                    torch.cuda.empty_cache()
    return rows


def _source(args):
    """The real memory-mapped cache layout (pyarrow-written: no ``datasets`` needed)."""
    from bench_loader import build_pyarrow

    from hf_pipeline.read.mapped import SampleSource

    files = build_pyarrow(
        str(Path(args.workdir) / "cache"),
        args.rows,
        args.dim,
        "float16",
        num_files=4,
        writer_batch_size=1000,
    )
    return SampleSource(*files, fingerprint="bench")


def bench_h2d(args) -> dict:
    import jax

    from hf_pipeline.read.loader import Loader

    src = _source(args)
    B = args.batch
    # Reference: the same bytes, already assembled on the host, device_put in a loop.
    host = src.gather(np.arange(B), np.zeros(B, np.int64))
    host = {k: np.ascontiguousarray(v) for k, v in host.items() if k != "keys"}
    jax.block_until_ready(jax.device_put(host))
    t0 = time.perf_counter()
    for _ in range(args.batches):
        jax.block_until_ready(jax.device_put(host))
    ref = args.batches / (time.perf_counter() - t0)
    nbytes = sum(v.nbytes for v in host.values())

    with Loader(
        src,
        global_batch_size=B,
        seed=0,
        process_index=0,
        process_count=1,
        prefetch=args.prefetch,
        num_threads=args.threads,
    ) as loader:
        it = loader.epochs(None)
        for _ in range(3):
            next(it)
        t0 = time.perf_counter()
        for _ in range(args.batches):
            b = next(it)
        jax.block_until_ready(b["latents"])
        got = args.batches / (time.perf_counter() - t0)
    return {
        "device": str(jax.devices()[0]),
        "batch": B,
        "mb_per_batch": nbytes / 1e6,
        "device_put_batches_s": ref,
        "loader_batches_s": got,
        "ratio": got / ref,
        "device_put_gb_s": ref * nbytes / 1e9,
        "loader_gb_s": got * nbytes / 1e9,
    }


def bench_overlap(args) -> dict:
    import jax
    import jax.numpy as jnp

    from hf_pipeline.read.loader import Loader

    src = _source(args)
    size = 2048 if jax.devices()[0].platform != "cpu" else 256

    def make_work(reps: int):
        @jax.jit
        def work(x, lat):
            for _ in range(reps):
                x = jnp.tanh(x @ x) * 0.5
            return x, lat.astype(jnp.float32).mean()

        return work

    x = jnp.ones((size, size), jnp.float32)
    lat0 = jnp.zeros((args.batch, 4, 32, 32), jnp.float16)
    reps = 1
    work = make_work(reps)
    jax.block_until_ready(work(x, lat0))
    # Calibrate the number of matmuls so that one step costs about --step-ms.
    for _ in range(12):
        t0 = time.perf_counter()
        jax.block_until_ready(work(x, lat0))
        dt = (time.perf_counter() - t0) * 1e3
        if abs(dt - args.step_ms) < 0.15 * args.step_ms:
            break
        reps = max(1, int(round(reps * args.step_ms / max(dt, 1e-3))))
        work = make_work(reps)
        jax.block_until_ready(work(x, lat0))
    with Loader(
        src,
        global_batch_size=args.batch,
        seed=0,
        process_index=0,
        process_count=1,
        prefetch=args.prefetch,
        num_threads=args.threads,
    ) as loader:
        it = loader.epochs(None)
        jax.block_until_ready(work(x, next(it)["latents"]))
        wait = 0.0
        empty = 0  # steps that found no batch ready (a real wait for data)
        t_all = time.perf_counter()
        for _ in range(args.batches):
            empty += loader.stats().queue_depth == 0
            t0 = time.perf_counter()
            b = next(it)
            wait += time.perf_counter() - t0
            x2, _ = work(x, b["latents"])
            jax.block_until_ready(x2)
        total = time.perf_counter() - t_all
    return {
        "step_ms": total / args.batches * 1e3,
        "matmuls_per_step": reps,
        "data_wait_share": wait / total,
        "mean_wait_ms": wait / args.batches * 1e3,
        "steps_with_empty_queue": int(empty),
        "steps": args.batches,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="embed,h2d,overlap")
    p.add_argument(
        "--minilm", default="", help="all-MiniLM-L6-v2 folder (default: the packaged one)"
    )
    p.add_argument("--embed-rows", type=int, default=20000)
    p.add_argument(
        "--caption-words",
        type=int,
        default=60,
        help="mean words per caption (llava captions: ~60-120)",
    )
    p.add_argument("--micro-batch", type=int, default=4096, help="encoder.micro_batch_size (rows)")
    p.add_argument("--rows", type=int, default=65536, help="rows in the memory-mapped source")
    p.add_argument("--dim", type=int, default=640)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "hfp_bench_gpu"))
    p.add_argument("--json", default="")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    out: dict = {}
    if "embed" in parts:
        out["embed"] = bench_embed(args)
        print(
            f"{'encoder':22} {'dtype':9} {'max_len':>7} {'tokens':>6} {'dim':>5} "
            f"{'model rows/s':>12} {'tokenize rows/s/process':>24}"
        )
        for r in out["embed"]:
            print(
                f"{r['model']:22} {r['dtype']:9} {r['max_length']:7d} {r['mean_tokens']:6.1f} "
                f"{r['dim']:5d} {r['rows_per_s']:12.0f} {r['tokenize_rows_per_s_one_process']:24.0f}"
            )
    if "h2d" in parts:
        h = out["h2d"] = bench_h2d(args)
        print(
            f"h2d on {h['device']}: batch {h['batch']} ({h['mb_per_batch']:.1f} MB): "
            f"device_put {h['device_put_batches_s']:.1f} batches/s ({h['device_put_gb_s']:.2f} GB/s), "
            f"loader {h['loader_batches_s']:.1f} batches/s ({h['loader_gb_s']:.2f} GB/s) = "
            f"{100 * h['ratio']:.0f}% of device_put"
        )
    if "overlap" in parts:
        o = out["overlap"] = bench_overlap(args)
        print(
            f"overlap: step {o['step_ms']:.1f} ms, data wait {100 * o['data_wait_share']:.2f}% "
            f"of step time (mean {o['mean_wait_ms']:.2f} ms); queue empty before "
            f"{o['steps_with_empty_queue']} of {o['steps']} steps"
        )
    if args.json:
        write_result(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
