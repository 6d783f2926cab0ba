"""Nova's driver plans from the local agent's background samples, handed over once.

A real Agent on a loopback socket (libvirt's test driver, no root) and the
driver's own reader of its reply.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("nova", reason="Nova is not installed (tools/setup.sh installs it)")

from agents.agent import auth  # noqa: E402
from agents.agent.client import AgentClient, AgentError  # noqa: E402
from flexmig import exceptions  # noqa: E402
from nova_driver import planning  # noqa: E402
from tests.unit.test_agent_hardening import KEY, agent_conf, serving  # noqa: E402

SAMPLED = [(1.0, 1_800.0), (5.0, 7_900.0), (15.0, 15_200.0)]


def test_the_driver_takes_the_agents_fresh_samples_once(tmp_path):
    with serving(agent_conf(tmp_path)) as (agent, port):
        agent.migrations.samples.put("instance-00000001", list(SAMPLED))
        client = AgentClient("127.0.0.1", port, KEY)
        assert planning.background_samples(client, "instance-00000001") == tuple(SAMPLED)
        # Taken: the next migration of the VM samples anew, as the agent's own plans do.
        assert planning.background_samples(client, "instance-00000001") is None
        assert client.post("/v1/samples/instance-00000001/take", {}) == {
            "vm": "instance-00000001",
            "samples": [],
        }


def test_without_background_samples_the_driver_samples_itself(tmp_path):
    with serving(agent_conf(tmp_path)) as (agent, port):
        client = AgentClient("127.0.0.1", port, KEY)
        assert planning.background_samples(client, "instance-00000002") is None
        # One length only: the fit could not tell the set from its rate.
        agent.migrations.samples.put("instance-00000002", [(1.0, 10.0), (1.0, 12.0)])
        assert planning.background_samples(client, "instance-00000002") is None


def test_a_bad_name_is_refused_and_an_older_agent_just_means_sampling_here(tmp_path):
    with serving(agent_conf(tmp_path)) as (_agent, port):
        client = AgentClient("127.0.0.1", port, KEY)
        with pytest.raises(exceptions.InvalidInput, match="400 .*not a valid name"):
            client.post("/v1/samples/-x/take", {})
        with pytest.raises(exceptions.InvalidInput, match="400"):
            client.post("/v1/samples/instance-1/take", {"vm": "other"})
        assert planning.background_samples(client, "-x") is None
    # Nothing listening any more: the driver samples here instead of failing the move.
    assert planning.background_samples(AgentClient("127.0.0.1", port, KEY, timeout=1), "vm") is None


def test_a_migration_scoped_credential_cannot_take_a_hosts_samples(tmp_path):
    """Only the host's own holders of the agent key (its Nova, its operator) may:
    a destination's scoped credential reads facts, never another VM's samples."""
    scope = auth.scope_for("5f0c", "instance-00000003", time.time() + 600)
    with serving(agent_conf(tmp_path)) as (agent, port):
        agent.migrations.samples.put("instance-00000003", list(SAMPLED))
        scoped = AgentClient("127.0.0.1", port, auth.scoped_key(KEY, scope), scope=scope)
        assert scoped.get("/v1/health")["ok"] is True
        with pytest.raises(AgentError, match="may not POST /v1/samples/instance-00000003/take"):
            scoped.post("/v1/samples/instance-00000003/take", {})
        # Still there for the host's own driver.
        owner = AgentClient("127.0.0.1", port, KEY)
        assert planning.background_samples(owner, "instance-00000003") == tuple(SAMPLED)
