"""Split mode's destination side: reservations, the memory cgroup, chunked flushing.

Sequence for an incoming split VM:
1. the destination agent records a *reservation* (VM name, RAM, budget);
2. libvirt starts the incoming QEMU and runs the host's qemu hook (``started``,
   synchronously, before the migration stream is opened); the hook moves that
   QEMU into a memory cgroup capped at the budget — so every incoming page is
   charged against the cap from the first one;
3. guest RAM is a shared mapping of a sparse file in the store: under the cap
   the kernel writes cold pages back to that file and drops them, while
   QEMU's own (anonymous) memory has no swap to go to and stays resident;
4. a flusher writes the file back in 1 MiB-aligned ranges, so the store sees
   large writes rather than reclaim's page-sized ones (seed 003: page-sized
   synchronous I/O made migration 4.3x slower, 1 MiB chunks made it equal);
5. when the VM leaves or is destroyed, libvirt removes the file and the
   ``release`` hook removes the cgroup and the reservation.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from flexmig import exceptions

LOG = logging.getLogger(__name__)
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages, do not wait
CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")
CHUNK_BYTES = 1 << 20
FLUSH_INTERVAL_S = 0.2
MIN_BUDGET_BYTES = 64 << 20
VM_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _check_name(vm: str) -> None:
    if not VM_NAME_RE.match(vm):
        raise exceptions.InvalidInput(what="VM name", reason=f"{vm!r} is not a valid name")


class SplitStore:
    def __init__(self, state_dir: str, store_dir: str, cgroup_parent: str = "flexmig") -> None:
        self.reservations = Path(state_dir) / "split"
        self.store_dir = Path(store_dir)
        self.cgroup_parent = cgroup_parent

    def cgroup_dir(self, vm: str) -> Path:
        return CGROUP_MEMORY / self.cgroup_parent / socket.gethostname() / vm

    def reservation(self, vm: str) -> dict[str, int] | None:
        _check_name(vm)
        try:
            return json.loads((self.reservations / f"{vm}.json").read_text())
        except FileNotFoundError:
            return None

    def prepare(self, vm: str, ram_bytes: int, budget_bytes: int) -> dict[str, object]:
        _check_name(vm)
        if not MIN_BUDGET_BYTES <= budget_bytes <= ram_bytes:
            raise exceptions.InvalidInput(
                what="split budget",
                reason=(
                    f"{budget_bytes} bytes not in {MIN_BUDGET_BYTES}..{ram_bytes} (the VM's RAM)"
                ),
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
        if not (CGROUP_MEMORY / "memory.limit_in_bytes").exists():
            raise exceptions.MissingPrerequisite(
                what="the cgroup-v1 memory controller", hint=f"mount it at {CGROUP_MEMORY}"
            )
        self.reservations.mkdir(parents=True, exist_ok=True)
        data = {"ram_bytes": ram_bytes, "budget_bytes": budget_bytes}
        tmp = self.reservations / f".{vm}.tmp"
        tmp.write_text(json.dumps(data))
        tmp.replace(self.reservations / f"{vm}.json")
        return {"vm": vm, **data, "cgroup": str(self.cgroup_dir(vm))}

    def memory_file(self, vm: str) -> str | None:
        """The VM's memory file libvirt made under the store (…/libvirt/qemu/<id>-<vm>/)."""
        _check_name(vm)
        for path in self.store_dir.glob(f"libvirt/qemu/*-{vm}/*"):
            if path.is_file():
                return str(path)
        return None

    def cap_process(self, vm: str, pid: int) -> None:
        """Move the VM's QEMU into its capped group (run by the libvirt hook)."""
        res = self.reservation(vm)
        if res is None:
            return
        group = self.cgroup_dir(vm)
        group.mkdir(parents=True, exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(str(res["budget_bytes"]))
        (group / "cgroup.procs").write_text(str(pid))

    def cleanup(self, vm: str, remove_cgroup: Callable[[str, str], None] | None = None) -> None:
        """Drop the reservation and the VM's group (the agent passes its privileged remover)."""
        _check_name(vm)
        (self.reservations / f"{vm}.json").unlink(missing_ok=True)
        (remove_cgroup or self._remove_cgroup)(self.cgroup_parent, vm)

    def _remove_cgroup(self, cgroup_parent: str, vm: str) -> None:
        group = CGROUP_MEMORY / cgroup_parent / socket.gethostname() / vm
        if group.exists():
            try:
                group.rmdir()
            except OSError as exc:
                raise exceptions.FlexMigError(
                    f"cgroup {group} still has processes; the VM is running: {exc}"
                ) from exc

    def usage(self, vm: str) -> dict[str, int] | None:
        group = self.cgroup_dir(vm)
        if not group.exists():
            return None
        read = lambda name: int((group / name).read_text())  # noqa: E731
        return {
            "usage_bytes": read("memory.usage_in_bytes"),
            "limit_bytes": read("memory.limit_in_bytes"),
            "max_usage_bytes": read("memory.max_usage_in_bytes"),
        }


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing a file range back without waiting (Python's os lacks sync_file_range)."""
    if _LIBC.sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sync_file_range: {os.strerror(err)}")


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
