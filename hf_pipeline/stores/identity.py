"""Content identity of local files: ``xxh3_128:<hex>`` of their bytes, remembered.

A local shard's identity is its content, so a ``touch``, or a copy by a tool that does
not keep mtimes, finds the same cache. Hashing every byte at every start would cost
minutes on a large dataset, so a small index beside the caches
(``<cache root>/.content-index/index.json``) remembers, as git's index does,

    absolute path -> (size, mtime_ns, inode, device, digest, hashed_at_ns, ctime_ns)

and a file is hashed again only when one of its stat fields differs. A path not in the
index is looked up by its inode too: an entry of another path with exactly the fresh
stat (same device, inode, size, mtime and ctime) is the same file, unchanged (a folder
renamed or reached by another path, hard links made before the hashing), and is
remembered under the new path as well. A hard link made after the hashing moves the
inode's ctime (``cp -al``, ``rsync --link-dest`` of a folder already hashed): hashed
again. The ctime is
compared too (as git does): a rewrite in place that puts the mtime back (``touch -r``,
``cp -p`` onto the file, ``rsync -t``) keeps size, mtime and inode, but the kernel moves
the ctime, which no user call can set. The rules:

- The index is input from others (anyone who shares the cache root writes it): it is
  read with :func:`dist.markers.load_json` (size and depth bounded), a file of the
  wrong shape is ignored whole with one warning line, and an entry of the wrong types
  is dropped. A digest is used only for a file whose *fresh* stat has exactly the
  entry's size, mtime_ns, inode, device and ctime_ns. A row written by a release before
  the ctime (six fields) is read, and is a miss: the file is hashed once more and
  remembered with its ctime.
- A file modified within :data:`RACY_NS` of its hashing ("racy", as git calls it) may
  have changed after it was read without its mtime moving on a filesystem with coarse
  timestamps: its digest serves the build that computed it, but the next start hashes
  it once more.
- A file whose stat changed while it was hashed is refused (:class:`SourceError`): the
  data is being written.
- Writes are atomic (:func:`dist.atomic.atomic_write`): the entries on disk are read
  again and merged just before the replace, so two jobs updating it at once lose at
  most an entry (hashed again later), never the file. It holds at most
  :data:`MAX_ENTRIES` entries (the least recently hashed go first).
- A read-only cache root: the index is read if present and never written (a warning).

Hashing runs on threads (:func:`dist.checksums.hash_files`: xxhash and the reads release
the GIL; ``benchmarks/bench_identity.py`` measured threads against processes).

Thread-safe: no shared state outside one :class:`ContentIndex`.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import stat
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dist.atomic import atomic_write
from dist.checksums import ALGORITHM, hash_files
from dist.markers import ForeignJSONError, load_json
from dist.safepath import own_folder
from hf_pipeline.cache.layout import INDEX_DIR
from hf_pipeline.errors import SourceError
from hf_pipeline.stores.remote_file import RemoteFile

__all__ = [
    "INDEX_DIR",
    "INDEX_NAME",
    "MAX_ENTRIES",
    "RACY_NS",
    "ContentIndex",
    "HashStats",
    "StatKey",
    "content_identities",
    "is_local",
    "stat_key",
]

log = logging.getLogger(__name__)

INDEX_NAME = "index.json"
_VERSION = 1
#: Entries kept. One is ~150 bytes of JSON: 200k entries (~30 MB) stay well under
#: :data:`dist.markers.MAX_JSON_BYTES`; COYO-11M has about 1,100 shard files.
MAX_ENTRIES = 200_000
#: A file modified less than this before it was hashed is hashed again at the next start
#: (mtime granularity: 1-2 s on some NFS servers and FAT, ns on ext4/xfs/tmpfs).
RACY_NS = 2_000_000_000
_HEX = re.compile(r"[0-9a-f]{32}")
_PREFIX = f"{ALGORITHM}:"

#: ``(absolute path, size, mtime_ns, inode, device, ctime_ns)`` of a file.
StatKey = tuple[str, int, int, int, int, int]


def is_local(file: RemoteFile) -> bool:
    """Whether ``file`` is read in place from a local path (its identity is its content)."""
    return "://" not in file.url


def stat_key(path: str | os.PathLike[str]) -> StatKey:
    """The index key of ``path``: its absolute path and what ``stat`` says of it.

    Not ``realpath``: it costs an ``lstat`` per path component (1.7 s of a 2.2 s start
    over 10,000 files, measured), and the entry is only trusted for the same inode and
    device anyway; a file reached by two paths has two entries. (The sources list
    local files by their resolved path already.)

    Raises:
        SourceError: the file cannot be stat'ed or is not a regular file.
    """
    real = os.path.abspath(path)
    try:
        st = os.stat(real)
    except OSError as e:
        raise SourceError(str(path), f"cannot stat: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SourceError(str(path), "is not a regular file")
    return (real, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HashStats:
    """What finding the identities of local inputs cost.

    Attributes:
        files: local files identified.
        index_hits: files whose digest came from the index (or from the job's resolver).
        hashed_files: files read and hashed.
        hashed_bytes: bytes read and hashed.
        seconds: wall time of the whole identification (stat, index, hashing).
        index: the index file ("" without one).
        index_problem: why the index on disk was ignored ("" when it was not).
    """

    files: int = 0
    index_hits: int = 0
    hashed_files: int = 0
    hashed_bytes: int = 0
    seconds: float = 0.0
    index: str = ""
    index_problem: str = ""

    @property
    def gb_per_s(self) -> float:
        """Hashing rate in GB/s (10^9 bytes), 0 when nothing was hashed."""
        return self.hashed_bytes / 1e9 / self.seconds if self.hashed_bytes and self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "gb_per_s": round(self.gb_per_s, 3)}


@dataclasses.dataclass(frozen=True)
class _Entry:
    size: int
    mtime_ns: int
    ino: int
    dev: int
    digest: str
    hashed_at_ns: int
    #: None: a row of the release before the ctime, never a hit.
    ctime_ns: int | None = None

    def row(self) -> list[Any]:
        row = [self.size, self.mtime_ns, self.ino, self.dev, self.digest, self.hashed_at_ns]
        return row if self.ctime_ns is None else [*row, self.ctime_ns]


def _entry(raw: Any) -> _Entry | None:
    """An index row, or None when it is not ``[4 ints >= 0, 32 hex, int >= 0]`` with,
    since the ctime is compared, one more int >= 0 (``ctime_ns``; absent in a row of the
    release before)."""
    if not (isinstance(raw, list) and len(raw) in (6, 7)):
        return None
    ints = [*raw[:4], *raw[5:]]
    if not all(type(v) is int and v >= 0 for v in ints):  # bool is not a size
        return None
    digest = raw[4]
    if not (isinstance(digest, str) and _HEX.fullmatch(digest)):
        return None
    ctime = raw[6] if len(raw) == 7 else None
    return _Entry(raw[0], raw[1], raw[2], raw[3], digest, raw[5], ctime)


class ContentIndex:
    """The ``path -> (stat, digest)`` index of one cache root (module docstring).

    Args:
        folder: the index folder (``<cache root>/.content-index``); None: no index
            (every file is hashed, nothing is remembered).
    """

    def __init__(self, folder: str | os.PathLike[str] | None):
        self.folder = None if folder is None else Path(folder)
        self.problem = ""
        self._entries: dict[str, _Entry] = {}
        self._new: dict[str, _Entry] = {}
        # (dev, inode) -> the entries of every path, built at the first miss by path.
        self._inodes: dict[tuple[int, int], list[_Entry]] | None = None
        if self.folder is not None:
            self._entries, self.problem = self._read()
            if self.problem:
                log.warning("ignoring the content index %s: %s", self.path, self.problem)

    @property
    def path(self) -> Path | None:
        return None if self.folder is None else self.folder / INDEX_NAME

    def _read(self) -> tuple[dict[str, _Entry], str]:
        """The entries on disk and why the file was ignored ("" if it was not)."""
        path = self.path
        assert path is not None
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return {}, ""
        except OSError as e:
            return {}, f"cannot stat it ({e.strerror or e})"
        if not stat.S_ISREG(st.st_mode):  # a link placed here could point anywhere
            return {}, "not a regular file"
        try:
            raw = load_json(path)
        except ForeignJSONError as e:
            return {}, e.reason
        except OSError as e:
            return {}, f"cannot read it ({e.strerror or e})"
        if not isinstance(raw, dict):
            return {}, f"not a JSON object ({type(raw).__name__})"
        if raw.get("version") != _VERSION or raw.get("algorithm") != ALGORITHM:
            return {}, (
                f"version {raw.get('version')!r}/algorithm {raw.get('algorithm')!r}, "
                f"expected {_VERSION}/{ALGORITHM}"
            )
        rows = raw.get("entries")
        if not isinstance(rows, dict):
            return {}, "'entries' is not a JSON object"
        if len(rows) > MAX_ENTRIES:
            return {}, f"holds {len(rows)} entries, more than {MAX_ENTRIES}"
        out: dict[str, _Entry] = {}
        for k, v in rows.items():
            entry = _entry(v)
            if entry is not None and os.path.isabs(k):
                out[k] = entry
        dropped = len(rows) - len(out)
        if dropped:
            log.warning("content index %s: %d malformed entries ignored", path, dropped)
        return out, ""

    def lookup(self, key: StatKey) -> str | None:
        """The digest recorded for exactly this stat, under this path or (the same
        inode) another one, unless it was racy (see module). A hit under another path
        is recorded under this one."""
        e = self._new.get(key[0]) or self._entries.get(key[0])
        elsewhere = e is None or (e.size, e.mtime_ns, e.ino, e.dev, e.ctime_ns) != key[1:]
        if elsewhere:
            e = self._same_inode(key)
        if e is None or e.hashed_at_ns - e.mtime_ns < RACY_NS:
            return None
        if elsewhere:
            self.record(key, e.digest, e.hashed_at_ns)
        return e.digest

    def _same_inode(self, key: StatKey) -> _Entry | None:
        """An entry of any path with exactly the stat ``key`` holds, or None."""
        if self._inodes is None:
            self._inodes = {}
            for e in [*self._entries.values(), *self._new.values()]:
                self._inodes.setdefault((e.dev, e.ino), []).append(e)
        _, size, mtime_ns, ino, dev, ctime_ns = key
        for e in self._inodes.get((dev, ino), ()):
            if (e.size, e.mtime_ns, e.ctime_ns) == (size, mtime_ns, ctime_ns):
                return e
        return None

    def record(self, key: StatKey, digest: str, hashed_at_ns: int) -> None:
        _, size, mtime_ns, ino, dev, ctime_ns = key
        entry = _Entry(size, mtime_ns, ino, dev, digest, hashed_at_ns, ctime_ns)
        self._new[key[0]] = entry
        if self._inodes is not None:
            self._inodes.setdefault((dev, ino), []).append(entry)

    def save(self) -> None:
        """Merge this run's entries into the index on disk (re-read now) and replace it.

        A read-only or full cache root leaves the index as it is (a warning).
        """
        path = self.path
        if self.folder is None or path is None or not self._new:
            return
        try:
            # A real folder, never a link someone put in a shared root (refused).
            own_folder(self.folder.parent, self.folder.name)
            on_disk, _ = self._read()  # what another job wrote since we read it
            merged = {**on_disk, **self._new}
            if len(merged) > MAX_ENTRIES:  # ours first, then the most recently hashed
                rest = sorted(
                    (k for k in merged if k not in self._new),
                    key=lambda k: merged[k].hashed_at_ns,
                    reverse=True,
                )
                keep = list(self._new) + rest[: max(0, MAX_ENTRIES - len(self._new))]
                merged = {k: merged[k] for k in keep[:MAX_ENTRIES]}
            doc = {
                "version": _VERSION,
                "algorithm": ALGORITHM,
                "entries": {k: e.row() for k, e in merged.items()},
            }
            with atomic_write(path, "w") as fh:
                json.dump(doc, fh, separators=(",", ":"))
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC):
                raise
            log.warning(
                "content index %s not written (%s): the next start hashes these files again",
                self.path,
                e.strerror or e,
            )
            return
        self._entries, self._new, self._inodes = merged, {}, None


def content_identities(
    files: Sequence[RemoteFile],
    *,
    index: ContentIndex,
    known: Mapping[StatKey, str] | None = None,
    progress: bool = False,
    workers: int | None = None,
) -> tuple[list[RemoteFile], HashStats]:
    """``files`` with each local file's ``etag`` set to ``xxh3_128:<hex>`` of its bytes.

    Remote files are returned as they are (their store's content hash is their etag).
    Digests come from ``index``, else from ``known`` (the job's resolver's, for the
    very same stat), else the file is hashed (``workers`` threads, a tqdm bar with
    ``progress``) and recorded; the index is saved before returning.

    Raises:
        SourceError: a local file cannot be read, or changed while it was hashed.
    """
    t0 = time.monotonic()
    keys: dict[int, StatKey] = {i: stat_key(f.url) for i, f in enumerate(files) if is_local(f)}
    digests: dict[int, str] = {}
    for i, key in keys.items():
        found = index.lookup(key) or (known or {}).get(key)
        if found is not None:
            digests[i] = found
    hits = len(digests)
    misses = [i for i in keys if i not in digests]
    total = sum(keys[i][1] for i in misses)
    hashed_at = time.time_ns()
    if misses:
        from tqdm.auto import tqdm

        with tqdm(
            total=total, desc="hashing inputs", unit="B", unit_scale=True, disable=not progress
        ) as bar:
            paths = [keys[i][0] for i in misses]
            for i, (_, size, digest) in zip(
                misses,
                hash_files(paths, workers=workers, on_bytes=bar.update),
                strict=True,
            ):
                path = files[i].url
                if isinstance(digest, OSError):
                    raise SourceError(path, f"cannot read: {digest.strerror or digest}")
                if size != keys[i][1] or stat_key(path) != keys[i]:
                    raise SourceError(
                        path, "changed while it was hashed (is it still being written?)"
                    )
                digests[i] = digest
                index.record(keys[i], digest, hashed_at)
    index.save()  # what was hashed, and the hits found under another path
    out = [
        dataclasses.replace(f, etag=_PREFIX + digests[i]) if i in digests else f
        for i, f in enumerate(files)
    ]
    stats = HashStats(
        files=len(keys),
        index_hits=hits,
        hashed_files=len(misses),
        hashed_bytes=total,
        seconds=round(time.monotonic() - t0, 6),
        index=str(index.path or ""),
        index_problem=index.problem,
    )
    return out, stats


def digests_of(files: Sequence[RemoteFile]) -> dict[StatKey, str]:
    """``{stat key: hex digest}`` of the identified local ``files`` (for the job's other
    ranks: see :func:`hf_pipeline.build.prepare.resolve_job_inputs`)."""
    out = {}
    for f in files:
        if is_local(f) and f.etag.startswith(_PREFIX):
            out[stat_key(f.url)] = f.etag[len(_PREFIX) :]
    return out
