"""How long real ``ovs-ofctl`` takes to read N flows from the statistics endpoint.

    .venv/bin/python -m tests.bench.bench_openflow_stats [--out FILE]

The endpoint on a UNIX socket, fed N offloaded-flow records (UDP 5-tuples);
``/usr/bin/ovs-ofctl dump-flows`` and ``dump-aggregate`` with OpenFlow 1.0
(no -O) and 1.3, median of 3 runs each, wall time of the whole command (its
start, negotiation, the dump, and printing every line).  Beside it, the
endpoint's own share: selecting and encoding all N flows in-process, first
dump and the best of later ones.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from ovs_ext.flow_record import FlowRecord
from ovs_ext.openflow_stats import OpenFlowStatsServer, codec, codec10
from ovs_ext.openflow_stats.codec import FlowStatsRequest
from ovs_ext.openflow_stats.selection import select
from ovs_ext.openflow_stats.session import _encoded

SIZES = (1_000, 10_000, 100_000)
RUNS = 3


def records(count: int, base: int) -> list[FlowRecord]:
    return [
        FlowRecord(
            0, 10, i,
            {"in_port": 1 + i % 8, "eth_type": 0x0800, "ip_proto": 17,
             "ipv4_src": str(ipaddress.IPv4Address(base + i)), "ipv4_dst": "10.1.0.1",
             "udp_src": 1024 + i % 60000, "udp_dst": 5001},
            packets=i, bytes=64 * i, duration_s=i / 1000, out_port=2, offloaded=True,
        )
        for i in range(count)
    ]  # fmt: skip


def timed_ofctl(args: list[str], expect_lines: int | None) -> float:
    samples = []
    for _ in range(RUNS):
        started = time.perf_counter()
        result = subprocess.run(
            ["/usr/bin/ovs-ofctl", *args], capture_output=True, text=True, timeout=300, check=True
        )
        samples.append(time.perf_counter() - started)
        if expect_lines is not None:
            assert result.stdout.count(" cookie=") == expect_lines
    return statistics.median(samples)


def encode_seconds(flows: list[FlowRecord], entry_encoder) -> float:
    started = time.perf_counter()
    selected = select(FlowStatsRequest(), flows)
    for _ in codec.encode_multipart_replies(1, 1, _encoded(selected, entry_encoder)):
        pass
    return time.perf_counter() - started


def measure(count: int, socket_dir: str) -> list[str]:
    flows = records(count, 0x0A000000 + count * 7)
    rows = []
    for label, encoder in (("1.3", codec.encode_flow_stats_entry),
                           ("1.0", codec10.encode_flow_stats_entry)):  # fmt: skip
        cold = encode_seconds(flows, encoder)
        warm = min(encode_seconds(flows, encoder) for _ in range(RUNS))
        rows.append((label, cold, warm))
    path = f"{socket_dir}/bench-{count}.mgmt"
    lines = []
    with OpenFlowStatsServer(lambda: flows, unix_socket=path):
        for (label, cold, warm), version in zip(rows, (["-O", "OpenFlow13"], []), strict=True):
            dump = timed_ofctl([*version, "dump-flows", f"unix:{path}"], count)
            aggregate = timed_ofctl([*version, "dump-aggregate", f"unix:{path}"], None)
            lines.append(
                f"| {count:,} | {label} | {dump:.3f} | {aggregate:.3f} | {cold:.3f} | {warm:.3f} "
                f"| {warm / dump:.0%} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/benchmarks/openflow_stats.md")
    args = parser.parse_args()
    table = [
        "| flows | OpenFlow | ovs-ofctl dump-flows s | dump-aggregate s "
        "| endpoint encode s, first dump | later dumps | endpoint share of dump-flows |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as socket_dir:
        for count in SIZES:
            table += measure(count, socket_dir)
            print(table[-1], flush=True)
    text = "\n".join(
        [
            f"# OpenFlow statistics endpoint read by ovs-ofctl ({datetime.date.today()})",
            "",
            "Command: `.venv/bin/python -m tests.bench.bench_openflow_stats`",
            "",
            "UNIX socket, N offloaded UDP flows; wall time of the real `/usr/bin/ovs-ofctl` "
            "(OVS 3.1), median of 3; endpoint encode = select + validate + encode all N "
            "flows in-process (first dump, and the best of 3 more). "
            "2 shared cores: absolute times are noisy, the shares within a row are what count.",
            "",
            *table,
            "",
        ]
    )
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
