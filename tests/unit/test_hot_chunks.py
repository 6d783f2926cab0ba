"""The source's map of what the guest writes, and the destination taking it as a hint."""

from __future__ import annotations

import os
import pathlib
import threading
import time
import types

import pytest

from agents.agent import cachestat, hot_chunks, migrations, privileged, residency, split_store
from agents.agent.service import Agent
from flexmig import exceptions
from nova_driver import planning
from tests.unit.test_agent_hardening import agent_conf

MIB = 1 << 20


@pytest.fixture
def memory_file(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "vm1.ram"
    path.write_bytes(b"\1" * (8 * MIB))  # all dirty: written before the sample
    fd = os.open(path, os.O_RDONLY)
    try:
        if not cachestat.available(fd):
            pytest.skip("this kernel has no cachestat (Linux >= 6.5 on x86_64/arm64/riscv64)")
    finally:
        os.close(fd)
    return path


def test_only_chunks_written_during_the_interval_are_hot(memory_file, monkeypatch):
    def write_while_waiting(_seconds: float) -> None:
        fd = os.open(memory_file, os.O_WRONLY)
        try:
            for offset in (2 * MIB + 4096, 3 * MIB, 6 * MIB + 8192):
                os.pwrite(fd, b"\2" * 4096, offset)
        finally:
            os.close(fd)

    monkeypatch.setattr(hot_chunks.time, "sleep", write_while_waiting)
    runs = hot_chunks.written_chunks(str(memory_file), 8 * MIB, 1.0)
    # The file's earlier writes were written back first: only the interval's show,
    # with the rest of their folio where the filesystem caches 2 MiB folios.
    assert {2, 3, 6} <= hot_chunks.chunks_of(runs) <= {2, 3, 6, 7}


def test_a_quiet_guest_has_no_hot_chunks(memory_file, monkeypatch):
    monkeypatch.setattr(hot_chunks.time, "sleep", lambda _s: None)
    assert hot_chunks.written_chunks(str(memory_file), 8 * MIB, 0.5) == []


@pytest.mark.parametrize("seconds", [0, -1, 10.5])
def test_the_interval_is_bounded(memory_file, seconds):
    with pytest.raises(exceptions.InvalidInput, match="hot sample interval"):
        hot_chunks.written_chunks(str(memory_file), 8 * MIB, seconds)


def test_a_writeback_slower_than_its_timeout_gives_up(memory_file, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(residency, "sync_file_range", lambda *a: release.wait(5) and None)
    try:
        with pytest.raises(exceptions.Timeout, match="written back"):
            hot_chunks.written_chunks(str(memory_file), 8 * MIB, 1.0, timeout_s=0.2)
    finally:
        release.set()


@pytest.mark.parametrize(
    "bad",
    [
        "0-3",
        [[0]],
        [[0, 0]],
        [[-1, 2]],
        [[7, 2]],
        [[True, 1]],
        [["0", 1]],
        [[0, 1]] * (hot_chunks.MAX_RANGES + 1),
    ],
)
def test_malformed_hints_are_refused(bad):
    with pytest.raises(exceptions.InvalidInput, match="hot chunks"):
        hot_chunks.check_ranges(bad, 8 * MIB)


# -- the destination: POST /v1/split/hot -------------------------------------


@pytest.fixture
def agent_with_keeper(tmp_path):
    agent = Agent(agent_conf(tmp_path))
    agent.store._write_reservation("vm1", {"ram_bytes": 8 * MIB, "budget_bytes": 4 * MIB})
    agent.keepers["vm1"] = split_store.ResidencyKeeper(agent.store, "vm1", threading.Event())
    return agent


def test_the_keeper_takes_the_hint(agent_with_keeper):
    code, body = agent_with_keeper.split_hot({"vm": "vm1", "chunks": [[1, 3], [6, 1]]}, None)
    assert (code, body["hinted_chunks"]) == (200, 4)
    assert agent_with_keeper.keepers["vm1"].hinted == {1, 2, 3, 6}


def test_a_bad_hint_changes_nothing(agent_with_keeper):
    agent_with_keeper.split_hot({"vm": "vm1", "chunks": [[0, 1]]}, None)
    with pytest.raises(exceptions.InvalidInput):
        agent_with_keeper.split_hot({"vm": "vm1", "chunks": [[0, 1], [7, 5]]}, None)
    assert agent_with_keeper.keepers["vm1"].hinted == {0}


def test_a_hint_for_a_vm_without_reservation_is_refused(agent_with_keeper):
    with pytest.raises(exceptions.NotFound, match="split reservation"):
        agent_with_keeper.split_hot({"vm": "vm2", "chunks": []}, None)


def test_hinted_chunks_are_dropped_after_the_other_written_once_ones():
    resident, ages, writes = [256] * 4, [0, 0, 0x80, 0], [1, 1, 1, 2]
    assert residency.drop_order(resident, ages, writes, 512) == [1, 0]
    assert residency.drop_order(resident, ages, writes, 512, hinted={0, 1}) == [2, 3]


# -- the source: what a split migration sends -----------------------------------


class _DestAgent:
    def __init__(self, fail: Exception | None = None):
        self.posts: list[tuple[str, dict]] = []
        self.fail = fail

    def post(self, path: str, body: dict) -> dict:
        if self.fail:
            raise self.fail
        self.posts.append((path, body))
        return {}


def _source(hot, seconds: float = 1.0):
    service = migrations.MigrationService.__new__(migrations.MigrationService)
    service.conf = types.SimpleNamespace(
        agent=types.SimpleNamespace(split_hot_sample_seconds=seconds)
    )
    service.hot_chunks = hot
    service.hot_ahead = {}
    record = types.SimpleNamespace(
        id="m1", vm="vm1", events=[], request=types.SimpleNamespace(mode="split")
    )
    record.event = record.events.append
    return service, record


def test_the_source_sends_what_it_sampled():
    asked = []
    service, record = _source(lambda vm, ram, s: asked.append((vm, ram, s)) or [[4, 2]])
    dest = types.SimpleNamespace(agent=_DestAgent())
    service._hint_hot_chunks(record, 64 * MIB, dest)
    assert asked == [("vm1", 64 * MIB, 1.0)]
    assert dest.agent.posts == [("/v1/split/hot", {"vm": "vm1", "chunks": [[4, 2]]})]
    assert "the guest wrote 2 MiB in 1 s" in record.events[0]


@pytest.mark.parametrize(
    ("hot", "fail", "says"),
    [
        (lambda *a: None, None, "has no writeback"),
        (lambda *a: (_ for _ in ()).throw(OSError(5, "EIO")), None, "not sent"),
        (lambda *a: [[0, 1]], exceptions.BackendError(backend="b", reason="gone"), "not sent"),
    ],
)
def test_no_hint_leaves_the_migration_to_the_stream(hot, fail, says):
    service, record = _source(hot)
    dest = types.SimpleNamespace(agent=_DestAgent(fail))
    service._hint_hot_chunks(record, 64 * MIB, dest)  # does not raise
    assert dest.agent.posts == [] and says in record.events[0]


def test_a_sample_taken_while_planning_is_the_one_sent():
    asked = []
    service, record = _source(lambda vm, ram, s: asked.append((vm, ram, s)) or [[4, 2]])
    service._hot_sampler(record)(64 * MIB)  # what plan() calls once it knows the RAM
    dest = types.SimpleNamespace(agent=_DestAgent())
    service._hint_hot_chunks(record, 64 * MIB, dest)
    assert asked == [("vm1", 64 * MIB, 1.0)]  # sampled once, ahead
    assert dest.agent.posts == [("/v1/split/hot", {"vm": "vm1", "chunks": [[4, 2]]})]
    assert "sampled while planning" in record.events[0] and service.hot_ahead == {}


@pytest.mark.parametrize(("mode", "seconds"), [("precopy", 1.0), ("postcopy", 1.0), ("auto", 0.0)])
def test_no_sample_ahead_where_split_cannot_come_or_sampling_is_off(mode, seconds):
    service, record = _source(lambda *a: pytest.fail("sampled"), seconds=seconds)
    record.request.mode = mode
    assert service._hot_sampler(record) is None


def test_a_sample_ahead_that_hangs_or_raises_gives_no_hint_and_says_why():
    release = threading.Event()
    hung = hot_chunks.SampleAhead(
        lambda: release.wait(5) and ([[0, 1]], ""), hot_chunks.no_runs, "t-hung"
    )
    started = time.monotonic()
    assert hung.answer(0.1) == (None, "the sample did not end within 0.1 s")
    assert time.monotonic() - started < 2.0
    release.set()
    assert hung.answer(2.0) == ([[0, 1]], "")

    def broken():
        raise RuntimeError("bug")

    failed = hot_chunks.SampleAhead(broken, hot_chunks.no_runs, "t-broken")
    runs, why = failed.answer(2.0)
    assert runs is None and "failed" in why


def test_sampling_turned_off_samples_nothing():
    service, record = _source(lambda *a: pytest.fail("sampled"), seconds=0.0)
    service._hint_hot_chunks(record, 64 * MIB, types.SimpleNamespace(agent=_DestAgent()))
    assert record.events == []


def test_the_privileged_side_rechecks_and_skips_memory_without_writeback(monkeypatch, tmp_path):
    privileged.agent_pctxt.set_client_mode(False)
    try:
        with pytest.raises(exceptions.InvalidInput):
            privileged.guest_hot_chunks("../x", MIB, 1.0)
        with pytest.raises(exceptions.InvalidInput):
            privileged.guest_hot_chunks("vm1", 0, 1.0)
        (tmp_path / "vm1.pid").write_text("123")
        monkeypatch.setattr(privileged, "LIBVIRT_PID_DIR", tmp_path)
        monkeypatch.setattr(privileged, "guest_ram_mapping", lambda pid, ram: ("/dev/shm/x", 0))
        monkeypatch.setattr(privileged, "filesystem_of", lambda path: "tmpfs")
        assert privileged.guest_hot_chunks("vm1", MIB, 1.0) is None
    finally:
        privileged.agent_pctxt.set_client_mode(True)


def test_the_source_agent_samples_for_novas_driver(tmp_path):
    agent = Agent(agent_conf(tmp_path, split_hot_sample_seconds=0.5))
    agent.migrations.hot_chunks = (
        lambda vm, ram, s: [[1, 2]] if (vm, ram, s) == ("vm1", MIB, 0.5) else None
    )
    code, body = agent.split_sample_hot({"vm": "vm1", "ram_bytes": MIB}, None)
    assert (code, body["chunks"]) == (200, [[1, 2]])
    with pytest.raises(exceptions.InvalidInput):
        agent.split_sample_hot({"vm": "../vm1", "ram_bytes": MIB}, None)
    # A VM not running here: no chunks, and why, not an error.
    agent.migrations.hot_chunks = lambda *a: (_ for _ in ()).throw(FileNotFoundError(2, "gone"))
    assert agent.split_sample_hot({"vm": "vm2", "ram_bytes": MIB}, None)[1]["chunks"] is None


def test_the_source_agent_samples_nothing_when_sampling_is_off(tmp_path):
    agent = Agent(agent_conf(tmp_path, split_hot_sample_seconds=0))
    agent.migrations.hot_chunks = lambda *a: pytest.fail("sampled")
    body = agent.split_sample_hot({"vm": "vm1", "ram_bytes": MIB}, None)[1]
    assert (body["chunks"], body["why"]) == (None, "sampling is off")


def test_novas_driver_hands_the_sample_to_the_destination():
    local = types.SimpleNamespace(post=lambda path, body: {"chunks": [[3, 5]], "seconds": 1.0})
    dest = _DestAgent()
    said = planning.hint_hot_chunks(local, dest, "vm1", 64 * MIB)  # type: ignore[arg-type]
    assert dest.posts == [("/v1/split/hot", {"vm": "vm1", "chunks": [[3, 5]]})]
    assert "5 MiB" in said


@pytest.mark.parametrize(
    ("answer", "fail", "says"),
    [
        ({"chunks": None, "why": "sampling is off"}, None, "no hot chunks"),
        (
            {"chunks": [[0, 1]], "seconds": 1.0},
            exceptions.BackendError(backend="b", reason="x"),
            "not sent",
        ),
    ],
)
def test_novas_driver_migrates_on_without_a_hint(answer, fail, says):
    local = types.SimpleNamespace(post=lambda path, body: answer)
    dest = _DestAgent(fail)
    assert says in planning.hint_hot_chunks(local, dest, "vm1", 64 * MIB)  # type: ignore[arg-type]
    assert dest.posts == []


@pytest.mark.parametrize("budget", [None, 240 * MIB])
def test_novas_driver_samples_while_planning_only_for_a_split_reservation(budget):
    from nova_driver import driver

    asked = []
    local = types.SimpleNamespace(
        post=lambda path, body: asked.append(body) or {"chunks": [[3, 5]], "seconds": 1.0}
    )
    dest = _DestAgent()
    drv = driver.FlexMigLibvirtDriver.__new__(driver.FlexMigLibvirtDriver)
    drv._local_agent = lambda: local
    drv._destination_agent = lambda offer: dest
    instance = types.SimpleNamespace(name="vm1", flavor=types.SimpleNamespace(memory_mb=64))
    hint = drv._hint_while_planning(instance, types.SimpleNamespace(split_budget_bytes=budget))
    if budget is None:
        assert hint is None and asked == []
        return
    assert "5 MiB" in hint.answer(5.0)
    assert asked == [{"vm": "vm1", "ram_bytes": 64 * MIB}]
    assert dest.posts == [("/v1/split/hot", {"vm": "vm1", "chunks": [[3, 5]]})]
