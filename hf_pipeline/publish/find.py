"""A published cache: what makes a store's folder one, and reading it back checked.

``scripts/prebuild_cache.py --publish URL`` (:mod:`hf_pipeline.publish.upload`) copies a built
cache to ``URL/<name>-<fingerprint>/``; ``build.pull_from`` (:mod:`hf_pipeline.publish.pull`)
downloads it instead of building it. A published cache holds, at the same paths
relative to the cache folder as on disk::

    every file a stage marker lists   whatever folders they are in: the markers, not
                                      folder names, say what a cache is
    manifest.json                     whole-file checksums, rows, bytes, date
                                      (hf_pipeline.publish.manifest)
    converted.json, filtered.json     the stage markers (dist.markers), byte for byte

*Complete or absent.* An object store shows a folder filling one object at a time, so
the publisher uploads the data files first, then the manifest, then the markers
(earlier stages first): a folder with every marker is complete, one missing a marker is
"not published" (yet, or an interrupted upload). On the Hub one commit holds all
(atomic). A folder whose markers are all there but disagree with each other, with the
manifest or with the store is *damaged*: :func:`find_published` raises
:class:`~hf_pipeline.errors.CacheFormatError` naming the file.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from dist.layout import marker_name, parse_stage_dir
from dist.markers import (
    MAX_JSON_BYTES,
    ForeignJSONError,
    Marker,
    derived_from_problem,
    load_json,
    schema_problem,
)
from dist.safepath import UnsafePathError, check_name, shown
from hf_pipeline.errors import CacheFormatError
from hf_pipeline.publish.manifest import MANIFEST_NAME, Manifest
from hf_pipeline.stores.base import Store
from hf_pipeline.stores.fetch_stats import FetchStats
from hf_pipeline.stores.remote_file import RemoteFile
from hf_pipeline.stores.staging import StagingFolder, stage_file

__all__ = [
    "PublishedCache",
    "PublishedStatus",
    "cache_folder_fingerprint",
    "cache_folder_names",
    "find_published",
    "list_published",
    "store_checksum_checked",
]

_CACHE_NAME = re.compile(r"-[0-9a-f]{16}\Z")  # \Z: "$" also matches before a final "\n"


def cache_folder_fingerprint(name: str) -> str | None:
    """The fingerprint a folder named ``<name>-<16 hex digits>`` is for, or None when the
    name is not a cache folder's (a store lists it: foreign, not yet checked for unsafe
    characters)."""
    return name.rsplit("-", 1)[-1] if _CACHE_NAME.search(name) else None


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


def _read_meta(
    store: Store, file: RemoteFile, url: str, staging: StagingFolder, stats: FetchStats
) -> Any:
    """A small JSON file of the store, staged (verified) first, parsed with the bounds of
    :func:`dist.markers.parse_json`; never downloads more than ``MAX_JSON_BYTES``.

    Raises:
        CacheFormatError: too large (by the listing, before any download), too deeply
            nested or not JSON; names ``url``.
    """
    if file.size > MAX_JSON_BYTES:
        raise CacheFormatError(url, f"is {file.size} bytes, more than {MAX_JSON_BYTES} (refused)")
    try:
        return load_json(stage_file(store.source, file, staging, store.policy, stats))
    except ForeignJSONError as e:
        reason = "is not valid JSON" if e.reason.startswith("malformed JSON") else e.reason
        raise CacheFormatError(url, reason) from None


def _parse_marker(raw: Any, url: str, stage: str, fingerprint: str) -> Marker:
    if not isinstance(raw, Mapping):
        raise CacheFormatError(url, "is not a JSON object")
    if schema_problem(raw):  # older published markers are read too (no whole checksums)
        raise CacheFormatError(url, str(schema_problem(raw)))
    try:
        marker = Marker.from_dict(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise CacheFormatError(url, f"malformed marker ({type(e).__name__}: {e})") from None
    if marker.fingerprint != fingerprint:
        raise CacheFormatError(url, f"fingerprint {marker.fingerprint!r}, expected {fingerprint!r}")
    if marker.stage != stage:
        raise CacheFormatError(url, f"stage {marker.stage!r}, expected {stage!r}")
    # The puller places files by their path inside the stage folder: a folder that is not
    # this stage's, or a file outside it, would land a level too deep (and be found
    # missing only when training opens the cache).
    folder = parse_stage_dir(marker.directory)
    if marker.directory != stage and (folder is None or folder.stage != stage):
        raise CacheFormatError(
            url, f"directory {shown(marker.directory)} is not a {stage!r} stage folder"
        )
    for entry in marker.files:
        if not entry.path.startswith(marker.directory + "/"):
            raise CacheFormatError(
                url, f"lists {shown(entry.path)} outside its folder {marker.directory!r}"
            )
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
        raw = _read_meta(store, listing[name], f"{url}/{name}", staging, stats)
        marker = _parse_marker(raw, f"{url}/{name}", stage, fingerprint)
        why = derived_from_problem(marker, markers)
        if why is not None:
            raise CacheFormatError(f"{url}/{name}", why)
        markers[stage] = marker
    if MANIFEST_NAME not in listing:
        raise CacheFormatError(
            f"{url}/{MANIFEST_NAME}", "missing although every marker is there (damaged)"
        )
    raw = _read_meta(store, listing[MANIFEST_NAME], f"{url}/{MANIFEST_NAME}", staging, stats)
    try:
        manifest = Manifest.from_dict(raw)
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
            # The listing carries the store's checksum: a file changed in place (same
            # size) is found here too, without reading it.
            store_checksum_checked(published, remote)
            files[entry.path] = remote
    # Every size the manifest states is then one the store's listing confirmed: an entry
    # no marker lists was trusted by the stream index, whose rows it bounds (an
    # adversarial tester: a fake 1 TiB entry made a stream allocate 64 GiB at open).
    extra = sorted(set(manifest.files) - set(files))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CacheFormatError(
            f"{url}/{MANIFEST_NAME}",
            f"lists {shown(extra[0])}{more}, which no stage marker lists (damaged or tampered)",
        )
    cache = PublishedCache(
        url=url, name=cache_name, markers=markers, manifest=manifest, files=files
    )
    return cache, ""


def store_checksum_checked(published, file: RemoteFile) -> bool:
    """Compare the store's listed checksum of ``file`` with the manifest's entry
    (``published``); True when the manifest has that kind, so it covers the whole file.

    Raises:
        CacheFormatError: they differ: the file changed after it was published.
    """
    kind, _, value = file.checksum.partition(":")
    ours = published.checksum(kind) if value else ""
    if not ours:
        return False
    if ours != value:
        raise CacheFormatError(
            file.url,
            f"the store's {kind} is {value}, but {MANIFEST_NAME} says {ours}: "
            "the file changed after it was published",
        )
    return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishedStatus:
    """One folder of a publish location, as ``prebuild_cache.py --status URL`` shows it.

    Attributes:
        name: the folder name (``<name>-<fingerprint>``).
        fingerprint: from the manifest, else the name's suffix.
        state: ``complete``, ``incomplete`` (a marker missing) or ``damaged``.
        rows: rows of the cache (complete ones; None otherwise).
        size_bytes: bytes of its files (complete ones; None otherwise: unknown).
        published_at: when (complete ones; seconds since the epoch).
        host: who published it.
        problem: why it is not complete.
    """

    name: str
    fingerprint: str
    state: Literal["complete", "incomplete", "damaged"]
    rows: int | None = None
    size_bytes: int | None = None
    published_at: float | None = None
    host: str = ""
    problem: str = ""


def cache_folder_names(store: Store) -> list[str]:
    """The folders at ``store``'s location named like a cache folder (``<name>-<16 hex
    digits>``), sorted; none is checked (:func:`list_published` checks them)."""
    return [n for n in store.list_cache_names() if cache_folder_fingerprint(n)]


def list_published(store: Store, stages: Sequence[str]) -> list[PublishedStatus]:
    """Every cache folder (``<name>-<16 hex digits>``) at ``store``'s location, checked
    like a pull would check it (markers, manifest, listed sizes; no data file is read).
    Other folders there are not listed."""
    out = []
    names = cache_folder_names(store)
    with tempfile.TemporaryDirectory(prefix="hf_pipeline-status-") as meta:
        for i, name in enumerate(names):
            fingerprint = name.rsplit("-", 1)[-1]
            try:
                check_name(name)
            except UnsafePathError as e:  # "x\nERROR ...-<fp>": a forged line, not a cache
                out.append(
                    PublishedStatus(
                        name=shown(name), fingerprint=fingerprint, state="damaged",
                        problem=f"{store.location.url}: {e}",
                    )
                )  # fmt: skip
                continue
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
