"""The agent's API under hostile clients: idle and slow connections, plain HTTP on TLS,
orchestration disabled, the mover's token kept off the wire.

Real sockets on loopback, a real Agent (libvirt's test driver), no root.
"""

from __future__ import annotations

import contextlib
import pathlib
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest
from oslo_config import cfg

from agents.agent import api, auth, listener, service
from agents.agent import config as agent_config
from agents.agent.client import AgentClient, AgentError
from agents.agent.service import Agent, limits, tls
from flexmig import exceptions

KEY = b"flexmig-hardening-test-key-0123456789"
TIMEOUT_S = 1.0  # the agent's socket_timeout in these tests
WORKERS = 4


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(directory: pathlib.Path, name: str, ip: str = "127.0.0.1") -> dict[str, str]:
    """A throwaway CA and a server certificate for ``ip`` (as a deployment's CA issues)."""
    directory.mkdir(parents=True, exist_ok=True)
    rsa = ["-newkey", "rsa:2048", "-nodes"]
    _openssl("req", "-x509", *rsa, "-days", "1", "-subj", f"/CN={name} test CA",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=directory)  # fmt: skip
    _openssl("req", *rsa, "-subj", f"/CN={ip}", "-keyout", "agent.key", "-out", "agent.csr",
             cwd=directory)  # fmt: skip
    (directory / "san.ext").write_text(f"subjectAltName=IP:{ip}\n")
    _openssl("x509", "-req", "-in", "agent.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "1", "-extfile", "san.ext", "-out", "agent.pem",
             cwd=directory)  # fmt: skip
    return {
        "tls_ca_file": str(directory / "ca.pem"),
        "tls_cert_file": str(directory / "agent.pem"),
        "tls_key_file": str(directory / "agent.key"),
    }


def agent_conf(tmp_path: pathlib.Path, **settings: object) -> cfg.ConfigOpts:
    key_file = tmp_path / "agent.key"
    key_file.write_bytes(KEY)
    (tmp_path / "node.xml").write_text("<node>\n</node>\n")
    (tmp_path / "store").mkdir(exist_ok=True)
    values = {
        "listen_address": "127.0.0.1",
        "key_file": key_file,
        "store_dir": tmp_path / "store",
        "state_dir": tmp_path / "state",
        "libvirt_uri": f"test://{tmp_path / 'node.xml'}",
        "socket_timeout": TIMEOUT_S,
        "workers": WORKERS,
        "max_queued": 8,
        **settings,
    }
    conf_file = tmp_path / "agent.conf"
    conf_file.write_text("[agent]\n" + "".join(f"{k} = {v}\n" for k, v in values.items()))
    conf = cfg.ConfigOpts()
    agent_config.register_opts(conf)
    conf(["--config-file", str(conf_file)], project="flexmig-test", default_config_files=[])
    agent_config.check_tls(conf)
    return conf


@contextlib.contextmanager
def serving(conf: cfg.ConfigOpts) -> Iterator[tuple[Agent, int]]:
    agent = Agent(conf)
    (server,) = api.make_servers(
        "127.0.0.1", 0, None, auth.Verifier(agent.key), agent.router, limits(conf), tls(conf)
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield agent, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _timed_health(client: AgentClient) -> float:
    start = time.monotonic()
    assert client.get("/v1/health")["ok"] is True
    return time.monotonic() - start


def test_200_silent_connections_leave_others_answered(tmp_path: pathlib.Path) -> None:
    with serving(agent_conf(tmp_path)) as (_agent, port):
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
        try:
            time.sleep(0.2)  # all accepted and waiting before the honest client comes
            client = AgentClient("127.0.0.1", port, KEY, timeout=5)
            for _ in range(5):
                assert _timed_health(client) < TIMEOUT_S
            # ... and the silent ones are closed once their time is up.
            for sock in silent:
                sock.settimeout(TIMEOUT_S + 2)
                assert sock.recv(1) == b""
        finally:
            for sock in silent:
                sock.close()


def test_slow_clients_are_cut_and_others_still_answered(tmp_path: pathlib.Path) -> None:
    with serving(agent_conf(tmp_path)) as (_agent, port):
        # More trickling clients than workers: each sends part of a request, then stalls.
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(2 * WORKERS)]
        try:
            for sock in slow:
                sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")
            time.sleep(0.2)
            client = AgentClient("127.0.0.1", port, KEY, timeout=10)
            # Queued behind the stalled ones at worst, which are cut at socket_timeout.
            assert _timed_health(client) < 2 * TIMEOUT_S + 0.5
            for sock in slow:
                sock.settimeout(TIMEOUT_S + 2)
                assert sock.recv(1) == b""  # cut without a reply
        finally:
            for sock in slow:
                sock.close()


def test_tls_serves_verified_clients_and_refuses_plain_http(tmp_path: pathlib.Path) -> None:
    files = make_ca(tmp_path / "ca", "deployment")
    with serving(agent_conf(tmp_path, **files)) as (_agent, port):
        secure = AgentClient("127.0.0.1", port, KEY, ca_file=files["tls_ca_file"])
        assert secure.get("/v1/health")["ok"] is True
        plain = AgentClient("127.0.0.1", port, KEY, timeout=5)
        with pytest.raises(AgentError):
            plain.get("/v1/health")
        # A certificate from another CA is not the deployment's.
        other = make_ca(tmp_path / "other", "other")
        stranger = AgentClient("127.0.0.1", port, KEY, ca_file=other["tls_ca_file"])
        with pytest.raises(AgentError, match="CERTIFICATE_VERIFY_FAILED"):
            stranger.get("/v1/health")
        assert secure.get("/v1/health")["ok"] is True  # still serving


def test_tls_needs_all_three_files(tmp_path: pathlib.Path) -> None:
    files = make_ca(tmp_path / "ca", "deployment")
    del files["tls_ca_file"]
    with pytest.raises(cfg.ConfigFileValueError, match="missing \\['tls_ca_file'\\]"):
        agent_conf(tmp_path, **files)


def test_orchestration_routes_answer_403_where_disabled(tmp_path: pathlib.Path) -> None:
    with serving(agent_conf(tmp_path, allow_orchestration=False)) as (_agent, port):
        client = AgentClient("127.0.0.1", port, KEY)
        assert client.get("/v1/health")["ok"] is True  # what Nova uses still works
        body = {"vm": "vm0", "dest": {}}
        for method, path, payload in [
            ("POST", "/v1/migrations", body),
            ("POST", "/v1/plan", body),
            ("GET", "/v1/migrations", None),
        ]:
            with pytest.raises(AgentError, match="403.*allow_orchestration = false"):
                client.request(method, path, payload)
        # The movers stay open: Nova's driver asks both agents for them.
        with pytest.raises(exceptions.InvalidInput, match="400.*migration_id must be 6..36 hex"):
            client.post("/v1/mover/receive", {"migration_id": "zz", "token_salt": "0" * 48})
        # Unsigned requests are still turned away by authentication first.
        with pytest.raises(AgentError, match="401"):
            AgentClient("127.0.0.1", port, b"not-the-deployment-key!!").post("/v1/migrations", body)


def test_orchestration_routes_are_live_where_allowed(tmp_path: pathlib.Path) -> None:
    with serving(agent_conf(tmp_path)) as (_agent, port):
        client = AgentClient("127.0.0.1", port, KEY)
        assert client.get("/v1/migrations") == {"migrations": []}
        # Past the orchestration gate: the request itself is read (and refused).
        with pytest.raises(exceptions.InvalidInput, match="400"):
            client.post("/v1/migrations", {"vm": "vm0", "dest": {}})


def test_the_mover_token_never_travels(tmp_path: pathlib.Path) -> None:
    salt = "5a" * 24
    token = auth.mover_token(KEY, "abcdef01", salt)
    assert token == auth.mover_token(KEY, "abcdef01", salt)  # both ends agree
    assert token != auth.mover_token(KEY, "abcdef01", "5b" * 24)
    assert token != auth.mover_token(b"another-deployment-key", "abcdef01", salt)
    with serving(agent_conf(tmp_path, allow_orchestration=True)) as (_agent, port):
        client = AgentClient("127.0.0.1", port, KEY)
        # A request carrying a token in clear is malformed: only the salt is accepted.
        with pytest.raises(exceptions.InvalidInput, match="400.*unknown field"):
            client.post("/v1/mover/receive", {"migration_id": "abcdef01", "token": token})


def test_limits_follow_the_options(tmp_path: pathlib.Path) -> None:
    conf = agent_conf(tmp_path, workers=3, max_queued=5, max_idle_connections=7)
    assert limits(conf) == listener.Limits(
        socket_timeout=TIMEOUT_S, workers=3, max_queued=5, max_idle_connections=7
    )


def test_facts_name_where_peers_reach_this_agent(tmp_path: pathlib.Path) -> None:
    # The caller may have come by another way (Nova's driver by a local socket):
    # the offload hand-off between agents uses this endpoint.
    with serving(agent_conf(tmp_path, port=9811)) as (_agent, port):
        facts = AgentClient("127.0.0.1", port, KEY).get("/v1/facts")
    assert facts["agent"] == {"address": "127.0.0.1", "port": 9811}


def test_background_sampling_is_refused_below_one_sampling_and_runs_otherwise(tmp_path):
    with pytest.raises(exceptions.InvalidInput, match=r"dirty_sample_refresh: 5 s is shorter"):
        service.refresh_samples(Agent(agent_conf(tmp_path, dirty_sample_refresh=5)))
    assert service.refresh_samples(Agent(agent_conf(tmp_path))) is None
    refresher = service.refresh_samples(Agent(agent_conf(tmp_path, dirty_sample_refresh=30)))
    assert refresher is not None
    try:
        deadline = time.monotonic() + 10
        while refresher.rounds == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        # The test driver's node runs no VM: a round that sampled none.
        assert refresher.rounds == 1
    finally:
        refresher.stop.set()


NODE_WITH_TWO_VMS = """<node>
  <domain type="test"><name>{0}</name><memory>65536</memory><os><type>hvm</type></os></domain>
  <domain type="test"><name>{1}</name><memory>65536</memory><os><type>hvm</type></os></domain>
</node>
"""


def test_background_sampling_leaves_split_vms_alone(tmp_path, monkeypatch):
    """libvirt's sampling reads pages all over guest RAM: on a split VM each read of a
    dropped page would fault 4 MiB back through the cap."""
    from flexmig.migration import facts

    sampled = []

    def sample(conn, dom, host, seconds):
        sampled.append(dom.name())
        return ((1.0, 10.0), (2.0, 15.0))

    monkeypatch.setattr(facts, "sample_dirty_pages", sample)
    conf = agent_conf(tmp_path, dirty_sample_refresh=30)
    (tmp_path / "node.xml").write_text(NODE_WITH_TWO_VMS.format("plain", "landed"))
    agent = Agent(conf)
    agent.migrations.ram_mapping = lambda vm, ram: (None, ram)  # no privsep daemon here
    reservations = tmp_path / "state" / "split"
    reservations.mkdir(parents=True)
    (reservations / "landed.json").write_text("{}")
    assert [vm["name"] for vm in agent.sample_running_vms(background=True)] == ["plain"]
    assert sampled == ["plain"]
    # A drain's inventory still reports it (sampled on request, as before).
    assert {vm["name"] for vm in agent.sample_running_vms()} == {"plain", "landed"}
