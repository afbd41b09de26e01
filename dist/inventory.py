"""Cache inventory for operators: status, verify and clean (``prebuild_cache.py``).

Reads the layout written by :mod:`dist.coordinator` (one sub-folder of ``root`` per cache;
:mod:`dist.layout` says which folders are caches and what lives in one).
Liveness of a builder is judged the same way waiters judge it: a lease is live only if its
heartbeat counter moves during an observation window on *this* machine's clock.

The root may hold other people's things (a shared ``HF_PIPELINE_CACHE``), so what
:func:`clean` deletes is bounded by proof, not by names:

- only folders that carry the project's mark (:func:`dist.layout.cache_mark`; an identity
  file of another fingerprint than the folder's name is none); anything else, and every
  symlink, is left as it is (and :func:`ignored_entries` reports it);
- of a cache it removes, only the entries the project writes, known by their names
  (:func:`_ours`); a cache holding anything else stays, with a ``left`` line naming it;
- nothing is ever reached through a symlink: entries are judged with ``lstat``, walks
  do not descend links, a link inside a cache is at most unlinked itself (trash links
  of an earlier run), never followed;
- inside a complete cache, only protocol bookkeeping, unpublished stage folders, and
  regular files inside a published stage folder that its marker does not list.

A *store* (``stores`` of :func:`clean`, :func:`list_store`) is a folder of the root
holding *units*: cache folders of one stage each, named ``<stage>-<id>``, whose files
caches hard-link into their own stages (hf_pipeline's part store, ``.parts``). Caches
that share a unit share its files' inodes: removing a cache removes its links, never
the bytes another cache still links. A *work folder* (``work`` of :func:`clean`,
:func:`list_work`: a pull's staging, ``.staging/pull-<fingerprint>``) is the project's
only with its mark (:func:`dist.layout.work_mark`), and abandoned once the cache it names
has no live lease (judged as the cache's own state is); :func:`clean` then removes the
entries its mark declares, and the folder when nothing else is in it. A *job folder*
(``jobs`` of :func:`clean`, :func:`list_jobs`: ``.jobs/<launch id>/``, the ranks'
agreement through a file store) is removed once it is provably finished or abandoned
(:func:`dist.agreement.job_folder_state`), and only when it holds nothing else. A complete unit is *in use* while one of its files
has a link besides its own, or while a unit in use names it in its marker's ``uses``;
:func:`clean` removes units that are not (and stale, failed or corrupt ones).
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import json
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from dist.agreement import job_folder_state
from dist.atomic import write_json_atomic
from dist.checksums import hash_files, hashed_problem
from dist.layout import (
    IDENTITY_FILE,
    VERIFY_RECORD,
    WORK_MARK,
    cache_mark,
    identity_bytes,
    is_bookkeeping,
    is_project_entry,
    is_retired_marker,
    marker_name,
    parse_stage_dir,
    parse_temp_name,
    parse_trash_name,
    trash_name,
    visible_folder_names,
    work_mark,
)
from dist.lease import LEASE_FILE, heartbeat_counter, heartbeat_path, holder_exited, read_lease
from dist.markers import (
    Marker,
    check_marker,
    derived_from_problem,
    file_problems,
    parse_marker,
    read_json,
)
from dist.safepath import UnsafePathError, join_under, remove_tree_at, shown

__all__ = [
    "DEFAULT_STAGES",
    "VERIFY_RECORD",
    "CacheState",
    "CacheStatus",
    "CleanReport",
    "StoredUnit",
    "JobFolder",
    "VerifyReport",
    "WorkFolder",
    "clean",
    "ignored_entries",
    "linked_by",
    "list_caches",
    "list_jobs",
    "list_store",
    "list_work",
    "unlisted_files",
    "verify",
    "verify_cache",
    "verify_findings",
]

DEFAULT_STAGES: tuple[str, ...] = ("converted", "filtered")
#: Unlisted files named one by one in a status's problems (all of them in ``unlisted``).
_SHOW_UNLISTED = 20
#: :data:`dist.layout.VERIFY_RECORD` is what ``verify_cache(record=True)`` leaves in a
#: cache whose files it found corrupt: ``--status`` then says "corrupt" (and ``--clean``
#: removes the cache) without re-reading.


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
        problems: human-readable findings (invalid markers, leftovers, failure messages,
            files no marker lists).
        unlisted: paths (relative to the folder) inside published stage folders that no
            marker lists: written by something else (a ``datasets`` call on the cache).
        shared_files, shared_bytes: the files its markers list that another cache of
            the root also holds (hard links to one inode: counted once on disk).
        shared_parts: the ``parts/<part>`` folders holding such files.
        shared_with: the names of those other caches.
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
    unlisted: tuple[str, ...] = ()
    shared_files: int = 0
    shared_bytes: int = 0
    shared_parts: int = 0
    shared_with: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """JSON-able (``prebuild_cache.py --status --json``)."""
        d = dataclasses.asdict(self)
        d.update(path=str(self.path), state=self.state.value)
        return d


@dataclasses.dataclass(frozen=True, kw_only=True)
class CleanReport:
    """What :func:`clean` removed (or would remove) and what it left, and why.

    Attributes:
        removed: paths removed (with ``dry_run``: that would be removed).
        left: ``(path, why)`` for what it found but did not touch (symlinks, folders
            without the project's mark that look like caches, removals that failed).
    """

    removed: tuple[Path, ...] = ()
    left: tuple[tuple[Path, str], ...] = ()


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _is_link(path: Path) -> bool:
    st = _lstat(path)
    return st is not None and stat.S_ISLNK(st.st_mode)


def _identity_mismatch(path: Path, name: str | None = None) -> str | None:
    """Why the identity file in ``path`` proves nothing (None: there is none, or it
    names the folder's own fingerprint). A folder holding one written for another name
    (copied or renamed) is no cache of ours, whatever else it holds: the legacy rules
    of :func:`dist.layout.cache_mark` are for folders written before it existed."""
    name = path.name if name is None else name
    if not os.path.lexists(path / IDENTITY_FILE):
        return None
    d = None if _is_link(path / IDENTITY_FILE) else read_json(path / IDENTITY_FILE)
    fp = d.get("fingerprint") if isinstance(d, dict) else None
    if isinstance(fp, str) and fp and name.endswith(f"-{fp}"):
        return None
    if isinstance(fp, str):
        return (
            f"its {IDENTITY_FILE} names fingerprint {shown(fp)}, not the folder name's: "
            "proves nothing, left as it is"
        )
    return f"its {IDENTITY_FILE} is not hf_pipeline's: proves nothing, left as it is"


def _unwritten_identity(path: Path, name: str) -> str | None:
    """The fingerprint of a folder whose builder died writing its identity file: no
    :data:`IDENTITY_FILE` yet, but a lease and the identity's temp file (dist.atomic's,
    before its link into place) holding exactly what the project writes there
    (:func:`dist.layout.identity_bytes`) for the folder's own name. Else None."""
    names = visible_folder_names(path, name)
    if (
        names is None
        or IDENTITY_FILE in names
        or LEASE_FILE not in names
        or read_lease(path / LEASE_FILE) is None
    ):
        return None
    for n in names:
        st = _lstat(path / n)
        if parse_temp_name(n) != IDENTITY_FILE or st is None or not stat.S_ISREG(st.st_mode):
            continue
        d = read_json(path / n)
        if not isinstance(d, dict):
            continue
        fp, host, pid = d.get("fingerprint"), d.get("host"), d.get("pid")
        if not (isinstance(fp, str) and fp and name.endswith(f"-{fp}")):
            continue
        if not (isinstance(host, str) and type(pid) is int):
            continue
        want = json.loads(identity_bytes(fp, host=host, pid=pid))
        if {k: v for k, v in d.items() if k != "created_at"} == {
            k: v for k, v in want.items() if k != "created_at"
        }:
            return fp
    return None


def _mark(path: Path, *, name: str | None = None) -> str | None:
    """:func:`dist.layout.cache_mark`, except that an identity file of another
    fingerprint than the folder's name makes it no cache (:func:`_identity_mismatch`),
    and that a folder whose builder died writing it is one (:func:`_unwritten_identity`)."""
    fingerprint = cache_mark(path, name=name)
    if fingerprint is None:
        return _unwritten_identity(path, path.name if name is None else name)
    if _identity_mismatch(path, name) is not None:
        return None
    return fingerprint


def _ours(folder: Path, name: str, stages: Sequence[str]) -> bool:
    """Whether entry ``name`` of cache ``folder`` is one the project writes, by the names
    it uses (dist.layout): markers (also retired), stage folders, lease and heartbeat,
    failure records, the identity file, --verify's record, temporary files and trash of
    these. A symlink only as trash (the coordinator's rename of a link in a stage
    folder's place; only ever unlinked, never followed)."""
    if _is_link(folder / name):
        inner = parse_trash_name(name)
        return inner is not None and is_project_entry(inner, stages)
    return is_project_entry(name, stages)


def _foreign(folder: Path, stages: Sequence[str]) -> list[str]:
    """The entries of cache ``folder`` that the project did not write (:func:`_ours`)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [n for n in names if not _ours(folder, n, stages)]


def _shown_foreign(folder: Path, names: Sequence[str]) -> str:
    """``names`` for a left line: the first few, links said so."""
    shown_names = [shown(n) + (" (a symbolic link)" if _is_link(folder / n) else "") for n in names]
    more = f" (+{len(names) - 5} more)" if len(names) > 5 else ""
    return ", ".join(shown_names[:5]) + more


def _lease_key(cache: Path) -> tuple[str, int | None] | None:
    view = read_lease(cache / LEASE_FILE)
    if view is None:
        return None
    return (view.key, heartbeat_counter(cache, view.key))


def _size_and_age(cache: Path) -> tuple[int, float]:
    """Bytes on disk under ``cache`` (a hard-linked file once: the ranks' parts and the
    stage they are assembled into share their files) and seconds since the last change.
    Never follows a symlink (walks do not descend links; lstat counts the link)."""
    total, newest = 0, 0.0
    seen: set[tuple[int, int]] = set()
    for dirpath, _, filenames in os.walk(cache):
        try:
            newest = max(newest, os.lstat(dirpath).st_mtime)
        except OSError:
            pass
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            newest = max(newest, st.st_mtime)
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total, max(0.0, time.time() - newest) if newest else 0.0


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


def _leftovers(
    cache: Path, done: dict[str, Marker], stages: Sequence[str], live_lease: str | None = None
) -> list[str]:
    """Entries no valid marker vouches for: unpublished or retired stage folders, retired
    markers, interrupted deletions, by the names the project gives them (a user's
    ``notes.trash-...`` is none of these). Not the folders of ``live_lease`` (it builds
    there)."""
    published = {m.directory for m in done.values()}
    out = []
    for n in sorted(os.listdir(cache)):
        if n in published or n == IDENTITY_FILE:
            continue
        parsed = parse_stage_dir(n)
        if parsed is not None and live_lease is not None and parsed.lease_id == live_lease:
            continue
        if ".tmp-" in n or parse_trash_name(n) is not None or is_retired_marker(n):
            if is_project_entry(n, stages):
                out.append(n)
        elif parsed is not None and (_is_link(cache / n) or (cache / n).is_dir()):
            out.append(n)
    return out


def _stage_folder(cache: Path, marker: Marker) -> Path | None:
    """The published folder of ``marker`` if it is one real folder directly in ``cache``
    (a marker is read from disk: never walk where a strange ``directory`` points)."""
    name = marker.directory
    if parse_stage_dir(name) is None and name != marker.stage:
        return None
    st = _lstat(cache / name)
    return cache / name if st is not None and stat.S_ISDIR(st.st_mode) else None


def _unlisted(cache: Path, done: dict[str, Marker]) -> list[str]:
    """Entries inside the published stage folders of ``done`` that no marker lists
    (relative to ``cache``); folders are walked, symlinks reported, neither followed."""
    listed = {f.path for m in done.values() for f in m.files}
    out = []
    for marker in done.values():
        folder = _stage_folder(cache, marker)
        if folder is None:
            continue
        for dirpath, dirnames, filenames in os.walk(folder):
            links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
            for name in filenames + links:
                rel = Path(dirpath, name).relative_to(cache).as_posix()
                if rel not in listed:
                    out.append(rel)
    return sorted(out)


def unlisted_files(
    cache_dir: str | os.PathLike[str], stages: Sequence[str] = DEFAULT_STAGES
) -> list[str]:
    """Files inside the published stage folders of ``cache_dir`` that no valid marker
    lists (paths relative to ``cache_dir``): not part of the cache. Reads only."""
    cache = Path(cache_dir)
    fingerprint = _mark(cache) or ""
    return _unlisted(cache, _valid_markers(cache, list(stages), fingerprint)[0])


def _failures(cache: Path, names: Sequence[str]) -> list[tuple[str, str]]:
    """``("(host H, pid P, stage S)", "ErrorType: message")`` of each failure record
    ``names`` of ``cache`` that parses (``failed-<lease id>.json``, :mod:`dist.coordinator`)."""
    out = []
    for n in names:
        record = read_json(cache / n)
        if isinstance(record, dict):
            # Written by any host sharing the root: escaped and bounded (shown), so a
            # newline or an ANSI escape in it cannot forge a row of --status or --verify.
            host, pid, stage, kind, message = (
                shown(record.get(k)) for k in ("host", "pid", "stage", "error_type", "message")
            )
            out.append((f"(host {host}, pid {pid}, stage {stage})", f"{kind}: {message}"))
    return out


def _failure_names(cache: Path) -> list[str]:
    """The failure records in ``cache`` (``failed-*.json``), sorted."""
    try:
        names = sorted(os.listdir(cache))
    except OSError:
        return []
    return [n for n in names if n.startswith("failed-") and n.endswith(".json")]


def _status(cache: Path, fingerprint: str, stages: Sequence[str], live: bool | None) -> CacheStatus:
    done, marker_problems = _valid_markers(cache, stages, fingerprint)
    corrupt = bool(marker_problems)
    problems = [p.replace(": ", ".json: ", 1) for p in marker_problems]
    found = verify_findings(cache, done)
    problems += found
    view = read_lease(cache / LEASE_FILE)
    building = view is not None and live is not False
    leftovers = _leftovers(cache, done, stages, view.key if view is not None and building else None)
    unlisted = _unlisted(cache, done)
    unmarked = [s for s in stages if (cache / s).is_dir() and s not in done]
    failures = _failure_names(cache)
    for n in leftovers:
        problems.append(f"leftover {n}" + (" (a symbolic link)" if _is_link(cache / n) else ""))
    for rel in unlisted[:_SHOW_UNLISTED]:
        problems.append(f"not listed by any marker: {rel}")
    if len(unlisted) > _SHOW_UNLISTED:
        problems.append(f"... and {len(unlisted) - _SHOW_UNLISTED} more files not listed")
    for s in unmarked:
        problems.append(f"stage folder {s}/ without a valid marker")
    problems += [f"failed build {where}: {what}" for where, what in _failures(cache, failures)]
    hb = read_json(heartbeat_path(cache, view.key)) if view is not None else None
    hb = hb if isinstance(hb, dict) else {}
    if building:
        state = CacheState.BUILDING
    elif found:
        state = CacheState.CORRUPT
    elif len(done) == len(stages):
        state = CacheState.COMPLETE
    elif corrupt:
        state = CacheState.CORRUPT
    elif view is not None:
        state = CacheState.STALE
        problems.append(f"dead lease {view.key} (host {shown(view.host)}, pid {view.pid})")
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
        unlisted=tuple(unlisted),
    )


def list_caches(
    root: str | os.PathLike[str], *, stages: Sequence[str] = DEFAULT_STAGES, observe_s: float = 0.0
) -> list[CacheStatus]:
    """Status of every cache folder directly under ``root``, sorted by name.

    Args:
        root: the folder holding one sub-folder per cache.
        stages: stage names in build order.
        observe_s: watch leases this long to tell live builders from dead ones (use more
            than the builders' heartbeat interval); 0 reports every lease as building.

    Returns:
        One :class:`CacheStatus` per cache folder (:func:`dist.layout.cache_mark`: a real
        folder carrying the project's mark; symlinks and other folders are not caches,
        see :func:`ignored_entries`); [] if ``root`` does not exist. Reads only.
    """
    if observe_s < 0:
        raise ValueError(f"observe_s must be >= 0, got {observe_s}")
    root = Path(root)
    if not root.is_dir():
        return []
    marks = {p: _mark(p) for p in sorted(root.iterdir())}
    caches = [p for p, fingerprint in marks.items() if fingerprint is not None]
    live = _observed(caches, observe_s)
    statuses = [_status(c, marks[c] or "", list(stages), live[c]) for c in caches]
    return _with_sharing(statuses, stages)


def _observed(folders: Sequence[Path], observe_s: float) -> dict[Path, bool | None]:
    """Whether each folder's lease heartbeat moved during ``observe_s`` (None: no lease,
    or not observed). A lease whose holder provably exited (on this machine:
    :func:`dist.lease.holder_exited`) is not live without waiting."""
    live: dict[Path, bool | None] = {c: None for c in folders}
    for c in folders:
        try:
            view = read_lease(c / LEASE_FILE)
        except OSError:
            continue
        if view is not None and holder_exited(view):
            live[c] = False
    watch = [c for c in folders if live[c] is None]
    if observe_s > 0 and watch:
        before = {c: _lease_key(c) for c in watch}
        if any(k is not None for k in before.values()):
            time.sleep(observe_s)
            for c in watch:
                if before[c] is not None:
                    live[c] = _lease_key(c) != before[c]
    return live


def _regular_files(folder: Path) -> list[os.stat_result]:
    """lstat of every regular file under ``folder``, never entering a link."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        for name in filenames:
            st = _lstat(Path(dirpath) / name)
            if st is not None and stat.S_ISREG(st.st_mode):
                out.append(st)
    return out


def _listed_regular(folder: Path, done: Mapping[str, Marker]) -> list[tuple[str, os.stat_result]]:
    """The regular files ``done``'s markers list (relative path, lstat), never a link."""
    out = []
    for marker in done.values():
        for f in marker.files:
            st = _lstat(folder / f.path)
            if st is not None and stat.S_ISREG(st.st_mode):
                out.append((f.path, st))
    return out


def _with_sharing(statuses: list[CacheStatus], stages: Sequence[str]) -> list[CacheStatus]:
    """``statuses`` with what each cache shares with the others (same inodes)."""
    owners: dict[tuple[int, int], set[Path]] = {}
    files: dict[Path, list[tuple[str, os.stat_result]]] = {}
    for st in statuses:
        done = _valid_markers(st.path, list(stages), st.fingerprint or "")[0]
        files[st.path] = _listed_regular(st.path, done)
        for _, f in files[st.path]:
            owners.setdefault((f.st_dev, f.st_ino), set()).add(st.path)
    out = []
    for st in statuses:
        shared = [(rel, f) for rel, f in files[st.path] if len(owners[(f.st_dev, f.st_ino)]) > 1]
        others = {o for _, f in shared for o in owners[(f.st_dev, f.st_ino)]} - {st.path}
        # <stage folder>/parts/<part>/...: the parts a cache is assembled from.
        parts = {
            "/".join(rel.split("/")[:3]) for rel, _ in shared if rel.split("/")[1:2] == ["parts"]
        }
        out.append(
            dataclasses.replace(
                st,
                shared_files=len(shared),
                shared_bytes=sum(f.st_size for _, f in shared),
                shared_parts=len(parts),
                shared_with=tuple(sorted(o.name for o in others)),
            )
        )
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoredUnit:
    """One unit of a store (the module docstring).

    Attributes:
        status: its :class:`CacheStatus` (its one stage: the name's prefix).
        in_use: complete and in use (a file linked elsewhere, or named by a unit in use).
        links: the most links any of its files has besides its own (the caches that
            hold it, while it is in the store).
        unfinished: its marker was never published (a build of it started, and is
            running or died).
        retired: its marker was published, then retired as damaged (moved aside to
            ``<stage>.json.retired-<id>`` by a build that found its files damaged or
            missing: :func:`dist.coordinator.retire_damaged`,
            :func:`dist.coordinator.retire_marker`) and none is published now: the next
            build that needs the unit makes it again (:func:`clean` removes what is
            left of it meanwhile).
        builder: for an unfinished or retired unit, ``"live"`` (its state is
            ``building``: the lease's heartbeat moved, or was not watched); for an
            unfinished one otherwise ``"abandoned"`` (no lease, or a dead one:
            :func:`clean` removes it); None for a published one or a retired one that
            no build is making again.
        uses: the units of the store its valid marker names in ``uses`` (the units it
            was made from), in the marker's order.
    """

    status: CacheStatus
    in_use: bool
    links: int
    unfinished: bool = False
    retired: bool = False
    builder: str | None = None
    uses: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.status.as_dict(),
            "in_use": self.in_use,
            "links": self.links,
            "unfinished": self.unfinished,
            "retired": self.retired,
            "builder": self.builder,
            "uses": list(self.uses),
        }


def list_store(
    store: str | os.PathLike[str],
    *,
    observe_s: float = 0.0,
    going: Mapping[tuple[int, int], int] | None = None,
) -> list[StoredUnit]:
    """The units of ``store`` (folders ``<stage>-<id>`` with the project's mark; anything
    else is left alone) and whether each is in use, sorted by name; [] if ``store`` does
    not exist. Reads only. ``going``: links to each ``(st_dev, st_ino)`` that are about
    to be removed (a dry run's caches), not counted as uses."""
    if observe_s < 0:
        raise ValueError(f"observe_s must be >= 0, got {observe_s}")
    store = Path(store)
    if not store.is_dir():
        return []
    marks = {p: _mark(p) for p in sorted(store.iterdir())}
    units = [p for p, fp in marks.items() if fp is not None and "-" in p.name]
    live = _observed(units, observe_s)
    found: dict[str, tuple[CacheStatus, int, list[str]]] = {}
    for u in units:
        stage = u.name.split("-", 1)[0]
        st = _status(u, marks[u] or "", [stage], live[u])
        done = _valid_markers(u, [stage], marks[u] or "")[0]
        links = max(
            (
                f.st_nlink - 1 - (going or {}).get((f.st_dev, f.st_ino), 0)
                for _, f in _listed_regular(u, done)
            ),
            default=0,
        )
        uses = done[stage].info.get("uses", []) if stage in done else []
        found[u.name] = (st, links, [n for n in uses if isinstance(n, str)])
    in_use = {n for n, (st, links, _) in found.items() if st.state is CacheState.COMPLETE and links}
    grew = True
    while grew:  # what a unit in use names is in use too (an embedding names its join...)
        more = {n for u in in_use for n in found[u][2] if n in found} - in_use
        grew = bool(more)
        in_use |= more
    out = []
    for name, (st, links, uses) in found.items():
        # No marker at all (a malformed one makes the unit corrupt): never published,
        # or retired as damaged (its marker moved aside: the next build makes it again).
        stage = name.split("-", 1)[0]
        unmarked = not os.path.lexists(store / name / marker_name(stage))
        retired = unmarked and any(
            is_retired_marker(n) and n.startswith(f"{marker_name(stage)}.")
            for n in os.listdir(store / name)
        )
        unfinished = unmarked and not retired
        builder = None
        if st.state is CacheState.BUILDING and unmarked:  # _status's liveness rule
            builder = "live"
        elif unfinished:
            builder = "abandoned"
        out.append(
            StoredUnit(
                status=st,
                in_use=name in in_use,
                links=links,
                unfinished=unfinished,
                retired=retired,
                builder=builder,
                uses=tuple(dict.fromkeys(n for n in uses if n in found)),
            )
        )
    return out


#: How many ``uses`` steps :func:`_named_by` follows from a unit (the store's chain is
#: 3 long: embed -> tokens -> text -> join; read from files on disk, so bounded).
_USES_DEPTH = 8


def _named_by(units: Sequence[StoredUnit], roots: Sequence[str]) -> dict[str, str]:
    """The units that ``roots`` name in ``uses``, directly or through each other (at
    most :data:`_USES_DEPTH` steps; a cycle ends where it comes back), each with the
    root it was reached from: ``{unit name: root name}``, the roots not included."""
    uses = {u.status.path.name: u.uses for u in units}
    out: dict[str, str] = {}
    for root in roots:
        seen, level = {root}, [root]
        for _ in range(_USES_DEPTH):
            level = [n for u in level for n in uses.get(u, ()) if n not in seen]
            if not level:
                break
            seen.update(level)
            for n in level:
                out.setdefault(n, root)
    return {n: r for n, r in out.items() if n not in roots}


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkFolder:
    """One marked work folder (the module docstring).

    Attributes:
        path: the folder.
        cache: the cache folder (under the root) it works for.
        fingerprint: that cache's fingerprint.
        state: ``"live"`` (the cache's lease is held: its heartbeat moved, or was not
            watched) or ``"abandoned"`` (no lease, a dead one, or an interrupted removal).
        size_bytes: bytes on disk under it.
        age_s: seconds since its newest entry changed (display only).
        owner_host, owner_pid, owner_lease: who wrote the mark.
        lease_id, lease_counter: the cache's lease and heartbeat when looked at (clean
            removes nothing if they changed since).
        foreign: entries the mark does not declare (never removed).
    """

    path: Path
    cache: str
    fingerprint: str
    state: str
    size_bytes: int = 0
    age_s: float = 0.0
    owner_host: str = ""
    owner_pid: int = 0
    owner_lease: str = ""
    lease_id: str | None = None
    lease_counter: int | None = None
    foreign: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(path=str(self.path), foreign=list(self.foreign))
        return d


def list_work(
    root: str | os.PathLike[str], where: str, *, observe_s: float = 0.0
) -> list[WorkFolder]:
    """The marked work folders in ``root/where`` (folders without the mark, and
    everything else there, are not looked at), sorted by name; [] if there is none.
    Reads only.

    Args:
        root: the cache root (the caches the marks name are its folders).
        where: a dot-folder of ``root`` (``.staging``); a symlink is never followed.
        observe_s: watch the caches' leases this long (:func:`list_caches`); 0 reports
            a lease whose holder did not provably exit as live.
    """
    if observe_s < 0:
        raise ValueError(f"observe_s must be >= 0, got {observe_s}")
    root = Path(root)
    folder = root / where
    st = _lstat(folder)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return []
    found = []
    for p in sorted(folder.iterdir()):
        inner = parse_trash_name(p.name)
        mark = work_mark(p, name=inner) if inner is not None else work_mark(p)
        if mark is not None:
            found.append((p, mark, inner is not None))
    caches = {root / m.cache for _, m, _ in found}
    # A cache named by a mark proves liveness only when it is a cache of ours.
    lease_of = {c: (_lease_key(c) if _mark(c) else None) for c in caches}
    live = _observed([c for c in caches if lease_of[c] is not None], observe_s)
    out = []
    for p, mark, trash in found:
        cache = root / mark.cache
        key = lease_of[cache]
        held = key is not None and live.get(cache) is not False and not trash
        size, age = _size_and_age(p)
        try:
            names = sorted(os.listdir(p))
        except OSError:
            names = []
        declared = {WORK_MARK, *mark.entries}
        out.append(
            WorkFolder(
                path=p,
                cache=mark.cache,
                fingerprint=mark.fingerprint,
                state="live" if held else "abandoned",
                size_bytes=size,
                age_s=age,
                owner_host=mark.host,
                owner_pid=mark.pid,
                owner_lease=mark.lease_id,
                lease_id=key[0] if key else None,
                lease_counter=key[1] if key else None,
                foreign=tuple(
                    n for n in names if n not in declared and parse_trash_name(n) not in declared
                ),
            )  # fmt: skip
        )
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobFolder:
    """One job folder (the module docstring; :class:`dist.agreement.JobFolderState`).

    Attributes:
        path: the folder.
        state: ``"finished"``, ``"abandoned"`` or ``"live"``.
        rounds: agreement rounds posted there.
        members: ``"host/pid"`` of every rank that posted.
        foreign: entries that are not the agreement's (never removed; the folder stays).
        size_bytes: bytes under it.
    """

    path: Path
    state: str
    rounds: int
    members: tuple[str, ...]
    foreign: tuple[str, ...]
    size_bytes: int

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(path=str(self.path), members=list(self.members), foreign=list(self.foreign))
        return d


def _job_folder(path: Path) -> JobFolder | None:
    st = _lstat(path)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return None  # never through a link
    found = job_folder_state(path)
    if found is None:
        return None
    return JobFolder(
        path=path, state=found.state, rounds=found.rounds,
        members=tuple(f"{shown(h)}/{p}" for h, p in found.members),
        foreign=found.foreign, size_bytes=_size_and_age(path)[0],
    )  # fmt: skip


def list_jobs(root: str | os.PathLike[str], where: str) -> list[JobFolder]:
    """The job folders in ``root/where`` (folders holding the ranks' agreement posts;
    anything else there is not looked at), sorted by name; [] if there is none. Reads
    only."""
    folder = Path(root) / where
    st = _lstat(folder)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return []
    out = []
    for p in sorted(folder.iterdir()):
        job = _job_folder(p)
        if job is not None:
            out.append(job)
    return out


def linked_by(unit: str | os.PathLike[str], folders: Sequence[Path]) -> list[Path]:
    """The ``folders`` (caches) holding a hard link to one of the regular files of
    ``unit`` (a stored unit: what a damaged unit's damage reaches)."""
    inodes = {(st.st_dev, st.st_ino) for st in _regular_files(Path(unit))}
    return [f for f in folders if any((st.st_dev, st.st_ino) in inodes for st in _regular_files(f))]


def _looks_like_cache(path: Path) -> bool:
    name = path.name
    return "-" in name and len(name.rsplit("-", 1)[1]) == 16


def ignored_entries(
    root: str | os.PathLike[str], *, own: Collection[str] = ()
) -> list[tuple[Path, str]]:
    """Entries of ``root`` that status and clean pass over and a person may want to know
    of: symlinks (never followed), folders named like a cache without the project's mark,
    folders holding an identity file of another fingerprint, trash of an interrupted
    removal (and folders only named like it), and a symlink or file in the place of one
    of the folders the project keeps in a root (``own``: its names), which builds refuse.
    Plain user folders are not listed. Reads only."""
    root = Path(root)
    out: list[tuple[Path, str]] = []
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return out
    for p in entries:
        st = _lstat(p)
        if st is None:
            continue
        inner = parse_trash_name(p.name)
        if inner is not None and p.name.startswith("."):
            # Trash only on proof (clean removes it): a link, or a cache's mark in it.
            if stat.S_ISLNK(st.st_mode) or _mark(p, name=inner):
                out.append((p, "trash of an interrupted removal"))
            else:
                out.append((p, "named like trash but carries no hf_pipeline mark: left as it is"))
        elif p.name in own and not stat.S_ISDIR(st.st_mode):
            what = "symbolic link" if stat.S_ISLNK(st.st_mode) else "file"
            out.append((p, f"a {what} where hf_pipeline keeps a folder of its own: builds on "
                           "this root refuse it; remove it (never followed, left as it is)"))  # fmt: skip
        elif p.name.startswith("."):
            continue
        elif stat.S_ISLNK(st.st_mode):
            out.append((p, "a symbolic link: never followed, left as it is"))
        elif stat.S_ISDIR(st.st_mode) and (why := _identity_mismatch(p)) is not None:
            out.append((p, why))
        elif stat.S_ISDIR(st.st_mode) and _looks_like_cache(p) and _mark(p) is None:
            out.append((p, "named like a cache but without the hf_pipeline mark: left as it is"))
    return out


def verify(cache_dir: str | os.PathLike[str], stages: Sequence[str] = DEFAULT_STAGES) -> list[str]:
    """Re-check every stage marker, file sizes and checksums; [] means the cache is sound.

    :func:`verify_cache`'s problems (every file read whole).

    Args:
        cache_dir: one cache folder.
        stages: stage names in build order.

    Returns:
        Problems, one line each (``"filtered: listed file ... checksum mismatch"``,
        ``"converted.<id>/rows/cache-1.arrow: not listed by any marker"``).
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
        shared: files checked against a digest this run made already (the same inode,
            unchanged, read for another cache or stored part: :func:`verify_cache`'s
            ``memo``), not read again.
    """

    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    shared: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0


def verify_cache(
    cache_dir: str | os.PathLike[str],
    stages: Sequence[str] = DEFAULT_STAGES,
    *,
    workers: int | None = None,
    progress: bool = False,
    record: bool = False,
    memo: dict[tuple[int, ...], tuple[int, str]] | None = None,
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
        memo: the whole-file digests of one verify run, by each file's inode and
            ``stat`` (device, inode, size, mtime, ctime): a file whose exact ``stat`` is
            there (a hard link of one read for another cache or stored part, unchanged
            since: a write moves its mtime and ctime) is not read again. The caches of a
            root and its stored parts share their files: each was read twice.

    Returns:
        A :class:`VerifyReport`.
    """
    cache = Path(cache_dir)
    stages = list(stages)
    fingerprint = _mark(cache) or ""
    done, problems = _valid_markers(cache, stages, fingerprint, verify=True, missing=True)
    if len(done) < len(stages):
        # Why stages are missing, first: "converted: missing" alone hid a failed build
        # (the record --status shows).
        failed = _failures(cache, _failure_names(cache))
        problems[:0] = [f"build failed: {what} {where}" for where, what in failed]
    # Files that something else wrote into a published stage (a `datasets` call).
    problems += [f"{rel}: not listed by any marker" for rel in _unlisted(cache, done)]
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
    # A stage whose marker reads but whose files differ: each file that differs is
    # named, and every file it lists is still read whole (its marker's first problem
    # alone used to hide the others, and no file of the stage was hashed).
    named: dict[str, set[str | None]] = {}  # per stage, the files named (not twice)
    for stage in stages:
        marker, _ = parse_marker(cache / marker_name(stage), fingerprint=fingerprint, stage=stage)
        if stage in done or marker is None:
            continue
        found = file_problems(marker, cache, verify=True)
        if found:
            at = next(
                (i for i, p in enumerate(problems) if p.split(": ", 1)[0] == stage),
                len(problems),  # (changed since it was checked: appended)
            )
            # its one line ("... (+1 more)") spelled out
            problems[at : at + 1] = [f"{stage}: {line}" for line in found.values()]
            named[stage] = set(found)
        if marker.schema_version >= 2:
            jobs += [(stage, e) for e in marker.files if _inside(cache, e.path)]
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
            if bar is not None:  # advance is passed only with a bar
                bar.update(n)

    read = files = shared = 0
    t0 = time.monotonic()
    try:
        paths = [cache / entry.path for _, entry in jobs]
        keys = [_memo_key(p) if memo is not None else None for p in paths]
        known = {i for i, k in enumerate(keys) if k is not None and memo is not None and k in memo}
        if bar is not None and known:
            bar.total = total - sum(jobs[i][1].size for i in known)
        todo = [p for i, p in enumerate(paths) if i not in known]
        sizes = [jobs[i][1].size for i in range(len(paths)) if i not in known]
        hashed = hash_files(
            todo, workers=workers, on_bytes=advance if bar else None, expected_sizes=sizes
        )
        for i, (stage, entry) in enumerate(jobs):
            key = keys[i]
            digest: str | OSError
            if i in known:
                assert memo is not None and key is not None
                size, digest = memo[key]
                shared += 1
            else:
                _, size, digest = next(hashed)
                read += size if digest != "" else 0  # "": larger than listed, not read
                files += not isinstance(digest, OSError)
                if memo is not None and key is not None and isinstance(digest, str):
                    memo[key] = (size, digest)
            if entry.path in named.get(stage, ()):
                continue  # named by its size or first/last MiB already
            why = hashed_problem(
                size, digest, expected_size=entry.size, expected=entry.whole_checksum
            )
            if why is None:
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
        files=files,
        bytes=read,
        seconds=seconds,
        shared=shared,
    )


def _memo_key(path: Path) -> tuple[int, ...] | None:
    """A regular file's identity for :func:`verify_cache`'s ``memo`` (None: not one)."""
    st = _lstat(path)
    if st is None or not stat.S_ISREG(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _inside(cache: Path, relpath: str) -> bool:
    """Whether a path listed by a marker that failed its checks is safe to read: under
    ``cache``, no symlink on the way (:func:`dist.safepath.join_under`)."""
    try:
        join_under(cache, relpath)
    except (UnsafePathError, OSError):
        return False
    return True


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


#: How :func:`verify_findings` starts each line (a cache's problems say so).
_VERIFY_FOUND = "--verify found: "


def verify_findings(cache: str | os.PathLike[str], done: Mapping[str, Marker]) -> list[str]:
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
        f"{_VERIFY_FOUND}{p}"
        for p in problems
        if isinstance(p, str) and p.split(": ", 1)[0] in current
    ]


def _open_folder(root: Path, folder: Path) -> int:
    """``folder`` (``root`` or a folder below it) opened as a descriptor: ``root`` as
    the user gave it (it may be a symlink), each level below it with ``O_NOFOLLOW``, so
    a folder swapped for a link since it was looked at is never followed (``ELOOP``).

    Raises:
        OSError: a level is a link (``ELOOP``), not a folder, or missing.
        ValueError: ``folder`` is not ``root`` or below it.
    """
    parts = folder.relative_to(root).parts
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def _rmtree_errors(
    folder: Path, parent_fd: int, expect: os.stat_result, stages: Sequence[str] | None = None
) -> list[str]:
    """Delete ``folder`` (an entry of the folder open as ``parent_fd``, which must be
    the folder ``expect`` describes: one swapped meanwhile is left); the identity file
    and markers last, so an interrupted removal is still known as a cache (and the
    next ``clean`` finishes it). With ``stages`` (``folder`` is a cache) only the
    entries the project wrote (:func:`_ours`): the rest, and so ``folder``, stay.
    Every step is relative to the open folder (:func:`dist.safepath.remove_tree_at`):
    a symlink is unlinked, never followed, and a folder swapped for one while this runs
    takes nothing outside with it. Returns what could not be removed."""
    swapped = f"{folder}: no longer the folder renamed there (swapped meanwhile), left as it is"
    try:
        fd = os.open(folder.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as e:
        # A symlink (or a file) put in its place since the rename: never followed.
        return [swapped if e.errno in (errno.ELOOP, errno.ENOTDIR) else f"{folder}: {e}"]
    errors: list[str] = []
    try:
        if not os.path.samestat(expect, os.fstat(fd)):
            return [swapped]
        try:
            names = os.listdir(fd)
        except OSError as e:
            return [f"{folder}: {e}"]
        foreign = [] if stages is None else sorted(_foreign_at(fd, names, stages))
        if foreign:
            errors.append(
                f"{folder}: kept, it holds what hf_pipeline did not write: "
                f"{_shown_foreign(folder, foreign)}"
            )
        for name in sorted(names, key=lambda n: (n == IDENTITY_FILE, n.endswith(".json"))):
            if name not in foreign:
                remove_tree_at(fd, name, folder, errors)
    finally:
        os.close(fd)
    if foreign:
        return errors
    try:
        os.rmdir(folder.name, dir_fd=parent_fd)
    except OSError as e:
        errors.append(f"{folder}: {e}")
    return errors


def _foreign_at(fd: int, names: Sequence[str], stages: Sequence[str]) -> list[str]:
    """:func:`_foreign` of the folder open as ``fd`` (its ``names``)."""
    out = []
    for name in names:
        try:
            link = stat.S_ISLNK(os.lstat(name, dir_fd=fd).st_mode)
        except OSError:
            continue  # gone
        inner = parse_trash_name(name) if link else name
        if inner is None or not is_project_entry(inner, stages):
            out.append(name)
    return out


def _remove(root: Path, path: Path, stages: Sequence[str] | None = None) -> list[str]:
    """Remove ``path`` (``root`` or below it); what could not be removed, one line each
    ([] when all went).

    A folder is renamed first so nobody ever sees (or resumes from) a half-deleted one;
    a symlink is only ever unlinked itself. With ``stages`` (``path`` is a cache whose
    every entry the project wrote when it was looked at) only the project's entries
    are deleted (:func:`_rmtree_errors`). Every step is relative to ``path``'s folder,
    opened level by level from ``root`` without following a link (:func:`_open_folder`):
    a folder of the root swapped for a symlink after it was judged (someone who can
    write in a shared root) makes this leave it, never remove through it.
    """
    try:
        pfd = _open_folder(root, path.parent)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        return [f"{path}: {path.parent} cannot be opened as a folder of the root ({e})"]
    try:
        try:
            st = os.lstat(path.name, dir_fd=pfd)
        except FileNotFoundError:
            return []
        except OSError as e:
            return [f"{path}: {e}"]
        if not stat.S_ISDIR(st.st_mode):
            try:
                os.unlink(path.name, dir_fd=pfd)
            except FileNotFoundError:
                pass
            except OSError as e:
                return [f"{path}: {e}"]
            return []
        trash = path.with_name(trash_name(path.name))
        try:
            os.rename(path.name, trash.name, src_dir_fd=pfd, dst_dir_fd=pfd)
        except FileNotFoundError:
            return []
        except OSError as e:
            return [f"{path}: {e}"]
        return _rmtree_errors(trash, pfd, st, stages)
    finally:
        os.close(pfd)


def _complete_targets(
    cache: Path, status: CacheStatus, stages: Sequence[str]
) -> tuple[list[Path], list[tuple[Path, str]]]:
    """What ``clean`` drops from a cache it keeps, and the links it leaves (reported)."""
    done = _valid_markers(cache, list(stages), status.fingerprint or "")[0]
    names = _leftovers(cache, done, stages) + [
        n for n in sorted(os.listdir(cache)) if is_bookkeeping(n)
    ]
    targets, left = [], []
    for name in names:
        path = cache / name
        if _is_link(path) and parse_trash_name(name) is None:
            left.append((path, "a symbolic link: never followed, left as it is"))
        elif not _ours(cache, name, stages):
            left.append((path, "named like a leftover but not hf_pipeline's: left as it is"))
        else:
            targets.append(path)
    if status.state is CacheState.COMPLETE:
        # Written into a published stage by something else: regular files only.
        for rel in _unlisted(cache, done):
            st = _lstat(cache / rel)
            if st is not None and stat.S_ISREG(st.st_mode):
                targets.append(cache / rel)
            else:
                left.append((cache / rel, "not a regular file: left as it is"))
    return targets, left


def clean(
    root: str | os.PathLike[str],
    *,
    dry_run: bool = True,
    stages: Sequence[str] = DEFAULT_STAGES,
    observe_s: float = 5.0,
    stores: Sequence[str] = (),
    work: Sequence[str] = (),
    jobs: Sequence[str] = (),
    own: Collection[str] = (),
) -> CleanReport:
    """Remove stale, corrupt and failed caches, and leftovers inside complete ones; then
    the units of ``stores`` that no cache uses any more (:func:`list_store`).

    Only folders carrying the project's mark (:func:`dist.layout.cache_mark`) are caches;
    nothing is reached through a symlink (see the module docstring). A cache whose lease
    heartbeat moves during the ``observe_s`` window is live and never touched; one whose
    lease changed between the observation and the removal is skipped too. Still, run it
    when no job is *starting* on ``root``: a builder that claims a stale cache in the
    instant after our last look would lose its folder (and fail). While any cache of
    ``root`` is being built, the stores' complete units that no cache uses are kept (the
    live build may link them as its stages publish). So are the sound units whose only
    users were caches removed by this call as corrupt by ``verify``'s record, and the
    sound units that the units of those caches name in their markers' ``uses``,
    transitively (a token-ids unit, which no cache links: an embedding names it); a
    rebuild of those caches reuses them, and the next call removes them if still
    unused.

    Args:
        root: the folder holding one sub-folder per cache.
        dry_run: only report what would be removed.
        stages: stage names in build order.
        observe_s: liveness observation window (> the builders' heartbeat interval).
        stores: folders of ``root`` that are stores (the module docstring); cleaned
            after the caches, so that a cache removed now frees its units at once.
        work: dot-folders of ``root`` holding work folders (:func:`list_work`): the
            abandoned ones are removed (only what their mark declares).
        own: the names of the folders the project keeps in ``root``: a symlink or file
            in the place of one is reported (:func:`ignored_entries`), never followed.
        jobs: dot-folders of ``root`` holding job folders (:func:`list_jobs`): those
            finished or abandoned, holding nothing else, are removed.

    Returns:
        A :class:`CleanReport`.
    """
    if observe_s <= 0:
        raise ValueError(f"observe_s must be > 0, got {observe_s}")
    removed: list[Path] = []
    left: list[tuple[Path, str]] = []
    # A dry run removes nothing, so the links of what it would remove still count as
    # uses of the stored units: counted here, discounted in list_store.
    going: dict[tuple[int, int], int] = {}
    # The files of the caches removed now that `verify` found damaged files in: a unit of
    # the stores whose only users they were is sound (a damaged one is corrupt itself)
    # and a rebuild of those caches reuses it; removing it with them made a rebuild read
    # every input again for one damaged part (outside tester). A cache corrupt for
    # another reason (its own marker) takes the units only it used with it.
    of_corrupt: set[tuple[int, int]] = set()
    # What happens to the rest of a folder kept for what it holds that is not ours.
    rest = "(the rest of it would be removed)" if dry_run else "(the rest of it removed)"

    def drop(target: Path, stages_of: Sequence[str] | None = None) -> None:
        if dry_run:
            for st in _regular_files(target):
                going[(st.st_dev, st.st_ino)] = going.get((st.st_dev, st.st_ino), 0) + 1
        errors = [] if dry_run else _remove(Path(root), target, stages_of)
        if errors:
            more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
            left.append((target, f"could not remove all of it: {errors[0]}{more}"))
        else:
            removed.append(target)

    def drop_cache(folder: Path, stages_of: Sequence[str]) -> None:
        """Remove a cache (or its trash): whole when every entry is one the project
        wrote (:func:`_ours`); else only those, its markers first (nobody resumes from
        a half-removed stage) and not its identity file (it stays a cache of ours:
        the next clean reports it again), and the folder stays with what it holds."""
        foreign = _foreign(folder, stages_of)
        if not foreign:
            drop(folder, stages_of)
            return
        markers = {marker_name(s) for s in stages_of}
        ours = [n for n in sorted(os.listdir(folder)) if n not in foreign and n != IDENTITY_FILE]
        for name in sorted(ours, key=lambda n: n not in markers):
            drop(folder / name)
        left.append((
            folder, f"kept: it holds what hf_pipeline did not write: "
            f"{_shown_foreign(folder, foreign)} {rest}",
        ))  # fmt: skip

    # A cache being built links its units only when its stages publish: until then
    # the units it made (or found) are used by no cache, and removing them would fail
    # it. While one is live, unused complete units stay.
    building: list[Path] = []
    for status in list_caches(root, stages=stages, observe_s=observe_s):
        if status.state is CacheState.BUILDING:
            building.append(status.path)
            continue
        cache = status.path
        if _lease_key(cache) != (
            None if status.lease_id is None else (status.lease_id, status.heartbeat_counter)
        ):
            continue  # somebody claimed or beat since we looked
        if status.state in _REMOVABLE:
            if status.state is CacheState.CORRUPT and any(
                p.startswith(_VERIFY_FOUND) for p in status.problems
            ):  # damaged files, which may be a stored part's: see of_corrupt
                of_corrupt.update((st.st_dev, st.st_ino) for st in _regular_files(cache))
            drop_cache(cache, stages)
            continue
        # Complete or resumable: keep, but drop what dead builders (and others) left.
        targets, links = _complete_targets(cache, status, stages)
        left += links
        for target in targets:
            drop(target)
    for path, why in ignored_entries(root, own=[n for n in own if n not in stores]):
        inner = parse_trash_name(path.name)
        if inner is not None and _is_link(path):
            drop(path)  # an earlier run's trash link: unlinked, never followed
        elif inner is not None and _mark(path, name=inner):
            drop_cache(path, stages)  # an earlier run's trash of a cache
        else:
            left.append((path, why))
    for name in work:
        for wf in list_work(root, name, observe_s=observe_s):
            if wf.state != "abandoned":
                continue
            cache = Path(root) / wf.cache
            if (_lease_key(cache) if _mark(cache) else None) != (
                None if wf.lease_id is None else (wf.lease_id, wf.lease_counter)
            ):
                continue  # a builder claimed its cache since we looked: it may resume here
            if not wf.foreign:
                drop(wf.path)
                continue
            # Its mark stays (the next clean and --status still know the folder).
            for entry in sorted(os.listdir(wf.path)):
                if entry != WORK_MARK and entry not in wf.foreign:
                    drop(wf.path / entry)
            left.append((
                wf.path, f"kept: it holds what hf_pipeline did not write: "
                f"{_shown_foreign(wf.path, wf.foreign)} {rest}",
            ))  # fmt: skip
    for name in jobs:
        for job in list_jobs(root, name):
            if job.state == "live":
                continue
            if job.foreign:
                left.append((
                    job.path, f"kept: it holds what hf_pipeline did not write: "
                    f"{_shown_foreign(job.path, job.foreign)}",
                ))  # fmt: skip
                continue
            if dry_run:
                removed.append(job.path)
                continue
            trash = job.path.with_name(trash_name(job.path.name))
            try:
                # Relative to the jobs' folder opened without following a link: one
                # swapped for a link since it was listed is left, never renamed in.
                pfd = _open_folder(Path(root), job.path.parent)
            except (OSError, ValueError) as e:
                left.append((job.path, f"could not remove all of it: {e}"))
                continue
            try:
                try:
                    os.rename(job.path.name, trash.name, src_dir_fd=pfd, dst_dir_fd=pfd)
                except OSError as e:
                    left.append((job.path, f"could not remove all of it: {e}"))
                    continue
                again = _job_folder(trash)
                if again is None or again.state == "live" or again.foreign:
                    # A rank posted (or a file came) between our look and the rename:
                    # put it back where its job reads it.
                    try:
                        os.rename(trash.name, job.path.name, src_dir_fd=pfd, dst_dir_fd=pfd)
                        left.append((job.path, "changed while we looked: left as it is"))
                    except OSError as e:
                        left.append((trash, f"could not put it back: {e}"))
                    continue
            finally:
                os.close(pfd)
            drop(trash)
            if removed and removed[-1] == trash:
                removed[-1] = job.path
    for name in stores:
        store = Path(root) / name
        if _is_link(store):
            left.append((store, "a symbolic link: never followed, left as it is"))
            continue
        units = list_store(store, observe_s=observe_s, going=going)
        # The units of the corrupt caches removed now (kept if sound, or removed as
        # damaged: the rebuild makes them again from what they name), and the sound
        # units those name: a token-ids unit no cache links (only an embedding's
        # `uses` names it) went with the caches, and a re-embedding tokenized every
        # caption again (outside tester).
        of_theirs = [
            u.status.path.name
            for u in units
            if of_corrupt
            and u.status.state in (CacheState.COMPLETE, CacheState.CORRUPT)
            and any((f.st_dev, f.st_ino) in of_corrupt for f in _regular_files(u.status.path))
        ]
        named = _named_by(units, of_theirs)
        for unit in units:
            st = unit.status
            if st.state is CacheState.BUILDING:
                continue
            if _lease_key(st.path) != (
                None if st.lease_id is None else (st.lease_id, st.heartbeat_counter)
            ):
                continue  # somebody claimed or beat since we looked
            if st.state is CacheState.COMPLETE and not unit.in_use and building:
                left.append((
                    st.path, f"kept: used by no cache, but {building[0].name} is being built "
                    "on this root and may link it; run --clean again once it is done",
                ))  # fmt: skip
                continue
            if st.state is CacheState.COMPLETE and not unit.in_use and st.path.name in of_theirs:
                left.append((
                    st.path, "kept: sound, used only by corrupt caches removed now; a "
                    "rebuild of them reuses it (a later --clean removes it if still unused)",
                ))  # fmt: skip
                continue
            if st.state is CacheState.COMPLETE and not unit.in_use and st.path.name in named:
                left.append((
                    st.path, f"kept: sound, named by {named[st.path.name]} of the corrupt "
                    "caches removed now; a rebuild of them reuses it (a later --clean "
                    "removes it if still unused)",
                ))  # fmt: skip
                continue
            if st.state in _REMOVABLE or (st.state is CacheState.COMPLETE and not unit.in_use):
                # no cache links its files: nothing reads them any more
                drop_cache(st.path, [st.path.name.split("-", 1)[0]])
            else:  # kept: only what dead builders left in it
                targets, links = _complete_targets(st.path, st, [st.path.name.split("-", 1)[0]])
                left += links
                for target in targets:
                    drop(target)
        for path in sorted(store.iterdir()) if store.is_dir() else []:
            inner = parse_trash_name(path.name)
            if inner is not None and _is_link(path):
                drop(path)  # an interrupted removal of a unit: a link
            elif inner is not None and _mark(path, name=inner):
                drop_cache(path, [inner.split("-", 1)[0]])  # an interrupted removal of a unit
    return CleanReport(removed=tuple(removed), left=tuple(left))
