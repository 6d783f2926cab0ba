"""OpenFlow codec of the statistics endpoint: round trips and malformed input."""

from __future__ import annotations

import struct

import pytest

from flexmig import exceptions
from ovs_ext.flow_record import FlowRecord
from ovs_ext.openflow_stats import codec, codec10, ofp13, selection
from ovs_ext.openflow_stats.codec import FlowStatsRequest, OpenFlowError, OxmTlv
from ovs_ext.openflow_stats.ofp13 import BadMatchCode, BadRequestCode, ErrorType, OxmField

BASIC = ofp13.OFPXMC_OPENFLOW_BASIC
TCP_MATCH = {
    "in_port": 3,
    "eth_type": 0x0800,
    "ip_proto": 6,
    "ipv4_src": "10.0.0.1",
    "ipv4_dst": "10.0.0.2",
    "tcp_src": 40000,
    "tcp_dst": 5201,
}
UDP_MATCH = {"eth_type": 0x0800, "ip_proto": 17, "ipv4_dst": "10.0.1.9", "udp_dst": 53}


def record(match=None, **kwargs) -> FlowRecord:
    values = dict(table_id=0, priority=100, cookie=0x5, packets=10, bytes=1000, duration_s=1.5)
    values.update(kwargs)
    return FlowRecord(match=TCP_MATCH if match is None else match, **values)


def tlv(field, value, mask=None) -> OxmTlv:
    return OxmTlv(BASIC, field, value, mask)


def oxm(field: int, payload: bytes, has_mask: bool = False, oxm_class: int = BASIC) -> bytes:
    return struct.pack("!HBB", oxm_class, field << 1 | has_mask, len(payload)) + payload


def match_bytes(*tlvs: bytes, match_type: int = ofp13.OFPMT_OXM) -> bytes:
    body = b"".join(tlvs)
    length = 4 + len(body)
    return struct.pack("!HH", match_type, length) + body + bytes(-length % 8)


def expect_error(err_type, code):
    return pytest.raises(OpenFlowError, match=rf"OpenFlow error {int(err_type)}/{int(code)}:")


# ---------------------------------------------------------------- hello


def test_hello_carries_a_version_bitmap_of_what_is_served():
    hello = codec.encode_hello({1, 4}, xid=7)
    header = codec.parse_header(hello)
    assert (header.version, header.msg_type, header.length, header.xid) == (4, 0, 16, 7)
    assert codec.decode_hello_versions(hello) == {1, 4}


def test_hello_without_bitmap_offers_its_version_and_all_earlier_ones():
    # ovs-ofctl's hello for "1.0 to 1.5": header version 6, no element.
    hello = codec.HEADER.pack(6, 0, 8, 1)
    assert codec.decode_hello_versions(hello) == {1, 2, 3, 4, 5, 6}


def test_hello_with_a_malformed_element_falls_back_to_its_version():
    hello = codec.HEADER.pack(4, 0, 12, 1) + struct.pack("!HH", 1, 40)  # element overruns
    assert codec.decode_hello_versions(hello) == {1, 2, 3, 4}


def test_error_carries_type_code_and_the_offending_bytes():
    offending = bytes(range(200)) * 10
    error = codec.encode_error(ErrorType.BAD_REQUEST, BadRequestCode.BAD_TYPE, 9, offending)
    assert codec.parse_header(error).xid == 9
    err_type, code, data = codec.decode_error(error)
    assert (err_type, code) == (1, 1)
    assert data == offending[: codec.ERROR_DATA_MAX]


# ---------------------------------------------------------------- match


def test_match_round_trip_keeps_every_field_in_prerequisite_order():
    fields, padded = codec.decode_match(codec.encode_match(TCP_MATCH), 0)
    assert padded % 8 == 0
    assert fields == (
        tlv(OxmField.IN_PORT, 3),
        tlv(OxmField.ETH_TYPE, 0x0800),
        tlv(OxmField.IP_PROTO, 6),
        tlv(OxmField.IPV4_SRC, 0x0A000001),
        tlv(OxmField.IPV4_DST, 0x0A000002),
        tlv(OxmField.TCP_SRC, 40000),
        tlv(OxmField.TCP_DST, 5201),
    )


def test_empty_match_is_eight_bytes():
    assert codec.encode_match({}) == struct.pack("!HH4x", 1, 4)
    assert codec.decode_match(codec.encode_match({}), 0) == ((), 8)


def test_masked_field_decodes_value_and_mask():
    raw = match_bytes(oxm(OxmField.IPV4_SRC, bytes([10, 0, 0, 0, 255, 0, 0, 0]), has_mask=True))
    (field,), _ = codec.decode_match(raw, 0)
    assert field == tlv(OxmField.IPV4_SRC, 0x0A000000, 0xFF000000)


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (match_bytes(match_type=0), BadMatchCode.BAD_TYPE),  # OFPMT_STANDARD
        (struct.pack("!HH", 1, 40) + bytes(4), BadMatchCode.BAD_LEN),  # overruns
        (struct.pack("!HH", 1, 2) + bytes(4), BadMatchCode.BAD_LEN),  # shorter than header
        (match_bytes(b"\x80\x00"), BadMatchCode.BAD_LEN),  # truncated OXM header
        (match_bytes(oxm(OxmField.IN_PORT, b"\x00\x01")), BadMatchCode.BAD_LEN),  # 2 not 4
        (match_bytes(oxm(45, b"\x00")), BadMatchCode.BAD_FIELD),  # not an OF1.3 field
        (match_bytes(oxm(5, b"\x08\x00"), oxm(5, b"\x08\x00")), BadMatchCode.DUP_FIELD),
        (
            match_bytes(oxm(OxmField.IP_PROTO, b"\x06\x00", has_mask=True)),
            BadMatchCode.BAD_WILDCARDS,
        ),
        (match_bytes(oxm(OxmField.IP_PROTO, b"\x06", has_mask=True)), BadMatchCode.BAD_LEN),
    ],
)
def test_malformed_match_is_a_bad_match_error(raw, code):
    with expect_error(ErrorType.BAD_MATCH, code):
        codec.decode_match(raw, 0)


def test_experimenter_class_fields_are_kept_for_selection():
    raw = match_bytes(oxm(0, b"\x00\x00\x00\x07", oxm_class=0x0001))  # NXM_NX_REG0
    (field,), _ = codec.decode_match(raw, 0)
    assert field == OxmTlv(0x0001, 0, 7, None)


# ---------------------------------------------------------------- records


@pytest.mark.parametrize(
    ("bad", "what"),
    [
        (record(match={"ipv4_src": "10.0.0.1"}), "needs eth_type"),
        (record(match={"eth_type": 0x800, "ip_proto": 17, "tcp_dst": 1}), "needs ip_proto"),
        (record(match={"vlan_vid": 1}), "unknown fields"),
        (record(match={"in_port": 0xFF00}), "in_port"),
        (record(match={"eth_type": 0x800, "ipv4_dst": "10.0.0.300"}), "ipv4_dst"),
        (record(out_port=0), "out_port"),
        (record(table_id=255), "table_id"),
        (record(packets=-1), "packets"),
        (record(duration_s=-1.0), "duration_s"),
        (record(duration_s=None), "duration_s"),
        (record(packets=None), "packets"),
        (record(priority=True), "priority"),
        (record(out_port="2"), "out_port"),
        (record(match={"in_port": [1]}), r"in_port: \[1\]"),
        (record(match={"in_port": "1"}), "in_port"),
    ],
)
def test_records_that_cannot_be_shown_are_rejected_with_the_reason(bad, what):
    with pytest.raises(exceptions.InvalidInput, match=what):
        codec.check_record(bad)


def test_flow_stats_entry_round_trip():
    rec = record(duration_s=12.25, out_port=7, packets=2**40, bytes=2**50 + 3, cookie=2**63)
    codec.check_record(rec)
    message = next(codec.encode_multipart_replies(1, 3, [codec.encode_flow_stats_entry(rec)]))
    (entry,) = codec.decode_flow_stats_entries(message)
    assert (entry.duration_sec, entry.duration_nsec) == (12, 250_000_000)
    assert (entry.priority, entry.cookie, entry.packets, entry.bytes) == (
        100, 2**63, 2**40, 2**50 + 3,
    )  # fmt: skip
    assert entry.match == codec.decode_match(codec.encode_match(TCP_MATCH), 0)[0]
    # apply-actions (4) of length 24 holding output (0, len 16) to port 7
    assert entry.instructions == struct.pack("!HH4xHHIH6x", 4, 24, 0, 16, 7, 0)


def test_normal_action_when_the_record_has_no_out_port():
    assert codec.encode_output_instruction(None)[12:16] == struct.pack("!I", ofp13.OFPP_NORMAL)


def test_large_tables_are_split_into_messages_flagged_more():
    entries = [codec.encode_flow_stats_entry(record(cookie=i)) for i in range(10_000)]
    messages = list(codec.encode_multipart_replies(ofp13.MultipartType.FLOW, 5, entries))
    assert len(messages) > 1
    assert all(len(m) <= ofp13.MAX_MESSAGE_LEN for m in messages)
    flags = [codec.decode_multipart_header(m)[1] for m in messages]
    assert flags == [ofp13.OFPMPF_REPLY_MORE] * (len(messages) - 1) + [0]
    cookies = [e.cookie for m in messages for e in codec.decode_flow_stats_entries(m)]
    assert cookies == list(range(10_000))


def test_nothing_selected_is_one_empty_final_reply():
    (message,) = codec.encode_multipart_replies(ofp13.MultipartType.FLOW, 5, [])
    assert len(message) == ofp13.MULTIPART_HEADER_LEN
    assert codec.decode_multipart_header(message) == (1, 0)


# ---------------------------------------------------------------- requests


def test_flow_stats_request_round_trip():
    request = FlowStatsRequest(
        table_id=3, out_port=2, out_group=ofp13.OFPG_ANY, cookie=0x50, cookie_mask=0xF0,
        match=(tlv(OxmField.ETH_TYPE, 0x800), tlv(OxmField.IPV4_SRC, 0x0A000000, 0xFF000000)),
    )  # fmt: skip
    message = codec.encode_flow_stats_request(request, xid=11)
    assert codec.decode_flow_stats_request(message) == request


def test_flow_stats_request_with_trailing_bytes_is_bad_len():
    message = bytearray(codec.encode_flow_stats_request(FlowStatsRequest(), xid=1) + bytes(8))
    struct.pack_into("!H", message, 2, len(message))
    with expect_error(ErrorType.BAD_REQUEST, BadRequestCode.BAD_LEN):
        codec.decode_flow_stats_request(bytes(message))


def test_truncated_flow_stats_request_is_bad_len():
    message = codec.encode_flow_stats_request(FlowStatsRequest(), xid=1)[:30]
    with expect_error(ErrorType.BAD_REQUEST, BadRequestCode.BAD_LEN):
        codec.decode_flow_stats_request(message)


# ---------------------------------------------------------------- OpenFlow 1.0


def test_of10_match_round_trip_through_the_wildcards():
    raw = codec10.encode_match(TCP_MATCH)
    assert len(raw) == 40
    assert set(codec10.decode_match(raw)) == set(
        codec.decode_match(codec.encode_match(TCP_MATCH), 0)[0]
    )
    udp = set(codec10.decode_match(codec10.encode_match(UDP_MATCH)))
    assert tlv(OxmField.UDP_DST, 53) in udp and tlv(OxmField.IPV4_DST, 0x0A000109) in udp


def test_of10_fully_wildcarded_match_selects_everything():
    raw = codec10.MATCH.pack(codec10.WILDCARD_ALL, 0, bytes(6), bytes(6), 0, 0, 0, 0, 0, 0, 0, 0, 0)
    assert codec10.decode_match(raw) == ()


def test_of10_address_prefix_becomes_a_mask():
    wildcards = codec10.WILDCARD_ALL & ~(0x3F << codec10.NW_SRC_SHIFT) | 8 << codec10.NW_SRC_SHIFT
    raw = codec10.MATCH.pack(wildcards, 0, bytes(6), bytes(6), 0, 0, 0, 0, 0, 0x0A0000FF, 0, 0, 0)
    assert codec10.decode_match(raw) == (tlv(OxmField.IPV4_SRC, 0x0A000000, 0xFFFFFF00),)


def test_of10_request_maps_reserved_ports_and_checks_its_length():
    match = codec10.encode_match({})
    request = codec10.decode_flow_stats_request(
        codec10.encode_flow_stats_request(match, 0xFF, codec10.OFPP_NONE, xid=1)
    )
    assert (request.table_id, request.out_port) == (0xFF, ofp13.OFPP_ANY)
    normal = codec10.encode_flow_stats_request(match, 0, codec10.OFPP_NORMAL, xid=1)
    assert codec10.decode_flow_stats_request(normal).out_port == ofp13.OFPP_NORMAL
    with expect_error(ErrorType.BAD_REQUEST, BadRequestCode.BAD_LEN):
        codec10.decode_flow_stats_request(normal[:-2])


def test_of10_entry_carries_counters_and_output_action():
    entry = codec10.encode_flow_stats_entry(record(out_port=4, packets=77, bytes=8800))
    length, table_id = struct.unpack_from("!HB", entry)
    assert (length, table_id) == (len(entry), 0) and length == 96
    packets, byte_count = struct.unpack_from("!QQ", entry, 72)
    assert (packets, byte_count) == (77, 8800)
    assert entry[88:] == struct.pack("!HHHH", 0, 8, 4, 0)


# ---------------------------------------------------------------- selection


@pytest.mark.parametrize(
    ("request_", "selected"),
    [
        (FlowStatsRequest(), {"tcp", "udp", "normal"}),
        (FlowStatsRequest(table_id=1), {"udp"}),
        (FlowStatsRequest(cookie=0x10, cookie_mask=0xF0), {"udp", "normal"}),
        (FlowStatsRequest(out_port=9), {"tcp"}),
        (FlowStatsRequest(out_port=ofp13.OFPP_NORMAL), {"normal"}),
        (FlowStatsRequest(out_group=1), set()),
        (FlowStatsRequest(match=(tlv(OxmField.IP_PROTO, 6),)), {"tcp"}),
        (FlowStatsRequest(match=(tlv(OxmField.IPV4_DST, 0x0A000000, 0xFF000000),)), {"tcp", "udp"}),
        (FlowStatsRequest(match=(tlv(OxmField.TCP_DST, 5202),)), set()),
        (FlowStatsRequest(match=(tlv(3, 0),)), set()),  # eth_dst: no record matches on it
    ],
)
def test_selection_is_openflow_non_strict(request_, selected):
    records = {
        "tcp": record(TCP_MATCH, out_port=9, cookie=0x05),
        "udp": record(UDP_MATCH, table_id=1, out_port=2, cookie=0x15),
        "normal": record({}, priority=0, cookie=0x1F),
    }
    chosen = selection.select(request_, records.values())
    assert {name for name, rec in records.items() if rec in chosen} == selected
