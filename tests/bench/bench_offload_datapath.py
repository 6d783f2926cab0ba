"""The XDP eSwitch fast path against OVS's userspace datapath, in one run.

    .venv/bin/python -m tests.bench.bench_offload_datapath [--out FILE] [--duration S]
        [--streams 1,2,4,8] [--flows 100000]

(a) packets/s, endpoint a1 -> a2 on host A, 64-byte frames from udpgen --raw:
    plain OVS, eSwitch attached but the flow not offloaded (a miss), offloaded;
(b) N streams, sender endpoints on host B -> receiver endpoints on host A
    (through both br-ints, phy0 and the fabric), UDP (1472-byte datagrams,
    unpaced) and TCP (iperf3): aggregate throughput and host CPU, plain OVS vs
    offloaded;
(c) 100k offloaded flows: install (one batch) and statistics polls, timed
    inside host A.

"Offload these flows" is one function, :func:`offload_flows`: by default it calls
the provider in each host (flexmig-offload is stopped on every host so the fast
path is the benchmark's alone); with ``--offload-path app`` it goes through
flexmig-offload's policy instead: header rules for exactly these flows, loaded
with SIGHUP, which the app applies to new and existing flows (the app keeps the
eSwitch attached to every port, so there "plain" is the same as "miss").
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from flexmig.lab import endpoints, offload, traffic
from flexmig.lab.host import LabHost
from flexmig.lab.lab import Lab
from ovs_ext.providers.base import FlowMatch, OffloadEntry
from ovs_ext.providers.xdp.labctl import HostXdp

OFFLOAD_PATH = "provider direct (XdpProvider, ovs_ext.providers.xdp.ctl in each host)"
UDP_PAYLOAD = 1472
TCP, UDP = 6, 17
DEFAULT_OUT = Path("docs/benchmarks/offload-datapath.md")


@dataclasses.dataclass(frozen=True)
class Placement:
    """One direction of one flow on one host: what a NIC eSwitch would hold."""

    host: str
    entry: OffloadEntry


APP_PATH = "flexmig-offload policy (header rules via SIGHUP, judged by the os-ken app)"
# Through the app: everything onloaded (judged at setup, switched by OVS) unless a
# header rule offloads it; no statistics rule, so nothing moves on its own.
APP_BASE_POLICY = "capacity: 1000000\nheader_rules: []\n"
APP_SETTLE_S = 0.5  # SIGHUP handled, existing flows re-judged


class Path_:
    """Which way flows are offloaded in this run (--offload-path)."""

    via_app = False


def _app_rule(index: int, placement: Placement) -> str:
    match, out_port = placement.entry.match, placement.entry.out_port
    egress = match.in_port != "phy0"
    port, direction = (match.in_port, "egress") if egress else (out_port, "ingress")
    proto = "tcp" if match.ip_proto == TCP else "udp"
    return (
        f"  - {{name: p{index}, port: {port}, direction: {direction}, ip_proto: {proto}, "
        f"ipv4_src: {match.ipv4_src}/32, ipv4_dst: {match.ipv4_dst}/32, "
        f"tp_src: {match.tp_src}, tp_dst: {match.tp_dst}, action: offload}}"
    )


def _app_policy(lab: Lab, placements: list[Placement]) -> None:
    for host in ("A", "B"):
        rules = [_app_rule(i, p) for i, p in enumerate(placements) if p.host == host]
        text = "capacity: 1000000\nheader_rules:\n" + "\n".join(rules) + "\n"
        offload.LabOffload(lab.host(host)).reload(text if rules else APP_BASE_POLICY)
    time.sleep(APP_SETTLE_S)


def offload_flows(lab: Lab, placements: list[Placement]) -> str:
    """Offload every placement; returns which path did it (for the table)."""
    if Path_.via_app:
        _app_policy(lab, placements)
        return APP_PATH
    for host in sorted({p.host for p in placements}):
        entries = [p.entry for p in placements if p.host == host]
        result = HostXdp(lab.host(host)).install_batch(entries)
        if result["failed"]:
            raise RuntimeError(f"host {host} refused offloads: {result['failed']}")
    return OFFLOAD_PATH


def onload_flows(lab: Lab, placements: list[Placement]) -> None:
    if Path_.via_app:
        _app_policy(lab, [])
        return
    for host in sorted({p.host for p in placements}):
        HostXdp(lab.host(host)).remove_batch([p.entry.match for p in placements if p.host == host])


# -- CPU accounting --------------------------------------------------------------
def _outer_pid(host: LabHost, pid_file: str) -> int:
    """The machine's PID of a daemon whose pidfile holds its PID inside the host."""
    inner = int(host.ns.root_path(pid_file).read_text())
    pid_ns = Path(f"/proc/{host.ns.holder_pid}/ns/pid").readlink()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "ns/pid").readlink() != pid_ns:
                continue
            nspid = next(
                line
                for line in (proc / "status").read_text().splitlines()
                if line.startswith("NSpid")
            )
        except (OSError, StopIteration):
            continue
        if int(nspid.split()[-1]) == inner:
            return int(proc.name)
    raise RuntimeError(f"no process for {pid_file} on host {host.name}")


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, USER_HZ


def _softirq_s() -> float:
    cpu = Path("/proc/stat").read_text().splitlines()[0].split()
    return int(cpu[7]) / 100.0


class CpuMeter:
    """ovs-vswitchd of the given hosts, and the machine's softirq time."""

    def __init__(self, hosts: list[LabHost]) -> None:
        self.pids = [_outer_pid(h, "/run/openvswitch/ovs-vswitchd.pid") for h in hosts]

    def __enter__(self) -> CpuMeter:
        self.t0, self.ovs0, self.irq0 = time.monotonic(), self._ovs(), _softirq_s()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self.t0
        self.ovs_pct = 100 * (self._ovs() - self.ovs0) / wall
        self.softirq_pct = 100 * (_softirq_s() - self.irq0) / wall

    def _ovs(self) -> float:
        return sum(_proc_cpu_s(p) for p in self.pids)


# -- (a) packet rate ----------------------------------------------------------------
def _mac(ep: endpoints.Endpoint) -> str:
    out = subprocess.run(
        ["ip", "-n", ep.netns, "-j", "link", "show", endpoints.ENDPOINT_IF],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)[0]["address"]


def packet_rate(lab: Lab, src, dst, duration: float, mode: str) -> dict[str, float]:
    """One unpaced 64-byte run a1 -> a2; mode: plain | miss | offloaded."""
    xdp = HostXdp(lab.host("A"))
    ports = (src.port, dst.port)
    match = FlowMatch(src.port, UDP, src.ip, dst.ip, 7000, 9000)
    placement = [Placement("A", OffloadEntry(match, dst.port))]
    if mode != "plain" and not Path_.via_app:
        xdp.attach(*ports)
    if mode == "offloaded":
        offload_flows(lab, placement)
    try:
        receiver = traffic.Receiver(endpoints.exec_prefix(dst), 9000, duration=duration + 10)
        sent = _raw_send(src, dst, duration)
        got = receiver.result()
    finally:
        if mode == "offloaded":
            onload_flows(lab, placement)
        if mode != "plain" and not Path_.via_app:
            xdp.detach(*ports)
    return {"sent_pps": sent["pps"], "received_pps": got["received_packets"] / duration}


def _raw_send(src, dst, duration: float) -> dict[str, float]:
    cmd = [*endpoints.exec_prefix(src), str(traffic.UDPGEN), "send", "--raw", "eth0"]
    cmd += ["--src", src.ip, "--dst", dst.ip, "--dst-mac", _mac(dst), "--port", "9000"]
    cmd += ["--sport", "7000", "--duration", str(duration)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=duration + 30)
    return json.loads(out.stdout)


# -- (b) streams --------------------------------------------------------------------
def stream_placements(senders, receivers, proto: str) -> list[Placement]:
    """Both hosts' entries for each stream (and its ACKs, for TCP)."""
    out = []
    for i, (s, r) in enumerate(zip(senders, receivers, strict=True)):
        sport, dport = (30000 + i, 5201 + i) if proto == "tcp" else (20000 + i, 9000 + i)
        number = TCP if proto == "tcp" else UDP
        fwd_b = FlowMatch(s.port, number, s.ip, r.ip, sport, dport)
        fwd_a = dataclasses.replace(fwd_b, in_port="phy0")
        out += [
            Placement("B", OffloadEntry(fwd_b, "phy0")),
            Placement("A", OffloadEntry(fwd_a, r.port)),
        ]
        if proto == "tcp":
            back_a = FlowMatch(r.port, TCP, r.ip, s.ip, dport, sport)
            back_b = dataclasses.replace(back_a, in_port="phy0")
            out += [
                Placement("A", OffloadEntry(back_a, "phy0")),
                Placement("B", OffloadEntry(back_b, s.port)),
            ]
    return out


def run_udp_streams(senders, receivers, duration: float) -> float:
    """Aggregate received Gbit/s of unpaced MTU-sized UDP streams."""
    rx = [
        traffic.Receiver(endpoints.exec_prefix(r), 9000 + i, duration=duration + 10)
        for i, r in enumerate(receivers)
    ]
    procs = []
    for i, (s, r) in enumerate(zip(senders, receivers, strict=True)):
        cmd = [*endpoints.exec_prefix(s), str(traffic.UDPGEN), "send", "--dst", r.ip]
        cmd += ["--port", str(9000 + i), "--sport", str(20000 + i), "--size", str(UDP_PAYLOAD)]
        cmd += ["--duration", str(duration)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
    for p in procs:
        p.wait(timeout=duration + 30)
    received = sum(r.result()["received_bytes"] for r in rx)
    return received * 8 / duration / 1e9


def run_tcp_streams(senders, receivers, duration: float) -> float:
    servers = [
        subprocess.Popen(
            [*endpoints.exec_prefix(r), "iperf3", "-s", "-1", "-B", r.ip, "-p", str(5201 + i)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i, r in enumerate(receivers)
    ]
    time.sleep(0.5)
    clients = []
    for i, (s, r) in enumerate(zip(senders, receivers, strict=True)):
        cmd = [*endpoints.exec_prefix(s), "iperf3", "-c", r.ip, "-p", str(5201 + i)]
        cmd += ["--cport", str(30000 + i), "-t", str(duration), "-J"]
        clients.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    total = 0.0
    for c in clients:
        out, _ = c.communicate(timeout=duration + 30)
        total += json.loads(out)["end"]["sum_received"]["bits_per_second"]
    for s in servers:
        s.wait(timeout=10)
    return total / 1e9


def stream_row(lab: Lab, senders, receivers, proto: str, duration: float, offload: bool) -> dict:
    """One measurement: N streams, plain OVS or offloaded; eSwitch attached only for the latter."""
    a, b = lab.host("A"), lab.host("B")
    xdp_a, xdp_b = HostXdp(a), HostXdp(b)
    placements = stream_placements(senders, receivers, proto)
    a_ports, b_ports = ["phy0", *(r.port for r in receivers)], ["phy0", *(s.port for s in senders)]
    if offload:
        if not Path_.via_app:
            xdp_a.attach(*a_ports)
            xdp_b.attach(*b_ports)
        offload_flows(lab, placements)
    run = run_tcp_streams if proto == "tcp" else run_udp_streams
    try:
        with CpuMeter([a, b]) as cpu:
            gbps = run(senders, receivers, duration)
        counted = HostXdp(a).stats() if offload else {}
    finally:
        if offload:
            onload_flows(lab, placements)
            if not Path_.via_app:
                xdp_a.detach(*a_ports)
                xdp_b.detach(*b_ports)
    host_pct = cpu.ovs_pct + cpu.softirq_pct
    return {
        "gbps": gbps,
        "ovs_pct": cpu.ovs_pct,
        "softirq_pct": cpu.softirq_pct,
        "cpu_per_gbps": host_pct / gbps if gbps > 0 else float("inf"),
        "offloaded_packets_on_a": sum(c.packets for c in counted.values()),
    }


# -- (c) scale, run inside host A ----------------------------------------------------------
def scale_inside(flows: int, in_port: str, out_port: str) -> dict[str, float]:
    """Install ``flows`` synthetic entries in one batch, poll stats, remove; timed."""
    from oslo_config import cfg

    from ovs_ext.providers.xdp.provider import XdpProvider

    provider = XdpProvider(cfg.ConfigOpts())
    provider.conf([])
    provider.attach_port(in_port)
    provider.attach_port(out_port)
    entries = [
        OffloadEntry(
            FlowMatch(
                in_port,
                UDP,
                f"10.{128 + i // 65536}.{i // 256 % 256}.{i % 256}",
                "10.251.0.211",
                1024 + i % 60000,
                9000,
            ),
            out_port,
        )
        for i in range(flows)
    ]
    t0 = time.perf_counter()
    result = provider.install(entries)
    install_s = time.perf_counter() - t0
    polls = []
    for _ in range(5):
        t0 = time.perf_counter()
        seen = len(provider.stats())
        polls.append(time.perf_counter() - t0)
    cold = XdpProvider(cfg.ConfigOpts())
    cold.conf([])
    t0 = time.perf_counter()
    cold_seen = len(cold.stats())  # a restarted provider: rebuilds its indexes first
    cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    removed = len(provider.remove(e.match for e in entries))
    remove_s = time.perf_counter() - t0
    provider.detach_port(in_port)
    provider.detach_port(out_port)
    return {
        "flows": flows, "installed": len(result.installed), "failed": len(result.failed),
        "install_s": install_s, "install_rate": len(result.installed) / install_s,
        "stats_seen": seen, "stats_median_s": statistics.median(polls), "stats_max_s": max(polls),
        "cold_seen": cold_seen, "cold_stats_s": cold_s,
        "removed": removed, "remove_s": remove_s,
    }  # fmt: skip


def scale(lab: Lab, flows: int, a1, a2) -> dict[str, float]:
    proc = lab.host("A").ns.run(
        # By path: nsenter starts the command outside this checkout's directory.
        [sys.executable, str(Path(__file__).resolve()), "--scale-inside",
         "--flows", str(flows), "--in-port", a1.port, "--out-port", a2.port],
        timeout=600,
    )  # fmt: skip
    return json.loads(proc.stdout)


# -- the run and its table ---------------------------------------------------------------
def setup_lab(streams: int) -> tuple[Lab, dict[str, endpoints.Endpoint]]:
    lab = Lab()
    lab.down()
    lab.up(2)
    for host in lab.hosts():
        service = offload.LabOffload(host)
        if Path_.via_app:
            service.start(APP_BASE_POLICY)
        else:
            service.stop()
    eps = {"a1": endpoints.add(lab, "A", "a1"), "a2": endpoints.add(lab, "A", "a2")}
    for i in range(streams):
        eps[f"r{i}"] = endpoints.add(lab, "A", f"r{i}")
        eps[f"s{i}"] = endpoints.add(lab, "B", f"s{i}")
    for name, ep in eps.items():  # resolve ARP through OVS before any offload
        peer = eps["a2"] if name == "a1" else eps.get("r" + name[1:]) if name[0] == "s" else None
        if peer is not None:
            subprocess.run(
                [*endpoints.exec_prefix(ep), "ping", "-c", "1", "-W", "2", peer.ip],
                capture_output=True,
                check=True,
            )
    return lab, eps


def measure(args: argparse.Namespace) -> dict:
    counts = [int(n) for n in args.streams.split(",")]
    lab, eps = setup_lab(max(counts))
    results: dict = {"pps": {}, "streams": [], "scale": {}}
    try:
        for mode in ("plain", "miss", "offloaded"):
            results["pps"][mode] = packet_rate(lab, eps["a1"], eps["a2"], args.duration, mode)
            print(f"(a) {mode}: {results['pps'][mode]}", flush=True)
        for proto in ("udp", "tcp"):
            for n in counts:
                senders = [eps[f"s{i}"] for i in range(n)]
                receivers = [eps[f"r{i}"] for i in range(n)]
                for offload in (False, True):
                    row = stream_row(lab, senders, receivers, proto, args.duration, offload)
                    row |= {"proto": proto, "streams": n, "offload": offload}
                    results["streams"].append(row)
                    print(f"(b) {row}", flush=True)
        results["scale"] = scale(lab, args.flows, eps["a1"], eps["a2"])
        print(f"(c) {results['scale']}", flush=True)
    finally:
        lab.down()
    return results


def render(results: dict, args: argparse.Namespace, command: str) -> str:
    pps = results["pps"]
    lines = [
        f"# Offload datapath: XDP eSwitch vs OVS userspace datapath ({datetime.date.today()})",
        "",
        f"Command: `{command}`",
        "",
        "One run per comparison, side by side. The machine has 2 cores shared with other "
        "developers' labs and QEMU guests while this ran: absolute numbers are noisy, the "
        "ratios within a table are the result. Offloads were installed through: "
        f"**{APP_PATH if Path_.via_app else OFFLOAD_PATH}**.",
        "",
        "## (a) Packets/s, endpoint a1 -> a2 on host A (64-byte frames, udpgen --raw, "
        f"{args.duration:g} s, unpaced)",
        "",
        "| path | offered pps | received pps | vs plain OVS |",
        "|---|---|---|---|",
    ]
    base = pps["plain"]["received_pps"] or 1
    for mode, label in (
        ("plain", "OVS userspace datapath (no eSwitch)"),
        ("miss", "eSwitch attached, flow not offloaded (miss -> OVS)"),
        ("offloaded", "offloaded (XDP redirect, OVS bypassed)"),
    ):
        row = pps[mode]
        lines.append(
            f"| {label} | {row['sent_pps']:,.0f} | {row['received_pps']:,.0f} | "
            f"{row['received_pps'] / base:.2f}x |"
        )
    lines += _stream_table(results["streams"], args) + _scale_table(results["scale"])
    return "\n".join(lines) + "\n"


def _stream_table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    lines = [
        "",
        f"## (b) N streams B -> A through both br-ints, phy0 and the fabric ({args.duration:g} s)",
        "",
        "UDP: udpgen, 1472-byte datagrams, unpaced, one sender per stream; TCP: iperf3, one "
        "connection per stream (data and ACK directions offloaded). Host CPU = ovs-vswitchd "
        "of hosts A and B + the machine's softirq time, in % of one core.",
        "",
        "| proto | N | path | Gbit/s | ovs-vswitchd % | softirq % | CPU %/Gbit/s | "
        "offload/onload CPU per Gbit/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    onload = {(r["proto"], r["streams"]): r for r in rows if not r["offload"]}
    for r in rows:
        ratio = ""
        if r["offload"]:
            ratio = f"{r['cpu_per_gbps'] / onload[(r['proto'], r['streams'])]['cpu_per_gbps']:.2f}"
        lines.append(
            f"| {r['proto']} | {r['streams']} | {'offloaded' if r['offload'] else 'plain OVS'} | "
            f"{r['gbps']:.2f} | {r['ovs_pct']:.0f} | {r['softirq_pct']:.0f} | "
            f"{r['cpu_per_gbps']:.0f} | {ratio} |"
        )
    return lines


def _scale_table(s: dict) -> list[str]:
    return [
        "",
        f"## (c) {s['flows']:,} offloaded flows (inside host A, provider in-process)",
        "",
        "| step | result |",
        "|---|---|",
        f"| install, one batch | {s['installed']:,} installed, {s['failed']} failed, "
        f"{s['install_s']:.3f} s ({s['install_rate']:,.0f} flows/s) |",
        f"| statistics poll of all flows (5 polls) | {s['stats_seen']:,} flows, median "
        f"{s['stats_median_s']:.3f} s, max {s['stats_max_s']:.3f} s |",
        f"| first poll of a restarted provider | {s['cold_seen']:,} flows, "
        f"{s['cold_stats_s']:.3f} s |",
        f"| remove all, final counters returned | {s['removed']:,} flows, {s['remove_s']:.3f} s |",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--streams", default="1,2,4,8")
    parser.add_argument("--flows", type=int, default=100_000)
    parser.add_argument(
        "--offload-path",
        choices=("provider", "app"),
        default="provider",
        help="install offloads by calling the provider (default) or through "
        "flexmig-offload's policy",
    )
    parser.add_argument("--scale-inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--in-port", help=argparse.SUPPRESS)
    parser.add_argument("--out-port", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scale_inside:
        print(json.dumps(scale_inside(args.flows, args.in_port, args.out_port)))
        return 0
    traffic.check_built()
    Path_.via_app = args.offload_path == "app"
    command = ".venv/bin/python -m tests.bench.bench_offload_datapath " + " ".join(sys.argv[1:])
    results = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(results, args, command.strip()))
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
