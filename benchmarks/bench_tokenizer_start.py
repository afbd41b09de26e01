#!/usr/bin/env python
"""A fresh process's caption tokenizer: read natively from the model folder
(:mod:`hf_pipeline.encoder.bert_tokenizer`) against through transformers, and the
cold-root demo build of this tree against an older one's (issue 28).

``--runs N``: N pairs of fresh interpreters (``python -c``), native and transformers
alternating: each loads the config and the tokenizer (:func:`native_tokenizer` +
:class:`~hf_pipeline.encoder.model.WorkerTokenizer`, or
:class:`~hf_pipeline.encoder.model.CaptionTokenizer`), tokenizes one caption and prints
a line; the figure is the wall from the spawn to that line.

``--build-runs N``: N pairs of ``scripts/prebuild_cache.py -q --json`` builds, each on a
cold root (a fresh ``HF_HOME`` and ``--cache-dir``: the demo data generated, nothing
stored), this tree and ``--before TREE`` alternating (``TREE``: an older commit's files,
e.g. ``git archive <sha> | tar -x -C TREE``; run with ``PYTHONPATH=TREE``): the walls
(spawn to exit) and each build's start-up (``startup`` of its report: the tokenizer and
the encoder ready after entry, where the tokenizer came from). ``--set`` overrides go to
every build (default: ``configs/demo.yaml`` as it is).

Each run records the 1-minute load average before it (the 2-CPU VM is shared). Compile
both trees first (``python -m compileall -q TREE``): a process that may not write
bytecode (``PYTHONDONTWRITEBYTECODE``) would compile the package from source each time.

Usage: ``python benchmarks/bench_tokenizer_start.py --runs 5 --build-runs 3 --before /tmp/t
--json benchmarks/results/tokenizer_start_2cpu.json``
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

REPO = Path(__file__).resolve().parent.parent

_LOAD = {
    "native": (
        "import tempfile\n"
        "from hf_pipeline.config import load_config\n"
        "from hf_pipeline.encoder.bert_tokenizer import native_tokenizer\n"
        "from hf_pipeline.encoder.model import WorkerTokenizer\n"
        "spec = native_tokenizer(load_config(None, [], environ={}).encoder, tempfile.mkdtemp())\n"
        "assert not isinstance(spec, str), spec\n"
        "tok = WorkerTokenizer(spec)\n"
    ),
    "transformers": (
        "from hf_pipeline.config import load_config\n"
        "from hf_pipeline.encoder.model import CaptionTokenizer\n"
        "tok = CaptionTokenizer(load_config(None, [], environ={}).encoder)\n"
    ),
}
_READY = "assert tok(['a cat on a mat'])[0][0] == 101\nprint('ready', flush=True)\n"


def _env(tree: Path, **extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", **extra)


def _load_average() -> float:
    return round(os.getloadavg()[0], 2)


def _tokenizer_runs(runs: int) -> dict:
    """``runs`` pairs of fresh interpreters, native first in each pair."""
    out: dict[str, list] = {"native_s": [], "transformers_s": [], "load_average": []}
    for _ in range(runs):
        for kind in ("native", "transformers"):
            out["load_average"].append(_load_average())
            t0 = time.perf_counter()
            p = subprocess.run(
                [sys.executable, "-c", _LOAD[kind] + _READY], capture_output=True, text=True,
                env=_env(REPO), cwd=REPO, timeout=600,
            )  # fmt: skip
            wall = time.perf_counter() - t0
            if p.returncode != 0 or "ready" not in p.stdout:
                raise SystemExit(f"{kind} run failed: {p.stderr[-2000:]}")
            out[f"{kind}_s"].append(round(wall, 3))
    return out


def _build(tree: Path, sets: list[str]) -> dict:
    """One cold-root build by ``tree``'s ``prebuild_cache.py``: wall and start-up."""
    with tempfile.TemporaryDirectory(prefix="bench-tok-") as tmp:
        summary = Path(tmp) / "summary.json"
        load = _load_average()
        t0 = time.perf_counter()
        p = subprocess.run(
            [sys.executable, str(tree / "scripts" / "prebuild_cache.py"), "-q",
             "--cache-dir", str(Path(tmp) / "cache"), "--json", str(summary), *sets],
            capture_output=True, text=True, env=_env(tree, HF_HOME=str(Path(tmp) / "hf")),
            cwd=tree, timeout=1800,
        )  # fmt: skip
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(f"build by {tree} failed: {p.stderr[-3000:]}")
        result = json.loads(summary.read_text())
        (report,) = Path(result["cache_dir"]).glob("filtered.*/report.json")
        startup = json.loads(report.read_text()).get("startup") or {}
    seconds, notes = startup.get("seconds", {}), startup.get("notes", {})
    return {
        "wall_s": round(wall, 3),
        "load_average": load,
        "rows_in": result.get("rows_in"),
        "tokenizer_from": notes.get("tokenizer"),
        "tokenizer_ready_after_entry_s": seconds.get("tokenizer"),
        "encoder_ready_after_entry_s": seconds.get("encoder"),
        "transformers_imported_after_entry_s": seconds.get("transformers"),
        "startup": startup,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="pairs of fresh tokenizer loads")
    ap.add_argument("--build-runs", type=int, default=0, help="pairs of cold-root builds")
    ap.add_argument("--before", default="", help="an older tree to build with (with --build-runs)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every build (repeatable)")  # fmt: skip
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.build_runs and not args.before:
        ap.error("--build-runs needs --before TREE")
    out: dict = {"cpus": os.cpu_count(), "overrides": args.set}
    if args.runs:
        out["tokenizer_ready"] = _tokenizer_runs(args.runs)
        print(json.dumps(out["tokenizer_ready"]), flush=True)
    if args.build_runs:
        sets = [a for o in args.set for a in ("--set", o)]
        before, after = [], []
        for _ in range(args.build_runs):
            before.append(_build(Path(args.before).resolve(), sets))
            after.append(_build(REPO, sets))
            print(json.dumps({"before": before[-1]["wall_s"], "after": after[-1]["wall_s"]}),
                  flush=True)  # fmt: skip
        out["cold_root_builds"] = {
            "before_tree": str(args.before),
            "before_walls_s": [b["wall_s"] for b in before],
            "after_walls_s": [a["wall_s"] for a in after],
            "before": before,
            "after": after,
        }
    if args.json:
        write_result(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
