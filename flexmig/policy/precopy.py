"""Round-by-round prediction of precopy and of hybrid postcopy.

Precopy sends every page once, then in each round the pages dirtied during the
previous one, until what is left fits the downtime budget (QEMU's own stop
rule: remaining bytes <= bandwidth * max downtime) or a cap says it never will:
a round cap and a cap on total bytes sent (seed 000: 30 rounds, 3x the VM).
Zero pages cost next to nothing on the wire, so round one carries the
resident (ever-touched) pages, not the whole of RAM.
"""

from __future__ import annotations

import dataclasses

from flexmig.policy.dirty_model import DirtyModel

MAX_ROUNDS = 30
MAX_TOTAL_FACTOR = 3.0
# Pages left that are not worth another round even with no downtime budget.
MIN_REMAINING_PAGES = 50


@dataclasses.dataclass(frozen=True)
class Transfer:
    """What moves and how fast: the inputs every prediction shares."""

    ram_pages: int
    resident_pages: int
    page_size: int
    bandwidth_bps: float  # bytes/s the migration stream achieves
    switchover_s: float  # fixed cost of stopping, device state and resuming
    # Fixed cost of every round (the dirty-bitmap sync over all of RAM; seed
    # 000 measured 2.5 ms over TCP).
    round_overhead_s: float = 0.0
    # Fixed cost before the first page moves (destination QEMU start, hooks).
    setup_s: float = 0.0

    def seconds(self, pages: float) -> float:
        return pages * self.page_size / self.bandwidth_bps

    def round_seconds(self, pages: float) -> float:
        return self.seconds(pages) + self.round_overhead_s


@dataclasses.dataclass(frozen=True)
class Round:
    index: int
    pages: int
    duration_s: float


@dataclasses.dataclass(frozen=True)
class Prediction:
    mode: str
    rounds: tuple[Round, ...]
    converged: bool
    stop_reason: str
    total_time_s: float
    total_bytes: int
    downtime_s: float
    remaining_pages: int  # pages still dirty at stop (moved during downtime or postcopy)

    def summary(self) -> str:
        return (
            f"{self.mode}: {len(self.rounds)} round(s), {self.total_time_s:.2f} s total, "
            f"{self.downtime_s * 1000:.0f} ms downtime, "
            f"{self.total_bytes / 2**20:.0f} MiB sent"
        )


def simulate_precopy(
    model: DirtyModel,
    xfer: Transfer,
    max_downtime_s: float,
    max_rounds: int = MAX_ROUNDS,
    max_total_factor: float = MAX_TOTAL_FACTOR,
) -> Prediction:
    """Predict precopy round by round under the stop conditions.

    >>> x = Transfer(ram_pages=1000, resident_pages=1000, page_size=4096,
    ...              bandwidth_bps=4096 * 1000, switchover_s=0.0)
    >>> p = simulate_precopy(DirtyModel(m_pages=400, tau_s=1.0), x, max_downtime_s=0.01)
    >>> [r.pages for r in p.rounds], p.converged, round(p.downtime_s * 1000)
    ([1000, 200, 52], True, 14)
    """
    budget_pages = max(max_downtime_s * xfer.bandwidth_bps / xfer.page_size, MIN_REMAINING_PAGES)
    cap_pages = max_total_factor * xfer.ram_pages
    rounds: list[Round] = []
    to_send, sent, elapsed = float(xfer.resident_pages), 0.0, 0.0
    reason, converged = "", False
    while True:
        duration = xfer.round_seconds(to_send)
        rounds.append(Round(len(rounds) + 1, round(to_send), duration))
        sent += to_send
        elapsed += duration
        dirty = model.pages(duration)
        if dirty <= budget_pages:
            converged, reason = True, "remaining pages fit the downtime budget"
        elif len(rounds) >= max_rounds:
            reason = f"round cap ({max_rounds}) reached"
        elif sent + dirty > cap_pages:
            reason = f"byte cap ({max_total_factor:g}x RAM) reached"
        if reason:
            break
        to_send = dirty
    downtime = xfer.seconds(dirty) + xfer.switchover_s
    return Prediction(
        mode="precopy",
        rounds=tuple(rounds),
        converged=converged,
        stop_reason=reason,
        total_time_s=xfer.setup_s + elapsed + downtime,
        total_bytes=round((sent + dirty) * xfer.page_size),
        downtime_s=downtime,
        remaining_pages=round(dirty) if not converged else 0,
    )


def best_switch_round(model: DirtyModel, xfer: Transfer, max_rounds: int = 5) -> int:
    """The precopy round after which hybrid switches to postcopy.

    More precopy rounds pay off only while each leaves fewer dirty pages than
    the last; switch after the round that leaves the fewest (earliest on ties).
    """
    best, best_left = 1, model.pages(xfer.round_seconds(xfer.resident_pages))
    to_send = best_left
    for index in range(2, max_rounds + 1):
        left = model.pages(xfer.round_seconds(to_send))
        if left < 0.5 * best_left:
            best, best_left = index, left
        to_send = left
    return best


def simulate_hybrid(model: DirtyModel, xfer: Transfer, switch_after: int) -> Prediction:
    """Precopy for ``switch_after`` rounds, then postcopy pulls what is left.

    Downtime is the switchover alone: the guest resumes on the destination and
    the remaining pages follow (on demand and in the background).
    """
    rounds: list[Round] = []
    to_send, sent, elapsed = float(xfer.resident_pages), 0.0, 0.0
    for index in range(1, switch_after + 1):
        duration = xfer.round_seconds(to_send)
        rounds.append(Round(index, round(to_send), duration))
        sent += to_send
        elapsed += duration
        to_send = model.pages(duration)
    postcopy_s = xfer.seconds(to_send)
    return Prediction(
        mode="postcopy",
        rounds=tuple(rounds),
        converged=True,
        stop_reason=f"switch to postcopy after round {switch_after}",
        total_time_s=xfer.setup_s + elapsed + xfer.switchover_s + postcopy_s,
        total_bytes=round((sent + to_send) * xfer.page_size),
        downtime_s=xfer.switchover_s,
        remaining_pages=round(to_send),
    )


DOWNTIME_LADDER_MS = (20, 30, 50, 75, 100, 150, 200, 300, 500, 1000, 2000, 5000)
# How much longer a tighter downtime limit may make the whole migration.
TIGHTER_DOWNTIME_SLACK = 1.10


def tightest_downtime(model: DirtyModel, xfer: Transfer, budget_ms: int) -> tuple[int, Prediction]:
    """The smallest downtime limit that still converges at little extra total time.

    The budget is what users tolerate, not what they want: a converging
    precopy stopped as soon as the remainder fits the budget pauses the guest
    longer than one run a few short rounds more.

    >>> x = Transfer(ram_pages=1000, resident_pages=1000, page_size=4096,
    ...              bandwidth_bps=4096 * 1000, switchover_s=0.0)
    >>> tightest_downtime(DirtyModel(m_pages=400, tau_s=1.0), x, 300)[0]
    20
    """
    full = simulate_precopy(model, xfer, budget_ms / 1000)
    if not full.converged:
        return budget_ms, full
    for limit in (ms for ms in DOWNTIME_LADDER_MS if ms < budget_ms):
        pred = simulate_precopy(model, xfer, limit / 1000)
        if pred.converged and pred.total_time_s <= full.total_time_s * TIGHTER_DOWNTIME_SLACK:
            return limit, pred
    return budget_ms, full
