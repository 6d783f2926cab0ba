"""xdpgen's command line and the template frame it sends (no root: --dump-frame).

The frame is decoded here independently of the C code that builds it: header
fields, lengths and both checksums must be what a receiver checks.
"""

from __future__ import annotations

import ipaddress
import struct
import subprocess

import pytest

from flexmig import exceptions
from flexmig_lab import traffic

SRC_MAC = "02:aa:00:00:00:01"
FLOW = traffic.XdpFlow(
    src="10.20.0.211", dst="10.20.0.212", dst_mac="02:bb:00:00:00:02", port=9000, sport=7001
)

pytestmark = pytest.mark.skipif(
    not traffic.XDPGEN.is_file(), reason=f"{traffic.XDPGEN} is not built (tools/setup.sh)"
)


def ones_complement_sum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def mac(text: str) -> bytes:
    return bytes(int(part, 16) for part in text.split(":"))


def test_template_is_the_benchmark_flow_in_a_60_byte_frame():
    frame = traffic.xdp_frame(FLOW, SRC_MAC)
    assert len(frame) == 60  # 64 on the wire with the FCS
    assert frame[0:6] == mac(FLOW.dst_mac) and frame[6:12] == mac(SRC_MAC)
    assert frame[12:14] == b"\x08\x00"
    ip = frame[14:34]
    assert ip[0] == 0x45 and ip[9] == 17  # IPv4 without options, UDP
    assert struct.unpack("!H", ip[2:4])[0] == 46
    assert ip[12:16] == ipaddress.IPv4Address(FLOW.src).packed
    assert ip[16:20] == ipaddress.IPv4Address(FLOW.dst).packed
    assert ones_complement_sum(ip) == 0xFFFF  # header checksum verifies
    sport, dport, length, checksum = struct.unpack("!HHHH", frame[34:42])
    assert (sport, dport, length) == (7001, 9000, 26)
    assert checksum != 0  # filled in: a socket receiver verifies it
    pseudo = ip[12:20] + struct.pack("!BBH", 0, 17, length)
    assert ones_complement_sum(pseudo + frame[34:]) == 0xFFFF


def test_payload_size_sets_the_frame_length():
    frame = traffic.xdp_frame(traffic.XdpFlow(**{**FLOW.__dict__, "size": 1472}), SRC_MAC)
    assert len(frame) == 14 + 20 + 8 + 1472
    assert struct.unpack("!H", frame[16:18])[0] == 1500


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("port", 0, "--port"),
        ("port", 70000, "--port"),
        ("sport", 65536, "--sport"),
        ("dst_mac", "02:bb:00:00:00", "--dst-mac"),
        ("dst_mac", "02:bb:00:00:00:02:03", "--dst-mac"),
        ("src", "10.20.0", "--src"),
        ("dst", "host", "--dst"),
        ("size", 17, "--size"),
        ("size", 1473, "--size"),
    ],
)
def test_bad_flow_is_refused_naming_the_option(field, value, named):
    flow = traffic.XdpFlow(**{**FLOW.__dict__, field: value})
    with pytest.raises(exceptions.InvalidInput, match=named):
        traffic.xdp_frame(flow, SRC_MAC)


def run_xdpgen(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(traffic.XDPGEN), *args], capture_output=True, text=True, timeout=30, check=False
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--count", "10", "--duration", "1"], "exactly one of --count and --duration"),
        ([], "exactly one of --count and --duration"),
        (["--count", "-3"], "--count"),
        (["--duration", "0"], "--duration"),
        (["--duration", "1s"], "--duration"),
        (["--batch", "257", "--count", "1"], "--batch"),
        (["--batch", "0", "--count", "1"], "--batch"),
        (["--count", "1", "stray"], "unexpected argument"),
        (["--count", "1", "--bogus"], "unknown option"),
    ],
)
def test_bad_run_options_fail_before_touching_a_device(extra, message):
    proc = run_xdpgen("--dev", "no-such-dev0", *FLOW.args(), *extra)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert proc.stdout == ""


def test_missing_device_is_named():
    proc = run_xdpgen("--dev", "no-such-dev0", *FLOW.args(), "--count", "1")
    assert proc.returncode == 1
    assert "no-such-dev0" in proc.stderr and proc.stdout == ""


def test_sender_needs_exactly_one_bound():
    with pytest.raises(exceptions.InvalidInput, match="exactly one"):
        traffic.XdpSender([], "eth0", FLOW)
    with pytest.raises(exceptions.InvalidInput, match="exactly one"):
        traffic.XdpSender([], "eth0", FLOW, count=5, duration=1.0)
