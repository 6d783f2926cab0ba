"""The plan's QEMU/libvirt knobs on real hosts: what each host reports, what libvirt takes.

The knobs past libvirt 9.0 (the switchover bandwidth hint, postcopy-preempt)
need the lab on libvirt 11 (``FLEXMIG_LAB_LIBVIRT=backports``); on Debian 12's
libvirt 9.0 the test checks that they are left out and explain says why.

The move is asked over the mover: where libvirt turns postcopy-preempt on by
itself (10.0 on) the plan must leave it for QEMU's own TCP, or the switch
fails ("Failed to establish preempt channel"); on 9.0 the mover carries it.
"""

from __future__ import annotations

import os

import pytest

from flexmig import migrate_cli
from flexmig_lab import vm

pytestmark = pytest.mark.lab

BACKPORTS = os.environ.get("FLEXMIG_LAB_LIBVIRT") == "backports"


def test_a_hot_vms_hybrid_move_uses_what_both_hosts_support(lab):
    vm.create(
        lab,
        "A",
        ram="512M",
        workload="dirtier:wss=256M,rate=150000",
        memory_backing="anonymous",
        name="knobs",
    )
    try:
        asked = dict(bandwidth_mib=64, transport="mover")
        plan = migrate_cli.explain(lab, "knobs", "B", **asked)
        assert plan["mode"] == "postcopy", plan["explanation"]
        features = plan["features"]
        text = plan["explanation"]
        assert "hosts: source libvirt" in text
        if BACKPORTS:
            # libvirt 11.3 turns preempt on by itself (no flag): QEMU's TCP, not the mover.
            assert features["postcopy-preempt"] == "yes", text
            assert plan["knobs"]["postcopy_preempt"], text
            assert plan["transport"] == "qemu-tcp", text
            assert "instead of the mover" in text
            assert features["switchover-bandwidth"] == "yes", text
            assert plan["knobs"]["avail_switchover_mib"] == 64
            assert features["postcopy-recovery"] == "yes", text
            assert "cannot be resumed" not in text
        else:
            assert features["postcopy-preempt"] == "no: source needs libvirt 10.0.0; " + (
                "destination needs libvirt 10.0.0"
            ), text
            assert not plan["knobs"]["postcopy_preempt"]
            assert plan["transport"] == "mover", text
            assert "postcopy-preempt: off (source needs libvirt 10.0.0" in text
            assert features["switchover-bandwidth"].startswith("no: source needs libvirt 11.1.0")
            assert plan["knobs"]["avail_switchover_mib"] is None
            assert "switchover bandwidth hint: not available" in text
            # Debian 12's libvirt 9.0 with the lab's QEMU 10: a broken postcopy
            # could not be resumed (the fault campaign's lost VMs), and the plan says so.
            assert features["postcopy-recovery"].startswith(
                "no: source needs libvirt 11.0.0 with QEMU 9.1.0 or later"
            ), text
            assert "note: a postcopy whose connection breaks cannot be resumed" in text
        result = migrate_cli.migrate(lab, "knobs", "B", show=False, **asked)
        # libvirt took every flag and parameter the plan chose, and the guest is whole.
        assert result["state"] == "completed", result.get("error")
        assert result["running_on"] == "B" and result["switched_to_postcopy"]
        assert (result["verify"]["bad"], result["verify"]["lost"]) == (0, 0)
        assert result["knobs"]["postcopy_preempt"] == plan["knobs"]["postcopy_preempt"]
        assert result["transport"] == plan["transport"]
        # The gap after a postcopy switch holds its faults: kept, not learnt as a first run.
        assert result["guest_gap_taught"].startswith("not learnt: a postcopy"), result
        # The summary carries the downtime's parts and the budget's verdict.
        parts = result["downtime_parts_ms"]
        assert parts["guest_ms"] == result["guest_observed_downtime_ms"]
        # After a postcopy libvirt may report no downtime statistic: then nothing
        # is made up beyond the guest's own measurement.
        qemu = result["downtime_ms"]
        assert parts["qemu_downtime_ms"] == (float(qemu) if qemu is not None else None)
        if qemu is None:
            assert parts["beyond_qemu_ms"] is None
        budget = result["downtime_budget_ms"]
        exceeded = result["downtime_exceeded_ms"]
        assert (exceeded is None) == (result["guest_observed_downtime_ms"] <= budget)
        print(
            f"\nknobs: {result['knobs']}; transport {result['transport']}; "
            f"guest {parts['guest_ms']} ms, QEMU "
            f"{parts['qemu_downtime_ms']} ms, predicted {result['predicted_guest_downtime_ms']}"
            f" ms ({result['predicted_downtime_parts_ms']})"
        )
    finally:
        vm.destroy(lab, "knobs")
