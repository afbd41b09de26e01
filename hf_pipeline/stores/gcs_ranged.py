"""Ranged GETs of GCS objects over plain keep-alive HTTP connections, one per thread.

A streamed cache (:mod:`hf_pipeline.read.stream`) makes thousands of small ranged reads
an epoch (a global shuffle: ~0.2 MB each), each from a thread of its read pool. Through
gcsfs (``cat_file``) each read crossed to fsspec's one event loop thread and back and
ran aiohttp's and gcsfs' request machinery there, all of it Python under the GIL: the
HTTP client's CPU per read, not the store, bounded the reads a second one process made
(benchmarks/NOTES.md, 2026-12-02, "CPU per ranged read"). Here each reading thread
sends its request and reads the body on a connection of its own (``http.client``; the
body's bytes are received in C with the GIL released), so nothing else runs per read.

What stays gcsfs': the endpoint (``STORAGE_EMULATOR_HOST``, the universe domain), the
credentials (their headers, refreshed when due, thread-safe), requester-pays, and the
mapping of an error status to an exception (:func:`gcsfs.retry.validate_response`: 404
is ``FileNotFoundError``, 403 ``OSError``, 429/5xx carry their status), so retries
classify a failure as they did. Retries are the caller's
(:func:`~hf_pipeline.stores.retry.with_retries`), except one: a kept-alive connection
the server closed while idle fails before any answer, and is reopened once at once
(as urllib3 does; not a store fault, not worth a warning and a backoff).

A body is bounded by the range asked for: a server that ignores the ``Range`` header
(``200`` with the whole object) is refused after ``end - start + 1`` bytes, the
connection dropped, and never read whole. A short body is told apart by the ``206``'s
``Content-Range`` (``bytes a-b/<size>``): an object that ends before the range does
(truncated after it was published) is :class:`~hf_pipeline.stores.retry.ShortObjectError`,
not retried; a body the connection cut (the size announced covers the range) comes
back short and is retried by the caller as an outage.

Thread-safe: connections are per thread (:class:`threading.local`); a connection is
dropped after any failure, so the next attempt starts on a fresh one.
"""

from __future__ import annotations

import http.client
import re
import socket
import ssl
import threading
from typing import Any, cast
from urllib.parse import urlencode, urlsplit

from hf_pipeline.stores.retry import ShortObjectError, TransientError

__all__ = ["RangedGetter"]

#: A ``206``'s ``Content-Range``: its last number is the object's size (RFC 9110 14.4).
_CONTENT_RANGE = re.compile(r"bytes \d{1,20}-\d{1,20}/(\d{1,20})")

#: Failures of a reused connection before the status line: the server closed it while
#: it sat idle in the pool (keep-alive timeouts); the request is sent once more at once.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class RangedGetter:
    """Ranged GETs of the objects of one gcsfs filesystem's endpoint (see the module).

    Args:
        fs: a ``gcsfs.GCSFileSystem``: its endpoint, credentials and requester-pays
            project are used; its session and event loop are not.
        connect_timeout: seconds to open a connection.
        read_timeout: seconds any one send or receive may wait (a stalled body fails
            after this long without a byte).
    """

    def __init__(self, fs: Any, *, connect_timeout: float, read_timeout: float):
        self._fs = fs
        url = fs.url("b/o")  # any object's: only the endpoint is kept
        location = urlsplit(url)
        if location.scheme not in ("http", "https") or not location.hostname:
            raise ValueError(f"a GCS endpoint must be http(s)://host[:port], got {url}")
        self._https = location.scheme == "https"
        self._host = location.hostname
        self._port = location.port
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._ssl = ssl.create_default_context() if self._https else None
        self._local = threading.local()
        self._targets: dict[str, str] = {}  # object path -> request target (path?query)

    def _target(self, path: str) -> str:
        target = self._targets.get(path)
        if target is None:
            url = urlsplit(self._fs.url(path))
            extra = self._fs._get_params({})  # requester pays: userProject
            query = url.query + (f"&{urlencode(extra)}" if extra else "")
            target = self._targets[path] = f"{url.path}?{query}"
        return target

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, connected, and whether it was opened now (not
        reused)."""
        conn = getattr(self._local, "conn", None)
        fresh = conn is None
        if conn is None:
            if self._ssl is not None:
                conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self._connect_timeout, context=self._ssl
                )
            else:
                conn = http.client.HTTPConnection(
                    self._host, self._port, timeout=self._connect_timeout
                )
            self._local.conn = conn
        if conn.sock is None:  # new, or closed by http.client after "Connection: close"
            fresh = True
            conn.connect()
            # connect() set it (mypy keeps the narrowing to None from the test above).
            sock = cast(socket.socket, conn.sock)
            # Every later send and receive on it: once here, not per request.
            sock.settimeout(self._read_timeout)
        return conn, fresh

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def get(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of object ``path`` (``bucket/key``), one attempt.

        A body shorter than asked comes back as it is (the caller checks the length),
        unless the store says the object ends before ``end``.

        Raises:
            FileNotFoundError, OSError, ...: the store's answer, mapped as gcsfs maps it.
            ShortObjectError: a ``206`` whose ``Content-Range`` gives the object fewer
                than ``end`` bytes (its size: the range crosses its end).
            TransientError: the server sent more than the range (it ignored ``Range``).
            TimeoutError, ConnectionError: the connection failed or stalled.
            TransientError: a malformed answer (``http.client.HTTPException``).
        """
        if end <= start:
            return b""
        headers = {"Range": f"bytes={start}-{end - 1}", "User-Agent": "hf_pipeline"}
        self._fs.credentials.apply(headers)
        target = self._target(path)
        try:
            for attempt in (1, 2):
                conn, fresh = self._connection()
                try:
                    conn.request("GET", target, headers=headers)
                    resp = conn.getresponse()
                    break
                except _STALE:
                    self._drop()
                    if fresh or attempt == 2:
                        raise
            want = end - start
            body = resp.read(want + 1)
            if resp.status >= 400:
                from gcsfs.retry import validate_response

                self._drop()  # the rest of an error body is not read
                validate_response(resp.status, body, path)
            if len(body) > want:
                self._drop()
                raise TransientError(
                    f"gs://{path}: HTTP {resp.status} sent more than the {want} bytes at "
                    f"{start} asked for (the Range header ignored)"
                )
            if len(body) < want and resp.status == 206:
                size = _CONTENT_RANGE.fullmatch(resp.getheader("Content-Range", "").strip())
                if size is not None and int(size.group(1)) < end:
                    raise ShortObjectError(f"gs://{path}", int(size.group(1)))
            if not resp.isclosed():  # a short body with more announced: do not reuse
                self._drop()
            return body
        except http.client.HTTPException as exc:  # a malformed or cut answer: retried
            self._drop()
            raise TransientError(f"gs://{path}: {exc!r}") from exc
        except BaseException:
            self._drop()
            raise

    def close(self) -> None:
        """Close this thread's connection (others close when their thread ends)."""
        self._drop()
