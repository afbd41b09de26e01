"""Benchmarks of dist.ensure_built with real processes.

Measures:
  wakeup   latency from the builder's publication to the last waiter returning, polling
           only vs. with a gloo process group (the store doorbell);
  detect   time from SIGKILL of the builder to a waiter's takeover, vs. lease_timeout;
  stress   N rounds x P processes with random SIGKILLs of random ranks at random times:
           kills, takeovers, builds, corruptions (must be 0);
  rss      RSS/USS of a waiting process before and after it memory-maps and reads a
           large file listed in the marker.

Usage:
  python benchmarks/bench_coordination.py                  # all, ~2 minutes on 2 cores
  python benchmarks/bench_coordination.py --only stress --rounds 100 --procs 16
  python benchmarks/bench_coordination.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks._results import write_result  # noqa: E402

RANK = REPO / "tests" / "procs" / "dist_rank.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Procs:
    def __init__(self, root: Path):
        self.root = root
        self.signal_dir = root / "signals"
        self.signal_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.n = 0

    def start(self, cache: Path, rank: int, *args: str, env: dict | None = None):
        self.n += 1
        result = self.root / f"r{self.n}.json"
        p = subprocess.Popen(
            [sys.executable, str(RANK), "--cache-dir", str(cache), "--rank", str(rank),
             "--result", str(result), "--signal-dir", str(self.signal_dir),
             "--builds-log", str(self.root / f"builds-{cache.name}.log"), *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        p.result_path = result  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def results(self, procs, timeout=120.0) -> list[dict | None]:
        out = []
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            try:
                out.append(json.loads(p.result_path.read_text()))
            except (OSError, ValueError):
                out.append(None)  # killed
        return out

    def wait_signal(self, event: str, timeout=30.0) -> int:
        path = self.signal_dir / f"at-{event}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return int(path.read_text())
            time.sleep(0.005)
        raise TimeoutError(f"nobody reached {event}")

    def kill_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _events(r: dict, name: str) -> list:
    return [e for e in r["events"] if e[0] == name]


def bench_wakeup(work: Path, repeats: int, waiters: int, poll: float) -> dict:
    rng = random.Random(0)
    rows = {}
    for mode in ("poll only", "gloo doorbell"):
        lat = []
        for i in range(repeats):
            procs = _Procs(work / f"wake-{mode[:4]}-{i}")
            cache = procs.root / "cache"
            args = ["--poll", str(poll), "--lease-timeout", "60", "--heartbeat", "1",
                    "--build-sleep", "1.0", "--files", "2", "--size-mb", "1"]  # fmt: skip
            env = None
            if mode == "gloo doorbell":
                args.append("--gloo")
                env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                       "WORLD_SIZE": str(waiters + 1)}  # fmt: skip
            else:
                args += ["--wakeup", "none"]
            # Waiters start at random offsets so their polls are out of phase with the
            # publication (else the poll-only latency is an artefact of start-up timing).
            t0 = time.time() + 0.5
            ps = [
                procs.start(
                    cache, r, *args, "--start-at", str(t0 + (rng.uniform(0, poll) if r else 0)),
                    env=env,
                )
                for r in range(waiters + 1)
            ]  # fmt: skip
            res = procs.results(ps)
            procs.kill_all()
            published = _events(res[0], "complete")[0][1]
            lat.append(max(r["returned_at"] for r in res[1:]) - published)
        rows[mode] = {"median_s": statistics.median(lat), "max_s": max(lat), "runs": lat}
    return {"waiters": waiters, "poll_interval_s": poll, "modes": rows}


def bench_detect(work: Path, lease_timeouts: list[float], repeats: int) -> dict:
    rows = []
    for lt in lease_timeouts:
        times = []
        for i in range(repeats):
            procs = _Procs(work / f"detect-{lt}-{i}")
            cache = procs.root / "cache"
            args = ["--poll", str(min(0.1, lt / 10)), "--lease-timeout", str(lt),
                    "--heartbeat", str(lt / 5), "--hold", "build-converted:120"]  # fmt: skip
            ps = [procs.start(cache, r, *args) for r in range(3)]
            victim = procs.wait_signal("build-converted")
            os.kill(victim, signal.SIGKILL)
            killed = time.time()
            res = [r for r in procs.results(ps) if r is not None]
            procs.kill_all()
            t = min(_events(r, "takeover")[0][1] for r in res if _events(r, "takeover"))
            times.append(t - killed)
        rows.append({"lease_timeout_s": lt, "median_s": statistics.median(times),
                     "max_s": max(times), "ratio": statistics.median(times) / lt})  # fmt: skip
    return {"rows": rows}


def bench_stress(work: Path, rounds: int, nprocs: int, kill_prob: float, seed: int) -> dict:
    from dist.inventory import verify

    rng = random.Random(seed)
    totals = dict(rounds=rounds, procs=nprocs, kills=0, builder_kills=0, takeovers=0,
                  builds=0, corruptions=0, failures=0, wall_s=0.0)  # fmt: skip
    reference = None
    t_all = time.monotonic()
    for i in range(rounds):
        procs = _Procs(work / f"stress-{i}")
        # Named <name>-<fingerprint> (dist_rank.py's default fingerprint): verify()
        # checks the markers' fingerprint against the folder's name.
        cache = procs.root / "cache-fp0"
        args = ["--poll", "0.05", "--lease-timeout", "1.0", "--heartbeat", "0.2",
                "--build-sleep", "0.6", "--files", "4", "--size-mb", "0.25",
                "--max-wait", "60"]  # fmt: skip
        if reference is None:
            ref = procs.start(procs.root / "reference", 0, *args)
            reference = procs.results([ref])[0]["content_hash"]
        start_at = time.time() + 0.5
        ps = [procs.start(cache, r, *args, "--start-at", str(start_at)) for r in range(nprocs)]
        killed: set[int] = set()
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline and any(p.poll() is None for p in ps):
            time.sleep(rng.uniform(0.1, 0.8))
            if rng.random() < kill_prob:
                alive = [p for p in ps if p.poll() is None]
                if len(alive) > 1:
                    # Prefer whoever holds the lease: the interesting victim.
                    lease = None
                    try:
                        lease = json.loads((cache / "lease").read_text())
                    except (OSError, ValueError):
                        pass
                    victim = next((p for p in alive if lease and p.pid == lease.get("pid")),
                                  rng.choice(alive))  # fmt: skip
                    if rng.random() < 0.3:
                        victim = rng.choice(alive)
                    victim.send_signal(signal.SIGKILL)
                    killed.add(victim.pid)
                    totals["kills"] += 1
                    totals["builder_kills"] += bool(lease and victim.pid == lease.get("pid"))
        res = procs.results(ps)
        procs.kill_all()
        for p, r in zip(ps, res, strict=True):
            if p.pid in killed:
                continue
            if r is None or not r["ok"]:
                totals["failures"] += 1
            elif r["content_hash"] != reference:
                totals["corruptions"] += 1
            else:
                totals["takeovers"] += len(_events(r, "takeover"))
        survivors_ok = [r for p, r in zip(ps, res, strict=True) if p.pid not in killed and r]
        if survivors_ok and verify(cache):
            totals["corruptions"] += 1
        log = procs.root / f"builds-{cache.name}.log"
        totals["builds"] += len(log.read_text().splitlines()) if log.exists() else 0
    totals["wall_s"] = time.monotonic() - t_all
    return totals


def _rss_child(cache: str) -> None:
    import psutil

    from dist import Stage, ensure_built

    def mem():
        # RssAnon is this process's own memory; RssFile is page cache mapped into it
        # (shared, reclaimable); VmHWM the peak RSS so far.
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                    fields[key] = int(value.split()[0]) / 1024
        fields["uss"] = psutil.Process().memory_full_info().uss / 2**20
        return fields

    def never(ctx):  # this process only waits / reads
        raise AssertionError("the RSS child must not build")

    stages = [Stage(name=s, build=never) for s in ("converted", "filtered")]
    out = {"start": mem()}
    markers = ensure_built(cache, "fp0", stages, builder=False, poll_interval=0.05,
                           lease_timeout=30, heartbeat_interval=1, wakeup=None)  # fmt: skip
    out["after_wait"] = mem()
    big = max(markers["converted"].files, key=lambda f: f.size)
    with open(Path(cache) / big.path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        out["file_mib"] = len(m) / 2**20
        out["after_mmap"] = mem()
        rng = random.Random(0)
        for _ in range(2000):  # random 4 KiB reads, like batch gathers
            off = rng.randrange(0, len(m) - 4096)
            m[off : off + 4096]
        out["after_2000_random_reads"] = mem()
        total = 0
        for off in range(0, len(m), 1 << 20):
            total += m[off]
        out["after_full_scan"] = mem()
        m.close()
    out["after_unmap"] = mem()
    print(json.dumps(out))


def bench_rss(work: Path, size_mb: int) -> dict:
    procs = _Procs(work / "rss")
    cache = procs.root / "cache"
    # The builder holds in stage 2 while the child waits, so "after_wait" is a real wait.
    b = procs.start(cache, 0, "--size-mb", str(size_mb), "--files", "1", "--poll", "0.05",
                    "--lease-timeout", "30", "--heartbeat", "1", "--build-sleep", "1")  # fmt: skip
    child = subprocess.run([sys.executable, __file__, "--_rss-child", str(cache)],
                           capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    procs.results([b])
    return json.loads(child.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", choices=["wakeup", "detect", "stress", "rss"], action="append")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--waiters", type=int, default=3)
    ap.add_argument("--poll", type=float, default=2.0, help="waiters' poll_interval (wakeup)")
    ap.add_argument("--lease-timeouts", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--kill-prob", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-size-mb", type=int, default=512)
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--_rss-child", dest="rss_child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        _rss_child(args.rss_child)
        return
    only = set(args.only or ["wakeup", "detect", "stress", "rss"])
    work = Path(tempfile.mkdtemp(prefix="bench_coord_", dir=args.work_dir))
    figures: dict = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    if "wakeup" in only:
        w = figures["wakeup"] = bench_wakeup(work, args.repeats, args.waiters, args.poll)
        print(f"\nwake-up latency, publication -> last of {w['waiters']} waiters "
              f"(poll_interval {w['poll_interval_s']} s, {args.repeats} runs)")  # fmt: skip
        print(f"  {'mode':<16}{'median s':>10}{'max s':>10}")
        for mode, r in w["modes"].items():
            print(f"  {mode:<16}{r['median_s']:>10.3f}{r['max_s']:>10.3f}")
    if "detect" in only:
        lts = [float(x) for x in args.lease_timeouts.split(",")]
        d = figures["detect"] = bench_detect(work, lts, args.repeats)
        print(f"\ndead-builder detection: SIGKILL -> takeover ({args.repeats} runs each)")
        print(f"  {'lease_timeout s':<16}{'median s':>10}{'max s':>10}{'ratio':>8}")
        for r in d["rows"]:
            print(f"  {r['lease_timeout_s']:<16}{r['median_s']:>10.3f}{r['max_s']:>10.3f}"
                  f"{r['ratio']:>8.2f}")  # fmt: skip
    if "stress" in only:
        s = figures["stress"] = bench_stress(work, args.rounds, args.procs, args.kill_prob,
                                             args.seed)  # fmt: skip
        print(f"\nstress: {s['rounds']} rounds x {s['procs']} processes, random SIGKILLs")
        for k in ("kills", "builder_kills", "takeovers", "builds", "failures", "corruptions"):
            print(f"  {k:<16}{s[k]:>8}")
        print(f"  {'wall s':<16}{s['wall_s']:>8.1f}")
    if "rss" in only:
        r = figures["rss"] = bench_rss(work, args.rss_size_mb)
        print(f"\nmemory of a waiting process, {r['file_mib']:.0f} MiB file from the marker")
        cols = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
        print(f"  {'point (MiB)':<26}" + "".join(f"{c:>10}" for c in cols))
        for k in ("start", "after_wait", "after_mmap", "after_2000_random_reads",
                  "after_full_scan", "after_unmap"):  # fmt: skip
            print(f"  {k:<26}" + "".join(f"{r[k][c]:>10.1f}" for c in cols))
    if args.json:
        write_result(args.json, figures)
        print(f"\nwrote {args.json}")
    import shutil

    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
