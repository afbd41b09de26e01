"""A build's start-up and end in a fresh process (issue 28): what the join's first shard
waits on, read from the build's own timeline (hf_pipeline.build.startup), and how soon
the process is gone once its report is out."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, SMALL_DEMO, script_env


def _sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


def _timed_run(args: list[str]) -> tuple[int, list[str], float]:
    """Run ``args`` with Python; its exit code, stdout lines, and the seconds between
    its last line of output and its exit."""
    p = subprocess.Popen(
        [PYTHON, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=script_env(), cwd=REPO,
    )  # fmt: skip
    lines, last = [], time.monotonic()
    assert p.stdout is not None
    for line in p.stdout:  # ends at EOF: the process closed stdout (exited)
        lines.append(line.rstrip("\n"))
        last = time.monotonic()
    gone = time.monotonic() - last
    err = p.stderr.read() if p.stderr else ""
    code = p.wait(timeout=60)
    assert code == 0, err
    return code, lines, gone


def _report(cache_root: Path, name: str) -> dict:
    (report,) = cache_root.glob(f"{name}-*/filtered.*/report.json")
    return json.loads(report.read_text())


# slow: two fresh-process builds and a reference interpreter (about 45 CPU-s).
@pytest.mark.slow
def test_fresh_process_starts_workers_and_encoder_first(tmp_path):
    """Two fresh-process builds (scripts/prebuild_cache.py): in both, the workers' fork
    server starts before the inputs are listed, the main thread has imported what the
    loading thread imports before that thread starts, and the join starts after. Then the process exits without the interpreter's
    shut-down: its exit after the report line takes a small share of what a fresh
    interpreter with the same libraries takes to shut down (measured in this test).

    On the code before issue 28 the report had no start-up timeline and the exit took
    seconds."""
    root = tmp_path / "cache"
    gaps = []
    for i in (1, 2):
        _, lines, gone = _timed_run([
            str(REPO / "scripts/prebuild_cache.py"), "--cache-dir", str(root), "-q",
            *_sets([*SMALL_DEMO, f"name=startup{i}", f"data.demo.seed={i}"]),
        ])  # fmt: skip
        assert any(line.startswith("rows ") for line in lines), lines
        gaps.append(gone)
    first, second = (_report(root, f"startup{i}")["startup"] for i in (1, 2))
    for s in (first, second):
        t = s["seconds"]
        assert t["workers_starting"] < t["identity"] < t["imports"] <= t["join_map"], t
        assert t["imports"] < t["tokenizer"] < t["encoder"], t  # the loading thread's
        assert t["join_map"] < t["first_shard"], t

    # The reference: a fresh interpreter with the build's heavy libraries, ending
    # through the interpreter's own shut-down.
    _, _, reference = _timed_run([
        "-c", "import datasets, torch, transformers.modeling_utils; print('ready', flush=True)",
    ])  # fmt: skip
    assert max(gaps) < reference / 4, (gaps, reference)
