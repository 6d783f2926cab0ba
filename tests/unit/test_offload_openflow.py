"""Golden tests of the OpenFlow 1.3 rules the offload app owns, and packet parsing."""

import types

import pytest
from os_ken.ofproto import ofproto_v1_3 as ofp
from os_ken.ofproto import ofproto_v1_3_parser as parser

from ovs_ext import flows, openflow
from ovs_ext.providers.base import FlowMatch

DATAPATH = types.SimpleNamespace(ofproto=ofp, ofproto_parser=parser)


def golden(msg):
    """What a rule says, in the terms ovs-ofctl prints, from the serialised bytes."""
    msg.datapath = DATAPATH
    msg.serialize()
    parsed = parser.OFPFlowMod.parser(DATAPATH, ofp.OFP_VERSION, ofp.OFPT_FLOW_MOD, len(msg.buf),
                                      0, bytes(msg.buf))  # fmt: skip
    actions = [(a.port, a.max_len) for inst in parsed.instructions for a in inst.actions]
    return {
        "cookie": hex(parsed.cookie),
        "command": parsed.command,
        "priority": parsed.priority,
        "match": dict(parsed.match.items()),
        "actions": actions,
    }


def test_discovery_rules_send_tcp_udp_to_the_app_and_learn_arp():
    rules = [golden(m) for m in openflow.discovery_rules(parser, ofp, 7)]
    assert rules == [
        {"cookie": "0xf1e0020000000007", "command": ofp.OFPFC_ADD, "priority": 10,
         "match": {"in_port": 7, "eth_type": 0x800, "ip_proto": 6},
         "actions": [(ofp.OFPP_CONTROLLER, 0xFFFF)]},
        {"cookie": "0xf1e0020000000007", "command": ofp.OFPFC_ADD, "priority": 10,
         "match": {"in_port": 7, "eth_type": 0x800, "ip_proto": 17},
         "actions": [(ofp.OFPP_CONTROLLER, 0xFFFF)]},
        {"cookie": "0xf1e0020000000007", "command": ofp.OFPFC_ADD, "priority": 10,
         "match": {"in_port": 7, "eth_type": 0x806},
         "actions": [(ofp.OFPP_CONTROLLER, 64), (ofp.OFPP_NORMAL, ofp.OFPCML_MAX)]},
    ]  # fmt: skip


def test_flow_rule_matches_the_five_tuple_and_switches_normal():
    match = FlowMatch("tap0", 6, "10.251.0.10", "10.251.0.20", 40000, 5201)
    rule = golden(openflow.flow_rule(parser, ofp, flows.flow_cookie(42), 3, match))
    assert rule["cookie"] == "0xf1e001000000002a" and rule["priority"] == 100
    assert rule["match"] == {
        "in_port": 3, "eth_type": 0x800, "ip_proto": 6, "ipv4_src": "10.251.0.10",
        "ipv4_dst": "10.251.0.20", "tcp_src": 40000, "tcp_dst": 5201,
    }  # fmt: skip
    assert rule["actions"] == [(ofp.OFPP_NORMAL, ofp.OFPCML_MAX)]


def test_table_miss_is_normal_and_exit_keeps_it():
    miss = golden(openflow.table_miss_rule(parser, ofp))
    assert (miss["priority"], miss["match"], miss["actions"]) == (
        0,
        {},
        [(ofp.OFPP_NORMAL, ofp.OFPCML_MAX)],
    )
    kinds = [m.cookie >> 40 & 0xFF for m in openflow.delete_judging_rules(parser, ofp)]
    assert kinds == [flows.COOKIE_KIND_DISCOVERY, flows.COOKIE_KIND_FLOW]
    assert flows.COOKIE_KIND_TABLE_MISS not in kinds
    everything = openflow.delete_owned(parser, ofp)
    assert everything.cookie_mask == flows.COOKIE_MASK and everything.command == ofp.OFPFC_DELETE


def test_stats_request_selects_only_flow_rules():
    req = openflow.owned_stats_request(parser, ofp)
    assert flows.cookie_flow_id(req.cookie) == 0
    assert (
        req.cookie_mask & flows.discovery_cookie(0) == flows.discovery_cookie(0) & req.cookie_mask
    )
    assert req.cookie & req.cookie_mask != flows.discovery_cookie(1) & req.cookie_mask


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
