"""OpenFlow 1.3 wire codec for the statistics endpoint: bytes in, bytes out.

Pure functions and plain data, no sockets: the session and the tests drive it.
Decoders raise :class:`OpenFlowError` carrying the OFPT_ERROR type and code a
switch answers with, so every malformed input maps to exactly one reply.
"""

from __future__ import annotations

import dataclasses
import functools
import socket
import struct
import typing
from collections.abc import Iterable, Iterator, Mapping

from flexmig import exceptions
from ovs_ext.flow_record import FlowRecord
from ovs_ext.openflow_stats import ofp13
from ovs_ext.openflow_stats.ofp13 import BadMatchCode, BadRequestCode, ErrorType

HEADER = struct.Struct("!BBHI")  # version, type, length, xid
MULTIPART = struct.Struct("!HH4x")  # type, flags (after the header)
FLOW_STATS_REQUEST = struct.Struct("!B3xII4xQQ")  # table, out_port, out_group, cookie, mask
FLOW_STATS_ENTRY = struct.Struct("!HBxIIHHHH4xQQQ")  # ofp_flow_stats up to the match
AGGREGATE_REPLY = struct.Struct("!QQI4x")
FEATURES_REPLY = struct.Struct("!QIBB2xII")
PORT = struct.Struct("!I4x6s2x16sIIIIIIII")
TABLE_FEATURES = struct.Struct("!HB5x32sQQII")  # ofp_table_features without properties
ERROR = struct.Struct("!HH")
OXM_HEADER = struct.Struct("!HBB")  # class, field << 1 | hasmask, payload length
MATCH_HEADER = struct.Struct("!HH")  # type, length (without padding)
OUTPUT_INSTRUCTION = struct.Struct("!HH4xHHIH6x")  # apply-actions holding one output
DESC_FIELDS = (("mfr", 256), ("hw", 256), ("sw", 256), ("serial", 32), ("dp", 256))
# OpenFlow 1.3 says an error carries "at least 64 bytes of the failed request";
# more helps a reader, but the error must itself fit in a message.
ERROR_DATA_MAX = 1024


class OpenFlowError(exceptions.FlexMigError):
    """A message the endpoint must answer with OFPT_ERROR (type, code)."""

    msg_fmt = "OpenFlow error %(err_type)s/%(code)s: %(reason)s"

    def __init__(self, err_type: int, code: int, reason: str) -> None:
        super().__init__(err_type=err_type, code=code, reason=reason)
        self.err_type = int(err_type)
        self.code = int(code)
        self.reason = reason


def bad_len(reason: str) -> OpenFlowError:
    return OpenFlowError(ErrorType.BAD_REQUEST, BadRequestCode.BAD_LEN, reason)


def _bad_match(code: BadMatchCode, reason: str) -> OpenFlowError:
    return OpenFlowError(ErrorType.BAD_MATCH, code, reason)


def _pad8(length: int) -> int:
    return (length + 7) // 8 * 8


# ---------------------------------------------------------------- framing


class Header(typing.NamedTuple):
    version: int
    msg_type: int
    length: int
    xid: int


def parse_header(data: bytes) -> Header:
    """The header at the start of ``data`` (at least 8 bytes)."""
    return Header(*HEADER.unpack_from(data))


def encode_message(
    msg_type: int, xid: int, body: bytes = b"", version: int = ofp13.OFP_VERSION
) -> bytes:
    length = ofp13.HEADER_LEN + len(body)
    if length > ofp13.MAX_MESSAGE_LEN:
        raise exceptions.InvalidInput(what="OpenFlow message", reason=f"{length} bytes")
    return HEADER.pack(version, msg_type, length, xid) + body


def encode_hello(versions: Iterable[int], xid: int = 0) -> bytes:
    """HELLO announcing ``versions`` with a version bitmap element."""
    bitmap = 0
    for version in versions:
        bitmap |= 1 << version
    element = struct.pack("!HHI", ofp13.OFPHET_VERSIONBITMAP, 8, bitmap)
    length = ofp13.HEADER_LEN + len(element)
    return HEADER.pack(bitmap.bit_length() - 1, ofp13.MsgType.HELLO, length, xid) + element


def decode_hello_versions(message: bytes) -> frozenset[int]:
    """Versions a peer's HELLO offers, as ``lib/vconn.c`` reads them.

    Without a bitmap element a HELLO offers its header version and every
    earlier one; a malformed element list falls back to that too, as OVS does.
    """
    header = parse_header(message)
    offered = frozenset(range(1, header.version + 1))
    offset = ofp13.HEADER_LEN
    while offset < header.length:
        if header.length - offset < 4:
            return offered
        elem_type, elem_len = struct.unpack_from("!HH", message, offset)
        if elem_len < 4 or offset + _pad8(elem_len) > header.length:
            return offered
        if elem_type == ofp13.OFPHET_VERSIONBITMAP and elem_len >= 8:
            (bitmap,) = struct.unpack_from("!I", message, offset + 4)
            bitmap &= ~1  # there is no version 0
            if bitmap:
                offered = frozenset(v for v in range(1, 32) if bitmap >> v & 1)
        offset += _pad8(elem_len)
    return offered


def encode_error(
    err_type: int, code: int, xid: int, data: bytes, version: int = ofp13.OFP_VERSION
) -> bytes:
    body = ERROR.pack(err_type, code) + data[:ERROR_DATA_MAX]
    return encode_message(ofp13.MsgType.ERROR, xid, body, version)


def decode_error(message: bytes) -> tuple[int, int, bytes]:
    """(type, code, data) of an OFPT_ERROR."""
    err_type, code = ERROR.unpack_from(message, ofp13.HEADER_LEN)
    return err_type, code, message[ofp13.HEADER_LEN + ERROR.size :]


# ---------------------------------------------------------------- match


@dataclasses.dataclass(frozen=True)
class OxmTlv:
    oxm_class: int
    field: int
    value: int
    mask: int | None  # None: exact


# FlowRecord match names -> (OXM field, payload bytes); the order is OVS's
# canonical one, so every prerequisite precedes the fields that need it.
RECORD_FIELDS: dict[str, tuple[ofp13.OxmField, int]] = {
    "in_port": (ofp13.OxmField.IN_PORT, 4),
    "eth_type": (ofp13.OxmField.ETH_TYPE, 2),
    "ip_proto": (ofp13.OxmField.IP_PROTO, 1),
    "ipv4_src": (ofp13.OxmField.IPV4_SRC, 4),
    "ipv4_dst": (ofp13.OxmField.IPV4_DST, 4),
    "tcp_src": (ofp13.OxmField.TCP_SRC, 2),
    "tcp_dst": (ofp13.OxmField.TCP_DST, 2),
    "udp_src": (ofp13.OxmField.UDP_SRC, 2),
    "udp_dst": (ofp13.OxmField.UDP_DST, 2),
}
FIELD_NAMES = {field: name for name, (field, _) in RECORD_FIELDS.items()}
ETH_TYPE_IPV4 = 0x0800
# Field -> (prerequisite field, required value), from the spec's table 12.
PREREQUISITES = {
    "ip_proto": ("eth_type", ETH_TYPE_IPV4),
    "ipv4_src": ("eth_type", ETH_TYPE_IPV4),
    "ipv4_dst": ("eth_type", ETH_TYPE_IPV4),
    "tcp_src": ("ip_proto", 6),
    "tcp_dst": ("ip_proto", 6),
    "udp_src": ("ip_proto", 17),
    "udp_dst": ("ip_proto", 17),
}


def decode_match(data: bytes, offset: int) -> tuple[tuple[OxmTlv, ...], int]:
    """The OXM match at ``offset``: its fields and its padded length."""
    if len(data) - offset < MATCH_HEADER.size:
        raise bad_len("message ends before its match")
    match_type, match_len = MATCH_HEADER.unpack_from(data, offset)
    if match_type != ofp13.OFPMT_OXM:
        raise _bad_match(BadMatchCode.BAD_TYPE, f"match type {match_type} is not OXM")
    if match_len < MATCH_HEADER.size or offset + _pad8(match_len) > len(data):
        raise _bad_match(BadMatchCode.BAD_LEN, f"match length {match_len} does not fit")
    fields: list[OxmTlv] = []
    position, end = offset + MATCH_HEADER.size, offset + match_len
    while position < end:
        tlv, position = _decode_oxm(data, position, end)
        if any((f.oxm_class, f.field) == (tlv.oxm_class, tlv.field) for f in fields):
            raise _bad_match(BadMatchCode.DUP_FIELD, f"field {tlv.field} appears twice")
        fields.append(tlv)
    return tuple(fields), _pad8(match_len)


def _decode_oxm(data: bytes, position: int, end: int) -> tuple[OxmTlv, int]:
    if end - position < OXM_HEADER.size:
        raise _bad_match(BadMatchCode.BAD_LEN, "truncated OXM header")
    oxm_class, field_and_mask, length = OXM_HEADER.unpack_from(data, position)
    field, has_mask = field_and_mask >> 1, field_and_mask & 1
    payload = position + OXM_HEADER.size
    if payload + length > end or length == 0 or (has_mask and length % 2):
        raise _bad_match(BadMatchCode.BAD_LEN, f"OXM field {field} length {length}")
    width = length // 2 if has_mask else length
    if oxm_class == ofp13.OFPXMC_OPENFLOW_BASIC:
        expected = ofp13.OXM_BASIC_LENGTHS.get(field)
        if expected is None:
            raise _bad_match(BadMatchCode.BAD_FIELD, f"unknown OXM field {field}")
        if width != expected:
            raise _bad_match(BadMatchCode.BAD_LEN, f"OXM field {field} length {length}")
    value = int.from_bytes(data[payload : payload + width], "big")
    mask = int.from_bytes(data[payload + width : payload + length], "big") if has_mask else None
    if mask is not None and value & ~mask:
        raise _bad_match(BadMatchCode.BAD_WILDCARDS, f"OXM field {field} value outside its mask")
    return OxmTlv(oxm_class, field, value, mask), payload + length


def match_value(name: str, value: int | str) -> int:
    """A FlowRecord match value as the integer its OXM field carries."""
    if name in ("ipv4_src", "ipv4_dst"):
        try:
            return int.from_bytes(socket.inet_pton(socket.AF_INET, str(value)), "big")
        except OSError as exc:
            raise exceptions.InvalidInput(
                what=f"match field {name}", reason=f"{value!r} is not an IPv4 address"
            ) from exc
    if isinstance(value, bool) or not isinstance(value, int):
        raise exceptions.InvalidInput(what=f"match field {name}", reason=f"{value!r}")
    return value


# Per field, precomputed (a dump encodes every flow's match each time, 100k
# of them at scale): name, width, largest value, prerequisite, OXM header.
_FieldSpec = tuple[str, int, int, "tuple[str, int] | None", bytes]
FIELD_SPECS: tuple[_FieldSpec, ...] = tuple(
    (
        name,
        width,
        0xFEFF if name == "in_port" else (1 << 8 * width) - 1,  # OFPP_MAX - 1 for ports
        PREREQUISITES.get(name),
        OXM_HEADER.pack(ofp13.OFPXMC_OPENFLOW_BASIC, field << 1, width),
    )
    for name, (field, width) in RECORD_FIELDS.items()
)
_KNOWN_FIELDS = frozenset(RECORD_FIELDS)
_PADDING = [bytes(n) for n in range(8)]


def _checked_fields(match: Mapping[str, int | str]) -> list[tuple[_FieldSpec, int]]:
    if not _KNOWN_FIELDS.issuperset(match):
        unknown = sorted(set(match) - _KNOWN_FIELDS)
        raise exceptions.InvalidInput(what="match", reason=f"unknown fields {unknown}")
    fields = []
    for spec in FIELD_SPECS:
        name, _, high, prerequisite, _ = spec
        if name not in match:
            continue
        value = match[name]
        number = value if type(value) is int else match_value(name, value)
        if not 0 <= number <= high:
            raise exceptions.InvalidInput(what=f"match field {name}", reason=f"{value!r}")
        if prerequisite is not None and match.get(prerequisite[0]) != prerequisite[1]:
            needed, needed_value = prerequisite
            raise exceptions.InvalidInput(
                what=f"match field {name}", reason=f"needs {needed}={needed_value:#x}"
            )
        fields.append((spec, number))
    return fields


def match_fields(match: Mapping[str, int | str]) -> dict[str, int]:
    """A FlowRecord match validated, as the integers its OXM fields carry;
    raises InvalidInput naming the bad field."""
    return {spec[0]: number for spec, number in _checked_fields(match)}


def encode_match(match: Mapping[str, int | str]) -> bytes:
    """An OXM ``ofp_match`` (padded) for a FlowRecord's match (validated)."""
    body = b"".join(
        spec[4] + number.to_bytes(spec[1], "big") for spec, number in _checked_fields(match)
    )
    length = MATCH_HEADER.size + len(body)
    return MATCH_HEADER.pack(ofp13.OFPMT_OXM, length) + body + _PADDING[-length % 8]


# ---------------------------------------------------------------- records

UINT64_MAX = (1 << 64) - 1


def check_counters(record: FlowRecord) -> None:
    """Raise InvalidInput if a record's numbers do not fit OpenFlow's fields."""
    checks = (
        ("table_id", record.table_id, 254),
        ("priority", record.priority, 0xFFFF),
        ("cookie", record.cookie, UINT64_MAX),
        ("packets", record.packets, UINT64_MAX),
        ("bytes", record.bytes, UINT64_MAX),
    )
    for what, value, high in checks:
        if type(value) is not int or not 0 <= value <= high:
            raise exceptions.InvalidInput(what=what, reason=f"{value!r} not in 0..{high}")
    out_port = record.out_port
    if out_port is not None and (type(out_port) is not int or not 1 <= out_port <= 0xFEFF):
        raise exceptions.InvalidInput(what="out_port", reason=f"{out_port!r} not in 1..65279")
    duration = record.duration_s
    if type(duration) not in (int, float) or not 0 <= duration < 2**32 - 1:
        raise exceptions.InvalidInput(what="duration_s", reason=f"{duration!r}")


def check_record(record: FlowRecord) -> None:
    """Raise InvalidInput if ``record`` cannot be shown as an OpenFlow flow."""
    check_counters(record)
    _checked_fields(record.match)


@functools.lru_cache(maxsize=4096)
def encode_output_instruction(out_port: int | None) -> bytes:
    port = ofp13.OFPP_NORMAL if out_port is None else out_port
    return OUTPUT_INSTRUCTION.pack(ofp13.OFPIT_APPLY_ACTIONS, 24, ofp13.OFPAT_OUTPUT, 16, port, 0)


def split_duration(duration_s: float) -> tuple[int, int]:
    """(duration_sec, duration_nsec) as flow statistics carry a duration."""
    # Rounded, not truncated: 12.345 s must print as 12.345s, not 12.344999999s.
    seconds, nanoseconds = divmod(round(duration_s * 1e9), 1_000_000_000)
    return int(seconds), int(nanoseconds)


def encode_flow_stats_entry(record: FlowRecord) -> bytes:
    """One ``ofp_flow_stats``; InvalidInput if the record cannot be shown."""
    check_counters(record)
    match = encode_match(record.match)
    instructions = encode_output_instruction(record.out_port)
    seconds, nanoseconds = split_duration(record.duration_s)
    length = FLOW_STATS_ENTRY.size + len(match) + len(instructions)
    head = FLOW_STATS_ENTRY.pack(
        length, record.table_id, seconds, nanoseconds, record.priority,
        0, 0, 0, record.cookie, record.packets, record.bytes,
    )  # fmt: skip
    return head + match + instructions


# ---------------------------------------------------------------- multipart


@dataclasses.dataclass(frozen=True)
class FlowStatsRequest:
    """The selection an OFPMP_FLOW or OFPMP_AGGREGATE request asks for."""

    table_id: int = ofp13.OFPTT_ALL
    out_port: int = ofp13.OFPP_ANY
    out_group: int = ofp13.OFPG_ANY
    cookie: int = 0
    cookie_mask: int = 0
    match: tuple[OxmTlv, ...] = ()


def decode_multipart_header(message: bytes) -> tuple[int, int]:
    """(multipart type, flags) of a multipart request or reply."""
    if len(message) < ofp13.MULTIPART_HEADER_LEN:
        raise bad_len(f"multipart message of {len(message)} bytes")
    return MULTIPART.unpack_from(message, ofp13.HEADER_LEN)


def decode_flow_stats_request(message: bytes) -> FlowStatsRequest:
    body = ofp13.MULTIPART_HEADER_LEN
    if len(message) < body + FLOW_STATS_REQUEST.size + MATCH_HEADER.size:
        raise bad_len(f"flow statistics request of {len(message)} bytes")
    table_id, out_port, out_group, cookie, cookie_mask = FLOW_STATS_REQUEST.unpack_from(
        message, body
    )
    match_at = body + FLOW_STATS_REQUEST.size
    match, match_len = decode_match(message, match_at)
    if match_at + match_len != len(message):
        raise bad_len("bytes after the match of a flow statistics request")
    return FlowStatsRequest(table_id, out_port, out_group, cookie, cookie_mask, match)


def encode_multipart_request(mp_type: int, xid: int, body: bytes = b"", flags: int = 0) -> bytes:
    return encode_message(
        ofp13.MsgType.MULTIPART_REQUEST, xid, MULTIPART.pack(mp_type, flags) + body
    )


def encode_flow_stats_request(
    request: FlowStatsRequest, xid: int, aggregate: bool = False
) -> bytes:
    """A controller's request (for tests and tools talking to the endpoint)."""
    body = FLOW_STATS_REQUEST.pack(
        request.table_id, request.out_port, request.out_group, request.cookie, request.cookie_mask
    )
    tlvs = bytearray()
    for tlv in request.match:
        width = max(1, (max(tlv.value, tlv.mask or 0).bit_length() + 7) // 8)
        if tlv.oxm_class == ofp13.OFPXMC_OPENFLOW_BASIC:
            width = ofp13.OXM_BASIC_LENGTHS[tlv.field]
        has_mask = tlv.mask is not None
        tlvs += OXM_HEADER.pack(tlv.oxm_class, tlv.field << 1 | has_mask, width * (1 + has_mask))
        tlvs += tlv.value.to_bytes(width, "big")
        if has_mask:
            tlvs += tlv.mask.to_bytes(width, "big")
    length = MATCH_HEADER.size + len(tlvs)
    body += MATCH_HEADER.pack(ofp13.OFPMT_OXM, length) + bytes(tlvs) + bytes(_pad8(length) - length)
    mp_type = ofp13.MultipartType.AGGREGATE if aggregate else ofp13.MultipartType.FLOW
    return encode_multipart_request(mp_type, xid, body)


def encode_multipart_replies(mp_type: int, xid: int, parts: Iterable[bytes]) -> Iterator[bytes]:
    """Reply messages holding ``parts``, each under 64 KiB, all but the last
    flagged OFPMPF_REPLY_MORE.  Lazy, so a large table is encoded as the
    client reads it."""
    limit = ofp13.MAX_MESSAGE_LEN - ofp13.MULTIPART_HEADER_LEN
    for flags, chunk in chunk_parts(parts, limit):
        body = MULTIPART.pack(mp_type, flags) + b"".join(chunk)
        yield encode_message(ofp13.MsgType.MULTIPART_REPLY, xid, body)


def chunk_parts(parts: Iterable[bytes], limit: int) -> Iterator[tuple[int, list[bytes]]]:
    """Group ``parts`` into chunks of at most ``limit`` bytes: (flags, chunk),
    flags being REPLY_MORE (1 in every version) on all but the last chunk,
    which is yielded even when empty (a reply with nothing selected)."""
    chunk: list[bytes] = []
    size = 0
    for part in parts:
        if size + len(part) > limit and chunk:
            yield ofp13.OFPMPF_REPLY_MORE, chunk
            chunk, size = [], 0
        chunk.append(part)
        size += len(part)
    yield 0, chunk


def encode_aggregate_body(packets: int, byte_count: int, flows: int) -> bytes:
    return AGGREGATE_REPLY.pack(packets % 2**64, byte_count % 2**64, flows)


def encode_desc_body(descriptions: Mapping[str, str]) -> bytes:
    """``ofp_desc``: fixed-width NUL-padded strings (mfr, hw, sw, serial, dp)."""
    body = bytearray()
    for key, width in DESC_FIELDS:
        text = descriptions.get(key, "").encode("utf-8", "replace")[: width - 1]
        body += text + bytes(width - len(text))
    return bytes(body)


def encode_port(port_no: int, name: str) -> bytes:
    """``ofp_port`` for a port name map (no address, state or speed to report)."""
    raw_name = name.encode("utf-8", "replace")[:15]
    return PORT.pack(port_no, bytes(6), raw_name, 0, 0, 0, 0, 0, 0, 0, 0)


def _table_feature_property(prop_type: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("!HH", prop_type, length) + payload + bytes(_pad8(length) - length)


def encode_table_features(table_id: int) -> bytes:
    """``ofp_table_features`` of a table of these flows: no name, what they
    match on, one apply-actions output.  OVS requires all eight properties
    OpenFlow 1.3 calls required, and rejects an empty reply."""
    oxm_ids = b"".join(
        OXM_HEADER.pack(ofp13.OFPXMC_OPENFLOW_BASIC, field << 1, width)
        for field, width in RECORD_FIELDS.values()
    )
    properties = b"".join(
        (
            _table_feature_property(0, struct.pack("!HH", ofp13.OFPIT_APPLY_ACTIONS, 4)),
            _table_feature_property(2, b""),  # next tables: none
            _table_feature_property(4, b""),  # write actions: none
            _table_feature_property(6, struct.pack("!HH", ofp13.OFPAT_OUTPUT, 4)),
            _table_feature_property(8, oxm_ids),  # match
            _table_feature_property(10, oxm_ids),  # wildcards
            _table_feature_property(12, b""),  # write set-field: none
            _table_feature_property(14, b""),  # apply set-field: none
        )
    )
    length = TABLE_FEATURES.size + len(properties)
    return TABLE_FEATURES.pack(length, table_id, b"", 0, 0, 0, 0xFFFFFFFF) + properties


def encode_features_reply(xid: int, datapath_id: int, n_tables: int) -> bytes:
    body = FEATURES_REPLY.pack(datapath_id, 0, n_tables, 0, ofp13.OFPC_FLOW_STATS, 0)
    return encode_message(ofp13.MsgType.FEATURES_REPLY, xid, body)


# ---------------------------------------------------------------- reply decoding


@dataclasses.dataclass(frozen=True)
class FlowStatsEntry:
    """A decoded ``ofp_flow_stats``, for tests and for reading a dump back."""

    table_id: int
    duration_sec: int
    duration_nsec: int
    priority: int
    cookie: int
    packets: int
    bytes: int
    match: tuple[OxmTlv, ...]
    instructions: bytes


def decode_flow_stats_entries(message: bytes) -> list[FlowStatsEntry]:
    """Every entry of one OFPMP_FLOW reply message."""
    entries = []
    offset = ofp13.MULTIPART_HEADER_LEN
    while offset < len(message):
        if len(message) - offset < FLOW_STATS_ENTRY.size:
            raise bad_len("truncated flow statistics entry")
        fields = FLOW_STATS_ENTRY.unpack_from(message, offset)
        length = fields[0]
        if length < FLOW_STATS_ENTRY.size or offset + length > len(message):
            raise bad_len(f"flow statistics entry length {length}")
        match, match_len = decode_match(message, offset + FLOW_STATS_ENTRY.size)
        instructions_at = offset + FLOW_STATS_ENTRY.size + match_len
        entries.append(
            FlowStatsEntry(
                table_id=fields[1], duration_sec=fields[2], duration_nsec=fields[3],
                priority=fields[4], cookie=fields[8], packets=fields[9], bytes=fields[10],
                match=match, instructions=message[instructions_at : offset + length],
            )
        )  # fmt: skip
        offset += length
    return entries
