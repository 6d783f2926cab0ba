"""Watching a FlexMig migration the way Nova's monitor does, with the plan's switch.

Nova's own ``_live_migration_monitor`` raises the downtime in steps and acts
on a completion timer (abort, or force postcopy).  FlexMig replaces those two
with the plan: the downtime limit is the decision's from the start, hybrid
switches to postcopy after the decision's precopy rounds, and a stream with no
progress for ``[flexmig] stall_timeout`` is aborted while abort is still safe.
Everything else is Nova's: its job-type untangling, its queued tasks
(force-complete, which switches to postcopy only where the plan enabled it),
its progress records on the migration object and its post/recover callbacks.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from nova.virt.libvirt import migration as libvirt_migrate
from oslo_log import log as logging

from flexmig import exceptions, hypervisor
from flexmig.policy import inflight
from nova_driver.planning import MigrationPlan

LOG = logging.getLogger(__name__)
POLL_S = 0.5
# Longest wait for one libvirt call from the monitor: libvirt waits for QEMU's
# monitor without limit, and a monitor stuck inside a call watches nothing (in
# the lab, migrate_start_postcopy once did not return for 5 min).
CALL_TIMEOUT_S = 30.0


@dataclasses.dataclass
class MonitorState:
    switched: bool = False
    last_processed: int = -1
    last_move: float = dataclasses.field(default_factory=time.monotonic)
    last_iteration: int = -1
    polls: int = 0
    aborted_for: str | None = None
    limit_ms: int = 0  # the downtime limit in force
    stopped: bool = False  # paused for stop-and-copy


def _percent_remaining(info: Any) -> int:
    if not info.memory_total:
        return 100
    return round(info.memory_remaining * 100 / info.memory_total)


class PlanMonitor:
    """One migration's watch; ``host`` is Nova's libvirt Host, ``migration`` its record."""

    def __init__(
        self,
        libvirt: Any,
        host: Any,
        plan: MigrationPlan,
        migration: Any,
        stall_timeout_s: float,
        save_interval_s: float,
        active_migrations: dict[str, collections.deque[str]],
        budget_ms: int,
    ) -> None:
        self.libvirt = libvirt
        self.host = host
        self.plan = plan
        self.migration = migration
        self.stall_timeout_s = stall_timeout_s
        self.save_every = max(1, int(save_interval_s / POLL_S))
        self.active_migrations = active_migrations
        self.budget_ms = budget_ms
        self.state = MonitorState(limit_ms=plan.decision.max_downtime_ms)

    def run(
        self,
        instance: Any,
        guest: Any,
        future: Any,
        on_done: Callable[[Any], None],
        on_failed: Callable[[Any, str | None], None],
    ) -> None:
        lv = self.libvirt
        migration = self.migration
        on_failure: collections.deque[str] = collections.deque()
        while True:
            info = self._job_info(guest)
            if info is None:
                self._unanswered(guest)
                time.sleep(POLL_S)
                continue
            if info.type == lv.VIR_DOMAIN_JOB_NONE and future.done():
                info.type = libvirt_migrate.find_job_type(guest, instance)
            if info.type == lv.VIR_DOMAIN_JOB_UNBOUNDED:
                self._running(instance, guest, info, on_failure)
            elif info.type == lv.VIR_DOMAIN_JOB_COMPLETED:
                LOG.info("FlexMig %s migration has completed", self.plan.decision.mode)
                if info.memory_total:
                    libvirt_migrate.save_stats(instance, migration, info, 0)
                on_done(info)
                return
            elif info.type in (lv.VIR_DOMAIN_JOB_FAILED, lv.VIR_DOMAIN_JOB_CANCELLED):
                cancelled = info.type == lv.VIR_DOMAIN_JOB_CANCELLED
                LOG.warning(
                    "FlexMig %s migration %s%s",
                    self.plan.decision.mode,
                    "was cancelled" if cancelled else "failed",
                    f" ({self.state.aborted_for})" if self.state.aborted_for else "",
                )
                libvirt_migrate.run_recover_tasks(self.host, guest, instance, on_failure)
                on_failed(info, "cancelled" if cancelled and not self.state.aborted_for else None)
                return
            time.sleep(POLL_S)

    def _running(
        self, instance: Any, guest: Any, info: Any, on_failure: collections.deque[str]
    ) -> None:
        migration = self.migration
        # Nova's queued tasks: force-complete from the API switches to
        # postcopy only where the plan turned it on.
        libvirt_migrate.run_tasks(
            guest,
            instance,
            self.active_migrations,
            on_failure,
            migration,
            self.plan.decision.transfer == "postcopy",
        )
        if migration.status == "running (post-copy)":
            self.state.switched = True
        stats = {"memory_iteration": info.memory_iteration}
        if not self.state.switched and self.plan.mode.should_switch_to_postcopy(
            self.plan.decision, stats
        ):
            LOG.info(
                "FlexMig hybrid: switching to postcopy after precopy round %d (the plan's)",
                info.memory_iteration - 1,
            )
            self._switch(guest, instance)
        if not self.state.switched and not self.state.stopped:
            self._correct(instance, guest, info, on_failure)
        self._watch_progress(guest, info)
        if self.state.polls % self.save_every == 0 or info.memory_iteration != (
            self.state.last_iteration
        ):
            libvirt_migrate.save_stats(instance, migration, info, _percent_remaining(info))
            self.state.last_iteration = info.memory_iteration
        self.state.polls += 1

    def _correct(
        self, instance: Any, guest: Any, info: Any, on_failure: collections.deque[str]
    ) -> None:
        """A stream slower than planned: the policy's in-flight correction."""
        decision = self.plan.decision
        change = inflight.adjust(
            inflight.Progress(
                iteration=info.memory_iteration,
                processed_bytes=info.memory_processed,
                remaining_bytes=info.memory_remaining,
                ram_bytes=decision.ram_bytes,
                bandwidth_bps=info.memory_bps,
            ),
            planned_rounds=len(decision.prediction.rounds),
            limit_ms=self.state.limit_ms,
            budget_ms=self.budget_ms,
            postcopy_enabled=decision.transfer == "postcopy",
        )
        if change.action == "none":
            return
        LOG.info("FlexMig: %s", change.reason, instance=instance)
        if change.action == "switch_postcopy":
            self._switch(guest, instance)
        elif change.action == "raise_downtime" and change.downtime_ms is not None:
            try:
                guest.migrate_configure_max_downtime(change.downtime_ms)
            except self.libvirt.libvirtError as exc:
                LOG.warning("FlexMig: libvirt refused the downtime limit: %s", exc)
            self.state.limit_ms = change.downtime_ms
        elif change.action == "stop_and_copy":
            # Nova's own force-complete does the same for a precopy; a failed
            # migration resumes the guest through Nova's recovery tasks.
            guest.pause()
            on_failure.append("unpause")
            self.state.stopped = True

    def _job_info(self, guest: Any) -> Any | None:
        try:
            return hypervisor.bounded(guest.get_job_info, CALL_TIMEOUT_S, "libvirt's job info")
        except exceptions.Timeout as exc:
            LOG.warning("FlexMig: %s", exc)
            return None

    def _unanswered(self, guest: Any) -> None:
        """libvirt gives no job info: no progress, so a precopy is aborted in time."""
        if self.state.switched or self.state.aborted_for:
            return
        if time.monotonic() - self.state.last_move > self.stall_timeout_s:
            self._abort(guest, f"libvirt gave no job info for {self.stall_timeout_s:.0f} s")

    def _switch(self, guest: Any, instance: Any) -> None:
        """Nova's switch, bounded: unanswered, the precopy is aborted (the VM is whole)."""
        try:
            hypervisor.bounded(
                lambda: libvirt_migrate.trigger_postcopy_switch(guest, instance, self.migration),
                CALL_TIMEOUT_S,
                "libvirt to switch to postcopy",
            )
        except exceptions.Timeout as exc:
            # If QEMU did switch after all, libvirt refuses the abort and the
            # migration goes on as postcopy.
            self._abort(guest, str(exc))
        self.state.switched = self.migration.status == "running (post-copy)"

    def _abort(self, guest: Any, reason: str) -> None:
        self.state.aborted_for = reason
        LOG.warning("FlexMig: %s; aborting the precopy", reason)
        try:
            hypervisor.bounded(guest.abort_job, CALL_TIMEOUT_S, "libvirt to abort the job")
        except (self.libvirt.libvirtError, exceptions.Timeout) as exc:
            LOG.warning("FlexMig: the abort failed: %s", exc)

    def _watch_progress(self, guest: Any, info: Any) -> None:
        now = time.monotonic()
        if info.memory_processed != self.state.last_processed:
            self.state.last_processed, self.state.last_move = info.memory_processed, now
            return
        if self.state.switched or self.state.aborted_for:
            # Once postcopy runs the guest lives on the destination: aborting
            # would lose it; libvirt and QEMU own postcopy recovery.
            return
        if now - self.state.last_move > self.stall_timeout_s:
            self._abort(guest, f"no progress for {self.stall_timeout_s:.0f} s")
