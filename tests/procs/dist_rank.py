"""One rank of a dist.ensure_built test job, as a real OS process.

Builds two deterministic stages ("converted", then "filtered") into --cache-dir and writes
a JSON result (markers, content hash, error) to --result. Fault injection:
``--hold EVENT:SECONDS`` makes the first process (job-wide, via an O_EXCL ticket in
--signal-dir) that reaches EVENT write ``<signal-dir>/at-EVENT`` (containing its pid) and
sleep, so the test can SIGKILL it right there. EVENT is ``build-<stage>`` (inside the
stage build, after half its files) or a coordinator event (``claimed``, ``publishing``,
``stage_built``...), optionally for one stage only (``publishing-filtered``).
``--layout N`` splits each stage into a different number of files (like two builders with
different ``num_proc``: same content, other file names).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import xxhash  # noqa: E402

from dist import Stage, detect, ensure_built  # noqa: E402

STAGES = ("converted", "filtered")


def _content(fingerprint: str, stage: str, index: int, size: int) -> bytes:
    seed = xxhash.xxh64(f"{fingerprint}/{stage}/{index}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def tree_hash(cache_dir: Path, markers: dict) -> str:
    """Hash of every published stage folder (the one its marker names): the paths inside
    it, prefixed by the stage name, and the bytes."""
    h = xxhash.xxh64()
    for stage in STAGES:
        root = cache_dir / markers[stage].directory
        for p in sorted(root.rglob("*")):
            if p.is_file():
                h.update(f"{stage}/{p.relative_to(root).as_posix()}".encode())
                h.update(p.read_bytes())
    return h.hexdigest()


class _Faults:
    def __init__(self, holds: list[str], signal_dir: Path | None):
        self.holds = {}
        for h in holds:
            event, _, seconds = h.partition(":")
            self.holds[event] = float(seconds or 3600)
        self.signal_dir = signal_dir

    def at(self, event: str) -> None:
        if event not in self.holds or self.signal_dir is None:
            return
        try:
            fd = os.open(self.signal_dir / f"ticket-{event}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # only the first process to get here holds
        os.close(fd)
        (self.signal_dir / f"at-{event}.tmp").write_text(str(os.getpid()))
        os.replace(self.signal_dir / f"at-{event}.tmp", self.signal_dir / f"at-{event}")
        time.sleep(self.holds[event])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir", required=True, type=Path)
    ap.add_argument("--fingerprint", default="fp0")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world-size", type=int, default=16)
    ap.add_argument("--builder", type=int, default=None, help="default: rank == 0")
    ap.add_argument("--poll", type=float, default=0.1)
    ap.add_argument("--lease-timeout", type=float, default=1.5)
    ap.add_argument("--heartbeat", type=float, default=0.25)
    ap.add_argument("--max-wait", type=float, default=60.0)
    ap.add_argument("--size-mb", type=float, default=1.0)
    ap.add_argument("--files", type=int, default=3)
    ap.add_argument("--layout", type=int, default=0, help="file-name variant (0: default)")
    ap.add_argument("--build-sleep", type=float, default=0.0)
    ap.add_argument("--hold", action="append", default=[])
    ap.add_argument("--fail-stage", default=None, help="raise RuntimeError in this stage")
    ap.add_argument("--signal-dir", type=Path)
    ap.add_argument("--builds-log", type=Path)
    ap.add_argument("--result", type=Path)
    ap.add_argument("--gloo", action="store_true", help="init torch.distributed (env://)")
    ap.add_argument("--wakeup", choices=["auto", "none"], default="auto")
    ap.add_argument("--no-barrier", action="store_true", help="skip the final gloo barrier")
    ap.add_argument("--start-at", type=float, default=0.0, help="wall time to start at")
    args = ap.parse_args()

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    faults = _Faults(args.hold, args.signal_dir)
    result: dict = {"rank": args.rank, "pid": os.getpid(), "ok": False, "events": []}
    if args.gloo:
        import torch.distributed as td

        td.init_process_group("gloo", rank=args.rank, world_size=int(os.environ["WORLD_SIZE"]))
    size = int(args.size_mb * (1 << 20))

    def build(ctx):
        if args.builds_log is not None:
            with open(args.builds_log, "a") as f:
                f.write(f"{ctx.stage} {os.getpid()} {ctx.lease_id}\n")
        if ctx.stage == args.fail_stage:
            raise RuntimeError(f"injected failure in {ctx.stage}")
        digest = xxhash.xxh64()
        for _name, folder in sorted(ctx.previous.items()):
            for p in sorted(folder.rglob("*")):
                if p.is_file():
                    digest.update(p.read_bytes())
        for i in range(args.files):
            name = f"part-{i:05d}.bin" if not args.layout else f"v{args.layout}-{i:05d}.bin"
            (ctx.tmp_dir / name).write_bytes(_content(ctx.fingerprint, ctx.stage, i, size))
            if i == args.files // 2:
                faults.at(f"build-{ctx.stage}")
            if args.build_sleep:
                time.sleep(args.build_sleep / args.files)
        (ctx.tmp_dir / "previous.txt").write_text(digest.hexdigest())
        return {"rows": args.files * 10, "stage": ctx.stage}

    def on_event(name, fields):
        result["events"].append([name, time.time(), {k: str(v) for k, v in fields.items()}])
        faults.at(name)
        if "stage" in fields:
            faults.at(f"{name}-{fields['stage']}")

    if args.start_at:
        time.sleep(max(0.0, args.start_at - time.time()))
    result["started_at"] = time.time()
    try:
        markers = ensure_built(
            args.cache_dir,
            args.fingerprint,
            [Stage(name=s, build=build) for s in STAGES],
            process=detect(rank=args.rank, world_size=args.world_size, environ={}),
            builder=None if args.builder is None else bool(args.builder),
            poll_interval=args.poll,
            max_wait=args.max_wait,
            lease_timeout=args.lease_timeout,
            heartbeat_interval=args.heartbeat,
            wakeup="auto" if args.wakeup == "auto" else None,
            on_event=on_event,
        )
        result["returned_at"] = time.time()
        result["ok"] = True
        result["markers"] = {k: m.to_dict() for k, m in markers.items()}
        result["content_hash"] = tree_hash(args.cache_dir, markers)
        # As hf_pipeline's BuildResult.built: a lease of ours published a stage.
        ours = {e[2]["lease_id"] for e in result["events"] if e[0] == "claimed"}
        result["built"] = any(m.lease_id in ours for m in markers.values())
    except BaseException as e:  # report everything to the test
        result["returned_at"] = time.time()
        result["error_type"] = type(e).__name__
        result["error"] = str(e)
        result["traceback"] = traceback.format_exc()
    if args.result is not None:
        tmp = args.result.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, args.result)
    if args.gloo:
        import torch.distributed as td

        if result["ok"] and not args.no_barrier:
            # Like a training job's first collective: rank 0 (the store's host) must not
            # exit before the others have seen the doorbell.
            td.barrier()
        if not args.no_barrier:
            td.destroy_process_group()  # with a dead rank it could block: just exit
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
