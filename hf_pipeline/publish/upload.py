"""Publish a built cache to a bucket or a Hub repository (``prebuild_cache.py --publish``).

:func:`publish_cache` copies the complete cache in ``cache_dir`` — its stage markers and
every file they list, nothing else (no lease, heartbeat or unpublished folder) — to
``URL/<name>-<fingerprint>/`` with a ``manifest.json`` of whole-file checksums and the
stream index a streaming reader needs (where each row sits, a checksum per block of rows:
:mod:`hf_pipeline.read.stream.index`). :mod:`hf_pipeline.publish.find` has the layout and
why the order below is safe; :mod:`hf_pipeline.publish.manifest` the manifest;
:mod:`hf_pipeline.stores` the stores:

* GCS: data files in parallel, then the manifest, then the markers (earlier stages
  first); each object is verified after upload (its crc32c against the local file's);
* the Hub: one commit with everything (``HfApi.create_commit``), atomic.

A data file that another complete publication at the same location holds (a re-embed
or an append shares its latents with the cache published before it) is made in the
store instead of uploaded (:mod:`hf_pipeline.publish.copies`): GCS copies the object
inside the store (no byte through this host) and checks the copy like an upload (and
its md5 against the local file's), uploading the file when it does not check out; the
Hub stores an LFS file once per repository, by its sha256. Each publication stays
self-contained (its objects are its own; on GCS they store their bytes again).

Idempotent and resumable: a file the store already holds with the same size and
checksum is not uploaded again (GCS: crc32c; the Hub: sha256 of LFS files, the git blob
id of small ones), so a publish killed half-way re-runs to completion, and a re-run of a
finished one uploads nothing. When the location already holds a complete cache of the
same fingerprint built elsewhere (other lease ids), nothing is uploaded: the published
cache stands, as a published stage does locally.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from dist.checksums import ALGORITHM
from dist.layout import marker_name
from dist.markers import FileEntry, Marker, check_marker, derived_from_problem, read_json
from dist.safepath import shown
from hf_pipeline.cache.layout import STAGES
from hf_pipeline.errors import CacheFormatError, SourceError, StoreUnreachableError
from hf_pipeline.publish.copies import find_copy_sources
from hf_pipeline.publish.find import find_published
from hf_pipeline.publish.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestEntry,
    bytes_digests,
    file_digests_and_whole,
    new_manifest,
    same_content,
)
from hf_pipeline.read.stream.index import DEFAULT_BLOCK_BYTES
from hf_pipeline.stores.base import Upload
from hf_pipeline.stores.factory import open_store
from hf_pipeline.stores.fetch_stats import FetchStats
from hf_pipeline.stores.retry import RetryPolicy
from hf_pipeline.stores.staging import StagingFolder, stage_file

if TYPE_CHECKING:  # pragma: no cover
    from hf_pipeline.config import DataConfig

__all__ = ["DamagedCacheError", "PublishReport", "PublishState", "publish_cache"]

logger = logging.getLogger(__name__)

#: What a publication did: uploaded something; found everything already there; or found
#: another build of the same fingerprint published there (left as it is).
PublishState = Literal["published", "unchanged", "already_published"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishReport:
    """What :func:`publish_cache` did.

    Attributes:
        url: the published cache folder.
        state: see :data:`PublishState`.
        files: files of the cache (the markers' files, the manifest and the markers).
        uploaded_files, uploaded_bytes: what went over the network this time.
        copied_files, copied_bytes: files made in the store from another publication's
            copy of the same bytes, not sent (:mod:`hf_pipeline.publish.copies`).
        skipped_files: files the store already held, unchanged, at their path.
        rows, total_bytes: the cache's rows and bytes (its data files).
        seconds: wall time.
    """

    url: str
    state: PublishState
    files: int
    uploaded_files: int
    uploaded_bytes: int
    copied_files: int
    copied_bytes: int
    skipped_files: int
    rows: int | None
    total_bytes: int
    seconds: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class DamagedCacheError(CacheFormatError):
    """A file of the local cache is not what its marker lists: publication refused.

    Attributes:
        path: the local file.
        reason: what differs, and what to run.
    """


def _local_markers(cache_dir: Path, fingerprint: str, stages: Sequence[str]) -> dict[str, Marker]:
    """The cache's markers, every listed file re-checksummed (a damaged local cache is
    never published)."""
    markers: dict[str, Marker] = {}
    for stage in stages:
        path = cache_dir / marker_name(stage)
        marker, why = check_marker(
            path, fingerprint=fingerprint, base_dir=cache_dir, stage=stage, verify=True
        )
        if marker is not None:
            why = derived_from_problem(marker, markers)
        if marker is None or why is not None:
            raise CacheFormatError(str(path), f"not a complete cache to publish: {why}")
        markers[stage] = marker
    return markers


def _listed_entries(markers: dict[str, Marker]) -> dict[str, tuple[str, FileEntry]]:
    """Every file the markers list: ``{path: (stage, entry)}`` (the first stage that lists
    it; one whose entry has a whole-file checksum wins)."""
    out: dict[str, tuple[str, FileEntry]] = {}
    for stage, marker in markers.items():
        for entry in marker.files:
            if entry.path not in out or (
                entry.whole_checksum and not out[entry.path][1].whole_checksum
            ):
                out[entry.path] = (stage, entry)
    return out


def _verified_digests(
    cache_dir: Path, stage: str, entry: FileEntry, *, sha256: bool
) -> ManifestEntry:
    """The manifest's digests of a listed file, from one read that also computes its
    whole-file checksum and compares it with the marker's (schema 1: nothing to compare).

    Raises:
        DamagedCacheError: the bytes are not those the marker lists.
    """
    path = cache_dir / entry.path
    digests, whole = file_digests_and_whole(path, sha256=sha256, whole=bool(entry.whole_checksum))
    if digests.size != entry.size:
        problem = f"{digests.size} bytes read, but {marker_name(stage)} lists {entry.size}"
    elif whole != entry.whole_checksum:
        problem = f"{ALGORITHM} {whole}, but {marker_name(stage)} lists {entry.whole_checksum}"
    else:
        return digests
    # Commands to run as written: with the cache's root (without it they look at the
    # default root), and no "build it again": a build of the config finds the cache
    # (complete by its markers) until `clean` removes it (outside tester).
    root = shlex.quote(str(cache_dir.absolute().parent))
    raise DamagedCacheError(
        str(path),
        f"{problem}: the local cache is damaged, nothing was uploaded; run `hf-pipeline "
        f"verify --cache-dir {root}` (it marks the cache corrupt, and a damaged stored "
        f"part with it), then `hf-pipeline clean --cache-dir {root}` (it removes them; "
        "the sound parts stay), then publish again: its build makes the damaged part anew",
    )


def _identity(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


def _check_unchanged(cache_dir: Path, stream: dict, before: dict[str, tuple[int, int, int]]):
    """Raise DamagedCacheError if a file the stream index covers is not one verified, or
    changed since it was (the index's block digests would not be the verified bytes')."""
    indexed = {r for column in stream.get("columns", {}).values() for r in column.get("files", ())}
    for rel in sorted(indexed | set(before)):
        path = cache_dir / rel
        if rel not in before:
            raise DamagedCacheError(str(path), "in the stream index, but no marker lists it")
        if _identity(path) != before[rel]:
            raise DamagedCacheError(
                str(path),
                "changed while it was being published (its size, mtime or inode); nothing "
                "was uploaded: publish again once nothing writes to the cache",
            )


def publish_cache(
    cache_dir: str | os.PathLike,
    fingerprint: str,
    url: str,
    *,
    data_config: DataConfig,
    stages: Sequence[str] = STAGES,
    policy: RetryPolicy | None = None,
    stream_block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> PublishReport:
    """Publish the complete cache in ``cache_dir`` to ``url/<cache folder name>/``.

    Args:
        cache_dir: a built cache (every stage marker valid).
        fingerprint: its identity.
        url: ``gs://<bucket>[/<prefix>]`` or ``hf://datasets/<org>/<repo>[@<branch>][/<path>]``
            (the Hub repository must exist).
        data_config: retries, timeouts and ``download_workers`` (parallel uploads).
        stages: the stage names, in build order.
        policy: override the retry policy.
        stream_block_bytes: target bytes of one checksum block of the stream index
            (whole rows; the unit of a streaming reader's ranged reads).

    Returns:
        What was done.

    Raises:
        DamagedCacheError: a listed file's bytes are not those its marker lists (the
            whole-file checksum, read once with the manifest's digests) or changed while
            being published; raised before anything is uploaded.
        CacheFormatError: the local cache is incomplete or damaged, or the location
            holds a damaged cache of this fingerprint (names the file; remove it).
        SourceError: a malformed URL, a URL that is a published cache folder (not a
            location), or the store refused (not found, forbidden).
        StoreUnreachableError: the store did not answer after every retry.
    """
    t0 = time.monotonic()
    cache_dir = Path(cache_dir)
    name = cache_dir.name
    markers = _local_markers(cache_dir, fingerprint, stages)
    unverifiable = [s for s, m in markers.items() if any(not e.whole_checksum for e in m.files)]
    if unverifiable:
        # Schema 1: only the edge checksums (checked above) to compare the bytes with.
        logger.warning(
            "%s: no whole-file checksums (schema 1 markers: %s): its files are published "
            "as read, not compared whole; rebuild or pull it to get them",
            cache_dir, ", ".join(unverifiable),
        )  # fmt: skip
    store = open_store(url, data_config=data_config, policy=policy)
    _refuse_a_cache_folder(store, stages)
    cache_url = store.location.cache_url(name)
    existing = store.list_files(name)
    hub = store.kind == "hub"
    workers = data_config.download_workers

    marker_bytes = {s: (cache_dir / marker_name(s)).read_bytes() for s in stages}
    marker_items = [
        Upload(rel=marker_name(s), local=b, entry=bytes_digests(b, sha256=hub))
        for s, b in marker_bytes.items()
    ]
    with tempfile.TemporaryDirectory(prefix="hf_pipeline-publish-") as meta:
        if all(marker_name(s) in existing for s in stages) and not all(
            same_content(existing[i.rel], i.entry, i.local) for i in marker_items
        ):
            # Another build of this fingerprint is published there: it stands (as the
            # first publication of a stage does locally), if it is intact.
            try:
                other, why = find_published(store, name, fingerprint, stages, meta_dir=meta)
            except CacheFormatError as e:
                raise CacheFormatError(
                    e.path, f"{e.reason}; remove {cache_url} and publish again"
                ) from None
            if other is None:  # pragma: no cover - listed a moment ago
                raise CacheFormatError(cache_url, why)
            logger.warning(
                "%s: already published (by %s at %s); left as it is",
                cache_url,
                other.manifest.host,
                time.strftime("%Y-%m-%d %H:%M", time.localtime(other.manifest.published_at)),
            )
            return _report(
                cache_url, "already_published", other.manifest, [], set(), len(existing), t0
            )

        listed = _listed_entries(markers)
        rels = sorted(listed)
        before = {r: _identity(cache_dir / r) for r in rels}
        with ThreadPoolExecutor(
            max(1, min(workers, len(rels) or 1)), thread_name_prefix="hf_pipeline-digest"
        ) as pool:
            digests = dict(
                zip(
                    rels,
                    pool.map(lambda r: _verified_digests(cache_dir, *listed[r], sha256=hub), rels),
                    strict=True,
                )
            )
        # Built from the files just verified (a second read of their rows, from the page
        # cache): a file changed since its verification (its size, mtime or inode moved)
        # is refused rather than indexed with other bytes than the manifest's.
        stream = _stream_index(cache_dir, markers, stream_block_bytes)
        _check_unchanged(cache_dir, stream, before)
        manifest = _manifest(store, existing, name, fingerprint, markers, digests, meta, stream)
        manifest_bytes = manifest.to_bytes()
        manifest_item = Upload(
            rel=MANIFEST_NAME, local=manifest_bytes, entry=bytes_digests(manifest_bytes, sha256=hub)
        )
        data = [Upload(rel=r, local=cache_dir / r, entry=digests[r]) for r in rels]
        tail = [manifest_item, *marker_items]  # the markers last: they make it a cache
        todo_data = [i for i in data if not same_content(existing.get(i.rel), i.entry, i.local)]
        if todo_data:
            sources = find_copy_sources(
                store, name, stages, {i.rel: (listed[i.rel][1], i.entry) for i in todo_data},
                meta_dir=Path(meta) / "sources",
            )  # fmt: skip
            todo_data = [dataclasses.replace(i, copy_from=sources.get(i.rel)) for i in todo_data]
        todo_tail = [i for i in tail if not same_content(existing.get(i.rel), i.entry, i.local)]
        todo = [*todo_data, *todo_tail]
        # Published files of this build whose bytes differ from the local ones: changed
        # or damaged in the store. Uploading them again repairs the copy; said, because
        # someone changed the store.
        replaced = [i.rel for i in todo_data if existing.get(i.rel) is not None]
        if replaced:
            logger.warning(
                "%s: %d published file(s) differ from this cache's and are uploaded again "
                "(changed or damaged in the store): %s%s",
                cache_url, len(replaced), ", ".join(shown(r) for r in replaced[:5]),
                " ..." if len(replaced) > 5 else "",
            )  # fmt: skip
        logger.info(
            "publishing %s: %d of %d files to write (%.1f MB), %d of them (%.1f MB) by a "
            "copy in the store from another publication there",
            cache_url, len(todo), len(data) + len(tail), sum(i.entry.size for i in todo) / 1e6,
            sum(1 for i in todo if i.copy_from), sum(i.entry.size for i in todo if i.copy_from) / 1e6,
        )  # fmt: skip
        copied = store.upload(name, todo_data, todo_tail, workers=workers)
        # Read it back as a pull would (a fresh store: the Hub has a new commit).
        check = open_store(url, data_config=data_config, policy=policy)
        got, why = find_published(check, name, fingerprint, stages, meta_dir=Path(meta) / "check")
        if got is None:
            raise CacheFormatError(cache_url, f"not readable after publishing: {why}")
        state: PublishState = "published" if todo else "unchanged"
        return _report(
            cache_url, state, manifest, todo, copied, len(data) + len(tail) - len(todo), t0
        )


def _refuse_a_cache_folder(store, stages: Sequence[str]) -> None:
    """Refuse a location that is itself a published cache folder (its manifest or first
    marker is right there): publishing into it made ``<folder>/<folder>/`` and uploaded
    everything again. Any folder without them (named like a cache or not) is a location.

    Raises:
        SourceError: it is one; names its parent location.
    """
    where = store.location.url
    for rel in (MANIFEST_NAME, marker_name(stages[0])):
        try:
            store.source.stat(f"{where}/{rel}")
        except StoreUnreachableError:
            raise
        except SourceError:  # not there (or not readable: the publish says so itself)
            continue
        raise SourceError(
            where,
            f"is a published cache folder (its {rel} is there): publish to its parent "
            f"location {where.rsplit('/', 1)[0]}",
        )


def _stream_index(cache_dir: Path, markers: dict[str, Marker], block_bytes: int) -> dict:
    """The stream index of the local cache (:mod:`hf_pipeline.read.stream.index`): where
    each row of the files the markers list sits, and a checksum per block of rows."""
    from hf_pipeline.cache.layout import CacheLayout
    from hf_pipeline.read.stream.index import build_stream_index

    layout = CacheLayout(cache_dir, {stage: m.directory for stage, m in markers.items()})

    def rels(paths: list[Path]) -> list[str]:
        return [p.relative_to(cache_dir).as_posix() for p in paths]

    try:
        latent_dtype = (layout.read_report().get("precision") or {}).get("storage_dtype")
    except FileNotFoundError:
        latent_dtype = None  # built before the report said: float16/float32, read as stored
    files = {
        "rows": rels(layout.rows_files()),
        "embeddings": rels(layout.embedding_files()),
        "indices": rels(layout.indices_files()),
    }
    index = build_stream_index(cache_dir, files, latent_dtype=latent_dtype, block_bytes=block_bytes)
    return index.to_dict()


def _manifest(store, existing, name, fingerprint, markers, digests, meta, stream) -> Manifest:
    """Ours, or the one already published when it describes the same files (so that a
    re-run uploads nothing, not even a new date)."""
    ours = new_manifest(name, fingerprint, markers, digests, stream)
    remote = existing.get(MANIFEST_NAME)
    if remote is None:
        return ours
    try:
        path = stage_file(store.source, remote, StagingFolder(meta), store.policy, FetchStats())
        raw = read_json(path)
        theirs = Manifest.from_dict(raw)
    except (KeyError, TypeError, ValueError):
        return ours  # malformed: ours replaces it (before the markers go up)
    return theirs if theirs.same_files(ours) else ours


def _report(
    url, state, manifest: Manifest, todo: list[Upload], copied: set[str], n_skip, t0
) -> PublishReport:
    sent = [i for i in todo if i.rel not in copied]
    return PublishReport(
        url=url,
        state=state,
        files=len(manifest.files) + 1 + len(manifest.stages),
        uploaded_files=len(sent),
        uploaded_bytes=sum(i.entry.size for i in sent),
        copied_files=len(todo) - len(sent),
        copied_bytes=sum(i.entry.size for i in todo if i.rel in copied),
        skipped_files=n_skip,
        rows=manifest.rows,
        total_bytes=manifest.total_bytes,
        seconds=time.monotonic() - t0,
    )
