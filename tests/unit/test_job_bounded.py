"""Every wait of the migration job is bounded, whatever libvirt does.

A fake domain stands in for a libvirt whose calls never return (the lab saw
``migrateStartPostCopy`` hang with libvirt 9.0 and QEMU 10): the job must
come back within its deadlines, say why, and leave the VM alive.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import libvirt
import pytest

from flexmig import exceptions, hypervisor
from flexmig.migration import libvirt_job as job_module
from flexmig.migration.libvirt_job import JobConfig, MigrationJob
from tests.unit.engine_fakes import make_plan

FOREVER = 30.0  # longer than any deadline below: a call that "never" returns


def test_bounded_returns_raises_or_times_out():
    assert hypervisor.bounded(lambda: 7, 1.0, "a quick call") == 7
    with pytest.raises(ZeroDivisionError):
        hypervisor.bounded(lambda: 1 / 0, 1.0, "a failing call")
    start = time.monotonic()
    with pytest.raises(exceptions.Timeout, match="a stuck call"):
        hypervisor.bounded(lambda: threading.Event().wait(FOREVER), 0.2, "a stuck call")
    assert time.monotonic() - start < 2.0


class WedgedDomain:
    """A source domain whose switch to postcopy never answers.

    ``abort_answers``: whether abortJob still works (libvirt's job then ends
    with an error, as a cancelled migration does).  ``postcopy_started``: the
    state libvirt reports on another connection.
    """

    def __init__(self, abort_answers: bool, postcopy_started: bool = False) -> None:
        self.abort_answers = abort_answers
        self.postcopy_started = postcopy_started
        self.ended = threading.Event()
        self.calls: list[str] = []
        self.processed = 0

    def name(self) -> str:
        return "vm"

    def migrateSetMaxDowntime(self, _ms: int) -> None:
        pass

    def jobStats(self) -> dict[str, int]:
        self.processed += 1 << 20  # progress: the stall watchdog stays quiet
        return {"memory_iteration": 3, "memory_processed": self.processed}

    def migrateStartPostCopy(self) -> None:
        self.calls.append("switch")
        threading.Event().wait(FOREVER)

    def abortJob(self) -> None:
        self.calls.append("abort")
        if not self.abort_answers:
            threading.Event().wait(FOREVER)
        self.ended.set()

    def abortJobFlags(self, _flags: int) -> None:
        self.calls.append("pause-postcopy")
        threading.Event().wait(FOREVER)

    def state(self) -> tuple[int, int]:
        if self.postcopy_started:
            return libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_POSTCOPY
        return libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_RUNNING_MIGRATED

    def resume(self) -> None:
        self.calls.append("resume")

    def isActive(self) -> bool:
        return True


def _run(monkeypatch, dom: WedgedDomain) -> tuple[job_module.JobResult, list[str], float]:
    def start_migration(_dom, _host, _uri, _params, _flags, _source_uri=""):
        errors: list[BaseException] = []

        def migrate() -> None:
            if dom.ended.wait(FOREVER):
                errors.append(exceptions.HypervisorError(host="A", action="migrate", reason="x"))

        worker = threading.Thread(target=migrate, daemon=True)
        worker.start()
        return worker, errors

    @contextlib.contextmanager
    def connect(_uri, _host):
        yield type("Conn", (), {"lookupByName": lambda _self, _name: dom})()

    monkeypatch.setattr(hypervisor, "start_migration", start_migration)
    monkeypatch.setattr(hypervisor, "connect", connect)
    plan = make_plan(hot=True, file_backed=False)
    assert plan.decision.transfer == "postcopy"
    plan = dataclasses.replace(
        plan, decision=dataclasses.replace(plan.decision, postcopy_after_round=1)
    )
    events: list[str] = []
    config = JobConfig(
        "qemu+tcp://b/system",
        "tcp://b",
        source_libvirt_uri="qemu+tcp://a/system",
        poll_s=0.05,
        stall_timeout_s=1.0,
        setup_timeout_s=1.0,
        recovery_timeout_s=1.0,
        call_timeout_s=0.3,
        end_timeout_s=1.0,
    )
    job = MigrationJob(dom, "A", plan, config, on_event=events.append)  # type: ignore[arg-type]
    start = time.monotonic()
    result = job.run()
    return result, events, time.monotonic() - start


def test_an_unanswered_switch_aborts_the_precopy_and_the_vm_stays_on_the_source(monkeypatch):
    dom = WedgedDomain(abort_answers=True)
    result, events, took = _run(monkeypatch, dom)
    assert result.state == "failed" and not result.switched_to_postcopy
    assert "did not answer the switch to postcopy" in (result.error or "")
    assert dom.calls == ["switch", "abort"]
    assert any("Timed out after 0.3 s waiting for libvirt to switch" in e for e in events)
    assert took < 5.0


def test_a_job_that_outlives_its_abort_is_reported_and_the_watch_ends(monkeypatch):
    dom = WedgedDomain(abort_answers=False)
    result, events, took = _run(monkeypatch, dom)
    assert result.state == "failed"
    assert "did not end within 1 s" in (result.error or "")
    assert "left running there" in (result.error or "")
    # The call still holds the VM's job: say so, and what ends it.
    assert job_module.STILL_HELD in (result.error or "")
    assert "restarted" in job_module.STILL_HELD
    assert any("no longer waiting" in e for e in events)
    assert took < 5.0


def test_a_later_call_blocked_by_that_job_says_what_holds_it_and_what_ends_it():
    """CI, 2026-11-29: after a cut link came back, the next migration of the VM
    failed on libvirt's 30 s lock wait, its message naming only libvirt's RPC."""
    held = libvirt.libvirtError("x")
    held.get_error_message = (
        lambda: (  # type: ignore[method-assign]
            "Timed out during operation: cannot acquire state change lock "
            "(held by monitor=remoteDispatchDomainMigratePerform3Params)"
        )
    )
    with pytest.raises(exceptions.HypervisorError) as raised:
        with hypervisor.wrap_errors("lab-a", "start a 1 s dirty-rate calculation"):
            raise held
    text = str(raised.value)
    assert "remoteDispatchDomainMigratePerform3Params" in text
    assert hypervisor.HELD_BY_MIGRATION_ADVICE in text
    # A lock held by anything else gets libvirt's words alone.
    other = "Timed out during operation: cannot acquire state change lock (held by agent=x)"
    assert hypervisor.reason_of(other) == other


def test_a_switch_made_without_an_answer_is_known_and_then_bounded(monkeypatch):
    # libvirt never answered, but the source is paused for postcopy: the VM
    # runs on the destination, so the job must not abort it, and a postcopy
    # whose job never ends is reported as split, not left waiting.
    dom = WedgedDomain(abort_answers=True, postcopy_started=True)
    dom.jobStats = lambda: {"memory_iteration": 3}  # type: ignore[method-assign]
    result, events, took = _run(monkeypatch, dom)
    assert result.switched_to_postcopy
    assert "abort" not in dom.calls and "pause-postcopy" in dom.calls
    assert result.state == "failed" and "split between the hosts" in (result.error or "")
    assert took < 10.0


def test_a_postcopy_that_never_took_over_is_reported_with_the_vm_on_the_source(monkeypatch):
    # The switch answered, then the job failed while the source still runs:
    # libvirt rolled back, so there is nothing to resume.
    dom = WedgedDomain(abort_answers=True)
    dom.migrateStartPostCopy = lambda: dom.ended.set()  # type: ignore[method-assign]
    result, events, took = _run(monkeypatch, dom)
    assert result.switched_to_postcopy and result.state == "failed"
    assert result.error == "postcopy never took over; the VM runs on the source"
    assert took < 5.0
