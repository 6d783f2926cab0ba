"""The offload service under load: 10k active flows, 1,000 new flows/s, 20 dumpers.

    .venv/bin/python -m tests.bench.offload_load [--trials N] [--out FILE]

Host A of a fresh two-host lab; endpoints s1, s2 -> r1 in br-int; the real
flexmig-offload with the XDP provider (poll 50 ms, window 0.2 s, OVS
revalidator 100 ms: the configuration whose promotion latency
docs/benchmarks/offload-control.md measured, target 200 ms).

- Mice: ``flowgen`` starts 1,000 new UDP flows a second from s2 (each a burst
  of PER_FLOW datagrams back to back), for WARMUP_S and then throughout; with
  ``flow_idle_timeout`` = IDLE_S the service holds ~10,000 active flows, each
  with its OpenFlow rule, every one judged by the app.
- Elephants, meanwhile, from s1: a flow starts, idles, jumps to ELEPHANT_PPS;
  promotion latency is threshold crossed -> the provider's install returned
  (as bench_offload_control measures it).
- The OpenFlow endpoint: DUMPERS clients run ``ovs-ofctl dump-flows
  br-int-offload`` in a loop, and an "operator" dump is timed beside them: it
  must come back within OPERATOR_TIMEOUT_S and show the elephants.
- Counters: at the end every mouse still shown counts <= PER_FLOW packets,
  and exactly PER_FLOW when r1 received every datagram sent; every elephant
  <= sent, == sent on a loss-free run.

The functional test (tests/functional/test_offload_load.py) runs
:func:`run` with fewer trials and holds it to those targets.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from flexmig import exceptions, processutil
from flexmig_lab import endpoints, offload, traffic

FLOWS_PER_S = 1000
IDLE_S = 10.0  # flow_idle_timeout: 1,000 flows/s x 10 s = 10,000 active
WARMUP_S = 12.0
PER_FLOW = 3
MICE_PORT = 9100
FIRST_SPORT = 2000
ELEPHANT_PORT = 9800
ELEPHANT_PPS = 10_000
PROMOTE_PPS = 2000
WINDOW_S = 0.2
POLL_S = 0.05
DUMPERS = 20
OPERATOR_TIMEOUT_S = 10.0
FLOW_SETUP_TIMEOUT_S = 15.0  # a new flow's first packet -> the flow in the status file
TARGET_MS = 200.0  # docs/benchmarks/offload-control.md: offloaded within 200 ms
POLICY = (
    "capacity: 1024\nstatistics:\n"
    f"  window_s: {WINDOW_S}\n  promote_pps: {PROMOTE_PPS}\n"
    f"  demote_pps: {PROMOTE_PPS // 10}\n  demote_intervals: 600\n"
)
OPTIONS = f"flow_idle_timeout = {IDLE_S}\n"
DUMP_LINE = re.compile(r"table=(\d+), n_packets=(\d+).*tp_src=(\d+),tp_dst=(\d+)")


@dataclasses.dataclass
class Result:
    latencies_ms: list[float] = dataclasses.field(default_factory=list)
    active_flows: list[int] = dataclasses.field(default_factory=list)
    operator_s: list[float] = dataclasses.field(default_factory=list)
    operator_failures: list[str] = dataclasses.field(default_factory=list)
    dumper_dumps: int = 0
    dumper_failures: list[str] = dataclasses.field(default_factory=list)
    mice: dict[str, int] = dataclasses.field(default_factory=dict)
    mice_bad: list[str] = dataclasses.field(default_factory=list)
    elephants_bad: list[str] = dataclasses.field(default_factory=list)
    elephants_exact: int = 0
    never_offloaded: int = 0
    load: list[float] = dataclasses.field(default_factory=list)
    setup_s: list[float | None] = dataclasses.field(default_factory=list)
    # [s since start, flows in the status file, its age s, service CPU s in the last s, load]
    timeline: list[list[float]] = dataclasses.field(default_factory=list)
    log_tail: str = ""


def shown(service: offload.LabOffload, timeout: float = 60.0) -> dict[tuple[int, int], int]:
    """{(sport, dport): packets} of table 0, as an operator's ovs-ofctl shows it."""
    out = service.host.ns.run(
        ["ovs-ofctl", f"--timeout={int(timeout)}", "dump-flows", offload.ENDPOINT_NAME],
        timeout=timeout + 5,
    ).stdout
    found = {}
    for line in out.splitlines():
        m = DUMP_LINE.search(line)
        if m and m.group(1) == "0":
            found[(int(m.group(3)), int(m.group(4)))] = int(m.group(2))
    return found


def final_dump(service: offload.LabOffload, attempts: int = 3) -> dict[tuple[int, int], int]:
    """The table once the load is over (an ovs-ofctl handshake may still fail: retried)."""
    for attempt in range(attempts):
        try:
            return shown(service)
        except exceptions.CommandFailed:
            if attempt == attempts - 1:
                raise
            time.sleep(1.0)
    return {}


def flow_of(service: offload.LabOffload, sport: int, dport: int) -> dict | None:
    try:
        flows = service.status()["flows"]
    except (FileNotFoundError, ValueError):
        return None
    for flow in flows:
        if (flow["match"]["tp_src"], flow["match"]["tp_dst"]) == (sport, dport):
            return flow
    return None


def wait_flow(service, sport, dport, predicate, timeout):
    def probe():
        flow = flow_of(service, sport, dport)
        return flow if flow is not None and predicate(flow) else None

    # Not faster: the status file of 10k flows is megabytes of JSON, and parsing
    # it takes CPU from the service measured (its own timestamps are the result).
    return processutil.wait_for(
        probe, timeout=timeout, interval=0.25, what=f"flow {sport}->{dport}"
    )


class Dumpers:
    """DUMPERS clients dumping the endpoint's table in a loop until stopped."""

    def __init__(self, service: offload.LabOffload, result: Result) -> None:
        self.service, self.result = service, result
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(DUMPERS)]

    def _loop(self) -> None:
        cmd = ["ovs-ofctl", "--timeout=30", "dump-flows", offload.ENDPOINT_NAME]
        while not self.stop.is_set():
            proc = self.service.host.ns.run(cmd, check=False, timeout=40)
            if proc.returncode == 0:
                self.result.dumper_dumps += 1
            else:
                self.result.dumper_failures.append(proc.stderr.strip()[:200])

    def __enter__(self) -> Dumpers:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


def operator_dump(service, result: Result, must_show: set[tuple[int, int]], mice_port: int):
    started = time.monotonic()
    try:
        table = shown(service, OPERATOR_TIMEOUT_S)
    except (exceptions.CommandFailed, exceptions.Timeout) as exc:
        result.operator_failures.append(str(exc)[:200])
        return
    result.operator_s.append(time.monotonic() - started)
    missing = must_show - set(table)
    if missing:
        result.operator_failures.append(f"flows missing from the dump: {sorted(missing)}")
    result.active_flows.append(sum(1 for (_s, d) in table if d == mice_port))


def elephant(service, eps, sport: int, result: Result) -> tuple[float | None, int]:
    """One promotion under load: (latency ms or None if never offloaded, packets sent)."""
    prefix = endpoints.exec_prefix(eps["s1"])
    started = time.monotonic()
    traffic.send(prefix, eps["r1"].ip, ELEPHANT_PORT, sport=sport, count=1, rate=1000)
    try:
        wait_flow(service, sport, ELEPHANT_PORT, lambda f: True, FLOW_SETUP_TIMEOUT_S)
    except exceptions.Timeout:
        result.setup_s.append(None)
        return None, 1
    result.setup_s.append(time.monotonic() - started)
    time.sleep(WINDOW_S + 0.3)  # idle: the window holds nothing
    count = ELEPHANT_PPS * 2
    cmd = [*prefix, str(traffic.UDPGEN), "send", "--dst", eps["r1"].ip]
    cmd += ["--port", str(ELEPHANT_PORT), "--sport", str(sport), "--count", str(count)]
    cmd += ["--rate", str(ELEPHANT_PPS), "--size", "18"]
    t0 = time.time()
    sender = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        flow = wait_flow(service, sport, ELEPHANT_PORT, lambda f: f["state"] == "offloaded", 10)
    except exceptions.Timeout:
        flow = None
    finally:
        out, _ = sender.communicate(timeout=30)
    sent = 1 + int(json.loads(out)["sent_packets"])
    crossed = t0 + WINDOW_S * PROMOTE_PPS / ELEPHANT_PPS
    return (None if flow is None else (flow["offloaded_at"] - crossed) * 1000), sent


class Timeline:
    """Once a second: flows in the status file, its age, the service's CPU share."""

    def __init__(self, service: offload.LabOffload, result: Result) -> None:
        self.service, self.result = service, result
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _cpu_s(self) -> float:
        try:
            pid = int(self.service.host.ns.root_path(offload.PID_FILE).read_text())
            fields = self.service.host.ns.root_path(f"/proc/{pid}/stat").read_text().split()
            return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return -1.0

    def _loop(self) -> None:
        start, cpu = time.monotonic(), self._cpu_s()
        while not self.stop.wait(1.0):
            path = self.service.host.ns.root_path(offload.STATUS_FILE)
            try:
                age = time.time() - path.stat().st_mtime
                flows = len(json.loads(path.read_text())["flows"])
            except (OSError, ValueError, KeyError):
                age, flows = -1.0, -1
            now_cpu = self._cpu_s()
            self.result.timeline.append(
                [round(time.monotonic() - start, 1), flows, round(age, 2),
                 round(now_cpu - cpu, 2), round(os.getloadavg()[0], 1)]
            )  # fmt: skip
            cpu = now_cpu

    def __enter__(self) -> Timeline:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def start_mice(eps, flows: int, port: int) -> subprocess.Popen:
    cmd = [*endpoints.exec_prefix(eps["s2"]), sys.executable, "-m", "flexmig_lab.traffic.flowgen"]
    cmd += ["--src", eps["s2"].ip, "--dst", eps["r1"].ip, "--port", str(port)]
    cmd += ["--first-sport", str(FIRST_SPORT), "--flows", str(flows)]
    cmd += ["--per-flow", str(PER_FLOW), "--flows-per-s", str(FLOWS_PER_S)]
    env = {**os.environ, "PYTHONPATH": str(Path(traffic.__file__).resolve().parents[2])}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def run(lab, eps, trials: int, stats_socket: str | None = None, index: int = 0) -> Result:
    """One configuration (``stats_socket``: the [offload] option, None: its
    default); ``index`` keeps its flows apart from an earlier one's (a restart
    carries the counters of flows not yet idle)."""
    service = offload.LabOffload(lab.host("A"))
    options = OPTIONS + (f"stats_socket = {stats_socket}\n" if stats_socket is not None else "")
    service.start(POLICY, poll_interval=POLL_S, options=options)
    mice_port, first_elephant = MICE_PORT + index, 30000 + 100 * index
    result = Result()
    elephant_sent: dict[int, int] = {}
    duration = WARMUP_S + trials * 4.0 + 10.0
    flows = int(duration * FLOWS_PER_S)
    prefix = endpoints.exec_prefix(eps["r1"])
    mice_rx = traffic.Receiver(prefix, mice_port, count=flows * PER_FLOW, idle_ms=5000,
                               duration=duration + 60)  # fmt: skip
    mice = start_mice(eps, flows, mice_port)
    timeline = Timeline(service, result).__enter__()
    try:
        time.sleep(WARMUP_S)
        # Every elephant's datagrams: it ends as soon as all came (a loss-free run).
        big_rx = traffic.Receiver(prefix, ELEPHANT_PORT, count=trials * (1 + 2 * ELEPHANT_PPS),
                                  idle_ms=20_000, duration=duration + 60)  # fmt: skip
        with Dumpers(service, result):
            for i in range(trials):
                result.load.append(os.getloadavg()[0])
                latency, sent = elephant(service, eps, first_elephant + i, result)
                print(f"elephant {i}: {latency} ms, {sent} sent", flush=True)
                if latency is not None:
                    result.latencies_ms.append(latency)
                else:
                    result.never_offloaded += 1
                elephant_sent[first_elephant + i] = sent
                operator_dump(service, result, {(first_elephant + i, ELEPHANT_PORT)}, mice_port)
        out, err = mice.communicate(timeout=duration + 60)
    finally:
        timeline.__exit__()
        if mice.poll() is None:
            mice.kill()
        # The service's own lines: the endpoint logs every dump's refused
        # vendor probe (ovs-ofctl's), thousands of them under this load.
        kept = [line for line in service.log_tail(100_000).splitlines()
                if "flexmig.ovs_ext.openflow_stats" not in line]  # fmt: skip
        result.log_tail = "\n".join(kept[-40:])
    generated = json.loads(out or b"{}") if mice.returncode == 0 else {"error": err.decode()}
    got = int(mice_rx.result()["received_packets"])
    big_got = int(big_rx.result()["received_packets"])
    time.sleep(1.5)  # the revalidator's push and a poll
    table = final_dump(service)
    check_mice(result, table, generated, got, mice_port)
    check_elephants(result, table, elephant_sent, big_got)
    service.start()  # the lab's standing configuration for whatever runs next
    return result


def check_mice(result: Result, table, generated: dict, received: int, mice_port: int) -> None:
    sent = int(generated.get("packets", -1))
    loss_free = received == sent
    mice = {k: v for k, v in table.items() if k[1] == mice_port}
    for (sport, _d), counted in mice.items():
        if counted > PER_FLOW or (loss_free and counted != PER_FLOW):
            result.mice_bad.append(f"{sport}: counted {counted} of {PER_FLOW}")
    result.mice = {
        "flows_started": int(generated.get("flows", -1)),
        "sent": sent,
        "received": received,
        "shown_at_end": len(mice),
        "generator_late_s": generated.get("last_flow_late_s", -1),
    }


def check_elephants(result: Result, table, sent: dict[int, int], received: int) -> None:
    loss_free = received == sum(sent.values())
    for sport, count in sent.items():
        counted = table.get((sport, ELEPHANT_PORT), 0)
        if counted > count or (loss_free and counted != count):
            result.elephants_bad.append(f"{sport}: sent {count} counted {counted}")
        elif counted == count:
            result.elephants_exact += 1


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"{statistics.median(ordered):.0f} / {p90:.0f} / {ordered[-1]:.0f}"


def render(result: Result, trials: int, title: str = "") -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    m = result.mice
    ops = [s * 1000 for s in result.operator_s]
    return "\n".join(
        [
            f"## {title or 'Statistics through the controller connection (default)'}",
            "",
            f"Run {when}; load average "
            f"(1 min) during the trials {min(result.load, default=0):.1f}-"
            f"{max(result.load, default=0):.1f} (the load is the benchmark's own: generator, "
            "OVS, the service, 21 ovs-ofctl loops). What runs is described in "
            "`tests/bench/offload_load.py`.",
            "",
            "| measure | value |",
            "|---|---|",
            f"| new flows started (1,000/s, {PER_FLOW} datagrams each) | "
            f"{m.get('flows_started')} |",
            f"| generator behind schedule at the end | {m.get('generator_late_s')} s |",
            f"| mice flows shown by ovs-ofctl (median over operator dumps) | "
            f"{statistics.median(result.active_flows) if result.active_flows else '-'} |",
            f"| promotion latency ms, median / p90 / max ({trials} elephants; target "
            f"{TARGET_MS:.0f}) | {_spread(result.latencies_ms)} |",
            f"| operator dump ms, median / p90 / max (timeout {OPERATOR_TIMEOUT_S:.0f} s) | "
            f"{_spread(ops)} |",
            f"| operator dumps failed or missing a flow | {len(result.operator_failures)} |",
            f"| other clients' dumps done / failed | {result.dumper_dumps} / "
            f"{len(result.dumper_failures)} |",
            f"| mice: sent / received | {m.get('sent')} / {m.get('received')} |",
            f"| mice shown at the end / counted wrong | {m.get('shown_at_end')} / "
            f"{len(result.mice_bad)} |",
            f"| elephants counted exactly / wrong | {result.elephants_exact} / "
            f"{len(result.elephants_bad)} |",
            "",
            f"| elephants never offloaded within 10 s / never seen within "
            f"{FLOW_SETUP_TIMEOUT_S:.0f} s | {result.never_offloaded} / "
            f"{sum(1 for s in result.setup_s if s is None)} |",
            f"| elephant's first packet -> flow in the status file, s (median / max) | "
            f"{_spread([s for s in result.setup_s if s is not None])} |",
            "",
            "Latencies: " + ", ".join(f"{v:.0f}" for v in result.latencies_ms) + " ms.",
            "",
            "Timeline (s since the generator started, flows in the status file, its age s, "
            "the service's CPU seconds in that second, load average):",
            "",
            "```",
            *(" ".join(str(v) for v in row) for row in result.timeline[::3]),
            "```",
            "",
        ]
    )


CONFIGS = (
    ("Statistics through the app's own reader (the default: [offload] stats_socket = auto)",
     None),
    ("Statistics through the controller connection ([offload] stats_socket empty)", ""),
)  # fmt: skip
HEADER_TEXT = """# Offload service under load: 10k active flows, 1,000 new flows/s, 20 dumpers

```sh
FLEXMIG_LAB_NAME=<name> .venv/bin/python -m tests.bench.offload_load --trials {trials}
.venv/bin/python -m tests.bench.offload_poll_cost    # one poll's parts, no lab
```

The lab alone on the 2-core development machine (the load is the benchmark's
own: the generator, OVS, the service, 21 ovs-ofctl loops); the two ways of
reading the rules' statistics side by side in one run. What runs is described
in `tests/bench/offload_load.py`.
"""


def main() -> None:
    from flexmig_lab.lab import Lab

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--out", default="docs/benchmarks/offload-load.md")
    args = parser.parse_args()
    lab = Lab()
    lab.down()
    lab.up(2)
    sections = [HEADER_TEXT.format(trials=args.trials)]
    try:
        eps = {name: endpoints.add(lab, "A", name) for name in ("s1", "s2", "r1")}
        for sender in ("s1", "s2"):
            ping = processutil.run(
                [*endpoints.exec_prefix(eps[sender]), "ping", "-c", "1", eps["r1"].ip]
            )
            assert ping.returncode == 0
        for index, (title, socket_path) in enumerate(CONFIGS):
            result = run(lab, eps, args.trials, socket_path, index)
            sections.append(render(result, args.trials, title))
            Path(args.out).write_text("\n".join(sections))  # kept should the next one hang
            print(sections[-1], flush=True)
            print(result.log_tail, flush=True)
            rest = {k: v for k, v in dataclasses.asdict(result).items() if k != "log_tail"}
            print(json.dumps(rest), flush=True)
    finally:
        lab.down()


if __name__ == "__main__":
    main()
