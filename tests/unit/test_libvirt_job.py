"""The agent's libvirt job carries out the controller's actions on the domain.

The domain is a small fake: this tests the job's coordination (which libvirt
call each action becomes); the decisions are tested in test_controller.py
and test_inflight.py.
"""

from __future__ import annotations

import dataclasses

import libvirt

from flexmig.migration.libvirt_job import JobConfig, MigrationJob
from tests.unit.engine_fakes import make_plan

MIB = 2**20


class FakeDomain:
    def __init__(self, refuse: set[str] | None = None) -> None:
        self.calls: list[tuple[str, object]] = []
        self.refuse = refuse or set()

    def _call(self, name: str, arg: object = None) -> None:
        if name in self.refuse:
            raise libvirt.libvirtError(f"{name} refused")
        self.calls.append((name, arg))

    def migrateSetMaxDowntime(self, ms: int) -> None:
        self._call("downtime", ms)

    def suspend(self) -> None:
        self._call("suspend")

    def migrateStartPostCopy(self) -> None:
        self._call("postcopy")

    def abortJob(self) -> None:
        self._call("abort")

    def abortJobFlags(self, flags: int) -> None:
        self._call("pause-postcopy", flags)


def _job(plan=None, dom=None) -> tuple[MigrationJob, FakeDomain, list[str]]:
    plan = plan or make_plan()
    plan = dataclasses.replace(
        plan, decision=dataclasses.replace(plan.decision, max_downtime_ms=20)
    )
    dom, events = dom or FakeDomain(), []
    job = MigrationJob(
        dom,  # type: ignore[arg-type]
        "A",
        plan,
        JobConfig("qemu+tcp://b/system", "tcp://b"),
        on_event=events.append,
    )
    return job, dom, events


def _stats(iteration: int, processed_mib: int, remaining_mib: int, bps_mib: int) -> dict:
    return {
        "memory_iteration": iteration,
        "memory_processed": processed_mib * MIB,
        "memory_remaining": remaining_mib * MIB,
        "memory_bps": bps_mib * MIB,
    }


def _feed(job: MigrationJob, stats: dict, now: float = 0.0) -> None:
    for action in job.control.on_stats(stats, now):
        job._apply(action, stats)


def test_a_slow_stream_raises_the_limit_then_stops_and_copies_at_the_caps():
    job, dom, events = _job()
    _feed(job, _stats(iteration=9, processed_mib=600, remaining_mib=8, bps_mib=13))
    assert dom.calls == [("downtime", 300)]
    _feed(job, _stats(iteration=10, processed_mib=640, remaining_mib=8, bps_mib=13))
    assert dom.calls == [("downtime", 300)]  # not capped yet: let precopy go on
    _feed(job, _stats(iteration=31, processed_mib=1400, remaining_mib=8, bps_mib=13))
    assert dom.calls[-1] == ("suspend", None)
    _feed(job, _stats(iteration=32, processed_mib=1500, remaining_mib=8, bps_mib=13))
    assert len(dom.calls) == 2  # paused once, nothing more
    assert any("stop-and-copy" in e for e in events)


def test_a_stream_as_fast_as_planned_is_left_alone():
    job, dom, _ = _job()
    _feed(job, _stats(iteration=9, processed_mib=600, remaining_mib=1, bps_mib=300))
    assert dom.calls == []


def test_a_refused_correction_is_reported_and_tried_again():
    job, dom, events = _job(dom=FakeDomain(refuse={"downtime"}))
    _feed(job, _stats(iteration=9, processed_mib=600, remaining_mib=8, bps_mib=13))
    assert any("libvirt refused to set_downtime" in e for e in events)
    assert job.control.limit_ms == 20  # not applied: the controller still has the old one
    dom.refuse.clear()
    _feed(job, _stats(iteration=10, processed_mib=640, remaining_mib=8, bps_mib=13))
    assert dom.calls == [("downtime", 300)]


def test_a_stall_aborts_a_precopy_and_pauses_a_postcopy():
    job, dom, events = _job()
    _feed(job, _stats(1, 10, 100, 10), now=0.0)
    _feed(job, _stats(1, 10, 100, 10), now=16.0)  # stall_timeout 15 s
    assert dom.calls == [("abort", None)]
    assert "interrupting: no progress for 15 s" in events
    job.result.switched_to_postcopy = True
    _feed(job, {}, now=40.0)  # no statistics at all is no progress too
    assert dom.calls[-1] == ("pause-postcopy", libvirt.VIR_DOMAIN_ABORT_JOB_POSTCOPY)


def test_the_plans_switch_becomes_migrate_start_postcopy():
    job, dom, events = _job(plan=make_plan(hot=True, file_backed=False))
    after = job.plan.decision.postcopy_after_round
    _feed(job, _stats(after, 512, 200, 300))
    assert dom.calls == []
    _feed(job, _stats(after + 1, 700, 200, 300))
    assert dom.calls == [("postcopy", None)]
    assert job.result.switched_to_postcopy
    assert events == [f"switched to postcopy after round {after}"]


def test_parallel_connections_become_libvirts_parallel_flag_and_parameter(started_migrations):
    started = started_migrations
    for parallel in (1, 4):
        plan = dataclasses.replace(make_plan(), parallel=parallel)
        job = MigrationJob(
            FakeDomain(),  # type: ignore[arg-type]
            "A",
            plan,
            JobConfig("qemu+tcp://b/system", "unix:///run/x.sock"),
        )
        job._start(job.flags())
    (single, single_flags), (multi, multi_flags) = started
    lv = libvirt
    assert lv.VIR_MIGRATE_PARAM_PARALLEL_CONNECTIONS not in single
    assert not single_flags & lv.VIR_MIGRATE_PARALLEL
    assert multi[lv.VIR_MIGRATE_PARAM_PARALLEL_CONNECTIONS] == 4
    assert multi_flags & lv.VIR_MIGRATE_PARALLEL
    assert multi[lv.VIR_MIGRATE_PARAM_URI] == "unix:///run/x.sock"
