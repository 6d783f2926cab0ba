"""The kernel's tracing filesystem, mounted where the kernel offers it.

BPF programs on tracepoints (the softirq clock) need the tracepoint's id, which
libbpf reads from tracefs, and the writeback benchmark enables syscall events
there.  A machine fresh from boot often has neither tracefs nor debugfs
mounted (systemd mounts them on first access through an automount; containers
and minimal images have no such unit), so the benchmarks mount it themselves,
the way ``perf`` users and ``bpftool`` do, instead of failing inside libbpf.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Iterator
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


def syscall_durations(trace_text: str, syscall: str) -> list[tuple[str, float]]:
    """(process name, ms) of each ``syscall`` in a trace of its enter and exit
    tracepoints, paired by thread.

    >>> text = (" rpc-libvirtd-26787 [001] ..... 72615.313600: sys_fsync(fd: 0x23)\\n"
    ...         " qemu-system-x86-9 [000] ..... 72615.313700: sys_fsync(fd: 0x3)\\n"
    ...         " rpc-libvirtd-26787 [001] ..... 72615.314600: sys_fsync -> 0x0\\n"
    ...         " qemu-system-x86-9 [000] ..... 72615.333700: sys_fsync -> 0x0\\n")
    >>> [(name, round(ms, 1)) for name, ms in syscall_durations(text, "fsync")]
    [('rpc-libvirtd', 1.0), ('qemu-system-x86', 20.0)]
    """
    line_re = re.compile(rf"^\s*(\S.*?)-(\d+)\s.*?(\d+\.\d+): sys_{syscall}(\(| ->)")
    started: dict[str, tuple[str, float]] = {}
    durations = []
    for line in trace_text.splitlines():
        match = line_re.search(line)
        if not match:
            continue
        name, tid, stamp = match.group(1), match.group(2), float(match.group(3))
        if match.group(4) == "(":
            started[tid] = (name, stamp)
        elif tid in started:
            name, start = started.pop(tid)
            durations.append((name, (stamp - start) * 1000))
    return durations


@contextlib.contextmanager
def syscall_trace(syscall: str) -> Iterator[list[tuple[str, float]]]:
    """(process name, ms) of every ``syscall`` on the machine while the block
    runs, filled in when it ends (tracefs mounted first where it is not)."""
    root = ensure_mounted()
    events = [root / f"events/syscalls/sys_{e}_{syscall}/enable" for e in ("enter", "exit")]
    if not all(event.is_file() for event in events):
        raise exceptions.MissingPrerequisite(
            what=f"the {syscall} syscall tracepoints", hint="kernel built without FTRACE_SYSCALLS"
        )
    (root / "trace").write_text("")
    for event in events:
        event.write_text("1")
    durations: list[tuple[str, float]] = []
    try:
        yield durations
    finally:
        for event in events:
            event.write_text("0")
        durations.extend(syscall_durations((root / "trace").read_text(), syscall))
