"""``manifest.json`` of a published cache, and the digests that compare files with a store.

The stage markers (:mod:`dist.markers`) checksum only the first and last MiB of a file:
cheap enough to check at every start, blind to a byte changed in the middle. A published
cache also carries a manifest: each listed file's size and whole-file crc32c (GCS's own
checksum, base64 of the big-endian value) and, when published to the Hub, sha256 (the
Hub's LFS oid). A puller compares those with the store's checksum before downloading
and with the bytes it got (:mod:`hf_pipeline.publish.pull`); a publisher uses them to skip files
the store already holds (:func:`same_content`).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import os
import re
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from dist.markers import Marker
from dist.safepath import check_name, check_relpath, shown
from hf_pipeline.stores.remote_file import RemoteFile
from hf_pipeline.stores.staging import READ_CHUNK, checksum_of

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "Manifest",
    "ManifestEntry",
    "bytes_digests",
    "file_digests",
    "file_digests_and_whole",
    "new_manifest",
    "same_content",
]

MANIFEST_NAME = "manifest.json"
#: Bump when the manifest's format changes (readers refuse other versions).
MANIFEST_VERSION = 1
#: Bounds of a manifest's fields (a published manifest is foreign input: a date or a
#: count beyond them is forged, and would overflow what prints or sums it).
MAX_FILE_BYTES = 1 << 50  # 1 PiB: no cache file is larger
MAX_ROWS = 1 << 48
MAX_TEXT = 255  # host, name, fingerprint, a stage name, a checksum
#: published_at from the epoch to 2200-01-01 (seconds; time.localtime handles these).
PUBLISHED_AT_RANGE = (0.0, 7_258_118_400.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManifestEntry:
    """What one published file holds.

    Attributes:
        size: bytes.
        crc32c: whole-file CRC32C, base64 of the big-endian value (GCS's encoding).
        sha256: whole-file SHA-256, hex ("" when not computed: published to GCS).
    """

    size: int
    crc32c: str
    sha256: str = ""

    def __post_init__(self):
        _check_int("size", self.size, MAX_FILE_BYTES)
        _check_text("crc32c", self.crc32c)
        if not re.fullmatch(r"[A-Za-z0-9+/]{6}==", self.crc32c):
            raise ValueError(f"crc32c must be base64 of 4 bytes, got {shown(self.crc32c)}")
        if self.sha256 and not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"sha256 must be 64 lowercase hex digits, got {shown(self.sha256)}")

    def checksum(self, kind: str) -> str:
        """This file's checksum in a store's encoding, or "" when the manifest lacks it."""
        return {"crc32c": self.crc32c, "sha256": self.sha256}.get(kind, "")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    """``manifest.json`` of a published cache (see the module docstring).

    Attributes:
        name: the cache folder name (``<name>-<fingerprint>``).
        fingerprint: the cache identity.
        stages: the stage names, in build order.
        rows: rows of the built cache (the last stage's ``rows_out``), or None.
        published_at: wall-clock seconds since the epoch of the publication.
        host: the publishing host.
        files: every file the markers list, by path relative to the cache folder.
        stream: the stream index (:mod:`hf_pipeline.read.stream.index`: where each row's
            bytes sit, per-block checksums) as published, or None (a cache published
            before streaming, which can still be pulled). Checked by the streaming
            reader (``StreamIndex.from_dict``), not here.
        version: :data:`MANIFEST_VERSION`.
    """

    name: str
    fingerprint: str
    stages: tuple[str, ...]
    rows: int | None
    published_at: float
    host: str
    files: Mapping[str, ManifestEntry]
    stream: Mapping[str, Any] | None = None
    version: int = MANIFEST_VERSION

    def __post_init__(self):
        # Everything is checked here, so that --status prints, sums and formats only
        # values that fit (a date of 1e300 or NaN crashed time.localtime).
        _check_text("name", self.name)
        _check_text("fingerprint", self.fingerprint)
        _check_text("host", self.host, empty_ok=True)
        if not self.stages:
            raise ValueError("stages must be non-empty")
        for stage in self.stages:
            _check_text("stages", stage)
        if self.rows is not None:
            _check_int("rows", self.rows, MAX_ROWS)
        at = self.published_at
        lo, hi = PUBLISHED_AT_RANGE
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not lo <= at <= hi:
            raise ValueError(
                f"published_at must be seconds since the epoch in [{lo:.0f}, {hi:.0f}], "
                f"got {shown(at)}"
            )

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files.values())

    def to_bytes(self) -> bytes:
        d = {
            "version": self.version,
            "name": self.name,
            "fingerprint": self.fingerprint,
            "stages": list(self.stages),
            "rows": self.rows,
            "published_at": self.published_at,
            "host": self.host,
            "bytes": self.total_bytes,
            "files": {
                p: {k: v for k, v in dataclasses.asdict(e).items() if v != ""}
                for p, e in sorted(self.files.items())
            },
        }
        if self.stream is not None:
            d["stream"] = self.stream
        return json.dumps(d, sort_keys=True, indent=1).encode()

    @classmethod
    def from_dict(cls, d: Any) -> Manifest:
        """Parse a manifest. Raises (KeyError, TypeError, ValueError) if malformed or
        of another version; :class:`~dist.safepath.UnsafePathError` (a ValueError) for a
        file path that is not a plain relative path or a name that is not one folder."""
        if not isinstance(d, Mapping):
            raise TypeError(f"manifest must be a JSON object, got {type(d).__name__}")
        if d.get("version") != MANIFEST_VERSION:
            raise ValueError(f"version {d.get('version')!r}, expected {MANIFEST_VERSION}")
        files = d["files"]
        if not isinstance(files, Mapping):
            raise TypeError("files must be a JSON object")
        stages = d["stages"]
        if not isinstance(stages, list):
            raise TypeError(f"stages must be a JSON list, got {type(stages).__name__}")
        at = d["published_at"]
        if isinstance(at, int) and not isinstance(at, bool):
            # 10**400 as a JSON number: float() would raise OverflowError (no ValueError)
            at = float(at) if abs(at) < 1 << 64 else math.inf
        stream = d.get("stream")
        if stream is not None and not isinstance(stream, Mapping):
            raise TypeError(f"stream must be a JSON object, got {type(stream).__name__}")
        entries = {}
        for p, e in files.items():
            if not isinstance(e, Mapping):
                raise TypeError(f"files[{shown(p)}] must be a JSON object")
            entries[check_relpath(p)] = ManifestEntry(
                size=e["size"], crc32c=e["crc32c"], sha256=e.get("sha256", "")
            )
        return cls(
            name=_check_text("name", check_name(d["name"])),
            fingerprint=d["fingerprint"],
            stages=tuple(stages),
            rows=d.get("rows"),
            published_at=at,
            host=d["host"],
            files=entries,
            stream=stream,
        )

    def same_files(self, other: Manifest) -> bool:
        """Whether both describe the same cache content (dates and hosts aside), stream
        index included (an older manifest without one is replaced by a re-publish)."""
        return (self.name, self.fingerprint, self.stages, dict(self.files), self.stream) == (
            other.name,
            other.fingerprint,
            other.stages,
            dict(other.files),
            other.stream,
        )


def _check_text(field: str, value: object, *, empty_ok: bool = False) -> str:
    """``value`` if it is a string of at most :data:`MAX_TEXT` printable characters."""
    if not isinstance(value, str):
        raise ValueError(f"{field} must be a string, got {type(value).__name__}")
    if not value and not empty_ok:
        raise ValueError(f"{field} must be non-empty")
    if len(value) > MAX_TEXT:
        raise ValueError(f"{field} must be at most {MAX_TEXT} characters, got {len(value)}")
    if not value.isprintable():  # newlines, ANSI escapes: forged lines on a terminal
        raise ValueError(f"{field} must hold no control character, got {shown(value)}")
    return value


def _check_int(field: str, value: object, limit: int) -> int:
    """``value`` if it is an int (not a bool) in ``[0, limit]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} must be an integer, got {type(value).__name__}")
    if not 0 <= value <= limit:
        raise ValueError(f"{field} must be in [0, {limit}], got {shown(value)}")
    return value


def _digest(chunks, *, sha256: bool, whole: bool = False) -> tuple[int, str, str, str]:
    """``(size, crc32c, sha256 or "", xxh3_128 or "")`` of the bytes ``chunks`` yield."""
    import google_crc32c

    crc = google_crc32c.Checksum()
    sha = hashlib.sha256() if sha256 else None
    # The markers' whole_checksum (dist.checksums.whole_checksum, ALGORITHM): computed
    # from the same bytes as the manifest's, so what is published is what was compared.
    xxh = xxhash.xxh3_128() if whole else None
    size = 0
    for block in chunks:
        size += len(block)
        crc.update(block)
        if sha is not None:
            sha.update(block)
        if xxh is not None:
            xxh.update(block)
    return (
        size,
        base64.b64encode(crc.digest()).decode(),
        sha.hexdigest() if sha else "",
        xxh.hexdigest() if xxh else "",
    )


def file_digests(path: str | os.PathLike, *, sha256: bool = False) -> ManifestEntry:
    """Size, crc32c (and sha256) of a file, in one read. Thread-safe."""
    return file_digests_and_whole(path, sha256=sha256, whole=False)[0]


def file_digests_and_whole(
    path: str | os.PathLike, *, sha256: bool = False, whole: bool = True
) -> tuple[ManifestEntry, str]:
    """:func:`file_digests` and, from the same read, the file's whole-file checksum
    (:data:`dist.checksums.ALGORITHM`, as :func:`dist.checksums.whole_checksum` computes
    it; "" when ``whole`` is False). Thread-safe."""
    with open(path, "rb") as fh:
        size, crc, sha, xxh = _digest(
            iter(lambda: fh.read(READ_CHUNK), b""), sha256=sha256, whole=whole
        )
    return ManifestEntry(size=size, crc32c=crc, sha256=sha), xxh


def bytes_digests(data: bytes, *, sha256: bool = False) -> ManifestEntry:
    """:func:`file_digests` of bytes held in memory."""
    size, crc, sha, _ = _digest([data], sha256=sha256)
    return ManifestEntry(size=size, crc32c=crc, sha256=sha)


def _checksum_of_bytes(data: bytes, kind: str) -> str:
    """:func:`~hf_pipeline.stores.staging.checksum_of` of bytes held in memory (md5, gitsha1)."""
    if kind == "md5":
        return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
    if kind == "gitsha1":
        return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()
    return ""


def same_content(remote: RemoteFile | None, entry: ManifestEntry, local: Path | bytes) -> bool:
    """Whether the store's ``remote`` holds exactly the bytes ``entry`` describes.

    Compared through the checksum the store publishes: crc32c/sha256 from ``entry``;
    md5 or a git blob id (small Hub files) computed from ``local`` (a path or bytes).
    A store that offers no checksum never matches (upload again rather than guess).
    """
    if remote is None or remote.size != entry.size:
        return False
    kind, _, value = remote.checksum.partition(":")
    ours = entry.checksum(kind)
    if not ours and kind in ("md5", "gitsha1"):
        ours = (
            _checksum_of_bytes(local, kind)
            if isinstance(local, bytes)
            else checksum_of(Path(local), kind)
        )
    return bool(ours) and ours == value


def new_manifest(
    cache_name: str,
    fingerprint: str,
    markers: Mapping[str, Marker],
    files: Mapping[str, ManifestEntry],
    stream: Mapping[str, Any] | None = None,
) -> Manifest:
    """The manifest of a cache about to be published from this host, now (``stream``:
    its stream index, ``StreamIndex.to_dict()``)."""
    last = list(markers.values())[-1]
    rows = last.info.get("rows_out")
    return Manifest(
        name=cache_name,
        fingerprint=fingerprint,
        stages=tuple(markers),
        rows=int(rows) if isinstance(rows, int) else None,
        published_at=time.time(),
        host=socket.gethostname(),
        files=dict(files),
        stream=stream,
    )
