"""Part (a) of the offload datapath benchmark: packets/s, endpoint a1 -> a2 on host A.

Three paths (plain OVS, eSwitch attached but the flow not offloaded, offloaded)
fed by two generators:

- ``xdpgen`` (tests/rig/flexmig_lab/traffic/xdpgen.c): in-kernel, XDP live frames out of
  a1's eth0; a veth's ndo_xdp_xmit puts them into the host port's (ep-a1's)
  ring as a NIC queue would, with no skb on the sending side, so the
  generator no longer decides the result.  A veth takes XDP frames only while
  its peer has NAPI: the eSwitch's XDP program gives ep-a1 one; for plain OVS
  (no eSwitch) the row turns on ep-a1's GRO instead (NAPI without an XDP
  program; these UDP frames are not coalesced) and polls it in a thread as
  the eSwitch's attach does, and puts both back afterwards.
- ``udpgen --raw`` (AF_PACKET, one process per flow): skbs, needed for the
  UDP socket sink anyway; the earlier runs' generator.

Received at a2 by an XDP sink on its eth0 (``rx_sink``: what the switch path
delivers to the port) or by a UDP socket (``udpgen recv``).  The main
benchmark (bench_offload_datapath.py) calls :func:`packet_rates` and
:func:`render_table`; how flows are offloaded is its business, passed in.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from flexmig import exceptions
from flexmig_lab import endpoints, errors, traffic
from flexmig_lab.lab import Lab
from flexmig_lab.xdpctl import HostXdp
from ovs_ext.providers.base import FlowMatch, OffloadEntry
from ovs_ext.providers.xdp.provider import BUILD_DIR, RX_PASS_OBJECT
from tests.bench import host_cpu

UDP = 17
SINK_PORT = 9000
FIRST_SPORT = 7000
RX_SINK_OBJECT = BUILD_DIR / "rx_sink.bpf.o"
DRAIN_S = 0.5  # queues drain into the sink's counter after the generator stops
# (generator, sink) in the order of the table.
CELLS = (("xdpgen", "xdp"), ("udpgen", "xdp"), ("udpgen", "socket"))
MODES = (
    ("plain", "OVS userspace datapath (no eSwitch)"),
    ("miss", "eSwitch attached, flow not offloaded (miss -> OVS)"),
    ("offloaded", "offloaded (XDP redirect, OVS bypassed)"),
)


@dataclasses.dataclass(frozen=True)
class Placement:
    """One direction of one flow on one host: what a NIC eSwitch would hold."""

    host: str
    entry: OffloadEntry


@dataclasses.dataclass(frozen=True)
class Offloader:
    """How the main benchmark offloads and onloads flows (provider or app)."""

    offload: Callable[[Lab, list[Placement]], str]
    onload: Callable[[Lab, list[Placement]], None]
    via_app: bool  # the app keeps the eSwitch attached itself


@dataclasses.dataclass(frozen=True)
class Run:
    lab: Lab
    src: endpoints.Endpoint
    dst: endpoints.Endpoint
    duration: float
    senders: int  # udpgen processes; xdpgen is one process, far faster than the path
    offloader: Offloader


# -- the endpoints' and ports' kernel state ----------------------------------------------------
def _ip_json(args: list[str]) -> list[dict]:
    out = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _bpftool(args: list[str]) -> dict:
    out = subprocess.run(["bpftool", "-j", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _u64(value: int | list[str]) -> int:
    """bpftool prints a value as a number (with BTF) or as its bytes in hex."""
    if isinstance(value, int):
        return value
    return int.from_bytes(bytes(int(b, 16) for b in value), "little")


def endpoint_mac(ep: endpoints.Endpoint) -> str:
    return _ip_json(["-n", ep.netns, "link", "show", endpoints.ENDPOINT_IF])[0]["address"]


class XdpSink:
    """``rx_sink`` on an endpoint's eth0: counts and drops UDP to port 9000."""

    def __init__(self, ep: endpoints.Endpoint) -> None:
        self.ep = ep

    def __enter__(self) -> XdpSink:
        self._load(RX_SINK_OBJECT)
        link = _ip_json(["-n", self.ep.netns, "link", "show", endpoints.ENDPOINT_IF])[0]
        prog = _bpftool(["prog", "show", "id", str(link["xdp"]["prog"]["id"])])
        self.map_id = prog["map_ids"][0]
        return self

    def count(self) -> int:
        rows = _bpftool(["map", "lookup", "id", str(self.map_id), "key", "0", "0", "0", "0"])
        return sum(_u64(v["value"]) for v in rows["values"])

    def __exit__(self, *exc: object) -> None:
        self._load(RX_PASS_OBJECT)

    def _load(self, obj: Path) -> None:
        subprocess.run(
            ["ip", "-force", "-n", self.ep.netns, "link", "set", "dev", endpoints.ENDPOINT_IF,
             "xdpdrv", "obj", str(obj), "sec", "xdp"],
            check=True,
            capture_output=True,
        )  # fmt: skip


class PortNapi:
    """GRO on and a NAPI thread for a host port without XDP, restored on exit.

    A veth accepts XDP frames only while its peer has NAPI; without an XDP
    program GRO is what gives it one.
    """

    def __init__(self, lab: Lab, port: str) -> None:
        self.host, self.port = lab.host("A"), port

    def _sh(self, *cmd: str) -> str:
        return self.host.ns.run(list(cmd)).stdout

    def __enter__(self) -> PortNapi:
        features = self._sh("ethtool", "-k", self.port)
        self.gro_was = "generic-receive-offload: on" in features
        self.threaded_was = self._sh("cat", f"/sys/class/net/{self.port}/threaded").strip()
        self._sh("ethtool", "-K", self.port, "gro", "on")
        self._sh("sh", "-c", f"echo 1 > /sys/class/net/{self.port}/threaded")
        return self

    def __exit__(self, *exc: object) -> None:
        self._sh("sh", "-c", f"echo {self.threaded_was} > /sys/class/net/{self.port}/threaded")
        self._sh("ethtool", "-K", self.port, "gro", "on" if self.gro_was else "off")


# -- the generators --------------------------------------------------------------------------
def _reap(proc: subprocess.Popen, timeout: float) -> tuple[str, float]:
    """Wait for ``proc`` with its resource usage: (stdout, CPU seconds it used)."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(timeout=10)
            raise exceptions.Timeout(seconds=timeout, what="udpgen sender")
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.stdout is not None
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise errors.LabError(reason=f"udpgen sender exited {proc.returncode}")
    return out, usage.ru_utime + usage.ru_stime


def udpgen_send(run: Run) -> dict[str, float]:
    """``run.senders`` concurrent udpgen --raw processes, a flow each; summed."""
    procs = []
    for k in range(run.senders):
        cmd = [*endpoints.exec_prefix(run.src), str(traffic.UDPGEN), "send", "--raw", "eth0"]
        cmd += ["--src", run.src.ip, "--dst", run.dst.ip, "--dst-mac", endpoint_mac(run.dst)]
        cmd += ["--port", str(SINK_PORT), "--sport", str(FIRST_SPORT + k)]
        cmd += ["--duration", str(run.duration)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    reaped = [_reap(p, run.duration + 30) for p in procs]
    results = [json.loads(out) for out, _ in reaped]
    seconds = max(r["seconds"] for r in results)
    return {
        "pps": sum(r["pps"] for r in results),
        "port_pps": sum(r["pps"] for r in results),  # a socket send is taken or blocks
        "seconds": seconds,
        "generator_cpu_pct": 100 * sum(cpu for _, cpu in reaped) / seconds,
    }


def xdpgen_send(run: Run) -> dict[str, float]:
    """One xdpgen, flat out; ``port_pps`` is what ep-a1 took of it (xdp_xmit)."""
    flow = traffic.XdpFlow(
        run.src.ip, run.dst.ip, endpoint_mac(run.dst), SINK_PORT, sport=FIRST_SPORT
    )
    sent = traffic.xdp_send(
        endpoints.exec_prefix(run.src), endpoints.ENDPOINT_IF, flow, duration=run.duration
    )
    return {
        "pps": sent["pps"],
        "port_pps": sent["xdp_xmit"] / sent["seconds"],
        "seconds": sent["seconds"],
        "generator_cpu_pct": 100 * sent["cpu_seconds"] / sent["seconds"],
    }


# -- one measurement and the rounds --------------------------------------------------------------
def _placements(run: Run, generator: str) -> list[Placement]:
    flows = 1 if generator == "xdpgen" else run.senders
    return [
        Placement(
            "A",
            OffloadEntry(
                FlowMatch(run.src.port, UDP, run.src.ip, run.dst.ip, FIRST_SPORT + k, SINK_PORT),
                run.dst.port,
            ),
        )
        for k in range(flows)
    ]


def _measure(run: Run, generator: str, sink: str) -> tuple[dict[str, float], int, object]:
    """The traffic itself, under the CPU meter: (generator totals, received, meter)."""
    send = xdpgen_send if generator == "xdpgen" else udpgen_send
    host = run.lab.host("A")
    meter = host_cpu.CpuMeter(
        [host],
        host_cpu.napi_threads(host.spec.netns, [run.src.port, run.dst.port]),
        host_cpu.guest_threads([run.src, run.dst]),
    )
    if sink == "xdp":
        with XdpSink(run.dst) as counter:
            with meter:
                sent = send(run)
            time.sleep(DRAIN_S)
            return sent, counter.count(), meter
    receiver = traffic.Receiver(
        endpoints.exec_prefix(run.dst), SINK_PORT, duration=run.duration + 10
    )
    with meter:
        sent = send(run)
    return sent, receiver.result()["received_packets"], meter


def packet_rate(run: Run, mode: str, generator: str, sink: str) -> dict[str, float]:
    """One row: mode plain | miss | offloaded, generator xdpgen | udpgen, sink xdp | socket."""
    xdp = HostXdp(run.lab.host("A"))
    ports = (run.src.port, run.dst.port)
    placements = _placements(run, generator)
    attach = mode != "plain" and not run.offloader.via_app
    port_napi = PortNapi(run.lab, run.src.port) if generator == "xdpgen" and not attach else None
    if attach:
        xdp.attach(*ports)
    if mode == "offloaded":
        run.offloader.offload(run.lab, placements)
    try:
        if port_napi:
            with port_napi:
                sent, received, meter = _measure(run, generator, sink)
        else:
            sent, received, meter = _measure(run, generator, sink)
    finally:
        if mode == "offloaded":
            run.offloader.onload(run.lab, placements)
        if attach:
            xdp.detach(*ports)
    received_pps = received / sent["seconds"]
    return {
        "sent_pps": sent["pps"],
        "port_pps": sent["port_pps"],
        "received_pps": received_pps,
        "datapath_cpu_pct": meter.host_pct,
        "generator_cpu_pct": sent["generator_cpu_pct"],
        "guest_napi_pct": meter.guest_napi_pct,
        "pps_per_core": received_pps / max(meter.host_pct / 100, 1e-9),
        "loadavg": os.getloadavg()[0],
        "napi_threads": len(meter.napi_pids),
    }


def packet_rates(run: Run, rounds: int) -> dict[str, dict]:
    """(a) in ``rounds`` interleaved rounds; per cell the median round, and all rounds.

    Interleaving puts every path through the same stretches of the shared
    machine's load; the median keeps one disturbed round from deciding.
    """
    samples: dict[str, list[dict]] = {}
    for round_no in range(rounds):
        for generator, sink in CELLS:
            for mode, _ in MODES:
                row = packet_rate(run, mode, generator, sink)
                samples.setdefault(f"{generator}/{sink}/{mode}", []).append(row)
                print(f"(a) round {round_no} {generator}/{sink}/{mode}: {row}", flush=True)
    cells = {}
    for cell, rows in samples.items():
        median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        cells[cell] = median | {"rounds_received_pps": [r["received_pps"] for r in rows]}
    return cells


# -- the table -------------------------------------------------------------------------------
def render_table(pps: dict[str, dict], args: argparse.Namespace) -> list[str]:
    lines = [
        "## (a) Packets/s, endpoint a1 -> a2 on host A (60-byte frames, 64 on the wire; "
        f"{args.duration:g} s, unpaced; median of {args.rounds} interleaved rounds)",
        "",
        "Generators: **xdpgen** (in-kernel: XDP live frames through bpf_prog_test_run, "
        "redirected out of a1's eth0, one flow; a veth hands them to the host port ep-a1's "
        "ring as a NIC queue would, no skb on the sending side) and **udpgen --raw** "
        f"({args.senders} AF_PACKET senders with a flow each: skbs). A veth takes XDP frames "
        "only while its peer has NAPI: the eSwitch's XDP program gives ep-a1 one; for the "
        "xdpgen plain OVS row ep-a1 has GRO turned on instead (NAPI without XDP; these UDP "
        "frames are not coalesced) and a NAPI thread, as the eSwitch's attach sets, both "
        "restored after the row. Offered = what the generator produced; port took = what "
        "ep-a1's ring accepted (xdpgen: the veth's xdp_xmit counter; the rest it refused "
        "when full; udpgen: every frame, a socket send blocks instead).",
        "",
        "Received at the endpoint two ways: an XDP sink on its eth0 (counts and drops: what "
        "the switch path delivers to the port) and a UDP socket (udpgen recv: what an "
        "application gets, which adds the receiver's own cost to both paths).",
        "",
        "Datapath CPU = host A's ovs-vswitchd + the machine's network softirq time + the "
        "NAPI threads of ports ep-a1 and ep-a2 (where the eSwitch runs), in % of one core; "
        "the endpoints' own eth0 receive threads are the guests' and shown apart. Packets "
        "per core-second = received pps / datapath CPU: the cost of the path itself. "
        "Generator CPU = the sender processes' own CPU (the kernel generates in xdpgen's "
        "syscall; udpgen's includes the softirq work run in its context, also in softirq).",
        "",
        "| generator | sink | path | offered pps | port took pps | received pps (rounds) | "
        "vs plain OVS | datapath CPU % | packets per core-second | vs plain OVS | "
        "generator CPU % | guests' eth0 NAPI % | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for generator, sink in CELLS:
        base = pps[f"{generator}/{sink}/plain"]
        for mode, label in MODES:
            row = pps[f"{generator}/{sink}/{mode}"]
            rounds = ", ".join(f"{x / 1000:.0f}k" for x in row["rounds_received_pps"])
            lines.append(
                f"| {generator} | {sink} | {label} | {row['sent_pps']:,.0f} | "
                f"{row['port_pps']:,.0f} | {row['received_pps']:,.0f} ({rounds}) | "
                f"{row['received_pps'] / (base['received_pps'] or 1):.2f}x | "
                f"{row['datapath_cpu_pct']:.0f} | {row['pps_per_core']:,.0f} | "
                f"{row['pps_per_core'] / (base['pps_per_core'] or 1):.2f}x | "
                f"{row['generator_cpu_pct']:.0f} | {row['guest_napi_pct']:.0f} | "
                f"{row['loadavg']:.1f} |"
            )
    return lines
