"""The datapath benchmark's flow placements (pure): both hosts, both directions for TCP."""

from flexmig_lab.endpoints import Endpoint
from tests.bench.bench_offload_datapath import stream_placements


def _eps(prefix: str, host: str, first: int, n: int) -> list[Endpoint]:
    return [Endpoint(f"{prefix}{i}", host, f"10.251.0.{first + i}") for i in range(n)]


def test_udp_streams_offload_the_sender_host_and_the_receiver_host():
    senders, receivers = _eps("s", "B", 220, 2), _eps("r", "A", 210, 2)
    placements = stream_placements(senders, receivers, "udp")
    assert len(placements) == 4
    by_host = {(p.host, p.entry.match.in_port): p.entry.out_port for p in placements}
    assert by_host[("B", "ep-s0")] == "phy0"
    assert by_host[("A", "phy0")] in {"ep-r0", "ep-r1"}
    ports = {p.entry.match.tp_src for p in placements}
    assert len(ports) == 2  # one flow per stream, each on both hosts


def test_tcp_streams_also_offload_the_acks():
    senders, receivers = _eps("s", "B", 220, 1), _eps("r", "A", 210, 1)
    placements = stream_placements(senders, receivers, "tcp")
    assert len(placements) == 4
    back = [p for p in placements if p.entry.match.ipv4_src == receivers[0].ip]
    assert {(p.host, p.entry.out_port) for p in back} == {("A", "phy0"), ("B", "ep-s0")}
    fwd = next(p for p in placements if p.entry.match.in_port == "ep-s0").entry.match
    ack = next(p for p in back if p.host == "A").entry.match
    assert (ack.tp_src, ack.tp_dst) == (fwd.tp_dst, fwd.tp_src)
