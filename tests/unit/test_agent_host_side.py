"""The agent's host-side pieces: its facts and the libvirt hook (no daemons, no root)."""

from __future__ import annotations

import io
import json
import pathlib

import libvirt

from agents.agent import facts, libvirt_hook
from flexmig.migration.facts import filesystem_of

MIB = 2**20


def test_facts_count_the_running_vms_against_the_budget(tmp_path):
    # libvirt's own test driver: one running domain, "test", of 8 GiB.
    uri = "test:///default"
    conn = libvirt.open(uri)
    running = sum(d.maxMemory() * 1024 for d in conn.listAllDomains(1))
    conn.close()
    assert running > 0
    cgroup = {"version": 1, "detail": "cgroup v1"}
    links = {"10.0.0.2": {"setup_s": 0.1}}
    probe = facts.StoreProbe(write_bps=5e8, fault_s=0.02, fault_pages=1024)
    got = facts.host_facts("A", uri, 16384, str(tmp_path), cgroup, links, probe)
    assert got["vm_ram_bytes"] == running
    assert got["free_for_vms_bytes"] == max(0, 16384 * MIB - running)
    assert got["store_fs_type"] == filesystem_of(str(tmp_path))
    assert 0 < got["store_free_bytes"] <= got["store_capacity_bytes"]
    assert got["measured_links"] == {"10.0.0.2": {"setup_s": 0.1}}
    assert got["memory_cgroup"] == cgroup
    assert (got["store_write_bps"], got["store_fault_s"]) == (5e8, 0.02)


def test_an_unprobed_store_reports_no_fault_time(tmp_path):
    got = facts.host_facts("A", "test:///default", 16384, str(tmp_path), {}, {})
    assert (got["store_write_bps"], got["store_fault_s"]) == (0.0, None)


def test_the_store_probe_faults_as_qemu_does_a_window_of_two_huge_pages_per_touch(tmp_path):
    # tmp_path may be a tmpfs (nothing to read back) or a disk: the time is
    # whatever it is, the shape of the answer is not.
    probe = facts.probe_store(str(tmp_path), nbytes=16 * MIB)
    assert probe.write_bps > 0 and 0 < probe.fault_s < 5.0
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    assert probe.folio_bytes in (facts.PAGE, facts.PMD_BYTES)  # the mapping was seen
    thp = pathlib.Path("/sys/kernel/mm/transparent_hugepage").exists()
    if thp and probe.fault_pages is not None and filesystem_of(str(tmp_path)) != "tmpfs":
        # MADV_HUGEPAGE: the kernel reads 4 MiB around the fault, not read_ahead_kb.
        assert probe.fault_pages == facts.FAULT_WINDOW_BYTES // facts.PAGE


def test_a_budget_of_zero_means_what_the_host_has_available(tmp_path, monkeypatch):
    # MemAvailable moves on a busy machine: pin it to test the rule, not the host.
    assert facts._mem_available() > 0
    monkeypatch.setattr(facts, "_mem_available", lambda: 3 << 30)
    got = facts.host_facts("A", "test:///default", 0, str(tmp_path), {}, {})
    assert got["memory_budget_bytes"] == (3 << 30) + got["vm_ram_bytes"]


def _hook(monkeypatch, tmp_path, *args: str) -> int:
    monkeypatch.setenv("FLEXMIG_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FLEXMIG_STORE_DIR", str(tmp_path))
    monkeypatch.setattr("sys.stdin", io.StringIO("<domain/>"))
    return libvirt_hook.main(list(args))


def test_the_hook_ignores_what_it_does_not_handle(monkeypatch, tmp_path):
    assert libvirt_hook.main([]) == 0
    assert _hook(monkeypatch, tmp_path, "vm1", "prepare", "begin", "-") == 0


def test_release_drops_the_reservation(monkeypatch, tmp_path):
    removed = []
    monkeypatch.setattr(
        libvirt_hook.SplitStore, "_remove_cgroup", lambda self, parent, vm: removed.append(vm)
    )
    store = libvirt_hook.SplitStore(str(tmp_path / "state"), str(tmp_path))
    store.reservations.mkdir(parents=True)
    (store.reservations / "vm1.json").write_text(json.dumps({"ram_bytes": 1, "budget_bytes": 1}))
    assert store.reservation("vm1") is not None
    assert _hook(monkeypatch, tmp_path, "vm1", "release", "end", "-") == 0
    assert store.reservation("vm1") is None
    assert removed == ["vm1"]


def test_a_start_that_cannot_be_capped_fails_so_libvirt_aborts_it(monkeypatch, tmp_path, capsys):
    # No QEMU pid file for this VM: the hook cannot cap it and must say so with exit 1.
    assert _hook(monkeypatch, tmp_path, "no-such-vm-here", "started", "begin", "-") == 1
    assert "flexmig hook: no-such-vm-here started" in capsys.readouterr().err
