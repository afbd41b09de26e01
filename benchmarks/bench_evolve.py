#!/usr/bin/env python
"""A cache that evolves (issue 26): append 10% shards, touch every shard, re-embed with
another encoder setting, another caption column, each against a from-scratch build of
the same input (same run).

Generates the demo scaled to ``--rows`` once, then makes two input folders of hard
links: *base* (the first 90% of the shards) and *full* (all shards: a new crawl appended
at the end), both with the demo's metadata. (Shards inserted between old ones are
correct too, tests/test_part_store.py, but each touches the content-defined part it
falls into: scattered over every part, they rebuild every part.) Every build is a fresh process
(``python -c`` running ``prepare_cache``), timed from its start to its exit:

1. ``scratch``: *full* built into an empty cache root (the reference);
2. ``base``: *base* built into root R;
3. ``append``: *full* built into R (only the new parts should be built);
4. ``touch``: every shard of *full* touched, built into R again (found: hashing only);
5. ``hit``: the same again (the content index hits: nothing hashed);
6. ``reembed``: *full* with ``encoder.max_length`` changed, into R (embeddings only);
7. ``recaption``: *full* with ``data.caption_column: caption_llava_short``, into R
   (captions and embeddings only: no shard read, no latent byte written).

Reports each wall, the report's ``reuse`` block (parts built/reused, latent bytes
written), the hashing stats, and the ratios the issue states: append / scratch (goal
<= 0.2), touch / scratch (<= 0.05), hit wall (<= 1 s), reembed / the scratch build's
embed stage (<= 1.2, latent bytes written 0), recaption / scratch, and the disk use of
R before and after the re-embedding and the re-captioning.

Each build ends as the CLI's do (:func:`hf_pipeline.commands.exit_now`), without the
interpreter's shut-down: until the 2-CPU append measurement the child ended through it,
and its wall minus ``inner_s`` (mostly that shut-down) was 1.3-2.0 s a build on the H200
host (``evolve_h200_1m_pyc.json``), part of every figure there.

``--append-only`` runs steps 1-3 alone; ``--repeats N`` runs them N times, each into
fresh cache roots (the inputs are generated once): the append's spread over runs on a
loaded machine; ``--baseline LABEL=DIR`` (repeatable) runs them with the code of another
checkout of this project too, taking turns with this one within each repeat (before
and after a change, under the same load); ``--append-copies N`` then appends N more
times per checkout into copies of one base root (``cp -a``, outside the timing): the
append alone, many times, without the long builds between (a copy has new inodes, so
the reused parts are read whole in each). Each build records the load average before it started
(``loadavg_before``). On a CPU-only machine, ``--random-tiny TOK`` (a 2-layer BERT of
width 32) keeps the encoder from being the subject.
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

REPO = Path(__file__).resolve().parent.parent

_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from hf_pipeline.build.prepare import prepare_cache
from hf_pipeline.config import load_config
cfg = load_config(None, json.loads(sys.argv[1]))
t_imports = time.perf_counter() - t0
wall_call = time.time()
res = prepare_cache(cfg, progress=False)
wall_return = time.time()
r = res.report
# Where this run's time went, in seconds after prepare_cache was entered (wall clock, as
# the report's timeline): each kind of part unit's first start and last end (this run's
# units only: a reused unit's walls are its own build's, earlier), then what followed.
spans = {}
for part in r.get("parts") or []:
    for kind, span in (part.get("wall") or {}).items():
        if not span:  # a unit this run did not make (reused): no interval
            continue
        a, b = span
        if a >= wall_call - 1:
            lo, hi = spans.get(kind, (a, b))
            spans[kind] = (min(lo, a), max(hi, b))
timeline = {k: [round(a - wall_call, 3), round(b - wall_call, 3)] for k, (a, b) in spans.items()}
# Where this process's encoder loading went (TextEncoder.load_seconds: imports, model,
# to_device, compile artifacts, warm_up, ready), from the first part that embedded here.
encoder_load = next((p["encoder_load"] for p in r.get("parts") or []
                     if p.get("encoder_load") and ((p.get("wall") or {}).get("embed") or [0])[0]
                     >= wall_call - 1), None)
timeline["return"] = round(wall_return - wall_call, 3)
print(json.dumps({
    "inner_s": round(time.perf_counter() - t0, 3), "imports_s": round(t_imports, 3),
    "built": res.built, "fingerprint": res.fingerprint, "rows_out": r["rows_out"],
    "reuse": r.get("reuse") if res.built else None,
    "seconds_embed": r.get("seconds_embed"), "seconds_convert": r.get("seconds_convert"),
    "seconds_text": r.get("seconds_text"), "seconds_tokenize": r.get("seconds_tokenize"),
    "seconds_assemble": r.get("seconds_assemble"), "seconds_captions": r.get("seconds_captions"),
    "startup": (r.get("startup") or {}).get("seconds") if res.built else None,
    "timeline": timeline,
    "hashing": getattr(res, "hashing", None),
    "encoder_load": encoder_load,
}))
# As the CLI ends a build (hf-pipeline build, prebuild_cache.py): without the
# interpreter's shut-down, which took 1.3-2.0 s of each build on the H200 host.
from hf_pipeline.commands import exit_now
exit_now(0)
"""


def _du(path: Path) -> int:
    """Bytes on disk under ``path``, each inode once (hard links are shared bytes)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _build(overrides: list[str], tree: Path = REPO) -> dict:
    """One build in a fresh process running the code of ``tree`` (a checkout)."""
    load = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(overrides)],
        capture_output=True, text=True, cwd=tree,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])},
    )  # fmt: skip
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"build failed ({overrides}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = round(wall, 3)
    out["loadavg_before"] = load
    return out


def _encoder_settings(common: list[str]) -> dict:
    """The encoder settings the builds ran with (the bench's config is
    ``configs/demo.yaml`` plus ``common``): ``encoder.compile`` is ``graphs`` there, not
    ``torch.compile``, which an earlier write-up took it for."""
    from hf_pipeline.config import load_config

    enc = load_config(None, common).encoder
    return {"encoder_compile": enc.compile, "encoder_dtype": enc.dtype,
            "encoder_backend": enc.backend, "encoder_max_length": enc.max_length}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--samples-per-shard", type=int, default=1000)
    ap.add_argument("--model", default="", help="encoder folder (default: the config's)")
    add_random_model_options(ap)
    ap.add_argument("--dtype", default="", help="encoder.dtype (default: the config's)")
    ap.add_argument("--work-dir", default="")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", default="")
    ap.add_argument("--reembed-only", action="store_true",
                    help="only the scratch build and a re-embedding over it (another "
                         "encoder.max_length): for a heavy encoder, whose builds are long")  # fmt: skip
    ap.add_argument("--no-recaption", action="store_true",
                    help="leave out the build with another caption column (with a heavy "
                         "encoder it re-embeds every caption: as long as a scratch build)")  # fmt: skip
    ap.add_argument("--append-only", action="store_true",
                    help="only the scratch build, the base build and the append")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=1,
                    help="with --append-only: the three builds this many times, each into "
                         "fresh cache roots (0: none, only --append-copies)")  # fmt: skip
    ap.add_argument("--baseline", action="append", default=[], metavar="LABEL=DIR",
                    help="with --append-only: the same three builds, in each repeat, with "
                         "the code of the checkout DIR too (another commit of this project; "
                         "LABEL names it in the result), taking turns with this one")  # fmt: skip
    ap.add_argument("--append-copies", type=int, default=0, metavar="N",
                    help="with --append-only: then N more appends of each tree, each into "
                         "a copy (cp -a) of one base root, taking turns: the append's fixed "
                         "costs under the same load, without the scratch and base builds "
                         "(a copy has new inodes: the reused parts are read whole)")  # fmt: skip
    args = ap.parse_args()
    if args.repeats < 0 or (args.repeats != 1 and not args.append_only):
        ap.error("--repeats takes N >= 0, and N != 1 only with --append-only")
    if args.repeats == 0 and not args.append_copies:
        ap.error("--repeats 0 (no scratch, base and append builds) needs --append-copies N")
    trees = {"this": REPO}
    for spec in args.baseline:
        label, _, folder = spec.partition("=")
        if not (label and folder and Path(folder, "hf_pipeline").is_dir()) or label in trees:
            ap.error(f"--baseline {spec}: expected LABEL=DIR, DIR a checkout of this project")
        trees[label] = Path(folder).resolve()
    if len(trees) > 1 and not args.append_only:
        ap.error("--baseline needs --append-only")
    if args.append_copies < 0 or (args.append_copies and not args.append_only):
        ap.error("--append-copies takes N >= 0, and N > 0 only with --append-only")
    kind, tokenizer = random_model_option(ap, args)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="hfp_evolve_"))
    model = args.model
    if tokenizer:
        model = str(random_model(kind, work / kind, tokenizer))
    shards = max(10, args.rows // args.samples_per_shard)
    common = [*([f"encoder.model={model}"] if model else []),
              *([f"encoder.dtype={args.dtype}"] if args.dtype else []), *args.set]  # fmt: skip

    # The demo, generated once, then two folders of hard links to its files.
    from hf_pipeline.build.prepare import resolve_inputs
    from hf_pipeline.config import load_config

    gen_root = work / "gen"
    t0 = time.perf_counter()
    inputs = resolve_inputs(
        load_config(None, [f"build.cache_dir={gen_root}", f"data.demo.num_shards={shards}",
                           f"data.demo.samples_per_shard={args.samples_per_shard}", *common])
    )  # fmt: skip
    generate_s = time.perf_counter() - t0
    shard_paths = sorted(Path(f.url) for f in inputs.shards)
    metadata = Path(inputs.metadata.url)
    base, full = work / "base", work / "full"
    cut = len(shard_paths) - max(1, len(shard_paths) // 10)
    for folder, keep in ((base, shard_paths[:cut]), (full, shard_paths)):
        folder.mkdir(parents=True, exist_ok=True)
        for p in keep:
            os.link(p, folder / p.name)
    os.sync()

    def cfg(data: Path, root: Path, *more: str) -> list[str]:
        return [f"build.cache_dir={root}", f"data.shards={data}",
                f"data.metadata={metadata}", *common, *more]  # fmt: skip

    root = work / "root"
    runs: dict[str, dict] = {}
    if args.append_only:
        return _append_only(args, work, trees, lambda r: cfg(full, r), lambda r: cfg(base, r),
                            shards=shards, appended=len(shard_paths) - cut,
                            generate_s=generate_s, common=common)  # fmt: skip
    runs["scratch"] = _build(cfg(full, work / "scratch-root"))
    max_length = load_config(None, common).encoder.max_length
    reembed = f"encoder.max_length={max(8, max_length // 2)}"
    if args.reembed_only:
        du_before = _du(work / "scratch-root")
        runs["reembed"] = _build(cfg(full, work / "scratch-root", reembed))
        out = {
            "rows_in": shards * args.samples_per_shard,
            "shards": shards,
            "cpus": os.cpu_count(),
            "generate_s": round(generate_s, 2),
            "runs": runs,
            "reembed_over_scratch_embed_stage": round(
                runs["reembed"]["wall_s"] / max(float(runs["scratch"]["seconds_embed"] or 0), 1e-9),
                3,
            ),
            "disk_bytes_before_reembed": du_before,
            "disk_bytes_after_reembed": _du(work / "scratch-root"),
            "overrides": common,
            **_encoder_settings(common),
        }
        print(json.dumps(out, indent=1))
        if args.json:
            write_result(args.json, out)
        return 0
    runs["base"] = _build(cfg(base, root))
    runs["append"] = _build(cfg(full, root))
    now = time.time()
    for p in full.iterdir():
        os.utime(p, (now, now))
    time.sleep(2.5)  # past the content index's racy window: the next start may trust it
    runs["touch"] = _build(cfg(full, root))
    runs["hit"] = _build(cfg(full, root))
    du_before = _du(root)
    runs["reembed"] = _build(cfg(full, root, reembed))
    du_after = _du(root)
    if not args.no_recaption:
        runs["recaption"] = _build(cfg(full, root, "data.caption_column=caption_llava_short"))
    du_recaption = _du(root)

    scratch = runs["scratch"]
    out = {
        "rows_in": shards * args.samples_per_shard,
        "shards": shards,
        "appended_shards": len(shard_paths) - len(list(base.iterdir())),
        "cpus": os.cpu_count(),
        "generate_s": round(generate_s, 2),
        "runs": runs,
        "append_over_scratch": round(runs["append"]["wall_s"] / scratch["wall_s"], 3),
        "touch_over_scratch": round(runs["touch"]["wall_s"] / scratch["wall_s"], 3),
        "hit_wall_s": runs["hit"]["wall_s"],
        "reembed_over_scratch_embed_stage": round(
            runs["reembed"]["wall_s"] / max(float(scratch["seconds_embed"] or 0), 1e-9), 3
        ),
        "append_same_fingerprint_as_scratch": runs["append"]["fingerprint"]
        == scratch["fingerprint"],
        "disk_bytes_before_reembed": du_before,
        "disk_bytes_after_reembed": du_after,
        "recaption_over_scratch": (
            round(runs["recaption"]["wall_s"] / scratch["wall_s"], 3)
            if "recaption" in runs
            else None
        ),
        "disk_bytes_after_recaption": du_recaption if "recaption" in runs else None,
        "overrides": common,
        **_encoder_settings(common),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        write_result(args.json, out)
    return 0


def _append_only(args, work: Path, trees: dict[str, Path], full, base, *, shards: int,
                 appended: int, generate_s: float, common: list[str]) -> int:  # fmt: skip
    """Scratch, base and append builds, ``args.repeats`` times, each repeat into fresh
    cache roots (the roots this script made before are removed first: nothing else
    is), with the code of each of ``trees`` in turn (this checkout first)."""
    import shutil

    by_tree: dict[str, list[dict]] = {label: [] for label in trees}
    for i in range(args.repeats):
        for label, tree in trees.items():
            scratch_root, root = work / "scratch-root", work / "root"
            for made in (scratch_root, root):
                if made.exists():
                    shutil.rmtree(made)
            runs = {
                "scratch": _build(full(scratch_root), tree),
                "base": _build(base(root), tree),
                "append": _build(full(root), tree),
            }
            runs["append_over_scratch"] = round(
                runs["append"]["wall_s"] / runs["scratch"]["wall_s"], 3
            )
            runs["append_same_fingerprint_as_scratch"] = (
                runs["append"]["fingerprint"] == runs["scratch"]["fingerprint"]
            )
            by_tree[label].append(runs)
            print(json.dumps({"repeat": i, "tree": label,
                              "append_over_scratch": runs["append_over_scratch"],
                              "scratch_s": runs["scratch"]["wall_s"],
                              "append_s": runs["append"]["wall_s"]}), flush=True)  # fmt: skip

    def summary(repeats: list[dict]) -> dict:
        ratios = sorted(r["append_over_scratch"] for r in repeats)
        return {
            "append_over_scratch": ratios,
            "append_over_scratch_median": ratios[len(ratios) // 2],
            "append_wall_s": sorted(r["append"]["wall_s"] for r in repeats),
            "scratch_wall_s": sorted(r["scratch"]["wall_s"] for r in repeats),
            "append_same_fingerprint_as_scratch": all(
                r["append_same_fingerprint_as_scratch"] for r in repeats
            ),
        }

    copies: dict[str, list[dict]] = {label: [] for label in trees}
    if args.append_copies:
        base_root, copy = work / "copies-base", work / "copy"
        for made in (base_root, copy):
            if made.exists():
                shutil.rmtree(made)
        copies_base = _build(base(base_root))
        for i in range(args.append_copies):
            for label, tree in trees.items():
                subprocess.run(["cp", "-a", str(base_root), str(copy)], check=True)
                run = _build(full(copy), tree)
                shutil.rmtree(copy)
                copies[label].append(run)
                print(json.dumps({"copy": i, "tree": label, "append_s": run["wall_s"],
                                  "first_shard": (run["startup"] or {}).get("first_shard")}),
                      flush=True)  # fmt: skip

    def copy_summary(runs: list[dict]) -> dict:
        first = sorted((r["startup"] or {}).get("first_shard", 0.0) for r in runs)
        return {
            "append_wall_s": sorted(r["wall_s"] for r in runs),
            "first_shard_after_entry_s": first,
            "runs": runs,
        }

    out = {
        "rows_in": shards * args.samples_per_shard,
        "shards": shards,
        "appended_shards": appended,
        "cpus": os.cpu_count(),
        "generate_s": round(generate_s, 2),
        **(
            {
                "append_copies": {
                    "base": copies_base,
                    **{k: copy_summary(v) for k, v in copies.items()},
                }
            }
            if args.append_copies
            else {}
        ),  # fmt: skip
        **(summary(by_tree["this"]) if args.repeats else {}),
        "repeats": by_tree["this"],
        "baselines": {
            label: {"tree": str(trees[label]), **(summary(reps) if reps else {}), "repeats": reps}
            for label, reps in by_tree.items()
            if label != "this"
        },
        "overrides": common,
        **_encoder_settings(common),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        write_result(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
