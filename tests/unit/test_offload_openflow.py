"""Golden tests of the OpenFlow 1.3 rules the offload app owns, and packet parsing."""

import types

import pytest
from os_ken.ofproto import ofproto_v1_3 as ofp
from os_ken.ofproto import ofproto_v1_3_parser as parser

from ovs_ext import flows, openflow
from ovs_ext.providers.base import FlowCounters, FlowMatch

DATAPATH = types.SimpleNamespace(ofproto=ofp, ofproto_parser=parser)


def golden(msg):
    """What a rule says, in the terms ovs-ofctl prints, from the serialised bytes."""
    msg.datapath = DATAPATH
    msg.serialize()
    parsed = parser.OFPFlowMod.parser(DATAPATH, ofp.OFP_VERSION, ofp.OFPT_FLOW_MOD, len(msg.buf),
                                      0, bytes(msg.buf))  # fmt: skip
    actions = [_action(a) for inst in parsed.instructions for a in inst.actions]
    return {
        "cookie": hex(parsed.cookie),
        "command": parsed.command,
        "priority": parsed.priority,
        "match": dict(parsed.match.items()),
        "actions": actions,
    }


def _action(action):
    if isinstance(action, parser.NXActionLearn):
        return ("learn", action.table_id, action.priority, hex(action.cookie),
                action.idle_timeout, [_spec(s) for s in action.specs])  # fmt: skip
    if isinstance(action, parser.NXActionResubmitTable):
        return ("resubmit", action.table_id)
    if isinstance(action, parser.NXActionNote):
        return ("note", bytes(action.note))
    return (action.port, action.max_len)


def _spec(spec):
    return (spec.src, spec.dst, spec.n_bits)


def _counting_learn(proto, l4):
    copy = [(f, 0) for f in ("in_port", "ipv4_src", "ipv4_dst", f"{l4}_src", f"{l4}_dst")]
    specs = [
        (copy[0], copy[0], 32), (0x800, ("eth_type", 0), 16), (proto, ("ip_proto", 0), 8),
        (copy[1], copy[1], 32), (copy[2], copy[2], 32), (copy[3], copy[3], 16),
        (copy[4], copy[4], 16),
    ]  # fmt: skip
    return ("learn", flows.COUNTING_TABLE, 100, "0xf1e0040000000000",
            openflow.COUNTING_IDLE_TIMEOUT, specs)  # fmt: skip


def _judged_learn(proto, l4):
    specs = _counting_learn(proto, l4)[5]
    return ("learn", flows.JUDGED_TABLE, 100, "0xf1e0050000000000", 0, specs)


def test_discovery_rules_switch_tcp_udp_count_them_per_flow_and_copy_the_app():
    rules = [golden(m) for m in openflow.discovery_rules(parser, ofp, 7)]
    # Each new TCP/UDP flow: its exact counting rule and its judged mark learnt,
    # the counting rule traversed, switched NORMAL by the bridge, then the judged
    # table (which copies the headers to the app unless the mark is there).
    assert rules == [
        {"cookie": "0xf1e0020000000007", "command": ofp.OFPFC_ADD, "priority": 10,
         "match": {"in_port": 7, "eth_type": 0x800, "ip_proto": 6},
         "actions": [_counting_learn(6, "tcp"), _judged_learn(6, "tcp"),
                     ("resubmit", flows.COUNTING_TABLE), (ofp.OFPP_NORMAL, ofp.OFPCML_MAX),
                     ("resubmit", flows.JUDGED_TABLE)]},
        {"cookie": "0xf1e0020000000007", "command": ofp.OFPFC_ADD, "priority": 10,
         "match": {"in_port": 7, "eth_type": 0x800, "ip_proto": 17},
         "actions": [_counting_learn(17, "udp"), _judged_learn(17, "udp"),
                     ("resubmit", flows.COUNTING_TABLE), (ofp.OFPP_NORMAL, ofp.OFPCML_MAX),
                     ("resubmit", flows.JUDGED_TABLE)]},
        {"cookie": "0xf1e0020000000007", "command": ofp.OFPFC_ADD, "priority": 10,
         "match": {"in_port": 7, "eth_type": 0x806},
         "actions": [(ofp.OFPP_CONTROLLER, 64), (ofp.OFPP_NORMAL, ofp.OFPCML_MAX)]},
    ]  # fmt: skip


def test_the_judged_mark_holds_copies_back_for_a_while_and_the_miss_copies():
    mark = openflow.judged_learn(parser, 6)
    assert (mark.hard_timeout, mark.idle_timeout) == (openflow.JUDGED_HOLD_S, 0)
    miss = openflow.judged_miss_rule(parser, ofp)
    assert miss.table_id == flows.JUDGED_TABLE
    assert (golden(miss)["priority"], golden(miss)["match"], golden(miss)["actions"]) == (
        0, {}, [(ofp.OFPP_CONTROLLER, openflow.JUDGE_MAX_LEN)]
    )  # fmt: skip
    # Marks and the miss rule are not counting rules: a poll never reads them as counts.
    assert not flows.is_counting_cookie(flows.judged_cookie())
    assert flows.cookie_flow_id(flows.judged_cookie()) is None


def test_flow_rule_matches_the_five_tuple_and_switches_normal():
    match = FlowMatch("tap0", 6, "10.251.0.10", "10.251.0.20", 40000, 5201)
    rule = golden(openflow.flow_rule(parser, ofp, flows.flow_cookie(42), 3, match, 1514))
    assert rule["cookie"] == "0xf1e001000000002a" and rule["priority"] == 100
    assert rule["match"] == {
        "in_port": 3, "eth_type": 0x800, "ip_proto": 6, "ipv4_src": "10.251.0.10",
        "ipv4_dst": "10.251.0.20", "tcp_src": 40000, "tcp_dst": 5201,
    }  # fmt: skip
    # The note (padded to 6 bytes on the wire) records the first packet's length.
    assert rule["actions"] == [
        ("note", bytes.fromhex("000005ea0000")), (ofp.OFPP_NORMAL, ofp.OFPCML_MAX)
    ]  # fmt: skip


def test_the_first_packet_is_read_back_from_a_flow_rule_note():
    match = FlowMatch("tap0", 17, "10.251.0.10", "10.251.0.20", 40000, 5201)
    msg = openflow.flow_rule(parser, ofp, flows.flow_cookie(7), 3, match, 60)
    msg.datapath = DATAPATH
    msg.serialize()
    parsed = parser.OFPFlowMod.parser(DATAPATH, ofp.OFP_VERSION, ofp.OFPT_FLOW_MOD, len(msg.buf),
                                      0, bytes(msg.buf))  # fmt: skip
    assert openflow.first_packet(parsed.instructions) == FlowCounters(1, 60)
    assert openflow.first_packet([]) == FlowCounters()


def test_table_miss_is_normal_and_exit_keeps_it():
    miss = golden(openflow.table_miss_rule(parser, ofp))
    assert (miss["priority"], miss["match"], miss["actions"]) == (
        0,
        {},
        [(ofp.OFPP_NORMAL, ofp.OFPCML_MAX)],
    )
    kinds = [m.cookie >> 40 & 0xFF for m in openflow.delete_judging_rules(parser, ofp)]
    assert kinds == [
        flows.COOKIE_KIND_DISCOVERY,
        flows.COOKIE_KIND_FLOW,
        flows.COOKIE_KIND_COUNTING,
        flows.COOKIE_KIND_JUDGED,
    ]
    assert flows.COOKIE_KIND_TABLE_MISS not in kinds
    everything = openflow.delete_owned(parser, ofp)
    assert everything.cookie_mask == flows.COOKIE_MASK and everything.command == ofp.OFPFC_DELETE


def test_stats_request_reads_every_owned_rule_in_every_table_at_once():
    req = openflow.owned_stats_request(parser, ofp)
    assert req.table_id == ofp.OFPTT_ALL and req.cookie_mask == flows.COOKIE_MASK
    for cookie in (flows.flow_cookie(5), flows.counting_cookie(), flows.discovery_cookie(1)):
        assert cookie & req.cookie_mask == req.cookie
    assert 0x1234 << 48 & req.cookie_mask != req.cookie  # someone else's rule


def test_counting_rule_match_maps_back_to_its_flow():
    fields = {"in_port": 3, "eth_type": 0x800, "ip_proto": 17, "ipv4_src": "10.251.0.10",
              "ipv4_dst": "10.251.0.20", "udp_src": 40000, "udp_dst": 5201}  # fmt: skip
    assert openflow.counted_match(fields, "tap0") == FlowMatch(
        "tap0", 17, "10.251.0.10", "10.251.0.20", 40000, 5201
    )
    assert openflow.counted_match(fields, None) is None  # its port left the bridge
    assert openflow.counted_match({**fields, "ip_proto": 1}, "tap0") is None
    assert flows.is_counting_cookie(flows.counting_cookie())
    assert not flows.is_counting_cookie(flows.flow_cookie(1))
    assert flows.cookie_flow_id(flows.counting_cookie()) is None


def test_counting_rules_are_deleted_per_flow_or_per_port():
    match = FlowMatch("tap0", 6, "10.251.0.10", "10.251.0.20", 40000, 5201)
    one = openflow.delete_counting_rules(parser, ofp, 3, match)
    port = openflow.delete_counting_rules(parser, ofp, 3)
    for mod in (one, port):
        assert mod.table_id == flows.COUNTING_TABLE
        assert mod.cookie == flows.counting_cookie() and mod.cookie_mask == 0xFFFFFF << 40
    # One flow's: strict (OVS looks it up instead of visiting the whole table),
    # at the priority counting_learn gives it; a port's: every match under in_port.
    assert (one.command, one.priority) == (ofp.OFPFC_DELETE_STRICT, flows.FLOW_PRIORITY)
    assert openflow.counting_learn(parser, 6).priority == flows.FLOW_PRIORITY
    assert port.command == ofp.OFPFC_DELETE
    assert dict(one.match.items())["tcp_dst"] == 5201
    assert dict(port.match.items()) == {"in_port": 3}


def frame(proto=17, ihl=5, frag=0, ports=b"\x9c\x40\x14\x51", eth_type=b"\x08\x00"):
    eth = bytes.fromhex("0200000000020200000000 01".replace(" ", "")) + eth_type
    header = bytearray(ihl * 4)
    header[0] = 0x40 | ihl
    header[6:8] = frag.to_bytes(2, "big")
    header[9] = proto
    header[12:16] = bytes([10, 251, 0, 10])
    header[16:20] = bytes([10, 251, 0, 20])
    return eth + bytes(header) + ports


@pytest.mark.parametrize(
    ("data", "five"),
    [
        (frame(), (17, "10.251.0.10", "10.251.0.20", 40000, 5201)),
        (frame(proto=6, ihl=6), (6, "10.251.0.10", "10.251.0.20", 40000, 5201)),
        (frame(proto=1), None),  # ICMP: not a flow the app judges
        (frame(frag=5), None),  # a later fragment has no ports
        (frame(ports=b"\x9c"), None),  # truncated transport header
        (frame(eth_type=b"\x08\x06"), None),  # ARP
    ],
)
def test_parse_packet(data, five):
    parsed = openflow.parse_packet(data)
    assert parsed.five_tuple == five
    assert parsed.eth_src == "02:00:00:00:00:01"


def test_parse_packet_rejects_runts():
    assert openflow.parse_packet(b"\x00" * 13) is None


def test_parse_fdb_skips_local_and_headers():
    text = " port  VLAN  MAC                Age\n LOCAL     0  aa:aa:aa:aa:aa:aa    1\n"
    text += "    3     0  02:00:00:00:00:0B    0\n"
    assert openflow.parse_fdb(text) == [(3, "02:00:00:00:00:0b")]
