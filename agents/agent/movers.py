"""Running flexmig-mover processes for migrations (the ``mover`` transport).

The source agent issues a migration-scoped credential and hands it to the
destination agent over the authenticated API; each side writes it to a 0600
file for its mover.  The destination mover listens for the source mover only
on the management address; the source mover accepts the source QEMU on a UNIX
socket, and libvirt migrates over ``unix://`` to the same path, which the
destination QEMU listens on inside its own host.

Parallel migration (QEMU multifd) opens one main connection and N channel
connections to that same path.  Each one rides its own mover pair: the agent
binds the socket once and every source mover accepts on it, so the kernel
hands each connection to a different mover; each destination mover connects to
the destination QEMU on its own.  The order in which they arrive there does not
matter: without postcopy-ram, QEMU (>= 8.1) peeks at each new connection's
first bytes and tells the main stream (QEMU_VM_FILE_MAGIC) from a multifd
channel (its own magic and channel id) -- hence parallel only for precopy.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from agents.agent import mover_files
from agents.mover import BINARY
from flexmig import exceptions

PORT_RANGE = range(7470, 7500)
READY_TIMEOUT_S = 15.0
# A finished pair is claimed (/v1/mover/finish) within ~30 s of its end: the
# source waits that long for its own senders' statistics first.
UNCLAIMED_S = 60.0
MAX_STREAMS = 9  # libvirt's parallel connections (<= 8 here) plus the main stream
SUMMED_STATS = ("bytes", "batches", "reverse_bytes", "cpu_user_s", "cpu_sys_s", "cpu_transfer_s")
_next_port = [0]


def new_token_salt() -> str:
    """Random input of auth.mover_token, fresh for every migration."""
    return secrets.token_hex(24)


def socket_path(state_dir: str, migration_id: str) -> str:
    return f"{state_dir}/mig-{migration_id}.sock"


def rdma_provider_present() -> bool:
    """Whether libfabric finds a verbs provider (an RDMA device via rdma-core)."""
    try:
        out = subprocess.run(
            ["fi_info", "-p", "verbs", "-l"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "verbs" in out.stdout


class MoverProcess:
    def __init__(
        self,
        state_dir: str,
        migration_id: str,
        role: str,
        args: list[str],
        token: str,
        stream: int = 0,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        if not BINARY.exists():
            raise exceptions.MissingPrerequisite(
                what=str(BINARY), hint="run 'make -C agents/mover' (tools/setup.sh does)"
            )
        base = Path(state_dir) / f"mover-{migration_id}-{role}{stream or ''}"
        self.base = base
        self.retired = False
        self.token_file = base.with_suffix(".token")
        self.stats_file = base.with_suffix(".stats")
        self.log_file = base.with_suffix(".log")
        self.ready_file = base.with_suffix(".ready")
        self.ready_file.unlink(missing_ok=True)
        if pass_fds:  # a sender accepting on the agent's socket
            args = [*args, "--listen-fd", str(pass_fds[0]), "--ready-file", str(self.ready_file)]
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    str(BINARY),
                    role,
                    "--token-file",
                    str(self.token_file),
                    "--stats-file",
                    str(self.stats_file),
                    *args,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=pass_fds,
            )

    def wait(self, timeout: float) -> dict[str, Any]:
        """Its statistics once it ended well; BackendError (its log kept) if not."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            rc = -1
        if rc != 0:
            tail = self.log_tail()
            self.retire(ok=False)
            raise exceptions.BackendError(backend="mover", reason=f"exited with {rc}: {tail}")
        # Read once, then gone: the stats file is a hand-over, not a record.
        try:
            return json.loads(self.stats_file.read_text())
        except (OSError, ValueError) as exc:
            raise exceptions.BackendError(
                backend="mover", reason=f"no statistics in {self.stats_file}: {exc}"
            ) from exc
        finally:
            self.retire(ok=True)

    def kill(self) -> None:
        """End it if it still runs; its files go (the log is kept unless it had
        already ended well by itself)."""
        if self.retired:
            return
        killed = self.proc.poll() is None
        if killed:
            self.proc.kill()
            self.proc.wait(5)
        self.retire(ok=not killed and self.proc.returncode == 0)

    def log_tail(self, size: int = 300) -> str:
        """The end of its log, wherever it is now (kept or not yet retired)."""
        for path in (self.log_file, mover_files.failed_log(self.base)):
            with contextlib.suppress(FileNotFoundError):
                return path.read_text(errors="replace")[-size:]
        return ""

    def retire(self, ok: bool) -> None:
        # Every path ends here once (the fault campaign found ready, stats and
        # log files left by killed, failed and completed movers alike).
        if not self.retired:
            self.retired = True
            mover_files.retire(self.base, ok)


class MoverSet:
    """One side's movers of a migration: one per connection QEMU opens."""

    def __init__(self, members: list[MoverProcess]) -> None:
        self.members = members
        self.started = time.monotonic()
        self.ended_at: float | None = None  # when first seen all ended

    def unclaimed(self, now: float, grace_s: float, max_run_s: float) -> bool:
        """Whether nobody will come for it: all ended more than ``grace_s``
        ago, or still running after ``max_run_s``."""
        if any(m.proc.poll() is None for m in self.members):
            return now - self.started > max_run_s
        self.ended_at = self.ended_at or now
        return now - self.ended_at > grace_s

    def wait(self, timeout: float) -> dict[str, Any]:
        """Wait for every stream; their statistics summed (time: the slowest's)."""
        deadline = time.monotonic() + timeout
        try:
            per_stream = [m.wait(max(1.0, deadline - time.monotonic())) for m in self.members]
        finally:
            self.kill()
        return combine_stats(per_stream)

    def kill(self) -> None:
        for member in self.members:
            member.kill()


def reap_unclaimed(
    sets: dict[str, MoverSet],
    state_dir: str,
    now: float | None = None,
    grace_s: float = UNCLAIMED_S,
    max_run_s: float = mover_files.ORPHAN_MAX_S,
) -> list[str]:
    """Kill and retire the movers whose migration never came back for them
    (its agent died before /v1/mover/finish); returns their ids.  A finish
    arriving later finds nothing (NotFound: the caller takes it as gone)."""
    now = time.monotonic() if now is None else now
    reaped = []
    for mid, mover_set in list(sets.items()):
        if mover_set.unclaimed(now, grace_s, max_run_s) and sets.pop(mid, None) is not None:
            mover_set.kill()
            Path(socket_path(state_dir, mid)).unlink(missing_ok=True)
            reaped.append(mid)
    return reaped


def combine_stats(per_stream: list[dict[str, Any]]) -> dict[str, Any]:
    """Parallel streams as one transfer: counters summed, elapsed time the longest.

    >>> combine_stats([{"bytes": 2**20, "seconds": 0.5, "cpu_user_s": 0.1},
    ...                {"bytes": 2**20, "seconds": 1.0, "cpu_user_s": 0.2}])["mib_per_s"]
    2.0
    """
    total = dict(per_stream[0])
    for key in SUMMED_STATS:
        if key in total:
            total[key] = round(sum(s[key] for s in per_stream), 6)
    seconds = max(s.get("seconds", 0.0) for s in per_stream)
    total["seconds"] = seconds
    total["mib_per_s"] = round(total.get("bytes", 0) / 2**20 / seconds, 1) if seconds else 0.0
    total["streams"] = len(per_stream)
    total["stream_bytes"] = [s.get("bytes", 0) for s in per_stream]
    return total


def wait_ready(senders: list[MoverProcess], timeout: float = READY_TIMEOUT_S) -> None:
    """Until every sender reached its receiver and registered its buffers.

    Starting libvirt earlier would let the movers' setup (fabric, registration,
    bootstrap: ~0.15 s of CPU each) compete with the migration on the cores.
    """
    deadline = time.monotonic() + timeout
    for mover in senders:
        while not mover.ready_file.exists():
            if mover.proc.poll() is not None or time.monotonic() > deadline:
                log = mover.log_tail()
                mover.kill()  # its log kept as a failed one
                raise exceptions.BackendError(
                    backend="source mover", reason=f"did not get ready: {log}"
                )
            time.sleep(0.01)


def check_streams(streams: int) -> None:
    if not 1 <= streams <= MAX_STREAMS:
        raise exceptions.InvalidInput(
            what="mover streams", reason=f"{streams} is not in 1..{MAX_STREAMS}"
        )


def start_receivers(
    state_dir: str, local: str, migration_id: str, token: str, streams: int = 1
) -> tuple[MoverSet, list[int]]:
    """``streams`` receiving movers, each on its own bootstrap port."""
    check_streams(streams)
    members: list[MoverProcess] = []
    ports: list[int] = []
    try:
        for stream in range(streams):
            mover, port = start_receiver(state_dir, local, migration_id, token, stream)
            members.append(mover)
            ports.append(port)
    except exceptions.FlexMigError:
        MoverSet(members).kill()
        raise
    return MoverSet(members), ports


def start_receiver(
    state_dir: str, local: str, migration_id: str, token: str, stream: int = 0
) -> tuple[MoverProcess, int]:
    _next_port[0] = (_next_port[0] + 1) % len(PORT_RANGE)
    port = PORT_RANGE[_next_port[0]]
    mover = MoverProcess(
        state_dir,
        migration_id,
        "recv",
        [
            "--local",
            local,
            "--port",
            str(port),
            "--connect-unix",
            socket_path(state_dir, migration_id),
        ],
        token,
        stream,
    )
    return mover, port


def start_senders(
    state_dir: str, local: str, peer: str, ports: list[int], migration_id: str, token: str
) -> MoverSet:
    """One sending mover per receiver, all accepting on the migration's socket.

    The socket is bound and every mover connected to its receiver before this
    returns, so QEMU's connections, as soon as libvirt starts it, find a mover
    ready to accept them (they wait in the backlog for the race to one).
    """
    check_streams(len(ports))
    path = socket_path(state_dir, migration_id)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    members: list[MoverProcess] = []
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener.bind(path)
        listener.listen(len(ports))
        fd = listener.fileno()
        for stream, port in enumerate(ports):
            args = ["--local", local, "--peer", peer, "--port", str(port)]
            mover = MoverProcess(
                state_dir, migration_id, "send", args, token, stream, pass_fds=(fd,)
            )
            members.append(mover)
        wait_ready(members)
    except OSError as exc:
        _abandon(members, path)
        raise exceptions.BackendError(
            backend="source movers", reason=f"socket {path}: {exc}"
        ) from exc
    except exceptions.FlexMigError:
        _abandon(members, path)
        raise
    finally:
        listener.close()  # the movers hold it now
    return MoverSet(members)


def _abandon(members: list[MoverProcess], path: str) -> None:
    """Senders that never got going: killed, and their socket gone with them
    (nobody else knows it exists: the caller never got its URI)."""
    MoverSet(members).kill()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
