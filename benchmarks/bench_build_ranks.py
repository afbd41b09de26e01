#!/usr/bin/env python
"""One builder against ``build.parallel: ranks`` on one multi-GPU host, same data, same run.

Generates the demo scaled to ``--rows`` latent rows (fp16 latents, ``--samples-per-shard``
a shard; the shards written by a pool of all usable CPUs, ``generate_demo(num_proc=...)``),
then builds it twice, each time into a fresh cache root, each process a fresh one:

1. ``one``: one builder process, ``DATASET_NUM_PROC`` = all usable CPUs (``--cpus``),
   the encoder on the first visible GPU (``encoder.device: auto``; the CPU without one);
2. ``ranks``: ``--ranks`` rank processes launched as torchrun launches them (``RANK``,
   ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
   ``MASTER_PORT``), each joining a gloo ``torch.distributed`` process group as a training
   job does (its TCPStore is the doorbell that wakes waiting ranks; ``--no-store``: files
   and polling only), with ``build.parallel=ranks``, ``DATASET_NUM_PROC`` = CPUs / ranks
   and ``CUDA_VISIBLE_DEVICES`` as inherited, so rank r embeds on ``cuda:r``.

Before the first build, after the demo and after each build, ``os.sync()`` (timed)
leaves no dirty page behind: no build pays for the writeback of the data written
before it. ``--one-num-proc N`` (repeatable) builds with one builder once per ``N``
(default: all usable CPUs): ``16`` is what a job launched with ``DATASET_NUM_PROC=16`` on
every rank gets when it turns ``build.parallel: ranks`` on; all CPUs is the strongest one
builder.

``--pin`` gives each process CPUs of its own (``sched_setaffinity`` before exec, so its
workers inherit them): rank r the r-th of ``--ranks`` equal slices of the usable CPUs, a
one builder the first slice (and, by default, that many workers). One host then stands
for ``--ranks`` nodes of one GPU and ``CPUs / ranks`` cores each sharing one store, the
setting ``parallel: ranks`` is for; memory bandwidth and the store stay shared.

The config is ``configs/demo.yaml`` (``encoder.compile: graphs``: nothing compiles) plus
the overrides. A compiled encoder (``--set encoder.compile=default``) compiles cold in
each process: it gets a fresh
``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` of its own, as a fresh node would;
before, a build found the graphs an earlier build of the run had compiled, which favoured
whichever came second. ``--warm-compile-cache`` shares the host's caches instead.

The storage reference (``--no-write-reference`` skips it), measured in the same run on the
same folder: as many processes as CPUs write the demo's byte count (each its share, in
8 MiB blocks, fsync at the end; as the join's workers write their Arrow files and a
part's publication fsyncs them). Its GB/s is the most a join can write to this folder;
each build's ``join_gb_per_s`` (latent bytes / the slowest builder's join seconds, its
parts summed) is reported as a share
of it. During each build a thread samples ``Dirty`` + ``Writeback`` of ``/proc/meminfo``
(peak GB).

Reported (``--json``): the wall time of each build from the launch of its first process
to the exit of its last (interpreter start, imports and process-group set-up included),
each process's own ``prepare_cache`` seconds and the GPUs it allocated memory on; the
speed-up ``one wall / ranks wall`` against each one-builder build; the ranks build's
timeline from its markers (wall clock, seconds after the launch): the caption table, each
part (who built it), the ``converted`` stage (rank 0's assembly of the parts: duplicates
across parts, final drop reasons, hard links, marker) and the ``filtered`` stage.
``assembly_s`` = end of ``filtered`` - start of ``converted``, and ``assembly_share`` =
``assembly_s`` / ranks wall; ``after_last_part_s`` also counts the wake-up after the last
part. The caches must be the same one (same fingerprint, rows in and out, drop counts;
the benchmark exits 1 otherwise). Targets (issue 10): speed-up >= 3.2 with 4 ranks,
assembly <= 5% of the build.

The encoder is the real MiniLM (``minilm``) unless ``--random-minilm TOKENIZER_DIR``: a
random-weight MiniLM made from its config (the architecture's speed, no download), or
``--random-gemma TOKENIZER_DIR``: a random-weight model shaped like gemma-3-270m, the
issue's COYO encoder, with that tokenizer (``--dtype bfloat16`` for it).

Usage::

    python benchmarks/bench_build_ranks.py [--rows 1000000] [--samples-per-shard 2000]
        [--ranks 4] [--random-minilm TOKENIZER_DIR | --random-gemma TOKENIZER_DIR]
        [--dtype float16]
        [--one-num-proc N ...] [--pin] [--warm-compile-cache] [--no-write-reference] [--work-dir DIR]
        [--json out.json] [--set section.field=value ...]

A 1M-row fp16 demo is 24.6 GB of shards, and each cache holds the latents again; a cache
is removed once its build is measured (``--keep-caches`` keeps them): about 50 GB of
``--work-dir`` (a temporary folder, removed at the end, by default).
Exit codes: 0 done (targets met or not), 1 a build failed or the caches differ, 2 bad
arguments.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._results import write_result  # noqa: E402
from benchmarks.random_models import (  # noqa: E402
    add_random_model_options,
    random_model,
    random_model_option,
)

#: Launcher variables a child must not inherit from the shell that runs the benchmark.
_LAUNCHER_PREFIXES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_",
    "JAX_COORDINATOR", "DATASET_", "HF_PIPELINE_",
)  # fmt: skip
SPEEDUP_TARGET = 3.2
ASSEMBLY_SHARE_TARGET = 0.05


# --------------------------------------------------------------------------- child


def _child(spec: dict) -> int:
    """One build process (the builder, or one rank): prepare_cache, then its numbers."""
    entered = time.time()
    import torch

    group = spec["store"] and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if group:
        import datetime

        import torch.distributed as td

        td.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    from dist.env import detect
    from hf_pipeline.build.prepare import prepare_cache
    from hf_pipeline.config import load_config

    cfg = load_config(None, spec["overrides"])  # DATASET_NUM_PROC from the environment
    process = detect()
    started = time.time()
    res = prepare_cache(cfg, process=process, progress=False)
    finished = time.time()
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            peak = torch.cuda.max_memory_allocated(i)
            if peak:
                name = torch.cuda.get_device_name(i)
                gpus.append({"index": i, "name": name, "peak_gb": round(peak / 1e9, 2)})
    r = res.report
    out = {
        "rank": process.rank,
        "local_rank": process.local_rank,
        "world_size": process.world_size,
        "pid": os.getpid(),
        "entered_at": entered,
        "prepare_started_at": started,
        "prepare_finished_at": finished,
        "prepare_s": round(finished - started, 3),
        "built": res.built,
        "fingerprint": res.fingerprint,
        "cache_dir": str(res.cache_dir),
        "num_proc": cfg.build.effective_num_proc,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "gpus": gpus,
        "rows_in": r["rows_in"],
        "rows_out": r["rows_out"],
        "dropped": r["dropped"],
        "embed_dim": r["embed_dim"],
        "seconds_convert": r["seconds_convert"],
        "seconds_embed": r["seconds_embed"],
        "seconds_captions": r.get("seconds_captions"),
        "seconds_assemble": r.get("seconds_assemble"),
        "parts": r["parts"],
        # The builder's start-up timeline (rank 0's report: its own process).
        "startup": r.get("startup"),
    }
    Path(spec["result"]).write_text(json.dumps(out, indent=1))
    if group:
        td.barrier()  # rank 0 hosts the store: it leaves last
        td.destroy_process_group()
    return 0


# --------------------------------------------------------------------------- storage


def _sync() -> float:
    """``os.sync()``: every dirty page of the host written back; its seconds."""
    t0 = time.perf_counter()
    os.sync()
    return round(time.perf_counter() - t0, 3)


def _meminfo_gb(*fields: str) -> float:
    """The sum of ``fields`` of ``/proc/meminfo``, in GB (0 where it cannot be read)."""
    total = 0
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name in fields:
                    total += int(rest.split()[0]) * 1024
    except OSError:
        return 0.0
    return total / 1e9


class _DirtySampler:
    """Samples ``Dirty`` + ``Writeback`` (GB) every 0.25 s from its creation to :meth:`stop`."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dirty-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(_meminfo_gb("Dirty", "Writeback"))
            self._stop.wait(0.25)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        s = self.samples or [0.0]
        return {"peak_gb": round(max(s), 2), "mean_gb": round(sum(s) / len(s), 2)}


_WRITER = """
import os, sys, time
path, nbytes = sys.argv[1], int(sys.argv[2])
block = os.urandom(8 << 20)
t0 = time.perf_counter()
with open(path, "wb") as fh:
    left = nbytes
    while left > 0:
        left -= fh.write(block[: min(left, len(block))])
    fh.flush()
    t1 = time.perf_counter()
    os.fsync(fh.fileno())
print(t1 - t0, time.perf_counter() - t1)
"""


def _write_reference(folder: Path, total_bytes: int, procs: int) -> dict:
    """``procs`` processes write ``total_bytes`` into ``folder`` at once (each its share,
    8 MiB blocks, fsync at the end); the GB/s from the first start to the last exit."""
    folder.mkdir(parents=True, exist_ok=True)
    share = -(-total_bytes // procs)
    t0 = time.perf_counter()
    running = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(folder / f"w{i}"), str(share)],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(procs)
    ]
    times = [tuple(map(float, p.communicate()[0].split())) for p in running]
    wall = time.perf_counter() - t0
    if any(p.returncode for p in running):
        raise RuntimeError(f"write reference: a writer failed in {folder}")
    shutil.rmtree(folder)
    return {
        "processes": procs,
        "gb": round(share * procs / 1e9, 2),
        "wall_s": round(wall, 3),
        "gb_per_s": round(share * procs / 1e9 / wall, 3),
        "max_write_s": round(max(t[0] for t in times), 3),  # before the fsync
        "max_fsync_s": round(max(t[1] for t in times), 3),
    }


def _storage_facts(folder: Path) -> dict:
    """Where the caches are written: the mount, and the kernel's writeback settings."""
    best = ("", "", "")
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                dev, mnt, fstype = line.split()[:3]
                inside = str(folder).startswith(mnt.rstrip("/") + "/") or str(folder) == mnt
                if inside and len(mnt) >= len(best[1]):
                    best = (dev, mnt, fstype)
    except OSError:
        pass
    vm = {}
    for knob in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes", "dirty_expire_centisecs"):
        try:
            vm[knob] = int(Path(f"/proc/sys/vm/{knob}").read_text())
        except (OSError, ValueError):
            pass
    usage = shutil.disk_usage(folder)
    return {
        "device": best[0], "mount": best[1], "fstype": best[2],
        "free_gb": round(usage.free / 1e9, 1), "mem_total_gb": round(_meminfo_gb("MemTotal"), 1),
        "vm": vm,
    }  # fmt: skip


# --------------------------------------------------------------------------- parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


def _launch(
    name: str, envs: list[dict], overrides: list[str], work: Path, args, cpu_sets=None
) -> dict:
    """Start one process per env at once (process i on the CPUs ``cpu_sets[i]`` when
    given); wait for all (killing all on a timeout or a failure); the wall time from the
    first launch to the last exit and their results."""
    logs, results, procs, ended = work / "logs", [], [], {}
    logs.mkdir(exist_ok=True)
    launched = time.time()
    t0 = time.perf_counter()
    for i, env in enumerate(envs):
        result = work / f"{name}-{i}.json"
        result.unlink(missing_ok=True)
        results.append(result)
        spec = {"overrides": overrides, "result": str(result), "store": not args.no_store}
        if not args.warm_compile_cache:
            # A cold torch.compile cache of its own, as on a fresh node: otherwise a build
            # finds the graphs and Triton kernels an earlier build compiled.
            compiled = work / "compile-cache" / name / str(i)
            shutil.rmtree(compiled, ignore_errors=True)
            env = {
                **env,
                "TORCHINDUCTOR_CACHE_DIR": str(compiled / "inductor"),
                "TRITON_CACHE_DIR": str(compiled / "triton"),
            }
        pin = None
        if cpu_sets is not None:  # before exec: the whole process tree inherits it
            pin = functools.partial(os.sched_setaffinity, 0, cpu_sets[i])
        with open(logs / f"{name}-{i}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--_child", json.dumps(spec)],
                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=pin,
                )
            )  # fmt: skip

    exited = threading.Condition()
    sampler = _DirtySampler()

    def wait(i: int, p: subprocess.Popen) -> None:
        p.wait()
        with exited:
            ended[i] = time.perf_counter()
            exited.notify_all()

    for i, p in enumerate(procs):
        threading.Thread(target=wait, args=(i, p), name=f"wait-{name}-{i}", daemon=True).start()
    deadline = time.monotonic() + args.timeout

    def first_failure() -> str | None:
        bad = sorted(i for i in ended if procs[i].returncode != 0)
        return f"{name}: process {bad[0]} exited with {procs[bad[0]].returncode}" if bad else None

    try:
        with exited:
            # A failed process fails the build at once: the others may wait for it (its
            # part, the final barrier) until the timeout.
            while (failed := first_failure()) is None and len(ended) < len(procs):
                if not exited.wait(max(0.0, deadline - time.monotonic())):
                    failed = f"{name}: still running after {args.timeout:.0f} s"
                    break
    finally:
        for p in procs:
            if p.poll() is None or p.returncode != 0:
                try:  # a session of its own: its datasets workers go with it
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # gone, and its workers with it
            p.wait()
        sampler.stop()
    if failed:
        tails = "\n".join(
            f"--- {log.name}\n" + log.read_text(errors="replace")[-3000:]
            for log in sorted(logs.glob(f"{name}-*.log"))
        )
        raise RuntimeError(f"{failed}\n{tails}")
    wall = max(ended.values()) - t0
    out = sorted((json.loads(r.read_text()) for r in results), key=lambda x: x["rank"])
    parts = out[0]["parts"]  # the same report in every process
    for proc in out:
        del proc["parts"]
        # Interpreter start, imports, the process group: before prepare_cache starts.
        proc["startup_s"] = round(proc["prepare_started_at"] - launched, 3)
    span = max(p["prepare_finished_at"] for p in out) - min(p["prepare_started_at"] for p in out)
    print(f"{name}: {len(procs)} process(es), wall {wall:.1f} s", file=sys.stderr, flush=True)
    return {
        "launched_at": launched,
        "wall_s": round(wall, 3),
        "prepare_span_s": round(span, 3),
        "processes": out,
        "parts": parts,
        "dirty_writeback": sampler.summary(),
        "sync_after_s": _sync(),  # what the build left unwritten
    }


def _marker_times(cache_dir: Path, launched: float) -> dict:
    """The timeline of a cache's published markers, in seconds after ``launched``."""
    from dist.markers import read_json

    def span(path: Path) -> dict | None:
        m = read_json(path)
        if not isinstance(m, dict):
            return None
        return {
            "start_s": round(float(m["started_at"]) - launched, 3),
            "end_s": round(float(m["finished_at"]) - launched, 3),
            "pid": m.get("pid"),
        }

    timeline = {s: span(cache_dir / f"{s}.json") for s in ("converted", "filtered")}
    # The store units the parts are made of (<cache root>/.parts/<kind>-<id...>/<kind>.json,
    # hf_pipeline.build.part_store), each with who built it and when; a unit another
    # cache built earlier has its old times.
    store = cache_dir.parent / ".parts"
    if store.is_dir():
        timeline["units"] = [
            {"unit": d.name, **(span(d / f"{d.name.split('-', 1)[0]}.json") or {})}
            for d in sorted(store.iterdir())
            if d.is_dir()
        ]
    return timeline


def _same_cache(one: dict, other: dict) -> dict:
    """Cheap checks that two builds made the same cache (from their reports)."""
    a = one["processes"][0]
    return {
        key: all(p[key] == a[key] for p in other["processes"])
        for key in ("fingerprint", "rows_in", "rows_out", "dropped", "embed_dim")
    }


def _ranks_checks(ranks: dict) -> dict:
    """Each rank built one part of its own (in one or more contiguous pieces)."""
    pids = [p["builder"]["pid"] for p in ranks["parts"]]
    runs = [pid for i, pid in enumerate(pids) if i == 0 or pid != pids[i - 1]]
    return {
        "one_part_per_rank": len(runs) == len(set(runs)) == len(ranks["processes"]),
        "every_rank_built": all(p["built"] for p in ranks["processes"]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, default=1_000_000, help="latent rows of the demo")
    ap.add_argument("--samples-per-shard", type=int, default=2000)
    ap.add_argument("--ranks", type=int, default=4, help="rank processes of the ranks build")
    add_random_model_options(ap)
    ap.add_argument("--dtype", default="float16", help="encoder.dtype")
    ap.add_argument("--cpus", type=int, default=0, help="CPUs to share (0: all usable)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="one more config override for both builds (repeatable)")  # fmt: skip
    ap.add_argument("--no-store", action="store_true",
                    help="ranks without a process group: waiters poll the files")  # fmt: skip
    ap.add_argument("--one-num-proc", type=int, action="append", default=[], metavar="N",
                    help="a one-builder build with DATASET_NUM_PROC=N (repeatable; "
                    "default: all usable CPUs)")  # fmt: skip
    ap.add_argument("--no-write-reference", action="store_true",
                    help="skip the storage reference (parallel writes + fsync)")  # fmt: skip
    ap.add_argument("--keep-caches", action="store_true", help="keep each build's cache")
    ap.add_argument("--pin", action="store_true",
                    help="each process on CPUs of its own: rank r on the r-th of --ranks "
                    "equal slices, a one builder on the first (default --one-num-proc: a "
                    "slice's CPUs), as if each rank were a node with a shared store")  # fmt: skip
    ap.add_argument("--ranks-first", action="store_true", help="build with ranks first")
    ap.add_argument("--warm-compile-cache", action="store_true",
                    help="share the host's torch.compile caches (default: each process "
                         "compiles cold, in a cache folder of its own)")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per build")
    ap.add_argument("--work-dir", default="", help="kept afterwards (default: tmp, removed)")
    ap.add_argument("--json", default="")
    ap.add_argument("--_child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        from hf_pipeline.commands import exit_now

        # Out as scripts/prebuild_cache.py goes once its output is written: the wall
        # counts to the last process's exit, not the interpreter's shut-down (issue 28).
        exit_now(_child(json.loads(args._child)))
    # `timeout` sends SIGTERM: unwind, so that the builds' process groups are killed and
    # the temporary folder removed (the children run in sessions of their own).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    from hf_pipeline.demo.generate import generate_demo
    from hf_pipeline.workers.pool import usable_cpus

    cpus = args.cpus or usable_cpus()
    shards = args.rows // args.samples_per_shard
    if args.ranks < 1 or cpus < args.ranks:
        ap.error(f"--ranks must be in [1, CPUs={cpus}], got {args.ranks}")
    if args.samples_per_shard < 10 or shards < args.ranks:
        ap.error(
            f"--rows / --samples-per-shard must give >= --ranks={args.ranks} shards of >= 10 "
            f"rows, got {shards} shards of {args.samples_per_shard}"
        )
    if any(n < 1 for n in args.one_num_proc):
        ap.error(f"--one-num-proc must be >= 1, got {args.one_num_proc}")
    kind, tokenizer = random_model_option(ap, args)

    tmp = None
    if args.work_dir:
        work = Path(args.work_dir).absolute()
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench_build_ranks-")
        work = Path(tmp.name)
    try:
        model = "minilm"
        if tokenizer:
            model = random_model(kind, work / kind, tokenizer)
        t0 = time.perf_counter()
        demo = generate_demo(
            work / f"demo-{shards}x{args.samples_per_shard}", num_shards=shards,
            samples_per_shard=args.samples_per_shard, latent_dtype="float16", num_proc=cpus,
        )  # fmt: skip
        generate_s = time.perf_counter() - t0
        latent_gb = sum(p.stat().st_size for p in demo.shard_paths) / 1e9
        print(
            f"demo: {shards} shards x {args.samples_per_shard} = {demo.num_latent_rows} rows, "
            f"{latent_gb:.1f} GB ({generate_s:.1f} s, {cpus} processes)",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        common = [
            f"data.shards={demo.out_dir}",
            f"encoder.model={model}",
            f"encoder.dtype={args.dtype}",
            *args.set,
        ]
        base = _base_env()
        port = _free_port()
        per_rank = max(1, cpus // args.ranks)
        rank_envs = [
            {
                **base,
                "DATASET_NUM_PROC": str(per_rank),
                "RANK": str(r),
                "WORLD_SIZE": str(args.ranks),
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": str(args.ranks),
                "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            for r in range(args.ranks)
        ]
        ones = list(dict.fromkeys(args.one_num_proc or [per_rank if args.pin else cpus]))
        slices = None
        if args.pin:  # as if each rank were a node of its own (the storage stays shared)
            mine = sorted(os.sched_getaffinity(0))[: per_rank * args.ranks]
            slices = [mine[r * per_rank : (r + 1) * per_rank] for r in range(args.ranks)]
        builds = {
            f"one-{n}": ([{**base, "DATASET_NUM_PROC": str(n)}], [], slices and slices[:1])
            for n in ones
        }
        builds["ranks"] = (rank_envs, ["build.parallel=ranks"], slices)
        order = list(builds)
        if args.ranks_first:
            order = ["ranks", *order[:-1]]
        storage = _storage_facts(work)
        storage["sync_after_demo_s"] = _sync()
        if not args.no_write_reference:
            ref = _write_reference(work / "write-reference", int(latent_gb * 1e9), cpus)
            storage["write_reference"] = ref
            print(
                f"storage: {cpus} writers + fsync, {ref['gb']} GB: {ref['gb_per_s']:.2f} GB/s "
                f"({storage['fstype']} on {storage['device']})",
                file=sys.stderr, flush=True,
            )  # fmt: skip
        res = {}
        try:
            for name in order:
                envs, extra, cpu_sets = builds[name]
                cache = work / name
                shutil.rmtree(cache, ignore_errors=True)  # fresh, also with a kept --work-dir
                run = _launch(
                    name, envs, [*common, f"build.cache_dir={cache}", *extra], work, args,
                    cpu_sets=cpu_sets,
                )  # fmt: skip
                run["cpu_sets"] = cpu_sets
                run["timeline"] = _marker_times(
                    Path(run["processes"][0]["cache_dir"]), run["launched_at"]
                )
                joins: dict[int, float] = {}  # each builder's join seconds, parts summed
                for p in run["parts"]:
                    if p.get("join"):
                        pid = p["builder"]["pid"]
                        joins[pid] = joins.get(pid, 0.0) + p["join"]["seconds"]
                if joins:
                    run["join_gb_per_s"] = round(latent_gb / max(joins.values()), 3)
                res[name] = run
                if not args.keep_caches:
                    shutil.rmtree(cache, ignore_errors=True)
        except RuntimeError as e:
            print(f"bench_build_ranks: {e}", file=sys.stderr)
            return 1
        ranks = res["ranks"]
        tl = ranks["timeline"]
        assembly = tl["filtered"]["end_s"] - tl["converted"]["start_s"]
        # The parts are done when their last embedding unit is (this build's own units:
        # every cache of this bench starts from an empty root).
        last_part = max(u["end_s"] for u in tl["units"] if u["unit"].startswith("embed-"))
        first_one = res[f"one-{ones[0]}"]
        checks = {**_same_cache(first_one, ranks), **_ranks_checks(ranks)}
        for n in ones[1:]:
            checks[f"one-{n} same as one-{ones[0]}"] = all(
                _same_cache(first_one, res[f"one-{n}"]).values()
            )
        speedups = {
            f"vs one-{n}": round(res[f"one-{n}"]["wall_s"] / ranks["wall_s"], 3) for n in ones
        }
        ref = storage.get("write_reference")
        if ref:
            for run in res.values():
                if "join_gb_per_s" in run:
                    run["join_vs_write_reference"] = round(
                        run["join_gb_per_s"] / ref["gb_per_s"], 3
                    )
        p0 = first_one["processes"][0]
        out = {
            "gpus": sorted(
                {g["name"] for run in res.values() for p in run["processes"] for g in p["gpus"]}
            )
            or ["none"],
            "cpus": cpus,
            "pinned": args.pin,
            "rows_in": p0["rows_in"],
            "rows_out": p0["rows_out"],
            "shards": shards,
            "samples_per_shard": args.samples_per_shard,
            "latent_gb": round(latent_gb, 2),
            "encoder": {
                "model": f"random-{kind}" if tokenizer else model,
                "dtype": args.dtype,
            },
            "overrides": args.set,
            "order": order,
            "generate_s": round(generate_s, 2),
            "storage": storage,
            **{f"one-{n}": {"num_proc": n, **res[f"one-{n}"]} for n in ones},
            "ranks": {
                "ranks": args.ranks,
                "num_proc_per_rank": per_rank,
                "store": not args.no_store,
                **ranks,
            },
            "speedup": speedups,
            # The same without interpreter start-up and exit: first prepare_cache call
            # to the last return.
            "speedup_prepare": {
                f"vs one-{n}": round(res[f"one-{n}"]["prepare_span_s"] / ranks["prepare_span_s"], 3)
                for n in ones
            },
            # GPUs each rank allocated memory on (one each, all different, with GPUs).
            "ranks_gpus": [[g["index"] for g in p["gpus"]] for p in ranks["processes"]],
            "assembly_s": round(assembly, 3),
            "assembly_share": round(assembly / ranks["wall_s"], 4),
            "after_last_part_s": round(tl["filtered"]["end_s"] - last_part, 3),
            "same_cache": checks,
            "targets": {
                **{
                    f"speedup {k} >= {SPEEDUP_TARGET}": v >= SPEEDUP_TARGET
                    for k, v in speedups.items()
                },
                f"assembly <= {ASSEMBLY_SHARE_TARGET:.0%}": (
                    assembly / ranks["wall_s"] <= ASSEMBLY_SHARE_TARGET
                ),
            },
        }
        if args.json:
            write_result(args.json, out)
        print(json.dumps(out, indent=1))
        walls = ", ".join(f"{k} {v['wall_s']:.1f} s" for k, v in res.items())
        ups = ", ".join(f"{v:.2f}x {k}" for k, v in speedups.items())
        print(
            f"{walls}: ranks {ups}; assembly {assembly:.2f} s = {out['assembly_share']:.1%} "
            f"of the ranks build; same cache: {all(checks.values())}",
            file=sys.stderr,
        )
        return 0 if all(checks.values()) else 1
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
