"""OpenFlow 1.0 wire format of the statistics endpoint.

Served because ``ovs-ofctl`` enables only OpenFlow 1.0 unless ``-O`` says
otherwise (utilities/ovs-ofctl.c: "For now, ovs-ofctl only enables OpenFlow
1.0 by default"), so a plain ``ovs-ofctl dump-flows <target>`` speaks it.
Requests decode into the same :class:`codec.FlowStatsRequest` the 1.3 path
uses, so selection is shared; only the framing and the fixed 40-byte match
differ.
"""

from __future__ import annotations

import enum
import functools
import struct
from collections.abc import Iterable, Iterator, Mapping

from ovs_ext.flow_record import FlowRecord
from ovs_ext.openflow_stats import codec, ofp13
from ovs_ext.openflow_stats.codec import FlowStatsRequest, OpenFlowError, OxmTlv
from ovs_ext.openflow_stats.ofp13 import BadRequestCode, ErrorType, OxmField

OFP10_VERSION = 0x01
STATS_HEADER_LEN = 12  # ofp_header + type, flags
STATS = struct.Struct("!HH")
MATCH = struct.Struct("!IH6s6sHBxHBB2xIIHH")  # ofp_match, 40 bytes
FLOW_STATS_REQUEST_TAIL = struct.Struct("!BxH")  # after the match: table_id, out_port
FLOW_STATS_ENTRY = struct.Struct("!HBx40sIIHHH6xQQQ")
OUTPUT_ACTION = struct.Struct("!HHHH")
FEATURES_REPLY = struct.Struct("!QIB3xII")
PHY_PORT = struct.Struct("!H6s16sIIIIII")

OFPP_NORMAL = 0xFFFA
OFPP_NONE = 0xFFFF
OFPC_FLOW_STATS = 1 << 0
OFPAT_OUTPUT = 0
OFPSF_REPLY_MORE = 1
FLOW_MOD_FAILED = 3  # OpenFlow 1.0 error type number
FLOW_MOD_FAILED_EPERM = 2


class MsgType(enum.IntEnum):
    HELLO = 0
    ERROR = 1
    ECHO_REQUEST = 2
    ECHO_REPLY = 3
    VENDOR = 4
    FEATURES_REQUEST = 5
    FEATURES_REPLY = 6
    GET_CONFIG_REQUEST = 7
    GET_CONFIG_REPLY = 8
    SET_CONFIG = 9
    PACKET_IN = 10
    FLOW_REMOVED = 11
    PORT_STATUS = 12
    PACKET_OUT = 13
    FLOW_MOD = 14
    PORT_MOD = 15
    STATS_REQUEST = 16
    STATS_REPLY = 17
    BARRIER_REQUEST = 18
    BARRIER_REPLY = 19
    QUEUE_GET_CONFIG_REQUEST = 20
    QUEUE_GET_CONFIG_REPLY = 21


STATE_CHANGING = frozenset(
    {MsgType.SET_CONFIG, MsgType.PACKET_OUT, MsgType.FLOW_MOD, MsgType.PORT_MOD}
)


class StatsType(enum.IntEnum):
    DESC = 0
    FLOW = 1
    AGGREGATE = 2
    TABLE = 3
    PORT = 4
    QUEUE = 5
    VENDOR = 0xFFFF


class Wildcard(enum.IntFlag):
    IN_PORT = 1 << 0
    DL_VLAN = 1 << 1
    DL_SRC = 1 << 2
    DL_DST = 1 << 3
    DL_TYPE = 1 << 4
    NW_PROTO = 1 << 5
    TP_SRC = 1 << 6
    TP_DST = 1 << 7
    DL_VLAN_PCP = 1 << 20
    NW_TOS = 1 << 21


NW_SRC_SHIFT = 8
NW_DST_SHIFT = 14
NW_ADDR_BITS = 0x3F  # 6-bit count of wildcarded low bits; >= 32 is "any"
WILDCARD_ALL = (1 << 22) - 1
# Fields with no FlowRecord counterpart: a request matching on them selects
# nothing, so they map to their OXM numbers only to be recognised as such.
UNSERVED = (
    (Wildcard.DL_VLAN, 6),
    (Wildcard.DL_SRC, 4),
    (Wildcard.DL_DST, 3),
    (Wildcard.DL_VLAN_PCP, 7),
    (Wildcard.NW_TOS, 8),
)


def encode_message(msg_type: int, xid: int, body: bytes = b"") -> bytes:
    return codec.encode_message(msg_type, xid, body, version=OFP10_VERSION)


def decode_stats_header(message: bytes) -> tuple[int, int]:
    """(stats type, flags) of a stats request or reply."""
    if len(message) < STATS_HEADER_LEN:
        raise codec.bad_len(f"stats message of {len(message)} bytes")
    return STATS.unpack_from(message, ofp13.HEADER_LEN)


# ---------------------------------------------------------------- match


def _nw_addr_tlv(field: OxmField, address: int, wildcarded_bits: int) -> OxmTlv | None:
    if wildcarded_bits >= 32:
        return None
    mask = 0xFFFFFFFF & ~((1 << wildcarded_bits) - 1)
    return OxmTlv(ofp13.OFPXMC_OPENFLOW_BASIC, field, address & mask,
                  None if wildcarded_bits == 0 else mask)  # fmt: skip


def decode_match(raw: bytes) -> tuple[OxmTlv, ...]:
    """A 40-byte ofp_match as the OXM fields it matches exactly or by prefix."""
    (wildcards, in_port, _dl_src, _dl_dst, _vlan, _pcp, dl_type, _tos, nw_proto,
     nw_src, nw_dst, tp_src, tp_dst) = MATCH.unpack(raw)  # fmt: skip
    basic = ofp13.OFPXMC_OPENFLOW_BASIC
    fields: list[OxmTlv | None] = []
    if not wildcards & Wildcard.IN_PORT:
        fields.append(OxmTlv(basic, OxmField.IN_PORT, in_port, None))
    if not wildcards & Wildcard.DL_TYPE:
        fields.append(OxmTlv(basic, OxmField.ETH_TYPE, dl_type, None))
    if not wildcards & Wildcard.NW_PROTO:
        fields.append(OxmTlv(basic, OxmField.IP_PROTO, nw_proto, None))
    fields.append(_nw_addr_tlv(OxmField.IPV4_SRC, nw_src,
                               wildcards >> NW_SRC_SHIFT & NW_ADDR_BITS))  # fmt: skip
    fields.append(_nw_addr_tlv(OxmField.IPV4_DST, nw_dst,
                               wildcards >> NW_DST_SHIFT & NW_ADDR_BITS))  # fmt: skip
    # OpenFlow 1.0 has one pair of transport ports; which OXM field they are
    # depends on the protocol (anything else matches no FlowRecord field).
    src_field, dst_field = {6: (OxmField.TCP_SRC, OxmField.TCP_DST),
                            17: (OxmField.UDP_SRC, OxmField.UDP_DST)}.get(
        nw_proto if not wildcards & Wildcard.NW_PROTO else -1, (63, 63))  # fmt: skip
    if not wildcards & Wildcard.TP_SRC:
        fields.append(OxmTlv(basic, src_field, tp_src, None))
    if not wildcards & Wildcard.TP_DST:
        fields.append(OxmTlv(basic, dst_field, tp_dst, None))
    for bit, oxm_field in UNSERVED:
        if not wildcards & bit:
            fields.append(OxmTlv(basic, oxm_field, 0, None))
    return tuple(f for f in fields if f is not None)


def encode_match(match: Mapping[str, int | str]) -> bytes:
    """A FlowRecord's match (validated) as an OpenFlow 1.0 ofp_match."""
    values = codec.match_fields(match)
    get = values.get
    wildcards = WILDCARD_ALL
    for name, bits in _WILDCARD_OF:
        if name in values:
            wildcards &= ~bits
    tp_src = get("tcp_src", get("udp_src"))
    tp_dst = get("tcp_dst", get("udp_dst"))
    if tp_src is not None:
        wildcards &= ~_TP_SRC_BIT
    if tp_dst is not None:
        wildcards &= ~_TP_DST_BIT
    return MATCH.pack(wildcards, get("in_port", 0), _NO_MAC, _NO_MAC, 0, 0, get("eth_type", 0),
                      0, get("ip_proto", 0), get("ipv4_src", 0), get("ipv4_dst", 0),
                      tp_src or 0, tp_dst or 0)  # fmt: skip


_NO_MAC = bytes(6)
# FlowRecord field -> the wildcard bits that stop being wildcarded when it is set.
# Plain ints: IntFlag arithmetic was half of encoding a 10k-flow dump.
_WILDCARD_OF = (
    ("in_port", int(Wildcard.IN_PORT)),
    ("eth_type", int(Wildcard.DL_TYPE)),
    ("ip_proto", int(Wildcard.NW_PROTO)),
    ("ipv4_src", NW_ADDR_BITS << NW_SRC_SHIFT),
    ("ipv4_dst", NW_ADDR_BITS << NW_DST_SHIFT),
)
_TP_SRC_BIT, _TP_DST_BIT = int(Wildcard.TP_SRC), int(Wildcard.TP_DST)


@functools.lru_cache(maxsize=4096)
def _output_action(out_port: int | None) -> bytes:
    port = OFPP_NORMAL if out_port is None else out_port
    return OUTPUT_ACTION.pack(OFPAT_OUTPUT, OUTPUT_ACTION.size, port, 0)


# ---------------------------------------------------------------- stats


def decode_flow_stats_request(message: bytes) -> FlowStatsRequest:
    """OFPST_FLOW / OFPST_AGGREGATE request: ofp_match, table_id, out_port."""
    expected = STATS_HEADER_LEN + MATCH.size + FLOW_STATS_REQUEST_TAIL.size
    if len(message) != expected:
        raise codec.bad_len(f"flow statistics request of {len(message)} bytes, not {expected}")
    match = decode_match(message[STATS_HEADER_LEN : STATS_HEADER_LEN + MATCH.size])
    table_id, out_port = FLOW_STATS_REQUEST_TAIL.unpack_from(message, STATS_HEADER_LEN + MATCH.size)
    if out_port == OFPP_NONE:
        out_port = ofp13.OFPP_ANY
    elif out_port == OFPP_NORMAL:
        out_port = ofp13.OFPP_NORMAL
    return FlowStatsRequest(table_id=table_id, out_port=out_port, match=match)


def encode_flow_stats_request(match: bytes, table_id: int, out_port: int, xid: int,
                              aggregate: bool = False) -> bytes:  # fmt: skip
    stats_type = StatsType.AGGREGATE if aggregate else StatsType.FLOW
    body = STATS.pack(stats_type, 0) + match + FLOW_STATS_REQUEST_TAIL.pack(table_id, out_port)
    return encode_message(MsgType.STATS_REQUEST, xid, body)


def encode_flow_stats_entry(record: FlowRecord) -> bytes:
    """One OpenFlow 1.0 ofp_flow_stats; InvalidInput if the record cannot be shown."""
    codec.check_counters(record)
    action = _output_action(record.out_port)
    seconds, nanoseconds = codec.split_duration(record.duration_s)
    head = FLOW_STATS_ENTRY.pack(
        FLOW_STATS_ENTRY.size + len(action), record.table_id, encode_match(record.match),
        seconds, nanoseconds, record.priority, 0, 0, record.cookie, record.packets, record.bytes,
    )  # fmt: skip
    return head + action


def encode_stats_replies(stats_type: int, xid: int, parts: Iterable[bytes]) -> Iterator[bytes]:
    """Stats replies under 64 KiB each, all but the last flagged REPLY_MORE."""
    limit = ofp13.MAX_MESSAGE_LEN - STATS_HEADER_LEN
    for flags, chunk in codec.chunk_parts(parts, limit):
        body = STATS.pack(stats_type, flags) + b"".join(chunk)
        yield encode_message(MsgType.STATS_REPLY, xid, body)


def encode_features_reply(xid: int, datapath_id: int, n_tables: int,
                          ports: Mapping[int, str]) -> bytes:  # fmt: skip
    """FEATURES reply; in OpenFlow 1.0 it also carries the ports (names for
    ovs-ofctl's --names)."""
    body = bytearray(FEATURES_REPLY.pack(datapath_id, 0, n_tables, OFPC_FLOW_STATS, 1))
    for port_no, name in sorted(ports.items()):
        if 1 <= port_no <= 0xFEFF:
            raw_name = name.encode("utf-8", "replace")[:15]
            body += PHY_PORT.pack(port_no, bytes(6), raw_name, 0, 0, 0, 0, 0, 0)
    return encode_message(MsgType.FEATURES_REPLY, xid, bytes(body))


def refusal(msg_type: int) -> OpenFlowError:
    """The error answering a message this endpoint does not serve."""
    if msg_type == MsgType.FLOW_MOD:
        return OpenFlowError(FLOW_MOD_FAILED, FLOW_MOD_FAILED_EPERM,
                             "the statistics endpoint is read-only")  # fmt: skip
    if msg_type in STATE_CHANGING:
        return OpenFlowError(ErrorType.BAD_REQUEST, BadRequestCode.EPERM,
                             f"message type {msg_type} would change state; read-only")  # fmt: skip
    if msg_type == MsgType.VENDOR:
        # Nicira extensions included: ovs-ofctl's NXT_SET_FLOW_FORMAT is
        # refused, so it falls back to the standard OpenFlow 1.0 match.
        return OpenFlowError(ErrorType.BAD_REQUEST, BadRequestCode.BAD_EXPERIMENTER,
                             "no vendor extensions are served")  # fmt: skip
    return OpenFlowError(ErrorType.BAD_REQUEST, BadRequestCode.BAD_TYPE,
                         f"message type {msg_type} is not served")  # fmt: skip
