"""The files a new cache links from stored units: what its marker records for them, and
the check of their bytes, remembered by ``stat``.

:func:`hf_pipeline.build.parts.assemble` hard-links the published files of every part's
units (:mod:`hf_pipeline.build.part_store`) into the new cache's ``converted`` stage.
The stage's marker lists them as the units' own markers do (:func:`recorded_entries`),
never with a checksum of what the disk holds now, which would certify a unit damaged
since it was published. Before the links, the files of the units this build did not
make (reused) are checked against their unit's ``whole_checksum``; a damaged one is
refused (:class:`~hf_pipeline.errors.CacheFormatError` naming the unit and the file),
so no cache is published over it.

Reading every reused file whole at every build made an append cost as much reading as
the whole cache holds (on a 2-CPU VM, 1.1 GB for an append of 10% to 50k rows; for
COYO-11M, 240 GB of latents to add 10%). So the cache root's content index
(:class:`hf_pipeline.stores.identity.ContentIndex`, the one that remembers the inputs)
also remembers, for each linked file, the ``stat`` under which its bytes were last
known to be its unit's:

- a reused file whose fresh ``stat`` (size, mtime, inode, device, ctime) is exactly a
  remembered one with its unit's digest is not read (the index's rules: an entry
  hashed within 2 s of the file's mtime is not trusted); any other is read whole and
  compared;
- after the links (a link moves the inode's ctime), each file is remembered under its
  new ``stat``: a reused file when its size, mtime, inode and device are still those it
  was checked with; a file of a unit this build made when its mtime is not later than
  the unit's publication (its marker's checksums were computed from these bytes);
- a file changed in place since it was remembered (a write moves the mtime, and a
  write whose mtime was put back still moves the ctime) misses and is read whole.

What this cannot see: bytes that change without any ``stat`` changing (a disk or
memory fault under the filesystem), and a write with its mtime put back between a
file's check (for a unit this build made: its publication) and its link, within one
build. ``hf-pipeline verify`` reads every byte of every
cache and stored unit against the records.

Thread-safe: no shared state.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from dist.markers import FileEntry
from hf_pipeline.stores.identity import ContentIndex, StatKey, stat_key

__all__ = [
    "LinkCheck",
    "LinkedFile",
    "check_linked",
    "linked_files",
    "recorded_entries",
    "remember_linked",
]

#: Where :func:`hf_pipeline.build.parts.assemble` puts part ``i``: ``parts/part-NNNNN``.
_PART = "parts/part-{:05d}"


@dataclasses.dataclass(frozen=True)
class LinkedFile:
    """One file of a stored unit that the new cache links.

    Attributes:
        path: the file in the store.
        entry: the unit marker's entry for it (path relative to the unit's folder).
        target: its path in the new cache, relative to the cache folder.
        marker: the unit's marker file (what an error names).
        published_ns: when the unit's marker was created (ns since the epoch).
        reused: made by an earlier build (checked before it is linked).
    """

    path: Path
    entry: FileEntry
    target: str
    marker: Path
    published_ns: int
    reused: bool


@dataclasses.dataclass(frozen=True)
class LinkCheck:
    """What :func:`check_linked` did: the reused files' ``stat`` before the links (by
    store path) and what it read."""

    before: Mapping[Path, StatKey]
    files: int
    files_read: int
    bytes_read: int
    seconds: float

    def report(self) -> dict[str, Any]:
        """The build report's lines (its ``reuse`` block)."""
        return {
            "reused_files_checked": self.files,
            "reused_files_read": self.files_read,
            "reused_bytes_read": self.bytes_read,
            "seconds_reused_check": round(self.seconds, 3),
        }


def linked_files(
    stage_dir: Path,
    cache_dir: Path,
    parts: Sequence[tuple[Sequence[Path], Mapping[str, Any]]],
    *,
    reused: Collection[Path],
) -> list[LinkedFile]:
    """The files :func:`hf_pipeline.build.parts.assemble` links into ``stage_dir`` for
    ``parts`` (each part's published unit folders and info), as the units' markers list
    them. Files of a schema-1 unit (no ``whole_checksum``) are left out: the new
    marker hashes those itself.

    Args:
        stage_dir: the stage folder being built.
        cache_dir: the cache folder (marker paths are relative to it).
        parts: what ``assemble`` takes.
        reused: the unit folders (of ``parts``) this build did not make.

    Raises:
        CacheFormatError: a unit's marker does not read or publishes another folder.
    """
    from dist.layout import marker_name
    from dist.markers import parse_marker
    from hf_pipeline.errors import CacheFormatError

    wanted = {Path(f) for f in reused}
    out = []
    for i, (folders, _) in enumerate(parts):
        target = stage_dir / _PART.format(i)
        for folder in map(Path, folders):
            unit = folder.parent  # <store>/<kind>-<id>/, its marker <kind>.json
            kind, _, unit_id = unit.name.partition("-")
            path = unit / marker_name(kind)
            marker, why = parse_marker(path, fingerprint=unit_id, stage=kind)
            if marker is not None and marker.directory != folder.name:
                why = f"publishes {marker.directory!r}, not {folder.name!r}"
            if marker is None or why:
                raise CacheFormatError(str(path), f"the stored part {unit.name}: {why}")
            for entry in marker.files:
                if not entry.whole_checksum:
                    continue
                inner = Path(entry.path).relative_to(folder.name)
                out.append(
                    LinkedFile(
                        path=unit / entry.path,
                        entry=entry,
                        target=(target / inner).relative_to(cache_dir).as_posix(),
                        marker=path,
                        published_ns=int(marker.finished_at * 1e9),
                        reused=folder in wanted,
                    )
                )
    return out


def check_linked(files: Sequence[LinkedFile], *, index: ContentIndex) -> LinkCheck:
    """Check the reused ``files`` before they are linked: each one the ``index``
    vouches for (its exact ``stat``, its unit's digest) is not read; every other is read
    whole and compared with its unit's record (module docstring).

    Raises:
        CacheFormatError: a file cannot be stat'ed or read, or its bytes are not those
            its unit's marker lists, naming the unit and the file.
    """
    from dist.checksums import hash_files, hashed_problem
    from hf_pipeline.errors import SourceError

    t0 = time.monotonic()
    reused = [f for f in files if f.reused]
    before: dict[Path, StatKey] = {}
    unread = []
    for f in reused:
        try:
            before[f.path] = key = stat_key(f.path)
        except SourceError as e:
            raise _damaged(f, e.reason) from None
        if index.lookup(key) != f.entry.whole_checksum:
            unread.append(f)
    hashed = hash_files([f.path for f in unread])
    for f, (_, size, digest) in zip(unread, hashed, strict=True):
        why = hashed_problem(
            size, digest, expected_size=f.entry.size, expected=f.entry.whole_checksum
        )
        if why is not None:
            raise _damaged(f, why)
    return LinkCheck(
        before=before,
        files=len(reused),
        files_read=len(unread),
        bytes_read=sum(f.entry.size for f in unread),
        seconds=time.monotonic() - t0,
    )


def _damaged(f: LinkedFile, why: str) -> Exception:
    """The error that refuses ``f``'s unit, whose marker is retired first: the next
    build makes that part again (its edges read fine: without the retirement every
    build found it and failed here; the old advice, verify then clean, removed every
    intact part of the caches that linked it: outside tester)."""
    from dist.coordinator import retire_marker
    from hf_pipeline.errors import CacheFormatError

    unit = f.marker.parent
    directory = Path(f.entry.path).parts[0]
    stage = f.marker.name.removesuffix(".json")
    problem = f"listed file {f.entry.path!r} {why}"
    retire_marker(unit, stage, directory, problem)
    return CacheFormatError(
        str(f.marker),
        f"the stored part {unit.name} is damaged ({problem}); every cache that links it "
        "is too (`hf-pipeline verify` marks them): its marker is retired, build again "
        "and that part is built anew",
    )


def remember_linked(files: Sequence[LinkedFile], check: LinkCheck, *, index: ContentIndex) -> None:
    """After the links: remember each of ``files`` under its new ``stat`` with its unit's
    digest, where the module docstring's conditions hold, and save ``index`` (a
    read-only or full cache root leaves it as it is, with a warning)."""
    from hf_pipeline.errors import SourceError

    now = time.time_ns()
    for f in files:
        try:
            key = stat_key(f.path)
        except SourceError:
            continue  # gone (a concurrent clean): nothing to remember
        _, size, mtime_ns, ino, dev, _ = key
        if f.reused:
            was = check.before.get(f.path)
            if was is None or (was[1], was[2], was[3], was[4]) != (size, mtime_ns, ino, dev):
                continue
        elif mtime_ns > f.published_ns:
            continue
        index.record(key, f.entry.whole_checksum, now)
    index.save()


def recorded_entries(files: Sequence[LinkedFile]) -> dict[str, FileEntry]:
    """What the new cache's marker records for the linked ``files``, by path relative to
    the cache folder (:func:`dist.markers.describe_files`' ``recorded``)."""
    return {f.target: dataclasses.replace(f.entry, path=f.target) for f in files}
