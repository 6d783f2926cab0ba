"""Split's cap and residency keeping on a real cgroup-v2 memory controller.

Runs where the unified hierarchy carries the memory controller (current
compute hosts).  On a host whose memory controller is on cgroup v1 (this
lab's machine: cgroup2 is mounted at /sys/fs/cgroup/unified without memory)
it skips and says so; the v2 path is then covered by tests/unit/test_memcg.py
against a cgroupfs tree in a temp dir.
"""

from __future__ import annotations

import os
import time

import pytest

from agents.agent import memcg, residency
from flexmig import exceptions
from tests.unit.test_residency import _Child

MIB = 1 << 20


def _v2_or_skip() -> memcg.MemoryHierarchy:
    if os.geteuid() != 0:
        pytest.skip("moving processes between cgroups needs root")
    try:
        hierarchy = memcg.detect()
    except exceptions.MissingPrerequisite as exc:
        pytest.skip(str(exc))
    if hierarchy.version != 2:
        unified = [line.split()[4] for line in memcg.MOUNTINFO.read_text().splitlines()
                   if " - cgroup2 " in line]  # fmt: skip
        pytest.skip(
            f"the memory controller is on cgroup v1 here ({hierarchy.mount}); cgroup2 "
            f"{'at ' + ', '.join(unified) if unified else 'is not mounted'} has no memory "
            "controller"
        )
    return hierarchy


@pytest.fixture
def scope(tmp_path):
    """A group standing in for libvirt's machine scope, removed afterwards."""
    hierarchy = _v2_or_skip()
    top = hierarchy.mount / f"flexmig-test-{os.getpid()}"
    group = top / "machine-qemu-test.scope"
    memcg._enable_memory(hierarchy.mount, top)
    group.mkdir(parents=True)
    yield hierarchy, group
    for path in (group, top):
        for _ in range(50):
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_v2_cap_and_keeper_hold_a_file_backed_writer_under_its_budget(scope, tmp_path):
    hierarchy, group = scope
    budget = 48 * MIB
    child = _Child(tmp_path / "guest.ram", 96 * MIB, pause_before_writing=True)
    try:
        (group / "cgroup.procs").write_text(str(child.pid))
        capped = memcg.cap(hierarchy, "flexmig", "vm", child.pid, budget)
        assert capped == group and (group / "memory.max").read_text().strip() == str(budget)
        ram = residency.GuestRam.find(child.pid, 96 * MIB)
        child.release()  # now it writes all 96 MiB into a 48 MiB cap
        fds = [os.open(ram.path, os.O_RDONLY), os.pidfd_open(child.pid)]
        fds += [os.open(f"/proc/{child.pid}/pagemap", os.O_RDONLY)]
        fds += [os.open("/proc/kpageflags", os.O_RDONLY)]
        target = residency.target_bytes(budget, 12 * MIB)
        ages = [0] * ram.chunks
        deadline = time.monotonic() + 60
        while not child.done() and time.monotonic() < deadline:
            scan = ram.scan(fds[2], fds[3])
            ages = residency.age(ages, scan.dirty)
            ram.write_back(fds[0], [c for c, n in enumerate(scan.resident) if n], wait=False)
            charge = memcg.usage(hierarchy, group)["usage_bytes"]
            if charge > target:
                victims = residency.drop_order(
                    scan.resident, ages, [1] * ram.chunks, (charge - target) // 4096
                )
                ram.write_back(fds[0], victims, wait=True)
                ram.page_out(fds[1], victims)
            time.sleep(0.05)
        assert child.done(), "the writer did not finish within 60 s"
        used = memcg.usage(hierarchy, group)
        assert used["limit_bytes"] == budget
        if used["max_usage_bytes"] is not None:
            assert used["max_usage_bytes"] <= budget
    finally:
        child.stop()
    data = (tmp_path / "guest.ram").read_bytes()
    assert all(int.from_bytes(data[o : o + 8], "little") == o for o in range(0, 96 * MIB, 4096))


def test_v2_detection_names_the_unified_hierarchy():
    hierarchy = _v2_or_skip()
    assert (hierarchy.mount / "cgroup.controllers").read_text().split().count("memory") == 1
    assert "cgroup v2" in hierarchy.describe()
