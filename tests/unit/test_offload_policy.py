"""The Policy Manager: parsing, validation naming the field, and its decisions."""

import json

import pytest

from ovs_ext import policy
from ovs_ext.policy import Action, Direction, PolicyError, Rate, StatisticsRule
from ovs_ext.providers.base import FlowMatch

GOOD = {
    "capacity": 8,
    "header_rules": [
        {"name": "iperf", "port": "tap0", "direction": "ingress", "ip_proto": "tcp",
         "tp_dst": 5201, "action": "offload"},
        {"name": "dns", "ip_proto": "udp", "tp_dst": 53, "action": "onload"},
        {"name": "lan", "ipv4_src": "10.251.0.0/24", "action": "offload", "port": "ep-x"},
    ],
    "statistics": {"window_s": 0.5, "promote_pps": 1000, "demote_pps": 100,
                   "demote_intervals": 3},
}  # fmt: skip


def udp(sport=40000, dport=5201, src="10.251.0.1", dst="10.251.0.2", port="phy0"):
    return FlowMatch(port, 17, src, dst, sport, dport)


def test_a_good_policy_parses_every_field():
    p = policy.parse_policy(GOOD)
    assert p.capacity == 8
    assert [r.name for r in p.header_rules] == ["iperf", "dns", "lan"]
    assert p.header_rules[0].ip_proto == 6 and p.header_rules[0].tp_dst == 5201
    assert p.header_rules[0].direction is Direction.INGRESS
    assert p.statistics.promote_pps == 1000.0 and p.statistics.demote_intervals == 3


def test_policy_file_yaml_and_json(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(GOOD))
    assert policy.load_policy(path).capacity == 8
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert policy.load_policy(empty) == policy.Policy(source=str(empty))


@pytest.mark.parametrize(
    ("mutate", "field", "reason"),
    [
        (lambda d: d.update(capacty=3), "capacty", "unknown field"),
        (lambda d: d["statistics"].update(promote_ppss=1), "statistics.promote_ppss", "unknown"),
        (lambda d: d["header_rules"][0].update(tp_dts=1), "header_rules[0].tp_dts", "unknown"),
        (lambda d: d.update(capacity=-1), "capacity", "outside"),
        (lambda d: d.update(capacity="many"), "capacity", "integer"),
        (lambda d: d["statistics"].update(demote_pps=1000), "statistics.demote_pps", "below"),
        (lambda d: d["statistics"].update(demote_pps=5000), "statistics.demote_pps", "below"),
        (lambda d: d["statistics"].update(window_s=0), "statistics.window_s", "outside"),
        (lambda d: d["statistics"].update(demote_intervals=0), "statistics.demote_intervals",
         "outside"),
        (lambda d: d["statistics"].update(demote_bytes=10), "statistics.demote_bytes",
         "without promote_bytes"),
        (lambda d: d["header_rules"][0].update(tp_dst=70000), "header_rules[0].tp_dst", "outside"),
        (lambda d: d["header_rules"][1].update(ip_proto="icmp"), "header_rules[1].ip_proto",
         "not tcp or udp"),
        (lambda d: d["header_rules"][1].update(action="drop"), "header_rules[1].action",
         "not one of"),
        (lambda d: d["header_rules"][2].update(ipv4_src="10.300.0.0/8"),
         "header_rules[2].ipv4_src", ""),
        (lambda d: d["header_rules"][2].update(name="iperf"), "header_rules[2].name", "duplicate"),
        (lambda d: d["header_rules"][2].pop("action"), "header_rules[2].action", "required"),
        (lambda d: d["header_rules"][2].update(tp_dst=80), "header_rules[2].ip_proto",
         "need ip_proto"),
    ],
)  # fmt: skip
def test_invalid_policy_names_the_field(mutate, field, reason):
    data = json.loads(json.dumps(GOOD))
    mutate(data)
    with pytest.raises(PolicyError) as err:
        policy.parse_policy(data, "p.yaml")
    message = str(err.value)
    assert f"p.yaml: {field}: " in message
    assert reason in message


def test_unreadable_and_malformed_files_are_policy_errors(tmp_path):
    with pytest.raises(PolicyError, match="file"):
        policy.load_policy(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("capacity: [1,\n")
    with pytest.raises(PolicyError, match="syntax"):
        policy.load_policy(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(PolicyError, match="policy: must be a mapping"):
        policy.load_policy(bad)


def test_header_rules_first_match_wins_and_respect_port_and_direction():
    p = policy.parse_policy(GOOD)
    tcp = FlowMatch("phy0", 6, "10.0.0.9", "10.251.0.10", 33000, 5201)
    assert policy.decide_at_setup(p, tcp, "tap0", Direction.INGRESS).action is Action.OFFLOAD
    # Same flow judged for another VM port or direction: no rule.
    assert policy.decide_at_setup(p, tcp, "tap1", Direction.INGRESS).action is None
    assert policy.decide_at_setup(p, tcp, "tap0", Direction.EGRESS).action is None
    dns = udp(dport=53)
    decision = policy.decide_at_setup(p, dns, "ep-x", Direction.EGRESS)
    assert decision.pinned_onload and decision.rule == "dns"  # before "lan"
    lan = udp(dport=9000)
    assert policy.decide_at_setup(p, lan, "ep-x", Direction.EGRESS).rule == "lan"
    outside = udp(dport=9000, src="192.168.1.1")
    assert policy.decide_at_setup(p, outside, "ep-x", Direction.EGRESS).action is None


def test_promotion_and_hysteresis_marks():
    rule = StatisticsRule(promote_pps=1000, demote_pps=100, demote_intervals=3)
    assert policy.should_promote(rule, Rate(1000, 0))
    assert not policy.should_promote(rule, Rate(999, 0))
    quiet = 0
    # Between the marks resets nothing and counts nothing.
    for pps in (50, 50, 500, 50, 50):
        quiet = policy.next_quiet_count(rule, Rate(pps, 0), quiet)
    assert quiet == 2 and not policy.should_demote(rule, quiet)
    quiet = policy.next_quiet_count(rule, Rate(10, 0), quiet)
    assert policy.should_demote(rule, quiet)


def test_bytes_trigger_in_window():
    rule = StatisticsRule(window_s=1.0, promote_bytes=10_000, demote_bytes=1_000)
    assert policy.should_promote(rule, Rate(1, 10_000))
    assert not policy.should_promote(rule, Rate(10**6, 9_999))
    assert policy.is_below_demote_marks(rule, Rate(10**6, 999))


def test_window_rate_uses_the_trailing_window():
    samples = [(0.0, 0, 0), (1.0, 100, 1000), (2.0, 1100, 11000), (2.5, 2100, 21000)]
    rate = policy.window_rate(samples, 1.0)
    # From t=2.0 (inside the 1 s window ending at 2.5) to 2.5: 1000 packets in 0.5 s.
    assert rate == Rate(2000.0, 10000)
    assert policy.window_rate(samples[:1], 1.0) == Rate(0.0, 0)


def test_admission_evicts_the_slowest_and_honours_forced():
    plan = policy.plan_admission(2, {"a": 5.0, "b": 50.0}, [("c", 10.0, False)])
    assert plan.admitted == ("c",) and plan.evicted == ("a",)
    plan = policy.plan_admission(2, {"a": 5.0, "b": 50.0}, [("c", 1.0, False)])
    assert plan.admitted == () and "full" in plan.refused["c"]
    plan = policy.plan_admission(2, {"a": 5.0, "b": 50.0}, [("c", 0.0, True)])
    assert plan.admitted == ("c",) and plan.evicted == ("a",)
    # Two candidates for one free slot: the faster wins, the slower is refused.
    plan = policy.plan_admission(1, {}, [("x", 10.0, False), ("y", 20.0, False)])
    assert plan.admitted == ("y",) and set(plan.refused) == {"x"}
    assert policy.plan_admission(0, {}, [("x", 1.0, True)]).refused["x"] == "offload capacity is 0"
