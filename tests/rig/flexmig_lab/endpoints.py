"""Light traffic endpoints: a namespace with a veth whose peer is a br-int port.

A TCG guest cannot push more than a few hundred Mbit/s; an endpoint can push
what the host can, so benchmarks measure the switch, not the guest.  An
endpoint looks to br-int like a VM port: a veth ``ep-<name>`` in the host's
``br-int``, its peer ``eth0`` in the namespace ``<lab>-ep-<name>`` with a
tenant address.  The namespace name starts with the lab's prefix, so
``flexmig-lab down`` removes it with everything else.

Both ends have ``tx off``: OVS's userspace datapath does not complete the
checksums veth leaves to offload.  ``eth0`` and the host's fabric-side uplink
peer get the eSwitch's XDP_PASS program so frames the XDP fast path redirects
into a veth are received (a veth peer only has the ring for them while it has
an XDP program), and ``eth0`` is polled by a threaded NAPI.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from pathlib import Path

from flexmig import exceptions, processutil
from flexmig_lab import fabric, netns, topology
from flexmig_lab.lab import Lab

NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")
ENDPOINT_IF = "eth0"
# VMs take .10 + index (0..199, see topology.tenant_ip); the probe is .254.
FIRST_ENDPOINT_HOST = 210
LAST_ENDPOINT_HOST = 253
MAX_ENDPOINTS = LAST_ENDPOINT_HOST - FIRST_ENDPOINT_HOST + 1


@dataclasses.dataclass(frozen=True)
class Endpoint:
    name: str
    host: str  # lab host name, "A"
    ip: str

    @property
    def netns(self) -> str:
        return endpoint_netns(self.name)

    @property
    def port(self) -> str:
        """The br-int port (host side of the veth)."""
        return endpoint_port(self.name)


def check_name(name: str) -> str:
    """
    >>> check_name("ep1")
    'ep1'
    >>> check_name("Ep 1")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    flexmig.exceptions.InvalidInput: Invalid endpoint name: 'Ep 1' is not 1-12 lowercase ...
    """
    if not NAME_RE.match(name):
        raise exceptions.InvalidInput(
            what="endpoint name",
            reason=f"{name!r} is not 1-12 lowercase letters/digits starting with a letter",
        )
    return name


def endpoint_netns(name: str) -> str:
    """
    >>> endpoint_netns("ep1").endswith("-ep-ep1")
    True
    """
    return f"{topology.NETNS_PREFIX}ep-{check_name(name)}"


def endpoint_port(name: str) -> str:
    """The br-int port name, within IFNAMSIZ.

    >>> endpoint_port("abcdefghijkl")
    'ep-abcdefghijkl'
    """
    return f"ep-{check_name(name)}"


def endpoint_ip(index: int) -> str:
    """The n-th endpoint's tenant address, after the VMs' range.

    >>> endpoint_ip(0)
    '10.251.0.210'
    >>> endpoint_ip(43)
    '10.251.0.253'
    """
    if not 0 <= index < MAX_ENDPOINTS:
        raise exceptions.InvalidInput(
            what="endpoint index", reason=f"{index} not in 0..{MAX_ENDPOINTS - 1}"
        )
    return str(topology.TENANT_NET.network_address + FIRST_ENDPOINT_HOST + index)


def check_ip(ip: str) -> str:
    """An explicit endpoint address: in the tenant network, outside VMs' and the probe's.

    >>> check_ip("10.251.0.220")
    '10.251.0.220'
    >>> check_ip("10.251.0.15")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    flexmig.exceptions.InvalidInput: Invalid endpoint address: 10.251.0.15 is not in ...
    """
    try:
        addr = ipaddress.IPv4Address(ip)
    except ValueError as exc:
        raise exceptions.InvalidInput(what="endpoint address", reason=str(exc)) from exc
    first, last = endpoint_ip(0), endpoint_ip(MAX_ENDPOINTS - 1)
    if not ipaddress.IPv4Address(first) <= addr <= ipaddress.IPv4Address(last):
        raise exceptions.InvalidInput(
            what="endpoint address",
            reason=f"{ip} is not in {first}-{last} (VMs use .10-.209, the probe .254)",
        )
    return str(addr)


def next_free_ip(used: set[str]) -> str:
    """
    >>> next_free_ip({"10.251.0.210"})
    '10.251.0.211'
    """
    for index in range(MAX_ENDPOINTS):
        candidate = endpoint_ip(index)
        if candidate not in used:
            return candidate
    raise exceptions.InvalidInput(
        what="endpoint", reason=f"all {MAX_ENDPOINTS} endpoint addresses are in use"
    )


# -- I/O ----------------------------------------------------------------------
def _state_dir(lab: Lab) -> Path:
    return lab.dir / "endpoints"


def list_endpoints(lab: Lab) -> list[Endpoint]:
    directory = _state_dir(lab)
    if not directory.is_dir():
        return []
    return [Endpoint(**json.loads(p.read_text())) for p in sorted(directory.glob("*.json"))]


def get(lab: Lab, name: str) -> Endpoint:
    path = _state_dir(lab) / f"{check_name(name)}.json"
    if not path.exists():
        raise exceptions.InvalidInput(what="endpoint", reason=f"{name!r} does not exist")
    return Endpoint(**json.loads(path.read_text()))


def add(lab: Lab, host_name: str, name: str, ip: str | None = None) -> Endpoint:
    """Create an endpoint on a host; all input is checked before anything is made."""
    check_name(name)
    if ip is not None:
        check_ip(ip)
    host = lab.host(host_name)
    existing = list_endpoints(lab)
    if any(e.name == check_name(name) for e in existing):
        raise exceptions.InvalidInput(what="endpoint", reason=f"{name!r} already exists")
    used = {e.ip for e in existing}
    if ip is not None and check_ip(ip) in used:
        raise exceptions.InvalidInput(what="endpoint address", reason=f"{ip} is in use")
    endpoint = Endpoint(name=name, host=host.name, ip=ip or next_free_ip(used))
    _state_dir(lab).mkdir(parents=True, exist_ok=True)
    try:
        _plumb(host.spec, endpoint)
        host.ovs_vsctl("--may-exist", "add-port", topology.INTEGRATION_BRIDGE, endpoint.port)
        prepare_uplink(host.spec)
    except exceptions.FlexMigError:
        _unplumb(lab, endpoint)
        raise
    (_state_dir(lab) / f"{name}.json").write_text(json.dumps(dataclasses.asdict(endpoint)))
    return endpoint


def _plumb(spec: topology.HostSpec, endpoint: Endpoint) -> None:
    netns.add_netns(endpoint.netns)
    processutil.run(
        [
            *("ip", "-n", spec.netns, "link", "add", endpoint.port, "type", "veth"),
            *("peer", "name", ENDPOINT_IF, "netns", endpoint.netns),
        ]
    )
    prefix = topology.TENANT_NET.prefixlen
    processutil.run(
        ["ip", "-n", endpoint.netns, "addr", "add", f"{endpoint.ip}/{prefix}", "dev", ENDPOINT_IF]
    )
    for ns, ifname in ((spec.netns, endpoint.port), (endpoint.netns, ENDPOINT_IF)):
        processutil.run(["ip", "netns", "exec", ns, "ethtool", "-K", ifname, "tx", "off"])
        processutil.run(["ip", "-n", ns, "link", "set", ifname, "up"])
    _attach_rx_pass(endpoint.netns, ENDPOINT_IF)
    # Frames redirected to the endpoint are polled in a kernel thread, not in the
    # sender's softirq, as a NIC queue's IRQ would land on another core.
    processutil.run(
        ["ip", "netns", "exec", endpoint.netns, "tee", f"/sys/class/net/{ENDPOINT_IF}/threaded"],
        input_text="1",
        check=False,  # best effort: polling in softirq still works, just slower
    )


def prepare_uplink(spec: topology.HostSpec) -> None:
    """Let XDP redirects out of the host's phy0 be received by the fabric (idempotent;
    ``lab up`` does it too, this covers labs brought up before it did)."""
    fabric.accept_xdp_redirects(spec)


def _attach_rx_pass(ns: str, ifname: str) -> None:
    from ovs_ext.providers.xdp import provider  # the lab works without the eSwitch built

    if provider.RX_PASS_OBJECT.is_file():
        provider.attach_rx_pass(ifname, ns)


def _unplumb(lab: Lab, endpoint: Endpoint) -> None:
    host = lab.host(endpoint.host)
    if host.ns.holder_pid is not None:
        host.ovs_vsctl("--if-exists", "del-port", topology.INTEGRATION_BRIDGE, endpoint.port)
    netns.delete_netns(endpoint.netns)  # takes the veth pair with it


def delete(lab: Lab, name: str) -> None:
    endpoint = get(lab, name)
    _unplumb(lab, endpoint)
    (_state_dir(lab) / f"{name}.json").unlink()


def exec_prefix(endpoint: Endpoint) -> list[str]:
    """Prefix that runs a command inside the endpoint's namespace."""
    return ["ip", "netns", "exec", endpoint.netns]
