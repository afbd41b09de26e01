"""Files another publication beside a cache already holds: made in the store, not uploaded.

A re-embedded or appended cache is another fingerprint, so another folder, yet most of
its bytes (the latents, the captions) are files a cache already published at the same
location holds. Before uploading, :func:`hf_pipeline.publish.upload.publish_cache` asks
:func:`find_copy_sources` which of the files to upload another complete publication
under the same base URL lists with the same content; the store then makes those from
the file it already holds (:meth:`hf_pipeline.stores.base.Store.upload`: GCS copies the
object inside the store and checks the copy; the Hub stores an LFS file once per
repository by its sha256).

The other publications are foreign input, read as a pull reads one
(:func:`~hf_pipeline.publish.find.find_published`: their markers and manifest staged,
bounded and parsed strictly, every listed file's size and the store's own checksum
compared with the manifest). A damaged one is no source (a warning says why). A file
matches only with the same size, the same whole-file checksum in its marker
(:data:`dist.checksums.ALGORITHM`) as the local marker's, and the same store checksum
(GCS crc32c, Hub LFS sha256) in the store's listing and in its manifest as the local
file's verified digests. A match is a hint, not trusted by itself: GCS checks what its
copy made against the local file and uploads it when the copy does not check out.

Bounded: at most :data:`MAX_SOURCES` other publications are read (those of the same
cache name first, then the others, in name order), each one listing and three small
JSON files of at most :data:`dist.markers.MAX_JSON_BYTES`, at most
:data:`MAX_SOURCE_META_BYTES` in all; the search stops once every file has a source.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from dist.markers import FileEntry
from dist.safepath import UnsafePathError, check_name, shown
from hf_pipeline.errors import CacheFormatError, SourceError
from hf_pipeline.publish.find import cache_folder_fingerprint, find_published
from hf_pipeline.publish.manifest import ManifestEntry
from hf_pipeline.stores.base import Store
from hf_pipeline.stores.fetch_stats import FetchStats
from hf_pipeline.stores.remote_file import RemoteFile

__all__ = ["MAX_SOURCES", "MAX_SOURCE_META_BYTES", "find_copy_sources"]

logger = logging.getLogger(__name__)

#: Other publications read at most, per publish.
MAX_SOURCES = 16
#: Bytes of their markers and manifests read at most, per publish (a manifest carries
#: the stream index: a few MB for a TB-sized cache).
MAX_SOURCE_META_BYTES = 256 << 20

#: (size, whole-file checksum, store checksum kind, its value): what makes two files one.
_Key = tuple[int, str, str, str]


def _keys(entry: FileEntry, digests: ManifestEntry) -> list[_Key]:
    """The keys a local file can be matched by (none without a whole-file checksum)."""
    if not entry.whole_checksum:
        return []
    return [
        (entry.size, entry.whole_checksum, kind, value)
        for kind in ("crc32c", "sha256")
        if (value := digests.checksum(kind))
    ]


def _candidates(store: Store, cache_name: str) -> list[tuple[str, str]]:
    """``(folder, fingerprint)`` of the other cache folders at the location, those of the
    same cache name first, at most :data:`MAX_SOURCES`."""
    stem = cache_name.rsplit("-", 1)[0]
    out = []
    for name in store.list_cache_names():
        fingerprint = cache_folder_fingerprint(name)
        if fingerprint is None or name == cache_name:
            continue
        try:
            check_name(name)
        except UnsafePathError:
            continue  # a forged name: `--status` shows it as damaged
        out.append((name, fingerprint))
    out.sort(key=lambda nf: (nf[0].rsplit("-", 1)[0] != stem, nf[0]))
    return out[:MAX_SOURCES]


def find_copy_sources(
    store: Store,
    cache_name: str,
    stages: Sequence[str],
    wanted: Mapping[str, tuple[FileEntry, ManifestEntry]],
    *,
    meta_dir: str | os.PathLike,
) -> dict[str, RemoteFile]:
    """A file of another complete publication at ``store``'s location for each file of
    ``wanted`` that one holds (see the module docstring for what makes a match).

    Args:
        store: the publish location.
        cache_name: the folder being published (not a source of its own files).
        stages: the stage names, in build order.
        wanted: the files to upload, ``{path: (its local marker entry, its verified
            digests)}``.
        meta_dir: where the other publications' markers and manifests are staged.

    Returns:
        ``{path: the other publication's file, as the store lists it}``.

    Raises:
        SourceError: the location cannot be listed (a publication that cannot be read
            is skipped, said in a warning).
    """
    by_key: dict[_Key, list[str]] = {}
    for rel, (entry, digests) in wanted.items():
        for key in _keys(entry, digests):
            by_key.setdefault(key, []).append(rel)
    found: dict[str, RemoteFile] = {}
    if not by_key:
        return found
    stats = FetchStats()
    for i, (name, fingerprint) in enumerate(_candidates(store, cache_name)):
        if len(found) == len(wanted) or stats.bytes >= MAX_SOURCE_META_BYTES:
            break
        try:
            other, _ = find_published(
                store, name, fingerprint, stages, meta_dir=Path(meta_dir) / str(i), stats=stats
            )
        except (CacheFormatError, SourceError) as e:
            logger.warning("%s: not a source of copies: %s", store.location.cache_url(name), e)
            continue
        if other is None:  # incomplete: an upload unfinished
            continue
        for marker in other.markers.values():
            for entry in marker.files:
                remote, published = other.files[entry.path], other.manifest.files[entry.path]
                kind, _, value = remote.checksum.partition(":")
                if not (value and entry.whole_checksum) or published.checksum(kind) != value:
                    continue
                for rel in by_key.get((entry.size, entry.whole_checksum, kind, value), ()):
                    found.setdefault(rel, remote)
    if found:
        logger.info(
            "%s: %d file(s) of %d found in other publications there: %s%s",
            store.location.cache_url(cache_name), len(found), len(wanted),
            ", ".join(shown(r) for r in sorted(found)[:3]), " ..." if len(found) > 3 else "",
        )  # fmt: skip
    return found
