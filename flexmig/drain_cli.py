"""``flexmig drain <host>``: plan, show, run, verify every guest.

The inventory supplies the hosts' endpoints and, after the drain, if it has
a probe inside the guests, each guest's own check of its memory (``verify``:
bad and lost pages).
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable
from typing import Any

from flexmig import drain_agents, drain_run, exceptions
from flexmig.migrate_cli import Inventory
from flexmig.policy import drain, drain_downtime


def endpoints(lab: Inventory) -> dict[str, drain_agents.HostEndpoint]:
    found = {}
    for name in lab.host_names():
        _, dest = lab.destination(name)
        found[name] = drain_agents.HostEndpoint(
            name=name,
            agent=lab.agent(name),
            address=dest["address"],
            port=dest["port"],
            libvirt_uri=dest["libvirt_uri"],
            migration_uri=dest["migration_uri"],
        )
    return found


def prepare(
    lab: Inventory,
    source: str,
    max_concurrency: int = 4,
    link_mib: int = 0,
    max_downtime_ms: int | None = None,
    cpus: int = 0,
    floor_ms: float = 0.0,
) -> tuple[drain.DrainPlan, drain_agents.Inputs, drain_run.Backend]:
    """Gather the facts and plan; nothing moves.

    ``cpus``: the cores the source's guests and the drain's migrations share
    (0: not modelled, CPU to spare); ``floor_ms``: the longest gap its guests
    see with no migration.  With them the plan keeps guests within their
    downtime budgets where it can and names the ones it cannot.
    """
    hosts = endpoints(lab)
    src, _ = lab.destination(source)
    dests = [h for name, h in hosts.items() if name != src]
    inputs = drain_agents.gather(hosts[src], dests, max_downtime_ms, link_mib)
    plan = drain.plan(
        src,
        inputs.vms,
        inputs.candidates,
        inputs.fabric,
        max_concurrency,
        inputs.options,
        drain_downtime.host_load([v.dirty.initial_rate() for v in inputs.vms], cpus, floor_ms),
    )
    if inputs.unreadable:
        plan = dataclasses.replace(plan, unplaceable={**plan.unplaceable, **inputs.unreadable})
    backend = drain_agents.AgentBackend(hosts[src], dests)
    return plan, inputs, backend


def execute(
    lab: Inventory,
    plan: drain.DrainPlan,
    inputs: drain_agents.Inputs,
    backend: drain_run.Backend,
    max_concurrency: int,
    on_event: Callable[[str], None] = print,
    verify: bool = True,
    started: Callable[[drain_run.DrainRun], None] | None = None,
) -> drain_run.DrainReport:
    """Run the plan; the first SIGINT aborts (start nothing more), a second one stops."""
    run = drain_run.DrainRun(
        plan, inputs.vms, inputs.candidates, backend, max_concurrency, on_event
    )
    if started is not None:
        started(run)

    def on_sigint(_sig: int, _frame: Any) -> None:
        on_event("drain: abort requested; running migrations finish or roll back")
        run.abort()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = _install(on_sigint)
    try:
        report = run.run()
    finally:
        _restore(previous)
    if verify:
        _verify(lab, report)
    return report


def _install(handler: Callable[[int, Any], None]) -> Any:
    try:
        return signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread (tests run a drain in a thread)
        return None


def _restore(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGINT, previous)


def _verify(lab: Inventory, report: drain_run.DrainReport) -> None:
    """Every guest checks its memory where it runs now, moved or not."""
    for out in report.outcomes:
        guest = lab.guest(out.vm)
        if guest is None:
            continue  # the inventory has no probe inside its guests
        where = lab.vm_host(out.vm)
        if where is None:
            check = {"bad": -1, "lost": -1}
        else:
            try:
                check = guest.verify()
            except exceptions.GuestError as exc:
                if "no-workset" not in str(exc):
                    raise
                continue  # no dirtier, nothing to check: its kernel booted and runs
        report.measured.setdefault(out.vm, {}).update(
            {"running_on": where, "bad": check.get("bad"), "lost": check.get("lost")}
        )


def guests_ok(report: drain_run.DrainReport) -> bool:
    return all(
        m.get("bad") == 0 and m.get("lost") == 0 for m in report.measured.values() if "bad" in m
    )
