"""``flexmig explain``/``migrate`` against agents the lab did not start (inventory ``host``).

The lab gives the hosts (namespaces, libvirtd, QEMU); the test starts its own
flexmig-agent on each of A and B with a configuration of its own (its own key,
port and memory budget), as an operator's deployment would, and runs the
``flexmig`` command inside host A the way an operator runs it on a compute
host: ``--config-file`` naming that agent's file, the VM by domain name or
UUID, the destination by address.  Nothing goes through ``Lab()``.
"""

from __future__ import annotations

import json
import secrets
import signal
import sys
from pathlib import Path

import pytest

from flexmig import migrate_cli, processutil
from flexmig_lab import topology, vm

pytestmark = pytest.mark.lab

PORT = 9798  # beside the lab's own agents (9797)
FLEXMIG = str(Path(sys.executable).parent / "flexmig")
B_BUDGET_MB = 300  # the test's agent on B offers less than cli1 needs: split


def _conf(host, key_file: Path, budget_mb: int) -> str:
    return "\n".join(
        [
            "[agent]",
            f"listen_address = {host.spec.mgmt_ip}",
            f"port = {PORT}",
            f"key_file = {key_file}",
            f"store_dir = {host.store_dir}",
            f"memory_budget_mb = {budget_mb}",
            f"cgroup_parent = {topology.cgroup_parent()}",
            "",
        ]
    )


@pytest.fixture(scope="module")
def own_agents(lab):
    """(config file of A's agent, of B's): agents on port 9798 with a key of the test's."""
    key = lab.dir / "own-agent.key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    confs, procs = {}, []
    for host in lab.hosts():
        conf = host.dir / "own-agent.conf"
        conf.write_text(_conf(host, key, B_BUDGET_MB if host.name == "B" else 4096))
        procs.append(
            host.ns.spawn(
                [sys.executable, "-m", "agents.agent.service", "--config-file", str(conf)],
                host.dir / "own-agent.log",
            )
        )
        address = f"{host.spec.mgmt_ip}:{PORT}"
        processutil.wait_for(
            lambda h=host, a=address: a in h.ns.run(["ss", "-ltnH"]).stdout,
            timeout=60,
            what=f"the test's agent on {host.name} listening on {address}",
        )
        confs[host.name] = conf
    yield confs
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def _flexmig(lab, *args: str, config: Path) -> tuple[int, str, str]:
    proc = lab.host("A").ns.run(
        [FLEXMIG, "--config-file", str(config), *args], check=False, timeout=300
    )
    return proc.returncode, proc.stdout, proc.stderr


def _uuid(lab, name: str) -> str:
    uri = lab.host("A").local_uri  # A's libvirtd, reached from outside the host
    return processutil.run(["virsh", "-c", uri, "domuuid", name]).stdout.strip()


def test_explain_through_an_agent_the_lab_did_not_start(lab, own_agents):
    vm.create(lab, "A", ram="384M", workload="idle", name="cli1")
    try:
        b_address = topology.host_by_name(lab.specs, "B").mgmt_ip
        rc, out, err = _flexmig(
            lab, "explain", "cli1", "--to", b_address, "--json", config=own_agents["A"]
        )
        assert rc == 0, err
        plan = json.loads(out)
        # The test's agent on B offers 300 MiB: the 384 MiB VM must be split.
        # The lab's own agent on B offers 4 GiB and gets precopy: the answer
        # above came from the agents named by the config file.
        assert plan["mode"] == "split", plan["explanation"]
        assert migrate_cli.explain(lab, "cli1", "B")["mode"] == "precopy"

        # The same VM by its UUID (a Nova instance's UUID is its domain's), as a table.
        rc, out, err = _flexmig(
            lab, "explain", _uuid(lab, "cli1"), "--to", b_address, config=own_agents["A"]
        )
        assert rc == 0, err
        assert "cli1: SPLIT" in out
        assert "| mode " in out and "| split " in out
    finally:
        vm.destroy(lab, "cli1")


def test_migrate_by_uuid_to_a_host_name_through_the_own_agents(lab, own_agents):
    vm.create(lab, "A", ram="128M", workload="idle", name="cli2")
    try:
        # B by its host name (the lab hosts' /etc/hosts lists them).
        b_name = topology.host_by_name(lab.specs, "B").hostname
        rc, out, err = _flexmig(
            lab, "migrate", _uuid(lab, "cli2"), "--to", b_name, config=own_agents["A"]
        )
        assert rc == 0, out + err
        assert "| result " in out and "completed" in out
        assert vm.LabVM(lab, "cli2").locate() == "B"
    finally:
        vm.destroy(lab, "cli2")


def test_bad_key_unknown_vm_and_missing_config_fail_clearly(lab, own_agents, tmp_path):
    wrong_key = lab.dir / "wrong.key"
    wrong_key.write_text(secrets.token_hex(32))
    wrong = lab.host("A").dir / "wrong-agent.conf"
    wrong.write_text(
        own_agents["A"].read_text().replace(str(lab.dir / "own-agent.key"), str(wrong_key))
    )
    vm.create(lab, "A", ram="128M", workload="idle", name="cli3")
    try:
        b_address = topology.host_by_name(lab.specs, "B").mgmt_ip
        rc, _out, err = _flexmig(lab, "migrate", "cli3", "--to", b_address, config=wrong)
        assert rc == 1 and "401" in err
        assert vm.LabVM(lab, "cli3").locate() == "A"  # nothing moved
        rc, _out, err = _flexmig(
            lab, "explain", "nosuchvm", "--to", b_address, config=own_agents["A"]
        )
        assert rc == 1 and "no domain 'nosuchvm'" in err
        rc, _out, err = _flexmig(
            lab, "explain", "cli3", "--to", b_address, config=tmp_path / "none.conf"
        )
        assert rc == 1 and "not found" in err
    finally:
        vm.destroy(lab, "cli3")
