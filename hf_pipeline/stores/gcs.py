"""``gs://bucket/prefix``, through gcsfs: :class:`GCSSource` lists and reads the objects
directly under a prefix; :class:`GCSStore` publishes caches there (object by object, each
read back and checked; a file another publication there holds is copied inside GCS).

Environment (read at call time through :mod:`hf_pipeline.config`):
``STORAGE_EMULATOR_HOST`` points at a GCS emulator (anonymous access).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hf_pipeline.config import gcs_emulator_host
from hf_pipeline.errors import SourceError
from hf_pipeline.stores.base import (
    PublishLocation,
    Source,
    Store,
    Upload,
    filter_by_glob,
    split_name_glob,
)
from hf_pipeline.stores.gcs_ranged import RangedGetter
from hf_pipeline.stores.remote_file import RemoteFile
from hf_pipeline.stores.retry import Cancelled, TransientError, check_deadline, with_retries
from hf_pipeline.stores.staging import READ_CHUNK, checksum_of

__all__ = ["GCSSource", "GCSStore"]

logger = logging.getLogger(__name__)


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
    if gcs_emulator_host():
        # Not our configuration but gcsfs': it reads this variable at import, so it
        # is set (unless the user chose) before gcsfs is first imported.
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


#: Bytes aiohttp buffers per connection before it stops reading the socket (its
#: default: 256 KiB). Measured on the 2-CPU host, 8 MiB ranges from fake-gcs-server
#: through gcsfs: 495-540 MB/s at 256 KiB, 750-760 at 1 MiB, 850-870 at 4 MiB.
READ_BUFSIZE = 4 << 20


class GCSSource(Source, scheme="gs://"):
    """``gs://bucket/prefix``: objects directly under the prefix, through gcsfs.

    The emulator is used when ``STORAGE_EMULATOR_HOST`` is set (anonymous access).
    """

    kind = "gcs"
    metadata_where = "next to the shards or at the bucket root"
    #: Bytes per ranged read. Each read is all-or-nothing (gcsfs buffers it), so this
    #: is also the resume granularity after a kill or a cut connection.
    read_chunk: int = READ_CHUNK

    def __init__(self, location: str, **kw: Any):
        super().__init__(location, **kw)
        path = location[len("gs://") :].strip("/")
        if not path:
            raise SourceError(location, "must look like gs://<bucket>/<prefix>")
        path, self.name_glob = split_name_glob(location, path)
        if not path:
            raise SourceError(location, "must look like gs://<bucket>/<prefix>")
        self._path = path
        self._bucket = path.split("/", 1)[0]
        self._fs_obj = None
        self._fs_pid = None
        self._ranged: RangedGetter | None = None

    def drop_handles(self, state: dict) -> dict:
        state["_fs_obj"] = None
        state["_fs_pid"] = None
        state["_ranged"] = None
        return state

    def _fs(self):
        # Rebuilt per process: the aiohttp session lives on fsspec's IO loop thread,
        # which a forked child does not have.
        if self._fs_obj is None or self._fs_pid != os.getpid():
            import aiohttp

            cls = _gcsfs_class()
            emulator = gcs_emulator_host()
            timeout_s = self.policy.file_timeout
            kw: dict[str, Any] = {
                "skip_instance_cache": True,
                "requests_timeout": aiohttp.ClientTimeout(
                    total=None, sock_connect=min(timeout_s, 30), sock_read=min(timeout_s, 60)
                ),
                # aiohttp's default read buffer (256 KiB) pauses and resumes the socket
                # every 256 KiB of a body: on fsspec's one event loop that capped a
                # streamed cache's 8 MiB ranged reads at ~60% of plain GETs' MB/s.
                "session_kwargs": {"read_bufsize": READ_BUFSIZE},
            }
            if emulator:
                kw.update(
                    endpoint_url=emulator if "://" in emulator else f"http://{emulator}",
                    token="anon",
                )
            fs = cls(**kw)
            # Ranged reads on connections of their own (gcs_ranged); with a client
            # certificate (mutual TLS) through gcsfs, which sets it up.
            self._ranged = (
                None
                if getattr(fs, "_use_client_cert", False)
                else RangedGetter(
                    fs, connect_timeout=min(timeout_s, 30), read_timeout=min(timeout_s, 60)
                )
            )
            self._fs_obj = fs
            self._fs_pid = os.getpid()
        return self._fs_obj

    def filesystem(self):
        """This process's gcsfs filesystem (emulator-aware; retries are the caller's,
        through :func:`~hf_pipeline.stores.retry.with_retries`)."""
        return self._fs()

    def describe(self, info: dict) -> RemoteFile:
        """The :class:`RemoteFile` of one gcsfs ``info``/``ls``/``find`` entry."""
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
            # The content, not the generation: a re-upload of the same bytes is the
            # same input. md5 first (128 bits; composite objects have only crc32c).
            etag=(
                f"md5:{info['md5Hash']}"
                if info.get("md5Hash")
                else checksum or str(info.get("generation") or info.get("etag") or "")
            ),
            checksum=checksum,
            version=str(info.get("generation") or info.get("etag") or ""),
        )

    def _ls(self, path: str) -> list[RemoteFile]:
        if path in self._listings:
            return self._listings[path]
        try:
            entries = with_retries(
                f"gs://{path}",
                lambda: self._fs().ls(path, detail=True, refresh=True),
                self.policy,
                on_retry=self.count_listing_retry,
            )
        except SourceError as err:
            if isinstance(err.__cause__, FileNotFoundError):
                raise SourceError(f"gs://{path}", "no such bucket or prefix") from err.__cause__
            raise
        out = [self.describe(e) for e in entries if e.get("type") == "file"]
        self._listings[path] = out
        return out

    def list_shard_folder(self) -> list[RemoteFile]:
        return filter_by_glob(self._ls(self._path), self.name_glob)

    def metadata_folders(self) -> Iterator[list[RemoteFile]]:
        yield self._ls(self._path)
        if self._path != self._bucket:
            yield self._ls(self._bucket)

    def owns(self, url: str) -> bool:
        return url.startswith(f"gs://{self._bucket}/")

    def stat(self, url: str) -> RemoteFile:
        path = url[len("gs://") :]
        try:
            info = with_retries(
                url,
                lambda: self._fs().info(path, refresh=True),
                self.policy,
                on_retry=self.count_listing_retry,
            )
        except SourceError as err:
            if isinstance(err.__cause__, FileNotFoundError):
                raise SourceError(url, "object does not exist") from err.__cause__
            raise
        return self.describe(info)

    def read_range(self, file, offset, deadline, stop):
        fs = self._fs()
        path = file.url[len("gs://") :]
        pos = offset
        while pos < file.size:
            check_deadline(deadline, file.url, self.policy.file_timeout)
            if stop is not None and stop.is_set():
                raise Cancelled(file.url)
            end = min(pos + self.read_chunk, file.size)
            block = fs.cat_file(path, start=pos, end=end)
            if not block:
                raise ConnectionError(f"empty body at offset {pos}")
            pos += len(block)
            yield block

    def read_span(self, rel: str, start: int, end: int, deadline: float) -> bytes:
        """Bytes ``[start, end)`` of object ``rel`` (a path under this source's location)
        in one ranged request (one attempt:
        retries are the caller's, :func:`~hf_pipeline.stores.retry.with_retries`), on this
        thread's own connection (:class:`~hf_pipeline.stores.gcs_ranged.RangedGetter`;
        through gcsfs with a client certificate).

        Fewer bytes than asked (a truncated body, or an object shorter than ``end``) come
        back as they are: the caller checks the length. Bounded by the client's socket
        timeouts (``file_timeout``) and by ``deadline`` (a ``time.monotonic()`` value).
        Thread-safe.
        """
        path = f"{self._path}/{rel}"
        check_deadline(deadline, f"gs://{path}", self.policy.file_timeout)
        fs = self._fs()
        ranged = self._ranged
        data = (
            fs.cat_file(path, start=start, end=end)
            if ranged is None
            else ranged.get(path, start, end)
        )
        check_deadline(deadline, f"gs://{path}", self.policy.file_timeout)
        return data


class GCSStore(Store, scheme="gs://"):
    """Published caches under ``gs://<bucket>[/<prefix>]``: each file an object, uploaded
    and read back (its crc32c checked) one by one; the tail in order, so the last stage
    marker appears last."""

    source: GCSSource
    kind = "gcs"
    location_form = "gs://<bucket>[/<prefix>]"

    @classmethod
    def parse_location(cls, url: str) -> PublishLocation | None:
        path = url[len("gs://") :].strip("/")
        if not path or "*" in path or "?" in path or "[" in path:
            return None  # a bucket is needed, and a glob names no single place
        return PublishLocation(url=f"gs://{path}", kind=cls.kind, path=path)

    @classmethod
    def source_location(cls, location: PublishLocation) -> str:
        return location.url

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

    def _put(self, cache_name: str, item: Upload) -> bool:
        """Make ``item``'s object: copied in the store when it has a source and the copy
        checks out, else uploaded; True when copied."""
        # Imported here: publish.manifest imports this package's leaf modules, so a
        # module-level import would run into it half-initialised.
        from hf_pipeline.publish.manifest import same_content

        path = f"{self._prefix(cache_name)}/{item.rel}"
        if item.copy_from is not None and self._copy(path, item):
            return True
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
        return False

    def _copy(self, path: str, item: Upload) -> bool:
        """Make object ``path`` a copy of ``item.copy_from`` inside GCS (``rewriteTo``: no
        byte through this host), of the generation that was listed, and check it as an
        upload is checked — its size and crc32c against the verified digests — and its
        md5 against the local file's, read now: a crc32c can be matched on purpose by
        whoever writes to the bucket, an md5 not without the local bytes. False (said in
        a warning) when the source is not what it was listed as, is gone, or the copy
        does not check out: the caller uploads the file, over the failed copy.

        The copy is an object of its own: it does not depend on the source's folder,
        and it stores its bytes again (GCS objects share no storage).
        """
        from hf_pipeline.publish.manifest import same_content

        src = item.copy_from
        assert src is not None and isinstance(item.local, Path), "copies are of data files"
        url = f"gs://{path}"
        md5 = f"md5:{checksum_of(item.local, 'md5')}"
        why = ""
        if src.etag != md5:
            why = f"{src.url} is listed with {src.etag or 'no md5'}, the local file has {md5}"
        else:
            fs = self._fs()
            src_bucket, src_key = src.url[len("gs://") :].split("/", 1)
            dst_bucket, dst_key = path.split("/", 1)

            def rewrite() -> RemoteFile:
                deadline = time.monotonic() + self.policy.file_timeout
                token = None
                while True:  # a large or cross-location rewrite answers in several steps
                    out = fs.call(
                        "POST", "b/{}/o/{}/rewriteTo/b/{}/o/{}",
                        src_bucket, src_key, dst_bucket, dst_key,
                        headers={"Content-Type": "application/json"}, json_out=True,
                        sourceGeneration=src.version or None, rewriteToken=token,
                    )  # fmt: skip
                    if out.get("done") is True:
                        return self.source.describe(fs.info(path, refresh=True))
                    token = out.get("rewriteToken")
                    if not token:
                        raise TransientError(f"rewrite of {src.url} not done and no token")
                    check_deadline(deadline, url, self.policy.file_timeout)

            try:
                got = with_retries(url, rewrite, self.policy)
            except SourceError as e:  # the listed generation gone (404), forbidden, down
                why = (
                    f"{src.url} is gone (generation {src.version}): replaced or removed "
                    "since it was listed"
                    if isinstance(e.__cause__, FileNotFoundError)
                    else f"the store's copy of {src.url} failed: {e.reason}"
                )
            else:
                if not same_content(got, item.entry, item.local) or got.etag != md5:
                    why = (
                        f"the copy of {src.url} holds {got.size} bytes ({got.checksum}, "
                        f"{got.etag or 'no md5'}), the local file {item.entry.size} "
                        f"(crc32c:{item.entry.crc32c}, {md5})"
                    )
        if why:
            logger.warning("%s: not copied in the store (%s); uploaded instead", url, why)
            return False
        return True

    def upload(
        self, cache_name: str, data: Sequence[Upload], tail: Sequence[Upload], *, workers: int
    ) -> set[str]:
        copied: list[str] = []
        if data:
            with ThreadPoolExecutor(
                max(1, min(workers, len(data))), thread_name_prefix="hf_pipeline-publish"
            ) as pool:
                # list(): re-raise the first failure here (never dropped with its future).
                made = list(pool.map(lambda item: self._put(cache_name, item), data))
            copied = [item.rel for item, by_copy in zip(data, made, strict=True) if by_copy]
        for item in tail:  # in order: the last marker is what makes the folder a cache
            self._put(cache_name, item)
        return set(copied)
