"""Cache inventory for operators: status, verify and clean (``prebuild_cache.py``).

Reads the layout written by :mod:`dist.coordinator` (one sub-folder of ``root`` per cache;
:mod:`dist.layout` says which folders are caches and what lives in one).
Liveness of a builder is judged the same way waiters judge it: a lease is live only if its
heartbeat counter moves during an observation window on *this* machine's clock.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import secrets
import shutil
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from dist.atomic import write_json_atomic
from dist.checksums import ALGORITHM, hash_files
from dist.layout import is_cache_folder, is_retired_marker, marker_name, parse_stage_dir
from dist.lease import LEASE_FILE, heartbeat_counter, heartbeat_path, read_lease
from dist.markers import Marker, check_marker, derived_from_problem, read_json

__all__ = [
    "DEFAULT_STAGES",
    "VERIFY_RECORD",
    "CacheState",
    "CacheStatus",
    "VerifyReport",
    "clean",
    "list_caches",
    "verify",
    "verify_cache",
    "verify_findings",
]

DEFAULT_STAGES: tuple[str, ...] = ("converted", "filtered")
#: What ``verify_cache(record=True)`` leaves in a cache whose files it found corrupt:
#: ``--status`` then says "corrupt" (and ``--clean`` removes the cache) without re-reading.
VERIFY_RECORD = "corrupt.json"
_BOOKKEEPING_PREFIXES = (f"{LEASE_FILE}.", "heartbeat-", "failed-")


class CacheState(str, enum.Enum):
    """What a cache folder looks like now (a ``str``: compares equal to its value)."""

    BUILDING = "building"  # a lease whose heartbeat moved while we watched (or unwatched)
    COMPLETE = "complete"  # every stage marker valid
    PARTIAL = "partial"  # the leading stages valid, no builder: resumable
    FAILED = "failed"  # a build raised (failure record)
    STALE = "stale"  # a dead lease, or leftovers of one
    CORRUPT = "corrupt"  # a marker lists missing or damaged files, or is malformed
    EMPTY = "empty"  # protocol files but nothing built

    def __str__(self) -> str:
        return self.value


#: States that ``clean`` removes whole.
_REMOVABLE = frozenset({CacheState.STALE, CacheState.CORRUPT, CacheState.FAILED, CacheState.EMPTY})


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheStatus:
    """What one cache folder looks like now.

    Attributes:
        path: the cache folder.
        fingerprint: from its markers (else the folder-name suffix after the last ``-``).
        state: a :class:`CacheState`.
        stages_done: stages with a valid marker (for ``PARTIAL``: where a build resumes).
        lease_id, builder_host, builder_pid: the lease holder, if any.
        heartbeat_counter, heartbeat_stage, heartbeat_phase: its last heartbeat.
        live: True/False if the heartbeat was observed to move / not move; None if not
            observed (``observe_s=0``) or no lease.
        size_bytes: total size of the files under the folder.
        age_s: seconds since the newest entry changed (local clock vs file mtimes: for
            display only; never used to judge liveness).
        problems: human-readable findings (invalid markers, leftovers, failure messages).
    """

    path: Path
    fingerprint: str | None
    state: CacheState
    stages_done: tuple[str, ...] = ()
    lease_id: str | None = None
    builder_host: str | None = None
    builder_pid: int | None = None
    heartbeat_counter: int | None = None
    heartbeat_stage: str | None = None
    heartbeat_phase: str | None = None
    live: bool | None = None
    size_bytes: int = 0
    age_s: float = 0.0
    problems: tuple[str, ...] = ()


def _lease_key(cache: Path) -> tuple | None:
    view = read_lease(cache / LEASE_FILE)
    if view is None:
        return None
    return (view.key, heartbeat_counter(cache, view.key))


def _size_and_age(cache: Path) -> tuple[int, float]:
    total, newest = 0, 0.0
    for dirpath, _, filenames in os.walk(cache):
        try:
            newest = max(newest, os.stat(dirpath).st_mtime)
        except OSError:
            pass
        for name in filenames:
            try:
                st = os.stat(os.path.join(dirpath, name))
            except OSError:
                continue
            total += st.st_size
            newest = max(newest, st.st_mtime)
    return total, max(0.0, time.time() - newest) if newest else 0.0


def _fingerprint(cache: Path, stages: Sequence[str]) -> str | None:
    for stage in stages:
        d = read_json(cache / marker_name(stage))
        if isinstance(d, dict) and isinstance(d.get("fingerprint"), str):
            return d["fingerprint"]
    return cache.name.rsplit("-", 1)[-1] if "-" in cache.name else None


def _valid_markers(
    cache: Path,
    stages: Sequence[str],
    fingerprint: str,
    *,
    verify: bool = False,
    missing: bool = False,
) -> tuple[dict[str, Marker], list[str]]:
    """The leading stages with a valid marker, and one problem line per invalid marker."""
    done: dict[str, Marker] = {}
    problems: list[str] = []
    for stage in stages:
        marker, why = check_marker(
            cache / marker_name(stage),
            fingerprint=fingerprint,
            base_dir=cache,
            stage=stage,
            verify=verify,
        )
        on_top = len(done) == stages.index(stage)  # every earlier stage is valid
        if marker is not None and on_top:
            why = derived_from_problem(marker, done)
        if marker is not None and why is None and on_top:
            done[stage] = marker
        elif why is not None and (missing or why != "missing"):
            problems.append(f"{stage}: {why}")
    return done, problems


def _leftovers(cache: Path, done: dict[str, Marker]) -> list[str]:
    """Entries no valid marker vouches for: unpublished or retired stage folders, retired
    markers, interrupted deletions."""
    published = {m.directory for m in done.values()}
    out = []
    for n in sorted(os.listdir(cache)):
        if n in published:
            continue
        if ".tmp-" in n or ".trash-" in n or is_retired_marker(n):
            out.append(n)
        elif parse_stage_dir(n) is not None and (cache / n).is_dir():
            out.append(n)
    return out


def _status(cache: Path, stages: Sequence[str], live: bool | None) -> CacheStatus:
    fingerprint = _fingerprint(cache, stages)
    done, marker_problems = _valid_markers(cache, stages, fingerprint or "")
    corrupt = bool(marker_problems)
    problems = [p.replace(": ", ".json: ", 1) for p in marker_problems]
    found = verify_findings(cache, done)
    problems += found
    names = sorted(os.listdir(cache))
    leftovers = _leftovers(cache, done)
    unmarked = [s for s in stages if (cache / s).is_dir() and s not in done]
    failures = [n for n in names if n.startswith("failed-") and n.endswith(".json")]
    for n in leftovers:
        problems.append(f"leftover {n}")
    for s in unmarked:
        problems.append(f"stage folder {s}/ without a valid marker")
    for n in failures:
        record = read_json(cache / n)
        if isinstance(record, dict):
            problems.append(
                f"failed build (host {record.get('host')}, pid {record.get('pid')}, stage "
                f"{record.get('stage')}): {record.get('error_type')}: {record.get('message')}"
            )
    view = read_lease(cache / LEASE_FILE)
    hb = read_json(heartbeat_path(cache, view.key)) if view is not None else None
    hb = hb if isinstance(hb, dict) else {}
    if view is not None and live is not False:
        state = CacheState.BUILDING
    elif found:
        state = CacheState.CORRUPT
    elif len(done) == len(stages):
        state = CacheState.COMPLETE
    elif corrupt:
        state = CacheState.CORRUPT
    elif view is not None:
        state = CacheState.STALE
        problems.append(f"dead lease {view.key} (host {view.host}, pid {view.pid})")
    elif failures:
        state = CacheState.FAILED
    elif leftovers or unmarked:
        state = CacheState.STALE
    elif done:
        state = CacheState.PARTIAL
    else:
        state = CacheState.EMPTY
    size, age = _size_and_age(cache)
    return CacheStatus(
        path=cache,
        fingerprint=fingerprint,
        state=state,
        stages_done=tuple(done),
        lease_id=view.key if view else None,
        builder_host=view.host if view else None,
        builder_pid=view.pid if view else None,
        heartbeat_counter=hb.get("counter"),
        heartbeat_stage=hb.get("stage"),
        heartbeat_phase=hb.get("phase"),
        live=live if view is not None else None,
        size_bytes=size,
        age_s=age,
        problems=tuple(problems),
    )


def list_caches(
    root: str | os.PathLike, *, stages: Sequence[str] = DEFAULT_STAGES, observe_s: float = 0.0
) -> list[CacheStatus]:
    """Status of every cache folder directly under ``root``, sorted by name.

    Args:
        root: the folder holding one sub-folder per cache.
        stages: stage names in build order.
        observe_s: watch leases this long to tell live builders from dead ones (use more
            than the builders' heartbeat interval); 0 reports every lease as building.

    Returns:
        One :class:`CacheStatus` per cache folder (see :func:`dist.layout.is_cache_folder`:
        hidden folders and folders holding no protocol file are not caches); [] if
        ``root`` does not exist. Reads only.
    """
    if observe_s < 0:
        raise ValueError(f"observe_s must be >= 0, got {observe_s}")
    root = Path(root)
    if not root.is_dir():
        return []
    caches = sorted(p for p in root.iterdir() if is_cache_folder(p))
    live: dict[Path, bool | None] = {c: None for c in caches}
    if observe_s > 0:
        before = {c: _lease_key(c) for c in caches}
        if any(k is not None for k in before.values()):
            time.sleep(observe_s)
            for c in caches:
                if before[c] is not None:
                    live[c] = _lease_key(c) != before[c]
    return [_status(c, list(stages), live[c]) for c in caches]


def verify(cache_dir: str | os.PathLike, stages: Sequence[str] = DEFAULT_STAGES) -> list[str]:
    """Re-check every stage marker, file sizes and checksums; [] means the cache is sound.

    :func:`verify_cache`'s problems (every file read whole).

    Args:
        cache_dir: one cache folder.
        stages: stage names in build order.

    Returns:
        Problems, one line each (``"filtered: listed file ... checksum mismatch"``).
    """
    return list(verify_cache(cache_dir, stages).problems)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """What :func:`verify_cache` found.

    Attributes:
        problems: one line each; () means every check passed.
        notes: what could not be checked (schema-1 markers have no whole-file checksums).
        files: files read whole.
        bytes: bytes read whole.
        seconds: wall time of the whole-file reads.
    """

    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0


def verify_cache(
    cache_dir: str | os.PathLike,
    stages: Sequence[str] = DEFAULT_STAGES,
    *,
    workers: int | None = None,
    progress: bool = False,
    record: bool = False,
) -> VerifyReport:
    """Check every stage marker, every listed file's size and edge checksum, and then
    every byte of every listed file against the marker's whole-file checksum.

    Args:
        cache_dir: one cache folder.
        stages: stage names in build order.
        workers: files hashed at once (default :func:`dist.checksums.default_workers`).
        progress: show a byte progress bar on stderr.
        record: write :data:`VERIFY_RECORD` into the cache when a published stage has a
            problem (``--status`` then reports the cache corrupt, and opening it for
            training is refused), and remove an earlier record when every stage is
            sound. Best effort: a read-only cache is still verified.

    Returns:
        A :class:`VerifyReport`.
    """
    cache = Path(cache_dir)
    stages = list(stages)
    done, problems = _valid_markers(
        cache, stages, _fingerprint(cache, stages) or "", verify=True, missing=True
    )
    old = [s for s, m in done.items() if m.schema_version < 2]
    notes = []
    if old:
        notes.append(
            f"no whole-file checksums (schema 1 markers: {', '.join(old)}): "
            "only sizes and first/last MiB checked"
        )
    jobs = [
        (stage, entry)
        for stage, marker in done.items()
        if marker.schema_version >= 2
        for entry in marker.files
    ]
    total = sum(entry.size for _, entry in jobs)
    bar = None
    if progress and jobs:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=total, unit="B", unit_scale=True, desc=cache.name, file=sys.stderr, leave=False
        )
    lock = threading.Lock()

    def advance(n: int) -> None:
        with lock:  # called from the hashing threads
            bar.update(n)

    read = 0
    t0 = time.monotonic()
    try:
        paths = [cache / entry.path for _, entry in jobs]
        hashed = hash_files(paths, workers=workers, on_bytes=advance if bar else None)
        for (stage, entry), (_, size, digest) in zip(jobs, hashed, strict=True):
            read += size
            if isinstance(digest, OSError):
                why = f"unreadable ({digest.strerror or digest})"
            elif size != entry.size:
                why = f"has {size} bytes, expected {entry.size}"
            elif digest != entry.whole_checksum:
                why = f"whole-file checksum mismatch ({ALGORITHM})"
            else:
                continue
            problems.append(f"{stage}: listed file {entry.path!r} {why}")
    finally:
        if bar is not None:
            bar.close()
    seconds = time.monotonic() - t0
    if record:
        _record_verify(cache, problems)
    return VerifyReport(
        problems=tuple(problems),
        notes=tuple(notes),
        files=len(jobs),
        bytes=read,
        seconds=seconds,
    )


def _record_verify(cache: Path, problems: Sequence[str]) -> None:
    """Leave (or withdraw) :data:`VERIFY_RECORD`: the problems of the stages whose
    marker names a stage folder, with those folders."""
    directories = {}
    for problem in problems:
        stage = problem.split(": ", 1)[0]  # "<stage>: <why>" (_valid_markers, verify_cache)
        d = read_json(cache / marker_name(stage))
        if isinstance(d, dict) and isinstance(d.get("directory"), str):
            directories[stage] = d["directory"]
    path = cache / VERIFY_RECORD
    try:
        if not directories:
            path.unlink(missing_ok=True)
            return
        write_json_atomic(
            path,
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "found_at": time.time(),
                # The record holds only while these folders are the published stages'.
                "directories": directories,
                "problems": [p for p in problems if p.split(": ", 1)[0] in directories],
            },
        )
    except OSError:
        pass  # a read-only cache: the findings are still printed and the exit code says so


def verify_findings(cache: str | os.PathLike, done: Mapping[str, Marker]) -> list[str]:
    """What an earlier ``--verify`` (:func:`verify_cache` with ``record``) found wrong
    with the stages published now (``done``: their valid markers), one line each, or []."""
    rec = read_json(Path(cache) / VERIFY_RECORD)
    if not isinstance(rec, dict) or not isinstance(rec.get("directories"), dict):
        return []
    dirs, problems = rec["directories"], rec.get("problems")
    # Only about the stage folders published now (a stage rebuilt since is another).
    current = {s for s, d in dirs.items() if s in done and done[s].directory == d}
    if not current or not isinstance(problems, list):
        return []
    return [
        f"--verify found: {p}"
        for p in problems
        if isinstance(p, str) and p.split(": ", 1)[0] in current
    ]


def _remove(path: Path) -> None:
    # Rename first so nobody ever sees (or resumes from) a half-deleted folder.
    trash = path.with_name(f".{path.name}.trash-{secrets.token_hex(4)}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    if trash.is_dir():
        shutil.rmtree(trash, ignore_errors=True)
    else:
        trash.unlink(missing_ok=True)


def clean(
    root: str | os.PathLike,
    *,
    dry_run: bool = True,
    stages: Sequence[str] = DEFAULT_STAGES,
    observe_s: float = 5.0,
) -> list[Path]:
    """Remove stale, corrupt and failed caches, and leftovers inside complete ones.

    A cache whose lease heartbeat moves during the ``observe_s`` window is live and never
    touched; one whose lease changed between the observation and the removal is skipped
    too. Still, run it when no job is *starting* on ``root``: a builder that claims a
    stale cache in the instant after our last look would lose its folder (and fail).

    Args:
        root: the folder holding one sub-folder per cache.
        dry_run: only report what would be removed.
        stages: stage names in build order.
        observe_s: liveness observation window (> the builders' heartbeat interval).

    Returns:
        The paths removed (or that would be removed).
    """
    if observe_s <= 0:
        raise ValueError(f"observe_s must be > 0, got {observe_s}")
    removed: list[Path] = []
    for status in list_caches(root, stages=stages, observe_s=observe_s):
        if status.state is CacheState.BUILDING:
            continue
        cache = status.path
        if _lease_key(cache) != (
            None if status.lease_id is None else (status.lease_id, status.heartbeat_counter)
        ):
            continue  # somebody claimed or beat since we looked
        if status.state in _REMOVABLE:
            targets = [cache]
        else:  # complete or resumable: keep, but drop what dead builders left
            targets = [
                cache / n
                for n in _leftovers(
                    cache, _valid_markers(cache, list(stages), status.fingerprint or "")[0]
                )
            ]
            targets += [
                cache / n
                for n in sorted(os.listdir(cache))
                if n == LEASE_FILE  # dead (we observed it), or we would not be here
                or n.startswith(_BOOKKEEPING_PREFIXES)
            ]
        for target in targets:
            removed.append(target)
            if not dry_run:
                _remove(target)
    return removed
