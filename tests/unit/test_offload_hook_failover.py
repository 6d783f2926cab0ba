"""SR-IOV failover pairs through the offload hook: the steps and their order.

Each host's extension is the simulated host of test_offload_control behind its
real control socket (with VF representors as VM ports); libvirt is its test
driver holding the VM with a VF primary and a virtio standby (the test driver
cannot hot-plug, so plugging a VF is recorded instead); sysfs is a tree in a
temporary directory laid out as a switchdev NIC's.
"""

from __future__ import annotations

import time

import pytest

from agents.agent import sriov_failover
from agents.agent.offload_hook import OffloadHook, check_failover
from flexmig import exceptions
from ovs_ext import control_api
from ovs_ext.app import Runtime
from ovs_ext.flows import FlowState
from ovs_ext.providers.base import FlowMatch
from tests.unit.test_offload_control import Sim, stats_policy
from tests.unit.test_offload_hook import KEY

MAC = "52:54:00:aa:bb:01"
SRC_VF, DST_VF = "0000:3b:02.1", "0000:5e:00.3"
STANDBY = """<interface type='bridge'><source bridge='br-int'/><mac address='{mac}'/>
<target dev='tap4'/><model type='virtio'/><teaming type='persistent'/>
<alias name='ua-standby0'/></interface>"""
PRIMARY = """<interface type='hostdev' managed='yes'><mac address='{mac}'/><source>
<address type='pci' domain='0x0000' bus='0x3b' slot='0x02' function='0x1'/></source>
<teaming type='transient' persistent='ua-standby0'/></interface>"""


def node(*ifaces):
    devices = "".join(i.format(mac=MAC) for i in ifaces)
    return (
        "<node><domain type='test'><name>vm1</name><memory>65536</memory>"
        f"<os><type>hvm</type></os><devices>{devices}</devices></domain></node>"
    )


def sysfs(root, pf, vf, index, switch_id, rep):
    """A PF in switchdev mode, one of its VFs, and the VF's representor."""
    pci = root / "bus/pci/devices"
    (pci / pf / "net/pfdev").mkdir(parents=True, exist_ok=True)
    (pci / pf / "net/pfdev/phys_switch_id").write_text(switch_id + "\n")
    (pci / pf / "net/pfdev/phys_port_name").write_text("p0\n")
    (pci / vf).mkdir(parents=True, exist_ok=True)
    (pci / vf / "physfn").symlink_to(pci / pf)
    (pci / pf / f"virtfn{index}").symlink_to(pci / vf)
    (root / "class/net" / rep).mkdir(parents=True)
    (root / "class/net" / rep / "phys_switch_id").write_text(switch_id + "\n")
    (root / "class/net" / rep / "phys_port_name").write_text(f"pf0vf{index}\n")


class Host:
    """One host: its extension (simulated, real socket), libvirt node, hook."""

    def __init__(self, tmp, name, node_xml, vfs=()):
        tmp.mkdir()
        self.sim = Sim(
            stats_policy(capacity=64), 64, (r"tap\d+", r"pf\d+vf\d+", r"eth\d+"),
            ("tap4", "pf0vf1", "eth9"),
        )  # fmt: skip
        runtime = Runtime(self.sim.control, "br-int", 0.1, status_file=str(tmp / "status.json"))
        self.served = control_api.serve(runtime, str(tmp / "ctl.sock"), KEY)
        (tmp / "node.xml").write_text(node_xml)
        self.node = tmp / "node.xml"
        self.hook = OffloadHook(
            str(tmp / "ctl.sock"), KEY, name, f"test://{self.node}", list(vfs), tmp.parent / "sys"
        )
        self.steps: list[str] = []
        local = self.hook.local

        def logged(method, path, body=None):
            self.steps.append(path.rsplit("/", 1)[-1] + _rekey_note(body))
            return local(method, path, body)

        self.hook.local = logged

    def close(self):
        self.served.server.shutdown()
        self.served.server.server_close()


def _rekey_note(body):
    if body and "from" in body:
        return f" {body['from']}->{body['to']}"
    if body and "rekey" in body:
        return " rekey " + ",".join(f"{k}->{v}" for k, v in body["rekey"].items())
    return ""


class PeerAgent:
    """The destination agent as the source's hook sees it: the real hook behind."""

    address = "hostB"

    def __init__(self, host):
        self.host = host
        self.posts = []

    def post(self, path, body):
        self.posts.append((path, body))
        hook = self.host.hook
        if path == "/v1/offload/arrive":
            note = hook.arrive(body["migration_id"], body["vm"], body["ports"], body["peer"],
                               body["flows"], failover=body.get("failover"))  # fmt: skip
            return {"note": note}
        if path == "/v1/offload/settle":
            return hook.settle(body["migration_id"], body["flows"])
        if path == "/v1/offload/abandon":
            return hook.abandon(body["migration_id"], body["reason"])
        raise AssertionError(path)


@pytest.fixture
def hosts(tmp_path, monkeypatch):
    sysfs(tmp_path / "sys", "0000:3b:00.0", SRC_VF, 1, "aa01", "pf0vf1")
    sysfs(tmp_path / "sys", "0000:5e:00.0", DST_VF, 3, "bb02", "eth9")
    src = Host(tmp_path / "a", "hostA", node(STANDBY, PRIMARY))
    dst = Host(tmp_path / "b", "hostB", node(STANDBY), vfs=[DST_VF])
    plugged = []

    def plug(dom, pair, host):
        plugged.append((host, pair.vf_pci, pair.mac, pair.standby_alias))
        for h in (src, dst):
            if h.hook.host == host:
                h.steps.append(f"plug {pair.vf_pci}")

    monkeypatch.setattr(sriov_failover, "plug", plug)
    yield src, dst, plugged
    src.close()
    dst.close()


def vf_flow(n=1, port="pf0vf1"):
    return FlowMatch(port, 17, "10.251.0.10", "10.251.0.20", 40000 + n, 5201)


def offloaded(sim, m):
    sim.start(m, "phy0")
    for _ in range(3):
        sim.tick({m: 5000})
    assert sim.control.flows.get(m).state is FlowState.OFFLOADED
    return sim.control.flows.get(m).total


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_the_vf_flows_go_to_the_standby_then_to_the_destination_vf(hosts):
    src, dst, plugged = hosts
    m = vf_flow()
    before = offloaded(src.sim, m)
    events = []
    assert src.hook.depart("m-1", "vm1", PeerAgent(dst), events.append)
    # Source: demoted and re-keyed to the standby in the one depart call.
    assert src.steps == ["depart rekey pf0vf1->tap4"]
    on_standby = src.sim.control.flows.get(vf_flow(port="tap4"))
    assert src.sim.control.flows.get(m) is None and on_standby.total == before
    assert on_standby.state is FlowState.ONLOADED and on_standby.held
    assert any("re-keyed to the standby tap4" in e and "QEMU unplugs" in e for e in events)
    # Destination: once the VM runs (the test driver's always does), a VF of its
    # pool is plugged, the flows re-keyed to its representor, then re-offloaded.
    assert wait_for(lambda: "resume" in dst.steps)
    assert dst.steps == ["arrive", f"plug {DST_VF}", "rekey tap4->eth9", "resume"]
    assert plugged == [("hostB", DST_VF, MAC, "ua-standby0")]
    arrived = dst.sim.control.flows.get(vf_flow(port="eth9"))
    assert arrived is not None and arrived.total == before and arrived.reoffload
    assert dst.sim.control.flows.get(vf_flow(port="tap4")) is None
    summary = src.hook.finish("m-1", PeerAgent(dst), events.append)
    assert summary["failover"] == [
        f"{MAC}: VF {DST_VF} plugged as primary; flows re-keyed from tap4 to eth9"
    ]
    assert any("SR-IOV failover on the destination" in e for e in events)


def test_a_failed_migration_plugs_the_vf_back_on_the_source_before_reoffloading(hosts):
    src, dst, plugged = hosts
    m = vf_flow()
    before = offloaded(src.sim, m)
    events = []
    peer = PeerAgent(dst)
    assert src.hook.depart("m-2", "vm1", peer, events.append)
    # QEMU unplugged the primary for the migration and did not plug it back.
    src.node.write_text(node(STANDBY))
    src.steps.clear()
    src.hook.restore("m-2", "the destination died", peer, events.append)
    # The VF first (the guest's traffic leaves the standby), then its flows, then offload.
    assert src.steps == [f"plug {SRC_VF}", "rekey tap4->pf0vf1", "restore"]
    assert ("hostA", SRC_VF, MAC, "ua-standby0") in plugged
    back = src.sim.control.flows.get(m)
    assert back is not None and back.state is FlowState.OFFLOADED and back.total == before
    assert src.sim.control.flows.get(vf_flow(port="tap4")) is None
    assert any(f"VF {SRC_VF} plugged back as primary on hostA" in e for e in events)
    assert peer.posts[-1][0] == "/v1/offload/abandon"


def test_when_qemu_replugged_the_primary_the_agent_plugs_nothing(hosts):
    src, dst, plugged = hosts
    offloaded(src.sim, vf_flow())
    events = []
    assert src.hook.depart("m-3", "vm1", PeerAgent(dst), events.append)
    src.hook.restore("m-3", "cancelled", PeerAgent(dst), events.append)
    assert [p for p in plugged if p[0] == "hostA"] == []
    assert any("QEMU plugged VF" in e for e in events)
    assert src.sim.control.flows.get(vf_flow()).state is FlowState.OFFLOADED


def test_on_novas_path_nova_swaps_the_vfs_and_the_agents_only_move_the_flows(hosts):
    src, dst, plugged = hosts
    offloaded(src.sim, vf_flow())
    events = []
    assert src.hook.depart("m-4", "vm1", PeerAgent(dst), events.append, nova_vfs={MAC: DST_VF})
    assert any("Nova detaches the VF before the job" in e for e in events)
    assert wait_for(lambda: "resume" in dst.steps)
    assert dst.steps == ["arrive", "rekey tap4->eth9", "resume"] and plugged == []


def test_explain_names_the_vf_its_representor_and_the_standby(hosts):
    src, _, _ = hosts
    offloaded(src.sim, vf_flow())
    text = src.hook.explain("vm1")
    assert "1 of 1 flows on tap4, pf0vf1 are offloaded" in text
    assert f"SR-IOV failover {MAC}: the flows of VF {SRC_VF} (representor pf0vf1)" in text
    assert "plugs this VF back" in text


def test_a_vf_without_a_representor_is_named_and_its_flows_left_alone(hosts, tmp_path):
    src, dst, _ = hosts
    src.hook.sysfs = tmp_path / "nowhere"
    events = []
    assert src.hook.depart("m-5", "vm1", PeerAgent(dst), events.append)
    assert src.steps == ["depart"]
    assert any("VF flows not handled" in e and SRC_VF in e for e in events)


def test_an_empty_pool_leaves_the_flows_on_the_standby_and_says_so(hosts):
    src, dst, plugged = hosts
    dst.hook.failover_vfs = []
    offloaded(src.sim, vf_flow())
    events = []
    assert src.hook.depart("m-6", "vm1", PeerAgent(dst), events.append)
    assert wait_for(lambda: "resume" in dst.steps)
    assert dst.steps == ["arrive", "resume"] and plugged == []
    summary = src.hook.finish("m-6", PeerAgent(dst), events.append)
    assert "no free VF" in summary["failover"][0] and "stay on the standby tap4" in summary[
        "failover"][0]  # fmt: skip


@pytest.mark.parametrize(
    "entry",
    [{"mac": "52:54:00:aa:bb", "standby": "tap4", "alias": "ua-s", "vf": "", "plug": True},
     {"mac": MAC, "standby": "tap4", "alias": "", "vf": "", "plug": True},
     {"mac": MAC, "standby": "tap4", "alias": "ua-s", "vf": "3b:02.1", "plug": True},
     {"mac": MAC, "standby": "tap4", "alias": "ua-s", "vf": "", "plug": True, "x": 1}],
)  # fmt: skip
def test_bad_failover_pairs_are_refused_before_anything_arrives(hosts, entry):
    _, dst, _ = hosts
    with pytest.raises(exceptions.InvalidInput):
        check_failover([entry])
    with pytest.raises(exceptions.InvalidInput):
        dst.hook.arrive("m-7", "vm1", ["tap4"], "hostA", [], failover=[entry])
    assert dst.steps == [] and dst.hook.arrivals == {}


@pytest.mark.parametrize(
    "nova_vfs", [{"52:54:00:aa:bb": DST_VF}, {MAC: "5e:00.3"}, {MAC: 3}]
)  # fmt: skip
def test_the_agent_refuses_a_bad_nova_vf_map_before_demoting_anything(nova_vfs):
    from agents.agent.service import Agent as AgentService

    class Agent:
        class offload:  # stands in for the hook
            departed = []

            @classmethod
            def depart(cls, *args, **kwargs):
                cls.departed.append(args)

        def _offload_peer(self, body):
            return "peer"

    body = {"migration_id": "m", "vm": "vm1", "dest": {}, "nova_vfs": nova_vfs}
    with pytest.raises(exceptions.InvalidInput):
        AgentService.offload_depart(Agent(), body, None)
    assert Agent.offload.departed == []
