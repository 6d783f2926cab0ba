"""Draining one host: Nova's default way, fixed concurrency, FlexMig's plan, in one run.

    .venv/bin/python -m tests.bench.bench_drain [--out FILE] [--strategies ...]

Lab: 4 hosts; host A runs seven small TCG guests of mixed workloads (idle,
moderate, hot, and one too big for any destination's free RAM); A's uplink is
shaped to LINK_MIB MiB/s in both directions (every migration leaving A
shares it); B, C and D offer BUDGET_MB MiB to VMs.  Each strategy gets the
same fresh guests on A, in the same listing order, and drains A:

- nova-serial: Nova's default (``max_concurrent_live_migrations = 1``):
  one at a time in listing order, libvirt precopy as Nova drives it
  (peer-to-peer; downtime 500 ms reached in 10 steps, 75 s per GiB apart; no
  postcopy, no auto-converge; aborted after the completion timeout, 800 s per
  GiB of RAM); each VM to the destination with the most free RAM that holds
  it with QEMU's own (Nova's RAM weigher); a VM none holds is NoValidHost;
- fixed-2, fixed-4: the same, 2 or 4 at once;
- flexmig: ``flexmig drain A`` (plan, then run it), timed from the moment
  the drain starts asking the agents, sampling included.

Every guest runs ``verify`` afterwards (bad or lost pages); "moved" counts
VMs that left A.  The lab is the caller's to share: run the whole comparison
under whatever lock the machine's users agree on (one run, so the ratios are
side by side).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import os
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

from flexmig import drain_cli, exceptions, processutil
from flexmig_lab import image, topology, vm
from flexmig_lab.lab import Lab

MIB = 2**20
LINK_MIB = 48
BUDGET_MB = 800
QEMU_OVERHEAD_MB = 160
DEFAULT_OUT = Path("docs/benchmarks/drain.md")
# Listing order (Nova lists a host's servers in creation order here).
GUESTS = (
    ("d-idle1", "256M", "dirtier:wss=32M,rate=0", "file"),
    ("d-hot", "256M", "dirtier:wss=128M,rate=30000", "anonymous"),
    ("d-mod1", "256M", "dirtier:wss=64M,rate=2000", "file"),
    ("d-big", "768M", "dirtier:wss=64M,rate=1000", "file"),
    ("d-idle2", "256M", "dirtier:wss=32M,rate=0", "file"),
    ("d-mod2", "256M", "dirtier:wss=64M,rate=2000", "file"),
    ("d-idle3", "256M", "dirtier:wss=32M,rate=0", "file"),
)
STRATEGIES = ("nova-serial", "flexmig", "fixed-2", "fixed-4")
COMPLETION_TIMEOUT_S_PER_GIB = 800
NOVA_MAX_DOWNTIME_MS = 500  # Nova's [libvirt] live_migration_downtime: its last step


def shape_uplink(lab: Lab, host: str, mib: int) -> None:
    """Token-bucket A's management uplink both ways: the link all drains share."""
    spec = topology.host_by_name(lab.specs, host)
    rate = f"{mib * 8 * 1.048576:.0f}mbit"
    for ns, dev in (
        (spec.netns, topology.HOST_MGMT_IF),
        (topology.FABRIC_NETNS, spec.fabric_mgmt_if),
    ):
        processutil.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "512kb",
                "latency",
                "100ms",
            ]
        )


def nova_steps(ram_gib: float) -> list[tuple[float, int]]:
    from tests.bench.bench_modes import nova_downtime_steps

    return nova_downtime_steps(ram_gib)


def nova_control(ram_gib: float):
    steps = nova_steps(ram_gib)
    timeout = COMPLETION_TIMEOUT_S_PER_GIB * ram_gib
    applied = {"index": -1}

    def control(dom, stats, elapsed):
        index = max(i for i, (at, _) in enumerate(steps) if elapsed >= at)
        if index != applied["index"]:
            dom.migrateSetMaxDowntime(steps[index][1])
            applied["index"] = index
        if elapsed > timeout:
            dom.abortJob()

    return control


def nova_placement(guests, budgets: dict[str, int]) -> dict[str, str | None]:
    """Nova's RAM weigher: the most free RAM that holds the VM with QEMU's own."""
    free = dict(budgets)
    where: dict[str, str | None] = {}
    for name, ram, _, _ in guests:
        mib = int(ram.rstrip("M"))
        fits = [h for h, f in free.items() if f >= mib + QEMU_OVERHEAD_MB]
        dest = max(fits, key=lambda h: free[h]) if fits else None
        where[name] = dest
        if dest:
            free[dest] -= mib
    return where


def run_nova(lab: Lab, concurrency: int, budgets: dict[str, int]) -> dict[str, Any]:
    where = nova_placement(GUESTS, budgets)
    outcomes: dict[str, str] = {n: "NoValidHost" for n, d in where.items() if d is None}
    ram = {n: int(r.rstrip("M")) / 1024 for n, r, _, _ in GUESTS}
    lock = threading.Lock()

    def one(name: str) -> None:
        try:
            vm.migrate_plain(lab, name, where[name], control=nova_control(ram[name]))
            state = "moved"
        except exceptions.FlexMigError as exc:
            state = f"failed: {str(exc)[:50]}"
        with lock:
            outcomes[name] = state

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, [n for n, d in where.items() if d is not None]))
    return {"total_s": time.monotonic() - t0, "outcomes": outcomes}


def run_flexmig(lab: Lab) -> dict[str, Any]:
    t0 = time.monotonic()
    plan, inputs, backend = drain_cli.prepare(lab, "A", max_concurrency=4)
    gathered = time.monotonic() - t0
    print(plan.explain(), flush=True)
    report = drain_cli.execute(lab, plan, inputs, backend, 4, verify=False)
    print(report.table(), flush=True)
    outcomes = {
        o.vm: ("moved" if o.state == "completed" else f"{o.state}: {o.note[:50]}")
        for o in report.outcomes
    }
    return {
        "total_s": time.monotonic() - t0,
        "outcomes": outcomes,
        "gather_s": gathered,
        "predicted_s": plan.total_s,
        "executed_s": report.total_s,
        "plan": plan.explain(),
        "table": report.table(),
        "concurrency": plan.concurrency,
        "budgets": {
            v.name: v.max_downtime_ms or inputs.options.max_downtime_ms for v in inputs.vms
        },
    }


def make_guests(lab: Lab) -> None:
    """The guests on A: created once, brought back to A between strategies.

    Booting seven TCG guests takes minutes on a loaded 2-core machine;
    migrating them back takes seconds (plain libvirt: precopy, postcopy for
    the hot one, which precopy cannot bring back).  A guest that cannot be
    brought back is created afresh.
    """
    wanted = {name for name, *_ in GUESTS}
    for name in vm.list_vms(lab):
        if name not in wanted:
            vm.destroy(lab, name)
    existing = set(vm.list_vms(lab))
    for name, ram, workload, backing in GUESTS:
        if name in existing and _bring_back(lab, name):
            continue
        if name in existing:
            vm.destroy(lab, name)
        vm.create(lab, "A", ram=ram, workload=workload, memory_backing=backing, name=name)
    time.sleep(3)  # dirtiers into their stride


def _bring_back(lab: Lab, name: str) -> bool:
    import libvirt

    from tests.bench.bench_modes import _postcopy_control

    where = vm.LabVM(lab, name).locate()
    if where == "A":
        return True
    if where is None:
        return False
    hot = name == "d-hot"
    try:
        vm.migrate_plain(
            lab,
            name,
            "A",
            extra_flags=libvirt.VIR_MIGRATE_POSTCOPY if hot else 0,
            control=_postcopy_control() if hot else None,
            max_downtime_ms=500,
        )
    except exceptions.FlexMigError as exc:
        print(f"  {name}: could not bring it back ({exc}); creating it afresh", flush=True)
        return False
    with contextlib.suppress(exceptions.FlexMigError):
        lab.agent(where).post("/v1/split/cleanup", {"vm": name})
    return True


def check_guests(lab: Lab) -> tuple[int, int, int]:
    """(moved off A, bad pages, lost pages) over every guest."""
    moved = bad = lost = 0
    for name, _, _, _ in GUESTS:
        guest = vm.LabVM(lab, name)
        where = guest.locate()
        moved += where not in (None, "A")
        result = guest.verify()
        bad, lost = bad + result["bad"], lost + result["lost"]
    return moved, bad, lost


def guest_downtimes(lab: Lab, since_ns: int) -> dict[str, float]:
    """Each moved guest's longest heartbeat gap since the strategy began: the
    downtime its migration cost it, as the guest saw it (the same measure as
    ``flexmig migrate``'s guest-observed downtime)."""
    gaps = {}
    for name, *_ in GUESTS:
        report = vm.LabVM(lab, name).heartbeat(since_ns=since_ns)
        if len(report.hosts) > 1:  # it changed host: it moved
            gaps[name] = round(report.longest_gap_ms, 1)
    return gaps


def over_budget(result: dict[str, Any]) -> list[str]:
    """The moved guests whose guest-observed downtime went over their budget."""
    budgets = result["budgets"]
    return [
        f"{name} {gap:.0f}/{budgets[name]} ms"
        for name, gap in result["downtime_ms"].items()
        if name in budgets and gap > budgets[name]
    ]


def one_strategy(lab: Lab, strategy: str) -> dict[str, Any]:
    budgets = {h: BUDGET_MB for h in "BCD"}
    make_guests(lab)
    started_ns = time.monotonic_ns()
    if strategy == "flexmig":
        result = run_flexmig(lab)
    else:
        concurrency = 1 if strategy == "nova-serial" else int(strategy.split("-")[1])
        result = run_nova(lab, concurrency, budgets)
    result["moved"], result["bad"], result["lost"] = check_guests(lab)
    result["downtime_ms"] = guest_downtimes(lab, started_ns)
    result.setdefault("budgets", {name: NOVA_MAX_DOWNTIME_MS for name, *_ in GUESTS})
    print(f"{strategy}: {result['total_s']:.1f} s, outcomes {result['outcomes']}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--keep", action="store_true", help="leave the lab up")
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    image.build()
    lab = Lab()
    lab.up(4)
    results = {}
    try:
        for host in "BCD":
            lab.set_budget(host, BUDGET_MB)
        shape_uplink(lab, "A", LINK_MIB)
        for strategy in strategies:
            results[strategy] = one_strategy(lab, strategy)
            write(args, [s for s in strategies if s in results], results)  # partial is kept
    finally:
        for name in vm.list_vms(lab):
            vm.destroy(lab, name)
        if not args.keep:
            lab.down()
    write(args, [s for s in strategies if s in results], results)


def command_line() -> str:
    """How this run was started (a lock the caller held around it is not seen here)."""
    return shlex.join([".venv/bin/python", "-m", "tests.bench.bench_drain", *sys.argv[1:]])


def write(args, strategies, results) -> None:
    base = results.get("nova-serial", {}).get("total_s")
    rows = []
    for s in strategies:
        r = results[s]
        failed = sum(1 for o in r["outcomes"].values() if o != "moved")
        ratio = f"{r['total_s'] / base:.2f}" if base else "-"
        gaps = r["downtime_ms"].values()
        worst = f"{max(gaps):.0f}" if gaps else "-"
        over = "; ".join(over_budget(r)) or "none"
        rows.append(
            f"| {s} | {r['total_s']:.1f} | {ratio} | {r['moved']}/{len(GUESTS)} | {failed} | "
            f"{r['bad']} | {r['lost']} | {worst} | {over} | "
            + "; ".join(f"{vm_}: {o}" for vm_, o in r["outcomes"].items() if o != "moved")
            + " |"
        )
    fm = results.get("flexmig")
    lines = [
        f"# Draining a host ({datetime.date.today()})",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Lab: 4 hosts, A drained; A's uplink shaped to {LINK_MIB} MiB/s both ways (tbf); B, C, D "
        f"offer {BUDGET_MB} MiB to VMs. Guests on A in listing order: "
        + ", ".join(f"{n} ({r}, {w}, {b})" for n, r, w, b in GUESTS)
        + ". TCG guests; load average at the end "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (shared machine).",
        "",
        "| strategy | total s | vs nova-serial | moved off A | not moved | bad | lost "
        "| worst downtime ms | over budget (gap/budget) | not moved, why |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Downtime: each moved guest's longest heartbeat gap during the strategy, as the "
        "guest saw it. Budget: FlexMig's per-VM plan budget (the source's [migration] "
        f"max_downtime_ms); Nova's ways: its live_migration_downtime, {NOVA_MAX_DOWNTIME_MS} ms.",
        "",
        "Per VM (ms): "
        + "; ".join(
            f"{s}: " + ", ".join(f"{n} {g:.0f}" for n, g in results[s]["downtime_ms"].items())
            for s in strategies
        ),
        "",
    ]
    if fm:
        lines += [
            f"FlexMig: {fm['concurrency']} at once; facts gathered and planned in "
            f"{fm['gather_s']:.1f} s, then executed in {fm['executed_s']:.1f} s against "
            f"{fm['predicted_s']:.1f} s predicted (measured/predicted "
            f"{fm['executed_s'] / fm['predicted_s']:.2f}).",
            "",
            "```",
            fm["plan"],
            "",
            fm["table"],
            "```",
        ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
