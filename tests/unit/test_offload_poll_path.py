"""What a statistics poll costs at scale: the parts made cheaper for 10k flows
(docs/benchmarks/offload-load.md), each held to what it replaced."""

from __future__ import annotations

import random
import types

import pytest

from ovs_ext import app, flows, policy, service, stats_reader
from ovs_ext.providers.base import FlowMatch
from tests.unit.test_offload_stats_reader import _body


@pytest.mark.parametrize("seed", range(20))
def test_a_flows_rate_from_its_window_equals_the_rate_from_its_whole_history(seed):
    rng = random.Random(seed)
    flow = flows.TrackedFlow(
        1, FlowMatch("tap0", 17, "10.0.0.1", "10.0.0.2", 1, 2), "tap0",
        policy.Direction.EGRESS, None, 0.0, policy.SetupDecision(None),
    )  # fmt: skip
    now, packets = 0.0, 0
    for _ in range(rng.randrange(0, 300)):
        now += rng.choice((0.01, 0.05, 0.1, 0.3, 2.0))
        packets += rng.randrange(0, 500)
        flow.history.append((now, packets, packets * 60))
    for window in (0.05, 0.2, 1.0, 30.0):
        assert flow.rate(window) == policy.window_rate(list(flow.history), window)


def test_the_reader_decodes_a_counting_rules_match_once_across_polls():
    body, decoded = _body(), {}
    wants = app._wants_match
    first = stats_reader.parse_flow_stats(body, wants, decoded)
    again = stats_reader.parse_flow_stats(body, wants, decoded)
    assert len(decoded) == 1  # the counting rule's; the flow rule's match is not read
    counting = [s for s in first if flows.is_counting_cookie(s.cookie)]
    assert counting[0].match["udp_src"] == 4000 and counting[0].match_key in decoded
    assert [s.match for s in again] == [s.match for s in first]


class FakeReader:
    def __init__(self) -> None:
        self.asked: list[tuple[int, int]] = []

    def read(self, cookie, cookie_mask, _wants):
        self.asked.append((cookie, cookie_mask))
        return []


def _poller(pipeline=None):
    return types.SimpleNamespace(
        rt=types.SimpleNamespace(pipeline=pipeline), _counting_read_at=float("-inf")
    )


def test_counting_rules_are_read_at_most_once_a_second(monkeypatch):
    clock = [10.0]
    monkeypatch.setattr(app.time, "monotonic", lambda: clock[0])
    poller, reader = _poller(), FakeReader()
    for _ in range(3):  # three polls within a second
        app.OffloadApp._read_rules(poller, reader)
        clock[0] += 0.1
    kinds = [cookie >> 40 & 0xFF for cookie, _mask in reader.asked]
    assert (
        kinds == [flows.COOKIE_KIND_FLOW, flows.COOKIE_KIND_COUNTING] + [flows.COOKIE_KIND_FLOW] * 2
    )
    clock[0] += 1.0
    app.OffloadApp._read_rules(poller, reader)
    assert [c >> 40 & 0xFF for c, _m in reader.asked[-2:]] == [
        flows.COOKIE_KIND_FLOW, flows.COOKIE_KIND_COUNTING,
    ]  # fmt: skip


def test_beside_neutron_every_owned_rule_is_read_every_poll():
    poller, reader = _poller(pipeline=object()), FakeReader()
    app.OffloadApp._read_rules(poller, reader)
    app.OffloadApp._read_rules(poller, reader)
    assert reader.asked == [(flows.COOKIE_PREFIX << 48, flows.COOKIE_MASK)] * 2


def test_a_slow_poll_is_followed_by_a_pause_as_long():
    assert app.poll_pause(0.05, 0.01) == pytest.approx(0.04)
    assert app.poll_pause(0.05, 0.3) == 0.3


def test_stats_socket_auto_is_the_bridges_mgmt_socket_when_it_is_there(tmp_path, monkeypatch):
    monkeypatch.setenv("OVS_RUNDIR", str(tmp_path))
    assert service.stats_socket_path("auto", "br-int") == ""  # not there: controller connection
    (tmp_path / "br-int.mgmt").touch()
    assert service.stats_socket_path("auto", "br-int") == str(tmp_path / "br-int.mgmt")
    assert service.stats_socket_path("", "br-int") == ""
    assert service.stats_socket_path("/x/y.mgmt", "br-int") == "/x/y.mgmt"
