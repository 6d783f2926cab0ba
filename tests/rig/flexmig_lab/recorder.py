"""Per-VM recorder: follows a guest's control port across hosts.

It runs in the machine's own namespace and reaches each host's copy of the
VM's serial socket through that host's mount namespace.  Heartbeats are
stamped on arrival and appended to ``heartbeat.log``; other guest lines
(READY, RESULT) go to ``events.log``.  Commands written to ``cmd.fifo`` are
forwarded to the host whose copy of the VM sent the latest heartbeat, since a
paused incoming copy would otherwise run them a second time after switchover.
"""

from __future__ import annotations

import argparse
import errno
import os
import selectors
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TextIO

POLL_INTERVAL = 0.02
CONNECT_TIMEOUT = 0.5


class Recorder:
    def __init__(self, vm_dir: Path, sockets: dict[str, str]) -> None:
        self.sockets = sockets
        self.sel = selectors.DefaultSelector()
        self.conns: dict[str, socket.socket] = {}
        self.partial: dict[str, bytes] = {}
        self.active: str | None = None
        self.hb_log: TextIO = open(vm_dir / "heartbeat.log", "a", encoding="ascii")
        self.events: TextIO = open(vm_dir / "events.log", "a", encoding="ascii")
        fifo = vm_dir / "cmd.fifo"
        if not fifo.exists():
            os.mkfifo(fifo, 0o600)
        # Holding a writer open keeps the FIFO from reporting EOF between clients.
        self.fifo_r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        self.fifo_w = os.open(fifo, os.O_WRONLY)
        self.sel.register(self.fifo_r, selectors.EVENT_READ, "fifo")

    def _connect_new(self) -> None:
        for host, path in self.sockets.items():
            if host in self.conns or not os.path.exists(path):
                continue
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            # A listener whose backlog is full (a QEMU not accepting) would
            # otherwise block connect, and the recorder with it, for good.
            sock.settimeout(CONNECT_TIMEOUT)
            try:
                sock.connect(path)
            except OSError:
                sock.close()
                continue
            sock.setblocking(False)
            self.conns[host] = sock
            self.partial[host] = b""
            self.sel.register(sock, selectors.EVENT_READ, host)
            self._event(host, "CONNECTED")

    def _event(self, host: str, text: str) -> None:
        self.events.write(f"{time.monotonic_ns()} {host} {text}\n")

    def _drop(self, host: str) -> None:
        sock = self.conns.pop(host)
        self.sel.unregister(sock)
        sock.close()
        self._event(host, "DISCONNECTED")
        if self.active == host:
            self.active = None

    def _on_data(self, host: str) -> None:
        try:
            data = self.conns[host].recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(host)
            return
        now = time.monotonic_ns()
        lines = (self.partial[host] + data).split(b"\n")
        self.partial[host] = lines.pop()
        for raw in lines:
            line = raw.decode("ascii", "replace").strip()
            if line.startswith("HB "):
                parts = line.split()
                if len(parts) == 3:
                    self.hb_log.write(f"{now} {host} {parts[1]} {parts[2]}\n")
                    self.active = host
            elif line:
                self.events.write(f"{now} {host} {line}\n")

    def _on_command(self) -> None:
        try:
            data = os.read(self.fifo_r, 4096)
        except BlockingIOError:
            return
        for line in data.decode("ascii", "replace").splitlines():
            if not line.strip():
                continue
            target = self.conns.get(self.active) if self.active else None
            if target is None:
                self._event("-", f"RESULT {line.split()[0]} error=guest-not-reachable")
                continue
            try:
                target.sendall(line.encode("ascii") + b"\n")
            except OSError as exc:
                self._event(self.active or "-", f"RESULT {line.split()[0]} error={exc.errno}")

    def run(self) -> None:
        while True:
            self._connect_new()
            for key, _ in self.sel.select(timeout=POLL_INTERVAL):
                if key.data == "fifo":
                    self._on_command()
                else:
                    self._on_data(key.data)
            self.hb_log.flush()
            self.events.flush()


def stop(vm_dir: Path, timeout: float = 5.0) -> None:
    """Stop the recorder of one VM, if it runs."""
    try:
        pid = int((vm_dir / "recorder.pid").read_text())
        os.kill(pid, signal.SIGTERM)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def stop_all(vms_dir: Path) -> None:
    if vms_dir.is_dir():
        for vm_dir in vms_dir.iterdir():
            stop(vm_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vm-dir", required=True, type=Path)
    parser.add_argument("--socket", action="append", default=[], metavar="HOST=PATH")
    args = parser.parse_args(argv)
    sockets = dict(item.split("=", 1) for item in args.socket)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        Recorder(args.vm_dir, sockets).run()
    except OSError as exc:
        if exc.errno != errno.EINTR:
            raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
