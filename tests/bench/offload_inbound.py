"""Traffic INTO a migrating VM: loss during the move and network convergence.

The other direction of ``tests.bench.offload_migration``.  A sender on a lab
host the VM never lives on (an endpoint on host C) sends a paced, numbered,
time-stamped UDP flow to the VM; the guest's own ``udpgen recv`` counts it and
its report comes back through the guest's control channel.  While the VM
moves A <-> B, the destination host's namespace is watched for the VM's
announcements (QEMU's RARP frames: on the VM's tap as QEMU sends them, and
leaving the destination's bridge by its uplink towards the fabric).

Why inbound packets are lost, in order: (1) while the VM is paused for
switchover the source's tap takes packets nobody reads; (2) after the VM
resumes on the destination, the fabric still sends its MAC to the source host
until an announcement has crossed it; the source's bridge no longer has the
VM's port and floods them in vain.  (1) is QEMU's downtime; (2) is
convergence, the part a vSwitch and its offload can make worse: a fast path on
the destination that dropped or misdirected the first packets of a flow it had
not judged yet, or one on the source that still steered the flow to a port
that is gone.  Both are measured per run from the sender's own stamps:

- ``lost``: numbers that never arrived (the guest's sink, per packet);
- ``gap_packets``: those lost in the move's own gap (the one straddling QEMU's
  resume; ``other_lost``: any elsewhere, e.g. a stalled sender's burst dropped by
  its own host's vSwitch, which happens in either case on a loaded machine);
- ``outage_ms``: send time of the first datagram delivered after that gap minus
  that of the last one before it (sender clock = every namespace's);
- ``first_after_resume_s``: that first delivered datagram's send time minus the
  moment the destination's agent saw the VM run (it polls every 100 ms, so
  this may be negative by up to that much);
- ``first_after_rarp_s``: the same against QEMU's first RARP on the
  destination's tap, the true start of convergence;
- ``rarp_on_tap_s`` / ``rarp_out_s``: QEMU's first announcement on the tap and
  the first one leaving the destination's bridge, against the agent's resume.
"""

from __future__ import annotations

import time
from typing import Any

from flexmig import migrate_cli, processutil
from flexmig_lab import announce, endpoints, offload, topology, traffic, vm

PORT_IN = 7002
RATE_IN = 1000  # pps: 1 ms per lost packet; a TCG guest's sink keeps up on a loaded machine
SECONDS_IN = 20
SIZE_IN = 1000  # bytes of UDP payload: 8 Mbit/s, one elephant flow
IDLE_MS = 5000  # the sink ends this long after the last datagram (longer than any gap here)


def inbound_flow(status: dict, sport: int, owner: str) -> dict | None:
    """The flow from the fabric to the VM on one host (enters by the uplink)."""
    for flow in status["flows"]:
        m = flow["match"]
        if (
            (m["tp_src"], m["tp_dst"]) == (sport, PORT_IN)
            and m["in_port"] == topology.HOST_TENANT_IF
            and flow["owner"] == owner
        ):
            return flow
    return None


def wait_inbound(service: offload.LabOffload, sport: int, owner: str, state: str) -> dict:
    def probe() -> dict | None:
        flow = inbound_flow(service.status(), sport, owner)
        return flow if flow is not None and flow["state"] == state else None

    return processutil.wait_for(
        probe, timeout=15, interval=0.1, what=f"the inbound flow {state} on {service.host.name}"
    )


def start_inbound(guest: vm.LabVM, sender: endpoints.Endpoint, sport: int, seconds: int):
    """The guest's sink, then the sender on the third host; returns the sender."""
    tag = f"in{sport}"
    guest.udpgen_start(
        tag,
        ["recv", "--port", str(PORT_IN), "--duration", str(seconds + 90),
         "--idle-ms", str(IDLE_MS)],
    )  # fmt: skip
    guest.udpgen_listening(tag)
    return traffic.Sender(
        endpoints.exec_prefix(sender), guest.spec.tenant_ip, PORT_IN, sport=sport,
        count=RATE_IN * seconds, rate=RATE_IN, size=SIZE_IN,
    )  # fmt: skip


# A datagram sent this close to the resume may still be the first one after it (in
# flight as the announcement lands) or the last one before it.
STRADDLE_NS = 50_000_000


def switchover_jump(jumps: list[dict], resumed_at: float | None) -> dict | None:
    """The gap of the move: the jump whose edges straddle the VM's resume (the
    last datagram before it sent before, the first after it sent after).  Other
    gaps are not the move's: a sender on a busy host that stalls and then catches
    up in a burst can lose the burst in its own vSwitch, in either case.  Without a
    resume time, or with no jump straddling it, the longest one.

    >>> j = [{"gap": 130, "before_ns": 1_00_000_000, "after_ns": 1_10_000_000},
    ...      {"gap": 40, "before_ns": 2_000_000_000, "after_ns": 2_041_000_000}]
    >>> switchover_jump(j, 2.040)["gap"], switchover_jump(j, None)["gap"]
    (40, 130)
    >>> switchover_jump([], 1.0) is None
    True
    """
    if not jumps:
        return None
    longest = max(jumps, key=lambda j: j["gap"])
    if resumed_at is None:
        return longest
    at = resumed_at * 1e9
    straddling = [
        j for j in jumps
        if j["before_ns"] <= at + STRADDLE_NS and j["after_ns"] >= at - STRADDLE_NS
    ]  # fmt: skip
    return max(straddling, key=lambda j: j["gap"]) if straddling else longest


def convergence(
    got: dict, resumed: float | None, frames: list[announce.Frame], mac: str, tap: str
) -> dict[str, Any]:
    """Outage and convergence times of one move (see the module's docstring)."""
    on_tap = out = None
    if resumed is not None:
        # QEMU announces as the VM resumes; the agent sees it run up to a poll later.
        since = resumed - 0.5
        on_tap = announce.first_announcement(frames, mac, since, ifname=tap)
        out = announce.first_announcement(
            frames, mac, since, ifname=topology.HOST_TENANT_IF, outgoing=True
        )
    # QEMU's first announcement is its resume; the agent's view is a poll later.
    jump = switchover_jump(got.get("jumps") or [], on_tap.at if on_tap else resumed)
    after = jump["after_ns"] / 1e9 if jump and jump["after_ns"] else None
    before = jump["before_ns"] / 1e9 if jump and jump["before_ns"] else None

    def rel(t: float | None, to: float | None) -> float | None:
        return round(t - to, 4) if t is not None and to is not None else None

    return {
        "gap_packets": jump["gap"] if jump else 0,  # lost in the move's own gap
        "other_lost": got["missing"] - (jump["gap"] if jump else 0),
        "outage_ms": round((after - before) * 1000, 1) if after and before else None,
        "first_after_resume_s": rel(after, resumed),
        "first_after_rarp_s": rel(after, on_tap.at if on_tap else None),
        "rarp_on_tap_s": rel(on_tap.at if on_tap else None, resumed),
        "rarp_out_s": rel(out.at if out else None, resumed),
        "announcements_out": sum(
            1 for f in frames
            if f.src_mac == mac and f.announces and f.outgoing
            and f.ifname == topology.HOST_TENANT_IF
        ),
    }  # fmt: skip


def run_inbound(
    lab, services, sender: endpoints.Endpoint, guest: vm.LabVM, case: str, sport: int, to: str
) -> dict[str, Any]:
    """One move of the VM with an inbound flow; the run's measurements."""
    frm = "A" if to == "B" else "B"
    tap = guest.spec.port_name
    # Long enough for the move (it starts 2 s in and takes a few seconds), not the whole run.
    capture = announce.AnnounceCapture(lab.host(to).ns.exec_prefix(), SECONDS_IN + 5)
    send = start_inbound(guest, sender, sport, SECONDS_IN)
    try:
        state = "offloaded" if case == "offloaded" else "onloaded"
        before = wait_inbound(services[frm], sport, tap, state)
        time.sleep(2)
        result = migrate_cli.migrate(lab, guest.name, to, mode="precopy", show=False)
        sent = send.result()["sent_packets"]
    finally:
        send.proc.kill()
    got = guest.udpgen_result(f"in{sport}", timeout=IDLE_MS / 1000 + 60)
    frames = capture.frames()
    time.sleep(1.5)  # the destination's last poll and OVS revalidator pass
    after = inbound_flow(services[to].status(), sport, tap)
    left = inbound_flow(services[frm].status(), sport, tap)
    summary = result.get("offload") or {}
    run = {
        "direction": "inbound",
        "sport": sport,
        "case": case,
        "to": to,
        "state": result["state"],
        "error": result["error"],
        "offloaded_before": before["state"] == "offloaded",
        "offloaded_after": after is not None and after["state"] == "offloaded",
        "sent": sent,
        "received": got["received_packets"],
        "lost": sent - got["unique_packets"],
        "missing_runs": got["missing_runs"],
        "duplicates": got["duplicates"],
        "late": got["late"],
        "dest_total": after["packets"] if after else None,
        "source_left_packets": left["packets"] if left else 0,
        "reoffload_delays_s": summary.get("reoffload_delays_s", []),
        "downtime_ms": result.get("downtime_ms"),
        "jumps": got.get("jumps", []),
        **convergence(got, summary.get("resumed_at"), frames, guest.spec.mac, tap),
    }
    # The agent sees the VM run up to a poll after QEMU resumed it (and announced
    # it): the re-offload's delay from that true start, too.
    rarp = run["rarp_on_tap_s"]
    run["reoffload_after_rarp_s"] = [
        round(d - rarp, 4) for d in run["reoffload_delays_s"] if rarp is not None
    ]
    return run
