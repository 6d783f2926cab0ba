"""The fault campaign's hands on a lab host: faults injected and repaired.

Apart from the campaign (tests/bench/fault_campaign.py), which decides what
to inject where and judges the outcome.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flexmig import exceptions, processutil
from flexmig_lab.lab import Lab

# Each host's store is a filesystem of its own (as a VM-dedicated NVMe store
# would be), small enough to fill: a loop-mounted ext4 image mounted inside the
# host, never the machine's shared disk.  No reserved blocks: QEMU runs as root.
STORE_FS_MB = 1024
FILLER = "campaign-filler"
STOP_TIMEOUT_S = 30.0  # libvirtd's SIGTERM grace in the campaign (systemd's TimeoutStopSec)


def restart_libvirtd(host: Any) -> None:
    """Restart libvirtd as systemd does: SIGTERM, SIGKILL once its stop timeout
    is spent (a libvirtd 9.0 busy with a migration ignored SIGTERM for 30 s)."""
    for signal, wait_s in (("TERM", STOP_TIMEOUT_S), ("KILL", 10.0)):
        host.ns.run(["sh", "-c", f"kill -{signal} $(cat /run/libvirtd.pid)"], check=False)
        try:
            processutil.wait_for(
                lambda: not host._pid_alive("/run/libvirtd.pid"),
                timeout=wait_s,
                what=f"libvirtd to stop on SIG{signal}",
            )
            break
        except exceptions.Timeout:
            if signal == "KILL":
                raise
    host._start_libvirt()


def store_path(host: Any) -> Path:
    """The host's store as its own processes see it (its mount, not the disk's)."""
    return host.ns.root_path(str(host.store_dir))


def small_stores(lab: Lab) -> None:
    """Every host's store on a STORE_FS_MB filesystem of its own, before any guest
    is made (a host whose store already has one keeps it)."""
    for host in lab.hosts():
        host.mount_own_store(STORE_FS_MB)


def fill_store(host: Any) -> Any:
    """Take every free block of the host's store (fallocate: instant, no I/O);
    returns the repair, which frees them."""
    filler = store_path(host) / FILLER
    stats = os.statvfs(store_path(host))
    size = stats.f_bavail * stats.f_frsize
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while size > 0:  # the extent tree needs blocks too: back off until it fits
            try:
                os.posix_fallocate(fd, 0, size)
                break
            except OSError:
                size -= 1 << 20
    finally:
        os.close(fd)

    def repair() -> None:
        filler.unlink(missing_ok=True)

    return repair


def restart_agent(host: Any) -> None:
    """Start a killed agent again: its socket file outlives it, and the lab
    takes an existing socket for a running agent."""
    host.agent_socket.unlink(missing_ok=True)
    host.start_agent()
