"""Stress: repeated hybrid postcopy migrations A->B; a run that does not end is dumped.

The hot guest of test_mover's hybrid test (256 MiB rewritten at 150k pages/s,
64 MiB/s cap) goes by hybrid postcopy over each transport in turn.  A run
still going after ``--hang-after`` seconds has both ends' state written to
``--dump``: libvirt's job, QEMU's ``query-migrate`` and capabilities, the
domains' states, the agent's migration record and the threads of the source
agent (py-spy, if installed), QEMU and libvirtd (eu-stack, if installed).
It prints one line per run and exits 1 if any run hung, failed or lost a page.

    .venv/bin/python -m tests.bench.stress_postcopy --runs 10 [--transports mover,qemu-tcp]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from flexmig import exceptions, migrate_cli
from flexmig_lab import vm
from flexmig_lab.lab import Lab

QMP = ('{"execute":"query-migrate"}', '{"execute":"query-migrate-capabilities"}')


def _run(cmd: list[str], timeout: float = 60) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"{cmd[0]}: no answer within {timeout:.0f} s (itself a finding)\n"
    return done.stdout + done.stderr


def _host_state(lab: Lab, host: str, name: str) -> list[str]:
    prefix = lab.host(host).ns.exec_prefix()
    out = [f"===== host {host}"]
    out += [_run([*prefix, "virsh", "domstate", "--reason", name], 20)]
    out += [_run([*prefix, "virsh", "domjobinfo", name], 20)]
    out += [_run([*prefix, "virsh", "qemu-monitor-command", name, q], 20) for q in QMP]
    if shutil.which("eu-stack"):
        for pattern in (f"guest={name}", "libvirtd"):
            for pid in _run([*prefix, "pgrep", "-f", pattern], 10).split():
                out += [f"--- threads of {pattern} ({pid})", _run([*prefix, "eu-stack", "-p", pid])]
    return out


def dump(lab: Lab, name: str, migration_id: str, path: Path) -> None:
    out = _host_state(lab, "A", name) + _host_state(lab, "B", name)
    try:
        record = lab.agent("A").get(f"/v1/migrations/{migration_id}")
        out.append(json.dumps(record, indent=1, default=str))
    except Exception as exc:  # noqa: BLE001 - a dump reports what it could not read
        out.append(f"agent record: {exc!r}")
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if Path(spy).exists():
        for pid in _run(["pgrep", "-f", "agents.agent.service"], 10).split():
            out += [f"--- agent threads ({pid})", _run([spy, "dump", "--pid", pid])]
    path.write_text("\n".join(out))


def one_run(lab: Lab, index: int, transport: str, hang_after: float, dump_dir: Path) -> bool:
    name = f"pc{index}{transport[0]}"  # names are never reused within a lab
    vm.create(
        lab, "A", ram="512M", workload="dirtier:wss=256M,rate=150000",
        memory_backing="anonymous", name=name,
    )  # fmt: skip
    outcome: dict[str, Any] = {}

    def migrate() -> None:
        _source, agent, outcome["id"] = migrate_cli.start(
            lab, name, "B", mode="postcopy", bandwidth_mib=64, transport=transport
        )
        outcome["record"] = migrate_cli.follow(agent, outcome["id"])

    worker = threading.Thread(target=migrate, daemon=True)
    start = time.monotonic()
    worker.start()
    worker.join(hang_after)
    if worker.is_alive():
        path = dump_dir / f"run{index}-{transport}.txt"
        dump(lab, name, outcome.get("id", "?"), path)
        print(f"run {index} {transport}: HUNG (> {hang_after:.0f} s), state in {path}", flush=True)
        return False
    try:
        record = outcome["record"]
        landed = lab.vm_host(name)
        try:
            check = lab.guest(name).verify() if landed else {}  # type: ignore[union-attr]
        except exceptions.FlexMigError as exc:  # a guest that cannot say is a bad run
            check = {"error": str(exc)}
        ok = record["state"] == "completed" and check.get("bad") == 0 == check.get("lost")
        events = "; ".join(text for _ts, text in record["events"][3:])
        print(
            f"run {index} {transport}: {'ok ' if ok else 'BAD'} {record['state']} in "
            f"{time.monotonic() - start:.0f} s, on {landed}, verify {check}, "
            f"error {record['error']}, events: {events}",
            flush=True,
        )
        return ok
    finally:
        vm.destroy(lab, name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--transports", default="mover,qemu-tcp")
    parser.add_argument("--hang-after", type=float, default=240.0)
    parser.add_argument("--dump", type=Path, default=Path("/tmp/flexmig-stress-postcopy"))
    args = parser.parse_args()
    args.dump.mkdir(parents=True, exist_ok=True)
    lab = Lab()
    lab.down()
    lab.up(2)
    failures = total = 0
    try:
        for i in range(args.runs):
            for transport in args.transports.split(","):
                total += 1
                failures += not one_run(lab, i, transport, args.hang_after, args.dump)
    finally:
        lab.down()
    print(f"{total - failures}/{total} runs completed with every page correct")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
