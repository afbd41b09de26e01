"""Where caches are published, and the store there, through its own client library.

A location is ``gs://<bucket>[/<prefix>]`` (gcsfs) or
``hf://datasets/<org>/<repo>[@<branch>][/<path>]`` (huggingface_hub); a published cache
is the folder ``<location>/<name>-<fingerprint>/`` (:mod:`hf_pipeline.publish.find`).
:class:`Store` lists, and uploads (:meth:`Store.upload`: data files in parallel, then
the "tail" in order — on GCS object by object, each read back and checked; on the Hub
one ``create_commit``, atomic); every call goes through
:func:`~hf_pipeline.stores.retry.with_retries`. Bytes are read through :attr:`Store.source`, the
store's :class:`~hf_pipeline.stores.Source`, so every download is a
:func:`~hf_pipeline.stores.staging.stage_file`. No hand-written HTTP.
"""

from __future__ import annotations

import abc
import dataclasses
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote

from dist.safepath import UnsafePathError, check_relpath
from hf_pipeline.config import PUBLISH_SCHEMES
from hf_pipeline.errors import CacheFormatError, SourceError
from hf_pipeline.publish.manifest import ManifestEntry, same_content
from hf_pipeline.stores.remote_file import RemoteFile
from hf_pipeline.stores.retry import RetryPolicy, TransientError, with_retries

if TYPE_CHECKING:  # pragma: no cover
    from hf_pipeline.config import DataConfig
    from hf_pipeline.stores import GCSSource, HubSource, Source

__all__ = [
    "PublishLocation",
    "Store",
    "StoreKind",
    "Upload",
    "open_store",
    "parse_location",
]

StoreKind = Literal["gcs", "hub"]


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


class Store(abc.ABC):
    """The store of one :class:`PublishLocation`, through its own client library.

    Every call goes through :func:`~hf_pipeline.stores.retry.with_retries`. Thread-safe for
    listing and reading; one :meth:`upload` at a time.

    Attributes:
        location: where.
        policy: retries and per-file timeout.
        source: reads files by range (:func:`~hf_pipeline.stores.staging.stage_file`'s reader).
    """

    kind: StoreKind

    def __init__(self, location: PublishLocation, source: Source, policy: RetryPolicy):
        self.location = location
        self.source = source
        self.policy = policy

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
    ) -> None:
        """Upload ``data`` (any order, in parallel), then ``tail`` in its order, into
        cache folder ``cache_name``; every upload is verified against its digests."""


class _GCSStore(Store):
    source: GCSSource
    kind = "gcs"

    def _fs(self):
        return self.source.filesystem()

    def _prefix(self, cache_name: str) -> str:
        return f"{self.location.path}/{cache_name}"

    def check_location(self) -> None:
        bucket = self.location.path.split("/", 1)[0]
        if not with_retries(f"gs://{bucket}", lambda: self._fs().exists(bucket), self.policy):
            # gcsfs says "FileNotFoundError: b/<bucket>/o" for every path in it.
            raise SourceError(self.location.url, f"no such bucket gs://{bucket}")

    def _list_files(self, cache_name: str) -> dict[str, RemoteFile]:
        prefix = self._prefix(cache_name)

        def find():
            fs = self._fs()
            fs.invalidate_cache(prefix)  # gcsfs keeps listings; a store changes under us
            try:
                return fs.find(prefix, detail=True, withdirs=False)
            except FileNotFoundError:  # no such bucket (a missing prefix lists empty)
                return {}

        found = with_retries(f"gs://{prefix}", find, self.policy)
        if not found:
            self.check_location()  # nothing there: say so when the bucket is missing
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
        if not entries:
            self.check_location()  # a missing bucket is not "nothing published yet"
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
    source: HubSource
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

    def _list_files(self, cache_name: str) -> dict[str, RemoteFile]:
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
    from hf_pipeline.stores import GCSSource, HubSource

    location = url if isinstance(url, PublishLocation) else parse_location(url)
    policy = policy or RetryPolicy.from_config(data_config)
    # The sources only read (by range); they never stage into their own folder here.
    staging = Path(tempfile.gettempdir())
    if location.kind == "gcs":
        source: Source = GCSSource(
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
