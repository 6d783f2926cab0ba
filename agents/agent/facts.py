"""Host facts a migration source asks the destination for."""

from __future__ import annotations

import os

import libvirt

from flexmig import hypervisor
from flexmig.migration.facts import filesystem_of

MIB = 2**20


def _mem_available() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def running_vm_ram(uri: str, host: str) -> int:
    with hypervisor.connect(uri, host) as conn:
        with hypervisor.wrap_errors(host, "list running VMs"):
            doms = conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE)
            return sum(d.maxMemory() * 1024 for d in doms)


def host_facts(
    host: str, uri: str, budget_mb: int, store_dir: str, links: dict[str, object]
) -> dict[str, object]:
    used = running_vm_ram(uri, host)
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
        "measured_links": links,
    }
