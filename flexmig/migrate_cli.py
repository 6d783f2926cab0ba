"""``flexmig explain`` and ``flexmig migrate``: the policy and modes on lab VMs."""

from __future__ import annotations

import time
from typing import Any

from agents.agent.client import DEFAULT_PORT
from flexmig import exceptions
from flexmig.lab import topology
from flexmig.lab import vm as lab_vm
from flexmig.lab.lab import Lab
from flexmig.migration.request import MigrationRequest
from flexmig.progress import MigrationProgress

POLL_S = 0.3
MIGRATION_TIMEOUT_S = 1800.0


def _request(lab: Lab, request: MigrationRequest, to: str) -> tuple[str, dict[str, Any]]:
    name = request.vm
    source = lab_vm.LabVM(lab, name).locate()
    if source is None:
        raise exceptions.InvalidInput(what="VM", reason=f"{name!r} is not running in the lab")
    dest = topology.host_by_name(lab.specs, to)
    if dest.name == source:
        raise exceptions.InvalidInput(what="destination", reason=f"{name} already runs on {to}")
    body = request.to_body() | {
        "dest": {
            "address": dest.mgmt_ip,
            "port": DEFAULT_PORT,
            "libvirt_uri": dest.libvirt_uri,
            "migration_uri": dest.migration_uri,
        },
    }
    return source, body


def explain(lab: Lab, name: str, to: str, **asked: Any) -> dict[str, Any]:
    """The source agent's plan for ``name`` (``asked``: MigrationRequest's fields)."""
    source, body = _request(lab, MigrationRequest(vm=name, **asked), to)
    return lab.agent(source).post("/v1/plan", body)


def start(lab: Lab, name: str, to: str, **asked: Any) -> tuple[str, Any, str]:
    """Start a migration on the source agent: (source host, its agent, migration id)."""
    source, body = _request(lab, MigrationRequest(vm=name, **asked), to)
    agent = lab.agent(source)
    return source, agent, agent.post("/v1/migrations", body)["id"]


def migrate(lab: Lab, name: str, to: str, show: bool = True, **asked: Any) -> dict[str, Any]:
    """Run a FlexMig migration and measure it from inside the guest."""
    guest = lab_vm.LabVM(lab, name)
    start_ns = time.monotonic_ns()
    source, agent, migration_id = start(lab, name, to, **asked)
    record = _follow(agent, migration_id, f"{name} {source}->{to.upper()}", show)
    result: dict[str, Any] = {
        "vm": name,
        "from": source,
        "to": to.upper(),
        "state": record["state"],
        "error": record["error"],
        **record["summary"],
        "explanation": record["explanation"],
        "events": [text for _ts, text in record["events"]],
    }
    landed = guest.locate()
    result["running_on"] = landed
    if landed is not None:
        guest.wait_heartbeat(host=landed)
        beats = guest.heartbeat(since_ns=start_ns)
        result["guest_observed_downtime_ms"] = round(beats.longest_gap_ms, 1)
        result["guest_switchover_gap_ms"] = round(beats.switchover_gap_ms, 1)
        result["guest_longest_gap_at_ms"] = round((beats.gap_start_ns - start_ns) / 1e6)
        result["heartbeat_hosts"] = "->".join(beats.hosts)
        result["verify"] = guest.verify()
    return result


def follow(agent: Any, migration_id: str, label: str = "", show: bool = False) -> dict[str, Any]:
    """Poll a migration until it ends (and draw its progress when ``show``)."""
    return _follow(agent, migration_id, label, show)


def _follow(agent: Any, migration_id: str, label: str, show: bool) -> dict[str, Any]:
    bar = MigrationProgress(label) if show else None
    seen_events = 0
    deadline = time.monotonic() + MIGRATION_TIMEOUT_S
    while time.monotonic() < deadline:
        record = agent.get(f"/v1/migrations/{migration_id}")
        if bar is not None:
            for _ts, text in record["events"][seen_events:]:
                bar.note(text)
            if record["progress"]:
                bar.label = f"{label} {record['phase']}"
                bar(record["progress"])
        seen_events = len(record["events"])
        if record["state"] in ("completed", "failed"):
            if bar is not None:
                bar.finish()
            return record
        time.sleep(POLL_S)
    raise exceptions.Timeout(seconds=MIGRATION_TIMEOUT_S, what=f"migration {migration_id}")
