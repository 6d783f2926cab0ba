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

The domain XML of a pair and plugging a VF are the agent's (it owns libvirt:
``agents/agent/sriov_failover.py``, re-exported here); re-keying the records
is the extension's (``ovs_ext.migration``); the hook runs both
(``agents/agent/offload_hook.py``).  A gate with such a NIC checks the whole
path (docs/sriov-failover-gate.md).
"""

from __future__ import annotations

import dataclasses

from agents.agent.sriov_failover import (
    FailoverPair,
    primary_interface_xml,
    standby_interface_xml,
)
from ovs_ext import migration
from ovs_ext.migration import FlowTransfer

__all__ = [
    "FailoverPair",
    "migration_steps",
    "primary_interface_xml",
    "rekey",
    "standby_interface_xml",
]


def rekey(records: list[FlowTransfer], old_port: str, new_port: str) -> list[FlowTransfer]:
    """Records of flows entering by (or owned by) ``old_port``, now by ``new_port``
    (the extension's ``FlowMigrations.rekey`` does this to a migration's flows)."""
    return migration.rekey_records(records, old_port, new_port)


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
