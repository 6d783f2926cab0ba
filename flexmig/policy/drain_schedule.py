"""When each migration of a drain starts and ends, with streams sharing one link.

A drain's migrations all leave the same host, so they share its uplink: with
n streams moving pages at once each gets ``link / n`` (TCP shares fairly), and
never more than one stream achieves alone (under TCG, QEMU's migration thread
is CPU-bound well below a fast link).  Each migration is a fixed part that
uses no bandwidth (the agent's preparation, libvirt's setup, the switchover)
followed by its bytes.  The simulation is a fluid one: between two events
(a start, the end of a fixed part, an end) every stream moves at its share.

Two constraints shape the order: a *solo* migration runs with the link to
itself (its precopy converges only at full bandwidth), and a migration may
wait for others (a split VM takes what RAM its destination has left, so it
starts once every whole VM bound there has landed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from flexmig import exceptions

# Below this many bytes (or seconds) a phase counts as finished: float residue
# of the fluid steps must never create an extra event.
_EPSILON = 1e-9


@dataclasses.dataclass(frozen=True)
class Work:
    """One migration as the schedule sees it."""

    name: str
    fixed_s: float  # time that needs no bandwidth (setup, switchover)
    bytes: float  # what the stream carries
    solo: bool = False
    after: tuple[str, ...] = ()  # start only once these have ended


@dataclasses.dataclass(frozen=True)
class Slot:
    name: str
    start_s: float
    end_s: float
    peak_streams: int  # most streams sharing the link while it moved pages


def share_bps(link_bps: float, stream_bps: float, streams: int) -> float:
    """What each of ``streams`` concurrent streams gets.

    >>> share_bps(100.0, 60.0, 1), share_bps(100.0, 60.0, 2), share_bps(100.0, 60.0, 4)
    (60.0, 50.0, 25.0)
    """
    return min(stream_bps, link_bps / max(1, streams))


@dataclasses.dataclass
class _Running:
    work: Work
    start_s: float
    fixed_left: float
    bytes_left: float
    peak: int = 0


def _eligible(work: Work, running: dict[str, _Running], done: set[str]) -> bool:
    if any(r.work.solo for r in running.values()):
        return False
    if work.solo and running:
        return False
    return all(name in done for name in work.after)


def _start_ready(
    pending: list[Work], running: dict[str, _Running], done: set[str], limit: int, now: float
) -> None:
    """Start, in list order, what may start now (list scheduling: no look-ahead)."""
    index = 0
    while index < len(pending) and len(running) < limit:
        work = pending[index]
        if _eligible(work, running, done):
            running[work.name] = _Running(work, now, work.fixed_s, work.bytes)
            pending.pop(index)
            continue
        if work.solo:
            return  # a solo migration holds its place: nothing behind it jumps ahead
        index += 1


def _step(running: dict[str, _Running], link_bps: float, stream_bps: float) -> float:
    """Time to the next event, with every stream at its current share."""
    moving = [r for r in running.values() if r.fixed_left <= _EPSILON]
    rate = share_bps(link_bps, stream_bps, len(moving))
    for r in moving:
        r.peak = max(r.peak, len(moving))
    return min(
        r.fixed_left if r.fixed_left > _EPSILON else r.bytes_left / rate for r in running.values()
    )


def _advance(running: dict[str, _Running], dt: float, link_bps: float, stream_bps: float) -> None:
    moving = [r for r in running.values() if r.fixed_left <= _EPSILON]
    rate = share_bps(link_bps, stream_bps, len(moving))
    for r in running.values():
        if r.fixed_left > _EPSILON:
            r.fixed_left -= dt
        else:
            r.bytes_left -= dt * rate


def simulate(
    works: Sequence[Work], concurrency: int, link_bps: float, stream_bps: float
) -> list[Slot]:
    """Start and end of every migration, run in list order, ``concurrency`` at once.

    Three 100 MB migrations on a 100 MB/s link that one stream fills alone:
    one at a time they take 3 x (1 s fixed + 1 s of pages); three at once
    overlap the fixed parts, and the link is the limit.

    >>> ws = [Work(n, fixed_s=1.0, bytes=100e6) for n in "abc"]
    >>> [round(s.end_s, 2) for s in simulate(ws, 1, 100e6, 100e6)]
    [2.0, 4.0, 6.0]
    >>> [round(s.end_s, 2) for s in simulate(ws, 3, 100e6, 100e6)]
    [4.0, 4.0, 4.0]

    When one stream cannot fill the link (here 40 of 100 MB/s), concurrency
    also adds bandwidth:

    >>> [round(s.end_s, 2) for s in simulate(ws, 1, 100e6, 40e6)]
    [3.5, 7.0, 10.5]
    >>> max(round(s.end_s, 2) for s in simulate(ws, 3, 100e6, 40e6))
    4.0
    """
    if concurrency < 1 or link_bps <= 0 or stream_bps <= 0:
        raise exceptions.InvalidInput(
            what="drain schedule", reason="concurrency and bandwidths must be positive"
        )
    names = {w.name for w in works}
    missing = {a for w in works for a in w.after} - names
    if missing:
        raise exceptions.InvalidInput(
            what="drain schedule", reason=f"waits for unknown migration(s) {sorted(missing)}"
        )
    pending, running = list(works), {}
    done: set[str] = set()
    slots: dict[str, Slot] = {}
    now = 0.0
    while pending or running:
        _start_ready(pending, running, done, concurrency, now)
        if not running:
            raise exceptions.InvalidInput(
                what="drain schedule",
                reason=f"{[w.name for w in pending]} wait for each other",
            )
        dt = max(0.0, _step(running, link_bps, stream_bps))
        _advance(running, dt, link_bps, stream_bps)
        now += dt
        for name, r in list(running.items()):
            if r.fixed_left <= _EPSILON and r.bytes_left <= _EPSILON * max(1.0, r.work.bytes):
                slots[name] = Slot(name, r.start_s, now, r.peak)
                done.add(name)
                del running[name]
    return [slots[w.name] for w in works]


def makespan(slots: Sequence[Slot]) -> float:
    return max((s.end_s for s in slots), default=0.0)
