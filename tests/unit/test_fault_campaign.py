"""The fault campaign's bookkeeping: which cells exist, how runs accumulate."""

import subprocess

import pytest

from tests.bench import fault_campaign as fc
from tests.bench import fault_runs


def _run(**kw):
    run = {"state": "failed", "error": "", "hosts": 1, "bad": 0, "lost": 0,
           "leftovers": [], "next_ok": True, "recovered": False}  # fmt: skip
    return run | kw


def test_cells_pair_movers_with_the_mover_transport_and_the_switch_with_postcopy():
    keys = {c.key for c in fc.cells()}
    assert "precopy/mover/kill-dst-mover/round" in keys
    assert not any("qemu-tcp/kill-" in k and "mover" in k.split("/")[2] for k in keys)
    assert not any(k.endswith("postcopy-switch") and not k.startswith("postcopy/") for k in keys)
    assert len(keys) == len(fc.cells())


def test_runs_accumulate_by_cell_and_losses_are_counted():
    cell = fc.cells()[0]
    results = {}
    fc.add_run(results, cell, _run(state="completed"))
    fc.add_run(results, cell, _run(hosts=0, leftovers=["reservation on B"], next_ok=False))
    row = results[cell.key]
    assert (row["runs"], row["completed"], row["failed"], row["vm_lost"]) == (2, 1, 1, 1)
    assert (row["leftovers"], row["next_ok"]) == (1, 1)
    assert row["notes"] == ["reservation on B"]
    table = fc.render_table(results)
    assert f"| {cell.key} | 2 | 1 | 1 | 1 |" in table


def test_sessions_take_the_cells_with_the_fewest_runs_first():
    first, second = fc.cells()[:2]
    results = {first.key: {"runs": 3}, second.key: {"runs": fc.TARGET_RUNS}}
    chosen = fc.choose(results, ["*"], 1)
    assert second not in chosen  # done
    assert chosen[-1] == first  # every other cell has 0 runs


def test_the_store_is_filled_only_where_guest_memory_is_a_file_in_it():
    filled = {c.key for c in fc.cells() if c.fault == "fill-dst-store"}
    assert {k.split("/")[0] for k in filled} == {
        mode for mode, kind in fc.MODES.items() if kind == "file"
    }
    assert "precopy/mover/fill-dst-store/switchover" in filled
    assert not any(k.startswith("postcopy/") for k in filled)  # anonymous memory


def test_runs_are_counted_by_the_lab_hosts_libvirt():
    cell = fc.cells()[0]
    results = {cell.key: {"runs": 2, "completed": 2, "failed": 0, "vm_lost": 0, "bad_pages": 0,
                          "lost_pages": 0, "leftovers": 0, "next_ok": 2, "recovered": 0,
                          "notes": []}}  # fmt: skip
    fc.add_run(results, cell, _run(libvirt="9.0.0"))
    fc.add_run(results, cell, _run(libvirt="11.3.0"))
    fc.add_run(results, cell, _run(libvirt="11.3.0"))
    assert results[cell.key]["libvirt"] == {"unrecorded": 2, "9.0.0": 1, "11.3.0": 2}
    assert f"- {cell.key}: 11.3.0: 2, 9.0.0: 1, unrecorded: 2" in fc.render_table(results)


def _cell(key):
    return next(c for c in fc.cells() if c.key == key)


def test_a_run_over_another_transport_is_not_applicable_not_counted():
    cell = _cell("postcopy/mover/kill-src-mover/postcopy-switch")
    why = fc.not_applicable(cell, {"transport": "qemu-tcp", "reason": "libvirt turns preempt on"})
    assert why == "ran over qemu-tcp, not mover: libvirt turns preempt on"
    results = {}
    fc.add_run(results, cell, _run(libvirt="11.3.0", not_applicable=why, leftovers=["x"]))
    row = results[cell.key]
    assert row["runs"] == 0 and row["not_applicable"] == {"11.3.0": 1}
    assert row["notes"] == ["(n/a run) x"]  # what it left is still shown
    fc.add_run(results, cell, _run(libvirt="9.0.0", state="completed", transport="mover"))
    assert (row["runs"], row["completed"], row["not_applicable"]) == (1, 1, {"11.3.0": 1})
    table = fc.render_table(results)
    assert f"| {cell.key} | 1 | 1 | 0 | 0 | 0 | 0 | 0 | 1 | 0 | 1 |" in table
    assert f"- {cell.key}: libvirt 11.3.0, 1 run(s): {why}" in table


def test_a_run_on_the_cells_transport_or_before_any_plan_applies():
    cell = _cell("precopy/qemu-tcp/cut-2s/round")
    assert fc.not_applicable(cell, {"transport": "qemu-tcp", "reason": "asked"}) is None
    assert fc.not_applicable(cell, None) is None  # refused or failed while planning


def test_cells_known_not_to_apply_on_this_libvirt_are_not_chosen_again():
    cell = _cell("postcopy/mover/cut-2s/round")
    results = {cell.key: {"runs": 0, "not_applicable": {"11.3.0": fc.NA_SKIP_AFTER}}}
    assert cell not in fc.choose(results, ["postcopy/mover/*"], 1, "11.3.0")
    assert cell in fc.choose(results, ["postcopy/mover/*"], 1, "9.0.0")


def test_leftovers_are_only_the_files_of_the_runs_own_migration():
    names = [
        "mover-1fe6a6c26d3a-send.ready",  # an earlier run's: not this one's to report
        "mover-1fe6a6c26d3a-send.log",
        "mover-ab12cd34ef56-recv.failed.log",  # kept by the agent: a diagnostic
        "mover-ab12cd34ef560001-send.token",  # a resume's pair of this migration
        "mig-ab12cd34ef56.sock",
        "split-fcfile.json",
    ]
    stray, kept, over = fc.run_files(names, "ab12cd34ef56")
    assert stray == ["mig-ab12cd34ef56.sock", "mover-ab12cd34ef560001-send.token"]
    assert kept == ["mover-ab12cd34ef56-recv.failed.log"]
    assert over == 0
    assert fc.run_files(names, "0123456789ab") == ([], [], 0)


def test_kept_logs_past_the_agents_bound_are_a_leftover():
    logs = [
        f"mover-{n:012x}-send.failed.log" for n in range(fc.agent_mover_files.KEPT_FAILED_LOGS + 2)
    ]
    assert fc.run_files(logs, "ffffffffffff")[2] == 2


def _record(state="running", phase="precopy", **progress):
    return {"state": state, "phase": phase, "progress": progress}


def test_a_round_is_reached_once_precopy_has_moved_bytes_not_at_its_first_statistics():
    # Issue 18: kill-src-mover at "round" fired while QEMU had not yet connected
    # to the mover ("Connection refused"), testing no mid-round kill.
    assert not fc.point_reached(_record(phase="planning"), "round")
    assert not fc.point_reached(_record(memory_processed=0, memory_total=2**28), "round")
    assert not fc.point_reached(_record(), "round")  # libvirt's job, no statistics yet
    assert fc.point_reached(_record(memory_processed=4096), "round")
    assert fc.point_reached(_record(state="failed", phase="planning"), "round")  # ended first


def test_the_other_points_are_reached_as_before():
    assert fc.point_reached(_record(phase="postcopy"), "postcopy-switch")
    assert not fc.point_reached(_record(memory_processed=4096), "postcopy-switch")
    near_end = _record(memory_total=1000, memory_remaining=99, memory_processed=901)
    assert fc.point_reached(near_end, "switchover")
    assert not fc.point_reached(_record(memory_total=1000, memory_remaining=100), "switchover")
    assert not fc.point_reached(_record(), "switchover")
    assert set(fc.POINT_WAITS) == set(fc.POINTS)


class _Agent:
    """The source agent's migration record, one answer per poll (the last repeats)."""

    def __init__(self, *records):
        self.records = list(records)

    def get(self, path):
        return self.records.pop(0) if len(self.records) > 1 else self.records[0]


def test_the_round_waits_for_bytes_and_a_timeout_says_what_it_waited_for(monkeypatch):
    monkeypatch.setattr(fc.random, "uniform", lambda a, b: 0.0)
    campaign = fc.Campaign(None)  # type: ignore[arg-type]
    moving = _record(memory_processed=4096)
    agent = _Agent(_record(phase="planning"), _record(memory_processed=0), moving)
    assert campaign.wait_point(agent, "m1", "round") == moving
    monkeypatch.setattr(fc, "PHASE_TIMEOUT_S", 0.2)
    with pytest.raises(fc.exceptions.Timeout, match=r"point round: .*memory_processed > 0"):
        campaign.wait_point(_Agent(_record(memory_processed=0)), "m1", "round")


def test_each_run_is_logged_with_its_code_and_a_loss_shows_in_its_cells_row(tmp_path):
    log = tmp_path / "runs.jsonl"
    cell = fc.cells()[0].key
    fault_runs.log_run(cell, _run(state="completed", libvirt="9.0.0"), 61.0, "abc123", log)
    fault_runs.log_run(cell, _run(hosts=2, lost=3, next_ok=False), 90.0, "def456+changes", log)
    lines = fault_runs.load(log)
    assert [line["code"] for line in lines] == ["abc123", "def456+changes"]
    assert lines[0]["libvirt"] == "9.0.0" and lines[1]["vm_lost"]
    section = "\n".join(fault_runs.render(lines))
    assert f"| {cell} | 2 | 1 | 3 | 0 | 1 | 75.5 | 0 | abc123, def456+changes |" in section
    assert fault_runs.render([]) == []


def test_the_code_version_names_a_commit_and_marks_a_changed_tree(tmp_path):
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    clean = fault_runs.code_version(tmp_path)
    assert len(clean) == 12 and "+" not in clean
    (tmp_path / "a.py").write_text("x = 2\n")
    assert fault_runs.code_version(tmp_path) == f"{clean}+changes"


def test_cells_that_lose_the_vm_by_design_run_only_when_named_in_full():
    lossy = "postcopy/mover/kill-dst-qemu/postcopy-switch"
    assert lossy in fc.LOSS_BY_DESIGN
    assert lossy not in {c.key for c in fc.choose({}, ["*"], 1)}
    assert lossy not in {c.key for c in fc.choose({}, ["postcopy/*"], 1)}
    assert [c.key for c in fc.choose({}, [lossy], 1)] == [lossy]


def test_the_losses_line_tells_the_by_design_cells_from_the_rest():
    results = {
        "postcopy/mover/kill-dst-qemu/postcopy-switch": {"runs": 1, "vm_lost": 1},
        "postcopy/qemu-tcp/cut-30s/switchover": {"runs": 5, "vm_lost": 2},
        "precopy/mover/cut-2s/round": {"runs": 3, "vm_lost": 0},
    }
    line = fc._losses(results)[0]
    assert line.startswith("Runs: 9; VMs lost: 3, of which 1 in the cells")
    assert "and 2 elsewhere (postcopy/qemu-tcp/cut-30s/switchover 2;" in line
