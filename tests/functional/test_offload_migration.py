"""Offloaded flows follow their VM across a live migration (issue 15), in the lab.

A guest on host A sends UDP with its own udpgen through its tap port to a
receiver endpoint on host B; the XDP eSwitch carries the flow (a header rule
offloads it).  The agents migrate the VM; what happened is read as an operator
reads it: ``ovs-ofctl dump-flows br-int-offload`` on each host, the status
files, the migration's events and summary.  Counters are checked against the
sender's own count: source + destination = sent, never more.
"""

from __future__ import annotations

import re
import time

import libvirt
import pytest

from flexmig import hypervisor, migrate_cli, processutil
from flexmig_lab import endpoints, offload, topology, traffic, vm
from ovs_ext.providers.xdp import provider as xdp_provider

pytestmark = pytest.mark.lab

PORT = 7001
RATE = 1000  # pps: a paced TCG guest holds it on a loaded machine; OVS loses nothing at it
POLICY = """\
capacity: 64
header_rules:
  - {name: guest-udp, ip_proto: udp, tp_dst: 7001, action: offload}
statistics:
  window_s: 0.5
  promote_pps: 1000000
  demote_pps: 1
  demote_intervals: 10000
"""
DUMP_LINE = re.compile(r"table=(\d+), n_packets=(\d+), n_bytes=(\d+)")
REOFFLOAD_BOUND_S = 5.0
POSTCOPY_MIB = 12  # below the guest's dirty rate: hybrid switches after round 1


@pytest.fixture(scope="module")
def mlab(lab):
    for built in (xdp_provider.ESWITCH_OBJECT, xdp_provider.RX_PASS_OBJECT, traffic.UDPGEN):
        if not built.is_file():
            pytest.skip(f"{built} is not built (tools/setup.sh)")
    if not offload.provider_installed("xdp"):
        pytest.skip("the xdp offload provider is not installed (tools/setup.sh)")
    services = {h: offload.LabOffload(lab.host(h)) for h in ("A", "B")}
    for service in services.values():
        service.start(POLICY)
    receiver = endpoints.add(lab, "B", "r1")
    # 4,000 pages/s over 32 MiB (16 MB/s): precopy converges at the lab's full
    # stream, never at POSTCOPY_MIB, so the postcopy case really switches.
    guest = vm.create(
        lab, "A", ram="192M", workload="dirtier:wss=32M,rate=4000",
        memory_backing="anonymous", name="flowvm",
    )  # fmt: skip
    port = f"tap{guest.spec.index}"
    status = wait_status(services["A"], lambda s: port in s["fast_path_ports"], what=port)
    assert port in status["ports"]
    yield services, receiver, guest
    vm.destroy(lab, "flowvm")
    endpoints.delete(lab, "r1")
    for service in services.values():
        service.start()  # the lab's standing policy for whatever runs next


# -- helpers -------------------------------------------------------------------------
def wait_status(service, predicate, timeout=15.0, what="offload status"):
    def probe():
        try:
            status = service.status()
        except (FileNotFoundError, ValueError):
            return None
        return status if predicate(status) else None

    return processutil.wait_for(probe, timeout=timeout, interval=0.05, what=what)


def flow_of(status, sport, in_port=None):
    """The guest's flow (entering by its tap) in a status file; the same packets
    crossing the other host's bridge from its uplink are another flow there."""
    for flow in status["flows"]:
        match = flow["match"]
        if (match["tp_src"], match["tp_dst"]) != (sport, PORT):
            continue
        if match["in_port"].startswith("tap") if in_port is None else match["in_port"] == in_port:
            return flow
    return None


def wait_flow(service, sport, predicate, what, timeout=15.0):
    status = wait_status(
        service, lambda s: (f := flow_of(s, sport)) is not None and predicate(f), timeout, what
    )
    return flow_of(status, sport)


def ofport(service, port):
    return service.host.ns.run(["ovs-vsctl", "get", "Interface", port, "ofport"]).stdout.strip()


def dumped(service, sport, port):
    """{table: packets} of the flow in `ovs-ofctl dump-flows br-int-offload`."""
    found = {}
    for line in _dumped_lines(service, sport):
        if f"in_port={ofport(service, port)}," in line:
            m = DUMP_LINE.search(line)
            found[int(m.group(1))] = int(m.group(2))
    return found


def _dumped_lines(service, sport):
    return [
        line
        for line in service.dump_flows().splitlines()
        if f"tp_src={sport}," in line and f"tp_dst={PORT}" in line
    ]


def guest_rules_left(service, sport):
    """Rules of the guest's flow on a host it left.  The same packets still cross
    that host's bridge from its uplink when the receiver lives there (the postcopy
    case, B -> A with the receiver on B): that is the fabric's flow, not the VM's."""
    uplink = f"in_port={ofport(service, topology.HOST_TENANT_IF)},"
    return [line for line in _dumped_lines(service, sport) if uplink not in line]


def start_traffic(guest, receiver, sport, seconds):
    """The guest sends for ``seconds`` at RATE; B's endpoint counts what arrives."""
    recv = traffic.Receiver(
        endpoints.exec_prefix(receiver), PORT, duration=seconds + 60, idle_ms=4000
    )
    count = RATE * seconds
    guest.udpgen_start(
        f"s{sport}",
        ["send", "--dst", receiver.ip, "--port", str(PORT), "--sport", str(sport),
         "--rate", str(RATE), "--count", str(count), "--size", "64", "--batch", "8"],
    )  # fmt: skip
    return recv


def destroy_incoming(lab, source_name, host_name, name, after_bytes=4 << 20):
    """The destination "crashes" mid-copy: its incoming QEMU is destroyed once the
    source's job has moved ``after_bytes`` (not while libvirt is still starting
    it, when destroy races the start and the domain vanishes by itself)."""
    copied = 0

    def copying():
        nonlocal copied
        source = lab.host(source_name)
        with hypervisor.connect(source.local_uri, source.name) as conn:
            dom = hypervisor.find_domain(conn, name)
            try:
                stats = dom.jobStats() if dom is not None else {}
            except libvirt.libvirtError:
                return False  # the job is starting or gone: look again
            copied = stats.get("data_processed", 0)
            return copied >= after_bytes

    processutil.wait_for(copying, timeout=60, interval=0.1, what=f"{name}'s copy under way")
    host = lab.host(host_name)
    with hypervisor.connect(host.local_uri, host.name) as conn:
        dom = hypervisor.find_domain(conn, name)
        assert dom is not None and dom.isActive(), f"no incoming {name} on {host_name}"
        dom.destroy()
    return copied


def wait_running(lab, host_name, name, timeout=10.0):
    """The VM runs on ``host_name`` (a failed migration's source must resume it)."""
    host = lab.host(host_name)

    def running():
        with hypervisor.connect(host.local_uri, host.name) as conn:
            dom = hypervisor.find_domain(conn, name)
            return dom is not None and dom.state()[0] == libvirt.VIR_DOMAIN_RUNNING

    processutil.wait_for(
        running, timeout=timeout, interval=0.1, what=f"{name} running on {host_name}"
    )


def check_counted_once(services, to, frm, sport, sent, received, port):
    """Destination totals = every packet the switches saw, the source shows nothing."""
    # What was received counted (shown counters lag by a revalidator push and a
    # poll, longer on a loaded host), then a last poll for anything beyond it.
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        flow = flow_of(services[to].status(), sport)
        if flow is not None and flow["packets"] >= received:
            break
        time.sleep(0.2)
    time.sleep(1.5)
    flow = flow_of(services[to].status(), sport)
    assert flow is not None
    assert flow_of(services[frm].status(), sport) is None
    assert guest_rules_left(services[frm], sport) == [], services[frm].dump_flows()
    assert received <= flow["packets"] <= sent, (received, flow, sent)
    if received == sent:  # a loss-free run: exactly what was sent, never more
        assert flow["packets"] == sent
    shown = dumped(services[to], sport, port)
    assert shown.get(0) == flow["packets"], (shown, services[to].dump_flows())
    assert shown.get(200) == flow["offloaded_packets"], shown
    return flow


def received_once(recv):
    """What arrived, by the sender's sequence numbers: no datagram twice."""
    got = recv.result()
    assert got["duplicates"] == 0 and got["unique_packets"] == got["received_packets"], got
    return got["received_packets"]


def run_migration(lab, services, guest, receiver, sport, mode, to, frm, bandwidth_mib=0):
    recv = start_traffic(guest, receiver, sport, seconds=25)
    try:
        return _migrate_with_traffic(
            lab, services, guest, recv, sport, (mode, bandwidth_mib), to, frm
        )
    finally:
        recv.proc.kill()  # a failed check must not leave the port taken


def _migrate_with_traffic(lab, services, guest, recv, sport, how, to, frm):
    mode, bandwidth_mib = how
    before = wait_flow(
        services[frm], sport, lambda f: f["state"] == "offloaded" and f["offloaded_packets"] > 0,
        f"the guest's flow offloaded on {frm}",
    )  # fmt: skip
    assert before["owner"] == f"tap{guest.spec.index}"
    result = migrate_cli.migrate(
        lab, "flowvm", to, mode=mode, show=False, bandwidth_mib=bandwidth_mib
    )
    assert result["state"] == "completed", result["error"]
    assert result["running_on"] == to
    after = wait_flow(
        services[to], sport, lambda f: f["state"] == "offloaded",
        f"the flow re-offloaded on {to}", timeout=5,
    )  # fmt: skip
    assert "re-offloaded after migration" in after["reason"], after
    # The source's offloaded packets came across: the destination's offloaded
    # part already exceeds what the source offloaded before the move.
    assert after["offloaded_packets"] >= before["offloaded_packets"]
    sent = guest.udpgen_result(f"s{sport}", timeout=60)["sent_packets"]
    received = received_once(recv)
    flow = check_counted_once(services, to, frm, sport, sent, received, before["owner"])
    summary = result["offload"]
    print(
        f"{mode}: re-offloaded {summary['reoffload_delays_s']} s after resume; "
        f"sent {sent} received {received} counted {flow['packets']}"
    )
    assert summary["were_offloaded"] >= 1 and summary["reoffloaded"] >= 1, summary
    # The 1 s target is the benchmark's (quiet machine, exclusive lock); here, on a
    # shared machine, the re-offload must happen and be timed, within a bound.
    assert 0 <= max(summary["reoffload_delays_s"]) <= REOFFLOAD_BOUND_S, summary
    events = "\n".join(result["events"])
    for step in ("demoted to the vSwitch", "flow records transferred", "re-offloaded there"):
        assert step in events, events
    return result, flow


def test_offloaded_flow_follows_a_precopy_migration(lab, mlab):
    services, receiver, guest = mlab
    if guest.locate() != "A":
        pytest.skip("the VM is not on A (an earlier test failed midway)")
    result, _ = run_migration(lab, services, guest, receiver, 41001, "precopy", "B", "A")
    assert not result["switched_to_postcopy"]


def test_offloaded_flow_follows_a_postcopy_migration(lab, mlab):
    services, receiver, guest = mlab
    here = guest.locate()
    there = "A" if here == "B" else "B"
    result, _ = run_migration(
        lab, services, guest, receiver, 41002, "postcopy", there, here, POSTCOPY_MIB
    )
    assert result["switched_to_postcopy"]


def test_failed_migration_leaves_flows_offloaded_on_the_source(lab, mlab):
    services, receiver, guest = mlab
    here = guest.locate()
    there = "A" if here == "B" else "B"
    sport = 41003
    recv = start_traffic(guest, receiver, sport, seconds=25)
    try:
        _fail_a_migration(lab, services, guest, recv, sport, here, there)
    finally:
        recv.proc.kill()


def _fail_a_migration(lab, services, guest, recv, sport, here, there):
    before = wait_flow(
        services[here], sport, lambda f: f["state"] == "offloaded", f"flow offloaded on {here}"
    )
    _, agent, mid = migrate_cli.start(lab, "flowvm", there, mode="precopy", bandwidth_mib=4)
    wait_status(
        services[here],
        lambda s: (f := flow_of(s, sport)) is not None and f["state"] == "onloaded",
        what="the flow demoted on the source for the migration",
    )
    destroy_incoming(lab, here, there, "flowvm")
    record = migrate_cli.follow(agent, mid)
    assert record["state"] == "failed"
    assert guest.locate() == here
    wait_running(lab, here, "flowvm")  # kept running, never left paused
    flow = wait_flow(
        services[here], sport, lambda f: f["state"] == "offloaded",
        "the flow re-offloaded on the source", timeout=5,
    )  # fmt: skip
    assert "failed" in flow["reason"] and flow["moves"] > before["moves"]
    status = services[here].status()
    mig = next(m for m in status["migrations"] if m["id"] == mid)
    assert mig["state"] == "restored" and mig["reason"].startswith("migration to")
    assert flow_of(services[there].status(), sport) is None  # the destination dropped it
    sent = guest.udpgen_result(f"s{sport}", timeout=60)["sent_packets"]
    received = received_once(recv)
    time.sleep(1.5)
    total = flow_of(services[here].status(), sport)["packets"]
    assert received <= total <= sent
