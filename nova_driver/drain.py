"""Draining a compute host through Nova's API, on FlexMig's plan.

The plan (``flexmig.policy.drain``) picks each server's destination host and
the order; Nova's live-migrate API (``os-migrateLive`` with that host) moves
it, and the FlexMig driver on the source decides each migration's mode as
for any live migration.  Inputs come from Nova (the host's servers, the
enabled and up compute services) and from the hosts' FlexMig agents (each
destination's free RAM and store, each VM's dirty model from the source's
inventory).  A server the source agent cannot describe is planned from its
flavor, as fully resident and idle, and the plan says so.

Nova runs at most ``[DEFAULT] max_concurrent_live_migrations`` (default 1)
live migrations per compute at once and queues the rest: a plan with more
would be mistimed.  So the plan is limited to what the operator says the
computes allow, unless they raise it for the drain, which is warned about.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any, Protocol

from flexmig import drain_agents, drain_run, exceptions
from flexmig.migration.options import EngineOptions
from flexmig.policy import drain, drain_downtime
from flexmig.policy.dirty_model import DirtyModel

LOG = logging.getLogger(__name__)
MIB = 2**20
NOVA_DEFAULT_MAX_CONCURRENT = 1


class NovaAPI(Protocol):
    """The two calls the drain needs; JSON bodies in and out."""

    def get(self, path: str) -> dict[str, Any]: ...

    def post(self, path: str, body: dict[str, Any]) -> None: ...


class SdkNovaAPI:
    """``NovaAPI`` over an openstacksdk connection (``openstack.connect()``)."""

    def __init__(self, conn: Any, microversion: str = "2.79") -> None:
        self.conn = conn
        self.microversion = microversion

    def get(self, path: str) -> dict[str, Any]:
        resp = self.conn.compute.get(path, microversion=self.microversion)
        if resp.status_code >= 400:
            raise exceptions.FlexMigError(f"Nova GET {path}: {resp.status_code} {resp.text}")
        return dict(resp.json())

    def post(self, path: str, body: dict[str, Any]) -> None:
        resp = self.conn.compute.post(path, json=body, microversion=self.microversion)
        if resp.status_code >= 400:
            raise exceptions.FlexMigError(f"Nova POST {path}: {resp.status_code} {resp.text}")


@dataclasses.dataclass(frozen=True)
class Server:
    id: str
    name: str
    instance_name: str  # the libvirt domain: how the agents know it
    ram_bytes: int


@dataclasses.dataclass(frozen=True)
class NovaInputs:
    servers: dict[str, Server]  # by instance name
    inputs: drain_agents.Inputs
    warnings: list[str]


def servers_on(api: NovaAPI, host: str) -> list[Server]:
    found = api.get(f"/servers/detail?all_tenants=1&host={host}")["servers"]
    return [
        Server(
            id=s["id"],
            name=s["name"],
            instance_name=s["OS-EXT-SRV-ATTR:instance_name"],
            ram_bytes=int(s["flavor"]["ram"]) * MIB,
        )
        for s in found
        if s.get("status") == "ACTIVE"
    ]


def compute_hosts(api: NovaAPI, source: str) -> list[str]:
    """Enabled, up nova-compute hosts other than the source."""
    services = api.get("/os-services?binary=nova-compute")["services"]
    return sorted(
        s["host"]
        for s in services
        if s["host"] != source and s.get("status") == "enabled" and s.get("state") == "up"
    )


def _from_flavor(server: Server, max_downtime_ms: int | None) -> drain.DrainVM:
    """Fully resident and idle, anonymous memory: only its timing is planned from this
    (the FlexMig driver on the source decides its mode when Nova migrates it)."""
    return drain.DrainVM.sized(
        server.instance_name,
        server.ram_bytes,
        server.ram_bytes,
        DirtyModel(0.0, 1.0),
        max_downtime_ms=max_downtime_ms,
    )


def gather(
    api: NovaAPI,
    source: str,
    agent_for: Callable[[str], Any | None],
    max_downtime_ms: int | None = None,
    link_mib: int = 0,
) -> NovaInputs:
    """Servers and hosts from Nova, facts from the agents that answer."""
    servers = {s.instance_name: s for s in servers_on(api, source)}
    candidates, warnings = [], []
    for host in compute_hosts(api, source):
        agent = agent_for(host)
        if agent is None:
            candidates.append(drain.Candidate(host, 0, 0, refusal="no FlexMig agent known"))
            continue
        candidates.append(
            drain_agents.candidate_from_agent(drain_agents.HostEndpoint(host, agent, "", 0, "", ""))
        )
    inventory: dict[str, Any] = {
        "vms": [],
        "links": {},
        "initial_stream_bps": EngineOptions().stream_bandwidth_mib * MIB,
        "max_downtime_ms": EngineOptions().max_downtime_ms,
    }
    source_agent = agent_for(source)
    if source_agent is not None:
        try:
            inventory = source_agent.post("/v1/inventory", {"probe": []}, timeout=120.0)
        except exceptions.FlexMigError as exc:
            warnings.append(f"the source's agent gave no inventory ({exc})")
    described = {}
    for entry in inventory["vms"]:
        if "error" in entry or entry.get("name") not in servers:
            continue
        try:
            described[entry["name"]] = drain_agents.vm_from_inventory(entry, max_downtime_ms)
        except exceptions.BackendError as exc:
            warnings.append(str(exc))
    vms = []
    for name, server in servers.items():
        if name not in described:
            warnings.append(
                f"{server.name}: planned from its flavor (the agent did not describe it)"
            )
        vms.append(described.get(name) or _from_flavor(server, max_downtime_ms))
    fabric = drain_agents.fabric_from(
        inventory["links"], float(inventory["initial_stream_bps"]), link_mib
    )
    options = drain_agents.options_from(inventory)
    return NovaInputs(servers, drain_agents.Inputs(vms, candidates, fabric, {}, options), warnings)


def concurrency_limit(nova_limit: int, wanted: int, raise_limit: bool) -> tuple[int, str | None]:
    """How many the plan may run at once, and the warning when Nova's limit is raised.

    >>> concurrency_limit(1, 4, False)
    (1, None)
    >>> concurrency_limit(1, 4, True)[0]
    4
    """
    if wanted <= nova_limit or not raise_limit:
        return min(wanted, nova_limit), None
    return wanted, (
        f"the drain runs up to {wanted} live migrations at once, above Nova's "
        f"max_concurrent_live_migrations={nova_limit} (Nova's documentation calls raising it "
        "risky): set it to at least that on the source compute and restart nova-compute, or "
        "Nova queues the extra migrations and the plan's timing no longer holds"
    )


class NovaBackend:
    """Each planned move is ``os-migrateLive`` to the plan's host."""

    def __init__(self, api: NovaAPI, source: str, servers: dict[str, Server]) -> None:
        self.api = api
        self.source = source
        self.servers = servers

    def start(self, move: drain.Move) -> str:
        server = self.servers[move.vm]
        body = {"os-migrateLive": {"host": move.dest, "block_migration": "auto"}}
        self.api.post(f"/servers/{server.id}/action", body)
        return server.id

    def poll(self, handle: str, move: drain.Move) -> drain_run.Status:
        current = self.api.get(f"/servers/{handle}")["server"]
        if current.get("OS-EXT-STS:task_state"):
            return drain_run.Status("running")
        host = current.get("OS-EXT-SRV-ATTR:host")
        if host == move.dest and current.get("status") == "ACTIVE":
            return drain_run.Status("completed", 1.0)
        migrations = self.api.get(f"/os-migrations?instance_uuid={handle}")["migrations"]
        status = migrations[0]["status"] if migrations else "unknown"
        if status in ("failed", "error", "cancelled") or host == self.source:
            return drain_run.Status(
                "failed", note=f"Nova's migration {status}; the server is on {host}"
            )
        return drain_run.Status("running")


def hypervisor_agents(
    api: NovaAPI, port: int, key: bytes, timeout: float = 30.0, ca_file: str | None = None
) -> Callable[[str], Any | None]:
    """Each compute's agent at its hypervisor's host_ip (how the driver finds its own).

    ``ca_file``: the deployment's CA when the agents serve TLS ([flexmig] agent_ca_file).
    """
    from agents.agent.client import AgentClient  # the agent's client, not its service

    found = api.get("/os-hypervisors/detail")["hypervisors"]
    ips = {h["service"]["host"]: h.get("host_ip") for h in found if h.get("service")}

    def agent_for(host: str) -> Any | None:
        ip = ips.get(host)
        return AgentClient(ip, port, key, timeout=timeout, ca_file=ca_file) if ip else None

    return agent_for


def drain_host(
    api: NovaAPI,
    source: str,
    agent_for: Callable[[str], Any | None],
    nova_limit: int = NOVA_DEFAULT_MAX_CONCURRENT,
    max_concurrency: int = 4,
    raise_limit: bool = False,
    dry_run: bool = False,
    on_event: Callable[[str], None] = print,
    link_mib: int = 0,
    started: Callable[[drain_run.DrainRun], None] | None = None,
    cpus: int = 0,
    floor_ms: float = 0.0,
) -> tuple[drain.DrainPlan, drain_run.DrainReport | None]:
    """Plan the drain of ``source`` and, unless ``dry_run``, carry it out through Nova.

    ``cpus``, ``floor_ms``: the source's cores and its guests' gaps with no
    migration, for the plan's downtime forecasts (``flexmig drain --host-cpus``).
    """
    gathered = gather(api, source, agent_for, link_mib=link_mib)
    limit, warning = concurrency_limit(nova_limit, max_concurrency, raise_limit)
    for text in gathered.warnings + ([warning] if warning else []):
        LOG.warning("drain %s: %s", source, text)
        on_event(f"WARNING: {text}")
    inputs = gathered.inputs
    load = drain_downtime.host_load([v.dirty.initial_rate() for v in inputs.vms], cpus, floor_ms)
    plan = drain.plan(
        source, inputs.vms, inputs.candidates, inputs.fabric, limit, inputs.options, load
    )
    if limit < max_concurrency:
        on_event(
            f"drain: at most {limit} at once (Nova's max_concurrent_live_migrations); "
            "--raise-nova-limit lets the plan use more"
        )
    on_event(plan.explain())
    if dry_run:
        return plan, None
    backend = NovaBackend(api, source, gathered.servers)
    run = drain_run.DrainRun(plan, inputs.vms, inputs.candidates, backend, limit, on_event)
    if started is not None:
        started(run)
    return plan, run.run()
