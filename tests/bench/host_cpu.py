"""Host CPU of a switch path on the lab: ovs-vswitchd, softirq, NAPI kthreads.

Used by the datapath benchmark; everything is read from /proc and from the
kernel's netdev netlink family (napi_threads.py), in seconds of CPU.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from pathlib import Path

from flexmig_lab import endpoints
from flexmig_lab.host import LabHost
from tests.bench.softirq_time import SLOT_OTHER_NS, SoftirqClock

NAPI_HELPER = Path(__file__).resolve().parent / "napi_threads.py"
BACKGROUND_SAMPLE_S = 1.0


def outer_pid(host: LabHost, pid_file: str) -> int:
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


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, USER_HZ


def _softirq_ticks_s() -> float:
    """/proc/stat's softirq column: tick-sampled, kept beside the exact time for comparison."""
    cpu = Path("/proc/stat").read_text().splitlines()[0].split()
    return int(cpu[7]) / 100.0


def napi_threads(netns: str, ifnames: list[str]) -> list[int]:
    """PIDs of the NAPI kthreads of interfaces in a namespace (see napi_threads.py)."""
    out = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, str(NAPI_HELPER), *ifnames],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return [pid for pids in json.loads(out).values() for pid in pids]


class CpuMeter:
    """Host CPU of a switch path, in % of one core.

    Host: ovs-vswitchd of the given hosts, the machine's network softirq time
    (NET_TX + NET_RX handlers, timed exactly: softirq_time.py), and the NAPI
    kthreads of the hosts' ports (``port_threads``) where the eSwitch runs.
    Apart, as the guests' own: the endpoints' eth0 NAPI kthreads
    (``guest_threads``, their receive stacks: a VM's vCPU work); and the
    fabric's (``fabric_threads``: the physical network's forwarding).
    Threads are named by the kernel per interface (napi_threads.py), so
    another lab's busy ports are never counted as ours.
    """

    def __init__(
        self,
        hosts: list[LabHost],
        port_threads: list[int],
        guest_threads: list[int],
        fabric_threads: list[int] | None = None,
    ) -> None:
        self.pids = [outer_pid(h, "/run/openvswitch/ovs-vswitchd.pid") for h in hosts]
        self.napi_pids, self.guest_pids = port_threads, guest_threads
        self.fabric_pids = fabric_threads or []

    def __enter__(self) -> CpuMeter:
        self._clock = SoftirqClock().__enter__()
        # The machine's softirq includes other labs' traffic: sample it idle first.
        idle0, t_idle = self._clock.seconds(), time.monotonic()
        time.sleep(BACKGROUND_SAMPLE_S)
        self.background_pct = 100 * (self._clock.seconds() - idle0) / (time.monotonic() - t_idle)
        self.t0, self.ovs0, self.irq0 = time.monotonic(), self._ovs(), self._clock.seconds()
        self.ticks0, self.other0 = _softirq_ticks_s(), self._clock.seconds(SLOT_OTHER_NS)
        self.napi0, self.guest0 = cpu_of(self.napi_pids), cpu_of(self.guest_pids)
        self.fabric0 = cpu_of(self.fabric_pids)
        self.sleeps0 = sleeps_of(self.napi_pids)
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self.t0
        self.ovs_pct = 100 * (self._ovs() - self.ovs0) / wall
        self.softirq_pct = 100 * (self._clock.seconds() - self.irq0) / wall
        self.softirq_ticks_pct = 100 * (_softirq_ticks_s() - self.ticks0) / wall
        # Timers, RCU, scheduler: not the switch path, kept for the record.
        self.softirq_other_pct = 100 * (self._clock.seconds(SLOT_OTHER_NS) - self.other0) / wall
        self._clock.__exit__()
        self.napi_pct = 100 * _delta(self.napi0, cpu_of(self.napi_pids)) / wall
        self.guest_napi_pct = 100 * _delta(self.guest0, cpu_of(self.guest_pids)) / wall
        self.fabric_napi_pct = 100 * _delta(self.fabric0, cpu_of(self.fabric_pids)) / wall
        self.napi_cpu_s = _delta(self.napi0, cpu_of(self.napi_pids))
        self.napi_sleeps = int(_delta(self.sleeps0, sleeps_of(self.napi_pids)))

    @property
    def host_pct(self) -> float:
        return self.ovs_pct + self.softirq_pct + self.napi_pct

    @property
    def net_host_pct(self) -> float:
        """Host CPU less the softirq the machine spent just before, with no traffic of ours."""
        return self.ovs_pct + max(0.0, self.softirq_pct - self.background_pct) + self.napi_pct

    def _ovs(self) -> float:
        return sum(proc_cpu_s(p) for p in self.pids)


@functools.cache
def stable_napi_threads(netns_names: tuple[str, ...], ifnames: tuple[str, ...]) -> list[int]:
    """NAPI threads of interfaces whose XDP program stays for the whole run
    (endpoints' eth0, the fabric's ports): looked up once, not per measurement."""
    return [pid for ns in netns_names for pid in napi_threads(ns, list(ifnames))]


def guest_threads(eps: list[endpoints.Endpoint]) -> list[int]:
    return [pid for ep in eps for pid in napi_threads(ep.netns, [endpoints.ENDPOINT_IF])]


def cpu_of(pids: list[int]) -> dict[int, float]:
    """CPU seconds so far of each thread still alive."""
    seconds = {}
    for pid in pids:
        try:
            seconds[pid] = proc_cpu_s(pid)
        except OSError:
            pass  # gone (its device was deleted)
    return seconds


def sleeps_of(pids: list[int]) -> dict[int, float]:
    """Voluntary context switches so far of each thread still alive.

    A NAPI kthread switches out voluntarily only when its poll found nothing
    left and it went to sleep, so the count is how often it was woken.
    """
    counts = {}
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                counts[pid] = float(line.split()[1])
    return counts


def _delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU used in between by the threads alive at both ends (never negative)."""
    return sum(after[pid] - before[pid] for pid in before.keys() & after.keys())
