"""Configuration files for each lab host's libvirt and QEMU: pure rendering."""

from __future__ import annotations

from flexmig_lab.topology import AGENT_PORT, LIBVIRT_TCP_PORT, HostSpec


def libvirtd_conf(spec: HostSpec, host_uuid: str) -> str:
    # Plain TCP without auth is acceptable only because the management fabric
    # exists solely inside the lab's namespaces; production uses TLS (Nova's
    # live_migration_scheme) and SASL.
    return "\n".join(
        [
            "listen_tls = 0",
            "listen_tcp = 1",
            f'listen_addr = "{spec.mgmt_ip}"',
            f'tcp_port = "{LIBVIRT_TCP_PORT}"',
            'auth_tcp = "none"',
            'auth_unix_rw = "none"',
            'unix_sock_rw_perms = "0700"',
            f'host_uuid = "{host_uuid}"',
            'log_outputs = "3:file:/var/log/libvirt/libvirtd.log"',
            "keepalive_interval = 5",
            "keepalive_count = 5",
            "",
        ]
    )


def qemu_conf(spec: HostSpec, store_dir: str) -> str:
    # QEMU runs as root in the lab: no per-host libvirt-qemu user is needed and
    # userfaultfd (postcopy) needs no sysctl.  libvirt's cgroup handling is off
    # because the namespaces have no systemd; FlexMig applies the one cgroup it
    # needs (split mode's memory cap) itself.
    return "\n".join(
        [
            'user = "root"',
            'group = "root"',
            "dynamic_ownership = 0",
            'security_driver = "none"',
            "cgroup_controllers = [ ]",
            f'memory_backing_dir = "{store_dir}"',
            f'migration_address = "{spec.mgmt_ip}"',
            "migration_port_min = 49152",
            "migration_port_max = 49215",
            "",
        ]
    )


def qemu_hook(python: str, store_dir: str, cgroup_parent: str) -> str:
    """/etc/libvirt/hooks/qemu: split mode's cap on incoming QEMU processes."""
    return "\n".join(
        [
            "#!/bin/sh",
            f"export FLEXMIG_STATE_DIR=/run/flexmig FLEXMIG_STORE_DIR={store_dir}",
            f"export FLEXMIG_CGROUP_PARENT={cgroup_parent}",
            f'exec {python} -m agents.agent.libvirt_hook "$@"',
            "",
        ]
    )


def agent_conf(
    spec: HostSpec,
    key_file: str,
    store_dir: str,
    unix_socket: str,
    memory_budget_mb: int,
    cgroup_parent: str,
    dirty_sample_seconds: str = "",
    dirty_sample_refresh: str = "",
) -> str:
    """``dirty_sample_seconds`` ([migration]) and ``dirty_sample_refresh`` ([agent]):
    the options of those names, when given."""
    samples = [f"dirty_sample_seconds = {dirty_sample_seconds}"] if dirty_sample_seconds else []
    refresh = [f"dirty_sample_refresh = {dirty_sample_refresh}"] if dirty_sample_refresh else []
    return "\n".join(
        [
            "[agent]",
            f"listen_address = {spec.mgmt_ip}",
            f"port = {AGENT_PORT}",
            f"key_file = {key_file}",
            f"store_dir = {store_dir}",
            f"unix_socket = {unix_socket}",
            f"memory_budget_mb = {memory_budget_mb}",
            f"cgroup_parent = {cgroup_parent}",
            *refresh,
            # The engine's options (flexmig/migration/options.py).
            "[migration]",
            # Lab fault tests cut links on purpose: notice a dead stream sooner.
            "stall_timeout = 8",
            "recovery_timeout = 120",
            *samples,
            "",
        ]
    )
