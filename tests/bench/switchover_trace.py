"""Where a switchover's time goes: QEMU's own downtime checkpoints per run.

Runs FlexMig migrations A->B of a moderate anonymous VM (mode precopy), of a
file-backed VM to a destination with enough RAM (precopy) and of the same VM
to a short destination (mode split), with the lab's QEMU trace events on, and
reads from each host's QEMU log: the source's last byte
(``src-non-iterable-saved``), the destination's load completion
(``dst-precopy-loadvm-completed``) and the source's end of downtime, beside
libvirt's downtime and the guest's heartbeat gap across the switchover.

    [FLEXMIG_LAB_QEMU=trixie] .venv/bin/python -m tests.bench.switchover_trace [--runs 2]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import re
import time
from pathlib import Path

from flexmig import migrate_cli
from flexmig_lab import heartbeat, vm
from flexmig_lab.lab import Lab
from tests.bench import bench_split
from tests.bench.bench_modes import _lab_qemu_version

OUT = Path("docs/benchmarks/switchover.md")
SPLIT_BUDGET_MIB = 384  # 75 % of the guest, as bench_split's split-75
HOT_SET = bench_split.HOT_SET_WORKLOAD
CHECKPOINT_RE = re.compile(r"@(\d+\.\d+):vmstate_downtime_checkpoint (\S+)")
# The destination's "running" (libvirt's `cont` done): where the guest may run.
RUNNING_RE = re.compile(r"@(\d+\.\d+):runstate_set .*new_state \d+ \(running\)")
CASES = {
    "idle precopy": dict(workload="dirtier:wss=128M,rate=0", memory_backing="anonymous"),
    "moderate precopy": dict(workload="dirtier:wss=128M,rate=4000", memory_backing="anonymous"),
    "file-backed precopy": dict(workload="dirtier:wss=200M,rate=2000", memory_backing="file"),
    "short-dest split": dict(workload="dirtier:wss=200M,rate=2000", memory_backing="file"),
    # bench_split's guest: its enough case, and its split-35 (a 179 MiB budget).
    "hot-set precopy": dict(workload=HOT_SET, memory_backing="file"),
    "hot-set split": dict(
        workload=HOT_SET, memory_backing="file", budget_mib=bench_split.offer_mb("split-35")
    ),
}


def checkpoints(lab: Lab, host: str, name: str) -> dict[str, float]:
    """QEMU's downtime checkpoints and its last change to "running", wall-clock seconds."""
    log = lab.host(host).ns.root_path(f"/var/log/libvirt/qemu/{name}.log").read_text()
    found = {m.group(2): float(m.group(1)) for m in CHECKPOINT_RE.finditer(log)}
    running = RUNNING_RE.findall(log)
    if running:
        found["running"] = float(running[-1])
    return found


def beats_around_switch(lab: Lab, name: str) -> tuple[float, float]:
    """Wall-clock seconds of the source's last heartbeat and the destination's first.

    The recorder stamps beats with the monotonic clock; QEMU's trace with the
    wall clock: both are this machine's, so one offset converts.
    """
    offset_ns = time.time_ns() - time.monotonic_ns()
    log = (vm.LabVM(lab, name).dir / "heartbeat.log").read_text().splitlines()
    beats = sorted(heartbeat.parse(log), key=lambda b: b.counter)
    for prev, cur in itertools.pairwise(beats):
        if prev.host == "A" and cur.host == "B":
            return (prev.host_ns + offset_ns) / 1e9, (cur.host_ns + offset_ns) / 1e9
    raise RuntimeError(f"{name}: no heartbeat from A followed by one from B")


def one(lab: Lab, case: str, index: int) -> str:
    name = f"sw{index}"
    lab.set_budget("B", 4096)
    spec = dict(CASES[case])
    budget_mib = spec.pop("budget_mib", SPLIT_BUDGET_MIB)
    vm.create(lab, "A", name=name, ram="512M", **spec)
    hot_set = spec["workload"] == HOT_SET  # as bench_split: filled, and sampled since
    try:
        if hot_set:
            bench_split.wait_ready(vm.LabVM(lab, name))
        if case.endswith("split"):
            lab.set_budget("B", budget_mib)
        if hot_set:
            bench_split.settle_samples()
        else:
            time.sleep(3)  # the guest's working set dirtied, as in bench_modes
        mode = case.split()[-1]  # "file-backed precopy" -> precopy
        r = migrate_cli.migrate(lab, name, "B", mode=mode, show=False, bandwidth_mib=100)
        if r["state"] != "completed":
            raise RuntimeError(f"{case}: the migration ended {r['state']}: {r.get('error')}")
        src, dst = checkpoints(lab, "A", name), checkpoints(lab, "B", name)
        last_byte = src["src-non-iterable-saved"]
        last_beat, first_beat = beats_around_switch(lab, name)
        parts = (
            (src["src-downtime-start"] - last_beat) * 1000,
            (dst["running"] - dst["dst-precopy-loadvm-completed"]) * 1000,
            (first_beat - dst["running"]) * 1000,
        )
        return (
            f"| {case} | {r['mode']} | {r['downtime_ms']} | {r['guest_switchover_gap_ms']:.0f} "
            f"| {(last_byte - src['src-downtime-start']) * 1000:.0f} "
            f"| {(dst['dst-precopy-loadvm-completed'] - last_byte) * 1000:.0f} "
            f"| {(src['src-downtime-end'] - dst['dst-precopy-loadvm-completed']) * 1000:.0f} "
            + "".join(f"| {ms:.0f} " for ms in parts)
            + f"| {r['verify']['bad'] + r['verify']['lost']} |"
        )
    finally:
        vm.destroy(lab, name)
        lab.set_budget("B", 4096)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES)
    )
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    os.environ["FLEXMIG_LAB_QEMU_TRACE"] = "vmstate_downtime_checkpoint,runstate_set"
    lab = Lab()
    lab.up(2)
    rows = []
    try:
        for i in range(args.runs):
            for j, case in enumerate(cases):
                rows.append(one(lab, case, i * len(cases) + j))
                print(rows[-1], flush=True)
    finally:
        lab.down()
    env = " ".join(
        f"{k}={os.environ[k]}"
        for k in ("FLEXMIG_LAB_QEMU", "FLEXMIG_LAB_LIBVIRT")
        if k in os.environ
    )
    lines = [
        f"# Where the switchover's time goes ({datetime.date.today()})",
        "",
        "Command: `"
        + (f"{env} " if env else "")
        + ".venv/bin/python -m tests.bench.switchover_trace"
        + (f" --runs {args.runs}" if args.runs != 2 else "")
        + (f" --cases '{args.cases}'" if cases != list(CASES) else "")
        + (f" --out {args.out}`" if args.out != OUT else "`"),
        "",
        f"FlexMig migrations A->B, 512 MiB TCG guests, stream capped at 100 MiB/s, QEMU "
        f"{_lab_qemu_version()} with its `vmstate_downtime_checkpoint` and `runstate_set` trace "
        f"events; split: B "
        f"offers {SPLIT_BUDGET_MIB} MiB (hot-set split: {bench_split.offer_mb('split-35')} MiB, "
        f"bench_split's split-35 offer, a "
        f"{bench_split.offer_mb('split-35') - bench_split.QEMU_OVERHEAD_MB} MiB budget). "
        f"Load average at the end {os.getloadavg()[0]:.1f}. "
        "Columns in ms: libvirt's downtime; the guest's heartbeat gap across the switchover; "
        "source stop to its last byte; last byte to the destination's load completion; that "
        "to the source's end of downtime (the destination's msync of file-backed RAM and its "
        "reply); the guest's last heartbeat from the source to the source's stop (the heartbeat's "
        "own period); the destination's load completion to its QEMU running again (libvirt's "
        "finish and resume); that to the guest's first heartbeat from the destination.",
        "",
        "| case | mode | libvirt ms | guest gap ms | src stop->last byte | last byte->dst "
        "loaded | dst loaded->src done | last beat->src stop | dst loaded->running "
        "| running->first beat | bad |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
