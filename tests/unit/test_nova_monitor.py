"""The Nova driver's executor: Nova's monitor loop carrying out the engine's controller.

Nova's own helpers (``nova.virt.libvirt.migration``) are replaced by recorders:
this tests which call each of the controller's actions becomes on Nova's
Guest, and that the job's end reaches Nova's callbacks.
"""

from __future__ import annotations

import collections
import types

import pytest

pytest.importorskip("nova", reason="Nova is not installed (tools/setup.sh installs it)")

from nova import exception as nova_exception  # noqa: E402

from nova_driver import monitor  # noqa: E402
from tests.unit.engine_fakes import make_plan  # noqa: E402

MIB = 2**20
LV = types.SimpleNamespace(
    VIR_DOMAIN_JOB_NONE=0,
    VIR_DOMAIN_JOB_UNBOUNDED=2,
    VIR_DOMAIN_JOB_COMPLETED=3,
    VIR_DOMAIN_JOB_FAILED=4,
    VIR_DOMAIN_JOB_CANCELLED=5,
    libvirtError=RuntimeError,
)


def _info(kind: int, iteration: int = 1, processed_mib: int = 0, remaining_mib: int = 1):
    return types.SimpleNamespace(
        type=kind,
        memory_iteration=iteration,
        memory_processed=processed_mib * MIB,
        memory_remaining=remaining_mib * MIB,
        memory_total=512 * MIB,
        memory_bps=300 * MIB,
    )


class FakeGuest:
    def __init__(self, infos: list) -> None:
        self.infos = collections.deque(infos)
        self.calls: list[str] = []

    def get_job_info(self):
        info = self.infos.popleft()
        if isinstance(info, Exception):
            raise info
        return info

    def abort_job(self) -> None:
        self.calls.append("abort")

    def pause(self) -> None:
        self.calls.append("pause")

    def migrate_configure_max_downtime(self, ms: int) -> None:
        self.calls.append(f"downtime {ms}")


@pytest.fixture
def nova_helpers(monkeypatch):
    seen: list[str] = []
    helpers = monitor.libvirt_migrate

    def switch(guest, instance, migration):
        seen.append("switch")
        migration.status = "running (post-copy)"

    monkeypatch.setattr(helpers, "run_tasks", lambda *a: seen.append("tasks"))
    monkeypatch.setattr(helpers, "save_stats", lambda *a: seen.append("save"))
    monkeypatch.setattr(helpers, "trigger_postcopy_switch", switch)
    monkeypatch.setattr(helpers, "run_recover_tasks", lambda *a: seen.append("recover"))
    monkeypatch.setattr(monitor.time, "sleep", lambda s: None)
    return seen


def _run(plan, infos, clock=None, monkeypatch=None, host=None):
    migration = types.SimpleNamespace(status="running")
    watch = monitor.PlanMonitor(LV, host, plan, migration, 15.0, 5.0, {})
    guest, ended = FakeGuest(infos), []
    watch.run(
        None,
        guest,
        types.SimpleNamespace(done=lambda: False),
        lambda info: ended.append("done"),
        lambda info, status: ended.append(f"failed {status}"),
    )
    return guest, ended, migration


def test_the_plans_switch_and_completion_reach_nova(nova_helpers):
    plan = make_plan(hot=True, file_backed=False)
    after = plan.decision.postcopy_after_round
    infos = [
        _info(LV.VIR_DOMAIN_JOB_UNBOUNDED, after, 512),
        _info(LV.VIR_DOMAIN_JOB_UNBOUNDED, after + 1, 700),
        _info(LV.VIR_DOMAIN_JOB_UNBOUNDED, after + 2, 800),
        _info(LV.VIR_DOMAIN_JOB_COMPLETED, after + 2, 900, 0),
    ]
    guest, ended, migration = _run(plan, infos)
    assert nova_helpers.count("switch") == 1
    assert migration.status == "running (post-copy)"
    assert ended == ["done"]


def test_a_slow_precopy_gets_the_budget_then_a_pause_at_the_caps(nova_helpers):
    plan = make_plan()
    tight = plan.decision.max_downtime_ms
    assert tight < 300
    infos = [
        # 200 MiB left at 300 MiB/s: ~670 ms, over the plan's tight limit and the budget
        _info(LV.VIR_DOMAIN_JOB_UNBOUNDED, 9, 600, 200),
        _info(LV.VIR_DOMAIN_JOB_UNBOUNDED, 31, 1600, 200),
        _info(LV.VIR_DOMAIN_JOB_FAILED, 31, 1600, 200),
    ]
    guest, ended, _ = _run(plan, infos)
    assert guest.calls == ["downtime 300", "pause"]
    assert "recover" in nova_helpers
    assert ended == ["failed None"]


def test_a_stalled_precopy_is_aborted_and_reported_as_failed_not_cancelled(
    nova_helpers, monkeypatch
):
    now = iter([0.0, 20.0, 40.0, 60.0])
    monkeypatch.setattr(monitor.time, "monotonic", lambda: next(now))
    infos = [
        _info(LV.VIR_DOMAIN_JOB_UNBOUNDED, 1, 100),
        _info(LV.VIR_DOMAIN_JOB_UNBOUNDED, 1, 100),
        _info(LV.VIR_DOMAIN_JOB_CANCELLED, 1, 100),
    ]
    guest, ended, _ = _run(make_plan(), infos)
    assert guest.calls == ["abort"]
    # aborted for a stall: Nova's recovery reports the migration failed, not cancelled
    assert ended == ["failed None"]


class FakeHost:
    """Nova's Host after the source libvirtd restarted: each lookup answers in turn."""

    def __init__(self, answers: list) -> None:
        self.answers = collections.deque(answers)
        self.lookups = 0

    def get_guest(self, instance):
        self.lookups += 1
        answer = self.answers.popleft()
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_a_dead_handle_after_a_libvirtd_restart_with_the_vm_gone_reads_completed(nova_helpers):
    closed = LV.libvirtError("internal error: client socket is closed")
    host = FakeHost(
        [
            nova_exception.HypervisorUnavailable(),  # the daemon is still starting
            nova_exception.InstanceNotFound(instance_id="vm"),  # it migrated the VM away
        ]
    )
    infos = [_info(LV.VIR_DOMAIN_JOB_UNBOUNDED, 1, 100), closed, closed]
    _, ended, _ = _run(make_plan(), infos, host=host)
    assert host.lookups == 2
    assert ended == ["done"]  # not Nova's FAILED and rollback of the destination


def test_a_dead_handle_with_the_vm_still_here_asks_the_fresh_handle(nova_helpers):
    closed = LV.libvirtError("End of file while reading data: Input/output error")
    fresh = FakeGuest([_info(LV.VIR_DOMAIN_JOB_FAILED, 1, 100)])
    host = FakeHost([fresh])
    _, ended, _ = _run(make_plan(), [_info(LV.VIR_DOMAIN_JOB_UNBOUNDED, 1, 100), closed], host=host)
    assert not fresh.infos  # the fresh handle answered the job's end
    assert ended == ["failed None"]
