"""Migration strategies x workloads on real lab guests, in one run.

    .venv/bin/python -m tests.bench.bench_modes [--repeat N] [--out FILE]

Workloads: idle, moderate (dirty rate well under the link), hot (dirty rate
above it: precopy cannot converge), short destination (its agent offers VMs
less RAM than the VM has).  Strategies:

- nova-default: libvirt precopy as Nova drives it by default (peer-to-peer,
  live_migration_downtime=500 ms reached in 10 steps, 75 s per GiB between
  steps, no postcopy, no auto-converge), given up after TIMEOUT_S (Nova's own
  completion timeout, 800 s per GiB, would end it as a failure too);
- always-postcopy: libvirt's postcopy-after-precopy (switch after the first pass);
- flexmig-auto: FlexMig's policy picks the mode and parameters;
- swap-baseline (short destination only): the conventional way to fit a VM on
  a host short of RAM: anonymous memory, the same resident cap, a swap file.

Every strategy migrates over the same path with the stream capped at
BANDWIDTH_MIB (a ~1 Gbit/s-class link, so "hot" really outruns it).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import subprocess
import time
from pathlib import Path

import libvirt

from flexmig import exceptions, migrate_cli
from flexmig_lab import emulator, image, vm
from flexmig_lab.lab import Lab

BANDWIDTH_MIB = 100
DEFAULT_OUT = Path("docs/benchmarks/modes.md")
TIMEOUT_S = 90.0
SHORT_BUDGET_MB = 400
QEMU_OVERHEAD_MB = 160
WORKLOADS = {
    "idle": dict(ram="512M", workload="dirtier:wss=128M,rate=0", memory_backing="anonymous"),
    "moderate": dict(ram="512M", workload="dirtier:wss=128M,rate=4000", memory_backing="anonymous"),
    "hot": dict(ram="512M", workload="dirtier:wss=256M,rate=120000", memory_backing="anonymous"),
    "short-dest": dict(ram="512M", workload="dirtier:wss=200M,rate=2000", memory_backing="file"),
}


def nova_downtime_steps(
    data_gb: float, downtime_ms: int = 500, steps: int = 10, delay_s: int = 75
) -> list[tuple[float, int]]:
    """Nova's documented ramp: (seconds after start, max downtime ms), geometric."""
    delay = delay_s * data_gb
    offset = downtime_ms / (steps + 1)
    base = (downtime_ms - offset) ** (1 / steps)
    return [(delay * i, int(offset + base**i)) for i in range(steps + 1)]


def _nova_control(ram_gb: float):
    steps = nova_downtime_steps(ram_gb)
    applied = {"index": -1}

    def control(dom, stats, elapsed):
        index = max(i for i, (at, _) in enumerate(steps) if elapsed >= at)
        if index != applied["index"]:
            dom.migrateSetMaxDowntime(steps[index][1])
            applied["index"] = index
        if elapsed > TIMEOUT_S:
            dom.abortJob()

    return control


def _postcopy_control():
    switched = {"done": False}

    def control(dom, stats, elapsed):
        if not switched["done"] and stats.get("memory_iteration", 0) >= 2:
            dom.migrateStartPostCopy()
            switched["done"] = True

    return control


def _measure(lab, name, start_ns, landed):
    guest = vm.LabVM(lab, name)
    guest.wait_heartbeat(host=landed)
    gap = guest.heartbeat(since_ns=start_ns).longest_gap_ms
    check = guest.verify()
    if check["bad"] or check["lost"]:
        print(f"  {name}: verify {check}", flush=True)
    return gap, check["bad"] + check["lost"]


def run_plain(lab, name, strategy):
    start_ns, t0 = time.monotonic_ns(), time.monotonic()
    flags, control = 0, _nova_control(0.5)
    if strategy == "always-postcopy":
        flags, control = libvirt.VIR_MIGRATE_POSTCOPY, _postcopy_control()
    try:
        stats = vm.migrate_plain(
            lab,
            name,
            "B",
            bandwidth_mib=BANDWIDTH_MIB,
            max_downtime_ms=50,
            extra_flags=flags,
            control=control,
        )
    except exceptions.FlexMigError as exc:
        landed = vm.LabVM(lab, name).locate()
        gap, bad = _measure(lab, name, start_ns, landed) if landed else (math.nan, -1)
        return dict(
            ok=False,
            note=str(exc)[:60],
            time_s=time.monotonic() - t0,
            gap_ms=gap,
            bytes_mib=math.nan,
            bad=bad,
        )
    wall_s = time.monotonic() - t0
    gap, bad = _measure(lab, name, start_ns, "B")
    # After a postcopy libvirt may not hand the destination completed statistics.
    return dict(
        ok=True,
        time_s=stats.get("time_elapsed", wall_s * 1000) / 1000,
        gap_ms=gap,
        qemu_ms=stats.get("downtime", math.nan),
        bytes_mib=stats.get("memory_processed", math.nan) / 2**20,
        bad=bad,
    )


def run_flexmig(lab, name):
    result = migrate_cli.migrate(lab, name, "B", show=False, bandwidth_mib=BANDWIDTH_MIB)
    check = result.get("verify") or {}
    if check.get("bad") or check.get("lost"):
        print(f"  {name}: verify {check}; events {result.get('events')}", flush=True)
    return dict(
        ok=result["state"] == "completed",
        mode=result.get("mode"),
        time_s=(result.get("total_time_ms") or 0) / 1000,
        gap_ms=result.get("guest_observed_downtime_ms", math.nan),
        bytes_mib=(result.get("bytes_moved") or 0) / 2**20,
        bad=check.get("bad", 0) + check.get("lost", 0),
        pred_time_s=(result.get("predicted_total_ms") or 0) / 1000,
        pred_downtime_ms=result.get("predicted_guest_downtime_ms"),  # the guest's, as measured
        note=(result.get("error") or "")[:60],
    )


def run_swap_baseline(lab, name, swap_file: Path):
    """Anonymous VM, same resident cap as split, the host swapping."""
    budget = (SHORT_BUDGET_MB - QEMU_OVERHEAD_MB) * 2**20
    lab.agent("B").post(
        "/v1/split/prepare", {"vm": name, "ram_bytes": 512 * 2**20, "budget_bytes": budget}
    )
    subprocess.run(["swapon", str(swap_file)], check=True)
    try:
        return run_plain(lab, name, "nova-default")
    finally:
        # The VM (and its swapped pages) must be gone before swapoff can succeed.
        vm.destroy(lab, name)
        subprocess.run(["swapoff", str(swap_file)], check=True)


def one_run(lab, workload, strategy, swap_file):
    spec = dict(WORKLOADS[workload])
    if strategy == "swap-baseline":
        spec["memory_backing"] = "anonymous"
    name = f"b-{workload[:5]}-{strategy[:5]}".replace("_", "-")
    lab.set_budget("B", SHORT_BUDGET_MB if workload == "short-dest" else 4096)
    if workload == "short-dest" and strategy in ("nova-default", "always-postcopy"):
        return dict(
            ok=False,
            note=f"not placeable: B offers {SHORT_BUDGET_MB} MiB, VM needs "
            f"{512 + QEMU_OVERHEAD_MB}",
            time_s=math.nan,
            gap_ms=math.nan,
            bytes_mib=math.nan,
            bad=0,
        )
    vm.create(lab, "A", name=name, **spec)
    try:
        time.sleep(3)
        if strategy == "flexmig-auto":
            return run_flexmig(lab, name)
        if strategy == "swap-baseline":
            return run_swap_baseline(lab, name, swap_file)
        return run_plain(lab, name, strategy)
    finally:
        vm.destroy(lab, name)


def safe_run(lab, workload, strategy, swap_file):
    """A run that breaks is a failed row with its reason, never a lost table."""
    try:
        return one_run(lab, workload, strategy, swap_file)
    except exceptions.FlexMigError as exc:
        return dict(
            ok=False,
            note=f"harness: {str(exc)[:70]}",
            time_s=math.nan,
            gap_ms=math.nan,
            bytes_mib=math.nan,
            bad=-1,
        )


def _fmt(rows):
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    ok = sum(r["ok"] for r in rows)
    first = rows[0]
    pred = (
        f"{statistics.median(r['pred_time_s'] for r in rows):.2f} s / "
        f"{first.get('pred_downtime_ms')} ms"
        if "pred_time_s" in first
        else ""
    )
    return (
        f"{ok}/{len(rows)} | {first.get('mode') or ''} | {med('time_s'):.2f} | "
        f"{med('gap_ms'):.0f} | {med('bytes_mib'):.0f} | {max(r['bad'] for r in rows)} | "
        f"{pred} | {first.get('note', '')}"
    )


def make_swap_file(path: Path) -> None:
    """A 1 GiB swap file at ``path`` (not yet on): the conventional-swap baseline's."""
    subprocess.run(["fallocate", "-l", "1G", str(path)], check=True)
    path.chmod(0o600)
    subprocess.run(["mkswap", str(path)], check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated subset of {', '.join(WORKLOADS)}",
    )
    args = parser.parse_args()
    image.build()
    lab = Lab()
    lab.down()
    lab.up(2)
    swap_file = Path("/var/tmp/flexmig-bench-swapfile")
    make_swap_file(swap_file)
    lines = []
    try:
        for workload in args.workloads.split(","):
            if workload not in WORKLOADS:
                raise SystemExit(f"unknown workload {workload!r}")
            strategies = ["nova-default", "always-postcopy", "flexmig-auto"]
            if workload == "short-dest":
                strategies.append("swap-baseline")
            # Strategies interleaved within each repeat: a noisy spell hits all of them.
            runs: dict[str, list] = {strategy: [] for strategy in strategies}
            for _ in range(args.repeat):
                for strategy in strategies:
                    runs[strategy].append(safe_run(lab, workload, strategy, swap_file))
            for strategy in strategies:
                line = f"| {workload} | {strategy} | {_fmt(runs[strategy])} |"
                print(line, flush=True)
                lines.append(line)
    finally:
        lab.down()
        swap_file.unlink(missing_ok=True)
    header = [
        f"# Migration strategies x workloads ({datetime.date.today()})",
        "",
        f"Command: `.venv/bin/python -m tests.bench.bench_modes --repeat {args.repeat}"
        + (f" --workloads {args.workloads}" if args.workloads != ",".join(WORKLOADS) else "")
        + (f" --out {args.out}`" if args.out != DEFAULT_OUT else "`"),
        "",
        f"Lab: 2 hosts, 512 MiB TCG guests, stream capped at {BANDWIDTH_MIB} MiB/s (both "
        f"phases) for every strategy; short destination: B offers {SHORT_BUDGET_MB} MiB for "
        "VMs. Medians of "
        f"{args.repeat} run(s). Downtime is guest-observed (longest heartbeat gap). "
        "bad = pages verify found bad or lost (max over runs).",
        "",
        f"QEMU {_lab_qemu_version()} (the lab's, see README), libvirt 9.0; load average at "
        f"the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (the machine is shared).",
        "",
        "| workload | strategy | completed | mode | total s | downtime ms | MiB moved | bad "
        "| predicted total / downtime | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(header + lines) + "\n")


def _lab_qemu_version() -> str:
    qemu = emulator.lab_qemu()
    version = emulator.installed_version(image.cache_dir(), qemu) or "unknown"
    return version + (" (trixie's, through its own loader)" if qemu.foreign else "")


if __name__ == "__main__":
    main()
