"""The agent's executor of a plan: one migration job through libvirt.

The job runs ``migrateToURI3`` in a worker thread and watches it from the
caller's thread, carrying out what the ``Controller`` decides (the plan's
postcopy switch, the in-flight correction, the stall watchdog).  A lost
destination agent interrupts it too.  An interruption aborts while abort is
still safe (precopy: the VM keeps running on the source).  Once postcopy has
started the VM's state is split between hosts, so it pauses postcopy instead
and the job keeps trying to resume it.

Every libvirt call the watch makes has a deadline (``call_timeout_s``), and
so has libvirt's own job once interrupted (``end_timeout_s``): a daemon or
QEMU that stops answering becomes a reported failure with the VM's state
named, never a watch that waits for ever.  (The lab met this: with libvirt 9.0
and QEMU 10, ``migrateStartPostCopy`` once never returned, and the watch that
would have aborted the stuck precopy sat inside that call.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Callable

import libvirt
import libvirt_qemu

from flexmig import exceptions, hypervisor
from flexmig.migration import controller, recovery
from flexmig.migration.controller import Action, Controller
from flexmig.migration.planner import Plan

ProgressFn = Callable[[str, dict[str, int]], None]
EventFn = Callable[[str], None]
PEER_CHECK_INTERVAL_S = 1.0
PEER_FAILURES_TO_ABORT = 3
BASE_FLAGS = (
    libvirt.VIR_MIGRATE_LIVE
    | libvirt.VIR_MIGRATE_PEER2PEER
    | libvirt.VIR_MIGRATE_PERSIST_DEST
    | libvirt.VIR_MIGRATE_UNDEFINE_SOURCE
)

LANDING_POLL_S = 1.0

# Where libvirt's call outlived its interruption, it still holds the VM's job:
# the next migration of it waits 30 s for that job and fails (CI, 2026-11-29:
# libvirt 9.0's Perform call stayed after a cut link came back).
STILL_HELD = (
    "libvirt's call still holds the VM's migration job, so a new migration of it fails "
    "until that call ends (when libvirt gives up on the destination) or libvirtd on the "
    "source is restarted (running domains are kept)"
)

# The source's VM states (state, reason) that mean it was given up as migrated.
NO_DOMAIN = (-1, -1)  # the source has no such domain (a transient one is gone)
SOURCE_MIGRATED = (libvirt.VIR_DOMAIN_SHUTOFF, libvirt.VIR_DOMAIN_SHUTOFF_MIGRATED)


@dataclasses.dataclass(frozen=True)
class JobConfig:
    dest_libvirt_uri: str
    migration_uri: str
    stall_timeout_s: float = 15.0
    recovery_timeout_s: float = 300.0
    poll_s: float = 0.2
    # The source's own libvirt, for questions asked on a connection of their
    # own; "": not asked (the job's connection alone).
    source_libvirt_uri: str = ""
    # Where the caller owns a connection to the source's libvirt that outlives
    # a daemon restart (Nova's Host reopens its own): returns it, live, never
    # closed by the job.  Used when source_libvirt_uri is "".
    source_connection: Callable[[], libvirt.virConnect] | None = None
    # Longest wait for the first page to move: libvirt starts the destination
    # QEMU first, seconds on a busy host, which is no stall.
    setup_timeout_s: float = 60.0
    # Longest a precopy runs with the whole budget as its limit, not fitting it,
    # before the guest is paused (stop-and-copy).
    converge_timeout_s: float = 30.0
    # Longest wait for one libvirt call (job statistics, switch, abort).
    call_timeout_s: float = 20.0
    # Longest wait for libvirt's job to end once interrupted.
    end_timeout_s: float = 60.0
    # The engine's way to open a fresh transport for postcopy resume attempt N
    # (from 1), returning its migration URI; raises FlexMigError when it cannot
    # (yet).  The mover transport needs it: its pair dies with the stream.
    # None: resume over migration_uri (QEMU's own TCP listens again there).
    reopen_transport: Callable[[int], str] | None = None
    # Longest a failed precopy's job asks where the VM ended up while the
    # source cannot say (its libvirtd restarting) or holds it paused.
    landing_check_s: float = 30.0
    # The libvirt flags the migration was started with, where another caller
    # started it (Nova): a resume repeats them.  None: the plan's own.
    flags: int | None = None


@dataclasses.dataclass
class JobResult:
    state: str  # completed | failed
    error: str | None = None
    switched_to_postcopy: bool = False
    recovered: bool = False
    elapsed_s: float = 0.0
    last_stats: dict[str, int] = dataclasses.field(default_factory=dict)


def _vm_state(conn: libvirt.virConnect, name: str) -> tuple[int, int]:
    """``name``'s (state, reason) on ``conn``, NO_DOMAIN where it has none."""
    dom = hypervisor.find_domain(conn, name)
    return tuple(dom.state()) if dom is not None else NO_DOMAIN  # type: ignore[return-value]


def _running(state: tuple[int, int] | None) -> bool:
    return state is not None and state[0] == libvirt.VIR_DOMAIN_RUNNING


def _given_up_as_migrated(source: tuple[int, int] | None) -> bool:
    """The source no longer has the VM, or shut it off as migrated: only then
    can a VM running on the destination be the one that landed."""
    return source in (NO_DOMAIN, SOURCE_MIGRATED)


def _int_stats(stats: dict[str, object]) -> dict[str, int]:
    return {k: v for k, v in stats.items() if isinstance(v, int)}


class MigrationJob:
    def __init__(
        self,
        dom: libvirt.virDomain,
        host: str,
        plan: Plan,
        config: JobConfig,
        on_progress: ProgressFn | None = None,
        on_event: EventFn | None = None,
        peer_alive: Callable[[], bool] | None = None,
    ) -> None:
        self.dom = dom
        self.host = host
        self.plan = plan
        self.config = config
        self.on_progress = on_progress or (lambda _phase, _stats: None)
        self.on_event = on_event or (lambda _text: None)
        self.peer_alive = peer_alive
        self.result = JobResult(state="running")
        self.control = Controller(
            plan,
            config.stall_timeout_s,
            recovers_postcopy=True,
            setup_timeout_s=config.setup_timeout_s,
            converge_timeout_s=config.converge_timeout_s,
        )
        self._abort_reason: str | None = None
        self._interrupted_at: float | None = None
        self._abandoned = False  # libvirt's job never ended after the interruption
        self._uri = config.migration_uri  # a resume's fresh transport replaces it

    def _params(self) -> dict[str, object]:
        params: dict[str, object] = {}
        if self._uri:  # "": libvirt's default (Nova's, without a migrate URI)
            params[libvirt.VIR_MIGRATE_PARAM_URI] = self._uri
        cap = self.plan.request.bandwidth_mib
        if cap:
            # A cap emulates a slower link: it holds for both phases (libvirt's
            # plain bandwidth leaves postcopy's page pushing uncapped).
            params[libvirt.VIR_MIGRATE_PARAM_BANDWIDTH] = cap
            params[libvirt.VIR_MIGRATE_PARAM_BANDWIDTH_POSTCOPY] = cap
        # The plan's knobs: parallel connections, compression, the switchover hint.
        return params | self.plan.params()

    def flags(self) -> int:
        if self.config.flags is not None:
            return self.config.flags
        return BASE_FLAGS | self.plan.mode_flags(libvirt)

    def recover_postcopy(self) -> JobResult:
        """Resume a postcopy that another caller started and that broke (Nova's
        path): the same recovery as this job's own."""
        start = time.monotonic()
        self.result.switched_to_postcopy = True
        self._recover()
        self.result.elapsed_s = time.monotonic() - start
        return self.result

    def _start(self, flags: int) -> tuple[threading.Thread, list[BaseException]]:
        return hypervisor.start_migration(
            self.dom,
            self.host,
            self.config.dest_libvirt_uri,
            self._params(),
            flags,
            self.config.source_libvirt_uri,
        )

    def run(self) -> JobResult:
        start = time.monotonic()
        with hypervisor.wrap_errors(self.host, "set the downtime limit"):
            limit = self.plan.decision.max_downtime_ms
            self._call(lambda: self.dom.migrateSetMaxDowntime(limit), "set the downtime limit")
        worker, errors = self._start(self.flags())
        self._watch(worker)
        if errors and not self.result.switched_to_postcopy and self._source_in_postcopy():
            # The switch was made although libvirt never answered it.
            self.result.switched_to_postcopy = True
        if self._abandoned:
            self._give_up()
        elif errors and self.result.switched_to_postcopy:
            self.on_event(f"postcopy interrupted ({errors[0]}); recovering")
            self._recover()
        elif errors and self._landed_after_failure():
            self.result.state = "completed"
            self.on_event(
                f"libvirt reported the migration failed ({errors[0]}), but QEMU completed "
                "it: the VM runs on the destination"
            )
        elif errors:
            self.result.state = "failed"
            self.result.error = self._abort_reason or str(errors[0])
            self._keep_source_running()
        else:
            self.result.state = "completed"
            if self.control.stopped:
                self._resume_on_destination()
        self.result.elapsed_s = time.monotonic() - start
        return self.result

    def _watch(self, worker: threading.Thread) -> None:
        peer_failures, next_peer_check = 0, time.monotonic() + PEER_CHECK_INTERVAL_S
        self._interrupted_at = None
        while worker.is_alive():
            worker.join(self.config.poll_s)
            if self._job_outlived_interruption():
                return
            stats = self._stats()
            if stats:
                phase = "postcopy" if self.result.switched_to_postcopy else "precopy"
                self.on_progress(phase, stats)
            if not worker.is_alive():
                break
            for action in self.control.on_stats(stats, time.monotonic()):
                if self._interrupted_at is None or action.kind == controller.INTERRUPT:
                    self._apply(action, stats)  # being ended: no switches or corrections
            if self.peer_alive and time.monotonic() >= next_peer_check:
                next_peer_check = time.monotonic() + PEER_CHECK_INTERVAL_S
                peer_failures = 0 if self.peer_alive() else peer_failures + 1
                if peer_failures == PEER_FAILURES_TO_ABORT:
                    self._interrupt("destination agent stopped answering")

    def _apply(self, action: Action, stats: dict[str, int]) -> None:
        if action.kind == controller.INTERRUPT:
            self._interrupt(action.reason)
            return
        if action.kind != controller.SWITCH:
            self.on_event(action.reason)
        try:
            if action.kind == controller.SWITCH:
                self._switch(action, stats)
                return
            if action.kind == controller.SET_DOWNTIME and action.downtime_ms is not None:
                limit = action.downtime_ms
                self._call(lambda: self.dom.migrateSetMaxDowntime(limit), "raise the limit")
            elif action.kind == controller.PAUSE_GUEST:
                # A failed migration resumes it (_keep_source_running).
                self._call(self.dom.suspend, "pause the guest")
        except libvirt.libvirtError as exc:
            self.on_event(f"libvirt refused to {action.kind}: {exc.get_error_message()}")
            return
        except exceptions.Timeout as exc:
            self.on_event(str(exc))
            return
        self.control.done(action)

    def _switch(self, action: Action, stats: dict[str, int]) -> None:
        try:
            self._call(self.dom.migrateStartPostCopy, "switch to postcopy")
        except exceptions.Timeout as exc:
            self.on_event(str(exc))
            if not self._source_in_postcopy():
                # Still precopy, with a daemon that does not answer: abort
                # while the VM is whole on the source.
                self._interrupt("libvirt did not answer the switch to postcopy")
                return
        self.result.switched_to_postcopy = True
        self.control.done(action)
        self.on_event(
            f"switched to postcopy after round {stats.get('memory_iteration', 0) - 1}"
            + ("" if action.reason.startswith("the plan") else f": {action.reason}")
        )

    def _job_outlived_interruption(self) -> bool:
        if self._interrupted_at is None:
            return False
        if time.monotonic() - self._interrupted_at < self.config.end_timeout_s:
            return False
        self._abandoned = True
        self.on_event(
            f"libvirt's migration job did not end within {self.config.end_timeout_s:.0f} s "
            "of the interruption; no longer waiting for it"
        )
        return True

    def _call(self, call: Callable[[], object], what: str) -> object:
        return hypervisor.bounded(call, self.config.call_timeout_s, f"libvirt to {what}")

    def _stats(self) -> dict[str, int]:
        try:
            stats = _int_stats(self._call(self.dom.jobStats, "report job statistics"))  # type: ignore[arg-type]
        except libvirt.libvirtError:
            return {}
        except exceptions.Timeout as exc:
            # No statistics count as no progress: the stall watchdog acts.
            self.on_event(str(exc))
            return {}
        if stats:
            self.result.last_stats = stats
        return stats

    def _interrupt(self, reason: str) -> None:
        """Abort while precopy (safe), pause while postcopy (recoverable)."""
        self._abort_reason = reason
        self.on_event(f"interrupting: {reason}")
        if self._interrupted_at is None:
            self._interrupted_at = time.monotonic()
        try:
            if self.result.switched_to_postcopy:
                self._call(
                    lambda: self.dom.abortJobFlags(libvirt.VIR_DOMAIN_ABORT_JOB_POSTCOPY),
                    "pause the postcopy",
                )
            else:
                self._call(self.dom.abortJob, "abort the precopy")
        except libvirt.libvirtError as exc:
            self.on_event(f"libvirt refused the interruption: {exc.get_error_message()}")
        except exceptions.Timeout as exc:
            self.on_event(str(exc))

    def _source_state(self) -> tuple[int, int] | None:
        """The source VM's (state, reason), NO_DOMAIN once the source has none,
        None when libvirt cannot say.

        Read on a connection other than the job's where the job has one: the
        job's may be the one stuck, and its domain handle dies with a restarted
        libvirtd ("client socket is closed" ever after), which left a postcopy
        that had completed across a source libvirtd restart reported as paused
        on both hosts (fault campaign).
        """

        def read() -> tuple[int, int]:
            if self.config.source_libvirt_uri:
                with hypervisor.connect(self.config.source_libvirt_uri, self.host) as conn:
                    return _vm_state(conn, self.dom.name())
            if self.config.source_connection is not None:
                return _vm_state(self.config.source_connection(), self.dom.name())
            try:
                return tuple(self.dom.state())  # type: ignore[return-value]
            except libvirt.libvirtError as exc:
                if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                    return NO_DOMAIN
                raise

        try:
            return self._call(read, "report the source VM's state")  # type: ignore[return-value]
        except (libvirt.libvirtError, exceptions.FlexMigError):
            return None

    def _destination_state(self) -> tuple[int, int] | None:
        """The destination VM's (state, reason), NO_DOMAIN where it has none,
        None whenever it cannot be asked (a cut link, a daemon restarting)."""

        def read() -> tuple[int, int]:
            with hypervisor.connect(self.config.dest_libvirt_uri, "destination") as conn:
                return _vm_state(conn, self.dom.name())

        try:
            return self._call(read, "ask the destination for the VM")  # type: ignore[return-value]
        except (libvirt.libvirtError, exceptions.FlexMigError):
            return None

    def _source_in_postcopy(self) -> bool:
        """Whether the source has handed execution over (libvirt pauses it for postcopy)."""
        return self._source_state() == (
            libvirt.VIR_DOMAIN_PAUSED,
            libvirt.VIR_DOMAIN_PAUSED_POSTCOPY,
        )

    def _give_up(self) -> None:
        """libvirt's job outlived its interruption: report where the VM is, keep it alive."""
        self.result.state = "failed"
        if self.result.switched_to_postcopy or self._source_in_postcopy():
            self.result.switched_to_postcopy = True
            where = (
                "postcopy had started, so the VM's memory is split between the hosts and "
                "it is paused; resume it with 'virsh migrate --postcopy --postcopy-resume' "
                "once libvirt answers again"
            )
        else:
            self._keep_source_running()
            where = f"the VM was still whole on the source and is left running there; {STILL_HELD}"
        self.result.error = (
            f"{self._abort_reason or 'interrupted'}; libvirt's job did not end within "
            f"{self.config.end_timeout_s:.0f} s of the interruption: {where}"
        )

    def _landed_after_failure(self) -> bool:
        """Whether a precopy whose libvirt call failed landed all the same.

        A source libvirtd restarted at the switchover ends libvirt's call
        ("End of file while reading data") while QEMU completes the
        migration, and the VM runs on the destination (fault campaign,
        */qemu-tcp/restart-src-libvirtd/switchover: reported failed, VM on B).
        Asked until the source says (up to landing_check_s): a VM running
        there, or a QEMU whose migration failed, stayed; one given up as
        migrated landed if it runs on the destination.
        """
        deadline = time.monotonic() + self.config.landing_check_s
        while True:
            source = self._source_state()
            if _running(source):
                return False
            if _given_up_as_migrated(source):
                if _running(self._destination_state()):
                    return True
            elif source is not None and self._qemu_migration_status() in ("failed", "cancelled"):
                return False  # paused (stop-and-copy) on a QEMU that kept the VM
            if time.monotonic() >= deadline:
                return False
            time.sleep(LANDING_POLL_S)

    def _resume_on_destination(self) -> None:
        """A VM paused for stop-and-copy must run where it landed."""
        try:
            with hypervisor.connect(self.config.dest_libvirt_uri, "destination") as conn:
                dom = hypervisor.find_domain(conn, self.dom.name())
                if dom is not None and dom.state()[0] == libvirt.VIR_DOMAIN_PAUSED:
                    dom.resume()
                    self.on_event("resumed the VM on the destination after stop-and-copy")
        except (libvirt.libvirtError, exceptions.FlexMigError) as exc:
            self.on_event(f"could not resume the VM on the destination: {exc}")

    def _keep_source_running(self) -> None:
        """After a failed precopy the VM must run on the source, never stay paused."""
        with contextlib.suppress(libvirt.libvirtError, exceptions.Timeout):
            state, reason = self._call(self.dom.state, "report the VM's state")  # type: ignore[misc]
            if state == libvirt.VIR_DOMAIN_PAUSED and reason != libvirt.VIR_DOMAIN_PAUSED_POSTCOPY:
                self._call(self.dom.resume, "resume the VM on the source")
                self.on_event("resumed the VM on the source")

    def _recover(self) -> None:
        """Resume a broken postcopy until it completes, the VM turns out to run
        on one host, or recovery_timeout_s is spent (the VM then stays paused
        on both hosts, never destroyed, and the error says how to resume it)."""
        deadline = time.monotonic() + self.config.recovery_timeout_s
        attempts, last_error = 0, ""
        while True:
            step = recovery.next_step(self._recovery_view(attempts, deadline))
            if step.kind == recovery.SOURCE_RUNS:
                # The switch was accepted but postcopy never took over (libvirt
                # 11 seen here): libvirt rolled back and the VM runs whole.
                self.result.state = "failed"
                self.result.error = "postcopy never took over; the VM runs on the source"
                self.on_event(self.result.error)
                return
            if step.kind == recovery.LANDED:
                # QEMU's own stream survived the cut, or completed a resume
                # libvirt reported failed: the VM runs there.
                self.result.state, self.result.recovered = "completed", True
                self.on_event(recovery.landed_event(attempts, last_error))
                return
            if step.kind == recovery.DEST_GONE:
                self.result.state = "failed"
                self.result.error = recovery.destination_lost(self.dom.name())
                self.on_event(self.result.error)
                return
            if step.kind == recovery.GIVE_UP:
                break
            time.sleep(step.delay_s)
            if step.kind == recovery.WAIT:
                continue
            attempts += 1
            error = self._resume(attempts, step.reopen)
            if error is None:
                self.result.state, self.result.recovered = "completed", True
                self.on_event(f"postcopy resumed and completed (attempt {attempts})")
                return
            last_error = error
            self.on_event(f"resume attempt {attempts} failed: {error}")
        self.result.state = "failed"
        self.result.error = recovery.given_up(
            self.config.recovery_timeout_s, attempts, last_error, self.config.dest_libvirt_uri
        )
        self.on_event(self.result.error)

    def _recovery_view(self, attempts: int, deadline: float) -> recovery.RecoveryView:
        # One question to each host per step: each may be a fresh connection
        # over a link that is cut.
        source, destination = self._source_state(), self._destination_state()
        return recovery.RecoveryView(
            runs_on_source=_running(source),
            landed_on_destination=_given_up_as_migrated(source) and _running(destination),
            attempts=attempts,
            time_left_s=deadline - time.monotonic(),
            fresh_transport=self.config.reopen_transport is not None,
            qemu_status=self._qemu_migration_status(),
            # Only an answer counts: the destination's QEMU ended.
            destination_gone=destination == NO_DOMAIN
            or (destination is not None and destination[0] == libvirt.VIR_DOMAIN_SHUTOFF),
        )

    def _resume(self, attempt: int, reopen: bool) -> str | None:
        """One POSTCOPY_RESUME, on a fresh transport if asked; None once it
        completed, else why not."""
        if reopen and self.config.reopen_transport is not None:
            try:
                self._uri = self.config.reopen_transport(attempt)
            except exceptions.FlexMigError as exc:
                return f"no fresh transport to resume over: {exc}"
            self.on_event(f"resume attempt {attempt} over a fresh transport: {self._uri}")
        worker, errors = self._start(self.flags() | libvirt.VIR_MIGRATE_POSTCOPY_RESUME)
        self._watch(worker)
        if self._abandoned:
            # Another attempt may still get through, or the VM land: the
            # deadline, not one stuck call, ends the recovery.
            self._abandoned = False
            return (
                f"{recovery.ABANDONED_CALL} {self.config.end_timeout_s:.0f} s "
                "of its interruption"
            )
        return str(errors[0]) if errors else None

    def _qemu_migration_status(self) -> str:
        """The source QEMU's own migration state (query-migrate); "" when unknown."""

        def query() -> str:
            reply = libvirt_qemu.qemuMonitorCommand(self.dom, '{"execute":"query-migrate"}', 0)
            return str(json.loads(reply).get("return", {}).get("status", ""))

        try:
            return str(self._call(query, "report QEMU's migration state"))
        except (libvirt.libvirtError, exceptions.Timeout, ValueError, AttributeError):
            return ""
