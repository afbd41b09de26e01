#!/usr/bin/env python
"""A compiled encoder's warm-up in a fresh process, cold and with the job's shared
compile artifacts (issue 28: each rank compiled the same graphs again, 97 s cold for the
gemma-3-270m shape on an H200).

Two fresh processes, one after the other, each with empty inductor and Triton caches of
its own (as two nodes have): the first compiles the encoder cold
(``TextEncoder.warm_up_shared``: it claims the compile and publishes its
``torch.compiler`` artifacts under ``--work-dir/cache/.compiled``); the second finds
them, loads them and warms up. Reported: each process's ``load_seconds`` (``warm_up``,
``compile_artifacts``: ``published`` / ``loaded``, the wait), the whole encoder start
(construction + warm-up), and ``warm_up_ratio`` = cold / shared.

The encoder is a random-weight ``--random-gemma`` (default) or ``--random-minilm`` model
with the tokenizer in ``TOKENIZER_DIR``, ``encoder.compile: default``, ``--dtype``
(bfloat16), on ``cuda:0`` (``--device cpu`` is a smoke run: nothing compiles in a CPU
warm-up). Target: the shared warm-up <= 10 s.

Usage::

    python benchmarks/bench_compile_share.py --random-gemma .tok [--dtype bfloat16]
        [--work-dir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._results import write_result  # noqa: E402
from benchmarks.random_models import (  # noqa: E402
    add_random_model_options,
    random_model,
    random_model_option,
)


def _child(spec: dict) -> None:
    """One process: the encoder's start with the shared artifacts folder."""
    t0 = time.monotonic()
    from hf_pipeline.config import EncoderConfig
    from hf_pipeline.encoder.model import (
        CompileArtifacts,
        TextEncoder,
        compile_artifacts_key,
        encoder_identity,
    )

    if spec.get("dynamic"):
        # An experiment, not a setting: compile with every size symbolic from the first
        # call (one compile), where the encoder's dynamic=None compiles the first shape
        # static and recompiles at the second (two). See --dynamic.
        import functools

        import torch

        torch.compile = functools.partial(torch.compile, dynamic=True)
    cfg = EncoderConfig(
        model=spec["model"], dtype=spec["dtype"], device=spec["device"], compile="default",
        max_length=spec["max_length"],
    )  # fmt: skip
    enc = TextEncoder(cfg)
    key = compile_artifacts_key(cfg, encoder_identity(cfg), enc.device, backend=enc.backend)
    shared = CompileArtifacts(spec["shared"], key, wait_s=0)
    t1 = time.monotonic()
    enc.warm_up_shared(shared)
    warm_up_shared_s = round(time.monotonic() - t1, 3)
    encoder_start_s = round(time.monotonic() - t0, 3)
    timed = {}
    if spec.get("timed_rows"):
        # The compiled forward's speed after the warm-up (same ids in every variant: a
        # fixed seed), so that a variant that compiles faster is not slower to run.
        import numpy as np
        import pyarrow as pa

        rng = np.random.default_rng(0)
        lengths = rng.integers(8, spec["max_length"] + 1, spec["timed_rows"])
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        tokens = rng.integers(1000, 30000, int(offsets[-1])).astype(np.int32)
        ids = pa.ListArray.from_arrays(offsets, pa.array(tokens))
        t2 = time.monotonic()
        enc.encode_ids(ids)  # first pass: a shape the warm-up missed would compile here
        first_pass_s = round(time.monotonic() - t2, 3)
        t2 = time.monotonic()
        enc.encode_ids(ids)
        seconds = time.monotonic() - t2
        timed = {
            "timed_rows": len(ids),
            "timed_tokens": int(offsets[-1]),
            "first_pass_s": first_pass_s,
            "timed_pass_s": round(seconds, 3),
            "rows_per_s": round(len(ids) / seconds, 1),
        }
    shapes = enc.warm_up_shapes
    slowest = sorted(shapes, key=lambda s: -s[2])[:6]
    out = {
        "load_seconds": enc.load_seconds,
        # Which warm-up calls cost the time: the compiles (or captures) stand out.
        "warm_up_calls": len(shapes),
        "warm_up_slowest": [{"rows": r, "tokens": w, "s": s} for r, w, s in slowest],
        "warm_up_rest_s": round(sum(s[2] for s in shapes) - sum(s[2] for s in slowest), 3),
        "warm_up_shared_s": warm_up_shared_s,
        **timed,
        "encoder_start_s": encoder_start_s,
    }
    print(_CHILD_RESULT + json.dumps(out), flush=True)  # the parent reads this line


#: The child's result line on its stdout (the result file is written once, by the parent).
_CHILD_RESULT = "hf_pipeline-compile-share-result: "


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_random_model_options(ap)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--max-length", type=int, default=0, help="0: 256 gemma, 64 MiniLM")
    ap.add_argument(
        "--dynamic",
        action="store_true",
        help="experiment: torch.compile(dynamic=True) from the first call (one compile "
        "instead of a static one and a symbolic recompile); use its own --work-dir",
    )
    ap.add_argument(
        "--timed-rows", type=int, default=0, help="then time one pass over this many rows"
    )
    ap.add_argument("--work-dir", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--_child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        _child(json.loads(args._child))
        return 0
    kind, tokenizer = random_model_option(ap, args)
    if not tokenizer:
        ap.error("give --random-gemma or --random-minilm TOKENIZER_DIR")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="hfp_compile_share_"))
    model = random_model(kind, work / kind, tokenizer)
    shared = work / "cache" / ".compiled"
    max_length = args.max_length or (256 if kind == "gemma" else 64)
    runs = {}
    for name in ("cold", "shared"):
        env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_FORCE_DISABLE_CACHES"}
        env["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor-{name}")
        env["TRITON_CACHE_DIR"] = str(work / f"triton-{name}")
        spec = {
            "model": model, "dtype": args.dtype, "device": args.device,
            "max_length": max_length, "shared": str(shared), "dynamic": args.dynamic,
            "timed_rows": args.timed_rows,
        }  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, __file__, "--_child", json.dumps(spec)], env=env, check=True,
            timeout=900, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(_CHILD_RESULT))
        runs[name] = {
            "process_wall_s": round(time.perf_counter() - t0, 3),
            **json.loads(line[len(_CHILD_RESULT) :]),
        }
    cold = runs["cold"]["load_seconds"].get("warm_up")
    warm = runs["shared"]["load_seconds"].get("warm_up")
    out = {
        "model": kind,
        "dtype": args.dtype,
        "device": args.device,
        "max_length": max_length,
        "dynamic": "true (experiment)" if args.dynamic else "the encoder's (None)",
        **runs,
        "warm_up_ratio": round(cold / warm, 2) if cold and warm else None,
        "targets": {"shared warm-up <= 10 s": warm is not None and warm <= 10},
    }
    print(json.dumps(out, indent=1))
    if args.json:
        write_result(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
