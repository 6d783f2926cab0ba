"""The app's own statistics reader against replies built as OVS sends them.

Entries are serialized with os-ken (match and instructions as OVS encodes
them); the reader must find what os-ken's full parse finds: table, cookie,
counters and, for counting rules, the match.  A fake bridge on a UNIX socket
answers the hello, an echo request in the middle and a reply in two parts.
"""

from __future__ import annotations

import socket
import struct
import threading

import pytest
from os_ken.ofproto import ofproto_v1_3 as ofp
from os_ken.ofproto import ofproto_v1_3_parser as parser

from ovs_ext import flows, openflow, stats_reader
from ovs_ext.providers.base import FlowMatch
from tests.bench.offload_poll_cost import _entry

MATCH = FlowMatch("tap0", 17, "10.0.0.1", "10.0.0.2", 4000, 5000)


def _body() -> bytes:
    rule = openflow.flow_rule(parser, ofp, flows.flow_cookie(7), 3, MATCH, 60)
    counting = parser.OFPMatch(**flows.openflow_match(MATCH, 3))
    return _entry(0, flows.flow_cookie(7), rule.match, rule.instructions) + _entry(
        1, flows.counting_cookie(), counting, []
    )


def test_the_reader_finds_what_osken_finds():
    body = _body()
    mine = stats_reader.parse_flow_stats(body, lambda table, cookie: True)
    theirs, offset = [], 0
    while offset < len(body):
        stat = parser.OFPFlowStats.parser(body, offset)
        theirs.append(stat)
        offset += stat.length
    assert [(m.table_id, m.cookie, m.packet_count, m.byte_count) for m in mine] == [
        (t.table_id, t.cookie, t.packet_count, t.byte_count) for t in theirs
    ]
    assert mine[1].match == dict(theirs[1].match.items())
    assert openflow.counted_match(mine[1].match, "tap0") == MATCH


def test_a_flow_rule_is_known_by_its_cookie_alone():
    found = stats_reader.parse_flow_stats(
        _body(), lambda t, cookie: flows.is_counting_cookie(cookie)
    )
    assert found[0].match == {} and found[1].match["udp_dst"] == 5000


def test_a_truncated_reply_is_an_error_not_a_guess():
    with pytest.raises(stats_reader.StatsReadError):
        stats_reader.parse_flow_stats(struct.pack("!H", 9999) + _body()[2:])


def _message(kind, xid, body=b""):
    return stats_reader.HEADER.pack(4, kind, 8 + len(body), xid) + body


def test_the_reader_asks_the_bridge_and_gathers_a_reply_in_parts(tmp_path):
    path = str(tmp_path / "br-int.mgmt")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    seen = []

    def bridge():
        conn, _ = server.accept()
        with conn:
            conn.sendall(_message(stats_reader.OFPT_HELLO, 1))
            seen.append(conn.recv(8))  # the reader's hello
            request = conn.recv(4096)
            seen.append(request)
            xid = stats_reader.HEADER.unpack_from(request)[3]
            conn.sendall(_message(stats_reader.OFPT_ECHO_REQUEST, 99, b"ping"))
            part = stats_reader.MULTIPART.pack(stats_reader.OFPMP_FLOW, 1) + _body()
            conn.sendall(_message(stats_reader.OFPT_MULTIPART_REPLY, xid, part))
            seen.append(conn.recv(12))  # the echo reply
            last = stats_reader.MULTIPART.pack(stats_reader.OFPMP_FLOW, 0) + _body()[:0]
            conn.sendall(_message(stats_reader.OFPT_MULTIPART_REPLY, xid, last))

    thread = threading.Thread(target=bridge, daemon=True)
    thread.start()
    reader = stats_reader.FlowStatsReader(path, timeout=5)
    found = reader.read(flows.COOKIE_PREFIX << 48, flows.COOKIE_MASK, lambda t, c: True)
    thread.join(5)
    reader.close()
    server.close()
    assert [f.cookie for f in found] == [flows.flow_cookie(7), flows.counting_cookie()]
    assert seen[0][1] == stats_reader.OFPT_HELLO
    kind, _len, cookie, mask = seen[1][1], 0, *struct.unpack_from("!QQ", seen[1], 32)
    assert (kind, cookie, mask) == (stats_reader.OFPT_MULTIPART_REQUEST, 0xF1E0 << 48, 0xFFFF << 48)
    assert seen[2] == _message(stats_reader.OFPT_ECHO_REPLY, 99, b"ping")


def test_a_bridge_that_hangs_up_is_an_error_and_the_next_read_reconnects(tmp_path):
    reader = stats_reader.FlowStatsReader(str(tmp_path / "absent.mgmt"), timeout=1)
    with pytest.raises(stats_reader.StatsReadError):
        reader.read(0, 0, lambda t, c: True)
