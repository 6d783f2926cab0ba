"""Where the guest's gap goes: what the vCPUs wait for and what the disk does (lab probe).

Runs bench_split's cases one after another with a tracefs instance on the
monotonic clock (the heartbeat recorder's): every switch of a vCPU thread
(``CPU n/TCG``) into D with its kernel stack, block requests issued and
completed, and memcg reclaim and its throttling.  For each run it prints the
migration's row, then, inside the guest's longest gap only: the vCPUs' D
time by the first telling frames of the stack, block I/O by kind (R, W, DS
= discard) and issuing task, and the requests' latency.
docs/benchmarks/README.md, "What the resumed guest's faults waited behind":

    FLEXMIG_LAB_QEMU=trixie FLEXMIG_LAB_DIRTY_SAMPLE_SECONDS=1,5,15 \\
    FLEXMIG_LAB_DIRTY_SAMPLE_REFRESH=25 .venv/bin/python -m tests.bench.gap_trace \\
        split-35,split-50,enough

Needs root (it mounts tracefs where it is not mounted).
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import time
from pathlib import Path

from flexmig_lab import image
from flexmig_lab.lab import Lab
from tests.bench import bench_modes, bench_split, tracefs

WORKLOAD = bench_split.HOT_SET_WORKLOAD
INSTANCE = "flexmig-gap"
LINE_RE = re.compile(r"^\s*(.+?)-(\d+)\s+\[\d+\]\s+\S+\s+(\d+\.\d+): (\w+): (.*)$")
SWITCH_RE = re.compile(
    r"prev_comm=(.+?) prev_pid=(\d+) .*?prev_state=(\S+) ==> next_comm=(.+?) next_pid=(\d+)"
)
BLOCK_RE = re.compile(r"^\d+,\d+ (\S+) (?:\d+ )?\(.*?\) (\d+) \+ (\d+)")
# Frames every sleep passes through: the first others say why it slept.
PLUMBING = frozenset(
    "__schedule schedule io_schedule schedule_timeout io_schedule_timeout "
    "folio_wait_bit_common folio_wait_bit __folio_lock schedule_hrtimeout_range "
    "trace_event_raw_event_sched_switch __traceiter_sched_switch".split()
)
EVENTS = (
    "sched/sched_switch",
    "block/block_rq_issue",
    "block/block_rq_complete",
    "vmscan/mm_vmscan_throttled",
    "ext4/ext4_free_blocks",
)
FREE_RE = re.compile(r"ino (\d+) mode \S+ block \d+ count (\d+)")
# ext4 discards what a file freed at the next journal commit (every 5 s by
# default): frees up to then before the gap may be the gap's discards.
FREED_BEFORE_S = 6.0
EXT4_BLOCK = 4096


def vcpu_waits(trace: str, lo: float, hi: float) -> dict[str, float]:
    """Milliseconds vCPU threads spent in D within [lo, hi], by why (stack frames).

    >>> t = ('  CPU 0/TCG-7 [000] d..2. 10.000: sched_switch: prev_comm=CPU 0/TCG prev_pid=7 '
    ...      'prev_prio=120 prev_state=D ==> next_comm=x next_pid=0 next_prio=120\\n'
    ...      '  CPU 0/TCG-7 [000] d..2. 10.000: <stack trace>\\n'
    ...      ' => __schedule\\n => io_schedule\\n => filemap_fault\\n => __do_fault\\n'
    ...      '  x-0 [000] d..2. 10.004: sched_switch: prev_comm=x prev_pid=0 prev_prio=120 '
    ...      'prev_state=R ==> next_comm=CPU 0/TCG next_pid=7 next_prio=120\\n')
    >>> {k: round(v, 1) for k, v in vcpu_waits(t, 9.0, 11.0).items()}
    {'filemap_fault/__do_fault': 4.0}
    """
    lines = trace.splitlines()
    asleep: dict[str, tuple[float, str]] = {}
    waits: collections.Counter[str] = collections.Counter()
    for i, line in enumerate(lines):
        event = LINE_RE.match(line)
        switch = SWITCH_RE.search(line) if event and event.group(4) == "sched_switch" else None
        if not switch:
            continue
        at = float(event.group(3))
        if switch.group(1).startswith("CPU") and switch.group(3).startswith("D"):
            asleep[switch.group(2)] = (at, _why(lines, i + 1))
        elif switch.group(4).startswith("CPU") and switch.group(5) in asleep:
            since, why = asleep.pop(switch.group(5))
            overlap = min(at, hi) - max(since, lo)
            if overlap > 0:
                waits[why] += overlap * 1000
    return dict(waits.most_common())


def _why(lines: list[str], at: int) -> str:
    frames = []
    if at < len(lines) and "<stack trace>" in lines[at]:
        for line in lines[at + 1 :]:
            if not line.lstrip().startswith("=>"):
                break
            frames.append(line.split("=>", 1)[1].strip())
    telling = [f for f in frames if f not in PLUMBING]
    return "/".join(telling[:2]) or "?"


def block_io(trace: str, lo: float, hi: float) -> tuple[dict[str, int], dict[str, list[float]]]:
    """Bytes issued within [lo, hi] by "kind issuer", and latencies (ms) by kind.

    >>> t = ('  python-5 [001] ..... 1.000: block_rq_issue: '
    ...      '254,0 W 4096 () 800 + 8 none,0,0 [py]\\n'
    ...      '  <idle>-0 [001] ..... 1.010: block_rq_complete: '
    ...      '254,0 W () 800 + 8 none,0,0 [0]\\n')
    >>> block_io(t, 0.0, 2.0)
    ({'W python': 4096}, {'W': [10.0]})
    """
    issued: dict[str, float] = {}
    volume: collections.Counter[str] = collections.Counter()
    latency: dict[str, list[float]] = collections.defaultdict(list)
    for line in trace.splitlines():
        event = LINE_RE.match(line)
        if not event or not event.group(4).startswith("block_rq_"):
            continue
        request, at = BLOCK_RE.search(event.group(5)), float(event.group(3))
        if not request or not lo <= at <= hi:
            continue
        kind = next((k for k in ("DS", "R", "W") if k in request.group(1)), request.group(1))
        if event.group(4) == "block_rq_issue":
            issued[request.group(2)] = at
            volume[f"{kind} {event.group(1)}"] += int(request.group(3)) * 512
        elif request.group(2) in issued:
            latency[kind].append(round((at - issued.pop(request.group(2))) * 1000, 3))
    return dict(volume.most_common()), dict(latency)


def freed_files(trace: str, lo: float, hi: float) -> dict[str, tuple[int, float]]:
    """Bytes ext4 freed within [lo, hi] by "task ino", with the first free's time
    relative to ``hi`` (s).

    >>> t = ('  rpc-libvirtd-9 [001] ..... 5.000: ext4_free_blocks: dev 254,0 ino 12 '
    ...      'mode 0100600 block 100 count 256 flags \\n')
    >>> freed_files(t, 0.0, 6.0)
    {'rpc-libvirtd ino 12': (1048576, -1.0)}
    """
    freed: dict[str, tuple[int, float]] = {}
    for line in trace.splitlines():
        event = LINE_RE.match(line)
        if not event or event.group(4) != "ext4_free_blocks":
            continue
        at, free = float(event.group(3)), FREE_RE.search(event.group(5))
        if free and lo <= at <= hi:
            key = f"{event.group(1)} ino {free.group(1)}"
            nbytes, first = freed.get(key, (0, at - hi))
            freed[key] = (nbytes + int(free.group(2)) * EXT4_BLOCK, first)
    return dict(sorted(freed.items(), key=lambda kv: -kv[1][0]))


def _instance() -> Path:
    inst = tracefs.ensure_mounted() / "instances" / INSTANCE
    if not inst.exists():
        inst.mkdir()
    (inst / "trace_clock").write_text("mono")
    (inst / "buffer_size_kb").write_text("16384")
    switch = inst / "events/sched/sched_switch"
    (switch / "filter").write_text('(prev_comm ~ "CPU*" && prev_state == 2) || next_comm ~ "CPU*"')
    (switch / "trigger").write_text('stacktrace if prev_comm ~ "CPU*" && prev_state == 2')
    for event in EVENTS:
        (inst / "events" / event / "enable").write_text("1")
    return inst


def _report(trace: str, lo: float, hi: float) -> None:
    for why, ms in vcpu_waits(trace, lo, hi).items():
        print(f"  vCPU in D: {why}: {ms:.1f} ms")
    volume, latency = block_io(trace, lo, hi)
    for who, nbytes in volume.items():
        print(f"  block {who}: {nbytes / 2**20:.1f} MiB")
    for kind, values in latency.items():
        print(
            f"  latency {kind}: {len(values)} requests, median {statistics.median(values):.2f}"
            f" ms, max {max(values):.2f} ms"
        )
    for who, (nbytes, at) in list(freed_files(trace, lo - FREED_BEFORE_S, hi).items())[:4]:
        print(f"  ext4 freed by {who}: {nbytes / 2**20:.1f} MiB, from {at:+.2f} s of the gap's end")
    throttled = trace.count("mm_vmscan_throttled:")
    print(f"  reclaim throttles in the trace: {throttled}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", help="bench_split cases, comma-separated")
    parser.add_argument("--workload", default=WORKLOAD, help="the guest's (lab VM syntax)")
    args = parser.parse_args()
    cases = args.cases.split(",")
    for case in cases:
        bench_split.case_parallel(case)
    inst = _instance()
    migrate, started = bench_split.migrate_cli.migrate, {}

    def traced(*a, **k):  # the trace spans the migration, cleared before it
        (inst / "trace").write_text("")
        started["at"] = time.monotonic()
        result = migrate(*a, **k)
        started["gap_at_ms"] = result.get("guest_longest_gap_at_ms")
        return result

    bench_split.migrate_cli.migrate = traced
    image.build()
    lab = Lab()
    lab.down()
    lab.up(2)
    swap = Path("/var/tmp/flexmig-gap-trace-swapfile")
    bench_modes.make_swap_file(swap)
    try:
        for case in cases:
            started.clear()
            row = bench_split.one_run(lab, case, swap, args.workload)
            print(case, {k: row.get(k) for k in ("time_s", "gap_ms", "qemu_downtime_ms")})
            # The gap's start is in ms from the migration's start: a ms of slack.
            at = started.get("gap_at_ms")
            if at is not None and row.get("gap_ms"):
                lo = started["at"] + at / 1000 - 0.001
                _report((inst / "trace").read_text(), lo, lo + row["gap_ms"] / 1000 + 0.002)
    finally:
        lab.down()
        swap.unlink(missing_ok=True)
        for event in EVENTS:
            (inst / "events" / event / "enable").write_text("0")


if __name__ == "__main__":
    main()
