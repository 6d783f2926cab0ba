"""xdpgen on the lab: in-kernel frames from an endpoint reach its host port and beyond.

Endpoints a1, a2 on host A.  xdpgen runs in a1's namespace and redirects its
frames out of a1's eth0; the veth hands them to the host port ep-a1 only
while ep-a1 has NAPI.  Counted at every hop by independent counters: the
veth's own (xdp_xmit at a1's eth0 and at ep-a2), the host port's rx
packets, the eSwitch's per-flow counter, OVS's probe rule and the XDP sink on
a2's eth0.
"""

from __future__ import annotations

import re
import time

import pytest

from flexmig import processutil
from flexmig_lab import endpoints, errors, offload, traffic
from flexmig_lab.host import LabHost
from flexmig_lab.xdpctl import HostXdp
from ovs_ext.providers.base import FlowCounters, FlowMatch
from ovs_ext.providers.xdp import provider as xdp_provider
from tests.bench.offload_pps import DRAIN_S, RX_SINK_OBJECT, PortNapi, XdpSink, endpoint_mac
from tests.functional.test_xdp_eswitch import add_probe, probe_packets

pytestmark = pytest.mark.lab

FRAME = 60
BURST = 200  # below the veth ring (256): nothing may be refused or lost
BURST_BATCH = 16
OVS_BURST, OVS_BURSTS, OVS_BURST_GAP_S = 32, 5, 0.2


@pytest.fixture(scope="module")
def glab(lab):
    for built in (traffic.XDPGEN, traffic.XDPGEN_OBJECT, xdp_provider.ESWITCH_OBJECT,
                  RX_SINK_OBJECT):  # fmt: skip
        if not built.is_file():
            pytest.skip(f"{built} is not built (tools/setup.sh)")
    # The lab's flexmig-offload would attach the eSwitch to the new ports and
    # promote a fast flow by itself: the ports here are the test's alone.
    offload.LabOffload(lab.host("A")).stop()
    eps = {name: endpoints.add(lab, "A", name) for name in ("a1", "a2")}
    ping = processutil.run(
        [*endpoints.exec_prefix(eps["a1"]), "ping", "-c", "1", "-W", "2", eps["a2"].ip],
        check=False,
    )
    assert ping.returncode == 0, ping.stdout  # OVS learned a2's MAC
    return lab, eps


def flow(eps: dict, sport: int) -> traffic.XdpFlow:
    a1, a2 = eps["a1"], eps["a2"]
    return traffic.XdpFlow(a1.ip, a2.ip, endpoint_mac(a2), 9000, sport=sport)


def send(eps: dict, sport: int, **kwargs) -> dict[str, float]:
    try:
        return traffic.xdp_send(
            endpoints.exec_prefix(eps["a1"]), endpoints.ENDPOINT_IF, flow(eps, sport), **kwargs
        )
    except errors.LabError as exc:
        if "BPF_F_TEST_XDP_LIVE_FRAMES" in str(exc):
            pytest.skip(f"this kernel has no XDP live frames: {exc}")
        raise


def rx_packets(host: LabHost, port: str) -> int:
    out = host.ns.run(["cat", f"/sys/class/net/{port}/statistics/rx_packets"]).stdout
    return int(out)


def xdp_xmit(host: LabHost, port: str) -> tuple[int, int]:
    """A veth's (frames it put into its peer's ring, frames it refused)."""
    out = host.ns.run(["ethtool", "-S", port]).stdout
    taken = sum(int(n) for n in re.findall(r"tx_queue_\d+_xdp_xmit: (\d+)", out))
    refused = sum(int(n) for n in re.findall(r"tx_queue_\d+_xdp_xmit_errors: (\d+)", out))
    return taken, refused


def test_port_without_napi_refuses_every_frame(glab):
    lab, eps = glab
    host = lab.host("A")
    features = host.ns.run(["ethtool", "-k", "ep-a1"]).stdout
    assert "generic-receive-offload: off" in features  # the lab's default
    assert "xdp" not in host.ns.run(["ip", "link", "show", "ep-a1"]).stdout
    before = rx_packets(host, "ep-a1")
    sent = send(eps, 7100, count=BURST, batch=BURST_BATCH)
    assert sent["packets"] == BURST  # generated...
    assert sent["xdp_xmit"] == 0 and sent["not_sent"] == BURST  # ...and none taken
    assert rx_packets(host, "ep-a1") - before <= 5  # the endpoint's own ARP/ND at most


def test_frames_reach_the_port_and_ovs_forwards_them(glab):
    lab, eps = glab
    host = lab.host("A")
    match = FlowMatch("ep-a1", 17, eps["a1"].ip, eps["a2"].ip, 7101, 9000)
    add_probe(host, match)
    before = rx_packets(host, "ep-a1")
    with PortNapi(lab, "ep-a1"), XdpSink(eps["a2"]) as sink:
        # Small bursts: OVS reads the port through an AF_PACKET socket whose
        # buffer holds ~80 of these frames; a line-rate burst beyond it is lost.
        for _ in range(OVS_BURSTS):
            sent = send(eps, 7101, count=OVS_BURST, batch=BURST_BATCH)
            assert sent["packets"] == OVS_BURST and sent["xdp_xmit"] == OVS_BURST
            assert sent["xdp_xmit_errors"] == 0 and sent["not_sent"] == 0
            assert sent["frame_bytes"] == FRAME
            time.sleep(OVS_BURST_GAP_S)
        total = OVS_BURSTS * OVS_BURST
        # The endpoint's own ARP/ND may add a few frames to the port's count.
        assert total <= rx_packets(host, "ep-a1") - before <= total + 5
        assert probe_packets(host, match, total) == total  # OVS switched each one
        assert sink.count() == total


def test_offloaded_frames_counted_by_the_eswitch_reach_the_sink(glab):
    lab, eps = glab
    host = lab.host("A")
    xdp = HostXdp(host)
    match = FlowMatch("ep-a1", 17, eps["a1"].ip, eps["a2"].ip, 7102, 9000)
    add_probe(host, match)
    xdp.attach("ep-a1", "ep-a2")
    try:
        assert xdp.install(match, "ep-a2")["failed"] == []
        with XdpSink(eps["a2"]) as sink:
            sent = send(eps, 7102, count=BURST, batch=BURST_BATCH)
            assert sent["xdp_xmit"] == BURST and sent["not_sent"] == 0
            assert xdp.stats()[match] == FlowCounters(BURST, BURST * FRAME)
            assert sink.count() == BURST
            assert probe_packets(host, match, 0) == 0  # OVS never saw them

            # Flat out: the port's ring overflows, every hop's counts still agree.
            to_a2_before, _ = xdp_xmit(host, "ep-a2")
            sent = send(eps, 7102, duration=1.0)
            time.sleep(DRAIN_S)
            to_a2 = xdp_xmit(host, "ep-a2")[0] - to_a2_before
            counted = xdp.stats()[match].packets - BURST
            assert sent["packets"] == sent["xdp_xmit"] + sent["not_sent"]
            assert sent["xdp_xmit"] > BURST and sent["cpu_seconds"] > 0
            assert counted == sent["xdp_xmit"]  # the eSwitch saw all ep-a1 took
            assert sink.count() - BURST == to_a2  # a2 got all ep-a2 put in its ring
            assert 0 < to_a2 <= counted
    finally:
        xdp.remove(match)
        xdp.detach("ep-a1", "ep-a2")
