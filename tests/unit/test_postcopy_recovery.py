"""Postcopy recovery: the decisions (pure) and the job's resume loop over them.

The loop's libvirt edges are stubs (where the VM runs, the started migration);
what is tested is the behaviour the fault campaign needs: a resume over the
mover transport gets a fresh transport every attempt, a transport that cannot
be had yet is tried again with bounded backoff, and running out of time leaves
the VM paused and recoverable with an error that says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading

import libvirt
import pytest

from flexmig import exceptions
from flexmig.migration import libvirt_job, recovery
from flexmig.migration.libvirt_job import JobConfig, MigrationJob
from tests.unit.engine_fakes import make_plan

PAUSED_POSTCOPY = (libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_POSTCOPY)
RUNNING = (libvirt.VIR_DOMAIN_RUNNING, libvirt.VIR_DOMAIN_RUNNING_MIGRATED)

VIEW = recovery.RecoveryView(
    runs_on_source=False,
    landed_on_destination=False,
    attempts=0,
    time_left_s=120.0,
    fresh_transport=True,
)


# -- decisions -------------------------------------------------------------------
def test_where_the_vm_runs_decides_before_any_resume():
    assert recovery.next_step(dataclasses.replace(VIEW, runs_on_source=True)).kind == (
        recovery.SOURCE_RUNS
    )
    landed = dataclasses.replace(VIEW, landed_on_destination=True, time_left_s=-5)
    assert recovery.next_step(landed).kind == recovery.LANDED


def test_the_mover_transport_is_reopened_for_every_resume_qemu_tcp_never():
    for attempts in range(5):
        view = dataclasses.replace(VIEW, attempts=attempts)
        assert recovery.next_step(view).reopen
        assert not recovery.next_step(dataclasses.replace(view, fresh_transport=False)).reopen


def test_backoff_grows_and_is_capped():
    delays = [recovery.retry_delay_s(n) for n in range(12)]
    assert delays == sorted(delays)
    assert delays[0] == recovery.FIRST_DELAY_S
    assert max(delays) == recovery.MAX_DELAY_S


def test_no_attempt_whose_wait_would_cross_the_deadline():
    delay = recovery.retry_delay_s(4)
    assert recovery.next_step(dataclasses.replace(VIEW, attempts=4, time_left_s=delay)).kind == (
        recovery.GIVE_UP
    )
    step = recovery.next_step(dataclasses.replace(VIEW, attempts=4, time_left_s=delay + 0.1))
    assert (step.kind, step.delay_s) == (recovery.RESUME, delay)


def test_each_resume_transport_has_an_id_of_its_own():
    ids = {recovery.resume_transport_id("ab12cd34ef56", n) for n in range(1, 50)}
    assert len(ids) == 49 and "ab12cd34ef56" not in ids
    assert all(len(i) <= 32 and int(i, 16) >= 0 for i in ids)  # the agents' hex ids
    with pytest.raises(ValueError):
        recovery.resume_transport_id("ab12cd34ef56", 0)


# -- the job's loop ----------------------------------------------------------------
class Clock:
    """time for the job: sleeping advances it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class Dom:
    def name(self) -> str:
        return "vm1"


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(libvirt_job, "time", fake)
    return fake


def _job(monkeypatch, outcomes: list[str | None], reopen=None, timeout_s: float = 60.0):
    """A postcopy job whose resume attempts end with ``outcomes`` (None: completed)."""
    started: list[tuple[dict, int]] = []

    def start(dom, host, uri, params, flags, *source):
        started.append((params, flags))
        done = threading.Thread(target=lambda: None)
        done.start()
        done.join()
        error = outcomes.pop(0) if outcomes else "connection refused"
        return done, [] if error is None else [
            exceptions.BackendError(backend="libvirt", reason=error)
        ]

    monkeypatch.setattr(libvirt_job.hypervisor, "start_migration", start)
    monkeypatch.setattr(MigrationJob, "_source_state", lambda self: PAUSED_POSTCOPY)
    monkeypatch.setattr(MigrationJob, "_destination_state", lambda self: PAUSED_POSTCOPY)
    monkeypatch.setattr(MigrationJob, "_qemu_migration_status", lambda self: "postcopy-paused")
    events: list[str] = []
    config = JobConfig(
        "qemu+tcp://b/system",
        "unix:///run/flexmig/mig-ab12cd34ef56.sock",
        recovery_timeout_s=timeout_s,
        reopen_transport=reopen,
    )
    job = MigrationJob(Dom(), "A", make_plan(hot=True), config, on_event=events.append)  # type: ignore[arg-type]
    job.result.switched_to_postcopy = True
    return job, started, events


def test_a_mover_resume_runs_over_the_fresh_pairs_uri(monkeypatch, clock):
    opened: list[int] = []

    def reopen(attempt: int) -> str:
        opened.append(attempt)
        return (
            f"unix:///run/flexmig/mig-{recovery.resume_transport_id('ab12cd34ef56', attempt)}.sock"
        )

    job, started, events = _job(monkeypatch, ["stream broke", None], reopen)
    job._recover()
    assert job.result.state == "completed" and job.result.recovered
    assert opened == [1, 2]
    uris = [params[libvirt.VIR_MIGRATE_PARAM_URI] for params, _ in started]
    assert uris == [
        "unix:///run/flexmig/mig-ab12cd34ef560001.sock",
        "unix:///run/flexmig/mig-ab12cd34ef560002.sock",
    ]
    assert all(flags & libvirt.VIR_MIGRATE_POSTCOPY_RESUME for _, flags in started)


def test_no_resume_is_started_without_a_fresh_pair_and_it_is_tried_again(monkeypatch, clock):
    calls: list[int] = []

    def reopen(attempt: int) -> str:
        calls.append(attempt)
        if attempt <= 3:  # the fabric is still cut: the destination agent is unreachable
            raise exceptions.BackendError(backend="agent on B", reason="timed out")
        return "unix:///run/flexmig/mig-fresh.sock"

    job, started, events = _job(monkeypatch, [None], reopen)
    job._recover()
    assert job.result.state == "completed"
    assert calls == [1, 2, 3, 4] and len(started) == 1
    assert any("no fresh transport to resume over" in e for e in events)
    assert clock.slept == [recovery.retry_delay_s(n) for n in range(4)]


def test_out_of_time_the_vm_stays_paused_and_the_error_says_how_to_resume(monkeypatch, clock):
    def unreachable(attempt: int) -> str:
        raise exceptions.BackendError(backend="agent on B", reason="no route to host")

    job, started, events = _job(monkeypatch, [], unreachable, timeout_s=30.0)
    job._recover()
    assert job.result.state == "failed" and not job.result.recovered
    assert started == []  # nothing was ever resumed over the dead pair's socket
    error = job.result.error or ""
    assert "within 30 s" in error and "no route to host" in error
    assert "paused on both hosts" in error and "recoverable" in error
    assert "--postcopy-resume" in error and "qemu+tcp://b/system" in error
    assert sum(clock.slept) < 30.0  # no wait crossed the deadline


def test_over_qemu_tcp_the_same_uri_serves_again(monkeypatch, clock):
    job, started, _ = _job(monkeypatch, ["refused", "refused", None], reopen=None)
    job._recover()
    assert job.result.state == "completed"
    assert {params[libvirt.VIR_MIGRATE_PARAM_URI] for params, _ in started} == {
        "unix:///run/flexmig/mig-ab12cd34ef56.sock"
    }


def test_a_resume_qemu_carries_on_is_waited_for_not_torn_down(monkeypatch, clock):
    """libvirt 9.0 reports a resume failed that QEMU 10 completes (lab): its
    pair must live until the VM lands, no new pair is opened meanwhile."""
    opened: list[int] = []
    job, started, events = _job(monkeypatch, ["job 'migration in' failed"], opened.append)
    states = itertools.chain(
        ["postcopy-paused", "postcopy-recover", "postcopy-active"], itertools.repeat("completed")
    )
    monkeypatch.setattr(MigrationJob, "_qemu_migration_status", lambda self: next(states))
    # The source gives the VM up as migrated on the fifth look.
    source = iter([PAUSED_POSTCOPY] * 4 + [libvirt_job.SOURCE_MIGRATED])
    monkeypatch.setattr(MigrationJob, "_source_state", lambda self: next(source))
    monkeypatch.setattr(MigrationJob, "_destination_state", lambda self: RUNNING)
    job._recover()
    assert job.result.state == "completed" and job.result.recovered
    assert opened == [1] and len(started) == 1
    assert clock.slept[1:] == [recovery.WAIT_POLL_S] * 3
    # The landing is that resume completing, and the record says so.
    assert events[-1].startswith("postcopy resumed and completed (attempt 1; QEMU completed")
    assert "job 'migration in' failed" in events[-1]


def test_a_resume_call_libvirt_never_ends_is_not_the_end_of_recovery(monkeypatch, clock):
    job, started, events = _job(monkeypatch, ["stuck", None], reopen=None)
    real_watch = MigrationJob._watch
    calls = iter([True, False])

    def watch(self, worker):
        real_watch(self, worker)
        self._abandoned = next(calls)  # the first resume call never returned

    monkeypatch.setattr(MigrationJob, "_watch", watch)
    job._recover()
    assert job.result.state == "completed" and len(started) == 2
    assert any("did not end within" in e for e in events)


def test_a_destination_qemu_that_ended_is_not_resumed_into_and_the_error_says_why(
    monkeypatch, clock
):
    """The fault campaign killed the destination QEMU after the switch: the job
    tried 14 resumes for 120 s into a domain that no longer existed."""
    job, started, events = _job(monkeypatch, [], reopen=None)
    # A cut first (libvirt unreachable: no answer), then its answer.
    destination = iter([None, (libvirt.VIR_DOMAIN_SHUTOFF, libvirt.VIR_DOMAIN_SHUTOFF_CRASHED)])
    monkeypatch.setattr(MigrationJob, "_destination_state", lambda self: next(destination))
    job._recover()
    assert job.result.state == "failed" and not job.result.recovered
    assert len(started) == 1  # the attempt before libvirt said so; none after
    error = job.result.error or ""
    assert "destination QEMU of vm1 ended after the switch to postcopy" in error
    assert "start it again from its disks" in error and events[-1] == error


def test_a_job_held_by_a_stuck_resume_call_says_to_restart_libvirtd():
    stuck = "Requested operation is not valid: migration of domain vm1 " + recovery.STUCK_JOB
    assert "restart libvirtd on the source" in recovery.given_up(120, 7, stuck, "qemu+tcp://b")
    # A resume call the job stopped waiting for holds the job as well.
    abandoned = f"{recovery.ABANDONED_CALL} 60 s of its interruption"
    assert "restart libvirtd on the source" in recovery.given_up(120, 1, abandoned, "qemu+tcp://b")
    assert "restart libvirtd" not in recovery.given_up(120, 1, "B unreachable", "qemu+tcp://b")
    assert "restart libvirtd" not in recovery.given_up(120, 7, "connection refused", "x")


class HandleOfARestartedLibvirtd:
    """The job's domain handle once the source's libvirtd restarted: every call fails."""

    def name(self) -> str:
        return "vm1"

    def state(self) -> tuple[int, int]:
        raise libvirt.libvirtError("internal error: client socket is closed")


class Listing:
    """A fresh connection's view of one host: ``state`` of the VM, or None: no such domain."""

    def __init__(self, state: tuple[int, int] | None) -> None:
        self.vm_state = state

    def lookupByName(self, name: str):
        if self.vm_state is None:
            error = libvirt.libvirtError(f"Domain not found: no domain with matching name '{name}'")
            error.err = (libvirt.VIR_ERR_NO_DOMAIN, 0, "", 0, "", None, None, 0, 0)
            raise error
        state = self.vm_state
        return type("Dom", (), {"state": lambda _self: state})()


@pytest.mark.parametrize(
    ("source", "landed"),
    [
        (None, True),  # the transient source domain is gone: migrated
        ((libvirt.VIR_DOMAIN_SHUTOFF, libvirt.VIR_DOMAIN_SHUTOFF_MIGRATED), True),
        ((libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_POSTCOPY), False),
    ],
)
def test_where_the_vm_runs_is_read_afresh_after_a_source_libvirtd_restart(
    monkeypatch, source, landed
):
    """Campaign postcopy/qemu-tcp/restart-src-libvirtd/postcopy-switch: QEMU's
    stream outlived the restart and the VM landed on B, but the job asked its
    dead handle, could not tell, and reported the VM paused on both hosts."""
    hosts = {
        "qemu+tcp://a/system": Listing(source),
        "qemu+tcp://b/system": Listing(RUNNING),
    }

    @contextlib.contextmanager
    def connect(uri, _host):
        yield hosts[uri]

    monkeypatch.setattr(libvirt_job.hypervisor, "connect", connect)
    monkeypatch.setattr(MigrationJob, "_qemu_migration_status", lambda self: "")
    config = JobConfig("qemu+tcp://b/system", "tcp://b", source_libvirt_uri="qemu+tcp://a/system")
    job = MigrationJob(HandleOfARestartedLibvirtd(), "A", make_plan(hot=True), config)  # type: ignore[arg-type]
    view = job._recovery_view(0, deadline=1e12)
    assert view.landed_on_destination is landed
    assert not view.runs_on_source and not view.destination_gone


@pytest.mark.parametrize(
    ("destination", "gone"),
    [
        (None, True),  # no such domain: its QEMU ended, a transient domain with it
        ((libvirt.VIR_DOMAIN_SHUTOFF, libvirt.VIR_DOMAIN_SHUTOFF_CRASHED), True),
        (PAUSED_POSTCOPY, False),
        (RUNNING, False),
    ],
)
def test_nova_paths_source_is_read_on_the_connection_nova_keeps(monkeypatch, destination, gone):
    """Nova's driver hands the job its Host's connection (reopened by Nova after
    a libvirtd restart) rather than a URI: the job's own domain handle is
    never asked; the destination is asked once per step."""
    asked: list[str] = []

    @contextlib.contextmanager
    def connect(uri, _host):
        asked.append(uri)
        yield Listing(destination)

    monkeypatch.setattr(libvirt_job.hypervisor, "connect", connect)
    monkeypatch.setattr(MigrationJob, "_qemu_migration_status", lambda self: "")
    config = JobConfig(
        "qemu+tcp://b/system", "tcp://b", source_connection=lambda: Listing(PAUSED_POSTCOPY)
    )
    job = MigrationJob(HandleOfARestartedLibvirtd(), "A", make_plan(hot=True), config)  # type: ignore[arg-type]
    view = job._recovery_view(0, deadline=1e12)
    assert (view.destination_gone, view.runs_on_source, view.landed_on_destination) == (
        gone,
        False,
        False,
    )
    assert asked == ["qemu+tcp://b/system"]
    assert job._source_in_postcopy()


def _failed_precopy(monkeypatch, sources, destination=RUNNING, qemu="", check_s=30.0):
    monkeypatch.setattr(MigrationJob, "_source_state", lambda self: next(sources))
    monkeypatch.setattr(MigrationJob, "_destination_state", lambda self: destination)
    monkeypatch.setattr(MigrationJob, "_qemu_migration_status", lambda self: qemu)
    config = JobConfig("qemu+tcp://b/system", "tcp://b", landing_check_s=check_s)
    return MigrationJob(Dom(), "A", make_plan(), config)  # type: ignore[arg-type]


def test_a_precopy_libvirt_called_failed_that_qemu_completed_is_reported_landed(monkeypatch, clock):
    """Campaign */qemu-tcp/restart-src-libvirtd/switchover: the source libvirtd's
    restart ended libvirt's call ("End of file while reading data") while QEMU
    completed the migration; the job reported failed with the VM running on B."""
    # The restarting daemon cannot say, then the source has given the VM up.
    job = _failed_precopy(monkeypatch, iter([None, None, libvirt_job.SOURCE_MIGRATED]))
    assert job._landed_after_failure()
    assert clock.slept == [libvirt_job.LANDING_POLL_S] * 2


@pytest.mark.parametrize(
    ("sources", "qemu", "polls"),
    [
        ([RUNNING], "", 0),  # libvirt rolled back: the VM runs on the source
        ([(libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_USER)], "failed", 0),
        ([None, None, RUNNING], "", 2),
    ],
)
def test_a_failed_precopy_that_stayed_on_the_source_is_not_taken_for_landed(
    monkeypatch, clock, sources, qemu, polls
):
    job = _failed_precopy(monkeypatch, iter(sources), qemu=qemu)
    assert not job._landed_after_failure()
    assert len(clock.slept) == polls


def test_a_source_gone_without_the_vm_running_on_the_destination_is_not_landed(monkeypatch, clock):
    """Given up on the source yet not running on the destination: no landing is
    claimed, whatever happens next, once landing_check_s is spent."""
    job = _failed_precopy(
        monkeypatch, itertools.repeat(libvirt_job.NO_DOMAIN), destination=None, check_s=5.0
    )
    assert not job._landed_after_failure()
    assert clock.now >= 1005.0
