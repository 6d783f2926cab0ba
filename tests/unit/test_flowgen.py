"""The lab's many-flows generator builds valid IPv4/UDP datagrams (no root needed)."""

import socket
import struct

import pytest

from flexmig_lab.traffic import flowgen


def test_a_datagram_is_ipv4_udp_with_a_valid_header_checksum():
    raw = flowgen.datagram("10.0.0.1", "10.0.0.2", 20001, 9100)
    version_ihl, _tos, total, _id, _frag, ttl, proto = struct.unpack_from("!BBHHHBB", raw)
    assert (version_ihl, total, ttl, proto) == (0x45, len(raw), 64, socket.IPPROTO_UDP)
    assert flowgen._checksum(raw[:20]) == 0  # a correct header sums to zero
    assert raw[12:20] == socket.inet_aton("10.0.0.1") + socket.inet_aton("10.0.0.2")
    sport, dport, length, _sum = struct.unpack_from("!HHHH", raw, 20)
    assert (sport, dport, length) == (20001, 9100, len(raw) - 20)


@pytest.mark.parametrize(
    "argv",
    [
        ["--first-sport", "65000", "--flows", "1000"],
        ["--flows", "10", "--per-flow", "0"],
        ["--flows", "10", "--flows-per-s", "0"],
    ],
)
def test_impossible_runs_are_refused_before_anything_is_sent(argv, capsys):
    with pytest.raises(SystemExit) as refused:
        flowgen.main(["--src", "10.0.0.1", "--dst", "10.0.0.2", "--port", "9100", *argv])
    assert refused.value.code == 2
    assert capsys.readouterr().out == ""
