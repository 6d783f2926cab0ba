"""The data mover against the raw path and QEMU's own TCP, in one run.

    .venv/bin/python -m tests.bench.bench_mover [--out FILE]

On the lab's management fabric (A -> B), unshaped and shaped to 10 and 1
Gbit/s (tc tbf on the fabric port towards B): iperf3 (the raw path), the mover
alone (depth 4 and depth 1), and the same precopy migration over QEMU's TCP
and through the movers.  CPU is user+sys seconds per GiB moved, both movers
together.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time
from pathlib import Path

from agents.mover import BINARY
from flexmig import migrate_cli
from flexmig.lab import commands, image, topology, vm
from flexmig.lab.lab import Lab

TOKEN = "benchmark-credential-0123456789abcdef"
MOVER_BYTES = 512 * 2**20
GIB = 2**30


def shape(lab: Lab, rate: str | None) -> None:
    dev = lab.host("B").spec.fabric_mgmt_if
    base = ["ip", "netns", "exec", topology.FABRIC_NETNS, "tc", "qdisc"]
    commands.run([*base, "del", "dev", dev, "root"], check=False)
    if rate:
        commands.run(
            [
                *base,
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "4mb",
                "latency",
                "100ms",
            ]
        )


def iperf(lab: Lab) -> float:
    a, b = lab.host("A"), lab.host("B")
    server = subprocess.Popen(
        [*b.ns.exec_prefix(), "iperf3", "-s", "-1", "-B", b.spec.mgmt_ip],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    out = a.ns.run(["iperf3", "-c", b.spec.mgmt_ip, "-t", "5", "-J"], timeout=60).stdout
    server.wait(10)
    return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 8 / 2**20


def mover_alone(lab: Lab, src: Path, depth: int) -> dict[str, float]:
    a, b = lab.host("A"), lab.host("B")
    env = dict(os.environ, FM_MOVER_TOKEN=TOKEN)
    common = ["--port", "7465", "--depth", str(depth)]
    recv = subprocess.Popen(
        [
            *b.ns.exec_prefix(),
            str(BINARY),
            "recv",
            "--local",
            b.spec.mgmt_ip,
            "--output",
            "/dev/null",
            *common,
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    send = subprocess.run(
        [
            *a.ns.exec_prefix(),
            str(BINARY),
            "send",
            "--local",
            a.spec.mgmt_ip,
            "--peer",
            b.spec.mgmt_ip,
            "--input",
            str(src),
            *common,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    r = json.loads(recv.communicate(timeout=60)[1].strip().splitlines()[-1])
    s = json.loads(send.stderr.strip().splitlines()[-1])
    cpu = sum(x["cpu_user_s"] + x["cpu_sys_s"] for x in (s, r))
    return {"mib_s": s["mib_per_s"], "cpu_s_per_gib": cpu / (s["bytes"] / GIB)}


def migration(lab: Lab, transport: str, n: int) -> dict[str, float]:
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
        r = migrate_cli.migrate(lab, name, "B", mode="precopy", show=False, transport=transport)
        assert r["state"] == "completed" and r["verify"]["bad"] == 0, r.get("error")
        out = {
            "time_s": r["total_time_ms"] / 1000,
            "downtime_ms": r["guest_observed_downtime_ms"],
            "mib_s": r["bytes_moved"] / 2**20 / (r["total_time_ms"] / 1000),
        }
        if r.get("movers"):
            s, v = r["movers"]["send"], r["movers"]["recv"]
            cpu = sum(x["cpu_user_s"] + x["cpu_sys_s"] for x in (s, v))
            out["mover_cpu_s_per_gib"] = cpu / (s["bytes"] / GIB)
        return out
    finally:
        vm.destroy(lab, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/mover.md"))
    args = parser.parse_args()
    image.build()
    lab = Lab()
    lab.down()
    lab.up(2)
    src = lab.dir / "mover-input"
    src.write_bytes(os.urandom(MOVER_BYTES))
    rows, n = [], 0
    try:
        for label, rate in (("unshaped", None), ("10 Gbit/s", "10gbit"), ("1 Gbit/s", "1gbit")):
            shape(lab, rate)
            raw = iperf(lab)
            d4, d1 = mover_alone(lab, src, 4), mover_alone(lab, src, 1)
            n += 1
            tcp = migration(lab, "qemu-tcp", n)
            n += 1
            mov = migration(lab, "mover", n)
            rows.append(
                f"| {label} | {raw:.0f} | {d4['mib_s']:.0f} ({d4['mib_s'] / raw:.0%}) | "
                f"{d4['cpu_s_per_gib']:.2f} | {d1['mib_s']:.0f} | "
                f"{tcp['mib_s']:.0f} / {tcp['time_s']:.2f} s / {tcp['downtime_ms']:.0f} ms | "
                f"{mov['mib_s']:.0f} / {mov['time_s']:.2f} s / {mov['downtime_ms']:.0f} ms | "
                f"{mov['mib_s'] / tcp['mib_s']:.2f} | {mov['mover_cpu_s_per_gib']:.2f} |"
            )
            print(rows[-1], flush=True)
    finally:
        shape(lab, None)
        lab.down()
    header = [
        f"# Data mover vs raw path vs QEMU TCP ({datetime.date.today()})",
        "",
        "Command: `.venv/bin/python -m tests.bench.bench_mover`",
        "",
        "Lab management fabric A -> B (veth + Linux bridge), provider tcp;ofi_rxm, batches "
        "of 4 MiB. Raw path: iperf3 single stream. Mover alone: 512 MiB from page cache to "
        "/dev/null. Migrations: 512 MiB anonymous TCG guest, 128 MiB working set at 3,000 "
        "pages/s, mode precopy; throughput = bytes moved / total time. CPU: user+sys of "
        "both movers per GiB.",
        "",
        "| fabric | raw MiB/s | mover depth 4 MiB/s (of raw) | mover CPU s/GiB | mover depth 1 "
        "MiB/s | migration qemu-tcp MiB/s / total / downtime | migration via mover | "
        "mover/qemu-tcp | mover CPU s/GiB in migration |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(header + rows) + "\n")


if __name__ == "__main__":
    main()
