"""The Nova source side's planning: an adapter over ``flexmig.migration``.

Inputs come from where they live: the VM's facts from libvirt through the
engine's one reader (its filesystem-backed memory judged by the filesystem of
this host's memory store, which the local agent reports), the fabric's rate
from a probe of the destination agent, the destination's free memory, store,
split reservation and movers from the offer it put in the migrate data.  The
plan is the engine's, exactly as the agent path makes it.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from typing import Any

from oslo_log import log as logging

from agents.agent import auth
from agents.agent.client import AgentClient
from flexmig import exceptions
from flexmig.migration import facts, planner
from flexmig.migration.knobs import HostSoftware
from flexmig.migration.options import EngineOptions
from flexmig.migration.planner import Plan
from flexmig.migration.request import MigrationRequest
from nova_driver.migrate_data import DestinationOffer

MIB = 2**20
LOG = logging.getLogger(__name__)


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


def destination_agent(offer: DestinationOffer, timeout: float, ca_file: str | None) -> AgentClient:
    """A client that holds only the migration-scoped credential the destination issued
    (over TLS against ``ca_file`` when the agents serve TLS)."""
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


def request_for(
    dom: Any, offer: DestinationOffer, opts: EngineOptions, conf: Any
) -> MigrationRequest:
    """What Nova asks of a migration: its own bandwidth cap and parallel connections
    ([libvirt] live_migration_bandwidth, live_migration_parallel_connections),
    the engine's transport.  The destination already resolved the transport (it
    started receiving movers, or did not): the mover exactly where it did, unless
    the plan leaves it for QEMU's TCP (``preempt_conflict``: postcopy where libvirt
    turns postcopy-preempt on)."""
    transport = "mover" if offer.mover else opts.transport
    if transport == "mover" and not offer.mover:
        transport = "qemu-tcp"
    # Nova's default (1) leaves the connections to the plan, as the agent API's
    # default does; a larger value is the operator's choice.
    asked = conf.libvirt.live_migration_parallel_connections
    return MigrationRequest(
        vm=dom.name(),
        bandwidth_mib=conf.libvirt.live_migration_bandwidth or 0,
        transport=transport,
        parallel=asked if asked > 1 else 0,
    )


def plan(
    conn: Any,
    dom: Any,
    host: str,
    offer: DestinationOffer,
    conf: Any,
    opts: EngineOptions,
    local_agent: AgentClient,
    libvirt_error: type[Exception],
) -> Plan:
    """Plan migrating ``dom`` to the offer's host.

    Bad input, a refusal and a backend failure (libvirt errors of Nova's
    binding, ``libvirt_error``, wrapped) raise the engine's errors; a bug
    raises as it is.
    """
    request = request_for(dom, offer, opts, conf)
    samples = background_samples(local_agent, request.vm)
    try:
        store_fs = local_agent.get("/v1/facts").get("store_fs_type")
        vm = facts.read_vm(
            conn, dom, host, opts.dirty_sample_seconds, None, store_fs, samples=samples
        )
    except libvirt_error as exc:
        raise exceptions.HypervisorError(
            host=host, action=f"read {request.vm}'s facts", reason=str(exc)
        ) from exc
    agent = destination_agent(offer, conf.flexmig.agent_timeout, conf.flexmig.agent_ca_file)
    fabric = None
    if opts.bandwidth_probe_mib:
        fabric = agent.probe_bandwidth(opts.bandwidth_probe_mib)
    dest_facts = _destination_facts(agent)
    dest = planner.DestinationFacts(
        free_for_vms_bytes=offer.free_for_vms_bytes,
        store_free_bytes=offer.store_free_bytes,
        split_reserved=offer.split_budget_bytes is not None,
        software=HostSoftware.from_facts(dest_facts),
        # The same destination facts the agent path reads (DestinationFacts.from_agent):
        # the store's write rate prices a file-backed guest's writeback at switchover.
        store_write_bps=_number(dest_facts, "store_write_bps"),
        store_fault_s=_number(dest_facts, "store_fault_s"),
        store_folio_bytes=int(_number(dest_facts, "store_folio_bytes")),
        store_shares_libvirt_fs=dest_facts.get("store_shares_libvirt_fs"),
    )
    try:
        source = planner.SourceFacts(facts.host_software(conn, host), facts.idle_cpus())
    except (exceptions.HypervisorError, libvirt_error):
        source = planner.SourceFacts(idle_cpus=facts.idle_cpus())
    link = planner.LinkFacts(fabric_bps=fabric)
    return planner.plan(request, vm, dest, link, opts, source=source)


def background_samples(local_agent: AgentClient, vm: str) -> tuple[tuple[float, float], ...] | None:
    """The local agent's fresh background samplings of ``vm``, handed over once.

    With ``[agent] dirty_sample_refresh`` on, the agent samples every VM in
    the background and its own plans fit all samplings of the last two
    minutes together, which averages out the noise of libvirt's page-sampled
    rates that split's forecast of store faults depends on, and spares the
    migration the samples' wait.  None (the driver then samples, as before):
    the agent has none fresh, is older than the request, or cannot answer.
    """
    try:
        reply = local_agent.post(f"/v1/samples/{vm}/take", {})
    except exceptions.FlexMigError as exc:
        LOG.info("FlexMig: sampling %s's dirty rate here (no background samples: %s)", vm, exc)
        return None
    samples = usable_samples(reply.get("samples") if isinstance(reply, dict) else None)
    if samples:
        LOG.info("FlexMig: planning %s from the host agent's %d recent samples", vm, len(samples))
    return samples


def usable_samples(raw: Any) -> tuple[tuple[float, float], ...] | None:
    """``raw`` as (seconds, pages) samples the dirty model can be fitted to, or None.

    >>> usable_samples([[1, 100.0], [5, 400.0]])
    ((1.0, 100.0), (5.0, 400.0))
    >>> [usable_samples(r) for r in (None, [], [[1, 5], [1, 6]], [[1, 5], [0, 6]], [[1, "x"]])]
    [None, None, None, None, None]
    >>> usable_samples([[1, 5], [2, -1]]), usable_samples([[1, 5], [2, float("nan")]])
    (None, None)
    """
    if not isinstance(raw, list):
        return None
    out = []
    for sample in raw:
        if not (isinstance(sample, list) and len(sample) == 2):
            return None
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in sample):
            return None
        seconds, pages = (float(v) for v in sample)
        if not (seconds > 0 and pages >= 0 and math.isfinite(seconds + pages)):
            return None
        out.append((seconds, pages))
    # The fit tells the set from its rate only across two interval lengths.
    return tuple(out) if len({s for s, _ in out}) >= 2 else None


def _number(dest_facts: dict[str, Any], key: str) -> float:
    """A measured number of the destination's facts (0: not reported, or not a number).

    >>> _number({"store_write_bps": 5e8}, "store_write_bps"), _number({}, "store_fault_s")
    (500000000.0, 0.0)
    >>> _number({"store_fault_s": "x"}, "store_fault_s"), _number({"store_fault_s": None}, "x")
    (0.0, 0.0)
    """
    try:
        return float(dest_facts.get(key) or 0.0)
    except (TypeError, ValueError):
        return 0.0


def _destination_facts(agent: AgentClient) -> dict[str, Any]:
    """The destination agent's facts ({} when it cannot say: its libvirt and QEMU
    are then unknown, the knobs that need both ends are left out, and explain
    says why)."""
    try:
        return dict(agent.get("/v1/facts"))
    except exceptions.FlexMigError:
        return {}


def scoped_credential(key: bytes, migration_id: str, vm: str, expires: float) -> tuple[str, str]:
    """(scope, scoped key) for one VM's migration: what the destination hands the source."""
    scope = auth.scope_for(migration_id, vm, expires)
    return scope, auth.scoped_key(key, scope).decode()


DIRECT_VNIC_TYPES = ("direct", "direct-physical", "macvtap", "remote-managed", "vdpa")


def destination_vfs(vifs: Any) -> dict[str, str]:
    """{MAC: destination VF} of the VM's SR-IOV ports, from Nova's migrate data.

    Nova claims a VF on the destination for each direct port during
    ``pre_live_migration`` (its binding profile's ``pci_slot``), detaches the
    source's VF before the job and attaches the claimed one after it (or the
    source's again on rollback); the offload hook only moves the flows, so it
    needs to know which VF's representor they go to.

    >>> class V:  # a VIFMigrateData as Nova fills it
    ...     def __init__(self, mac, vnic, profile):
    ...         self.source_vif, self.vnic_type, self.profile = {"address": mac}, vnic, profile
    >>> destination_vfs([V("52:54:00:AA:BB:01", "direct", {"pci_slot": "0000:5e:00.3"}),
    ...                  V("52:54:00:aa:bb:02", "normal", {})])
    {'52:54:00:aa:bb:01': '0000:5e:00.3'}
    """
    found = {}
    for vif in vifs or []:
        source = getattr(vif, "source_vif", None) or {}
        profile = getattr(vif, "profile", None) or {}
        slot, mac = profile.get("pci_slot"), source.get("address")
        if getattr(vif, "vnic_type", None) in DIRECT_VNIC_TYPES and slot and mac:
            found[str(mac).lower()] = str(slot).lower()
    return found


def no_hint(why: str) -> str:
    """What the log says of a hint that was not sent."""
    return f"FlexMig: hot chunks not sent, the destination goes by the stream: {why}"


def hint_hot_chunks(
    local_agent: AgentClient, dest_agent: AgentClient, vm: str, ram_bytes: int
) -> str:
    """A split VM's hot chunks, sampled here and handed to the destination's
    keeper (agents/agent/hot_chunks.py); what happened, for the log.

    Nothing raised: without the hint the keeper goes by the stream, as before.
    """
    try:
        answer = local_agent.post("/v1/split/sample-hot", {"vm": vm, "ram_bytes": ram_bytes})
        runs = answer.get("chunks")
        if runs is None:
            return f"FlexMig: no hot chunks for the destination: {answer.get('why')}"
        dest_agent.post("/v1/split/hot", {"vm": vm, "chunks": runs})
    except exceptions.FlexMigError as exc:
        return no_hint(str(exc))
    mib = sum(count for _first, count in runs)
    return f"FlexMig: the guest wrote {mib} MiB in {answer.get('seconds')} s; kept resident there"
