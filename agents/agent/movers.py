"""Running flexmig-mover processes for migrations (the ``mover`` transport).

The source agent issues a migration-scoped credential and hands it to the
destination agent over the authenticated API; each side writes it to a 0600
file for its mover.  The destination mover listens for the source mover only
on the management address; the source mover accepts the source QEMU on a UNIX
socket, and libvirt migrates over ``unix://`` to the same path, which the
destination QEMU listens on inside its own host.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path

from agents.mover import BINARY
from flexmig import exceptions

PORT_RANGE = range(7470, 7500)
_next_port = [0]


def new_token() -> str:
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
        self, state_dir: str, migration_id: str, role: str, args: list[str], token: str
    ) -> None:
        if not BINARY.exists():
            raise exceptions.MissingPrerequisite(
                what=str(BINARY), hint="run 'make -C agents/mover' (tools/setup.sh does)"
            )
        base = Path(state_dir) / f"mover-{migration_id}-{role}"
        self.token_file = base.with_suffix(".token")
        self.stats_file = base.with_suffix(".stats")
        self.log_file = base.with_suffix(".log")
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
            )

    def wait(self, timeout: float) -> dict[str, object]:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = -1
        self.token_file.unlink(missing_ok=True)
        if rc != 0:
            raise exceptions.FlexMigError(
                f"mover exited with {rc}: {self.log_file.read_text(errors='replace')[-300:]}"
            )
        return json.loads(self.stats_file.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.token_file.unlink(missing_ok=True)


def start_receiver(
    state_dir: str, local: str, migration_id: str, token: str
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
    )
    return mover, port


def start_sender(
    state_dir: str, local: str, peer: str, port: int, migration_id: str, token: str
) -> MoverProcess:
    path = socket_path(state_dir, migration_id)
    mover = MoverProcess(
        state_dir,
        migration_id,
        "send",
        ["--local", local, "--peer", peer, "--port", str(port), "--listen-unix", path],
        token,
    )
    deadline = time.monotonic() + 10
    while not os.path.exists(path):  # listening before libvirt makes QEMU connect
        if mover.proc.poll() is not None or time.monotonic() > deadline:
            mover.kill()
            raise exceptions.FlexMigError(
                f"source mover did not start: {mover.log_file.read_text(errors='replace')}"
            )
        time.sleep(0.02)
    return mover
