"""How long every fsync takes around a migration's switchover (lab probe).

Runs bench_split's cases (``enough``, ``split-75`` ...) one after another and,
for each, times every fsync(2) on the machine with the kernel's syscall
tracepoints (``tracefs.syscall_trace``: enter and exit paired by thread),
then prints the migration's row and the fsyncs per process name.
docs/benchmarks/switchover.md, "libvirt's persist fsync, measured again":

    FLEXMIG_LAB_QEMU=trixie FLEXMIG_LAB_DIRTY_SAMPLE_SECONDS=1,5,15 \\
    FLEXMIG_LAB_DIRTY_SAMPLE_REFRESH=25 .venv/bin/python -m tests.bench.fsync_probe \\
        enough,split-50,enough,split-50,split-75,enough,split-35
    ... -m tests.bench.fsync_probe --no-writeback enough,enough,enough

Needs root (it mounts tracefs where it is not mounted).
"""

from __future__ import annotations

import argparse

from flexmig_lab import image
from flexmig_lab.lab import Lab
from tests.bench import bench_split, tracefs

WORKLOAD = bench_split.HOT_SET_WORKLOAD
SHOWN = ("time_s", "gap_ms", "qemu_downtime_ms", "pred_downtime_ms", "pred_parts")


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
    lab = Lab()
    lab.down()
    lab.up(2)
    try:
        for case in args.cases.split(","):
            with tracefs.syscall_trace("fsync") as calls:
                row = bench_split.one_run(lab, case, None, WORKLOAD)
            by_name: dict[str, list[float]] = {}
            for name, ms in calls:
                by_name.setdefault(name, []).append(round(ms, 1))
            print(case, {k: row.get(k) for k in SHOWN}, flush=True)
            print(
                "  fsyncs (count, longest ms):", {n: (len(v), max(v)) for n, v in by_name.items()}
            )
    finally:
        lab.down()


if __name__ == "__main__":
    main()
