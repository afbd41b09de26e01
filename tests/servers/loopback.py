"""The lifecycle both loopback test servers share: a threaded HTTP server on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LoopbackServer:
    """Serve ``handler`` on a free loopback port from a daemon thread.

    ``start()``/``stop()`` or a ``with`` block; ``stop()`` joins the thread (bounded).

    ``reuse_port``: the port is opened with ``SO_REUSEPORT`` (Linux), and ``port`` may
    be one that servers of other processes opened so: the kernel spreads the
    connections over them (a proxy in several processes, each with its own GIL).
    """

    thread_name = "loopback-server"

    def __init__(
        self, handler: type[BaseHTTPRequestHandler], *, port: int = 0, reuse_port: bool = False
    ):
        self._server = ThreadingHTTPServer(("127.0.0.1", port), handler, bind_and_activate=False)
        # socketserver listens with a backlog of 5: clients opening many connections at
        # once (stream workers, 64 each) lost SYNs, and a read waited out its connect
        # timeout (30 s) on the 2-CPU VM's bench.
        self._server.request_queue_size = 1024
        try:
            if reuse_port:
                self._server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            self._server.server_bind()
            self._server.server_activate()
        except BaseException:
            self._server.server_close()
            raise
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self):
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=self.thread_name, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
