"""The Nova monitor's libvirt calls are bounded: a switch that never answers aborts
the precopy (the VM is whole on the source) instead of holding the monitor."""

from __future__ import annotations

import collections
import threading
import time

import libvirt
import pytest

pytest.importorskip("nova")

from nova_driver import monitor  # noqa: E402
from tests.unit.engine_fakes import make_plan  # noqa: E402


class StuckGuest:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def migrate_start_postcopy(self) -> None:
        self.calls.append("switch")
        threading.Event().wait(30)

    def abort_job(self) -> None:
        self.calls.append("abort")

    def get_job_info(self) -> None:
        threading.Event().wait(30)

    def migrate_configure_max_downtime(self, ms: int) -> None:
        self.calls.append(f"downtime {ms}")
        threading.Event().wait(30)

    def pause(self) -> None:
        self.calls.append("pause")
        threading.Event().wait(30)


class Migration:
    status = "running"

    def save(self) -> None:
        pass


def _monitor() -> monitor.PlanMonitor:
    return monitor.PlanMonitor(libvirt, None, make_plan(hot=True), Migration(), 0.3, 5.0, {})


def test_an_unanswered_switch_aborts_within_the_call_deadline(monkeypatch):
    monkeypatch.setattr(monitor, "CALL_TIMEOUT_S", 0.2)
    watch, guest = _monitor(), StuckGuest()
    start = time.monotonic()
    switch = monitor.controller.Action(monitor.controller.SWITCH, "the plan switches")
    watch._switch(guest, None, switch)
    assert time.monotonic() - start < 2.0
    assert guest.calls == ["switch", "abort"]
    assert not watch.control.switched
    assert "switch to postcopy" in (watch.state.aborted_for or "")


def test_job_info_that_never_comes_aborts_a_precopy_after_the_stall_timeout(monkeypatch):
    monkeypatch.setattr(monitor, "CALL_TIMEOUT_S", 0.2)
    watch, guest = _monitor(), StuckGuest()
    assert watch._job_info(guest) is None
    watch._unanswered(guest)
    assert guest.calls == []  # not yet past the stall timeout
    time.sleep(0.4)
    watch._unanswered(guest)
    assert guest.calls == ["abort"] and "no job info" in (watch.state.aborted_for or "")


def test_an_unanswered_raise_of_the_limit_leaves_the_monitor_watching(monkeypatch):
    # The CI's failure: virDomainMigrateSetMaxDowntime did not return for 5 min
    # and the monitor, inside it, watched nothing while the precopy never converged.
    monkeypatch.setattr(monitor, "CALL_TIMEOUT_S", 0.2)
    watch, guest = _monitor(), StuckGuest()
    raise_limit = monitor.controller.Action(monitor.controller.SET_DOWNTIME, "slow", 777)
    start = time.monotonic()
    watch._apply(raise_limit, None, guest, collections.deque())
    assert time.monotonic() - start < 2.0
    assert guest.calls == ["downtime 777"]
    assert watch.control.limit_ms != 777  # not done: the controller asks again


def test_an_unanswered_pause_is_bounded_and_the_guest_is_resumed_on_failure(monkeypatch):
    monkeypatch.setattr(monitor, "CALL_TIMEOUT_S", 0.2)
    watch, guest = _monitor(), StuckGuest()
    on_failure: collections.deque[str] = collections.deque()
    pause = monitor.controller.Action(monitor.controller.PAUSE_GUEST, "converge_timeout")
    for _ in range(2):
        watch._apply(pause, None, guest, on_failure)
    assert guest.calls == ["pause", "pause"]
    assert list(on_failure) == ["unpause"]  # a late pause is undone if the migration fails
    assert not watch.control.stopped
