"""Split mode's destination side: reservations, the memory cgroup, chunked flushing.

Sequence for an incoming split VM:
1. the destination agent records a *reservation* (VM name, RAM, budget);
2. libvirt starts the incoming QEMU and runs the host's qemu hook (``started``,
   synchronously, before the migration stream is opened); the hook caps that
   QEMU's memory cgroup at the budget (v1 or v2, ``memcg.py``) — so every
   incoming page is charged against the cap from the first one;
3. guest RAM is a shared mapping of a sparse file in the store; the agent's
   residency keeper (``residency.py``) writes it back in 1 MiB-aligned
   ranges and drops cold chunks itself (never-written ones first, the
   rewritten set last), keeping the charge below the cap with headroom for
   the final round: the cap is only the safety net (seed 003: page-sized
   synchronous I/O made migration 4.3x slower, 1 MiB chunks made it
   equal; reclaim at the cap cost ~250 ms of switchover here);
4. when the VM leaves or is destroyed, libvirt removes the file and the
   ``release`` hook removes FlexMig's group (if it made one) and the
   reservation.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agents.agent import cachestat, memcg, residency
from flexmig import exceptions

LOG = logging.getLogger(__name__)
CHUNK_BYTES = 1 << 20
FLUSH_INTERVAL_S = 0.2
MIN_BUDGET_BYTES = 64 << 20
VM_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_name(vm: str) -> None:
    if not VM_NAME_RE.match(vm):
        raise exceptions.InvalidInput(what="VM name", reason=f"{vm!r} is not a valid name")


class SplitStore:
    def __init__(
        self,
        state_dir: str,
        store_dir: str,
        cgroup_parent: str = "flexmig",
        hierarchy: memcg.MemoryHierarchy | None = None,
    ) -> None:
        """``hierarchy``: the memory cgroup hierarchy (None: detected when first needed)."""
        self.reservations = Path(state_dir) / "split"
        self.store_dir = Path(store_dir)
        self.cgroup_parent = cgroup_parent
        self._hierarchy = hierarchy

    @property
    def hierarchy(self) -> memcg.MemoryHierarchy:
        if self._hierarchy is None:
            self._hierarchy = memcg.detect()
        return self._hierarchy

    def cgroup_dir(self, vm: str) -> Path:
        """Where the VM is capped: as the hook recorded it, else FlexMig's own group."""
        res = self.reservation(vm) or {}
        recorded = res.get("cgroup")
        return Path(recorded) if recorded else self.hierarchy.own_group(self.cgroup_parent, vm)

    def reservation(self, vm: str) -> dict[str, Any] | None:
        check_name(vm)
        try:
            return json.loads((self.reservations / f"{vm}.json").read_text())
        except FileNotFoundError:
            return None

    def prepare(
        self, vm: str, ram_bytes: int, budget_bytes: int, headroom_bytes: int | None = None
    ) -> dict[str, object]:
        """Reserve; ``headroom_bytes``: kept free under the cap for the final round."""
        check_name(vm)
        if not MIN_BUDGET_BYTES <= budget_bytes <= ram_bytes:
            raise exceptions.InvalidInput(
                what="split budget",
                reason=(
                    f"{budget_bytes} bytes not in {MIN_BUDGET_BYTES}..{ram_bytes} (the VM's RAM)"
                ),
            )
        headroom = default_headroom(budget_bytes) if headroom_bytes is None else headroom_bytes
        if not 0 <= headroom <= budget_bytes // 2:
            raise exceptions.InvalidInput(
                what="split headroom",
                reason=f"{headroom} bytes not in 0..{budget_bytes // 2} (half the budget)",
            )
        st = os.statvfs(self.store_dir)
        if st.f_bavail * st.f_frsize < ram_bytes:
            raise exceptions.InvalidInput(
                what="split store",
                reason=(
                    f"{self.store_dir} has {st.f_bavail * st.f_frsize >> 20} MiB free, the VM "
                    f"needs {ram_bytes >> 20} MiB"
                ),
            )
        hierarchy = self.hierarchy  # refuses here, before anything is recorded
        data = {"ram_bytes": ram_bytes, "budget_bytes": budget_bytes, "headroom_bytes": headroom}
        self._write_reservation(vm, data)
        return {
            "vm": vm,
            **data,
            "cgroup": str(self.cgroup_dir(vm)),
            "cgroup_version": hierarchy.version,
        }

    def _write_reservation(self, vm: str, data: dict[str, Any]) -> None:
        self.reservations.mkdir(parents=True, exist_ok=True)
        tmp = self.reservations / f".{vm}.tmp"
        tmp.write_text(json.dumps(data))
        tmp.replace(self.reservations / f"{vm}.json")

    def memory_file(self, vm: str) -> str | None:
        """The VM's memory file libvirt made under the store (…/libvirt/qemu/<id>-<vm>/)."""
        check_name(vm)
        for path in self.store_dir.glob(f"libvirt/qemu/*-{vm}/*"):
            if path.is_file():
                return str(path)
        return None

    def cap_process(self, vm: str, pid: int) -> None:
        """Cap the VM's QEMU at its budget (run by the libvirt hook) and record where."""
        res = self.reservation(vm)
        if res is None:
            return
        group = memcg.cap(self.hierarchy, self.cgroup_parent, vm, pid, res["budget_bytes"])
        self._write_reservation(vm, res | {"cgroup": str(group)})

    def cleanup(self, vm: str, remove_cgroup: Callable[[str, str], None] | None = None) -> None:
        """Drop the reservation and the VM's group (the agent passes its privileged remover)."""
        check_name(vm)
        (self.reservations / f"{vm}.json").unlink(missing_ok=True)
        (remove_cgroup or self._remove_cgroup)(self.cgroup_parent, vm)

    def _remove_cgroup(self, cgroup_parent: str, vm: str) -> None:
        memcg.remove_own_group(self.hierarchy, cgroup_parent, vm)

    def usage(self, vm: str) -> dict[str, int | None] | None:
        return memcg.usage(self.hierarchy, self.cgroup_dir(vm))


def default_headroom(budget_bytes: int) -> int:
    """Headroom when the source names none: an eighth of the budget, at least 16 MiB.

    >>> default_headroom(240 << 20) >> 20
    30
    """
    return min(budget_bytes // 2, max(16 << 20, budget_bytes // 8))


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing a file range back without waiting."""
    residency.sync_file_range(fd, offset, nbytes, residency.SYNC_FILE_RANGE_WRITE)


class ChunkFlusher(threading.Thread):
    """Writes a VM memory file back in 1 MiB-aligned ranges while it exists.

    Also keeps an incoming file-backed VM's dirty page cache small: QEMU
    msyncs all of guest RAM before it tells the source the migration is
    done, inside the downtime, so whatever is still dirty then is paid for
    by the guest.
    """

    def __init__(self, path: str, stop: threading.Event, deadline: float | None = None) -> None:
        """``deadline``: a time.monotonic() value to stop at (None: while the file exists)."""
        super().__init__(name=f"flush-{os.path.basename(path)}", daemon=True)
        self.path = path
        self.stop_event = stop
        self.deadline = deadline
        self.rounds = 0

    def run(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            LOG.warning("cannot flush %s: %s", self.path, exc)
            return
        try:
            while not self.stop_event.wait(FLUSH_INTERVAL_S) and not self._expired():
                if os.fstat(fd).st_nlink == 0:
                    return  # libvirt removed the file: the VM left
                self.flush_once(fd)
        except OSError as exc:
            LOG.warning("stopped flushing %s: %s", self.path, exc)
        finally:
            os.close(fd)

    def flush_once(self, fd: int) -> None:
        for offset in range(0, os.fstat(fd).st_size, CHUNK_BYTES):
            start_writeback(fd, offset, CHUNK_BYTES)
        self.rounds += 1

    def _expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


KEEPER_INTERVAL_S = 0.1
# How long after the resume the keeper counts the dropped chunks the guest reads
# back: the switchover's gap and what follows it, not the guest's reads of its
# cold memory minutes later.
RESUME_WINDOW_S = 1.0
# Looks whose charge growth the keeper makes room for (0.8 s at 0.1 s a look,
# as long as the ages remember a reference).
GROWTH_LOOKS = 8
# Looks between writebacks of the chunks the keeper keeps (the rewritten set
# and the hint: residency.chunks_to_write_back), where the destination's QEMU
# does not write dirty guest RAM inside the downtime: 1 s.
KEPT_WRITEBACK_LOOKS = 10
KEEPER_FIND_TIMEOUT_S = 120.0  # how long an incoming QEMU may take to appear
LIBVIRT_PID_DIR = Path("/run/libvirt/qemu")


# libvirt's live status of a domain: <domstatus state='paused' reason='migration' ...>
# while it migrates in, state='running' once the destination resumed it.
DOMSTATUS_STATE = re.compile(r"<domstatus\b[^>]*?\bstate=['\"](\w+)['\"]")
STATUS_HEAD_BYTES = 4096


def runs_here(status_xml: str) -> bool:
    """Whether libvirt's status file says the domain runs (the migration is over).

    >>> runs_here("<domstatus state='paused' reason='migration' pid='7'>")
    False
    >>> runs_here("<domstatus state='running' reason='migrated' pid='7'>")
    True
    >>> runs_here("")
    False
    """
    found = DOMSTATUS_STATE.search(status_xml)
    return found is not None and found.group(1) == "running"


@dataclasses.dataclass(frozen=True)
class _Marks:
    target: int  # drop once the charge is above this (the cap less the headroom)
    low: int  # ... down to this, so the next interval's stream lands in free room
    floor: int = 0  # ... and never below this, however fast the charge grows

    @classmethod
    def of(cls, budget_bytes: int, headroom_bytes: int) -> _Marks:
        return cls(
            residency.target_bytes(budget_bytes, headroom_bytes),
            residency.low_mark(budget_bytes, headroom_bytes),
            budget_bytes // 2,
        )


@dataclasses.dataclass
class _Chunks:
    """What the keeper remembers of each 1 MiB chunk between intervals."""

    ages: list[int]
    writes: list[int]  # writes seen per chunk (residency.record_writes)
    dirty: set[int] = dataclasses.field(default_factory=set)  # dirty at the last look
    dropped: set[int] = dataclasses.field(default_factory=set)
    exact: bool = True  # dirty pages counted by cachestat, not sampled page flags
    # What the charge grew between looks, the last GROWTH_LOOKS of them, and
    # the charge the last look left (after its drop).
    growths: collections.deque[int] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=GROWTH_LOOKS)
    )
    settled: int | None = None


class ResidencyKeeper(threading.Thread):
    """Keeps a split VM's charge under its cap by writing back and dropping cold chunks.

    Runs from the reservation until the VM's memory file is gone (the VM
    left) or it is told to stop; ``stats`` is what the status API reports.
    """

    def __init__(
        self, store: SplitStore, vm: str, stop: threading.Event, kept_writeback_looks: int = 1
    ) -> None:
        """``kept_writeback_looks``: looks between writebacks of the chunks kept
        resident (1: every look; residency.chunks_to_write_back)."""
        super().__init__(name=f"residency-{vm}", daemon=True)
        self.store, self.vm, self.stop_event = store, vm, stop
        self.kept_writeback_looks = max(1, kept_writeback_looks)
        self.stats: dict[str, Any] = {
            "state": "waiting for QEMU",
            "samples": 0,
            "max_charge_bytes": 0,
            "max_guest_resident_bytes": 0,
            "dropped_bytes": 0,
            # What the drops took, by write class (residency.WRITE_CLASSES).
            "dropped_pages_by_class": dict.fromkeys(residency.WRITE_CLASSES, 0),
            "drops": 0,
            "rounds": 0,
            # Dropped chunks the guest read back in its first RESUME_WINDOW_S here,
            # by write class: each such fault read up to 4 MiB from the store
            # (residency.py), in the gap or after it (whatever the guest reads).  The
            # first look after the resume also counts what came back since the
            # look before it (up to KEEPER_INTERVAL_S of the final round).
            "back_after_resume_chunks": dict.fromkeys(residency.WRITE_CLASSES, 0),
            # Chunks the source saw the guest write before the migration (hint).
            "hinted_chunks": 0,
            "kept_writeback_every_looks": self.kept_writeback_looks,
        }
        self.hinted: frozenset[int] = frozenset()

    def hint(self, chunks: frozenset[int]) -> None:
        """Chunks to keep with the rewritten set from now on (hot_chunks.py).

        One reference swap: the keeper's thread reads whichever set is current.
        """
        self.hinted = chunks
        self.stats["hinted_chunks"] = len(chunks)

    def run(self) -> None:
        try:
            found = self._wait_for_qemu()
            if found is not None:
                self._keep(*found)
        except (OSError, LookupError, ValueError, exceptions.FlexMigError) as exc:
            self.stats["state"] = f"stopped: {exc}"
            LOG.warning("residency keeper for %s stopped: %s", self.vm, exc)

    def _wait_for_qemu(self) -> tuple[residency.GuestRam, dict[str, Any]] | None:
        deadline = time.monotonic() + KEEPER_FIND_TIMEOUT_S
        while not self.stop_event.wait(0.02):
            res = self.store.reservation(self.vm)
            path = self.store.memory_file(self.vm)
            pid_file = LIBVIRT_PID_DIR / f"{self.vm}.pid"
            if res and res.get("cgroup") and path and pid_file.exists():
                ram = residency.GuestRam.find(int(pid_file.read_text()), res["ram_bytes"])
                return ram, res
            if time.monotonic() > deadline:
                raise exceptions.Timeout(seconds=KEEPER_FIND_TIMEOUT_S, what=f"{self.vm}'s QEMU")
        return None

    def _keep(self, ram: residency.GuestRam, res: dict[str, Any]) -> None:
        marks = _Marks.of(res["budget_bytes"], res["headroom_bytes"])
        self.stats |= {"state": "keeping", "target_bytes": marks.target, "pid": ram.pid}
        self.stats |= {"low_bytes": marks.low}
        fds = [os.open(ram.path, os.O_RDONLY), os.pidfd_open(ram.pid)]
        state = _Chunks(ages=[0] * ram.chunks, writes=[0] * ram.chunks)
        state.exact = cachestat.available(fds[0])
        # Without cachestat (Linux < 6.5) the page flags of a sample say what was
        # written, and QEMU's page map what is resident (the pages it maps only).
        if state.exact:
            fds += [-1, -1]
        else:
            fds += [os.open(f"/proc/{ram.pid}/pagemap", os.O_RDONLY)]
            fds += [os.open("/proc/kpageflags", os.O_RDONLY)]
        self.stats["written_pages_from"] = "cachestat" if state.exact else "kpageflags sample"
        self.stats["resident_pages_from"] = "cachestat" if state.exact else "QEMU's page map"
        resumed_at: float | None = None
        try:
            while not self.stop_event.wait(KEEPER_INTERVAL_S):
                if os.fstat(fds[0]).st_nlink == 0:
                    self.stats["state"] = "VM left"
                    return
                if resumed_at is None and self._guest_runs_here():
                    # No final round to come; the kernel's LRU sees the guest's reads.
                    resumed_at = time.monotonic()
                    self.stats["state"] = "writing back; the guest runs here, the cap reclaims"
                resumed = resumed_at is not None
                count_back = resumed and time.monotonic() - resumed_at <= RESUME_WINDOW_S
                self._step(ram, fds, marks, state, resumed, count_back)
        finally:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)

    def _guest_runs_here(self) -> bool:
        try:
            with open(LIBVIRT_PID_DIR / f"{self.vm}.xml", encoding="utf-8") as status:
                return runs_here(status.read(STATUS_HEAD_BYTES))
        except (OSError, UnicodeDecodeError):
            return False  # not known: the headroom stays

    def _step(
        self,
        ram: residency.GuestRam,
        fds: list[int],
        marks: _Marks,
        state: _Chunks,
        guest_runs_here: bool = False,
        count_back: bool = False,
    ) -> None:
        file_fd, pidfd = fds[0], fds[1]
        scan = self._look(ram, fds, state, count_back)
        writable = residency.chunks_to_write_back(
            scan.resident,
            state.writes,
            self.hinted,
            self.stats["rounds"],
            self.kept_writeback_looks,
        )
        ram.write_back(file_fd, writable, wait=False)
        charge = self._charge()
        self._sample(charge, sum(scan.resident) * residency.PAGE)
        if state.settled is not None:
            state.growths.append(charge - state.settled)
        growth = residency.charge_growth(state.growths)
        self.stats["growth_bytes"] = growth
        excess = residency.drop_pages(
            charge, marks.target, marks.low, guest_runs_here, growth, marks.floor
        )
        state.settled = charge
        if excess:
            victims = residency.drop_order(
                scan.resident, state.ages, state.writes, excess, self.hinted
            )
            ram.write_back(file_fd, victims, wait=True)
            ram.page_out(pidfd, victims)  # what QEMU maps ...
            ram.forget(file_fd, victims)  # ... and the cache it does not
            self.stats["dropped_bytes"] += sum(scan.resident[c] for c in victims) * residency.PAGE
            self.stats["drops"] += 1
            state.dropped.update(victims)
            taken = residency.dropped_by_class(scan.resident, state.writes, victims)
            for name, pages in zip(residency.WRITE_CLASSES, taken, strict=True):
                self.stats["dropped_pages_by_class"][name] += pages
            state.settled = self._charge()
        self.stats["rounds"] += 1

    def _charge(self) -> int:
        return (self.store.usage(self.vm) or {}).get("usage_bytes") or 0

    def _look(
        self, ram: residency.GuestRam, fds: list[int], state: _Chunks, count_back: bool = False
    ) -> residency.ChunkScan:
        """Read each chunk's residency and writes (the page cache, else QEMU's page
        map); count writes and age every chunk (updates ``state``); ``count_back``:
        count the dropped chunks back since the last look in the stats."""
        file_fd, pagemap_fd, kpf_fd = fds[0], fds[2], fds[3]
        if state.exact:
            # The page cache, mapped or not, is what the VM is charged for.
            cached, written = cachestat.chunk_pages(file_fd, ram.chunks, residency.CHUNK_BYTES)
            scan = residency.ChunkScan(cached, {c for c, n in enumerate(written) if n})
        else:
            scan = ram.scan(pagemap_fd, kpf_fd)
        dirty = scan.dirty
        back = {c for c in state.dropped if scan.resident[c]}
        state.dropped -= back
        if count_back:
            returned = self.stats["back_after_resume_chunks"]
            for chunk in back:
                returned[residency.WRITE_CLASSES[residency.write_class(state.writes[chunk])]] += 1
        state.writes = residency.record_writes(state.writes, state.dirty, dirty)
        state.dirty = dirty
        # A first arrival counts as a reference too: a trial that counted only
        # rewrites dropped the never-rewritten pages the resumed guest reads
        # (its kernel, its programs) and its gap after resume grew (split_trace).
        state.ages = residency.age(state.ages, dirty | back)
        return scan

    def _sample(self, charge: int, guest_resident: int) -> None:
        s = self.stats
        s["samples"] += 1
        s["charge_bytes"], s["guest_resident_bytes"] = charge, guest_resident
        s["max_charge_bytes"] = max(s["max_charge_bytes"], charge)
        s["max_guest_resident_bytes"] = max(s["max_guest_resident_bytes"], guest_resident)
