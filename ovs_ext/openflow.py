"""The OpenFlow 1.3 rules the offload app owns in br-int, and packet parsing.

Pure builders over an os-ken ``ofproto_v1_3_parser`` module (golden-tested in
the unit tests) and a header parser for packet-ins.  Three kinds of rule, all
tagged with cookies under :data:`~ovs_ext.flows.COOKIE_MASK`:

- per watched port (VM ports and uplinks), priority 10: IPv4 TCP and UDP
  are switched NORMAL by the bridge itself, a ``learn`` action creates the
  flow's *counting rule* in :data:`~ovs_ext.flows.COUNTING_TABLE` which the
  packet then traverses (see "Why a counting rule" below), and a header copy
  of the flow's *first* packet goes to the app to be judged (see "One copy per
  flow"); ARP goes to the controller (truncated) *and* NORMAL, so the app
  learns which port each MAC sits behind;
- per flow, priority 100: the 5-tuple on its in_port, NORMAL — the rule whose
  counters are the flow's onloaded traffic;
- a priority-0 NORMAL rule for everything else (ICMP, other ethertypes,
  unwatched ports): ovs-vswitchd removes its own default NORMAL rule once a
  bridge has a controller, so the app puts it back, as Neutron's agent does.

Why a counting rule: OVS credits a datapath flow's packets to the rules its
key translates to *when the revalidator next pushes them*, not when they
passed.  Packets of a burst that hit the discovery rule's datapath flow before
the per-flow rule existed used to be sent to the app (counted and forwarded
there) and then credited again to the new per-flow rule by that push: a flow
starting with 640 unpaced packets showed 907.  Now the bridge forwards every
packet and the app counts none but the first (the datapath miss, credited to
the shared discovery rule).  Every later pre-rule packet is credited exactly
once, by the push, either to the flow's rule (pushed after it exists) or to its
counting rule (pushed before): first + counting + flow rule = what passed.
The learn also reads the whole 5-tuple, so the datapath flow is per flow, never
a megaflow that would credit another flow's packets to this one.

One copy per flow: the copy to the app is the judged table's miss rule
(:data:`~ovs_ext.flows.JUDGED_TABLE`), reached last.  The discovery rule also
learns a mark for the flow there; OVS translates a packet against the tables as
they were when it started, so the packet that learns the mark misses it and is
copied, and every later one (until the flow's own rule exists) finds it and is
not.  Before, every packet of a new flow went to the app until its rule was
in: 3 packet-ins per 3-packet flow, and a datapath flow slow-pathed for each
(docs/benchmarks/offload-load.md).  The mark expires after JUDGED_HOLD_S, so a
copy OVS dropped is sent again.  Beside Neutron (ovs_ext/neutron.py) every
packet is still copied until the rule exists.
"""

from __future__ import annotations

import dataclasses
import struct
from types import ModuleType
from typing import Any

from ovs_ext import flows
from ovs_ext.providers.base import IPPROTO_TCP, IPPROTO_UDP, FlowCounters, FlowMatch

ETH_TYPE_IPV4 = 0x0800
ETH_TYPE_ARP = 0x0806
ETH_HEADER = struct.Struct("!6s6sH")
IPV4_MIN_HEADER = 20
ARP_LEARN_MAX_LEN = 64  # enough for Ethernet + ARP's sender fields
JUDGE_MAX_LEN = 128  # Ethernet + the longest IPv4 header + the L4 ports
# A counting rule outlives its flow's rule only until it has been idle this
# long (the app also deletes it with the flow); its last counters are kept.
COUNTING_IDLE_TIMEOUT = 30
# How long a flow's judged mark stops copies to the app (see judged_learn): far
# longer than the app takes to install the flow's rule (ms), short enough that a
# copy OVS dropped is sent again soon.
JUDGED_HOLD_S = 2
OFPCML_NO_BUFFER = 0xFFFF
OFP_NO_BUFFER = 0xFFFFFFFF
# The note in a flow rule: the length of the flow's first packet (see flow_rule).
FIRST_PACKET_NOTE = struct.Struct("!I")


@dataclasses.dataclass(frozen=True)
class ParsedPacket:
    eth_src: str
    eth_dst: str
    eth_type: int
    five_tuple: tuple[int, str, str, int, int] | None  # proto, src, dst, sport, dport


def mac_text(raw: bytes) -> str:
    return ":".join(f"{b:02x}" for b in raw)


def parse_packet(data: bytes) -> ParsedPacket | None:
    """Ethernet + IPv4 + TCP/UDP ports; None for a frame too short to be Ethernet.

    >>> frame = bytes(6) + bytes.fromhex("020000000001") + b"\\x08\\x00"
    >>> ip = bytes.fromhex("4500001c00004000401100000a0000010a000002")
    >>> parse_packet(frame + ip + bytes.fromhex("9c4014510008 0000")).five_tuple
    (17, '10.0.0.1', '10.0.0.2', 40000, 5201)
    """
    if len(data) < ETH_HEADER.size:
        return None
    dst, src, eth_type = ETH_HEADER.unpack_from(data)
    ip = data[ETH_HEADER.size :]
    five = None
    if eth_type == ETH_TYPE_IPV4 and len(ip) >= IPV4_MIN_HEADER and ip[0] >> 4 == 4:
        header_len = (ip[0] & 0x0F) * 4
        proto = ip[9]
        fragment = struct.unpack_from("!H", ip, 6)[0] & 0x1FFF
        if proto in (IPPROTO_TCP, IPPROTO_UDP) and fragment == 0 and len(ip) >= header_len + 4:
            sport, dport = struct.unpack_from("!HH", ip, header_len)
            src_ip = ".".join(str(b) for b in ip[12:16])
            dst_ip = ".".join(str(b) for b in ip[16:20])
            five = (proto, src_ip, dst_ip, sport, dport)
    return ParsedPacket(mac_text(src), mac_text(dst), eth_type, five)


def parse_fdb(text: str) -> list[tuple[int, str]]:
    """(OpenFlow port, MAC) rows of ``ovs-appctl fdb/show``.

    >>> parse_fdb(" port  VLAN  MAC                Age\\n    2     0  02:00:00:00:00:01    3\\n")
    [(2, '02:00:00:00:00:01')]
    """
    rows = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[0].isdigit() and fields[2].count(":") == 5:
            rows.append((int(fields[0]), fields[2].lower()))
    return rows


def flow_match(in_port: str, parsed: ParsedPacket) -> FlowMatch | None:
    if parsed.five_tuple is None:
        return None
    proto, src, dst, sport, dport = parsed.five_tuple
    return FlowMatch(in_port, proto, src, dst, sport, dport)


# -- rule builders ------------------------------------------------------------------
def discovery_rules(parser: ModuleType, ofproto: ModuleType, ofport: int) -> list[Any]:
    """Flow-mods switching a watched port's new TCP/UDP flows (a copy to the app,
    the flow's counting rule learnt) and sending ARP to the app as well."""
    cookie = flows.discovery_cookie(ofport)
    mods = [
        _flow_mod(
            parser,
            ofproto,
            cookie,
            flows.DISCOVERY_PRIORITY,
            parser.OFPMatch(in_port=ofport, eth_type=ETH_TYPE_IPV4, ip_proto=proto),
            [
                counting_learn(parser, proto),
                judged_learn(parser, proto),
                parser.NXActionResubmitTable(table_id=flows.COUNTING_TABLE),
                parser.OFPActionOutput(ofproto.OFPP_NORMAL),
                parser.NXActionResubmitTable(table_id=flows.JUDGED_TABLE),
            ],
        )  # fmt: skip
        for proto in (IPPROTO_TCP, IPPROTO_UDP)
    ]
    learn_arp = [
        parser.OFPActionOutput(ofproto.OFPP_CONTROLLER, ARP_LEARN_MAX_LEN),
        parser.OFPActionOutput(ofproto.OFPP_NORMAL),
    ]
    mods.append(
        _flow_mod(
            parser,
            ofproto,
            cookie,
            flows.DISCOVERY_PRIORITY,
            parser.OFPMatch(in_port=ofport, eth_type=ETH_TYPE_ARP),
            learn_arp,
        )
    )
    return mods


def counting_learn(parser: ModuleType, proto: int, table: int = flows.COUNTING_TABLE) -> Any:
    """``learn``: the packet's exact 5-tuple on its in_port, no actions, in the
    counting table (a rule that only counts what traverses it)."""
    return parser.NXActionLearn(
        table_id=table,
        specs=_five_tuple_specs(parser, proto),
        idle_timeout=COUNTING_IDLE_TIMEOUT,
        priority=flows.FLOW_PRIORITY,
        cookie=flows.counting_cookie(),
    )


def judged_learn(parser: ModuleType, proto: int) -> Any:
    """``learn``: a mark for the packet's flow in the judged table, which stops
    the copies to the app once the first is sent (see discovery_rules).  It
    lasts JUDGED_HOLD_S whatever the traffic: if that copy was lost (OVS drops
    packet-ins the app is too slow to read) the flow is copied again."""
    return parser.NXActionLearn(
        table_id=flows.JUDGED_TABLE,
        specs=_five_tuple_specs(parser, proto),
        hard_timeout=JUDGED_HOLD_S,
        priority=flows.FLOW_PRIORITY,
        cookie=flows.judged_cookie(),
    )


def judged_miss_rule(parser: ModuleType, ofproto: ModuleType) -> Any:
    """The judged table's rule for a flow with no mark yet: copy it to the app."""
    return _flow_mod(
        parser,
        ofproto,
        flows.judged_cookie(),
        0,
        parser.OFPMatch(),
        [parser.OFPActionOutput(ofproto.OFPP_CONTROLLER, JUDGE_MAX_LEN)],
        table=flows.JUDGED_TABLE,
    )


def _five_tuple_specs(parser: ModuleType, proto: int) -> list[Any]:
    l4 = "tcp" if proto == IPPROTO_TCP else "udp"

    def copy(field: str, bits: int) -> Any:
        return parser.NXFlowSpecMatch(src=(field, 0), dst=(field, 0), n_bits=bits)

    return [
        copy("in_port", 32),
        parser.NXFlowSpecMatch(src=ETH_TYPE_IPV4, dst=("eth_type", 0), n_bits=16),
        parser.NXFlowSpecMatch(src=proto, dst=("ip_proto", 0), n_bits=8),
        copy("ipv4_src", 32),
        copy("ipv4_dst", 32),
        copy(f"{l4}_src", 16),
        copy(f"{l4}_dst", 16),
    ]


def table_miss_rule(parser: ModuleType, ofproto: ModuleType) -> Any:
    """Everything the app does not judge is switched by the bridge (NORMAL)."""
    return _flow_mod(
        parser,
        ofproto,
        flows.table_miss_cookie(),
        0,
        parser.OFPMatch(),
        [parser.OFPActionOutput(ofproto.OFPP_NORMAL)],
    )


def flow_rule(parser: ModuleType, ofproto: ModuleType, cookie: int, in_port: int,
              match: FlowMatch, first_length: int = 0) -> Any:  # fmt: skip
    """The per-flow rule: its 5-tuple on its in_port, forwarded NORMAL.

    A note carries the length of the flow's first packet: that packet is
    counted by the app alone (no rule counts it), and the note is how a later
    run reading the rule back (:func:`first_packet`) counts it too.
    """
    fields: dict[str, Any] = dict(flows.openflow_match(match, in_port))
    note = parser.NXActionNote(note=list(FIRST_PACKET_NOTE.pack(first_length)))
    return _flow_mod(
        parser,
        ofproto,
        cookie,
        flows.FLOW_PRIORITY,
        parser.OFPMatch(**fields),
        [note, parser.OFPActionOutput(ofproto.OFPP_NORMAL)],
    )


def first_packet(instructions: Any) -> FlowCounters:
    """The first packet a flow rule's note records (one packet of that length);
    nothing for a rule without one."""
    for instruction in instructions or ():
        for action in getattr(instruction, "actions", ()):
            note = bytes(getattr(action, "note", b"") or b"")
            if len(note) >= FIRST_PACKET_NOTE.size:
                (length,) = FIRST_PACKET_NOTE.unpack_from(note)
                return FlowCounters(1, length)
    return FlowCounters()


def delete_owned(parser: ModuleType, ofproto: ModuleType, cookie: int = 0,
                 cookie_mask: int = flows.COOKIE_MASK) -> Any:  # fmt: skip
    """Delete every rule the app owns (all of them, or one by exact cookie)."""
    if cookie == 0:
        cookie = flows.COOKIE_PREFIX << 48
    return delete_rules(parser, ofproto, cookie, cookie_mask)


def delete_judging_rules(parser: ModuleType, ofproto: ModuleType) -> list[Any]:
    """At exit: the discovery and per-flow rules, keeping the NORMAL table-miss rule."""
    kind_mask = flows.COOKIE_MASK | (0xFF << 40)
    prefix = flows.COOKIE_PREFIX << 48
    return [
        delete_rules(parser, ofproto, prefix | (kind << 40), kind_mask)
        for kind in (
            flows.COOKIE_KIND_DISCOVERY,
            flows.COOKIE_KIND_FLOW,
            flows.COOKIE_KIND_COUNTING,
            flows.COOKIE_KIND_JUDGED,
        )
    ]


def delete_rules(parser: ModuleType, ofproto: ModuleType, cookie: int, cookie_mask: int) -> Any:
    return parser.OFPFlowMod(
        datapath=None,
        cookie=cookie,
        cookie_mask=cookie_mask,
        table_id=ofproto.OFPTT_ALL,
        command=ofproto.OFPFC_DELETE,
        out_port=ofproto.OFPP_ANY,
        out_group=ofproto.OFPG_ANY,
        match=parser.OFPMatch(),
    )


def owned_stats_request(parser: ModuleType, ofproto: ModuleType) -> Any:
    """Flow statistics of every rule the app owns, in every table (one request,
    so the per-flow and counting rules are read at the same moment)."""
    return parser.OFPFlowStatsRequest(
        datapath=None,
        table_id=ofproto.OFPTT_ALL,
        out_port=ofproto.OFPP_ANY,
        out_group=ofproto.OFPG_ANY,
        cookie=flows.COOKIE_PREFIX << 48,
        cookie_mask=flows.COOKIE_MASK,
        match=parser.OFPMatch(),
    )


def counted_match(fields: Any, port_name: str | None) -> FlowMatch | None:
    """The flow a counting rule's match (from a flow-stats reply) counts for."""
    if port_name is None:
        return None
    proto = fields.get("ip_proto")
    l4 = {IPPROTO_TCP: "tcp", IPPROTO_UDP: "udp"}.get(proto)
    if l4 is None:
        return None
    return FlowMatch(port_name, proto, fields.get("ipv4_src"), fields.get("ipv4_dst"),
                     fields.get(f"{l4}_src"), fields.get(f"{l4}_dst"))  # fmt: skip


def delete_counting_rules(parser: ModuleType, ofproto: ModuleType, in_port: int,
                          match: FlowMatch | None = None,
                          table: int = flows.COUNTING_TABLE) -> Any:  # fmt: skip
    """Delete one flow's counting rule, or every one on ``in_port``.

    One flow's is deleted strictly (its exact match and priority): OVS finds
    that rule by lookup, where a loose delete visits every rule of the table
    (10k at 10k flows, for each of the ~1,000 flows expiring a second, in the
    thread that also forwards in the userspace datapath).
    """
    fields: dict[str, Any] = {"in_port": in_port}
    command = ofproto.OFPFC_DELETE
    if match is not None:
        fields = dict(flows.openflow_match(match, in_port))
        command = ofproto.OFPFC_DELETE_STRICT
    return parser.OFPFlowMod(
        datapath=None,
        cookie=flows.counting_cookie(),
        cookie_mask=flows.COOKIE_MASK | (0xFF << 40),
        table_id=table,
        command=command,
        priority=flows.FLOW_PRIORITY,
        out_port=ofproto.OFPP_ANY,
        out_group=ofproto.OFPG_ANY,
        match=parser.OFPMatch(**fields),
    )


def _flow_mod(parser: ModuleType, ofproto: ModuleType, cookie: int, priority: int,
              match: Any, actions: list[Any], table: int = flows.FLOW_TABLE) -> Any:  # fmt: skip
    return parser.OFPFlowMod(
        datapath=None,
        cookie=cookie,
        table_id=table,
        command=ofproto.OFPFC_ADD,
        priority=priority,
        buffer_id=OFP_NO_BUFFER,
        match=match,
        instructions=[parser.OFPInstructionActions(ofproto.OFPIT_APPLY_ACTIONS, actions)],
    )
