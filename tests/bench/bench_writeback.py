"""Store writeback on/off: what a file-backed VM's switchover costs on QEMU 10.

QEMU msyncs all of a file-backed VM's guest RAM on the destination before it
tells the source the migration is done (found with the lab's QEMU trace
events: ``FLEXMIG_LAB_QEMU_TRACE='vmstate_downtime*,migrate_send_rp*'``), so
every page still dirty in the page cache then is written inside the downtime.
The destination agent's writeback keeps that small.  This runs the same
precopy migration back and forth, alternating writeback on and off, and
measures the destination QEMU's msync directly (kernel syscall tracepoints).

    .venv/bin/python -m tests.bench.bench_writeback [--pairs 4]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

from flexmig import migrate_cli
from flexmig_lab import vm
from flexmig_lab.lab import Lab
from tests.bench import tracefs

OUT = Path("docs/benchmarks/writeback.md")
WORKLOAD = "dirtier:wss=128M,rate=3000"


@contextlib.contextmanager
def msync_trace() -> Iterator[list[float]]:
    """Durations (ms) of every QEMU msync while the block runs."""
    durations: list[float] = []
    with tracefs.syscall_trace("msync") as calls:
        yield durations
    durations.extend(ms for name, ms in calls if name.startswith("qemu-system-x86"))


def one(lab: Lab, to: str, writeback: bool) -> dict[str, float]:
    with msync_trace() as msyncs:
        result = migrate_cli.migrate(
            lab, "wb", to, mode="precopy", show=False, store_writeback=writeback
        )
    if result["state"] != "completed" or result["verify"]["bad"] or result["verify"]["lost"]:
        raise SystemExit(f"migration failed or lost pages: {result}")
    return {
        "total_s": result["total_time_ms"] / 1000,
        "libvirt_ms": result["downtime_ms"],
        "guest_ms": result["guest_observed_downtime_ms"],
        "msync_ms": max(msyncs, default=0.0),
        "rounds": result.get("store_writeback_rounds") or 0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4)
    args = parser.parse_args()
    lab = Lab()
    lab.up(2)
    vm.create(lab, "A", ram="512M", workload=WORKLOAD, name="wb")
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    try:
        hosts = ["B", "A"]
        for i in range(args.pairs * 2):
            writeback = i % 4 in (0, 3)  # on/off/off/on: each direction gets both
            time.sleep(3)  # let the guest dirty its working set again
            runs[writeback].append(one(lab, hosts[i % 2], writeback))
            print(f"run {i + 1}: writeback={'on' if writeback else 'off'} {runs[writeback][-1]}")
    finally:
        vm.destroy(lab, "wb")
    write_table(runs, args.pairs)
    return 0


def write_table(runs: dict[bool, list[dict[str, float]]], pairs: int) -> None:
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
    lines = [
        f"# Store writeback during incoming migrations ({datetime.date.today()})",
        "",
        "Command: `.venv/bin/python -m tests.bench.bench_writeback"
        + (f" --pairs {pairs}`" if pairs != 4 else "`"),
        "",
        f"512 MiB file-backed TCG guest ({WORKLOAD}), precopy A<->B unshaped, QEMU 10.0, "
        f"store on the host's ext4; {pairs * 2} runs alternating writeback on/off, medians. "
        "msync = the destination QEMU's msync of guest RAM (syscall tracepoints), which "
        "QEMU does before telling the source it is done, so inside the downtime.",
        "",
        "| writeback | runs | dest msync ms | libvirt downtime ms | guest downtime ms "
        "| total s | flush rounds |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in (False, True):
        m = med[key]
        lines.append(
            f"| {'on' if key else 'off'} | {len(runs[key])} | {m['msync_ms']:.0f} "
            f"| {m['libvirt_ms']:.0f} | {m['guest_ms']:.0f} | {m['total_s']:.2f} "
            f"| {m['rounds']:.0f} |"
        )
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
