"""Host facts a migration source asks the destination for."""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import statistics
import tempfile
import time

import libvirt

from agents.agent import cachestat
from flexmig import exceptions, hypervisor
from flexmig.migration import facts as migration_facts
from flexmig.migration import writeback
from flexmig.migration.facts import filesystem_of, same_filesystem
from flexmig.migration.knobs import HostSoftware

MIB = 2**20
PAGE = 4096
PMD_BYTES = 2 * MIB


def _mem_available() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


STORE_PROBE_BYTES = 32 * MIB
# A fault on a dropped page of guest RAM reads this much: QEMU marks guest RAM
# MADV_HUGEPAGE, and for such a mapping the kernel reads two huge pages'
# worth around the fault whatever read_ahead_kb says (1,024 pages per touch
# in the lost session's trace; 1 page with read_ahead_kb 0 and no hint).
FAULT_WINDOW_BYTES = 4 * MIB
# Touches this far apart each start a window of their own (no readahead of
# an earlier one reaches them).
FAULT_STRIDE_BYTES = 2 * FAULT_WINDOW_BYTES


@dataclasses.dataclass(frozen=True)
class StoreProbe:
    write_bps: float  # written in 1 MiB chunks, then made durable
    fault_s: float  # median time of one fault on a page not in memory (a 4 MiB read)
    fault_pages: int | None  # pages one such fault brought in (None: cachestat missing)
    # The page cache's folio size there, which reclaim frees at a time (None: not seen).
    folio_bytes: int | None = None


def probe_store(store_dir: str, nbytes: int = STORE_PROBE_BYTES) -> StoreProbe:
    """The store measured the way split uses it: chunked writes, then faults as QEMU takes them."""
    fd, path = tempfile.mkstemp(prefix=".probe-", dir=store_dir)
    try:
        nbytes = max(FAULT_STRIDE_BYTES, nbytes // MIB * MIB)
        write_bps = _timed_write(fd, nbytes)
        fault_s, fault_pages, folio_bytes = _timed_faults(fd, nbytes, path)
        return StoreProbe(write_bps, fault_s, fault_pages, folio_bytes)
    finally:
        os.close(fd)
        os.unlink(path)


def _timed_write(fd: int, nbytes: int) -> float:
    chunk = os.urandom(MIB)  # not zeros: some stores compress or skip them
    start = time.monotonic()
    for _ in range(nbytes // MIB):
        os.write(fd, chunk)
    os.fdatasync(fd)
    return nbytes / max(time.monotonic() - start, 1e-6)


def _timed_faults(fd: int, nbytes: int, path: str) -> tuple[float, int | None, int | None]:
    """(median seconds, pages read, folio size) of a read fault at each stride of a
    MAP_SHARED, MADV_HUGEPAGE mapping of the written file (at ``path``), its pages
    dropped from the cache first."""
    os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)  # clean (fdatasync): dropped
    exact = cachestat.available(fd)
    times, pages = [], []
    with mmap.mmap(fd, nbytes, mmap.MAP_SHARED, prot=mmap.PROT_READ) as mem:
        with contextlib.suppress(OSError):  # a kernel without THP: QEMU's hint fails too
            mem.madvise(mmap.MADV_HUGEPAGE)
        for offset in range(0, nbytes - FAULT_WINDOW_BYTES + 1, FAULT_STRIDE_BYTES):
            cached = cachestat.cachestat(fd, 0, 0).nr_cache if exact else 0
            start = time.perf_counter()
            _ = mem[offset + PAGE]  # the touch is the measurement
            times.append(time.perf_counter() - start)
            if exact:
                pages.append(cachestat.cachestat(fd, 0, 0).nr_cache - cached)
        folio = folio_bytes(path)
    return statistics.median(times), (int(statistics.median(pages)) if pages else None), folio


def folio_bytes(path: str, smaps: str = "/proc/self/smaps") -> int | None:
    r"""The folio size this process's mapping of ``path`` is held in: 2 MiB where
    the kernel mapped any of it with huge page-table entries (a filesystem with
    large folios: ext4 since Linux 6.16, XFS), else a page; None: no such mapping.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".smaps") as f:
    ...     _ = f.write("7f00-7f80 r--s 0 08:01 12 /store/.probe-x\nFilePmdMapped:  4096 kB\n")
    ...     f.flush()
    ...     folio_bytes("/store/.probe-x", f.name) // MIB, folio_bytes("/other", f.name)
    (2, None)
    """
    inside, found = False, None
    with open(smaps, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            fields = line.split()
            if fields and "-" in fields[0] and not fields[0].endswith(":"):
                inside = fields[-1] == path
            elif inside and fields[0] == "FilePmdMapped:":
                found = PMD_BYTES if int(fields[1]) > 0 else max(found or 0, PAGE)
    return found


def running_vm_ram(uri: str, host: str) -> tuple[int, HostSoftware]:
    """(RAM of the running VMs, this host's libvirt and QEMU versions)."""
    with hypervisor.connect(uri, host) as conn:
        with hypervisor.wrap_errors(host, "list running VMs"):
            doms = conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE)
            used = sum(d.maxMemory() * 1024 for d in doms)
        return used, migration_facts.host_software(conn, host)


def qemu_syncs_incoming_ram(uri: str, host: str) -> bool:
    """Whether this host's QEMU writes an incoming file-backed guest's dirty RAM
    back inside the downtime (writeback.qemu_syncs_file_ram); True when the
    version cannot be read, the case a dirtier file costs most."""
    try:
        with hypervisor.connect(uri, host) as conn:
            qemu = migration_facts.host_software(conn, host).qemu
    except exceptions.FlexMigError:
        return True
    return writeback.qemu_syncs_file_ram(qemu) is not False


def host_facts(
    host: str,
    uri: str,
    budget_mb: int,
    store_dir: str,
    memory_cgroup: dict[str, object],
    links: dict[str, object],
    store: StoreProbe | None = None,
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
        "store_write_bps": store.write_bps if store else 0.0,
        # A fault on a page the residency keeper dropped (None: not measured):
        # what the guest waits for each 4 MiB of its rewritten set off budget.
        "store_fault_s": store.fault_s if store else None,
        "store_fault_pages": store.fault_pages if store else None,
        # Reclaim frees the store's page cache a folio at a time: with 2 MiB
        # folios a hot page keeps its 2 MiB resident (docs/benchmarks/store-folios.md).
        "store_folio_bytes": store.folio_bytes if store else None,
        # libvirt fsyncs the domain it persists here before resuming an incoming
        # guest: on a shared ext4 that waits for the guest memory's writeback.
        "store_shares_libvirt_fs": same_filesystem(store_dir, writeback.LIBVIRT_CONFIG_DIR),
        "memory_cgroup": memory_cgroup,
        "measured_links": links,
        # What the knobs of a migration to or from here may use (knobs.FEATURES).
        "libvirt_version": software.libvirt,
        "qemu_version": software.qemu,
    }
