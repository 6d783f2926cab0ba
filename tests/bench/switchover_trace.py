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
import os
import re
import time
from pathlib import Path

from flexmig import migrate_cli
from flexmig_lab import vm
from flexmig_lab.lab import Lab
from tests.bench.bench_modes import _lab_qemu_version

OUT = Path("docs/benchmarks/switchover.md")
SPLIT_BUDGET_MIB = 384  # 75 % of the guest, as bench_split's split-75
CHECKPOINT_RE = re.compile(r"@(\d+\.\d+):vmstate_downtime_checkpoint (\S+)")
CASES = {
    "moderate precopy": dict(workload="dirtier:wss=128M,rate=4000", memory_backing="anonymous"),
    "file-backed precopy": dict(workload="dirtier:wss=200M,rate=2000", memory_backing="file"),
    "short-dest split": dict(workload="dirtier:wss=200M,rate=2000", memory_backing="file"),
}


def checkpoints(lab: Lab, host: str, name: str) -> dict[str, float]:
    log = lab.host(host).ns.root_path(f"/var/log/libvirt/qemu/{name}.log").read_text()
    return {m.group(2): float(m.group(1)) for m in CHECKPOINT_RE.finditer(log)}


def one(lab: Lab, case: str, index: int) -> str:
    name = f"sw{index}"
    lab.set_budget("B", 4096)
    vm.create(lab, "A", name=name, ram="512M", **CASES[case])
    try:
        if case.endswith("split"):
            lab.set_budget("B", SPLIT_BUDGET_MIB)
        time.sleep(3)  # the guest's working set dirtied, as in bench_modes
        mode = case.split()[-1]  # "file-backed precopy" -> precopy
        r = migrate_cli.migrate(lab, name, "B", mode=mode, show=False, bandwidth_mib=100)
        src, dst = checkpoints(lab, "A", name), checkpoints(lab, "B", name)
        last_byte = src["src-non-iterable-saved"]
        return (
            f"| {case} | {r['mode']} | {r['downtime_ms']} | {r['guest_switchover_gap_ms']:.0f} "
            f"| {(last_byte - src['src-downtime-start']) * 1000:.0f} "
            f"| {(dst['dst-precopy-loadvm-completed'] - last_byte) * 1000:.0f} "
            f"| {(src['src-downtime-end'] - dst['dst-precopy-loadvm-completed']) * 1000:.0f} "
            f"| {r['verify']['bad'] + r['verify']['lost']} |"
        )
    finally:
        vm.destroy(lab, name)
        lab.set_budget("B", 4096)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    os.environ["FLEXMIG_LAB_QEMU_TRACE"] = "vmstate_downtime_checkpoint"
    lab = Lab()
    lab.up(2)
    rows = []
    try:
        for i in range(args.runs):
            for j, case in enumerate(CASES):
                rows.append(one(lab, case, i * len(CASES) + j))
                print(rows[-1], flush=True)
    finally:
        lab.down()
    qemu_env = os.environ.get("FLEXMIG_LAB_QEMU")
    lines = [
        f"# Where the switchover's time goes ({datetime.date.today()})",
        "",
        "Command: `"
        + (f"FLEXMIG_LAB_QEMU={qemu_env} " if qemu_env else "")
        + ".venv/bin/python -m tests.bench.switchover_trace"
        + (f" --runs {args.runs}" if args.runs != 2 else "")
        + (f" --out {args.out}`" if args.out != OUT else "`"),
        "",
        f"FlexMig migrations A->B, 512 MiB TCG guests, stream capped at 100 MiB/s, QEMU "
        f"{_lab_qemu_version()} with its `vmstate_downtime_checkpoint` trace events; split: B "
        f"offers {SPLIT_BUDGET_MIB} MiB. Load average at the end {os.getloadavg()[0]:.1f}. "
        "Columns in ms: libvirt's downtime; the guest's heartbeat gap across the switchover; "
        "source stop to its last byte; last byte to the destination's load completion; that "
        "to the source's end of downtime (the destination's msync of file-backed RAM and its "
        "reply). The rest of the guest's gap is libvirt finishing and resuming it.",
        "",
        "| case | mode | libvirt ms | guest gap ms | src stop->last byte | last byte->dst "
        "loaded | dst loaded->src done | bad |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
