"""SR-IOV VMs across a live migration: a VF primary with a virtio standby.

A VF cannot be migrated, so a VM offloaded by ``tc-flower`` on a switchdev NIC
gets two NICs with one MAC: the VF as *primary* (``<interface type='hostdev'>``
with ``<teaming type='transient'>``) and a virtio-net port on br-int as
*standby* (``<teaming type='persistent'>``; QEMU's ``failover=on``, the
guest's ``net_failover`` bonds them).  QEMU unplugs the primary when the
migration starts; the guest carries on through the standby.  Hence the hook's
steps for such a VM (:func:`migration_steps`):

source  1. demote the VF representor's flows (tc filters removed, final NIC
           counters carried over, as for any provider);
        2. re-key their records to the standby port: while the VF is unplugged
           the guest's packets enter br-int by the standby tap;
        3. QEMU unplugs the primary (the guest's failover device switches);
        4. migrate;
dest    5. hot-plug a free VF of the destination with the VM's MAC as primary
           (the guest's failover device switches back);
        6. re-key the arrived records to the destination's VF representor and
           re-offload them there (destination policy and capacity permitting).

Pure functions: the XML and record rewriting; the plug/unplug is libvirt's
(``attachDeviceFlags``), tested on a gate with such a NIC (docs/sriov-failover-gate.md).
"""

from __future__ import annotations

import dataclasses
import re
from xml.sax.saxutils import quoteattr

from flexmig import exceptions
from ovs_ext.migration import FlowTransfer

PCI_ADDRESS = re.compile(
    r"^(?P<domain>[0-9a-f]{4}):(?P<bus>[0-9a-f]{2}):(?P<slot>[0-9a-f]{2})\.(?P<function>[0-7])$"
)
MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
ALIAS = re.compile(r"^ua-[A-Za-z0-9_-]{1,40}$")  # libvirt: user aliases start with "ua-"


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
        if not PCI_ADDRESS.match(self.vf_pci):
            raise exceptions.InvalidInput(what="VF PCI address", reason=repr(self.vf_pci))
        if not MAC.match(self.mac):
            raise exceptions.InvalidInput(what="MAC", reason=repr(self.mac))
        if not ALIAS.match(self.standby_alias):
            raise exceptions.InvalidInput(what="standby alias", reason=repr(self.standby_alias))
        for what, name in (("representor", self.vf_representor), ("standby", self.standby_port)):
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,15}", name):
                raise exceptions.InvalidInput(what=f"{what} port", reason=repr(name))


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


def rekey(records: list[FlowTransfer], old_port: str, new_port: str) -> list[FlowTransfer]:
    """Records of flows entering by (or owned by) ``old_port``, now by ``new_port``.

    Counters and history stay: the flow is the guest's, whichever NIC carries it.
    """
    out = []
    for record in records:
        match = record.match
        if match.in_port == old_port:
            match = dataclasses.replace(match, in_port=new_port)
        owner = new_port if record.owner == old_port else record.owner
        out.append(dataclasses.replace(record, match=match, owner=owner))
    return out


def migration_steps(source: FailoverPair, dest_vf_pci: str, dest_representor: str) -> list[str]:
    """What the hook does for one failover pair, in order (shown by explain)."""
    dest = dataclasses.replace(source, vf_pci=dest_vf_pci, vf_representor=dest_representor)
    return [
        f"demote the flows of VF representor {source.vf_representor} (NIC counters carried)",
        f"re-key their records to the standby {source.standby_port}",
        f"QEMU unplugs the primary VF {source.vf_pci}; the guest's net_failover "
        f"switches to the standby",
        "migrate",
        f"hot-plug VF {dest.vf_pci} on the destination as primary (MAC {source.mac})",
        f"re-key the records to {dest.vf_representor} and re-offload them there",
    ]
