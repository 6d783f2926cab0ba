"""The extension's local control interface over a real UNIX socket, signed like the agents'.

The control state is the simulated host of test_offload_control (fake fast
path); requests go through the same client the agent uses.
"""

import pytest

from agents.agent.client import AgentClient, AgentError
from flexmig import exceptions
from ovs_ext import control_api
from ovs_ext.app import Runtime
from ovs_ext.flows import FlowState
from tests.unit.test_offload_control import Sim, flow, stats_policy

KEY = b"k" * 32


@pytest.fixture
def served(tmp_path):
    sim = Sim(stats_policy())
    runtime = Runtime(sim.control, "br-int", 0.1, status_file=str(tmp_path / "status.json"))
    api = control_api.serve(runtime, str(tmp_path / "ctl.sock"), KEY)
    client = AgentClient(str(tmp_path / "ctl.sock"), 0, KEY)
    yield sim, client, tmp_path
    api.server.shutdown()
    api.server.server_close()


def offloaded(sim, m):
    sim.start(m, "phy0")
    for _ in range(3):
        sim.tick({m: 5000})
    assert sim.control.flows.get(m).state is FlowState.OFFLOADED


def test_depart_over_the_socket_demotes_and_returns_the_records(served):
    sim, client, tmp_path = served
    m = flow(1)
    offloaded(sim, m)
    body = {"migration_id": "m-1", "ports": ["tap0"], "peer": "hostB"}
    records = client.post("/v1/migrations/depart", body)["flows"]
    assert len(records) == 1 and records[0]["was_offloaded"]
    assert sim.control.flows.get(m).state is FlowState.ONLOADED
    assert '"state": "departing"' in (tmp_path / "status.json").read_text()
    shown = client.get("/v1/migrations/m-1")
    assert shown["role"] == "source" and shown["were_offloaded"] == 1


def test_an_unsigned_or_wrongly_signed_request_changes_nothing(served):
    sim, _client, tmp_path = served
    m = flow(1)
    offloaded(sim, m)
    intruder = AgentClient(str(tmp_path / "ctl.sock"), 0, b"x" * 32)
    with pytest.raises(AgentError, match="401"):
        intruder.post(
            "/v1/migrations/depart", {"migration_id": "m", "ports": ["tap0"], "peer": "b"}
        )
    assert sim.control.flows.get(m).state is FlowState.OFFLOADED


@pytest.mark.parametrize(
    "body",
    [
        {"migration_id": "m 1", "ports": ["tap0"], "peer": "b"},
        {"migration_id": "m1", "ports": [], "peer": "b"},
        {"migration_id": "m1", "ports": ["tap0; rm -rf"], "peer": "b"},
        {"migration_id": "m1", "ports": ["tap0"]},
        {"migration_id": "m1", "ports": ["tap0"], "peer": "b", "extra": 1},
        {"migration_id": "m1", "ports": ["tap0"], "peer": "b", "rekey": {"tap9": "tap1"}},
        {"migration_id": "m1", "ports": ["tap0"], "peer": "b", "rekey": {"tap0": "x;y"}},
        {"migration_id": "m1", "ports": ["tap0"], "peer": "b", "rekey": {"tap0": "tap0"}},
    ],
)
def test_bad_depart_requests_are_refused_and_change_nothing(served, body):
    sim, client, _ = served
    m = flow(1)
    offloaded(sim, m)
    with pytest.raises(exceptions.InvalidInput, match="400"):  # bad input, not a backend
        client.post("/v1/migrations/depart", body)
    assert sim.control.flows.get(m).state is FlowState.OFFLOADED
    assert sim.control.flows.get(m).held == ""


def test_arrive_with_a_malformed_record_registers_nothing(served):
    sim, client, _ = served
    body = {"migration_id": "m1", "ports": ["tap0"], "peer": "a", "flows": [{"v": 1}]}
    with pytest.raises(exceptions.InvalidInput, match="400"):  # bad input, not a backend
        client.post("/v1/migrations/arrive", body)
    assert len(sim.control.flows) == 0
    with pytest.raises(exceptions.InvalidInput, match="400"):  # bad input, not a backend
        client.post("/v1/migrations/m1/resume", {})


def test_records_of_a_vm_with_many_flows_arrive_in_parts(served, tmp_path):
    """600 flows' records are more than one request carries (api.MAX_BODY):
    the first part arrives, the rest follow as records, and every flow is known."""
    from agents.agent import api, offload_hook

    sim, client, _ = served
    for n in range(600):
        sim.start(flow(n), "ep-a")
    depart = {"migration_id": "m-many", "ports": ["tap0"], "peer": "hostB"}
    records = client.post("/v1/migrations/depart", depart)["flows"]
    assert len(records) == 600
    dest_sim = Sim(stats_policy())
    runtime = Runtime(dest_sim.control, "br-int", 0.1, status_file=str(tmp_path / "b.json"))
    dest_api = control_api.serve(runtime, str(tmp_path / "b.sock"), KEY)
    dest = AgentClient(str(tmp_path / "b.sock"), 0, KEY)
    try:
        arrive = {"migration_id": "m-many", "ports": ["tap0"], "peer": "hostA"}
        with pytest.raises(exceptions.InvalidInput, match=f"0..{api.MAX_BODY} bytes"):
            dest.post("/v1/migrations/arrive", arrive | {"flows": records})  # one request
        first, *rest = offload_hook.parts(records)
        assert rest, "600 records fit one request: the test no longer tests parts"
        dest.post("/v1/migrations/arrive", arrive | {"flows": first})
        for part in rest:
            shown = dest.post("/v1/migrations/m-many/records", {"flows": part})["migration"]
        assert shown["flows"] == 600 and len(dest_sim.control.flows) == 600
        dest.post("/v1/migrations/m-many/resume", {})
        with pytest.raises(exceptions.InvalidInput, match="400.*resumed"):  # too late
            dest.post("/v1/migrations/m-many/records", {"flows": rest[0]})
    finally:
        dest_api.server.shutdown()
        dest_api.server.server_close()


def test_depart_with_rekey_returns_records_keyed_by_the_standby(served):
    """An SR-IOV failover pair: the VF representor's flows leave keyed by the standby."""
    sim, client, tmp_path = served
    m = flow(1, port="tap1")  # tap1 plays the VF representor, tap0 the standby
    offloaded(sim, m)
    body = {"migration_id": "m-2", "ports": ["tap0", "tap1"], "peer": "hostB"}
    records = client.post("/v1/migrations/depart", body | {"rekey": {"tap1": "tap0"}})["flows"]
    assert [r["match"]["in_port"] for r in records] == ["tap0"]
    assert [r["owner"] for r in records] == ["tap0"] and records[0]["was_offloaded"]
    assert sim.control.flows.get(m) is None
    with pytest.raises(exceptions.InvalidInput, match="400"):
        client.post("/v1/migrations/m-2/rekey", {"from": "tap0", "to": "tap0"})
    back = client.post("/v1/migrations/m-2/rekey", {"from": "tap0", "to": "tap1"})
    assert back["rekeyed"] == 1 and sim.control.flows.get(m) is not None
