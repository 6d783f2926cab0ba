"""The offload app beside Neutron's real OVS agent driving the lab's br-int.

What runs on lab host A (``flexmig_lab.neutron_agent``): Neutron 29's
``neutron-openvswitch-agent`` main (``neutron.cmd.agents.ovs_neutron_agent``)
as Neutron ships it: its os-ken app is br-int's OpenFlow controller (native
of_interface, tcp:127.0.0.1:6633); ``OVSNeutronAgent`` sets the bridge up
(``setup_integration_br``: secure fail mode, its controller, default tables,
canary), polls OVSDB, binds the ports (local VLANs), cleans stale flows; the
OVS firewall driver (``OVSFirewallDriver``) installs the ports' anti-spoofing
and security-group rules with conntrack; its L2 agent extensions manager
loads FlexMig's ``flexmig_offload`` extension, which writes the port facts
flexmig-offload reads.  Only neutron-server is a stub, at the RPC boundary
(oslo.messaging's fake transport; the module's doc says which calls).

Then FlexMig's real flexmig-offload (``pipeline = neutron``, XDP provider)
joins the bridge beside it: its own controller record, its hand-off rules.

- s1: port security on; its security group allows egress ICMP and UDP to port
  5201 only;
- s2, r1: port security off, same network.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flexmig import processutil
from flexmig_lab import endpoints, offload, traffic
from ovs_ext.providers.xdp import provider as xdp_provider
from tests.functional.test_offload_neutron import (
    POLICY,
    counted,
    flow_of,
    ofctl,
    receive,
    run_in,
    send,
    sent_frames,
    settle,
    vsctl,
    wait_flow,
    wait_status,
)

pytestmark = pytest.mark.lab

NEUTRON_CONTROLLER = "tcp:127.0.0.1:6633"
PORTS_FILE = "/run/flexmig/neutron-ports.json"
AGENT_PID_FILE = "/run/flexmig/neutron-agent.pid"
AGENT_HOST = "lab-host-a"
NETWORK_ID = "0f1e0000-0000-4000-8000-00000000ae71"
SUBNET_ID = "0f1e0000-0000-4000-8000-00000000ae72"
SG_ID = "5ec00000-0000-4000-8000-000000000001"
ALLOWED_DPORT = 5201
APP_COOKIE_PREFIX = "cookie=0xf1e"
NEUTRON_READY_TIMEOUT = 120.0


def port_id(name: str) -> str:
    return f"0f1e0000-0000-4000-8000-{name.encode().hex():0>12}"


def agent_conf(host) -> str:
    return f"""\
[DEFAULT]
host = {AGENT_HOST}
transport_url = fake:/
state_path = {host.dir}/neutron
debug = true
log_file = {host.dir}/neutron-agent.log
[agent]
extensions = flexmig_offload
# Root already; privsep-helper comes from the same virtualenv (PATH).
root_helper = env
polling_interval = 1
# Poll every second instead of waiting for OVSDB events: the agent's one-off
# stale-flow cleanup then runs at its second iteration, not at some later
# port change, and the tests know when it has run.
minimize_polling = false
[ovs]
integration_bridge = br-int
# The lab's br-int is userspace (netdev), as on a DPDK host; the default
# (system) would move it to the kernel datapath.
datapath_type = netdev
ovsdb_connection = unix:/run/openvswitch/db.sock
of_listen_address = 127.0.0.1
of_listen_port = 6633
[securitygroup]
firewall_driver = openvswitch
enable_security_group = true
[flexmig_offload]
ports_file = {PORTS_FILE}
"""


def server_state(eps, macs, secured) -> dict:
    return {
        "host": AGENT_HOST,
        "network_id": NETWORK_ID,
        "subnet_id": SUBNET_ID,
        "ports": [
            {
                "id": port_id(name),
                "name": ep.port,
                "mac": macs[name],
                "ip": ep.ip,
                "port_security": name in secured,
                "security_groups": [SG_ID] if name == "s1" else [],
            }
            for name, ep in eps.items()
        ],  # fmt: skip
        "security_groups": [
            {
                "id": SG_ID,
                "rules": [
                    {"direction": "egress", "protocol": "icmp"},
                    {
                        "direction": "egress",
                        "protocol": "udp",
                        "port_range_min": ALLOWED_DPORT,
                        "port_range_max": ALLOWED_DPORT,
                    },
                ],
            }
        ],  # fmt: skip
    }


def write_state(host, eps, macs, secured) -> None:
    path = host.dir / "neutron-server.json"
    tmp = path.with_name(".neutron-server.tmp")
    tmp.write_text(json.dumps(server_state(eps, macs, secured)))
    tmp.replace(path)


def endpoint_mac(ep) -> str:
    out = processutil.run([*endpoints.exec_prefix(ep), "ip", "-j", "link", "show",
                           endpoints.ENDPOINT_IF]).stdout  # fmt: skip
    return json.loads(out)[0]["address"]


def neutron_rules(host, stats=False) -> list[str]:
    """Every rule on br-int that is not the app's, as `ovs-ofctl dump-flows` prints it."""
    out = ofctl(host, "dump-flows", "br-int", *(() if stats else ("--no-stats",)))
    return sorted(
        line.strip() for line in out.splitlines()
        if "cookie=" in line and APP_COOKIE_PREFIX not in line
    )  # fmt: skip


def without_cookie(rules: list[str]) -> list[str]:
    return sorted(re.sub(r"cookie=0x[0-9a-f]+,? ?", "", r) for r in rules)


def rule_packets(host, table: int, *needles: str) -> int:
    found = [line for line in neutron_rules(host, stats=True) if f"table={table}," in line
             and all(n in line for n in needles)]  # fmt: skip
    assert len(found) == 1, found
    return int(re.search(r"n_packets=(\d+)", found[0]).group(1))


class NeutronAgent:
    """neutron-openvswitch-agent on a lab host (flexmig_lab.neutron_agent)."""

    def __init__(self, host) -> None:
        self.host = host
        self.conf = host.dir / "neutron-agent.ini"
        self.log = host.dir / "neutron-agent.log"

    def start(self) -> None:
        self.conf.write_text(agent_conf(self.host))
        bindir = Path(sys.executable).parent
        script = (
            f"echo $$ > {AGENT_PID_FILE}; PATH={bindir}:$PATH exec {sys.executable} "
            f"-m flexmig_lab.neutron_agent --config-file {self.conf} "
            f"--server-state {self.host.dir / 'neutron-server.json'}"
        )
        self.proc = self.host.ns.spawn(["sh", "-c", script], self.host.dir / "neutron-agent.out")

    def wait_ready(self, ports: list[int], after: int = 0) -> None:
        """The firewall's rules for every port are in, and its stale-flow cleanup ran."""

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"neutron agent exited: {self.tail()}")
            text = self.log.read_text(errors="replace") if self.log.exists() else ""
            if "Agent main thread died" in text:  # os-ken's threads keep the process up
                raise AssertionError(f"neutron agent failed: {self.tail()}")
            if text.count("Cleaning stale br-int flows") <= after:
                return None
            out = ofctl(self.host, "dump-flows", "br-int", "table=60")
            return all(f"in_port={p} " in out for p in ports) or None

        processutil.wait_for(ready, timeout=NEUTRON_READY_TIMEOUT, interval=0.5,
                             what="Neutron's OVS agent to set br-int up")  # fmt: skip
        settle()  # the iteration after the cleanup

    def cleanups(self) -> int:
        return self.log.read_text(errors="replace").count("Cleaning stale br-int flows")

    def stop(self) -> None:
        """SIGTERM as systemd stops it; SIGKILL when its os-ken threads outlive its loop."""
        for sig, wait_s in (("TERM", 5), ("KILL", 10)):
            if self.proc.poll() is not None:
                return
            self.host.ns.run(["sh", "-c", f"kill -{sig} $(cat {AGENT_PID_FILE})"], check=False)
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else "(no log)"
        return "\n".join(text.splitlines()[-lines:])


@pytest.fixture(scope="module")
def real(lab):
    if importlib.util.find_spec("neutron") is None:
        pytest.skip("Neutron is not installed (test-requirements.txt: tools/setup.sh, tox)")
    for built in (xdp_provider.ESWITCH_OBJECT, xdp_provider.RX_PASS_OBJECT, traffic.UDPGEN):
        if not built.is_file():
            pytest.skip(f"{built} is not built (tools/setup.sh)")
    if not offload.provider_installed("xdp"):
        pytest.skip("the xdp offload provider is not installed (tools/setup.sh)")
    host = lab.host("A")
    service = offload.LabOffload(host)
    service.stop()  # Neutron's agent owns this bridge now
    eps = {name: endpoints.add(lab, "A", name) for name in ("s1", "s2", "r1")}
    macs = {name: endpoint_mac(ep) for name, ep in eps.items()}
    ofports = {name: int(vsctl(host, "get", "Interface", ep.port, "ofport")) for name, ep in
               eps.items()}  # fmt: skip
    # What Nova's VIF plugging (os-vif) leaves on a VM's port: its Neutron port id.
    for name, ep in eps.items():
        vsctl(
            host,
            "set",
            "Interface",
            ep.port,
            f"external_ids:iface-id={port_id(name)}",
            f"external_ids:attached-mac={macs[name]}",
            "external_ids:iface-status=active",
        )
    vsctl(host, "del-controller", "br-int")
    ofctl(host, "del-flows", "br-int")
    write_state(host, eps, macs, secured={"s1"})
    agent = NeutronAgent(host)
    agent.start()
    try:
        agent.wait_ready(list(ofports.values()))
        golden = neutron_rules(host)
        service.start(
            POLICY,
            provider="xdp",
            options=f"pipeline = neutron\nneutron_ports_file = {PORTS_FILE}\n",
        )
        status = wait_status(service, lambda s: {"ep-s1", "ep-s2", "ep-r1"} <= set(s["ports"]))
        if "ep-r1" not in status["fast_path_ports"]:
            pytest.skip(f"XDP could not attach here: {service.log_tail()}")
        for sender in ("s1", "s2"):  # ARP through Neutron's pipeline; the app learns MACs
            ping = run_in(eps[sender], ["ping", "-c", "1", "-W", "2", eps["r1"].ip])
            assert ping.returncode == 0, ping.stdout
        yield host, service, agent, eps, macs, ofports, golden
    finally:
        service.stop()
        agent.stop()
        for cmd in (
            ["ovs-vsctl", "--timeout=10", "del-controller", "br-int", "--", "set-fail-mode",
             "br-int", "standalone"],
            ["ovs-ofctl", "del-flows", "br-int"],
            ["ovs-ofctl", "add-flow", "br-int", "priority=0,actions=NORMAL"],
        ):  # fmt: skip
            host.ns.run(cmd, check=False)  # best effort: the lab goes down after
        host.ns.root_path(PORTS_FILE).unlink(missing_ok=True)
        for name in eps:
            endpoints.delete(lab, name)
        service.start()  # the lab's standing (standalone) app for whatever runs next


# -- tests --------------------------------------------------------------------------
def test_real_agent_keeps_its_controller_rules_and_counters(real):
    host, service, agent, eps, macs, ofports, golden = real
    controllers = vsctl(host, "get-controller", "br-int").split()
    assert NEUTRON_CONTROLLER in controllers and len(controllers) == 2, controllers
    assert vsctl(host, "get-fail-mode", "br-int").strip() == "secure"
    # Neutron's firewall saw the ports: its anti-spoofing rule for s1 is in.
    s1 = ofports["s1"]
    spoof = (f"ip,reg5={s1:#x},in_port={s1},dl_src={macs['s1']},nw_src={eps['s1'].ip}",)
    app_rules = [line for line in ofctl(host, "dump-flows", "br-int").splitlines()
                 if APP_COOKIE_PREFIX in line]  # fmt: skip
    assert app_rules and all("priority=0" not in line for line in app_rules), app_rules
    assert all("table=0," not in line or "priority=65000" in line for line in app_rules)
    before = rule_packets(host, 71, *spoof)
    dispatch_before = rule_packets(host, 60, f"priority=100,in_port={s1} ")
    frames_before = sent_frames(eps["s1"])
    packets = 500
    receiver = receive(eps, ALLOWED_DPORT, packets)
    send(eps, "s1", 42001, ALLOWED_DPORT, packets, rate=1000)
    received = receiver.result()["received_packets"]
    settle()
    frames = sent_frames(eps["s1"]) - frames_before
    # Neutron's port dispatch saw every frame s1 sent exactly once (its ARP
    # probes and IPv6 chatter too: CI once saw 501 for 500), its anti-spoofing
    # rule every IPv4 packet, the app judged the flow, and Neutron's rules are
    # exactly its own.
    assert rule_packets(host, 71, *spoof) - before == packets
    assert frames >= packets
    assert rule_packets(host, 60, f"priority=100,in_port={s1} ") - dispatch_before == frames
    assert received == packets
    assert counted(service, 42001, ALLOWED_DPORT, packets) == packets
    assert neutron_rules(host) == golden


def test_security_group_drops_stay_dropped_at_elephant_rate(real):
    host, service, agent, eps, macs, ofports, golden = real
    s1 = ofports["s1"]
    denied_dport = 5301
    # Table 72 (the OVS firewall's egress rules): a new connection no rule
    # accepts goes to the drop table.
    drop_rule = (f"priority=40,ct_state=-est,reg5={s1:#x} ",)
    drops_before = rule_packets(host, 72, *drop_rule)
    packets = 8000  # an elephant: 2 s above promote_pps
    receiver = receive(eps, denied_dport, packets)
    send(eps, "s1", 42002, denied_dport, packets)
    received = receiver.result()["received_packets"]
    settle()
    flow = flow_of(service, 42002, denied_dport)
    assert flow["state"] == "onloaded" and flow["moves"] == 0, flow
    assert "port ep-s1 has port security" in flow["reason"], flow
    assert received == 0
    assert rule_packets(host, 72, *drop_rule) - drops_before == packets
    # An allowed elephant from the secured port is delivered, still through OVS.
    receiver = receive(eps, ALLOWED_DPORT, packets)
    send(eps, "s1", 42003, ALLOWED_DPORT, packets)
    assert receiver.result()["received_packets"] == packets
    settle()
    allowed = flow_of(service, 42003, ALLOWED_DPORT)
    assert allowed["state"] == "onloaded" and "port security" in allowed["reason"], allowed
    assert neutron_rules(host) == golden


def test_port_security_off_flow_offloaded_and_back_when_neutron_enables_it(real):
    host, service, agent, eps, macs, ofports, golden = real
    sport, dport = 42004, 7001
    packets = 12_000
    receiver = receive(eps, dport, packets)
    send(eps, "s2", sport, dport, packets)
    received = receiver.result()["received_packets"]
    flow = wait_flow(service, sport, dport, lambda f: f["state"] == "offloaded", timeout=3)
    assert flow["reason"] == "promoted by statistics", flow
    settle()
    flow = flow_of(service, sport, dport)
    assert flow["offloaded_packets"] > 0 and received >= 0.99 * packets
    assert neutron_rules(host) == golden
    # neutron-server turns port security on for s2 and pushes the port: the
    # agent re-handles it, FlexMig's extension writes the fact, and the flow is
    # back in OVS (where Neutron's firewall now judges s2's packets).
    write_state(host, eps, macs, secured={"s1", "s2"})
    flow = wait_flow(service, sport, dport, lambda f: f["state"] == "onloaded", timeout=15)
    assert "port ep-s2 has port security" in flow["reason"], flow
    write_state(host, eps, macs, secured={"s1"})
    wait_status(service, lambda s: True)
    processutil.wait_for(
        lambda: json.loads(host.ns.root_path(PORTS_FILE).read_text())["ports"]["ep-s2"][
            "port_security"] is False or None,
        timeout=15, interval=0.2, what="the extension to see s2 unsecured again",
    )  # fmt: skip


def test_app_survives_a_restart_of_neutrons_agent(real):
    host, service, agent, eps, macs, ofports, golden = real
    # A restarted agent reserves a new cookie, re-installs its rules under it
    # and deletes, in its tables, every rule whose cookie it did not reserve:
    # the app's hand-off rules in table 0 among them.
    cleanups = agent.cleanups()
    deleted_before = agent.log.read_text(errors="replace").count("Deleting flow with cookie 0xf1e")
    agent.stop()
    agent.start()
    agent.wait_ready(list(ofports.values()), after=cleanups)

    def handoffs_back():
        out = ofctl(host, "dump-flows", "br-int", "table=0")
        return out.count("priority=65000") >= 3 or None

    processutil.wait_for(handoffs_back, timeout=15, interval=0.2, what="hand-off rules re-added")
    # They were Neutron's to delete: the restarted agent's cleanup took them.
    deleted = agent.log.read_text(errors="replace").count("Deleting flow with cookie 0xf1e")
    assert deleted > deleted_before, agent.tail()
    controllers = vsctl(host, "get-controller", "br-int").split()
    assert NEUTRON_CONTROLLER in controllers and len(controllers) == 2, controllers
    # Neutron's rules are its own again (a new cookie, the same rules).
    assert without_cookie(neutron_rules(host)) == without_cookie(golden)
    packets = 200
    receiver = receive(eps, 7002, packets)
    send(eps, "s2", 42005, 7002, packets, rate=1000)
    assert receiver.result()["received_packets"] == packets
    assert counted(service, 42005, 7002, packets) == packets
