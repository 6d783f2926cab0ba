"""The source side's planning: gather the policy's inputs, let ``flexmig.policy`` decide.

Inputs come from where they live: the VM's size, memory backing and devices
from its libvirt definition, its dirty pages from libvirt's dirty-rate
calculation, the fabric's rate from a probe of the destination agent, the
destination's free memory and store from the offer it put in the migrate
data.  The decision itself is ``flexmig.policy.decision.decide``; here it only
becomes libvirt flags and a bandwidth.
"""

from __future__ import annotations

import dataclasses
import xml.etree.ElementTree as ET
from typing import Any

from stevedore import driver as stevedore_driver

from agents.agent import auth
from agents.agent.client import AgentClient
from flexmig import exceptions, vm_facts
from flexmig.modes.base import MigrationMode
from flexmig.policy import dirty_model
from flexmig.policy.decision import Decision, MigrationInputs, decide
from nova_driver.migrate_data import DestinationOffer

MIB = 2**20
PAGE = 4096


class PlanningFailed(exceptions.FlexMigError):
    msg_fmt = "FlexMig could not plan the migration of %(vm)s: %(reason)s"


@dataclasses.dataclass(frozen=True)
class GuestMemory:
    ram_bytes: int
    resident_bytes: int
    file_backed: bool
    postcopy_blocker: str | None


@dataclasses.dataclass(frozen=True)
class MigrationPlan:
    decision: Decision
    mode: MigrationMode
    bandwidth_mib: int  # 0: unlimited
    offer: DestinationOffer

    def flags(self, nova_flags: int, libvirt: Any) -> int:
        return merge_flags(nova_flags, self.mode.flags(self.decision), libvirt)


def merge_flags(nova_flags: int, mode_flags: int, libvirt: Any) -> int:
    """Nova's flags (tunnelling, TLS, block migration…) with the mode's own choices.

    Postcopy and auto-converge are the decision's, whatever Nova's
    ``live_migration_permit_*`` options say; everything else stays Nova's.

    >>> import types
    >>> lv = types.SimpleNamespace(VIR_MIGRATE_POSTCOPY=32768, VIR_MIGRATE_AUTO_CONVERGE=8192)
    >>> merge_flags(1 | 2 | 8192, 1 | 32768, lv)
    32771
    """
    chosen = libvirt.VIR_MIGRATE_POSTCOPY | libvirt.VIR_MIGRATE_AUTO_CONVERGE
    return (nova_flags & ~chosen) | (mode_flags & chosen)


def split_destination_xml(xml: str) -> str:
    """The destination XML for a split VM: its file-backed memory allocated on demand.

    Nova asks for ``<allocation mode="immediate"/>`` with file-backed memory,
    which makes the incoming QEMU preallocate all of the VM's RAM: under
    split's resident cap that would fault the whole VM through the cap before
    the first page arrives.  On demand, pages land as they come and the cold
    ones stay in the store file.

    >>> xml = split_destination_xml('<domain><memoryBacking><source type="file"/>'
    ...                             '<allocation mode="immediate"/></memoryBacking></domain>')
    >>> xml[xml.index("<allocation"):]
    '<allocation mode="ondemand" /></memoryBacking></domain>'
    """
    root = ET.fromstring(xml)
    for allocation in root.findall("memoryBacking/allocation"):
        allocation.set("mode", "ondemand")
    return ET.tostring(root, encoding="unicode")


def guest_memory(xml: str, max_memory_kib: int, memory_stats: dict[str, int]) -> GuestMemory:
    """The guest's memory facts from its libvirt definition and memory statistics.

    Resident is QEMU's RSS where libvirt reports it (capped at RAM), else all
    of RAM: over-estimating what moves keeps the prediction on the safe side.
    """
    root = ET.fromstring(xml)
    ram = max_memory_kib * 1024
    rss = memory_stats.get("rss")
    resident = min(ram, rss * 1024) if rss else ram
    backing = root.find("memoryBacking")
    file_backed = (
        backing is not None
        and backing.find("source[@type='file']") is not None
        and backing.find("access[@mode='shared']") is not None
    )
    blocker = None
    if root.find("devices/hostdev") is not None:
        blocker = "the VM has a passthrough device"
    elif file_backed:
        # Nova's memory_backing_dir is a disk-backed store (that is what lets
        # split place memory there); userfaultfd serves only tmpfs/hugetlbfs.
        blocker = "its memory is file-backed, and userfaultfd cannot serve a disk-backed file"
    return GuestMemory(ram, resident, file_backed, blocker)


def load_mode(name: str) -> MigrationMode:
    try:
        return stevedore_driver.DriverManager("flexmig.modes", name, invoke_on_load=True).driver
    except Exception as exc:
        raise exceptions.InvalidInput(what="migration mode", reason=f"{name}: {exc}") from exc


def destination_agent(
    offer: DestinationOffer, timeout: float, ca_file: str | None = None
) -> AgentClient:
    """A client that holds only the migration-scoped credential the destination issued."""
    return AgentClient(
        offer.agent_address,
        offer.agent_port,
        offer.scoped_key.encode(),
        timeout=timeout,
        scope=offer.scope,
        ca_file=ca_file,
    )


def peer_endpoint(offer: DestinationOffer, facts: dict[str, Any]) -> dict[str, Any]:
    """Where this host's agent reaches the destination's: the address the
    destination agent gives in its facts (its listen address), else the offer's.

    The offer holds the address the destination's driver uses for its own
    agent, which may be one only that host can use (a local UNIX socket).

    >>> offer = DestinationOffer("/run/flexmig/agent.sock", 0, "s", "k", 1, 1, None)
    >>> peer_endpoint(offer, {"agent": {"address": "10.0.0.2", "port": 9797}})
    {'address': '10.0.0.2', 'port': 9797}
    >>> peer_endpoint(offer, {})
    {'address': '/run/flexmig/agent.sock', 'port': 0}
    """
    agent = facts.get("agent")
    if isinstance(agent, dict) and isinstance(agent.get("address"), str):
        port = agent.get("port")
        if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
            return {"address": agent["address"], "port": port}
    return {"address": offer.agent_address, "port": offer.agent_port}


def fabric_bandwidth(offer: DestinationOffer, conf: Any) -> float:
    """Bytes/s the stream is planned at: assumed rate, probed fabric, Nova's cap."""
    bandwidth = float(conf.flexmig.stream_bandwidth_mib * MIB)
    if conf.flexmig.bandwidth_probe_mib:
        agent = destination_agent(offer, conf.flexmig.agent_timeout, conf.flexmig.agent_ca_file)
        bandwidth = min(bandwidth, agent.probe_bandwidth(conf.flexmig.bandwidth_probe_mib))
    if conf.libvirt.live_migration_bandwidth:
        bandwidth = min(bandwidth, conf.libvirt.live_migration_bandwidth * MIB)
    return bandwidth


def blockers(conf: Any, memory: GuestMemory, paused: bool) -> tuple[str | None, str | None]:
    """(postcopy blocker, split blocker) from the VM and the operator's allowed modes."""
    allowed = set(conf.flexmig.allowed_modes)
    postcopy = memory.postcopy_blocker
    if postcopy is None and "postcopy" not in allowed:
        postcopy = "postcopy is not in [flexmig] allowed_modes"
    if postcopy is None and paused:
        postcopy = "the VM is paused (libvirt refuses postcopy for a paused VM)"
    split = None if "split" in allowed else "split is not in [flexmig] allowed_modes"
    return postcopy, split


def plan(
    conn: Any,
    dom: Any,
    host: str,
    offer: DestinationOffer,
    conf: Any,
    paused: bool = False,
) -> MigrationPlan:
    """Decide the mode and parameters for migrating ``dom`` to the offer's host."""
    vm = dom.name()
    try:
        memory = guest_memory(dom.XMLDesc(0), dom.maxMemory(), dom.memoryStats())
        samples = vm_facts.sample_dirty_pages(
            conn, dom, host, tuple(conf.flexmig.dirty_sample_seconds)
        )
        bandwidth = fabric_bandwidth(offer, conf)
        postcopy_blocker, split_blocker = blockers(conf, memory, paused)
        decision = decide(
            MigrationInputs(
                vm=vm,
                ram_bytes=memory.ram_bytes,
                resident_bytes=memory.resident_bytes,
                dirty=dirty_model.fit(samples, max_pages=memory.ram_bytes / PAGE),
                bandwidth_bps=bandwidth,
                dest_free_bytes=offer.free_for_vms_bytes,
                dest_store_free_bytes=offer.store_free_bytes,
                file_backed=memory.file_backed,
                max_downtime_ms=conf.flexmig.max_downtime_ms,
                postcopy_blocker=postcopy_blocker,
                split_blocker=split_blocker,
            )
        )
    except exceptions.FlexMigError as exc:
        raise PlanningFailed(vm=vm, reason=str(exc)) from exc
    except Exception as exc:  # a libvirt error from Nova's (possibly fake) binding
        raise PlanningFailed(vm=vm, reason=f"{type(exc).__name__}: {exc}") from exc
    _check_allowed(decision, conf, offer)
    cap = conf.libvirt.live_migration_bandwidth
    return MigrationPlan(decision, load_mode(decision.mode), cap, offer)


def _check_allowed(decision: Decision, conf: Any, offer: DestinationOffer) -> None:
    if decision.mode not in conf.flexmig.allowed_modes:
        raise PlanningFailed(
            vm=decision.vm,
            reason=f"the policy chose {decision.mode}, which [flexmig] allowed_modes "
            f"excludes:\n{decision.explain()}",
        )
    if decision.mode == "split" and offer.split_budget_bytes is None:
        raise PlanningFailed(
            vm=decision.vm,
            reason="the policy chose split but the destination reserved no budget for it",
        )


def scoped_credential(key: bytes, migration_id: str, vm: str, expires: float) -> tuple[str, str]:
    """(scope, scoped key) for one VM's migration: what the destination hands the source."""
    scope = auth.scope_for(migration_id, vm, expires)
    return scope, auth.scoped_key(key, scope).decode()
