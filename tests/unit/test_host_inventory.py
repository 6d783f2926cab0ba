"""The ``host`` inventory's configuration and addressing, and the CLI over any inventory."""

from __future__ import annotations

import json

import pytest

from agents.agent import host_inventory
from flexmig import cli, exceptions


def _write_conf(tmp_path, key: bytes | None = b"k" * 32, extra: str = ""):
    key_file = tmp_path / "agent.key"
    if key is not None:
        key_file.write_bytes(key + b"\n")
    conf = tmp_path / "agent.conf"
    conf.write_text(
        "[agent]\nlisten_address = 192.0.2.10\nport = 9900\n"
        f"key_file = {key_file}\nstore_dir = /srv/store\n{extra}"
    )
    return conf


def test_reads_the_agents_own_configuration(tmp_path):
    inv = host_inventory.HostInventory([str(_write_conf(tmp_path))])
    assert inv.key == b"k" * 32
    assert inv.host_names() == ["192.0.2.10"]
    name, dest = inv.destination("192.0.2.11")
    assert name == "192.0.2.11"
    assert dest == {
        "address": "192.0.2.11",
        "port": 9900,
        "libvirt_uri": "qemu+tcp://192.0.2.11/system",
        "migration_uri": "tcp://192.0.2.11",
    }
    local = inv.agent("192.0.2.10")
    assert (local.address, local.port) == ("192.0.2.10", 9900)


def test_destination_by_name_and_uri_templates(tmp_path):
    extra = (
        "[cli]\npeer_libvirt_uri = qemu+ssh://%(address)s/system\n"
        "peer_migration_uri = tcp://%(address)s:49152\npeers = 127.0.0.1\n"
    )
    inv = host_inventory.HostInventory([str(_write_conf(tmp_path, extra=extra))])
    name, dest = inv.destination("localhost")
    assert name in ("127.0.0.1", "::1")
    assert dest["libvirt_uri"].startswith("qemu+ssh://")
    assert dest["migration_uri"].endswith(":49152")
    _, v6 = inv.destination("2001:db8::1")
    assert v6["migration_uri"] == "tcp://[2001:db8::1]:49152"
    assert inv.host_names() == ["192.0.2.10", "127.0.0.1"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "absent.conf", "not found"),
        (lambda p: _write_conf(p, key=None), "cannot read"),
        (lambda p: _write_conf(p, extra="port = 70000\n"), "configuration"),
    ],
)
def test_bad_configuration_is_a_clear_error(tmp_path, make, message):
    with pytest.raises(exceptions.InvalidInput, match=message):
        host_inventory.HostInventory([str(make(tmp_path))])


def test_unresolvable_destination_is_refused(tmp_path):
    inv = host_inventory.HostInventory([str(_write_conf(tmp_path))])
    with pytest.raises(exceptions.InvalidInput, match="does not resolve"):
        inv.destination("no-such-host.invalid")


class FakeAgent:
    def __init__(self) -> None:
        self.posted: list[tuple[str, dict]] = []

    def post(self, path, body):
        self.posted.append((path, body))
        return {"mode": "split", "transfer": "split", "explanation": "vm: SPLIT\n  - why"}


class FakeInventory:
    def __init__(self) -> None:
        self.agent_ = FakeAgent()

    def host_names(self):
        return ["src", "dst"]

    def domain(self, vm):
        return {"6f1c2a9e-0000-4000-8000-000000000001": "instance-0001"}.get(vm, vm)

    def vm_host(self, vm):
        return "src" if vm == "instance-0001" else None

    def agent(self, host):
        return self.agent_

    def destination(self, to):
        return to, {"address": to, "port": 1, "libvirt_uri": "u", "migration_uri": "m"}

    def guest(self, vm):
        return None


def test_explain_json_is_the_plan_and_the_vm_goes_by_its_domain_name(monkeypatch, capsys):
    inv = FakeInventory()
    monkeypatch.setattr(cli, "load_inventory", lambda name, files: inv)
    argv = ["explain", "6f1c2a9e-0000-4000-8000-000000000001", "--to", "dst", "--json"]
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["mode"] == "split"
    assert inv.agent_.posted[0][1]["vm"] == "instance-0001"
    assert cli.main(argv[:-1]) == 0
    out = capsys.readouterr().out
    assert out.startswith("vm: SPLIT") and "| mode" in out


def test_a_vm_not_running_here_and_the_same_host_are_refused(monkeypatch, capsys):
    inv = FakeInventory()
    monkeypatch.setattr(cli, "load_inventory", lambda name, files: inv)
    assert cli.main(["explain", "other", "--to", "dst"]) == 1
    assert "'other' is not running" in capsys.readouterr().err
    assert cli.main(["explain", "instance-0001", "--to", "src"]) == 1
    assert "already runs on src" in capsys.readouterr().err
    assert inv.agent_.posted == []


@pytest.mark.parametrize(
    ("result", "ok"),
    [
        ({"state": "completed", "running_on": "B"}, True),
        ({"state": "completed", "running_on": "B", "verify": {"bad": 0, "lost": 0}}, True),
        ({"state": "completed", "running_on": "B", "verify": {"bad": 1, "lost": 0}}, False),
        ({"state": "completed", "running_on": None}, False),
        ({"state": "failed", "running_on": "A"}, False),
    ],
)
def test_migration_ok(result, ok):
    assert cli.migration_ok(result) is ok


def test_unknown_inventory_is_named(capsys):
    assert cli.main(["--inventory", "nope", "explain", "vm", "--to", "B"]) == 1
    assert "'nope' is not installed" in capsys.readouterr().err


class MovingInventory(FakeInventory):
    """The VM leaves this host when the migration completes (a real source's view)."""

    def __init__(self, state: str) -> None:
        super().__init__()
        self.state = state
        self.moved = False
        agent = self.agent_

        def post(path, body):
            agent.posted.append((path, body))
            return {"id": "abc123"}

        def get(path):
            self.moved = state == "completed"
            return {
                "state": state, "error": None, "summary": {"mode": "precopy"},
                "explanation": "", "events": [], "progress": None, "phase": "",
            }  # fmt: skip

        agent.post, agent.get = post, get

    def vm_host(self, vm):
        return None if self.moved else super().vm_host(vm)


@pytest.mark.parametrize(
    ("state", "running_on", "rc"), [("completed", "dst", 0), ("failed", "src", 1)]
)
def test_migrate_without_a_guest_probe_trusts_libvirts_completion(
    monkeypatch, capsys, state, running_on, rc
):
    inv = MovingInventory(state)
    monkeypatch.setattr(cli, "load_inventory", lambda name, files: inv)
    assert cli.main(["migrate", "instance-0001", "--to", "dst", "--json"]) == rc
    result = json.loads(capsys.readouterr().out)
    assert result["running_on"] == running_on
    assert "verify" not in result
