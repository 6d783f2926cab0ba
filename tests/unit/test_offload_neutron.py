"""Offload beside Neutron: the rules it builds, what it offloads, the ports file."""

import json
import os
import struct
import types

import pytest
from os_ken.ofproto import ofproto_v1_3 as ofp
from os_ken.ofproto import ofproto_v1_3_parser as ofpp
from oslo_config import cfg

from ovs_ext import config, flows, neutron, neutron_agent_ext, openflow, policy, restore
from ovs_ext.control import OffloadControl
from ovs_ext.dispatcher import Dispatchers
from ovs_ext.flows import FlowState
from ovs_ext.providers.base import FlowCounters, FlowMatch
from ovs_ext.service import neutron_mode
from tests.unit.offload_fakes import FakeProvider

PIPELINE = neutron.NeutronPipeline(210, 211, 12, 0xF1E0)
OPEN = neutron.PortFacts("p", "net1", port_security=False)
SECURED = neutron.PortFacts("p", "net1", port_security=True)


def _actions(mod):
    return mod.instructions[0].actions if mod.instructions else []


# -- the rules ----------------------------------------------------------------------
def test_no_rule_forwards_and_nothing_lands_in_neutrons_tables_but_the_handoff():
    mods = PIPELINE.port_rules(ofpp, ofp, 7)
    handoff, judging = mods[0], mods[1:]
    assert (handoff.table_id, handoff.priority) == (0, neutron.HANDOFF_PRIORITY)
    assert dict(handoff.match.items()) == {"in_port": 7, "reg12": 0}
    marks, to_app, back = _actions(handoff)
    assert marks.key == "reg12" and marks.value == 1
    assert (to_app.table_id, back.table_id) == (210, 0)
    assert {m.table_id for m in judging} == {210}
    for mod in mods:
        assert mod.cookie >> 48 == flows.COOKIE_PREFIX
        for action in _actions(mod):
            # Neither NORMAL nor a plain output: Neutron's pipeline forwards.
            assert not isinstance(action, ofpp.OFPActionOutput)
    controllers = [
        a for m in judging for a in _actions(m) if isinstance(a, ofpp.NXActionController)
    ]
    assert len(controllers) == 3 and {a.controller_id for a in controllers} == {0xF1E0}
    learns = [a for m in judging for a in _actions(m) if isinstance(a, ofpp.NXActionLearn)]
    assert {a.table_id for a in learns} == {211}


def test_flow_rule_only_counts_and_notes_its_first_packet():
    match = FlowMatch("tap1", 17, "10.0.0.1", "10.0.0.2", 1000, 5201)
    mod = PIPELINE.flow_rule(ofpp, ofp, 77, 7, match, 60)
    assert (mod.table_id, mod.priority, mod.cookie) == (210, flows.FLOW_PRIORITY, 77)
    (note,) = _actions(mod)  # nothing that forwards, drops or rewrites
    assert isinstance(note, ofpp.NXActionNote)
    assert openflow.first_packet(mod.instructions) == FlowCounters(1, 60)
    assert dict(mod.match.items())["udp_dst"] == 5201


def test_a_neutron_flow_read_back_after_a_crash_counts_its_first_packet():
    match = FlowMatch("tap1", 17, "10.0.0.1", "10.0.0.2", 1000, 5201)
    mod = PIPELINE.flow_rule(ofpp, ofp, flows.flow_cookie(4), 7, match, 60)
    mod.datapath = types.SimpleNamespace(ofproto=ofp, ofproto_parser=ofpp)
    mod.serialize()  # through the wire format, as OVS would hand it back
    back = ofpp.OFPFlowMod.parser(mod.datapath, *_header(mod.buf), bytes(mod.buf))
    stat = types.SimpleNamespace(
        cookie=back.cookie, match=back.match, packet_count=9, byte_count=540,
        instructions=back.instructions,
    )  # fmt: skip
    manager = flows.FlowManager()
    assert restore.from_rules(manager, [stat], {7: "tap1"}.get) == 1
    assert manager.restored()[match][0] == FlowCounters(10, 600)


def _header(buf):
    version, msg_type, length, xid = struct.unpack_from("!BBHI", bytes(buf))
    return version, msg_type, length, xid


def test_set_controller_id_is_the_nicira_message():
    msg = PIPELINE.set_controller_id(ofpp)

    class Datapath:
        ofproto, ofproto_parser = ofp, ofpp

    msg.datapath = Datapath()
    msg.serialize()
    # OFPT_EXPERIMENTER, Nicira vendor id, subtype 20, 6 zero bytes, the id.
    assert bytes(msg.buf)[8:] == bytes.fromhex("00002320" "00000014" "000000000000" "f1e0")


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"table": 60}, "table 60"),
        ({"counting_table": 94}, "counting_table 94"),
        ({"counting_table": 210}, "must differ"),
        ({"register": 5}, "reg5"),
        ({"register": 16}, "reg16"),
        ({"controller_id": 0}, "controller id 0"),
    ],
)
def test_pipeline_refuses_neutrons_tables_and_registers(kwargs, error):
    args = {"table": 210, "counting_table": 211, "register": 12, "controller_id": 1} | kwargs
    with pytest.raises(neutron.NeutronModeError, match=error):
        neutron.NeutronPipeline(**args)


def test_missing_handoffs_are_the_watched_ports_without_their_rule():
    watched = {"tap1": 3, "tap2": 4, "tap3": 9}
    seen = {flows.discovery_cookie(4), flows.discovery_cookie(99)}
    assert neutron.missing_handoffs(watched, seen) == [3, 9]
    assert neutron.missing_handoffs({}, set()) == []


# -- what may be offloaded ------------------------------------------------------------
@pytest.mark.parametrize(
    ("facts", "out_port", "reason"),
    [
        ({"a": OPEN, "b": OPEN}, "b", ""),
        ({"a": OPEN, "b": SECURED}, "b", "port b has port security"),
        ({"a": SECURED, "b": OPEN}, "b", "port a has port security"),
        ({"a": OPEN}, "b", "port b is not a Neutron port"),
        ({"a": OPEN, "b": OPEN}, None, "not learned yet"),
        ({"a": OPEN, "b": neutron.PortFacts("q", "net2", False)}, "b", "different networks"),
        ({"a": OPEN, "b": neutron.PortFacts("q", "net1", False, "qos1")}, "b", "QoS policy qos1"),
    ],
)
def test_offload_block_reason(facts, out_port, reason):
    why = neutron.offload_block_reason(facts, "a", out_port)
    assert (why == "") if not reason else (reason in why)


@pytest.mark.parametrize(
    "data",
    [
        [],
        {"ports": []},
        {"ports": {"tapa": "x"}},
        {"ports": {"tapa": {"port_id": "a", "network_id": "n", "port_security": "no"}}},
        {"ports": {"tapa": {"port_id": "", "network_id": "n", "port_security": False}}},
        {"ports": {"tapa": {"port_id": "a", "network_id": "n", "port_security": False,
                            "qos_policy_id": 3}}},
    ],
)  # fmt: skip
def test_ports_file_refused_whole(data):
    with pytest.raises(neutron.NeutronModeError):
        neutron.parse_port_facts(data)


def _write(path, ports):
    path.write_text(json.dumps({"ports": ports}))
    # Same size twice in a row within one mtime tick must still be seen.
    os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 1_000_000))


def test_guard_follows_the_file_and_vetoes_everything_without_it(tmp_path):
    path = tmp_path / "ports.json"
    guard = neutron.NeutronGuard(str(path))
    match = FlowMatch("tapa", 17, "10.0.0.1", "10.0.0.2", 1, 2)
    assert "ports file" in guard.why_not(match, "tapb")
    entry = {"port_id": "a", "network_id": "n", "port_security": False}
    _write(path, {"tapa": entry, "tapb": entry})
    assert guard.why_not(match, "tapb") == ""
    _write(path, {"tapa": entry, "tapb": entry | {"port_security": True}})
    assert "port tapb has port security" in guard.why_not(match, "tapb")
    path.write_text("{not json")
    assert "unusable" in guard.why_not(match, "tapb")
    path.unlink()
    assert "No such file" in guard.why_not(match, "tapb")


# -- the control loop with the guard ------------------------------------------------------
ELEPHANTS = policy.parse_policy(
    {
        "capacity": 8,
        "statistics": {"window_s": 0.2, "promote_pps": 100, "demote_pps": 1,
                       "demote_intervals": 100},
    }
)  # fmt: skip


def test_guard_keeps_flows_onloaded_and_onloads_offloaded_ones_when_it_changes():
    provider = FakeProvider(8)
    dispatchers = Dispatchers(provider, "fake", [r"tap\d+"], [])
    veto = {"tap1": ""}
    clock = Clock()
    control = OffloadControl(
        ELEPHANTS, provider, "fake", dispatchers, flows.FlowManager(clock),
        offload_guard=lambda match, out: veto[match.in_port],
    )  # fmt: skip

    def poll(packets):
        clock.now += 0.1
        return control.poll({flow.flow_id: FlowCounters(packets, packets * 100)}, {})

    for port in ("tap1", "tap2"):
        control.port_added(port)
    match = FlowMatch("tap1", 17, "10.0.0.1", "10.0.0.2", 1, 2)
    flow, _new = control.flow_seen(match, "tap2")
    veto["tap1"] = "neutron: port tap1 has port security"
    for packets in (1000, 2000, 3000):
        poll(packets)
    assert flow.state is FlowState.ONLOADED and match not in provider.entries
    assert "port tap1 has port security" in flow.reason
    veto["tap1"] = ""
    for packets in (4000, 5000, 6000):
        poll(packets)
    assert flow.state is FlowState.OFFLOADED and match in provider.entries
    veto["tap1"] = "neutron: port tap1 has port security"
    report = poll(6000)
    assert flow.state is FlowState.ONLOADED and match not in provider.entries
    assert match in report.demoted and "port security" in flow.reason


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


# -- configuration ------------------------------------------------------------------------
def _conf(**overrides):
    conf = cfg.ConfigOpts()
    config.register_opts(conf)
    conf([], project="flexmig-test")
    for name, value in overrides.items():
        conf.set_override(name, value, group="offload")
    return conf


def test_standalone_has_no_pipeline_nor_guard():
    assert neutron_mode(_conf().offload) == (None, None)


def test_neutron_mode_builds_its_pipeline_and_guard(tmp_path):
    opts = _conf(pipeline="neutron", neutron_ports_file=str(tmp_path / "p.json")).offload
    pipeline, guard = neutron_mode(opts)
    assert pipeline == neutron.NeutronPipeline(210, 211, 12, 0xF1E0)
    assert "ports file" in guard(FlowMatch("tapa", 17, "1.1.1.1", "1.1.1.2", 1, 2), "tapb")


def test_neutron_mode_refuses_a_bad_combination():
    opts = _conf(pipeline="neutron", neutron_table=211).offload
    with pytest.raises(neutron.NeutronModeError, match="must differ"):
        neutron_mode(opts)


@pytest.mark.parametrize(
    ("name", "value"), [("pipeline", "ovn"), ("neutron_register", 5), ("neutron_table", 60)]
)
def test_bad_options_are_refused(name, value):
    with pytest.raises(ValueError):
        _conf(**{name: value})


# -- the L2 agent extension in Neutron's OVS agent -----------------------------------------
class Vif:
    def __init__(self, name):
        self.port_name = name
        self.ofport = 5


def _details(port_id, name, security=False, qos=None, network_qos=None, network="net1"):
    return {
        "port_id": port_id, "device": port_id, "network_id": network,
        "port_security_enabled": security, "qos_policy_id": qos,
        "network_qos_policy_id": network_qos, "vif_port": Vif(name),
    }  # fmt: skip


def _extension(tmp_path):
    conf = cfg.ConfigOpts()
    ext = neutron_agent_ext.FlexMigOffloadExtension(conf)
    conf([], project="flexmig-test")
    conf.set_override("ports_file", str(tmp_path / "run" / "ports.json"), "flexmig_offload")
    ext.initialize(None, "ovs")
    return ext, tmp_path / "run" / "ports.json"


def test_extension_is_a_neutron_l2_agent_extension():
    from neutron_lib.agent import l2_extension

    assert issubclass(neutron_agent_ext.FlexMigOffloadExtension, l2_extension.L2AgentExtension)
    neutron_agent_ext.FlexMigOffloadExtension(cfg.ConfigOpts())  # nothing left abstract


def test_extension_writes_what_the_offload_guard_reads(tmp_path):
    ext, path = _extension(tmp_path)
    assert neutron.parse_port_facts(json.loads(path.read_text())) == {}
    ext.handle_port(None, _details("p1", "tapp1"))
    ext.handle_port(None, _details("p2", "tapp2", security=True))
    ext.handle_port(None, _details("p3", "tapp3", network_qos="q9"))
    ext.handle_port(None, {"port_id": "p4", "network_id": "n"})  # no OVS port: skipped
    facts = neutron.parse_port_facts(json.loads(path.read_text()))
    assert facts == {
        "tapp1": neutron.PortFacts("p1", "net1", False),
        "tapp2": neutron.PortFacts("p2", "net1", True),
        "tapp3": neutron.PortFacts("p3", "net1", False, "q9"),
    }
    guard = neutron.NeutronGuard(str(path))
    match = FlowMatch("tapp1", 17, "10.0.0.1", "10.0.0.2", 1, 2)
    assert "port tapp2 has port security" in guard.why_not(match, "tapp2")
    ext.delete_port(None, {"port_id": "p2"})
    ext.delete_port(None, {"port_id": "unknown"})
    assert set(json.loads(path.read_text())["ports"]) == {"tapp1", "tapp3"}


def test_extension_removes_the_file_when_it_cannot_write_it(tmp_path):
    ext, path = _extension(tmp_path)
    ext.handle_port(None, _details("p1", "tapp1"))
    assert path.exists()
    path.parent.chmod(0o500)
    try:
        if os.access(path.parent, os.W_OK):  # root ignores the mode: make it a directory
            path.parent.chmod(0o700)
            path.unlink()
            path.mkdir()
            (path / "x").write_text("")  # os.replace onto a non-empty directory fails
        ext.handle_port(None, _details("p2", "tapp2"))
    finally:
        path.parent.chmod(0o700)
    guard = neutron.NeutronGuard(str(path))
    assert guard.why_not(FlowMatch("tapp1", 17, "1.1.1.1", "1.1.1.2", 1, 2), "tapp2")
