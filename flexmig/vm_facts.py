"""What the policy needs to know about a running VM, read from libvirt and /proc.

This is the I/O edge in front of ``flexmig.policy``: dirty-rate samples from
libvirt's page-sampling calculation, the guest RAM mapping of the QEMU process
(resident pages, the backing file and its filesystem), and devices that rule
postcopy out.
"""

from __future__ import annotations

import dataclasses
import os
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable

import libvirt

from flexmig import exceptions, hypervisor, processutil

PAGE = 4096
MIB = 2**20
# Filesystems whose files userfaultfd can serve for postcopy (missing mode).
UFFD_FILESYSTEMS = ("tmpfs", "hugetlbfs")
SAMPLE_TIMEOUT_PAD_S = 10.0
# libvirt's page-sampling mode; QEMU 7.2's dirty-bitmap mode crashed TCG
# guests on this machine, and dirty-ring needs KVM.
DIRTYRATE_MODE = libvirt.VIR_DOMAIN_DIRTYRATE_MODE_PAGE_SAMPLING


RamMappingReader = Callable[[str, int], tuple[str | None, int]]


@dataclasses.dataclass(frozen=True)
class MemoryFacts:
    ram_bytes: int
    resident_bytes: int
    file_backed: bool
    backing_file: str | None
    postcopy_blocker: str | None


def guest_ram_mapping(pid: int, ram_bytes: int) -> tuple[str | None, int]:
    """(backing path or None, resident bytes) of the QEMU mapping that is guest RAM."""
    want_kb = ram_bytes // 1024
    path, size_kb = None, 0
    with open(f"/proc/{pid}/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                path = fields[5] if len(fields) >= 6 and fields[5].startswith("/") else None
            elif fields[0] == "Size:":
                size_kb = int(fields[1])
            elif fields[0] == "Rss:" and size_kb == want_kb:
                return path, int(fields[1]) * 1024
    raise exceptions.FlexMigError(f"no guest RAM mapping of {want_kb} kB in QEMU pid {pid}")


def _fs_type(path: str) -> str:
    return processutil.run(["stat", "-f", "-c", "%T", path]).stdout.strip()


def _read_ram_mapping(vm: str, ram_bytes: int) -> tuple[str | None, int]:
    pid = int(open(f"/run/libvirt/qemu/{vm}.pid", encoding="ascii").read())
    return guest_ram_mapping(pid, ram_bytes)


def memory_facts(
    dom: libvirt.virDomain, host: str, ram_mapping: RamMappingReader = _read_ram_mapping
) -> MemoryFacts:
    """``ram_mapping`` reads QEMU's map: the agent passes its privileged reader."""
    with hypervisor.wrap_errors(host, f"read {dom.name()}'s definition"):
        root = ET.fromstring(dom.XMLDesc())
        ram_bytes = dom.maxMemory() * 1024
    path, resident = ram_mapping(dom.name(), ram_bytes)
    blocker = None
    if root.find("devices/hostdev") is not None:
        blocker = "the VM has a passthrough device"
    elif path is not None and _fs_type(os.path.dirname(path)) not in UFFD_FILESYSTEMS:
        blocker = (
            f"its memory file is on {_fs_type(os.path.dirname(path))}, which "
            "userfaultfd cannot serve (only tmpfs and hugetlbfs)"
        )
    return MemoryFacts(
        ram_bytes=ram_bytes,
        resident_bytes=min(resident, ram_bytes),
        file_backed=path is not None,
        backing_file=path,
        postcopy_blocker=blocker,
    )


def sample_dirty_pages(
    conn: libvirt.virConnect, dom: libvirt.virDomain, host: str, intervals: tuple[int, ...] = (1, 2)
) -> list[tuple[float, float]]:
    """(interval seconds, distinct pages dirtied) from libvirt's dirty-rate calculation."""
    samples = []
    for seconds in intervals:
        with hypervisor.wrap_errors(host, f"start a {seconds} s dirty-rate calculation"):
            dom.startDirtyRateCalc(seconds, DIRTYRATE_MODE)
        deadline = time.monotonic() + seconds + SAMPLE_TIMEOUT_PAD_S
        # Until the period has passed, the status may still be the previous
        # calculation's "measured".
        time.sleep(seconds)
        while True:
            time.sleep(0.1)
            with hypervisor.wrap_errors(host, "read dirty-rate statistics"):
                stats = conn.domainListGetStats([dom], libvirt.VIR_DOMAIN_STATS_DIRTYRATE)[0][1]
            if stats.get("dirtyrate.calc_status") == libvirt.VIR_DOMAIN_DIRTYRATE_MEASURED:
                break
            if time.monotonic() > deadline:
                raise exceptions.Timeout(
                    seconds=seconds + SAMPLE_TIMEOUT_PAD_S,
                    what=f"the dirty-rate calculation of {dom.name()}",
                )
        mib_per_s = stats.get("dirtyrate.megabytes_per_second", 0)
        samples.append((float(seconds), mib_per_s * seconds * MIB / PAGE))
    return samples
