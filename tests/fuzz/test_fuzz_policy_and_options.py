"""Fuzzing what operators write: the offload policy file and the [flexmig],
[agent] and [offload] options.  Any input is either accepted (and then within
every declared bound) or refused with the project's error naming the field; a
refused policy reload changes nothing in the running service."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from hypothesis import example, given
from hypothesis import strategies as st
from oslo_config import cfg

from agents.agent import config as agent_config
from flexmig import exceptions
from flexmig.migration import options as migration_options
from nova_driver import conf as nova_conf
from ovs_ext import config as offload_config
from ovs_ext import policy, service
from ovs_ext.app import Runtime
from ovs_ext.control import OffloadControl
from ovs_ext.dispatcher import Dispatchers
from tests.unit.offload_fakes import FakeProvider

SCALARS = (
    st.none() | st.booleans() | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
)  # fmt: skip
KEYS = st.sampled_from(
    ["capacity", "statistics", "header_rules", "window_s", "promote_pps", "promote_bytes",
     "demote_pps", "demote_bytes", "demote_intervals", "name", "port", "direction",
     "ip_proto", "tp_dst", "tp_src", "ipv4_src", "ipv4_dst", "action"]
) | st.text(max_size=8)  # fmt: skip
DOCUMENTS = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=6),
    max_leaves=24,
)  # fmt: skip
VALID = {"capacity": 8, "statistics": {"window_s": 0.5, "promote_pps": 1000, "demote_pps": 10}}


def check_policy(result: policy.Policy) -> None:
    assert result.capacity >= 1
    rule = result.statistics
    for value in (rule.window_s, rule.promote_pps, rule.demote_pps):
        assert value is None or (isinstance(value, int | float) and math.isfinite(value))


@given(DOCUMENTS)
@example(VALID)
@example({"capacity": float("nan")})
@example({"statistics": {"window_s": float("inf"), "promote_pps": 1, "demote_pps": 0}})
def test_any_policy_document_is_accepted_within_bounds_or_refused_naming_the_field(data):
    try:
        result = policy.parse_policy(data)
    except policy.PolicyError as exc:
        assert str(exc)
        return
    check_policy(result)


@given(st.text(max_size=400) | st.binary(max_size=400).map(lambda b: b.decode("latin-1")))
@example("capacity: 4\nstatistics: {promote_pps: 10, demote_ppps: 1}\n")
@example("&a [*a, *a]")
@example("!!python/object/apply:os.system ['true']")
def test_a_refused_policy_file_leaves_the_running_service_unchanged(text):
    provider = FakeProvider(8)
    dispatchers = Dispatchers(provider, "fake", [r"tap\d+"], ["phy0"])
    running = policy.parse_policy(VALID)
    control = OffloadControl(running, provider, "fake", dispatchers)
    runtime = Runtime(control, "br-int", 0.1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "policy.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        accepted = service.reload_policy(runtime, str(path))
    if accepted:
        check_policy(control.policy)
    else:
        assert control.policy is running


OPTION_VALUES = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r\x00"),
    max_size=24,
) | st.sampled_from(["-1", "0", "1", "65536", "1e309", "nan", "true", "", "0x10", "9" * 30])


def group_options(group):
    if group == "agent":
        return agent_config.agent_opts
    if group == "offload":
        return offload_config.offload_opts
    if group == "migration":
        return migration_options.migration_opts
    return nova_conf.flexmig_opts


def load(group, text):
    conf = cfg.ConfigOpts()
    conf.register_opts(group_options(group), group=group)
    if group not in ("migration", "offload"):
        migration_options.register_opts(conf)  # the engine's, read by both services
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "flexmig.conf"
        path.write_text(text)
        conf([], default_config_files=[str(path)], project="flexmig-fuzz")
        try:
            if group == "offload":
                offload_config.validate(conf)
            elif group == "flexmig":
                nova_conf.validate(conf)
            elif group == "migration":
                migration_options.read(conf)
            else:
                for opt in agent_config.agent_opts:
                    getattr(conf.agent, opt.dest)
                migration_options.read(conf)
        finally:
            conf.reset()
    return conf


@st.composite
def option_files(draw):
    group = draw(st.sampled_from(["flexmig", "agent", "offload", "migration"]))
    names = [opt.dest for opt in group_options(group)]
    chosen = draw(st.dictionaries(st.sampled_from(names), OPTION_VALUES, max_size=4))
    body = "".join(f"{name} = {value}\n" for name, value in chosen.items())
    return group, f"[{group}]\n{body}"


@given(option_files())
@example(("flexmig", "[flexmig]\nagent_timeout = NAN\n"))  # found by this fuzzer: was accepted
@example(("offload", "[offload]\npoll_interval = NAN\n"))  # likewise
def test_any_option_value_is_accepted_within_its_bounds_or_refused(case):
    group, text = case
    try:
        load(group, text)
    # oslo.config's refusals and the services' own (InvalidConfig) name the option.
    except (cfg.Error, ValueError, exceptions.FlexMigError) as exc:
        assert str(exc)
        return
    # Accepted: every integer option read back lies within its declared bounds.
    conf = cfg.ConfigOpts()
    conf.register_opts(group_options(group), group=group)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "flexmig.conf"
        path.write_text(text)
        conf([], default_config_files=[str(path)], project="flexmig-fuzz")
        for opt in group_options(group):
            value = getattr(conf[group], opt.dest)
            low = getattr(opt.type, "min", None)
            high = getattr(opt.type, "max", None)
            if isinstance(value, int | float) and not isinstance(value, bool):
                assert low is None or value >= low, (opt.dest, value)
                assert high is None or value <= high, (opt.dest, value)
