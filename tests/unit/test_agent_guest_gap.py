"""A guest probe's heartbeat gap reported to the source agent: checked, kept in
the migration's summary, and learnt as the destination's first run only from a
plain precopy job."""

import json

import pytest

from agents.agent.client import AgentClient
from agents.agent.migration_records import MigrationRecord
from flexmig import exceptions
from flexmig.migration import downtime
from flexmig.migration.request import MigrationRequest
from tests.unit.test_agent_hardening import KEY, agent_conf, serving

DEST = "10.0.0.2"


def completed(agent, mid, mode="precopy", switched=False, downtime_ms=30, state="completed"):
    rec = MigrationRecord(id=mid, request=MigrationRequest(vm=f"vm-{mid}"), dest=DEST, state=state)
    rec.summary = {"mode": mode, "switched_to_postcopy": switched, "downtime_ms": downtime_ms}
    agent.migrations.records[mid] = rec
    return rec


def post(port, mid, body):
    return AgentClient("127.0.0.1", port, KEY).post(f"/v1/migrations/{mid}/guest-gap", body)


def test_a_precopy_jobs_gap_teaches_the_first_run_and_is_kept(tmp_path):
    with serving(agent_conf(tmp_path)) as (agent, port):
        for mid, gap, qemu in (("a1", 74.0, 31), ("a2", 50.0, 40), ("a3", 100.0, 20)):
            completed(agent, mid, downtime_ms=qemu)
            assert post(port, mid, {"gap_ms": gap}) == {"learnt": True, "why": None}
        link = agent.migrations.links[DEST]
        assert link.first_run_recent == pytest.approx([0.043, 0.010, 0.080])
        assert link.learnt_side.first_run_s == pytest.approx(0.043)
        assert agent.migrations.get("a1").summary["guest_observed_downtime_ms"] == 74.0
        saved = json.loads((tmp_path / "state" / "links.json").read_text())
        assert saved[DEST]["first_run_recent"] == pytest.approx([0.043, 0.010, 0.080])


def test_split_postcopy_and_unmeasured_jobs_are_kept_but_teach_nothing(tmp_path):
    with serving(agent_conf(tmp_path)) as (agent, port):
        completed(agent, "b1", mode="split")
        completed(agent, "b2", mode="precopy", switched=True)
        completed(agent, "b3", downtime_ms=None)
        for mid in ("b1", "b2", "b3"):
            reply = post(port, mid, {"gap_ms": 90})
            assert reply["learnt"] is False and reply["why"]
            assert agent.migrations.get(mid).summary["guest_observed_downtime_ms"] == 90
        assert DEST not in agent.migrations.links


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"gap_ms": -1}, "0-3600000"),
        ({"gap_ms": 4e6}, "0-3600000"),
        ({"gap_ms": "70"}, "wrong type"),
        ({"gap_ms": True}, "wrong type"),
        ({}, "missing field"),
        ({"gap_ms": 70, "more": 1}, "unknown field"),
    ],
)
def test_bad_reports_are_refused_and_change_nothing(tmp_path, body, match):
    with serving(agent_conf(tmp_path)) as (agent, port):
        completed(agent, "c1")
        with pytest.raises(exceptions.InvalidInput, match=match):
            post(port, "c1", body)
        assert "guest_observed_downtime_ms" not in agent.migrations.get("c1").summary
        assert DEST not in agent.migrations.links


def test_a_running_unknown_or_reported_migration_is_refused(tmp_path):
    with serving(agent_conf(tmp_path)) as (agent, port):
        completed(agent, "d1", state="running")
        with pytest.raises(exceptions.InvalidInput, match="is running"):
            post(port, "d1", {"gap_ms": 70})
        with pytest.raises(exceptions.FlexMigError, match="404"):
            post(port, "d9", {"gap_ms": 70})
        completed(agent, "d2")
        post(port, "d2", {"gap_ms": 70})
        with pytest.raises(exceptions.InvalidInput, match="reported already"):
            post(port, "d2", {"gap_ms": 20})
        assert agent.migrations.links[DEST].first_run_recent == pytest.approx([0.040])


def test_a_split_jobs_gap_teaches_splits_own_first_run_less_its_forecast_faults(tmp_path):
    """A split guest reads back pages its keeper dropped once it runs: its first
    run is its own, learnt apart from a precopy's, beside the faults its plan
    forecast after the resume and the share of it the plan left stored."""
    with serving(agent_conf(tmp_path)) as (agent, port):
        rec = completed(agent, "e1", mode="split", downtime_ms=35)
        rec.summary |= {"predicted_faults_after_resume_ms": 20.0, "predicted_stored_share": 0.4}
        assert post(port, "e1", {"gap_ms": 148.0}) == {"learnt": True, "why": None}
        completed(agent, "e2", downtime_ms=30)
        post(port, "e2", {"gap_ms": 85.0})
        link = agent.migrations.links[DEST]
        assert link.split_first_run_recent == [[0.4, pytest.approx(0.093)]]
        assert link.first_run_recent == pytest.approx([0.055])
        side = link.learnt_side
        assert side.first_run_s == pytest.approx(0.055)
        assert side.split_first_run == downtime.SplitFirstRun(pytest.approx(0.093))
        saved = json.loads((tmp_path / "state" / "links.json").read_text())
        assert saved[DEST]["split_first_run_recent"] == [[0.4, pytest.approx(0.093)]]


def test_split_jobs_at_several_budgets_teach_a_first_run_growing_with_the_share_stored(
    tmp_path,
):
    """The less of a split VM its budget holds, the more of its first touches
    fault: jobs at three budgets teach a line, and a roomy budget's forecast
    stays under a tight one's instead of sharing one median."""
    runs = [(0.3, 104), (0.6, 106), (0.8, 120), (0.3, 60), (0.6, 177), (0.8, 101)]
    with serving(agent_conf(tmp_path)) as (agent, port):
        for n, (share, first_run_ms) in enumerate(runs):
            rec = completed(agent, f"f{n}", mode="split", downtime_ms=40)
            rec.summary |= {
                "predicted_faults_after_resume_ms": 0.0,
                "predicted_stored_share": share,
            }
            post(port, f"f{n}", {"gap_ms": 40.0 + first_run_ms})
        line = agent.migrations.links[DEST].learnt_side.split_first_run
    assert line.per_share_s > 0
    one_median = 0.1125  # of the six first runs
    assert line.at(0.3) < one_median < line.at(0.8)


def test_a_saved_split_first_run_without_a_share_still_loads_and_counts(tmp_path):
    """links.json written before shares were recorded: its bare split first runs
    load (a TypeError would drop every learnt link) and count in the median."""
    conf = agent_conf(tmp_path)
    state = tmp_path / "state"
    state.mkdir(parents=True, exist_ok=True)
    (state / "links.json").write_text(json.dumps({DEST: {"split_first_run_recent": [0.09, 0.11]}}))
    with serving(conf) as (agent, _port):
        line = agent.migrations.links[DEST].learnt_side.split_first_run
    assert line == downtime.SplitFirstRun(pytest.approx(0.10))
