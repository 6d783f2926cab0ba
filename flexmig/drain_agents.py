"""A drain through the FlexMig agents: their facts in, their migrations out.

The source host's agent reports every running VM with the engine's facts
(memory, dirty-rate samples and the model fitted to them) and its
``[migration]`` options, and probes the fabric to each destination
(``POST /v1/inventory``); each destination's agent reports the RAM and store
it offers (``/v1/facts``).  Each planned move is then the engine's request
with the plan's mode, started on the source agent, whose engine plans it
again on the same samples (``inventory.SampleCache``).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from flexmig import drain_run, exceptions
from flexmig.migration import planner
from flexmig.migration.facts import GuestMemory, VmFacts
from flexmig.migration.options import EngineOptions
from flexmig.policy import drain
from flexmig.policy.decision import MODES
from flexmig.policy.dirty_model import DirtyModel

MIB = 2**20
# The agent's own work per migration before libvirt's job starts (the
# destination's facts, the store writeback request, the transport): measured
# in the lab's drains, not part of libvirt's setup time that the agent learns.
AGENT_OVERHEAD_S = 0.4


@dataclasses.dataclass(frozen=True)
class HostEndpoint:
    """How to reach one host: its agent and its libvirt."""

    name: str
    agent: Any  # agents.agent.client.AgentClient: how this tool reaches it
    address: str  # where other agents reach it (management network)
    port: int
    libvirt_uri: str
    migration_uri: str

    def dest_body(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "port": self.port,
            "libvirt_uri": self.libvirt_uri,
            "migration_uri": self.migration_uri,
        }


@dataclasses.dataclass(frozen=True)
class Inputs:
    vms: list[drain.DrainVM]
    candidates: list[drain.Candidate]
    fabric: drain.Fabric
    unreadable: dict[str, str]  # VMs the source could not describe, with why
    options: EngineOptions = dataclasses.field(default_factory=EngineOptions)


def vm_from_inventory(entry: dict[str, Any], max_downtime_ms: int | None = None) -> drain.DrainVM:
    """The engine's facts of one VM from the inventory; another shape is a backend error.

    >>> entry = {"name": "v", "paused": False, "samples": [[1, 0], [2, 0]],
    ...          "dirty": {"m_pages": 0, "tau_s": 1},
    ...          "memory": {"ram_bytes": 2**28, "resident_bytes": 2**26, "backing": "file",
    ...                     "backing_fs": "ext4", "passthrough": False}}
    >>> vm = vm_from_inventory(entry)
    >>> vm.name, vm.file_backed, vm.facts.memory.backing_fs, vm.facts.dirty_samples
    ('v', True, 'ext4', ((1.0, 0.0), (2.0, 0.0)))
    """
    try:
        mem, dirty = entry["memory"], entry["dirty"]
        facts = VmFacts(
            name=str(entry["name"]),
            memory=GuestMemory(
                ram_bytes=int(mem["ram_bytes"]),
                resident_bytes=int(mem["resident_bytes"]),
                backing=str(mem["backing"]),
                backing_fs=mem.get("backing_fs"),
                passthrough=bool(mem["passthrough"]),
            ),
            dirty_samples=tuple((float(t), float(n)) for t, n in entry["samples"]),
            paused=bool(entry.get("paused", False)),
            # An agent from before it was reported: production hosts run KVM.
            accelerator=str(entry.get("accelerator", "kvm")),
        )
        model = DirtyModel(float(dirty["m_pages"]), float(dirty["tau_s"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise exceptions.BackendError(
            backend="source agent", reason=f"inventory entry not in the API's shape: {exc!r}"
        ) from exc
    return drain.DrainVM(facts, model, max_downtime_ms)


def options_from(inventory: dict[str, Any]) -> EngineOptions:
    """The source engine's options the plan must keep (its allowed modes, budget, first rate)."""
    allowed = tuple(m for m in inventory.get("allowed_modes", MODES) if m in MODES)
    return EngineOptions(
        max_downtime_ms=int(inventory["max_downtime_ms"]),
        allowed_modes=allowed or MODES,
        stream_bandwidth_mib=max(1, int(inventory["initial_stream_bps"]) // MIB),
    )


def candidate_from_agent(host: HostEndpoint) -> drain.Candidate:
    try:
        facts = host.agent.get("/v1/facts")
        return drain.Candidate(
            host.name,
            int(facts["free_for_vms_bytes"]),
            int(facts["store_free_bytes"]),
            facts=planner.DestinationFacts.from_agent(facts),
        )
    except (exceptions.FlexMigError, KeyError, TypeError, ValueError) as exc:
        return drain.Candidate(host.name, 0, 0, refusal=f"its agent did not answer: {exc}")


def timings_learned(link: dict[str, Any]) -> bool:
    """Whether the agent learnt this link's setup and switchover (its
    ``LinkEstimate``): agents learn them under a bandwidth cap too, without the
    rate, so a capped host's seconds of setup count; an agent that predates the
    count (or its saved estimate) learnt them only with the rate.

    >>> timings_learned({"stream_bps": None, "timings_learned": 2})
    True
    >>> timings_learned({"stream_bps": 100.0}), timings_learned({"stream_bps": None})
    (True, False)
    """
    return planner.timings_were_learnt(link.get("timings_learned"), link.get("stream_bps"))


def fabric_from(
    links: dict[str, dict[str, Any]], initial_stream_bps: float, link_mib: int = 0
) -> drain.Fabric:
    """The shared link and one stream's rate from what the source agent measured.

    The link is the slowest probed path (all streams leave through the
    source's uplink); one stream's rate is what earlier migrations achieved,
    else the agent's configured first guess.  Setup and switchover are the
    mean of the links whose timings were learnt, with or without their rate.

    >>> links = {"b": {"fabric_bps": 200 * MIB, "stream_bps": None, "setup_s": 0,
    ...                "switchover_s": 0.05}}
    >>> f = fabric_from(links, 256 * MIB)
    >>> f.link_bps / MIB, f.stream_bps / MIB
    (200.0, 200.0)
    >>> fabric_from(links, 256 * MIB, link_mib=100).link_bps / MIB
    100.0
    >>> f.switchover_learned
    False
    """
    probed = [v["fabric_bps"] for v in links.values() if v.get("fabric_bps")]
    link = link_mib * MIB if link_mib else min(probed, default=initial_stream_bps)
    learned = [v["stream_bps"] for v in links.values() if v.get("stream_bps")]
    stream = max(learned, default=initial_stream_bps)
    timed = [v for v in links.values() if timings_learned(v)]
    setups = [v["setup_s"] for v in timed]
    switchovers = [v["switchover_s"] for v in timed]
    return drain.Fabric(
        link_bps=link,
        stream_bps=min(stream, link),
        setup_s=(statistics.mean(setups) if setups else 0.5) + AGENT_OVERHEAD_S,
        switchover_s=statistics.mean(switchovers) if switchovers else 0.05,
        switchover_learned=bool(switchovers),
    )


def gather(
    source: HostEndpoint,
    destinations: list[HostEndpoint],
    max_downtime_ms: int | None = None,
    link_mib: int = 0,
) -> Inputs:
    """Everything the planner needs, read from the agents."""
    reachable = [(d, candidate_from_agent(d)) for d in destinations]
    probe = [{"address": d.address, "port": d.port} for d, c in reachable if c.refusal is None]
    inventory = source.agent.post("/v1/inventory", {"probe": probe}, timeout=120.0)
    vms, unreadable = [], {}
    for entry in inventory["vms"]:
        if "error" in entry:
            unreadable[entry["name"]] = f"the source could not describe it: {entry['error']}"
            continue
        try:
            vms.append(vm_from_inventory(entry, max_downtime_ms))
        except exceptions.BackendError as exc:
            unreadable[str(entry.get("name"))] = str(exc)
    return Inputs(
        vms=vms,
        candidates=[c for _, c in reachable],
        fabric=fabric_from(inventory["links"], float(inventory["initial_stream_bps"]), link_mib),
        unreadable=unreadable,
        options=options_from(inventory),
    )


class AgentBackend:
    """Starts each planned move on the source agent: the engine's request, the plan's mode."""

    def __init__(self, source: HostEndpoint, destinations: list[HostEndpoint]) -> None:
        self.source = source
        self.destinations = {d.name: d for d in destinations}

    def start(self, move: drain.Move) -> str:
        body = {**move.request().to_body(), "dest": self.destinations[move.dest].dest_body()}
        return str(self.source.agent.post("/v1/migrations", body)["id"])

    def poll(self, handle: str, move: drain.Move) -> drain_run.Status:
        record = self.source.agent.get(f"/v1/migrations/{handle}")
        processed = int(record.get("progress", {}).get("memory_processed", 0))
        predicted = max(1, move.decision.prediction.total_bytes)
        state = {"completed": "completed", "failed": "failed"}.get(record["state"], "running")
        summary = record.get("summary") or {}
        return drain_run.Status(
            state=state,
            fraction=min(1.0, processed / predicted) if state == "running" else 1.0,
            mode=record.get("mode"),
            note=record.get("error") or "",
            measured={
                k: summary.get(k)
                for k in ("total_time_ms", "downtime_ms", "bytes_moved", "switched_to_postcopy")
            },
        )
