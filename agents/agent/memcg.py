"""The memory cgroup a split VM's QEMU is capped in, on cgroup v1 or v2.

Which hierarchy carries the memory controller is detected once, from the
mount table: current compute hosts (Ubuntu 22.04+, RHEL 9, Debian 12) mount
only the unified (v2) hierarchy, older ones and this lab's machine have the
controller on v1.

- v1: FlexMig's own group ``<memory mount>/<parent>/<host>/<vm>``; QEMU is
  moved into it and capped by ``memory.limit_in_bytes``.
- v2: the group libvirt already put QEMU in (``machine.slice/machine-qemu…
  .scope/libvirt`` under systemd): moving QEMU out of it would take it away
  from libvirt's own cgroup management, so its ``memory.max`` is set where it
  is.  Only where QEMU sits in the root group (no libvirt cgroup) does
  FlexMig make its own group, as on v1.

On both the cap is a safety net: the residency keeper (``residency.py``)
keeps the VM under it before reclaim would have to.
"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

from flexmig import exceptions

MOUNTINFO = Path("/proc/self/mountinfo")


@dataclasses.dataclass(frozen=True)
class MemoryHierarchy:
    version: int  # 1 or 2
    mount: Path

    def describe(self) -> str:
        if self.version == 2:
            return f"cgroup v2 (unified hierarchy at {self.mount}, memory.max)"
        return f"cgroup v1 (memory controller at {self.mount}, memory.limit_in_bytes)"

    def own_group(self, parent: str, vm: str, host: str | None = None) -> Path:
        """FlexMig's own group for a VM (v1 always, v2 when QEMU has none of libvirt's)."""
        return self.mount / parent / (host or socket.gethostname()) / vm


def _mounts(mountinfo: str) -> list[tuple[str, str, set[str]]]:
    """(mount point, filesystem type, super options) of every mount."""
    mounts = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) < 3:
            continue
        mounts.append((fields[4], after[0], set(after[2].split(","))))
    return mounts


def detect(mountinfo: str | None = None, root: Path = Path("/")) -> MemoryHierarchy:
    """The hierarchy holding the memory controller; v2 wins where both could.

    ``root`` prefixes mount points (unit tests build a cgroupfs tree in a temp dir).
    """
    text = MOUNTINFO.read_text() if mountinfo is None else mountinfo
    seen = []
    for point, fstype, _options in _mounts(text):
        path = root / point.lstrip("/")
        if fstype == "cgroup2":
            controllers = _read(path / "cgroup.controllers").split()
            if "memory" in controllers:
                return MemoryHierarchy(2, path)
            seen.append(f"cgroup2 at {point} without memory ({' '.join(controllers) or 'none'})")
    for point, fstype, options in _mounts(text):
        if fstype == "cgroup" and "memory" in options:
            return MemoryHierarchy(1, root / point.lstrip("/"))
    raise exceptions.MissingPrerequisite(
        what="a memory cgroup controller",
        hint=(
            f"found {'; '.join(seen) or 'no cgroup mount'}; mount cgroup2 with the memory "
            "controller (systemd.unified_cgroup_hierarchy=1) or a v1 memory hierarchy"
        ),
    )


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def process_group(hierarchy: MemoryHierarchy, pid: int, proc: Path = Path("/proc")) -> Path:
    """The v2 group a process is in (``0::/path`` in /proc/<pid>/cgroup)."""
    for line in _read(proc / str(pid) / "cgroup").splitlines():
        if line.startswith("0::"):
            return hierarchy.mount / line[3:].strip().lstrip("/")
    raise exceptions.FlexMigError(f"process {pid} is in no cgroup-v2 group (is it running?)")


def cap(
    hierarchy: MemoryHierarchy,
    parent: str,
    vm: str,
    pid: int,
    limit: int,
    proc: Path = Path("/proc"),
) -> Path:
    """Cap QEMU's memory at ``limit`` bytes; returns the group it is capped in."""
    if hierarchy.version == 1:
        group = hierarchy.own_group(parent, vm)
        group.mkdir(parents=True, exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(str(limit))
        (group / "cgroup.procs").write_text(str(pid))
        return group
    group = process_group(hierarchy, pid, proc)
    if group == hierarchy.mount:
        group = hierarchy.own_group(parent, vm)
        _enable_memory(hierarchy.mount, group.parent)
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(pid))
    elif not (group / "memory.max").exists():
        _enable_memory(hierarchy.mount, group.parent)
    if not (group / "memory.max").exists():
        raise exceptions.MissingPrerequisite(
            what=f"the memory controller in {group}",
            hint="enable it for the machine slice (MemoryAccounting=yes on machine.slice)",
        )
    (group / "memory.max").write_text(str(limit))
    # memory.high would throttle QEMU itself once crossed, at switchover too:
    # the keeper, not the kernel, keeps the VM below the cap.
    (group / "memory.high").write_text("max")
    # Only guest RAM may leave memory, and only to its store file; QEMU's own
    # memory swapped out made downtime 6.3x worse in seed 003.
    if (group / "memory.swap.max").exists():
        (group / "memory.swap.max").write_text("0")
    return group


def _enable_memory(mount: Path, parent: Path) -> None:
    """Enable the memory controller on every level from the mount down to ``parent``."""
    parent.mkdir(parents=True, exist_ok=True)
    level = mount
    for part in (None, *parent.relative_to(mount).parts):
        level = level if part is None else level / part
        if "memory" not in _read(level / "cgroup.subtree_control").split():
            try:
                (level / "cgroup.subtree_control").write_text("+memory")
            except OSError as exc:
                raise exceptions.MissingPrerequisite(
                    what=f"the memory controller below {level}", hint=str(exc)
                ) from exc


def usage(hierarchy: MemoryHierarchy, group: Path) -> dict[str, int | None] | None:
    """Charged bytes, the cap, the peak and how often the cap was hit (None: not kept).

    ``limit_hits`` is the evidence that the cap stayed a safety net: v1's
    ``memory.failcnt``, v2's ``max`` event (each time a charge had to reclaim).
    """
    if not group.is_dir():
        return None
    if hierarchy.version == 1:
        names = ("memory.usage_in_bytes", "memory.limit_in_bytes", "memory.max_usage_in_bytes")
        hits = _read(group / "memory.failcnt").strip()
    else:
        names = ("memory.current", "memory.max", "memory.peak")
        events = dict(
            line.split(None, 1) for line in _read(group / "memory.events").splitlines() if line
        )
        hits = events.get("max", "").strip()
    values = []
    for name in names:
        text = _read(group / name).strip()
        values.append(None if text in ("", "max") else int(text))
    return {
        "usage_bytes": values[0],
        "limit_bytes": values[1],
        "max_usage_bytes": values[2],
        "limit_hits": int(hits) if hits.isdigit() else None,
    }


def remove_own_group(hierarchy: MemoryHierarchy, parent: str, vm: str) -> None:
    """Remove FlexMig's own group of a VM, if it made one (libvirt removes its own)."""
    group = hierarchy.own_group(parent, vm)
    if not group.exists():
        return
    try:
        group.rmdir()
    except OSError as exc:
        raise exceptions.FlexMigError(
            f"cgroup {group} still has processes; the VM is running: {exc}"
        ) from exc
