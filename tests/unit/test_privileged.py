"""The privileged entry points re-check what the unprivileged side sends."""

import socket

import pytest

from agents.agent import memcg, privileged
from flexmig import exceptions


@pytest.fixture(params=[1, 2])
def in_process(monkeypatch, tmp_path, request):
    """Run entry points in this process (no daemon), against a fake cgroup tree (v1, v2)."""
    privileged.agent_pctxt.set_client_mode(False)
    hierarchy = memcg.MemoryHierarchy(request.param, tmp_path)
    monkeypatch.setattr(privileged, "memory_hierarchy", lambda: hierarchy)
    monkeypatch.setattr(privileged, "LIBVIRT_PID_DIR", tmp_path / "pids")
    yield tmp_path
    privileged.agent_pctxt.set_client_mode(True)


@pytest.mark.parametrize("name", ["..", "a/b", "", "x" * 65, "."])
def test_path_components_from_the_caller_are_refused(in_process, name):
    with pytest.raises(exceptions.InvalidInput):
        privileged.remove_split_cgroup("flexmig", name)
    with pytest.raises(exceptions.InvalidInput):
        privileged.remove_split_cgroup(name, "vm1")


def test_remove_split_cgroup_removes_only_that_vms_group(in_process):
    host = in_process / "flexmig" / socket.gethostname()
    (host / "vm1").mkdir(parents=True)
    (host / "vm2").mkdir()
    privileged.remove_split_cgroup("flexmig", "vm1")
    assert not (host / "vm1").exists()
    assert (host / "vm2").exists()
    privileged.remove_split_cgroup("flexmig", "vm1")  # idempotent


def test_remove_split_cgroup_refuses_while_qemu_is_in_it(in_process):
    group = in_process / "flexmig" / socket.gethostname() / "vm1"
    group.mkdir(parents=True)
    (group / "cgroup.procs").write_text("1234\n")  # a real cgroup would refuse rmdir
    with pytest.raises(exceptions.FlexMigError, match="still has processes"):
        privileged.remove_split_cgroup("flexmig", "vm1")


def test_ram_mapping_refuses_absurd_sizes_before_reading_anything(in_process):
    with pytest.raises(exceptions.InvalidInput, match="RAM size"):
        privileged.qemu_ram_mapping("vm1", 0)
    with pytest.raises(exceptions.InvalidInput, match="VM name"):
        privileged.qemu_ram_mapping("../../etc/passwd", 1 << 20)
