"""How long every fsync takes around a migration's switchover (lab probe).

Runs bench_split's cases (``enough``, ``split-75`` ...) one after another and,
for each, times every fsync(2) on the machine with the kernel's syscall
tracepoints (a tracefs instance of its own, mono clock, enter and exit paired
by thread), then prints the migration's row and the fsyncs per process name.
docs/benchmarks/switchover.md, "libvirt's persist fsync, measured again":

    FLEXMIG_LAB_QEMU=trixie FLEXMIG_LAB_DIRTY_SAMPLE_SECONDS=1,5,15 \\
    FLEXMIG_LAB_DIRTY_SAMPLE_REFRESH=25 .venv/bin/python -m tests.bench.fsync_probe \\
        enough,split-50,enough,split-50,split-75,enough,split-35
    ... -m tests.bench.fsync_probe --no-writeback enough,enough,enough

Needs root and tracefs at /sys/kernel/tracing.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from flexmig_lab import image
from flexmig_lab.lab import Lab
from tests.bench import bench_split

WORKLOAD = "dirtier:wss=400M,hot=64M,rate=2000"
INSTANCE = Path("/sys/kernel/tracing/instances/flexmig-fsync")
EVENTS = ("syscalls/sys_enter_fsync", "syscalls/sys_exit_fsync")
LINE = re.compile(r"^\s*(\S.*?)-(\d+)\s+\[\d+\].{4,6}\s+([\d.]+): sys_fsync(.*)$")
SHOWN = ("time_s", "gap_ms", "qemu_downtime_ms", "pred_downtime_ms", "pred_parts")


def _write(path: str, value: str) -> None:
    (INSTANCE / path).write_text(value)


def _events(on: bool) -> None:
    for event in EVENTS:
        _write(f"events/{event}/enable", "1" if on else "0")


def fsyncs() -> list[tuple[str, float]]:
    """(process name, ms) of every fsync since the last call; clears the buffer."""
    text = (INSTANCE / "trace").read_text()
    _write("trace", "")
    entered: dict[int, tuple[float, str]] = {}
    out = []
    for line in text.splitlines():
        match = LINE.match(line)
        if not match:
            continue
        comm, tid, stamp, rest = match[1], int(match[2]), float(match[3]), match[4]
        if "->" not in rest:
            entered[tid] = (stamp, comm)
        elif tid in entered:
            start, name = entered.pop(tid)
            out.append((name, round((stamp - start) * 1000, 1)))
    return out


def _without_writeback(migrate):
    def migrate_without(*args, **kwargs):
        kwargs["store_writeback"] = False
        return migrate(*args, **kwargs)

    return migrate_without


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", help="bench_split cases, comma-separated")
    parser.add_argument("--no-writeback", action="store_true", help="store_writeback off")
    args = parser.parse_args()
    if args.no_writeback:
        bench_split.migrate_cli.migrate = _without_writeback(bench_split.migrate_cli.migrate)
    image.build()
    os.makedirs(INSTANCE, exist_ok=True)
    _write("buffer_size_kb", "8192")
    _write("trace_clock", "mono")
    _events(True)
    lab = Lab()
    lab.down()
    lab.up(2)
    try:
        for case in args.cases.split(","):
            fsyncs()
            row = bench_split.one_run(lab, case, None, WORKLOAD)
            by_name: dict[str, list[float]] = {}
            for name, ms in fsyncs():
                by_name.setdefault(name, []).append(ms)
            print(case, {k: row.get(k) for k in SHOWN}, flush=True)
            print(
                "  fsyncs (count, longest ms):", {n: (len(v), max(v)) for n, v in by_name.items()}
            )
    finally:
        _events(False)
        lab.down()


if __name__ == "__main__":
    main()
