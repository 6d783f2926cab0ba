"""The agent's privileged operations, run by an oslo.privsep daemon.

The agent's API, policy and mover handling need no privilege; only these few
steps do: reading QEMU's memory map (QEMU belongs to libvirt, ptrace-read
rules apply), reading libvirt's pid files, and removing a split VM's memory
cgroup.  They run in a separate daemon holding just the capabilities they
need, and every entry point re-checks its arguments: the daemon trusts
nothing the unprivileged side sends.  As root the agent forks the daemon
itself; run unprivileged it starts it through ``[privsep_agent]
helper_command`` (sudo privsep-helper …), as Nova and os-vif do.
"""

from __future__ import annotations

import os
from pathlib import Path

from oslo_privsep import capabilities as caps
from oslo_privsep import priv_context

from agents.agent import hot_chunks, memcg
from flexmig import exceptions
from flexmig.migration.facts import NO_WRITEBACK_FILESYSTEMS, filesystem_of, guest_ram_mapping

LIBVIRT_PID_DIR = Path("/run/libvirt/qemu")
MAX_RAM_BYTES = 1 << 42

agent_pctxt = priv_context.PrivContext(
    "agents.agent",
    cfg_section="privsep_agent",
    pypath=__name__ + ".agent_pctxt",
    capabilities=[caps.CAP_DAC_OVERRIDE, caps.CAP_DAC_READ_SEARCH, caps.CAP_SYS_PTRACE],
)


def start() -> None:
    """Start the daemon now, so a failure shows at service start, not mid-migration."""
    if os.geteuid() == 0:
        agent_pctxt.start(priv_context.Method.FORK)
    else:
        agent_pctxt.start(priv_context.Method.ROOTWRAP)


def check_name(what: str, value: str) -> None:
    """Names that become one path component: no separators, no dot-dot."""
    if not value or "/" in value or value in (".", "..") or len(value) > 64:
        raise exceptions.InvalidInput(what=what, reason=f"{value!r} is not a plain name")


@agent_pctxt.entrypoint
def qemu_ram_mapping(vm: str, ram_bytes: int) -> tuple[str | None, int]:
    """(backing file or None, resident bytes) of a running VM's guest RAM."""
    check_name("VM name", vm)
    if not 0 < ram_bytes <= MAX_RAM_BYTES:
        raise exceptions.InvalidInput(what="RAM size", reason=str(ram_bytes))
    pid = int((LIBVIRT_PID_DIR / f"{vm}.pid").read_text(encoding="ascii"))
    return guest_ram_mapping(pid, ram_bytes)


@agent_pctxt.entrypoint
def guest_hot_chunks(vm: str, ram_bytes: int, interval_s: float) -> list[list[int]] | None:
    """Runs of 1 MiB chunks a running VM's guest wrote within ``interval_s``
    (hot_chunks.py; None: its memory is not a file with writeback)."""
    check_name("VM name", vm)
    if not 0 < ram_bytes <= MAX_RAM_BYTES:
        raise exceptions.InvalidInput(what="RAM size", reason=str(ram_bytes))
    pid = int((LIBVIRT_PID_DIR / f"{vm}.pid").read_text(encoding="ascii"))
    path, _resident = guest_ram_mapping(pid, ram_bytes)
    if path is None or filesystem_of(path) in NO_WRITEBACK_FILESYSTEMS:
        return None
    runs = hot_chunks.written_chunks(path, ram_bytes, interval_s)
    return None if runs is None else [[first, count] for first, count in runs]


@agent_pctxt.entrypoint
def remove_split_cgroup(cgroup_parent: str, vm: str) -> None:
    """Remove a split VM's memory group; refuses while QEMU is still in it."""
    check_name("cgroup parent", cgroup_parent)
    check_name("VM name", vm)
    memcg.remove_own_group(memory_hierarchy(), cgroup_parent, vm)


def memory_hierarchy() -> memcg.MemoryHierarchy:
    return memcg.detect()
