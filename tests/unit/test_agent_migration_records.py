"""The source agent's migration records across a restart (issue 18): kept on
disk, bounded, and settled from libvirt's view when the agent died mid-migration."""

import dataclasses
import json
import types

import pytest

from agents.agent import migration_records
from agents.agent.migration_records import MigrationRecord, Reconciler, RecordStore
from flexmig import exceptions
from flexmig.migration import reconcile
from flexmig.migration.reconcile import (
    ABSENT,
    MIGRATED,
    PAUSED,
    POSTCOPY_PAUSED,
    RUNNING,
    UNKNOWN,
)
from flexmig.migration.request import MigrationRequest
from flexmig.policy.transport import TransportChoice


class FakePlan:
    mode = "split"
    parallel = 1
    transport = TransportChoice("mover", "asked for")

    def explain(self) -> str:
        return "split: the destination has 140 MiB free"


MIB = 2**20


def record(mid="ab12cd34ef56", state="running", **fields):
    rec = MigrationRecord(
        id=mid,
        request=MigrationRequest(vm="vm1", mode="split", bandwidth_mib=24),
        dest="10.0.0.2",
        state=state,
        dest_access={"port": 9876, "libvirt_uri": "qemu+tcp://b/system", "migration_uri": ""},
        **fields,
    )
    rec.event("decided: split")
    return rec


# -- the decision ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("source", "job", "dest", "state", "action", "vm_here"),
    [
        (RUNNING, True, UNKNOWN, "running", reconcile.FOLLOW, False),
        (UNKNOWN, False, RUNNING, "running", reconcile.FOLLOW, False),
        (RUNNING, False, ABSENT, "failed", reconcile.SETTLE, True),
        (RUNNING, False, UNKNOWN, "failed", reconcile.SETTLE, True),
        (PAUSED, False, ABSENT, "failed", reconcile.RESUME_SOURCE, True),
        (MIGRATED, False, RUNNING, "completed", reconcile.SETTLE, False),
        (ABSENT, False, RUNNING, "completed", reconcile.SETTLE, False),
        (MIGRATED, False, PAUSED, "completed", reconcile.RESUME_DEST, False),
        (MIGRATED, False, UNKNOWN, "running", reconcile.FOLLOW, False),
        (MIGRATED, False, ABSENT, "failed", reconcile.SETTLE, False),
        (POSTCOPY_PAUSED, False, POSTCOPY_PAUSED, "failed", reconcile.SETTLE, False),
    ],
)
def test_reconcile_decides_from_where_libvirt_shows_the_vm(
    source, job, dest, state, action, vm_here
):
    verdict = reconcile.reconcile("running", source, job, dest)
    assert (verdict.state, verdict.action, verdict.vm_here) == (state, action, vm_here)


def test_a_vm_left_on_the_source_is_a_failure_that_names_the_restart():
    verdict = reconcile.reconcile("running", RUNNING, False, ABSENT)
    assert "agent restarted" in verdict.note and "stayed on the source" in verdict.note
    planning = reconcile.reconcile("planning", RUNNING, False, UNKNOWN)
    assert "before the migration started" in planning.note


def test_a_vm_on_the_destination_is_completed_with_the_outcome_read_from_libvirt():
    verdict = reconcile.reconcile("running", MIGRATED, False, RUNNING)
    assert verdict.note == "agent restarted during the migration; outcome read from libvirt"


def test_a_broken_postcopy_is_never_resumed_on_one_side_only():
    verdict = reconcile.reconcile("running", POSTCOPY_PAUSED, False, POSTCOPY_PAUSED)
    assert verdict.action == reconcile.SETTLE and "--postcopy-resume" in verdict.note


# -- on disk -----------------------------------------------------------------------
def test_a_reloaded_record_answers_with_the_same_keys_and_values(tmp_path):
    store = RecordStore(tmp_path, keep_ended=50)
    rec = record(plan=FakePlan(), phase="precopy", progress={"memory_processed": 5})
    store.save(rec)
    (loaded,) = RecordStore(tmp_path, keep_ended=50).load()
    before, after = rec.as_dict(), loaded.as_dict()
    assert after.keys() == before.keys()
    # events are JSON lists, compared as such
    assert json.loads(json.dumps(before)) == json.loads(json.dumps(after))
    assert after["explanation"] == "split: the destination has 140 MiB free"
    assert after["transport"]["transport"] == "mover"
    assert loaded.dest_access["port"] == 9876 and loaded.request == rec.request
    assert (tmp_path / "migrations" / f"{rec.id}.json").exists()


def test_a_record_without_a_plan_reloads_without_one(tmp_path):
    store = RecordStore(tmp_path, keep_ended=5)
    store.save(record(state="planning"))
    (loaded,) = store.load()
    assert loaded.as_dict()["mode"] is None and loaded.as_dict()["explanation"] is None


def test_only_the_newest_ended_records_are_kept_and_running_ones_always(tmp_path):
    store = RecordStore(tmp_path, keep_ended=3)
    for n in range(6):
        store.save(record(mid=f"{n:012x}", state="completed", ended=1000.0 + n))
    store.save(record(mid="aaaaaaaaaaaa", state="running"))
    names = sorted(p.stem for p in (tmp_path / "migrations").glob("*.json"))
    assert names == ["000000000003", "000000000004", "000000000005", "aaaaaaaaaaaa"]
    # a tighter bound on the next start prunes what the files hold
    loaded = RecordStore(tmp_path, keep_ended=1).load()
    assert {r.id for r in loaded} == {"000000000005", "aaaaaaaaaaaa"}
    assert len(list((tmp_path / "migrations").glob("*.json"))) == 2


def test_unreadable_records_and_unfinished_writes_are_skipped(tmp_path):
    store = RecordStore(tmp_path, keep_ended=5)
    store.save(record())
    folder = tmp_path / "migrations"
    (folder / "0123456789ab.json").write_text("{not json")
    (folder / "ffffffffffff.json").write_text(json.dumps({"format": 99, "id": "ffffffffffff"}))
    (folder / "ab12cd34ef56.tmp").write_text("half a rec")
    assert [r.id for r in store.load()] == ["ab12cd34ef56"]
    assert not (folder / "ab12cd34ef56.tmp").exists()


def test_a_record_that_cannot_be_written_does_not_fail_the_migration(tmp_path):
    (tmp_path / "migrations").write_text("a file where the folder goes")
    RecordStore(tmp_path, keep_ended=5).save(record())  # logged, not raised


# -- settling a record a dead agent left -------------------------------------------
class FakeDestAgent:
    address = "10.0.0.2"

    def __init__(self):
        self.posts = []

    def post(self, path, body):
        self.posts.append((path, body))
        return {"rounds": 3}


def reconciler(tmp_path, views):
    """A reconciler whose libvirt reads come from ``views``: (source, job, dest) in turn."""
    dest_agent = FakeDestAgent()
    rec = Reconciler("A", "qemu:///system", RecordStore(tmp_path, 50), lambda a, p: dest_agent)
    rec.poll_s = 0.0
    seen = iter(views)
    current = {}

    def source_view(vm):
        current["v"] = next(seen)
        source, job, _ = current["v"]
        return migration_records.SourceView(source, job, {"memory_processed": 7} if job else {})

    rec.source_view = source_view
    rec.dest_view = lambda vm, dest: current["v"][2]
    return rec, dest_agent


def test_a_job_still_running_is_followed_until_the_vm_lands(tmp_path):
    rec, dest_agent = reconciler(
        tmp_path, [(RUNNING, True, UNKNOWN), (RUNNING, True, UNKNOWN), (MIGRATED, False, RUNNING)]
    )
    mig = record(saved_plan={**migration_records.NO_PLAN, "mode": "precopy",
                             "transport": {"transport": "qemu-tcp"}})  # fmt: skip
    mig.request = dataclasses.replace(mig.request, mode="precopy")
    rec.follow(mig)
    assert mig.state == "completed" and mig.error is None and mig.ended is not None
    assert mig.events[-1][1] == reconcile.FROM_LIBVIRT
    assert mig.summary["outcome_from"] == "libvirt"
    # the dead agent's early writeback on the destination is ended
    assert dest_agent.posts == [("/v1/incoming/writeback", {"vm": "vm1", "active": False})]
    assert mig.writeback_rounds == 3
    (saved,) = RecordStore(tmp_path, 50).load()
    assert saved.state == "completed"


def test_a_split_vm_left_on_the_source_has_its_reservation_released(tmp_path):
    rec, dest_agent = reconciler(tmp_path, [(RUNNING, False, ABSENT)])
    mig = record(plan=FakePlan())
    rec.follow(mig)
    assert mig.state == "failed" and "stayed on the source" in mig.error
    assert ("/v1/split/cleanup", {"vm": "vm1"}) in dest_agent.posts
    assert ("/v1/mover/finish", {"migration_id": mig.id, "abort": True}) in dest_agent.posts


def test_a_completed_split_keeps_its_reservation(tmp_path):
    rec, dest_agent = reconciler(tmp_path, [(MIGRATED, False, RUNNING)])
    mig = record(plan=FakePlan())
    rec.follow(mig)
    assert mig.state == "completed"
    assert all(path != "/v1/split/cleanup" for path, _ in dest_agent.posts)


def test_a_view_that_never_settles_ends_failed_after_the_timeout(tmp_path):
    rec, _ = reconciler(tmp_path, [(UNKNOWN, False, UNKNOWN)] * 1000)
    rec.timeout_s = 0.0
    mig = record(state="planning")
    rec.follow(mig)
    assert mig.state == "failed" and "did not settle" in mig.error


def test_a_record_without_the_destinations_port_is_settled_from_the_source_alone(tmp_path):
    rec, dest_agent = reconciler(tmp_path, [(RUNNING, False, UNKNOWN)])
    mig = record()
    mig.dest_access = {}
    rec.follow(mig)
    assert mig.state == "failed" and dest_agent.posts == []


def test_a_paused_source_is_resumed_only_if_still_paused(tmp_path, monkeypatch):
    rec, _ = reconciler(tmp_path, [(PAUSED, False, ABSENT)])
    resumed = []
    monkeypatch.setattr(rec, "_resume", lambda uri, host, vm: resumed.append(host) or "")
    mig = record()
    rec.follow(mig)
    assert resumed == ["A"] and mig.state == "failed"


def test_the_service_reloads_records_and_follows_the_unended(tmp_path, monkeypatch):
    from agents.agent import migrations

    store = RecordStore(tmp_path, 50)
    store.save(record(mid="111111111111", state="completed", ended=5.0))
    store.save(record(mid="222222222222", state="running"))
    conf = types.SimpleNamespace(
        agent=types.SimpleNamespace(
            state_dir=str(tmp_path),
            migration_records_kept=50,
            libvirt_uri="qemu:///system",
            reconcile_timeout=3600,
        )
    )
    monkeypatch.setattr(migrations.movers, "rdma_provider_present", lambda: False)
    options = migrations.EngineOptions(converge_timeout_s=45.0)
    service = migrations.MigrationService("A", conf, options=options)
    assert service.get("111111111111").state == "completed"
    started = []
    monkeypatch.setattr(
        Reconciler,
        "start",
        lambda self, r: started.append((r.id, self.converge_timeout_s, self.timeout_s)),
    )
    assert [r.id for r in service.reconcile_unended(lambda a, p: None)] == ["222222222222"]
    # the engine's [migration] converge_timeout, the agent's [agent] reconcile_timeout
    assert started == [("222222222222", 45.0, 3600.0)]


def test_a_precopy_nobody_drives_is_aborted_once_it_iterates_without_converging(tmp_path):
    """The campaign's postcopy/mover/kill-src-agent/round run: the agent died before
    its switch, and libvirt's precopy iterated for 10 min (159 rounds)."""
    rec, dest_agent = reconciler(tmp_path, [])
    rec.converge_timeout_s = 0.0
    rounds = iter(range(10, 100))
    aborted = []

    def source_view(vm):
        if aborted:  # libvirt rolled back: the VM runs whole on the source
            return migration_records.SourceView(RUNNING, False, {})
        stats = {"memory_iteration": next(rounds), "memory_remaining": 9 * MIB}
        return migration_records.SourceView(RUNNING, True, stats)

    rec.source_view = source_view
    rec.dest_view = lambda vm, dest: ABSENT
    rec.abort_job = aborted.append
    mig = record(saved_plan={**migration_records.NO_PLAN, "mode": "postcopy",
                             "transport": {"transport": "mover"}})  # fmt: skip
    rec.follow(mig)
    assert aborted == ["vm1"]
    texts = [text for _ts, text in mig.events]
    assert any(t.startswith("aborted libvirt's precopy: 4 rounds") for t in texts), texts
    assert mig.state == "failed" and "stayed on the source" in mig.error
    assert mig.error.startswith(reconcile.RESTARTED + ": aborted libvirt's precopy")
    assert ("/v1/mover/finish", {"migration_id": mig.id, "abort": True}) in dest_agent.posts


def test_a_converging_or_long_first_round_precopy_or_a_postcopy_is_never_aborted(tmp_path):
    def job(domain, rounds, remaining):
        views = [
            migration_records.SourceView(domain, True, {"memory_iteration": r,
                                                        "memory_remaining": m})
            for r, m in zip(rounds, remaining, strict=True)
        ]  # fmt: skip
        return [*views, migration_records.SourceView(reconcile.MIGRATED, False, {})]

    for views in (
        job(RUNNING, range(1, 9), [2**k * MIB for k in range(8, 0, -1)]),  # converging
        job(RUNNING, [1] * 8, [300 * MIB] * 8),  # one long first round
        job(reconcile.POSTCOPY_PAUSED, range(1, 9), [9 * MIB] * 8),
    ):
        rec, _ = reconciler(tmp_path, [])
        seen = iter(views)
        rec.source_view = lambda vm, seen=seen: next(seen)
        rec.dest_view = lambda vm, dest: RUNNING
        rec.converge_timeout_s = 0.0
        rec.abort_job = lambda vm: pytest.fail("aborted")
        mig = record(saved_plan={**migration_records.NO_PLAN, "mode": "postcopy"})
        rec.follow(mig)
        assert mig.state == "completed"


def test_the_service_keeps_in_memory_only_the_ended_records_the_files_keep(tmp_path, monkeypatch):
    from agents.agent import migrations

    conf = types.SimpleNamespace(
        agent=types.SimpleNamespace(
            state_dir=str(tmp_path),
            migration_records_kept=2,
            libvirt_uri="qemu:///system",
            split_hot_sample_seconds=1.0,
        )
    )
    monkeypatch.setattr(migrations.movers, "rdma_provider_present", lambda: False)
    service = migrations.MigrationService("A", conf, options=migrations.EngineOptions())

    def refuse(request, dest, on_ram_bytes=None):
        raise exceptions.InvalidInput(what="VM", reason="no room")

    monkeypatch.setattr(service, "plan", refuse)
    running = record(mid="000000000000")
    service.records[running.id] = running
    ids = [f"{n:012d}" for n in range(1, 6)]
    for mid in ids:
        ended = record(mid=mid)
        service.records[mid] = ended
        service._run(ended, None)
        assert ended.state == "failed" and "no room" in ended.error
    assert sorted(service.records) == ["000000000000", *ids[-2:]]
    assert sorted(p.stem for p in (tmp_path / "migrations").glob("*.json")) == sorted(ids[-2:])
