"""What the planner needs to know about a running VM, read from libvirt and /proc.

The one reader of guest-memory facts for every caller: the VM's size,
devices and memory backing from its libvirt definition, the mapping of guest
RAM in the QEMU process where the caller can read it (the agent, through its
privileged helper), and dirty-rate samples from libvirt's page-sampling
calculation.  Everything here is I/O; what the facts mean is decided in
``planner``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable

import libvirt

from flexmig import exceptions, hypervisor
from flexmig.migration.knobs import HostSoftware

PAGE = 4096
MIB = 2**20
SAMPLE_TIMEOUT_PAD_S = 10.0
# libvirt's page-sampling mode; QEMU 7.2's dirty-bitmap mode crashed TCG
# guests on this machine, and dirty-ring needs KVM.
DIRTYRATE_MODE = libvirt.VIR_DOMAIN_DIRTYRATE_MODE_PAGE_SAMPLING
# QEMU's memfd-backed RAM shows in smaps under this name: shared memory (shmem).
MEMFD_PREFIX = "/memfd:"
# Memory files whose pages are never written back: no map of what the guest
# writes can be read from them (agents/agent/hot_chunks.py).
NO_WRITEBACK_FILESYSTEMS = ("tmpfs", "hugetlbfs", "ramfs")

# (vm name, RAM bytes) -> (backing file or None, resident bytes)
RamMappingReader = Callable[[str, int], tuple[str | None, int]]


@dataclasses.dataclass(frozen=True)
class GuestMemory:
    ram_bytes: int
    resident_bytes: int
    backing: str  # anonymous | shmem | hugepages | file
    backing_fs: str | None  # file: the filesystem holding it; None: unknown
    passthrough: bool  # a host device assigned to the VM

    @property
    def file_backed(self) -> bool:
        return self.backing == "file"


@dataclasses.dataclass(frozen=True)
class VmFacts:
    name: str
    memory: GuestMemory
    dirty_samples: tuple[tuple[float, float], ...]  # (interval s, distinct pages dirtied)
    paused: bool
    accelerator: str = "kvm"  # kvm | tcg: how its vCPUs run (domain type kvm or qemu)


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
    raise exceptions.BackendError(
        backend=f"QEMU pid {pid}", reason=f"no guest RAM mapping of {want_kb} kB in its smaps"
    )


def filesystem_of(path: str, mounts: str = "/proc/self/mounts") -> str | None:
    """The type of the filesystem holding ``path`` (the longest mount point above it)."""
    target = os.path.realpath(path)
    best, fs = "", None
    try:
        with open(mounts, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fs = point, fields[2]
    except OSError:
        return None
    return fs


def same_filesystem(path_a: str, path_b: str) -> bool | None:
    """Whether two paths live on one filesystem (None: either is missing)."""
    try:
        return os.stat(path_a).st_dev == os.stat(path_b).st_dev
    except OSError:
        return None


def declared_backing(xml: str) -> tuple[str, bool]:
    """(backing kind, has a passthrough device) from a libvirt domain definition.

    >>> declared_backing("<domain><memoryBacking><source type='file'/></memoryBacking>"
    ...                  "<devices/></domain>")
    ('file', False)
    >>> declared_backing("<domain><devices><hostdev/></devices></domain>")
    ('anonymous', True)
    """
    root = ET.fromstring(xml)
    backing = root.find("memoryBacking")
    kind = "anonymous"
    if backing is not None:
        source = backing.find("source")
        if backing.find("hugepages") is not None:
            kind = "hugepages"
        elif source is not None and source.get("type") == "file":
            kind = "file"
        elif source is not None and source.get("type") == "memfd":
            kind = "shmem"
    return kind, root.find("devices/hostdev") is not None


def declared_accelerator(xml: str) -> str:
    """How a domain's vCPUs run: "kvm", or "tcg" for libvirt's type "qemu" (emulated).

    >>> declared_accelerator("<domain type='qemu'/>"), declared_accelerator("<domain type='kvm'/>")
    ('tcg', 'kvm')
    """
    kind = ET.fromstring(xml).get("type", "kvm")
    return "tcg" if kind == "qemu" else kind


def read_memory(
    dom: libvirt.virDomain,
    host: str,
    ram_mapping: RamMappingReader | None = None,
    memory_dir_fs: str | None = None,
) -> GuestMemory:
    """The VM's memory facts.

    ``ram_mapping`` reads QEMU's map (the agent passes its privileged reader);
    without it, resident is libvirt's RSS (all of RAM when unknown: moving
    more than planned is the safe mistake) and a file's filesystem is
    ``memory_dir_fs``, that of the host's memory backing directory.
    """
    with hypervisor.wrap_errors(host, f"read {dom.name()}'s definition"):
        xml = dom.XMLDesc(0)
        ram = dom.maxMemory() * 1024
        stats = {} if ram_mapping else dom.memoryStats()
    kind, passthrough = declared_backing(xml)
    path, fs = None, memory_dir_fs
    if ram_mapping is not None:
        path, resident = ram_mapping(dom.name(), ram)
    else:
        rss = stats.get("rss")
        resident = rss * 1024 if rss else ram
    if path is not None and path.startswith(MEMFD_PREFIX):
        kind = "shmem"
    elif path is not None:
        kind, fs = "file", filesystem_of(os.path.dirname(path))
    return GuestMemory(
        ram_bytes=ram,
        resident_bytes=min(resident, ram),
        backing=kind,
        backing_fs=fs if kind == "file" else None,
        passthrough=passthrough,
    )


@dataclasses.dataclass
class _SampleFlight:
    """One VM's dirty-rate calculations, one at a time: QEMU refuses a second
    while one runs ("the dirty rate is already being measured"), so concurrent
    plans of one VM failed (found by 100 concurrent plan requests).  Callers
    that waited take the samples of the calculation that ended meanwhile."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    intervals: tuple[int, ...] = ()
    samples: tuple[tuple[float, float], ...] = ()
    ended: float = -1.0  # monotonic


_FLIGHTS: dict[tuple[str, str], _SampleFlight] = {}
_FLIGHTS_LOCK = threading.Lock()


def sample_dirty_pages(
    conn: libvirt.virConnect, dom: libvirt.virDomain, host: str, intervals: tuple[int, ...]
) -> tuple[tuple[float, float], ...]:
    """(interval seconds, distinct pages dirtied) from libvirt's dirty-rate calculation."""
    with _FLIGHTS_LOCK:
        flight = _FLIGHTS.setdefault((host, dom.name()), _SampleFlight())
    arrived = time.monotonic()
    # Each caller ahead takes at most its intervals plus the pad, but they are
    # shared, so one such wait (twice, for a calculation that had just begun).
    patience = 2 * (sum(intervals) + SAMPLE_TIMEOUT_PAD_S * len(intervals))
    if not flight.lock.acquire(timeout=patience):
        raise exceptions.Timeout(seconds=patience, what=f"{dom.name()}'s dirty-rate calculation")
    try:
        if flight.ended >= arrived and flight.intervals == intervals:
            return flight.samples
        samples = _sample_dirty_pages(conn, dom, host, intervals)
        flight.intervals, flight.samples, flight.ended = intervals, samples, time.monotonic()
        return samples
    finally:
        flight.lock.release()


def _sample_dirty_pages(
    conn: libvirt.virConnect, dom: libvirt.virDomain, host: str, intervals: tuple[int, ...]
) -> tuple[tuple[float, float], ...]:
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
    return tuple(samples)


def read_vm(
    conn: libvirt.virConnect,
    dom: libvirt.virDomain,
    host: str,
    sample_seconds: tuple[int, ...],
    ram_mapping: RamMappingReader | None = None,
    memory_dir_fs: str | None = None,
    samples: tuple[tuple[float, float], ...] | None = None,
) -> VmFacts:
    """Everything the planner needs about a running VM (takes the samples' time,
    unless fresh ``samples`` are at hand: a drain's inventory just took them)."""
    with hypervisor.wrap_errors(host, f"read {dom.name()}'s state"):
        if not dom.isActive():
            raise exceptions.InvalidInput(what="VM", reason=f"{dom.name()!r} is not running")
        # info()'s first field is the state (Nova's fakelibvirt has no state()).
        paused = dom.info()[0] == libvirt.VIR_DOMAIN_PAUSED
        accelerator = declared_accelerator(dom.XMLDesc(0))
    memory = read_memory(dom, host, ram_mapping, memory_dir_fs)
    if not samples:
        samples = sample_dirty_pages(conn, dom, host, sample_seconds)
    return VmFacts(dom.name(), memory, samples, paused, accelerator)


def host_software(conn: libvirt.virConnect, host: str) -> HostSoftware:
    """The libvirt and QEMU versions behind ``conn`` (a remote URI: the remote host's)."""
    with hypervisor.wrap_errors(host, "read libvirt's and QEMU's versions"):
        return HostSoftware(libvirt=conn.getLibVersion(), qemu=conn.getVersion())


def idle_cpus() -> float:
    """CPUs of this host not busy: its count minus the 1-minute load average."""
    return max(0.0, (os.cpu_count() or 1) - os.getloadavg()[0])
