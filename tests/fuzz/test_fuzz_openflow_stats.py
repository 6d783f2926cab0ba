"""Fuzzing the OpenFlow statistics endpoint: framing, every message type, both
versions, fed as ovs-ofctl would (whole messages) and as an attacker would
(arbitrary bytes, wrong lengths, split anywhere).  A connection must answer
with well-framed OpenFlow or close; it never raises, never loops, and never
changes what it serves (it is read-only)."""

from __future__ import annotations

import copy
import struct

from hypothesis import example, given
from hypothesis import strategies as st

from ovs_ext.flow_record import FlowRecord
from ovs_ext.openflow_stats import codec
from ovs_ext.openflow_stats.session import EndpointInfo, Session

TCP = {"in_port": 1, "eth_type": 0x800, "ip_proto": 6, "ipv4_dst": "10.0.0.2", "tcp_dst": 5201}
RECORDS = [
    FlowRecord(0, 100, 1, TCP, packets=5, bytes=500, duration_s=2.0, out_port=2),
    FlowRecord(200, 100, 1, TCP, packets=3, bytes=300, duration_s=2.0, offloaded=True),
    FlowRecord(0, 0, 2, {}, packets=7, bytes=700, duration_s=9.0),
]
VERSIONS = st.sampled_from([1, 4]) | st.integers(0, 255)
# OpenFlow 1.0 STATS_REQUEST is 16, 1.3 MULTIPART_REQUEST is 18; their body
# starts with a 16-bit stats type (0 desc, 1 flow, 2 aggregate, 3 table, 13
# port desc, 12 table features in 1.3).
STATS_TYPES = st.sampled_from([0, 1, 2, 3, 4, 12, 13, 0xFFFF]) | st.integers(0, 0xFFFF)


def message(version, msg_type, xid, body, length=None):
    size = 8 + len(body) if length is None else length
    return struct.pack("!BBHI", version, msg_type, size & 0xFFFF, xid) + body


@st.composite
def messages(draw):
    version = draw(VERSIONS)
    msg_type = draw(st.sampled_from([0, 1, 2, 3, 5, 7, 14, 16, 18, 20]) | st.integers(0, 40))
    body = draw(st.binary(max_size=256))
    if msg_type in (16, 18) and draw(st.booleans()):
        flags = draw(st.integers(0, 0xFFFF))
        body = struct.pack("!HH", draw(STATS_TYPES), flags) + bytes(4 * (version != 1)) + body
    length = draw(st.none() | st.integers(0, 0xFFFF))
    return message(version, msg_type, draw(st.integers(0, 2**32 - 1)), body, length)


def drive(chunks, records=RECORDS):
    """Feed every chunk, draining replies as a socket would; returns all output."""
    served = copy.deepcopy(records)
    # Few tables: a table-features reply for 254 tables costs time, not coverage.
    session = Session(
        lambda: served, port_names=lambda: {1: "tap0", 2: "phy0"}, info=EndpointInfo(n_tables=4)
    )
    out = bytearray()
    for chunk in chunks:
        session.feed(chunk)
        for _ in range(10_000):  # bounded: a session that never drains is a hang
            data = session.pull_output(1 << 16)
            out += data
            if not data:
                break
        else:
            raise AssertionError("the session kept producing output")
    assert served == records  # read-only: nothing it was fed changed what it serves
    return bytes(out)


def check_framing(out: bytes) -> list[codec.Header]:
    headers = []
    while out:
        header = codec.parse_header(out)
        assert 8 <= header.length <= len(out), header
        assert header.version in (1, 4)
        headers.append(header)
        out = out[header.length :]
    return headers


@given(st.lists(messages(), max_size=6), st.sampled_from([1, 4]))
@example([message(4, 18, 7, struct.pack("!HH4x", 1, 0) + bytes(40))], 4)
@example([message(1, 16, 7, struct.pack("!HH", 1, 0) + bytes(44))], 1)
def test_any_message_sequence_after_hello_is_answered_in_framed_openflow(msgs, version):
    hello = message(version, 0, 1, b"")
    check_framing(drive([hello, *msgs]))


@given(st.binary(max_size=2048), st.integers(1, 64))
def test_arbitrary_bytes_split_anywhere_never_break_the_endpoint(data, step):
    chunks = [data[i : i + step] for i in range(0, len(data), step)]
    check_framing(drive([message(4, 0, 1, b""), *chunks]))


@given(st.binary(max_size=512))
def test_bytes_before_any_hello_are_refused_or_negotiated(data):
    check_framing(drive([data]))
