"""The ``host`` inventory of ``flexmig explain``/``migrate``/``drain``: a real compute host.

Run on the host where the VM runs, next to its flexmig-agent, with that agent's
configuration (``/etc/flexmig/agent.conf`` by default): the deployment's key
(``[agent] key_file``), the local agent's UNIX socket or address, its port and
libvirt.  A VM is named by its libvirt domain name or its UUID (a Nova
instance's UUID is its domain's); a destination by host name or address, whose
agent listens on the same port as every agent of the deployment.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import uuid
from typing import Any

import libvirt
from oslo_config import cfg

from agents.agent import config as agent_config
from agents.agent.client import AgentClient
from flexmig import exceptions, hypervisor

DEFAULT_CONFIG_FILES = ("/etc/flexmig/agent.conf",)
AGENT_TIMEOUT_S = 60.0
CLI_GROUP = "cli"

cli_opts = [
    cfg.StrOpt(
        "peer_libvirt_uri",
        default="qemu+tcp://%(address)s/system",
        help="How this host's libvirt reaches a destination's libvirtd; %(address)s "
        "is the destination's address (Nova's [libvirt] live_migration_uri).",
    ),
    cfg.StrOpt(
        "peer_migration_uri",
        default="tcp://%(address)s",
        help="Where the migration stream goes; %(address)s is the destination's "
        "address (Nova's [libvirt] live_migration_inbound_addr).",
    ),
    cfg.ListOpt(
        "peers",
        default=[],
        help="Other hosts (names or addresses) whose agents a drain may move VMs to.",
    ),
]


def list_opts() -> list[tuple[str, list[cfg.Opt]]]:
    return [(CLI_GROUP, cli_opts)]


def load_conf(config_files: list[str]) -> cfg.ConfigOpts:
    """The agent's options from its config file(s); a missing file is an error."""
    files = list(config_files) or list(DEFAULT_CONFIG_FILES)
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise exceptions.InvalidInput(
            what="configuration",
            reason=f"{', '.join(missing)} not found (the agent's config: --config-file)",
        )
    conf = cfg.ConfigOpts()
    conf.register_opts(agent_config.agent_opts, group="agent")
    conf.register_opts(cli_opts, group=CLI_GROUP)
    try:
        conf([], project="flexmig", default_config_files=files)
        agent = conf.agent
        _ = (agent.listen_address, agent.port, agent.key_file, agent.libvirt_uri)
    except (cfg.Error, ValueError) as exc:
        raise exceptions.InvalidInput(what="configuration", reason=str(exc)) from exc
    return conf


def resolve_address(host: str) -> str:
    """A host name or address as an IPv4/IPv6 address string."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise exceptions.InvalidInput(
            what="destination", reason=f"{host!r} does not resolve ({exc})"
        ) from exc
    return str(infos[0][4][0])


class HostInventory:
    """VMs on this host's libvirt; agents reached with the deployment's key."""

    def __init__(self, config_files: list[str] | None = None) -> None:
        self.conf = load_conf(config_files or [])
        agent = self.conf.agent
        try:
            with open(agent.key_file, "rb") as f:
                self.key = f.read().strip()
        except OSError as exc:
            raise exceptions.InvalidInput(
                what="agent key", reason=f"cannot read {agent.key_file}: {exc.strerror}"
            ) from exc
        self.local = str(agent.listen_address)

    # -- the inventory (flexmig.migrate_cli.Inventory) ---------------------------
    def host_names(self) -> list[str]:
        return [self.local, *(resolve_address(p) for p in self.conf.cli.peers)]

    def domain(self, vm: str) -> str:
        """The libvirt domain name of ``vm`` (a domain name or a UUID)."""
        return self._lookup(vm)[0]

    def vm_host(self, vm: str) -> str | None:
        """This host if the VM runs here; None if it does not (or is not here at all)."""
        try:
            _name, active = self._lookup(vm)
        except exceptions.InvalidInput:
            return None  # e.g. migrated away: the source keeps no definition
        return self.local if active else None

    def agent(self, host: str) -> AgentClient:
        agent = self.conf.agent
        if host == self.local and agent.unix_socket and os.path.exists(agent.unix_socket):
            return AgentClient(agent.unix_socket, 0, self.key, timeout=AGENT_TIMEOUT_S)
        return AgentClient(host, agent.port, self.key, timeout=AGENT_TIMEOUT_S)

    def destination(self, to: str) -> tuple[str, dict[str, Any]]:
        address = resolve_address(to)
        uri_address = f"[{address}]" if ":" in address else address
        cli = self.conf.cli
        return address, {
            "address": address,
            "port": self.conf.agent.port,
            "libvirt_uri": cli.peer_libvirt_uri % {"address": uri_address},
            "migration_uri": cli.peer_migration_uri % {"address": uri_address},
        }

    def guest(self, vm: str) -> None:
        """No probe inside a real guest: its owner's, not the operator's."""
        return None

    def _lookup(self, vm: str) -> tuple[str, bool]:
        uri = self.conf.agent.libvirt_uri
        try:
            conn = libvirt.openReadOnly(uri)
        except libvirt.libvirtError as exc:
            raise exceptions.HypervisorError(
                host=self.local, action=f"connect to {uri}", reason=exc.get_error_message()
            ) from exc
        try:
            with hypervisor.wrap_errors(self.local, f"look up {vm}"):
                try:
                    dom = (
                        conn.lookupByUUIDString(str(uuid.UUID(vm)))
                        if _is_uuid(vm)
                        else conn.lookupByName(vm)
                    )
                except libvirt.libvirtError as exc:
                    if exc.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                        raise
                    raise exceptions.InvalidInput(
                        what="VM", reason=f"no domain {vm!r} on this host ({uri})"
                    ) from exc
                return dom.name(), bool(dom.isActive())
        finally:
            conn.close()


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True
