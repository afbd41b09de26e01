"""``hf://datasets/<org>/<repo>[@<revision>]/<folder>``, through huggingface_hub:
:class:`HubSource` lists and reads files; :class:`HubStore` publishes caches there (one
``create_commit`` per cache, atomic).

Also :func:`resolve_hub_commit`, the one rule for turning a Hub revision into a commit
(used for datasets here and for the text encoder's model in :mod:`hf_pipeline.encoder.model`).

Environment (read at call time through :mod:`hf_pipeline.config`): ``HF_ENDPOINT``,
``HF_HUB_OFFLINE``, ``HF_HUB_CACHE``/``HF_HOME``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from dist.atomic import write_json_atomic
from dist.markers import load_json
from dist.safepath import UnsafePathError, check_relpath, own_folder
from hf_pipeline.cache.layout import HUB_LISTINGS_DIR
from hf_pipeline.config import default_cache_root, hub_cache_dir, hub_endpoint, hub_offline
from hf_pipeline.errors import SourceError, StoreUnreachableError
from hf_pipeline.stores.base import (
    PublishLocation,
    Source,
    Store,
    filter_by_glob,
    split_name_glob,
)
from hf_pipeline.stores.remote_file import RemoteFile
from hf_pipeline.stores.retry import (
    Cancelled,
    RetryPolicy,
    TransientError,
    check_deadline,
    is_transient,
    with_retries,
)
from hf_pipeline.stores.staging import checksum_of

__all__ = ["HubSource", "HubStore", "resolve_hub_commit"]

logger = logging.getLogger(__name__)

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def _cached_ref(repo_id: str, repo_type: str, revision: str) -> tuple[Path, str]:
    """huggingface_hub's cache ref file of ``revision`` and the commit it holds ("" if none)."""
    folder = f"{repo_type}s--{repo_id.replace('/', '--')}"
    ref = Path(hub_cache_dir()) / folder / "refs" / revision
    try:
        commit = ref.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return ref, ""
    return ref, commit if _COMMIT_RE.match(commit) else ""


def resolve_hub_commit(
    repo_id: str,
    revision: str = "",
    *,
    repo_type: str = "model",
    policy: RetryPolicy | None = None,
) -> str:
    """The commit a Hub revision (branch, tag or commit; "" is ``main``) stands for.

    Never a guess: every process of a job must get the same answer or an error, or
    their cache fingerprints differ. A 40-hex ``revision`` is returned as is. Online,
    the Hub is asked (``HfApi.model_info``/``dataset_info``, with retries). With
    ``HF_HUB_OFFLINE`` set, or when the Hub does not answer, the ref huggingface_hub's
    cache recorded for this revision is used (a warning says so when the Hub was down).
    Thread-safe.

    Args:
        repo_id: ``"org/name"``.
        revision: branch, tag or commit.
        repo_type: ``"model"`` or ``"dataset"``.
        policy: retries for the Hub call (default: 3 retries, 0.5 s first backoff).

    Returns:
        The 40-hex commit hash.

    Raises:
        SourceError: the Hub answered that the repository or revision does not exist
            (or is not accessible), or ``HF_HUB_OFFLINE`` is set and the cache has no
            ref for the revision.
        StoreUnreachableError: the Hub did not answer and the cache has no ref.
    """
    rev = revision or "main"
    if _COMMIT_RE.match(rev):
        return rev
    where = f"{repo_id}@{rev}"
    ref, cached = _cached_ref(repo_id, repo_type, rev)
    if hub_offline():
        if cached:
            return cached
        raise SourceError(
            where,
            f"HF_HUB_OFFLINE is set and huggingface_hub's cache has no ref for revision {rev!r} "
            f"({ref})",
        )

    def ask() -> str:
        from huggingface_hub import HfApi

        api = HfApi(endpoint=hub_endpoint())
        get = api.model_info if repo_type == "model" else api.dataset_info
        return get(repo_id, revision=rev, timeout=30).sha or ""

    try:
        sha = with_retries(where, ask, policy or RetryPolicy(max_retries=3))
    except StoreUnreachableError as err:
        if not cached:
            raise StoreUnreachableError(
                where,
                f"the Hub did not answer ({err.reason}) and huggingface_hub's cache has no "
                f"ref for revision {rev!r} ({ref})",
            ) from err
        logger.warning(
            "%s: the Hub did not answer (%s); using commit %s from huggingface_hub's cache",
            where,
            err.reason,
            cached,
        )
        return cached
    if not _COMMIT_RE.match(sha):
        raise SourceError(where, f"the Hub returned no commit for revision {rev!r} (got {sha!r})")
    return sha


class HubSource(Source, scheme="hf://"):
    """``hf://datasets/<org>/<repo>[@<revision>]/<folder>`` through huggingface_hub.

    A branch or tag is resolved to a commit hash once (``HfApi.dataset_info``); every
    listing and download then pins that commit, and the commit is part of
    :meth:`identity`. The listing is saved under the project cache so that, with
    ``HF_HUB_OFFLINE=1``, the same commit can be listed again without the network.

    Where bytes go: the metadata parquet through ``hf_hub_download`` into
    huggingface_hub's cache (reused offline). Shards are streamed with
    huggingface_hub's HTTP session (``hf_hub_url`` + ``get_session``) into the bounded
    staging area, so a 1 TB dataset never has to fit in the Hub cache; a shard that is
    already in the Hub cache (``hf download`` ahead of time) is used in place.
    """

    metadata_where = "next to the shards or at the repository root"
    kind = "hub"

    def __init__(self, location: str, **kw: Any):
        super().__init__(location, **kw)
        rest = location[len("hf://") :]
        parts = rest.split("/")
        if len(parts) < 3 or parts[0] != "datasets":
            raise SourceError(
                location, "must look like hf://datasets/<org>/<repo>[@<revision>]/<folder>"
            )
        name, _, rev = parts[2].partition("@")
        self.repo_id = f"{parts[1]}/{name}"
        self.revision = unquote(rev) if rev else "main"
        self.path_in_repo, self.name_glob = split_name_glob(
            location, "/".join(p for p in parts[3:] if p)
        )
        self._commit: str | None = None

    # -- plumbing
    def _api(self):
        from huggingface_hub import HfApi

        return HfApi(endpoint=hub_endpoint())

    def _listing_cache(self) -> Path:
        key = hashlib.sha1(f"{self.repo_id}|{self.revision}".encode()).hexdigest()[:16]
        return (
            default_cache_root()
            / HUB_LISTINGS_DIR
            / f"{self.repo_id.replace('/', '--')}-{key}.json"
        )

    def _load_listing(self) -> dict:
        try:
            data = load_json(self._listing_cache())  # bounded: the cache root is shared
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _save_listing(self, folder: str, files: list[RemoteFile]) -> None:
        data = self._load_listing()
        data["commit"] = self.commit
        data.setdefault("folders", {})[folder] = [dataclasses.asdict(f) for f in files]
        path = self._listing_cache()
        with contextlib.suppress(OSError):
            # A real folder, never a link someone put in a shared root (refused).
            own_folder(path.parent.parent, path.parent.name)
            write_json_atomic(path, data)

    @property
    def commit(self) -> str:
        """The commit hash the revision resolved to (resolved on first use)."""
        if self._commit is None:
            if _COMMIT_RE.match(self.revision):
                self._commit = self.revision
            elif hub_offline():
                cached = self._load_listing().get("commit")
                if not cached:
                    raise SourceError(
                        self.location,
                        "HF_HUB_OFFLINE is set and this revision was never listed online",
                    )
                self._commit = cached
            else:
                self._commit = self._resolve_online()
        return self._commit

    def _resolve_online(self) -> str:
        try:
            sha = with_retries(
                self.location,
                lambda: self._api().dataset_info(self.repo_id, revision=self.revision).sha,
                self.policy,
                on_retry=self.count_listing_retry,
            )
        except SourceError as err:
            # Same class: a Hub that is down stays "unreachable" (exit code 1).
            raise type(err)(
                self.location, f"cannot resolve revision {self.revision!r}: {err.reason}"
            ) from err
        if not sha:
            raise SourceError(
                self.location, f"the Hub returned no commit for revision {self.revision!r}"
            )
        return sha

    def _url(self, path_in_repo: str) -> str:
        return f"hf://datasets/{self.repo_id}@{self.commit}/{path_in_repo}"

    def _path_of(self, file: RemoteFile) -> str:
        prefix = f"hf://datasets/{self.repo_id}@"
        if not file.url.startswith(prefix):
            raise SourceError(file.url, f"not a file of {self.repo_id}")
        path = file.url[len(prefix) :].split("/", 1)[1]
        try:  # huggingface_hub joins it into its cache folder: a listing is foreign
            return check_relpath(path)
        except UnsafePathError as e:
            raise SourceError(file.url, str(e)) from None

    def describe(self, entry: Any) -> RemoteFile:
        """The :class:`RemoteFile` of one file entry of ``HfApi.list_repo_tree`` at
        :attr:`commit` (LFS files carry their sha256, others their git blob id)."""
        lfs = getattr(entry, "lfs", None)
        sha256 = getattr(lfs, "sha256", None) if lfs is not None else None
        return RemoteFile(
            name=entry.path.rsplit("/", 1)[-1],
            url=self._url(entry.path),
            size=int(entry.size),
            etag=sha256 or entry.blob_id,
            checksum=f"sha256:{sha256}" if sha256 else f"gitsha1:{entry.blob_id}",
        )

    def _list(self, folder: str) -> list[RemoteFile]:
        if folder in self._listings:
            return self._listings[folder]
        commit = self.commit
        if hub_offline():
            cached = self._load_listing()
            if cached.get("commit") == commit and folder in cached.get("folders", {}):
                return [RemoteFile(**f) for f in cached["folders"][folder]]
            raise SourceError(
                self._url(folder), "HF_HUB_OFFLINE is set and this folder was never listed online"
            )

        def list_tree():
            return list(
                self._api().list_repo_tree(
                    self.repo_id,
                    folder or None,
                    revision=commit,
                    repo_type="dataset",
                    recursive=False,
                )
            )

        try:
            entries = with_retries(
                self._url(folder), list_tree, self.policy, on_retry=self.count_listing_retry
            )
        except SourceError as err:
            if type(err.__cause__).__name__ in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
                raise SourceError(
                    self._url(folder), "no such folder in the repository"
                ) from err.__cause__
            raise
        # Folders have no blob id.
        out = [self.describe(entry) for entry in entries if hasattr(entry, "blob_id")]
        self._save_listing(folder, out)
        self._listings[folder] = out
        return out

    # -- Source
    def identity(self) -> list[tuple]:
        """The commit first (``(<repo>@<revision>, 0, <commit>)``), then the shards."""
        return [(f"{self.repo_id}@{self.revision}", 0, self.commit), *super().identity()]

    def list_shard_folder(self) -> list[RemoteFile]:
        return filter_by_glob(self._list(self.path_in_repo), self.name_glob)

    def metadata_folders(self) -> Iterator[list[RemoteFile]]:
        yield self._list(self.path_in_repo)
        if self.path_in_repo:
            yield self._list("")

    def owns(self, url: str) -> bool:
        if not url.startswith(f"hf://datasets/{self.repo_id}"):
            return False
        rest = url[len(f"hf://datasets/{self.repo_id}") :]
        if rest.startswith("@"):
            rev = unquote(rest[1:].split("/", 1)[0])
            return rev in (self.revision, self._commit)
        return rest.startswith("/")

    def stat(self, url: str) -> RemoteFile:
        rest = url[len(f"hf://datasets/{self.repo_id}") :]
        path = rest.split("/", 1)[1] if "/" in rest else ""
        folder, _, name = path.rpartition("/")
        for f in self._list(folder):
            if f.name == name:
                return f
        raise SourceError(url, "file does not exist in the repository")

    def direct_path(self, file: RemoteFile) -> Path | None:
        """The file in huggingface_hub's cache for this commit, if already there."""
        from huggingface_hub import try_to_load_from_cache

        try:
            hit = try_to_load_from_cache(
                self.repo_id,
                self._path_of(file),
                cache_dir=hub_cache_dir(),
                revision=self.commit,
                repo_type="dataset",
            )
        except Exception:  # noqa: BLE001 - a broken cache entry is a miss, not a crash
            return None
        if isinstance(hit, str) and os.path.isfile(hit) and os.path.getsize(hit) == file.size:
            return Path(hit)
        return None

    def fetch_missing(self, file: RemoteFile) -> Path:
        """Download into huggingface_hub's cache (``hf_hub_download``), verified.

        Raises:
            SourceError: unreachable after retries, offline and not cached, or the
                checksum does not match.
        """
        if hub_offline():
            raise SourceError(
                file.url, "HF_HUB_OFFLINE is set and the file is not in the Hub cache"
            )
        from huggingface_hub import hf_hub_download

        path_in_repo = self._path_of(file)
        # After a checksum mismatch the cached copy is bad: the next attempt replaces it.
        force = [False]

        def download() -> Path:
            try:
                local = hf_hub_download(
                    self.repo_id,
                    path_in_repo,
                    repo_type="dataset",
                    revision=self.commit,
                    cache_dir=hub_cache_dir(),
                    endpoint=hub_endpoint(),
                    force_download=force[0],
                )
            except FileNotFoundError as exc:
                # hf_hub_download reports a failed HEAD (503, reset, ...) as "not in
                # the local cache" (a FileNotFoundError); what failed is the network.
                cause = exc.__cause__ or exc.__context__
                if cause is not None and is_transient(cause):
                    raise TransientError(f"{type(cause).__name__}: {cause}") from exc
                raise
            kind, _, want = file.checksum.partition(":")
            if kind and checksum_of(Path(local), kind) != want:
                force[0] = True
                raise TransientError(f"{kind} mismatch after download")
            return Path(local)

        started = time.monotonic()
        path = with_retries(
            file.url, download, self.policy, on_retry=lambda e: self.fetch_stats.add(retries=1)
        )
        self.fetch_stats.span(started, time.monotonic())
        self.fetch_stats.add(files=1, bytes=file.size)
        return path

    def read_span(self, rel: str, start: int, end: int, deadline: float) -> bytes:
        """Bytes ``[start, end)`` of file ``rel`` (a path under this source's folder; read
        at :attr:`commit`) in one ranged request; one attempt, retries are the caller's (:func:`~hf_pipeline.stores.retry.with_retries`).

        Fewer bytes than asked (a cut body) come back as they are: the caller checks the
        length. Bounded by the HTTP timeouts (``file_timeout``) and by ``deadline`` (a
        ``time.monotonic()`` value), checked between the body's reads. Thread-safe.
        """
        if hub_offline():
            raise SourceError(
                f"{self.location}/{rel}",
                "HF_HUB_OFFLINE is set: a cache cannot be streamed offline",
            )
        from huggingface_hub import hf_hub_url

        try:  # the path comes from a published manifest: foreign
            path = check_relpath(f"{self.path_in_repo}/{rel}" if self.path_in_repo else rel)
        except UnsafePathError as e:
            raise SourceError(f"{self.location}/{rel}", str(e)) from None
        url = self._url(path)
        http = hf_hub_url(
            self.repo_id, path, repo_type="dataset", revision=self.commit, endpoint=hub_endpoint()
        )
        parts, got = [], 0
        with self._get(http, {"Range": f"bytes={start}-{end - 1}"}) as resp:
            skip = start if resp.status_code == 200 else 0  # a server that ignored Range
            for block in resp.iter_bytes():
                check_deadline(deadline, url, self.policy.file_timeout)
                if skip:
                    cut = min(skip, len(block))
                    block, skip = block[cut:], skip - cut
                parts.append(block)
                got += len(block)
                if got >= end - start:
                    break
        return b"".join(parts)[: end - start]

    def _get(self, url: str, extra: dict[str, str]):
        """A streamed GET of ``url`` through huggingface_hub's session (a context manager);
        raises the Hub's error for a failed status."""
        import httpx2
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        headers = build_hf_headers()
        headers["Accept-Encoding"] = "identity"  # sizes and checksums are of the raw bytes
        headers.update(extra)
        timeout_s = self.policy.file_timeout
        timeout = httpx2.Timeout(
            connect=min(timeout_s, 30),
            read=min(timeout_s, 60),
            write=min(timeout_s, 60),
            pool=min(timeout_s, 60),
        )

        @contextlib.contextmanager
        def checked():
            with get_session().stream(
                "GET", url, headers=headers, timeout=timeout, follow_redirects=True
            ) as resp:
                hf_raise_for_status(resp)
                yield resp

        return checked()

    def read_range(self, file, offset, deadline, stop):
        if hub_offline():
            raise SourceError(
                file.url, "HF_HUB_OFFLINE is set and the file is not staged or cached"
            )
        import httpx2
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = hf_hub_url(
            self.repo_id,
            self._path_of(file),
            repo_type="dataset",
            revision=self.commit,
            endpoint=hub_endpoint(),
        )
        headers = build_hf_headers()
        headers["Accept-Encoding"] = "identity"  # sizes and checksums are of the raw bytes
        if offset:
            headers["Range"] = f"bytes={offset}-"
        timeout_s = self.policy.file_timeout
        timeout = httpx2.Timeout(
            connect=min(timeout_s, 30),
            read=min(timeout_s, 60),
            write=min(timeout_s, 60),
            pool=min(timeout_s, 60),
        )
        with get_session().stream(
            "GET", url, headers=headers, timeout=timeout, follow_redirects=True
        ) as resp:
            hf_raise_for_status(resp)
            skip = offset if (offset and resp.status_code == 200) else 0  # Range ignored
            # No chunk_size: yield what each socket read brings, so the bytes received
            # before a cut connection reach the part file and the retry resumes.
            for block in resp.iter_bytes():
                check_deadline(deadline, file.url, self.policy.file_timeout)
                if stop is not None and stop.is_set():
                    raise Cancelled(file.url)
                if skip:
                    cut = min(skip, len(block))
                    block, skip = block[cut:], skip - cut
                if block:
                    yield block


class HubStore(Store, scheme="hf://datasets/"):
    """Published caches in a Hub dataset repository's folder; one ``create_commit`` per
    cache, so a cache appears whole or not at all."""

    source: HubSource
    kind = "hub"
    location_form = "hf://datasets/<org>/<repo>[@<branch>][/<path>]"

    @classmethod
    def parse_location(cls, url: str) -> PublishLocation | None:
        parts = [p for p in url[len("hf://datasets/") :].split("/") if p]
        if len(parts) < 2:
            return None
        name, _, rev = parts[1].partition("@")
        if not name:
            return None
        return PublishLocation(
            url=url,
            kind=cls.kind,
            path="/".join(parts[2:]),
            repo_id=f"{parts[0]}/{name}",
            revision=unquote(rev) if rev else "main",
        )

    @classmethod
    def source_location(cls, location: PublishLocation) -> str:
        return f"hf://datasets/{location.repo_id}@{location.revision}"

    def _api(self):
        from huggingface_hub import HfApi

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
            return set()
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
        # The Hub stores an LFS file once per repository, by its sha256: for content the
        # repository already holds, the LFS batch endpoint answers with no upload action
        # and huggingface_hub sends no byte (Xet dedups by chunk likewise). copy_from is
        # such a file (an LFS file of this repository, listed with this sha256).
        return {
            i.rel
            for i in data
            if i.copy_from is not None
            and i.entry.sha256
            and i.copy_from.checksum == f"sha256:{i.entry.sha256}"
        }
