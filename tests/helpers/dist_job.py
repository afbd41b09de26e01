"""A job of ``tests/procs/dist_rank.py`` rank processes, shared by the dist tests.

Every process a :class:`Job` starts is killed by ``kill_all`` (idempotent), which the
tests' ``job`` fixtures always call, even when a test fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dist.markers import read_json

RANK_SCRIPT = Path(__file__).resolve().parents[1] / "procs" / "dist_rank.py"


class Job:
    """Launches rank processes; ``kill_all`` is idempotent and always called."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.signal_dir = root / "signals"
        self.signal_dir.mkdir(parents=True, exist_ok=True)

    def start(
        self,
        cache_dir: Path,
        rank: int,
        *extra: str,
        env: dict | None = None,
        hostname: str | None = None,
        **kw,
    ):
        """Start a rank; ``hostname``: in a UTS namespace of its own with that host name
        (a process of another host, as far as its name goes; needs root)."""
        result = self.root / f"result-{cache_dir.name}-{rank}-{len(self.procs)}.json"
        prefix = []
        if hostname is not None:
            # unshare and sh exec: the rank keeps the pid Popen reports (tests signal it).
            prefix = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname]
        cmd = [
            *prefix,
            sys.executable,
            str(RANK_SCRIPT),
            "--cache-dir",
            str(cache_dir),
            "--rank",
            str(rank),
            "--result",
            str(result),
            "--signal-dir",
            str(self.signal_dir),
            "--builds-log",
            str(self.root / f"builds-{cache_dir.name}.log"),
            *extra,
        ]
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            text=True,
        )
        proc.result_path = result  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def wait(self, procs, timeout: float = 60.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        results = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_all()
                raise AssertionError(f"rank process {p.pid} did not finish in {timeout}s") from None
            r = read_json(p.result_path)
            assert r is not None, f"process {p.pid} (rc {p.returncode}) wrote no result:\n{out}"
            r["output"] = out
            r["returncode"] = p.returncode
            results.append(r)
        return results

    def wait_for_signal(self, event: str, timeout: float = 30.0) -> int:
        path = self.signal_dir / f"at-{event}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return int(path.read_text())
            for p in self.procs:
                if p.poll() is not None and p.returncode > 0:  # < 0: killed by the test
                    out = p.stdout.read() if p.stdout else ""
                    raise AssertionError(f"process {p.pid} died early:\n{out}")
            time.sleep(0.01)
        raise AssertionError(f"no process reached {event} in {timeout}s")

    def builds(self, cache_dir: Path) -> list[str]:
        log = self.root / f"builds-{cache_dir.name}.log"
        return log.read_text().split("\n")[:-1] if log.exists() else []

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                    p.kill()
            with contextlib.suppress(Exception):
                p.wait(timeout=10)
            if p.stdout:
                p.stdout.close()


def two_rank_nodes(root: Path):
    """``rank_env`` for ``run_ranks``: ranks in nodes of 2 (local rank, node), each node
    with its own cache root ``root/node<N>`` (as hosts without a shared filesystem)."""

    def node_env(rank: int) -> dict[str, str]:
        node = rank // 2
        return {
            "LOCAL_RANK": str(rank % 2),
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": str(node),
            "HF_PIPELINE_CACHE": str(root / f"node{node}"),
        }

    return node_env
