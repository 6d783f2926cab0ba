"""The benchmark's exact softirq clock (tests/bench/softirq_time.py) on the real kernel."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from flexmig import exceptions
from tests.bench.softirq_time import SLOT_OTHER_NS, SoftirqClock, require_tracepoints

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="attaching BPF tracepoints needs root")


@pytest.fixture(autouse=True)
def tracepoints() -> None:
    """Mounts tracefs where the machine has none; skips, naming it, where it cannot."""
    try:
        require_tracepoints()
    except exceptions.MissingPrerequisite as missing:
        pytest.skip(str(missing))


def _flood_loopback(packets: int) -> float:
    start = time.monotonic()
    subprocess.run(
        ["ping", "-f", "-q", "-c", str(packets), "127.0.0.1"], check=True, capture_output=True
    )
    return time.monotonic() - start


def test_loopback_traffic_is_timed_as_network_softirq() -> None:
    with SoftirqClock() as clock:
        net0, other0 = clock.seconds(), clock.seconds(SLOT_OTHER_NS)
        wall = _flood_loopback(20000)
        net = clock.seconds() - net0
        other = clock.seconds(SLOT_OTHER_NS) - other0
    # 40k loopback packets are received in NET_RX: far more than a µs each,
    # and never more than every CPU busy for the whole flood.
    assert 0.005 < net < wall * os.cpu_count()
    assert other < net


def _attached_programs() -> int:
    out = subprocess.run(
        ["bpftool", "-j", "prog", "show"], check=True, capture_output=True, text=True
    ).stdout
    return sum(p.get("name") in ("softirq_entry", "softirq_exit") for p in json.loads(out))


def test_the_clock_detaches_when_closed() -> None:
    before = _attached_programs()
    with SoftirqClock():
        assert _attached_programs() == before + 2
    assert _attached_programs() == before
