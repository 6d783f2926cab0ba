"""SR-IOV failover pairs: the domain XML libvirt gets and the records' re-keying."""

import dataclasses
import xml.etree.ElementTree as ET

import pytest

from flexmig import exceptions
from ovs_ext.migration import FlowTransfer
from ovs_ext.providers.base import FlowCounters, FlowMatch
from ovs_ext.providers.tc_flower import failover

PAIR = failover.FailoverPair("0000:3b:02.1", "pf0vf1", "tap4", "52:54:00:aa:bb:01")


def test_standby_is_a_persistent_virtio_team_member_on_the_bridge():
    iface = ET.fromstring(failover.standby_interface_xml(PAIR))
    assert iface.get("type") == "bridge"
    assert iface.find("model").get("type") == "virtio"
    assert iface.find("teaming").get("type") == "persistent"
    assert iface.find("alias").get("name") == "ua-standby0"
    assert iface.find("target").get("dev") == "tap4"
    assert iface.find("mac").get("address") == PAIR.mac


def test_primary_is_the_vf_paired_with_the_standby_by_alias_and_mac():
    iface = ET.fromstring(failover.primary_interface_xml(PAIR))
    assert iface.get("type") == "hostdev" and iface.get("managed") == "yes"
    teaming = iface.find("teaming")
    assert (teaming.get("type"), teaming.get("persistent")) == ("transient", "ua-standby0")
    addr = iface.find("source/address")
    assert (addr.get("domain"), addr.get("bus"), addr.get("slot"), addr.get("function")) == (
        "0x0000", "0x3b", "0x02", "0x1",
    )  # fmt: skip
    assert iface.find("mac").get("address") == PAIR.mac


@pytest.mark.parametrize(
    "field, value",
    [("vf_pci", "3b:02.1"), ("mac", "52:54:00:aa:bb"), ("standby_port", "tap4'/><x"),
     ("vf_representor", ""), ("standby_alias", "standby0")],
)  # fmt: skip
def test_bad_pairs_are_refused(field, value):
    args = {"vf_pci": "0000:3b:02.1", "vf_representor": "pf0vf1", "standby_port": "tap4",
            "mac": "52:54:00:aa:bb:01"} | {field: value}  # fmt: skip
    with pytest.raises(exceptions.InvalidInput):
        failover.FailoverPair(**args)


def record(in_port, owner, direction="egress"):
    match = FlowMatch(in_port, 17, "10.0.0.1", "10.0.0.2", 4000, 7001)
    return FlowTransfer(match, owner, direction, True, "r", FlowCounters(5, 500),
                        FlowCounters(90, 9000), 1, 1.0)  # fmt: skip


def test_rekey_moves_the_vf_flows_to_the_standby_and_keeps_their_counters():
    egress, ingress, other = (
        record("pf0vf1", "pf0vf1"),
        record("phy0", "pf0vf1", "ingress"),
        (record("tap9", "tap9")),
    )
    out = failover.rekey([egress, ingress, other], "pf0vf1", "tap4")
    assert out[0].match.in_port == "tap4" and out[0].owner == "tap4"
    assert out[1].match.in_port == "phy0" and out[1].owner == "tap4"
    assert out[2] == other
    assert [r.total for r in out] == [r.total for r in (egress, ingress, other)]
    back = failover.rekey(out, "tap4", "pf0vf7")
    assert back[0].match.in_port == "pf0vf7"


def test_steps_name_both_vfs_in_order():
    steps = failover.migration_steps(PAIR, "0000:5e:00.3", "pf1vf3")
    assert steps[0].startswith("demote") and "pf0vf1" in steps[0]
    assert "0000:3b:02.1" in steps[2] and "0000:5e:00.3" in steps[4] and "pf1vf3" in steps[5]


# -- the extension's side: a migration's flows re-keyed between NICs ----------------
def rep_sim():
    from tests.unit.test_offload_control import Sim, stats_policy

    return Sim(stats_policy(), 16, (r"tap\d+", r"pf\d+vf\d+"), ("tap4", "pf0vf1", "pf1vf3"))


def test_a_vf_flow_goes_to_the_standby_and_on_to_the_next_vf_with_every_packet_counted():
    from ovs_ext import migration
    from ovs_ext.flows import FlowState

    src, dst = rep_sim(), rep_sim()
    vf = FlowMatch("pf0vf1", 17, "10.0.0.1", "10.0.0.2", 4000, 7001)
    src.start(vf, "phy0")
    for _ in range(3):
        src.tick({vf: 5000})
    assert src.control.flows.get(vf).state is FlowState.OFFLOADED
    s_mig, d_mig = migration.FlowMigrations(src.control), migration.FlowMigrations(dst.control)
    s_mig.depart("m", ["tap4", "pf0vf1"], "hostB")
    gone = s_mig.rekey("m", "pf0vf1", "tap4")
    standby = dataclasses.replace(vf, in_port="tap4")
    assert [f.match for f in gone] == [vf] and src.control.flows.get(vf) is None
    held = src.control.flows.get(standby)
    assert held.state is FlowState.ONLOADED and held.held and held.out_port == "phy0"
    assert held.total.packets == src.sent[vf]
    d_mig.arrive("m", ["tap4"], "hostA", s_mig.records("m"))
    d_mig.rekey("m", "tap4", "pf1vf3")
    # While the VF is unplugged the guest's packets enter by the standby, counted
    # there after the records left: only the final counters bring them.
    src.sent[standby] = src.sent[vf]
    src.start(standby, "phy0")
    src.tick({standby: 2000})
    d_mig.resume("m")
    final, _ = s_mig.finish("m")
    d_mig.settle("m", final)  # still keyed by the standby: the destination renames them
    there = dst.control.flows.get(dataclasses.replace(vf, in_port="pf1vf3"))
    assert there.owner == "pf1vf3" and there.reoffload
    assert there.total.packets == src.sent[standby]  # every packet, once
    assert dst.control.flows.get(standby) is None


def test_rekey_outside_a_departing_or_arriving_migration_is_refused_and_changes_nothing():
    from ovs_ext import migration

    sim = rep_sim()
    vf = FlowMatch("pf0vf1", 17, "10.0.0.1", "10.0.0.2", 4000, 7001)
    sim.start(vf, "phy0")
    flows = migration.FlowMigrations(sim.control)
    with pytest.raises(exceptions.InvalidInput):
        flows.rekey("nope", "pf0vf1", "tap4")
    flows.depart("m", ["pf0vf1"], "hostB")
    flows.finish("m")
    with pytest.raises(exceptions.InvalidInput):
        flows.rekey("m", "pf0vf1", "tap4")
    assert sim.control.flows.get(dataclasses.replace(vf, in_port="tap4")) is None
