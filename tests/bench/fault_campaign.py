"""The fault campaign (issue 18): every fault against every migration path, many times.

    FLEXMIG_LAB_NAME=<lab> .venv/bin/python -m tests.bench.fault_campaign \\
        [--budget-min 12] [--cells GLOB] [--runs N] [--list] [--table-only]

Run it alone on the machine (the lab's timings are part of what it checks).

A cell is mode x transport x fault x injection point (``cells()``).  Each run
boots nothing new: one small guest per memory kind stays up for the whole
session and goes back and forth between hosts A and B.  A run starts a
migration through the engine (``migrate_cli.start``), waits for the injection
point, injects the fault, repairs what the fault broke (the link back up, the
daemon restarted: what an operator or systemd does), follows the migration to
its end and then checks:

- the VM runs on exactly one host, and its guest's ``verify`` finds 0 bad and
  0 lost pages;
- nothing is left behind: no split reservation on either agent, no memory
  cgroup, no mover process or file (socket, token, ready, stats, log) of this
  run's migration -- judged by its id, so an earlier run's file is never
  charged to this one; a failed mover's log the agent keeps (``.failed.log``,
  within its bound) is a diagnostic, counted apart --, no store file of the VM
  on the host it does not run on (all given CLEANUP_GRACE_S to go);
- the next migration of the VM (back where it came from) completes.

A run records the transport its migration really used (the agent's record
says it): where the planner chose another than the cell's (postcopy never
rides the mover where libvirt >= 10 turns postcopy-preempt on), the fault is
not injected and the run is counted as not applicable on those hosts, with
the planner's reason, never as a run of the cell.

Results accumulate across sessions in ``docs/benchmarks/faults.json``, keyed by
cell (a session runs the cells with the fewest runs first, until its time
budget is spent), and ``docs/benchmarks/faults.md`` is regenerated from it.
A lost VM or page is a bug: the run stops the campaign and says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import json
import random
import time
from pathlib import Path
from typing import Any

import libvirt

from agents.agent import mover_files as agent_mover_files
from flexmig import exceptions, hypervisor, migrate_cli, processutil
from flexmig_lab import fabric, vm
from flexmig_lab.lab import CGROUP_ROOT, Lab
from tests.bench import fault_runs
from tests.bench.fault_findings import FINDINGS
from tests.bench.fault_inject import (
    fill_store,
    restart_agent,
    restart_libvirtd,
    small_stores,
    store_path,
)

RESULTS = Path("docs/benchmarks/faults.json")
TABLE = Path("docs/benchmarks/faults.md")
COMMAND = "FLEXMIG_LAB_NAME=<lab> .venv/bin/python -m tests.bench.fault_campaign --budget-min 12"
TARGET_RUNS = 20
BANDWIDTH_MIB = 24  # slow enough that a fault lands inside the migration
# Small guests keep a run short: the precopy one converges in a few rounds,
# the postcopy one dirties faster than the capped link (hybrid really switches).
GUESTS = {
    "file": dict(ram="256M", workload="dirtier:wss=64M,rate=1500", memory_backing="file"),
    "anon": dict(ram="256M", workload="dirtier:wss=96M,rate=60000", memory_backing="anonymous"),
}
MODES = {"precopy": "file", "postcopy": "anon", "split": "file"}
SPLIT_BUDGET_MB = 300  # B offers 140 MiB for the 256 MiB guest (QEMU takes 160): split
FULL_BUDGET_MB = 4096
TRANSPORTS = ("qemu-tcp", "mover")
FAULTS = (
    "kill-src-agent", "kill-dst-agent", "kill-src-mover", "kill-dst-mover", "cut-2s",
    "cut-30s", "restart-src-libvirtd", "restart-dst-libvirtd", "kill-dst-qemu",
    "fill-dst-store",
)  # fmt: skip
POINTS = ("round", "postcopy-switch", "switchover")
# What each injection point waits for (a timeout names it).
POINT_WAITS = {
    "round": "precopy to move bytes (libvirt's memory_processed > 0)",
    "postcopy-switch": "the switch to postcopy",
    "switchover": "precopy to have under a tenth of memory left",
}
PHASE_TIMEOUT_S = 120.0
ENDED_FIRST = "ended before the fault"
SETTLE_TIMEOUT_S = 180.0
AGENT_STATE_DIR = "/run/flexmig"  # the agents' state_dir inside a lab host
# A cell whose migrations ran over another transport this many times on one
# libvirt is known not to apply there (the planner's choice, not chance).
NA_SKIP_AFTER = 2
# Movers nobody finishes (their migration's agent died) are retired by the
# other agent 60 s after they end (agents.agent.movers.UNCLAIMED_S), checked every 5 s.
CLEANUP_GRACE_S = 75.0
# A destination QEMU killed after the switch to postcopy takes the guest's
# newest pages with it (FINDINGS): each run stops the campaign, so a session
# runs these only when asked by name (--cells with the full key).
LOSS_BY_DESIGN = frozenset(
    f"postcopy/{transport}/kill-dst-qemu/postcopy-switch" for transport in TRANSPORTS
)
COUNTED = ("completed", "failed", "vm_lost", "bad_pages", "lost_pages", "leftovers", "next_ok",
           "recovered")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Cell:
    mode: str
    transport: str
    fault: str
    point: str

    @property
    def key(self) -> str:
        return f"{self.mode}/{self.transport}/{self.fault}/{self.point}"


def cells() -> list[Cell]:
    """Every combination that exists: movers only on the mover transport, the
    postcopy switch only in hybrid postcopy, a store to fill only for guests
    whose memory is a file in it."""
    found = []
    for mode in MODES:
        for transport in TRANSPORTS:
            for fault in FAULTS:
                if "mover" in fault and transport != "mover":
                    continue
                if fault == "fill-dst-store" and MODES[mode] != "file":
                    continue  # an anonymous-memory guest writes nothing to the store
                for point in POINTS:
                    if point == "postcopy-switch" and mode != "postcopy":
                        continue
                    found.append(Cell(mode, transport, fault, point))
    return found


# -- results ---------------------------------------------------------------------
def load_results(path: Path = RESULTS) -> dict[str, dict[str, Any]]:
    return json.loads(path.read_text()) if path.exists() else {}


def not_applicable(cell: Cell, used: dict[str, Any] | None) -> str | None:
    """Why a run did not test ``cell`` (None: it did): the migration went over
    another transport than the cell's (``used``: the agent's record's
    ``transport``, None while no plan was made).

    >>> cell = Cell("postcopy", "mover", "kill-src-mover", "postcopy-switch")
    >>> not_applicable(cell, {"transport": "qemu-tcp", "reason": "preempt"})
    'ran over qemu-tcp, not mover: preempt'
    >>> not_applicable(cell, {"transport": "mover", "reason": "asked"}) is None
    True
    >>> not_applicable(cell, None) is None
    True
    """
    if not used or used.get("transport") in (None, cell.transport):
        return None
    return f"ran over {used['transport']}, not {cell.transport}: {used.get('reason', '')}"


def point_reached(record: dict[str, Any], point: str) -> bool:
    """Whether the migration (the source agent's record) reached ``point``, or ended.

    "round" waits for bytes moved, not the phase alone: the phase says precopy
    from libvirt's first job statistics, before QEMU has connected to its
    transport, and a mover killed then only refused QEMU's connection.

    >>> running = {"state": "running", "phase": "precopy", "progress": {"memory_processed": 0}}
    >>> point_reached(running, "round"), point_reached(running | {"state": "failed"}, "round")
    (False, True)
    >>> point_reached(running | {"progress": {"memory_processed": 4096}}, "round")
    True
    """
    if record["state"] not in ("planning", "running"):
        return True
    progress = record.get("progress") or {}
    if point == "round":
        return record["phase"] == "precopy" and progress.get("memory_processed", 0) > 0
    if point == "postcopy-switch":
        return record["phase"] == "postcopy"
    total = progress.get("memory_total") or 0
    return bool(total) and progress.get("memory_remaining", total) < total // 10


def add_not_applicable(results: dict[str, dict[str, Any]], cell: Cell, run: dict[str, Any]) -> None:
    """A run that did not test its cell: counted by libvirt, apart from its runs."""
    row = results.setdefault(cell.key, {"runs": 0, "notes": []})
    by_libvirt = row.setdefault("not_applicable", {})
    version = run.get("libvirt") or "unrecorded"
    by_libvirt[version] = by_libvirt.get(version, 0) + 1
    reasons = row.setdefault("not_applicable_why", {})
    reasons.setdefault(version, run["not_applicable"][:200])
    # It tested no fault of the cell, but what it left behind is still a bug.
    for note in run.get("leftovers", []):
        short = f"(n/a run) {note}"[:120]
        if short not in row["notes"] and len(row["notes"]) < 4:
            row["notes"].append(short)


def add_run(results: dict[str, dict[str, Any]], cell: Cell, run: dict[str, Any]) -> None:
    if run.get("not_applicable"):
        add_not_applicable(results, cell, run)
        return
    row = results.setdefault(cell.key, {"runs": 0, "notes": []})
    for key in COUNTED:
        row.setdefault(key, 0)
    # Which libvirt the lab hosts ran: postcopy recovery depends on it (FINDINGS).
    by_libvirt = row.setdefault("libvirt", {"unrecorded": row["runs"]} if row["runs"] else {})
    version = run.get("libvirt") or "unrecorded"
    by_libvirt[version] = by_libvirt.get(version, 0) + 1
    row["runs"] += 1
    row["completed" if run["state"] == "completed" else "failed"] += 1
    row["vm_lost"] += int(run["hosts"] != 1)
    row["bad_pages"] += run["bad"]
    row["lost_pages"] += run["lost"]
    row["leftovers"] += int(bool(run["leftovers"]))
    row["kept_logs"] = row.get("kept_logs", 0) + len(run.get("kept_logs", []))
    row["next_ok"] += int(run["next_ok"])
    row["recovered"] += int(run["recovered"])
    if run.get("switch_held"):  # the controller kept the switch off a still stream
        row["switch_held"] = row.get("switch_held", 0) + 1
    for note in run["leftovers"] + ([run["error"]] if run["error"] else []):
        short = note[:120]
        if short not in row["notes"] and len(row["notes"]) < 4:
            row["notes"].append(short)


def render_table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "# Fault campaign (issue 18, part 1)",
        "",
        f"Command: `{COMMAND}` (accumulates into `{RESULTS}`; re-run to add runs).",
        f"Target: {TARGET_RUNS} runs per cell; {len(cells())} cells. A run injects the",
        "fault at the point, repairs it (link up, daemon restarted; a filled store",
        "is freed once the migration ended), follows the migration to its end,",
        "checks the VM runs on exactly one host, the guest's",
        "`verify`, leftovers of that run's migration (split reservation, memory cgroup,",
        "mover process, its socket/token/ready/stats/log files, store file on the other",
        "host) and that the next migration completes. A failed mover's log kept by the",
        "agent (`.failed.log`, bounded) is a diagnostic, not a leftover. A run whose",
        "migration went over another transport than its cell's (the planner's choice on",
        "that host) did not test the cell: it is counted under n/a, not in runs.",
        "",
        "| cell (mode/transport/fault/point) | runs | completed | failed | VM lost "
        "| bad pages | lost pages | leftovers | next ok | postcopy resumed | n/a |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in cells():
        row = results.get(cell.key)
        if row is not None:
            lines.append(_table_row(cell, row))
    done = sum(1 for c in cells() if results.get(c.key, {}).get("runs", 0) >= TARGET_RUNS)
    started = sum(1 for c in cells() if results.get(c.key, {}).get("runs", 0))
    lines += [
        "",
        f"Cells run so far: {started} of {len(cells())}; at {TARGET_RUNS} runs: {done}.",
        "",
        *_losses(results),
        *fault_runs.render(fault_runs.load()),
        "Notes (first errors and leftovers seen per cell):",
        "",
    ]
    for cell in cells():
        for note in results.get(cell.key, {}).get("notes", []):
            lines.append(f"- {cell.key}: {note}")
    lines += ["", "Not applicable on these hosts (runs that went over another transport):", ""]
    for cell in cells():
        for version, why in sorted(results.get(cell.key, {}).get("not_applicable_why", {}).items()):
            count = results[cell.key]["not_applicable"][version]
            lines.append(f"- {cell.key}: libvirt {version}, {count} run(s): {why}")
    lines += ["", "Runs whose switch to postcopy was held on a still stream (controller):", ""]
    for cell in cells():
        if results.get(cell.key, {}).get("switch_held"):
            lines.append(f"- {cell.key}: {results[cell.key]['switch_held']}")
    lines += ["", "Runs by the lab hosts' libvirt (QEMU 10.0 throughout):", ""]
    for cell in cells():
        by_libvirt = results.get(cell.key, {}).get("libvirt")
        if by_libvirt:
            counts = ", ".join(f"{v}: {n}" for v, n in sorted(by_libvirt.items()))
            lines.append(f"- {cell.key}: {counts}")
    lines += ["", "Findings:", "", *[f"- {finding}" for finding in FINDINGS]]
    return "\n".join(lines) + "\n"


def _losses(results: dict[str, dict[str, Any]]) -> list[str]:
    """Where the VMs lost so far were: the cells that lose by design, the rest."""
    lost = {key: row.get("vm_lost", 0) for key, row in results.items() if row.get("vm_lost")}
    by_design = sum(n for key, n in lost.items() if key in LOSS_BY_DESIGN)
    others = ", ".join(f"{key} {n}" for key, n in sorted(lost.items()) if key not in LOSS_BY_DESIGN)
    runs = sum(row.get("runs", 0) for row in results.values())
    return [
        f"Runs: {runs}; VMs lost: {sum(lost.values())}, of which {by_design} in the cells that "
        "lose the VM by postcopy's design (a destination QEMU killed after the switch; run "
        f"only when named) and {sum(lost.values()) - by_design} elsewhere"
        + (f" ({others}; the findings below say what each was and what changed)" if others else "")
        + ".",
        "",
    ]


def _table_row(cell: Cell, row: dict[str, Any]) -> str:
    counts = [row.get(k, 0) for k in ("runs", *COUNTED)]
    na = sum(row.get("not_applicable", {}).values())
    return f"| {cell.key} | " + " | ".join(str(n) for n in [*counts, na]) + " |"


def save(results: dict[str, dict[str, Any]]) -> None:
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    TABLE.write_text(render_table(results))


# -- one run ---------------------------------------------------------------------
class Campaign:
    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.guests: dict[str, str] = {}  # memory kind -> VM name
        self.budgets: dict[str, int] = {}

    def budget(self, host: str, mb: int) -> None:
        """Set a host's VM budget (restarting its agent) only when it changes."""
        if self.budgets.get(host, FULL_BUDGET_MB) != mb:
            self.lab.set_budget(host, mb)
            self.budgets[host] = mb

    def guest(self, kind: str) -> str:
        name = self.guests.get(kind)
        if name is None:
            name = f"fc{kind}"
            if name not in vm.list_vms(self.lab):
                vm.create(self.lab, "A", name=name, **GUESTS[kind])
            self.guests[kind] = name
        return name

    def run(self, cell: Cell) -> dict[str, Any]:
        name = self.guest(MODES[cell.mode])
        src = self.lab.vm_host(name)
        if src is None:
            raise CampaignStop(f"{name} runs nowhere before the run")
        dst = "B" if src == "A" else "A"
        self.budget(dst, SPLIT_BUDGET_MB if cell.mode == "split" else FULL_BUDGET_MB)
        request = dict(mode=cell.mode, transport=cell.transport, bandwidth_mib=BANDWIDTH_MIB)
        try:
            _, agent, mid = migrate_cli.start(self.lab, name, dst, **request)
        except exceptions.FlexMigError as exc:
            self.budget(dst, FULL_BUDGET_MB)
            return self.check(name, {"state": "refused", "error": str(exc)}, src, dst, "", False)
        missed = ENDED_FIRST
        try:
            at_point = self.wait_point(agent, mid, cell.point)
        except exceptions.Timeout as exc:
            at_point, missed = {}, f"not injected: {exc}"
        # The planner may have chosen another transport (postcopy never rides
        # the mover where libvirt turns preempt on): then the fault would test
        # nothing of the cell; the run still checks the VM and its leftovers.
        why_not = not_applicable(cell, at_point.get("transport"))
        injected = at_point.get("state") in ("planning", "running") and not why_not
        repair = self.inject(cell.fault, src, dst, name) if injected else None
        record = self.follow(src, mid)
        if repair is not None:
            repair()
        self.budget(dst, FULL_BUDGET_MB)
        # (An n/a run's fault was left out on purpose: not "ended before the fault".)
        run = self.check(name, record, src, dst, mid, injected or bool(why_not), missed)
        events = [text for _ts, text in record.get("events", [])]
        run["switch_held"] = any(text.startswith("switch to postcopy held") for text in events)
        used = record.get("transport") or at_point.get("transport") or {}
        run["transport"] = used.get("transport")
        run["not_applicable"] = why_not or not_applicable(cell, used)
        return run

    def wait_point(self, agent: Any, mid: str, point: str) -> dict[str, Any]:
        """The migration's record once it reached ``point``, or ended first."""

        def reached() -> dict[str, Any] | None:
            record = agent.get(f"/v1/migrations/{mid}")
            return record if point_reached(record, point) else None

        what = f"point {point}: {POINT_WAITS[point]}"
        record = processutil.wait_for(reached, timeout=PHASE_TIMEOUT_S, interval=0.1, what=what)
        if point == "round":
            time.sleep(random.uniform(0.2, 2.0))  # somewhere inside a round
        return record

    def inject(self, fault: str, src: str, dst: str, name: str) -> Any:
        """Inject ``fault``; a fault that lasts until the migration ends returns
        its repair (what the operator does afterwards), the others None."""
        host = {"src": self.lab.host(src), "dst": self.lab.host(dst)}
        if fault == "fill-dst-store":
            return fill_store(host["dst"])
        side = "src" if "-src-" in fault else "dst"
        if fault.endswith("-agent"):
            host[side].ns.run(["pkill", "-KILL", "-f", "agents.agent.service"], check=False)
            time.sleep(1.0)  # systemd's restart delay, roughly
            restart_agent(host[side])
        elif fault.endswith("-mover"):
            host[side].ns.run(["pkill", "-KILL", "-f", "flexmig-mover"], check=False)
        elif fault.startswith("cut-"):
            spec = host["dst"].spec
            fabric.set_mgmt_link(spec, False)
            time.sleep(float(fault[4:-1]))
            fabric.set_mgmt_link(spec, True)
        elif fault.endswith("-libvirtd"):
            restart_libvirtd(host[side])
        elif fault == "kill-dst-qemu":
            # Only the migrating VM's QEMU: the other guest may be parked on
            # that host (killing it lost a bystander VM, session 18).
            host["dst"].ns.run(["pkill", "-KILL", "-f", qemu_pattern(name)], check=False)
        else:
            raise ValueError(fault)
        return None

    def follow(self, src: str, mid: str) -> dict[str, Any]:
        """The migration's end as its source agent reports it (a restarted agent
        no longer knows it: then libvirt's view is all there is)."""
        try:
            return migrate_cli.follow(self.lab.agent(src), mid)
        except (exceptions.FlexMigError, KeyError, OSError) as exc:
            return {"state": "unknown", "error": f"not followed: {exc}", "summary": {}}

    def check(self, name: str, record: dict[str, Any], src: str, dst: str, mid: str,
              injected: bool, missed: str = ENDED_FIRST) -> dict[str, Any]:  # fmt: skip
        running = self.settled(name)
        run: dict[str, Any] = {
            "state": record.get("state"),
            "error": record.get("error") or ("" if injected else missed),
            "hosts": len(running),
            "bad": 0,
            "lost": 0,
            "leftovers": [],
            "kept_logs": [],
            "next_ok": False,
            "recovered": bool((record.get("summary") or {}).get("recovered")),
        }
        if len(running) != 1:
            return run
        # The agent's reported end must say where the VM is (a restarted agent's too).
        expected = {"completed": dst, "failed": src}.get(str(run["state"]))
        if expected is not None and running[0] != expected:
            run["error"] = (
                f"{run['error']}; reported {run['state']} but the VM runs on {running[0]}"
            )
        guest = self.lab.guest(name)
        try:
            guest.wait_heartbeat(host=running[0])
        except exceptions.GuestError as exc:
            # Active but silent: paused (a host whose libvirtd died is not
            # counted by running_on, so "one host" can hide a VM paused on both).
            run["hosts"], run["error"] = 0, f"{run['error']}; no heartbeat: {exc}"[:300]
            return run
        check = guest.verify()
        run["bad"], run["lost"] = check["bad"], check["lost"]
        run["leftovers"], run["kept_logs"] = self.leftovers_settled(name, running[0], mid)
        back = dst if running[0] == src else src
        try:
            result = migrate_cli.migrate(self.lab, name, back, show=False)
        except exceptions.FlexMigError as exc:
            run["error"] = f"{run['error']}; next migration: {exc}".lstrip("; ")
            return run
        run["next_ok"] = result["state"] == "completed" and result["verify"]["bad"] == 0
        if not run["next_ok"]:
            run["error"] = f"{run['error']}; next migration: {result['error']}".lstrip("; ")
        return run

    def settled(self, name: str) -> list[str]:
        """The hosts running the VM once no libvirt job on it is left (a job that
        outlived its agent, a paused postcopy awaiting recovery), or as they are
        after SETTLE_TIMEOUT_S: a VM paused on both hosts then counts as lost."""
        seen: list[str] = []

        def quiet() -> bool:
            nonlocal seen
            seen, busy = self.running_on(name)
            return len(seen) == 1 and not busy

        try:
            processutil.wait_for(quiet, timeout=SETTLE_TIMEOUT_S, interval=1.0, what="settle")
        except exceptions.Timeout:
            pass
        return seen

    def running_on(self, name: str) -> tuple[list[str], bool]:
        """(hosts where the domain is active, whether any has a job running)."""
        found, busy = [], False
        for host in self.lab.hosts():
            try:
                with hypervisor.connect(host.local_uri, host.name) as conn:
                    dom = hypervisor.find_domain(conn, name)
                    if dom is not None and dom.isActive():
                        found.append(host.name)
                        busy = busy or dom.jobInfo()[0] != libvirt.VIR_DOMAIN_JOB_NONE
            except (exceptions.FlexMigError, libvirt.libvirtError):
                busy = True  # its libvirtd is (re)starting
        return found, busy

    def state_files(self) -> dict[str, list[str]]:
        """Every host's agent state files: host -> file names."""
        found = {}
        for host in self.lab.hosts():
            state = host.ns.root_path(AGENT_STATE_DIR)
            found[host.name] = sorted(p.name for p in state.iterdir()) if state.exists() else []
        return found

    def leftovers_settled(self, name: str, where: str, mid: str) -> tuple[list[str], list[str]]:
        """``leftovers`` once the agents had CLEANUP_GRACE_S to clean up: movers
        whose migration's agent died are retired that long after they end."""
        deadline = time.monotonic() + CLEANUP_GRACE_S
        while True:
            found, kept = self.leftovers(name, where, mid)
            if not found or time.monotonic() > deadline:
                return found, kept
            time.sleep(3.0)

    def leftovers(self, name: str, where: str, mid: str) -> tuple[list[str], list[str]]:
        """What this run's migration left behind, and the failed movers' logs the
        agents kept (diagnostics, not leftovers, while within their bound)."""
        found, kept = [], []
        for host, names in self.state_files().items():
            stray, logs, over = run_files(names, mid)
            found += [f"mover files on {host}: {stray[:3]}"] if stray else []
            found += [f"{over} failed mover logs on {host} past the bound"] if over else []
            kept += [f"{host}:{log}" for log in logs]
        for host in self.lab.hosts():
            found += self.agent_leftovers(host.name, name, where)
            # Its token file names the pair (and a resume's pair id starts with mid).
            pgrep = ["pgrep", "-f", f"[f]lexmig-mover .*/mover-{mid}"]
            movers = host.ns.run(pgrep, check=False).stdout.split()
            if movers:
                found.append(f"{len(movers)} mover process(es) on {host.name}")
            if host.name != where:
                group = CGROUP_ROOT / f"lab-{host.name.lower()}" / name
                if group.exists():
                    found.append(f"memory cgroup {group}")
                files = list(store_path(host).rglob(f"*{name}*"))
                if files:
                    found.append(f"store files on {host.name}: {[p.name for p in files[:3]]}")
        return found, kept

    def agent_leftovers(self, host: str, name: str, where: str) -> list[str]:
        """A reservation left on the host the VM is not on; an agent that is not
        answering after the run is a finding too (and is started again)."""
        try:
            reservation = self.lab.agent(host).get(f"/v1/split/{name}")["reservation"]
        except exceptions.FlexMigError as exc:
            restart_agent(self.lab.host(host))
            return [f"agent on {host} not answering after the run ({exc})"]
        return [f"reservation on {host}"] if reservation is not None and host != where else []


def run_files(names: list[str], mid: str) -> tuple[list[str], list[str], int]:
    """One host's state files judged for the run of migration ``mid``: (its
    leftovers, its movers' kept failed logs, how many kept logs exceed the
    agent's bound).  Files of other migrations are not this run's (a resume's
    pair id starts with the migration's: recovery.resume_transport_id).

    >>> run_files(["mover-ab12-send.log", "mig-ab120001.sock", "mover-ab12-recv.failed.log",
    ...            "mover-ff00-send.ready", "links.json"], "ab12")
    (['mig-ab120001.sock', 'mover-ab12-send.log'], ['mover-ab12-recv.failed.log'], 0)
    """
    ours = [n for n in names if n.startswith((f"mover-{mid}", f"mig-{mid}"))]
    kept = [n for n in ours if n.endswith(agent_mover_files.FAILED_LOG)]
    every_kept = [n for n in names if n.endswith(agent_mover_files.FAILED_LOG)]
    over = max(0, len(every_kept) - agent_mover_files.KEPT_FAILED_LOGS)
    return sorted(set(ours) - set(kept)), kept, over


def lab_libvirt(lab: Lab) -> str:
    """The libvirt version the lab hosts run (the system's, or the backport)."""
    host = lab.hosts()[0]
    with hypervisor.connect(host.local_uri, host.name) as conn:
        number = conn.getLibVersion()
    return f"{number // 1_000_000}.{number // 1000 % 1000}.{number % 1000}"


def qemu_pattern(name: str) -> str:
    """pkill's pattern for the QEMU of VM ``name`` (libvirt's ``-name guest=<name>,``).

    >>> import re
    >>> line = "qemu-system-x86_64 -name guest=fcfile,debug-threads=on -S"
    >>> bool(re.search(qemu_pattern("fcfile"), line)), bool(re.search(qemu_pattern("fcanon"), line))
    (True, False)
    """
    return f"qemu-system.* -name guest={name},"


class CampaignStop(Exception):
    """A VM or page was lost: stop and look (a bug, not a row)."""


# -- the session -----------------------------------------------------------------
def choose(
    results: dict[str, dict[str, Any]], patterns: list[str], runs: int, libvirt: str = ""
) -> list[Cell]:
    """The cells to run, fewest runs first (so sessions fill the matrix evenly);
    not those known not to apply on hosts with this ``libvirt``, nor those
    that lose the VM by postcopy's design unless named in full."""
    todo = [c for c in cells() if any(fnmatch.fnmatch(c.key, p) for p in patterns)]
    todo = [c for c in todo if c.key not in LOSS_BY_DESIGN or c.key in patterns]
    todo = [c for c in todo if results.get(c.key, {}).get("runs", 0) < TARGET_RUNS]
    todo = [
        c for c in todo
        if results.get(c.key, {}).get("not_applicable", {}).get(libvirt, 0) < NA_SKIP_AFTER
    ]  # fmt: skip
    todo.sort(key=lambda c: (results.get(c.key, {}).get("runs", 0), c.key))
    return [c for c in todo for _ in range(runs)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budget-min",
        type=float,
        default=12.0,
        help="stop starting runs after this many minutes (lab lock holds)",
    )
    parser.add_argument(
        "--cells",
        action="append",
        help="glob over mode/transport/fault/point (repeatable; default all)",
    )
    parser.add_argument("--runs", type=int, default=1, help="runs per chosen cell this session")
    parser.add_argument("--list", action="store_true", help="print the cells and exit")
    parser.add_argument("--table-only", action="store_true", help="re-render the table")
    parser.add_argument(
        "--keep-on-stop",
        action="store_true",
        help="leave the lab up when a run loses a VM or a page, to look (flexmig-lab down ends it)",
    )
    args = parser.parse_args(argv)  # fmt: skip
    results = load_results()
    if args.list:
        for cell in cells():
            print(cell.key, results.get(cell.key, {}).get("runs", 0))
        return 0
    if args.table_only:
        save(results)
        return 0
    deadline = time.monotonic() + args.budget_min * 60
    lab = Lab()
    lab.up()
    small_stores(lab)
    campaign = Campaign(lab)
    libvirt_version, code = lab_libvirt(lab), fault_runs.code_version()
    status = 0
    try:
        for cell in choose(results, args.cells or ["*"], args.runs, libvirt_version):
            if time.monotonic() >= deadline:
                break
            started = time.monotonic()
            run = campaign.run(cell) | {"libvirt": libvirt_version}
            took = time.monotonic() - started
            add_run(results, cell, run)
            fault_runs.log_run(cell.key, run, took, code)
            save(results)
            print(f"{datetime.datetime.now():%H:%M:%S} {cell.key}: {json.dumps(run)} "
                  f"({took:.0f} s)", flush=True)  # fmt: skip
            if run["hosts"] != 1 or run["bad"] or run["lost"]:
                raise CampaignStop(f"{cell.key}: {run}")
    except CampaignStop as exc:
        print(f"STOP: a VM or page was lost: {exc}", flush=True)
        status = 1
    finally:
        if status and args.keep_on_stop:
            print(f"the lab in {lab.dir} is left up as it was: .venv/bin/flexmig-lab down")
        else:
            lab.down()
    return status


if __name__ == "__main__":
    raise SystemExit(main())
