"""Lab hosts as network + mount + UTS namespaces.

A host is an ``ip netns`` network namespace plus a *holder* process that owns a
private mount, UTS and PID namespace inside it.  The holder mounts a tmpfs over
``/run`` and bind-mounts the host's private state over the daemons' directories
(``/etc/libvirt``, ``/var/lib/libvirt``, ...), then sleeps.  Every daemon of the
host is started with ``nsenter`` into the holder, so it sees only its own files.
Nothing is mounted in the caller's namespace: when the last process of a host
dies, its mounts go with it, which is what makes ``lab down`` leave nothing.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

from flexmig import processutil
from flexmig_lab import errors

NETNS_DIR = Path("/run/netns")


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def list_netns(prefix: str) -> list[str]:
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))


def add_netns(name: str) -> None:
    if not netns_exists(name):
        processutil.run(["ip", "netns", "add", name])
    processutil.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])


def pids_in_netns(name: str) -> list[int]:
    if not netns_exists(name):
        return []
    proc = processutil.run(["ip", "netns", "pids", name], check=False)
    return [int(p) for p in proc.stdout.split()]


def kill_pids(pids: list[int], *, grace: float = 5.0) -> None:
    """SIGTERM, wait up to ``grace`` seconds, then SIGKILL whatever is left."""
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    _signal_all([p for p in pids if _alive(p)], signal.SIGKILL)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)


def delete_netns(name: str, *, grace: float = 5.0) -> None:
    """Kill every process in the namespace, then delete it."""
    kill_pids(pids_in_netns(name), grace=grace)
    if netns_exists(name):
        processutil.run(["ip", "netns", "del", name])


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            # A zombie has released its namespaces; it only waits for its parent.
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False  # gone, or went between the open and the read (ESRCH)


def holder_script(hostname: str, binds: dict[str, str], ready_file: str) -> str:
    """The shell the holder runs: private /run, bind mounts, hostname, then sleep."""
    lines = [
        "set -e",
        "mount --make-rprivate /",
        "mount -t tmpfs -o mode=0755 tmpfs /run",
        "mkdir -p /run/lock /run/libvirt /run/openvswitch /run/flexmig",
    ]
    for target, source in sorted(binds.items()):
        lines.append(f"[ -e {shlex.quote(target)} ] || mkdir -p {shlex.quote(target)}")
        lines.append(f"mount --bind {shlex.quote(source)} {shlex.quote(target)}")
    # The cgroup-v1 memory controller, for split mode's per-VM caps.  Without
    # it the host still works; split then reports the controller missing.
    lines.append(
        "mount -t tmpfs -o mode=0755 cgroup /sys/fs/cgroup && "
        "mkdir -p /sys/fs/cgroup/memory && "
        "{ mount -t cgroup -o memory memory /sys/fs/cgroup/memory || true; }"
    )
    lines.append(f"hostname {shlex.quote(hostname)}")
    lines.append(f"touch {shlex.quote(ready_file)}")
    # PID 1 of the host's PID namespace: tini reaps the daemons that
    # double-fork into it, and its death takes every process of the host along.
    lines.append("exec tini -s -- sleep infinity")
    return "\n".join(lines)


class HostNamespace:
    """A network namespace with a holder owning its mount and UTS namespaces."""

    def __init__(self, netns: str, state_dir: Path) -> None:
        self.netns = netns
        self.state_dir = state_dir
        self.pid_file = state_dir / "holder.pid"

    @property
    def holder_pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text())
        except (FileNotFoundError, ValueError):
            return None
        return pid if _alive(pid) else None

    def start(self, hostname: str, binds: dict[str, str], timeout: float = 15.0) -> int:
        add_netns(self.netns)
        pid = self.holder_pid
        if pid is not None:
            return pid
        ready = self.state_dir / "holder.ready"
        ready.unlink(missing_ok=True)
        script = holder_script(hostname, binds, str(ready))
        cmd = [
            "ip",
            "netns",
            "exec",
            self.netns,
            "unshare",
            "--mount",
            "--uts",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
        ]
        with open(self.state_dir / "holder.log", "ab") as log:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )

        def holder_ready() -> bool:
            if proc.poll() is not None:
                raise errors.LabError(
                    reason=(
                        f"namespace holder for {self.netns} exited with {proc.returncode}; "
                        f"see {self.state_dir / 'holder.log'}"
                    )
                )
            return ready.exists()

        processutil.wait_for(holder_ready, timeout=timeout, what=f"{self.netns} holder mounts")
        # unshare --fork stays outside; its child is PID 1 of the host.
        init_pid = int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
        self.pid_file.write_text(str(init_pid))
        return init_pid

    def exec_prefix(self) -> list[str]:
        pid = self.holder_pid
        if pid is None:
            raise errors.LabNotUp(reason=f"namespace holder of {self.netns} is not running")
        return ["nsenter", "-t", str(pid), "-m", "-u", "-n", "-p", "--"]

    def run(self, cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return processutil.run(self.exec_prefix() + cmd, **kwargs)  # type: ignore[arg-type]

    def spawn(self, cmd: list[str], log_path: Path) -> subprocess.Popen[bytes]:
        """Start a long-running process inside the host, detached from the caller."""
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                self.exec_prefix() + cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )

    def root_path(self, path: str) -> Path:
        """A path inside the host's mount namespace, reachable from outside."""
        pid = self.holder_pid
        if pid is None:
            raise errors.LabNotUp(reason=f"namespace holder of {self.netns} is not running")
        return Path(f"/proc/{pid}/root") / path.lstrip("/")

    def pid_alive(self, inner_pid: int) -> bool:
        """Whether a PID as seen inside the host (e.g. from a pidfile) is running."""
        return self.holder_pid is not None and self.root_path(f"/proc/{inner_pid}").exists()

    def destroy(self) -> None:
        delete_netns(self.netns)
        self.pid_file.unlink(missing_ok=True)
