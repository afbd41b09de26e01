"""What lives in a cache folder, and which folders of a cache root are caches.

One place for the naming rules that the protocol (:mod:`dist.coordinator`), the
inventory (:mod:`dist.inventory`) and readers share. A cache folder holds::

    <stage>.json                 marker of a published stage (dist.markers), created once,
                                 never overwritten (create-if-absent)
    <stage>.<lease id>/          the stage folder built under one lease; published when the
                                 marker names it, and then never changed or removed by a
                                 builder (only by ``prebuild_cache.py --clean``)
    <stage>/                     a stage folder published by hf_pipeline <= 0.1 (still read)
    <stage>.json.retired-<id>    a marker found invalid and moved aside by lease <id>
    lease, heartbeat-<id>.json   the builder's lease and heartbeat (dist.lease)
    failed-<id>.json             failure record of a lease whose build raised
    lease.<purpose>-*, *.trash-*, .<name>.<pid>.<rand>.tmp: bookkeeping in flight

    .hf_pipeline-cache.json      identity: {kind, schema_version, fingerprint, host, pid,
                                 created_at}; written (create-if-absent) by the first lease
                                 that claims the folder, before it builds anything

A cache *root* (``$HF_HOME/datasets/hf_pipeline``) holds one folder per cache; anything
else there is a dot-folder (``.staging``, ``.demo-data``, ``.hub_listings``) and is
never a cache. A *work folder* under such a dot-folder (a pull's staging,
``.staging/pull-<fingerprint>/``) is the project's only when it holds :data:`WORK_MARK`,
written first, before anything else in it (:func:`work_mark_bytes`, :func:`work_mark`):
it names the cache the work is for (its lease says whether the work is live), the
writer, and the entries the writer creates there (only those are ever removed).
The root may be shared with other things (``HF_PIPELINE_CACHE`` pointing
at a parent folder), so a folder counts as a cache only on a positive mark the project
wrote (:func:`cache_mark`): a real folder (not a symlink) named ``<name>-<fingerprint>``
that holds the identity file of that fingerprint, or -- for a cache written before the
identity file existed, always named ``<name>-<16 hex>`` -- a stage marker of the
project's schema and that fingerprint, or a lease / failure record of exactly the
project's shape. Names alone
(``lease-agreement.pdf``, ``package.json`` beside ``package/``) never make a cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Sequence
from pathlib import Path

from dist.lease import LEASE_FILE
from dist.markers import SCHEMA_VERSION, Marker, loads_finite

__all__ = [
    "IDENTITY_FILE",
    "StageDir",
    "cache_mark",
    "identity_bytes",
    "identity_fingerprint",
    "VERIFY_RECORD",
    "WORK_MARK",
    "WorkMark",
    "is_bookkeeping",
    "is_cache_folder",
    "is_project_entry",
    "is_retired_marker",
    "marker_name",
    "parse_stage_dir",
    "parse_temp_name",
    "parse_trash_name",
    "retired_marker_name",
    "stage_dir_name",
    "trash_name",
    "visible_folder_names",
    "work_mark",
    "work_mark_bytes",
]

#: The identity file of a cache folder (hidden: scanners of the folder skip it).
IDENTITY_FILE = ".hf_pipeline-cache.json"
_IDENTITY_KIND = "hf_pipeline-cache"
#: Version of the identity file's format.
IDENTITY_SCHEMA = 1
#: The mark of a work folder (module docstring), hidden like the identity file.
WORK_MARK = ".hf_pipeline-work.json"
_WORK_KIND = "hf_pipeline-work"
_WORK_SCHEMA = 1
#: Largest protocol file read to judge a mark (a marker lists every file of a stage:
#: ~150 bytes each); anything bigger is not a mark.
_MAX_MARK_BYTES = 64 << 20

_STAGE = r"[A-Za-z0-9][A-Za-z0-9_]*(?:-[A-Za-z0-9_]+)*"
_STAGE_DIR = re.compile(rf"^(?P<stage>{_STAGE})\.(?P<lease>[0-9a-f]{{16}})$")
_LEGACY_TMP = re.compile(rf"^(?P<stage>{_STAGE})\.tmp-(?P<lease>[0-9A-Za-z]+)$")
_RETIRED = re.compile(rf"^(?P<stage>{_STAGE})\.json\.retired-[0-9a-f]+$")
_LEASE_ID = re.compile(r"^[0-9a-f]{16}$")
_HEARTBEAT = re.compile(r"^heartbeat-[0-9a-f]{16}\.json$")
_FAILED = re.compile(r"^failed-(?P<lease>[0-9a-f]{16})\.json$")
_LEASE_MOVED = re.compile(rf"^{LEASE_FILE}\.(dead|takeover|released)-")
#: ``<name>-<16 hex>``: how hf_pipeline names a cache (``CacheLayout.for_config``).
_PROJECT_NAME = re.compile(r"^[^.].*-[0-9a-f]{16}$")
_TRASH = re.compile(r"^\.?(?P<inner>.+)\.trash-[0-9a-f]{8}$")
#: How :mod:`dist.atomic` names a file while writing it: ``.<name>.<pid>.<12 hex>.tmp``.
_ATOMIC_TMP = re.compile(r"^\.(?P<inner>.+)\.[0-9]+\.[0-9a-f]{12}\.tmp$")
#: The record ``verify`` leaves in a cache whose published files it found damaged
#: (:mod:`dist.inventory`).
VERIFY_RECORD = "corrupt.json"


@dataclasses.dataclass(frozen=True)
class StageDir:
    """A stage folder built under one lease (``converted.0123456789abcdef``)."""

    stage: str
    lease_id: str


def stage_dir_name(stage: str, lease_id: str) -> str:
    """The folder a lease builds ``stage`` in (and which its marker names if it wins)."""
    return f"{stage}.{lease_id}"


def parse_stage_dir(name: str) -> StageDir | None:
    """The stage and lease of a lease's stage folder name (also ``<stage>.tmp-<id>`` of
    hf_pipeline <= 0.1), else None."""
    m = _STAGE_DIR.match(name) or _LEGACY_TMP.match(name)
    return StageDir(m["stage"], m["lease"]) if m else None


def marker_name(stage: str) -> str:
    return f"{stage}.json"


def retired_marker_name(stage: str, lease_id: str) -> str:
    return f"{stage}.json.retired-{lease_id}"


def is_retired_marker(name: str) -> bool:
    return bool(_RETIRED.match(name))


def is_bookkeeping(name: str) -> bool:
    """Whether ``name`` is a lease, heartbeat, failure record or moved lease of a cache."""
    return bool(
        name == LEASE_FILE or _HEARTBEAT.match(name) or _FAILED.match(name)
        or _LEASE_MOVED.match(name)
    )  # fmt: skip


def is_project_entry(name: str, stages: Sequence[str]) -> bool:
    """Whether ``name``, an entry of a cache folder of ``stages``, is one the project
    writes, by the names it gives them: markers (also retired), stage folders (and
    ``<stage>``/``<stage>.tmp-<id>`` of hf_pipeline <= 0.1), lease and heartbeat, failure
    records, the identity file, ``verify``'s record, and files being written
    (:mod:`dist.atomic`) and trash of any of these. What else is there is not ours to
    remove."""
    inner = parse_trash_name(name)
    if inner is not None:
        return is_project_entry(inner, stages)
    tmp = _ATOMIC_TMP.match(name)
    if tmp is not None:
        return is_project_entry(tmp["inner"], stages)
    parsed = parse_stage_dir(name)
    return (
        name in (IDENTITY_FILE, VERIFY_RECORD)
        or name in {marker_name(s) for s in stages}
        or name in stages
        or is_bookkeeping(name)
        or (is_retired_marker(name) and name.split(".json.", 1)[0] in stages)
        or (parsed is not None and parsed.stage in stages)
    )


def parse_temp_name(name: str) -> str | None:
    """The name a :mod:`dist.atomic` write was creating (``.<name>.<pid>.<hex>.tmp``),
    else None."""
    m = _ATOMIC_TMP.match(name)
    return m["inner"] if m else None


def trash_name(name: str) -> str:
    """A fresh hidden name to rename ``name`` to before deleting it (nobody ever sees, or
    resumes from, a half-deleted folder under its real name)."""
    return f".{name}.trash-{secrets.token_hex(4)}"


def parse_trash_name(name: str) -> str | None:
    """The original name of a trash entry (:func:`trash_name`, or the coordinator's
    ``<name>.trash-<hex>``), else None."""
    m = _TRASH.match(name)
    return m["inner"] if m else None


def identity_bytes(fingerprint: str, *, host: str, pid: int) -> bytes:
    """The content of :data:`IDENTITY_FILE` for a cache of ``fingerprint``."""
    record = {
        "kind": _IDENTITY_KIND,
        "schema_version": IDENTITY_SCHEMA,
        "fingerprint": fingerprint,
        "host": host,
        "pid": pid,
        "created_at": time.time(),  # informational
    }
    return json.dumps(record, sort_keys=True, indent=1).encode()


def identity_fingerprint(folder: Path) -> str | None:
    """What the identity file of ``folder`` says: the fingerprint it names, ``""`` when
    it is there but not one the project wrote (a symlink, another format), None when
    there is none. Never raises on what it finds."""
    path = folder / IDENTITY_FILE
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return ""
    d = _read_regular(path, 1 << 16)
    fingerprint = d.get("fingerprint") if isinstance(d, dict) else None
    if isinstance(d, dict) and d.get("kind") == _IDENTITY_KIND and isinstance(fingerprint, str):
        return fingerprint
    return ""


def _read_regular(path: Path, limit: int = _MAX_MARK_BYTES) -> object | None:
    """Parsed JSON of a regular file (not a symlink) of at most ``limit`` bytes, else None."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            parsed: object = loads_finite(f.read(limit + 1))
            return parsed
    except (OSError, ValueError, RecursionError):
        return None


def _names_fingerprint(name: str, fingerprint: object) -> bool:
    """``name`` is ``<something>-<fingerprint>``."""
    return (
        isinstance(fingerprint, str) and bool(fingerprint) and "/" not in fingerprint
        and len(name) > len(fingerprint) + 1 and name.endswith(f"-{fingerprint}")
        and not name.startswith(".")
    )  # fmt: skip


def _legacy_mark(folder: Path, name: str, names: list[str]) -> str | None:
    """The fingerprint of a cache written before the identity file existed, else None."""
    if not _PROJECT_NAME.match(name):
        return None  # the project has always named a cache <name>-<16 hex>: read nothing else
    for n in sorted(names):
        stage = n[: -len(".json")] if n.endswith(".json") else ""
        if not re.fullmatch(_STAGE, stage) or _HEARTBEAT.match(n) or _FAILED.match(n):
            continue
        d = _read_regular(folder / n)
        if not isinstance(d, dict) or d.get("schema_version") != SCHEMA_VERSION:
            continue
        try:
            marker = Marker.from_dict(d)
        except (KeyError, TypeError, ValueError):
            continue
        if marker.stage == stage and _names_fingerprint(name, marker.fingerprint):
            return marker.fingerprint
    fingerprint = name.rsplit("-", 1)[1]
    lease = _read_regular(folder / LEASE_FILE, 4096) if LEASE_FILE in names else None
    if (
        isinstance(lease, dict) and set(lease) == {"lease_id", "host", "pid"}
        and isinstance(lease["lease_id"], str) and _LEASE_ID.match(lease["lease_id"])
        and isinstance(lease["host"], str) and type(lease["pid"]) is int
    ):  # fmt: skip
        return fingerprint
    for n in names:
        m = _FAILED.match(n)
        record = _read_regular(folder / n, 1 << 20) if m else None
        if (
            m is not None and isinstance(record, dict) and record.get("lease_id") == m["lease"]
            and {"host", "pid", "stage", "error_type", "message"} <= set(record)
        ):  # fmt: skip
            return fingerprint
    return None


def visible_folder_names(path: Path, name: str) -> list[str] | None:
    """The entries of ``path`` judged as named ``name``: None when that name is hidden
    (a dot-folder is never a cache or a unit), ``path`` is not a real folder (a symlink
    is never followed) or cannot be listed."""
    try:
        if name.startswith(".") or not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
        return os.listdir(path)
    except OSError:
        return None


def cache_mark(path: Path, *, name: str | None = None) -> str | None:
    """The fingerprint of the cache in ``path`` if the project's mark says it is one.

    A cache is a real folder (never a symlink: nothing here follows one) whose name is
    ``<name>-<fingerprint>`` and which holds :data:`IDENTITY_FILE` of that fingerprint;
    for caches written before it (always named ``<name>-<16 hex>``), a stage marker
    of the project's schema and of that fingerprint, or a lease or failure record of
    exactly the project's shape. Reads at most a few small files; never raises on what it
    finds.

    Args:
        path: a folder directly under a cache root.
        name: judge the folder as if it had this name (a trash folder's original name).

    Returns:
        The fingerprint, or None: not a cache.
    """
    name = path.name if name is None else name
    names = visible_folder_names(path, name)
    if names is None:
        return None
    identity = _read_regular(path / IDENTITY_FILE, 1 << 16) if IDENTITY_FILE in names else None
    if (
        isinstance(identity, dict) and identity.get("kind") == _IDENTITY_KIND
        and identity.get("schema_version") == IDENTITY_SCHEMA
        and _names_fingerprint(name, identity.get("fingerprint"))
    ):  # fmt: skip
        fingerprint: str = identity["fingerprint"]  # a str: _names_fingerprint checked it
        return fingerprint
    return _legacy_mark(path, name, names)


def is_cache_folder(path: Path) -> bool:
    """Whether ``path`` (a folder directly under a cache root) is a cache (:func:`cache_mark`)."""
    return cache_mark(path) is not None


@dataclasses.dataclass(frozen=True)
class WorkMark:
    """What :data:`WORK_MARK` says of a work folder.

    Attributes:
        cache: the cache folder (a name directly under the cache root) the work is for:
            the work is live while that cache's lease is.
        fingerprint: that cache's fingerprint (the work folder's and the cache's names
            end with ``-<fingerprint>``).
        entries: the names the writer creates in the work folder besides the mark.
        lease_id, host, pid: the writer (informational: a later lease of the same
            cache may resume the work).
    """

    cache: str
    fingerprint: str
    entries: tuple[str, ...]
    lease_id: str
    host: str
    pid: int


def work_mark_bytes(
    *, cache: str, fingerprint: str, entries: Sequence[str], lease_id: str, host: str, pid: int
) -> bytes:
    """The content of :data:`WORK_MARK` (see :class:`WorkMark`)."""
    record = {
        "kind": _WORK_KIND,
        "schema_version": _WORK_SCHEMA,
        "cache": cache,
        "fingerprint": fingerprint,
        "entries": sorted(entries),
        "lease_id": lease_id,
        "host": host,
        "pid": pid,
        "created_at": time.time(),  # informational
    }
    return json.dumps(record, sort_keys=True, indent=1).encode()


def _plain_name(name: object) -> bool:
    return (
        isinstance(name, str) and name not in ("", ".", "..", WORK_MARK)
        and "/" not in name and "\\" not in name and "\0" not in name
    )  # fmt: skip


def work_mark(path: Path, *, name: str | None = None) -> WorkMark | None:
    """The mark of the work folder ``path`` (judged as if named ``name``), or None: not
    the project's. The folder must be a real folder named ``<something>-<fingerprint>``
    holding a regular :data:`WORK_MARK` of exactly the project's shape, naming a cache
    ``<name>-<fingerprint>`` and plain entry names. Never raises on what it finds."""
    name = path.name if name is None else name
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
    except OSError:
        return None
    d = _read_regular(path / WORK_MARK, 1 << 16)
    if not isinstance(d, dict) or d.get("kind") != _WORK_KIND:
        return None
    if d.get("schema_version") != _WORK_SCHEMA:
        return None
    fp, cache, entries = d.get("fingerprint"), d.get("cache"), d.get("entries")
    if not (
        isinstance(fp, str) and isinstance(cache, str)
        and _names_fingerprint(name, fp) and _plain_name(cache)
        and _names_fingerprint(cache, fp) and isinstance(entries, list)
        and all(_plain_name(e) for e in entries)
        and isinstance(d.get("lease_id"), str) and isinstance(d.get("host"), str)
        and type(d.get("pid")) is int
    ):  # fmt: skip
        return None
    return WorkMark(
        cache=cache, fingerprint=fp, entries=tuple(entries),
        lease_id=d["lease_id"], host=d["host"], pid=d["pid"],
    )  # fmt: skip
