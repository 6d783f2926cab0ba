"""The gate's Zuul jobs (.zuul.yaml): structure, and the FlexMig settings each node gets.

Zuul cannot run here.  These tests read the job definitions as Zuul would —
job.vars for the controller, job.group-vars.subnode for the other nodes, each
merged down the inheritance chain — and run the plugin's phases on the
stand-in node with exactly the settings each node of each job would get.
"""

from __future__ import annotations

import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from flexmig.policy import decision
from flexmig.policy.dirty_model import DirtyModel
from tests.devstack_standin.node import REPO, ini, make_stack

ZUUL = REPO / ".zuul.yaml"
PRE_RUN = REPO / "playbooks" / "flexmig-live-migration" / "pre.yaml"
# Parents defined by other projects (openstack/nova's and openstack-zuul-jobs').
EXTERNAL_PARENTS = {"nova-live-migration", "openstack-tox-functional-py311"}
# OpenStack's templates: tox -e pep8 / pyXY, docs, releasenotes.
TEMPLATES = ["openstack-python3-jobs", "publish-openstack-docs-pti", "release-notes-jobs-python3"]
TOX_JOBS = ["flexmig-tox-functional"]
TOX_INI = REPO / "tox.ini"
PLUGIN_URL = "https://opendev.org/x/flexmig"
JOBS = ["flexmig-live-migration", "flexmig-live-migration-split"]
ROLES = ["controller", "subnode"]


def load_zuul() -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    docs = yaml.safe_load(ZUUL.read_text())
    jobs = {doc["job"]["name"]: doc["job"] for doc in docs if "job" in doc}
    projects = [doc["project"] for doc in docs if "project" in doc]
    return jobs, projects


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Zuul's merge of a child's variables into its parent's: dicts recursively."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def node_vars(jobs: dict[str, dict[str, Any]], name: str, role: str) -> dict[str, Any]:
    """The variables one node of job ``name`` sees (only what this file defines)."""
    chain = []
    while name in jobs:
        chain.append(jobs[name])
        name = jobs[name].get("parent", "")
    job_vars: dict[str, Any] = {}
    group_vars: dict[str, Any] = {}
    for job in reversed(chain):
        job_vars = merge(job_vars, job.get("vars", {}))
        group_vars = merge(group_vars, job.get("group-vars", {}).get("subnode", {}))
    if role == "controller":
        return job_vars
    # Ansible: a group variable replaces the job variable of the same name.
    return {**job_vars, **group_vars}


def gate_key_path() -> str:
    plays = yaml.safe_load(PRE_RUN.read_text())
    return plays[0]["vars"]["flexmig_gate_key"]


def localrc_lines(variables: dict[str, Any], key_source: Path) -> str:
    """The localrc lines devstack's write-devstack-local-conf role would write."""
    lines = []
    for service, enabled in variables["devstack_services"].items():
        if service.startswith("flexmig-"):
            lines.append(f"{'enable' if enabled else 'disable'}_service {service}")
    for key, value in variables["devstack_localrc"].items():
        if key.startswith("FLEXMIG_"):
            written = key_source if key == "FLEXMIG_AGENT_KEY_SOURCE" else value
            lines.append(f'{key}="{written}"')
    return "\n".join(lines)


def test_jobs_derive_from_novas_live_migration_job():
    jobs, _ = load_zuul()
    assert sorted(jobs) == sorted(JOBS + TOX_JOBS)
    assert jobs["flexmig-live-migration"]["parent"] == "nova-live-migration"
    assert jobs["flexmig-live-migration-split"]["parent"] == "flexmig-live-migration"
    for job in jobs.values():
        assert job["parent"] in jobs or job["parent"] in EXTERNAL_PARENTS
        assert job["description"].strip()


def test_pipelines_run_only_jobs_defined_here():
    jobs, projects = load_zuul()
    assert len(projects) == 1
    for pipeline in ("check", "gate"):
        listed = projects[0][pipeline]["jobs"]
        assert set(listed) == set(JOBS + TOX_JOBS), pipeline
    assert projects[0]["templates"] == TEMPLATES


def test_tox_jobs_run_environments_tox_ini_defines():
    """The templates' jobs run tox -e pep8, pyXY, docs, releasenotes; ours functional."""
    jobs, _ = load_zuul()
    defined = set(re.findall(r"^\[testenv:([a-z0-9]+)\]", TOX_INI.read_text(), re.MULTILINE))
    assert {"pep8", "py3", "docs", "releasenotes", "functional", "genconfig"} <= defined
    for name in TOX_JOBS:
        assert jobs[name]["vars"]["tox_envlist"] in defined
        run = yaml.safe_load((REPO / jobs[name]["run"]).read_text())
        command = run[0]["tasks"][0]["command"]
        assert command.endswith(f"-e {jobs[name]['vars']['tox_envlist']}")
        assert run[0]["tasks"][0]["become"] is True  # the lab needs root


def test_test_command_runs_environments_tox_ini_defines():
    """tools/test.sh (the README's test command, .ci/run's) runs its stages through tox."""
    defined = set(re.findall(r"^\[testenv:([a-z0-9]+)\]", TOX_INI.read_text(), re.MULTILINE))
    script = (REPO / "tools" / "test.sh").read_text()
    used = re.findall(r"^\s*(?:exec )?\$TOX\b.*? -e (\w+)", script, re.MULTILINE)
    assert set(used) == {"pep8", "functional"}, used
    assert set(used) <= defined
    # pytest only inside tox's environments, never from .venv directly.
    code = [line.split("#")[0] for line in script.splitlines()]
    assert not [line for line in code if "pytest" in line and "$TOX" not in line]


def test_playbooks_named_by_jobs_exist():
    jobs, _ = load_zuul()
    for job in jobs.values():
        for kind in ("pre-run", "run", "post-run"):
            playbooks = job.get(kind, [])
            for playbook in [playbooks] if isinstance(playbooks, str) else playbooks:
                assert (REPO / playbook).is_file(), playbook


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", JOBS)
def test_every_node_enables_the_plugin_its_services_and_the_shared_key(name, role):
    jobs, _ = load_zuul()
    variables = node_vars(jobs, name, role)
    assert variables["devstack_plugins"] == {"flexmig": PLUGIN_URL}
    services = variables["devstack_services"]
    assert services["flexmig-agent"] is True
    # OVN manages br-int in these jobs: the plugin would refuse flexmig-offload.
    assert services.get("flexmig-offload") is not True
    localrc = variables["devstack_localrc"]
    assert localrc["FLEXMIG_AGENT_KEY_SOURCE"] == gate_key_path()
    assert localrc["FLEXMIG_AGENT_KEY_GENERATE"] is False


def test_split_job_allows_split_on_both_nodes_and_the_base_job_does_not():
    jobs, _ = load_zuul()
    for role in ROLES:
        base = node_vars(jobs, "flexmig-live-migration", role)["devstack_localrc"]
        split = node_vars(jobs, "flexmig-live-migration-split", role)["devstack_localrc"]
        assert "split" not in base["FLEXMIG_ALLOWED_MODES"].split(",")
        assert "split" in split["FLEXMIG_ALLOWED_MODES"].split(",")


def test_job_settings_are_plugin_settings():
    settings = (REPO / "devstack" / "settings").read_text()
    known = set(re.findall(r"^(FLEXMIG_\w+)=", settings, re.MULTILINE))
    jobs, _ = load_zuul()
    for name in JOBS:
        for role in ROLES:
            used = {k for k in node_vars(jobs, name, role)["devstack_localrc"] if "FLEXMIG" in k}
            assert used <= known, (name, role, used - known)


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", JOBS)
def test_each_node_of_each_job_stacks_with_its_settings(tmp_path: Path, name, role):
    jobs, _ = load_zuul()
    variables = node_vars(jobs, name, role)
    key = tmp_path / "gate-agent.key"
    key.write_text("5e" * 32)
    key.chmod(0o600)
    stack = make_stack(tmp_path / "node")
    # What these jobs run on each node (devstack's and Nova's jobs): nova-compute
    # beside OVN on br-int.
    stack.env["ENABLED_SERVICES"] = "n-cpu,placement-client,ovn-controller,ovs-vswitchd,q-ovn-agent"
    if role == "controller":
        stack.env["ENABLED_SERVICES"] += ",key,n-api,n-cond,n-sch,placement-api,q-svc,ovn-northd"
    stack.run(
        "stack:install",
        "stack:post-config",
        "stack:extra",
        localrc=localrc_lines(variables, key),
    )
    localrc = variables["devstack_localrc"]
    nova = ini(stack.path("NOVA_CONF"))
    assert nova["migration"]["allowed_modes"] == localrc["FLEXMIG_ALLOWED_MODES"]
    assert nova["migration"]["max_downtime_ms"] == str(localrc["FLEXMIG_MAX_DOWNTIME_MS"])
    conf_dir = stack.path("FLEXMIG_CONF_DIR")
    assert (conf_dir / "agent.key").read_text() == "5e" * 32 + "\n"
    budget = str(localrc.get("FLEXMIG_AGENT_MEMORY_BUDGET_MB", 0))
    assert ini(conf_dir / "agent.conf")["agent"]["memory_budget_mb"] == budget
    started = [call[0] for call in stack.calls("run_process")]
    assert started == ["flexmig-agent"]


def test_tempest_regex_selects_the_live_migration_tests():
    jobs, _ = load_zuul()
    regex = re.compile(
        node_vars(jobs, "flexmig-live-migration", "controller")["tempest_test_regex"]
    )
    assert regex.search(
        "tempest.api.compute.admin.test_live_migration.LiveMigrationTest.test_live_block_migration"
    )
    assert regex.search(
        "tempest.scenario.test_network_advanced_server_ops.TestNetworkAdvancedServerOps."
        "test_server_connectivity_live_migration"
    )
    assert not regex.search("tempest.api.compute.servers.test_create_server.ServersTestJSON")


def test_the_key_never_reaches_the_logs():
    jobs, _ = load_zuul()
    copied = node_vars(jobs, "flexmig-live-migration", "controller")["zuul_copy_output"]
    assert not any(
        path.rstrip("/") in ("/etc/flexmig", "/opt/stack/flexmig-gate") for path in copied
    )
    assert not any(path.endswith(".key") for path in copied)
    tasks = yaml.safe_load(PRE_RUN.read_text())[0]["tasks"]
    for task in tasks:
        if "slurp" in task or "copy" in task:
            assert task.get("no_log") is True, task["name"]


def tempest_guest_decision(budget_mib: int, ram_mib: int) -> str:
    """The mode FlexMig's policy picks for a quiet tempest guest towards an empty node."""
    mib = 2**20
    inputs = decision.MigrationInputs(
        vm="tempest-server",
        ram_bytes=ram_mib * mib,
        resident_bytes=ram_mib * mib // 2,
        dirty=DirtyModel(m_pages=200, tau_s=1.0),
        bandwidth_bps=100 * mib,
        dest_free_bytes=budget_mib * mib,
        dest_store_free_bytes=10 * 1024 * mib,
        file_backed=True,
        max_downtime_ms=500,
    )
    return decision.decide(inputs).mode


@pytest.mark.parametrize("ram_mib", [128, 192])  # tempest's flavor_ref and flavor_ref_alt
def test_split_jobs_budget_makes_tempest_guests_go_split(ram_mib):
    jobs, _ = load_zuul()
    for role in ROLES:
        localrc = node_vars(jobs, "flexmig-live-migration-split", role)["devstack_localrc"]
        assert tempest_guest_decision(localrc["FLEXMIG_AGENT_MEMORY_BUDGET_MB"], ram_mib) == "split"
    # The same guest towards a node with the RAM goes precopy.
    assert tempest_guest_decision(8192, ram_mib) == "precopy"


def test_pre_run_generates_a_private_key_the_plugin_accepts(tmp_path: Path):
    tasks = yaml.safe_load(PRE_RUN.read_text())[0]["tasks"]
    generate = next(t for t in tasks if t["name"] == "Generate the key on the controller")
    key = tmp_path / "agent.key"
    script = generate["shell"].replace("{{ flexmig_gate_key }}", str(key))
    subprocess.run(["bash", "-c", script], check=True, timeout=30)
    assert re.fullmatch("[0-9a-f]{64}", key.read_text())
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    stack = make_stack(tmp_path / "node")
    stack.run("stack:post-config", localrc=f"FLEXMIG_AGENT_KEY_SOURCE={key}")
    assert (stack.path("FLEXMIG_CONF_DIR") / "agent.key").read_text() == key.read_text() + "\n"
