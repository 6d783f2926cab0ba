"""One connection's OpenFlow protocol, driven with bytes (no sockets)."""

from __future__ import annotations

import struct

import pytest

from ovs_ext.flow_record import FlowRecord
from ovs_ext.openflow_stats import codec, codec10, ofp13
from ovs_ext.openflow_stats.codec import FlowStatsRequest, OxmTlv
from ovs_ext.openflow_stats.ofp13 import MsgType
from ovs_ext.openflow_stats.session import Session

TCP = {"in_port": 1, "eth_type": 0x800, "ip_proto": 6, "ipv4_dst": "10.0.0.2", "tcp_dst": 5201}
RECORDS = [
    FlowRecord(0, 100, 1, TCP, packets=5, bytes=500, duration_s=2.0, out_port=2),
    FlowRecord(0, 0, 2, {}, packets=7, bytes=700, duration_s=9.0),
]


def split(data: bytes) -> list[bytes]:
    messages = []
    while data:
        length = codec.parse_header(data).length
        messages.append(data[:length])
        data = data[length:]
    return messages


def exchange(session: Session, *messages: bytes) -> list[bytes]:
    for message in messages:
        session.feed(message)
    return split(session.pull_output(1 << 30))


def connected(version: int = 4, records=RECORDS, **kwargs) -> Session:
    session = Session(lambda: records, **kwargs)
    hello = codec.encode_hello({version})
    (our_hello,) = exchange(session, hello)
    assert codec.decode_hello_versions(our_hello) == {1, 4}
    return session


def error_of(message: bytes) -> tuple[int, int, bytes]:
    assert codec.parse_header(message).msg_type == MsgType.ERROR
    return codec.decode_error(message)


def echo(xid: int, version: int = 4) -> bytes:
    return codec.encode_message(MsgType.ECHO_REQUEST, xid, b"ping", version)


def test_default_ovs_ofctl_hello_negotiates_openflow_13():
    session = Session(lambda: RECORDS)
    replies = exchange(session, codec.HEADER.pack(6, 0, 8, 1), echo(2))
    assert [codec.parse_header(m).msg_type for m in replies] == [MsgType.HELLO, MsgType.ECHO_REPLY]
    assert codec.parse_header(replies[1]).version == 4 and replies[1][8:] == b"ping"


def test_openflow_10_hello_negotiates_10():
    session = connected(version=1)
    (reply,) = exchange(session, echo(3, version=1))
    assert codec.parse_header(reply)[:2] == (1, codec10.MsgType.ECHO_REPLY)


def test_no_common_version_fails_hello_and_closes():
    session = Session(lambda: RECORDS)
    replies = exchange(session, codec.encode_hello({2, 3}), echo(2))
    assert len(replies) == 2  # our HELLO, then the error; the echo is never answered
    err_type, code, text = error_of(replies[1])
    assert (err_type, code) == (ofp13.ErrorType.HELLO_FAILED, ofp13.HelloFailedCode.INCOMPATIBLE)
    assert b"no common versions" in text
    assert session.closing and not session.wants_input()


def test_message_before_hello_fails_and_closes():
    session = Session(lambda: RECORDS)
    replies = exchange(session, echo(5))
    assert error_of(replies[1])[:2] == (0, 0)
    assert session.closing


def test_header_shorter_than_itself_is_bad_len_and_closes():
    session = connected()
    bad = codec.HEADER.pack(4, MsgType.ECHO_REQUEST, 4, 77)
    (reply,) = exchange(session, bad + echo(78))
    err_type, code, data = error_of(reply)
    assert (err_type, code, data) == (1, ofp13.BadRequestCode.BAD_LEN, bad)
    assert codec.parse_header(reply).xid == 77
    assert session.closing


def test_partial_message_waits_for_the_rest():
    session = connected()
    message = echo(9)
    assert exchange(session, message[:5]) == []
    assert session.wants_input()
    (reply,) = exchange(session, message[5:])
    assert codec.parse_header(reply).xid == 9


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (codec.encode_message(200, 1), (1, ofp13.BadRequestCode.BAD_TYPE)),
        (codec.encode_message(MsgType.FEATURES_REPLY, 1, bytes(24)), (1, 1)),
        (codec.encode_message(MsgType.EXPERIMENTER, 1, bytes(8)), (1, 3)),
        (codec.encode_message(MsgType.BARRIER_REQUEST, 1, b"xx"), (1, 6)),
        (codec.encode_message(MsgType.ECHO_REQUEST, 1, b"", version=1), (1, 0)),
        (codec.encode_multipart_request(ofp13.MultipartType.METER, 1), (1, 2)),
        (codec.encode_multipart_request(ofp13.MultipartType.DESC, 1, flags=1), (1, 2)),
        (codec.encode_multipart_request(ofp13.MultipartType.DESC, 1, b"12345678"), (1, 6)),
        (codec.encode_multipart_request(ofp13.MultipartType.FLOW, 1, bytes(8)), (1, 6)),
        (codec.encode_message(MsgType.MULTIPART_REQUEST, 1, b"\x00"), (1, 6)),
    ],
    ids=[
        "unknown-type",
        "switch-message",
        "experimenter",
        "barrier-with-body",
        "wrong-version",
        "unserved-multipart",
        "req-more",
        "desc-with-body",
        "short-flow-request",
        "short-multipart",
    ],
)
def test_bad_requests_get_their_error_and_the_connection_goes_on(message, expected):
    session = connected()
    replies = exchange(session, message, echo(50))
    assert error_of(replies[0])[:2] == expected
    assert error_of(replies[0])[2] == message
    assert codec.parse_header(replies[1])[1:] == (MsgType.ECHO_REPLY, 12, 50)
    assert not session.closing


@pytest.mark.parametrize(
    ("msg_type", "expected"),
    [
        (MsgType.FLOW_MOD, (ofp13.ErrorType.FLOW_MOD_FAILED, ofp13.FlowModFailedCode.EPERM)),
        (MsgType.GROUP_MOD, (1, ofp13.BadRequestCode.EPERM)),
        (MsgType.PACKET_OUT, (1, ofp13.BadRequestCode.EPERM)),
        (MsgType.SET_CONFIG, (1, ofp13.BadRequestCode.EPERM)),
        (MsgType.ROLE_REQUEST, (1, ofp13.BadRequestCode.EPERM)),
    ],
)
def test_state_changing_messages_are_refused_and_change_nothing(msg_type, expected):
    records = list(RECORDS)
    session = connected(records=records)
    (reply,) = exchange(session, codec.encode_message(msg_type, 4, bytes(48)))
    assert error_of(reply)[:2] == expected
    assert records == RECORDS


def test_of10_flow_mod_is_refused_with_the_10_error_numbers():
    session = connected(version=1)
    (reply,) = exchange(session, codec.encode_message(codec10.MsgType.FLOW_MOD, 4, bytes(64), 1))
    assert codec.parse_header(reply).version == 1
    assert error_of(reply)[:2] == (codec10.FLOW_MOD_FAILED, codec10.FLOW_MOD_FAILED_EPERM)


def test_flow_dump_honours_the_request_match():
    session = connected()
    request = FlowStatsRequest(match=(OxmTlv(ofp13.OFPXMC_OPENFLOW_BASIC, 14, 5201, None),))
    (reply,) = exchange(session, codec.encode_flow_stats_request(request, xid=21))
    (entry,) = codec.decode_flow_stats_entries(reply)
    assert (entry.cookie, entry.packets, entry.bytes, entry.duration_sec) == (1, 5, 500, 2)


def test_aggregate_sums_the_selected_flows():
    session = connected()
    message = codec.encode_flow_stats_request(FlowStatsRequest(), xid=22, aggregate=True)
    (reply,) = exchange(session, message)
    assert struct.unpack_from("!QQI", reply, 16) == (12, 1200, 2)


@pytest.mark.parametrize("match", [{"tcp_dst": 80}, {"in_port": [1]}, {"ipv4_dst": "::1"}])
def test_a_record_that_cannot_be_shown_does_not_hide_the_others(match):
    bad = FlowRecord(0, 1, 3, match, packets=1, bytes=1, duration_s=0)
    session = connected(records=[bad, *RECORDS])
    (reply,) = exchange(session, codec.encode_flow_stats_request(FlowStatsRequest(), xid=1))
    assert [e.cookie for e in codec.decode_flow_stats_entries(reply)] == [1, 2]
    filtered = FlowStatsRequest(match=(OxmTlv(ofp13.OFPXMC_OPENFLOW_BASIC, 0, 1, None),))
    (reply,) = exchange(session, codec.encode_flow_stats_request(filtered, xid=2))
    assert [e.cookie for e in codec.decode_flow_stats_entries(reply)] == [1]


def test_large_dump_is_produced_as_the_reader_takes_it():
    many = [FlowRecord(0, 1, i, TCP, 1, 1, 1.0, 2) for i in range(20_000)]
    session = connected(records=many)
    session.feed(codec.encode_flow_stats_request(FlowStatsRequest(), xid=1))
    first = session.pull_output(1)
    assert len(split(first)) == 1 and codec.decode_multipart_header(first)[1] == 1
    assert not session.wants_input()  # still answering: no new requests read
    rest = split(session.pull_output(1 << 30))
    cookies = [e.cookie for m in [first, *rest] for e in codec.decode_flow_stats_entries(m)]
    assert cookies == list(range(20_000))
    assert session.wants_input()


def test_port_desc_and_table_features_and_desc_are_answered():
    session = connected(port_names=lambda: {1: "vm1-tap", 2: "phy0", 0xFFFE: "LOCAL"})
    ports, tables, desc = exchange(
        session,
        codec.encode_multipart_request(ofp13.MultipartType.PORT_DESC, 1),
        codec.encode_multipart_request(ofp13.MultipartType.TABLE_FEATURES, 2),
        codec.encode_multipart_request(ofp13.MultipartType.DESC, 3),
    )
    assert len(ports) == 16 + 2 * 64 and ports[16 + 16 : 16 + 23] == b"vm1-tap"
    assert codec.decode_multipart_header(tables) == (ofp13.MultipartType.TABLE_FEATURES, 0)
    assert struct.unpack_from("!HB", tables, 16)[1] == 0
    assert desc[16:23] == b"FlexMig" and len(desc) == 16 + 1056


def test_of10_features_reply_lists_the_ports():
    session = connected(version=1, port_names=lambda: {3: "vm3-tap"})
    (reply,) = exchange(session, codec.encode_message(codec10.MsgType.FEATURES_REQUEST, 1, b"", 1))
    assert codec.parse_header(reply)[:3] == (1, codec10.MsgType.FEATURES_REPLY, 32 + 48)
    assert reply[32:34] == b"\x00\x03" and reply[40:47] == b"vm3-tap"


def test_of10_flow_dump_and_table_stats():
    session = connected(version=1)
    dump, tables = exchange(
        session,
        codec10.encode_flow_stats_request(codec10.encode_match({}), 0xFF, codec10.OFPP_NONE, 8),
        codec10.encode_message(codec10.MsgType.STATS_REQUEST, 9, struct.pack("!HH", 3, 0)),
    )
    assert codec10.decode_stats_header(dump) == (codec10.StatsType.FLOW, 0)
    assert len(dump) == 12 + 2 * 96
    assert len(tables) == 12


def test_non_openflow_bytes_are_refused_without_waiting_for_a_body():
    session = Session(lambda: RECORDS)
    replies = exchange(session, b"GET / HTTP/1.1\r\n\r\n")  # "length" 0x5420 never arrives
    assert error_of(replies[1])[:2] == (0, 0)
    assert session.closing


def test_of10_nicira_set_flow_format_is_refused_so_ovs_ofctl_falls_back():
    session = connected(version=1)
    # NXT_SET_FLOW_FORMAT: vendor 0x2320, subtype 12, format 2 (NXM)
    nxt = codec.encode_message(codec10.MsgType.VENDOR, 6, struct.pack("!III", 0x2320, 12, 2), 1)
    barrier = codec.encode_message(codec10.MsgType.BARRIER_REQUEST, 7, b"", 1)
    error, reply = exchange(session, nxt, barrier)
    assert error_of(error)[:2] == (1, ofp13.BadRequestCode.BAD_EXPERIMENTER)  # BAD_VENDOR
    assert codec.parse_header(reply)[:2] == (1, codec10.MsgType.BARRIER_REPLY)
