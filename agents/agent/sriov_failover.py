"""A VM's SR-IOV failover pairs across a live migration: the libvirt side.

A VF cannot be migrated, so a VM whose NIC is a VF (offloaded by ``tc-flower``
on a switchdev NIC) gets two NICs with one MAC: the VF as *primary*
(``<interface type='hostdev'>`` with ``<teaming type='transient'>``) and a
virtio-net port on br-int as *standby* (``<teaming type='persistent'>``;
QEMU's virtio-net ``failover=on``, the guest's ``net_failover`` bonds them).
QEMU unplugs the primary when the migration starts and re-plugs it if the
migration fails; the guest carries on through the standby meanwhile.

What the offload hook (``offload_hook.py``) does with each pair, in order:

source  demote the VF representor's flows and re-key them to the standby
        (the extension's ``depart`` with ``rekey``); QEMU unplugs the primary
        (Nova's path: Nova detaches the VF itself before the job);
        migrate;
dest    once the VM runs: plug a free VF of this host with the VM's MAC as
        primary (Nova's path: Nova attaches the VF it claimed, in
        ``post_live_migration_at_destination``), re-key the flows from the
        standby to that VF's representor, re-offload them;
source  (failed) plug the VF back if QEMU has not, re-key back to its
        representor, re-offload there.

Parsing the domain XML, naming the XML to plug, finding a VF's representor
and picking a free VF are pure functions here (unit-tested); ``plug`` and the
sysfs reads are the only I/O.  A gate with such a NIC checks the whole path
(docs/sriov-failover-gate.md).
"""

from __future__ import annotations

import dataclasses
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from xml.sax.saxutils import quoteattr

import libvirt

from flexmig import exceptions, hypervisor

PCI_ADDRESS = re.compile(
    r"^(?P<domain>[0-9a-f]{4}):(?P<bus>[0-9a-f]{2}):(?P<slot>[0-9a-f]{2})\.(?P<function>[0-7])$"
)
MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
ALIAS = re.compile(r"^ua-[A-Za-z0-9_-]{1,40}$")  # libvirt: user aliases start with "ua-"
PORT = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")
MAX_PAIRS = 8


@dataclasses.dataclass(frozen=True)
class FailoverPair:
    """One guest NIC: a VF primary and its virtio standby, one MAC."""

    vf_pci: str  # the VF's PCI address on this host, e.g. 0000:3b:02.1
    vf_representor: str  # its representor netdev in br-int's host, e.g. eth2_1 / pf0vf1
    standby_port: str  # the standby's tap on br-int
    mac: str
    bridge: str = "br-int"
    standby_alias: str = "ua-standby0"

    def __post_init__(self) -> None:
        check_pci(self.vf_pci)
        if not MAC.match(self.mac):
            raise exceptions.InvalidInput(what="MAC", reason=repr(self.mac))
        if not ALIAS.match(self.standby_alias):
            raise exceptions.InvalidInput(what="standby alias", reason=repr(self.standby_alias))
        for what, name in (("representor", self.vf_representor), ("standby", self.standby_port)):
            if not PORT.match(name):
                raise exceptions.InvalidInput(what=f"{what} port", reason=repr(name))


@dataclasses.dataclass(frozen=True)
class FailoverNic:
    """A failover pair as the live domain XML shows it now."""

    mac: str
    standby_port: str
    standby_alias: str
    vf_pci: str | None  # the primary plugged now; None while it is unplugged


def check_pci(text: str) -> str:
    if not isinstance(text, str) or not PCI_ADDRESS.match(text):
        raise exceptions.InvalidInput(what="VF PCI address", reason=repr(text))
    return text


def standby_interface_xml(pair: FailoverPair) -> str:
    """The virtio standby, always present: QEMU's virtio-net ``failover=on``."""
    return (
        "<interface type='bridge'>"
        f"<source bridge={quoteattr(pair.bridge)}/><virtualport type='openvswitch'/>"
        f"<mac address={quoteattr(pair.mac)}/><target dev={quoteattr(pair.standby_port)}/>"
        "<model type='virtio'/><teaming type='persistent'/>"
        f"<alias name={quoteattr(pair.standby_alias)}/>"
        "</interface>"
    )


def primary_interface_xml(pair: FailoverPair) -> str:
    """The VF primary (``failover_pair_id`` = the standby): unplugged by QEMU when
    a migration starts, hot-plugged on the destination with that host's VF."""
    m = PCI_ADDRESS.match(pair.vf_pci)
    assert m is not None  # checked in __post_init__
    address = " ".join(f"{k}={quoteattr('0x' + v)}" for k, v in m.groupdict().items())
    return (
        "<interface type='hostdev' managed='yes'>"
        f"<mac address={quoteattr(pair.mac)}/>"
        f"<source><address type='pci' {address}/></source>"
        f"<teaming type='transient' persistent={quoteattr(pair.standby_alias)}/>"
        "</interface>"
    )


def _pci_of(iface: ET.Element) -> str | None:
    addr = iface.find("source/address")
    if addr is None:
        return None
    try:
        parts = [int(addr.get(k, ""), 16) for k in ("domain", "bus", "slot", "function")]
    except ValueError:
        return None
    return "{:04x}:{:02x}:{:02x}.{:x}".format(*parts)


def failover_nics(domain_xml: str) -> list[FailoverNic]:
    """The VM's failover pairs: a virtio standby on the bridge with ``<teaming
    type='persistent'>``, and the hostdev primary naming it (or, where the XML
    has no teaming, e.g. Nova's, a hostdev with the standby's MAC).

    >>> xml = ("<domain><devices><interface type='bridge'><mac address='52:54:00:aa:bb:01'/>"
    ...        "<target dev='tap4'/><teaming type='persistent'/><alias name='ua-sb0'/>"
    ...        "</interface><interface type='hostdev'><mac address='52:54:00:aa:bb:01'/>"
    ...        "<source><address type='pci' domain='0x0000' bus='0x3b' slot='0x02' "
    ...        "function='0x1'/></source><teaming type='transient' persistent='ua-sb0'/>"
    ...        "</interface></devices></domain>")
    >>> failover_nics(xml)
    [FailoverNic(mac='52:54:00:aa:bb:01', standby_port='tap4', standby_alias='ua-sb0', vf_pci='0000:3b:02.1')]
    """  # noqa: E501
    root = ET.fromstring(domain_xml)
    ifaces = root.findall("./devices/interface")
    primaries = [i for i in ifaces if i.get("type") == "hostdev"]
    nics = []
    for iface in ifaces:
        target, mac = iface.find("target"), iface.find("mac")
        if iface.get("type") == "hostdev" or target is None or mac is None:
            continue
        teaming, alias = iface.find("teaming"), iface.find("alias")
        alias_name = alias.get("name", "") if alias is not None else ""
        standby = teaming is not None and teaming.get("type") == "persistent"
        address = mac.get("address", "").lower()
        primary = next((p for p in primaries if _pairs(p, address, alias_name, standby)), None)
        if standby or primary is not None:
            nics.append(
                FailoverNic(
                    address,
                    target.get("dev", ""),
                    alias_name,
                    _pci_of(primary) if primary is not None else None,
                )  # fmt: skip
            )
    return nics[:MAX_PAIRS]


def _pairs(primary: ET.Element, mac: str, alias: str, standby: bool) -> bool:
    teaming = primary.find("teaming")
    if standby and teaming is not None:
        return teaming.get("type") == "transient" and teaming.get("persistent") == alias
    found = primary.find("mac")
    return found is not None and found.get("address", "").lower() == mac


def representor_of(vf_pci: str, sysfs: Path = Path("/sys")) -> str:
    """The netdev representing a VF on its NIC's switchdev eswitch (its port in
    br-int's host): the netdev with the PF's ``phys_switch_id`` whose
    ``phys_port_name`` is ``pf<N>vf<M>`` (M: the VF's index under its PF)."""
    check_pci(vf_pci)
    vf_dir = sysfs / "bus/pci/devices" / vf_pci
    try:
        pf_dir = (vf_dir / "physfn").resolve(strict=True)
        index = next(
            int(link.name[len("virtfn") :])
            for link in pf_dir.glob("virtfn*")
            if link.resolve() == vf_dir.resolve()
        )
        pf_net = next((pf_dir / "net").iterdir())
        switch_id = (pf_net / "phys_switch_id").read_text().strip()
        pf_port = (pf_net / "phys_port_name").read_text().strip()  # "p0" / "pf0"
    except (OSError, StopIteration) as exc:
        raise exceptions.MissingPrerequisite(
            what=f"the switchdev representor of VF {vf_pci}",
            hint="the VF must belong to a PF in switchdev mode (devlink dev eswitch set)",
        ) from exc
    wanted = f"pf{pf_port.lstrip('pf').lstrip('p')}vf{index}"
    for dev in sorted((sysfs / "class/net").iterdir()):
        try:
            if (dev / "phys_switch_id").read_text().strip() != switch_id:
                continue
            if (dev / "phys_port_name").read_text().strip() == wanted:
                return dev.name
        except OSError:
            continue
    raise exceptions.MissingPrerequisite(
        what=f"a representor {wanted} for VF {vf_pci}", hint="is the PF in switchdev mode?"
    )


def vfs_in_use(domain_xmls: list[str]) -> set[str]:
    """PCI addresses of the VFs the host's domains have as hostdev interfaces."""
    used = set()
    for text in domain_xmls:
        for iface in ET.fromstring(text).findall("./devices/interface"):
            if iface.get("type") == "hostdev" and (pci := _pci_of(iface)) is not None:
                used.add(pci)
    return used


def pick_free_vf(pool: list[str], in_use: set[str]) -> str:
    """The first VF of this host's failover pool no domain has.

    >>> pick_free_vf(["0000:3b:02.1", "0000:3b:02.2"], {"0000:3b:02.1"})
    '0000:3b:02.2'
    """
    for vf in pool:
        if vf not in in_use:
            return vf
    raise exceptions.InvalidInput(
        what="SR-IOV failover", reason=f"no free VF in [agent] sriov_failover_vfs ({len(pool)})"
    )


def plug(dom: libvirt.virDomain, pair: FailoverPair, host: str) -> None:
    """Hot-plug the VF as the running VM's primary (the guest's net_failover
    switches to it)."""
    with hypervisor.wrap_errors(host, f"plug VF {pair.vf_pci} as primary"):
        dom.attachDeviceFlags(primary_interface_xml(pair), libvirt.VIR_DOMAIN_AFFECT_LIVE)
