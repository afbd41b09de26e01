"""The benchmarks' result files (``benchmarks/_results.py``) and the scripts' command lines.

The stamp is checked in a real git checkout made for the test (a copy of the helper and
``dist/``), in real subprocesses run by path as the benchmarks are; one real benchmark
(``bench_filter.py``, small) writes its file through it.
"""

from __future__ import annotations

import ast
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

BENCH = REPO / "benchmarks"
SCRIPTS = sorted(BENCH.glob("bench_*.py"))

_PROBE = """\
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._results import write_result

write_result(sys.argv[1], {"figure": 1.5, "rows": [1, 2]})
"""


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout


def _checkout(root: Path) -> Path:
    """A git checkout holding the helper, ``dist/`` and a probe benchmark; committed."""
    repo = root / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy(BENCH / "_results.py", repo / "benchmarks" / "_results.py")
    (repo / "benchmarks" / "bench_probe.py").write_text(_PROBE)
    shutil.copytree(REPO / "dist", repo / "dist", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".gitignore", repo / ".gitignore")  # __pycache__/ is not a change
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "probe")
    return repo


def _probe(repo: Path, out: Path) -> dict:
    # Bytecode written as anywhere else (the project's .gitignore covers it).
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")
    }
    # By absolute path from another folder: argv[0] must still come out repo-relative.
    script = repo / "benchmarks" / "bench_probe.py"
    subprocess.run(
        [sys.executable, str(script), str(out)],
        check=True, cwd=repo.parent, env=env, timeout=120, capture_output=True,
    )  # fmt: skip
    return json.loads(out.read_text())


def test_stamp_records_commit_host_card_argv_and_versions(tmp_path):
    repo = _checkout(tmp_path)
    head = _git(repo, "rev-parse", "HEAD").strip()
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    # Under benchmarks/results/ (untracked): a result file does not make the tree dirty.
    doc = _probe(repo, repo / "benchmarks" / "results" / "probe.json")

    assert doc["schema_version"] == 1
    assert doc["commit"] == head and doc["dirty"] is False
    assert doc["host"] == socket.gethostname()
    gpus = shutil.which("nvidia-smi") is not None
    assert doc["card"] and (gpus or doc["card"].startswith("cpu: ")), doc["card"]
    if not gpus and Path("/proc/cpuinfo").is_file():
        models = [
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.split(":")[0].strip() == "model name"
        ]
        assert doc["card"] == f"cpu: {models[0]}"
    assert doc["cpus"] == {"affinity": len(os.sched_getaffinity(0)), "count": os.cpu_count()}
    assert doc["argv"] == ["benchmarks/bench_probe.py", str(repo / "benchmarks/results/probe.json")]
    assert doc["python"] == platform.python_version()
    import numpy

    assert doc["libraries"]["numpy"] == numpy.__version__
    assert set(doc["libraries"]) >= {"torch", "jax", "datasets", "transformers"}
    written = datetime.datetime.fromisoformat(doc["written_at"])
    assert written.utcoffset() == datetime.timedelta(0)
    assert before <= written <= datetime.datetime.now(datetime.timezone.utc)
    assert doc["results"] == {"figure": 1.5, "rows": [1, 2]}

    # A change to a tracked file, or an untracked module, is a dirty tree.
    (repo / "dist" / "env.py").write_text((repo / "dist" / "env.py").read_text() + "\n")
    assert _probe(repo, tmp_path / "a.json")["dirty"] is True
    _git(repo, "checkout", "--", "dist/env.py")
    (repo / "benchmarks" / "helper.py").write_text("")
    assert _probe(repo, tmp_path / "b.json")["dirty"] is True


def test_stamp_without_git_is_unknown_even_inside_another_checkout(tmp_path):
    repo = _checkout(tmp_path)
    shutil.rmtree(repo / ".git")
    doc = _probe(repo, tmp_path / "plain.json")
    assert (doc["commit"], doc["dirty"]) == ("unknown", None)
    assert doc["results"] == {"figure": 1.5, "rows": [1, 2]}

    # The copy of a tree (no .git) sitting inside someone else's checkout: not its commit.
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "commit", "-q", "--allow-empty", "-m", "outer")
    doc = _probe(repo, tmp_path / "nested.json")
    assert (doc["commit"], doc["dirty"]) == ("unknown", None)


def test_a_copy_records_the_commit_its_sender_declares(tmp_path, monkeypatch):
    repo = _checkout(tmp_path)
    head = _git(repo, "rev-parse", "HEAD").strip()
    declared = "ab" * 20
    # The GPU hosts' copies carry a .git that is not their history: the declaration wins.
    monkeypatch.setenv("BENCH_TREE_COMMIT", declared)
    doc = _probe(repo, tmp_path / "over_git.json")
    assert (doc["commit"], doc["dirty"], doc["commit_declared"]) == (declared, None, True)
    shutil.rmtree(repo / ".git")
    monkeypatch.setenv("BENCH_TREE_COMMIT", head)
    doc = _probe(repo, tmp_path / "declared.json")
    assert (doc["commit"], doc["dirty"], doc["commit_declared"]) == (head, None, True)
    monkeypatch.setenv("BENCH_TREE_COMMIT", "not-a-sha; rm -rf /")
    doc = _probe(repo, tmp_path / "garbage.json")
    assert (doc["commit"], doc["dirty"]) == ("unknown", None)
    assert "commit_declared" not in doc


@pytest.mark.parametrize(
    ("names", "exit_code", "card"),
    [
        (["NVIDIA H200"] * 4, 0, "4x NVIDIA H200"),
        (["NVIDIA H100 80GB HBM3"], 0, "NVIDIA H100 80GB HBM3"),
        (["NVIDIA H200", "NVIDIA A100"], 0, "NVIDIA H200, NVIDIA A100"),
        ([], 9, "cpu: "),  # nvidia-smi without a driver: exit 9, the CPU's model
    ],
)
def test_card_from_nvidia_smi(tmp_path, monkeypatch, names, exit_code, card):
    """No GPU here: a stand-in ``nvidia-smi`` on PATH prints what the real one prints."""
    from benchmarks._results import stamp

    tool = tmp_path / "nvidia-smi"
    lines = "".join(f"echo '{n}'\n" for n in names)
    tool.write_text(f"#!/bin/sh\n{lines}exit {exit_code}\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    got = stamp()["card"]
    assert got.startswith(card) if card == "cpu: " else got == card


def test_write_replaces_atomically_and_never_half_writes(tmp_path):
    from benchmarks._results import read_result, write_result

    path = tmp_path / "new" / "r.json"  # the folder is created
    write_result(path, {"v": 1})
    first = path.stat().st_ino
    write_result(path, {"v": 2})
    # A new inode: os.replace of a complete temp file, not a rewrite in place that a
    # reader could catch half-done.
    assert path.stat().st_ino != first
    assert read_result(path).results == {"v": 2}
    with pytest.raises(TypeError):
        write_result(path, {"v": object()})
    assert read_result(path).results == {"v": 2}
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.json"]  # no temp file left


def test_reader_accepts_the_unstamped_files_and_refuses_bad_ones(tmp_path):
    from benchmarks._results import ResultFileError, read_result

    old = sorted((BENCH / "results").glob("*.json"))
    assert old
    for path in old:
        got = read_result(path)
        if got.stamp is None:  # written before the helper: the whole file is the payload
            assert got.results == json.loads(path.read_text()), path
        else:
            assert got.stamp["schema_version"] == 1 and "results" not in got.stamp, path

    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({"schema_version": 2, "results": {}}))
    with pytest.raises(ResultFileError, match="schema_version") as e:
        read_result(newer)
    assert e.value.path == str(newer)
    broken = tmp_path / "broken.json"
    broken.write_text('{"rows": 1')
    with pytest.raises(ResultFileError, match="broken.json"):
        read_result(broken)


@pytest.mark.slow
def test_bench_filter_writes_a_stamped_result(tmp_path):
    out = tmp_path / "filter.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_filter.py", "--rows", "20000", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["schema_version"] == 1 and doc["commit"] and doc["card"] and doc["host"]
    assert doc["argv"][:3] == ["benchmarks/bench_filter.py", "--rows", "20000"]
    # The payload's fields, as docs/performance.md cites them, unchanged.
    res = doc["results"]
    assert res["rows"] == 20000 and res["same_indices"] is True
    assert {"dropped", "datasets_filter", "write_kept_indices", "speedup", "what"} <= set(res)


def _writes_json(script: Path) -> bool:
    return '"--json"' in script.read_text()


def _own_json_writes(tree: ast.Module) -> list[int]:
    """Lines that write JSON to a file by hand: ``x.write_text(json.dumps(...))``,
    ``json.dump(obj, fh)``."""
    lines = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        dumps_arg = any(  # json.dumps(...) or json.dumps(...) + "\n"
            isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "dumps"
            for a in node.args
            for n in ast.walk(a)
        )
        json_dump = node.func.attr == "dump" and getattr(node.func.value, "id", "") == "json"
        if json_dump or (node.func.attr == "write_text" and dumps_arg):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("script", [s for s in SCRIPTS if _writes_json(s)], ids=lambda p: p.name)
def test_every_result_goes_through_the_helper(script):
    """A script with ``--json`` imports ``write_result`` and writes no JSON file itself."""
    tree = ast.parse(script.read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "benchmarks._results"
        for alias in node.names
    }
    assert "write_result" in imported
    # The one allowed: bench_build_ranks' children hand their figures to the parent.
    allowed = {"bench_build_ranks.py": 1}
    assert len(_own_json_writes(tree)) == allowed.get(script.name, 0), _own_json_writes(tree)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_script_parses_its_arguments(script):
    proc = subprocess.run(
        [sys.executable, str(script), "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def _expand(name: str) -> list[str]:
    """A file name of the index with its shell braces expanded (``{a,b}``, ``{1..4}``)."""
    import re

    m = re.search(r"\{([^{}]*)\}", name)
    if m is None:
        return [name]
    body = m.group(1)
    if re.fullmatch(r"\d+\.\.\d+", body):
        lo, hi = map(int, body.split(".."))
        options = [str(i) for i in range(lo, hi + 1)]
    else:
        options = body.split(",")
    return [x for o in options for x in _expand(name[: m.start()] + o + name[m.end() :])]


def test_every_result_file_is_in_the_index_and_every_indexed_file_exists():
    """``benchmarks/README.md``'s "Every result file" table names each file under
    ``benchmarks/results/`` (a reader goes from a figure to its run and back), and names
    no file that is not there."""
    import re

    text = (BENCH / "README.md").read_text()
    table = text.split("## Every result file", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    named: set[str] = set()
    for row in rows:
        first_cell = row.split("|")[1]
        for name in re.findall(r"`([^`]+)`", first_cell):
            named.update(_expand(name))
    on_disk = {p.name for p in (BENCH / "results").iterdir() if p.is_file()}
    assert sorted(on_disk - named) == [], "result files the index does not name"
    assert sorted(named - on_disk) == [], "indexed files that are not in benchmarks/results"
