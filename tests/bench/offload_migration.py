"""A VM with offloaded flows, live-migrated: loss, re-offload time, counters, convergence.

    .venv/bin/python -m tests.bench.offload_migration \\
        [--runs N] [--out docs/benchmarks/offload-migration.md]

A three-host lab; flexmig-offload (XDP eSwitch) on A and B, between which the
VM moves; host C holds the far ends of its traffic (endpoints), so every
packet crosses the fabric whichever host the VM is on.  Two directions:

- outbound: the guest sends UDP with its own udpgen at RATE pps through its
  tap port to an endpoint on C (below);
- inbound: an endpoint on C sends to the VM, the guest's udpgen counts it
  (``tests/bench/offload_inbound.py``: loss while the fabric converges, QEMU's
  announcements on the destination, first packet at the new location).

Two cases side by side, interleaved, migrating the same VM back and forth by
precopy through the agents:

- ``offloaded``: a header rule offloads the guest's flow (the migration hook
  demotes it before the job, re-offloads it on the destination);
- ``onloaded``: no rule offloads anything (plain vSwitch on both hosts).

Per run: packets lost during the move, by the receiver's sequence numbers
(udpgen numbers every datagram: the numbers that never arrived, in how many
runs, the longest run as milliseconds of outage at RATE, and duplicates);
re-offload delay (the destination extension's
``offloaded_at`` minus the moment its agent saw the incoming domain run); the
destination's total for the flow against the sender's count (source counts
carried over, the source forgets); convergence: first UDP packet reaching the
receiver after the VM resumed, and the first RARP the destination's QEMU
announced (both captured by an AF_PACKET socket in the receiver's namespace).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from flexmig import migrate_cli, processutil
from flexmig_lab import endpoints, offload, traffic, vm
from flexmig_lab.lab import Lab
from tests.bench import offload_inbound

RATE = 1000
SECONDS = 20
PORT = 7001
OFFLOAD_POLICY = """\
capacity: 64
header_rules:
  - {name: guest-udp, ip_proto: udp, tp_dst: 7001, action: offload}
  - {name: inbound-udp, ip_proto: udp, tp_dst: 7002, action: offload}
statistics:
  window_s: 0.5
  promote_pps: 1000000
  demote_pps: 1
  demote_intervals: 10000
"""
ONLOAD_POLICY = """\
capacity: 64
header_rules: []
statistics:
  window_s: 0.5
"""
CASES = {"offloaded": OFFLOAD_POLICY, "onloaded": ONLOAD_POLICY}
RULES = {"offloaded": ["guest-udp", "inbound-udp"], "onloaded": []}
# Timestamps (wall clock) of UDP datagrams to PORT and of RARP frames, seen on
# the receiver's interface; runs in the receiver's network namespace.
CAPTURE = r"""
import json, socket, struct, sys, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
s.settimeout(0.2)
udp, rarp, end = [], [], time.time() + seconds
print("listening", file=sys.stderr, flush=True)
while time.time() < end:
    try:
        frame = s.recv(128)
    except socket.timeout:
        continue
    now = time.time()
    etype = struct.unpack("!H", frame[12:14])[0]
    if etype == 0x8035:
        rarp.append(now)
    elif etype == 0x0800 and frame[23] == 17:
        ihl = (frame[14] & 0x0F) * 4
        if struct.unpack("!H", frame[14 + ihl + 2 : 14 + ihl + 4])[0] == port:
            udp.append(now)
print(json.dumps({"udp": udp, "rarp": rarp}))
"""


def start_capture(receiver: endpoints.Endpoint, seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [*endpoints.exec_prefix(receiver), sys.executable, "-c", CAPTURE, str(PORT), str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    if "listening" not in proc.stderr.readline():
        proc.kill()
        raise RuntimeError("capture did not start")
    return proc


def tap_flow(status: dict, sport: int) -> dict | None:
    for flow in status["flows"]:
        m = flow["match"]
        if (m["tp_src"], m["tp_dst"]) == (sport, PORT) and m["in_port"].startswith("tap"):
            return flow
    return None


def set_policy(services: dict[str, offload.LabOffload], text: str, rules: list[str]) -> None:
    for service in services.values():
        service.reload(text)
        processutil.wait_for(
            lambda s=service: s.status()["header_rules"] == rules,
            timeout=10,
            what="the policy to be applied",
        )


def one_run(lab, services, receiver, guest, case: str, sport: int, to: str) -> dict:
    set_policy(services, CASES[case], RULES[case])
    frm = "A" if to == "B" else "B"
    capture = start_capture(receiver, SECONDS + 5)
    recv = traffic.Receiver(
        endpoints.exec_prefix(receiver), PORT, duration=SECONDS + 30, idle_ms=4000
    )
    guest.udpgen_start(
        f"b{sport}",
        ["send", "--dst", receiver.ip, "--port", str(PORT), "--sport", str(sport),
         "--rate", str(RATE), "--count", str(RATE * SECONDS), "--size", "64", "--batch", "8"],
    )  # fmt: skip
    time.sleep(3)
    before = tap_flow(services[frm].status(), sport)
    result = migrate_cli.migrate(lab, guest.name, to, mode="precopy", show=False)
    sent = guest.udpgen_result(f"b{sport}", timeout=90)["sent_packets"]
    got = recv.result()
    received = got["received_packets"]
    out, _ = capture.communicate(timeout=SECONDS + 60)
    seen = json.loads(out)
    time.sleep(1.5)  # the destination's last poll and OVS revalidator pass
    after = tap_flow(services[to].status(), sport)
    summary = result.get("offload") or {}
    resumed = summary.get("resumed_at")
    first_after = next((t for t in seen["udp"] if resumed and t >= resumed), None)
    rarp_after = next((t for t in seen["rarp"] if resumed and t >= resumed - 0.05), None)
    return {
        "direction": "outbound",
        "case": case,
        "to": to,
        "state": result["state"],
        "error": result["error"],
        "offloaded_before": before is not None and before["state"] == "offloaded",
        "offloaded_after": after is not None and after["state"] == "offloaded",
        "sent": sent,
        "received": received,
        "lost": sent - got["unique_packets"],
        "missing_runs": got["missing_runs"],
        "longest_outage_ms": round(got["longest_missing_run"] * 1000 / RATE, 1),
        "duplicates": got["duplicates"],
        "late": got["late"],
        "dest_total": after["packets"] if after else None,
        "source_forgot": tap_flow(services[frm].status(), sport) is None,
        "reoffload_delays_s": summary.get("reoffload_delays_s", []),
        "first_packet_after_resume_s": round(first_after - resumed, 4) if first_after else None,
        "rarp_after_resume_s": round(rarp_after - resumed, 4) if rarp_after else None,
        "downtime_ms": result.get("downtime_ms"),
        "guest_switchover_gap_ms": result.get("guest_switchover_gap_ms"),
    }


def _med_max(values: list[float], fmt: str = ".3f") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):{fmt}} / {max(values):{fmt}}"


def outbound_rows(runs: list[dict]) -> list[str]:
    lines = [
        "| case | runs | lost packets med / max | longest outage ms med / max "
        "| duplicates | re-offload after resume s med / max "
        "| first packet at receiver after resume s med / max | RARP after resume s "
        "med / max | dest total = sent (loss-free) | dest total <= sent | source forgot |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in CASES:
        rs = [r for r in runs if r["case"] == case and r["state"] == "completed"]
        if not rs:
            continue
        lost = [r["lost"] for r in rs]
        delays = [max(r["reoffload_delays_s"]) for r in rs if r["reoffload_delays_s"]]
        exact = [r["dest_total"] == r["sent"] for r in rs if r["lost"] == 0]
        never_more = all(r["dest_total"] is not None and r["dest_total"] <= r["sent"] for r in rs)
        lines.append(
            f"| {case} | {len(rs)} | {statistics.median(lost):.0f} / {max(lost)} "
            f"| {_med_max([r['longest_outage_ms'] for r in rs], '.1f')} "
            f"| {sum(r['duplicates'] for r in rs)} "
            f"| {_med_max(delays)} | {_med_max([r['first_packet_after_resume_s'] for r in rs])} "
            f"| {_med_max([r['rarp_after_resume_s'] for r in rs])} "
            f"| {sum(exact)}/{len(exact)} | {never_more} "
            f"| {all(r['source_forgot'] for r in rs)} |"
        )
    return lines


def inbound_rows(runs: list[dict]) -> list[str]:
    lines = [
        "| case | runs | lost packets med / max | lost in the move's gap med / max "
        "| outage ms (last before -> first after the gap, sender's stamps) med / max "
        "| QEMU downtime ms med / max "
        "| outage beyond downtime ms med / max | first packet at the VM after resume s "
        "med / max | first packet after QEMU's first RARP s med / max "
        "| RARP on dest tap after resume s med / max | RARP out of dest bridge after resume "
        "s med / max | re-offload after resume s med / max | re-offload after QEMU's first "
        "RARP s med / max | received <= dest total <= sent | duplicates |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in CASES:
        rs = [r for r in runs if r["case"] == case and r["state"] == "completed"]
        if not rs:
            continue
        lost = [r["lost"] for r in rs]
        beyond = [
            r["outage_ms"] - r["downtime_ms"]
            for r in rs
            if r["outage_ms"] is not None and r["downtime_ms"] is not None
        ]
        delays = [max(r["reoffload_delays_s"]) for r in rs if r["reoffload_delays_s"]]
        true_delays = [max(r["reoffload_after_rarp_s"]) for r in rs if r["reoffload_after_rarp_s"]]
        bounded = all(
            r["dest_total"] is not None
            and r["received"] <= r["dest_total"] + r["source_left_packets"] <= r["sent"]
            for r in rs
        )
        lines.append(
            f"| {case} | {len(rs)} | {statistics.median(lost):.0f} / {max(lost)} "
            f"| {_med_max([r['gap_packets'] for r in rs], '.0f')} "
            f"| {_med_max([r['outage_ms'] for r in rs], '.1f')} "
            f"| {_med_max([r['downtime_ms'] for r in rs], '.0f')} "
            f"| {_med_max(beyond, '.1f')} "
            f"| {_med_max([r['first_after_resume_s'] for r in rs])} "
            f"| {_med_max([r['first_after_rarp_s'] for r in rs])} "
            f"| {_med_max([r['rarp_on_tap_s'] for r in rs])} "
            f"| {_med_max([r['rarp_out_s'] for r in rs])} "
            f"| {_med_max(delays)} | {_med_max(true_delays)} | {bounded} "
            f"| {sum(r['duplicates'] for r in rs)} |"
        )
    return lines


def loss_ratio(runs: list[dict]) -> str:
    medians = {}
    for case in CASES:
        lost = [r["lost"] for r in runs if r["case"] == case and r["state"] == "completed"]
        if lost:
            medians[case] = statistics.median(lost)
    if len(medians) < 2:
        return "n/a (a case has no completed run)"
    off, on = medians["offloaded"], medians["onloaded"]
    return "n/a (no loss in either)" if on == 0 and off == 0 else f"{off / max(on, 1):.2f}"


def beyond_difference(runs: list[dict]) -> str:
    """The comparison the pause does not blur: loss minus what QEMU's downtime
    alone loses at the sender's rate, offloaded minus onloaded (medians)."""
    medians = {}
    for case in CASES:
        beyond = [
            r["gap_packets"] - r["downtime_ms"] * offload_inbound.RATE_IN / 1000
            for r in runs
            if r["case"] == case and r["state"] == "completed" and r["downtime_ms"] is not None
        ]
        if beyond:
            medians[case] = statistics.median(beyond)
    if len(medians) < 2:
        return "n/a"
    return f"{medians['offloaded'] - medians['onloaded']:+.1f}"


def table(runs: list[dict], command: str) -> str:
    out = [r for r in runs if r.get("direction", "outbound") == "outbound"]
    inb = [r for r in runs if r.get("direction") == "inbound"]
    lines = [
        "# Offloaded flows across a live migration (issue 15)",
        "",
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, command:",
        "",
        f"    {command}",
        "",
        "Three-host lab: the VM (192 MiB, dirtier 32 MiB at 500 pages/s) migrates A<->B by "
        "precopy through the agents; its traffic's far ends are endpoints on host C. "
        "Directions and cases interleaved in one run, each case moving A->B and B->A in "
        "turn (tests/bench/offload_migration.py, tests/bench/offload_inbound.py).",
        "",
        f"## Outbound: the VM sends (guest udpgen, {RATE} pps, 64 B, {SECONDS} s, to C)",
        "",
        *outbound_rows(out),
        "",
        f"Loss ratio offloaded / onloaded (medians): {loss_ratio(out)}.",
        "",
        f"## Inbound: C sends to the VM ({offload_inbound.RATE_IN} pps, "
        f"{offload_inbound.SIZE_IN} B, {offload_inbound.SECONDS_IN} s; the guest's udpgen "
        "counts)",
        "",
        *inbound_rows(inb),
        "",
        f"Loss ratio offloaded / onloaded (medians): {loss_ratio(inb)}; packets lost in "
        f"the move's gap beyond its own QEMU downtime at {offload_inbound.RATE_IN} pps, offloaded "
        f"minus onloaded (medians): {beyond_difference(inb)}.",
    ]
    failed = [r for r in runs if r["state"] != "completed"]
    if failed:
        lines += ["", f"Failed runs (not in the tables): {[r['error'] for r in failed]}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per case and direction (1..10)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/offload-migration.md"))
    args = parser.parse_args(argv)
    if not 1 <= args.runs <= 10:
        parser.error("--runs must be 1..10")
    command = ".venv/bin/python -m tests.bench.offload_migration " + (
        " ".join(argv if argv is not None else sys.argv[1:])
    )
    load_before = os.getloadavg()
    lab = Lab()
    lab.down()
    lab.up(3)
    runs: list[dict] = []
    try:
        runs = run_all(lab, args.runs)
    finally:
        lab.down()
    loads = (load_before, os.getloadavg())
    text = table(runs, command.strip())
    text += (
        "\nLoad average (1/5/15 min) before the lab came up and at its end: "
        + "; ".join("/".join(f"{v:.2f}" for v in load) for load in loads)
        + ".\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(runs, indent=1))
    print(text)
    return 0


def round_order(r: int) -> list[tuple[str, str]]:
    """One round's moves.  The VM alternates A->B, B->A, so a fixed order would
    send each case the same way every time (and QEMU's downtime, which decides
    most of the inbound loss, differs by direction): odd rounds swap the cases.

    >>> round_order(0)[2:], round_order(1)[2:]
    ([('inbound', 'offloaded'), ('inbound', 'onloaded')], [('inbound', 'onloaded'), ('inbound', 'offloaded')])
    """  # noqa: E501
    cases = ("offloaded", "onloaded") if r % 2 == 0 else ("onloaded", "offloaded")
    return [(d, c) for d in ("outbound", "inbound") for c in cases]


def run_all(lab: Lab, rounds: int) -> list[dict]:
    """Rounds of (outbound, inbound) x (offloaded, onloaded), the VM moving each time."""
    services = {h: offload.LabOffload(lab.host(h)) for h in ("A", "B")}
    for service in services.values():
        service.start(OFFLOAD_POLICY)
    receiver = endpoints.add(lab, "C", "r1")
    sender = endpoints.add(lab, "C", "s1")
    guest = vm.create(
        lab, "A", ram="192M", workload="dirtier:wss=32M,rate=500",
        memory_backing="anonymous", name="benchvm",
    )  # fmt: skip
    runs: list[dict] = []
    order = [(d, c) for r in range(rounds) for d, c in round_order(r)]
    for i, (direction, case) in enumerate(order):
        to = "B" if guest.locate() == "A" else "A"
        if direction == "outbound":
            run = one_run(lab, services, receiver, guest, case, 42000 + i, to)
        else:
            set_policy(services, CASES[case], RULES[case])
            run = offload_inbound.run_inbound(lab, services, sender, guest, case, 43000 + i, to)
        print(json.dumps(run), flush=True)
        runs.append(run)
    return runs


if __name__ == "__main__":
    sys.exit(main())
