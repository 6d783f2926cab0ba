"""How the eSwitch ports are polled, against the offloaded path's host CPU.

    .venv/bin/python -m tests.bench.offload_napi_modes [--out FILE] [--streams 8]
        [--rounds 2] [--duration 4] [--udp-mbps 100] [--protos udp-paced,udp,tcp]
        [--modes threaded,softirq,...]

Part (b) of bench_offload_datapath at one stream count, for each protocol
(UDP paced is where the XDP path's CPU per Gbit/s is highest; unpaced UDP and
TCP show what the polling style does to throughput): plain OVS once per round, then the
offloaded path with the ports' NAPI polled in a kernel thread (the provider's
``threaded_napi``, the lab's default) or in softirq, each optionally with
interrupt-moderation style deferral (``napi_defer_hard_irqs`` 1 and
``gro_flush_timeout`` in µs).  Softirq is timed exactly (softirq_time.py), so
the two polling styles are read with the same precision.  Rounds interleave
every mode; each cell is its median round.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
from pathlib import Path

from flexmig_lab import traffic
from flexmig_lab.host import LabHost
from tests.bench import bench_offload_datapath as datapath

DEFAULT_OUT = Path("docs/benchmarks/offload-napi-modes.md")
NO_DEFERRAL = {"napi_defer_hard_irqs": "0", "gro_flush_timeout": "0"}
DEFAULT_MODES = "threaded,softirq,threaded+defer100,softirq+defer100,threaded+defer250"


def napi_knobs(mode: str) -> dict[str, str]:
    """sysfs values for a mode such as ``softirq+defer100`` (µs)."""
    polling, sep, defer = mode.partition("+defer")
    if polling not in ("threaded", "softirq") or (sep and not defer.isdigit()):
        raise ValueError(f"unknown NAPI mode {mode!r}: threaded|softirq[+deferUS]")
    return {
        "threaded": "1" if polling == "threaded" else "0",
        "napi_defer_hard_irqs": "1" if defer else "0",
        "gro_flush_timeout": str(int(defer) * 1000) if defer else "0",
    }


def set_napi(host: LabHost, ports: list[str], knobs: dict[str, str]) -> None:
    for port in ports:
        for knob, value in knobs.items():
            subprocess.run(
                ["ip", "netns", "exec", host.spec.netns, "tee", f"/sys/class/net/{port}/{knob}"],
                input=value,
                text=True,
                capture_output=True,
                check=True,
                timeout=10,
            )


def measure(args: argparse.Namespace) -> dict[str, list[dict]]:
    lab, eps = datapath.setup_lab(args.streams)
    senders = [eps[f"s{i}"] for i in range(args.streams)]
    receivers = [eps[f"r{i}"] for i in range(args.streams)]
    rows: dict[str, list[dict]] = {}
    for round_no, proto in ((r, p) for r in range(args.rounds) for p in args.protos):
        for mode in ["plain", *args.modes]:
            tune = None if mode == "plain" else (lambda h, p, m=mode: set_napi(h, p, napi_knobs(m)))
            try:
                row = datapath.stream_row(
                    lab, senders, receivers, proto, args, mode != "plain", tune
                )
            finally:
                for host in lab.hosts():  # deferral is kept per device: undo it
                    ports = [
                        "phy0",
                        *(e.port for e in [*senders, *receivers] if e.host == host.name),
                    ]
                    set_napi(host, ports, NO_DEFERRAL)
            rows.setdefault(f"{proto}/{mode}", []).append(row)
            print(f"round {round_no} {proto}/{mode}: {row}", flush=True)
    return rows


def render(rows: dict[str, list[dict]], args: argparse.Namespace, command: str) -> str:
    lines = [
        f"# eSwitch port polling vs the offloaded path's host CPU ({datetime.date.today()})",
        "",
        f"Command: `{command}`",
        "",
        f"{args.streams} streams B -> A (udp-paced: {args.udp_mbps:g} Mbit/s each; udp: "
        f"unpaced; tcp: iperf3), {args.duration:g} s per row, {args.rounds} interleaved "
        "rounds (median; every round listed). Host CPU as in offload-datapath.md (b): "
        "ovs-vswitchd of both hosts + the network softirq time (exact) + the ports' NAPI "
        "threads. Deferral: "
        "`napi_defer_hard_irqs` 1 and `gro_flush_timeout` as named.",
        "",
        "| proto | ports polled | Gbit/s | softirq % | port NAPI % | "
        "host CPU %/Gbit/s (rounds) | vs plain OVS | packets per wake-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, cell in rows.items():
        proto, mode = key.split("/")
        base = statistics.median(r["cpu_per_gbps"] for r in rows[f"{proto}/plain"])
        median = sorted(cell, key=lambda r: r["cpu_per_gbps"])[(len(cell) - 1) // 2]
        rounds = ", ".join(f"{r['cpu_per_gbps']:.0f}" for r in cell)
        wakeups = f"{median['packets_per_wakeup']:.1f}" if median["packets_per_wakeup"] else ""
        label = "plain OVS (no eSwitch)" if mode == "plain" else f"offloaded, {mode}"
        lines.append(
            f"| {proto} | {label} | {median['gbps']:.2f} | {median['softirq_pct']:.0f} | "
            f"{median['napi_pct']:.0f} | {median['cpu_per_gbps']:.0f} ({rounds}) | "
            f"{median['cpu_per_gbps'] / base:.2f} | {wakeups} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--udp-mbps", type=float, default=100)
    parser.add_argument("--modes", default=DEFAULT_MODES)
    parser.add_argument("--protos", default="udp-paced")
    args = parser.parse_args()
    args.modes, args.protos = args.modes.split(","), args.protos.split(",")
    if not set(args.protos) <= set(datapath.STREAM_PROTOS):
        parser.error(f"--protos: choose from {','.join(datapath.STREAM_PROTOS)}")
    for mode in args.modes:
        try:
            napi_knobs(mode)
        except ValueError as exc:
            parser.error(str(exc))
    traffic.check_built()
    command = ".venv/bin/python -m tests.bench.offload_napi_modes " + " ".join(sys.argv[1:])
    rows = measure(args)
    datapath.write_results(args.out, render(rows, args, command.strip()), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
