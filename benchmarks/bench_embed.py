#!/usr/bin/env python
"""Caption-embedding throughput on the accelerator: bare forward variants and FLOP use.

For all-MiniLM-L6-v2 and a model shaped like ``google/gemma-3-270m`` (random weights
built from their configs: the speed is the architecture's, no download needed), in each
compute dtype, times :meth:`hf_pipeline.embed.TextEncoder.encode_ids` on the same
synthetic token ids (COYO llava-caption lengths, truncated to ``max_length``) with:

- ``rows``: micro-batches of ``micro_batch_size`` rows (the 0.1 behaviour, the reference);
- ``tokens``: micro-batches of ``encoder.tokens_per_batch`` padded tokens;
- ``tokens+compile``: the same with ``encoder.compile`` (one graph per padded shape; the
  compile time is reported apart and a second, timed pass reuses the graphs).

Reports rows/s, the ratio to the ``rows`` reference of the same run, and the model FLOP
utilisation: useful FLOPs (2 x non-embedding parameters per real token, plus attention
4 x layers x hidden x length per real token) per second over the card's dense peak for
the dtype (H100/H200: 989 TFLOP/s bf16/fp16, 67 fp32 without TF32).

Usage: ``python benchmarks/bench_embed.py --json out.json`` (a GPU; on the CPU it is a
smoke run with tiny sizes).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_PEAK_TFLOPS = {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}  # H100/H200 SXM dense


def _tokenizer_folder(args) -> Path:
    """A folder holding the MiniLM tokenizer files (from --tokenizer or the package)."""
    if args.tokenizer:
        return Path(args.tokenizer)
    from hf_pipeline.embed import resolve_encoder_path

    return Path(resolve_encoder_path("minilm"))


def _random_model(kind: str, folder: Path, tok: Path) -> tuple[str, int, int]:
    """Save a random-weight model of ``kind`` with the MiniLM tokenizer; (path, layers, hidden)."""
    import torch
    from transformers import AutoModel, AutoTokenizer, BertConfig, Gemma3TextConfig

    if kind == "minilm":
        cfg = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6,
                         num_attention_heads=12, intermediate_size=1536,
                         max_position_embeddings=512)  # fmt: skip
    else:
        cfg = Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                               num_hidden_layers=18, num_attention_heads=4,
                               num_key_value_heads=1, head_dim=256,
                               max_position_embeddings=32768)  # fmt: skip
    torch.manual_seed(0)
    AutoModel.from_config(cfg).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tok)).save_pretrained(folder)
    return str(folder), cfg.num_hidden_layers, cfg.hidden_size


def _non_embedding_params(model) -> int:
    total = sum(p.numel() for p in model.parameters())
    emb = sum(m.weight.numel() for m in model.modules() if m.__class__.__name__ == "Embedding")
    return total - emb


def _ids(n: int, max_length: int, vocab: int, seed: int = 0):
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    # llava captions: ~60-120 words, ~1.3 tokens a word; truncated at max_length.
    lengths = np.clip(rng.normal(95, 35, size=n).astype(int), 8, max_length)
    flat = rng.integers(1000, vocab - 1, size=int(lengths.sum()), dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat)), lengths


def _time(fn, gpu: bool) -> float:
    import torch

    if gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if gpu:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench(args) -> list[dict]:
    import torch

    from hf_pipeline.config import EncoderConfig
    from hf_pipeline.embed import TextEncoder

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    tok = _tokenizer_folder(args)
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, max_len in (("minilm", args.minilm_length), ("gemma", args.gemma_length)):
            if kind not in args.models:
                continue
            path, layers, hidden = _random_model(kind, Path(tmp) / kind, tok)
            for dtype in args.dtypes:
                base = dict(model=path, dtype=dtype, device=device, max_length=max_len)
                variants = {
                    "rows": EncoderConfig(**base, micro_batch_size=args.micro_batch),
                    "tokens": EncoderConfig(**base, micro_batch_size=4096,
                                            tokens_per_batch=args.tokens),  # fmt: skip
                    "tokens+compile": EncoderConfig(**base, micro_batch_size=4096,
                                                    tokens_per_batch=args.tokens, compile=True),  # fmt: skip
                }
                ref = None
                for name, cfg in variants.items():
                    if name not in args.variants:
                        continue
                    enc = TextEncoder(cfg)
                    ids, lengths = _ids(args.rows, max_len, enc.model.config.vocab_size)
                    warm = _time(lambda e=enc, i=ids: e.encode_ids(i), gpu)  # compile, plans
                    dt = min(_time(lambda e=enc, i=ids: e.encode_ids(i), gpu) for _ in range(args.repeat))
                    p_ne = _non_embedding_params(enc.model)
                    flops = float(2 * p_ne * lengths.sum() + 4 * layers * hidden * (lengths**2).sum())
                    rate = args.rows / dt
                    ref = rate if name == "rows" else ref
                    row = {
                        "model": kind, "dtype": dtype, "variant": name, "max_length": max_len,
                        "rows": args.rows, "mean_tokens": float(lengths.mean()),
                        "tokens_per_batch": cfg.tokens_per_batch, "rows_per_s": rate,
                        "vs_rows_reference": rate / ref if ref else None,
                        "first_pass_s": warm, "timed_pass_s": dt,
                        "non_embedding_params": p_ne,
                        "mfu": flops / dt / (_PEAK_TFLOPS[dtype] * 1e12) if gpu else None,
                    }  # fmt: skip
                    rows_out.append(row)
                    print(json.dumps(row), flush=True)
                    del enc
                    if gpu:
                        torch.cuda.empty_cache()
    return rows_out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="minilm,gemma")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--variants", default="rows,tokens,tokens+compile")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=256, help="rows per micro-batch (reference)")
    p.add_argument("--tokens", type=int, default=65536, help="tokens_per_batch of the variants")
    p.add_argument("--minilm-length", type=int, default=64)
    p.add_argument("--gemma-length", type=int, default=256)
    p.add_argument("--tokenizer", default="", help="folder with the MiniLM tokenizer files")
    p.add_argument("--json", default="")
    args = p.parse_args()
    args.models, args.dtypes = args.models.split(","), args.dtypes.split(",")
    args.variants = args.variants.split(",")
    rows = bench(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
