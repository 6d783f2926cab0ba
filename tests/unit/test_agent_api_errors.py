"""The agent API says what happened: 400 bad input, 404, 409 refusal with reasons,
502 backend failure, 500 a bug; the client turns each back into its own error."""

from __future__ import annotations

import threading

import pytest

from agents.agent import api, auth
from agents.agent.client import AgentClient, AgentError
from flexmig import exceptions

KEY = b"k" * 32


@pytest.fixture
def agent():
    def refuse(body, m):
        raise exceptions.PolicyRefused("vm1", ["precopy is unavailable", "split is unavailable"])

    def backend(body, m):
        raise exceptions.HypervisorError(host="A", action="migrate vm1", reason="boom")

    def bug(body, m):
        return {}["missing"]

    def bad(body, m):
        raise exceptions.InvalidInput(what="migration request", reason="mode 'fast'")

    router = api.Router()
    router.add("POST", "/refuse", refuse)
    router.add("POST", "/backend", backend)
    router.add("POST", "/bug", bug)
    router.add("POST", "/bad", bad)
    server = api.make_servers("127.0.0.1", 0, None, auth.Verifier(KEY), router)[0]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield AgentClient("127.0.0.1", server.server_address[1], KEY)
    server.shutdown()
    server.server_close()


def test_a_refusal_is_409_and_comes_back_with_its_reasons(agent):
    with pytest.raises(exceptions.PolicyRefused) as refused:
        agent.post("/refuse", {})
    assert refused.value.vm == "vm1"
    assert refused.value.reasons == ("precopy is unavailable", "split is unavailable")


def test_bad_input_and_a_missing_thing_are_the_callers_errors(agent):
    with pytest.raises(exceptions.InvalidInput, match="400 .*mode 'fast'"):
        agent.post("/bad", {})
    with pytest.raises(exceptions.NotFound, match="404"):
        agent.get("/nothing/here")


def test_a_backend_failure_is_502_and_a_bug_500_saying_so(agent):
    with pytest.raises(AgentError, match="502 libvirt on A failed to migrate vm1: boom"):
        agent.post("/backend", {})
    with pytest.raises(AgentError, match="500 Internal error .*a bug in FlexMig.*KeyError"):
        agent.post("/bug", {})


@pytest.mark.parametrize("size", [api.MAX_BODY + 1, 8 * 2**20])
def test_a_body_too_large_is_refused_with_the_agents_reason_not_a_broken_pipe(agent, size):
    """The agent refuses a body over MAX_BODY once it has read the headers.
    Closing on the unread body would reset the connection and could discard
    the reply (a CI failure, 8 MiB under load); the agent drops the body before
    closing, so the caller gets the agent's reason every time."""
    for _ in range(5):
        with pytest.raises(exceptions.InvalidInput, match=f"400 .*0..{api.MAX_BODY} bytes"):
            agent.post("/bad", {"pad": "x" * size})
