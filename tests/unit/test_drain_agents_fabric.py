"""The drain's fabric from the links a source agent reports (flexmig.drain_agents)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from agents.agent.link_estimate import LinkEstimate
from flexmig import drain_agents

MIB = 2**20
FIRST_GUESS = 256 * MIB


def job(bps_mib: int, processed_mib: int, elapsed_ms: int, downtime_ms: int) -> dict[str, int]:
    return {
        "memory_bps": bps_mib * MIB,
        "memory_processed": processed_mib * MIB,
        "time_elapsed": elapsed_ms,
        "downtime": downtime_ms,
    }


def reported(link: LinkEstimate, fabric_mib: int = 1000) -> dict:
    """The link as the agent's inventory answers it: its estimate's fields, through JSON."""
    link.fabric_bps = fabric_mib * MIB
    return json.loads(json.dumps(dataclasses.asdict(link)))


def capped() -> LinkEstimate:
    """A destination reached only under a bandwidth cap: 2 s setup, 60 ms switchover."""
    link = LinkEstimate()
    link.learn(job(100, 300, 5060, 60), cap_bps=100 * MIB)
    return link


def test_a_capped_hosts_learnt_setup_and_switchover_count_without_a_rate():
    fabric = drain_agents.fabric_from({"b": reported(capped())}, FIRST_GUESS)
    assert fabric.setup_s == pytest.approx(2.0 + drain_agents.AGENT_OVERHEAD_S)
    assert fabric.switchover_s == pytest.approx(0.06)
    assert fabric.stream_bps == FIRST_GUESS  # the cap's rate is not the link's


def test_links_never_learnt_do_not_dilute_the_learnt_timings():
    links = {"b": reported(capped()), "c": reported(LinkEstimate())}
    fabric = drain_agents.fabric_from(links, FIRST_GUESS)
    assert fabric.setup_s == pytest.approx(2.0 + drain_agents.AGENT_OVERHEAD_S)
    assert fabric.switchover_s == pytest.approx(0.06)


def test_capped_and_uncapped_hosts_timings_are_averaged_and_only_the_uncapped_rate_kept():
    uncapped = LinkEstimate()
    uncapped.learn(job(200, 400, 3040, 40))  # 2 s of transfer, 1 s setup, 40 ms switchover
    fabric = drain_agents.fabric_from({"b": reported(capped()), "c": reported(uncapped)}, 0)
    assert fabric.setup_s == pytest.approx(1.5 + drain_agents.AGENT_OVERHEAD_S)
    assert fabric.switchover_s == pytest.approx(0.05)
    assert fabric.stream_bps == 200 * MIB


def test_without_learnt_timings_the_defaults_stand():
    fabric = drain_agents.fabric_from({"b": reported(LinkEstimate())}, FIRST_GUESS)
    assert fabric.setup_s == pytest.approx(0.5 + drain_agents.AGENT_OVERHEAD_S)
    assert fabric.switchover_s == pytest.approx(0.05)


def test_an_older_agents_link_without_the_count_learnt_its_timings_with_its_rate():
    old = {"fabric_bps": 1000 * MIB, "stream_bps": 150 * MIB, "setup_s": 3.0, "switchover_s": 0.1}
    fabric = drain_agents.fabric_from({"b": old}, FIRST_GUESS)
    assert fabric.setup_s == pytest.approx(3.0 + drain_agents.AGENT_OVERHEAD_S)
    assert fabric.stream_bps == 150 * MIB


def test_a_learnt_switchover_is_known_as_such_by_the_drain():
    assert drain_agents.fabric_from({"b": reported(capped())}, FIRST_GUESS).switchover_learned
    never = drain_agents.fabric_from({"b": reported(LinkEstimate())}, FIRST_GUESS)
    assert not never.switchover_learned


def test_a_drains_plan_does_not_add_the_resume_to_a_learnt_switchover():
    """libvirt's downtime, which the switchover was learnt from, ends with the guest
    running: a drain counting the finish and resume again overstated every gap."""
    from flexmig.policy import drain
    from flexmig.policy.dirty_model import DirtyModel

    vm = drain.DrainVM.sized("vm0", 256 * MIB, 64 * MIB, DirtyModel(0, 1), True)
    hosts = [drain.Candidate("B", 2048 * MIB, 0)]
    parts = {}
    for learnt in (False, True):
        fabric = drain.Fabric(100 * MIB, 100 * MIB, switchover_s=0.06, switchover_learned=learnt)
        move = drain.plan("A", [vm], hosts, fabric).moves[0]
        parts[learnt] = move.plan.guest_downtime.parts_ms
    assert parts[False]["device state"] == pytest.approx(60)
    assert parts[False]["finish and resume"] > 0
    assert parts[True]["device state, finish and resume"] == pytest.approx(60)
    assert "finish and resume" not in parts[True] or parts[True]["finish and resume"] == 0
