"""``flexmig drain`` in the lab: real guests leave host A on the plan, abort included.

Each move is the migration engine's plan (``flexmig.migration.planner``) and is
carried out by the source agent's engine with that plan's mode.  A slow start
of the destination QEMU on a busy machine is not a stall: the engine waits
``[migration] setup_timeout`` for the first page, ``stall_timeout`` after it.
"""

import pytest

from flexmig import drain_cli
from flexmig_lab import vm
from flexmig_lab.lab import Lab
from tests.functional.conftest import keep_logs, lab_missing_reason, leftovers

pytestmark = pytest.mark.lab

GUESTS = {
    "dr-idle": "dirtier:wss=16M,rate=0",
    "dr-mod": "dirtier:wss=32M,rate=1500",
    "dr-idle2": "dirtier:wss=16M,rate=0",
}


@pytest.fixture(scope="module")
def lab3():
    reason = lab_missing_reason()
    if reason:
        pytest.skip(reason)
    the_lab = Lab()
    the_lab.down()
    the_lab.up(3)
    yield the_lab
    keep_logs(the_lab)
    the_lab.down()
    assert leftovers(the_lab) == []


def _where(lab):
    return {name: vm.LabVM(lab, name).locate() for name in GUESTS}


def _assert_intact(lab):
    for name in GUESTS:
        check = vm.LabVM(lab, name).verify()
        assert (check["bad"], check["lost"]) == (0, 0), (name, check)


def _assert_ran_as_planned(plan, report):
    """Every completed migration ran in the mode of its move's engine plan, to its host."""
    planned = {m.vm: m for m in plan.moves}
    for out in report.outcomes:
        if out.state == "completed":
            assert (out.mode, out.dest) == (planned[out.vm].mode, planned[out.vm].dest), out


def test_dry_run_then_abort_then_the_rest(lab3):
    for name, workload in GUESTS.items():
        vm.create(lab3, "A", ram="256M", workload=workload, name=name)
    try:
        # Dry run: every VM planned, nothing moves.
        plan, inputs, backend = drain_cli.prepare(lab3, "A", max_concurrency=1)
        assert sorted(m.vm for m in plan.moves) == sorted(GUESTS)
        assert not plan.unplaceable and plan.concurrency == 1
        assert set(_where(lab3).values()) == {"A"}

        # Abort as soon as the first migration has started: it finishes, the
        # others are never started and keep running on A.
        runs = []

        def abort_on_first_start(text):
            if " started at " in text and runs:
                runs[0].abort()

        report = drain_cli.execute(
            lab3, plan, inputs, backend, 1, on_event=abort_on_first_start, started=runs.append
        )
        assert report.aborted
        assert report.counts() == {"completed": 1, "skipped": 2}, report.table()
        _assert_ran_as_planned(plan, report)
        first = next(o for o in report.outcomes if o.state == "completed")
        where = _where(lab3)
        assert where[first.vm] == first.dest != "A"
        skipped = sorted(o.vm for o in report.outcomes if o.state == "skipped")
        assert sorted(n for n, h in where.items() if h == "A") == skipped
        _assert_intact(lab3)

        # Drain again: the rest leave, A ends empty, every guest intact.
        plan, inputs, backend = drain_cli.prepare(lab3, "A", max_concurrency=2)
        assert sorted(m.vm for m in plan.moves) == skipped
        report = drain_cli.execute(lab3, plan, inputs, backend, 2, on_event=lambda _t: None)
        assert report.counts() == {"completed": 2}, report.table()
        _assert_ran_as_planned(plan, report)
        assert "A" not in _where(lab3).values()
        assert drain_cli.guests_ok(report)
        _assert_intact(lab3)
        assert "measured/predicted" in report.table()
    finally:
        for name in GUESTS:
            vm.destroy(lab3, name)
