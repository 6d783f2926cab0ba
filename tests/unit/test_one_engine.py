"""The agent path and the Nova path give the same plan for the same VM facts.

Each adapter reads the facts its own way (the agent through its privileged
reader of QEMU's map, Nova through libvirt's memory statistics and the
filesystem of the host's memory store that its local agent reports); both
must come to the same decision, transport and parallel connections.  libvirt
and the agents are small fakes here: this is the adapters' wiring, not I/O.
"""

from __future__ import annotations

import dataclasses
import threading
import types

import pytest

pytest.importorskip("nova", reason="Nova is not installed (tools/setup.sh installs it)")

from agents.agent import migrations  # noqa: E402
from agents.agent.client import AgentClient  # noqa: E402
from flexmig import exceptions  # noqa: E402
from flexmig.migration import facts  # noqa: E402
from flexmig.migration.options import EngineOptions  # noqa: E402
from flexmig.migration.request import MigrationRequest  # noqa: E402
from nova_driver import planning  # noqa: E402
from nova_driver.migrate_data import DestinationOffer, MoverOffer  # noqa: E402

MIB = 2**20
PAGE = 4096
FABRIC_BPS = 300 * MIB


@dataclasses.dataclass
class Guest:
    """One VM as libvirt and /proc show it."""

    ram_mib: int = 512
    resident_mib: int = 200
    file_backed: bool = True
    dirty_mib_per_s: dict[int, float] = dataclasses.field(
        default_factory=lambda: {1: 19.0, 2: 17.0}
    )


class FakeDomain:
    def __init__(self, guest: Guest) -> None:
        self.guest = guest
        self.period = 1

    def name(self) -> str:
        return "vm1"

    def XMLDesc(self, flags: int = 0) -> str:
        backing = (
            "<memoryBacking><source type='file'/><access mode='shared'/></memoryBacking>"
            if self.guest.file_backed
            else ""
        )
        return f"<domain><name>vm1</name>{backing}<devices/></domain>"

    def maxMemory(self) -> int:
        return self.guest.ram_mib * 1024

    def memoryStats(self) -> dict[str, int]:
        return {"rss": self.guest.resident_mib * 1024}

    def isActive(self) -> bool:
        return True

    def info(self) -> list[int]:
        return [1, self.guest.ram_mib * 1024, self.guest.ram_mib * 1024, 1, 0]  # running

    def startDirtyRateCalc(self, seconds: int, flags: int) -> None:
        self.period = seconds


class FakeConnection:
    def __init__(self, dom: FakeDomain) -> None:
        self.dom = dom

    def domainListGetStats(self, doms, stats, flags=0):
        rate = self.dom.guest.dirty_mib_per_s[self.dom.period]
        return [(self.dom, {"dirtyrate.calc_status": 2, "dirtyrate.megabytes_per_second": rate})]

    def lookupByName(self, name: str) -> FakeDomain:
        return self.dom

    def getLibVersion(self) -> int:
        return LIBVIRT_VERSION

    def getVersion(self) -> int:
        return QEMU_VERSION

    def close(self) -> None:
        pass


class FakeAgent:
    def __init__(self, facts: dict, background: dict | None = None) -> None:
        self.facts = facts
        self.address = "10.250.0.2"
        self.background = dict(background or {})  # VM -> its background samples

    def get(self, path: str, **kw) -> dict:
        assert path == "/v1/facts"
        return self.facts

    def post(self, path: str, body: dict, **kw) -> dict:
        vm = path.removeprefix("/v1/samples/").removesuffix("/take")
        assert path == f"/v1/samples/{vm}/take" and body == {}
        return {"vm": vm, "samples": [list(s) for s in self.background.pop(vm, ())]}

    def probe_bandwidth(self, mib: int) -> float:
        return FABRIC_BPS


LIBVIRT_VERSION, QEMU_VERSION = 11_003_000, 10_000_002  # the lab's backports
# The lab's default layout: the store on /etc/libvirt's filesystem, probed at 500 MiB/s.
STORE = {"store_write_bps": 500.0 * MIB, "store_shares_libvirt_fs": True}
SOFTWARE = {"libvirt_version": LIBVIRT_VERSION, "qemu_version": QEMU_VERSION} | STORE


@pytest.fixture(autouse=True)
def instant_sampling(monkeypatch):
    monkeypatch.setattr(facts.time, "sleep", lambda s: None)
    monkeypatch.setattr(facts, "idle_cpus", lambda: 1.5)
    monkeypatch.setattr(AgentClient, "probe_bandwidth", lambda self, mib: FABRIC_BPS)
    # The Nova path asks the destination's agent for its libvirt and QEMU.
    monkeypatch.setattr(AgentClient, "get", lambda self, path, **kw: dict(SOFTWARE))


OPTS = EngineOptions(dirty_sample_seconds=(1, 2))


def _agent_plan(
    guest: Guest, dest_free_mib: int, store, monkeypatch, dest_facts=None, background=(), **asked
):
    dom = FakeDomain(guest)
    monkeypatch.setattr(
        migrations.hypervisor, "connect", lambda uri, host: _context(FakeConnection(dom))
    )
    monkeypatch.setattr(migrations.hypervisor, "find_domain", lambda conn, name: dom)
    conf = types.SimpleNamespace(
        agent=types.SimpleNamespace(libvirt_uri="test:///", state_dir=str(store / "state"))
    )
    service = migrations.MigrationService.__new__(migrations.MigrationService)
    service.host, service.conf, service.options, service.links = "A", conf, OPTS, {}
    service.links_file = store / "state" / "links.json"
    service.links_lock, service._probe_lock = threading.Lock(), threading.Lock()
    service.rdma = False
    service.samples = migrations.inventory.SampleCache()
    if background:
        service.samples.put("vm1", list(background))
    memory_file = str(store / "libvirt" / "qemu" / "vm1.ram") if guest.file_backed else None
    service.ram_mapping = lambda vm, ram: (memory_file, guest.resident_mib * MIB)
    dest_agent = FakeAgent(
        {"free_for_vms_bytes": dest_free_mib * MIB, "store_free_bytes": 8 << 30}
        | (dest_facts or SOFTWARE)
    )
    dest = migrations.Destination(dest_agent, "qemu+tcp://b/system", "tcp://b")  # type: ignore[arg-type]
    return service.plan(MigrationRequest(vm="vm1", **asked), dest)


def _nova_plan(
    guest: Guest,
    dest_free_mib: int,
    store,
    split_reserved: bool,
    mover=None,
    background=(),
    **asked,
):
    dom = FakeDomain(guest)
    offer = DestinationOffer(
        mover=mover,
        agent_address="10.250.0.2",
        agent_port=9797,
        scope="migration/m1/vm1/1900000000",
        scoped_key="ab" * 32,
        free_for_vms_bytes=dest_free_mib * MIB,
        store_free_bytes=8 << 30,
        split_budget_bytes=(dest_free_mib - 160) * MIB if split_reserved else None,
    )
    conf = types.SimpleNamespace(
        libvirt=types.SimpleNamespace(
            live_migration_bandwidth=asked.get("bandwidth_mib", 0),
            live_migration_parallel_connections=asked.get("parallel", 1),
        ),
        flexmig=types.SimpleNamespace(agent_timeout=10.0, agent_ca_file=None),
    )
    local = FakeAgent(
        {"store_fs_type": facts.filesystem_of(str(store))},
        {"vm1": background} if background else {},
    )
    return planning.plan(
        FakeConnection(dom),
        dom,
        "A",
        offer,
        conf,
        OPTS,
        local,
        RuntimeError,  # type: ignore[arg-type]
    )


class _context:
    def __init__(self, value):
        self.value = value

    def __enter__(self):
        return self.value

    def __exit__(self, *exc):
        return False


HOT = {1: 400.0, 2: 350.0}


@pytest.mark.parametrize(
    ("guest", "dest_free_mib", "mode"),
    [
        (Guest(), 4096, "precopy"),
        (Guest(file_backed=False, dirty_mib_per_s=HOT), 4096, "postcopy"),
        # file-backed on this disk filesystem: userfaultfd cannot serve it, on both paths
        (Guest(dirty_mib_per_s=HOT), 4096, "precopy"),
        (Guest(), 400, "split"),
    ],
)
@pytest.mark.parametrize("asked", [{}, {"bandwidth_mib": 64, "parallel": 4}])
def test_both_paths_plan_the_same(tmp_path, monkeypatch, guest, dest_free_mib, mode, asked):
    agent = _agent_plan(guest, dest_free_mib, tmp_path, monkeypatch, **asked)
    nova = _nova_plan(guest, dest_free_mib, tmp_path, split_reserved=mode == "split", **asked)
    assert agent.mode == mode, agent.explain()
    assert agent.decision == nova.decision
    assert (agent.transport, agent.parallel) == (nova.transport, nova.parallel)
    assert agent.knobs == nova.knobs
    assert agent.features == nova.features
    assert agent.guest_downtime == nova.guest_downtime
    # Both hosts run libvirt 11.3: the switchover hint (libvirt 11.1) on either path.
    assert nova.knobs.avail_switchover_mib == agent.knobs.avail_switchover_mib > 0


def test_both_paths_plan_a_split_from_the_agents_background_samples(tmp_path, monkeypatch):
    """With [agent] dirty_sample_refresh on, Nova's driver takes the samplings the
    agent's own plan would: a guest that looks idle now but rewrote ~150 MiB in the
    background samples is planned as the rewriter on both paths."""
    background = [(1.0, 25_000.0), (2.0, 35_000.0), (1.0, 24_000.0), (2.0, 36_000.0)]
    idle_now = Guest(resident_mib=512, dirty_mib_per_s={1: 0.5, 2: 0.4})
    agent = _agent_plan(idle_now, 300, tmp_path, monkeypatch, background=background)
    nova = _nova_plan(idle_now, 300, tmp_path, split_reserved=True, background=background)
    sampled_now = _nova_plan(idle_now, 300, tmp_path, split_reserved=True)
    assert agent.mode == nova.mode == "split", agent.explain()
    assert agent.decision == nova.decision and agent.guest_downtime == nova.guest_downtime
    assert nova.decision.store_faults.off_budget_bytes > 0, nova.explain()
    assert sampled_now.decision.store_faults.off_budget_bytes == 0, sampled_now.explain()


def test_both_paths_refuse_the_same_vm_with_the_same_reasons(tmp_path, monkeypatch):
    anonymous = Guest(file_backed=False)
    with pytest.raises(exceptions.PolicyRefused) as by_agent:
        _agent_plan(anonymous, 400, tmp_path, monkeypatch)
    with pytest.raises(exceptions.PolicyRefused) as by_nova:
        _nova_plan(anonymous, 400, tmp_path, split_reserved=False)
    assert by_agent.value.reasons[0] == by_nova.value.reasons[0]
    assert "not file-backed" in by_agent.value.reasons[1]


@pytest.mark.parametrize(
    ("qemu", "shares", "part"),
    [
        (QEMU_VERSION, True, "destination msync"),  # 10.0.2 msyncs file-backed RAM
        (10_000_013, True, None),  # fixed QEMU: libvirt's fsync named, not counted
        (10_000_013, False, None),  # a current host: nothing to wait for
    ],
)
def test_both_paths_forecast_the_destinations_writeback_the_same(
    tmp_path, monkeypatch, qemu, shares, part
):
    dest = SOFTWARE | {"qemu_version": qemu, "store_shares_libvirt_fs": shares}
    monkeypatch.setattr(AgentClient, "get", lambda self, path, **kw: dict(dest))
    agent = _agent_plan(Guest(), 4096, tmp_path, monkeypatch, dest_facts=dest)
    nova = _nova_plan(Guest(), 4096, tmp_path, split_reserved=False)
    assert agent.guest_downtime == nova.guest_downtime
    parts = agent.guest_downtime.parts_ms
    if part is None:
        assert parts["destination msync"] == 0 and "persist fsync" not in parts
        assert "filesystem of its own" in agent.explain()
        return
    # 200 MiB resident, 40 % left dirty by the flusher, at the probed 500 MiB/s.
    assert parts[part] == pytest.approx(160, abs=1)
    assert f"{part} 160" in nova.explain()


def test_both_paths_forecast_splits_faults_on_the_store_the_same(tmp_path, monkeypatch):
    # A 512 MiB guest rewriting ~150 MiB into a 140 MiB budget: part of its
    # rewritten set lives in the store, each fault a 4 MiB read of 25 ms.
    dest = SOFTWARE | {"store_fault_s": 0.025, "store_shares_libvirt_fs": False}
    monkeypatch.setattr(AgentClient, "get", lambda self, path, **kw: dict(dest))
    guest = Guest(resident_mib=512, dirty_mib_per_s={1: 100.0, 2: 140.0})
    agent = _agent_plan(guest, 300, tmp_path, monkeypatch, dest_facts=dest)
    nova = _nova_plan(guest, 300, tmp_path, split_reserved=True)
    assert agent.mode == nova.mode == "split", agent.explain()
    assert agent.decision == nova.decision and agent.guest_downtime == nova.guest_downtime
    faults = agent.decision.store_faults
    assert faults.fault_s == 0.025 and faults.final_round + faults.first_heartbeat > 0
    spent_ms = (faults.final_round + faults.first_heartbeat) * 25
    assert agent.guest_downtime.parts_ms["store faults"] == pytest.approx(spent_ms)
    assert "reads a 4 MiB window in 25 ms (measured)" in agent.explain()
    assert f"store faults {spent_ms}" in nova.explain()


RECEIVERS = MoverOffer(migration_id="m1", token_salt="s", address="10.250.0.2", ports=(7001,))


@pytest.mark.parametrize(
    ("dest_libvirt", "carried_by", "preempt"),
    [
        (LIBVIRT_VERSION, "qemu-tcp", True),  # libvirt 11.3 turns preempt on: not the mover
        (9_000_000, "mover", False),  # Debian 12's 9.0 does not: the mover carries postcopy
    ],
)
def test_both_paths_leave_the_mover_for_postcopy_where_libvirt_turns_preempt_on(
    tmp_path, monkeypatch, dest_libvirt, carried_by, preempt
):
    # The agent is asked for the mover; Nova's destination already started receivers.
    dest = SOFTWARE | {"libvirt_version": dest_libvirt}
    monkeypatch.setattr(AgentClient, "get", lambda self, path, **kw: dict(dest))
    hot = Guest(file_backed=False, dirty_mib_per_s=HOT)
    agent = _agent_plan(hot, 4096, tmp_path, monkeypatch, dest_facts=dest, transport="mover")
    nova = _nova_plan(hot, 4096, tmp_path, split_reserved=False, mover=RECEIVERS)
    assert agent.mode == nova.mode == "postcopy"
    assert agent.transport == nova.transport
    assert agent.transport.transport == carried_by
    assert agent.knobs.postcopy_preempt is nova.knobs.postcopy_preempt is preempt
    assert agent.guest_downtime == nova.guest_downtime
