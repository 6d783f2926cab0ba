"""Guest-observed downtime from the heartbeat record: pure analysis.

The recorder writes one line per heartbeat: ``<host_ns> <host> <counter>
<guest_ns>``, stamped with the host's monotonic clock on arrival.  The longest
gap between consecutive heartbeats is the downtime the guest's users saw.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

PERIOD_NS = 10_000_000  # the guest writes every 10 ms


@dataclasses.dataclass(frozen=True)
class Beat:
    host_ns: int
    host: str
    counter: int


@dataclasses.dataclass(frozen=True)
class GapReport:
    beats: int
    longest_gap_ms: float
    gap_start_ns: int  # host time of the beat before the longest gap
    hosts: tuple[str, ...]  # hosts in the order beats came from them
    last_host: str | None
    switchover_gap_ms: float = 0.0  # longest gap across a change of host

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def parse(lines: Iterable[str]) -> list[Beat]:
    beats = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and parts[0].isdigit() and parts[2].isdigit():
            beats.append(Beat(host_ns=int(parts[0]), host=parts[1], counter=int(parts[2])))
    return beats


def analyse(beats: list[Beat], *, since_ns: int = 0, until_ns: int | None = None) -> GapReport:
    """Longest gap between consecutive beats within [since_ns, until_ns].

    >>> b = [Beat(0, "A", 0), Beat(10_000_000, "A", 1), Beat(250_000_000, "B", 2)]
    >>> r = analyse(b)
    >>> r.longest_gap_ms, r.hosts, r.last_host, r.switchover_gap_ms
    (240.0, ('A', 'B'), 'B', 240.0)
    """
    window = [
        b for b in beats if b.host_ns >= since_ns and (until_ns is None or b.host_ns <= until_ns)
    ]
    window.sort(key=lambda b: b.counter)
    longest, start, switchover = 0, 0, 0
    hosts: list[str] = []
    for prev, cur in itertools.pairwise(window):
        gap = cur.host_ns - prev.host_ns
        if gap > longest:
            longest, start = gap, prev.host_ns
        if cur.host != prev.host:
            switchover = max(switchover, gap)
    for beat in window:
        if not hosts or hosts[-1] != beat.host:
            hosts.append(beat.host)
    return GapReport(
        beats=len(window),
        longest_gap_ms=longest / 1e6,
        gap_start_ns=start,
        hosts=tuple(hosts),
        last_host=window[-1].host if window else None,
        switchover_gap_ms=switchover / 1e6,
    )
