"""Correcting a running precopy when the stream is slower than the plan assumed.

A plan is made from a bandwidth estimate; the stream the migration really
gets can be far slower (a busy host, a destination writing a split VM's pages
back to its store under a memory cap).  Then the decision's downtime limit
may never be met and precopy iterates for ever.  Seed 000's precopy has the
answer built in: after its caps (30 rounds, 3x the VM's pages sent) it stops
and copies what is left during downtime.  Here, in order:

1. while the remainder fits the current limit at the observed rate, nothing;
2. once the plan's rounds are past (two rounds of slack) or a cap is reached:
   switch to postcopy where the plan enabled it;
3. else raise the downtime limit to the full budget (the plan may have chosen
   a tighter one on the faster estimate);
4. at a cap with the budget already in force, stop and copy: pause the guest
   so the remainder moves while it is stopped, as seed 000 does.

Seed 000's caps count rounds and bytes, which assume the stream runs near its
planned rate.  A stream that trickles at about the guest's dirty rate (the
lab's split destination, faulting re-sent pages back from its store at the
cap, moved 3-20 MiB/s against a guest dirtying ~8 MiB/s) reaches neither in
minutes: its rounds grow longer instead of more numerous.  So being behind
for ``converge_timeout`` is a cap too, counted from when the correction
engaged rather than from the raised limit taking effect: the lab's libvirt
once never returned from raising it.
"""

from __future__ import annotations

import dataclasses
import math

from flexmig.policy.precopy import MAX_ROUNDS, MAX_TOTAL_FACTOR

ROUNDS_OF_SLACK = 2


@dataclasses.dataclass(frozen=True)
class Progress:
    """What libvirt reports about a running migration (its job statistics)."""

    iteration: int  # memory_iteration: dirty-bitmap syncs so far
    processed_bytes: int
    remaining_bytes: int
    ram_bytes: int
    bandwidth_bps: float  # memory_bps, the stream's observed rate

    def expected_downtime_ms(self) -> float:
        if self.remaining_bytes <= 0:
            return 0.0
        if self.bandwidth_bps <= 0:
            return math.inf
        return self.remaining_bytes / self.bandwidth_bps * 1000


@dataclasses.dataclass(frozen=True)
class Adjustment:
    action: str  # none | switch_postcopy | raise_downtime | stop_and_copy
    downtime_ms: int | None = None
    reason: str = ""


NONE = Adjustment("none")


def _capped(progress: Progress) -> bool:
    return (
        progress.iteration > MAX_ROUNDS
        or progress.processed_bytes > MAX_TOTAL_FACTOR * progress.ram_bytes
    )


def behind(progress: Progress, planned_rounds: int, limit_ms: int) -> bool:
    """Whether the remainder does not fit the limit once the plan's rounds (and slack)
    are past or a cap is reached: from then on the correction acts.

    >>> p = Progress(iteration=8, processed_bytes=0, remaining_bytes=4 << 20,
    ...              ram_bytes=512 << 20, bandwidth_bps=10 << 20)
    >>> behind(p, 4, 300), behind(p, 6, 300), behind(p, 4, 500)
    (True, False, False)
    """
    if progress.expected_downtime_ms() <= limit_ms:
        return False
    return _capped(progress) or progress.iteration > planned_rounds + ROUNDS_OF_SLACK


def adjust(
    progress: Progress,
    planned_rounds: int,
    limit_ms: int,
    budget_ms: int,
    postcopy_enabled: bool,
    correcting_s: float = 0.0,
    converge_timeout_s: float = math.inf,
) -> Adjustment:
    """What to change in a running precopy, given its progress.

    ``correcting_s``: how long the precopy has been ``behind`` (the correction engaged).

    >>> slow = Progress(iteration=8, processed_bytes=600 << 20, remaining_bytes=4 << 20,
    ...                 ram_bytes=512 << 20, bandwidth_bps=10 << 20)
    >>> adjust(slow, planned_rounds=4, limit_ms=20, budget_ms=300, postcopy_enabled=False).action
    'raise_downtime'
    >>> adjust(slow, planned_rounds=4, limit_ms=20, budget_ms=300, postcopy_enabled=True).action
    'switch_postcopy'
    >>> capped = dataclasses.replace(slow, iteration=31)
    >>> adjust(capped, planned_rounds=4, limit_ms=300, budget_ms=300,
    ...        postcopy_enabled=False).action
    'stop_and_copy'
    >>> adjust(dataclasses.replace(slow, iteration=3), 4, 20, 300, False).action
    'none'
    >>> adjust(slow, 4, 20, 300, False, correcting_s=31, converge_timeout_s=30).action
    'stop_and_copy'
    """
    if not behind(progress, planned_rounds, limit_ms):
        return NONE
    capped = _capped(progress)
    expected = progress.expected_downtime_ms()
    where = (
        f"round {progress.iteration - 1}: {progress.remaining_bytes / 2**20:.1f} MiB left at "
        f"{progress.bandwidth_bps / 2**20:.1f} MiB/s needs ~{expected:.0f} ms of downtime, "
        f"over the {limit_ms} ms limit"
    )
    if postcopy_enabled:
        return Adjustment("switch_postcopy", reason=f"{where}: switching to postcopy")
    overdue = correcting_s > converge_timeout_s
    if limit_ms < budget_ms and not overdue:
        return Adjustment(
            "raise_downtime",
            downtime_ms=budget_ms,
            reason=f"{where}: the stream is slower than planned, raising it to the "
            f"{budget_ms} ms budget",
        )
    stop = "pausing the guest so the rest moves while it is stopped (seed 000's stop-and-copy)"
    if capped:
        return Adjustment(
            "stop_and_copy",
            reason=f"{where}, and precopy's caps ({MAX_ROUNDS} rounds or "
            f"{MAX_TOTAL_FACTOR:g}x RAM) are reached: {stop}",
        )
    if overdue:
        return Adjustment(
            "stop_and_copy",
            reason=f"{where}, {correcting_s:.0f} s after the correction engaged "
            f"(converge_timeout {converge_timeout_s:g} s): {stop}",
        )
    return NONE
