"""The agent's half of moving a VM's offloaded flows (agents/agent/offload_hook.py).

The extension is the simulated host of test_offload_control behind its real
control socket; libvirt is its test driver holding one VM with a tap port; the
destination agent is a recorder of what the hook sends it.
"""

from __future__ import annotations

import json

import pytest

from agents.agent import api
from agents.agent.offload_hook import OffloadHook
from ovs_ext import control_api
from ovs_ext.app import Runtime
from tests.unit.test_offload_control import Sim, flow, stats_policy

KEY = b"k" * 32
NODE = """<node><domain type='test'><name>vm1</name><memory>65536</memory>
<os><type>hvm</type></os><devices><interface type='bridge'><source bridge='br-int'/>
<target dev='tap0'/></interface></devices></domain></node>"""


class Destination:
    """The destination agent as the hook sees it: every request kept."""

    address = "hostB"

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict]] = []

    def post(self, path: str, body: dict) -> dict:
        assert len(json.dumps(body).encode()) <= api.MAX_BODY, path  # what the agent accepts
        self.posts.append((path, body))
        return {"note": "taken"}


@pytest.fixture
def hook(tmp_path):
    sim = Sim(stats_policy(capacity=64), capacity=64)
    runtime = Runtime(sim.control, "br-int", 0.1, status_file=str(tmp_path / "status.json"))
    served = control_api.serve(runtime, str(tmp_path / "ctl.sock"), KEY)
    (tmp_path / "node.xml").write_text(NODE)
    yield sim, OffloadHook(str(tmp_path / "ctl.sock"), KEY, "hostA", f"test://{tmp_path}/node.xml")
    served.server.shutdown()
    served.server.server_close()


def many_flows(sim, n, offloaded):
    matches = [flow(i) for i in range(n)]
    for m in matches:
        sim.start(m, "ep-a")
    for _ in range(3):
        sim.tick({m: 5000 for m in matches[:offloaded]})
    return matches


def test_explain_says_how_many_of_the_vms_flows_are_offloaded(hook):
    sim, offload = hook
    many_flows(sim, 3, offloaded=2)
    text = offload.explain("vm1")
    assert text.startswith("offloaded flows: 2 of 3 flows on tap0 are offloaded (provider fake)")


def test_depart_hands_hundreds_of_records_over_in_parts_that_each_fit_a_request(hook):
    sim, offload = hook
    matches = many_flows(sim, 600, offloaded=40)
    dest, events = Destination(), []
    assert offload.depart("m-1", "vm1", dest, events.append)
    paths = [path for path, _ in dest.posts]
    assert paths[0] == "/v1/offload/arrive" and len(paths) > 1
    assert set(paths[1:]) == {"/v1/offload/records"}
    carried = [r for _, body in dest.posts for r in body["flows"]]
    assert len(carried) == len({json.dumps(r["match"], sort_keys=True) for r in carried}) == 600
    assert sum(r["was_offloaded"] for r in carried) == 40
    assert dest.posts[0][1]["ports"] == ["tap0"] and dest.posts[0][1]["peer"] == "hostA"
    assert f"600 flow records transferred in {len(paths)} request(s)" in "\n".join(events)
    assert not sim.control.flows.offloaded() and len(matches) == 600  # all held on the vSwitch


def test_without_the_extension_the_vm_migrates_and_the_events_say_why(tmp_path):
    offload = OffloadHook(str(tmp_path / "absent.sock"), KEY, "hostA", "test:///default")
    dest, events = Destination(), []
    assert not offload.depart("m-1", "vm1", dest, events.append)
    assert dest.posts == [] and "not running here" in events[0]
