"""A fault-injecting HTTP reverse proxy for tests (threaded ``http.server``).

Put it between a client and a real server (fake-gcs-server, the fake Hub) and it
forwards every request, except that requests matching a :class:`Fault` get a 5xx/429,
a connection reset, a truncated body, a stall, a throttled body, or a body sent through one link shared by all such requests.
A body with no fault, or after a stall, is forwarded as it arrives (chunks of 256 KiB
as upstream sends them), never held whole: a stall is a per-request latency (time to
the first byte), and the body then streams at the speed of upstream and the client. It counts every
request so tests can assert what was (not) fetched again, the body bytes it sent
(:meth:`FaultProxy.body_bytes`: what a client fetched, counted the same for any client)
and those it was sent (:meth:`FaultProxy.request_bytes`: what a client uploaded).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import re
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote, urlsplit

from tests.servers.loopback import LoopbackServer

__all__ = ["Fault", "FaultProxy"]

#: Bytes forwarded at a time when a body is streamed (no fault, or a stall).
_STREAM_CHUNK = 256 << 10

_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
}


@dataclasses.dataclass(kw_only=True)
class Fault:
    """One injected failure.

    Attributes:
        match: substring of the unquoted request path (a file name, say).
        action: "status" (reply ``status``), "reset" (RST the connection), "truncate"
            (send full headers, half the body, close), "stall" (sleep ``seconds``
            before forwarding), "throttle" (send the body at ``rate`` bytes/s), "link"
            (send the body through one link of ``rate`` bytes/s shared by every request
            this fault applies to, as a store's bandwidth is: two bodies at once each
            get half; each is held ``seconds`` first, a request's latency), "close"
            (answer in full, then close the kept-alive connection without saying so, as
            a server does with an idle one) or "ignore_range" (forward the request
            without its ``Range`` header: the whole object comes back, ``200``).
        times: how many matching requests it applies to (-1: all).
        status: for "status".
        seconds: for "stall".
        rate: for "throttle" and "link".
        method: only requests with this method ("" any).
        skip: let this many matching requests through untouched first.
    """

    match: str
    action: str
    times: int = 1
    status: int = 503
    seconds: float = 0.0
    rate: int = 0
    method: str = "GET"
    skip: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Logged:
    method: str
    path: str
    range: str
    fault: str
    body: int = 0  # request body bytes (an upload's)


class FaultProxy(LoopbackServer):
    """Reverse proxy to ``upstream`` on 127.0.0.1 with scheduled faults. Thread-safe.

    Usage::

        with FaultProxy("http://127.0.0.1:4443") as proxy:
            proxy.add(Fault(match="000000-000009.pt", action="status", status=503, times=2))
            os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
    """

    def media_ranges(self, name: str) -> list[tuple[int, int]]:
        """(start, end) byte ranges of the GCS body downloads of ``name`` seen so far
        (end -1: to the end of the object)."""
        out = []
        for r in list(self.log):
            if name in r.path and "alt=media" in r.path and r.method == "GET":
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", r.range or "")
                out.append((int(m.group(1)), int(m.group(2) or -1)) if m else (0, -1))
        return out

    def __init__(self, upstream: str, *, port: int = 0, reuse_port: bool = False):
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self.log: list[_Logged] = []
        # (path, body bytes sent) of every GET answered with a body.
        self._sent: list[tuple[str, int]] = []
        self._stop = threading.Event()
        # "link": when the shared link is free next (time.monotonic()), under _lock.
        self._link_free = 0.0
        super().__init__(self._handler_class(), port=port, reuse_port=reuse_port)

    thread_name = "fault-proxy"

    def stop(self) -> None:
        self._stop.set()
        super().stop()

    def add(self, *faults: Fault) -> None:
        with self._lock:
            self._faults.extend(faults)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
            self.log.clear()
            self._sent.clear()

    def count(self, match: str, method: str = "GET", *, media_only: bool = True) -> int:
        """Requests whose path contains ``match`` (by default only body downloads)."""
        with self._lock:
            return sum(
                1
                for r in self.log
                if match in r.path
                and (not method or r.method == method)
                and (not media_only or "alt=media" in r.path or "/resolve/" in r.path)
            )

    def request_bytes(self, match: str = "") -> int:
        """Request body bytes (uploads, any method) of the requests whose path contains
        ``match``: what a client sent."""
        with self._lock:
            return sum(r.body for r in self.log if match in r.path)

    def body_bytes(self, match: str = "") -> int:
        """Body bytes sent in answer to GET requests whose path contains ``match``."""
        with self._lock:
            return sum(n for path, n in self._sent if match in path)

    def _body_sent(self, path: str, n: int) -> None:
        with self._lock:
            self._sent.append((path, n))

    def _link_slot(self, nbytes: int, rate: int) -> float:
        """Reserve the shared link for ``nbytes`` at ``rate``: when they are sent."""
        with self._lock:
            start = max(time.monotonic(), self._link_free)
            self._link_free = start + nbytes / rate
            return self._link_free

    def _take(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.times != 0 and f.match in path and (not f.method or f.method == method):
                    if f.skip > 0:
                        f.skip -= 1
                        return None
                    if f.times > 0:
                        f.times -= 1
                    return f
        return None

    def _handler_class(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                path = unquote(self.path)
                fault = proxy._take(self.command, path)
                with proxy._lock:
                    proxy.log.append(
                        _Logged(
                            method=self.command,
                            path=path,
                            range=self.headers.get("Range", ""),
                            fault=fault.action if fault else "",
                            body=len(body or b""),
                        )
                    )
                if fault is not None and fault.action == "reset":
                    # SO_LINGER 0: close() sends RST, the client sees "connection reset".
                    self.connection.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                    self.close_connection = True
                    self.connection.close()
                    return
                if fault is not None and fault.action == "status":
                    payload = json.dumps(
                        {"error": {"code": fault.status, "message": "injected"}}
                    ).encode()
                    self.send_response(fault.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                if fault is not None and fault.action in ("stall", "link"):
                    if proxy._stop.wait(fault.seconds):
                        return
                conn = http.client.HTTPConnection(
                    proxy.upstream_host, proxy.upstream_port, timeout=60
                )
                if fault is not None and fault.action == "close":
                    self.close_connection = True  # after this answer, with no header
                try:
                    skip = _HOP | (
                        {"range"} if fault is not None and fault.action == "ignore_range" else set()
                    )
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    upstream = f"http://{proxy.upstream_host}:{proxy.upstream_port}"
                    out_headers = [
                        # A resumable upload's session URL names the server: sent back
                        # through the proxy, the upload's bytes are counted (and faulted).
                        (k, proxy.url + v[len(upstream) :])
                        if k.lower() == "location" and v.startswith(upstream + "/")
                        else (k, v)
                        for k, v in resp.getheaders()
                        if k.lower() not in _HOP | {"content-length"}
                    ]
                    length = resp.getheader("Content-Length")
                    if (
                        self.command == "GET"
                        and (fault is None or fault.action in ("stall", "close", "ignore_range"))
                        and length is not None
                        and length.isdigit()
                    ):
                        # Forwarded as it arrives, as a store sends a body: the client
                        # reads the first bytes while the last are still upstream.
                        self._stream(path, resp, out_headers, int(length))
                        return
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in out_headers:
                    self.send_header(k, v)
                # HEAD carries the upstream length; GET carries what we send.
                if self.command == "HEAD":
                    self.send_header("Content-Length", resp.getheader("Content-Length", "0"))
                else:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if fault is not None and fault.action == "truncate":
                    self.wfile.write(data[: len(data) // 2])
                    proxy._body_sent(path, len(data) // 2)
                    self.wfile.flush()
                    self.close_connection = True
                    return
                if fault is not None and fault.action == "throttle" and fault.rate > 0:
                    proxy._body_sent(path, len(data))
                    step = max(1, fault.rate // 20)
                    for i in range(0, len(data), step):
                        if proxy._stop.is_set():
                            return
                        self.wfile.write(data[i : i + step])
                        self.wfile.flush()
                        time.sleep(step / fault.rate)
                    return
                if fault is not None and fault.action == "link" and fault.rate > 0:
                    # Chunks interleave with the other bodies on the link, in turn.
                    step = 64 << 10
                    for i in range(0, len(data), step):
                        chunk = data[i : i + step]
                        done = proxy._link_slot(len(chunk), fault.rate)
                        if proxy._stop.wait(max(0.0, done - time.monotonic())):
                            return
                        self.wfile.write(chunk)
                    self.wfile.flush()
                    proxy._body_sent(path, len(data))
                    return
                self.wfile.write(data)
                # Counted once written: a body the client reset mid-way is not counted.
                if self.command == "GET":
                    proxy._body_sent(path, len(data))

            def _stream(self, path, resp, out_headers, length: int) -> None:
                """Send ``resp``'s body on in chunks as they come from upstream."""
                self.send_response(resp.status)
                for k, v in out_headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(length))
                self.end_headers()
                sent = 0
                while sent < length:
                    if proxy._stop.is_set():
                        self.close_connection = True
                        return
                    chunk = resp.read1(_STREAM_CHUNK)
                    if not chunk:  # upstream ended early: the client sees a short body
                        self.close_connection = True
                        break
                    self.wfile.write(chunk)
                    sent += len(chunk)
                self.wfile.flush()
                # Counted once written: a body the client reset mid-way is not counted.
                proxy._body_sent(path, sent)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

        return Handler
