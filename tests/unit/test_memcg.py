"""The memory cgroup on v1 and v2, against cgroupfs trees built in a temp dir."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from agents.agent import memcg, split_store
from flexmig import exceptions

V1_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2_MOUNTS = "30 23 0:27 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
LIBVIRT_GROUP = "machine.slice/machine-qemu\\x2d3\\x2dvm1.scope/libvirt"


def _tree(root: Path, mount: str, controllers: str) -> Path:
    path = root / mount.lstrip("/")
    path.mkdir(parents=True)
    (path / "cgroup.controllers").write_text(controllers + "\n")
    (path / "cgroup.subtree_control").write_text("")
    return path


def _qemu_in(root: Path, pid: int, group: str) -> Path:
    (root / "proc" / str(pid)).mkdir(parents=True)
    (root / "proc" / str(pid) / "cgroup").write_text(f"0::/{group}\n")
    return root / "proc"


def test_this_machines_layout_is_v1_even_with_a_unified_mount(tmp_path):
    _tree(tmp_path, "/sys/fs/cgroup/unified", "hugetlb")  # cgroup2 there, without memory
    found = memcg.detect(V1_MOUNTS, tmp_path)
    assert found == memcg.MemoryHierarchy(1, tmp_path / "sys/fs/cgroup/memory")
    assert "cgroup v1" in found.describe()


def test_a_unified_hierarchy_with_memory_is_v2(tmp_path):
    _tree(tmp_path, "/sys/fs/cgroup", "cpuset cpu io memory pids")
    found = memcg.detect(V2_MOUNTS, tmp_path)
    assert found.version == 2 and found.mount == tmp_path / "sys/fs/cgroup"
    assert "memory.max" in found.describe()


def test_no_memory_controller_anywhere_is_named(tmp_path):
    _tree(tmp_path, "/sys/fs/cgroup", "cpu pids")
    with pytest.raises(exceptions.MissingPrerequisite, match="without memory .cpu pids."):
        memcg.detect(V2_MOUNTS, tmp_path)


def test_v1_caps_in_flexmigs_own_group(tmp_path):
    hierarchy = memcg.MemoryHierarchy(1, tmp_path)
    group = memcg.cap(hierarchy, "flexmig", "vm1", 4321, 240 << 20)
    assert group == tmp_path / "flexmig" / socket.gethostname() / "vm1"
    assert (group / "memory.limit_in_bytes").read_text() == str(240 << 20)
    assert (group / "cgroup.procs").read_text() == "4321"


def test_v2_caps_the_group_libvirt_put_qemu_in(tmp_path):
    mount = _tree(tmp_path, "/cg", "memory")
    scope = mount / LIBVIRT_GROUP
    scope.mkdir(parents=True)
    for name in ("memory.max", "memory.high", "memory.swap.max"):
        (scope / name).write_text("max\n")
    proc = _qemu_in(tmp_path, 77, LIBVIRT_GROUP)
    group = memcg.cap(memcg.MemoryHierarchy(2, mount), "flexmig", "vm1", 77, 240 << 20, proc)
    assert group == scope  # QEMU stays where libvirt manages it
    assert (scope / "memory.max").read_text() == str(240 << 20)
    assert (scope / "memory.high").read_text() == "max"  # no throttling of QEMU itself
    assert (scope / "memory.swap.max").read_text() == "0"  # QEMU's own memory never swaps
    assert not (mount / "flexmig").exists()


def test_v2_without_the_memory_controller_in_the_slice_says_what_to_enable(tmp_path):
    mount = _tree(tmp_path, "/cg", "memory")
    (mount / LIBVIRT_GROUP).mkdir(parents=True)  # no memory.* files: controller off
    proc = _qemu_in(tmp_path, 77, LIBVIRT_GROUP)
    with pytest.raises(exceptions.MissingPrerequisite, match="MemoryAccounting=yes"):
        memcg.cap(memcg.MemoryHierarchy(2, mount), "flexmig", "vm1", 77, 240 << 20, proc)
    # every level down to the scope was asked for the controller
    assert (mount / "cgroup.subtree_control").read_text() == "+memory"
    assert (mount / "machine.slice" / "cgroup.subtree_control").read_text() == "+memory"


def test_v2_qemu_in_the_root_group_gets_flexmigs_own_group(tmp_path):
    mount = _tree(tmp_path, "/cg", "memory")
    own = mount / "flexmig" / socket.gethostname() / "vm1"
    own.mkdir(parents=True)
    (own / "memory.max").write_text("max\n")  # what the kernel makes once enabled
    proc = _qemu_in(tmp_path, 77, "")
    group = memcg.cap(memcg.MemoryHierarchy(2, mount), "flexmig", "vm1", 77, 100 << 20, proc)
    assert group == own
    assert (own / "cgroup.procs").read_text() == "77"
    assert (own / "memory.max").read_text() == str(100 << 20)
    assert (mount / "flexmig" / "cgroup.subtree_control").read_text() == "+memory"


@pytest.mark.parametrize(
    ("version", "files", "expected"),
    [
        (1, {"memory.usage_in_bytes": "10", "memory.limit_in_bytes": "20",
             "memory.max_usage_in_bytes": "15", "memory.failcnt": "7"}, (10, 20, 15, 7)),
        (2, {"memory.current": "10", "memory.max": "20", "memory.peak": "15",
             "memory.events": "low 0\nhigh 3\nmax 9\noom 0\noom_kill 0"}, (10, 20, 15, 9)),
        (2, {"memory.current": "10", "memory.max": "max"}, (10, None, None, None)),
    ],
)  # fmt: skip
def test_usage_reads_each_versions_files(tmp_path, version, files, expected):
    for name, text in files.items():
        (tmp_path / name).write_text(text + "\n")
    got = memcg.usage(memcg.MemoryHierarchy(version, tmp_path), tmp_path)
    keys = ("usage_bytes", "limit_bytes", "max_usage_bytes", "limit_hits")
    assert tuple(got[k] for k in keys) == expected
    assert memcg.usage(memcg.MemoryHierarchy(version, tmp_path), tmp_path / "gone") is None


def test_the_store_records_where_the_hook_capped_qemu(tmp_path):
    mount = _tree(tmp_path, "/cg", "memory")
    scope = mount / LIBVIRT_GROUP
    scope.mkdir(parents=True)
    (scope / "memory.max").write_text("max\n")
    (scope / "memory.current").write_text(str(50 << 20))
    (tmp_path / "store").mkdir()
    store = split_store.SplitStore(
        str(tmp_path / "state"), str(tmp_path / "store"), hierarchy=memcg.MemoryHierarchy(2, mount)
    )
    reply = store.prepare("vm1", 512 << 20, 240 << 20)
    assert reply["cgroup_version"] == 2 and reply["headroom_bytes"] == 30 << 20
    proc = _qemu_in(tmp_path, 77, LIBVIRT_GROUP)
    group = memcg.cap(store.hierarchy, "flexmig", "vm1", 77, 240 << 20, proc)
    store._write_reservation("vm1", store.reservation("vm1") | {"cgroup": str(group)})
    assert store.cgroup_dir("vm1") == scope
    assert store.usage("vm1") == {
        "usage_bytes": 50 << 20, "limit_bytes": 240 << 20, "max_usage_bytes": None,
        "limit_hits": None,
    }  # fmt: skip


def test_prepare_refuses_without_a_memory_controller_and_records_nothing(tmp_path, monkeypatch):
    (tmp_path / "store").mkdir()
    store = split_store.SplitStore(str(tmp_path / "state"), str(tmp_path / "store"))

    def none_found(*_a, **_k):
        raise exceptions.MissingPrerequisite(what="a memory cgroup controller", hint="none")

    monkeypatch.setattr(memcg, "detect", none_found)
    with pytest.raises(exceptions.MissingPrerequisite):
        store.prepare("vm1", 512 << 20, 240 << 20)
    assert store.reservation("vm1") is None


@pytest.mark.parametrize("headroom", [-1, 121 << 20])
def test_prepare_refuses_headroom_outside_half_the_budget(tmp_path, headroom):
    (tmp_path / "store").mkdir()
    store = split_store.SplitStore(
        str(tmp_path / "state"),
        str(tmp_path / "store"),
        hierarchy=memcg.MemoryHierarchy(1, tmp_path),
    )
    with pytest.raises(exceptions.InvalidInput, match="headroom"):
        store.prepare("vm1", 512 << 20, 240 << 20, headroom)
    assert store.reservation("vm1") is None


def test_remove_own_group_leaves_libvirts_alone(tmp_path):
    hierarchy = memcg.MemoryHierarchy(2, tmp_path)
    (tmp_path / LIBVIRT_GROUP).mkdir(parents=True)
    own = hierarchy.own_group("flexmig", "vm1")
    own.mkdir(parents=True)
    memcg.remove_own_group(hierarchy, "flexmig", "vm1")
    assert not own.exists() and (tmp_path / LIBVIRT_GROUP).exists()
