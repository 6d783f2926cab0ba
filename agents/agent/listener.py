"""The agent's listener: TLS, a deadline per request, a bounded pool of workers.

A connection takes a worker only once its first bytes arrive; until then it
waits in one selector thread and is closed after ``socket_timeout``, so a
client that opens connections and sends nothing holds no worker and starves
nobody.  Once it has a worker, the whole request (TLS handshake, headers and
body) must arrive within ``socket_timeout`` or the connection is cut: a
client that sends a byte at a time cannot keep a worker either.  Requests
beyond ``workers + max_queued`` are refused by closing the connection.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

LOG = logging.getLogger("flexmig.agent.listener")
SELECT_TICK_S = 0.1  # how late an idle connection may be closed
BACKLOG = 128


@dataclasses.dataclass(frozen=True)
class Limits:
    socket_timeout: float = 10.0
    workers: int = 16
    max_queued: int = 64
    max_idle_connections: int = 1024


def server_tls(cert_file: str, key_file: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


def client_tls(ca_file: str) -> ssl.SSLContext:
    """Verifies an agent's certificate against the deployment's CA (names and IPs)."""
    context = ssl.create_default_context(cafile=ca_file)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


class Deadline:
    """Cuts a connection whose request has not fully arrived in time."""

    def __init__(self, conn: socket.socket, seconds: float) -> None:
        self._timer = threading.Timer(seconds, self._cut, args=(conn,))
        self._timer.daemon = True
        self._timer.start()

    @staticmethod
    def _cut(conn: socket.socket) -> None:
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed

    def met(self) -> None:
        self._timer.cancel()


class Listener:
    """Serves ``handler`` (a socketserver-style request handler class) on ``sock``."""

    def __init__(
        self,
        sock: socket.socket,
        handler: Callable[[Any, Any, Any], Any],
        limits: Limits,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.socket = sock
        self.server_address = sock.getsockname()
        self.handler = handler
        self.limits = limits
        self.tls = tls
        self._pool = ThreadPoolExecutor(limits.workers, thread_name_prefix="agent-api")
        self._busy = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        self._stop = threading.Event()
        self._stopped = threading.Event()

    def request_read(self) -> None:
        """Called by the handler once the request has arrived: no more deadline."""
        deadline = getattr(self._local, "deadline", None)
        if deadline is not None:
            deadline.met()

    def serve_forever(self) -> None:
        selector = selectors.DefaultSelector()
        self.socket.setblocking(False)
        selector.register(self.socket, selectors.EVENT_READ, None)
        idle: dict[socket.socket, float] = {}  # connected, nothing sent yet: since when
        try:
            while not self._stop.is_set():
                for key, _events in selector.select(SELECT_TICK_S):
                    if key.data is None:
                        self._accept(selector, idle)
                    else:
                        conn = key.fileobj
                        selector.unregister(conn)
                        idle.pop(conn, None)  # type: ignore[call-overload]
                        self._dispatch(conn, key.data)  # type: ignore[arg-type]
                self._expire(selector, idle, time.monotonic() - self.limits.socket_timeout)
        finally:
            for conn in idle:
                conn.close()
            selector.close()
            self._stopped.set()

    def _accept(self, selector: selectors.BaseSelector, idle: dict[socket.socket, float]) -> None:
        while True:
            try:
                conn, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                LOG.warning("accept failed: %s", exc)
                return
            if len(idle) >= self.limits.max_idle_connections:
                oldest = min(idle, key=idle.__getitem__)
                selector.unregister(oldest)
                del idle[oldest]
                oldest.close()
            conn.setblocking(False)
            idle[conn] = time.monotonic()
            selector.register(conn, selectors.EVENT_READ, address)  # "" for UNIX

    @staticmethod
    def _expire(
        selector: selectors.BaseSelector, idle: dict[socket.socket, float], before: float
    ) -> None:
        for conn in [c for c, since in idle.items() if since < before]:
            selector.unregister(conn)
            del idle[conn]
            conn.close()

    def _dispatch(self, conn: socket.socket, address: Any) -> None:
        with self._lock:
            full = self._busy >= self.limits.workers + self.limits.max_queued
            if not full:
                self._busy += 1
        if full:
            LOG.warning(
                "refusing a request from %s: %d requests in hand", address or "unix", self._busy
            )
            conn.close()
            return
        conn.setblocking(True)
        conn.settimeout(self.limits.socket_timeout)
        self._pool.submit(self._serve, conn, address)

    def _serve(self, conn: socket.socket, address: Any) -> None:
        self._local.deadline = Deadline(conn, self.limits.socket_timeout)
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            self.handler(conn, address, self)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            LOG.info("connection from %s dropped: %s", address or "unix", exc)
        except Exception:
            LOG.exception("connection from %s failed", address or "unix")
        finally:
            self._local.deadline.met()
            self._local.deadline = None
            conn.close()
            with self._lock:
                self._busy -= 1

    def shutdown(self) -> None:
        self._stop.set()
        self._stopped.wait(10 * SELECT_TICK_S + 1)

    def server_close(self) -> None:
        self.socket.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def tcp_listener(
    address: str, port: int, handler: Any, limits: Limits, tls: ssl.SSLContext | None
) -> Listener:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return Listener(sock, handler, limits, tls)


def unix_listener(path: str, handler: Any, limits: Limits) -> Listener:
    """The same API for local tools: mode 0600, no TLS (it never leaves the host)."""
    if os.path.exists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return Listener(sock, handler, limits)
