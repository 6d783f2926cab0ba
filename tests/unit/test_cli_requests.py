"""``flexmig explain``/``migrate`` build one MigrationRequest and say what went wrong."""

from __future__ import annotations

import pytest

from flexmig import cli, exceptions


class FakeAgent:
    def __init__(self, reply=None, error=None) -> None:
        self.posted: list[tuple[str, dict]] = []
        plan = {"explanation": "vm1: PRECOPY", "mode": "precopy", "transfer": "precopy"}
        self.reply, self.error = reply or plan, error

    def post(self, path: str, body: dict) -> dict:
        self.posted.append((path, body))
        if self.error:
            raise self.error
        return self.reply


class FakeInventory:
    def __init__(self, agent: FakeAgent) -> None:
        self.the_agent = agent

    def domain(self, vm: str) -> str:
        return vm

    def vm_host(self, vm: str) -> str | None:
        return "A" if vm == "vm1" else None

    def destination(self, to: str) -> tuple[str, dict]:
        return to.upper(), {"address": "10.0.0.2", "port": 9797}

    def agent(self, host: str) -> FakeAgent:
        return self.the_agent

    def guest(self, vm: str) -> None:
        return None


@pytest.fixture
def agent(monkeypatch):
    fake = FakeAgent()
    monkeypatch.setattr(cli, "load_inventory", lambda name, files: FakeInventory(fake))
    return fake


def test_explain_sends_one_request_with_only_what_was_asked(agent, capsys):
    assert (
        cli.main(["explain", "vm1", "--to", "b", "--mode", "precopy", "--bandwidth-mib", "64"]) == 0
    )
    ((path, body),) = agent.posted
    assert path == "/v1/plan"
    assert body == {
        "vm": "vm1",
        "mode": "precopy",
        "bandwidth_mib": 64,
        "dest": {"address": "10.0.0.2", "port": 9797},
    }
    assert "vm1: PRECOPY" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["migrate", "vm1", "--to", "b", "--bandwidth-mib", "-1"],
        ["explain", "vm1", "--to", "b", "--max-downtime-ms", "0"],
        ["explain", "vm2", "--to", "b"],  # not running anywhere the inventory knows
        ["explain", "vm1", "--to", "a"],  # already there
    ],
)
def test_bad_input_is_an_error_before_any_agent_is_asked(agent, capsys, argv):
    assert cli.main(argv) == 1
    assert capsys.readouterr().err.startswith("flexmig: error: ")
    assert agent.posted == []


def test_a_refusal_names_its_reasons(agent, capsys):
    agent.error = exceptions.PolicyRefused("vm1", ["split is unavailable: not file-backed"])
    assert cli.main(["explain", "vm1", "--to", "b"]) == 1
    err = capsys.readouterr().err
    assert "FlexMig refuses to migrate vm1: split is unavailable: not file-backed" in err


def test_the_command_line_refuses_what_it_cannot_parse(agent):
    for argv in (
        ["explain", "vm1", "--to", "b", "--mode", "fast"],
        ["migrate", "vm1", "--to", "b", "--parallel", "9"],
    ):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2
    assert agent.posted == []
