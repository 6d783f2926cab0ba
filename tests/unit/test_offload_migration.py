"""A VM's flows across a live migration, between two simulated hosts.

Each host is the control-plane simulation of test_offload_control (fake fast
path, OpenFlow rule counters); packets are sent on whichever host the VM is
on, so the tests know exactly how many went where and can check that the
destination's totals are source + destination, never more.
"""

import dataclasses

import pytest

from flexmig import exceptions
from ovs_ext import migration
from ovs_ext.flows import FlowState
from ovs_ext.providers.base import FlowCounters
from tests.unit.test_offload_control import SIZE, Sim, flow, stats_policy


def two_hosts(capacity=16):
    return Sim(stats_policy(capacity=capacity)), Sim(stats_policy(capacity=capacity))


def offloaded_on(sim, m, pps=5000):
    sim.start(m, "phy0")
    for _ in range(3):
        sim.tick({m: pps})
    assert sim.control.flows.get(m).state is FlowState.OFFLOADED
    return sim.control.flows.get(m)


def wire(records):
    """Across the network: the JSON shape, parsed back."""
    return [migration.FlowTransfer.from_wire(r.to_wire()) for r in records]


def migrate(src, dst, matches, pps=5000, mid="m1"):
    """Depart, arrive, a few polls of traffic on the source during the copy,
    resume on the destination, traffic there, finish and settle."""
    src_mig, dst_mig = migration.FlowMigrations(src.control), migration.FlowMigrations(dst.control)
    records = src_mig.depart(mid, ["tap0"], "hostB")
    dst_mig.arrive(mid, ["tap0"], "hostA", wire(records))
    for _ in range(3):
        src.tick({m: pps for m in matches})  # the copy: the VM still runs on the source
    dst_mig.resume(mid)
    for m in matches:
        dst.sent[m] = src.sent[m]  # the sender's count goes on
        dst.start(m, "phy0")  # first packet here: rule, egress port, re-offload
    for _ in range(3):
        dst.tick({m: pps for m in matches})
    final, gone = src_mig.finish(mid)
    dst_mig.settle(mid, wire(final))
    return src_mig, dst_mig, gone


def test_offloaded_flow_follows_its_vm_and_counts_continue():
    src, dst = two_hosts()
    m = flow(1)
    offloaded_on(src, m)
    _, dst_mig, gone = migrate(src, dst, [m])
    arrived = dst.control.flows.get(m)
    assert arrived.state is FlowState.OFFLOADED
    assert "re-offloaded after migration" in arrived.reason and "hostA" in arrived.reason
    # Every packet sent, counted once: the source forgot the flow.
    assert src.control.flows.get(m) is None and [f.match for f in gone] == [m]
    assert arrived.total == FlowCounters(dst.sent[m], dst.sent[m] * SIZE)
    assert m not in src.provider.entries and m in dst.provider.entries
    mig = dst_mig.by_id["m1"].as_dict()
    assert mig["state"] == "settled" and len(mig["reoffloaded"]) == 1


def test_source_demotes_before_switchover_and_holds_the_flow_onloaded():
    src, dst = two_hosts()
    m = flow(1)
    tracked = offloaded_on(src, m)
    offloaded_before = tracked.offloaded_counters
    records = migration.FlowMigrations(src.control).depart("m1", ["tap0"], "hostB")
    assert tracked.state is FlowState.ONLOADED and m not in src.provider.entries
    assert tracked.offloaded_counters == offloaded_before  # carried, not lost
    assert records[0].was_offloaded and records[0].total == tracked.total
    for _ in range(10):  # an elephant: statistics would promote it, the hold wins
        report = src.tick({m: 50000})
        assert not report.promoted
    assert tracked.held.startswith("migrating to hostB")


def test_failed_migration_reoffloads_on_the_source_with_the_reason():
    src, dst = two_hosts()
    m, quiet = flow(1), flow(2)
    offloaded_on(src, m)
    src.start(quiet, "phy0")
    src_mig, dst_mig = migration.FlowMigrations(src.control), migration.FlowMigrations(dst.control)
    records = src_mig.depart("m1", ["tap0"], "hostB")
    dst_mig.arrive("m1", ["tap0"], "hostA", wire(records))
    src.tick({m: 5000, quiet: 10})
    src_mig.restore("m1", "libvirt: domain crashed")
    gone = dst_mig.abandon("m1", "libvirt: domain crashed")
    tracked = src.control.flows.get(m)
    assert tracked.state is FlowState.OFFLOADED and m in src.provider.entries
    assert "migration to hostB failed: libvirt: domain crashed" in tracked.reason
    assert src.control.flows.get(quiet).state is FlowState.ONLOADED  # as it was
    assert {f.match for f in gone} == {m, quiet} and dst.control.flows.get(m) is None
    src.tick({m: 5000, quiet: 10})
    assert tracked.total.packets == src.sent[m]
    status = src.control.status()["migrations"][0]
    assert status["state"] == "restored" and "domain crashed" in status["reason"]


def test_destination_policy_and_capacity_decide_the_reoffload():
    src, dst = Sim(stats_policy(capacity=4)), Sim(stats_policy(capacity=1))
    a, b = flow(1), flow(2)
    offloaded_on(src, a)
    offloaded_on(src, b)
    dst.sent.update(src.sent)
    dst_mig = migration.FlowMigrations(dst.control)
    records = migration.FlowMigrations(src.control).depart("m1", ["tap0"], "hostB")
    dst_mig.arrive("m1", ["tap0"], "hostA", wire(records))
    dst_mig.resume("m1")
    dst.start(a, "phy0")
    dst.start(b, "phy0")
    states = sorted(dst.control.flows.get(x).state.value for x in (a, b))
    assert states == ["offloaded", "onloaded"]
    refused = next(dst.control.flows.get(x) for x in (a, b) if x not in dst.provider.entries)
    assert refused.reason.startswith("offload refused")


def test_arrived_flow_is_judged_before_its_first_packet_and_not_offloaded_before_resume():
    src, dst = two_hosts()
    m = flow(1)
    offloaded_on(src, m)
    records = migration.FlowMigrations(src.control).depart("m1", ["tap0"], "hostB")
    migration.FlowMigrations(dst.control).arrive("m1", ["tap0"], "hostA", wire(records))
    arrived = dst.control.flows.get(m)
    assert arrived.total == records[0].total and arrived.reoffload
    flow_obj, new = dst.control.flow_seen(m, "phy0")
    assert new  # the app installs its rule on the first packet
    assert flow_obj.state is FlowState.ONLOADED  # still held: the VM has not resumed
    assert dst.control.flow_seen(m, "phy0")[1] is False


def test_counters_never_exceed_what_was_sent_with_a_late_final():
    """The destination's carried counters are replaced by the final ones, not added."""
    src, dst = two_hosts()
    m = flow(1)
    offloaded_on(src, m)
    migrate(src, dst, [m])
    total = dst.control.flows.get(m).total.packets
    assert total == dst.sent[m]


@pytest.mark.parametrize(
    "bad",
    [
        {"v": 2},
        {"match": {"in_port": "tap0", "ip_proto": 1}},
        {"onloaded": [-1, 0]},
        {"offloaded": [1]},
        {"direction": "sideways"},
        {"moves": "many"},
    ],
)
def test_malformed_records_are_refused_whole(bad):
    src, dst = two_hosts()
    offloaded_on(src, flow(1))
    good = migration.FlowMigrations(src.control).depart("m1", ["tap0"], "b")[0].to_wire()
    broken = good | bad
    if "match" in bad:
        broken["match"] = good["match"] | bad["match"]
    with pytest.raises(exceptions.InvalidInput):
        migration.FlowTransfer.from_wire(broken)
    assert len(dst.control.flows) == 0


def test_records_of_another_port_are_refused_and_nothing_arrives():
    src, dst = two_hosts()
    offloaded_on(src, flow(1))
    records = migration.FlowMigrations(src.control).depart("m1", ["tap0"], "b")
    with pytest.raises(exceptions.InvalidInput):
        migration.FlowMigrations(dst.control).arrive("m1", ["tap7"], "a", wire(records))
    assert len(dst.control.flows) == 0


def test_a_migration_cannot_depart_twice():
    src, _ = two_hosts()
    offloaded_on(src, flow(1))
    migs = migration.FlowMigrations(src.control)
    migs.depart("m1", ["tap0"], "b")
    with pytest.raises(exceptions.InvalidInput):
        migs.depart("m1", ["tap0"], "b")


def test_a_flow_from_another_local_port_stays_with_its_sender():
    src, dst = two_hosts()
    own, from_uplink, from_local = flow(1), flow(2, port="phy0"), flow(3, port="ep-a")
    offloaded_on(src, own)
    src.start(from_uplink, "tap0")
    src.start(from_local, "tap0")
    records = migration.FlowMigrations(src.control).depart("m1", ["tap0"], "hostB")
    assert {r.match for r in records} == {own, from_uplink}
    assert src.control.flows.get(from_local).held == ""


def test_records_in_parts_arrive_whole_and_a_bad_part_changes_nothing():
    src, dst = two_hosts()
    matches = [flow(n) for n in range(4)]
    for m in matches:
        src.start(m, "phy0")
    for _ in range(3):
        src.tick({m: 5000 for m in matches})
    records = wire(migration.FlowMigrations(src.control).depart("m1", ["tap0"], "b"))
    dst_mig = migration.FlowMigrations(dst.control)
    dst_mig.arrive("m1", ["tap0"], "a", records[:1])
    foreign = dataclasses.replace(records[1], match=flow(9, port="tap7"), owner="tap7")
    with pytest.raises(exceptions.InvalidInput, match="not the VM's"):
        dst_mig.add_records("m1", [records[1], foreign])  # refused whole
    assert len(dst.control.flows) == 1
    dst_mig.add_records("m1", records[1:])
    assert len(dst_mig.get("m1", migration.Role.DESTINATION).flows) == 4
    mig = dst_mig.get("m1", migration.Role.DESTINATION)
    assert mig.was_offloaded == set(matches)
    assert all(dst.control.flows.get(m).reoffload for m in matches)
    dst_mig.resume("m1")
    with pytest.raises(exceptions.InvalidInput, match="resumed"):  # parts come before resume
        dst_mig.add_records("m1", records[:1])


def test_kept_counters_of_a_vm_flow_not_seen_again_move_with_the_vm():
    """After a restart of the source's service a quiet flow is only kept counters
    (no rule, not tracked); a migration before its next packet takes them along:
    the destination goes on from them and the source shows the flow no more."""
    src, dst = two_hosts()
    quiet, other_port = flow(1), flow(2, port="tap9")
    src.control.flows.restore(quiet, onloaded=FlowCounters(40, 40 * SIZE),
                              offloaded=FlowCounters(60, 60 * SIZE))  # fmt: skip
    src.control.flows.restore(other_port, onloaded=FlowCounters(5, 5 * SIZE))
    src_mig, dst_mig = migration.FlowMigrations(src.control), migration.FlowMigrations(dst.control)
    records = src_mig.depart("m1", ["tap0"], "hostB")
    assert [(r.match, r.total.packets, r.direction) for r in records] == [(quiet, 100, "egress")]
    dst_mig.arrive("m1", ["tap0"], "hostA", wire(records))
    dst_mig.resume("m1")
    dst.sent[quiet] = 100
    dst.start(quiet, "phy0")
    for _ in range(2):
        dst.tick({quiet: 200})
    final, _ = src_mig.finish("m1")
    dst_mig.settle("m1", wire(final))
    arrived = dst.control.flows.get(quiet)
    assert arrived.total == FlowCounters(dst.sent[quiet], dst.sent[quiet] * SIZE)
    assert quiet not in src.control.flows.kept_entering_by(["tap0"])
    assert src.control.flows.kept_entering_by(["tap9"])  # another VM's stays here
    # The source's dump lists the other VM's kept flow, no longer the one that left.
    shown = src.control.flows.records({"tap0": 3, "tap9": 9}.get)
    assert [r.match["in_port"] for r in shown] == [9]


def departing_with_kept(packets):
    """A source whose VM departs with one kept flow of ``packets`` (not seen again)."""
    src, _ = two_hosts()
    quiet = flow(1)
    src.control.flows.restore(quiet, onloaded=FlowCounters(packets, packets * SIZE))
    src_mig = migration.FlowMigrations(src.control)
    src_mig.depart("m1", ["tap0"], "hostB")
    return src, src_mig, quiet


def test_a_kept_flow_seen_again_during_the_migration_leaves_with_its_counters():
    src, src_mig, quiet = departing_with_kept(30)
    src.sent[quiet] = 30
    src.start(quiet, "phy0")  # the VM still runs on the source: the flow is back
    src.tick({quiet: 100})
    final, gone = src_mig.finish("m1")
    assert [(r.match, r.total.packets) for r in final] == [(quiet, src.sent[quiet])]
    assert [f.match for f in gone] == [quiet] and src.control.flows.get(quiet) is None
    assert not src.control.flows.kept_entering_by(["tap0"])


def test_a_failed_migration_leaves_kept_counters_where_they_were():
    src, src_mig, quiet = departing_with_kept(7)
    src_mig.restore("m1", "libvirt failed")
    assert src.control.flows.kept_entering_by(["tap0"]) == {
        quiet: (FlowCounters(7, 7 * SIZE), FlowCounters())
    }
