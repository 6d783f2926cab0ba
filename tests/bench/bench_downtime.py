"""Guest-observed downtime, predicted and measured, per strategy, in one run.

    FLEXMIG_LAB_LIBVIRT=backports .venv/bin/python -m tests.bench.bench_downtime [--repeat N]

The workloads and fixed strategies of ``bench_modes`` (nova-default,
always-postcopy, at the same 100 MiB/s cap), against flexmig-auto with every
knob its plan picks on these hosts.  For flexmig: the guest's longest
heartbeat gap beside QEMU's downtime, the plan's forecast of the gap and its
parts, and the knobs it used.  ``file``: a file-backed guest (as
``switchover_trace``'s and ``bench_split``'s), whose switchover the
destination's QEMU and store layout lengthen (FLEXMIG_LAB_QEMU,
FLEXMIG_LAB_STORE); postcopy cannot serve its memory file, so no
always-postcopy for it.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from flexmig import exceptions, migrate_cli
from flexmig_lab import image, vm
from flexmig_lab.lab import Lab
from tests.bench import bench_modes

DEFAULT_OUT = Path("docs/benchmarks/downtime.md")
# The file-backed and hot guests first: a hold cut short still measured them.
WORKLOADS = ("file", "hot", "idle", "moderate")
STRATEGIES = ("nova-default", "always-postcopy", "flexmig-auto")
FILE_BACKED = dict(ram="512M", workload="dirtier:wss=200M,rate=2000", memory_backing="file")
LAB_ENV = ("FLEXMIG_LAB_QEMU", "FLEXMIG_LAB_STORE", "FLEXMIG_LAB_LIBVIRT")


def spec(workload: str) -> dict:
    return FILE_BACKED if workload == "file" else bench_modes.WORKLOADS[workload]


def strategies(workload: str) -> tuple[str, ...]:
    # userfaultfd cannot serve a memory file on the store's ext4: no postcopy.
    return tuple(s for s in STRATEGIES if workload != "file" or s != "always-postcopy")


def run_flexmig(lab: Lab, name: str) -> dict:
    result = migrate_cli.migrate(
        lab, name, "B", show=False, bandwidth_mib=bench_modes.BANDWIDTH_MIB
    )
    check = result.get("verify") or {}
    knobs = result.get("knobs") or {}
    used = [k for k in ("postcopy_preempt", "zerocopy") if knobs.get(k)]
    if knobs.get("compression"):
        used.append(knobs["compression"])
    if knobs.get("avail_switchover_mib"):
        used.append(f"hint {knobs['avail_switchover_mib']} MiB/s")
    if (knobs.get("parallel") or 1) > 1:
        used.append(f"{knobs['parallel']} channels")
    if result.get("downtime_limit_ms"):
        used.append(f"limit {result['downtime_limit_ms']} ms")
    return dict(
        ok=result["state"] == "completed",
        mode=result.get("mode"),
        time_s=(result.get("total_time_ms") or 0) / 1000,
        gap_ms=result.get("guest_observed_downtime_ms", math.nan),
        qemu_ms=result.get("downtime_ms") or math.nan,
        pred_ms=result.get("predicted_guest_downtime_ms") or math.nan,
        parts=result.get("predicted_downtime_parts_ms") or {},
        knobs=", ".join(used) or "none",
        bad=check.get("bad", 0) + check.get("lost", 0),
        note=(result.get("error") or "")[:60],
    )


def one_run(lab: Lab, workload: str, strategy: str) -> dict:
    name = f"d-{workload[:5]}-{strategy[:5]}"
    lab.set_budget("B", 4096)
    vm.create(lab, "A", name=name, **spec(workload))
    try:
        time.sleep(3)  # the working set dirtied, as in bench_modes
        if strategy == "flexmig-auto":
            return run_flexmig(lab, name)
        return bench_modes.run_plain(lab, name, strategy)
    except exceptions.FlexMigError as exc:
        return dict(ok=False, note=f"harness: {str(exc)[:60]}", time_s=math.nan, gap_ms=math.nan)
    finally:
        vm.destroy(lab, name)


def row(workload: str, strategy: str, runs: list[dict]) -> str:
    def med(key: str) -> float:
        values = [r[key] for r in runs if isinstance(r.get(key), int | float)]
        return statistics.median(values) if values else math.nan

    ok = sum(bool(r.get("ok")) for r in runs)
    first = runs[0]
    gap, pred = med("gap_ms"), med("pred_ms")
    err = f"{(pred - gap) / gap * 100:+.0f}%" if gap and not math.isnan(pred) else ""
    gaps = sorted(r["gap_ms"] for r in runs if isinstance(r.get("gap_ms"), int | float)
                  and not math.isnan(r["gap_ms"]))  # fmt: skip
    spread = f" ({gaps[0]:.0f}-{gaps[-1]:.0f})" if len(gaps) > 1 else ""
    parts = ", ".join(f"{k} {v:.0f}" for k, v in (first.get("parts") or {}).items() if v)
    return (
        f"| {workload} | {strategy} | {ok}/{len(runs)} | {first.get('mode') or ''} | "
        f"{med('time_s'):.2f} | {gap:.0f}{spread} | {med('qemu_ms'):.0f} | {pred:.0f} | {err} | "
        f"{parts} | {first.get('knobs', '')} | {max(r.get('bad', 0) for r in runs)} | "
        f"{first.get('note', '')} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args()
    # A timeout's SIGTERM still takes the lab down (finally) and keeps the table.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    image.build()
    lab = Lab()
    lab.down()
    started = (datetime.datetime.now(datetime.UTC), os.getloadavg()[0])
    lab.up(2)
    lines: list[str] = []
    software: dict = {}
    try:
        software = lab.agent("B").get("/v1/facts")  # the destination
        for workload in args.workloads.split(","):
            runs: dict[str, list] = {s: [] for s in strategies(workload)}
            for _ in range(args.repeat):
                for strategy in runs:  # interleaved: a noisy spell hits all
                    runs[strategy].append(one_run(lab, workload, strategy))
            for strategy in runs:
                lines.append(row(workload, strategy, runs[strategy]))
                print(lines[-1], flush=True)
            write(args, started, software, lines)  # what a cut-short hold measured is kept
    finally:
        lab.down()
    write(args, started, software, lines)


def write(args: argparse.Namespace, started: tuple, software: dict, lines: list[str]) -> None:
    libvirt_v = software.get("libvirt_version", 0)
    env = " ".join(f"{k}={os.environ[k]}" for k in LAB_ENV if os.environ.get(k))
    ended = datetime.datetime.now(datetime.UTC)
    header = [
        f"# Guest-observed downtime, predicted and measured ({datetime.date.today()})",
        "",
        f"Command: `{env + ' ' if env else ''}.venv/bin/python -m "
        f"tests.bench.bench_downtime --repeat {args.repeat}"
        + (f" --workloads {args.workloads}" if args.workloads != ",".join(WORKLOADS) else "")
        + (f" --out {args.out}`" if args.out != DEFAULT_OUT else "`")
        + f" ({started[0]:%H:%M}-{ended:%H:%M} UTC, load average {started[1]:.1f} at the "
        f"start)",
        "",
        f"Destination store: shares /etc/libvirt's filesystem: "
        f"{software.get('store_shares_libvirt_fs')}; measured write rate "
        f"{(software.get('store_write_bps') or 0) / 2**20:,.0f} MiB/s (agent facts).",
        "",
        "Lab: 2 hosts, 512 MiB TCG guests (bench_modes' workloads; file: "
        f"{FILE_BACKED['workload']}, file-backed), stream capped at "
        f"{bench_modes.BANDWIDTH_MIB} MiB/s for every strategy; libvirt "
        f"{libvirt_v // 1_000_000}.{libvirt_v // 1000 % 1000}, QEMU "
        f"{bench_modes._lab_qemu_version()}. Medians of {args.repeat} run(s); load average "
        f"at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (shared machine). "
        "guest ms: the longest heartbeat gap (median, and the range over the runs); "
        "QEMU ms: libvirt's downtime statistic; "
        "predicted: the plan's forecast of the guest's gap (flexmig/migration/downtime.py), "
        "error = (predicted - measured) / measured.",
        "",
        "| workload | strategy | completed | mode | total s | guest ms | QEMU ms | predicted ms "
        "| error | predicted parts (ms) | knobs | bad | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(header + lines) + "\n")


if __name__ == "__main__":
    main()
