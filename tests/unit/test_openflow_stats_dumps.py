"""Dumps shared between the endpoint's connections: encoded once per interval."""

from __future__ import annotations

from ovs_ext.flow_record import FlowRecord
from ovs_ext.openflow_stats import codec, codec10
from ovs_ext.openflow_stats.codec import FlowStatsRequest
from ovs_ext.openflow_stats.dumps import MAX_KEPT, SharedDumps
from ovs_ext.openflow_stats.ofp13 import MsgType
from ovs_ext.openflow_stats.session import Session
from tests.unit.test_openflow_stats_session import exchange

TCP = {"in_port": 1, "eth_type": 0x800, "ip_proto": 6, "ipv4_dst": "10.0.0.2", "tcp_dst": 5201}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class CountingRecords:
    """The record source, counting how often the endpoint asked for it."""

    def __init__(self, packets: int = 5) -> None:
        self.calls = 0
        self.packets = packets

    def __call__(self) -> list[FlowRecord]:
        self.calls += 1
        return [FlowRecord(0, 100, 1, TCP, packets=self.packets, bytes=500, duration_s=2.0)]


def connected(version: int = 4, *, records: CountingRecords, dumps=None) -> Session:
    session = Session(records, dumps=dumps)
    exchange(session, codec.encode_hello({version}))
    return session


def _dump(session: Session, xid: int) -> list[bytes]:
    request = codec.encode_flow_stats_request(FlowStatsRequest(), xid)
    return exchange(session, request)


def test_an_answer_is_reused_within_max_age_then_built_again():
    clock = Clock()
    dumps = SharedDumps(0.25, clock)
    built = []
    assert dumps.answer("k", lambda: built.append(1) or [b"a"]) == [b"a"]
    clock.now += 0.2
    assert dumps.answer("k", lambda: built.append(1) or [b"b"]) == [b"a"]
    clock.now += 0.1
    assert dumps.answer("k", lambda: built.append(1) or [b"c"]) == [b"c"]
    assert len(built) == dumps.built == 2


def test_a_slow_encoding_is_reused_as_long_as_it_took():
    clock = Clock()
    dumps = SharedDumps(0.25, clock)

    def slow() -> list[bytes]:
        clock.now += 1.0  # a loaded host: encoding took a second
        return [b"slow"]

    dumps.answer("k", slow)
    clock.now += 0.9  # older than max_age, younger than the encoding took
    assert dumps.answer("k", lambda: [b"new"]) == [b"slow"]
    clock.now += 0.2
    assert dumps.answer("k", lambda: [b"new"]) == [b"new"]


def test_zero_max_age_builds_every_time_and_keeps_nothing():
    dumps = SharedDumps(0.0, Clock())
    assert dumps.answer("k", lambda: [b"a"]) == [b"a"]
    assert dumps.answer("k", lambda: [b"b"]) == [b"b"]


def test_distinct_requests_kept_are_bounded():
    dumps = SharedDumps(10.0, Clock())
    for n in range(MAX_KEPT * 3):
        dumps.answer(n, lambda: [b"x"])
    assert len(dumps._kept) <= MAX_KEPT


def test_clients_dumping_at_once_read_the_records_once_each_with_its_own_xid():
    records, dumps = CountingRecords(), SharedDumps(5.0, Clock())
    first, second = connected(records=records, dumps=dumps), connected(records=records, dumps=dumps)
    one, two = _dump(first, 7), _dump(second, 8)
    assert records.calls == 1
    assert [codec.parse_header(m).xid for m in one + two] == [7, 8]
    assert one[0][8:] == two[0][8:]  # the same entries, framed for each client
    assert codec.parse_header(one[0]).msg_type == MsgType.MULTIPART_REPLY


def test_each_version_and_selection_has_its_own_answer():
    records, dumps = CountingRecords(), SharedDumps(5.0, Clock())
    _dump(connected(records=records, dumps=dumps), 1)
    ten = connected(version=1, records=records, dumps=dumps)
    request = codec10.encode_flow_stats_request(bytes(40), 0xFF, 0xFFFF, 2)
    (reply,) = exchange(ten, request)
    assert codec.parse_header(reply).version == 1 and records.calls == 2
    aggregate = codec.encode_flow_stats_request(FlowStatsRequest(), 3, aggregate=True)
    exchange(connected(records=records, dumps=dumps), aggregate)
    assert records.calls == 3


def test_without_sharing_every_dump_reads_the_records():
    records = CountingRecords()
    session = connected(records=records)
    _dump(session, 1)
    _dump(session, 2)
    assert records.calls == 2
