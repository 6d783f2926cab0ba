"""Counters read back after a bridge reconnection or a service restart go on."""

import types

from os_ken.ofproto import ofproto_v1_3 as ofp
from os_ken.ofproto import ofproto_v1_3_parser as parser

from ovs_ext import flows, openflow, policy, restore
from ovs_ext.flows import FlowManager
from ovs_ext.providers.base import FlowCounters, FlowMatch

MATCH = FlowMatch("tap0", 17, "10.0.0.1", "10.0.0.2", 4000, 5000)
PORTS = {3: "tap0"}


def stat(cookie, packets, nbytes, instructions=()):
    fields = dict(flows.openflow_match(MATCH, 3))
    return types.SimpleNamespace(
        cookie=cookie, match=fields, packet_count=packets, byte_count=nbytes,
        instructions=instructions,
    )  # fmt: skip


def seen_again(manager):
    return manager.add(
        MATCH, owner="tap0", direction=policy.Direction.EGRESS, out_port=None,
        setup=policy.decide_at_setup(policy.Policy(), MATCH, "tap0", policy.Direction.EGRESS),
    )  # fmt: skip


def test_a_flow_seen_again_goes_on_from_its_rules_and_first_packet():
    rule = openflow.flow_rule(parser, ofp, flows.flow_cookie(9), 3, MATCH, 60)
    found = [
        stat(flows.flow_cookie(9), 10, 600, rule.instructions),
        stat(flows.counting_cookie(), 4, 240),
        stat(flows.discovery_cookie(3), 99, 9900),  # shared by every flow: not this one's
    ]
    manager = FlowManager()
    assert restore.from_rules(manager, found, PORTS.get) == 1
    flow = seen_again(manager)
    flow.packet_in = FlowCounters(1, 60)
    assert flow.total == FlowCounters(16, 960)
    assert manager.restored() == {}  # taken once


def test_rules_of_unknown_ports_restore_nothing():
    manager = FlowManager()
    assert restore.from_rules(manager, [stat(flows.counting_cookie(), 4, 240)], {}.get) == 0
    assert seen_again(manager).total == FlowCounters()


def test_forgotten_flows_keep_their_counters_and_rules_read_back_replace_their_polled_part():
    manager = FlowManager()
    flow = seen_again(manager)
    flow.packet_in, flow.rule = FlowCounters(1, 60), FlowCounters(5, 300)  # in the rules
    flow.offload_done, flow.carried_onloaded = FlowCounters(7, 420), FlowCounters(2, 120)
    manager.forget(MATCH)
    restore.from_forgotten(manager, [flow])
    manager.restore(MATCH, offloaded=FlowCounters(3, 180))  # a pinned entry, too
    # The rules survived the reconnection and counted 2 more since the last poll.
    rule = openflow.flow_rule(parser, ofp, flows.flow_cookie(1), 3, MATCH, 60)
    restore.from_rules(manager, [stat(flows.flow_cookie(1), 7, 420, rule.instructions)], PORTS.get)
    again = seen_again(manager)
    assert again.onloaded_counters == FlowCounters(2 + 8, 120 + 480)
    assert again.offloaded_counters == FlowCounters(10, 600)


def test_rules_flushed_by_the_reconnection_leave_the_polled_part():
    manager = FlowManager()
    flow = seen_again(manager)
    flow.packet_in, flow.learned = FlowCounters(1, 60), FlowCounters(4, 240)
    manager.forget(MATCH)
    restore.from_forgotten(manager, [flow])
    restore.from_rules(manager, [], PORTS.get)
    assert seen_again(manager).total == FlowCounters(5, 300)
