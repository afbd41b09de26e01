"""One writer for every benchmark's result file, and a reader that accepts the old ones.

A result file says what was measured and on what, so a figure in ``docs/performance.md``
can be traced to its run::

    {"schema_version": 1,
     "commit": "<sha of HEAD>" | "unknown", "dirty": true | false | null,
     "host": "<hostname>", "card": "4x NVIDIA H200" | "cpu: <model name>",
     "cpus": {"affinity": 16, "count": 64}, "argv": ["benchmarks/bench_x.py", ...],
     "python": "3.11.9", "libraries": {"torch": "2.5.1", "jax": null, ...},
     "written_at": "2026-12-01T13:30:00+00:00",
     "results": <the script's own payload, unchanged>}

``commit`` is that of the repository this file lives in. The GPU hosts receive a copy of
the working tree that may lack ``.git``: then ``commit`` is ``HF_PIPELINE_BENCH_COMMIT``
(set by ``benchmarks/gpu_session.sh --commit SHA``) or ``"unknown"``, and ``dirty``
is ``null`` (never the commit of some enclosing repository the copy happens to sit in).
``dirty`` counts tracked changes and untracked files, except result files (under
``benchmarks/results/`` and the file being written): an untracked module is code that
ran, a result written earlier is not.

The stamp is taken when the file is written, not when the script starts: the timed child
processes import the scripts too and must not pay for ``git`` (so a commit made during a
run on a shared checkout is the one stamped; the GPU hosts' copies do not change).

Files written before this helper (the older ones in ``results/``) are the payload alone;
:func:`read_result` returns those with ``stamp=None``.

Usage from a benchmark (run by path: the repository root is put on ``sys.path``)::

    from benchmarks._results import write_result
    write_result(args.json, out)
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dist.atomic import write_json_atomic  # noqa: E402

__all__ = [
    "SCHEMA_VERSION",
    "BenchResult",
    "ResultFileError",
    "read_result",
    "stamp",
    "write_result",
]

#: Bumped when a stamp field changes meaning; :func:`read_result` refuses newer files.
SCHEMA_VERSION = 1

#: Distributions whose versions are recorded (read from their metadata: nothing imported).
LIBRARIES = ("numpy", "pyarrow", "datasets", "torch", "transformers", "jax", "jaxlib", "grain")

#: Seconds for one ``git`` or ``nvidia-smi`` call: a hung NFS mount or driver must not
#: hold a finished benchmark's result hostage.
TOOL_TIMEOUT_S = 20.0

_RESULTS_DIR = "benchmarks/results/"


class ResultFileError(ValueError):
    """A result file is unreadable, not JSON, or of a newer schema than this reader.

    Attributes:
        path: the file.
    """

    def __init__(self, message: str, path: str | os.PathLike):
        super().__init__(message)
        self.path = str(path)

    def __reduce__(self):
        return (type(self), (self.args[0], self.path))


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchResult:
    """One result file as read by :func:`read_result`.

    Attributes:
        path: the file.
        stamp: every field but ``results`` (commit, host, card, ...); None for a file
            written before the stamping helper.
        results: the benchmark's payload.
    """

    path: Path
    stamp: dict[str, Any] | None
    results: Any


def _run_tool(cmd: Sequence[str]) -> str | None:
    """stdout of ``cmd``, or None when it is missing, fails or overruns its deadline."""
    try:
        proc = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _commit(repo: Path, written: Path | None) -> tuple[str, bool | None]:
    """(HEAD's sha, dirty) of ``repo``; ("unknown", None) when it is not a git checkout."""
    git = ["git", "-C", str(repo)]
    top = _run_tool([*git, "rev-parse", "--show-toplevel"])
    # A copy without .git inside another checkout would report that checkout's commit.
    if top is None or Path(top.strip()).resolve() != repo.resolve():
        # A GPU host's copy of the tree has no .git: the commit it was sent from, as
        # the sender says (benchmarks/gpu_session.sh --commit), dirty unknown.
        sent = os.environ.get("HF_PIPELINE_BENCH_COMMIT", "").strip()
        return (sent or "unknown"), None
    head = _run_tool([*git, "rev-parse", "HEAD"])
    status = _run_tool([*git, "status", "--porcelain", "--untracked-files=all"])
    if head is None:
        return "unknown", None
    if status is None:
        return head.strip(), None
    skip = None
    if written is not None:
        try:
            skip = written.resolve().relative_to(repo.resolve()).as_posix()
        except ValueError:
            skip = None
    dirty = False
    for line in status.splitlines():
        path = line[3:].strip().strip('"')
        untracked = line.startswith("??")
        if untracked and (path.startswith(_RESULTS_DIR) or path == skip):
            continue
        dirty = True
        break
    return head.strip(), dirty


def _card() -> str:
    """The GPUs' names ("4x NVIDIA H200"), else "cpu: <model name>"."""
    out = _run_tool(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    names = [n.strip() for n in (out or "").splitlines() if n.strip()]
    if names:
        if len(set(names)) == 1:
            return names[0] if len(names) == 1 else f"{len(names)}x {names[0]}"
        return ", ".join(names)
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                    break
    except OSError:
        pass
    return f"cpu: {model or platform.processor() or platform.machine() or 'unknown'}"


def _argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the script's path relative to the repository (when it is inside)."""
    out = [str(a) for a in argv]
    if out:
        try:
            out[0] = Path(out[0]).resolve().relative_to(REPO.resolve()).as_posix()
        except (ValueError, OSError):
            pass
    return out


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def stamp(*, written: str | os.PathLike | None = None, repo: Path = REPO) -> dict[str, Any]:
    """The provenance fields of a result file (everything but ``results``).

    Args:
        written: the result file about to be written (an untracked copy of it does not
            make the tree dirty).
        repo: the repository whose commit is recorded (this file's).
    """
    commit, dirty = _commit(repo, Path(written) if written is not None else None)
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except AttributeError:  # not on macOS
        affinity = None
    return {
        "schema_version": SCHEMA_VERSION,
        "commit": commit,
        "dirty": dirty,
        "host": socket.gethostname(),
        "card": _card(),
        "cpus": {"affinity": affinity, "count": os.cpu_count()},
        "argv": _argv(sys.argv),
        "python": platform.python_version(),
        "libraries": _versions(),
        "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_result(path: str | os.PathLike, results: Any) -> Path:
    """Write ``results`` under a fresh :func:`stamp` to ``path``, atomically.

    The folder is created if missing. A reader of ``path`` sees the previous file or the
    complete new one, never a part (temp file, fsync, ``os.replace``); a payload that is
    not JSON-serializable raises before anything is written.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        TypeError, ValueError: ``results`` cannot be written as JSON.
        OSError: the folder or file cannot be written.
    """
    path = Path(path)
    doc = {**stamp(written=path), "results": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, doc, indent=1)
    return path


def read_result(path: str | os.PathLike) -> BenchResult:
    """Read a result file, stamped or written before the stamping helper.

    Raises:
        ResultFileError: the file cannot be read, is not JSON, or has a
            ``schema_version`` this reader does not know.
    """
    path = Path(path)
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise ResultFileError(f"{path}: not a readable JSON result file: {e}", path) from e
    if not (isinstance(doc, dict) and "schema_version" in doc):
        return BenchResult(path=path, stamp=None, results=doc)
    version = doc["schema_version"]
    if not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION or "results" not in doc:
        raise ResultFileError(
            f"{path}: schema_version must be an int in [1, {SCHEMA_VERSION}] with a 'results' "
            f"field, got {version!r}",
            path,
        )
    fields = {k: v for k, v in doc.items() if k != "results"}
    return BenchResult(path=path, stamp=fields, results=doc["results"])
