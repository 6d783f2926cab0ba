"""Where the eSwitch's maps and program are pinned: a bpffs per lab host.

Each lab host has its own mount namespace; a bpffs mounted there is a fresh
instance, so two hosts' eSwitches never see each other's pins.
"""

from __future__ import annotations

import os
from pathlib import Path

from flexmig import processutil


def bpffs_mount_of(path: str, mounts_text: str) -> str | None:
    """The bpffs mount point containing ``path``, from /proc/self/mounts text.

    >>> bpffs_mount_of("/sys/fs/bpf/flexmig", "bpf /sys/fs/bpf bpf rw 0 0\\n")
    '/sys/fs/bpf'
    >>> bpffs_mount_of("/sys/fs/bpf/flexmig", "sysfs /sys sysfs rw 0 0\\n") is None
    True
    """
    best: str | None = None
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point, fstype = fields[1], fields[2]
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) > len(best)):
            best = mount_point if fstype == "bpf" else None
    return best


def ensure(pin_dir: str) -> None:
    """Make ``pin_dir`` a directory on a bpffs, mounting one on its parent if needed."""
    mounts = Path("/proc/self/mounts").read_text()
    if bpffs_mount_of(pin_dir, mounts) is None:
        parent = os.path.dirname(pin_dir.rstrip("/")) or "/"
        os.makedirs(parent, exist_ok=True)
        processutil.run(["mount", "-t", "bpf", "bpf", parent])
    os.makedirs(pin_dir, exist_ok=True)
