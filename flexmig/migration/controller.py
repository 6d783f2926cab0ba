"""What to do next in a running migration job, decided from its statistics.

One controller for every path: the agent's executor (``libvirt_job``, over a
libvirt domain) and the Nova driver's (``nova_driver.monitor``, over Nova's
Guest) feed it libvirt's job statistics and carry out the actions it returns:

- the plan's switch to postcopy once its precopy rounds are done;
- the in-flight correction when the stream is slower than planned
  (``flexmig.policy.inflight``: switch, raise the downtime limit, stop and copy,
  the last also ``converge_timeout`` after the correction engaged if the
  remainder still does not fit);
- no switch into a stream that has stopped moving (``SWITCH_NEEDS_MOVE_S``):
  the switch would send the guest's device state into a dead link, and a
  destination that never got it is killed by its libvirt once the peers'
  keepalive expires, leaving the VM paused on the source (fault campaign,
  postcopy/qemu-tcp/cut-30s/switchover); held, the stall watchdog aborts the
  precopy and the VM runs on where it is;
- the stall watchdog: no bytes moved for ``stall_timeout`` interrupts the job
  (the executor aborts a precopy; a postcopy it pauses for recovery where it
  can recover one, and otherwise leaves to libvirt and QEMU).

No I/O here: time is passed in, results of actions are reported back.
"""

from __future__ import annotations

import dataclasses
import math

from flexmig.migration.planner import Plan
from flexmig.policy import inflight

SWITCH = "switch_postcopy"
SET_DOWNTIME = "set_downtime"
PAUSE_GUEST = "pause_guest"  # seed 000's stop-and-copy
INTERRUPT = "interrupt"
HOLD_SWITCH = "hold_switch"  # nothing to carry out: the executor reports it

# A switch needs bytes moved within this long: a cut link stops the counter
# once the socket's buffer is full (a fraction of a second at tens of MiB/s),
# while a moving stream advances it between any two polls.
SWITCH_NEEDS_MOVE_S = 1.0


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # SWITCH | SET_DOWNTIME | PAUSE_GUEST | INTERRUPT | HOLD_SWITCH
    reason: str
    downtime_ms: int | None = None


def plan_says_switch(plan: Plan, stats: dict[str, int]) -> bool:
    """Hybrid: switch once the decision's precopy rounds are done.

    libvirt's memory_iteration counts dirty-bitmap syncs: it reads k+1 while
    round k+1 runs, i.e. once k full rounds are done.
    """
    decision = plan.decision
    if decision.transfer != "postcopy" or decision.postcopy_after_round is None:
        return False
    return stats.get("memory_iteration", 0) > decision.postcopy_after_round


class Controller:
    """One job's watch state; ``recovers_postcopy``: the executor can pause and resume it."""

    def __init__(
        self,
        plan: Plan,
        stall_timeout_s: float,
        recovers_postcopy: bool,
        setup_timeout_s: float | None = None,
        converge_timeout_s: float = math.inf,
    ) -> None:
        self.plan = plan
        self.stall_timeout_s = stall_timeout_s
        # Before the first page moves libvirt starts the destination QEMU:
        # seconds on a busy host, which is no stall.
        self.setup_timeout_s = setup_timeout_s or stall_timeout_s
        self.recovers_postcopy = recovers_postcopy
        self.converge_timeout_s = converge_timeout_s
        self.limit_ms = plan.decision.max_downtime_ms
        self.budget_ms = max(plan.downtime_budget_ms, plan.decision.max_downtime_ms)
        self._correcting_since: float | None = None  # when the correction engaged
        self.switched = False
        self.stopped = False  # the guest is paused for stop-and-copy
        self._last_processed = -1
        self._last_move: float | None = None
        self._held_since_move: float | None = None  # the move a held switch waits past

    def on_stats(self, stats: dict[str, int], now: float) -> list[Action]:
        """Actions for one poll; ``stats`` empty when libvirt gave none (no progress either)."""
        actions = []
        if stats:
            processed = stats.get("memory_processed", 0)
            if processed != self._last_processed:
                self._last_processed, self._last_move = processed, now
            if not self.switched and plan_says_switch(self.plan, stats):
                round_done = stats.get("memory_iteration", 0) - 1
                actions.append(Action(SWITCH, f"the plan switches after round {round_done}"))
            elif not self.switched and not self.stopped:
                actions += self._correction(stats, now)
            actions = self._hold_switch_on_a_still_stream(actions, now)
        if self._last_move is None:
            self._last_move = now
        limit = self.stall_timeout_s if self._last_processed > 0 else self.setup_timeout_s
        stalled = now - self._last_move > limit
        if stalled and (not self.switched or self.recovers_postcopy):
            actions.append(Action(INTERRUPT, f"no progress for {limit:.0f} s"))
            self._last_move = now  # re-armed: one interruption per stall period
        return actions

    def _hold_switch_on_a_still_stream(self, actions: list[Action], now: float) -> list[Action]:
        """``actions`` without a switch while the stream stands still, with one
        HOLD_SWITCH per standstill saying why."""
        still_s = now - self._last_move if self._last_move is not None else 0.0
        if still_s <= SWITCH_NEEDS_MOVE_S or not any(a.kind == SWITCH for a in actions):
            return actions
        kept = [a for a in actions if a.kind != SWITCH]
        if self._held_since_move != self._last_move:
            self._held_since_move = self._last_move
            kept.append(
                Action(
                    HOLD_SWITCH,
                    f"switch to postcopy held: the stream has not moved for {still_s:.1f} s "
                    "(a switch into a dead link would strand the VM's state in it)",
                )
            )
        return kept

    def _correction(self, stats: dict[str, int], now: float) -> list[Action]:
        decision = self.plan.decision
        progress = inflight.Progress(
            iteration=stats.get("memory_iteration", 0),
            processed_bytes=stats.get("memory_processed", 0),
            remaining_bytes=stats.get("memory_remaining", 0),
            ram_bytes=decision.ram_bytes,
            bandwidth_bps=float(stats.get("memory_bps", 0)),
        )
        planned = len(decision.prediction.rounds)
        if self._correcting_since is None and inflight.behind(progress, planned, self.limit_ms):
            self._correcting_since = now  # converge_timeout runs from here
        since = self._correcting_since
        change = inflight.adjust(
            progress,
            planned_rounds=planned,
            limit_ms=self.limit_ms,
            budget_ms=self.budget_ms,
            postcopy_enabled=decision.transfer == "postcopy",
            correcting_s=0.0 if since is None else now - since,
            converge_timeout_s=self.converge_timeout_s,
        )
        kind = {
            "switch_postcopy": SWITCH,
            "raise_downtime": SET_DOWNTIME,
            "stop_and_copy": PAUSE_GUEST,
        }.get(change.action)
        return [Action(kind, change.reason, change.downtime_ms)] if kind else []

    def done(self, action: Action) -> None:
        """The executor carried ``action`` out (a refused one is simply not reported)."""
        if action.kind == SWITCH:
            self.switched = True
        elif action.kind == SET_DOWNTIME and action.downtime_ms is not None:
            self.limit_ms = action.downtime_ms
        elif action.kind == PAUSE_GUEST:
            self.stopped = True
