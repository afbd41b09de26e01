"""``gs://bucket/prefix``: objects directly under a prefix, listed and read with gcsfs.

Environment (read at call time through :mod:`hf_pipeline.config`):
``STORAGE_EMULATOR_HOST`` points at a GCS emulator (anonymous access).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from hf_pipeline.config import gcs_emulator_host
from hf_pipeline.errors import SourceError
from hf_pipeline.stores.base import Source, filter_by_glob, split_name_glob
from hf_pipeline.stores.remote_file import RemoteFile
from hf_pipeline.stores.retry import Cancelled, check_deadline, with_retries
from hf_pipeline.stores.staging import READ_CHUNK

__all__ = ["GCSSource"]


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


class GCSSource(Source, scheme="gs://"):
    """``gs://bucket/prefix``: objects directly under the prefix, through gcsfs.

    The emulator is used when ``STORAGE_EMULATOR_HOST`` is set (anonymous access).
    """

    kind = "gcs"
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

    def drop_handles(self, state: dict) -> dict:
        state["_fs_obj"] = None
        state["_fs_pid"] = None
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
            }
            if emulator:
                kw.update(
                    endpoint_url=emulator if "://" in emulator else f"http://{emulator}",
                    token="anon",
                )
            self._fs_obj = cls(**kw)
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
            etag=str(info.get("generation") or info.get("etag") or ""),
            checksum=checksum,
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
        retries are the caller's, :func:`~hf_pipeline.stores.retry.with_retries`).

        Fewer bytes than asked (a truncated body, or an object shorter than ``end``) come
        back as they are: the caller checks the length. Bounded by the client's socket
        timeouts (``file_timeout``) and by ``deadline`` (a ``time.monotonic()`` value).
        Thread-safe.
        """
        path = f"{self._path}/{rel}"
        check_deadline(deadline, f"gs://{path}", self.policy.file_timeout)
        data = self._fs().cat_file(path, start=start, end=end)
        check_deadline(deadline, f"gs://{path}", self.policy.file_timeout)
        return data
