"""The lab's naming and addressing: pure functions, no I/O.

Two fabrics join the hosts, as in a real cloud: a management/migration network
(libvirt, agents, migration streams; one address per host) and a tenant network
whose host ends are ports of each host's ``br-int``.  Both live in the fabric
namespace as Linux bridges; no address ever exists outside the lab's namespaces.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import string

from agents.agent.client import DEFAULT_PORT
from flexmig import exceptions

MAX_HOSTS = 8
LAB_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,5}$")


def lab_name() -> str:
    """This lab's name (``FLEXMIG_LAB_NAME``, default ``fm``).

    Namespaces, the state directory and memory cgroups carry it, so several
    labs (say, two developers' test runs) can live on one machine; inside its
    namespaces each lab uses the same addresses.
    """
    name = os.environ.get("FLEXMIG_LAB_NAME", "fm")
    if not LAB_NAME_RE.match(name):
        raise exceptions.InvalidInput(
            what="FLEXMIG_LAB_NAME", reason=f"{name!r} is not 1-6 lowercase letters/digits"
        )
    return name


def _suffix() -> str:
    return "" if lab_name() == "fm" else "-" + lab_name()


def cgroup_parent() -> str:
    """The memory-cgroup directory of this lab's split-mode groups."""
    return "flexmig" + _suffix()


def default_state_dir() -> str:
    return "/var/lib/flexmig-lab" + _suffix()


NETNS_PREFIX = lab_name() + "-"
FABRIC_NETNS = NETNS_PREFIX + "fabric"
MGMT_NET = ipaddress.IPv4Network("10.250.0.0/24")
TENANT_NET = ipaddress.IPv4Network("10.251.0.0/24")
MGMT_BRIDGE = "br-mgmt"
TENANT_BRIDGE = "br-tenant"
HOST_MGMT_IF = "mgmt0"
HOST_TENANT_IF = "phy0"
INTEGRATION_BRIDGE = "br-int"
LIBVIRT_TCP_PORT = 16509
AGENT_PORT = DEFAULT_PORT  # every lab host's flexmig-agent, on its management address
# The fabric namespace's own tenant address: a probe point for the tenant
# network (e.g. pinging a VM through its host's br-int and uplink).
TENANT_PROBE_IP = TENANT_NET.network_address + 254


@dataclasses.dataclass(frozen=True)
class HostSpec:
    name: str  # "A", "B", ...
    index: int

    @property
    def netns(self) -> str:
        return NETNS_PREFIX + self.name.lower()

    @property
    def hostname(self) -> str:
        return "lab-" + self.name.lower()

    @property
    def mgmt_ip(self) -> str:
        return str(MGMT_NET.network_address + 1 + self.index)

    @property
    def fabric_mgmt_if(self) -> str:
        return f"{self.name.lower()}-mgmt"

    @property
    def fabric_tenant_if(self) -> str:
        return f"{self.name.lower()}-tenant"

    @property
    def libvirt_uri(self) -> str:
        """The URI peers use to reach this host's libvirtd over the fabric."""
        return f"qemu+tcp://{self.mgmt_ip}/system"

    @property
    def migration_uri(self) -> str:
        return f"tcp://{self.mgmt_ip}"


def host_specs(count: int) -> list[HostSpec]:
    if not 2 <= count <= MAX_HOSTS:
        raise exceptions.InvalidInput(
            what="host count", reason=f"{count} is outside 2..{MAX_HOSTS}"
        )
    return [HostSpec(name=string.ascii_uppercase[i], index=i) for i in range(count)]


def host_by_name(specs: list[HostSpec], name: str) -> HostSpec:
    for spec in specs:
        if spec.name == name.upper():
            return spec
    known = ", ".join(s.name for s in specs)
    raise exceptions.InvalidInput(what="host", reason=f"{name!r} is not a lab host ({known})")


def tenant_ip(vm_index: int) -> str:
    """Tenant address of the n-th VM created in the lab."""
    if not 0 <= vm_index < 200:
        raise exceptions.InvalidInput(what="VM index", reason=f"{vm_index} not in 0..199")
    return str(TENANT_NET.network_address + 10 + vm_index)


def etc_hosts(count: int = MAX_HOSTS) -> str:
    """/etc/hosts for lab hosts: libvirt resolves its peers' and its own names."""
    lines = ["127.0.0.1 localhost"]
    lines += [f"{s.mgmt_ip} {s.hostname}" for s in host_specs(count)]
    return "\n".join(lines) + "\n"
