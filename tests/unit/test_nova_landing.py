"""A completed job is recorded as a move only when the destination runs the VM.

Nova reads a source domain that is gone or not running as COMPLETED, which is
also what a VM destroyed on the source mid-migration looks like.  The Nova
monitor asks the destination's libvirt (``monitor.destination_runs``) and the
engine's pure rules (``flexmig.migration.landing``) weigh the answers: these
tests drive the monitor's end of a job against a destination libvirt double.
"""

from __future__ import annotations

import threading
import time
import types

import pytest

pytest.importorskip("nova", reason="Nova is not installed (tools/setup.sh installs it)")

from flexmig.migration import landing  # noqa: E402
from flexmig.migration.landing import Answer, Verdict  # noqa: E402
from nova_driver import monitor  # noqa: E402
from tests.unit.engine_fakes import make_plan  # noqa: E402

NO_DOMAIN = 42
URI = "qemu+tcp://dest/system"
UUID = "5e1f7d0c-0000-4000-8000-00000000d00d"


class LibvirtError(Exception):
    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code

    def get_error_code(self) -> int:
        return self.code


LV = types.SimpleNamespace(
    VIR_DOMAIN_JOB_NONE=0,
    VIR_DOMAIN_JOB_UNBOUNDED=2,
    VIR_DOMAIN_JOB_COMPLETED=3,
    VIR_DOMAIN_JOB_FAILED=4,
    VIR_DOMAIN_JOB_CANCELLED=5,
    VIR_ERR_NO_DOMAIN=NO_DOMAIN,
    libvirtError=LibvirtError,
)


class Domain:
    def __init__(self, active: bool) -> None:
        self.active = active

    def isActive(self) -> int:
        return int(self.active)


class DestinationLibvirt:
    """The destination host's libvirt: one scripted outcome per connection.

    An outcome is a Domain (found), "absent" (no such domain), "hang" (the
    call never returns), or an exception (the connection fails).
    """

    def __init__(self, *outcomes: object) -> None:
        self.outcomes = list(outcomes)
        self.opened: list[str] = []
        self.closed = 0

    def connect(self, uri: str) -> DestinationLibvirt:
        self.opened.append(uri)
        outcome = self.outcomes[min(len(self.opened), len(self.outcomes)) - 1]
        if isinstance(outcome, Exception):
            raise outcome
        self.current = outcome
        return self

    def lookupByUUIDString(self, uuid: str) -> Domain:
        assert uuid == UUID
        if self.current == "hang":
            threading.Event().wait(5)
        if not isinstance(self.current, Domain):
            raise LibvirtError(
                f"Domain not found: no domain with matching uuid '{uuid}'", NO_DOMAIN
            )
        return self.current

    def close(self) -> int:
        self.closed += 1
        return 0


@pytest.fixture
def sleeps(monkeypatch):
    slept: list[float] = []
    helpers = monitor.libvirt_migrate
    monkeypatch.setattr(helpers, "save_stats", lambda *a: None)
    monkeypatch.setattr(monitor.time, "sleep", slept.append)
    return slept


def _end_of_job(dest: DestinationLibvirt) -> list[str]:
    """The monitor reading COMPLETED from the source; what reached Nova's callbacks."""
    info = types.SimpleNamespace(type=LV.VIR_DOMAIN_JOB_COMPLETED, memory_total=0)
    guest = types.SimpleNamespace(get_job_info=lambda: info)
    watch = monitor.PlanMonitor(
        LV,
        None,
        make_plan(),
        types.SimpleNamespace(status="running"),
        15.0,
        5.0,
        {},
        destination=monitor.Destination(URI, dest.connect),
    )
    ended: list[str] = []
    watch.run(
        types.SimpleNamespace(uuid=UUID),
        guest,
        types.SimpleNamespace(done=lambda: True),
        lambda _info: ended.append("done"),
        lambda _info, status: ended.append(f"failed {status}"),
        lambda answers: ended.append(f"lost: {answers}"),
    )
    return ended


def test_a_vm_the_destination_runs_is_recorded_as_moved(sleeps):
    dest = DestinationLibvirt(Domain(active=True))
    assert _end_of_job(dest) == ["done"]
    assert dest.opened == [URI]  # asked once, at Nova's migration URI
    assert dest.closed == 1
    assert sleeps == []


def test_a_vm_the_destination_does_not_know_is_lost_after_three_asks(sleeps):
    dest = DestinationLibvirt("absent")
    assert _end_of_job(dest) == ["lost: not found, not found, not found"]
    assert len(dest.opened) == landing.ASKS == 3
    assert sleeps == [2.0, 2.0]


def test_a_vm_defined_but_not_running_on_the_destination_is_lost(sleeps):
    dest = DestinationLibvirt(Domain(active=False))
    assert _end_of_job(dest) == ["lost: not running, not running, not running"]


def test_an_unreachable_destination_leaves_novas_reading_with_a_warning(sleeps, caplog):
    dest = DestinationLibvirt(LibvirtError("unable to connect to server at 'dest:16509'"))
    assert _end_of_job(dest) == ["done"]
    assert len(dest.opened) == 3
    assert "could not be asked whether it runs the VM" in caplog.text
    assert "unable to connect" in caplog.text


def test_a_transient_error_then_an_answer_lands(sleeps):
    dest = DestinationLibvirt(LibvirtError("Cannot recv data: Connection reset"), Domain(True))
    assert _end_of_job(dest) == ["done"]
    assert len(dest.opened) == 2
    assert sleeps == [2.0]


def test_a_destination_that_never_answers_is_bounded_and_unanswered(monkeypatch, caplog):
    monkeypatch.setattr(landing, "ASK_TIMEOUT_S", 0.2)
    dest = DestinationLibvirt("hang")
    start = time.monotonic()
    answer = monitor.destination_runs(LV, monitor.Destination(URI, dest.connect), UUID)
    assert time.monotonic() - start < 2.0
    assert answer is Answer.UNANSWERED
    assert "Timed out after 0.2 s" in caplog.text


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        ([Answer.RUNS], Verdict.LANDED),
        ([Answer.NOT_FOUND, Answer.RUNS], Verdict.LANDED),
        ([Answer.NOT_RUNNING] * 3, Verdict.LOST),
        ([Answer.UNANSWERED, Answer.NOT_FOUND, Answer.UNANSWERED], Verdict.LOST),
        ([Answer.UNANSWERED] * 3, Verdict.UNKNOWN),
        ([], Verdict.UNKNOWN),
    ],
)
def test_the_verdict_weighs_every_answer(answers, expected):
    assert landing.verdict(answers) is expected


def test_confirm_stops_at_the_first_running_answer():
    answers = iter([Answer.UNANSWERED, Answer.RUNS, Answer.NOT_FOUND])
    slept: list[float] = []
    assert landing.confirm(lambda: next(answers), slept.append) == (
        Verdict.LANDED,
        [Answer.UNANSWERED, Answer.RUNS],
    )
    assert slept == [landing.INTERVAL_S]
