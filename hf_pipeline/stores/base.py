"""The two interfaces a kind of store implements, and their shared logic.

:class:`Source` is the read side (shard inputs, and the bytes of a published cache).
What all kinds share lives here: the shard listing rules (natural order, names that
must be row ranges, missing shards under ``data.on_missing``), metadata discovery,
sibling sources for a metadata file in another store, and the staging of a file that
cannot be read in place. A kind (:mod:`~hf_pipeline.stores.local`,
:mod:`~hf_pipeline.stores.gcs`, :mod:`~hf_pipeline.stores.hub`) implements the hooks
listed in :class:`Source` and declares the URL scheme it serves; :func:`make_source`
picks the kind for a location.

:class:`Store` is the write side: a :class:`PublishLocation` where caches are published
(listing and :meth:`Store.upload`). A kind that can hold published caches subclasses it
in the same module, with the scheme of its locations; :func:`store_class` picks it.
"""

from __future__ import annotations

import abc
import dataclasses
import fnmatch
import hashlib
import logging
import os
import re
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from dist.safepath import UnsafePathError, check_relpath
from hf_pipeline.cache.layout import STAGING_DIR
from hf_pipeline.config import default_cache_root
from hf_pipeline.errors import CacheFormatError, SourceError
from hf_pipeline.stores.fetch_stats import FetchStats
from hf_pipeline.stores.remote_file import RemoteFile
from hf_pipeline.stores.retry import Cancelled, RetryPolicy
from hf_pipeline.stores.staging import StagingFolder, stage_file

if TYPE_CHECKING:  # pragma: no cover
    from hf_pipeline.config import DataConfig
    from hf_pipeline.publish.manifest import ManifestEntry

__all__ = [
    "GLOB_CHARS",
    "SHARD_SUFFIX",
    "PublishLocation",
    "Source",
    "Store",
    "Upload",
    "filter_by_glob",
    "make_source",
    "natural_key",
    "parse_location",
    "publish_schemes",
    "split_name_glob",
    "store_class",
]

logger = logging.getLogger(__name__)

SHARD_SUFFIX = ".pt"
#: What a shard found by listing a folder must be called: its row range
#: (``000000-000009.pt``). Any other ``*.pt`` there (``latest.pt``) is refused; a glob
#: the user writes may name any file.
_SHARD_NAME = re.compile(r"\d+-\d+\.pt")
#: Characters that make a location's file name part a glob.
GLOB_CHARS = re.compile(r"[*?\[]")


def natural_key(name: str) -> tuple:
    """Sort key ordering ``000010-000019.pt`` after ``000000-000009.pt`` by number.

    Numbers compare as integers, so unpadded names (``9-9.pt`` < ``10-19.pt``) sort
    right too; the text breaks ties.
    """
    return tuple(int(n) for n in re.findall(r"\d+", Path(name).name)), name


def split_name_glob(location: str, path: str) -> tuple[str, str]:
    """``"a/b/0*.pt"`` -> ``("a/b", "0*.pt")``; ``"a/b"`` -> ``("a/b", "")``.

    Raises:
        SourceError: a pattern outside the file name part (stores list one folder).
    """
    folder, _, name = path.rpartition("/")
    if GLOB_CHARS.search(folder):
        raise SourceError(
            location, "a pattern may only stand in the file name part (<folder>/<pattern>)"
        )
    return (folder, name) if GLOB_CHARS.search(name) else (path, "")


def filter_by_glob(files: list[RemoteFile], pattern: str) -> list[RemoteFile]:
    """The files whose name matches ``pattern`` (all of them for ``""``)."""
    if not pattern:
        return files
    # Like a shell glob: "*" does not match a leading dot (partial downloads).
    return [
        f
        for f in files
        if fnmatch.fnmatchcase(f.name, pattern) and (pattern.startswith(".") or f.name[:1] != ".")
    ]


def _is_meta(name: str) -> bool:
    return name.lower().endswith(".parquet") and "meta" in name.lower()


def _pick_metadata(candidates: list[RemoteFile], where: str) -> RemoteFile | None:
    if not candidates:
        return None
    if len(candidates) > 1:
        # Full locations: the candidates may sit in different folders (shards, root).
        names = ", ".join(sorted(c.url for c in candidates))
        raise SourceError(
            where, f"several metadata candidates ({names}); set data.metadata to one of them"
        )
    return candidates[0]


#: URL scheme ("gs://", "hf://"; "" for plain paths) -> the kind serving it.
_KINDS: dict[str, type[Source]] = {}


def staging_root(staging_dir: str | os.PathLike | None, cache_root: Path) -> tuple[Path, Path]:
    """The folder downloads go below, and the user's folder it lies in (see
    :attr:`Source.staging_base`: it may be a link, what hf_pipeline makes below it may
    not): ``data.staging_dir`` (``staging_dir``) itself when set, else
    ``<cache_root>/.staging`` in the cache root. Sources and builds each stage in a
    folder of their own below it (:func:`staging_place`; a build per identity)."""
    if staging_dir:
        base = Path(staging_dir).expanduser()
        return base, base
    return cache_root / STAGING_DIR, cache_root


def staging_place(
    location: str, staging_dir: str | os.PathLike | None, cache_root: Path
) -> tuple[Path, Path]:
    """Where a source of ``location`` stages its downloads, and the user's folder that
    lies in: a folder of its own per location (16 hex digits of its SHA-1) below
    :func:`staging_root`. Two sources never share one: two buckets whose shards have
    the same names, staged into one flat ``data.staging_dir``, took each other's files
    (a build waited forever for one the other had replaced)."""
    root, base = staging_root(staging_dir, cache_root)
    return root / hashlib.sha1(location.encode()).hexdigest()[:16], base


class Source(abc.ABC):
    """A place holding shard files and (usually) the metadata parquet.

    Listing is done once and cached on the instance (thread-safe). Instances pickle
    without their network handles, which are rebuilt lazily in the new process (forked
    ``datasets`` workers must not share an event loop or connection pool).

    A kind subclasses with the scheme it serves (``class GCSSource(Source,
    scheme="gs://")``; ``scheme=""`` for plain paths) and implements the hooks:

    * :meth:`list_shard_folder` (abstract): the files at the shard location.
    * :meth:`metadata_folders` (abstract): where to look for the metadata parquet.
    * :meth:`stat` (abstract): describe one file by URL.
    * :meth:`owns` (abstract): whether a URL lives in this store.
    * :meth:`direct_path`: a path readable in place, if any (default: none).
    * :meth:`read_range`: the bytes of a file from an offset (remote kinds; staging
      downloads through it).
    * :meth:`fetch_missing`: fetch a file not readable in place (default: stage it
      with :func:`~hf_pipeline.stores.staging.stage_file`).
    * :meth:`unreadable_shards`: entries the listing saw but cannot read.
    * :meth:`drop_handles`: remove network handles from the pickled state.

    and sets :attr:`name_glob` when the location ends in a file name pattern.

    Attributes:
        location: as given to :func:`~hf_pipeline.stores.open_source`.
        is_local: files are readable in place (no staging copy).
        staging_dir: folder for verified downloads of this source.
        staging_base: the user's folder that :attr:`staging_dir` lies in (the cache root
            for the default ``<root>/.staging/<key>``; else ``staging_dir`` itself): it
            may be a symlink, the folders hf_pipeline makes below it may not.
        policy: retry policy for listing and fetching.
        fetch_stats: this source's counters (listing retries, metadata download,
            shards the listing found missing).
        name_glob: the file name pattern of a location such as ``.../0000*.pt``
            ("" for a folder).
    """

    kind: ClassVar[str] = ""
    is_local: ClassVar[bool] = False
    name_glob: str = ""

    def __init_subclass__(cls, *, scheme: str | None = None, **kw: Any):
        super().__init_subclass__(**kw)
        if scheme is not None:
            _KINDS[scheme] = cls

    def __init__(
        self,
        location: str,
        *,
        data_config: DataConfig,
        policy: RetryPolicy | None = None,
        staging_dir: str | os.PathLike | None = None,
        staging_base: str | os.PathLike | None = None,
    ):
        self.location = location
        self.data_config = data_config
        self.policy = policy or RetryPolicy.from_config(data_config)
        if staging_dir is None:
            staging_dir, staging_base = staging_place(
                location, data_config.staging_dir, default_cache_root()
            )
        self.staging_dir = Path(staging_dir).expanduser()
        self.staging_base = (
            self.staging_dir if staging_base is None else Path(staging_base).expanduser()
        )
        self._lock = threading.Lock()
        self._shards: list[RemoteFile] | None = None
        #: A remote kind's folder listings, per folder (this instance's; not pickled).
        self._listings: dict[str, list[RemoteFile]] = {}
        self._siblings: dict[str, Source] = {}
        self.fetch_stats = FetchStats()

    def with_staging_dir(
        self, staging_dir: str | os.PathLike, *, base: str | os.PathLike | None = None
    ) -> Source:
        """This source (same listing, identity and stats) downloading into ``staging_dir``.

        The build stages into one folder per cache identity, which is known only after
        the listing: it asks for that folder here rather than changing this source.
        ``base``: as :attr:`staging_base` (default ``staging_dir`` itself).
        """
        # Not copy.copy: that goes through __getstate__, which drops the stats and locks
        # (it is for pickling to workers); this clone shares them with the original.
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.staging_dir = Path(staging_dir).expanduser()
        clone.staging_base = clone.staging_dir if base is None else Path(base).expanduser()
        return clone

    @property
    def staging(self) -> StagingFolder:
        """The staging folder (:attr:`staging_dir`, its parts below :attr:`staging_base`
        proven real folders before anything is written there)."""
        return StagingFolder(self.staging_dir, base=self.staging_base)

    def __getstate__(self):
        # For the join's workers (StagingClient), which fetch the files they are given
        # and never list: without the listing, a source pickles in the same few hundred
        # bytes at any shard count (it was 612 KB at 5,500 shards, pickled with dill's
        # pure-Python pickler into each of the num_proc tasks of every part).
        state = dict(self.__dict__)
        for k in ("_lock", "fetch_stats"):
            state.pop(k, None)
        state["_siblings"] = {}
        state["_shards"] = None
        state["_listings"] = {}
        return self.drop_handles(state)

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self.fetch_stats = FetchStats()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"

    # -- public API
    def list_shards(self) -> list[RemoteFile]:
        """All ``*.pt`` shards, natural-sorted by their numeric ranges.

        Listing a folder takes only files named by their row range
        (``000000-000009.pt``) and refuses any other ``*.pt`` there (hidden ones too); a
        location with a glob in its file name part (``.../0*.pt``, ``.../*.pt``) takes
        what the glob matches (as a shell does: not names starting with "."). A shard
        the listing finds but cannot read (a dangling symlink, a symlink loop, a folder,
        a fifo) is a missing shard: an error under ``data.on_missing: fail``, else
        recorded in ``fetch_stats.skipped`` (and so in the build report).

        Returns:
            The shards (cached after the first call).

        Raises:
            SourceError: the location cannot be listed, holds no shards, holds
                ``*.pt`` files not named by a row range, or a missing shard under
                ``on_missing: fail``.
            StoreUnreachableError: the store did not answer after every retry.
        """
        with self._lock:
            if self._shards is None:
                files = [f for f in self.list_shard_folder() if f.name.endswith(SHARD_SUFFIX)]
                missing = [m for m in self.unreadable_shards() if m[0].endswith(SHARD_SUFFIX)]
                if not self.name_glob:
                    self._refuse_stray_names([f.name for f in files] + [m[0] for m in missing])
                self._missing_shards(missing)
                if not files:
                    raise SourceError(self.location, f"no *{SHARD_SUFFIX} shards found")
                self._shards = sorted(files, key=lambda f: natural_key(f.name))
            return list(self._shards)

    def find_metadata(self, explicit: str = "") -> RemoteFile:
        """The caption parquet: ``explicit`` if given, else discovered.

        Discovery looks in :meth:`metadata_folders` (next to the shards; for a Hub
        repository or a GCS bucket also at its root, where such datasets keep the
        parquet) and takes the one ``*meta*.parquet`` found there. Two or more, in one
        folder or across them, are refused naming each: nearest-first would pick one
        silently, and which one was meant is for ``data.metadata`` to say.

        Args:
            explicit: a full location (any kind), or a bare file name looked up in the
                same folders (refused when more than one holds it).

        Returns:
            The metadata file.

        Raises:
            SourceError: not found, or several candidates.
        """
        if explicit:
            if (
                "://" in explicit
                or os.path.isabs(explicit)
                or (self.is_local and os.sep in explicit)
            ):
                other = self._sibling_for(explicit)
                return other.stat(explicit)
            hits = [f for folder in self.metadata_folders() for f in folder if f.name == explicit]
            found = _pick_metadata(hits, explicit)
            if found is None:
                raise SourceError(
                    explicit, f"metadata file not found {self.metadata_where} of {self.location}"
                )
            return found
        candidates = [f for folder in self.metadata_folders() for f in folder if _is_meta(f.name)]
        found = _pick_metadata(candidates, self.location)
        if found is None:
            raise SourceError(
                self.location,
                f"no *meta*.parquet found {self.metadata_where}; set data.metadata",
            )
        return found

    def identity(self) -> list[tuple]:
        """``[(name, size, etag), ...]`` of the shards, for the cache fingerprint."""
        return [f.identity() for f in self.list_shards()]

    def fetch_one(self, file: RemoteFile) -> Path:
        """A local verified copy of one file (the metadata parquet), fetched now.

        Local files are returned in place; GCS files are staged (and kept); Hub files go
        through huggingface_hub's own cache, so ``HF_HUB_OFFLINE=1`` finds them later.
        Thread-safe.

        Raises:
            SourceError: the file cannot be fetched after retries.
        """
        owner = self._sibling_for(file.url)
        if owner is not self:
            return owner.fetch_one(file)
        direct = self.direct_path(file)
        if direct is not None:
            return direct
        return self.fetch_missing(file)

    def count_listing_retry(self, exc: BaseException) -> None:
        """``on_retry`` for listing, stat and revision calls: counts them apart."""
        self.fetch_stats.add(listing_retries=1)

    # -- hooks a kind implements
    @abc.abstractmethod
    def list_shard_folder(self) -> list[RemoteFile]:
        """The files at the shard location, filtered by :attr:`name_glob` (unsorted)."""

    #: Where :meth:`metadata_folders` looks, for the messages.
    metadata_where = "next to the shards or at the root"

    @abc.abstractmethod
    def metadata_folders(self) -> Iterator[list[RemoteFile]]:
        """Folders to search for ``*meta*.parquet``, nearest first."""

    @abc.abstractmethod
    def stat(self, url: str) -> RemoteFile:
        """Describe one file of this store.

        Raises:
            SourceError: no such file.
        """

    @abc.abstractmethod
    def owns(self, url: str) -> bool:
        """Whether ``url`` lives in this source's store (else a sibling source reads it)."""

    def direct_path(self, file: RemoteFile) -> Path | None:
        """A path readable in place (local file, Hub cache hit), or None."""
        return None

    def read_range(
        self, file: RemoteFile, offset: int, deadline: float, stop: threading.Event | None
    ) -> Iterator[bytes]:
        """Yield the bytes of ``file`` from ``offset`` on; raise on failure or deadline.

        Called by :func:`~hf_pipeline.stores.staging.stage_file` inside its retry loop, so a
        transient failure may simply raise. Checks ``stop`` (raise
        :class:`~hf_pipeline.stores.retry.Cancelled`) and ``deadline`` (a ``time.monotonic()``
        value; :func:`~hf_pipeline.stores.retry.check_deadline`) between blocks.
        """
        # Only remote stores read ranges; local files are always read in place.
        raise TypeError(f"{type(self).__name__} reads files in place, not by ranges")

    def read_span(self, rel: str, start: int, end: int, deadline: float) -> bytes:
        """Bytes ``[start, end)`` of ``rel`` (a path under this source's location) in one
        ranged request, for streaming a published cache (:mod:`hf_pipeline.read.stream`);
        the remote stores implement it."""
        raise TypeError(f"{type(self).__name__} does not serve ranged reads of a published cache")

    def fetch_missing(self, file: RemoteFile) -> Path:
        """Fetch ``file``, owned here and not readable in place; default: stage it."""
        try:
            return stage_file(self, file, self.staging, self.policy, self.fetch_stats)
        except Cancelled as exc:  # pragma: no cover - no stop event here
            raise SourceError(file.url, "cancelled") from exc

    def unreadable_shards(self) -> list[tuple[str, str, str]]:
        """``(name, url, why)`` of entries the last listing saw but cannot read."""
        return []

    def drop_handles(self, state: dict) -> dict:
        """The pickled ``state`` without handles that must not cross processes."""
        return state

    # -- helpers
    def _refuse_stray_names(self, names: list[str]) -> None:
        stray = sorted((n for n in names if not _SHARD_NAME.fullmatch(n)), key=natural_key)
        if not stray:
            return
        shown = ", ".join(stray[:10]) + (f" and {len(stray) - 10} more" if len(stray) > 10 else "")
        where = self.location.rstrip("/")
        raise SourceError(
            self.location,
            f"{len(stray)} *{SHARD_SUFFIX} file(s) not named by a row range like "
            f"000000-000009{SHARD_SUFFIX}: {shown}; move them out of the folder, or name "
            f"the files you mean with a glob (data.shards: {where}/*{SHARD_SUFFIX} takes "
            "every *.pt file whose name does not start with '.')",
        )

    def _missing_shards(self, missing: list[tuple[str, str, str]]) -> None:
        """Apply ``data.on_missing`` to shards the listing found unreadable."""
        if not missing:
            return
        if self.data_config.on_missing == "fail":
            name, url, why = missing[0]
            more = (
                f" (and {len(missing) - 1} more: {', '.join(m[0] for m in missing[1:])})"
                if len(missing) > 1
                else ""
            )
            raise SourceError(
                url,
                f"missing shard: {why}{more}; fix or remove it, or set data.on_missing: skip "
                "to build without it",
            )
        for name, url, why in missing:
            logger.warning("skipping missing shard %s: %s", url, why)
            self.fetch_stats.add(skipped={"name": name, "url": url, "reason": why})

    def _sibling_for(self, url: str) -> Source:
        """This source if it owns ``url``, else one source per parent folder (cached)."""
        if self.owns(url):
            return self
        parent = url.rsplit("/", 1)[0] if "://" in url else str(Path(url).parent)
        with self._lock:
            if parent not in self._siblings:
                sibling = make_source(
                    parent,
                    data_config=self.data_config,
                    policy=self.policy,
                    staging_dir=self.staging_dir,
                    staging_base=self.staging_base,
                )
                # One set of counters: the metadata's retries belong to this build too.
                sibling.fetch_stats = self.fetch_stats
                self._siblings[parent] = sibling
            return self._siblings[parent]


def make_source(location: str, **kw: Any) -> Source:
    """The kind of :class:`Source` serving ``location``, built with ``kw``; no I/O.

    Raises:
        SourceError: a scheme no kind serves.
    """
    for scheme, cls in _KINDS.items():
        if scheme and location.startswith(scheme):
            return cls(location, **kw)
    if "://" in location:
        raise SourceError(
            location, "unsupported scheme (use a local path, hf://datasets/... or gs://...)"
        )
    # The package's __init__ imports every kind, so plain paths always have one.
    return _KINDS[""](location, **kw)


# --------------------------------------------------------------- the write side


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishLocation:
    """Where published caches live.

    Attributes:
        url: the location, without a trailing slash.
        kind: the store (its :attr:`Store.kind`).
        path: GCS: ``bucket[/prefix]``; the Hub: the folder in the repository ("" for
            its root).
        repo_id: the Hub repository (``org/name``); "" for GCS.
        revision: the Hub branch published to and read from (``main``); "" for GCS.
    """

    url: str
    kind: str
    path: str
    repo_id: str = ""
    revision: str = ""

    def cache_url(self, cache_name: str, rel: str = "") -> str:
        """The URL of cache folder ``cache_name`` (or of ``rel`` inside it)."""
        return f"{self.url}/{cache_name}" + (f"/{rel}" if rel else "")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Upload:
    """One file to publish.

    Attributes:
        rel: path relative to the cache folder.
        local: the local file, or its bytes.
        entry: its digests (:func:`~hf_pipeline.publish.manifest.file_digests`).
        copy_from: a file of another publication in the same store that its checked
            listing says holds these bytes (:mod:`hf_pipeline.publish.copies`), or None:
            the store may make this file from it without uploading, and checks what it
            made (:meth:`Store.upload`).
    """

    rel: str
    local: Path | bytes
    entry: ManifestEntry
    copy_from: RemoteFile | None = None


#: URL scheme of a publish location ("gs://", "hf://datasets/") -> the kind serving it.
_STORES: dict[str, type[Store]] = {}


class Store(abc.ABC):
    """The store of one :class:`PublishLocation`, through its own client library.

    A kind subclasses with the scheme of its locations (``class GCSStore(Store,
    scheme="gs://")``) and implements :meth:`parse_location`, :meth:`source_location`,
    :meth:`_list_files`, :meth:`list_cache_names` and :meth:`upload` (and
    :meth:`check_location` if the location can be checked before a build).

    Every call goes through :func:`~hf_pipeline.stores.retry.with_retries`. Thread-safe for
    listing and reading; one :meth:`upload` at a time.

    Attributes:
        location: where.
        policy: retries and per-file timeout.
        source: reads files by range (:func:`~hf_pipeline.stores.staging.stage_file`'s reader).
    """

    kind: ClassVar[str] = ""
    #: The form of a location, for the error that names the accepted ones.
    location_form: ClassVar[str] = ""

    def __init_subclass__(cls, *, scheme: str | None = None, **kw: Any):
        super().__init_subclass__(**kw)
        if scheme is not None:
            _STORES[scheme] = cls

    def __init__(self, location: PublishLocation, source: Source, policy: RetryPolicy):
        self.location = location
        self.source = source
        self.policy = policy

    @classmethod
    @abc.abstractmethod
    def parse_location(cls, url: str) -> PublishLocation | None:
        """The location ``url`` (which starts with this kind's scheme, and has no trailing
        slash) names, or None when it is malformed."""

    @classmethod
    @abc.abstractmethod
    def source_location(cls, location: PublishLocation) -> str:
        """The location of the :class:`Source` that reads this store's files."""

    def check_location(self) -> None:  # noqa: B027 - a store without a check: nothing to do
        """Raise :class:`SourceError` if the location cannot hold caches (GCS: no such
        bucket), before a build whose publish or pull would fail on it."""

    def list_files(self, cache_name: str) -> dict[str, RemoteFile]:
        """Every file under cache folder ``cache_name``, by path relative to it ({} when
        there is no such folder). Zero-byte objects named ``<folder>/`` (folder
        placeholders) are left out.

        Raises:
            CacheFormatError: the store lists a path that is not a plain relative path
                (``a//b``, ``..``, a newline...: :func:`dist.safepath.check_relpath`);
                someone wrote it there, and no file of a cache has such a name.
        """
        listing = {
            rel: file
            for rel, file in self._list_files(cache_name).items()
            # A zero-byte "<folder>/" object is what the GCS console's "Create folder"
            # makes: a folder placeholder, no file of the cache. Only empty ones: bytes
            # under such a name are still refused below.
            if not ((rel == "" or rel.endswith("/")) and file.size == 0)
        }
        for rel in listing:
            try:
                check_relpath(rel)
            except UnsafePathError as e:
                raise CacheFormatError(self.location.cache_url(cache_name), str(e)) from None
        return listing

    @abc.abstractmethod
    def _list_files(self, cache_name: str) -> dict[str, RemoteFile]:
        """:meth:`list_files`, unchecked."""

    @abc.abstractmethod
    def list_cache_names(self) -> list[str]:
        """The folders directly under the location (sorted)."""

    @abc.abstractmethod
    def upload(
        self, cache_name: str, data: Sequence[Upload], tail: Sequence[Upload], *, workers: int
    ) -> set[str]:
        """Upload ``data`` (any order, in parallel), then ``tail`` in its order, into
        cache folder ``cache_name``; every upload is verified against its digests.

        An item with :attr:`Upload.copy_from` may be made in the store from that file
        instead (GCS: a server-side copy, verified as an upload is, and uploaded when it
        does not check out; the Hub: the LFS object of that sha256 the repository
        already stores). Each file written is the repository's or bucket's own: none
        refers to another folder.

        Returns:
            The ``rel`` of the items made in the store without sending their bytes.
        """


def publish_schemes() -> tuple[str, ...]:
    """The schemes of the kinds caches can be published to (``config.PUBLISH_SCHEMES``
    must list the same: a test checks)."""
    return tuple(_STORES)


def store_class(url: str) -> type[Store]:
    """The kind of :class:`Store` serving publish location ``url``; no I/O.

    Raises:
        SourceError: a scheme no kind of store serves.
    """
    for scheme, cls in _STORES.items():
        if url.startswith(scheme):
            return cls
    raise _not_a_location(url)


def parse_location(url: str) -> PublishLocation:
    """Parse a publish location (``gs://<bucket>[/<prefix>]``,
    ``hf://datasets/<org>/<repo>[@<rev>][/<path>]``, ...: one form per kind of store).

    Raises:
        SourceError: any other form.
    """
    given = url.strip()
    url = given.rstrip("/")
    location = store_class(given).parse_location(url)
    if location is None:
        raise _not_a_location(given)  # as given: "gs://" stripped of its "/" read "gs:"
    return location


def _not_a_location(url: str) -> SourceError:
    forms = " or ".join(cls.location_form for cls in _STORES.values())
    return SourceError(
        url,
        f"a place to publish caches must look like {forms} (one of {', '.join(publish_schemes())})",
    )
