"""``flexmig explain`` and ``flexmig migrate`` over an inventory.

An inventory says where a VM runs, how to reach a host's agent and how a
destination is addressed; it may also offer a probe inside the guest
(heartbeats, page verification) to measure a migration from the guest's side.
The lab's rig is one inventory (entry point group ``flexmig.inventories``).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from flexmig import exceptions
from flexmig.migration import downtime
from flexmig.migration.request import MigrationRequest
from flexmig.progress import MigrationProgress

POLL_S = 0.3
MIGRATION_TIMEOUT_S = 1800.0


class GuestProbe(Protocol):
    """Measurements from inside a guest: heartbeats and page verification."""

    def wait_heartbeat(self, host: str) -> Any: ...

    def heartbeat(self, since_ns: int = 0) -> Any: ...

    def verify(self) -> dict[str, Any]: ...


class Inventory(Protocol):
    def host_names(self) -> list[str]:
        """Every host the inventory knows (a drain's candidate destinations)."""

    def domain(self, vm: str) -> str:
        """The libvirt domain name of ``vm`` (however the inventory lets VMs be named)."""

    def vm_host(self, vm: str) -> str | None:
        """The host the VM runs on, or None."""

    def agent(self, host: str) -> Any:
        """A client of that host's agent (``get``/``post``)."""

    def destination(self, to: str) -> tuple[str, dict[str, Any]]:
        """(host name, the request's ``dest``: address, port, libvirt and migration URIs)."""

    def guest(self, vm: str) -> GuestProbe | None:
        """A probe inside the VM, if the inventory has one."""


def _request(lab: Inventory, request: MigrationRequest, to: str) -> tuple[str, dict[str, Any]]:
    source = lab.vm_host(request.vm)  # request.vm: the libvirt domain name (lab.domain)
    if source is None:
        raise exceptions.InvalidInput(what="VM", reason=f"{request.vm!r} is not running")
    dest_name, dest = lab.destination(to)
    if dest_name == source:
        raise exceptions.InvalidInput(
            what="destination", reason=f"{request.vm} already runs on {to}"
        )
    return source, request.to_body() | {"dest": dest}


def explain(lab: Inventory, name: str, to: str, **asked: Any) -> dict[str, Any]:
    """The source agent's plan for ``name`` (``asked``: MigrationRequest's fields)."""
    source, body = _request(lab, MigrationRequest(vm=lab.domain(name), **asked), to)
    return lab.agent(source).post("/v1/plan", body)


def start(lab: Inventory, name: str, to: str, **asked: Any) -> tuple[str, Any, str]:
    """Start a migration on the source agent: (source host, its agent, migration id)."""
    source, body = _request(lab, MigrationRequest(vm=lab.domain(name), **asked), to)
    agent = lab.agent(source)
    return source, agent, agent.post("/v1/migrations", body)["id"]


def migrate(lab: Inventory, name: str, to: str, show: bool = True, **asked: Any) -> dict[str, Any]:
    """Run a FlexMig migration; measure it from inside the guest if the inventory can.

    ``asked``: MigrationRequest's fields (mode, max_downtime_ms, bandwidth_mib,
    transport, parallel, store_writeback), validated before anything is sent.
    """
    name = lab.domain(name)
    guest = lab.guest(name)
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
    landed = lab.vm_host(name)
    if landed is None and guest is None and record["state"] == "completed":
        # No probe inside the guest and the source no longer has it: libvirt
        # reported the migration complete, so it runs on the destination.
        landed = lab.destination(to)[0]
    result["running_on"] = landed
    if landed is not None and guest is not None:
        guest.wait_heartbeat(host=landed)
        beats = guest.heartbeat(since_ns=start_ns)
        result["guest_observed_downtime_ms"] = round(beats.longest_gap_ms, 1)
        budget = result.get("downtime_budget_ms")
        if budget:
            # Never silent: the summary says by how much the guest's budget went.
            result["downtime_exceeded_ms"] = downtime.excess(budget, beats.longest_gap_ms)
            parts = dict(result.get("downtime_parts_ms") or {})
            qemu = parts.get("qemu_downtime_ms")
            parts["guest_ms"] = round(beats.longest_gap_ms, 1)
            parts["beyond_qemu_ms"] = (
                round(beats.longest_gap_ms - qemu, 1) if qemu is not None else None
            )
            result["downtime_parts_ms"] = parts
        result["guest_switchover_gap_ms"] = round(beats.switchover_gap_ms, 1)
        result["guest_longest_gap_at_ms"] = round((beats.gap_start_ns - start_ns) / 1e6)
        result["heartbeat_hosts"] = "->".join(beats.hosts)
        if record["state"] == "completed":
            result["guest_gap_taught"] = _report_gap(agent, migration_id, beats.longest_gap_ms)
        result["verify"] = guest.verify()
    return result


def _report_gap(agent: Any, migration_id: str, gap_ms: float) -> str:
    """Tell the source agent what the guest noticed: its next forecasts to the
    destination learn the guest's first run from it.  What it did, as text (a
    report that fails costs the forecast a sample, not the migration)."""
    try:
        reply = agent.post(f"/v1/migrations/{migration_id}/guest-gap", {"gap_ms": gap_ms})
    except exceptions.FlexMigError as exc:
        return f"not reported: {exc}"
    if reply.get("learnt"):
        return "learnt by the source agent"
    return f"not learnt: {reply.get('why')}"


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
