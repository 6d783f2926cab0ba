"""The XDP eSwitch fast path against OVS's userspace datapath, in one run.

    .venv/bin/python -m tests.bench.bench_offload_datapath [--out FILE] [--duration S]
        [--parts abc] [--streams 1,2,4,8] [--flows 100000] [--senders 2] [--rounds 3]
        [--udp-mbps 100] [--stream-rounds 3]

(a) packets/s, endpoint a1 -> a2 on host A, 64-byte frames from xdpgen (in-kernel)
    and udpgen --raw: plain OVS, eSwitch attached but the flow not offloaded (a
    miss), offloaded (offload_pps.py; ``--parts a`` runs it alone, written to
    docs/benchmarks/offload-pps.md);
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
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from flexmig_lab import endpoints, offload, topology, traffic
from flexmig_lab.host import LabHost
from flexmig_lab.lab import Lab
from flexmig_lab.xdpctl import HostXdp
from ovs_ext.providers.base import FlowMatch, OffloadEntry
from tests.bench import host_cpu, offload_pps
from tests.bench.offload_pps import Placement

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[2]
THIS_MODULE = "tests.bench.bench_offload_datapath"
OFFLOAD_PATH = "provider direct (XdpProvider, ovs_ext.providers.xdp.ctl in each host)"
UDP_PAYLOAD = 1472
TCP, UDP = 6, 17
DEFAULT_OUT = Path("docs/benchmarks/offload-datapath.md")
PPS_OUT = Path("docs/benchmarks/offload-pps.md")  # part (a) alone


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


def run_udp_streams(senders, receivers, duration: float, mbps_each: float = 0) -> float:
    """Aggregate received Gbit/s of MTU-sized UDP streams (paced if ``mbps_each``)."""
    rx = [
        traffic.Receiver(endpoints.exec_prefix(r), 9000 + i, duration=duration + 10)
        for i, r in enumerate(receivers)
    ]
    procs = []
    for i, (s, r) in enumerate(zip(senders, receivers, strict=True)):
        cmd = [*endpoints.exec_prefix(s), str(traffic.UDPGEN), "send", "--dst", r.ip]
        cmd += ["--port", str(9000 + i), "--sport", str(20000 + i), "--size", str(UDP_PAYLOAD)]
        cmd += ["--duration", str(duration)]
        if mbps_each:
            cmd += ["--rate", str(int(mbps_each * 1e6 / 8 / UDP_PAYLOAD)), "--batch", "8"]
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


def stream_row(
    lab: Lab,
    senders,
    receivers,
    proto: str,
    args: argparse.Namespace,
    offload: bool,
    tune_ports: Callable[[LabHost, list[str]], None] | None = None,
) -> dict:
    """One measurement: N streams, plain OVS or offloaded; eSwitch attached only for the latter.

    proto: ``udp`` (unpaced), ``udp-paced`` (``args.udp_mbps`` per stream), ``tcp``.
    ``tune_ports(host, ports)`` runs after the eSwitch is attached (offloaded rows).
    """
    a, b = lab.host("A"), lab.host("B")
    xdp_a, xdp_b = HostXdp(a), HostXdp(b)
    placements = stream_placements(senders, receivers, proto)
    a_ports, b_ports = ["phy0", *(r.port for r in receivers)], ["phy0", *(s.port for s in senders)]
    if offload:
        if not Path_.via_app:
            xdp_a.attach(*a_ports)
            xdp_b.attach(*b_ports)
        if tune_ports is not None:
            tune_ports(a, a_ports)
            tune_ports(b, b_ports)
        offload_flows(lab, placements)
    try:
        port_threads = host_cpu.napi_threads(a.spec.netns, a_ports) + host_cpu.napi_threads(
            b.spec.netns, b_ports
        )
        fabric_ifs = [a.spec.fabric_tenant_if, b.spec.fabric_tenant_if]
        meter = host_cpu.CpuMeter(
            [a, b],
            port_threads,
            host_cpu.stable_napi_threads(
                tuple(ep.netns for ep in [*senders, *receivers]), ENDPOINT_IFS
            ),
            host_cpu.stable_napi_threads((topology.FABRIC_NETNS,), tuple(fabric_ifs)),
        )
        with meter as cpu:
            if proto == "tcp":
                gbps = run_tcp_streams(senders, receivers, args.duration)
            else:
                paced = args.udp_mbps if proto == "udp-paced" else 0
                gbps = run_udp_streams(senders, receivers, args.duration, paced)
        counted = HostXdp(a).stats() if offload else {}
        port_packets = (
            sum(c.packets for h in (xdp_a, xdp_b) for c in h.stats().values()) if offload else 0
        )
    finally:
        if offload:
            onload_flows(lab, placements)
            if not Path_.via_app:
                xdp_a.detach(*a_ports)
                xdp_b.detach(*b_ports)
    return {
        "gbps": gbps,
        "ovs_pct": cpu.ovs_pct,
        "softirq_pct": cpu.softirq_pct,
        "softirq_ticks_pct": cpu.softirq_ticks_pct,
        "softirq_other_pct": cpu.softirq_other_pct,
        "napi_pct": cpu.napi_pct,
        "guest_napi_pct": cpu.guest_napi_pct,
        "fabric_napi_pct": cpu.fabric_napi_pct,
        "napi_threads": len(cpu.napi_pids),
        "softirq_background_pct": cpu.background_pct,
        "cpu_per_gbps": cpu.host_pct / gbps if gbps > 0 else float("inf"),
        "net_cpu_per_gbps": cpu.net_host_pct / gbps if gbps > 0 else float("inf"),
        # What stays on the host when a NIC's eSwitch does the forwarding: all but the
        # port NAPI threads, where this lab's software eSwitch stands in for that NIC.
        "vswitch_cpu_per_gbps": (cpu.ovs_pct + cpu.softirq_pct) / gbps
        if gbps > 0
        else float("inf"),
        "offloaded_packets_on_a": sum(c.packets for c in counted.values()),
        # Packets the eSwitch redirected on both hosts: one per port thread crossed.
        "port_packets": port_packets,
        "napi_us_per_packet": 1e6 * cpu.napi_cpu_s / port_packets if port_packets else 0.0,
        "packets_per_wakeup": port_packets / cpu.napi_sleeps if cpu.napi_sleeps else 0.0,
        "loadavg": os.getloadavg()[0],
    }


STREAM_PROTOS = ("udp", "udp-paced", "tcp")
ENDPOINT_IFS = (endpoints.ENDPOINT_IF,)


def stream_rows(lab: Lab, eps: dict, counts: list[int], args: argparse.Namespace) -> list[dict]:
    """(b) in ``args.stream_rounds`` interleaved rounds; per cell the median round.

    The median round is the one with the median host CPU per Gbit/s, shown
    whole (its columns belong together); every round's value is listed.
    """
    samples: dict[tuple[str, int, bool], list[dict]] = {}
    for round_no in range(args.stream_rounds):
        for proto in STREAM_PROTOS:
            for n in counts:
                senders = [eps[f"s{i}"] for i in range(n)]
                receivers = [eps[f"r{i}"] for i in range(n)]
                for offloaded in (False, True):
                    row = stream_row(lab, senders, receivers, proto, args, offloaded)
                    row |= {"proto": proto, "streams": n, "offload": offloaded}
                    samples.setdefault((proto, n, offloaded), []).append(row)
                    print(f"(b) round {round_no} {row}", flush=True)
    rows = []
    for cell in samples.values():
        ordered = sorted(cell, key=lambda r: r["cpu_per_gbps"])
        rounds = [r["cpu_per_gbps"] for r in cell]
        rows.append(ordered[(len(ordered) - 1) // 2] | {"rounds_cpu_per_gbps": rounds})
    return rows


# -- (c) scale, run inside host A ----------------------------------------------------------
def _cpu_now() -> float:
    """CPU seconds of this process and its children (the privsep daemon) so far."""
    total = time.process_time()
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in children.read_text().split():
            total += host_cpu.cpu_of([int(pid)]).get(int(pid), 0.0)
    return total


def _timed(step: Callable[[], T]) -> tuple[T, float, float]:
    """(result, wall seconds, CPU seconds incl. the privsep daemon) of one step."""
    wall0, cpu0 = time.perf_counter(), _cpu_now()
    result = step()
    return result, time.perf_counter() - wall0, _cpu_now() - cpu0


def _synthetic_entries(flows: int, in_port: str, out_port: str) -> list[OffloadEntry]:
    return [
        OffloadEntry(
            FlowMatch(in_port, UDP, f"10.{128 + i // 65536}.{i // 256 % 256}.{i % 256}",
                      "10.251.0.211", 1024 + i % 60000, 9000),
            out_port,
        )
        for i in range(flows)
    ]  # fmt: skip


def scale_inside(flows: int, in_port: str, out_port: str) -> dict[str, float]:
    """Install ``flows`` synthetic entries in one batch, poll stats, remove; timed."""
    from oslo_config import cfg

    from ovs_ext.providers.xdp.provider import XdpProvider

    provider = XdpProvider(cfg.ConfigOpts())
    provider.conf([])
    provider.attach_port(in_port)
    provider.attach_port(out_port)
    entries = _synthetic_entries(flows, in_port, out_port)
    result, install_s, install_cpu = _timed(lambda: provider.install(entries))
    polls = [_timed(provider.stats) for _ in range(5)]
    cold = XdpProvider(cfg.ConfigOpts())
    cold.conf([])
    cold_stats, cold_s, cold_cpu = _timed(cold.stats)  # a restarted provider: rebuilds first
    removed, remove_s, remove_cpu = _timed(lambda: provider.remove(e.match for e in entries))
    inline_polls = _inline_polls(entries)
    provider.detach_port(in_port)
    provider.detach_port(out_port)
    return {
        "flows": flows, "installed": len(result.installed), "failed": len(result.failed),
        "install_s": install_s, "install_cpu_s": install_cpu,
        "install_rate": len(result.installed) / install_s,
        "stats_seen": len(polls[-1][0]),
        "stats_median_s": statistics.median(p[1] for p in polls),
        "stats_max_s": max(p[1] for p in polls),
        "stats_median_cpu_s": statistics.median(p[2] for p in polls),
        "cold_seen": len(cold_stats), "cold_stats_s": cold_s, "cold_stats_cpu_s": cold_cpu,
        "removed": len(removed), "remove_s": remove_s, "remove_cpu_s": remove_cpu,
        "inline_stats_median_s": statistics.median(p[1] for p in inline_polls),
        "inline_stats_median_cpu_s": statistics.median(p[2] for p in inline_polls),
        "loadavg": os.getloadavg()[0],
    }  # fmt: skip


def _inline_polls(entries: list[OffloadEntry]) -> list[tuple[dict, float, float]]:
    """The same polls with the kernel side in this process: what privsep costs.

    Last, since inline mode holds for the whole process from then on.
    """
    from oslo_config import cfg

    from ovs_ext.providers.xdp.provider import XdpProvider

    conf = cfg.ConfigOpts()
    inline = XdpProvider(conf)
    conf([])
    conf.set_override("privsep", "inline", group="offload_xdp")
    inline.install(entries)
    polls = [_timed(inline.stats) for _ in range(3)]
    inline.remove(e.match for e in entries)
    return polls


def scale(lab: Lab, flows: int, a1, a2) -> dict[str, float]:
    proc = lab.host("A").ns.run(
        # nsenter starts the command outside this checkout: name it on PYTHONPATH.
        ["env", f"PYTHONPATH={REPO_ROOT}", sys.executable, "-m", THIS_MODULE,
         "--scale-inside", "--flows", str(flows), "--in-port", a1.port, "--out-port", a2.port],
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


def packet_rates(lab: Lab, a1, a2, args: argparse.Namespace) -> dict[str, dict]:
    """(a): offload_pps.py, with this run's way of offloading flows."""
    offloader = offload_pps.Offloader(offload_flows, onload_flows, Path_.via_app)
    run = offload_pps.Run(lab, a1, a2, args.duration, args.senders, offloader)
    return offload_pps.packet_rates(run, args.rounds)


def measure(args: argparse.Namespace) -> dict:
    counts = [int(n) for n in args.streams.split(",")]
    lab, eps = setup_lab(max(counts) if "b" in args.parts else 0)
    results: dict = {"pps": {}, "streams": [], "scale": {}}
    try:
        if "a" in args.parts:
            results["pps"] = packet_rates(lab, eps["a1"], eps["a2"], args)
        if "b" in args.parts:
            results["streams"] = stream_rows(lab, eps, counts, args)
        if "c" in args.parts:
            results["scale"] = scale(lab, args.flows, eps["a1"], eps["a2"])
            print(f"(c) {results['scale']}", flush=True)
    finally:
        lab.down()
    return results


def render(results: dict, args: argparse.Namespace, command: str) -> str:
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
    ]
    if results["pps"]:
        lines += offload_pps.render_table(results["pps"], args)
    if results["streams"]:
        lines += _stream_table(results["streams"], args)
    if results["scale"]:
        lines += _scale_table(results["scale"])
    return "\n".join(lines) + "\n"


def _stream_table(rows: list[dict], args: argparse.Namespace) -> list[str]:
    lines = [
        "",
        f"## (b) N streams B -> A through both br-ints, phy0 and the fabric ({args.duration:g} s; "
        f"median of {args.stream_rounds} interleaved rounds)",
        "",
        "UDP: udpgen, 1472-byte datagrams, one sender per stream, unpaced (udp) or paced at "
        f"{args.udp_mbps:g} Mbit/s per stream (udp-paced: the same offered load on both "
        "paths, as the paper's 1 Gbit/s per VM); TCP: iperf3, one "
        "connection per stream (data and ACK directions offloaded). Host CPU = ovs-vswitchd "
        "of hosts A and B + the machine's network softirq time (NET_TX/NET_RX handlers timed "
        "exactly by a BPF program, tests/bench/softirq_time.py) + the NAPI threads of the "
        "br-int ports and phy0 (where the eSwitch runs), in % of one core. The machine's "
        f"softirq was also timed for {host_cpu.BACKGROUND_SAMPLE_S:g} s with no traffic of "
        'ours just before each row ("bg"). "Without the software eSwitch" leaves out the '
        "port NAPI threads (ovs-vswitchd + softirq only): what a host would still spend if a "
        "NIC's eSwitch did the offloaded forwarding, as in the paper; the ratio is against "
        "the onloaded row's full host CPU. The endpoints' eth0 NAPI threads (their "
        "receive stacks: a guest's vCPU work) are shown apart, not in host CPU.",
        "",
        "Each cell is its median round (by host CPU per Gbit/s, shown whole); the rounds' "
        "host CPU %/Gbit/s are listed. For the offloaded rows, where the port NAPI threads are "
        "the fast path's CPU: µs of those threads per packet they redirected (both hosts: "
        "a packet crosses two) and packets per wake-up (redirected packets / the threads' "
        "voluntary context switches, i.e. how many packets each wake-up found).",
        "",
        "| proto | N | path | Gbit/s | ovs-vswitchd % | softirq % (bg) | port NAPI % | "
        "host CPU %/Gbit/s (rounds) | offload/onload | without the software eSwitch "
        "%/Gbit/s | offload/onload | "
        "port NAPI µs/packet | packets per wake-up | guests' eth0 NAPI % | fabric NAPI % | "
        "load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    onload = {(r["proto"], r["streams"]): r for r in rows if not r["offload"]}
    for r in rows:
        ratio = net_ratio = ""
        if r["offload"]:
            base = onload[(r["proto"], r["streams"])]
            ratio = f"{r['cpu_per_gbps'] / base['cpu_per_gbps']:.2f}"
            net_ratio = f"{r['vswitch_cpu_per_gbps'] / base['cpu_per_gbps']:.2f}"
        per_packet = per_wakeup = ""
        if r["offload"] and r["port_packets"]:
            per_packet = f"{r['napi_us_per_packet']:.2f}"
            per_wakeup = f"{r['packets_per_wakeup']:.1f}"
        rounds = ", ".join(f"{x:.0f}" for x in r["rounds_cpu_per_gbps"])
        lines.append(
            f"| {r['proto']} | {r['streams']} | {'offloaded' if r['offload'] else 'plain OVS'} | "
            f"{r['gbps']:.2f} | {r['ovs_pct']:.0f} | {r['softirq_pct']:.0f} "
            f"({r['softirq_background_pct']:.0f}) | {r['napi_pct']:.0f} | "
            f"{r['cpu_per_gbps']:.0f} ({rounds}) | {ratio} | {r['vswitch_cpu_per_gbps']:.1f} | "
            f"{net_ratio} | {per_packet} | {per_wakeup} | "
            f"{r['guest_napi_pct']:.0f} | {r['fabric_napi_pct']:.0f} | {r['loadavg']:.1f} |"
        )
    return lines


def _scale_table(s: dict) -> list[str]:
    return [
        "",
        f"## (c) {s['flows']:,} offloaded flows (inside host A: XdpProvider and its "
        "oslo.privsep daemon, as the os-ken app runs it)",
        "",
        "Wall time, and CPU time of the provider's process plus its privsep daemon (the work "
        "itself, whatever else the machine runs); load average "
        f"{s['loadavg']:.1f} on 2 cores when it ended.",
        "",
        "| step | flows | wall s | CPU s | rate |",
        "|---|---|---|---|---|",
        f"| install, one batch | {s['installed']:,} installed, {s['failed']} failed | "
        f"{s['install_s']:.3f} | {s['install_cpu_s']:.3f} | {s['install_rate']:,.0f} flows/s |",
        f"| statistics poll of all flows (median of 5; max wall {s['stats_max_s']:.3f} s) | "
        f"{s['stats_seen']:,} | {s['stats_median_s']:.3f} | {s['stats_median_cpu_s']:.3f} | |",
        f"| first poll of a restarted provider | {s['cold_seen']:,} | {s['cold_stats_s']:.3f} | "
        f"{s['cold_stats_cpu_s']:.3f} | |",
        f"| the same poll without privsep (inline, median of 3) | {s['stats_seen']:,} | "
        f"{s['inline_stats_median_s']:.3f} | {s['inline_stats_median_cpu_s']:.3f} | |",
        f"| remove all, final counters returned | {s['removed']:,} | {s['remove_s']:.3f} | "
        f"{s['remove_cpu_s']:.3f} | |",
    ]


def _parts(text: str) -> str:
    if not text or set(text) - set("abc"):
        raise argparse.ArgumentTypeError(f"{text!r}: give some of the letters a, b, c")
    return "".join(sorted(set(text)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out", type=Path, help=f"default {DEFAULT_OUT}, or {PPS_OUT} for --parts a"
    )
    parser.add_argument(
        "--parts",
        default="abc",
        type=_parts,
        help="which parts to run: any of a (packets/s), b (streams), c (100k flows)",
    )
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
    parser.add_argument(
        "--senders", type=int, default=2, help="(a): udpgen --raw processes, a flow each"
    )
    parser.add_argument("--rounds", type=int, default=3, help="(a): interleaved rounds, median")
    parser.add_argument("--udp-mbps", type=float, default=100, help="(b): udp-paced per stream")
    parser.add_argument(
        "--stream-rounds", type=int, default=3, help="(b): interleaved rounds, median"
    )
    parser.add_argument("--scale-inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--in-port", help=argparse.SUPPRESS)
    parser.add_argument("--out-port", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scale_inside:
        print(json.dumps(scale_inside(args.flows, args.in_port, args.out_port)))
        return 0
    traffic.check_built()
    traffic.check_xdpgen_built()
    args.out = args.out or (PPS_OUT if args.parts == "a" else DEFAULT_OUT)
    Path_.via_app = args.offload_path == "app"
    command = ".venv/bin/python -m tests.bench.bench_offload_datapath " + " ".join(sys.argv[1:])
    results = measure(args)
    write_results(args.out, render(results, args, command.strip()), results)
    return 0


def write_results(out: Path, table: str, results: object) -> None:
    """The table (markdown) and beside it the raw results (same name, .json)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
