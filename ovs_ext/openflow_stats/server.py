"""The OpenFlow statistics endpoint's sockets: one selector thread.

Listens only where configured (a UNIX socket, mode 0600 by default; TCP only
on a given address), serves a bounded number of connections, bounds every
read and every connection's queued output, and closes connections that stay
silent.  Protocol logic lives in :mod:`session`.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import selectors
import socket
import stat
import threading
import time

from oslo_config import cfg

from flexmig import exceptions
from ovs_ext.openflow_stats import config
from ovs_ext.openflow_stats.dumps import SharedDumps
from ovs_ext.openflow_stats.session import EndpointInfo, PortNameSource, RecordSource, Session

LOG = logging.getLogger("flexmig.ovs_ext.openflow_stats")

READ_CHUNK = 65536  # one recv; a message is at most 64 KiB
OUTPUT_HIGH_WATER = 256 * 1024  # queued reply bytes per connection
TICK_S = 0.5  # idle checks and stop requests are noticed this often
MIN_BACKLOG = 16


class EndpointError(exceptions.FlexMigError):
    msg_fmt = "OpenFlow statistics endpoint on %(where)s: %(reason)s"


@dataclasses.dataclass
class _Connection:
    sock: socket.socket
    session: Session
    peer: str
    last_activity: float
    outbuf: bytearray = dataclasses.field(default_factory=bytearray)
    eof: bool = False


class OpenFlowStatsServer:
    """Serves ``records()`` to ``ovs-ofctl`` until :meth:`stop`.

    ``records`` is called once per flow or aggregate request, from the
    server's thread: it must be cheap and thread-safe (return a snapshot).
    """

    def __init__(
        self,
        records: RecordSource,
        *,
        unix_socket: str | None = None,
        unix_socket_mode: int = 0o600,
        tcp_address: tuple[str, int] | None = None,
        max_connections: int = 16,
        idle_timeout: float = 60.0,
        port_names: PortNameSource | None = None,
        info: EndpointInfo | None = None,
        dump_reuse_s: float = 0.0,
    ) -> None:
        if not unix_socket and tcp_address is None:
            raise EndpointError(where="(nowhere)", reason="neither a UNIX socket nor TCP is set")
        self._records = records
        self._port_names = port_names
        self._info = info or EndpointInfo()
        self._unix_path = unix_socket or None
        self._unix_mode = unix_socket_mode
        self._tcp_address = tcp_address
        self._max_connections = max_connections
        self._idle_timeout = idle_timeout
        # One per endpoint: every connection's dumps share its answers (dumps.py).
        self._dumps = SharedDumps(dump_reuse_s) if dump_reuse_s > 0 else None
        self._listeners: list[socket.socket] = []
        self._connections: dict[int, _Connection] = {}
        self._selector: selectors.BaseSelector | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake_r: socket.socket | None = None  # stop() wakes the loop through it
        self._wake_w: socket.socket | None = None
        self._unix_inode: tuple[int, int] | None = None
        # Room for every connection the endpoint would serve to wait while the
        # thread encodes a dump: a full UNIX backlog makes a client's connect()
        # fail (EAGAIN), which ovs-ofctl reports as "Protocol error".
        self._backlog = max(MIN_BACKLOG, max_connections)

    @classmethod
    def from_config(
        cls,
        conf: cfg.ConfigOpts,
        records: RecordSource,
        port_names: PortNameSource | None = None,
    ) -> OpenFlowStatsServer:
        opts = conf[config.GROUP]
        tcp = (str(opts.tcp_address), opts.tcp_port) if opts.tcp_address else None
        return cls(
            records,
            unix_socket=opts.unix_socket or None,
            unix_socket_mode=int(opts.unix_socket_mode, 8),
            tcp_address=tcp,
            max_connections=opts.max_connections,
            idle_timeout=opts.idle_timeout,
            port_names=port_names,
            info=EndpointInfo(datapath_id=opts.datapath_id),
            dump_reuse_s=opts.dump_reuse_s,
        )

    # ------------------------------------------------------------ lifecycle

    @property
    def tcp_port(self) -> int | None:
        """The bound TCP port (useful when configured as 0)."""
        for listener in self._listeners:
            if listener.family == socket.AF_INET:
                return listener.getsockname()[1]
        return None

    def start(self) -> None:
        try:
            if self._unix_path:
                self._listeners.append(self._listen_unix(self._unix_path))
            if self._tcp_address is not None:
                self._listeners.append(self._listen_tcp(*self._tcp_address))
        except EndpointError:
            self._close_listeners()
            raise
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for listener in self._listeners:
            listener.setblocking(False)
            self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="openflow-stats", daemon=True)
        self._thread.start()
        LOG.info("OpenFlow statistics endpoint listening on %s", ", ".join(self.targets()))

    def targets(self) -> list[str]:
        """The ovs-ofctl targets that reach this endpoint."""
        found = []
        if self._unix_path:
            found.append(f"unix:{self._unix_path}")
        if self._tcp_address is not None:
            found.append(f"tcp:{self._tcp_address[0]}:{self.tcp_port}")
        return found

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._wake_w is not None:
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise exceptions.Timeout(seconds=timeout, what="the OpenFlow stats thread")
            self._thread = None
        for conn in list(self._connections.values()):
            self._close(conn)
        self._close_listeners()
        if self._selector is not None:
            self._selector.close()
            self._selector = None
        for wake in (self._wake_r, self._wake_w):
            if wake is not None:
                wake.close()
        self._wake_r = self._wake_w = None

    def __enter__(self) -> OpenFlowStatsServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------ listeners

    def _listen_unix(self, path: str) -> socket.socket:
        _remove_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            # Connections are refused until listen(), so the socket is never
            # reachable with the wider default mode.
            os.chmod(path, self._unix_mode)
            sock.listen(self._backlog)
        except OSError as exc:
            sock.close()
            raise EndpointError(where=path, reason=exc.strerror or str(exc)) from exc
        info = os.stat(path)
        self._unix_inode = (info.st_dev, info.st_ino)
        return sock

    def _listen_tcp(self, address: str, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
            sock.listen(self._backlog)
        except OSError as exc:
            sock.close()
            raise EndpointError(where=f"{address}:{port}", reason=exc.strerror or str(exc)) from exc
        return sock

    def _close_listeners(self) -> None:
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()
        if self._unix_path and self._unix_inode:
            try:
                info = os.stat(self._unix_path)
                if (info.st_dev, info.st_ino) == self._unix_inode:
                    os.unlink(self._unix_path)
            except FileNotFoundError:
                pass
            self._unix_inode = None

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        assert self._selector is not None
        while not self._stop.is_set():
            for key, events in self._selector.select(TICK_S):
                if key.fileobj in self._listeners:
                    self._accept(key.fileobj)
                elif key.fileobj is self._wake_r:
                    key.fileobj.recv(64)
                else:
                    self._service(key.data, events)
            self._close_idle()

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, address = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        peer = str(address) if address else "unix"
        if len(self._connections) >= self._max_connections:
            LOG.warning("OpenFlow stats: %d connections open, refusing %s", self._max_connections,
                        peer)  # fmt: skip
            sock.close()
            return
        sock.setblocking(False)
        session = Session(self._records, self._port_names, self._info, peer, self._dumps)
        conn = _Connection(sock, session, peer, time.monotonic())
        self._connections[sock.fileno()] = conn
        assert self._selector is not None
        self._selector.register(sock, selectors.EVENT_WRITE, conn)
        self._service(conn, selectors.EVENT_WRITE)

    def _service(self, conn: _Connection, events: int) -> None:
        try:
            if events & selectors.EVENT_READ:
                self._receive(conn)
            if len(conn.outbuf) < OUTPUT_HIGH_WATER:
                conn.outbuf += conn.session.pull_output(OUTPUT_HIGH_WATER - len(conn.outbuf))
            if conn.outbuf:
                sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
                conn.last_activity = time.monotonic()
        except BlockingIOError:
            pass
        except OSError as exc:
            LOG.info("OpenFlow stats: %s: %s", conn.peer, exc)
            self._close(conn)
            return
        except Exception:  # a failing record source must not stop the endpoint
            LOG.exception("OpenFlow stats: serving %s failed", conn.peer)
            self._close(conn)
            return
        self._update_interest(conn)

    def _receive(self, conn: _Connection) -> None:
        data = conn.sock.recv(READ_CHUNK)
        if not data:
            conn.eof = True
            return
        conn.last_activity = time.monotonic()
        conn.session.feed(data)

    def _update_interest(self, conn: _Connection) -> None:
        done = conn.session.closing or conn.eof
        if not conn.outbuf and done and not conn.session.has_work():
            self._close(conn)
            return
        events = 0
        if conn.session.wants_input() and not conn.eof:
            events |= selectors.EVENT_READ
        if conn.outbuf or conn.session.has_work():
            events |= selectors.EVENT_WRITE
        assert self._selector is not None
        if events:
            self._selector.modify(conn.sock, events, conn)
        else:
            self._close(conn)

    def _close_idle(self) -> None:
        deadline = time.monotonic() - self._idle_timeout
        for conn in list(self._connections.values()):
            if conn.last_activity < deadline:
                LOG.info("OpenFlow stats: closing %s, idle %.0f s", conn.peer, self._idle_timeout)
                self._close(conn)

    def _close(self, conn: _Connection) -> None:
        fileno = conn.sock.fileno()
        if self._connections.pop(fileno, None) is None:
            return
        if self._selector is not None:
            try:
                self._selector.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        conn.sock.close()


def _remove_stale_socket(path: str) -> None:
    """Remove a socket file left by a previous run; refuse anything else."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise EndpointError(where=path, reason="exists and is not a socket; not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise EndpointError(where=path, reason=f"probing it: {exc}") from exc
        os.unlink(path)
        return
    finally:
        probe.close()
    raise EndpointError(where=path, reason="another process is listening on it")
