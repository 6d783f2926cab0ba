"""Stress: repeated long migrations A->B, each checked by the guest's own verify.

This is what exposed QEMU 7.2's TCG dirty-tracking bug (README, "The lab"): a
guest dirtying a 200 MiB working set, a destination short of RAM (split) or
not (--mode precopy), a low downtime limit so precopy runs many rounds.  It
prints one line per run and exits 1 if any page was bad or lost, or a guest
was lost.

    .venv/bin/python -m tests.bench.stress_split --runs 10 [--mode split|precopy]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from flexmig_lab.lab import Lab

FLEXMIG = [sys.executable, "-m", "flexmig.cli"]


def _flexmig(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FLEXMIG, *args], capture_output=True, text=True, check=check)


def one_run(index: int, mode: str, budget: str) -> tuple[bool, str]:
    name = f"stress{index}"
    _flexmig("lab", "host", "budget", "B", "4096M")
    _flexmig(
        "lab", "vm", "create", "--host", "A", "--name", name, "--ram", "512M",
        "--workload", "dirtier:wss=200M,rate=2000", "--memory-backing", "file",
    )  # fmt: skip
    try:
        _flexmig("lab", "host", "budget", "B", budget if mode == "split" else "4096M")
        proc = _flexmig("migrate", name, "--to", "B", "--mode", mode, "--json", check=False)
        try:
            summary = json.loads(proc.stdout)
        except json.JSONDecodeError:
            return False, f"no summary (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
        check = summary.get("verify") or {}
        ok = summary.get("state") == "completed" and check.get("bad") == 0 == check.get("lost")
        return ok, (
            f"{summary.get('state')} rounds={summary.get('rounds')} "
            f"total={summary.get('total_time_ms')} ms "
            f"guest downtime={summary.get('guest_observed_downtime_ms')} ms "
            f"bad={check.get('bad')} lost={check.get('lost')} of {check.get('pages')}"
        )
    finally:
        _flexmig("lab", "vm", "destroy", name, check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--mode", choices=("split", "precopy"), default="split")
    parser.add_argument("--budget", default="400M", help="B's VM budget for split runs")
    args = parser.parse_args()
    lab = Lab()
    lab.down()
    lab.up(2)
    failures = 0
    try:
        for i in range(1, args.runs + 1):
            ok, line = one_run(i, args.mode, args.budget)
            failures += not ok
            print(f"run {i}: {'ok ' if ok else 'BAD'} {line}", flush=True)
    finally:
        lab.down()
    print(f"{args.runs - failures}/{args.runs} runs with every page correct")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
