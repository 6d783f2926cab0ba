"""udpgen's sequence numbers: the sink tells loss, duplicates and late arrivals per packet.

Runs the built generator on the loopback interface (no root, no lab).
"""

from __future__ import annotations

import socket
import struct

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
