"""Where raw files live: a local folder/glob, ``hf://datasets/...`` or ``gs://...``.

One interface, :class:`Source`, from :func:`open_source`::

    src = open_source("gs://bucket/prefix", data_config=cfg.data)
    shards = src.list_shards()          # [RemoteFile], natural-sorted by numeric range
    meta = src.find_metadata(cfg.data.metadata)
    fingerprint_inputs = src.identity()  # [(name, size, etag)]
    meta_path = src.fetch_one(meta)      # local verified copy

Shard bytes are fetched through :mod:`hf_pipeline.fetch` (``Prefetcher`` in the parent,
``StagingClient`` in ``datasets.map`` workers). The real stores are reached only through
their own client libraries: gcsfs for GCS, huggingface_hub (``HfApi``,
``hf_hub_download`` and its HTTP session) for the Hub.

Environment (read at call time): ``STORAGE_EMULATOR_HOST`` (GCS emulator),
``HF_ENDPOINT``, ``HF_HUB_OFFLINE``, ``HF_HUB_CACHE``/``HF_HOME``.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import errno
import fnmatch
import glob as _glob
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import unquote

from dist.atomic import write_json_atomic
from hf_pipeline.cache import HUB_LISTINGS_DIR, STAGING_DIR
from hf_pipeline.config import default_cache_root
from hf_pipeline.errors import SourceError, StoreUnreachableError
from hf_pipeline.fetch import (
    _CHUNK,
    FetchStats,
    RetryPolicy,
    _Cancelled,
    _is_transient,
    _stage_file,
    _Staging,
    _TransientError,
    _with_retries,
)

if TYPE_CHECKING:  # pragma: no cover
    import threading as _threading

    from hf_pipeline.config import DataConfig

__all__ = [
    "GCSSource",
    "HubSource",
    "LocalSource",
    "RemoteFile",
    "Source",
    "natural_key",
    "open_source",
    "resolve_hub_commit",
]

logger = logging.getLogger(__name__)

_SHARD_SUFFIX = ".pt"
#: What a shard found by listing a folder must be called: its row range
#: (``000000-000009.pt``). Any other ``*.pt`` there (``latest.pt``) is refused; a glob
#: the user writes may name any file.
_SHARD_NAME = re.compile(r"\d+-\d+\.pt")
_GLOB_CHARS = re.compile(r"[*?\[]")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteFile:
    """One file of a source, as the store describes it.

    Attributes:
        name: base name (``"000000-000009.pt"``).
        url: full location (local path, ``gs://bucket/obj``,
            ``hf://datasets/org/repo@<commit>/path``).
        size: bytes.
        etag: the store's version token: GCS generation, Hub content hash
            (LFS sha256 or git blob id), local ``mtime_ns``.
        checksum: ``"<kind>:<value>"`` the download is verified against
            (``crc32c``/``md5`` base64 for GCS, ``sha256``/``gitsha1`` hex for the
            Hub), or ``""`` when the store offers none (local).
    """

    name: str
    url: str
    size: int
    etag: str = ""
    checksum: str = ""

    def identity(self) -> tuple[str, int, str]:
        """``(name, size, etag)`` for the cache fingerprint."""
        return (self.name, self.size, self.etag)


def natural_key(name: str) -> tuple:
    """Sort key ordering ``000010-000019.pt`` after ``000000-000009.pt`` by number.

    Numbers compare as integers, so unpadded names (``9-9.pt`` < ``10-19.pt``) sort
    right too; the text breaks ties.
    """
    return tuple(int(n) for n in re.findall(r"\d+", Path(name).name)), name


def _is_meta(name: str) -> bool:
    return name.lower().endswith(".parquet") and "meta" in name.lower()


def _pick_metadata(candidates: list[RemoteFile], where: str) -> RemoteFile | None:
    if not candidates:
        return None
    if len(candidates) > 1:
        names = ", ".join(sorted(c.name for c in candidates))
        raise SourceError(
            where, f"several metadata candidates ({names}); set data.metadata to one of them"
        )
    return candidates[0]


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


class Source(abc.ABC):
    """A place holding shard files and (usually) the metadata parquet.

    Listing is done once and cached on the instance (thread-safe). Instances pickle
    without their network handles, which are rebuilt lazily in the new process (forked
    ``datasets`` workers must not share an event loop or connection pool).

    Attributes:
        location: as given to :func:`open_source`.
        is_local: files are readable in place (no staging copy).
        staging_dir: folder for verified downloads of this source.
        policy: retry policy for listing and fetching.
    """

    kind: ClassVar[str] = ""
    is_local: ClassVar[bool] = False

    def __init__(
        self,
        location: str,
        *,
        data_config: DataConfig,
        policy: RetryPolicy | None = None,
        staging_dir: str | os.PathLike | None = None,
    ):
        self.location = location
        self.data_config = data_config
        self.policy = policy or RetryPolicy.from_config(data_config)
        if staging_dir is None:
            staging_dir = data_config.staging_dir or (
                default_cache_root() / STAGING_DIR / hashlib.sha1(location.encode()).hexdigest()[:16]
            )
        self.staging_dir = Path(staging_dir).expanduser()
        self._lock = threading.Lock()
        self._shards: list[RemoteFile] | None = None
        self._siblings: dict[str, Source] = {}
        self._folders: dict[str, list[RemoteFile]] = {}  # listing per folder, per instance
        self.fetch_stats = FetchStats()

    def __getstate__(self):
        state = dict(self.__dict__)
        for k in ("_lock", "fetch_stats"):
            state.pop(k, None)
        state["_siblings"] = {}
        return self._drop_handles(state)

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self.fetch_stats = FetchStats()

    def _drop_handles(self, state: dict) -> dict:
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"

    # -- public API
    def list_shards(self) -> list[RemoteFile]:
        """All ``*.pt`` shards, natural-sorted by their numeric ranges.

        Listing a folder takes only files named by their row range
        (``000000-000009.pt``) and refuses any other ``*.pt`` there; a location with a
        glob in its file name part (``.../0*.pt``, ``.../*.pt``) takes what the glob
        matches. A shard the listing finds but cannot read (a dangling symlink, a
        symlink loop) is a missing shard: an error under ``data.on_missing: fail``,
        else recorded in ``fetch_stats.skipped`` (and so in the build report).

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
                files = [f for f in self._list_shard_folder() if f.name.endswith(_SHARD_SUFFIX)]
                missing = [m for m in self._unreadable_shards() if m[0].endswith(_SHARD_SUFFIX)]
                if not self._name_glob:
                    self._refuse_stray_names([f.name for f in files] + [m[0] for m in missing])
                self._missing_shards(missing)
                if not files:
                    raise SourceError(self.location, f"no *{_SHARD_SUFFIX} shards found")
                self._shards = sorted(files, key=lambda f: natural_key(f.name))
            return list(self._shards)

    def find_metadata(self, explicit: str = "") -> RemoteFile:
        """The caption parquet: ``explicit`` if given, else discovered.

        Discovery looks for exactly one ``*meta*.parquet`` next to the shards, then at
        the repository / bucket root.

        Args:
            explicit: a full location (any kind), or a bare file name looked up next
                to the shards and then at the root.

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
                return other._stat(explicit)
            for folder in self._metadata_folders():
                hit = [f for f in folder if f.name == explicit]
                if hit:
                    return hit[0]
            raise SourceError(
                explicit, f"metadata file not found next to {self.location} or at its root"
            )
        for folder in self._metadata_folders():
            found = _pick_metadata([f for f in folder if _is_meta(f.name)], self.location)
            if found is not None:
                return found
        raise SourceError(
            self.location,
            "no *meta*.parquet found next to the shards or at the root; set data.metadata",
        )

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
        owner = self._owner_of(file)
        if owner is not self:
            return owner.fetch_one(file)
        direct = self._direct_path(file)
        if direct is not None:
            return direct
        return self._fetch_missing(file)

    # -- for subclasses
    #: The file name pattern of a location such as ``.../0000*.pt`` ("" for a folder).
    _name_glob: str = ""

    def _unreadable_shards(self) -> list[tuple[str, str, str]]:
        """``(name, url, why)`` of entries the last listing saw but cannot read."""
        return []

    def _count_listing_retry(self, exc: BaseException) -> None:
        self.fetch_stats.add(listing_retries=1)

    def _filter_glob(self, files: list[RemoteFile]) -> list[RemoteFile]:
        """The files whose name matches ``_name_glob`` (all of them without one)."""
        pat = self._name_glob
        if not pat:
            return files
        # Like a shell glob: "*" does not match a leading dot (partial downloads).
        return [
            f
            for f in files
            if fnmatch.fnmatchcase(f.name, pat) and (pat.startswith(".") or f.name[:1] != ".")
        ]

    def _refuse_stray_names(self, names: list[str]) -> None:
        stray = sorted((n for n in names if not _SHARD_NAME.fullmatch(n)), key=natural_key)
        if not stray:
            return
        shown = ", ".join(stray[:10]) + (f" and {len(stray) - 10} more" if len(stray) > 10 else "")
        where = self.location.rstrip("/")
        raise SourceError(
            self.location,
            f"{len(stray)} *{_SHARD_SUFFIX} file(s) not named by a row range like "
            f"000000-000009{_SHARD_SUFFIX}: {shown}; move them out of the folder, or name "
            f"the files you mean with a glob (data.shards: {where}/*{_SHARD_SUFFIX} takes "
            "every *.pt file)",
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

    def _fetch_missing(self, file: RemoteFile) -> Path:
        """Fetch ``file``, owned here and not readable in place; default: stage it."""
        try:
            return _stage_file(
                self, file, _Staging(self.staging_dir), self.policy, self.fetch_stats
            )
        except _Cancelled as exc:  # pragma: no cover - no stop event here
            raise SourceError(file.url, "cancelled") from exc

    @abc.abstractmethod
    def _list_shard_folder(self) -> list[RemoteFile]:
        """The ``*.pt`` files of the shard location (unsorted)."""

    @abc.abstractmethod
    def _metadata_folders(self) -> Iterator[list[RemoteFile]]:
        """Folders to search for ``*meta*.parquet``, nearest first."""

    @abc.abstractmethod
    def _stat(self, url: str) -> RemoteFile:
        """Describe one file of this store."""

    @abc.abstractmethod
    def _owns(self, url: str) -> bool:
        """Whether ``url`` lives in this source's store (else a sibling source reads it)."""

    def _direct_path(self, file: RemoteFile) -> Path | None:
        """A path readable in place (local file, Hub cache hit), or None."""
        return None

    def _read_range(
        self, file: RemoteFile, offset: int, deadline: float, stop: _threading.Event | None
    ) -> Iterator[bytes]:
        """Yield the bytes of ``file`` from ``offset`` on; raise on failure or deadline."""
        # Only remote stores read ranges; local files are always read in place.
        raise TypeError(f"{type(self).__name__} reads files in place, not by ranges")

    # -- helpers
    def _sibling_for(self, url: str) -> Source:
        if self._owns(url):
            return self
        parent = url.rsplit("/", 1)[0] if "://" in url else str(Path(url).parent)
        with self._lock:
            if parent not in self._siblings:
                sibling = _make_source(
                    parent,
                    data_config=self.data_config,
                    policy=self.policy,
                    staging_dir=self.staging_dir,
                )
                # One set of counters: the metadata's retries belong to this build too.
                sibling.fetch_stats = self.fetch_stats
                self._siblings[parent] = sibling
            return self._siblings[parent]

    def _owner_of(self, file: RemoteFile) -> Source:
        return self._sibling_for(file.url)

    def _deadline_check(self, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{what}: per-file timeout of {self.policy.file_timeout:g}s exceeded"
            )


# --------------------------------------------------------------------------- local


class LocalSource(Source):
    """A local folder of shards, or a glob. Files are read in place, never copied."""

    kind = "local"
    is_local = True

    def __init__(self, location: str, **kw: Any):
        super().__init__(location, **kw)
        loc = os.path.expanduser(location)
        self._glob = loc if _GLOB_CHARS.search(loc) else os.path.join(loc, f"*{_SHARD_SUFFIX}")
        self._folder = Path(loc).parent if _GLOB_CHARS.search(loc) else Path(loc)
        if _GLOB_CHARS.search(loc):
            self._name_glob = os.path.basename(loc)  # glob.glob does the matching
        self._unreadable: list[tuple[str, str, str]] = []

    @staticmethod
    def _file(path: Path) -> RemoteFile:
        st = path.stat()
        return RemoteFile(
            name=path.name, url=str(path.resolve()), size=st.st_size, etag=str(st.st_mtime_ns)
        )

    def _list_shard_folder(self) -> list[RemoteFile]:
        if not _GLOB_CHARS.search(os.path.expanduser(self.location)) and not self._folder.is_dir():
            raise SourceError(self.location, "folder does not exist")
        files, unreadable = [], []
        for p in sorted(_glob.glob(self._glob)):
            if os.path.isfile(p):
                files.append(self._file(Path(p)))
            elif os.path.islink(p):
                # isfile() is False for a link to nothing or a loop: a shard that is
                # named but cannot be read must never vanish from the build silently.
                why = _broken_link(p)
                if why:
                    unreadable.append((os.path.basename(p), os.path.abspath(p), why))
        self._unreadable = unreadable
        return files

    def _unreadable_shards(self) -> list[tuple[str, str, str]]:
        return list(self._unreadable)

    def _metadata_folders(self) -> Iterator[list[RemoteFile]]:
        for folder in (self._folder, self._folder.parent):
            if folder.is_dir():
                yield [self._file(p) for p in folder.iterdir() if p.is_file()]

    def _owns(self, url: str) -> bool:
        return "://" not in url

    def _stat(self, url: str) -> RemoteFile:
        p = Path(url).expanduser()
        if not p.is_file():
            raise SourceError(url, "file does not exist")
        return self._file(p)

    def _direct_path(self, file: RemoteFile) -> Path | None:
        return Path(file.url)


def _broken_link(path: str) -> str:
    """Why the symlink ``path`` cannot be read as a file, or "" (it points to a folder)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"dangling symlink (its target {target} does not exist)"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "symlink loop (the link resolves to itself)"
        return f"unreadable symlink ({exc.strerror or exc})"
    return ""


def _split_name_glob(location: str, path: str) -> tuple[str, str]:
    """``"a/b/0*.pt"`` -> ``("a/b", "0*.pt")``; ``"a/b"`` -> ``("a/b", "")``.

    Raises:
        SourceError: a pattern outside the file name part (stores list one folder).
    """
    folder, _, name = path.rpartition("/")
    if _GLOB_CHARS.search(folder):
        raise SourceError(
            location, "a pattern may only stand in the file name part (<folder>/<pattern>)"
        )
    return (folder, name) if _GLOB_CHARS.search(name) else (path, "")


# --------------------------------------------------------------------------- GCS


def _gcsfs_class():
    """gcsfs' filesystem class, with its internal per-request retry loop removed.

    gcsfs retries every request up to 6 times with sleeps of up to 32 s, fixed at class
    definition. Stacked under our own retries that multiplies attempts and hides them
    from the stats, so we call the undecorated ``_request`` and retry (with the
    configured policy) ourselves. If a gcsfs version lacks ``__wrapped__`` we keep its
    retries (correct, just slower to give up).

    With an emulator we use ``gcsfs.core.GCSFileSystem`` directly: the "extended"
    class that ``gcsfs`` exports when ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` is on
    stalls on a gRPC probe the emulator cannot answer.
    """
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        from gcsfs.core import GCSFileSystem as base
    else:
        from gcsfs import GCSFileSystem as base
    raw = getattr(base._request, "__wrapped__", None)
    if raw is None:  # pragma: no cover - depends on gcsfs version
        return base

    class _SingleShotGCSFileSystem(base):
        async def _request(self, *args, **kwargs):
            return await raw(self, *args, **kwargs)

    return _SingleShotGCSFileSystem


class GCSSource(Source):
    """``gs://bucket/prefix``: objects directly under the prefix, through gcsfs.

    The emulator is used when ``STORAGE_EMULATOR_HOST`` is set (anonymous access).
    """

    kind = "gcs"
    #: Bytes per ranged read. Each read is all-or-nothing (gcsfs buffers it), so this
    #: is also the resume granularity after a kill or a cut connection.
    read_chunk: int = _CHUNK

    def __init__(self, location: str, **kw: Any):
        super().__init__(location, **kw)
        path = location[len("gs://") :].strip("/")
        if not path:
            raise SourceError(location, "must look like gs://<bucket>/<prefix>")
        path, self._name_glob = _split_name_glob(location, path)
        if not path:
            raise SourceError(location, "must look like gs://<bucket>/<prefix>")
        self._path = path
        self._bucket = path.split("/", 1)[0]
        self._fs_obj = None
        self._fs_pid = None

    def _drop_handles(self, state: dict) -> dict:
        state["_fs_obj"] = None
        state["_fs_pid"] = None
        return state

    def _fs(self):
        # Rebuilt per process: the aiohttp session lives on fsspec's IO loop thread,
        # which a forked child does not have.
        if self._fs_obj is None or self._fs_pid != os.getpid():
            import aiohttp

            cls = _gcsfs_class()
            emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
            t = self.policy.file_timeout
            kw: dict[str, Any] = {
                "skip_instance_cache": True,
                "requests_timeout": aiohttp.ClientTimeout(
                    total=None, sock_connect=min(t, 30), sock_read=min(t, 60)
                ),
            }
            if emulator:
                kw.update(
                    endpoint_url=emulator if "://" in emulator else f"http://{emulator}",
                    token="anon",
                )
            self._fs_obj = cls(**kw)
            self._fs_pid = os.getpid()
        return self._fs_obj

    def _file(self, info: dict) -> RemoteFile:
        name = info["name"].rstrip("/")
        if info.get("crc32c"):
            checksum = f"crc32c:{info['crc32c']}"
        elif info.get("md5Hash"):
            checksum = f"md5:{info['md5Hash']}"
        else:
            checksum = ""
        return RemoteFile(
            name=name.rsplit("/", 1)[-1],
            url=f"gs://{name}",
            size=int(info["size"]),
            etag=str(info.get("generation") or info.get("etag") or ""),
            checksum=checksum,
        )

    def _ls(self, path: str) -> list[RemoteFile]:
        if path in self._folders:
            return self._folders[path]

        def go():
            return self._fs().ls(path, detail=True, refresh=True)

        try:
            entries = _with_retries(
                f"gs://{path}", go, self.policy, on_retry=self._count_listing_retry
            )
        except SourceError as err:
            if isinstance(err.__cause__, FileNotFoundError):
                raise SourceError(f"gs://{path}", "no such bucket or prefix") from err.__cause__
            raise
        out = [self._file(e) for e in entries if e.get("type") == "file"]
        self._folders[path] = out
        return out

    def _list_shard_folder(self) -> list[RemoteFile]:
        return self._filter_glob(self._ls(self._path))

    def _metadata_folders(self) -> Iterator[list[RemoteFile]]:
        yield self._ls(self._path)
        if self._path != self._bucket:
            yield self._ls(self._bucket)

    def _owns(self, url: str) -> bool:
        return url.startswith(f"gs://{self._bucket}/")

    def _stat(self, url: str) -> RemoteFile:
        path = url[len("gs://") :]
        try:
            info = _with_retries(
                url,
                lambda: self._fs().info(path, refresh=True),
                self.policy,
                on_retry=self._count_listing_retry,
            )
        except SourceError as err:
            if isinstance(err.__cause__, FileNotFoundError):
                raise SourceError(url, "object does not exist") from err.__cause__
            raise
        return self._file(info)

    def _read_range(self, file, offset, deadline, stop):
        fs = self._fs()
        path = file.url[len("gs://") :]
        pos = offset
        while pos < file.size:
            self._deadline_check(deadline, file.url)
            if stop is not None and stop.is_set():
                raise _Cancelled(file.url)
            end = min(pos + self.read_chunk, file.size)
            block = fs.cat_file(path, start=pos, end=end)
            if not block:
                raise ConnectionError(f"empty body at offset {pos}")
            pos += len(block)
            yield block


# --------------------------------------------------------------------------- Hub


def _hub_endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _hub_cache_dir() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or bool(constants.HF_HUB_OFFLINE)


def _cached_ref(repo_id: str, repo_type: str, revision: str) -> tuple[Path, str]:
    """huggingface_hub's cache ref file of ``revision`` and the commit it holds ("" if none)."""
    folder = f"{repo_type}s--{repo_id.replace('/', '--')}"
    ref = Path(_hub_cache_dir()) / folder / "refs" / revision
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
    if _hub_offline():
        if cached:
            return cached
        raise SourceError(
            where,
            f"HF_HUB_OFFLINE is set and huggingface_hub's cache has no ref for revision {rev!r} "
            f"({ref})",
        )

    def ask() -> str:
        from huggingface_hub import HfApi

        api = HfApi(endpoint=_hub_endpoint())
        get = api.model_info if repo_type == "model" else api.dataset_info
        return get(repo_id, revision=rev, timeout=30).sha or ""

    try:
        sha = _with_retries(where, ask, policy or RetryPolicy(max_retries=3))
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


class HubSource(Source):
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
        self.path_in_repo, self._name_glob = _split_name_glob(
            location, "/".join(p for p in parts[3:] if p)
        )
        self._commit: str | None = None

    # -- plumbing
    def _api(self):
        from huggingface_hub import HfApi

        return HfApi(endpoint=_hub_endpoint())

    def _listing_cache(self) -> Path:
        key = hashlib.sha1(f"{self.repo_id}|{self.revision}".encode()).hexdigest()[:16]
        return (
            default_cache_root() / HUB_LISTINGS_DIR / f"{self.repo_id.replace('/', '--')}-{key}.json"
        )

    def _load_listing(self) -> dict:
        try:
            data = json.loads(self._listing_cache().read_text(encoding="utf-8"))
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _save_listing(self, folder: str, files: list[RemoteFile]) -> None:
        data = self._load_listing()
        data["commit"] = self.commit
        data.setdefault("folders", {})[folder] = [dataclasses.asdict(f) for f in files]
        path = self._listing_cache()
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, data)

    @property
    def commit(self) -> str:
        """The commit hash the revision resolved to (resolved on first use)."""
        if self._commit is None:
            if _COMMIT_RE.match(self.revision):
                self._commit = self.revision
            elif _hub_offline():
                cached = self._load_listing().get("commit")
                if not cached:
                    raise SourceError(
                        self.location,
                        "HF_HUB_OFFLINE is set and this revision was never listed online",
                    )
                self._commit = cached
            else:

                def resolve():
                    return self._api().dataset_info(self.repo_id, revision=self.revision).sha

                try:
                    sha = _with_retries(
                        self.location, resolve, self.policy, on_retry=self._count_listing_retry
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
                self._commit = sha
        return self._commit

    def _url(self, path_in_repo: str) -> str:
        return f"hf://datasets/{self.repo_id}@{self.commit}/{path_in_repo}"

    def _path_of(self, file: RemoteFile) -> str:
        prefix = f"hf://datasets/{self.repo_id}@"
        if not file.url.startswith(prefix):
            raise SourceError(file.url, f"not a file of {self.repo_id}")
        return file.url[len(prefix) :].split("/", 1)[1]

    def _list(self, folder: str) -> list[RemoteFile]:
        if folder in self._folders:
            return self._folders[folder]
        commit = self.commit
        if _hub_offline():
            cached = self._load_listing()
            if cached.get("commit") == commit and folder in cached.get("folders", {}):
                return [RemoteFile(**f) for f in cached["folders"][folder]]
            raise SourceError(
                self._url(folder), "HF_HUB_OFFLINE is set and this folder was never listed online"
            )

        def go():
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
            entries = _with_retries(
                self._url(folder), go, self.policy, on_retry=self._count_listing_retry
            )
        except SourceError as err:
            if type(err.__cause__).__name__ in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
                raise SourceError(
                    self._url(folder), "no such folder in the repository"
                ) from err.__cause__
            raise
        out = []
        for e in entries:
            if not hasattr(e, "blob_id"):
                continue  # a folder
            lfs = getattr(e, "lfs", None)
            sha256 = getattr(lfs, "sha256", None) if lfs is not None else None
            out.append(
                RemoteFile(
                    name=e.path.rsplit("/", 1)[-1],
                    url=self._url(e.path),
                    size=int(e.size),
                    etag=sha256 or e.blob_id,
                    checksum=f"sha256:{sha256}" if sha256 else f"gitsha1:{e.blob_id}",
                )
            )
        self._save_listing(folder, out)
        self._folders[folder] = out
        return out

    # -- Source
    def identity(self) -> list[tuple]:
        """The commit first (``(<repo>@<revision>, 0, <commit>)``), then the shards."""
        return [(f"{self.repo_id}@{self.revision}", 0, self.commit), *super().identity()]

    def _list_shard_folder(self) -> list[RemoteFile]:
        return self._filter_glob(self._list(self.path_in_repo))

    def _metadata_folders(self) -> Iterator[list[RemoteFile]]:
        yield self._list(self.path_in_repo)
        if self.path_in_repo:
            yield self._list("")

    def _owns(self, url: str) -> bool:
        if not url.startswith(f"hf://datasets/{self.repo_id}"):
            return False
        rest = url[len(f"hf://datasets/{self.repo_id}") :]
        if rest.startswith("@"):
            rev = unquote(rest[1:].split("/", 1)[0])
            return rev in (self.revision, self._commit)
        return rest.startswith("/")

    def _stat(self, url: str) -> RemoteFile:
        rest = url[len(f"hf://datasets/{self.repo_id}") :]
        path = rest.split("/", 1)[1] if "/" in rest else ""
        folder, _, name = path.rpartition("/")
        for f in self._list(folder):
            if f.name == name:
                return f
        raise SourceError(url, "file does not exist in the repository")

    def _direct_path(self, file: RemoteFile) -> Path | None:
        """The file in huggingface_hub's cache for this commit, if already there."""
        from huggingface_hub import try_to_load_from_cache

        try:
            hit = try_to_load_from_cache(
                self.repo_id,
                self._path_of(file),
                cache_dir=_hub_cache_dir(),
                revision=self.commit,
                repo_type="dataset",
            )
        except Exception:  # noqa: BLE001 - a broken cache entry is a miss, not a crash
            return None
        if isinstance(hit, str) and os.path.isfile(hit) and os.path.getsize(hit) == file.size:
            return Path(hit)
        return None

    def _fetch_missing(self, file: RemoteFile) -> Path:
        """Download into huggingface_hub's cache (``hf_hub_download``), verified.

        Raises:
            SourceError: unreachable after retries, offline and not cached, or the
                checksum does not match.
        """
        if _hub_offline():
            raise SourceError(
                file.url, "HF_HUB_OFFLINE is set and the file is not in the Hub cache"
            )
        from huggingface_hub import hf_hub_download

        from hf_pipeline.fetch import _checksum_of

        path_in_repo = self._path_of(file)
        force = [False]

        def go():
            try:
                local = hf_hub_download(
                    self.repo_id,
                    path_in_repo,
                    repo_type="dataset",
                    revision=self.commit,
                    cache_dir=_hub_cache_dir(),
                    endpoint=_hub_endpoint(),
                    force_download=force[0],
                )
            except FileNotFoundError as exc:
                # hf_hub_download reports a failed HEAD (503, reset, ...) as "not in
                # the local cache" (a FileNotFoundError); what failed is the network.
                cause = exc.__cause__ or exc.__context__
                if cause is not None and _is_transient(cause):
                    raise _TransientError(f"{type(cause).__name__}: {cause}") from exc
                raise
            kind, _, want = file.checksum.partition(":")
            if kind and _checksum_of(Path(local), kind) != want:
                force[0] = True
                raise _TransientError(f"{kind} mismatch after download")
            return Path(local)

        t0 = time.monotonic()
        path = _with_retries(
            file.url, go, self.policy, on_retry=lambda e: self.fetch_stats.add(retries=1)
        )
        self.fetch_stats.span(t0, time.monotonic())
        self.fetch_stats.add(files=1, bytes=file.size)
        return path

    def _read_range(self, file, offset, deadline, stop):
        if _hub_offline():
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
            endpoint=_hub_endpoint(),
        )
        headers = build_hf_headers()
        headers["Accept-Encoding"] = "identity"  # sizes and checksums are of the raw bytes
        if offset:
            headers["Range"] = f"bytes={offset}-"
        t = self.policy.file_timeout
        timeout = httpx2.Timeout(
            connect=min(t, 30), read=min(t, 60), write=min(t, 60), pool=min(t, 60)
        )
        with get_session().stream(
            "GET", url, headers=headers, timeout=timeout, follow_redirects=True
        ) as resp:
            hf_raise_for_status(resp)
            skip = offset if (offset and resp.status_code == 200) else 0  # Range ignored
            # No chunk_size: yield what each socket read brings, so the bytes received
            # before a cut connection reach the part file and the retry resumes.
            for block in resp.iter_bytes():
                self._deadline_check(deadline, file.url)
                if stop is not None and stop.is_set():
                    raise _Cancelled(file.url)
                if skip:
                    cut = min(skip, len(block))
                    block, skip = block[cut:], skip - cut
                if block:
                    yield block


# --------------------------------------------------------------------------- factory


def _make_source(location: str, **kw: Any) -> Source:
    if location.startswith("gs://"):
        return GCSSource(location, **kw)
    if location.startswith("hf://"):
        return HubSource(location, **kw)
    if "://" in location:
        raise SourceError(
            location, "unsupported scheme (use a local path, hf://datasets/... or gs://...)"
        )
    return LocalSource(location, **kw)


def open_source(
    location: str,
    *,
    data_config: DataConfig,
    policy: RetryPolicy | None = None,
    staging_dir: str | os.PathLike | None = None,
) -> Source:
    """Open a shard location: local folder/glob, ``hf://datasets/...`` or ``gs://...``.

    A remote source is listed right away. If that fails with a transient error
    (unreachable, timeouts, 5xx after retries) and ``data_config.local_mirror`` is set,
    the mirror folder is used instead and a warning line says so.

    Args:
        location: where the shards are.
        data_config: retries, timeouts, staging and mirror settings.
        policy: override the retry policy (tests use short backoffs).
        staging_dir: override the staging folder (default ``data.staging_dir``, else
            ``<cache root>/staging/<hash of location>``).

    Returns:
        A :class:`Source`.

    Raises:
        SourceError: bad location.
        StoreUnreachableError: unreachable (after retries) without a mirror.
    """
    src = _make_source(location, data_config=data_config, policy=policy, staging_dir=staging_dir)
    if src.is_local or not data_config.local_mirror:
        return src
    try:
        src.list_shards()
    except StoreUnreachableError as err:
        mirror = data_config.local_mirror
        logger.warning(
            "%s is unreachable (%s); using the local mirror %s", location, err.reason, mirror
        )
        local = LocalSource(mirror, data_config=data_config, policy=policy, staging_dir=staging_dir)
        local.fetch_stats = src.fetch_stats  # the retries that led here are reported too
        return local
    return src
