"""Split migration vs enough RAM vs conventional swap, side by side in one run.

    .venv/bin/python -m tests.bench.bench_split [--repeat N] [--out FILE] [--workload W]
        [--cases enough,split-50,split-50:p2,...]

One 512 MiB file-backed TCG guest dirtying a 200 MiB working set (or the
workload given: `dirtier:wss=400M,hot=64M,rate=2000` is seed 003's VM, its
memory all in use and a small part of it hot), migrated A->B over the same
path with the stream capped at BANDWIDTH_MIB, to:

- enough: B offers 4 GiB (FlexMig picks precopy);
- split-75/50/35: B offers the VM's RAM x 75/50/35 % plus QEMU's own, so
  FlexMig picks split with that resident budget;
- swap-50: the conventional way: an anonymous-memory guest, B's QEMU capped
  at the split-50 budget by the same cgroup, a host swap file.

A FlexMig case may name the parallel connections it asks for (`split-50:p2`:
two channels; `split-50:p1`: one stream; bare: the plan's choice), so one
run can compare them side by side.

Per run: total time, guest-observed downtime (longest heartbeat gap),
bad + lost pages (the guest's verify), the largest charge of B's cgroup
sampled by the residency keeper (split) or kept by the kernel (swap), the
prediction (split), and the dirtier's pages/s in the 10 s after the move,
counted by the guest (written pages between two verifies).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from agents.agent.inventory import SAMPLES_MAX_AGE_S
from flexmig import exceptions, migrate_cli
from flexmig.migration.request import MAX_PARALLEL
from flexmig_lab import image, vm, vmspec
from flexmig_lab.lab import Lab
from tests.bench import bench_modes
from tests.bench.bench_modes import _lab_qemu_version, _measure

BANDWIDTH_MIB = 100
RAM_MIB = 512
QEMU_OVERHEAD_MB = 160
WORKLOAD = "dirtier:wss=200M,rate=2000"
# Seed 003's VM (see above): the workload of the committed split tables.
HOT_SET_WORKLOAD = "dirtier:wss=400M,hot=64M,rate=2000"
CASES = ("enough", "split-75", "split-50", "split-35", "swap-50")
DEFAULT_OUT = Path("docs/benchmarks/split.md")
AFTER_S = 10.0
# Named in the table's command.
LAB_ENV = (
    "FLEXMIG_LAB_QEMU",
    "FLEXMIG_LAB_STORE",
    "FLEXMIG_LAB_DIRTY_SAMPLE_SECONDS",
    "FLEXMIG_LAB_DIRTY_SAMPLE_REFRESH",
)
READY_TIMEOUT_S = 300.0


def case_parallel(case: str) -> tuple[str, int]:
    """A case's base and the parallel connections its migration asks for (0: the plan's).

    >>> case_parallel("split-50:p2"), case_parallel("enough")
    (('split-50', 2), ('enough', 0))
    >>> case_parallel("swap-50:p2")
    Traceback (most recent call last):
    ValueError: 'swap-50:p2': a case of enough, split-75, split-50, split-35, swap-50; \
FlexMig's may end :pN (N in 1..8)
    """
    base, sep, count = case.partition(":p")
    parallel = int(count) if count.isdigit() else -1
    if base not in CASES or (
        sep and (base.startswith("swap") or not 1 <= parallel <= MAX_PARALLEL)
    ):
        raise ValueError(
            f"{case!r}: a case of {', '.join(CASES)}; "
            f"FlexMig's may end :pN (N in 1..{MAX_PARALLEL})"
        )
    return base, parallel if sep else 0


def offer_mb(case: str) -> int:
    """What B offers VMs: the budget plus QEMU's own (flexmig/policy/decision.py)."""
    if case == "enough":
        return 4096
    return RAM_MIB * int(case.split("-")[1]) // 100 + QEMU_OVERHEAD_MB


def wait_ready(guest: vm.LabVM) -> None:
    """The working set is filled (TCG on a busy machine takes a while)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            guest.verify()
            return
        except exceptions.GuestError:
            if time.monotonic() > deadline:
                raise
            time.sleep(5)


def settle_samples() -> None:
    """With background sampling (FLEXMIG_LAB_DIRTY_SAMPLE_REFRESH), wait until every
    sampling the agent keeps for the plan began after the working set was filled,
    as for a guest that has run steadily for a while: one begun during the fill
    would plan on the fill's dirty rate."""
    refresh = int(os.environ.get("FLEXMIG_LAB_DIRTY_SAMPLE_REFRESH") or 0)
    if refresh:
        lengths = os.environ.get("FLEXMIG_LAB_DIRTY_SAMPLE_SECONDS") or "1,2,3"
        time.sleep(SAMPLES_MAX_AGE_S + sum(int(s) for s in lengths.split(",")) + 2)


def _after_move_rate(guest: vm.LabVM) -> float:
    """Dirtier pages/s on the destination over AFTER_S, as the guest counts them."""
    first, t0 = guest.verify(), time.monotonic()
    time.sleep(AFTER_S)
    second = guest.verify()
    return (second["written"] - first["written"]) / (time.monotonic() - t0)


def run_flexmig(lab: Lab, name: str, parallel: int = 0) -> dict:
    asked = {"parallel": parallel} if parallel else {}
    result = migrate_cli.migrate(lab, name, "B", show=False, bandwidth_mib=BANDWIDTH_MIB, **asked)
    check = result.get("verify") or {}
    status = lab.agent("B").get(f"/v1/split/{name}")
    keeper = status.get("residency") or {}
    reservation = status.get("reservation") or {}
    row = dict(
        ok=result["state"] == "completed",
        mode=result.get("mode"),
        time_s=(result.get("total_time_ms") or math.nan) / 1000,
        gap_ms=result.get("guest_observed_downtime_ms", math.nan),
        # QEMU's own (source stop to destination resume): the rest of the gap is
        # the guest's first run on B.
        qemu_downtime_ms=result.get("downtime_ms") or math.nan,
        bad=check.get("bad", -1) + check.get("lost", 0),
        pred_time_s=(result.get("predicted_total_ms") or math.nan) / 1000,
        # The guest-observed forecast, as the downtime column is the guest's gap.
        pred_downtime_ms=result.get("predicted_guest_downtime_ms") or math.nan,
        budget_mib=(reservation.get("budget_bytes") or 0) / 2**20,
        max_charge_mib=(keeper.get("max_charge_bytes") or 0) / 2**20,
        dropped_mib=(keeper.get("dropped_bytes") or 0) / 2**20,
        cap_hits=(status.get("cgroup") or {}).get("limit_hits"),
        note=(result.get("error") or "")[:60],
        pred_parts=result.get("predicted_downtime_parts_ms"),  # printed per run, for the reading
        # The share of the VM its plan left in the store: what the first run is learnt beside.
        stored_share=result.get("predicted_stored_share"),  # printed per run
        # QEMU's own memory shares the cap with the guest's RAM: printed per run.
        own_mib=((keeper.get("charge_bytes") or 0) - (keeper.get("guest_resident_bytes") or 0))
        / 2**20,
        by_class=keeper.get("dropped_pages_by_class"),
        # Dropped chunks (1 MiB) the guest read back in its first second on B.
        back_mib=sum((keeper.get("back_after_resume_chunks") or {}).values()),
        back_by_class=keeper.get("back_after_resume_chunks"),  # printed per run
    )
    if row["ok"]:
        row["after_pps"] = _after_move_rate(vm.LabVM(lab, name))
    return row


def run_swap(lab: Lab, name: str, swap_file: Path) -> dict:
    budget = (offer_mb("split-50") - QEMU_OVERHEAD_MB) * 2**20
    lab.agent("B").post(
        "/v1/split/prepare", {"vm": name, "ram_bytes": RAM_MIB * 2**20, "budget_bytes": budget}
    )
    subprocess.run(["swapon", str(swap_file)], check=True)
    try:
        start_ns, t0 = time.monotonic_ns(), time.monotonic()
        stats = vm.migrate_plain(lab, name, "B", bandwidth_mib=BANDWIDTH_MIB, max_downtime_ms=100)
        gap, bad = _measure(lab, name, start_ns, "B")
        cgroup = lab.agent("B").get(f"/v1/split/{name}").get("cgroup") or {}
        return dict(
            ok=True,
            time_s=stats.get("time_elapsed", (time.monotonic() - t0) * 1000) / 1000,
            gap_ms=gap,
            qemu_downtime_ms=stats.get("downtime", math.nan),
            bad=bad,
            budget_mib=budget / 2**20,
            max_charge_mib=(cgroup.get("max_usage_bytes") or 0) / 2**20,
            cap_hits=cgroup.get("limit_hits"),
            after_pps=_after_move_rate(vm.LabVM(lab, name)),
        )
    finally:
        vm.destroy(lab, name)
        subprocess.run(["swapoff", str(swap_file)], check=True)


def one_run(lab: Lab, variant: str, swap_file: Path, workload: str) -> dict:
    case, parallel = case_parallel(variant)
    name = f"bs-{case}" + (f"-p{parallel}" if parallel else "")
    lab.set_budget("B", 4096)
    backing = "anonymous" if case.startswith("swap") else "file"
    vm.create(lab, "A", name=name, ram=f"{RAM_MIB}M", workload=workload, memory_backing=backing)
    try:
        wait_ready(vm.LabVM(lab, name))
        lab.set_budget("B", offer_mb(case) if not case.startswith("swap") else 4096)
        if case.startswith("swap"):
            return run_swap(lab, name, swap_file)
        settle_samples()
        return run_flexmig(lab, name, parallel)
    except exceptions.FlexMigError as exc:
        return dict(ok=False, time_s=math.nan, gap_ms=math.nan, bad=-1, note=str(exc)[:70])
    finally:
        vm.destroy(lab, name)
        lab.set_budget("B", 4096)


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return statistics.median(values) if values else math.nan


def _cap_hits(rows: list[dict]) -> str:
    hits = [r["cap_hits"] for r in rows if isinstance(r.get("cap_hits"), int)]
    return str(max(hits)) if hits else ""


def _each(rows: list[dict], key: str) -> str:
    """Each completed run's ``key``, where the case has it (swap has no keeper)."""
    return ", ".join(f"{r[key]:.0f}" for r in rows if r.get("ok") and key in r)


def table(runs: dict[str, list[dict]]) -> list[str]:
    base_t, base_d = _median(runs["enough"], "time_s"), _median(runs["enough"], "gap_ms")
    lines = []
    for case, rows in runs.items():
        t, d = _median(rows, "time_s"), _median(rows, "gap_ms")
        pt, pd = _median(rows, "pred_time_s"), _median(rows, "pred_downtime_ms")
        max_charge = max(r.get("max_charge_mib", 0) for r in rows)
        pred = f"{pt:.2f} s ({pt / t - 1:+.0%}) / {pd:.0f} ms ({pd / d - 1:+.0%})"
        lines.append(
            f"| {case} | {sum(r['ok'] for r in rows)}/{len(rows)} | {t:.2f} | {t / base_t:.2f} "
            f"| {d:.0f} ({_each(rows, 'gap_ms')}) | {_each(rows, 'qemu_downtime_ms')} "
            f"| {d - base_d:+.0f} "
            f"| {max(r['bad'] for r in rows)} "
            f"| {_median(rows, 'budget_mib'):.0f} | {max_charge:.0f} | {_cap_hits(rows)} "
            f"| {_each(rows, 'back_mib')} | {pred if not case.startswith('swap') else ''} "
            f"| {_median(rows, 'after_pps'):.0f} "
            f"| {rows[0].get('note', '')} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"subset of {', '.join(CASES)}; a FlexMig case may end :pN (N parallel connections)",
    )
    parser.add_argument("--workload", default=WORKLOAD, help="the guest's (lab VM syntax)")
    args = parser.parse_args()
    try:
        vmspec.make_spec("bs-enough", f"{RAM_MIB}M", 1, args.workload, "file", 0)
    except exceptions.InvalidInput as exc:
        parser.error(f"--workload: {exc}")
    cases = args.cases.split(",")
    try:
        for case in cases:
            case_parallel(case)
    except ValueError as exc:
        parser.error(f"--cases: {exc}")
    if "enough" not in cases or len(set(cases)) != len(cases):
        parser.error("--cases: each case once, 'enough' among them (the baseline)")
    # A timeout's or an operator's SIGTERM still takes the lab (and the swap) down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    image.build()
    args.load_at_start = os.getloadavg()[0]
    args.started = datetime.datetime.now(datetime.UTC).strftime("%H:%M")
    lab = Lab()
    lab.down()
    lab.up(2)
    swap_file = Path("/var/tmp/flexmig-bench-split-swapfile")
    bench_modes.make_swap_file(swap_file)
    runs: dict[str, list[dict]] = {case: [] for case in cases}
    try:
        for _ in range(args.repeat):  # cases interleaved: a noisy spell hits all of them
            for case in cases:
                runs[case].append(one_run(lab, case, swap_file, args.workload))
                print(case, runs[case][-1], flush=True)
    finally:
        lab.down()
        swap_file.unlink(missing_ok=True)
    write(args, runs)


def write(args: argparse.Namespace, runs: dict[str, list[dict]]) -> None:
    env = " ".join(f"{k}={os.environ[k]}" for k in LAB_ENV if os.environ.get(k))
    command = (
        (env + " " if env else "")
        + ".venv/bin/python -m tests.bench.bench_split"
        + (f" --repeat {args.repeat}" if args.repeat != 1 else "")
        + (f" --cases {args.cases}" if args.cases != ",".join(CASES) else "")
        + (f" --out {args.out}" if args.out != DEFAULT_OUT else "")
        + (f" --workload {args.workload}" if args.workload != WORKLOAD else "")
    )
    header = [
        f"# Split vs enough RAM vs conventional swap ({datetime.date.today()})",
        "",
        f"Command: `{command}`",
        "",
        f"Lab: 2 hosts, {RAM_MIB} MiB TCG guest `{args.workload}`, file-backed (swap: anonymous), "
        f"stream capped at {BANDWIDTH_MIB} MiB/s; split-N: B offers N % of the VM's RAM as its "
        "resident budget; swap-50: the split-50 cap on an anonymous guest with a host swap file. "
        f"Medians of {args.repeat} run(s). Downtime is guest-observed; QEMU's = its own "
        "downtime per run (source stop to destination resume). bad = bad + lost pages "
        "(max). max charge = largest charge of B's cgroup (keeper's samples for split, the "
        "kernel's peak for swap). cap hits = times a charge met B's cap and had to reclaim "
        "(memory.failcnt, max). read back = MiB the keeper had dropped that the guest read "
        "back in its first second on B, per run (split; it includes the guest's verify, "
        "which starts as soon as the heartbeat is back). "
        f"after = dirtier pages/s in the {AFTER_S:.0f} s after the move "
        f"(the workload asks for {vmspec.parse_workload(args.workload).rate}/s).",
        "",
        f"QEMU {_lab_qemu_version()}; started {args.started} UTC; load average at the start "
        f"{args.load_at_start:.1f}, at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
        "CPUs (the machine is shared; every lab run holds the lab lock).",
        "",
        "| case | completed | total s | x enough | downtime ms (each run) | QEMU's ms "
        "| vs enough ms | bad "
        "| budget MiB | max charge MiB | cap hits | read back MiB "
        "| predicted total / downtime (error) | after pages/s | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(header + table(runs)) + "\n")


if __name__ == "__main__":
    main()
