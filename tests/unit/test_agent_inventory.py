"""The agent's inventory for a drain: samples kept briefly and once, unreadable VMs named."""

from __future__ import annotations

import json

import pytest

from agents.agent import inventory
from flexmig import exceptions
from flexmig.policy import dirty_model


def test_samples_are_taken_once_and_only_while_fresh(monkeypatch):
    cache = inventory.SampleCache()
    cache.put("vm1", [(1.0, 10.0), (2.0, 15.0)])
    assert cache.take("vm1") == ((1.0, 10.0), (2.0, 15.0))
    assert cache.take("vm1") is None  # a second migration samples anew
    cache.put("vm1", [(1.0, 10.0)])
    now = inventory.time.monotonic()
    monkeypatch.setattr(inventory.time, "monotonic", lambda: now + inventory.SAMPLES_MAX_AGE_S + 1)
    assert cache.take("vm1") is None


def test_a_migration_takes_every_fresh_sampling_together(monkeypatch):
    cache = inventory.SampleCache()
    clock = [1000.0]
    monkeypatch.setattr(inventory.time, "monotonic", lambda: clock[0])
    cache.put("vm1", [(1.0, 10.0), (5.0, 40.0)])
    clock[0] += inventory.SAMPLES_MAX_AGE_S - 10
    cache.put("vm1", [(1.0, 12.0), (5.0, 38.0)])
    # A drain plans from them without taking them; its migration then takes both.
    assert cache.peek("vm1") == ((1.0, 10.0), (5.0, 40.0), (1.0, 12.0), (5.0, 38.0))
    clock[0] += 20  # the first is now too old: only the second is fitted
    assert cache.peek("vm1") == ((1.0, 12.0), (5.0, 38.0))
    assert cache.take("vm1") == ((1.0, 12.0), (5.0, 38.0))
    assert cache.take("vm1") is None
    for i in range(inventory.MAX_SAMPLINGS + 3):
        cache.put("vm2", [(1.0, float(i))])
    kept = cache.take("vm2")
    assert kept is not None and len(kept) == inventory.MAX_SAMPLINGS and kept[-1][1] == 10.0
    # A VM no longer running here leaves nothing a new VM of its name could inherit.
    cache.put("gone", [(1.0, 1.0)])
    cache.put("vm3", [(1.0, 1.0)])
    cache.forget_all_but({"vm3"})
    assert cache.take("gone") is None and cache.take("vm3") == ((1.0, 1.0),)


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


def test_the_inventory_carries_the_engines_facts_to_the_drain(monkeypatch):
    """What the source agent reports is what the drain plans each move from: the
    engine's VmFacts, rebuilt field for field, and the samples kept for the migration."""
    from flexmig import drain_agents
    from flexmig.migration import facts

    samples = ((1.0, 500.0), (2.0, 800.0))
    monkeypatch.setattr(facts, "sample_dirty_pages", lambda conn, dom, host, sec: samples)
    cache = inventory.SampleCache()
    entries = inventory.running_vms(
        "test:///default", "A", (1, 2), lambda vm, ram: ("/dev/shm/mem-test", ram // 2), cache
    )
    vm = drain_agents.vm_from_inventory(json.loads(json.dumps(entries[0])))
    assert vm.facts.memory == facts.GuestMemory(
        entries[0]["ram_bytes"], entries[0]["ram_bytes"] // 2, "file", "tmpfs", False
    )
    assert vm.facts.dirty_samples == samples and not vm.facts.paused
    # libvirt's test driver runs domains of type "test": said as it is.
    assert vm.facts.accelerator == entries[0]["accelerator"] == "test"
    older = {k: v for k, v in entries[0].items() if k != "accelerator"}
    assert drain_agents.vm_from_inventory(older).facts.accelerator == "kvm"
    assert vm.dirty == dirty_model.fit(samples, max_pages=vm.ram_bytes / facts.PAGE)
    assert cache.take("test") == samples


def test_an_inventory_entry_of_another_shape_is_a_backend_error():
    from flexmig import drain_agents, exceptions

    with pytest.raises(exceptions.BackendError, match="inventory entry"):
        drain_agents.vm_from_inventory({"name": "v", "ram_bytes": 1})


def test_the_agent_is_asked_for_the_engines_request_with_the_plans_mode():
    from flexmig import drain_agents
    from flexmig.policy import drain

    class Agent:
        posted: list = []

        def post(self, path, body, timeout=None):
            self.posted.append((path, body))
            return {"id": "m1"}

    src = drain_agents.HostEndpoint("A", Agent(), "10.0.0.1", 1, "qemu://a", "tcp://a")
    dst = drain_agents.HostEndpoint("B", None, "10.0.0.2", 2, "qemu://b", "tcp://b")
    vm = drain.DrainVM.sized("v", 256 << 20, 64 << 20, dirty_model.IDLE, max_downtime_ms=150)
    p = drain.plan("A", [vm], [drain.Candidate("B", 4 << 30, 0)], drain.Fabric(1e8, 1e8))
    assert drain_agents.AgentBackend(src, [dst]).start(p.moves[0]) == "m1"
    assert Agent.posted == [
        (
            "/v1/migrations",
            {"vm": "v", "mode": "precopy", "max_downtime_ms": 150, "dest": dst.dest_body()},
        )
    ]


def test_the_background_refresher_keeps_samples_for_the_next_plan(monkeypatch):
    from flexmig.migration import facts

    taken = []

    def sample(conn, dom, host, seconds):
        taken.append(seconds)
        return ((1.0, 500.0), (5.0, 1800.0))

    monkeypatch.setattr(facts, "sample_dirty_pages", sample)
    cache = inventory.SampleCache()
    busy: set[str] = set()

    def running():
        return inventory.running_vms(
            "test:///default",
            "A",
            (1, 5),
            lambda vm, ram: (None, ram),
            cache,
            skip=busy.__contains__,
        )

    refresher = inventory.SampleRefresher(30, running)
    assert refresher.once() == 1 and taken == [(1, 5)]
    # The plan of a migration takes them instead of sampling (MigrationService.plan).
    assert cache.take("test") == ((1.0, 500.0), (5.0, 1800.0))
    busy.add("test")  # migrating: not sampled under its migration
    assert refresher.once() == 0 and len(taken) == 1 and cache.take("test") is None
    assert refresher.rounds == 2


def test_the_refresher_outlives_a_failed_round_and_stops_when_told():
    calls = []

    def flaky():
        calls.append(len(calls))
        if len(calls) == 1:
            raise exceptions.BackendError(backend="libvirt on A", reason="down")
        refresher.stop.set()
        return [{"name": "vm1", "error": "no dirty-rate calculation"}]

    refresher = inventory.SampleRefresher(1, flaky)
    refresher.run()  # returns once stopped; the first round's error is logged
    assert calls == [0, 1] and refresher.rounds == 1


def test_background_sampling_skips_paused_vms(monkeypatch):
    """A VM still arriving is paused, and its libvirt job would hold the sampling."""
    import libvirt

    from flexmig.migration import facts

    monkeypatch.setattr(
        facts, "sample_dirty_pages", lambda conn, dom, host, sec: ((1.0, 1.0), (2.0, 2.0))
    )
    conn = libvirt.open("test:///default")  # the test driver's default state, shared
    dom = conn.lookupByName("test")
    dom.suspend()
    try:

        def names(**kw):
            vms = inventory.running_vms(
                "test:///default",
                "A",
                (1, 2),
                lambda vm, ram: (None, ram),
                inventory.SampleCache(),
                **kw,
            )
            return [vm["name"] for vm in vms]

        assert names(running_only=True) == []
        assert names() == ["test"]  # a drain's inventory reports paused VMs too
    finally:
        dom.resume()
        conn.close()
