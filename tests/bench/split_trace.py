"""What a split migration's destination does during its final round, sampled every 10 ms.

    FLEXMIG_LAB_QEMU=trixie FLEXMIG_LAB_STORE=own-fs \\
        .venv/bin/python -m tests.bench.split_trace [--budgets 75,50,35] [--workload W] \\
        [--parallel N]

One 512 MiB file-backed guest (as ``bench_split``) migrated A->B by split.
While it moves, a sampler in this process reads B's memory cgroup (charge,
failcnt = times the cap was hit, ``memory.stat``: dirty, writeback, pages
paged in/out, major faults), the destination QEMU's threads (state and
wchan: what a blocked thread waits in) and, every 50 ms, the residency
keeper's stats from B's agent.  QEMU's ``vmstate_downtime_checkpoint``
trace events (and ``handle_qmp_command``: what the destination's libvirt
asks when) give the source's stop and last byte and the destination's
load completion on the same (wall) clock.  Printed: the samples from 0.5 s
before the source stops to the destination's load completion, and a
summary of the final round (last byte -> loaded).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import threading
import time
from pathlib import Path

from flexmig import migrate_cli
from flexmig_lab import image, vm
from flexmig_lab.lab import CGROUP_ROOT, Lab
from tests.bench.bench_split import BANDWIDTH_MIB, RAM_MIB, WORKLOAD, offer_mb, wait_ready
from tests.bench.switchover_trace import checkpoints

STAT_KEYS = (
    "cache",
    "rss",
    "dirty",
    "writeback",
    "pgpgin",
    "pgpgout",
    "pgmajfault",
    "mapped_file",
    "inactive_file",
    "active_file",
)
SAMPLE_S = 0.01
QMP_RE = re.compile(r"@(\d+\.\d+):handle_qmp_command .*?\"execute\": ?\"([\w-]+)\"")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _threads(pid: int) -> list[tuple[str, str, str]]:
    """(thread name, state, wchan) of every thread of ``pid``."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        stat = _read(task / "stat")
        if ")" not in stat:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        state = stat[stat.rindex(")") + 2]
        out.append((name, state, _read(task / "wchan")))
    return out


def _meminfo(key: str) -> int:
    for line in _read(Path("/proc/meminfo")).splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _qemu_pid(name: str) -> int | None:
    """The destination QEMU's pid as this (root) pid namespace numbers it.

    The lab's hosts have pid namespaces of their own: libvirt's pid file holds
    the namespace's number.  The incoming QEMU is the one with ``-incoming``.
    """
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        args = _read(cmdline).split("\0")
        if f"guest={name}" in ",".join(args) and "-incoming" in args:
            return int(cmdline.parent.name)
    return None


class Sampler(threading.Thread):
    def __init__(self, lab: Lab, name: str) -> None:
        super().__init__(daemon=True)
        self.lab, self.name = lab, name
        self.stop = threading.Event()
        self.samples: list[dict] = []
        self.keeper: list[tuple[float, dict]] = []
        self.cap = True

    def run(self) -> None:
        group, pid, last_keeper = None, None, 0.0
        while not self.stop.wait(SAMPLE_S):
            now = time.time()
            if group is None:
                found = list(CGROUP_ROOT.glob(f"*/{self.name}"))
                group = found[0] if found else None
            if pid is None:
                pid = _qemu_pid(self.name)
            if group is None and self.cap:
                continue
            text = _read(group / "memory.stat") if group else ""
            stat = dict(line.split() for line in text.splitlines() if " " in line)
            sample = {
                "t": now,
                "usage": int(_read(group / "memory.usage_in_bytes") or 0) if group else 0,
                "failcnt": int(_read(group / "memory.failcnt") or 0) if group else 0,
                **{k: int(stat.get(k, 0)) for k in STAT_KEYS},
                "blocked": [t for t in _threads(pid) if t[1] == "D"] if pid else [],
                "host_dirty_kb": _meminfo("Dirty"),
                "host_wb_kb": _meminfo("Writeback"),
                "pid": pid or 0,
            }
            self.samples.append(sample)
            if now - last_keeper > 0.05:
                last_keeper = now
                try:
                    status = self.lab.agent("B").get(f"/v1/split/{self.name}")
                    self.keeper.append((now, dict(status.get("residency") or {})))
                except Exception:  # noqa: BLE001 (the agent may be busy; a gap is fine)
                    pass


def report(sampler: Sampler, src: dict[str, float], dst: dict[str, float]) -> None:
    stop, last = src["src-downtime-start"], src["src-non-iterable-saved"]
    loaded = dst["dst-precopy-loadvm-completed"]
    print(
        f"src stop->last byte {(last - stop) * 1000:.0f} ms, last byte->loaded "
        f"{(loaded - last) * 1000:.0f} ms, loaded->src done "
        f"{(src['src-downtime-end'] - loaded) * 1000:.0f} ms; dst checkpoints "
        + ", ".join(
            f"{k} {(v - stop) * 1000:+.0f}" for k, v in sorted(dst.items(), key=lambda i: i[1])
        )
    )
    window = [s for s in sampler.samples if stop - 0.5 <= s["t"] <= src["src-downtime-end"] + 0.05]
    mib = 2**20
    for s in window[::3]:
        waits = collections.Counter(w for _n, _s, w in s["blocked"])
        print(
            f"{(s['t'] - stop) * 1000:+6.0f} ms usage {s['usage'] / mib:6.1f} failcnt "
            f"{s['failcnt']:6d} dirty {s['dirty'] / mib:5.1f} wb {s['writeback'] / mib:5.1f} "
            f"pgpgin {s['pgpgin']:7d} pgpgout {s['pgpgout']:7d} majflt {s['pgmajfault']:6d} "
            f"hostdirty {s['host_dirty_kb'] >> 10} wb {s['host_wb_kb'] >> 10} pid {s['pid']} "
            f"D {dict(waits)}"
        )
    for label, at in (("at stop", stop), ("at load", loaded), ("at end", sampler.samples[-1]["t"])):
        s = min(sampler.samples, key=lambda x: abs(x["t"] - at))
        print(
            f"{label}: charge {s['usage'] / mib:.0f} MiB = QEMU anon {s['rss'] / mib:.0f} + file "
            f"{s['cache'] / mib:.0f} (mapped {s['mapped_file'] / mib:.0f}, active "
            f"{s['active_file'] / mib:.0f}, inactive {s['inactive_file'] / mib:.0f}) + other "
            f"{(s['usage'] - s['rss'] - s['cache']) / mib:.0f}"
        )
    final = [s for s in sampler.samples if last <= s["t"] <= loaded]
    if len(final) >= 2:
        a, b = final[0], final[-1]
        print(
            "final round: failcnt +%d, pgpgin +%d, pgpgout +%d, majflt +%d, max usage %.1f MiB"
            % (
                b["failcnt"] - a["failcnt"],
                b["pgpgin"] - a["pgpgin"],
                b["pgpgout"] - a["pgpgout"],
                b["pgmajfault"] - a["pgmajfault"],
                max(s["usage"] for s in final) / mib,
            )
        )
        waits = collections.Counter(w for s in final for _n, _st, w in s["blocked"])
        print("blocked-thread samples by wchan:", dict(waits.most_common(8)))
    for t, k in sampler.keeper:
        if stop - 1.0 <= t <= loaded + 0.1:
            print(
                f"keeper {(t - stop) * 1000:+6.0f} ms charge {k.get('charge_bytes', 0) / mib:.1f} "
                f"target {k.get('target_bytes', 0) / mib:.0f} drops {k.get('drops')} dropped "
                f"{k.get('dropped_bytes', 0) / mib:.0f} MiB rounds {k.get('rounds')} "
                f"state {k.get('state')}"
            )


def one(lab: Lab, budget_pct: int, index: int, workload: str, parallel: int = 0) -> None:
    name = f"st{index}"
    lab.set_budget("B", 4096)
    vm.create(lab, "A", name=name, ram=f"{RAM_MIB}M", workload=workload, memory_backing="file")
    sampler = Sampler(lab, name)
    try:
        wait_ready(vm.LabVM(lab, name))
        if budget_pct < 100:
            lab.set_budget("B", offer_mb(f"split-{budget_pct}"))
        sampler.cap = budget_pct < 100
        sampler.start()
        try:
            r = migrate_cli.migrate(
                lab, name, "B", show=False, bandwidth_mib=BANDWIDTH_MIB, parallel=parallel
            )
        finally:
            sampler.stop.set()
            sampler.join(2)

        print(
            f"{name}: {r['state']} mode {r.get('mode')} total {r.get('total_time_ms')} ms, "
            f"guest gap {r.get('guest_observed_downtime_ms')} ms, libvirt {r.get('downtime_ms')}"
            f" ms, parallel {r.get('parallel')}, verify {r.get('verify')}"
        )
        src = checkpoints(lab, "A", name)
        report(sampler, src, checkpoints(lab, "B", name))
        log = lab.host("B").ns.root_path(f"/var/log/libvirt/qemu/{name}.log").read_text()
        qmp = [
            f"{(float(m.group(1)) - src['src-downtime-start']) * 1000:+.0f} {m.group(2)}"
            for m in QMP_RE.finditer(log)
            if float(m.group(1)) >= src["src-downtime-start"] - 0.1
        ]
        print("destination QMP commands (ms after the source stopped):", qmp[:14])
    finally:
        sampler.stop.set()
        vm.destroy(lab, name)
        lab.set_budget("B", 4096)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budgets", default="50", help="comma list of 35, 50, 75, 100 (% of RAM; 100: enough RAM)"
    )
    parser.add_argument("--workload", default=WORKLOAD, help="the guest's (lab VM syntax)")
    parser.add_argument(
        "--parallel",
        type=int,
        default=0,
        choices=range(9),
        metavar="N",
        help="connections to ask for (0: the plan's choice; 1: one stream; up to 8)",
    )
    args = parser.parse_args()
    os.environ["FLEXMIG_LAB_QEMU_TRACE"] = "vmstate_downtime_checkpoint,handle_qmp_command"
    image.build()
    lab = Lab()
    lab.up(2)
    try:
        for i, pct in enumerate(int(b) for b in args.budgets.split(",")):
            one(lab, pct, i, args.workload, args.parallel)
    finally:
        lab.down()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
