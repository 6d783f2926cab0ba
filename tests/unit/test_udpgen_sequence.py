"""udpgen's sequence numbers: the sink tells loss, duplicates and late arrivals per packet.

Runs the built generator on the loopback interface (no root, no lab).
"""

from __future__ import annotations

import socket
import struct
import time

import pytest

from flexmig_lab import traffic

MAGIC = 0x464D5351  # "FMSQ", udpgen.c's SEQ_MAGIC

pytestmark = pytest.mark.skipif(
    not traffic.UDPGEN.is_file(), reason=f"{traffic.UDPGEN} is not built (tools/setup.sh)"
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sink(port: int) -> traffic.Receiver:
    return traffic.Receiver([], port, duration=10, idle_ms=300)


def test_numbers_the_sender_stamps_arrive_whole_and_once() -> None:
    port = _free_port()
    sink = _sink(port)
    sent = traffic.send([], "127.0.0.1", port, sport=0, count=400, size=64, rate=20000)
    got = sink.result()
    assert sent["sent_packets"] == 400
    assert got["sequenced_packets"] == got["unique_packets"] == got["received_packets"]
    assert (got["duplicates"], got["late"], got["highest_seq"]) == (0, 0, 399)
    assert got["missing"] == 400 - got["unique_packets"]


def test_gaps_duplicates_and_late_arrivals_are_counted_per_packet() -> None:
    port = _free_port()
    sink = _sink(port)
    order = [*range(10), *range(15, 20), 12, 12]  # 10, 11, 13, 14 never sent
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for seq in order:
            s.sendto(struct.pack("!IQ", MAGIC, seq) + bytes(20), ("127.0.0.1", port))
        s.sendto(b"no number here", ("127.0.0.1", port))
    got = sink.result()
    assert got["received_packets"] == len(order) + 1
    assert got["sequenced_packets"] == len(order)
    assert (got["unique_packets"], got["duplicates"], got["late"]) == (16, 1, 1)
    assert (got["highest_seq"], got["missing"]) == (19, 4)
    assert (got["missing_runs"], got["longest_missing_run"]) == (2, 2)


def test_each_forward_jump_is_reported_with_the_send_times_around_it() -> None:
    port = _free_port()
    sink = _sink(port)
    order = [0, 1, 2, 6, 7, 3, 20]  # jumps 2 -> 6 (3 skipped) and 7 -> 20 (12 skipped)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for seq in order:
            stamp = 1_000_000 + 10 * seq  # the sender's clock, ns
            s.sendto(struct.pack("!IQQ", MAGIC, seq, stamp) + bytes(20), ("127.0.0.1", port))
    got = sink.result()
    assert got["jumps_seen"] == 2
    assert got["jumps"] == [
        {"seq": 6, "gap": 3, "before_ns": 1_000_020, "after_ns": 1_000_060},
        {"seq": 20, "gap": 12, "before_ns": 1_000_070, "after_ns": 1_000_200},
    ]
    assert (got["first_sent_ns"], got["last_sent_ns"]) == (1_000_000, 1_000_200)
    assert got["missing"] == 3 - 1 + 12  # 3 came late


def test_the_sender_stamps_its_own_clock_on_every_datagram() -> None:
    port = _free_port()
    sink = _sink(port)
    before = time.time_ns()
    traffic.send([], "127.0.0.1", port, sport=0, count=50, size=64, rate=5000, batch=1)
    after = time.time_ns()
    got = sink.result()
    assert got["jumps"] == [] and got["unique_packets"] == 50
    assert before <= got["first_sent_ns"] < got["last_sent_ns"] <= after
