"""What a guest notices of its move when a drain runs several at once on shared CPUs. Pure.

The engine's forecast (``flexmig.migration.downtime``) is for one migration
on a host with CPU to spare.  A drain is not that: while c migrations run,
every one of them is a QEMU migration thread on the source (and an incoming
QEMU on a destination) competing with the guests' own vCPUs for the cores.
The parts of the guest's gap that are CPU work — QEMU's device state and
switchover, libvirt's finish and the guest's resume — stretch by how
oversubscribed the CPUs are; the parts that wait for the link (the last
dirty pages, postcopy's first faults) do not.  And whatever the migration
does, a guest never notices less than the gaps the machine already gives it
with no migration at all (``floor_ms``, measured: a guest's longest
heartbeat gap over a comparable window).

    guest gap(c) = max(floor, link parts + stretch(c) x CPU parts)
    stretch(c)   = max(1, (busy guests + 2 c) / CPUs)

(two threads per stream: the source's migration thread and the
destination's incoming QEMU; a lab's hosts share one machine's cores.)
"""

from __future__ import annotations

import dataclasses

from flexmig.migration.downtime import LEARNT_QEMU_SIDE, LEARNT_SWITCHOVER, Forecast

# A TCG guest's "first run" (translating its code again) is CPU work too, yet
# counted as is: drain.md's gaps under a 5.5x stretch of the two parts below
# (406-555 ms for idle guests, predicted 469) leave no room for a stretched 70 ms.
# A QEMU side learnt whole holds a usual final round's copy beside the
# switchover: stretched whole, as that copy is small beside it (1-18 ms
# forecast against 20-40 ms downtimes, docs/benchmarks/split-first-run.md).
CPU_PARTS = ("device state", "finish and resume", LEARNT_SWITCHOVER, LEARNT_QEMU_SIDE)
THREADS_PER_STREAM = 2
# A guest dirtying fewer pages a second than this is idle: its vCPU sleeps.
BUSY_PAGES_PER_S = 100.0


@dataclasses.dataclass(frozen=True)
class HostLoad:
    """The CPUs the drain's guests and migrations share, and the gaps they cost alone."""

    cpus: int
    busy_guests: int
    floor_ms: float = 0.0

    def stretch(self, streams: int) -> float:
        """How much longer CPU work takes with ``streams`` migrations running.

        >>> HostLoad(cpus=2, busy_guests=4).stretch(1), HostLoad(2, 4).stretch(2)
        (3.0, 4.0)
        >>> HostLoad(cpus=32, busy_guests=4).stretch(4)
        1.0
        """
        runnable = self.busy_guests + THREADS_PER_STREAM * streams
        return max(1.0, runnable / max(1, self.cpus))


def guest_gap_ms(forecast: Forecast, load: HostLoad | None, streams: int) -> float:
    """The gap the guest is predicted to notice with ``streams`` migrations at once.

    >>> f = Forecast({"stop-and-copy": 10.0, "device state": 50.0,
    ...               "finish and resume": 35.0, "postcopy faults": 0.0})
    >>> guest_gap_ms(f, None, 4)
    95.0
    >>> guest_gap_ms(f, HostLoad(cpus=2, busy_guests=4), 2)
    350.0
    >>> guest_gap_ms(f, HostLoad(cpus=2, busy_guests=4, floor_ms=420.0), 1)
    420.0
    """
    if load is None:
        return forecast.total_ms
    cpu = sum(v for k, v in forecast.parts_ms.items() if k in CPU_PARTS)
    link = forecast.total_ms - cpu
    return round(max(load.floor_ms, link + load.stretch(streams) * cpu), 1)


def miss_reason(
    forecast: Forecast, load: HostLoad | None, streams: int, budget_ms: int
) -> str | None:
    """Why this VM will miss its budget at ``streams`` at once, or None if it will not.

    >>> f = Forecast({"device state": 50.0, "finish and resume": 35.0})
    >>> miss_reason(f, HostLoad(2, 4, floor_ms=420.0), 1, 300)
    'the machine alone gives this guest 420 ms gaps with no migration (floor), over its 300 ms \
budget whatever the plan'
    >>> miss_reason(f, HostLoad(2, 6), 1, 300)
    'predicted 340 ms even alone (device state and resume stretched 4.0x: 6 busy guests and \
2 migration threads on 2 CPUs), over its 300 ms budget'
    >>> miss_reason(f, HostLoad(2, 6), 2, 300)
    'predicted 425 ms at 2 at once (device state and resume stretched 5.0x: 6 busy guests and \
4 migration threads on 2 CPUs), ~340 ms alone, over its 300 ms budget'
    >>> miss_reason(f, HostLoad(2, 2), 1, 300) is None
    True
    """
    gap = guest_gap_ms(forecast, load, streams)
    if gap <= budget_ms:
        return None
    if load is not None and load.floor_ms > budget_ms:
        return (
            f"the machine alone gives this guest {load.floor_ms:.0f} ms gaps with no migration "
            f"(floor), over its {budget_ms} ms budget whatever the plan"
        )
    if load is None:
        return f"predicted {gap:.0f} ms, over its {budget_ms} ms budget"
    alone = "" if streams == 1 else f", ~{guest_gap_ms(forecast, load, 1):.0f} ms alone"
    return (
        f"predicted {gap:.0f} ms {'even alone' if streams == 1 else f'at {streams} at once'} "
        f"(device state and resume stretched {load.stretch(streams):.1f}x: {load.busy_guests} "
        f"busy guests and {THREADS_PER_STREAM * streams} migration threads on {load.cpus} "
        f"CPUs){alone}, over its {budget_ms} ms budget"
    )


def busy(initial_rates: list[float]) -> int:
    """How many guests keep a vCPU busy, from their dirty models' initial rates (pages/s).

    >>> busy([0.0, 30000.0, 2000.0, 50.0])
    2
    """
    return sum(1 for rate in initial_rates if rate > BUSY_PAGES_PER_S)


def host_load(initial_rates: list[float], cpus: int, floor_ms: float) -> HostLoad | None:
    """The contention a drain plans with: ``cpus`` shared (0: not modelled, None).

    >>> host_load([0.0, 30000.0], 2, 250.0)
    HostLoad(cpus=2, busy_guests=1, floor_ms=250.0)
    >>> host_load([30000.0], 0, 0.0) is None
    True
    """
    if cpus <= 0:
        return None
    return HostLoad(cpus, busy(initial_rates), floor_ms)
