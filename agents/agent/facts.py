"""Host facts a migration source asks the destination for."""

from __future__ import annotations

import os
import tempfile
import time

import libvirt

from flexmig import hypervisor
from flexmig.migration import facts as migration_facts
from flexmig.migration import writeback
from flexmig.migration.facts import filesystem_of, same_filesystem
from flexmig.migration.knobs import HostSoftware

MIB = 2**20


def _mem_available() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


STORE_PROBE_BYTES = 32 * MIB


def store_write_bps(store_dir: str, nbytes: int = STORE_PROBE_BYTES) -> float:
    """The store's write bandwidth the way split writes it: 1 MiB chunks, then durable."""
    chunk = os.urandom(MIB)  # not zeros: some stores compress or skip them
    fd, path = tempfile.mkstemp(prefix=".write-probe-", dir=store_dir)
    try:
        start = time.monotonic()
        for _ in range(max(1, nbytes // MIB)):
            os.write(fd, chunk)
        os.fdatasync(fd)
        return max(1, nbytes // MIB) * MIB / max(time.monotonic() - start, 1e-6)
    finally:
        os.close(fd)
        os.unlink(path)


def running_vm_ram(uri: str, host: str) -> tuple[int, HostSoftware]:
    """(RAM of the running VMs, this host's libvirt and QEMU versions)."""
    with hypervisor.connect(uri, host) as conn:
        with hypervisor.wrap_errors(host, "list running VMs"):
            doms = conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE)
            used = sum(d.maxMemory() * 1024 for d in doms)
        return used, migration_facts.host_software(conn, host)


def host_facts(
    host: str,
    uri: str,
    budget_mb: int,
    store_dir: str,
    memory_cgroup: dict[str, object],
    links: dict[str, object],
    store_bps: float = 0.0,
) -> dict[str, object]:
    """``memory_cgroup``: which hierarchy caps split VMs here (version 1, 2 or None)."""
    used, software = running_vm_ram(uri, host)
    budget = budget_mb * MIB if budget_mb else _mem_available() + used
    st = os.statvfs(store_dir)
    return {
        "host": host,
        "memory_budget_bytes": budget,
        "vm_ram_bytes": used,
        "free_for_vms_bytes": max(0, budget - used),
        "store_dir": store_dir,
        # The store is qemu.conf's memory_backing_dir: where file-backed VMs'
        # memory lives, so its filesystem says whether postcopy can serve it.
        "store_fs_type": filesystem_of(store_dir),
        "store_capacity_bytes": st.f_blocks * st.f_frsize,
        "store_free_bytes": st.f_bavail * st.f_frsize,
        "store_write_bps": store_bps,
        # libvirt fsyncs the domain it persists here before resuming an incoming
        # guest: on a shared ext4 that waits for the guest memory's writeback.
        "store_shares_libvirt_fs": same_filesystem(store_dir, writeback.LIBVIRT_CONFIG_DIR),
        "memory_cgroup": memory_cgroup,
        "measured_links": links,
        # What the knobs of a migration to or from here may use (knobs.FEATURES).
        "libvirt_version": software.libvirt,
        "qemu_version": software.qemu,
    }
