"""Marker files: atomic JSON write, strict read, validation of the files they list.

A marker says "stage S of the cache with fingerprint F is complete": schema version,
fingerprint, stage, the builder's host/pid/lease id, start and finish times, a
caller-supplied ``info`` dict (row counts...) and every file of the stage (path relative
to the cache folder, size, cheap edge checksum and, from schema 2 on, whole-file checksum).

Readers trust a marker only when it parses, its schema version and fingerprint match and
every listed file exists with its recorded size (``verify=True`` also recomputes the
edge checksums; the whole-file ones are for ``prebuild_cache.py --verify``, see
:mod:`dist.inventory`). Markers of every version in :data:`READABLE_SCHEMA_VERSIONS` are
read: a schema-1 marker simply has no whole-file checksums. Anything else is "absent":
:func:`read_marker` returns None and logs one line on the ``"dist"`` logger saying why.
It never raises on a malformed marker.

All functions here are process- and thread-safe in the sense that a reader can never see
a half-written marker: :func:`publish_marker` creates the marker only if none exists
(temp file, fsync, ``link``: the first publication stands, a later one never overwrites
it); :func:`write_marker` replaces (tests and tools only).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from dist import atomic
from dist.checksums import hash_files, open_regular
from dist.safepath import UnsafePathError, check_name, check_relpath, join_under

__all__ = [
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "loads_finite",
    "read_regular_bytes",
    "READABLE_SCHEMA_VERSIONS",
    "SCHEMA_VERSION",
    "FileEntry",
    "ForeignJSONError",
    "Marker",
    "check_marker",
    "derived_from_problem",
    "describe_files",
    "file_checksum",
    "file_problems",
    "load_json",
    "parse_json",
    "parse_marker",
    "publish_marker",
    "read_json",
    "read_marker",
    "schema_problem",
    "write_marker",
]

logger = logging.getLogger(__name__)

#: Version of the markers written now. 2: every file entry has ``whole_checksum``.
SCHEMA_VERSION = 2
#: Versions read (1: no whole-file checksums; its entries read with ``whole_checksum=""``).
READABLE_SCHEMA_VERSIONS = (1, 2)
_WHOLE_CHECKSUM_HEX = 32  # xxh3_128
_EDGE = 1 << 20  # checksum covers the first and last MiB: catches truncation and torn tails

#: Largest JSON file read from a cache folder or a store (markers, manifests, failure
#: records, heartbeats, reports). Measured: a manifest entry is 216 bytes (path, size,
#: crc32c, sha256), a marker entry ~125; the demo's converted.json is 3 KB (4 files). A
#: cache has about parts x (num_proc + 1) files: COYO-11M over 800 ranks with num_proc=16
#: is ~14k files, a ~3 MB manifest. 64 MiB holds ~300k files: a 20x margin.
MAX_JSON_BYTES = 64 << 20
#: Deepest nesting accepted. Ours are 4 deep (marker -> files -> entry; info -> dict);
#: Python's parser dies of RecursionError near 1000.
MAX_JSON_DEPTH = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One file of a stage.

    Attributes:
        path: POSIX path relative to the cache folder (``"converted/data-00000.arrow"``).
        size: size in bytes.
        checksum: :func:`file_checksum` of the file (size, first and last MiB).
        whole_checksum: :func:`dist.checksums.whole_checksum` of the file (xxh3_128 of
            every byte, hex); "" in a schema-1 marker.
    """

    path: str
    size: int
    checksum: str
    whole_checksum: str = ""

    def __post_init__(self) -> None:
        try:  # it comes from others' markers: never joined to a folder unchecked
            check_relpath(self.path)
        except UnsafePathError as e:
            raise UnsafePathError(
                self.path, f"{e.reason}; a path must be relative inside the cache"
            ) from None
        if self.size < 0:
            raise ValueError(f"size must be >= 0, got {self.size}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Marker:
    """A completed stage. Immutable; compare two markers with ``==``.

    Attributes:
        fingerprint: identity of the cache.
        stage: stage name (``"converted"``).
        directory: the published stage folder, relative to the cache folder.
        host, pid, lease_id: who built it.
        started_at, finished_at: wall-clock seconds since the epoch (informational only).
        info: caller-supplied JSON-able data (row counts...).
        files: the stage's files.
        inputs: the folders of the earlier stages this one was derived from, by stage
            name (a later stage is valid only over exactly those).
        schema_version: marker format version.
    """

    fingerprint: str
    stage: str
    directory: str
    host: str
    pid: int
    lease_id: str
    started_at: float
    finished_at: float
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    files: tuple[FileEntry, ...] = ()
    inputs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        # Stage folders are one level under the cache folder: a directory that is a path
        # (or a foreign marker's "../x") is not a folder this cache owns.
        check_name(self.directory)
        for folder in self.inputs.values():
            check_name(folder)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["info"] = dict(self.info)
        d["inputs"] = dict(self.inputs)
        d["files"] = [dataclasses.asdict(f) for f in self.files]
        if self.schema_version < 2:  # written as schema 1 wrote it
            for f in d["files"]:
                del f["whole_checksum"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Marker:
        """Build from parsed JSON. Raises (KeyError, TypeError, ValueError) if malformed."""
        if not isinstance(d, Mapping):
            raise TypeError(f"marker must be a JSON object, got {type(d).__name__}")
        version = int(d["schema_version"])
        files = tuple(
            FileEntry(
                path=str(f["path"]),
                size=int(f["size"]),
                checksum=str(f["checksum"]),
                whole_checksum=_whole_checksum_field(f, version),
            )
            for f in d["files"]
        )
        info = d.get("info", {})
        if not isinstance(info, Mapping):
            raise TypeError("info must be a JSON object")
        inputs = d.get("inputs", {})
        if not isinstance(inputs, Mapping):
            raise TypeError("inputs must be a JSON object")
        return cls(
            fingerprint=str(d["fingerprint"]),
            stage=str(d["stage"]),
            directory=str(d["directory"]),
            host=str(d["host"]),
            pid=int(d["pid"]),
            lease_id=str(d["lease_id"]),
            started_at=float(d["started_at"]),
            finished_at=float(d["finished_at"]),
            info=dict(info),
            files=files,
            inputs={str(k): str(v) for k, v in inputs.items()},
            schema_version=version,
        )

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _whole_checksum_field(f: Mapping[str, Any], version: int) -> str:
    """A file entry's ``whole_checksum``: required from schema 2 on, absent before."""
    if version < 2:
        return ""
    value = f["whole_checksum"]
    if not (
        isinstance(value, str)
        and len(value) == _WHOLE_CHECKSUM_HEX
        and all(c in "0123456789abcdef" for c in value)
    ):
        raise ValueError(
            f"whole_checksum of {f.get('path')!r} must be {_WHOLE_CHECKSUM_HEX} lowercase "
            f"hex digits, got {value!r}"
        )
    return value


def schema_problem(raw: Any) -> str | None:
    """Why parsed marker JSON ``raw`` is of a version this code cannot read, or None."""
    version = raw.get("schema_version") if isinstance(raw, Mapping) else None
    if version in READABLE_SCHEMA_VERSIONS and not isinstance(version, bool):
        return None
    readable = " or ".join(map(str, READABLE_SCHEMA_VERSIONS))
    return f"schema version {version!r}, expected {readable}"


def file_checksum(path: str | os.PathLike[str], size: int | None = None) -> str:
    """Cheap checksum: xxh64 over the size, the first MiB and the last MiB.

    Reads at most 2 MiB whatever the file size, so verifying a 100 GB cache is quick;
    it detects truncation, a torn tail and a wrong file, not a flipped bit in the middle.
    """
    fd = open_regular(path)  # a fifo in a listed file's place made verify wait forever
    with os.fdopen(fd, "rb") as f:
        if size is None:
            size = os.fstat(fd).st_size
        h = xxhash.xxh64()
        h.update(str(size).encode())
        h.update(f.read(min(size, _EDGE)))
        if size > _EDGE:
            f.seek(max(size - _EDGE, _EDGE))
            h.update(f.read(_EDGE))
    return h.hexdigest()


def describe_files(
    folder: str | os.PathLike[str],
    *,
    relative_to: str | os.PathLike[str],
    recorded: Mapping[str, FileEntry] | None = None,
) -> tuple[FileEntry, ...]:
    """List every regular file under ``folder`` (sorted) with size and checksums.

    Reads every file whole (the whole-file checksum), several at a time: called at
    publication, right after the stage wrote (and fsynced) them, while they are still in
    the page cache (datasets' writers give no hook to hash as they write).

    Args:
        folder: the stage folder to describe.
        relative_to: paths in the result are relative to this folder.
        recorded: entries of files the stage hard-linked from published units, by path
            relative to ``relative_to``, as those units' markers list them: taken as
            they are, not read (a checksum of the bytes on disk now would certify a
            unit damaged since it was published; the record lets ``verify`` find it).

    Raises:
        ValueError: ``folder`` contains a symlink (a cache must be self-contained), or a
            recorded file's size is not the recorded one.
    """
    folder = Path(folder)
    base = Path(relative_to)
    paths = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if p.is_symlink():
                raise ValueError(f"{p}: symlinks are not allowed in a stage folder")
            paths.append(p)
    recorded = recorded or {}
    known = {}
    for p in paths:
        entry = recorded.get(p.relative_to(base).as_posix())
        if entry is not None:
            size = p.stat().st_size
            if size != entry.size:
                raise ValueError(f"{p}: has {size} bytes, but its unit lists {entry.size}")
            known[p] = entry
    entries = dict(known)
    for p, size, whole in hash_files([p for p in paths if p not in known]):
        if isinstance(whole, OSError):
            raise whole
        entries[p] = FileEntry(
            path=p.relative_to(base).as_posix(),
            size=size,
            checksum=file_checksum(p, size),
            whole_checksum=whole,
        )
    return tuple(entries[p] for p in paths)


class ForeignJSONError(ValueError):
    """JSON that others wrote is malformed, larger than :data:`MAX_JSON_BYTES` or nested
    deeper than :data:`MAX_JSON_DEPTH`. ``str()`` is one line, ``"<path>: <reason>"``.

    Attributes:
        path: the file (or URL); empty when built from the message alone (as torch's
            ``DataLoader`` re-raises a worker's exception).
        reason: what is wrong with it.
    """

    def __init__(self, path: str, reason: str | None = None):
        if reason is None:  # the message alone (torch's DataLoader re-raise): path empty
            super().__init__(str(path))
            self.path, self.reason = "", str(path)
            return
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (
            type(self),
            (self.reason,) if self.args[0] == self.reason else (self.path, self.reason),
        )


# A JSON string, escapes included; possessive, so a long string is one linear scan.
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _depth(raw: bytes) -> int:
    """Deepest bracket nesting of ``raw`` outside strings (a cheap pre-scan: Python's
    parser recurses once per level)."""
    depth = deepest = 0
    for b in _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS):
        depth += 1 if b in (0x5B, 0x7B) else -1
        deepest = max(deepest, depth)
    return deepest


#: The largest integer foreign JSON may hold (sizes, times, ids are 64-bit at most): a
#: 400-digit "finished_at" made ``float()`` raise an OverflowError in every command.
_MAX_JSON_INT = 1 << 64


def loads_finite(raw: bytes | str) -> Any:
    """``json.loads`` of what others wrote, refusing ``NaN``, ``Infinity``, numbers
    beyond a float's range (``1e999``) and integers beyond 64 bits with ``ValueError``
    naming where (``published_at: NaN is not a finite number``): Python's json takes
    them as float infinities or big ints, which ``int()`` and ``float()`` then turn into
    an ``OverflowError`` that no reader of a marker, lease or manifest expected (an
    adversarial tester: one ``"pid": Infinity`` in a marker made status, verify, clean,
    build, a pull and a stream crash)."""
    value = json.loads(raw)
    problem = number_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def number_problem(value: Any) -> str | None:
    """Where parsed JSON ``value`` holds a non-finite float or an integer beyond 64 bits,
    and which (``published_at: nan is not a finite number``); None when it holds none."""
    # (item, where): where is (its container's where, its key), spelled out on a refusal.
    todo: list[tuple[Any, Any]] = [(value, None)]
    while todo:
        item, where = todo.pop()
        if isinstance(item, dict):
            todo.extend((v, (where, k)) for k, v in item.items())
        elif isinstance(item, list):
            todo.extend((v, (where, i)) for i, v in enumerate(item))
        elif isinstance(item, float) and not math.isfinite(item):
            return f"{_json_where(where)}: {item} is not a finite number"
        elif isinstance(item, int) and not isinstance(item, bool) and abs(item) > _MAX_JSON_INT:
            return f"{_json_where(where)}: an integer beyond 64 bits"
    return None


def _json_where(where: Any) -> str:
    """``(((None, "a"), 0), "b")`` -> ``a[0].b``, bounded."""
    parts: list[str] = []
    while where is not None:
        where, key = where
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    text = "".join(reversed(parts)).lstrip(".")
    return text[:200] or "the value"


def parse_json(raw: bytes, *, path: str | os.PathLike[str]) -> Any:
    """Parse JSON that others wrote, of at most :data:`MAX_JSON_BYTES` bytes and
    :data:`MAX_JSON_DEPTH` levels.

    Args:
        raw: the bytes.
        path: where they came from (named in the error).

    Raises:
        ForeignJSONError: too large, too deep or malformed.
    """
    if len(raw) > MAX_JSON_BYTES:
        raise ForeignJSONError(str(path), f"larger than {MAX_JSON_BYTES} bytes")
    if _depth(raw) > MAX_JSON_DEPTH:
        raise ForeignJSONError(str(path), f"nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: the pre-scan is a heuristic
        raise ForeignJSONError(str(path), f"malformed JSON ({type(e).__name__}: {e})") from None
    problem = number_problem(value)
    if problem is not None:
        raise ForeignJSONError(str(path), problem)
    return value


def load_json(path: str | os.PathLike[str]) -> Any:
    """Read and parse a JSON file others wrote; reads at most :data:`MAX_JSON_BYTES` + 1
    bytes whatever the file's size.

    Raises:
        OSError: missing or unreadable (``FileNotFoundError`` when missing).
        ForeignJSONError: too large, too deep or malformed.
    """
    raw = read_regular_bytes(path, MAX_JSON_BYTES)
    if raw is None:
        raise ForeignJSONError(str(path), "not a regular file")
    return parse_json(raw, path=path)


def read_regular_bytes(path: str | os.PathLike[str], limit: int) -> bytes | None:
    """At most ``limit`` + 1 bytes of the file at ``path`` (symlinks followed); None when
    it is not a regular file. Opened without blocking: a fifo in a marker's, lease's or
    record's place (others can write the folder) made every command that read it wait
    forever (an adversarial tester: status, verify, clean and build hung).

    Raises:
        OSError: missing or unreadable (``FileNotFoundError`` when missing).
    """
    try:
        fd = open_regular(path)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return None
        raise
    with os.fdopen(fd, "rb") as f:
        return f.read(limit + 1)


def read_json(path: str | os.PathLike[str]) -> Any | None:
    """:func:`load_json`, lenient: None if the file is missing, unreadable, malformed,
    too large or too deep (a malformed file others wrote counts as absent)."""
    try:
        return load_json(path)
    except (OSError, ValueError):
        return None


def _marker_bytes(marker: Marker) -> bytes:
    return json.dumps(marker.to_dict(), sort_keys=True, indent=1).encode("utf-8")


def write_marker(path: str | os.PathLike[str], marker: Marker) -> None:
    """Write ``marker`` atomically to ``path``, replacing any marker there (tools, tests).

    The build protocol never calls this: it publishes with :func:`publish_marker`.
    """
    with atomic.atomic_write(path, "wb") as fh:
        fh.write(_marker_bytes(marker))


def publish_marker(path: str | os.PathLike[str], marker: Marker) -> bool:
    """Create the marker at ``path`` unless one exists: the first publication stands.

    Returns:
        True if this call published ``marker``; False if a marker was already there
        (nothing written; the caller reads and judges the one that is).
    """
    return atomic.create_new(path, _marker_bytes(marker))


def check_marker(
    path: str | os.PathLike[str],
    *,
    fingerprint: str,
    base_dir: str | os.PathLike[str],
    stage: str | None = None,
    verify: bool = False,
) -> tuple[Marker | None, str | None]:
    """Like :func:`read_marker` but silent: returns ``(marker, None)`` or ``(None, why)``."""
    marker, why = parse_marker(path, fingerprint=fingerprint, stage=stage)
    if marker is None:
        return None, why
    problems = list(file_problems(marker, Path(base_dir), verify=verify).values())
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return None, problems[0] + more
    return marker, None


def parse_marker(
    path: str | os.PathLike[str], *, fingerprint: str, stage: str | None = None
) -> tuple[Marker | None, str | None]:
    """The marker at ``path`` if it parses and is of ``fingerprint`` (and ``stage``), its
    files not checked (:func:`file_problems`): ``(marker, None)`` or ``(None, why)``."""
    try:
        parsed = load_json(path)
    except FileNotFoundError:
        return None, "missing"
    except OSError as e:
        return None, f"unreadable ({e.strerror or e})"
    except ForeignJSONError as e:
        return None, e.reason
    if isinstance(parsed, Mapping) and schema_problem(parsed):
        return None, schema_problem(parsed)
    try:
        marker = Marker.from_dict(parsed)
    except (KeyError, TypeError, ValueError) as e:
        return None, f"malformed marker ({type(e).__name__}: {e})"
    if marker.fingerprint != fingerprint:
        return None, f"fingerprint {marker.fingerprint!r}, expected {fingerprint!r}"
    if stage is not None and marker.stage != stage:
        return None, f"stage {marker.stage!r}, expected {stage!r}"
    return marker, None


def derived_from_problem(marker: Marker, earlier: Mapping[str, Marker]) -> str | None:
    """Why ``marker`` does not belong on top of the ``earlier`` published stages, or None.

    A later stage is valid only over exactly the folders it was derived from.
    """
    expected = {name: m.directory for name, m in earlier.items()}
    if dict(marker.inputs) == expected:
        return None
    if not marker.inputs and all(m.directory == name for name, m in earlier.items()):
        return None  # hf_pipeline <= 0.1: fixed folder names, no inputs recorded
    return f"derived from {dict(marker.inputs)}, but the published earlier stages are {expected}"


def file_problems(marker: Marker, base: Path, *, verify: bool) -> dict[str | None, str]:
    """Every problem of ``marker``'s files under ``base``, one line per file, by the
    file's listed path (``None``: the stage folder is missing): a file missing, a path
    that leaves ``base``, a size, and with ``verify`` the first and last MiB
    (:func:`file_checksum`) that differ from the marker."""
    directory = base / marker.directory
    if not directory.is_dir():
        return {None: f"stage folder {marker.directory!r} missing"}
    problems: dict[str | None, str] = {}
    seen: set[Path] = set()
    for entry in marker.files:
        name = f"listed file {entry.path!r}"
        try:
            p = join_under(base, entry.path, checked_dirs=seen)
            size = p.stat().st_size
        except UnsafePathError as e:
            problems[entry.path] = f"{name}: {e.reason}"
            continue
        except OSError:
            problems[entry.path] = f"{name} missing"
            continue
        if size != entry.size:
            problems[entry.path] = f"{name} has {size} bytes, expected {entry.size}"
            continue
        if verify:
            try:
                checksum = file_checksum(p, size)
            except OSError as e:
                problems[entry.path] = f"{name} unreadable ({e})"
                continue
            if checksum != entry.checksum:
                problems[entry.path] = f"{name} checksum mismatch"
    return problems


def read_marker(
    path: str | os.PathLike[str],
    *,
    fingerprint: str,
    base_dir: str | os.PathLike[str],
    stage: str | None = None,
    verify: bool = False,
) -> Marker | None:
    """Read and validate a marker; None (and one log line saying why) if not trusted.

    Args:
        path: the marker file.
        fingerprint: the expected cache identity.
        base_dir: the folder the marker's file paths are relative to (the cache folder).
        stage: if given, the expected stage name.
        verify: also recompute every file's edge checksum (reads up to 2 MiB per file).

    Returns:
        The marker, or None when it is missing, malformed, of another schema version or
        fingerprint, or a listed file is missing, has the wrong size or (``verify``)
        checksum. A missing marker is logged at DEBUG, the others at WARNING.
    """
    marker, why = check_marker(
        path, fingerprint=fingerprint, base_dir=base_dir, stage=stage, verify=verify
    )
    if marker is None:
        level = logging.DEBUG if why == "missing" else logging.WARNING
        logger.log(level, "ignoring marker %s: %s", path, why)
    return marker
