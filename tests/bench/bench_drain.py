"""Draining one host: Nova's default way, fixed concurrency, FlexMig's plan, in one run.

    .venv/bin/python -m tests.bench.bench_drain [--out FILE] [--strategies ...]

Lab: 4 hosts; host A runs seven small TCG guests of mixed workloads (idle,
moderate, hot, and one too big for any destination's free RAM); A's uplink is
shaped to LINK_MIB MiB/s in both directions (every migration leaving A
shares it); B, C and D offer BUDGET_MB MiB to VMs.  Each strategy gets the
same fresh guests on A, in the same listing order, and drains A:

- nova-serial: Nova's default (``max_concurrent_live_migrations = 1``):
  one at a time in listing order, libvirt precopy as Nova's driver runs it
  (``tests/bench/nova_way.py``: its linear downtime steps to 500 ms, its
  completion timeout of 800 s per GiB with the default action, abort; no
  postcopy, no auto-converge), every wait bounded so a job Nova's abort
  cannot end is reported, with the time it held the drain, instead of
  hanging the run; each VM to the destination with the most free RAM that
  holds it with QEMU's own (Nova's RAM weigher); a VM none holds is
  NoValidHost;
- fixed-2, fixed-4: the same, 2 or 4 at once;
- flexmig: ``flexmig drain A`` (plan, then run it), timed from the moment
  the drain starts asking the agents, sampling included;
- flexmig-1: the same, its planner held to one migration at a time (what
  the guests notice with the CPUs and the link to each move alone);
- noise: no migration at all, the same guests running on A for NOISE_S:
  each guest's longest heartbeat gap is what the machine alone costs it (the
  floor under every guest-observed downtime of this run).

Every guest runs ``verify`` afterwards (bad or lost pages); "moved" counts
VMs that left A.  The lab is the caller's to share: run the whole comparison
under whatever lock the machine's users agree on (one run, so the ratios are
side by side).  ``--holds`` splits the strategies into groups, each run in a
lab of its own (up, the same guests created afresh, down) under its own
exclusive hold of the lock named by FLEXMIG_LAB_LOCK, so other users of the
machine can take the lab between them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import fcntl
import json
import os
import shlex
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from flexmig import drain_cli, exceptions, processutil
from flexmig_lab import image, topology, vm, vmspec
from flexmig_lab.lab import Lab
from tests.bench import drain_report, nova_way

MIB = 2**20
LINK_MIB = 48
# Half the sizes of the first runs (256 MiB guests, 800 MiB per host), all
# scaled alike, so the four strategies fit the machine's lab holds: Nova's
# completion timeout is 800 s per GiB, 125 s for the hot guest.  The hot
# guest keeps its 64 MiB working set (160 MiB: the guest's 96 MiB of its own
# beside it), so precopy still cannot converge on the shaped link.
BUDGET_MB = 500
QEMU_OVERHEAD_MB = 160
DEFAULT_OUT = Path("docs/benchmarks/drain.md")
# Listing order (Nova lists a host's servers in creation order here).
GUESTS = (
    ("d-idle1", "128M", "dirtier:wss=16M,rate=0", "file"),
    ("d-hot", "160M", "dirtier:wss=64M,rate=30000", "anonymous"),
    ("d-mod1", "128M", "dirtier:wss=32M,rate=2000", "file"),
    ("d-big", "384M", "dirtier:wss=32M,rate=1000", "file"),
    ("d-idle2", "128M", "dirtier:wss=16M,rate=0", "file"),
    ("d-mod2", "128M", "dirtier:wss=32M,rate=2000", "file"),
    ("d-idle3", "128M", "dirtier:wss=16M,rate=0", "file"),
)
STRATEGIES = ("noise", "flexmig", "nova-serial", "fixed-2", "fixed-4", "flexmig-1")
NOVA_MAX_DOWNTIME_MS = 500  # Nova's [libvirt] live_migration_downtime: its last step
FLEXMIG_BUDGET_MS = 300  # the lab agents' [migration] max_downtime_ms
HOLD_S = 660  # the machine's rule: a lab hold under 12 min, the lab's teardown included
NOISE_S = 40.0  # about as long as FlexMig's drain, the window its gaps are taken over


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
    """Nova's way, ``concurrency`` at once in listing order; every VM's wait is bounded
    (``nova_way``), so the pool always drains."""
    where = nova_placement(GUESTS, budgets)
    outcomes: dict[str, str] = {n: "NoValidHost" for n, d in where.items() if d is None}
    held: dict[str, float] = {}
    ram_gib = {n: int(r.rstrip("M")) / 1024 for n, r, _, _ in GUESTS}
    lock = threading.Lock()

    def one(name: str) -> None:
        try:
            result = nova_way.migrate(lab, name, where[name], ram_gib[name])
            state = "moved" if result.state == "moved" else f"{result.state}: {result.note}"
            for event in result.events:
                print(f"  {name}: {event}", flush=True)
        except exceptions.FlexMigError as exc:
            result, state = None, f"failed: {str(exc)[:80]}"
        with lock:
            outcomes[name] = state
            if result is not None:
                held[name] = round(result.held_s, 1)

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, [n for n, d in where.items() if d is not None]))
    return {"total_s": time.monotonic() - t0, "outcomes": outcomes, "held_s": held}


def run_noise(lab: Lab) -> dict[str, Any]:
    """No migration: the guests run on A for NOISE_S; their gaps are the machine's own."""
    t0 = time.monotonic()
    time.sleep(NOISE_S)
    return {"total_s": time.monotonic() - t0, "outcomes": {}}


def run_flexmig(lab: Lab, floor_ms: float, max_concurrency: int = 4) -> dict[str, Any]:
    t0 = time.monotonic()
    # The lab's hosts are one machine: every guest and migration shares its CPUs.
    plan, inputs, backend = drain_cli.prepare(
        lab, "A", max_concurrency, cpus=os.cpu_count() or 1, floor_ms=floor_ms
    )
    gathered = time.monotonic() - t0
    print(plan.explain(), flush=True)
    report = drain_cli.execute(lab, plan, inputs, backend, max_concurrency, verify=False)
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
        "forecast_ms": {m.vm: m.guest_gap_ms for m in plan.moves},
        "misses": dict(plan.downtime_misses),
        "budgets": {
            v.name: v.max_downtime_ms or inputs.options.max_downtime_ms for v in inputs.vms
        },
    }


def make_guests(lab: Lab, afresh: set[str] = frozenset()) -> None:
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
        if name in existing and name not in afresh and _bring_back(lab, name):
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


def guest_gaps(lab: Lab, since_ns: int, moved_only: bool = True) -> dict[str, tuple[float, float]]:
    """Each guest's (longest heartbeat gap, longest gap across its change of host)
    since the strategy began, as the guest saw them: the first holds whatever
    the machine did to it meanwhile, the second its switchover alone."""
    gaps = {}
    for name, *_ in GUESTS:
        report = vm.LabVM(lab, name).heartbeat(since_ns=since_ns)
        if len(report.hosts) > 1 or not moved_only:  # it changed host: it moved
            gaps[name] = (round(report.longest_gap_ms, 1), round(report.switchover_gap_ms, 1))
    return gaps


def one_strategy(lab: Lab, strategy: str, floor_ms: float, afresh: set[str]) -> dict[str, Any]:
    budgets = {h: BUDGET_MB for h in "BCD"}
    make_guests(lab, afresh)
    started_ns = time.monotonic_ns()
    if strategy == "noise":
        result = run_noise(lab)
    elif strategy.startswith("flexmig"):
        result = run_flexmig(lab, floor_ms, 1 if strategy == "flexmig-1" else 4)
    else:
        concurrency = 1 if strategy == "nova-serial" else int(strategy.split("-")[1])
        result = run_nova(lab, concurrency, budgets)
    result["moved"], result["bad"], result["lost"] = check_guests(lab)
    result["downtime_ms"] = guest_gaps(lab, started_ns, moved_only=strategy != "noise")
    default = FLEXMIG_BUDGET_MS if strategy == "noise" else NOVA_MAX_DOWNTIME_MS
    result.setdefault("budgets", {name: default for name, *_ in GUESTS})
    print(f"{strategy}: {result['total_s']:.1f} s, outcomes {result['outcomes']}", flush=True)
    return result


def _typical_floor(results: dict[str, Any]) -> float:
    """The median guest's longest gap with no migration (0 before noise was measured)."""
    gaps = [g for g, _ in results.get("noise", {}).get("downtime_ms", {}).values()]
    return statistics.median(gaps) if gaps else 0.0


def _stop(_signum: int, _frame: Any) -> None:
    raise SystemExit(143)  # a timeout's SIGTERM still takes the lab down (finally)


@contextlib.contextmanager
def lab_hold(lock_path: str | None):
    """An exclusive hold of the machine's lab lock (FLEXMIG_LAB_LOCK), if one is named."""
    if not lock_path:
        yield
        return
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        signal.alarm(HOLD_S)  # past it the hold ends (its lab down) with what it measured
        try:
            yield
        finally:
            signal.alarm(0)
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_hold(strategies: list[str], results: dict[str, Any], args) -> None:
    """One lab, up for these strategies only, then down."""
    lab = Lab()
    started = time.strftime("%H:%M:%S", time.gmtime())
    load = os.getloadavg()[0]
    afresh: set[str] = set()
    try:
        lab.up(4)
        for host in "BCD":
            lab.set_budget(host, BUDGET_MB)
        shape_uplink(lab, "A", LINK_MIB)
        for strategy in strategies:
            floor = _typical_floor(results)
            results[strategy] = one_strategy(lab, strategy, floor, afresh)
            ended = time.strftime("%H:%M:%S", time.gmtime())
            results[strategy]["hold"] = f"{started}-{ended} UTC, load {load:.1f} at its start"
            # A VM Nova's way left stuck is created afresh for the next strategy.
            afresh = {n for n, o in results[strategy]["outcomes"].items() if o.startswith("stuck")}
            write(args, [s for s in STRATEGIES if s in results], results)  # partial is kept
    finally:
        for name in vm.list_vms(lab):
            vm.destroy(lab, name)
        if not args.keep:
            lab.down()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--holds",
        default=",".join(STRATEGIES),
        help="strategies, comma-separated; ';' splits them into lab holds of their own "
        "(each under FLEXMIG_LAB_LOCK, when set); noise, when run, must come first",
    )
    parser.add_argument("--keep", action="store_true", help="leave the lab up")
    args = parser.parse_args()
    holds = [h.split(",") for h in args.holds.split(";")]
    unknown = {s for h in holds for s in h} - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; known: {', '.join(STRATEGIES)}")
    for index, (name, ram, workload, backing) in enumerate(GUESTS):
        vmspec.make_spec(name, ram, 1, workload, backing, index)  # bad sizes fail before a hold
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGALRM, _stop)
    image.build()
    results: dict[str, Any] = {}
    for strategies in holds:
        with lab_hold(os.environ.get("FLEXMIG_LAB_LOCK")):
            run_hold(strategies, results, args)
    write(args, [s for s in STRATEGIES if s in results], results)


LAB_ENV = ("FLEXMIG_LAB_QEMU", "FLEXMIG_LAB_STORE", "FLEXMIG_LAB_LIBVIRT")


def command_line() -> str:
    """How this run was started (a lock the caller held around it is not seen here)."""
    # The lab's QEMU and store layout change every file-backed guest's switchover.
    env = [f"{k}={os.environ[k]}" for k in LAB_ENV if os.environ.get(k)]
    return shlex.join([*env, ".venv/bin/python", "-m", "tests.bench.bench_drain", *sys.argv[1:]])


def write(args, strategies, results) -> None:
    header = [
        f"# Draining a host ({datetime.date.today()})",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Lab: 4 hosts, A drained; A's uplink shaped to {LINK_MIB} MiB/s both ways (tbf); B, C, D "
        f"offer {BUDGET_MB} MiB to VMs. Guests on A in listing order: "
        + ", ".join(f"{n} ({r}, {w}, {b})" for n, r, w, b in GUESTS)
        + f". TCG guests on {os.cpu_count()} CPUs; load average at the end "
        f"{os.getloadavg()[0]:.1f}. Noise window {NOISE_S:.0f} s.",
    ]
    text = drain_report.render(results, [n for n, *_ in GUESTS], header)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    # The raw figures beside the table, for a later reading.
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
