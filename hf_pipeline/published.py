"""A published cache in a bucket or a Hub repository: where it is and what it holds.

``scripts/prebuild_cache.py --publish URL`` (:mod:`hf_pipeline.publish`) copies a built
cache to ``URL/<name>-<fingerprint>/``; ``build.pull_from`` (:mod:`hf_pipeline.pull`)
downloads it instead of building it. A published cache holds, at the same paths
relative to the cache folder as on disk::

    every file a stage marker lists   whatever folders they are in: the markers, not
                                      folder names, say what a cache is
    manifest.json                     each of those files' size and whole-file crc32c
                                      (and sha256 on the Hub), the name, rows, bytes, date
    converted.json, filtered.json     the stage markers (dist.markers), byte for byte

The markers' own checksums read only the first and last MiB of a file (cheap enough to
check on every start); the manifest covers every byte, so a file changed anywhere after
publication is refused — before the download when the store's own checksum already
differs from the manifest's.

*Complete or absent.* An object store shows a folder filling one object at a time, so
the publisher uploads the data files first, then the manifest, then the markers
(earlier stages first): a folder with every marker is complete, one missing a marker is
"not published" (yet, or an interrupted upload). On the Hub one commit holds all
(atomic). A folder whose markers are all there but disagree with each other, with the
manifest or with the store is *damaged*: :func:`find_published` raises
:class:`~hf_pipeline.errors.CacheFormatError` naming the file.

:class:`Store` lists, reads small files and uploads through the stores' own clients
(gcsfs, huggingface_hub; no hand-written HTTP); the bytes of data files are read through
its :attr:`Store.source` (a :class:`~hf_pipeline.sources.Source`), so every download is a
:func:`~hf_pipeline.staging.stage_file`: bounded, retried, verified, resumable.
"""

from __future__ import annotations

import abc
import base64
import dataclasses
import hashlib
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote

from dist.layout import marker_name
from dist.markers import SCHEMA_VERSION, Marker, derived_from_problem, read_json
from hf_pipeline.config import PUBLISH_SCHEMES
from hf_pipeline.errors import CacheFormatError, SourceError
from hf_pipeline.fetch_stats import FetchStats
from hf_pipeline.remote_file import RemoteFile
from hf_pipeline.retry import RetryPolicy, TransientError, with_retries
from hf_pipeline.staging import READ_CHUNK, StagingFolder, checksum_of, stage_file

if TYPE_CHECKING:  # pragma: no cover
    from hf_pipeline.config import DataConfig
    from hf_pipeline.sources import Source

__all__ = [
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "Manifest",
    "ManifestEntry",
    "PublishLocation",
    "PublishedCache",
    "PublishedStatus",
    "Store",
    "StoreKind",
    "Upload",
    "bytes_digests",
    "file_digests",
    "find_published",
    "list_published",
    "new_manifest",
    "open_store",
    "parse_location",
    "same_content",
]

logger = logging.getLogger("hf_pipeline")

MANIFEST_NAME = "manifest.json"
#: Bump when the manifest's format changes (readers refuse other versions).
MANIFEST_VERSION = 1

StoreKind = Literal["gcs", "hub"]


# ----------------------------------------------------------------------------- where


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishLocation:
    """Where published caches live.

    Attributes:
        url: the location, without a trailing slash.
        kind: the store.
        path: GCS: ``bucket[/prefix]``; the Hub: the folder in the repository ("" for
            its root).
        repo_id: the Hub repository (``org/name``); "" for GCS.
        revision: the Hub branch published to and read from (``main``); "" for GCS.
    """

    url: str
    kind: StoreKind
    path: str
    repo_id: str = ""
    revision: str = ""

    def cache_url(self, cache_name: str, rel: str = "") -> str:
        """The URL of cache folder ``cache_name`` (or of ``rel`` inside it)."""
        return f"{self.url}/{cache_name}" + (f"/{rel}" if rel else "")


def parse_location(url: str) -> PublishLocation:
    """Parse ``gs://<bucket>[/<prefix>]`` or ``hf://datasets/<org>/<repo>[@<rev>][/<path>]``.

    Raises:
        SourceError: any other form.
    """
    url = url.strip().rstrip("/")
    if url.startswith("gs://"):
        path = url[len("gs://") :].strip("/")
        if path and "*" not in path and "?" not in path and "[" not in path:
            return PublishLocation(url=f"gs://{path}", kind="gcs", path=path)
    elif url.startswith("hf://datasets/"):
        parts = [p for p in url[len("hf://datasets/") :].split("/") if p]
        if len(parts) >= 2:
            name, _, rev = parts[1].partition("@")
            if name:
                return PublishLocation(
                    url=url,
                    kind="hub",
                    path="/".join(parts[2:]),
                    repo_id=f"{parts[0]}/{name}",
                    revision=unquote(rev) if rev else "main",
                )
    raise SourceError(
        url,
        "a place to publish caches must look like gs://<bucket>[/<prefix>] or "
        f"hf://datasets/<org>/<repo>[@<branch>][/<path>] (one of {', '.join(PUBLISH_SCHEMES)})",
    )


# ----------------------------------------------------------------------------- what


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
        if self.size < 0:
            raise ValueError(f"size must be >= 0, got {self.size}")
        if not self.crc32c:
            raise ValueError("crc32c must be non-empty")

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
        version: :data:`MANIFEST_VERSION`.
    """

    name: str
    fingerprint: str
    stages: tuple[str, ...]
    rows: int | None
    published_at: float
    host: str
    files: Mapping[str, ManifestEntry]
    version: int = MANIFEST_VERSION

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
        return json.dumps(d, sort_keys=True, indent=1).encode()

    @classmethod
    def from_dict(cls, d: Any) -> Manifest:
        """Parse a manifest. Raises (KeyError, TypeError, ValueError) if malformed or
        of another version."""
        if not isinstance(d, Mapping):
            raise TypeError(f"manifest must be a JSON object, got {type(d).__name__}")
        if d.get("version") != MANIFEST_VERSION:
            raise ValueError(f"version {d.get('version')!r}, expected {MANIFEST_VERSION}")
        files = d["files"]
        if not isinstance(files, Mapping):
            raise TypeError("files must be a JSON object")
        rows = d.get("rows")
        return cls(
            name=str(d["name"]),
            fingerprint=str(d["fingerprint"]),
            stages=tuple(str(s) for s in d["stages"]),
            rows=None if rows is None else int(rows),
            published_at=float(d["published_at"]),
            host=str(d["host"]),
            files={
                str(p): ManifestEntry(
                    size=int(e["size"]), crc32c=str(e["crc32c"]), sha256=str(e.get("sha256", ""))
                )
                for p, e in files.items()
            },
        )

    def same_files(self, other: Manifest) -> bool:
        """Whether both describe the same cache content (dates and hosts aside)."""
        return (self.name, self.fingerprint, self.stages, dict(self.files)) == (
            other.name,
            other.fingerprint,
            other.stages,
            dict(other.files),
        )


def _digest(chunks, *, sha256: bool) -> tuple[int, str, str]:
    import google_crc32c

    crc = google_crc32c.Checksum()
    sha = hashlib.sha256() if sha256 else None
    size = 0
    for block in chunks:
        size += len(block)
        crc.update(block)
        if sha is not None:
            sha.update(block)
    return size, base64.b64encode(crc.digest()).decode(), sha.hexdigest() if sha else ""


def file_digests(path: str | os.PathLike, *, sha256: bool = False) -> ManifestEntry:
    """Size, crc32c (and sha256) of a file, in one read. Thread-safe."""
    with open(path, "rb") as fh:
        size, crc, sha = _digest(iter(lambda: fh.read(READ_CHUNK), b""), sha256=sha256)
    return ManifestEntry(size=size, crc32c=crc, sha256=sha)


def bytes_digests(data: bytes, *, sha256: bool = False) -> ManifestEntry:
    """:func:`file_digests` of bytes held in memory."""
    size, crc, sha = _digest([data], sha256=sha256)
    return ManifestEntry(size=size, crc32c=crc, sha256=sha)


def _checksum_of_bytes(data: bytes, kind: str) -> str:
    """:func:`~hf_pipeline.staging.checksum_of` of bytes held in memory (md5, gitsha1)."""
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Upload:
    """One file to publish.

    Attributes:
        rel: path relative to the cache folder.
        local: the local file, or its bytes.
        entry: its digests (:func:`file_digests`).
    """

    rel: str
    local: Path | bytes
    entry: ManifestEntry


# ----------------------------------------------------------------------------- stores


class Store(abc.ABC):
    """The store of one :class:`PublishLocation`, through its own client library.

    Every call goes through :func:`~hf_pipeline.retry.with_retries`. Thread-safe for
    listing and reading; one :meth:`upload` at a time.

    Attributes:
        location: where.
        policy: retries and per-file timeout.
        source: reads files by range (:func:`~hf_pipeline.staging.stage_file`'s reader).
    """

    kind: StoreKind

    def __init__(self, location: PublishLocation, source: Source, policy: RetryPolicy):
        self.location = location
        self.source = source
        self.policy = policy

    @abc.abstractmethod
    def list_files(self, cache_name: str) -> dict[str, RemoteFile]:
        """Every file under cache folder ``cache_name``, by path relative to it ({} when
        there is no such folder)."""

    @abc.abstractmethod
    def list_cache_names(self) -> list[str]:
        """The folders directly under the location (sorted)."""

    @abc.abstractmethod
    def upload(
        self, cache_name: str, data: Sequence[Upload], tail: Sequence[Upload], *, workers: int
    ) -> None:
        """Upload ``data`` (any order, in parallel), then ``tail`` in its order, into
        cache folder ``cache_name``; every upload is verified against its digests."""


class _GCSStore(Store):
    kind = "gcs"

    def _fs(self):
        return self.source.filesystem()

    def _prefix(self, cache_name: str) -> str:
        return f"{self.location.path}/{cache_name}"

    def list_files(self, cache_name: str) -> dict[str, RemoteFile]:
        prefix = self._prefix(cache_name)

        def find():
            fs = self._fs()
            fs.invalidate_cache(prefix)  # gcsfs keeps listings; a store changes under us
            return fs.find(prefix, detail=True, withdirs=False)

        found = with_retries(f"gs://{prefix}", find, self.policy)
        return {
            name[len(prefix) + 1 :]: self.source.describe(info)
            for name, info in found.items()
            if name.startswith(prefix + "/") and info.get("type") == "file"
        }

    def list_cache_names(self) -> list[str]:
        path = self.location.path

        def ls():
            try:
                return self._fs().ls(path, detail=True, refresh=True)
            except FileNotFoundError:
                return []  # an empty prefix: nothing published yet

        entries = with_retries(self.location.url, ls, self.policy)
        return sorted(
            e["name"].rstrip("/").rsplit("/", 1)[-1]
            for e in entries
            if e.get("type") == "directory"
        )

    def _put(self, cache_name: str, item: Upload) -> None:
        path = f"{self._prefix(cache_name)}/{item.rel}"
        fs = self._fs()

        def attempt():
            if isinstance(item.local, bytes):
                fs.pipe_file(path, item.local)
            else:
                fs.put_file(str(item.local), path)
            got = self.source.describe(fs.info(path, refresh=True))
            if not same_content(got, item.entry, item.local):
                raise TransientError(
                    f"after upload the store holds {got.size} bytes ({got.checksum}), "
                    f"expected {item.entry.size} (crc32c:{item.entry.crc32c})"
                )

        with_retries(f"gs://{path}", attempt, self.policy)

    def upload(self, cache_name, data, tail, *, workers):
        from concurrent.futures import ThreadPoolExecutor

        if data:
            with ThreadPoolExecutor(
                max(1, min(workers, len(data))), thread_name_prefix="hf_pipeline-publish"
            ) as pool:
                # list(): re-raise the first failure here (never dropped with its future).
                list(pool.map(lambda item: self._put(cache_name, item), data))
        for item in tail:  # in order: the last marker is what makes the folder a cache
            self._put(cache_name, item)


class _HubStore(Store):
    kind = "hub"

    def _api(self):
        from huggingface_hub import HfApi

        from hf_pipeline.config import hub_endpoint

        return HfApi(endpoint=hub_endpoint())

    def _folder(self, cache_name: str = "") -> str:
        return "/".join(p for p in (self.location.path, cache_name) if p)

    def _tree(self, folder: str, *, recursive: bool) -> list[Any]:
        def list_tree():
            return list(
                self._api().list_repo_tree(
                    self.location.repo_id,
                    folder or None,
                    revision=self.source.commit,
                    repo_type="dataset",
                    recursive=recursive,
                )
            )

        try:
            return with_retries(self.location.cache_url(folder), list_tree, self.policy)
        except SourceError as err:
            if type(err.__cause__).__name__ in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
                return []  # no such folder: nothing published there
            raise

    def list_files(self, cache_name: str) -> dict[str, RemoteFile]:
        folder = self._folder(cache_name)
        return {
            e.path[len(folder) + 1 :]: self.source.describe(e)
            for e in self._tree(folder, recursive=True)
            if hasattr(e, "blob_id") and e.path.startswith(folder + "/")
        }

    def list_cache_names(self) -> list[str]:
        return sorted(
            e.path.rsplit("/", 1)[-1]
            for e in self._tree(self._folder(), recursive=False)
            if not hasattr(e, "blob_id")
        )

    def upload(self, cache_name, data, tail, *, workers):
        from huggingface_hub import CommitOperationAdd

        items = [*data, *tail]
        if not items:
            return
        folder = self._folder(cache_name)

        def commit():
            ops = []
            for item in items:
                local = item.local if isinstance(item.local, bytes) else str(item.local)
                op = CommitOperationAdd(path_in_repo=f"{folder}/{item.rel}", path_or_fileobj=local)
                if item.entry.sha256:
                    op.upload_info.sha256 = bytes.fromhex(item.entry.sha256)  # hashed once
                ops.append(op)
            # One commit: the cache appears whole or not at all. A retry after a lost
            # answer finds the files there and commits nothing twice.
            return self._api().create_commit(
                self.location.repo_id,
                ops,
                commit_message=f"hf_pipeline: publish {cache_name}",
                repo_type="dataset",
                revision=self.location.revision,
                num_threads=max(1, workers),
            )

        with_retries(self.location.cache_url(cache_name), commit, self.policy)


def open_store(
    url: str | PublishLocation, *, data_config: DataConfig, policy: RetryPolicy | None = None
) -> Store:
    """The :class:`Store` of a publish location; no I/O yet.

    Raises:
        SourceError: a malformed URL.
    """
    from hf_pipeline.sources import GCSSource, HubSource

    location = url if isinstance(url, PublishLocation) else parse_location(url)
    policy = policy or RetryPolicy.from_config(data_config)
    # The sources only read (by range); they never stage into their own folder here.
    staging = Path(tempfile.gettempdir())
    if location.kind == "gcs":
        source = GCSSource(
            location.url, data_config=data_config, policy=policy, staging_dir=staging
        )
        return _GCSStore(location, source, policy)
    rev = location.revision
    source = HubSource(
        f"hf://datasets/{location.repo_id}@{rev}",
        data_config=data_config,
        policy=policy,
        staging_dir=staging,
    )
    return _HubStore(location, source, policy)


# ----------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishedCache:
    """A complete published cache, checked for consistency (not yet downloaded).

    Attributes:
        url: its folder.
        name: ``<name>-<fingerprint>``.
        markers: the stage markers, by stage name.
        manifest: its manifest.
        files: every file the markers list, as the store describes it, by path relative
            to the cache folder.
    """

    url: str
    name: str
    markers: Mapping[str, Marker]
    manifest: Manifest
    files: Mapping[str, RemoteFile]

    def file_url(self, rel: str) -> str:
        return f"{self.url}/{rel}"


def _read_meta(store: Store, file: RemoteFile, staging: StagingFolder, stats: FetchStats) -> Any:
    """A small JSON file of the store, staged (verified) first; None if not JSON."""
    return read_json(stage_file(store.source, file, staging, store.policy, stats))


def _parse_marker(raw: Any, url: str, stage: str, fingerprint: str) -> Marker:
    if raw is None:
        raise CacheFormatError(url, "is not valid JSON")
    if not isinstance(raw, Mapping) or raw.get("schema_version") != SCHEMA_VERSION:
        version = raw.get("schema_version") if isinstance(raw, Mapping) else None
        raise CacheFormatError(url, f"schema version {version!r}, expected {SCHEMA_VERSION}")
    try:
        marker = Marker.from_dict(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise CacheFormatError(url, f"malformed marker ({type(e).__name__}: {e})") from None
    if marker.fingerprint != fingerprint:
        raise CacheFormatError(url, f"fingerprint {marker.fingerprint!r}, expected {fingerprint!r}")
    if marker.stage != stage:
        raise CacheFormatError(url, f"stage {marker.stage!r}, expected {stage!r}")
    return marker


def find_published(
    store: Store,
    cache_name: str,
    fingerprint: str,
    stages: Sequence[str],
    *,
    meta_dir: str | os.PathLike,
    stats: FetchStats | None = None,
) -> tuple[PublishedCache | None, str]:
    """The complete published cache ``cache_name`` of ``fingerprint``, checked.

    Lists the folder once and reads (stages into ``meta_dir``, verified) the markers
    and the manifest; downloads no data file.

    Returns:
        ``(cache, "")``, or ``(None, why)`` when nothing complete is published there
        (no folder, or a marker missing: never published or an interrupted upload).

    Raises:
        CacheFormatError: every marker is there but the cache is damaged (a marker or
            the manifest malformed, of another fingerprint or schema, not derived from
            the published earlier stage; a listed file missing from the store or of
            another size than its marker and the manifest say); names the file.
        SourceError: the store refused (not found, forbidden).
        StoreUnreachableError: the store did not answer.
    """
    stats = stats or FetchStats()
    url = store.location.cache_url(cache_name)
    listing = store.list_files(cache_name)
    if not listing:
        return None, f"nothing at {url}"
    missing = [marker_name(s) for s in stages if marker_name(s) not in listing]
    if missing:
        return None, f"{url} has no {', '.join(missing)} (an upload unfinished or interrupted)"
    staging = StagingFolder(meta_dir)
    markers: dict[str, Marker] = {}
    for stage in stages:
        name = marker_name(stage)
        raw = _read_meta(store, listing[name], staging, stats)
        marker = _parse_marker(raw, f"{url}/{name}", stage, fingerprint)
        why = derived_from_problem(marker, markers)
        if why is not None:
            raise CacheFormatError(f"{url}/{name}", why)
        markers[stage] = marker
    if MANIFEST_NAME not in listing:
        raise CacheFormatError(
            f"{url}/{MANIFEST_NAME}", "missing although every marker is there (damaged)"
        )
    try:
        manifest = Manifest.from_dict(_read_meta(store, listing[MANIFEST_NAME], staging, stats))
    except (KeyError, TypeError, ValueError) as e:
        raise CacheFormatError(
            f"{url}/{MANIFEST_NAME}", f"malformed manifest ({type(e).__name__}: {e})"
        ) from None
    if manifest.fingerprint != fingerprint:
        raise CacheFormatError(
            f"{url}/{MANIFEST_NAME}",
            f"fingerprint {manifest.fingerprint!r}, expected {fingerprint!r}",
        )
    files: dict[str, RemoteFile] = {}
    for stage, marker in markers.items():
        for entry in marker.files:
            where = f"{url}/{entry.path}"
            published = manifest.files.get(entry.path)
            if published is None:
                raise CacheFormatError(
                    where, f"listed by {marker_name(stage)} but not by {MANIFEST_NAME}"
                )
            if published.size != entry.size:
                raise CacheFormatError(
                    where,
                    f"{marker_name(stage)} says {entry.size} bytes, {MANIFEST_NAME} {published.size}",
                )
            remote = listing.get(entry.path)
            if remote is None:
                raise CacheFormatError(
                    where, f"listed by {marker_name(stage)} but missing from the store"
                )
            if remote.size != entry.size:
                raise CacheFormatError(
                    where,
                    f"has {remote.size} bytes in the store, but {marker_name(stage)} says {entry.size}",
                )
            files[entry.path] = remote
    cache = PublishedCache(
        url=url, name=cache_name, markers=markers, manifest=manifest, files=files
    )
    return cache, ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishedStatus:
    """One folder of a publish location, as ``prebuild_cache.py --status URL`` shows it.

    Attributes:
        name: the folder name (``<name>-<fingerprint>``).
        fingerprint: from the manifest, else the name's suffix.
        state: ``complete``, ``incomplete`` (a marker missing) or ``damaged``.
        rows: rows of the cache (complete ones).
        size_bytes: bytes of its files (complete ones).
        published_at: when (complete ones; seconds since the epoch).
        host: who published it.
        problem: why it is not complete.
    """

    name: str
    fingerprint: str
    state: Literal["complete", "incomplete", "damaged"]
    rows: int | None = None
    size_bytes: int = 0
    published_at: float | None = None
    host: str = ""
    problem: str = ""


def list_published(store: Store, stages: Sequence[str]) -> list[PublishedStatus]:
    """Every cache folder at ``store``'s location, checked like a pull would check it
    (markers, manifest, listed sizes; no data file is read)."""
    out = []
    with tempfile.TemporaryDirectory(prefix="hf_pipeline-status-") as meta:
        for i, name in enumerate(store.list_cache_names()):
            fingerprint = name.rsplit("-", 1)[-1]
            try:
                cache, why = find_published(
                    store, name, fingerprint, stages, meta_dir=Path(meta) / str(i)
                )
            except CacheFormatError as e:
                out.append(
                    PublishedStatus(
                        name=name, fingerprint=fingerprint, state="damaged", problem=str(e)
                    )
                )
                continue
            if cache is None:
                out.append(
                    PublishedStatus(
                        name=name, fingerprint=fingerprint, state="incomplete", problem=why
                    )
                )
                continue
            m = cache.manifest
            out.append(
                PublishedStatus(
                    name=name,
                    fingerprint=m.fingerprint,
                    state="complete",
                    rows=m.rows,
                    size_bytes=m.total_bytes,
                    published_at=m.published_at,
                    host=m.host,
                )
            )
    return out


def new_manifest(
    cache_name: str,
    fingerprint: str,
    markers: Mapping[str, Marker],
    files: Mapping[str, ManifestEntry],
) -> Manifest:
    """The manifest of a cache about to be published from this host, now."""
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
    )
