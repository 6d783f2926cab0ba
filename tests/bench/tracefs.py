"""The kernel's tracing filesystem, mounted where the kernel offers it.

BPF programs on tracepoints (the softirq clock) need the tracepoint's id, which
libbpf reads from tracefs, and the writeback benchmark enables syscall events
there.  A machine fresh from boot often has neither tracefs nor debugfs
mounted (systemd mounts them on first access through an automount; containers
and minimal images have no such unit), so the benchmarks mount it themselves,
the way ``perf`` users and ``bpftool`` do, instead of failing inside libbpf.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from flexmig import exceptions

TRACEFS = "/sys/kernel/tracing"
DEBUGFS = "/sys/kernel/debug"
MOUNT_TIMEOUT_S = 10


def mount_plan(filesystems_text: str, mounts_text: str) -> tuple[str, list[str] | None]:
    """Where tracefs is (or will be), and the mount command needed, if any.

    ``filesystems_text`` is /proc/filesystems, ``mounts_text`` /proc/self/mounts.
    libbpf looks in /sys/kernel/tracing first and /sys/kernel/debug/tracing
    second; a kernel without tracefs as its own filesystem (before 4.1) has it
    only under debugfs.

    >>> mount_plan("nodev\\ttracefs\\n", "tracefs /sys/kernel/tracing tracefs rw 0 0\\n")
    ('/sys/kernel/tracing', None)
    >>> mount_plan("nodev\\ttracefs\\nnodev\\tdebugfs\\n", "")
    ('/sys/kernel/tracing', ['mount', '-t', 'tracefs', 'tracefs', '/sys/kernel/tracing'])
    >>> mount_plan("nodev\\tdebugfs\\n", "")
    ('/sys/kernel/debug/tracing', ['mount', '-t', 'debugfs', 'debugfs', '/sys/kernel/debug'])
    >>> mount_plan("nodev\\tdebugfs\\n", "debugfs /sys/kernel/debug debugfs rw 0 0\\n")
    ('/sys/kernel/debug/tracing', None)
    >>> mount_plan("nodev\\tsysfs\\n", "")
    Traceback (most recent call last):
    ...
    flexmig.exceptions.MissingPrerequisite: the kernel's tracing filesystem is missing: ...
    """
    filesystems = {line.split()[-1] for line in filesystems_text.splitlines() if line.split()}
    mounted = {
        (fields[1], fields[2])
        for fields in (line.split() for line in mounts_text.splitlines())
        if len(fields) >= 3
    }
    if (TRACEFS, "tracefs") in mounted:
        return TRACEFS, None
    if (DEBUGFS, "debugfs") in mounted and "tracefs" not in filesystems:
        return f"{DEBUGFS}/tracing", None
    if "tracefs" in filesystems:
        return TRACEFS, ["mount", "-t", "tracefs", "tracefs", TRACEFS]
    if "debugfs" in filesystems:
        return f"{DEBUGFS}/tracing", ["mount", "-t", "debugfs", "debugfs", DEBUGFS]
    raise exceptions.MissingPrerequisite(
        what="the kernel's tracing filesystem",
        hint="this kernel offers neither tracefs nor debugfs (CONFIG_TRACING off?)",
    )


def ensure_mounted() -> Path:
    """The tracefs directory, mounting it first where it is not (needs root)."""
    path, command = mount_plan(
        Path("/proc/filesystems").read_text(), Path("/proc/self/mounts").read_text()
    )
    if command is not None:
        if os.geteuid() != 0:
            raise exceptions.MissingPrerequisite(
                what=f"tracefs at {path}", hint="mounting it needs root"
            )
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            raise exceptions.MissingPrerequisite(
                what=f"tracefs at {path}",
                hint=f"{' '.join(command)} failed: {done.stderr.strip() or done.returncode}",
            )
    if not Path(path, "events").is_dir():
        raise exceptions.MissingPrerequisite(
            what=f"tracepoint events under {path}", hint="the kernel exposes no trace events"
        )
    return Path(path)
