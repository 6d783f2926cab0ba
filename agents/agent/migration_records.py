"""The source agent's migration records: kept on disk, settled after a restart.

``MigrationService`` keeps a record per migration for whoever polls
``GET /v1/migrations/<id>`` (the CLI, Nova's drain).  libvirt's peer-to-peer
job outlives the agent that started it, so an agent killed mid-migration
used to come back knowing nothing: the poller got 404 and was never told how
the migration ended.  Each record is therefore written to
``<state_dir>/migrations/<id>.json`` whenever its state or phase changes (not
per progress sample: a precopy reports several a second), the newest
``keep_ended`` ended ones kept.  A restarted agent loads them; one it finds
"planning"/"running" is reconciled against libvirt on both hosts
(``flexmig.migration.reconcile``) by a thread that follows the job to its end,
and the destination is cleaned up as a failed migration's would have been.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import libvirt

from agents.agent.client import AgentClient
from flexmig import exceptions, hypervisor
from flexmig.migration import reconcile
from flexmig.migration.planner import Plan
from flexmig.migration.request import MigrationRequest

LOG = logging.getLogger("flexmig.agent.migration_records")
MAX_EVENTS = 200
ACTIVE = ("planning", "running")
RECORDS_DIR = "migrations"
FORMAT = 1
# How long a restarted agent follows a job its predecessor started: beyond a
# postcopy's recovery (recovery_timeout, 300 s by default) and the job's own
# end timeouts, so a job that still ends is seen ending.
FOLLOW_TIMEOUT_S = 900.0
FOLLOW_POLL_S = 1.0
LIBVIRT_CALL_S = 20.0
NO_PLAN: dict[str, Any] = {"mode": None, "transport": None, "parallel": None, "explanation": None}
_ID = re.compile(r"[0-9a-f]{6,36}")


@dataclasses.dataclass(frozen=True)
class Destination:
    agent: AgentClient
    libvirt_uri: str
    migration_uri: str


def plan_view(plan: Plan | None) -> dict[str, Any]:
    """The plan as a record reports it (and keeps it: a Plan is not saved)."""
    if plan is None:
        return dict(NO_PLAN)
    return {
        "mode": plan.mode,
        "transport": dataclasses.asdict(plan.transport),
        "parallel": plan.parallel,
        "explanation": plan.explain(),
    }


@dataclasses.dataclass
class MigrationRecord:
    id: str
    request: MigrationRequest
    dest: str
    writeback_rounds: int | None = None
    state: str = "planning"
    plan: Plan | None = None
    progress: dict[str, int] = dataclasses.field(default_factory=dict)
    phase: str = "planning"
    events: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None
    started: float = dataclasses.field(default_factory=time.time)
    ended: float | None = None
    # How a restarted agent reaches the destination: port, libvirt_uri, migration_uri.
    dest_access: dict[str, Any] = dataclasses.field(default_factory=dict)
    # A reloaded record's plan as ``plan_view`` gave it (its Plan is gone).
    saved_plan: dict[str, Any] | None = None

    @property
    def vm(self) -> str:
        return self.request.vm

    @property
    def mode(self) -> str | None:
        return self.plan_fields()["mode"]

    def event(self, text: str) -> None:
        # Also in the agent's log: the record keeps the last MAX_EVENTS and goes
        # with the agent's state, the log is what an operator's collector keeps.
        LOG.info("migration %s of %s: %s", self.id, self.vm, text)
        self.events.append((time.time(), text))
        del self.events[:-MAX_EVENTS]

    def plan_fields(self) -> dict[str, Any]:
        if self.plan is None and self.saved_plan is not None:
            return self.saved_plan
        return plan_view(self.plan)

    def as_dict(self) -> dict[str, Any]:
        plan = self.plan_fields()
        return {
            "id": self.id,
            "vm": self.vm,
            "dest": self.dest,
            "state": self.state,
            "phase": self.phase,
            "requested_mode": self.request.mode,
            "mode": plan["mode"],
            "transport": plan["transport"],
            "parallel": plan["parallel"],
            "explanation": plan["explanation"],
            "progress": self.progress,
            "events": self.events,
            "summary": self.summary,
            "error": self.error,
        }


def to_json(record: MigrationRecord) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "id": record.id,
        "request": record.request.to_body(),
        "dest": record.dest,
        "dest_access": record.dest_access,
        "writeback_rounds": record.writeback_rounds,
        "state": record.state,
        "phase": record.phase,
        "plan": record.plan_fields(),
        "progress": record.progress,
        "events": record.events,
        "summary": record.summary,
        "error": record.error,
        "started": record.started,
        "ended": record.ended,
    }


def from_json(data: dict[str, Any]) -> MigrationRecord:
    """A saved record; raises ValueError (or KeyError, TypeError, InvalidInput) if malformed."""
    if data.get("format") != FORMAT or not _ID.fullmatch(str(data["id"])):
        raise ValueError("not a migration record this agent wrote")
    plan = data["plan"]
    if not isinstance(plan, dict) or set(plan) != set(NO_PLAN):
        raise ValueError("the record's plan is malformed")
    return MigrationRecord(
        id=data["id"],
        request=MigrationRequest.from_body(data["request"]),
        dest=str(data["dest"]),
        dest_access=dict(data["dest_access"]),
        writeback_rounds=data["writeback_rounds"],
        state=str(data["state"]),
        phase=str(data["phase"]),
        saved_plan=plan,
        progress=dict(data["progress"]),
        events=[(float(t), str(text)) for t, text in data["events"]],
        summary=dict(data["summary"]),
        error=data["error"],
        started=float(data["started"]),
        ended=None if data["ended"] is None else float(data["ended"]),
    )


def beyond_kept(ended: dict[str, float], keep: int) -> list[str]:
    """The ended migrations past the newest ``keep`` (id -> when it ended), oldest first.

    >>> beyond_kept({"a": 3.0, "b": 1.0, "c": 2.0}, 1)
    ['b', 'c']
    """
    oldest_first = sorted(ended, key=ended.__getitem__)
    return oldest_first[: max(0, len(oldest_first) - keep)]


class RecordStore:
    """One JSON file per record, replaced whole (a temporary file renamed over
    it, as ``links.json``), so a killed agent leaves the last complete one."""

    def __init__(self, state_dir: str | Path, keep_ended: int) -> None:
        self.dir = Path(state_dir) / RECORDS_DIR
        self.keep_ended = keep_ended
        self._lock = threading.Lock()
        self._ended: dict[str, float] = {}  # ended records on disk: id -> when they ended

    def path(self, migration_id: str) -> Path:
        return self.dir / f"{migration_id}.json"

    def save(self, record: MigrationRecord) -> None:
        """Write ``record``; a failure to write is logged, never fails the migration."""
        text = json.dumps(to_json(record))
        with self._lock:
            path = self.path(record.id)
            tmp = path.with_suffix(".tmp")
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                tmp.write_text(text)
                tmp.replace(path)
            except OSError as exc:
                LOG.warning("cannot keep migration %s's record: %s", record.id, exc)
                return
            if record.ended is not None:
                self._ended[record.id] = record.ended
                self._prune()

    def _prune(self) -> None:
        """Delete ended records beyond the newest ``keep_ended`` (caller holds the lock)."""
        for migration_id in beyond_kept(self._ended, self.keep_ended):
            del self._ended[migration_id]
            self.path(migration_id).unlink(missing_ok=True)

    def load(self) -> list[MigrationRecord]:
        """Every readable record within the bound, oldest first; unreadable ones are
        logged and left for an operator to look at."""
        records = []
        for tmp in self.dir.glob("*.tmp"):  # a write the previous agent did not finish
            tmp.unlink(missing_ok=True)
        for path in sorted(self.dir.glob("*.json")):
            try:
                record = from_json(json.loads(path.read_text()))
                if path.stem != record.id:
                    raise ValueError(f"it holds migration {record.id}")
            except (OSError, ValueError, KeyError, TypeError, exceptions.FlexMigError) as exc:
                LOG.warning("ignoring the migration record %s: %s", path, exc)
                continue
            records.append(record)
        with self._lock:
            self._ended = {r.id: r.ended for r in records if r.ended is not None}
            self._prune()
            kept = [r for r in records if r.ended is None or r.id in self._ended]
        return sorted(kept, key=lambda r: r.started)


# -- the destination's cleanup after a migration ends (also _execute's) ---------------
def quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except exceptions.FlexMigError:
        pass


def end_writeback(record: MigrationRecord, dest: Destination) -> int | None:
    """Stop the destination's early writeback of the VM's memory file: how often
    it wrote the file back (None: unknown)."""
    try:
        body = {"vm": record.vm, "active": False}
        return int(dest.agent.post("/v1/incoming/writeback", body)["rounds"])
    except (exceptions.FlexMigError, KeyError, TypeError, ValueError):
        return None


def release_split(record: MigrationRecord, dest: Destination) -> None:
    """Release the destination's split reservation of a VM that stayed on the source."""
    quietly(lambda: dest.agent.post("/v1/split/cleanup", {"vm": record.vm}))


# -- a restarted agent's records --------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SourceView:
    domain: str  # reconcile.domain_view
    job_active: bool
    stats: dict[str, int]  # the active job's statistics


class Reconciler:
    """Settles the records a dead agent left unended, one thread each: follows
    libvirt's job while it runs, then settles the record from what libvirt shows
    and cleans the destination up as ``MigrationService._execute`` would have."""

    def __init__(
        self,
        host: str,
        libvirt_uri: str,
        store: RecordStore,
        peer: Callable[[str, int], AgentClient],
        timeout_s: float = FOLLOW_TIMEOUT_S,
        poll_s: float = FOLLOW_POLL_S,
        converge_timeout_s: float = 30.0,
    ) -> None:
        self.host = host
        self.libvirt_uri = libvirt_uri
        self.store = store
        self.peer = peer
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.converge_timeout_s = converge_timeout_s  # [migration] converge_timeout

    def start(self, record: MigrationRecord) -> threading.Thread:
        record.event("the agent restarted during the migration: reading its outcome from libvirt")
        thread = threading.Thread(
            target=self.follow, args=(record,), name=f"reconcile-{record.id}", daemon=True
        )
        thread.start()
        return thread

    def follow(self, record: MigrationRecord) -> None:
        """Look until the verdict is no longer FOLLOW (or the time is up), then settle."""
        try:
            dest = self.destination(record)
            started = time.monotonic()
            remaining_by_round: dict[int, int] = {}  # round -> what was left as it began
            aborted = ""
            verdict, source = self.look(record, dest)
            while verdict.action == reconcile.FOLLOW:
                if time.monotonic() > started + self.timeout_s:
                    verdict = reconcile.gave_up(verdict, self.timeout_s)
                    break
                if source.job_active:
                    round_now = source.stats.get("memory_iteration", 0)
                    left = source.stats.get("memory_remaining", 0)
                    remaining_by_round.setdefault(round_now, left)
                aborted = aborted or self._bound_orphan(
                    record, source, list(remaining_by_round.values()), time.monotonic() - started
                )
                time.sleep(self.poll_s)
                verdict, source = self.look(record, dest)
            if aborted and verdict.vm_here:
                verdict = dataclasses.replace(verdict, note=f"{reconcile.RESTARTED}: {aborted}")
            self.settle(record, verdict, dest)
        except Exception as exc:  # the record must end whatever went wrong here
            error = exceptions.InternalError(action=f"reconciling {record.id}", error=repr(exc))
            LOG.exception("%s", error)
            self._end(record, "failed", str(error))

    def _bound_orphan(
        self, record: MigrationRecord, source: SourceView, remaining: list[int], followed_s: float
    ) -> str:
        """Abort a precopy no agent drives any more once it proves stuck (the
        next look then finds the VM whole on the source and settles); what was
        done, "" when nothing."""
        if not source.job_active or not reconcile.abort_orphaned_precopy(
            source.domain, remaining, followed_s, self.converge_timeout_s
        ):
            return ""
        try:
            self.abort_job(record.vm)
            done = reconcile.orphan_aborted(len(remaining), followed_s)
        except exceptions.FlexMigError as exc:
            done = ""
            record.event(f"aborting libvirt's stuck precopy failed: {exc}")
        if done:
            record.event(done)
        self.store.save(record)
        return done

    def abort_job(self, vm: str) -> None:
        """Abort the source's migration job of ``vm`` (bounded)."""

        def abort() -> None:
            with hypervisor.connect(self.libvirt_uri, self.host) as conn:
                with hypervisor.wrap_errors(self.host, f"abort {vm}'s migration job"):
                    dom = hypervisor.find_domain(conn, vm)
                    if dom is not None:
                        dom.abortJob()

        hypervisor.bounded(abort, LIBVIRT_CALL_S, f"libvirt to abort {vm}'s job")

    def destination(self, record: MigrationRecord) -> Destination | None:
        access = record.dest_access
        if not access.get("port"):
            return None  # written by an agent that did not keep it: libvirt's view only
        return Destination(
            self.peer(record.dest, int(access["port"])),
            str(access.get("libvirt_uri", "")),
            str(access.get("migration_uri", "")),
        )

    def look(
        self, record: MigrationRecord, dest: Destination | None
    ) -> tuple[reconcile.Verdict, SourceView]:
        source = self.source_view(record.vm)
        if source.job_active:
            if record.state == "planning":
                record.state = "running"  # the job had started
                self.store.save(record)
            record.progress = source.stats
        dest_domain = (
            self.dest_view(record.vm, dest) if not source.job_active else reconcile.UNKNOWN
        )
        verdict = reconcile.reconcile(record.state, source.domain, source.job_active, dest_domain)
        return verdict, source

    def source_view(self, vm: str) -> SourceView:
        def read() -> SourceView:
            with hypervisor.connect(self.libvirt_uri, self.host) as conn:
                with hypervisor.wrap_errors(self.host, f"read {vm}'s state"):
                    dom = hypervisor.find_domain(conn, vm)
                    if dom is None:
                        return SourceView(reconcile.domain_view(False), False, {})
                    state, reason = dom.state()
                    active = dom.jobInfo()[0] != libvirt.VIR_DOMAIN_JOB_NONE
                    stats = dom.jobStats() if active else {}
            ints = {k: v for k, v in stats.items() if isinstance(v, int)}
            return SourceView(reconcile.domain_view(True, state, reason), active, ints)

        try:
            return hypervisor.bounded(read, LIBVIRT_CALL_S, f"libvirt to report {vm}")
        except exceptions.FlexMigError as exc:
            LOG.warning("cannot read %s on the source: %s", vm, exc)
            return SourceView(reconcile.UNKNOWN, False, {})

    def dest_view(self, vm: str, dest: Destination | None) -> str:
        if dest is None or not dest.libvirt_uri:
            return reconcile.UNKNOWN

        def read() -> str:
            with hypervisor.connect(dest.libvirt_uri, dest.agent.address) as conn:
                with hypervisor.wrap_errors(dest.agent.address, f"read {vm}'s state"):
                    dom = hypervisor.find_domain(conn, vm)
                    if dom is None:
                        return reconcile.ABSENT
                    view = reconcile.domain_view(True, *dom.state())
            # A domain shut off as migrated on the destination is not the VM either.
            return reconcile.ABSENT if view == reconcile.MIGRATED else view

        try:
            return hypervisor.bounded(read, LIBVIRT_CALL_S, f"libvirt on {dest.agent.address}")
        except exceptions.FlexMigError as exc:
            LOG.warning("cannot read %s on the destination: %s", vm, exc)
            return reconcile.UNKNOWN

    def settle(
        self, record: MigrationRecord, verdict: reconcile.Verdict, dest: Destination | None
    ) -> None:
        note = verdict.note
        if verdict.action == reconcile.RESUME_SOURCE:
            note += self._resume(self.libvirt_uri, self.host, record.vm)
        elif verdict.action == reconcile.RESUME_DEST and dest is not None:
            note += self._resume(dest.libvirt_uri, dest.agent.address, record.vm)
        if dest is not None:
            self._clean_destination(record, dest, vm_here=verdict.vm_here)
        if verdict.state == "completed":
            record.summary = {"mode": record.mode, "outcome_from": "libvirt", "recovered": False}
            record.event(note)
            self._end(record, "completed", None)
        else:
            self._end(record, "failed", note)

    def _end(self, record: MigrationRecord, state: str, error: str | None) -> None:
        record.state, record.error = state, error
        if error is not None:
            record.event(f"failed: {error}")
        record.ended = time.time()
        self.store.save(record)

    def _resume(self, uri: str, host: str, vm: str) -> str:
        """Resume ``vm`` on ``host`` if it is still paused there, not for postcopy
        (looked at again: a VM that runs is never touched); what happened, for the note."""

        def resume() -> str:
            with hypervisor.connect(uri, host) as conn:
                with hypervisor.wrap_errors(host, f"resume {vm}"):
                    dom = hypervisor.find_domain(conn, vm)
                    if dom is None or reconcile.domain_view(True, *dom.state()) != reconcile.PAUSED:
                        return f" (not resumed on {host}: no longer paused)"
                    dom.resume()
                    return ""

        try:
            return hypervisor.bounded(resume, LIBVIRT_CALL_S, f"libvirt on {host} to resume {vm}")
        except exceptions.FlexMigError as exc:
            return f" (resuming it on {host} failed: {exc})"

    def _clean_destination(self, record: MigrationRecord, dest: Destination, vm_here: bool) -> None:
        """What the dead agent's ``_execute`` would have done on the destination."""
        transport = record.plan_fields()["transport"] or {}
        if transport.get("transport") == "mover":
            # Its receivers: the dead agent's pair (the destination would retire them later).
            body = {"migration_id": record.id, "abort": True}
            quietly(lambda: dest.agent.post("/v1/mover/finish", body))
        if record.mode == "split":
            if vm_here:
                release_split(record, dest)
        elif record.request.store_writeback and record.mode is not None:
            record.writeback_rounds = end_writeback(record, dest)
