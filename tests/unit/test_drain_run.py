"""The drain loop (flexmig.drain_run) against a backend that keeps time itself."""

import threading
import time

import pytest

from flexmig import drain_run, exceptions
from flexmig.policy import drain
from flexmig.policy.dirty_model import DirtyModel

MIB = 2**20


class ClockBackend:
    """Each migration takes ``seconds[vm]`` of wall time (scaled down), or fails."""

    def __init__(self, seconds, fail=(), refuse=()):
        self.seconds = seconds
        self.fail = set(fail)
        self.refuse = set(refuse)
        self.started: dict[str, float] = {}
        self.ended: dict[str, float] = {}
        self.lock = threading.Lock()

    def start(self, move):
        if move.vm in self.refuse:
            raise exceptions.InvalidInput(what="VM", reason=f"{move.vm} refused")
        with self.lock:
            self.started[move.vm] = time.monotonic()
        return move.vm

    def poll(self, handle, move):
        elapsed = time.monotonic() - self.started[handle]
        if elapsed < self.seconds[handle]:
            return drain_run.Status("running", elapsed / self.seconds[handle])
        self.ended.setdefault(handle, time.monotonic())
        if handle in self.fail:
            return drain_run.Status("failed", note="libvirt said no; the VM runs on the source")
        return drain_run.Status("completed", 1.0, mode=move.mode)

    def overlapping(self, vm):
        s, e = self.started[vm], self.ended[vm]
        return [
            o
            for o in self.started
            if o != vm and self.started[o] < e and self.ended.get(o, 1e18) > s
        ]


IDLE = DirtyModel(0, 1)


def vm(name, touched=64, dirty=IDLE, postcopy=None):
    """``postcopy``: a filesystem userfaultfd cannot serve, holding its memory file."""
    return drain.DrainVM.sized(name, 256 * MIB, touched * MIB, dirty, True, postcopy or "tmpfs")


HOSTS = [drain.Candidate("B", 8192 * MIB, 8192 * MIB), drain.Candidate("C", 8192 * MIB, 8192 * MIB)]
FAST = drain.Fabric(400 * MIB, 400 * MIB, setup_s=1.0, switchover_s=0.05)


def run(vms, backend, max_concurrency=3, events=None):
    plan = drain.plan("A", vms, HOSTS, FAST, max_concurrency)
    runner = drain_run.DrainRun(
        plan, vms, HOSTS, backend, max_concurrency, (events or []).append, poll_s=0.01
    )
    return plan, runner


def test_runs_every_vm_within_the_concurrency():
    vms = [vm(f"v{i}") for i in range(6)]
    backend = ClockBackend({v.name: 0.1 for v in vms})
    plan, runner = run(vms, backend)
    report = runner.run()
    assert report.counts() == {"completed": 6}
    for v in vms:
        assert len(backend.overlapping(v.name)) <= 2 * (plan.concurrency - 1)
    assert "measured/predicted" in report.table()


def test_a_solo_migration_moves_alone():
    warm = DirtyModel(m_pages=65536, tau_s=0.5)
    vms = [vm(f"v{i}") for i in range(4)] + [vm("w", touched=256, dirty=warm, postcopy="ext4")]
    backend = ClockBackend({v.name: 0.1 for v in vms})
    plan, runner = run(vms, backend)
    assert next(m for m in plan.moves if m.vm == "w").solo
    runner.run()
    assert backend.overlapping("w") == []


def test_abort_starts_nothing_more_and_lets_running_finish():
    vms = [vm(f"v{i}") for i in range(6)]
    backend = ClockBackend({v.name: 0.3 for v in vms})
    plan, runner = run(vms, backend, max_concurrency=2)
    assert plan.concurrency == 2
    threading.Timer(0.1, runner.abort).start()
    report = runner.run()
    states = {o.vm: o.state for o in report.outcomes}
    assert sorted(states.values()) == ["completed"] * 2 + ["skipped"] * 4
    assert len(backend.started) == 2
    assert report.aborted and "aborted" in report.table()


def test_a_refused_or_failed_migration_does_not_stop_the_drain():
    vms = [vm(f"v{i}") for i in range(4)]
    backend = ClockBackend({v.name: 0.05 for v in vms}, fail={"v1"}, refuse={"v2"})
    _, runner = run(vms, backend)
    report = runner.run()
    states = {o.vm: o.state for o in report.outcomes}
    assert states == {"v0": "completed", "v1": "failed", "v2": "failed", "v3": "completed"}
    assert "not started" in next(o.note for o in report.outcomes if o.vm == "v2")


def test_a_slow_migration_makes_the_rest_replanned():
    vms = [vm(f"v{i}", touched=200) for i in range(5)]
    plan = drain.plan("A", vms, HOSTS, FAST, 1)
    first = plan.moves[0]
    planned = first.end_s - first.start_s
    # Scaled: the plan thinks in seconds; make the first run far past its plan.
    seconds = {v.name: 0.05 for v in vms}
    seconds[first.vm] = planned + drain_run.REPLAN_MIN_LATE_S + 0.5
    backend = ClockBackend(seconds)
    events: list[str] = []
    runner = drain_run.DrainRun(plan, vms, HOSTS, backend, 1, events.append, poll_s=0.01)
    report = runner.run()
    assert report.replans, events
    assert report.counts() == {"completed": 5}
    assert any("re-planned" in e for e in events)


class PacedBackend(ClockBackend):
    """Each migration takes ``pace[vm]`` times what its move (as started) planned."""

    def __init__(self, pace):
        super().__init__({})
        self.pace = pace

    def start(self, move):
        self.seconds[move.vm] = (move.end_s - move.start_s) * self.pace.get(move.vm, 1.0)
        return super().start(move)


def test_slowdowns_seen_one_after_another_multiply(monkeypatch):
    """The second slow VM was started on the re-plan: its slowdown is on top of
    the first's, and the rest is planned on both (the drain benchmark's re-plans
    each predicted the rest at the first plan's rate over the last factor only)."""
    fast = drain.Fabric(4000 * MIB, 4000 * MIB, setup_s=0.05, switchover_s=0.01)
    vms = [vm(f"v{i}") for i in range(4)]
    plan = drain.plan("A", vms, HOSTS, fast, 1)
    monkeypatch.setattr(drain_run, "REPLAN_MIN_LATE_S", 0.0)
    factors: list[float] = []
    real_replan = drain.replan

    def recording_replan(current, remaining, candidates, started, factor, max_concurrency):
        factors.append(factor)
        return real_replan(current, remaining, candidates, started, factor, max_concurrency)

    monkeypatch.setattr(drain, "replan", recording_replan)
    first, second = plan.moves[0].vm, plan.moves[1].vm
    backend = PacedBackend({first: 3.0, second: 2.0})
    runner = drain_run.DrainRun(plan, vms, HOSTS, backend, 1, print, poll_s=0.005)
    assert runner.run().counts() == {"completed": 4}
    # (A busy machine may make a later VM look slow too: a third re-plan.)
    assert len(factors) >= 2, runner.replans
    assert factors[0] >= 2.0
    assert factors[1] >= factors[0] * 1.5, factors
    assert runner.slowdown == factors[-1]


def test_unplaceable_vms_are_in_the_report_and_never_started():
    vms = [vm("a"), drain.DrainVM.sized("huge", 9000 * MIB, MIB, DirtyModel(0, 1))]
    backend = ClockBackend({"a": 0.02})
    _, runner = run(vms, backend)
    report = runner.run()
    assert {o.vm: o.state for o in report.outcomes} == {"a": "completed", "huge": "unplaceable"}
    assert "huge" not in backend.started


@pytest.mark.parametrize("max_concurrency", [1, 4])
def test_split_waits_for_its_destination(max_concurrency):
    hosts = [drain.Candidate("B", 1200 * MIB, 8192 * MIB)]
    vms = [
        vm("a"),
        vm("b"),
        drain.DrainVM.sized("big", 1024 * MIB, 200 * MIB, DirtyModel(0, 1), True),
    ]
    plan = drain.plan("A", vms, hosts, FAST, max_concurrency)
    big = next(m for m in plan.moves if m.vm == "big")
    assert big.mode == "split" and set(big.waits_for) == {"a", "b"}
    backend = ClockBackend({"a": 0.1, "b": 0.15, "big": 0.05})
    runner = drain_run.DrainRun(plan, vms, hosts, backend, max_concurrency, print, poll_s=0.01)
    runner.run()
    assert backend.started["big"] >= max(backend.ended["a"], backend.ended["b"])


def test_a_failing_replan_leaves_the_drain_running_on_its_plan(monkeypatch):
    vms = [vm(f"v{i}", touched=200) for i in range(4)]
    plan = drain.plan("A", vms, HOSTS, FAST, 1)
    first = plan.moves[0]
    seconds = {v.name: 0.05 for v in vms}
    seconds[first.vm] = first.end_s - first.start_s + drain_run.REPLAN_MIN_LATE_S + 0.5

    def broken(*_a, **_k):
        raise exceptions.InvalidInput(what="drain schedule", reason="cannot be made")

    monkeypatch.setattr(drain, "replan", broken)
    runner = drain_run.DrainRun(plan, vms, HOSTS, ClockBackend(seconds), 1, print, poll_s=0.01)
    report = runner.run()
    assert report.counts() == {"completed": 4}
    assert len(report.replans) == 1 and "re-plan failed" in report.replans[0]
