"""flexmig-offload's options, start-up refusals and policy reload (no daemons)."""

from ovs_ext import config, policy, service
from ovs_ext.app import Runtime
from ovs_ext.control import OffloadControl
from ovs_ext.dispatcher import Dispatchers
from ovs_ext.providers.base import FlowCounters, FlowMatch
from tests.unit.offload_fakes import FakeProvider


def test_every_option_has_help_and_the_devstack_names_exist():
    ((group, opts),) = config.list_opts()
    assert group == "offload"
    names = {o.name for o in opts}
    assert {"provider", "policy_file", "bridge", "poll_interval", "stats_endpoint"} <= names
    assert all(o.help for o in opts)
    poll = next(o for o in opts if o.name == "poll_interval")
    assert (poll.type.min, poll.type.max) == (0.02, 60.0)


def test_invalid_policy_stops_the_start_naming_the_field(tmp_path, capsys):
    bad = tmp_path / "policy.yaml"
    bad.write_text("statistics: {promote_pps: 100, demote_pps: 100}\n")
    conf = tmp_path / "offload.conf"
    conf.write_text(f"[offload]\nprovider = noop\npolicy_file = {bad}\n")
    assert service.main(["--config-file", str(conf)]) == 2
    err = capsys.readouterr().err
    assert "statistics.demote_pps" in err and "below promote_pps" in err


def test_out_of_range_option_stops_the_start(tmp_path, capsys):
    conf = tmp_path / "offload.conf"
    conf.write_text("[offload]\npoll_interval = 0.001\n")
    assert service.main(["--config-file", str(conf)]) == 2
    assert "poll_interval" in capsys.readouterr().err


def _runtime(pol):
    provider = FakeProvider()
    dispatchers = Dispatchers(provider, "fake", [r"tap\d+"], ["phy0"])
    control = OffloadControl(pol, provider, "fake", dispatchers)
    for port in ("tap0", "phy0"):
        control.port_added(port)
    return Runtime(control, "br-int", 0.1)


def test_reload_rejects_an_invalid_policy_and_keeps_the_running_one(tmp_path):
    rule = policy.HeaderRule("all-udp", policy.Action.OFFLOAD, ip_proto=17)
    runtime = _runtime(policy.Policy(header_rules=(rule,)))
    match = FlowMatch("tap0", 17, "10.0.0.1", "10.0.0.2", 1, 2)
    flow, _ = runtime.control.flow_seen(match, "phy0")
    assert flow.state.value == "offloaded"
    running = runtime.control.policy
    path = tmp_path / "p.yaml"
    path.write_text("capacity: 10\nheader_rulez: []\n")
    assert not service.reload_policy(runtime, str(path))
    assert runtime.control.policy is running
    assert runtime.control.flows.get(match).state.value == "offloaded"
    path.write_text("capacity: 0\n")
    assert service.reload_policy(runtime, str(path))
    assert runtime.control.policy.capacity == 0
    # Capacity 0: the offloaded flow goes back to the vSwitch, counters kept.
    assert runtime.control.flows.get(match).state.value == "onloaded"


def test_stale_provider_entries_are_taken_at_start_with_their_counters():
    provider = FakeProvider()
    stale = FlowMatch("tap0", 17, "10.0.0.1", "10.0.0.2", 1, 2)
    provider.entries[stale] = FlowCounters(5, 500)
    assert service.take_stale_entries(provider, "fake") == {stale: FlowCounters(5, 500)}
    assert provider.entries == {}
    assert service.take_stale_entries(provider, "fake") == {}


def test_the_lab_config_is_valid_for_the_service(tmp_path):
    from oslo_config import cfg

    from flexmig_lab import offload as lab_offload

    path = tmp_path / "offload.conf"
    extra = "[offload_xdp]\ncapacity = 16\n\n"
    path.write_text(lab_offload.offload_conf("xdp", "/p.yaml", 0.05, extra))
    conf = cfg.ConfigOpts()
    config.register_opts(conf)
    conf(["--config-file", str(path)], project="flexmig")
    config.validate(conf)
    opts = conf.offload
    assert (opts.provider, opts.policy_file, opts.bridge) == ("xdp", "/p.yaml", "br-int")
    assert (opts.poll_interval, opts.ovs_revalidator_ms, opts.uplinks) == (0.05, 100, ["phy0"])
    assert opts.stats_endpoint.endswith("/br-int-offload.mgmt")
    assert opts.status_file == lab_offload.STATUS_FILE
    assert opts.vm_port_patterns == [r"tap\d+", r"ep-[a-z0-9]+"]


def test_the_default_vm_ports_are_novas_taps():
    """A real host's defaults: Neutron's tap<11 chars of port UUID>, no lab names."""
    import re

    from oslo_config import cfg

    conf = cfg.ConfigOpts()
    config.register_opts(conf)
    conf([], project="flexmig", default_config_files=[])
    patterns = conf.offload.vm_port_patterns
    assert any(re.fullmatch(p, "tap5f4bd1b6-0e") for p in patterns)
    assert not any(re.fullmatch(p, name) for p in patterns for name in ("tap0", "ep-a1", "phy0"))
    assert conf.offload.uplinks == []
