#!/usr/bin/env python
"""Caption-embedding throughput on the accelerator: bare forward variants and FLOP use.

For all-MiniLM-L6-v2 and a model shaped like ``google/gemma-3-270m`` (random weights
built from their configs: the speed is the architecture's, no download needed), in each
compute dtype, times :meth:`hf_pipeline.encoder.model.TextEncoder.encode_ids` on the same
synthetic token ids (COYO llava-caption lengths, ~95 tokens, truncated to ``max_length``)
with the variants named in ``--variants`` (see ``VARIANTS``): ``v0.1`` is the reference,
a frozen copy of ``encode_ids`` as it was before issue 10 (``_encode_ids_v01``: 256-row
micro-batches padded on the host, eager); ``rows256`` is today's loop with the 0.1
micro-batch size (it gains from every change to that loop); ``defaults-fuse_gelu`` the
defaults with ``encoder.fuse_gelu: false``; ``tokNk`` micro-batches
of N*1024 padded tokens; ``+compile`` is ``encoder.compile: default`` (``torch.compile``),
``+graphs`` is ``reduce-overhead`` (``torch.compile`` replaying CUDA graphs); ``eager``
and ``graphs`` are the defaults with ``encoder.compile: eager`` / ``graphs`` (eager
kernels replayed from CUDA graphs captured per shape, no compiler);
``+eager_attn`` transformers' eager attention instead of SDPA. With ``--tf32`` every float32
variant is timed once more with ``encoder.tf32`` (TF32 matmuls: other numerics, an explicit
option).

Each variant: a first pass (compilation, CUDA graph recording, kernel plans; reported as
``first_pass_s``), then the best of ``--repeat`` timed passes. Reports rows/s, the ratios
to ``rows256`` and ``v0.1`` of the same run, the embeddings' largest relative L2
difference from theirs, how many bias+GELU steps the encoder fused, and the model FLOP
utilisation: useful FLOPs (2 x non-embedding parameters
per real token, plus attention 4 x layers x attention width x length per real token;
padding counts as waste) per second over the card's dense peak for the dtype (H100/H200
SXM: 989 TFLOP/s bf16/fp16 and tf32 495, 67 fp32).

Every variant compiles cold: the run sets ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``
(``--warm-compile-cache`` keeps inductor's on-disk caches). Those caches key on the graph
before the attention kernel is chosen, so a variant could otherwise run the graph an
earlier variant, or an earlier version of the code, compiled.

Usage: ``python benchmarks/bench_embed.py --variants v0.1,rows256,defaults --json out.json``
(a GPU; on the CPU it is a smoke run: use ``--minilm-rows`` and ``--gemma-rows`` small).
``--json`` is rewritten after each variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._results import write_result  # noqa: E402

_PEAK_TFLOPS = {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0, "tf32": 494.5}

#: name -> EncoderConfig overrides (on top of model, dtype, device, max_length).
VARIANTS = {
    "rows256": dict(micro_batch_size=256, tokens_per_batch=0, compile="eager"),
    **{
        f"tok{k}k": dict(micro_batch_size=1 << 20, tokens_per_batch=k * 1024, compile="eager")
        for k in (16, 32, 64, 128, 256)
    },
    **{
        f"tok{k}k+compile": dict(
            micro_batch_size=1 << 20, tokens_per_batch=k * 1024, compile="default"
        )
        for k in (16, 32, 64, 128, 256)
    },
    **{
        f"tok{k}k+graphs": dict(
            micro_batch_size=1 << 20, tokens_per_batch=k * 1024, compile="reduce-overhead"
        )  # fmt: skip
        for k in (16, 32, 64, 128, 256)
    },
    "tok64k+eager_attn": dict(
        micro_batch_size=1 << 20,
        tokens_per_batch=65536,
        compile="eager",
        attn_implementation="eager",
    ),  # fmt: skip
    "defaults": {},  # whatever EncoderConfig defaults to (encoder.compile: auto)
    "eager": dict(compile="eager"),  # the defaults, eager (configs/demo.yaml's setting)
    "graphs": dict(compile="graphs"),  # the defaults, eager kernels from captured CUDA graphs
    "defaults-fuse_gelu": dict(fuse_gelu=False),
    # The encoder loop as it was when issue 10 was filed (see _encode_ids_v01).
    "v0.1": dict(micro_batch_size=256, tokens_per_batch=0, compile="eager", fuse_gelu=False),
}


def _encode_ids_v01(enc, ids) -> np.ndarray:
    """``TextEncoder.encode_ids`` as of commit 4b9487f (before issue 10's work), frozen
    here as the reference the issue's "3x the bare forward of today" is measured against:
    256-row micro-batches padded on the host (widths rounded to 32) and uploaded one by
    one, eager model with torch's own SDPA choice, results copied to pageable memory and
    scattered back to the input order on the host. Later changes to ``TextEncoder`` (device
    batches, pinned copies...) speed up ``rows256`` as well; this copy keeps the baseline
    fixed."""
    import pyarrow as pa
    import torch

    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    n = len(ids)
    out = np.zeros((n, enc.dim), dtype=enc.output_dtype)
    offsets = ids.offsets.to_numpy()
    flat = ids.flatten().to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    starts = offsets[:-1] - offsets[0]
    lengths = np.diff(offsets)
    order = np.argsort(lengths, kind="stable")
    mb, pad = enc.cfg.micro_batch_size, enc.tokenizer.pad_token_id
    pooled_parts = []
    with torch.inference_mode():
        for first in range(0, n, mb):
            idx = order[first : first + mb]
            lens = lengths[idx]
            width = min(max(1, int(lens.max())), enc.cfg.max_length)
            width = max(width, min(enc.cfg.max_length, -(-width // 32) * 32))
            cols = np.arange(width)
            valid = cols[None, :] < lens[:, None]
            gather = np.where(valid, starts[idx, None] + cols[None, :], 0)
            tokens = np.where(valid, flat[gather] if flat.size else pad, pad)
            input_ids = torch.from_numpy(tokens).to(enc.device, non_blocking=True)
            mask = torch.from_numpy(valid.astype(np.int64)).to(enc.device, non_blocking=True)
            hidden = enc.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1)
            if enc.cfg.normalize:
                pooled = torch.nn.functional.normalize(pooled.float(), dim=-1)
            pooled_parts.append(pooled.float())
        result = torch.cat(pooled_parts).cpu().numpy()
    out[order] = result.astype(enc.output_dtype, copy=False)
    return out


def _tokenizer_folder(args) -> Path:
    """A folder holding the MiniLM tokenizer files (from --tokenizer or the package)."""
    if args.tokenizer:
        return Path(args.tokenizer)
    from hf_pipeline.encoder.model import resolve_encoder_path

    return Path(resolve_encoder_path("minilm"))


def _random_model(kind: str, folder: Path, tok: Path) -> tuple[str, int, int]:
    """Save a random-weight model of ``kind`` with the MiniLM tokenizer.

    Returns (path, layers, attention width = heads x head dim).
    """
    from benchmarks.random_models import save_random_model

    cfg = save_random_model(kind, folder, tok)
    attn = cfg.hidden_size if kind == "minilm" else cfg.num_attention_heads * cfg.head_dim
    return str(folder), cfg.num_hidden_layers, attn


def _non_embedding_params(model) -> int:
    import torch

    total = sum(p.numel() for p in model.parameters())
    # Table lookups, not matmuls (gemma's scaled word embedding subclasses nn.Embedding).
    emb = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    return total - emb


def _ids(n: int, max_length: int, vocab: int, seed: int = 0):
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    # llava captions: ~60-120 words, ~1.3 tokens a word; truncated at max_length.
    lengths = np.clip(rng.normal(95, 35, size=n).astype(int), 8, max_length)
    flat = rng.integers(1000, vocab - 1, size=int(lengths.sum()), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat)), lengths


def _timed(fn, gpu: bool) -> tuple[float, object]:
    import torch

    if gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if gpu:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def _rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    """Largest per-row relative L2 difference."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(
        (np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-30)).max()
    )


def _measure(enc, ids, lengths, args, gpu, flops, peak, encode=None) -> dict:
    encode = encode or enc.encode_ids
    first, out = _timed(lambda: encode(ids), gpu)
    dt = min(_timed(lambda: encode(ids), gpu)[0] for _ in range(args.repeat))
    return {
        "rows_per_s": len(lengths) / dt, "timed_pass_s": dt, "first_pass_s": first,
        "tflops": flops / dt / 1e12, "mfu": flops / dt / (peak * 1e12) if gpu else None,
        "out": out,
    }  # fmt: skip


def bench(args) -> list[dict]:
    import torch

    from hf_pipeline.config import EncoderConfig
    from hf_pipeline.encoder.model import TextEncoder

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    card = torch.cuda.get_device_name() if gpu else "cpu"
    tok = _tokenizer_folder(args)
    rows_out: list[dict] = []
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.models:
            max_len = args.minilm_length if kind == "minilm" else args.gemma_length
            n = args.minilm_rows if kind == "minilm" else args.gemma_rows
            path, layers, attn = _random_model(kind, Path(tmp) / kind, tok)
            for dtype in args.dtypes:
                ref = ref_out = v01 = v01_out = None
                ids = lengths = None
                for name in args.variants:
                    if time.monotonic() - t_start > args.deadline:
                        print(f"deadline: skipped {kind} {dtype} {name}", flush=True)
                        continue
                    cfg = EncoderConfig(model=path, dtype=dtype, device=device,
                                        max_length=max_len, **VARIANTS[name])  # fmt: skip
                    torch._dynamo.reset()  # each variant compiles for itself
                    enc = TextEncoder(cfg)
                    if ids is None:
                        ids, lengths = _ids(n, max_len, enc.model.config.vocab_size)
                    p_ne = _non_embedding_params(enc.model)
                    flops = float(2 * p_ne * lengths.sum() + 4 * layers * attn * (lengths**2).sum())
                    tf32_runs = (
                        [False, True] if (args.tf32 and dtype == "float32" and gpu) else [False]
                    )
                    for tf32 in tf32_runs:
                        # Same encoder (compiled graphs reused), float32 matmul precision
                        # switched through its config: encode_ids reads it at call time.
                        enc.cfg = dataclasses.replace(cfg, tf32=tf32)
                        peak = _PEAK_TFLOPS["tf32" if tf32 else dtype]
                        encode = functools.partial(_encode_ids_v01, enc) if name == "v0.1" else None
                        m = _measure(enc, ids, lengths, args, gpu, flops, peak, encode)
                        out = m.pop("out")
                        if name == "rows256" and not tf32:
                            ref, ref_out = m["rows_per_s"], out
                        if name == "v0.1" and not tf32:
                            v01, v01_out = m["rows_per_s"], out
                        row = {
                            "card": card, "model": kind, "dtype": dtype,
                            "variant": name + ("+tf32" if tf32 else ""),
                            "max_length": max_len, "rows": n,
                            "mean_tokens": float(lengths.mean()),
                            "tokens_per_batch": cfg.tokens_per_batch,
                            "micro_batch_size": cfg.micro_batch_size,
                            "compile": enc.compile_mode,
                            "attn": enc.model.config._attn_implementation,
                            **m,
                            "vs_rows256": m["rows_per_s"] / ref if ref else None,
                            "max_rel_diff_vs_rows256": _rel_diff(out, ref_out) if ref_out is not None else None,
                            "vs_v0.1": m["rows_per_s"] / v01 if v01 else None,
                            "max_rel_diff_vs_v0.1": _rel_diff(out, v01_out) if v01_out is not None else None,
                            "fused_gelu": enc.fused_gelu,
                            "non_embedding_params": p_ne,
                            "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
                        }  # fmt: skip
                        rows_out.append(row)
                        print(json.dumps(row), flush=True)
                        if args.json:
                            write_result(args.json, rows_out)
                        if gpu and name in args.profile and not tf32:
                            try:
                                _profile(enc, ids, f"{args.profile_dir}/profile_{kind}_{dtype}.txt")
                            except Exception as exc:  # a profiler quirk must not cost the run
                                print(f"profile failed: {exc!r}", flush=True)
                    del enc
                    if gpu:
                        torch.cuda.empty_cache()
    return rows_out


def _profile(enc, ids, path: str) -> None:
    """One more pass under torch.profiler: the kernels that take the GPU's time, and how
    much of the pass the GPU was busy (the rest: host work and launch gaps)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        enc.encode_ids(ids)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e6
    table = events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70)
    text = f"wall {wall:.3f} s (profiled), kernels {busy:.3f} s ({100 * busy / wall:.0f}%)\n{table}"
    Path(path).write_text(text)
    print(text[:3000], flush=True)


def _table(rows: list[dict]) -> str:
    lines = [f"{'model':7} {'dtype':9} {'variant':24} {'rows/s':>10} {'x 256':>6} {'x 0.1':>6} "
             f"{'MFU':>6} {'first s':>8} {'reldiff':>8}"]  # fmt: skip
    for r in rows:
        mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] is not None else "   -"
        vs = f"{r['vs_rows256']:6.2f}" if r["vs_rows256"] else "     -"
        v01 = f"{r['vs_v0.1']:6.2f}" if r["vs_v0.1"] else "     -"
        rd = r["max_rel_diff_vs_rows256"]
        lines.append(f"{r['model']:7} {r['dtype']:9} {r['variant']:24} {r['rows_per_s']:10.0f} "
                     f"{vs} {v01} {mfu:>6} {r['first_pass_s']:8.1f} "
                     f"{'-' if rd is None else format(rd, '.1e'):>8}")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="minilm,gemma")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument(
        "--variants", default="v0.1,rows256,tok64k,tok64k+compile,tok64k+graphs,defaults"
    )
    p.add_argument("--minilm-rows", type=int, default=100_000)
    p.add_argument("--gemma-rows", type=int, default=30_000)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--minilm-length", type=int, default=64)
    p.add_argument("--gemma-length", type=int, default=256)
    p.add_argument(
        "--tf32", action="store_true", help="also time float32 variants with TF32 matmuls"
    )
    p.add_argument("--deadline", type=float, default=1e9, help="skip variants starting after N s")
    p.add_argument("--profile", default="", help="variants to profile once more (comma list)")
    p.add_argument("--profile-dir", default=".", help="where profile_<model>_<dtype>.txt go")
    p.add_argument("--tokenizer", default="", help="folder with the MiniLM tokenizer files")
    p.add_argument("--warm-compile-cache", action="store_true",
                   help="keep inductor's on-disk caches (default: every variant compiles cold)")  # fmt: skip
    p.add_argument("--json", default="")
    args = p.parse_args()
    if not args.warm_compile_cache:  # read when torch is first imported, below
        os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    args.models, args.dtypes = args.models.split(","), args.dtypes.split(",")
    args.variants = args.variants.split(",")
    args.profile = args.profile.split(",") if args.profile else []
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown --variants {unknown}; known: {', '.join(VARIANTS)}")
    for reference in ("rows256", "v0.1"):  # references first: ratios and differences need them
        if reference in args.variants:
            args.variants.remove(reference)
            args.variants.insert(0, reference)
    rows = bench(args)
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
