"""Flow Manager accounting and dispatcher decisions, driven by a simulated switch.

The simulation plays OVS and the fast path: each tick every flow sends
packets, which the fake provider counts when the flow has an entry there and
the flow's OpenFlow rule counts otherwise — so the test knows exactly how many
packets went each way and can check nothing is lost or counted twice.
"""

import pytest

from ovs_ext import flows, policy
from ovs_ext.control import OffloadControl
from ovs_ext.dispatcher import Dispatchers
from ovs_ext.flows import FlowState
from ovs_ext.providers.base import FlowCounters, FlowMatch
from tests.unit.offload_fakes import FakeProvider

SIZE = 100


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Sim:
    def __init__(self, pol, capacity=16, vm_ports=(r"tap\d+", r"ep-\w+"), ports=()):
        self.clock = Clock()
        self.provider = FakeProvider(capacity)
        self.dispatchers = Dispatchers(self.provider, "fake", list(vm_ports), ["phy0"])
        self.control = OffloadControl(
            pol, self.provider, "fake", self.dispatchers, flows.FlowManager(self.clock),
            wall_clock=self.clock,
        )  # fmt: skip
        self.rules: dict[int, FlowCounters] = {}
        self.sent: dict[FlowMatch, int] = {}
        for port in ("phy0", "tap0", "tap1", "ep-a", *ports):
            self.control.port_added(port)

    def start(self, match, out_port):
        """First packet: switched by the bridge, judged and counted by the app."""
        flow, new = self.control.flow_seen(match, out_port)
        self.control.flows.count_packet_in(match, SIZE)
        self.sent[match] = self.sent.get(match, 0) + 1
        return flow

    def tick(self, rates, dt=0.1):
        """Send ``rates[match]`` packets per second for ``dt``; then one poll."""
        for match, pps in rates.items():
            n = int(pps * dt)
            self.sent[match] += n
            if n == 0:
                continue
            if match in self.provider.entries:
                self.provider.carry(match, n, SIZE)
            else:
                fid = self.control.flows.get(match).flow_id
                self.rules[fid] = self.rules.get(fid, FlowCounters()) + FlowCounters(n, n * SIZE)
        self.clock.now += dt
        return self.control.poll(dict(self.rules), self.provider.stats())

    def total(self, match):
        return self.control.flows.get(match).total


def stats_policy(capacity=16, **stats):
    rule = dict(window_s=0.5, promote_pps=1000, demote_pps=100, demote_intervals=3)
    rule.update(stats)
    return policy.Policy(capacity=capacity, statistics=policy.StatisticsRule(**rule))


def flow(n, port="tap0", proto=17):
    return FlowMatch(port, proto, "10.251.0.10", "10.251.0.20", 40000 + n, 5201)


def test_counters_are_continuous_across_promotion_and_demotion():
    sim = Sim(stats_policy())
    m = flow(1)
    sim.start(m, "phy0")
    for _ in range(3):
        sim.tick({m: 200})
    assert sim.control.flows.get(m).state is FlowState.ONLOADED
    report = sim.tick({m: 5000})
    assert report.promoted == (m,)
    tracked = sim.control.flows.get(m)
    assert tracked.state is FlowState.OFFLOADED and tracked.reason == "promoted by statistics"
    for _ in range(5):
        sim.tick({m: 5000})
    assert sim.provider.entries[m].packets == 5 * 500
    # Slows down: below the lower mark for 3 polls (hysteresis), then onloaded.
    demoted_at = None
    for i in range(12):
        report = sim.tick({m: 10})
        if report.demoted:
            demoted_at = i
            break
    assert demoted_at is not None and demoted_at >= 2
    assert tracked.state is FlowState.ONLOADED and m not in sim.provider.entries
    for _ in range(3):
        sim.tick({m: 10})
    total = sim.total(m)
    assert total.packets == sim.sent[m]
    assert total.bytes == sim.sent[m] * SIZE
    # The promoting poll's packets went through the rule; the rest through the fast
    # path until the demoting poll.
    assert tracked.offloaded_counters.packets == 5 * 500 + (demoted_at + 1) * 1
    assert tracked.onloaded_counters.packets + tracked.offloaded_counters.packets == sim.sent[m]
    assert tracked.moves == 2


def test_no_flapping_between_the_marks():
    sim = Sim(stats_policy())
    m = flow(1)
    sim.start(m, "phy0")
    sim.tick({m: 5000})
    sim.tick({m: 5000})
    assert sim.control.flows.get(m).state is FlowState.OFFLOADED
    # 500 pps: under the promote mark, over the demote mark: stays offloaded.
    for _ in range(30):
        report = sim.tick({m: 500})
        assert not report.demoted
    # Alternating quiet and busy polls never reaches 3 quiet in a row.
    for i in range(30):
        sim.tick({m: 10 if i % 3 else 3000}, dt=0.1)
    assert sim.control.flows.get(m).moves == 1


def test_header_rule_offloads_at_setup_and_onload_rule_pins():
    rules = (
        policy.HeaderRule("iperf", policy.Action.OFFLOAD, port="tap0", ip_proto=6, tp_dst=5201),
        policy.HeaderRule("pinned", policy.Action.ONLOAD, ip_proto=17, tp_dst=5201),
    )
    sim = Sim(policy.Policy(header_rules=rules, statistics=stats_policy().statistics))
    tcp = flow(1, proto=6)
    tracked = sim.start(tcp, "phy0")
    assert tracked.state is FlowState.OFFLOADED and "iperf" in tracked.reason
    assert sim.provider.entries[tcp] == FlowCounters()
    pinned = flow(2)
    tracked = sim.start(pinned, "phy0")
    for _ in range(5):
        sim.tick({pinned: 50_000, tcp: 50_000})
    assert tracked.state is FlowState.ONLOADED and "pinned" in tracked.reason


def test_ingress_flow_is_owned_by_the_receiving_vm():
    rules = (
        policy.HeaderRule(
            "to-tap1", policy.Action.OFFLOAD, port="tap1", direction=policy.Direction.INGRESS
        ),
    )
    sim = Sim(policy.Policy(header_rules=rules))
    m = flow(1, port="phy0")
    tracked = sim.start(m, "tap1")
    assert (tracked.owner, tracked.direction) == ("tap1", policy.Direction.INGRESS)
    assert tracked.state is FlowState.OFFLOADED
    assert m in sim.dispatchers.by_port["tap1"].filter_table
    # Between two VM ports both dispatchers judge it: the receiver's rule matches.
    m2 = flow(2, port="tap0")
    tracked = sim.start(m2, "tap1")
    assert (tracked.owner, tracked.direction) == ("tap1", policy.Direction.INGRESS)
    assert tracked.state is FlowState.OFFLOADED
    # No rule for either: the sender's dispatcher owns it.
    m3 = flow(3, port="tap0")
    tracked = sim.start(m3, "ep-a")
    assert (tracked.owner, tracked.direction) == ("tap0", policy.Direction.EGRESS)


def test_full_table_evicts_the_slowest_and_counts_survive():
    sim = Sim(stats_policy(capacity=2))
    a, b, c = flow(1), flow(2), flow(3)
    for m in (a, b, c):
        sim.start(m, "phy0")
    sim.tick({a: 3000, b: 8000, c: 500})
    sim.tick({a: 3000, b: 8000, c: 500})
    assert {m for m in (a, b, c) if sim.control.flows.get(m).state is FlowState.OFFLOADED} == {a, b}
    report = None
    for _ in range(4):
        report = sim.tick({a: 3000, b: 8000, c: 20000})
        if report.evicted:
            break
    assert report.evicted == (a,) and report.promoted == (c,)
    assert sim.control.flows.get(a).state is FlowState.ONLOADED
    assert "evicted" in sim.control.flows.get(a).reason
    for _ in range(3):
        sim.tick({a: 3000, b: 8000, c: 20000})
    # a is faster than nothing offloaded now (b, c faster): it stays onloaded, says why.
    assert "table full" in sim.control.flows.get(a).reason
    for m in (a, b, c):
        assert sim.total(m).packets == sim.sent[m]


def test_provider_refusal_keeps_the_flow_onloaded_with_the_reason():
    sim = Sim(stats_policy())
    m = flow(1)
    sim.provider.refuse[m] = "no room in the BPF map"
    sim.start(m, "phy0")
    for _ in range(4):
        sim.tick({m: 5000})
    tracked = sim.control.flows.get(m)
    assert tracked.state is FlowState.ONLOADED
    assert tracked.reason == "offload refused: provider fake: no room in the BPF map"
    assert sim.total(m).packets == sim.sent[m]
    status = sim.control.status()["flows"][0]
    assert status["state"] == "onloaded" and "BPF map" in status["reason"]


def test_unattached_port_or_unknown_destination_is_refused_with_reason():
    sim = Sim(stats_policy())
    sim.provider.fail_attach.add("tap9")
    sim.control.port_added("tap9")
    m = flow(1, port="tap9")
    sim.start(m, "phy0")
    sim.tick({m: 5000})
    sim.tick({m: 5000})
    assert "not attached" in sim.control.flows.get(m).reason
    m2 = flow(2)
    sim.start(m2, None)
    sim.tick({m: 5000, m2: 5000})
    sim.tick({m: 5000, m2: 5000})
    assert "not learned" in sim.control.flows.get(m2).reason


def test_port_removal_carries_nothing_over_and_detaches():
    sim = Sim(stats_policy())
    m = flow(1)
    sim.start(m, "phy0")
    sim.tick({m: 5000})
    sim.tick({m: 5000})
    assert m in sim.provider.entries
    gone = sim.control.port_removed("tap0")
    assert [f.match for f in gone] == [m]
    assert m not in sim.provider.entries and "tap0" not in sim.provider.ports
    assert sim.control.flows.get(m) is None


def test_lower_capacity_on_policy_reload_evicts_slowest():
    sim = Sim(stats_policy(capacity=3))
    ms = [flow(i) for i in range(3)]
    for m in ms:
        sim.start(m, "phy0")
    for _ in range(3):
        sim.tick({ms[0]: 2000, ms[1]: 9000, ms[2]: 5000})
    assert len(sim.control.flows.offloaded()) == 3
    report = sim.control.replace_policy(stats_policy(capacity=1))
    assert set(report.evicted) == {ms[0], ms[2]}
    assert [f.match for f in sim.control.flows.offloaded()] == [ms[1]]


def test_records_show_rule_totals_and_the_offloaded_part():
    sim = Sim(stats_policy())
    m = flow(1)
    sim.start(m, "phy0")
    sim.tick({m: 200})
    sim.tick({m: 5000})
    sim.tick({m: 5000})
    ofports = {"tap0": 3, "phy0": 1}
    records = sim.control.flows.records(ofports.get)
    rule = [r for r in records if r.table_id == flows.FLOW_TABLE]
    part = [r for r in records if r.table_id == flows.OFFLOAD_TABLE]
    assert len(rule) == 1 and len(part) == 1
    assert rule[0].packets == sim.sent[m] and rule[0].offloaded
    assert part[0].packets == 500 and part[0].bytes == 500 * SIZE
    assert rule[0].match == {
        "in_port": 3, "eth_type": 0x800, "ip_proto": 17, "ipv4_src": "10.251.0.10",
        "ipv4_dst": "10.251.0.20", "udp_src": 40001, "udp_dst": 5201,
    }  # fmt: skip
    assert rule[0].out_port == 1 and rule[0].cookie == flows.flow_cookie(1)
    assert rule[0].duration_s == pytest.approx(0.3)


def test_cookies_round_trip_and_foreign_cookies_are_ignored():
    assert flows.cookie_flow_id(flows.flow_cookie(12345)) == 12345
    assert flows.cookie_flow_id(flows.discovery_cookie(3)) is None
    assert flows.cookie_flow_id(0x1234) is None
    fm = flows.FlowManager()
    fm.observe_rule_stats({99: FlowCounters(5, 5)})  # unknown flow: no effect, no error
    assert len(fm) == 0


def test_policy_reload_rejudges_existing_flows_by_header_rules():
    sim = Sim(policy.Policy())
    a, b = flow(1), flow(2)
    for m in (a, b):
        sim.start(m, "phy0")
    sim.tick({a: 100, b: 100})
    offload_a = policy.HeaderRule("a", policy.Action.OFFLOAD, ip_proto=17, tp_src=40001)
    report = sim.control.replace_policy(policy.Policy(header_rules=(offload_a,)))
    assert report.promoted == (a,)
    assert sim.control.flows.get(a).state is FlowState.OFFLOADED
    assert sim.control.flows.get(b).state is FlowState.ONLOADED
    sim.tick({a: 100, b: 100})
    # The rule goes away: its flow comes back, counters carried over.
    report = sim.control.replace_policy(policy.Policy())
    assert report.demoted == (a,)
    assert "no header rule" in sim.control.flows.get(a).reason
    sim.tick({a: 100, b: 100})
    assert sim.total(a).packets == sim.sent[a]
    assert sim.control.flows.get(a).offloaded_counters.packets == 10


def test_idle_flows_are_forgotten_with_their_offload_entry():
    sim = Sim(stats_policy())
    sim.control.idle_timeout = 1.0
    busy, quiet = flow(1), flow(2)
    for m in (busy, quiet):
        sim.start(m, "phy0")
    sim.tick({busy: 5000, quiet: 5000})
    sim.tick({busy: 5000, quiet: 5000})
    assert quiet in sim.provider.entries
    expired = []
    for _ in range(15):
        expired += sim.tick({busy: 5000, quiet: 0}).expired
    assert [f.match for f in expired] == [quiet]
    assert sim.control.flows.get(quiet) is None and quiet not in sim.provider.entries
    assert sim.control.flows.get(busy) is not None


def test_offloaded_at_is_when_the_install_returned_not_when_asked():
    sim = Sim(stats_policy())
    m = flow(1)
    sim.start(m, "phy0")
    for _ in range(3):
        sim.tick({m: 200})
    install = sim.provider.install

    def slow_install(entries):
        sim.clock.now += 0.25  # the provider takes a while (privsep, map update)
        return install(entries)

    sim.provider.install = slow_install
    sim.tick({m: 5000})
    asked_at = sim.clock.now - 0.25
    record = next(
        f for f in sim.control.status()["flows"] if f["id"] == sim.control.flows.get(m).flow_id
    )
    assert record["state"] == "offloaded"
    assert record["offload_requested_at"] == pytest.approx(asked_at)
    assert record["offloaded_at"] == pytest.approx(asked_at + 0.25)


@pytest.mark.parametrize("pushed_before_rule", [0, 37, 639])
def test_a_burst_before_the_rule_is_counted_once_wherever_ovs_credits_it(pushed_before_rule):
    """640 packets at flow start: the first is judged (packet-in); OVS switched the
    rest and credits each once, to the counting rule (pushed before the flow's
    rule existed) or to the flow's rule (pushed after).  The total is 640 whatever
    the split, and stays so after the counting rule idles out of the bridge."""
    sim = Sim(stats_policy(promote_pps=10**9))
    m = flow(7)
    sim.start(m, "phy0")  # the packet-in: 1
    fid = sim.control.flows.get(m).flow_id
    learned = {m: FlowCounters(pushed_before_rule, pushed_before_rule * SIZE)}
    rest = 639 - pushed_before_rule
    rule = {fid: FlowCounters(rest, rest * SIZE)}
    sim.control.poll(rule, {}, learned)
    assert sim.total(m) == FlowCounters(640, 640 * SIZE)
    sim.control.poll(rule, {}, {})  # the counting rule idled out: nothing is lost
    sim.control.poll(rule, {}, {m: FlowCounters()})  # ... or was learnt anew
    assert sim.total(m) == FlowCounters(640, 640 * SIZE)
