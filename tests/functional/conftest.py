"""Functional tests: real libvirtd, QEMU and OVS in the lab's namespaces."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from flexmig import exceptions
from flexmig_lab import image, topology
from flexmig_lab.lab import Lab

LAB_PROCESSES = r"qemu-system|ovs-vswitchd|ovsdb-server|libvirtd|virtlogd|flexmig_lab\.recorder"


def lab_missing_reason() -> str | None:
    if os.geteuid() != 0:
        return "the lab needs root (namespaces, libvirtd, OVS)"
    for tool in ("libvirtd", "ovs-vswitchd", "qemu-system-x86_64", "tini"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (tools/setup.sh installs it)"
    try:
        image.existing()
    except exceptions.MissingPrerequisite as exc:
        return str(exc)
    return None


def leftovers(lab: Lab) -> list[str]:
    """Everything a lab could leave behind on the machine."""
    found = (
        [f"netns {n}" for n in os.listdir("/run/netns") if n.startswith(topology.NETNS_PREFIX)]
        if os.path.isdir("/run/netns")
        else []
    )
    procs = subprocess.run(
        ["pgrep", "-a", "-f", LAB_PROCESSES], capture_output=True, text=True, check=False
    ).stdout.strip()
    found += [
        f"process {line}"
        for line in procs.splitlines()
        if "pgrep" not in line and _belongs_to(lab, int(line.split()[0]), line)
    ]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    found += [
        f"link {line.split(':')[1].strip()}"
        for line in links.splitlines()
        if any(k in line for k in ("-mgmt", "-tenant", "phy0", "mgmt0"))
    ]
    if lab.dir.exists():
        found.append(f"directory {lab.dir}")
    return found


def _netns_inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _belongs_to(lab: Lab, pid: int, cmdline: str) -> bool:
    """Whether a daemon is this lab's, with other labs (FLEXMIG_LAB_NAME) running beside it.

    Another lab's daemons sit in namespaces still listed in /run/netns; a
    leaked daemon of this lab sits in a namespace whose name is gone, or (the
    recorder) in the machine's own namespace with this lab's directory in its
    command line.
    """
    inode = _netns_inode(f"/proc/{pid}/ns/net")
    if inode is None:
        return False
    # The machine's namespace is the test runner's own: /proc/1 may be unreadable
    # (a sandboxed PID 1), and then every other lab's recorder looked like ours.
    if inode == _netns_inode("/proc/self/ns/net"):
        return f"{lab.dir}/" in cmdline
    others = {
        _netns_inode(f"/run/netns/{n}")
        for n in (os.listdir("/run/netns") if os.path.isdir("/run/netns") else [])
        if not n.startswith(topology.NETNS_PREFIX)
    }
    return inode not in others


def keep_logs(the_lab: Lab) -> None:
    """Before tear-down: the hosts' logs under FLEXMIG_LAB_KEEP_LOGS, if set."""
    dest = os.environ.get("FLEXMIG_LAB_KEEP_LOGS")
    if dest:
        the_lab.save_logs(Path(dest))


@pytest.fixture(scope="module")
def lab():
    reason = lab_missing_reason()
    if reason:
        pytest.skip(reason)
    the_lab = Lab()
    the_lab.down()
    the_lab.up(2)
    yield the_lab
    keep_logs(the_lab)
    the_lab.down()
    assert leftovers(the_lab) == []
