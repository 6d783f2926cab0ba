"""The offload extension on a real lab host: OVS, os-ken, the XDP eSwitch, ovs-ofctl.

Endpoints s1, s2 (senders) and r1 (receiver) on host A are namespaces with a
veth in br-int.  flexmig-offload runs inside host A with a policy per test;
what it did is read the way an operator reads it: ``ovs-ofctl dump-flows`` of
the statistics endpoint (``br-int-offload``) and of ``br-int`` itself, plus
the service's status file for the reasons.  Onloaded traffic stays at 5k pps,
where the lab's OVS loses nothing, so packet counts can be exact (the exactness
test sends at 5k pps so that even a busy machine loses nothing).
"""

from __future__ import annotations

import re
import sys
import time

import pytest

from flexmig import processutil
from flexmig_lab import endpoints, errors, offload, traffic
from ovs_ext.providers.xdp import provider as xdp_provider

pytestmark = pytest.mark.lab

PAYLOAD = 18
FRAME = 14 + 20 + 8 + PAYLOAD
LOSS_FREE_PPS = 5_000
ELEPHANT_POLICY = """\
capacity: 64
statistics:
  window_s: 0.5
  promote_pps: 3000
  demote_pps: 300
  demote_intervals: 5
"""

# For tests about something else than demotion: a flow offloaded at setup and
# idle while the test does something else (start another flow, reload a policy
# on a busy machine) must not be demoted meanwhile (5 quiet polls are 0.5 s).
PATIENT_POLICY = ELEPHANT_POLICY.replace("demote_intervals: 5", "demote_intervals: 600")


@pytest.fixture(scope="module")
def olab(lab):
    for built in (xdp_provider.ESWITCH_OBJECT, xdp_provider.RX_PASS_OBJECT, traffic.UDPGEN):
        if not built.is_file():
            pytest.skip(f"{built} is not built (tools/setup.sh)")
    if not offload.provider_installed("xdp"):
        pytest.skip("the xdp offload provider is not installed (tools/setup.sh)")
    service = offload.LabOffload(lab.host("A"))
    service.start(ELEPHANT_POLICY)
    eps = {name: endpoints.add(lab, "A", name) for name in ("s1", "s2", "r1")}
    status = wait_status(service, lambda s: {"ep-s1", "ep-s2", "ep-r1"} <= set(s["ports"]))
    if "ep-r1" not in status["fast_path_ports"]:
        pytest.skip(f"XDP could not attach here: {service.log_tail()}")
    for sender in ("s1", "s2"):  # ARP through OVS: the app learns where each MAC is
        ping = run_in(eps[sender], ["ping", "-c", "1", "-W", "2", eps["r1"].ip])
        assert ping.returncode == 0, ping.stdout
    yield service, eps
    service.start()  # the lab's standing policy for whatever runs next


# -- helpers ---------------------------------------------------------------------
def run_in(ep, cmd):
    return processutil.run([*endpoints.exec_prefix(ep), *cmd], check=False)


def wait_status(service, predicate, timeout=10.0, what="offload status"):
    def probe():
        try:
            status = service.status()
        except (FileNotFoundError, ValueError):
            return None
        return status if predicate(status) else None

    return processutil.wait_for(probe, timeout=timeout, interval=0.05, what=what)


def reload(service, text, applied):
    """SIGHUP with a new policy; returns once the status shows it applied."""
    service.reload(text)
    return wait_status(service, applied, what="the new policy to be applied")


def flow_status(service, sport, dport):
    for flow in service.status()["flows"]:
        if flow["match"]["tp_src"] == sport and flow["match"]["tp_dst"] == dport:
            return flow
    return None


def wait_flow(service, sport, dport, predicate=lambda f: True, timeout=10.0, what=""):
    return wait_status(
        service,
        lambda s: any(
            f["match"]["tp_src"] == sport and f["match"]["tp_dst"] == dport and predicate(f)
            for f in s["flows"]
        ),
        timeout=timeout,
        what=what or f"flow {sport}->{dport}",
    ) and flow_status(service, sport, dport)


def send(eps, src, sport, dport, count, rate=LOSS_FREE_PPS):
    return traffic.send(
        endpoints.exec_prefix(eps[src]), eps["r1"].ip, dport, sport=sport, count=count,
        rate=rate, size=PAYLOAD,
    )  # fmt: skip


def start_flow(service, eps, src, sport, dport):
    """The first packet, judged by the app; returns once the flow is tracked."""
    send(eps, src, sport, dport, 1)
    return wait_flow(service, sport, dport, what=f"the app to see flow {sport}->{dport}")


DUMP_LINE = re.compile(r"table=(\d+), n_packets=(\d+), n_bytes=(\d+)")


def endpoint_counts(service, sport, dport):
    """{table: (packets, bytes)} of one flow in `ovs-ofctl dump-flows br-int-offload`."""
    found = {}
    for line in service.dump_flows().splitlines():
        if f"tp_src={sport}," in line and f"tp_dst={dport}" in line:
            m = DUMP_LINE.search(line)
            assert m, line
            found[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
    return found


def bridge_rule_packets(host, sport, dport):
    """n_packets of the flow's own rule in br-int (what OVS itself switched)."""
    out = host.ns.run(["ovs-ofctl", "-O", "OpenFlow13", "dump-flows", "br-int"]).stdout
    for line in out.splitlines():
        if f"tp_src={sport}," in line and f"tp_dst={dport}" in line:
            return int(re.search(r"n_packets=(\d+)", line).group(1))
    return None


def settle():
    """Counters shown are at most 1 s stale (poll interval + OVS's revalidator)."""
    time.sleep(1.5)


# -- tests -------------------------------------------------------------------------
def test_header_rule_offloads_a_matching_flow_at_setup(olab, lab):
    service, eps = olab
    try:
        _header_rule_offloads_a_matching_flow(service, eps, lab)
    finally:
        # The module's policy again: the next test needs demotion after 5 quiet polls.
        reload(service, ELEPHANT_POLICY, lambda s: s["header_rules"] == [])


def _header_rule_offloads_a_matching_flow(service, eps, lab):
    reload(
        service,
        PATIENT_POLICY
        + "header_rules:\n"
        + "  - {name: to-r1, port: ep-r1, direction: ingress, ip_proto: udp, tp_dst: 9101,"
        + " action: offload}\n",
        lambda s: s["header_rules"] == ["to-r1"],
    )
    flow = start_flow(service, eps, "s1", 41001, 9101)
    assert flow["state"] == "offloaded", flow
    assert "to-r1" in flow["reason"] and flow["owner"] == "ep-r1"
    assert flow["direction"] == "ingress"
    other = start_flow(service, eps, "s1", 41001, 9102)  # the rule does not match: onloaded
    assert other["state"] == "onloaded"
    packets = 4000
    receiver = traffic.Receiver(endpoints.exec_prefix(eps["r1"]), 9101, count=packets)
    send(eps, "s1", 41001, 9101, packets)
    received = receiver.result()["received_packets"]
    settle()
    shown = endpoint_counts(service, 41001, 9101)
    # Every packet after the first went through the XDP fast path, none through OVS.
    # (A switch counts what it forwards: a loaded machine may still drop some in the
    # receiving namespace, never more than were sent.)
    offloaded = shown[200][0]
    assert received <= offloaded <= packets and offloaded > 0.9 * packets
    assert shown[200][1] == offloaded * FRAME
    assert shown[0] == (offloaded + 1, (offloaded + 1) * FRAME)
    assert bridge_rule_packets(lab.host("A"), 41001, 9101) == 0


def test_statistics_rule_promotes_an_elephant_and_demotes_it_with_hysteresis(olab):
    service, eps = olab
    sport, dport = 41002, 9201
    start_flow(service, eps, "s1", sport, dport)
    send(eps, "s1", sport, dport, 2000, rate=1500)  # a mouse: below promote_pps
    assert flow_status(service, sport, dport)["state"] == "onloaded"
    send(eps, "s1", sport, dport, 10_000, rate=LOSS_FREE_PPS)  # an elephant
    flow = wait_flow(service, sport, dport, lambda f: f["state"] == "offloaded", timeout=3)
    assert flow["reason"] == "promoted by statistics" and flow["moves"] == 1
    # Between the marks (300 < 1000 < 3000 pps): stays offloaded, no flapping.
    send(eps, "s1", sport, dport, 2000, rate=1000)
    assert flow_status(service, sport, dport)["moves"] == 1
    # Below the lower mark (100 pps): demoted after 5 quiet polls in a row.
    send(eps, "s1", sport, dport, 300, rate=100)
    flow = wait_flow(service, sport, dport, lambda f: f["state"] == "onloaded", timeout=5)
    assert flow["moves"] == 2 and "demoted" in flow["reason"]


def test_counters_exact_across_a_promotion(olab, lab):
    service, eps = olab
    sport, dport = 41003, 9301
    packets = 20_000  # plus the first one; 4k pps: above promote_pps, gentle on OVS
    receiver = traffic.Receiver(endpoints.exec_prefix(eps["r1"]), dport, count=packets + 1)
    start_flow(service, eps, "s1", sport, dport)
    send(eps, "s1", sport, dport, packets, rate=4000)
    received = receiver.result()["received_packets"]
    flow = wait_flow(service, sport, dport, lambda f: f["moves"] >= 1, timeout=2)
    settle()
    shown = endpoint_counts(service, sport, dport)
    total, offloaded = shown[0][0], shown[200][0]
    onloaded_in_ovs = bridge_rule_packets(lab.host("A"), sport, dport)
    # Every packet counted exactly once, wherever it went: onloaded + offloaded
    # (the 1: the judged first packet).
    assert total == onloaded_in_ovs + 1 + offloaded
    assert shown[0][1] == total * FRAME
    assert 0 < offloaded < total  # it really moved mid-flow
    assert flow["state"] in ("offloaded", "onloaded")
    # = P on a loss-free run.  A busy machine may drop packets before a switch
    # counts them (fewer than P) or in the receiver after (more than received);
    # never counted twice (more than P), never missing one that arrived.
    sent = packets + 1
    assert received <= total <= sent
    if received == sent:
        assert total == sent


def test_full_offload_table_evicts_the_slowest_flow(olab):
    service, eps = olab
    reload(
        service,
        ELEPHANT_POLICY.replace("capacity: 64", "capacity: 2"),
        lambda s: s["capacity"] == 2,
    )
    flows = {"slow": ("s1", 41011, 3500), "mid": ("s1", 41012, 5000), "fast": ("s2", 41013, 8000)}
    dport = 9401
    for src, sport, _ in flows.values():
        start_flow(service, eps, src, sport, dport)
    running = []
    try:
        for name in ("slow", "mid"):
            src, sport, rate = flows[name]
            running.append(_background_send(eps, src, sport, dport, rate, 9.0))
        for name in ("slow", "mid"):
            wait_flow(service, flows[name][1], dport, lambda f: f["state"] == "offloaded", 4)
        src, sport, rate = flows["fast"]
        running.append(_background_send(eps, src, sport, dport, rate, 4.0))
        wait_flow(service, sport, dport, lambda f: f["state"] == "offloaded", timeout=3)
        slow = flow_status(service, flows["slow"][1], dport)
        assert slow["state"] == "onloaded", slow
        assert f":{flows['slow'][1]}->" in _eviction_lines(service)
        assert flow_status(service, flows["mid"][1], dport)["state"] == "offloaded"
        assert service.status()["offloaded"] == 2
    finally:
        for proc in running:
            proc.wait(timeout=20)
        reload(service, ELEPHANT_POLICY, lambda s: s["capacity"] == 64)


def _eviction_lines(service):
    return "\n".join(line for line in service.log_tail(200).splitlines() if "evicted" in line)


def _background_send(eps, src, sport, dport, rate, seconds):
    import subprocess

    cmd = [*endpoints.exec_prefix(eps[src]), str(traffic.UDPGEN), "send", "--dst", eps["r1"].ip]
    cmd += ["--port", str(dport), "--sport", str(sport), "--size", str(PAYLOAD)]
    cmd += ["--rate", str(rate), "--duration", str(seconds)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_invalid_policy_is_rejected_and_changes_nothing(olab, lab):
    service, eps = olab
    host = lab.host("A")
    patient = PATIENT_POLICY
    reload(
        service,
        patient + "header_rules:\n  - {name: keep, ip_proto: udp, tp_dst: 9501, action: offload}\n",
        lambda s: s["header_rules"] == ["keep"],
    )
    flow = start_flow(service, eps, "s1", 41021, 9501)
    assert flow["state"] == "offloaded"
    bridge_before = _owned_rules(host)
    before = service.status()
    # A contradictory reload: rejected whole, naming the field; nothing moves.
    service.reload(patient.replace("demote_pps: 300", "demote_pps: 3000"))
    processutil.wait_for(
        lambda: "policy reload rejected" in service.log_tail(50),
        timeout=5,
        what="the service to reject the policy",
    )
    rejected = [line for line in service.log_tail(50).splitlines() if "rejected" in line]
    assert "statistics.demote_pps" in rejected[-1]
    send(eps, "s1", 41021, 9501, 500)
    after = service.status()
    assert (after["header_rules"], after["capacity"]) == (["keep"], before["capacity"])
    assert flow_status(service, 41021, 9501)["state"] == "offloaded"
    assert _owned_rules(host) == bridge_before
    # The running policy still judges new flows the same way.
    assert start_flow(service, eps, "s1", 41022, 9501)["state"] == "offloaded"
    bridge_before = _owned_rules(host)
    # An unknown field at start: the service refuses to run, naming it, and a
    # second instance never touched the bridge.
    bad = host.dir / "bad-policy.yaml"
    bad.write_text("capacity: 4\nstatistics: {promote_pps: 10, demote_ppps: 1}\n")
    conf = host.dir / "bad-offload.conf"
    conf.write_text(offload.offload_conf("xdp", str(bad), 0.1))
    proc = host.ns.run(
        [sys.executable, "-m", "ovs_ext.service", "--config-file", str(conf)], check=False
    )
    assert proc.returncode == 2
    assert "statistics.demote_ppps: unknown field" in proc.stderr
    assert _owned_rules(host) == bridge_before


def _owned_rules(host):
    """The app's rules in br-int, without counters and durations.  Counting rules
    (cookie kind 4) are left out: the bridge learns them and idles them out itself."""
    out = host.ns.run(["ovs-ofctl", "-O", "OpenFlow13", "dump-flows", "br-int"]).stdout
    strip = re.compile(r"duration=[^,]+, |n_packets=\d+, |n_bytes=\d+, |idle_age=[^,]+, ")
    return sorted(
        strip.sub("", line)
        for line in out.splitlines()
        if line.lstrip().startswith("cookie=0xf1e0")
        and not line.lstrip().startswith("cookie=0xf1e004")
    )


def test_provider_refusal_leaves_the_flow_onloaded_with_the_reason(olab, lab):
    service, eps = olab
    host = lab.host("A")
    small = "[offload_xdp]\ncapacity = 16\nbpffs_dir = /sys/fs/bpf/flexmig-cap16\n\n"
    policy = (
        ELEPHANT_POLICY
        + "header_rules:\n  - {name: full, ip_proto: udp, tp_dst: 9601, action: offload}\n"
    )
    service.start(policy, extra_conf=small)
    try:
        wait_status(service, lambda s: "ep-r1" in s["fast_path_ports"])
        # Another tool fills the eSwitch's table behind the app's back: the
        # kernel map, not the app's bookkeeping, is what refuses.
        for i in range(16):
            ctl = host.ns.run(
                [sys.executable, "-m", "ovs_ext.providers.xdp.ctl", "--config-file",
                 str(service.conf_file), "install", "ep-s2", "udp", eps["s2"].ip,
                 eps["r1"].ip, str(50000 + i), "9699", "ep-r1"],
                check=False,
            )  # fmt: skip
            assert ctl.returncode == 0, ctl.stderr
        for ep in ("s1",):
            assert run_in(eps[ep], ["ping", "-c", "1", "-W", "2", eps["r1"].ip]).returncode == 0
        flow = start_flow(service, eps, "s1", 41031, 9601)
        assert flow["state"] == "onloaded"
        assert flow["reason"] == "offload refused: provider xdp: offload table full (capacity 16)"
        assert "offload table full" in service.log_tail(30)
        packets = 2000
        receiver = traffic.Receiver(endpoints.exec_prefix(eps["r1"]), 9601, count=packets)
        send(eps, "s1", 41031, 9601, packets, rate=2000)
        received = receiver.result()["received_packets"]
        settle()
        shown = endpoint_counts(service, 41031, 9601)
        assert 200 not in shown  # nothing offloaded
        # All through OVS: its rule counted every packet, plus the judged first one.
        in_ovs = bridge_rule_packets(host, 41031, 9601)
        assert shown[0][0] == in_ovs + 1
        assert received <= in_ovs <= packets
    finally:
        service.start(ELEPHANT_POLICY)
        wait_status(service, lambda s: "ep-r1" in s["fast_path_ports"])
        for sender in ("s1", "s2"):
            run_in(eps[sender], ["ping", "-c", "1", "-W", "2", eps["r1"].ip])


def test_app_death_leaves_the_bridge_switching(olab, lab):
    """fail-mode standalone: with the app gone (cleanly), br-int switches NORMAL."""
    service, eps = olab
    service.stop()
    try:
        receiver = traffic.Receiver(endpoints.exec_prefix(eps["r1"]), 9701, count=100)
        send(eps, "s1", 41041, 9701, 100)
        assert receiver.result()["received_packets"] == 100
        out = lab.host("A").ns.run(["ovs-ofctl", "dump-flows", "br-int"]).stdout
        assert "cookie=0xf1e0" not in out and "actions=NORMAL" in out
    finally:
        service.start(ELEPHANT_POLICY)
        wait_status(service, lambda s: "ep-r1" in s["fast_path_ports"])


def test_bridge_reconnect_starts_the_app_afresh(olab, lab):
    """OVS dropping the controller connection (a restart, say): on reconnection the
    app deletes its rules, forgets every flow and offload entry, relearns ports."""
    service, eps = olab
    host = lab.host("A")
    start_flow(service, eps, "s1", 41051, 9801)
    _reconnect_bridge(service, host)
    discovery = [r for r in _owned_rules(host) if "cookie=0xf1e002" in r]
    assert len(discovery) == 3 * 4  # tcp, udp, arp on phy0, ep-s1, ep-s2, ep-r1
    assert start_flow(service, eps, "s1", 41052, 9801)["packets"] == 1


def test_a_flow_seen_before_a_reconnection_counts_each_packet_once(olab, lab):
    """The datapath still caches the flow after the reconnection: a packet through
    that cache must not be counted as the judged first one and again by its rule.
    The flow's counters go on from before the reconnection (never reset)."""
    service, eps = olab
    start_flow(service, eps, "s1", 41053, 9801)
    _reconnect_bridge(service, lab.host("A"))
    start_flow(service, eps, "s1", 41053, 9801)
    # Shown counters lag by a push and a poll (longer on a loaded host): wait for
    # the second packet, then check it stays counted once.
    wait_flow(service, 41053, 9801, lambda f: f["packets"] >= 2, what="the second packet counted")
    settle()
    assert flow_status(service, 41053, 9801)["packets"] == 2
    assert endpoint_counts(service, 41053, 9801)[0][0] == 2


def _reconnect_bridge(service, host):
    """OVS drops the controller and connects again; returns once the app started afresh."""
    host.ovs_vsctl("del-controller", "br-int")
    time.sleep(0.5)
    host.ovs_vsctl("set-controller", "br-int", "tcp:127.0.0.1:6653")
    wait_status(
        service,
        lambda s: not s["flows"] and "ep-r1" in s["fast_path_ports"] and s["bridge"]["judging"],
        what="the app to start afresh after reconnecting",
    )


def test_bad_provider_name_is_refused_at_start(lab):
    host = lab.host("A")
    conf = host.dir / "bad-provider.conf"
    policy_file = offload.LabOffload(host).policy_file
    conf.write_text(offload.offload_conf("tc-flowerz", str(policy_file), 0.1))
    proc = host.ns.run(
        [sys.executable, "-m", "ovs_ext.service", "--config-file", str(conf)], check=False
    )
    assert proc.returncode == 2
    assert "provider" in proc.stderr and "tc-flowerz" in proc.stderr
    with pytest.raises(errors.LabError):
        offload.LabOffload(host).start(provider="nonexistent", poll_interval=0.1)
    offload.LabOffload(host).start()
