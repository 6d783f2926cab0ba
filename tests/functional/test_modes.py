"""FlexMig's three modes on real guests, chosen by the policy and run by the agents."""

import json

import pytest

from agents.agent import auth
from agents.agent.client import _UnixHTTPConnection
from flexmig import exceptions, migrate_cli
from flexmig_lab import vm
from flexmig_lab.lab import CGROUP_ROOT

pytestmark = pytest.mark.lab


def _assert_intact(result, on):
    assert result["state"] == "completed", result.get("error")
    assert result["running_on"] == on
    assert (result["verify"]["bad"], result["verify"]["lost"]) == (0, 0)
    assert result["heartbeat_hosts"].endswith(on)


def test_moderate_vm_goes_by_precopy(lab):
    vm.create(lab, "A", ram="384M", workload="dirtier:wss=96M,rate=3000", name="moderate")
    try:
        result = migrate_cli.migrate(lab, "moderate", "B", show=False)
        _assert_intact(result, "B")
        assert (result["mode"], result["transfer"]) == ("precopy", "precopy")
        assert not result["switched_to_postcopy"]
        assert result["predicted_total_ms"] > 0 and result["total_time_ms"] > 0
        # B wrote the file-backed VM's memory back while pages arrived (QEMU
        # msyncs guest RAM inside the downtime)
        assert result["store_writeback_rounds"] > 0
        # The guest's gap went to A's agent, which learnt B's first run from it
        # and its QEMU side from the job: the next forecast to B counts both.
        assert result["guest_gap_taught"] == "learnt by the source agent"
        link = lab.agent("A").get("/v1/facts")["measured_links"][lab.destination("B")[1]["address"]]
        gap, qemu = result["guest_observed_downtime_ms"], result["downtime_ms"]
        assert link["first_run_recent"][-1] == pytest.approx(max(0.0, gap - qemu) / 1000, abs=1e-3)
        assert link["qemu_side_recent"]
        vm.create(lab, "A", ram="384M", workload="dirtier:wss=96M,rate=3000", name="moderate2")
        plan = migrate_cli.explain(lab, "moderate2", "B")
        assert "QEMU's downtime, learnt" in plan["explanation"], plan["explanation"]
        assert "the guest's first run" in plan["explanation"]
    finally:
        vm.destroy(lab, "moderate")
        vm.destroy(lab, "moderate2")


HOT_LINK_MIB = 24


def test_hot_anonymous_vm_goes_by_hybrid_postcopy(lab):
    vm.create(
        lab,
        "A",
        ram="512M",
        workload="dirtier:wss=256M,rate=150000",
        memory_backing="anonymous",
        name="hot",
    )
    # The link well below what the guest rewrites even on a loaded host: at
    # 64 MiB/s a CI run at load 10 learnt the stream at 35 MiB/s against the
    # TCG guest's 33 MiB/s of dirtying, and precopy was (rightly) chosen.
    try:
        plan = migrate_cli.explain(lab, "hot", "B", bandwidth_mib=HOT_LINK_MIB)
        assert plan["mode"] == "postcopy", plan["explanation"]
        result = migrate_cli.migrate(lab, "hot", "B", show=False, bandwidth_mib=HOT_LINK_MIB)
        _assert_intact(result, "B")
        assert result["mode"] == "postcopy" and result["switched_to_postcopy"]
        assert result["store_writeback_rounds"] == 0  # anonymous memory: no file to write
    finally:
        vm.destroy(lab, "hot")


def test_file_backed_vm_never_gets_postcopy(lab):
    vm.create(lab, "A", ram="256M", workload="idle", name="filevm")
    try:
        with pytest.raises(exceptions.FlexMigError, match="userfaultfd cannot serve"):
            migrate_cli.explain(lab, "filevm", "B", mode="postcopy")
    finally:
        vm.destroy(lab, "filevm")


def test_short_destination_goes_by_split_and_caps_residency(lab):
    lab.set_budget("B", 400)  # 400 MiB for VMs: less than the VM's 512 MiB + QEMU's own
    try:
        vm.create(lab, "A", ram="512M", workload="dirtier:wss=300M,rate=2000", name="big")
        result = migrate_cli.migrate(lab, "big", "B", show=False)
        _assert_intact(result, "B")
        assert result["mode"] == "split"
        # A split guest's first run is learnt apart (it reads back dropped pages).
        assert result["guest_gap_taught"] == "learnt by the source agent"
        link = lab.agent("A").get("/v1/facts")["measured_links"][lab.destination("B")[1]["address"]]
        # beside the share of it the plan left in the store (300 MiB written, 240 capped)
        entry = link["split_first_run_recent"][-1]
        assert isinstance(entry, list) and len(entry) == 2, link
        share, first_run_s = entry
        assert 0.1 < share <= 1 and first_run_s >= 0, link
        # and its QEMU side apart from a precopy's, at least the 10 ms floor
        assert link["split_qemu_side_recent"][-1][0] >= 0.010, link
        # The source told B's keeper which chunks the guest writes (hot_chunks.py).
        assert lab.agent("B").get("/v1/split/big")["residency"]["hinted_chunks"] > 0
        group = CGROUP_ROOT / "lab-b" / "big"
        limit = int((group / "memory.limit_in_bytes").read_text())
        assert limit <= (400 - 160) * 2**20
        assert int((group / "memory.max_usage_in_bytes").read_text()) <= limit
        # 300 MiB of verified working set lives on a host capped below it.
        assert result["verify"]["pages"] * 4096 > limit
        # Seen from B's mount namespace: the store may be a mount of its own there
        # (FLEXMIG_LAB_STORE=own-fs), invisible from the lab's.
        memory_file = lab.host("B").ns.root_path(str(lab.host("B").store_dir / "libvirt/qemu"))
        assert any(memory_file.glob("*-big/*"))
        vm.destroy(lab, "big")
        assert not group.exists()  # the release hook removed the group
        assert not any(memory_file.glob("*-big/*"))  # and libvirt the memory file
    finally:
        vm.destroy(lab, "big")
        lab.set_budget("B", 4096)


def test_short_destination_without_file_backing_is_refused_and_nothing_moves(lab):
    lab.set_budget("B", 400)
    try:
        vm.create(
            lab,
            "A",
            ram="512M",
            workload="dirtier:wss=64M,rate=1000",
            memory_backing="anonymous",
            name="anon",
        )
        with pytest.raises(exceptions.FlexMigError, match="not file-backed"):
            migrate_cli.explain(lab, "anon", "B")
        result = migrate_cli.migrate(lab, "anon", "B", show=False)
        assert result["state"] == "failed" and "not file-backed" in result["error"]
        assert result["running_on"] == "A"
        assert result["verify"]["bad"] == 0
    finally:
        vm.destroy(lab, "anon")
        lab.set_budget("B", 4096)


def _raw_request(lab, method, path, body=b"", headers=None):
    conn = _UnixHTTPConnection(str(lab.host("A").agent_socket), 10)
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"{}")


def test_agent_rejects_unauthenticated_and_malformed_requests(lab):
    body = json.dumps({"vm": "x", "ram_bytes": 2**30, "budget_bytes": 2**28}).encode()
    status, reply = _raw_request(lab, "POST", "/v1/split/prepare", body)
    assert status == 401 and "missing credential" in reply["error"]
    wrong = auth.sign(b"k" * 32, "POST", "/v1/split/prepare", body)
    status, reply = _raw_request(lab, "POST", "/v1/split/prepare", body, wrong)
    assert status == 401 and "bad signature" in reply["error"]
    good = auth.sign(lab.key(), "POST", "/v1/split/prepare", body)
    replay = dict(good)
    assert _raw_request(lab, "POST", "/v1/split/prepare", body, good)[0] == 200
    status, reply = _raw_request(lab, "POST", "/v1/split/prepare", body, replay)
    assert status == 401 and "replayed" in reply["error"]
    lab.agent("A").post("/v1/split/cleanup", {"vm": "x"})
    for bad in (
        b"[1,2]",
        b"{not json",
        json.dumps({"vm": "x", "extra": 1}).encode(),
        json.dumps({"vm": "x", "ram_bytes": "big", "budget_bytes": 1}).encode(),
    ):
        headers = auth.sign(lab.key(), "POST", "/v1/split/prepare", bad)
        status, _ = _raw_request(lab, "POST", "/v1/split/prepare", bad, headers)
        assert status == 400
    assert lab.agent("A").get("/v1/split/x")["reservation"] is None  # nothing changed
    for bad_writeback in ({"vm": "../x", "active": True}, {"vm": "x", "active": 1}, {"vm": "x"}):
        with pytest.raises(exceptions.FlexMigError, match="400"):
            lab.agent("A").post("/v1/incoming/writeback", bad_writeback)


def test_agent_listens_only_on_its_management_address(lab):
    host = lab.host("A")
    listening = host.ns.run(["ss", "-Hltnp"]).stdout
    agent_lines = [line for line in listening.splitlines() if ":9797" in line]
    assert agent_lines and all(f"{host.spec.mgmt_ip}:9797" in line for line in agent_lines)


def test_http_error_paths_are_clear(lab):
    client = lab.agent("A")
    with pytest.raises(exceptions.FlexMigError, match="404"):
        client.get("/v1/nothing")
    with pytest.raises(exceptions.FlexMigError, match="no migration"):
        client.get("/v1/migrations/abc123")
