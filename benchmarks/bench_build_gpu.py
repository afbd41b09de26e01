#!/usr/bin/env python
"""One builder on a GPU host: the whole build of a scaled demo, its stages, and the
embed stage against the bare forward on the same token ids (same run).

Generates the demo scaled to ``--rows`` (fp16 latents, ``--samples-per-shard`` a
shard), builds it with ``DATASET_NUM_PROC`` workers and the encoder on the GPU, and
reports: wall time of ``prepare_cache``, the join (``seconds_convert``), tokenize
(``seconds_tokenize``: the parts' tokens units, by the workers) and embed
(``seconds_embed``, the encoder's load overlapped with the join) stages, then times
``TextEncoder.encode_ids`` alone on the cache's kept token ids (warm) and reports the
embed stage's rows/s as a ratio to it.

The encoder is ``--model`` (a folder; with ``--random-minilm TOKENIZER_DIR`` a random-
weight MiniLM is made from its config: the speed is the architecture's, no download;
``--random-gemma TOKENIZER_DIR``: a random-weight gemma-3-270m-shaped encoder).

The config is ``configs/demo.yaml`` (``encoder.compile: graphs``: nothing compiles; the
report's ``encoder`` field says which mode ran) plus the ``--set`` overrides. A compiled
encoder (``--set encoder.compile=default``) compiles cold: the run sets
``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``
(``--warm-compile-cache`` keeps inductor's on-disk caches), so a run neither gets graphs
an earlier run (or another version of the code) compiled nor hides the compile time a
fresh node pays.

``--fresh-process-runs N`` measures the build as a user runs it instead: N times, the
caches and the part store removed, ``scripts/prebuild_cache.py`` runs as a fresh
subprocess with the same overrides. The first run starts from a cold root: the
tokenizer store (``.tokenizers``) and the compile artifacts (``.compiled``) removed too,
as on a node's first build (``cold_root_wall_s``); the later runs keep what the runs
before saved there, as on a node that built before (``warm_root_walls_s``; each run's
``tokenizer_from`` says whether its tokenizer came from the store or from
transformers). Each wall is its start to its exit
(``fresh_process_walls_s``), with each build's start-up timeline from its report
(``startup``: when the first shard started after ``prepare_cache`` was entered, issue 28),
the seconds between its last line of output and its exit, and its milestones in seconds
after the process was started (``after_process_start_s``: ``prepare_cache`` entered,
first shard, encoder ready, last marker, exit).
"""

from __future__ import annotations

import argparse
import json
import os
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


def _remove_caches(cache_root: Path, *, cold: bool = False) -> None:
    """Remove the caches and the part store; with ``cold``, what a node's first build
    has not either: the tokenizer store and the compile artifacts."""
    import shutil

    from hf_pipeline.build.part_store import PARTS_DIR
    from hf_pipeline.build.tokenizer_store import TOKENIZER_SPECS_DIR
    from hf_pipeline.encoder.model import COMPILE_ARTIFACTS_DIR

    gone = {PARTS_DIR, *([TOKENIZER_SPECS_DIR, COMPILE_ARTIFACTS_DIR] if cold else [])}
    for old in cache_root.iterdir() if cache_root.is_dir() else ():
        # Kept: .demo-data, .staging (and unless cold, .tokenizers, .compiled). The
        # stored parts go: a run that found them would build nothing.
        if not old.name.startswith(".") or old.name in gone:
            shutil.rmtree(old)


def _after_start(startup: dict | None, started: float, last_marker: float, wall: float):
    """One fresh-process run's milestones in seconds after the process was started
    (``started``, wall clock): ``prepare_cache`` entered, the join's first shard, the
    encoder ready (from the report's ``startup``), the ``filtered`` marker written
    (``last_marker``, its ``finished_at``) and the exit (``wall``)."""
    s = startup or {}
    entered = s.get("entered")
    seconds = s.get("seconds", {})

    def at(event: str) -> float | None:
        t = seconds.get(event)
        return None if entered is None or t is None else round(entered + t - started, 3)

    return {
        "entered": None if entered is None else round(entered - started, 3),
        "first_shard": at("first_shard"),
        "encoder": at("encoder"),
        "last_marker": round(last_marker - started, 3),
        "exit": round(wall, 3),
    }


def _fresh_process_runs(args, work: Path, overrides: list[str], generate_s: float) -> dict:
    """``args.fresh_process_runs`` builds, each by ``scripts/prebuild_cache.py`` in a
    fresh process (caches removed first): their walls (start to exit) and start-ups."""
    import subprocess

    import torch

    repo = Path(__file__).resolve().parent.parent
    script = repo / "scripts" / "prebuild_cache.py"
    sets = [a for o in overrides for a in ("--set", o)]
    walls, gaps, startups, timelines, summary = [], [], [], [], {}
    for run in range(args.fresh_process_runs):
        _remove_caches(work / "cache", cold=run == 0)
        os.sync()
        summary_path = work / "summary.json"
        started = time.time()  # wall clock: the report's start-up timeline counts in it
        t0 = time.perf_counter()
        p = subprocess.Popen(
            [sys.executable, str(script), "-q", "--json", str(summary_path), *sets],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        last, lines = t0, []
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line.rstrip())
            last = time.perf_counter()
        code = p.wait(timeout=600)
        end = time.perf_counter()
        if code != 0:
            raise SystemExit(f"prebuild_cache.py exited {code}: " + "\n".join(lines[-20:]))
        walls.append(round(end - t0, 3))
        gaps.append(round(end - last, 3))
        summary = json.loads(summary_path.read_text())
        cache_dir = Path(summary["cache_dir"])
        (report,) = cache_dir.glob("filtered.*/report.json")
        startups.append(json.loads(report.read_text()).get("startup"))
        last_marker = json.loads((cache_dir / "filtered.json").read_text())["finished_at"]
        timelines.append(_after_start(startups[-1], started, float(last_marker), end - t0))
    first_shard = [(s or {}).get("seconds", {}).get("first_shard") for s in startups]
    tokenizer_from = [(s or {}).get("notes", {}).get("tokenizer") for s in startups]
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cpus": os.cpu_count(),
        "rows_in": summary.get("rows_in"),
        "rows_out": summary.get("rows_out"),
        "generate_s": round(generate_s, 2),
        "fresh_process_walls_s": walls,
        # The first run on a cold root (no stored tokenizer, no compile artifacts), the
        # others on what the runs before left there: report both.
        "cold_root_wall_s": walls[0] if walls else None,
        "warm_root_walls_s": walls[1:],
        "tokenizer_from": tokenizer_from,
        "tokenizer_ready_after_entry_s": [
            (s or {}).get("seconds", {}).get("tokenizer") for s in startups
        ],
        "first_shard_after_entry_s": first_shard,
        "exit_after_last_output_s": gaps,
        "after_process_start_s": timelines,
        "startup": startups,
        "overrides": args.set,
        "targets": {
            "every wall <= 10 s": all(w <= 10 for w in walls),
            "every first shard <= 1.5 s": all(f is not None and f <= 1.5 for f in first_shard),
            "every exit <= 0.3 s": all(g <= 0.3 for g in gaps),
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--samples-per-shard", type=int, default=1000)
    ap.add_argument("--model", default="minilm")
    add_random_model_options(ap)
    ap.add_argument("--dtype", default="float16", help="encoder.dtype")
    ap.add_argument("--work-dir", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="one more config override (repeatable), e.g. build.part_shards=25")  # fmt: skip
    ap.add_argument(
        "--rebuild", action="store_true",
        help="remove the caches already in --work-dir first (the generated demo stays)",
    )  # fmt: skip
    ap.add_argument("--warm-compile-cache", action="store_true",
                    help="keep inductor's on-disk caches (default: compile cold)")  # fmt: skip
    ap.add_argument("--fresh-process-runs", type=int, default=0, metavar="N",
                    help="time N builds by scripts/prebuild_cache.py in fresh processes")  # fmt: skip
    args = ap.parse_args()
    kind, tokenizer = random_model_option(ap, args)
    if not args.warm_compile_cache:  # read when torch is first imported, below
        os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"

    import numpy as np
    import torch

    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config
    from hf_pipeline.encoder.model import TextEncoder

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="hfp_build_gpu_"))
    model = args.model
    if tokenizer:
        model = random_model(kind, work / kind, tokenizer)
    shards = max(1, args.rows // args.samples_per_shard)
    overrides = [
        f"build.cache_dir={work / 'cache'}",
        f"data.demo.num_shards={shards}",
        f"data.demo.samples_per_shard={args.samples_per_shard}",
        f"encoder.model={model}",
        f"encoder.dtype={args.dtype}",
        *args.set,
    ]
    cfg = load_config(None, overrides)
    if args.rebuild:
        _remove_caches(work / "cache")
    # The demo is generated once (timed apart): the figures are the build's.
    from hf_pipeline.build.prepare import resolve_inputs

    t0 = time.perf_counter()
    resolve_inputs(cfg)
    generate_s = time.perf_counter() - t0
    os.sync()  # the build does not pay for the writeback of the demo (or earlier caches)
    if args.fresh_process_runs:
        out = _fresh_process_runs(args, work, overrides, generate_s)
        print(json.dumps(out, indent=1))
        if args.json:
            write_result(args.json, out)
        return 0
    t0 = time.perf_counter()
    res = prepare_cache(cfg, progress=False)
    wall = time.perf_counter() - t0
    r = res.report
    # The bare forward on the kept rows' token ids, warm, same process and GPU.
    from hf_pipeline.cache.layout import open_dataset

    ids = open_dataset(res.layout).data.column("input_ids")
    encoder = TextEncoder(cfg.encoder)
    encoder.encode_ids(ids.slice(0, min(len(ids), 20_000)))  # warm: kernels, compile
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    bare_laps: dict[str, float] = {}
    encoder.encode_ids(ids, laps=bare_laps)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    bare = time.perf_counter() - t0
    # The same rows in the stage's calls (EMBED_ROWS_PER_CALL rows each), nothing beside.
    from hf_pipeline.build.embed_stage import EMBED_ROWS_PER_CALL

    call_laps: dict[str, float] = {}
    t0 = time.perf_counter()
    for start in range(0, len(ids), EMBED_ROWS_PER_CALL):
        encoder.encode_ids(ids.slice(start, EMBED_ROWS_PER_CALL), laps=call_laps)
    in_calls = time.perf_counter() - t0
    embedded_rows = int(r["rows_out"]) + int(r["dropped"].get("duplicate_key", 0))
    out = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cpus": os.cpu_count(),
        "num_proc": cfg.build.effective_num_proc,
        "rows_in": r["rows_in"],
        "rows_out": r["rows_out"],
        "generate_s": round(generate_s, 2),
        "build_wall_s": round(wall, 2),
        "join_s": r["seconds_convert"],
        "embed_stage_s": r["seconds_embed"],
        # The parts' token ids (their tokens units, by the num_proc workers between
        # joins; None from a release before them), and the embed stage's own
        # tokenizing (0 when every part's ids came from its tokens unit).
        "tokenize_s": r.get("seconds_tokenize"),
        "tokenize_worker_busy_s": round(
            sum(float((p.get("tokens") or {}).get("worker_busy_seconds", 0)) for p in r["parts"]), 3
        ),
        "embed_stage_tokenize_s": round(
            sum(float((p.get("embed") or {}).get("seconds_tokenize", 0)) for p in r["parts"]), 3
        ),
        "bare_forward_s": round(bare, 3),
        "bare_forward_rows_per_s": round(len(ids) / bare),
        "bare_forward_laps": {k: round(v, 3) for k, v in bare_laps.items()},
        "bare_in_stage_calls_s": round(in_calls, 3),
        "bare_in_stage_calls_laps": {k: round(v, 3) for k, v in call_laps.items()},
        "embed_stage_rows_per_s": round(embedded_rows / max(r["seconds_embed"], 1e-9)),
        "embed_stage_vs_bare": round((embedded_rows / r["seconds_embed"]) / (len(ids) / bare), 3),
        "overrides": args.set,
        "parts": r["parts"],  # each part's join and embed timelines, encoder wait
        "encoder": {"dtype": cfg.encoder.dtype, "compile": cfg.encoder.compile,
                    "tokens_per_batch": cfg.encoder.tokens_per_batch},
    }  # fmt: skip
    print(json.dumps(out, indent=1))
    if args.json:
        write_result(args.json, out)
    del np
    return 0


if __name__ == "__main__":
    sys.exit(main())
