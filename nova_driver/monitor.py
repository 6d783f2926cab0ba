"""The Nova driver's executor of a plan: Nova's monitor loop, the engine's controller.

Nova's own ``_live_migration_monitor`` raises the downtime in steps and acts
on a completion timer (abort, or force postcopy).  FlexMig replaces those two
with the engine's ``Controller`` (``flexmig.migration.controller``), the one
the agent's job uses too: the downtime limit is the decision's from the start,
hybrid switches to postcopy after the decision's precopy rounds, the in-flight
correction applies (in place of Nova's completion timeout, a precopy that has
not fit the downtime budget for ``[migration] converge_timeout`` is stopped
and copied), and a stream with no progress for ``[migration]
stall_timeout`` is aborted while abort is still safe; once postcopy runs it
is paused instead, and the driver resumes it with the engine's recovery
(``nova_driver.postcopy``) rather than letting Nova roll back.  Everything else is Nova's:
its job-type untangling, its queued tasks (force-complete, which switches to
postcopy only where the plan enabled it), its progress records on the
migration object and its post/recover callbacks.

One thing Nova does not do: before a completed job is recorded as a move, the
destination's libvirt is asked whether it runs the VM
(``flexmig.migration.landing``).  Nova reads a source domain that is gone or
not running as COMPLETED, which is also what a VM destroyed on the source
mid-migration looks like; recorded as a move, it would be lost from Nova's
view on a destination that never got it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from nova import exception as nova_exception
from nova.virt.libvirt import guest as libvirt_guest
from nova.virt.libvirt import migration as libvirt_migrate
from oslo_log import log as logging

from flexmig import exceptions, hypervisor
from flexmig.migration import controller, downtime, landing
from flexmig.migration.controller import Action, Controller
from flexmig.migration.planner import Plan

LOG = logging.getLogger(__name__)
POLL_S = 0.5
# Longest wait for one libvirt call from the monitor: libvirt waits for QEMU's
# monitor without limit, and a monitor stuck inside a call watches nothing (in
# the lab, migrate_start_postcopy once did not return for 5 min).
CALL_TIMEOUT_S = 30.0
ABORT_JOB_POSTCOPY = 1  # libvirt's VIR_DOMAIN_ABORT_JOB_POSTCOPY (1 << 0)


class VMNotOnDestination(exceptions.FlexMigError):
    msg_fmt = (
        "%(vm)s is not running on %(dest)s although libvirt reported its migration "
        "completed (the destination's libvirt answered: %(answers)s): the source "
        "stopped running it mid-migration (destroyed or crashed). Nova keeps it on "
        "%(source)s, where its definition and disks are, in ERROR; once the cause is "
        "known, start it there again (openstack server reboot --hard)"
    )


@dataclasses.dataclass(frozen=True)
class Destination:
    """Where a completed migration is checked: Nova's migration URI for the
    destination, and how Nova connects to a libvirt URI (read-only)."""

    uri: str
    connect: Callable[[str], Any]


@dataclasses.dataclass
class MonitorState:
    last_iteration: int = -1
    polls: int = 0
    aborted_for: str | None = None


def job_stats(info: Any) -> dict[str, int]:
    """Nova's JobInfo as libvirt's job statistics, what the controller reads."""
    return {
        "memory_iteration": info.memory_iteration,
        "memory_processed": info.memory_processed,
        "memory_remaining": info.memory_remaining,
        "memory_total": info.memory_total,
        "memory_bps": info.memory_bps,
    }


def completion_summary(plan: Plan, downtime_ms: int | None) -> tuple[str, bool]:
    """The log line a completed migration ends with, and whether its budget was exceeded.

    QEMU's downtime is a floor of what the guest noticed: a budget it alone
    exceeds is never left unsaid.
    """
    excess = downtime.excess(plan.downtime_budget_ms, downtime_ms)
    text = (
        f"FlexMig {plan.decision.mode} migration has completed: QEMU downtime "
        f"{downtime_ms if downtime_ms is not None else 'unknown'} ms, the guest's predicted "
        f"{plan.guest_downtime.total_ms:.0f} ms, budget {plan.downtime_budget_ms} ms"
    )
    if excess is not None:
        text += f"; the budget was EXCEEDED by {excess:.0f} ms"
    return text, excess is not None


def destination_runs(libvirt: Any, destination: Destination, uuid: str) -> landing.Answer:
    """One ask of the destination's libvirt: does it run the domain ``uuid``?

    Bounded (``landing.ASK_TIMEOUT_S``): a destination that does not answer
    is UNANSWERED, like one that cannot be reached.
    """

    def ask() -> landing.Answer:
        conn = destination.connect(destination.uri)
        try:
            dom = conn.lookupByUUIDString(uuid)
            # Active is running or paused: a paused VM arrives paused.
            return landing.Answer.RUNS if dom.isActive() else landing.Answer.NOT_RUNNING
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return landing.Answer.NOT_FOUND
            raise
        finally:
            try:
                conn.close()
            except libvirt.libvirtError:
                pass  # the answer is in; a failed close changes nothing

    try:
        return hypervisor.bounded(
            ask, landing.ASK_TIMEOUT_S, f"the destination's libvirt ({destination.uri})"
        )
    except Exception as exc:  # noqa: BLE001 - an ask that fails leaves Nova's reading standing
        LOG.warning("FlexMig: could not ask %s about the VM: %s", destination.uri, exc)
        return landing.Answer.UNANSWERED


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
        plan: Plan,
        migration: Any,
        stall_timeout_s: float,
        save_interval_s: float,
        active_migrations: dict[str, collections.deque[str]],
        setup_timeout_s: float | None = None,
        converge_timeout_s: float = math.inf,
        destination: Destination | None = None,
    ) -> None:
        self.libvirt = libvirt
        self.destination = destination  # None: a completed job is taken as Nova reads it
        self.host = host
        self.plan = plan
        self.migration = migration
        self.save_every = max(1, int(save_interval_s / POLL_S))
        self.active_migrations = active_migrations
        self.state = MonitorState()
        self.control = Controller(
            plan,
            stall_timeout_s,
            recovers_postcopy=True,
            setup_timeout_s=setup_timeout_s,
            converge_timeout_s=converge_timeout_s,
        )

    def run(
        self,
        instance: Any,
        guest: Any,
        future: Any,
        on_done: Callable[[Any], None],
        on_failed: Callable[[Any, str | None], None],
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        """Watch until the job ends: ``on_done`` (it landed), ``on_failed``, or
        ``on_lost`` with the destination's answers (completed, but not there);
        without ``on_lost`` a completed job is taken as Nova reads it."""
        lv = self.libvirt
        migration = self.migration
        on_failure: collections.deque[str] = collections.deque()
        while True:
            try:
                info = self._job_info(guest)
            except lv.libvirtError as exc:
                guest, info = self._looked_up_afresh(instance, guest, exc)
            if info is None:
                self._unanswered(guest)
                time.sleep(POLL_S)
                continue
            if info.type == lv.VIR_DOMAIN_JOB_NONE and future.done():
                info.type = libvirt_migrate.find_job_type(guest, instance)
            if info.type == lv.VIR_DOMAIN_JOB_UNBOUNDED:
                self._running(instance, guest, info, on_failure)
            elif info.type == lv.VIR_DOMAIN_JOB_COMPLETED:
                answers = self._confirm_landing(instance) if on_lost is not None else None
                if answers is not None and on_lost is not None:
                    on_lost(answers)
                    return
                text, exceeded = completion_summary(self.plan, getattr(info, "downtime", None))
                (LOG.warning if exceeded else LOG.info)("%s", text, instance=instance)
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

    def _confirm_landing(self, instance: Any) -> str | None:
        """None when the destination runs the VM, or cannot be asked (Nova's
        reading stands); else the destination's answers: the VM is not there."""
        destination = self.destination
        if destination is None:
            return None
        verdict, answers = landing.confirm(
            lambda: destination_runs(self.libvirt, destination, instance.uuid), time.sleep
        )
        seen = landing.describe(answers)
        if verdict is landing.Verdict.LANDED:
            LOG.info("FlexMig: %s runs the VM", destination.uri, instance=instance)
        elif verdict is landing.Verdict.LOST:
            LOG.error(
                "FlexMig: libvirt reported the migration completed, but %s does not run "
                "the VM (asked %d time(s): %s)",
                destination.uri,
                len(answers),
                seen,
                instance=instance,
            )
            return seen
        else:
            LOG.warning(
                "FlexMig: libvirt reported the migration completed; %s could not be asked "
                "whether it runs the VM (%s), so the move is recorded as libvirt reports it",
                destination.uri,
                seen,
                instance=instance,
            )
        return None

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
        if migration.status == "running (post-copy)" and not self.control.switched:
            self.control.done(Action(controller.SWITCH, "Nova's force-complete"))
        for action in self.control.on_stats(job_stats(info), time.monotonic()):
            self._apply(action, instance, guest, on_failure)
        if self.state.polls % self.save_every == 0 or info.memory_iteration != (
            self.state.last_iteration
        ):
            libvirt_migrate.save_stats(instance, migration, info, _percent_remaining(info))
            self.state.last_iteration = info.memory_iteration
        self.state.polls += 1

    def _apply(
        self, action: Action, instance: Any, guest: Any, on_failure: collections.deque[str]
    ) -> None:
        LOG.info("FlexMig: %s: %s", action.kind, action.reason, instance=instance)
        try:
            if action.kind == controller.SWITCH:
                self._switch(guest, instance, action)
                return
            elif action.kind == controller.SET_DOWNTIME and action.downtime_ms is not None:
                limit = action.downtime_ms
                hypervisor.bounded(
                    lambda: guest.migrate_configure_max_downtime(limit),
                    CALL_TIMEOUT_S,
                    "libvirt to raise the downtime limit",
                )
            elif action.kind == controller.PAUSE_GUEST:
                # Nova's own force-complete does the same for a precopy; a failed
                # migration resumes the guest through Nova's recovery tasks
                # (which unpause only a paused guest): queued first, as a pause
                # that times out may still happen.
                if "unpause" not in on_failure:
                    on_failure.append("unpause")
                hypervisor.bounded(guest.pause, CALL_TIMEOUT_S, "libvirt to pause the guest")
            elif action.kind == controller.INTERRUPT:
                self._abort(guest, action.reason)
        except self.libvirt.libvirtError as exc:
            LOG.warning("FlexMig: libvirt refused to %s: %s", action.kind, exc)
            return
        except exceptions.Timeout as exc:
            # Not done: the controller asks again, and its converge_timeout
            # runs on (the CI's monitor once sat 5 min in the raise, unbounded).
            LOG.warning("FlexMig: %s", exc)
            return
        self.control.done(action)

    def _job_info(self, guest: Any) -> Any | None:
        try:
            return hypervisor.bounded(guest.get_job_info, CALL_TIMEOUT_S, "libvirt's job info")
        except exceptions.Timeout as exc:
            LOG.warning("FlexMig: %s", exc)
            return None

    def _looked_up_afresh(self, instance: Any, guest: Any, error: Exception) -> tuple[Any, Any]:
        """(guest, job info) after the guest's job info failed with an error Nova
        does not read (it reads a domain gone as COMPLETED).

        A source libvirtd restarted at the switchover: the guest's handle died
        with the old daemon ('client socket is closed') while QEMU completed
        the move (fault campaign, restart-src-libvirtd/switchover).  Raised,
        that error ended the watch, and Nova put the instance in ERROR on the
        source while the VM ran on the destination.  The VM is looked up again on Nova's
        connection, which Nova reopens: gone from this host, the job reads
        COMPLETED (and the landing check asks the destination); found, the
        next poll asks the fresh handle; libvirt still away, the next poll
        tries again (an unanswered poll feeds the stall watchdog).
        """
        LOG.warning(
            "FlexMig: libvirt's job info failed (%s); looking the VM up again",
            error,
            instance=instance,
        )
        try:
            return self.host.get_guest(instance), None
        except nova_exception.InstanceNotFound:
            return guest, libvirt_guest.JobInfo(type=self.libvirt.VIR_DOMAIN_JOB_COMPLETED)
        except (nova_exception.NovaException, self.libvirt.libvirtError) as exc:
            LOG.warning("FlexMig: this host's libvirt cannot say yet: %s", exc, instance=instance)
            return guest, None

    def _unanswered(self, guest: Any) -> None:
        """libvirt gives no job info: no progress, so a precopy is aborted in time."""
        for action in self.control.on_stats({}, time.monotonic()):
            if action.kind == controller.INTERRUPT and not self.state.aborted_for:
                self._abort(guest, f"libvirt gave no job info ({action.reason})")

    def _switch(self, guest: Any, instance: Any, action: Action) -> None:
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
        if self.migration.status == "running (post-copy)":
            self.control.done(action)

    def _abort(self, guest: Any, reason: str) -> None:
        """Abort a precopy (the VM is whole on the source); pause a postcopy,
        which the driver then resumes (nova_driver/postcopy.py)."""
        self.state.aborted_for = reason
        if self.control.switched:
            LOG.warning("FlexMig: %s; pausing the postcopy to resume it", reason)
            # Nova's test double of libvirt lacks the flag: the binding's value.
            flag = getattr(self.libvirt, "VIR_DOMAIN_ABORT_JOB_POSTCOPY", ABORT_JOB_POSTCOPY)

            def interrupt() -> None:
                guest._domain.abortJobFlags(flag)
        else:
            LOG.warning("FlexMig: %s; aborting the precopy", reason)
            interrupt = guest.abort_job
        try:
            hypervisor.bounded(interrupt, CALL_TIMEOUT_S, "libvirt to interrupt the job")
        except (self.libvirt.libvirtError, exceptions.Timeout) as exc:
            LOG.warning("FlexMig: the interruption failed: %s", exc)
