"""Counters read back after a bridge reconnection or a service restart go on."""

import dataclasses
import json
import types

import pytest
from os_ken.ofproto import ofproto_v1_3 as ofp
from os_ken.ofproto import ofproto_v1_3_parser as parser

from ovs_ext import flows, openflow, policy, restore, service
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


# -- a clean stop: the counters file ---------------------------------------------------
OTHER = FlowMatch("tap0", 17, "10.0.0.1", "10.0.0.2", 4001, 5000)
UNSEEN = FlowMatch("tap0", 6, "10.0.0.1", "10.0.0.3", 4002, 80)


def test_a_clean_stop_keeps_every_flow_and_the_next_start_goes_on_from_there():
    manager = FlowManager()
    manager.restore(UNSEEN, onloaded=FlowCounters(4, 400))  # an earlier run's, not seen since
    onloaded = seen_again(manager)  # still tracked at the stop; its rule counted on since
    onloaded.packet_in, onloaded.rule = FlowCounters(1, 60), FlowCounters(5, 300)
    offloaded = manager.add(
        OTHER, owner="tap0", direction=policy.Direction.EGRESS, out_port=None,
        setup=policy.decide_at_setup(policy.Policy(), OTHER, "tap0", policy.Direction.EGRESS),
    )  # fmt: skip
    offloaded.packet_in, offloaded.offload_done = FlowCounters(1, 60), FlowCounters(90, 5400)
    gone = [manager.forget(OTHER)]  # the stop detached its port's fast path
    rule = openflow.flow_rule(parser, ofp, flows.flow_cookie(onloaded.flow_id), 3, MATCH, 60)
    final_read = [stat(flows.flow_cookie(onloaded.flow_id), 7, 420, rule.instructions)]

    doc = restore.counters_document(restore.kept_at_stop(manager, gone, final_read, PORTS.get))
    next_run = FlowManager()
    assert restore.from_document(next_run, json.loads(json.dumps(doc))) == 3
    again = seen_again(next_run)
    assert again.total == FlowCounters(1 + 7, 60 + 420)  # the final read, not the poll's 5
    restored = next_run.restored()
    assert restored[OTHER][0] + restored[OTHER][1] + restored[OTHER][2] == FlowCounters(91, 5460)
    assert restored[UNSEEN][1] == FlowCounters(4, 400)


@pytest.mark.parametrize(
    "doc",
    [
        [],
        {"version": 2, "flows": []},
        {"version": 1, "flows": {}},
        {"version": 1, "flows": [{"match": {"in_port": "tap0"}}]},
        {"version": 1, "flows": [{"match": dataclasses.asdict(MATCH), "ruled": [1, 60],
                                  "onloaded": [-1, 0], "offloaded": [0, 0]}]},
        {"version": 1, "flows": [{"match": dataclasses.asdict(MATCH), "ruled": [True, 60],
                                  "onloaded": [0, 0], "offloaded": [0, 0]}]},
        {"version": 1, "flows": [{"match": {**dataclasses.asdict(MATCH), "ip_proto": 1},
                                  "ruled": [1, 60], "onloaded": [0, 0], "offloaded": [0, 0]}]},
    ],
)  # fmt: skip
def test_a_malformed_counters_file_restores_nothing(doc):
    good = {"match": dataclasses.asdict(OTHER), "ruled": [1, 60], "onloaded": [0, 0],
            "offloaded": [0, 0]}  # fmt: skip
    if isinstance(doc, dict) and isinstance(doc.get("flows"), list):
        doc["flows"].insert(0, good)  # a good entry before the bad one is not restored either
    manager = FlowManager()
    with pytest.raises(ValueError):
        restore.from_document(manager, doc)
    assert manager.restored() == {}


def test_the_service_takes_the_kept_counters_once_and_sets_a_bad_file_aside(tmp_path):
    control = types.SimpleNamespace(flows=FlowManager())
    path = tmp_path / "counters.json"
    kept = {MATCH: (FlowCounters(2, 120), FlowCounters(), FlowCounters(3, 180))}
    path.write_text(json.dumps(restore.counters_document(kept)))
    assert service.take_kept_counters(control, str(path)) == 1
    assert not path.exists()  # once: a later crash restart must not add them again
    assert service.take_kept_counters(control, str(path)) == 0
    assert seen_again(control.flows).total == FlowCounters(5, 300)
    path.write_text("{not json")
    assert service.take_kept_counters(control, str(path)) == 0
    assert (tmp_path / "counters.json.rejected").read_text() == "{not json"
    assert not path.exists()


def test_kept_flows_are_shown_right_after_a_restart_until_seen_again():
    """A dump right after the restart lists every kept flow with what it counted
    (a quiet flow may never be seen again); seen again, it keeps its cookie and
    is listed once, its counters going on from there."""
    next_run = FlowManager()
    next_run.restore(MATCH, ruled=FlowCounters(227, 13620))
    next_run.restore(OTHER, onloaded=FlowCounters(1, 60), offloaded=FlowCounters(90, 5400))
    next_run.restore(UNSEEN, onloaded=FlowCounters(4, 400))
    ports = {"tap0": 3}.get
    shown = {(r.table_id, r.match["udp_src"]): r for r in next_run.records(ports)
             if "udp_src" in r.match}  # fmt: skip
    assert shown[(0, 4000)].packets == 227 and shown[(0, 4000)].bytes == 13620
    assert shown[(0, 4001)].packets == 91 and shown[(200, 4001)].packets == 90
    assert (200, 4000) not in shown and not shown[(0, 4001)].offloaded
    assert [r.packets for r in next_run.records(ports) if r.match.get("tcp_dst") == 80] == [4]
    kept_cookie = shown[(0, 4000)].cookie
    again = seen_again(next_run)
    again.packet_in = FlowCounters(1, 60)
    mine = [r for r in next_run.records(ports) if r.match.get("udp_src") == 4000]
    assert [(r.table_id, r.packets, r.cookie) for r in mine] == [(0, 228, kept_cookie)]
    assert next_run.records({}.get) == []  # ports gone: nothing to show them under


def test_kept_counters_no_flow_claims_are_forgotten_after_the_idle_timeout():
    now = [100.0]
    manager = FlowManager(clock=lambda: now[0])
    manager.restore(MATCH, ruled=FlowCounters(5, 300))
    now[0] += 299.0
    assert manager.expire_kept(300.0) == [] and len(manager.records({"tap0": 3}.get)) == 1
    now[0] += 2.0
    assert manager.expire_kept(300.0) == [MATCH]
    assert manager.records({"tap0": 3}.get) == [] and manager.restored() == {}
    assert seen_again(manager).total == FlowCounters()  # a new flow, counted from 0
