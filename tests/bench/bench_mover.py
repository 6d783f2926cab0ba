"""The data mover against the raw path and QEMU's own TCP, in one run.

    .venv/bin/python -m tests.bench.bench_mover [--out FILE]

On the lab's management fabric (A -> B), unshaped, shaped to 10 and 1 Gbit/s
(tc tbf on the fabric port towards B) and with 2 ms of added delay (netem):

* the raw path (iperf3) against the mover alone at depth 4 and depth 1, runs
  interleaved, medians of three;
* the same precopy migration over QEMU's TCP and through the movers (medians
  of two on the unshaped fabric, where the ratio is the target);
* parallel connections (libvirt's VIR_MIGRATE_PARALLEL, QEMU multifd) 1, 2
  and 4, over QEMU's TCP and through one mover pair per connection.

CPU is user+sys seconds per GiB of the transfer proper (the movers also report
their setup apart: fabric, registration, bootstrap), both sides together.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from agents.mover import BINARY
from flexmig import migrate_cli, processutil
from flexmig_lab import image, topology, vm
from flexmig_lab.lab import Lab

TOKEN = "benchmark-credential-0123456789abcdef"
MOVER_BYTES = 512 * 2**20
GIB = 2**30
FABRICS = (
    ("unshaped", []),
    ("10 Gbit/s", ["tbf", "rate", "10gbit", "burst", "4mb", "latency", "100ms"]),
    ("1 Gbit/s", ["tbf", "rate", "1gbit", "burst", "4mb", "latency", "100ms"]),
)
# (depth, batch KiB): seed 000's 4 MiB and the tcp default of 256 KiB, each with the
# default depth and with no overlap (depth 1).
MOVER_RUNS = ((4, 4096), (1, 4096), (4, 256), (1, 256))
PARALLEL = (2, 4)


def shape(lab: Lab, qdisc: list[str]) -> None:
    dev = lab.host("B").spec.fabric_mgmt_if
    base = ["ip", "netns", "exec", topology.FABRIC_NETNS, "tc", "qdisc"]
    processutil.run([*base, "del", "dev", dev, "root"], check=False)
    if qdisc:
        processutil.run([*base, "add", "dev", dev, "root", *qdisc])


def iperf(lab: Lab, seconds: int = 3) -> dict[str, float]:
    a, b = lab.host("A"), lab.host("B")
    server = subprocess.Popen(
        [*b.ns.exec_prefix(), "iperf3", "-s", "-1", "-B", b.spec.mgmt_ip],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    out = a.ns.run(["iperf3", "-c", b.spec.mgmt_ip, "-t", str(seconds), "-J"], timeout=60).stdout
    server.wait(10)
    end = json.loads(out)["end"]
    cpu = end["cpu_utilization_percent"]
    moved = end["sum_received"]["bytes"]
    busy_s = (cpu["host_total"] + cpu["remote_total"]) / 100 * end["sum_received"]["seconds"]
    return {
        "mib_s": end["sum_received"]["bits_per_second"] / 8 / 2**20,
        "cpu_s_per_gib": busy_s / (moved / GIB),
    }


def mover_alone(
    lab: Lab, src: Path, depth: int, batch_kib: int = 4096, binary: Path = BINARY
) -> dict[str, float]:
    a, b = lab.host("A"), lab.host("B")
    env = dict(os.environ, FM_MOVER_TOKEN=TOKEN)
    common = ["--port", "7465", "--depth", str(depth), "--batch-kib", str(batch_kib)]
    recv_args = ["--local", b.spec.mgmt_ip, "--output", "/dev/null", "--slots", "16"]
    send_args = ["--local", a.spec.mgmt_ip, "--peer", b.spec.mgmt_ip, "--input", str(src)]
    recv = subprocess.Popen(
        [*b.ns.exec_prefix(), str(binary), "recv", *recv_args, *common],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    send = subprocess.run(
        [*a.ns.exec_prefix(), str(binary), "send", *send_args, *common],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    r = json.loads(recv.communicate(timeout=60)[1].strip().splitlines()[-1])
    s = json.loads(send.stderr.strip().splitlines()[-1])
    return {"mib_s": s["mib_per_s"], "cpu_s_per_gib": _transfer_cpu(s, r) / (s["bytes"] / GIB)}


def _transfer_cpu(*stats: dict[str, Any]) -> float:
    """CPU of the transfer proper (older movers report only the total)."""
    return sum(
        x.get("cpu_transfer_s", x["cpu_user_s"] + x["cpu_sys_s"])  # type: ignore[misc]
        for x in stats
    )


def migration(lab: Lab, transport: str, n: int, parallel: int = 1) -> dict[str, float]:
    name = f"bm{n}"
    vm.create(
        lab,
        "A",
        ram="512M",
        workload="dirtier:wss=128M,rate=3000",
        memory_backing="anonymous",
        name=name,
    )
    try:
        time.sleep(2)
        r = migrate_cli.migrate(
            lab,
            name,
            "B",
            mode="precopy",
            show=False,
            transport=transport,
            parallel=parallel,
        )
        assert r["state"] == "completed" and r["verify"]["bad"] == 0, r.get("error")
        out = {
            "time_s": r["total_time_ms"] / 1000,
            "downtime_ms": r["guest_observed_downtime_ms"],
            "mib_s": r["bytes_moved"] / 2**20 / (r["total_time_ms"] / 1000),
        }
        if r.get("movers"):
            s, v = r["movers"]["send"], r["movers"]["recv"]
            out["mover_cpu_s_per_gib"] = _transfer_cpu(s, v) / (s["bytes"] / GIB)
            total = sum(x["cpu_user_s"] + x["cpu_sys_s"] for x in (s, v))
            out["mover_setup_cpu_s"] = total - _transfer_cpu(s, v)
        return out
    finally:
        vm.destroy(lab, name)


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median throughput, its other figures with it (of two: the lower)."""
    ranked = sorted(runs, key=lambda r: r["mib_s"])
    return ranked[(len(ranked) - 1) // 2]


class Bench:
    def __init__(self, lab: Lab, src: Path) -> None:
        self.lab, self.src, self.n = lab, src, 0

    def migrate(self, transport: str, parallel: int = 1) -> dict[str, float]:
        self.n += 1
        return migration(self.lab, transport, self.n, parallel)

    def alone_row(self, label: str) -> str:
        raws = [iperf(self.lab)]
        runs: dict[tuple[int, int], list[dict[str, float]]] = {run: [] for run in MOVER_RUNS}
        for _ in range(3):
            for depth, batch_kib in MOVER_RUNS:
                runs[depth, batch_kib].append(mover_alone(self.lab, self.src, depth, batch_kib))
        raws.append(iperf(self.lab))
        raw = statistics.mean(r["mib_s"] for r in raws)
        raw_cpu = statistics.mean(r["cpu_s_per_gib"] for r in raws)
        mib = {run: statistics.median(r["mib_s"] for r in rs) for run, rs in runs.items()}
        cpu = statistics.median(r["cpu_s_per_gib"] for r in runs[4, 4096])
        small_cpu = statistics.median(r["cpu_s_per_gib"] for r in runs[4, 256])
        d4, d1, s4, s1 = (mib[run] for run in MOVER_RUNS)
        return (
            f"| {label} | {raw:.0f} | {raw_cpu:.2f} | {s4:.0f} ({s4 / raw:.0%}) | "
            f"{small_cpu:.2f} | {s1:.0f} | {s4 / s1:.2f}x | {d4:.0f} ({d4 / raw:.0%}) | "
            f"{cpu:.2f} | {d1:.0f} | {d4 / d1:.2f}x |"
        )

    def migration_row(self, label: str, repeats: int) -> str:
        tcp_runs, mover_runs = [], []
        for _ in range(repeats):
            tcp_runs.append(self.migrate("qemu-tcp"))
            mover_runs.append(self.migrate("mover"))
        tcp, mov = median_run(tcp_runs), median_run(mover_runs)
        return (
            f"| {label} | {_mig(tcp)} | {_mig(mov)} | {mov['mib_s'] / tcp['mib_s']:.2f} | "
            f"{mov['mover_cpu_s_per_gib']:.2f} | {mov['mover_setup_cpu_s']:.2f} |"
        )

    def parallel_rows(self) -> list[str]:
        rows = []
        for parallel in PARALLEL:
            tcp = self.migrate("qemu-tcp", parallel)
            mov = self.migrate("mover", parallel)
            rows.append(
                f"| {parallel} | {_mig(tcp)} | {_mig(mov)} | {mov['mib_s'] / tcp['mib_s']:.2f} | "
                f"{mov['mover_cpu_s_per_gib']:.2f} | {mov['mover_setup_cpu_s']:.2f} |"
            )
            print(rows[-1], flush=True)
        return rows


def _mig(r: dict[str, float]) -> str:
    return f"{r['mib_s']:.0f} / {r['time_s']:.2f} s / {r['downtime_ms']:.0f} ms"


HEADER = """\
# Data mover vs raw path vs QEMU TCP ({date})

Command: `.venv/bin/python -m tests.bench.bench_mover`

Lab management fabric A -> B (veth + Linux bridge), provider tcp;ofi_rxm (default batches
of 256 KiB there), run with no other lab job on the 2 cores. Raw path:
iperf3, one stream, two 3 s runs (before and after the mover runs) averaged. Mover alone:
512 MiB from page cache to /dev/null, with 256 KiB and with seed 000's 4 MiB batches, the
four variants interleaved, medians of 3 (receiver ring of 16 slots in every run).
Migrations: 512 MiB anonymous TCG guest, 128 MiB working set at 3,000 pages/s, mode
precopy; throughput = bytes moved / libvirt's total time; on the unshaped fabric the run
with the median throughput of {repeats}, one run elsewhere. CPU: user+sys seconds per GiB,
both ends together (iperf3's own report; the movers' from the first byte on, their setup
shown apart).

## The mover alone

| fabric | raw MiB/s | raw CPU s/GiB | mover, 256 KiB (tcp default), depth 4 MiB/s (of raw) \
| CPU s/GiB | depth 1 MiB/s | depth 4 / depth 1 | mover, 4 MiB, depth 4 (of raw) | CPU s/GiB \
| depth 1 | depth 4 / depth 1 |
|---|---|---|---|---|---|---|---|---|---|---|
"""

MIGRATION_HEADER = """
## A migration over QEMU's TCP and through the movers

| fabric | qemu-tcp MiB/s / total / downtime | via mover | mover/qemu-tcp | mover CPU s/GiB \
| mover setup CPU s |
|---|---|---|---|---|---|
"""

PARALLEL_HEADER = """
## Parallel connections (unshaped; 1 connection: the table above, unshaped row)

| connections | qemu-tcp MiB/s / total / downtime | via mover (a pair per connection + main) \
| mover/qemu-tcp | mover CPU s/GiB | mover setup CPU s |
|---|---|---|---|---|---|
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/mover.md"))
    parser.add_argument("--repeats", type=int, default=3, choices=range(1, 4))
    args = parser.parse_args()
    image.build()
    lab = Lab()
    lab.down()
    lab.up(2)
    src = lab.dir / "mover-input"
    src.write_bytes(os.urandom(MOVER_BYTES))
    bench = Bench(lab, src)
    alone, migrations, parallel = [], [], []
    try:
        for label, qdisc in FABRICS:
            shape(lab, qdisc)
            alone.append(bench.alone_row(label))
            print(alone[-1], flush=True)
            repeats = args.repeats if label == "unshaped" else 1
            migrations.append(bench.migration_row(label, repeats))
            print(migrations[-1], flush=True)
            if label == "unshaped":
                parallel = bench.parallel_rows()
    finally:
        shape(lab, [])
        lab.down()
    text = HEADER.format(date=datetime.date.today(), repeats=args.repeats)
    text += "\n".join(alone) + "\n" + MIGRATION_HEADER + "\n".join(migrations) + "\n"
    text += PARALLEL_HEADER + "\n".join(parallel) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
