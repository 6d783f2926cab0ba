"""Carrying out a drain plan: start in order, watch, re-plan, abort, summarise.

The plan (``flexmig.policy.drain``) says which VM goes where, how and when;
this loop is the I/O around it, the same for every way a migration can be
started (a ``Backend``: the FlexMig agents, Nova's API).  Rules it keeps:

- never more migrations at once than the plan's concurrency; nothing beside a
  solo migration; a VM that waits for others (split) starts after them;
- when a running migration goes clearly slower than planned, the migrations
  not yet started are planned again on the slower link (once per migration);
- abort stops starting new migrations; running ones are left to finish or to
  fail, and a migration that fails leaves its VM running on the source (the
  agent's and Nova's own rollback), so an abort never loses a VM;
- a backend that refuses a start (no state change) marks that VM failed and
  the drain goes on.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from flexmig import exceptions
from flexmig.policy import drain, drain_report

POLL_S = 0.5
PROGRESS_EVERY_S = 2.0
# A migration is "clearly slower" at this factor and this many seconds late.
REPLAN_FACTOR = 1.5
REPLAN_MIN_LATE_S = 2.0
DRAIN_TIMEOUT_S = 3600.0


@dataclasses.dataclass(frozen=True)
class Status:
    state: str  # running | completed | failed
    fraction: float = 0.0  # of the bytes the plan predicted
    mode: str | None = None  # the mode the migration really ran in
    note: str = ""
    measured: dict[str, Any] = dataclasses.field(default_factory=dict)


class Backend(Protocol):
    def start(self, move: drain.Move) -> Any: ...

    def poll(self, handle: Any, move: drain.Move) -> Status: ...


@dataclasses.dataclass
class _Running:
    move: drain.Move
    handle: Any
    started: float
    replanned: bool = False
    fraction: float = 0.0


@dataclasses.dataclass
class DrainReport:
    plan: drain.DrainPlan
    outcomes: list[drain_report.Outcome]
    total_s: float
    replans: list[str]
    aborted: bool
    measured: dict[str, dict[str, Any]]

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for out in self.outcomes:
            counts[out.state] = counts.get(out.state, 0) + 1
        return counts

    def table(self) -> str:
        lines = [drain_report.compare(self.plan, self.outcomes, self.total_s)]
        for out in self.outcomes:
            if out.note:
                lines.append(f"  {out.vm}: {out.note}")
        for text in self.replans:
            lines.append(f"  re-planned: {text}")
        if self.aborted:
            lines.append("  aborted: VMs not started stay on the source")
        return "\n".join(lines)


class DrainRun:
    def __init__(
        self,
        plan: drain.DrainPlan,
        vms: Sequence[drain.DrainVM],
        candidates: Sequence[drain.Candidate],
        backend: Backend,
        max_concurrency: int,
        on_event: Callable[[str], None] = print,
        poll_s: float = POLL_S,
        timeout_s: float = DRAIN_TIMEOUT_S,
    ) -> None:
        self.plan = plan
        self.vms = {vm.name: vm for vm in vms}
        self.candidates = list(candidates)
        self.backend = backend
        self.max_concurrency = max_concurrency
        self.on_event = on_event
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.concurrency = plan.concurrency
        self.pending = list(plan.moves)
        self.running: dict[str, _Running] = {}
        self.started: list[drain.Move] = []
        self.outcomes: dict[str, drain_report.Outcome] = {
            vm: drain_report.Outcome(vm, "unplaceable", note=why)
            for vm, why in plan.unplaceable.items()
        }
        self.measured: dict[str, dict[str, Any]] = {}
        self.replans: list[str] = []
        # How much slower than the first plan the link has proved: a re-planned
        # move's slowdown is measured against the re-plan, so they multiply.
        self.slowdown = 1.0
        self._abort = threading.Event()
        self._t0 = 0.0

    def abort(self) -> None:
        """Start nothing more; what runs finishes or rolls back on its own."""
        self._abort.set()

    def run(self) -> DrainReport:
        self._t0 = time.monotonic()
        last_progress = 0.0
        while self.pending or self.running:
            if time.monotonic() - self._t0 > self.timeout_s and not self._abort.is_set():
                self.on_event(f"drain: {self.timeout_s:.0f} s passed, aborting")
                self.abort()
            if self._abort.is_set() and self.pending:
                self._skip_pending()
            self._poll_running()
            self._replan_if_slow()
            self._start_ready()
            if time.monotonic() - last_progress >= PROGRESS_EVERY_S:
                self.on_event(self.progress())
                last_progress = time.monotonic()
            if self.pending or self.running:
                time.sleep(self.poll_s)
        order = [m.vm for m in self.plan.moves] + list(self.plan.unplaceable)
        order += [vm for vm in self.outcomes if vm not in order]
        return DrainReport(
            plan=self.plan,
            outcomes=[self.outcomes[vm] for vm in order if vm in self.outcomes],
            total_s=time.monotonic() - self._t0,
            replans=self.replans,
            aborted=self._abort.is_set(),
            measured=self.measured,
        )

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def progress(self) -> str:
        done = sum(1 for o in self.outcomes.values() if o.state == "completed")
        moving = ", ".join(f"{vm} {r.fraction:.0%}" for vm, r in self.running.items())
        return (
            f"drain {self.plan.source}: {done}/{len(self.plan.moves)} moved, "
            f"running [{moving}], {len(self.pending)} waiting; "
            f"{self._now():.1f} s of {self.plan.total_s:.1f} s planned"
        )

    def _skip_pending(self) -> None:
        for move in self.pending:
            self.outcomes[move.vm] = drain_report.Outcome(
                move.vm, "skipped", mode=move.mode, dest=move.dest, note="drain aborted: not moved"
            )
        self.on_event(f"drain: aborted, {len(self.pending)} VM(s) will not be started")
        self.pending = []

    def _may_start(self, move: drain.Move) -> bool:
        if len(self.running) >= self.concurrency:
            return False
        if any(r.move.solo for r in self.running.values()):
            return False
        if move.solo and self.running:
            return False
        return all(vm in self.outcomes for vm in move.waits_for)

    def _start_ready(self) -> None:
        index = 0
        while index < len(self.pending) and not self._abort.is_set():
            move = self.pending[index]
            if not self._may_start(move):
                if move.solo:
                    return  # holds its place in the order
                index += 1
                continue
            self.pending.pop(index)
            self._start(move)

    def _start(self, move: drain.Move) -> None:
        now = self._now()
        try:
            handle = self.backend.start(move)
        except exceptions.FlexMigError as exc:
            self.outcomes[move.vm] = drain_report.Outcome(
                move.vm, "failed", now, now, move.mode, move.dest, note=f"not started: {exc}"
            )
            self.on_event(f"{move.vm}: could not start ({exc}); it stays on the source")
            return
        self.running[move.vm] = _Running(move, handle, now)
        self.started.append(move)
        self.on_event(
            f"{move.vm}: -> {move.dest} {move.mode}{' (solo)' if move.solo else ''} started "
            f"at {now:.1f} s (planned {move.start_s:.1f} s)"
        )

    def _poll_running(self) -> None:
        for vm, run in list(self.running.items()):
            try:
                status = self.backend.poll(run.handle, run.move)
            except exceptions.FlexMigError as exc:
                status = Status("running", run.fraction, note=f"poll failed: {exc}")
            run.fraction = status.fraction
            if status.state == "running":
                continue
            end = self._now()
            del self.running[vm]
            self.measured[vm] = status.measured
            self.outcomes[vm] = drain_report.Outcome(
                vm,
                status.state,
                run.started,
                end,
                status.mode or run.move.mode,
                run.move.dest,
                note=status.note,
            )
            self.on_event(
                f"{vm}: {status.state} after {end - run.started:.1f} s "
                f"(planned {run.move.end_s - run.move.start_s:.1f} s)"
                + (f": {status.note}" if status.note else "")
            )

    def _replan_if_slow(self) -> None:
        if not self.pending:
            return
        for vm, run in self.running.items():
            planned = run.move.end_s - run.move.start_s
            elapsed = self._now() - run.started
            factor = drain.slowdown(planned, elapsed, run.fraction)
            if run.replanned or factor < REPLAN_FACTOR or elapsed < planned + REPLAN_MIN_LATE_S:
                continue
            run.replanned = True
            self._replan(vm, factor)
            return

    def _wait_for_running(self, move: drain.Move) -> drain.Move:
        """A re-planned split VM also waits for what is still landing on its host."""
        if move.mode != "split":
            return move
        landing = tuple(vm for vm, r in self.running.items() if r.move.dest == move.dest)
        return dataclasses.replace(move, waits_for=move.waits_for + landing)

    def _replan(self, vm: str, factor: float) -> None:
        remaining = [self.vms[m.vm] for m in self.pending]
        slowdown = self.slowdown * factor
        try:
            again = drain.replan(
                self.plan, remaining, self.candidates, self.started, slowdown, self.max_concurrency
            )
        except exceptions.FlexMigError as exc:
            # Migrations are running: the drain goes on with the plan it has.
            text = f"at {self._now():.1f} s {vm} ran {factor:.1f}x slower; re-plan failed: {exc}"
            self.replans.append(text)
            self.on_event(f"drain: {text}")
            return
        for name, why in again.unplaceable.items():
            self.outcomes[name] = drain_report.Outcome(
                name, "unplaceable", note=f"after re-plan: {why}"
            )
        before = self.concurrency
        self.slowdown = slowdown
        self.pending = [self._wait_for_running(m) for m in again.moves]
        self.concurrency = again.concurrency
        text = (
            f"at {self._now():.1f} s {vm} ran {factor:.1f}x slower than planned "
            f"({slowdown:.1f}x the first plan's link): {len(self.pending)} VM(s) re-planned, "
            f"{before} -> {self.concurrency} at once, "
            f"the rest predicted {again.total_s:.1f} s"
        )
        self.replans.append(text)
        self.on_event(f"drain: {text}")
