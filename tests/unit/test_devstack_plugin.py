"""The DevStack plugin's real plugin.sh phases, under bash, against a stand-in for DevStack.

DevStack itself cannot run here.  ``tests/devstack_standin/functions`` implements
the DevStack functions the plugin calls with DevStack's semantics, acting on a
temporary tree (DEST, /etc/nova, qemu.conf, ...) and logging what would touch
the host (run_process, sudo, restart_service).  Each phase runs in its own bash
process, as stack.sh/unstack.sh/clean.sh source the plugin in separate runs.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import os
import re
import socket
import ssl
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from oslo_config import cfg

from agents.agent import auth, listener
from agents.agent import config as agent_config
from tests.devstack_standin.node import (
    NOVA_CONF,
    QEMU_CONF,
    REPO,
    SERVICES,
    Stack,
    ini,
    make_stack,
)


@pytest.fixture
def stack(tmp_path: Path) -> Stack:
    return make_stack(tmp_path)


def conf_dir(stack: Stack) -> Path:
    return stack.path("FLEXMIG_CONF_DIR")


def mem_total_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no MemTotal")


# -- install ------------------------------------------------------------------


def test_install_installs_flexmig_and_builds_the_mover_and_writes_no_config(stack):
    before = stack.snapshot()
    stack.run("stack:install")
    checkout = stack.path("DEST") / "flexmig"
    assert stack.calls("setup_develop") == [[str(checkout), ""]]
    assert (checkout / "agents" / "mover" / "build" / "flexmig-mover").exists()
    after = stack.snapshot()
    assert after.pop("opt/stack/flexmig/agents/mover/build/flexmig-mover") == b""
    assert after == before
    assert not conf_dir(stack).exists()


# -- post-config --------------------------------------------------------------


def test_post_config_points_nova_at_flexmig_with_every_option(stack):
    stack.run("stack:install", "stack:post-config")
    nova = ini(stack.path("NOVA_CONF"))
    assert nova["DEFAULT"]["compute_driver"] == "flexmig.FlexMigLibvirtDriver"
    assert dict(nova["flexmig"]) == {
        "agent_port": "9797",
        "agent_key_file": str(conf_dir(stack) / "agent.key"),
        "agent_timeout": "30",
    }
    assert dict(nova["migration"]) == {
        "max_downtime_ms": "300",
        "allowed_modes": "precopy,postcopy,split",
        "dirty_sample_seconds": "1,2,3",
    }
    # Split: file-backed memory (Nova needs no RAM overcommit for it); postcopy.
    assert nova["libvirt"]["file_backed_memory"] == str(mem_total_mib())
    assert nova["DEFAULT"]["ram_allocation_ratio"] == "1.0"
    assert nova["libvirt"]["live_migration_permit_post_copy"] == "True"
    # What DevStack wrote stays.
    assert nova["DEFAULT"]["my_ip"] == "10.0.0.11"
    assert nova["libvirt"]["live_migration_uri"] == "qemu+ssh://stack@%s/system"


def flexmig_nova_opts() -> list[tuple[str, list[cfg.Opt]]]:
    """The Nova driver's option groups, found as oslo-config-generator finds them."""
    for entry in importlib.metadata.entry_points(group="oslo.config.opts"):
        if entry.name == "flexmig.nova":
            return [(str(group), list(opts)) for group, opts in entry.load()()]
    pytest.skip("no oslo.config.opts entry point flexmig.nova (the Nova driver)")


def test_nova_conf_is_what_the_nova_driver_accepts(stack):
    groups = flexmig_nova_opts()
    stack.run("stack:install", "stack:post-config")
    conf = cfg.ConfigOpts()
    for group, opts in groups:
        conf.register_opts(opts, group=group)
    conf(["--config-file", str(stack.path("NOVA_CONF"))], project="flexmig-test")
    assert conf.flexmig.agent_port == 9797
    assert list(conf.migration.allowed_modes) == ["precopy", "postcopy", "split"]
    assert conf.migration.max_downtime_ms == 300
    assert float(conf.flexmig.agent_timeout) == 30


def test_ipv6_only_devstack_agent_listens_on_host_ipv6(stack):
    stack.env.pop("HOST_IP")
    stack.run("stack:post-config", localrc="HOST_IPV6=fd00::11")
    assert ini(conf_dir(stack) / "agent.conf")["agent"]["listen_address"] == "fd00::11"


def test_post_config_writes_an_agent_config_the_agent_accepts(stack):
    stack.run("stack:install", "stack:post-config")
    conf = cfg.ConfigOpts()
    agent_config.register_opts(conf)
    conf(["--config-file", str(conf_dir(stack) / "agent.conf")], project="flexmig-test")
    assert conf.agent.listen_address == "10.0.0.11"
    assert conf.agent.port == 9797
    assert conf.agent.key_file == str(conf_dir(stack) / "agent.key")
    assert conf.agent.store_dir == stack.env["FLEXMIG_STORE_DIR"]
    assert conf.agent.state_dir == stack.env["FLEXMIG_STATE_DIR"]
    assert conf.agent.unix_socket == stack.env["FLEXMIG_STATE_DIR"] + "/agent.sock"
    assert conf.migration.max_downtime_ms == 300
    assert list(conf.migration.allowed_modes) == ["precopy", "postcopy", "split"]
    assert conf.agent.memory_budget_mb == 0
    assert conf.agent.cgroup_parent == "flexmig"
    assert conf.agent.libvirt_uri == "qemu:///system"
    # Nova drives migrations under DevStack: the agent's own orchestration is off.
    assert conf.agent.allow_orchestration is False
    # The agent samples in the background, and Nova's driver plans from its samplings.
    assert conf.agent.dirty_sample_refresh == 25
    assert list(conf.migration.dirty_sample_seconds) == [1, 2, 3]


def test_longer_samples_reach_the_agent_and_nova_alike(stack):
    localrc = "FLEXMIG_DIRTY_SAMPLE_SECONDS=1,5,15 FLEXMIG_DIRTY_SAMPLE_REFRESH=030"
    stack.run("stack:install", "stack:post-config", localrc=localrc)
    conf = cfg.ConfigOpts()
    agent_config.register_opts(conf)
    conf(["--config-file", str(conf_dir(stack) / "agent.conf")], project="flexmig-test")
    assert (conf.agent.dirty_sample_refresh, list(conf.migration.dirty_sample_seconds)) == (
        30,
        [1, 5, 15],
    )
    assert ini(stack.path("NOVA_CONF"))["migration"]["dirty_sample_seconds"] == "1,5,15"


def _devstack_ca(stack):
    """A CA where DevStack's tls-proxy keeps its intermediate (INT_CA_DIR), and its bundle."""
    ca_dir = stack.root / "opt" / "stack" / "data" / "CA" / "int-ca"
    (ca_dir / "private").mkdir(parents=True)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/O=standin/CN=standin-int-ca", "-keyout", str(ca_dir / "private" / "cacert.key"),
         "-out", str(ca_dir / "cacert.pem")],
        check=True, capture_output=True,
    )  # fmt: skip
    bundle = stack.root / "opt" / "stack" / "data" / "ca-bundle.pem"
    bundle.write_text((ca_dir / "cacert.pem").read_text())
    stack.env |= {"INT_CA_DIR": str(ca_dir), "SSL_BUNDLE_FILE": str(bundle)}
    stack.env["ENABLED_SERVICES"] += ",tls-proxy"
    return bundle


def _handshake(server_ctx, client_ctx, name):
    """A real TLS handshake over loopback; the client checks the cert for ``name``."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        errors = []

        def serve():
            conn, _ = listening.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True):
                    pass
            except (OSError, ssl.SSLError) as exc:
                errors.append(exc)

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            with socket.create_connection(listening.getsockname(), timeout=5) as raw:
                with client_ctx.wrap_socket(raw, server_hostname=name):
                    return True
        except ssl.SSLCertVerificationError:
            return False
        finally:
            thread.join(5)


def test_agent_serves_tls_with_a_certificate_from_devstacks_ca(stack):
    bundle = _devstack_ca(stack)
    stack.run("stack:install", "stack:post-config")
    conf = cfg.ConfigOpts()
    agent_config.register_opts(conf)
    conf(["--config-file", str(conf_dir(stack) / "agent.conf")], project="flexmig-test")
    agent_config.check_tls(conf)
    assert conf.agent.tls_ca_file == str(bundle)
    key = Path(conf.agent.tls_key_file)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert ini(stack.path("NOVA_CONF"))["flexmig"]["agent_ca_file"] == str(bundle)
    server = listener.server_tls(conf.agent.tls_cert_file, conf.agent.tls_key_file)
    client = listener.client_tls(str(bundle))
    # Nova and peer agents reach the agent by its listen address: the cert names it.
    assert _handshake(server, client, "10.0.0.11")
    assert not _handshake(server, client, "10.0.0.12")
    first = Path(conf.agent.tls_cert_file).read_text()
    stack.run("stack:post-config")  # a second run keeps the certificate
    assert Path(conf.agent.tls_cert_file).read_text() == first


def test_agent_tls_needs_devstacks_ca(stack):
    before = stack.snapshot()
    proc = stack.run("stack:install", check=False, localrc="FLEXMIG_AGENT_TLS=True")
    assert proc.returncode != 0 and "enable_service tls-proxy" in proc.stderr
    assert stack.snapshot() == before


def test_agent_without_tls_proxy_serves_plain_http(stack):
    stack.run("stack:install", "stack:post-config")
    assert "tls_cert_file" not in ini(conf_dir(stack) / "agent.conf")["agent"]
    assert "agent_ca_file" not in ini(stack.path("NOVA_CONF"))["flexmig"]


def test_generated_key_is_private_to_the_stack_user_and_generated_once(stack):
    stack.run("stack:install", "stack:post-config")
    key_file = conf_dir(stack) / "agent.key"
    mode = key_file.stat()
    assert stat.S_IMODE(mode.st_mode) == 0o600
    assert mode.st_uid == os.getuid()
    key = auth.load_key(str(key_file))
    assert len(key) == 64 and int(key, 16) >= 0
    stack.run("stack:post-config")
    assert auth.load_key(str(key_file)) == key


def test_key_from_a_distributed_file_is_the_same_on_every_node(stack, tmp_path):
    source = tmp_path / "gate-agent.key"
    source.write_text("0123456789abcdef0123456789abcdef\n")
    source.chmod(0o600)
    stack.env["FLEXMIG_AGENT_KEY_SOURCE"] = str(source)
    stack.run("stack:install", "stack:post-config")
    key_file = conf_dir(stack) / "agent.key"
    assert key_file.read_text() == "0123456789abcdef0123456789abcdef\n"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


def test_key_from_a_devstack_variable(stack):
    stack.run("stack:post-config", localrc="FLEXMIG_AGENT_KEY=" + "ab" * 20)
    assert (conf_dir(stack) / "agent.key").read_text() == "ab" * 20 + "\n"


def test_split_configures_libvirt_and_the_hook(stack):
    stack.run("stack:install", "stack:post-config")
    store = stack.env["FLEXMIG_STORE_DIR"]
    qemu_conf = stack.path("QEMU_CONF").read_text()
    assert qemu_conf.startswith(QEMU_CONF)
    assert f'\nmemory_backing_dir = "{store}"\n' in qemu_conf
    hook = stack.path("FLEXMIG_LIBVIRT_HOOK")
    assert stat.S_IMODE(hook.stat().st_mode) == 0o755
    text = hook.read_text()
    assert f"FLEXMIG_STORE_DIR={store}" in text
    assert f"FLEXMIG_STATE_DIR={stack.env['FLEXMIG_STATE_DIR']}" in text
    assert f'exec {sys.executable} -m agents.agent.libvirt_hook "$@"' in text
    assert Path(store).is_dir()
    assert stack.calls("restart_service") == [["libvirtd"]]


def test_split_on_cgroup_v1_leaves_systemd_alone(stack):
    stack.run("stack:install", "stack:post-config")
    assert not stack.path("FLEXMIG_MACHINE_SLICE_DROPIN").exists()
    assert not [c for c in stack.calls("sudo") if c[0] == "systemctl"]


def test_split_on_cgroup_v2_gives_the_machine_slice_the_memory_controller(stack):
    (stack.path("FLEXMIG_CGROUP_ROOT") / "cgroup.controllers").write_text("cpu io memory pids\n")
    before = stack.snapshot()
    stack.run("stack:install", "stack:post-config")
    dropin = stack.path("FLEXMIG_MACHINE_SLICE_DROPIN").read_text()
    assert "[Slice]\nMemoryAccounting=yes\n" in dropin
    systemctl = [c for c in stack.calls("sudo") if c[0] == "systemctl"]
    assert systemctl == [["systemctl", "daemon-reload"], ["systemctl", "restart", "machine.slice"]]
    stack.run("clean:")
    assert not stack.path("FLEXMIG_MACHINE_SLICE_DROPIN").exists()
    after = stack.snapshot()
    assert {k for k in after if "machine.slice" in k} == {k for k in before if "machine.slice" in k}


def test_split_on_cgroup_v2_without_memory_fails_naming_it(stack):
    (stack.path("FLEXMIG_CGROUP_ROOT") / "cgroup.controllers").write_text("cpu io pids\n")
    proc = stack.run("stack:install", "stack:post-config", check=False)
    assert proc.returncode != 0
    assert "cgroup-v2 memory controller" in proc.stdout + proc.stderr


def test_postcopy_allows_unprivileged_userfaultfd(stack):
    stack.run("stack:install", "stack:post-config")
    assert ["sysctl", "-w", "vm.unprivileged_userfaultfd=1"] in stack.calls("sudo")
    assert (stack.path("STANDIN_STATE") / "vm.unprivileged_userfaultfd").read_text() == "1\n"
    assert "vm.unprivileged_userfaultfd = 1" in stack.path("FLEXMIG_SYSCTL_FILE").read_text()


def test_post_config_writes_offload_config_and_policy(stack):
    stack.run("stack:install", "stack:post-config")
    offload = ini(conf_dir(stack) / "offload.conf")
    policy = conf_dir(stack) / "offload-policy.yaml"
    assert dict(offload["offload"]) == {
        "provider": "xdp",
        "policy_file": str(policy),
        "bridge": "br-int",
        "configure_bridge": "True",
        "vm_port_patterns": "tap[0-9a-f]{8}-[0-9a-f]{2}",
        "uplinks": "",
        "stats_endpoint": "/var/run/openvswitch/br-int-offload.mgmt",
        "status_file": stack.env["FLEXMIG_STATE_DIR"] + "/offload-status.json",
        "control_key_file": str(conf_dir(stack) / "agent.key"),
        "pipeline": "standalone",
    }
    example = REPO / "devstack" / "files" / "offload-policy.example.yaml"
    assert policy.read_text() == example.read_text()


def test_offload_config_and_policy_are_what_the_offload_service_accepts(stack):
    offload_config = pytest.importorskip(
        "ovs_ext.config", reason="ovs_ext.config (the OVS extension, branch ovs) not here yet"
    )
    policy = pytest.importorskip(
        "ovs_ext.policy", reason="ovs_ext.policy (the OVS extension, branch ovs) not here yet"
    )
    stack.run("stack:install", "stack:post-config")
    conf = cfg.ConfigOpts()
    offload_config.register_opts(conf)
    conf(["--config-file", str(conf_dir(stack) / "offload.conf")], project="flexmig-test")
    assert conf.offload.provider == "xdp"
    assert conf.offload.vm_port_patterns == ["tap[0-9a-f]{8}-[0-9a-f]{2}"]
    assert re.fullmatch(conf.offload.vm_port_patterns[0], "tap5f4bd1b6-0e")
    assert conf.offload.uplinks == []
    loaded = policy.load_policy(conf.offload.policy_file)
    assert loaded.capacity == 1024 and loaded.header_rules


def test_offload_is_opt_in(stack):
    stack.env["ENABLED_SERVICES"] = SERVICES.replace(",flexmig-offload", "")
    stack.run("stack:install", "stack:post-config", "stack:extra")
    assert not (conf_dir(stack) / "offload.conf").exists()
    assert [c[0] for c in stack.calls("run_process")] == ["flexmig-agent"]


def test_offload_refuses_the_bridge_ovn_manages(stack):
    stack.env["ENABLED_SERVICES"] += ",q-svc,ovn-controller"
    before = stack.snapshot()
    proc = stack.run("stack:install", check=False)
    assert proc.returncode != 0
    assert "cannot run on br-int, which ovn-controller manages" in proc.stderr
    assert stack.snapshot() == before


@pytest.mark.parametrize(
    ("services", "localrc", "error"),
    [
        (",q-svc,q-agt", "FLEXMIG_OFFLOAD_PIPELINE=standalone", "Neutron's OVS agent manages"),
        ("", "FLEXMIG_OFFLOAD_PIPELINE=neutron", "needs Neutron's OVS agent"),
        (",q-agt", "FLEXMIG_OFFLOAD_PIPELINE=ovs", "must be standalone or neutron"),
    ],
)
def test_offload_pipeline_refused_where_it_cannot_run(stack, services, localrc, error):
    stack.env["ENABLED_SERVICES"] += services
    before = stack.snapshot()
    proc = stack.run("stack:install", check=False, localrc=localrc)
    assert proc.returncode != 0 and error in proc.stderr, proc.stderr
    assert stack.snapshot() == before


@pytest.mark.parametrize("agent", ["q-agt", "neutron-agent"])
def test_offload_beside_neutrons_ovs_agent_loads_the_extension(stack, agent, tmp_path):
    agent_conf = tmp_path / "etc" / "neutron" / "ml2_conf.ini"
    agent_conf.parent.mkdir(parents=True)
    agent_conf.write_text("[agent]\nextensions = qos\n")
    stack.env["ENABLED_SERVICES"] += f",q-svc,{agent}"
    stack.env["NEUTRON_CORE_PLUGIN_CONF"] = str(agent_conf)
    stack.run("stack:install", "stack:post-config")
    ports_file = stack.env["FLEXMIG_STATE_DIR"] + "/neutron/ports.json"
    offload = ini(conf_dir(stack) / "offload.conf")["offload"]
    assert (offload["pipeline"], offload["neutron_ports_file"]) == ("neutron", ports_file)
    neutron_agent = ini(agent_conf)
    assert neutron_agent["agent"]["extensions"] == "qos,flexmig_offload"
    assert neutron_agent["flexmig_offload"]["ports_file"] == ports_file
    stack.run("stack:post-config")  # a second run adds it once
    assert ini(agent_conf)["agent"]["extensions"] == "qos,flexmig_offload"
    # What the offload service and the extension accept.
    conf = cfg.ConfigOpts()
    offload_config = pytest.importorskip("ovs_ext.config")
    offload_config.register_opts(conf)
    conf(["--config-file", str(conf_dir(stack) / "offload.conf")], project="flexmig-test")
    assert conf.offload.pipeline == "neutron"


def test_offload_beside_neutron_when_the_operator_connects_the_bridge(stack):
    stack.env["ENABLED_SERVICES"] += ",q-svc,ovn-controller"
    stack.run("stack:install", "stack:post-config", localrc="FLEXMIG_OFFLOAD_CONFIGURE_BRIDGE=no")
    offload = ini(conf_dir(stack) / "offload.conf")
    assert offload["offload"]["configure_bridge"] == "False"


def test_second_post_config_changes_nothing(stack):
    stack.run("stack:install", "stack:post-config")
    first = stack.snapshot()
    stack.run("stack:post-config")
    assert stack.snapshot() == first


def test_only_the_allowed_modes_touch_libvirt_and_the_kernel(stack):
    stack.run("stack:install", "stack:post-config", localrc="FLEXMIG_ALLOWED_MODES=precopy")
    nova = ini(stack.path("NOVA_CONF"))
    assert nova["migration"]["allowed_modes"] == "precopy"
    assert not nova.has_option("libvirt", "file_backed_memory")
    assert not nova.has_option("libvirt", "live_migration_permit_post_copy")
    assert stack.path("QEMU_CONF").read_text() == QEMU_CONF
    assert not stack.path("FLEXMIG_LIBVIRT_HOOK").exists()
    assert not stack.path("FLEXMIG_SYSCTL_FILE").exists()
    assert stack.calls("restart_service") == []


def test_node_without_nova_compute_gets_no_agent_and_no_nova_changes(stack):
    stack.env["ENABLED_SERVICES"] = "key,n-api,n-sch,placement-api,ovs-vswitchd,flexmig-offload"
    stack.run("stack:install", "stack:post-config", "stack:extra")
    assert stack.path("NOVA_CONF").read_text() == NOVA_CONF
    assert not (conf_dir(stack) / "agent.conf").exists()
    assert [c[0] for c in stack.calls("run_process")] == ["flexmig-offload"]


def test_disabled_offload_is_neither_configured_nor_started(stack):
    stack.run(
        "stack:install",
        "stack:post-config",
        "stack:extra",
        localrc="disable_service flexmig-offload",
    )
    assert not (conf_dir(stack) / "offload.conf").exists()
    assert [c[0] for c in stack.calls("run_process")] == ["flexmig-agent"]


# -- extra, unstack, clean ----------------------------------------------------


def test_extra_starts_agent_and_offload_with_their_configs(stack):
    stack.run("stack:install", "stack:post-config", "stack:extra")
    bin_dir = Path(stack.env["DEVSTACK_VENV"]) / "bin"
    assert stack.calls("run_process") == [
        [
            "flexmig-agent",
            f"{bin_dir}/flexmig-agent --config-file {conf_dir(stack)}/agent.conf",
            "",
            "root",
        ],
        [
            "flexmig-offload",
            f"{bin_dir}/flexmig-offload --config-file {conf_dir(stack)}/offload.conf",
            "",
            "root",
        ],
    ]
    unit = ini(stack.root / "systemd" / "devstack@flexmig-agent.service")
    assert unit["Service"]["User"] == "root"
    assert stack.path("FLEXMIG_STATE_DIR").is_dir()


def test_unstack_stops_what_extra_started(stack):
    stack.run("stack:install", "stack:post-config", "stack:extra")
    stack.run("unstack:")
    assert stack.calls("stop_process") == [["flexmig-agent"], ["flexmig-offload"]]
    assert not list(stack.path("STANDIN_STATE").glob("*.started"))


def test_clean_removes_everything_install_and_post_config_created(stack):
    before = stack.snapshot()
    stack.run("stack:install", "stack:post-config", "stack:extra")
    stack.run("unstack:")
    stack.run("clean:")
    after = stack.snapshot()
    nova_after = ini(stack.path("NOVA_CONF"))
    nova_before = configparser.RawConfigParser(default_section="no default section")
    nova_before.read_string(NOVA_CONF)
    assert {s: dict(nova_after[s]) for s in nova_after.sections()} == {
        s: dict(nova_before[s]) for s in nova_before.sections()
    }
    del before["etc/nova/nova.conf"], after["etc/nova/nova.conf"]
    # The systemd unit is DevStack's to remove (clean.sh deletes devstack@*).
    after.pop("systemd/devstack@flexmig-agent.service")
    after.pop("systemd/devstack@flexmig-offload.service")
    assert after == before
    for created in ("FLEXMIG_CONF_DIR", "FLEXMIG_STATE_DIR", "FLEXMIG_STORE_DIR"):
        assert not stack.path(created).exists(), created
    assert not (stack.path("DATA_DIR") / "flexmig").exists()
    assert stack.calls("pip_uninstall") == [["flexmig"]]


def test_clean_keeps_a_store_directory_it_did_not_create(stack):
    store = stack.path("FLEXMIG_STORE_DIR")
    store.mkdir(parents=True)
    (store / "other-vm.ram").write_text("x")
    stack.run("stack:install", "stack:post-config")
    stack.run("clean:")
    assert (store / "other-vm.ram").read_text() == "x"


def test_all_stack_phases_in_one_process_as_stack_sh_runs_them(stack):
    stack.run(
        "stack:pre-install",
        "stack:install",
        "stack:post-config",
        "stack:extra",
        "stack:test-config",
    )
    assert [c[0] for c in stack.calls("run_process")] == ["flexmig-agent", "flexmig-offload"]
    assert ini(stack.path("NOVA_CONF"))["migration"]["allowed_modes"] == "precopy,postcopy,split"


# -- bad settings ---------------------------------------------------------------

BAD_SETTINGS = [
    ("FLEXMIG_MAX_DOWNTIME_MS=abc", "FLEXMIG_MAX_DOWNTIME_MS='abc'"),
    ("FLEXMIG_MAX_DOWNTIME_MS=0", "FLEXMIG_MAX_DOWNTIME_MS='0'"),
    ("FLEXMIG_ALLOWED_MODES=precopy,turbo", "'turbo' is not a migration mode"),
    ("FLEXMIG_ALLOWED_MODES=precopy,precopy", "'precopy' is listed twice"),
    ("FLEXMIG_ALLOWED_MODES=,", "'' is not a migration mode"),
    ("FLEXMIG_AGENT_PORT=70000", "FLEXMIG_AGENT_PORT='70000'"),
    ("FLEXMIG_AGENT_TIMEOUT=0", "FLEXMIG_AGENT_TIMEOUT='0'"),
    ("FLEXMIG_OFFLOAD_PROVIDER=dpdk", "FLEXMIG_OFFLOAD_PROVIDER='dpdk'"),
    ("FLEXMIG_FILE_BACKED_MEMORY_MB=lots", "FLEXMIG_FILE_BACKED_MEMORY_MB='lots'"),
    ("FLEXMIG_AGENT_KEY=short", "FLEXMIG_AGENT_KEY: must be at least 32 hex digits"),
    ("FLEXMIG_AGENT_KEY_SOURCE=/nonexistent/key", "FLEXMIG_AGENT_KEY_SOURCE='/nonexistent/key'"),
    ("FLEXMIG_AGENT_KEY_GENERATE=False", "no agent key"),
    ("HOST_IP=", "FLEXMIG_AGENT_LISTEN_ADDRESS=''"),
    ("FLEXMIG_AGENT_LISTEN_ADDRESS=0.0.0.0/0", "FLEXMIG_AGENT_LISTEN_ADDRESS='0.0.0.0/0'"),
    ("FLEXMIG_AGENT_LISTEN_ADDRESS=0.0.0.0", "never on all addresses"),
    ("FLEXMIG_AGENT_LISTEN_ADDRESS=::", "never on all addresses"),
    ("FLEXMIG_STORE_DIR=relative/store", "FLEXMIG_STORE_DIR='relative/store'"),
    ("FLEXMIG_OFFLOAD_UPLINKS='eth0 eth1'", "FLEXMIG_OFFLOAD_UPLINKS='eth0 eth1'"),
    ("FLEXMIG_OFFLOAD_BRIDGE=br-int-is-too-long", "FLEXMIG_OFFLOAD_BRIDGE='br-int-is-too-long'"),
    ("FLEXMIG_DIRTY_SAMPLE_SECONDS='1 2'", "FLEXMIG_DIRTY_SAMPLE_SECONDS='1 2': comma-separated"),
    ("FLEXMIG_DIRTY_SAMPLE_SECONDS=1,45", "'45' is not from 1 to 30 seconds"),
    ("FLEXMIG_DIRTY_SAMPLE_SECONDS=2,02", "needs at least two distinct lengths"),
    ("FLEXMIG_DIRTY_SAMPLE_REFRESH=often", "FLEXMIG_DIRTY_SAMPLE_REFRESH='often'"),
    ("FLEXMIG_DIRTY_SAMPLE_REFRESH=101", "FLEXMIG_DIRTY_SAMPLE_REFRESH='101'"),
    (
        "FLEXMIG_DIRTY_SAMPLE_SECONDS=1,5,15 FLEXMIG_DIRTY_SAMPLE_REFRESH=20",
        "shorter than one sampling, the 21 s",
    ),
]


@pytest.mark.parametrize("phase", ["stack:install", "stack:post-config"])
@pytest.mark.parametrize(("localrc", "message"), BAD_SETTINGS)
def test_bad_setting_fails_clearly_before_anything_changes(stack, phase, localrc, message):
    before = stack.snapshot()
    proc = stack.run(phase, localrc=localrc, check=False)
    assert proc.returncode != 0
    assert "[ERROR]" in proc.stderr and "nothing was changed" in proc.stderr
    assert message in proc.stderr
    assert stack.snapshot() == before
    assert not any(entry[0] in ("setup_develop", "run_process") for entry in stack.log())


def test_all_bad_settings_are_reported_at_once(stack):
    proc = stack.run(
        "stack:post-config",
        localrc="FLEXMIG_AGENT_PORT=x FLEXMIG_ALLOWED_MODES=fast",
        check=False,
    )
    assert "FLEXMIG_AGENT_PORT='x'" in proc.stderr
    assert "'fast' is not a migration mode" in proc.stderr


def test_someone_elses_hook_stops_split_before_anything_changes(stack):
    hook = stack.path("FLEXMIG_LIBVIRT_HOOK")
    hook.parent.mkdir(parents=True)
    hook.write_text("#!/bin/sh\nexit 0\n")
    before = stack.snapshot()
    proc = stack.run("stack:post-config", check=False)
    assert proc.returncode != 0
    assert "exists and is not FlexMig's" in proc.stderr
    assert stack.snapshot() == before


def test_another_memory_backing_dir_stops_split_before_anything_changes(stack):
    stack.path("QEMU_CONF").write_text(QEMU_CONF + 'memory_backing_dir = "/srv/ram"\n')
    before = stack.snapshot()
    proc = stack.run("stack:post-config", check=False)
    assert proc.returncode != 0
    assert "already sets 'memory_backing_dir = \"/srv/ram\"'" in proc.stderr
    assert stack.snapshot() == before


def test_an_equal_memory_backing_dir_of_the_operator_is_kept_as_is(stack):
    own = QEMU_CONF + f'memory_backing_dir = "{stack.env["FLEXMIG_STORE_DIR"]}"\n'
    stack.path("QEMU_CONF").write_text(own)
    stack.run("stack:post-config")
    assert stack.path("QEMU_CONF").read_text() == own
    stack.run("clean:")
    assert stack.path("QEMU_CONF").read_text() == own


def test_plugin_does_nothing_when_its_services_are_disabled(stack):
    before = stack.snapshot()
    stack.run(
        "stack:install",
        "stack:post-config",
        "stack:extra",
        localrc="disable_service flexmig-agent flexmig-offload",
    )
    assert stack.snapshot() == before
    assert stack.log() == []


def test_every_setting_is_documented_with_its_default():
    settings = (REPO / "devstack" / "settings").read_text()
    defaults = re.findall(
        r"^(FLEXMIG_\w+)=(?:\$\{\1:-(.*)\}|\$\(trueorfalse (\w+) \1\))$", settings, re.MULTILINE
    )
    names = re.findall(r"^(FLEXMIG_\w+)=", settings, re.MULTILINE)
    assert len(defaults) == len(names) > 20
    readme = (REPO / "devstack" / "README.rst").read_text()
    for name, default, boolean in defaults:
        shown = (boolean or default).replace("${HOST_IP:-${HOST_IPV6:-}}", "$HOST_IP")
        assert f"``{name}`` (``{shown}``)" in readme or (
            not shown and f"``{name}`` (empty)" in readme
        ), name
