"""The agent's inventory for a drain: samples kept briefly and once, unreadable VMs named."""

from __future__ import annotations

import pytest

from agents.agent import inventory


def test_samples_are_taken_once_and_only_while_fresh(monkeypatch):
    cache = inventory.SampleCache()
    cache.put("vm1", [(1.0, 10.0), (2.0, 15.0)])
    assert cache.take("vm1") == ((1.0, 10.0), (2.0, 15.0))
    assert cache.take("vm1") is None  # a second migration samples anew
    cache.put("vm1", [(1.0, 10.0)])
    now = inventory.time.monotonic()
    monkeypatch.setattr(inventory.time, "monotonic", lambda: now + inventory.SAMPLES_MAX_AGE_S + 1)
    assert cache.take("vm1") is None


def test_a_vm_that_cannot_be_read_stays_in_the_answer_with_why():
    # libvirt's test driver runs one domain, "test", but has no dirty-rate
    # calculation: the inventory must say so for that VM, not drop it.
    cache = inventory.SampleCache()
    vms = inventory.running_vms(
        "test:///default", "A", (1, 2), lambda vm, ram: (None, ram // 2), cache
    )
    assert [vm["name"] for vm in vms] == ["test"]
    assert "error" in vms[0] and "dirty-rate" in vms[0]["error"]
    assert cache.take("test") is None


def test_vms_being_migrated_are_skipped():
    assert (
        inventory.running_vms(
            "test:///default",
            "A",
            (1, 2),
            lambda vm, ram: (None, 0),
            inventory.SampleCache(),
            skip=lambda name: name == "test",
        )
        == []
    )


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch):
    monkeypatch.setattr("flexmig.migration.facts.time.sleep", lambda s: None)
