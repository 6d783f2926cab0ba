"""The XDP eSwitch on real lab hosts: offloaded packets bypass OVS, counted exactly.

Endpoints a1, a2 on host A and b1 on host B (namespaces with a veth in br-int).
A probe OpenFlow rule matching the test flow (priority above NORMAL, action
NORMAL) counts exactly the packets OVS switches for that flow: zero while the
flow is offloaded, all of them when it is onloaded.
"""

from __future__ import annotations

import re
import time

import pytest

from flexmig_lab import endpoints, errors, traffic
from flexmig_lab.host import LabHost
from flexmig_lab.xdpctl import HostXdp
from ovs_ext.providers.base import FlowCounters, FlowMatch
from ovs_ext.providers.xdp import provider as xdp_provider

pytestmark = pytest.mark.lab

PACKETS = 5000
RATE = 4000  # pps, in small bursts: loss-free through OVS even on a busy machine
PAYLOAD = 18  # 60-byte frames
FRAME = 14 + 20 + 8 + PAYLOAD
PROBE_COOKIE = "0x7e57"


@pytest.fixture(scope="module")
def xlab(lab):
    for built in (xdp_provider.ESWITCH_OBJECT, xdp_provider.RX_PASS_OBJECT, traffic.UDPGEN):
        if not built.is_file():
            pytest.skip(f"{built} is not built (tools/setup.sh)")
    eps = {
        name: endpoints.add(lab, host, name)
        for host, name in (("A", "a1"), ("A", "a2"), ("B", "b1"))
    }
    xdp = {"A": HostXdp(lab.host("A")), "B": HostXdp(lab.host("B"))}
    try:
        xdp["A"].attach("ep-a1", "ep-a2", "phy0")
        xdp["B"].attach("ep-b1", "phy0")
    except errors.LabError as exc:
        pytest.skip(f"XDP cannot attach here: {exc}")
    for src, dst in (("a1", "a2"), ("a1", "b1")):  # resolve ARP through OVS first
        ping = traffic_run(eps[src], ["ping", "-c", "1", "-W", "2", eps[dst].ip])
        assert ping.returncode == 0, ping.stdout
    yield lab, eps, xdp


def traffic_run(ep: endpoints.Endpoint, cmd: list[str]):
    from flexmig import processutil

    return processutil.run([*endpoints.exec_prefix(ep), *cmd], check=False)


def flow_of(src: endpoints.Endpoint, dst: endpoints.Endpoint, in_port: str, sport: int):
    return FlowMatch(in_port, 17, src.ip, dst.ip, sport, 9000)


def add_probe(host: LabHost, match: FlowMatch) -> None:
    host.ns.run(
        [
            "ovs-ofctl",
            "add-flow",
            "br-int",
            f"cookie={PROBE_COOKIE},priority=100,udp,nw_src={match.ipv4_src},"
            f"nw_dst={match.ipv4_dst},tp_src={match.tp_src},tp_dst={match.tp_dst},"
            "actions=NORMAL",
        ]
    )


def probe_packets(host: LabHost, match: FlowMatch, expected: int) -> int:
    """The probe rule's packet count once OVS has folded in its datapath stats.

    OpenFlow counters lag the userspace datapath's flow cache by up to a
    revalidator round (500 ms): wait at least a second, then until the count
    is what the test expects or 5 s have passed, and return what is there.
    """
    time.sleep(1.0)
    deadline = time.monotonic() + 4.0
    while True:
        out = host.ns.run(
            [
                "ovs-ofctl",
                "dump-flows",
                "br-int",
                f"cookie={PROBE_COOKIE}/-1,udp,tp_src={match.tp_src}",
            ]
        ).stdout
        counts = re.findall(r"n_packets=(\d+)", out)
        assert len(counts) == 1, out
        if int(counts[0]) == expected or time.monotonic() > deadline:
            return int(counts[0])
        time.sleep(0.2)


def blast(src: endpoints.Endpoint, dst: endpoints.Endpoint, sport: int) -> dict[str, float]:
    """Send exactly PACKETS datagrams; returns what the receiver got."""
    receiver = traffic.Receiver(endpoints.exec_prefix(dst), 9000, count=PACKETS, duration=20)
    sent = traffic.send(
        endpoints.exec_prefix(src), dst.ip, 9000, sport=sport, count=PACKETS, rate=RATE, batch=8
    )
    assert sent["sent_packets"] == PACKETS
    return receiver.result()


def test_offloaded_flow_bypasses_ovs_on_one_host(xlab):
    lab, eps, xdp = xlab
    host = lab.host("A")
    match = flow_of(eps["a1"], eps["a2"], "ep-a1", 7001)
    add_probe(host, match)
    result = xdp["A"].install(match, "ep-a2")
    assert result["failed"] == [] and len(result["installed"]) == 1

    got = blast(eps["a1"], eps["a2"], 7001)
    assert got["received_packets"] == PACKETS
    assert xdp["A"].stats()[match] == FlowCounters(PACKETS, PACKETS * FRAME)
    assert probe_packets(host, match, 0) == 0  # OVS never saw them

    removed = xdp["A"].remove(match)
    assert removed == {match: FlowCounters(PACKETS, PACKETS * FRAME)}
    assert match not in xdp["A"].stats()

    got = blast(eps["a1"], eps["a2"], 7001)  # onloaded again: through OVS
    assert got["received_packets"] == PACKETS
    assert probe_packets(host, match, PACKETS) == PACKETS


def test_offloaded_flow_across_hosts_through_the_uplink(xlab):
    lab, eps, xdp = xlab
    a, b = lab.host("A"), lab.host("B")
    out_of_a = flow_of(eps["a1"], eps["b1"], "ep-a1", 7002)
    into_b = flow_of(eps["a1"], eps["b1"], "phy0", 7002)
    for host, match in ((a, out_of_a), (b, into_b)):
        add_probe(host, match)
    assert xdp["A"].install(out_of_a, "phy0")["failed"] == []
    assert xdp["B"].install(into_b, "ep-b1")["failed"] == []

    got = blast(eps["a1"], eps["b1"], 7002)
    assert got["received_packets"] == PACKETS
    assert got["received_bytes"] == PACKETS * PAYLOAD
    assert xdp["A"].stats()[out_of_a] == FlowCounters(PACKETS, PACKETS * FRAME)
    assert xdp["B"].stats()[into_b] == FlowCounters(PACKETS, PACKETS * FRAME)
    assert probe_packets(a, out_of_a, 0) == 0
    assert probe_packets(b, into_b, 0) == 0

    assert xdp["A"].remove(out_of_a)[out_of_a].packets == PACKETS
    assert xdp["B"].remove(into_b)[into_b].packets == PACKETS


def test_entry_to_a_port_not_attached_stays_onloaded_with_reason(xlab):
    lab, eps, xdp = xlab
    host = lab.host("A")
    match = flow_of(eps["a1"], eps["a2"], "ep-a1", 7003)
    add_probe(host, match)
    xdp["A"].detach("ep-a2")
    try:
        result = xdp["A"].install(match, "ep-a2")
        assert result["installed"] == []
        assert "ep-a2 is not attached" in result["failed"][0]["reason"]
        got = blast(eps["a1"], eps["a2"], 7003)
        assert got["received_packets"] == PACKETS
        assert probe_packets(host, match, PACKETS) == PACKETS  # OVS carried every packet
        assert match not in xdp["A"].stats()
    finally:
        xdp["A"].attach("ep-a2")


def test_detach_removes_the_entries_using_the_port(xlab):
    lab, eps, xdp = xlab
    match = flow_of(eps["a1"], eps["a2"], "ep-a1", 7004)
    assert xdp["A"].install(match, "ep-a2")["failed"] == []
    xdp["A"].detach("ep-a2")
    try:
        assert match not in xdp["A"].stats()
        assert "ep-a2" not in xdp["A"].detach("ep-a2")  # idempotent: lists what is left
    finally:
        xdp["A"].attach("ep-a2")


def _tap_tx_packets(host: LabHost, tap: str) -> int:
    return int(host.ns.root_path(f"/sys/class/net/{tap}/statistics/tx_packets").read_text())


def test_offload_into_a_qemu_guest_tap(xlab):
    """Redirect into a tun/tap (QEMU's side); misses from the tap still reach OVS."""
    from flexmig_lab import vm

    lab, eps, xdp = xlab
    host = lab.host("A")
    guest = vm.create(lab, "A", ram="256M", name="xdpvm")
    tap, guest_ip = guest.spec.port_name, guest.spec.tenant_ip
    xdp["A"].attach(tap)
    # ICMP is never offloaded: the reply leaves the tap through the eSwitch (a miss) to OVS.
    ping = traffic_run(eps["a1"], ["ping", "-c", "4", "-W", "5", guest_ip])
    assert ping.returncode == 0, ping.stdout
    match = FlowMatch("ep-a1", 17, eps["a1"].ip, guest_ip, 7005, 9999)
    add_probe(host, match)
    assert xdp["A"].install(match, tap)["failed"] == []
    before = _tap_tx_packets(host, tap)
    sent = traffic.send(
        endpoints.exec_prefix(eps["a1"]),
        guest_ip,
        9999,
        sport=7005,
        count=PACKETS,
        rate=RATE,
        batch=8,
    )
    assert sent["sent_packets"] == PACKETS
    assert xdp["A"].stats()[match] == FlowCounters(PACKETS, PACKETS * FRAME)
    # Every redirected frame was queued to QEMU (ARP or ICMP may add a few).
    assert _tap_tx_packets(host, tap) - before >= PACKETS
    assert probe_packets(host, match, 0) == 0
    assert xdp["A"].remove(match)[match].packets == PACKETS
    vm.destroy(lab, "xdpvm")
