"""The migration job applies the policy's in-flight corrections to the domain.

The domain is a small fake: this tests the job's coordination (which libvirt
call each correction becomes), the decisions themselves are tested in
test_inflight.py.
"""

from __future__ import annotations

import dataclasses

from flexmig.modes.job import JobConfig, MigrationJob
from flexmig.modes.precopy import PrecopyMode
from flexmig.policy.decision import decide
from tests.unit.test_policy import _inputs

MIB = 2**20


class FakeDomain:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def migrateSetMaxDowntime(self, ms: int) -> None:
        self.calls.append(("downtime", ms))

    def suspend(self) -> None:
        self.calls.append(("suspend", None))

    def migrateStartPostCopy(self) -> None:
        self.calls.append(("postcopy", None))


def _job(budget_ms: int = 300) -> tuple[MigrationJob, FakeDomain, list[str]]:
    decision = dataclasses.replace(decide(_inputs()), max_downtime_ms=20)
    dom, events = FakeDomain(), []
    job = MigrationJob(
        dom,  # type: ignore[arg-type]
        "A",
        decision,
        PrecopyMode(),
        JobConfig("qemu+tcp://b/system", "tcp://b", downtime_budget_ms=budget_ms),
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


def test_a_slow_stream_raises_the_limit_then_stops_and_copies_at_the_caps():
    job, dom, events = _job()
    job._on_stats(_stats(iteration=9, processed_mib=600, remaining_mib=8, bps_mib=13))
    assert dom.calls == [("downtime", 300)]
    job._on_stats(_stats(iteration=10, processed_mib=640, remaining_mib=8, bps_mib=13))
    assert dom.calls == [("downtime", 300)]  # not capped yet: let precopy go on
    job._on_stats(_stats(iteration=31, processed_mib=1400, remaining_mib=8, bps_mib=13))
    assert dom.calls[-1] == ("suspend", None)
    job._on_stats(_stats(iteration=32, processed_mib=1500, remaining_mib=8, bps_mib=13))
    assert len(dom.calls) == 2  # paused once, nothing more
    assert any("stop-and-copy" in e for e in events)


def test_a_stream_as_fast_as_planned_is_left_alone():
    job, dom, _ = _job()
    job._on_stats(_stats(iteration=9, processed_mib=600, remaining_mib=1, bps_mib=300))
    assert dom.calls == []


def test_parallel_connections_become_libvirts_parallel_flag_and_parameter(monkeypatch):
    from flexmig import hypervisor
    from flexmig.modes import job as job_module

    started: list[tuple[dict, int]] = []
    monkeypatch.setattr(
        job_module.hypervisor,
        "start_migration",
        lambda dom, host, uri, params, flags, source="": started.append((params, flags))
        or (None, []),
    )
    for parallel in (1, 4):
        job = MigrationJob(
            FakeDomain(),  # type: ignore[arg-type]
            "A",
            decide(_inputs()),
            PrecopyMode(),
            JobConfig("qemu+tcp://b/system", "unix:///run/x.sock", parallel=parallel),
        )
        job._start(PrecopyMode().flags(job.decision))
    (single, single_flags), (multi, multi_flags) = started
    lv = hypervisor.libvirt
    assert lv.VIR_MIGRATE_PARAM_PARALLEL_CONNECTIONS not in single
    assert not single_flags & lv.VIR_MIGRATE_PARALLEL
    assert multi[lv.VIR_MIGRATE_PARAM_PARALLEL_CONNECTIONS] == 4
    assert multi_flags & lv.VIR_MIGRATE_PARALLEL
    assert multi[lv.VIR_MIGRATE_PARAM_URI] == "unix:///run/x.sock"
